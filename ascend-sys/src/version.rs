//! CANN version strings ("8.0.RC2", "8.1.RC1", "8.2.0", "8.0.RC2.alpha003") as comparable values, so a
//! backend can gate on known-bad ranges.

use std::cmp::Ordering;
use std::fmt;

/// Where a release stands within `major.minor`: release candidates come before the final releases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    /// `RCn`
    Rc(u32),
    /// a final release `.n` (`8.2.0`)
    Release(u32),
}

/// A parsed CANN version. Ordering: major, minor, stage (RC1 < RC2 < .0 < .1), then a pre-release suffix
/// (`.alpha003`, `.beta1`, `.B050`) sorts before the same version without one.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CannVersion {
    pub major: u32,
    pub minor: u32,
    pub stage: Stage,
    /// The rest after the third part, e.g. `alpha003`; `None` for a plain release.
    pub suffix: Option<String>,
}

impl CannVersion {
    /// Parses `A.B.RCn[.suffix]` or `A.B.C[.suffix]` (case-insensitive `RC`). Returns `None` for anything else.
    pub fn parse(s: &str) -> Option<CannVersion> {
        let s = s.trim();
        let mut parts = s.splitn(4, '.');
        let major = parts.next()?.parse().ok()?;
        let minor = parts.next()?.parse().ok()?;
        let third = parts.next()?;
        let stage = if let Some(rc) = third.strip_prefix("RC").or_else(|| third.strip_prefix("rc")) {
            Stage::Rc(rc.parse().ok()?)
        } else {
            Stage::Release(third.parse().ok()?)
        };
        let suffix = match parts.next() {
            Some(x) if !x.is_empty() && x.chars().all(|c| c.is_ascii_alphanumeric()) => Some(x.to_string()),
            Some(_) => return None,
            None => None,
        };
        Some(CannVersion { major, minor, stage, suffix })
    }

    /// `self >= lo && self < hi`: for "known bad from 8.0.RC2 up to (not including) 8.1.RC1" checks.
    pub fn in_range(&self, lo: &CannVersion, hi: &CannVersion) -> bool {
        self >= lo && self < hi
    }
}

impl Ord for CannVersion {
    fn cmp(&self, o: &Self) -> Ordering {
        (self.major, self.minor, self.stage).cmp(&(o.major, o.minor, o.stage)).then_with(|| {
            match (&self.suffix, &o.suffix) {
                (None, None) => Ordering::Equal,
                (None, Some(_)) => Ordering::Greater,
                (Some(_), None) => Ordering::Less,
                (Some(a), Some(b)) => natural(a, b),
            }
        })
    }
}

impl PartialOrd for CannVersion {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

/// `alpha3 < alpha10`: compare the alphabetic prefix, then the number.
fn natural(a: &str, b: &str) -> Ordering {
    let split = |s: &str| {
        let i = s.find(|c: char| c.is_ascii_digit()).unwrap_or(s.len());
        (s[..i].to_ascii_lowercase(), s[i..].parse::<u64>().ok())
    };
    split(a).cmp(&split(b)).then_with(|| a.cmp(b))
}

impl fmt::Display for CannVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.stage {
            Stage::Rc(n) => write!(f, "{}.{}.RC{}", self.major, self.minor, n)?,
            Stage::Release(n) => write!(f, "{}.{}.{}", self.major, self.minor, n)?,
        }
        if let Some(s) = &self.suffix {
            write!(f, ".{s}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> CannVersion {
        CannVersion::parse(s).unwrap_or_else(|| panic!("{s} should parse"))
    }

    #[test]
    fn parses_the_three_forms_and_round_trips() {
        assert_eq!(v("8.0.RC2"), CannVersion { major: 8, minor: 0, stage: Stage::Rc(2), suffix: None });
        assert_eq!(v("8.2.0"), CannVersion { major: 8, minor: 2, stage: Stage::Release(0), suffix: None });
        assert_eq!(v("8.0.RC2.alpha003").suffix.as_deref(), Some("alpha003"));
        for s in ["8.0.RC2", "8.1.RC1", "8.2.0", "8.0.RC2.alpha003", "7.3.10"] {
            assert_eq!(v(s).to_string(), s);
        }
        assert_eq!(v(" 8.1.rc1\n"), v("8.1.RC1"));
    }

    #[test]
    fn rejects_what_is_not_a_version() {
        for s in ["", "8", "8.0", "8.x.RC1", "8.0.RCx", "8.0.RC1.", "latest", "1.2.3.4.5."] {
            assert!(CannVersion::parse(s).is_none(), "{s:?} should not parse");
        }
    }

    #[test]
    fn orders_release_candidates_before_releases_and_prereleases_first() {
        let order = [
            "7.0.0",
            "8.0.RC1",
            "8.0.RC2.alpha003",
            "8.0.RC2.alpha010",
            "8.0.RC2",
            "8.0.RC3",
            "8.0.0",
            "8.0.1",
            "8.1.RC1",
            "8.2.0",
            "10.0.RC1",
        ];
        for w in order.windows(2) {
            assert!(v(w[0]) < v(w[1]), "{} < {}", w[0], w[1]);
        }
        assert!(v("8.0.RC3").in_range(&v("8.0.RC2"), &v("8.1.RC1")));
        assert!(!v("8.1.RC1").in_range(&v("8.0.RC2"), &v("8.1.RC1")));
    }
}
