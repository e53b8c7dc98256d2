//! Comparing a backend's output with the reference: within a bound per element, or exact.

pub const EXACT_COPY: &str = "exact: the op copies or converts values (a correctly rounded conversion has one answer)";

pub type R<T> = Result<T, String>;

pub fn be_err(e: tboost_engine::Error) -> String {
    format!("backend error: {e}")
}

/// What the checks of one case measured (for the report).
#[derive(Default)]
pub struct Measured {
    max_abs: f64,
    max_want: f64,
    /// The largest `|err| / tol` of the toleranced checks (how much room the bound left).
    worst: f64,
    values: usize,
    exact: bool,
}

impl Measured {
    /// `|got - want| ≤ bound(i)` for every element; infinities and NaN must match exactly.
    pub fn close(&mut self, what: &str, got: &[f32], want: &[f64], bound: impl Fn(usize) -> f64) -> R<()> {
        if got.len() != want.len() {
            return Err(format!("{what}: {} values, the reference has {}", got.len(), want.len()));
        }
        let mut bad = 0usize;
        let mut first = None;
        for i in 0..got.len() {
            let (g, w, b) = (got[i] as f64, want[i], bound(i));
            let err = (g - w).abs();
            let ok = if w.is_nan() {
                g.is_nan()
            } else if w.is_infinite() {
                g == w
            } else {
                err <= b
            };
            if !ok {
                bad += 1;
                first.get_or_insert((i, g, w, err, b));
            } else if w.is_finite() {
                self.max_abs = self.max_abs.max(err);
                self.max_want = self.max_want.max(w.abs());
                if b > 0.0 {
                    self.worst = self.worst.max(err / b);
                }
            }
        }
        self.values += got.len();
        match first {
            None => Ok(()),
            Some((i, g, w, err, b)) => Err(format!(
                "{what}[{i}]: got {g:e}, want {w:e}, |err| {err:.3e} > tol {b:.3e} ({bad} of {} values out of tolerance)",
                got.len()
            )),
        }
    }

    /// Bit-exact f32 (NaN matches any NaN).
    pub fn exact(&mut self, what: &str, got: &[f32], want: &[f32]) -> R<()> {
        self.exact = true;
        if got.len() != want.len() {
            return Err(format!("{what}: {} values, the reference has {}", got.len(), want.len()));
        }
        let bad: Vec<usize> = (0..got.len())
            .filter(|&i| !(got[i].to_bits() == want[i].to_bits() || got[i].is_nan() && want[i].is_nan()))
            .collect();
        self.values += got.len();
        match bad.first() {
            None => Ok(()),
            Some(&i) => Err(format!(
                "{what}[{i}]: got {:e} ({:#010x}), want {:e} ({:#010x}) ({} of {} values differ)",
                got[i],
                got[i].to_bits(),
                want[i],
                want[i].to_bits(),
                bad.len(),
                got.len()
            )),
        }
    }

    pub fn exact_u32(&mut self, what: &str, got: &[u32], want: &[u32]) -> R<()> {
        self.exact = true;
        self.values += got.len();
        match (0..got.len().max(want.len())).find(|&i| got.get(i) != want.get(i)) {
            None => Ok(()),
            Some(i) => Err(format!(
                "{what}[{i}]: got {:?}, want {:?} (all: got {got:?}, want {want:?})",
                got.get(i),
                want.get(i)
            )),
        }
    }

    pub fn exact_bytes(&mut self, what: &str, got: &[u8], want: &[u8], elem: usize) -> R<()> {
        self.exact = true;
        self.values += got.len() / elem.max(1);
        if got.len() != want.len() {
            return Err(format!("{what}: {} bytes, the reference has {}", got.len(), want.len()));
        }
        match (0..got.len()).find(|&i| got[i] != want[i]) {
            None => Ok(()),
            Some(i) => {
                let e = i / elem;
                Err(format!(
                    "{what} element {e}: got bytes {:02x?}, want {:02x?}",
                    &got[e * elem..(e + 1) * elem],
                    &want[e * elem..(e + 1) * elem]
                ))
            }
        }
    }

    pub fn summary(&self) -> String {
        if self.exact && self.max_want == 0.0 {
            format!("{} values, exact", self.values)
        } else {
            let rel = if self.max_want > 0.0 { self.max_abs / self.max_want } else { 0.0 };
            format!(
                "{} values, max|err| {:.2e}, max|err|/max|want| {:.2e}, worst |err|/tol {:.3}",
                self.values, self.max_abs, rel, self.worst
            )
        }
    }
}
