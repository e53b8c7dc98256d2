//! Work-split tunables of the CPU kernels ("tiling"), beside FlashAttention's
//! [`crate::check_tile_kv`]: how a matmul or a grouped MoE cuts its work into parallel tasks.
//!
//! Every field is `None` for the op's own default. No value changes a result: each kernel
//! computes an output element with one fixed reduction order whatever the split (the batch and
//! split invariance of `tboost-kernels`' matmul and MoE), so these only move speed. A device
//! backend's kernels tile themselves and take only the defaults.

use serde::Serialize;

use crate::Unsupported;

/// One tunable: its name (the engine key is `tiling.<group>.<name>`), what it sets and the
/// values it accepts (`min..=max`, a multiple of `multiple_of`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tunable {
    pub name: &'static str,
    pub what: &'static str,
    pub min: usize,
    pub max: usize,
    pub multiple_of: usize,
}

impl Tunable {
    /// The accepted range in words: "a multiple of 16 in 16..=4096", "in 1..=64".
    pub fn need(&self) -> String {
        if self.multiple_of > 1 {
            format!("a multiple of {} in {}..={}", self.multiple_of, self.min, self.max)
        } else {
            format!("in {}..={}", self.min, self.max)
        }
    }

    /// `value` against the range: `Unsupported { param: name, value, need }` when outside.
    pub fn check(&self, value: usize) -> Result<(), Unsupported> {
        if value < self.min || value > self.max || !value.is_multiple_of(self.multiple_of) {
            return Err(Unsupported::new(self.name, value, self.need()));
        }
        Ok(())
    }
}

/// A set of tunables of one op family (matmul, MoE), addressed by name.
pub trait Tiling: Copy + Default + PartialEq + std::fmt::Debug {
    /// The family in engine keys (`tiling.matmul.panel_rows`).
    const GROUP: &'static str;
    /// Every tunable of the family, in field order.
    const TUNABLES: &'static [Tunable];

    /// Every field with its name, in [`Tiling::TUNABLES`] order.
    fn fields_mut(&mut self) -> Vec<(&'static str, &mut Option<usize>)>;

    /// The values, in [`Tiling::TUNABLES`] order.
    fn values(&self) -> Vec<Option<usize>> {
        let mut copy = *self;
        copy.fields_mut().into_iter().map(|(_, v)| *v).collect()
    }

    /// True when every tunable is left to the op.
    fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// The set tunables with their values: `[("panel_rows", 96)]`.
    fn set_values(&self) -> Vec<(&'static str, usize)> {
        Self::TUNABLES.iter().zip(self.values()).filter_map(|(t, v)| v.map(|v| (t.name, v))).collect()
    }

    /// Every set value against its range; the first outside names itself.
    fn check(&self) -> Result<(), Unsupported> {
        // Every matmul call checks its tiling: the default one without building `values`.
        if self.is_default() {
            return Ok(());
        }
        Self::TUNABLES.iter().zip(self.values()).try_for_each(|(t, v)| v.map_or(Ok(()), |v| t.check(v)))
    }

    /// Sets tunable `name` to `value` after checking it. An unknown name is an `Unsupported`
    /// on `param = "tiling.<group>"` listing the known ones.
    fn set(&mut self, name: &str, value: usize) -> Result<(), Unsupported> {
        let Some(t) = Self::TUNABLES.iter().find(|t| t.name == name) else {
            let known: Vec<&str> = Self::TUNABLES.iter().map(|t| t.name).collect();
            return Err(Unsupported::new(
                format!("tiling.{}", Self::GROUP),
                name,
                format!("one of {}", known.join(", ")),
            ));
        };
        t.check(value)?;
        if let Some((_, f)) = self.fields_mut().into_iter().find(|(n, _)| *n == name) {
            *f = Some(value);
        }
        Ok(())
    }

    /// `panel_rows=96 act_rows=default ...` over every tunable.
    fn describe(&self) -> String {
        let vals = self.values();
        let words: Vec<String> = Self::TUNABLES
            .iter()
            .zip(vals)
            .map(|(t, v)| format!("{}={}", t.name, v.map_or("default".to_string(), |v| v.to_string())))
            .collect();
        words.join(" ")
    }
}

/// How a matmul (and the fused gate-up SwiGLU) splits its outputs into parallel tasks on the
/// CPU. Weight rows are the output features, activation rows the tokens.
///
/// Defaults (the op's, `None`): block-quantized weights from 5 activation rows on (6 at fast
/// precision) run packed/tiled tasks of 48 weight rows and as many activation rows as keep about
/// 1 MiB of activations hot (12..=96; 1024 at fast precision); fewer rows (decode) run tasks of
/// about `total weight bytes / (threads × tasks_per_thread)`, at least `decode_task_min_bytes`
/// (32 KiB) and at most 1 MiB, over all activation rows. Dense weights aim at
/// `threads × tasks_per_thread` tasks of at least 2^18 multiply-adds, weight rows in multiples of
/// 8, activation rows split (in whole register tiles) only when the weight rows alone give too
/// few tasks. `tasks_per_thread` defaults to 8 for a decode split (fewer activation rows than
/// the kernel's register tile; 16 or fewer over dense panels) and to 4 otherwise. Unless
/// `tasks_per_thread` or `panel_rows` is set, a decode split's last tasks shrink (down to
/// `decode_task_min_bytes`, or one 16-row panel of dense weights) so that the threads finish
/// together; a set value gives even tasks. The bf16
/// kernels of fast precision (AMX, AVX512_BF16) keep their own split and take only the
/// defaults.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
pub struct MatMulTiling {
    /// Weight rows (output features) per task: a panel of the weight matrix. When set it fixes
    /// every task's panel, decode included.
    pub panel_rows: Option<usize>,
    /// Activation rows (tokens) per task.
    pub act_rows: Option<usize>,
    /// Tasks per thread the split aims at where it derives the panel (dense weights, and
    /// block-quantized decode): more balance against more scheduling (default 8 for a
    /// decode split, 4 otherwise).
    pub tasks_per_thread: Option<usize>,
    /// Least weight bytes a block-quantized decode task streams (default 32 KiB).
    pub decode_task_min_bytes: Option<usize>,
}

/// Tasks per thread the matmul split aims at unless set.
pub const DEFAULT_TASKS_PER_THREAD: usize = 4;
/// Tasks per thread of a decode split (a GEMV's few activation rows) unless set. A decode
/// matmul is short, so with too few tasks one thread streams the last task alone while the
/// other waits; with too many, scheduling costs more than the balance gains. 8 was the best
/// of 4, 8, 16 and 32 on decode (the runs are in docs/perf/journal.md).
pub const DEFAULT_DECODE_TASKS_PER_THREAD: usize = 8;
/// Least weight bytes of a block-quantized decode task unless set.
pub const DEFAULT_DECODE_TASK_MIN_BYTES: usize = 32 << 10;

const MATMUL_TUNABLES: [Tunable; 4] = [
    Tunable { name: "panel_rows", what: "weight rows (output features) per task", min: 16, max: 4096, multiple_of: 16 },
    Tunable { name: "act_rows", what: "activation rows (tokens) per task", min: 1, max: 65536, multiple_of: 1 },
    Tunable {
        name: "tasks_per_thread",
        what: "tasks per thread the split aims at (default 8 in decode, 4 otherwise)",
        min: 1,
        max: 64,
        multiple_of: 1,
    },
    Tunable {
        name: "decode_task_min_bytes",
        what: "least weight bytes per block-quantized decode task (default 32768)",
        min: 4096,
        max: 16 << 20,
        multiple_of: 1024,
    },
];

/// `impl Tiling` for a struct of `Option<usize>` fields named as its tunables.
macro_rules! tiling {
    ($ty:ty, $group:literal, $tunables:expr, [$($field:ident),+]) => {
        impl Tiling for $ty {
            const GROUP: &'static str = $group;
            const TUNABLES: &'static [Tunable] = &$tunables;

            fn fields_mut(&mut self) -> Vec<(&'static str, &mut Option<usize>)> {
                vec![$((stringify!($field), &mut self.$field)),+]
            }
        }
    };
}

tiling!(MatMulTiling, "matmul", MATMUL_TUNABLES, [panel_rows, act_rows, tasks_per_thread, decode_task_min_bytes]);

impl MatMulTiling {
    /// The tasks per thread a split aims at: the set value, else the default of a decode
    /// split (`decode`: few activation rows) or of a larger one.
    pub fn tasks_per_thread_for(&self, decode: bool) -> usize {
        let default = if decode { DEFAULT_DECODE_TASKS_PER_THREAD } else { DEFAULT_TASKS_PER_THREAD };
        self.tasks_per_thread.unwrap_or(default).max(1)
    }
}

/// Whether every set matmul tunable is in its range.
pub fn check_matmul_tiling(t: &MatMulTiling) -> Result<(), Unsupported> {
    t.check()
}

/// How the grouped MoE batches its experts' work on the CPU. By default (`None`) each expert
/// runs all the tokens routed to it as one batch (its gate/up and down matmuls over those
/// rows, each split over the pool), one expert after another.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
pub struct MoeTiling {
    /// Most tokens in one expert batch: an expert with more routed tokens runs them in several
    /// batches (bounds the per-batch scratch; each batch streams the expert's weights again).
    pub expert_batch_tokens: Option<usize>,
    /// Expert batches run at once as parallel tasks (default 1: one after another, each
    /// batch's matmuls split over the pool).
    pub parallel_expert_batches: Option<usize>,
}

const MOE_TUNABLES: [Tunable; 2] = [
    Tunable {
        name: "expert_batch_tokens",
        what: "most tokens in one expert batch (default: all the expert's tokens)",
        min: 1,
        max: 65536,
        multiple_of: 1,
    },
    Tunable {
        name: "parallel_expert_batches",
        what: "expert batches run at once (default 1)",
        min: 1,
        max: 64,
        multiple_of: 1,
    },
];

tiling!(MoeTiling, "moe", MOE_TUNABLES, [expert_batch_tokens, parallel_expert_batches]);

/// Whether every set MoE tunable is in its range.
pub fn check_moe_tiling(t: &MoeTiling) -> Result<(), Unsupported> {
    t.check()
}

/// `Unsupported` for a backend whose kernels tile themselves when `t` sets anything: the first
/// set tunable, with `need` saying the backend takes only the default.
pub fn default_only<T: Tiling>(t: &T, backend: &str) -> Result<(), Unsupported> {
    match t.set_values().first() {
        None => Ok(()),
        Some(&(name, v)) => Err(Unsupported::new(
            name,
            v,
            format!("the default (unset) on {backend}, whose kernels choose their own tiling"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tasks_per_thread_defaults_by_split_and_a_set_value_overrides_both() {
        let d = MatMulTiling::default();
        assert_eq!(d.tasks_per_thread_for(true), DEFAULT_DECODE_TASKS_PER_THREAD);
        assert_eq!(d.tasks_per_thread_for(false), DEFAULT_TASKS_PER_THREAD);
        let set = MatMulTiling { tasks_per_thread: Some(3), ..d };
        assert_eq!((set.tasks_per_thread_for(true), set.tasks_per_thread_for(false)), (3, 3));
    }

    #[test]
    fn tunables_and_fields_have_the_same_names_in_the_same_order() {
        fn names<T: Tiling>() -> (Vec<&'static str>, Vec<&'static str>) {
            let mut t = T::default();
            let fields = t.fields_mut().into_iter().map(|(n, _)| n).collect();
            (T::TUNABLES.iter().map(|t| t.name).collect(), fields)
        }
        let (a, b) = names::<MatMulTiling>();
        assert_eq!(a, b);
        let (a, b) = names::<MoeTiling>();
        assert_eq!(a, b);
    }

    #[test]
    fn every_tunable_names_itself_and_its_range() {
        let mut t = MatMulTiling::default();
        assert!(t.is_default() && t.check().is_ok());
        let mut refuse = |name: &str, v: usize| t.set(name, v).unwrap_err().to_string();
        assert_eq!(refuse("panel_rows", 20), "panel_rows=20 is not a multiple of 16 in 16..=4096");
        assert_eq!(refuse("act_rows", 0), "act_rows=0 is not in 1..=65536");
        assert_eq!(refuse("tasks_per_thread", 65), "tasks_per_thread=65 is not in 1..=64");
        let bytes = "decode_task_min_bytes=1000 is not a multiple of 1024 in 4096..=16777216";
        assert_eq!(refuse("decode_task_min_bytes", 1000), bytes);
        let known = "one of panel_rows, act_rows, tasks_per_thread, decode_task_min_bytes";
        assert_eq!(refuse("panel", 16), format!("tiling.matmul=panel is not {known}"));
        assert!(t.is_default(), "rejected values leave the tiling unchanged");
        t.set("panel_rows", 96).unwrap();
        t.set("decode_task_min_bytes", 65536).unwrap();
        assert_eq!(t, MatMulTiling { panel_rows: Some(96), decode_task_min_bytes: Some(65536), ..Default::default() });
        assert_eq!(t.set_values(), vec![("panel_rows", 96), ("decode_task_min_bytes", 65536)]);
        assert_eq!(t.describe(), "panel_rows=96 act_rows=default tasks_per_thread=default decode_task_min_bytes=65536");
        let bad = MatMulTiling { act_rows: Some(0), ..t };
        assert_eq!(check_matmul_tiling(&bad).unwrap_err().param, "act_rows");

        let mut m = MoeTiling::default();
        assert_eq!(
            m.set("expert_batch_tokens", 0).unwrap_err().to_string(),
            "expert_batch_tokens=0 is not in 1..=65536"
        );
        let e = m.set("parallel_expert_batches", 100).unwrap_err();
        assert_eq!(e.to_string(), "parallel_expert_batches=100 is not in 1..=64");
        m.set("parallel_expert_batches", 2).unwrap();
        assert!(check_moe_tiling(&m).is_ok());
        assert_eq!(
            default_only(&m, "ascend").unwrap_err().to_string(),
            "parallel_expert_batches=2 is not the default (unset) on ascend, whose kernels choose their own tiling"
        );
        assert!(default_only(&MoeTiling::default(), "ascend").is_ok());
    }
}
