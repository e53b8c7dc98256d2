//! Driving a backend through one group of cases and reporting on it: the buffers a case holds,
//! the op variants it launches, skips with the backend's reason, and the per-test driver that
//! runs a group on every backend present.

use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use tboost_engine::backend::{Backend, BackendExt, BufId, DType, Op, OpQuery, StepHost, StepViews, View, WeightId};
use tboost_engine::model::Tensor;
use tboost_testkit::backends;
use tboost_testkit::golden::Rng;

use super::measure::{be_err, Measured, R};
use super::numbers::{decode, encode, Mat};

/// Every `Op` variant: the exhaustive match makes a new variant a compile error here until
/// the suite covers it.
pub const OP_NAMES: [&str; 21] = [
    "embed",
    "rmsnorm",
    "add_rmsnorm",
    "add",
    "matmul",
    "matmul_swiglu",
    "swiglu",
    "rope_tables",
    "rope",
    "write_kv",
    "attention",
    "moe_route",
    "moe_grouped",
    "moe_scatter",
    "moe_combine",
    "gather_rows",
    "convert",
    "zero",
    "geglu",
    "scale",
    "rope_tables_scaled",
];

pub fn variant(op: &Op) -> usize {
    match op {
        Op::Embed { .. } => 0,
        Op::RmsNorm { .. } => 1,
        Op::AddRmsNorm { .. } => 2,
        Op::Add { .. } => 3,
        Op::MatMul { .. } => 4,
        Op::MatMulSwiGlu { .. } => 5,
        Op::SwiGlu { .. } => 6,
        Op::RopeTables { .. } => 7,
        Op::Rope { .. } => 8,
        Op::WriteKv { .. } => 9,
        Op::Attention { .. } => 10,
        Op::MoeRoute { .. } => 11,
        Op::MoeGrouped { .. } => 12,
        Op::MoeScatter { .. } => 13,
        Op::MoeCombine { .. } => 14,
        Op::GatherRows { .. } => 15,
        Op::Convert { .. } => 16,
        Op::Zero { .. } => 17,
        Op::GeGlu { .. } => 18,
        Op::Scale { .. } => 19,
        Op::RopeTablesScaled { .. } => 20,
    }
}

/// One case's hold on a backend: the buffers it allocated (freed when the case ends) and the
/// op variants it launched.
pub struct Dev<'a> {
    pub be: &'a mut dyn Backend,
    live: Vec<BufId>,
    launched: &'a mut [bool; 21],
}

pub fn empty_host<'a>() -> StepHost<'a> {
    StepHost { ids: &[], positions: &[], slots: &[], seqs: &[], block_tables: &[], logit_rows: &[] }
}

impl Dev<'_> {
    pub fn alloc(&mut self, dtype: DType, len: usize) -> R<View> {
        let b = self.be.alloc(dtype, len.max(1)).map_err(be_err)?;
        self.live.push(b);
        Ok(View::new(b, 0, len))
    }

    /// A buffer of activations: `data` stored in `act` (round it with `round_to` first for an exact
    /// reference).
    pub fn acts(&mut self, act: DType, data: &[f32]) -> R<View> {
        let v = self.alloc(act, data.len())?;
        if !data.is_empty() {
            self.be.write(v, &encode(act, data)).map_err(be_err)?;
        }
        Ok(v)
    }

    /// A float buffer's values (f32, f16 or bf16) as f32.
    pub fn read_act(&mut self, v: View) -> R<Vec<f32>> {
        let (dtype, _) = self.be.buffer(v.buf).ok_or("read of an unknown buffer")?;
        let b = self.read_bytes(v)?;
        Ok(decode(dtype, &b, v.len))
    }

    pub fn u32s(&mut self, data: &[u32]) -> R<View> {
        let v = self.alloc(DType::U32, data.len())?;
        if !data.is_empty() {
            self.be.write_typed(v, data).map_err(be_err)?;
        }
        Ok(v)
    }

    /// A buffer of `len` elements of `dtype` holding `bytes`.
    pub fn raw(&mut self, dtype: DType, len: usize, bytes: &[u8]) -> R<View> {
        let v = self.alloc(dtype, len)?;
        self.be.write(v, bytes).map_err(be_err)?;
        Ok(v)
    }

    pub fn upload(&mut self, name: &str, dtype: DType, shape: Vec<usize>, bytes: Vec<u8>) -> R<WeightId> {
        let t = Tensor::owned(name, dtype, shape, bytes).map_err(|e| format!("tensor {name}: {e}"))?;
        self.be.upload_weight(&t).map_err(be_err)
    }

    pub fn mat(&mut self, name: &str, m: &Mat) -> R<WeightId> {
        self.upload(name, m.dtype, vec![m.rows, m.cols], m.bytes.clone())
    }

    pub fn vector(&mut self, name: &str, dtype: DType, v: &[f32]) -> R<WeightId> {
        self.upload(name, dtype, vec![v.len()], encode(dtype, v))
    }

    /// The step's index arrays in fresh buffers, made resident with `set_step`.
    pub fn step(&mut self, host: &StepHost<'_>, max_blocks: usize) -> R<StepViews> {
        let views = StepViews {
            ids: self.alloc(DType::U32, host.ids.len())?,
            positions: self.alloc(DType::U32, host.positions.len())?,
            slots: self.alloc(DType::U32, host.slots.len())?,
            seqs: self.alloc(DType::U32, host.seqs.len() * 3)?,
            block_tables: self.alloc(DType::U32, host.block_tables.len())?,
            max_blocks,
            logit_rows: self.alloc(DType::U32, host.logit_rows.len())?,
        };
        self.be.set_step(host, &views).map_err(be_err)?;
        Ok(views)
    }

    pub fn launch(&mut self, op: Op) -> R<()> {
        self.launched[variant(&op)] = true;
        self.be.launch(&op).map_err(be_err)
    }

    pub fn sync(&mut self) -> R<()> {
        self.be.synchronize().map_err(be_err)
    }

    pub fn read_u32(&mut self, v: View) -> R<Vec<u32>> {
        let mut out = vec![0u32; v.len];
        self.be.read_typed(v, &mut out).map_err(be_err)?;
        Ok(out)
    }

    pub fn read_bytes(&mut self, v: View) -> R<Vec<u8>> {
        let (dtype, _) = self.be.buffer(v.buf).ok_or("read of an unknown buffer")?;
        let n = dtype.bytes_for(v.len).ok_or("view splits a block")?;
        let mut out = vec![0u8; n];
        self.be.read(v, &mut out).map_err(be_err)?;
        Ok(out)
    }
}

#[derive(Default)]
pub struct Group {
    name: String,
    tolerance: &'static str,
    pub lines: Vec<String>,
    run: usize,
    failed: usize,
    skipped: usize,
}

/// One test's group of cases on one backend: the report so far.
pub struct Suite<'b> {
    test: &'static str,
    backend: &'static str,
    pub be: &'b mut dyn Backend,
    /// The activation dtype the backend computes in (its first choice).
    pub act: DType,
    /// Tokens per KV block of the attention cases: the CPU's table (8..32), or the backend's
    /// preferred size when it wants larger blocks (Ascend's FIA: 128).
    pub min_block: usize,
    /// Only list the cases (the coverage test): no query is asked, no case runs.
    pub dry: bool,
    groups: Vec<Group>,
    launched: [bool; 21],
    /// Op variants some case of the table launches, and those of cases that ran.
    wanted: [bool; 21],
    ran: [bool; 21],
    failures: Vec<String>,
}

pub fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}

impl<'b> Suite<'b> {
    fn new(test: &'static str, backend: &'static str, be: &'b mut dyn Backend, act: DType, dry: bool) -> Suite<'b> {
        let min_block = be.preferred_block_size();
        Suite {
            test,
            backend,
            be,
            act,
            min_block,
            dry,
            groups: Vec::new(),
            launched: [false; 21],
            wanted: [false; 21],
            ran: [false; 21],
            failures: Vec::new(),
        }
    }

    pub fn group(&mut self, name: &str, tolerance: &'static str) -> &mut Group {
        let i = match self.groups.iter().position(|g| g.name == name) {
            Some(i) => i,
            None => {
                self.groups.push(Group { name: name.into(), tolerance, ..Default::default() });
                self.groups.len() - 1
            }
        };
        let g = &mut self.groups[i];
        if g.tolerance.is_empty() {
            g.tolerance = tolerance;
        }
        g
    }

    /// A failure that is not a case's result (a broken plan-level rule).
    pub fn fail(&mut self, group: &str, case: &str, why: String) {
        let g = self.group(group, "");
        g.failed += 1;
        g.lines.push(format!("  FAIL {case}: {why}"));
        self.failures.push(format!("[{}] {group} / {case}: {why}", self.backend));
    }

    /// One case: every query the plan would ask must be supported, or the case is listed as
    /// skipped with the backend's reason; otherwise `body` runs it on the backend and checks
    /// the result. `ops` are the op variants the case launches (for the coverage checks).
    pub fn case(
        &mut self,
        group: &str,
        tolerance: &'static str,
        case: String,
        queries: &[OpQuery],
        ops: &[usize],
        body: impl FnOnce(&mut Dev<'_>) -> R<Measured>,
    ) {
        for &o in ops {
            self.wanted[o] = true;
        }
        if self.dry {
            return;
        }
        for q in queries {
            if let Err(why) = self.be.supports(q) {
                let g = self.group(group, tolerance);
                g.skipped += 1;
                g.lines.push(format!("  skip {case}: {why}  (query {})", query_name(q)));
                return;
            }
        }
        for &o in ops {
            self.ran[o] = true;
        }
        let mut dev = Dev { be: &mut *self.be, live: Vec::new(), launched: &mut self.launched };
        let r = match catch_unwind(AssertUnwindSafe(|| body(&mut dev))) {
            Ok(r) => r,
            Err(p) => Err(format!("panicked: {}", panic_text(p.as_ref()))),
        };
        // A failed case may leave work queued: drain it before freeing its buffers.
        let _ = dev.be.synchronize();
        for b in std::mem::take(&mut dev.live) {
            dev.be.free(b);
        }
        let backend = self.backend;
        let g = self.group(group, tolerance);
        g.run += 1;
        match r {
            Ok(m) => g.lines.push(format!("  ok   {case}: {}", m.summary())),
            Err(why) => {
                g.failed += 1;
                g.lines.push(format!("  FAIL {case}: {why}"));
                self.failures.push(format!("[{backend}] {group} / {case}: {why}"));
            }
        }
    }

    /// The op variants this test's cases launch: each was launched unless every case that
    /// launches it was skipped (and so listed).
    fn check_launched(&mut self) {
        for (i, op) in OP_NAMES.iter().enumerate() {
            if self.ran[i] && !self.launched[i] {
                self.fail("coverage", op, "cases that launch it ran, but it was never launched".into());
            } else if self.wanted[i] && !self.launched[i] {
                let g = self.group("coverage", "");
                g.lines.push(format!(
                    "  note {op}: never launched on this backend (every case that launches it was skipped)"
                ));
            }
        }
    }

    fn report(&self, secs: f64) -> String {
        let mut s = format!(
            "\n=== {}: {} ({}), activations {} ===\n",
            self.test,
            self.backend,
            self.be.device().device,
            self.act
        );
        let (mut run, mut failed, mut skipped) = (0, 0, 0);
        for g in &self.groups {
            s += &format!(
                "{} [{}]: {} run, {} passed, {} failed, {} skipped\n",
                g.name,
                self.backend,
                g.run,
                g.run - g.failed,
                g.failed,
                g.skipped
            );
            if !g.tolerance.is_empty() {
                s += &format!("  tolerance: {}\n", g.tolerance);
            }
            // Passing cases in full only on request; skips, failures and notes always.
            let verbose = std::env::var_os("TBOOST_CONFORMANCE_VERBOSE").is_some();
            for l in g.lines.iter().filter(|l| verbose || !l.starts_with("  ok ")) {
                s += l;
                s.push('\n');
            }
            run += g.run;
            failed += g.failed;
            skipped += g.skipped;
        }
        s += &format!(
            "=== {} [{}, {}]: {run} cases run, {} passed, {failed} failed, {skipped} skipped, in {secs:.1} s ===\n",
            self.test,
            self.backend,
            self.act,
            run - failed.min(run)
        );
        s
    }
}

/// A test's group of cases: it adds them to the suite, drawing its values from `rng`.
pub type Cases = fn(&mut Suite<'_>, &mut Rng);

/// The seed of a test's values: fixed per test (FNV-1a of its name over the suite's seed), so
/// a test draws the same values whether it runs alone or beside the others.
fn seed(test: &str) -> u64 {
    test.bytes().fold(0x7b00_57c0_f041 ^ 0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// Runs `cases` on every backend present, once per activation dtype it computes in (the CPU:
/// f32; Ascend: f16, bf16); prints the report (also when it passes) and fails listing every
/// failed case.
pub fn run(test: &'static str, cases: Cases) {
    let mut failures = Vec::new();
    for b in backends::present() {
        let turn = b.exclusive();
        let mut be = b.open(2);
        for act in be.activation_dtypes().to_vec() {
            let t0 = Instant::now();
            let mut s = Suite::new(test, b.name, be.as_mut(), act, false);
            cases(&mut s, &mut Rng::new(seed(test)));
            s.check_launched();
            // Straight to the process's stdout (past the test harness's capture), one write
            // per report so parallel tests do not interleave: the report is the point of the
            // suite, also when it passes.
            let report = s.report(t0.elapsed().as_secs_f64());
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(report.as_bytes());
            let _ = out.flush();
            failures.extend(s.failures.into_iter().map(|x| format!("({act}) {x}")));
        }
        drop(be);
        b.check_released(test);
        drop(turn);
    }
    assert!(failures.is_empty(), "{test}: {} conformance failures:\n{}", failures.len(), failures.join("\n"));
}

/// Every `Op` variant is launched by some case of the table (`groups`, every test's): the cases
/// are listed, not run. Once, on the CPU: a case records its ops before any backend is asked
/// about it, so the list is the same on every backend.
pub fn coverage(groups: &[(&'static str, Cases)]) {
    let b = backends::cpu();
    let mut be = b.open(1);
    let mut s = Suite::new("coverage", b.name, be.as_mut(), DType::F32, true);
    for &(test, cases) in groups {
        cases(&mut s, &mut Rng::new(seed(test)));
    }
    let missing: Vec<&str> = OP_NAMES.iter().enumerate().filter(|&(i, _)| !s.wanted[i]).map(|(_, op)| *op).collect();
    assert!(missing.is_empty(), "no case of the table launches these ops: {missing:?}");
}

pub fn query_name(q: &OpQuery) -> String {
    serde_json::to_value(q)
        .ok()
        .and_then(|v| v.get("op").and_then(|o| o.as_str().map(String::from)))
        .unwrap_or_default()
}
