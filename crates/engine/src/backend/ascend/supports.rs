//! The Ascend capability table: for every `OpQuery`, the aclnn ops that would run it and the
//! documented constraints they impose, answered as `Unsupported { param, value, need }`.
//!
//! Sources (shared/research/ascend-api.md; OT = hicann/ops-transformer, NN = hicann/ops-nn, all at
//! https://github.com/hicann/<repo>; the op docs are `<family>/<op>/docs/aclnn<Op>.md` there):
//! - FusedInferAttentionScore (research §2.4, OT `attention/fused_infer_attention_score/docs/
//!   aclnnFusedInferAttentionScoreV2.md`): Atlas A2/A3 only; fp16/bf16 query/key/value of one dtype;
//!   `numHeads % numKeyValueHeads == 0`, ratio ≤ 64; N ≤ 256; D ≤ 512 and 16-aligned for fp16/bf16;
//!   paged KV: Q_S > 1 needs a block size in 128..512 that is a multiple of 128, Q_S == 1 a 16-aligned
//!   one ≤ 512 (IFA V4 doc); BnBsH caches reject KV_N·D > 65535. On Ascend950 only V5 runs (V1..V4
//!   return 361001 there: OT `attention/fused_infer_attention_score/op_api/
//!   aclnn_fused_infer_attention_score_v4.cpp`; V5's signature: `docs/aclnnFusedInferAttentionScoreV5.md`).
//! - ScatterPaKvCache (OT-EN `aclnnScatterPaKvCache_en.md`): A2/A3; key and caches of one dtype.
//! - RotaryPositionEmbedding (research §2.4; OT `posembedding/rotary_position_embedding/docs/
//!   aclnnRotaryPositionEmbedding.md`): A2/A3 only (no kernel on Atlas inference 310P, the training
//!   series 910A or 200I/500 A2 310B); D even and < 896; modes 0 (half) and 1 (interleave); it rotates
//!   the whole head (no partial rotary in the doc).
//! - RmsNorm / AddRmsNorm (NN `norm/rms_norm/docs/aclnnRmsNorm.md`): gamma in x's dtype (or f32; tboost
//!   takes the activation dtype so the plan converts gains at upload); RmsNorm absent on 310B.
//! - SwiGlu (NN `activation/swi_glu/docs/aclnnSwiGlu.md`): absent on 310B.
//! - GeluV2 (NN `activation/gelu_v2/docs/aclnnGeluV2.md`): `approximate` 1 is the tanh form (Gemma's
//!   GeGLU, in FLOAT with `aclnnMul` by up and `aclnnCast` back); absent on 310B; bf16 not on Atlas inference/training (the
//!   activation rule already refuses bf16 there). The embedding scale: `aclnnMul` by a FLOAT scalar
//!   tensor, `aclnnCast` back.
//! - Sliding-window attention: FIA's band (`sparseMode` 4 with preTokens = window - 1, nextTokens 0,
//!   OT `docs/context/sparse_mode参数说明.md`) for prefill, a per-call `attenMask` for decodes (Q_S == 1
//!   ignores sparseMode and preTokens/nextTokens: FIA V4 doc); the constraints are FIA's own.
//! - Mm (NN `matmul/mat_mul_v3/docs/aclnnMm.md`): absent on 310B; bf16 only on A2/A3. self and mat2
//!   follow CANN's dtype promotion (互推导关系: f32 with f16/bf16 promotes to f32, which the simulator
//!   implements); tboost converts weights to the activation dtype at upload instead, because a promoted
//!   f32 matmul would keep f32 weights (twice the device memory) and f32 outputs. Int8 activations have
//!   no declared op.
//! - WeightQuantBatchMatmulV2 (NN `matmul/weight_quant_batch_matmul_v2/docs/aclnnWeightQuantBatchMatmulV2.md`):
//!   GGUF types with one scale and min per 32 values stay quantized as A16W8/A16W4 per group of 32
//!   ([`quant_layout`]): the weight is `(w + antiquantOffset) · antiquantScale`, so a group `a·q − m`
//!   is `w = q − c`, scale `a`, offset `c − m/a` (signed types need no offset). The doc: x f16/bf16,
//!   weight INT8/INT4, scale and offset in x's dtype and of one shape,
//!   antiquantGroupSize a multiple of 32 in [32, k-1] (so k > 32), k and n in [1, 65535]. tboost uses it on
//!   A2/A3 (and 950) only: Atlas inference (310P) takes INT8 with FLOAT16 and other scale layouts (not
//!   built), 310B and the training series are not in its product table. Elsewhere the plan converts the
//!   weights to f16 at upload and reports why.
//! - MoeGatingTopKSoftmax (YC doc): k ≤ 1024, A2/A3 only; it does not renormalise (tboost adds
//!   `aclnnMm` with ones + `aclnnDiv`). GroupedMatmulV4 (OT `gmm/grouped_matmul/docs/
//!   aclnnGroupedMatmulV4.md`): at most 1024 groups (the simulator's bound); on 310P only FLOAT16 with
//!   FRACTAL_NZ weights and N % 16 == 0 (tboost keeps ND weights, so the grouped path falls back there).
//! - MoeInitRoutingV2 / MoeFinalizeRoutingV2 (OT `moe/moe_init_routing_v2/docs/aclnnMoeInitRoutingV2.md`,
//!   `moe/moe_finalize_routing_v2/docs/aclnnMoeFinalizeRoutingV2.md`): absent on 910A and 310B; on 310P
//!   H % 32 == 0, and Finalize wants x1/x2/bias/expertIdx NULL with dropPadMode 2.
//! - SoC (research §1.5, ATB `include/atb/types.h`, the Mm/RmsNorm docs): bf16 only on A2/A3 and 950
//!   (none on 310P, 910A, 310B).
//! - Missing symbols (`Cann::has_op`) and CANN versions in a known-bad range (`KNOWN_BAD`, plus
//!   `TBOOST_ASCEND_KNOWN_BAD`) reject the op that needs them, as ATB gates runners on versions.

use ascend_sys::aclnn::fused_infer_attention_version;
use ascend_sys::{Cann, CannVersion, DeviceFacts, SocFamily};
use tboost_ops::{AttentionCase, AttnPhase, DType, MatMulCase, Precision, Unsupported};

use crate::backend::{AttnKind, OpQuery};

/// A CANN version range in which an op is known to misbehave: `from <= v < until`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KnownBad {
    /// An aclnn op name, or a prefix of one (`aclnnFusedInferAttentionScore` covers V2..V4).
    pub op: String,
    pub from: CannVersion,
    pub until: CannVersion,
    pub why: String,
}

/// The built-in table. No public CANN release note or issue gave a version range in which one of
/// these ops is wrong (research §5 lists version *mismatches*, not op defects), so the table holds
/// one EXAMPLE entry, in versions no CANN release has, that exercises the mechanism (a test sets
/// the simulator's version into it). Real entries go here, or into `TBOOST_ASCEND_KNOWN_BAD`
/// (`op@from..until[;...]`, e.g. `aclnnFusedInferAttentionScore@8.0.RC1..8.0.RC3`) at deployment.
const KNOWN_BAD: &[(&str, &str, &str, &str)] = &[(
    "aclnnFusedInferAttentionScore",
    "0.0.RC1",
    "0.1.RC1",
    "EXAMPLE entry of the version gate (no real CANN release is in this range)",
)];

/// Parses `TBOOST_ASCEND_KNOWN_BAD`: `op@from..until` items separated by `;`.
pub fn parse_known_bad(spec: &str) -> Result<Vec<KnownBad>, String> {
    let mut out = Vec::new();
    for item in spec.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        let bad = || format!("`{item}` is not op@from..until (e.g. aclnnRmsNorm@8.0.RC1..8.0.RC3)");
        let (op, range) = item.split_once('@').ok_or_else(bad)?;
        let (from, until) = range.split_once("..").ok_or_else(bad)?;
        let (from, until) = (CannVersion::parse(from).ok_or_else(bad)?, CannVersion::parse(until).ok_or_else(bad)?);
        if !op.starts_with("aclnn") || from >= until {
            return Err(bad());
        }
        out.push(KnownBad { op: op.to_string(), from, until, why: "listed in TBOOST_ASCEND_KNOWN_BAD".into() });
    }
    Ok(out)
}

fn builtin_known_bad() -> Vec<KnownBad> {
    KNOWN_BAD
        .iter()
        .filter_map(|&(op, from, until, why)| {
            Some(KnownBad {
                op: op.into(),
                from: CannVersion::parse(from)?,
                until: CannVersion::parse(until)?,
                why: why.into(),
            })
        })
        .collect()
}

/// What the capability answers depend on, fixed when the backend opens.
pub(super) struct Caps {
    cann: Cann,
    pub soc: SocFamily,
    pub soc_name: String,
    pub version: Option<CannVersion>,
    known_bad: Vec<KnownBad>,
}

fn no(param: &'static str, value: impl std::fmt::Display, need: impl Into<String>) -> Result<(), Unsupported> {
    Err(Unsupported::new(param, value, need))
}

pub(super) const WQBMM: &str = "aclnnWeightQuantBatchMatmulV2";
/// The fused matmul + all-reduce (MC2).
pub(super) const MC2: &str = "aclnnMatmulAllReduce";
/// The antiquant group: one GGUF block.
pub(super) const QUANT_GROUP: usize = 32;

/// The block types kept quantized on the device (A16W8 / A16W4 per 32-value group).
pub(super) fn quant_kept(d: DType) -> bool {
    quant_layout(d).is_some()
}

/// How aclnnWeightQuantBatchMatmulV2 holds a kept GGUF type: `(int4, offsets)`. Q4_0 as INT4 and Q8_0,
/// Q5_0 as INT8 (signed values, scale only); Q4_1, Q4_K as INT4 and Q5_1, Q5_K as INT8 with a per-group
/// antiquant offset for their mins. The K-quants with 16-value scales (Q2_K, Q3_K, Q6_K) and IQ4 have
/// no such form: they are converted at upload.
pub(super) fn quant_layout(d: DType) -> Option<(bool, bool)> {
    match d {
        DType::Q4_0 => Some((true, false)),
        DType::Q8_0 | DType::Q5_0 => Some((false, false)),
        DType::Q4_1 | DType::Q4K => Some((true, true)),
        DType::Q5_1 | DType::Q5K => Some((false, true)),
        _ => None,
    }
}

const GROUPED: [&str; 5] =
    ["aclnnMoeInitRoutingV2", "aclnnGroupedMatmulV4", "aclnnSwiGlu", "aclnnMoeFinalizeRoutingV2", "aclnnCast"];
const ROUTE: [&str; 4] = ["aclnnCast", "aclnnMoeGatingTopKSoftmax", "aclnnMm", "aclnnDiv"];

impl Caps {
    /// `extra_known_bad`: the engine config's `ascend_known_bad` (default from
    /// `TBOOST_ASCEND_KNOWN_BAD`), added to the built-in table.
    pub fn new(cann: &Cann, facts: &DeviceFacts, extra_known_bad: &str) -> Result<Caps, String> {
        let mut known_bad = builtin_known_bad();
        known_bad.extend(parse_known_bad(extra_known_bad).map_err(|e| format!("ascend_known_bad: {e}"))?);
        Ok(Caps {
            cann: cann.clone(),
            soc: facts.soc,
            soc_name: facts.soc_name.clone().unwrap_or_else(|| "unknown SoC".into()),
            version: facts.cann_version.clone(),
            known_bad,
        })
    }

    /// The op is exported, its CANN version is not in a known-bad range and the SoC has its kernel.
    fn op(&self, name: &str) -> Result<(), Unsupported> {
        if !self.cann.has_op(name) {
            return no("symbol", name, "present in libopapi");
        }
        self.kernel(name)?;
        if let Some(v) = &self.version {
            if let Some(k) = self.known_bad.iter().find(|k| name.starts_with(&k.op) && v.in_range(&k.from, &k.until)) {
                return no(
                    "cann_version",
                    v,
                    format!("outside {}..{} for {name} (known bad: {})", k.from, k.until, k.why),
                );
            }
        }
        Ok(())
    }

    fn ops(&self, names: &[&str]) -> Result<(), Unsupported> {
        names.iter().try_for_each(|n| self.op(n))
    }

    /// aclnnMatmulAllReduce over a group of `ranks` (ops-transformer
    /// `mc2/matmul_all_reduce/docs/aclnnMatmulAllReduce.md`: Atlas A2 with 1, 2, 4 or 8 cards, Ascend950
    /// with up to 64; not A3 or the inference and training series).
    pub fn mc2(&self, ranks: u32) -> Result<(), Unsupported> {
        self.op(MC2)?;
        let ok = match self.soc {
            SocFamily::Ascend910B => matches!(ranks, 1 | 2 | 4 | 8),
            _ => ranks.is_power_of_two() && ranks <= 64,
        };
        if !ok {
            return no("ranks", ranks, format!("1, 2, 4 or 8 on {} (the op's HCCS all-mesh rule)", self.soc_name));
        }
        Ok(())
    }

    /// Ops whose kernels exist only on Atlas A2/A3 (and 950).
    fn a2a3(&self, op: &str) -> Result<(), Unsupported> {
        if !self.soc.is_a2_or_a3() {
            return no("soc", &self.soc_name, format!("Atlas A2/A3 ({op} has kernels only there)"));
        }
        Ok(())
    }

    /// The SoC profile: ops whose doc's product-support table leaves this SoC out (sources in the
    /// module docs), answered like a missing kernel (`aclnn` would return 561003).
    fn kernel(&self, op: &str) -> Result<(), Unsupported> {
        use SocFamily::*;
        let soc = self.soc;
        match op {
            "aclnnRotaryPositionEmbedding"
            | "aclnnScatterPaKvCache"
            | "aclnnMoeGatingTopKSoftmax"
            | "aclnnFusedInferAttentionScoreV2"
            | "aclnnFusedInferAttentionScoreV3"
            | "aclnnFusedInferAttentionScoreV4"
            | "aclnnFusedInferAttentionScoreV5" => self.a2a3(op)?,
            WQBMM if !self.soc.is_a2_or_a3() => {
                return no(
                    "soc",
                    &self.soc_name,
                    format!("Atlas A2/A3 for {WQBMM} (A16W8/A16W4 per group; tboost has no 310P layout)"),
                )
            }
            MC2 if !matches!(soc, Ascend910B | Ascend950) => {
                return no("soc", &self.soc_name, format!("Atlas A2 or Ascend950 for {MC2} (its product table)"))
            }
            "aclnnRmsNorm" | "aclnnSwiGlu" | "aclnnMm" | "aclnnGeluV2" if soc == Ascend310B => {
                return no("soc", &self.soc_name, format!("a SoC that has the {op} kernel (200I/500 A2 has none)"))
            }
            "aclnnMoeInitRoutingV2" | "aclnnMoeFinalizeRoutingV2" if matches!(soc, Ascend910A | Ascend310B) => {
                return no(
                    "soc",
                    &self.soc_name,
                    format!("a SoC that has the {op} kernel (the training series and 200I/500 A2 have none)"),
                )
            }
            "aclnnGroupedMatmulV4" if soc == Ascend310P => {
                return no(
                    "soc",
                    &self.soc_name,
                    "a SoC whose aclnnGroupedMatmulV4 takes ND weights (Atlas inference wants FRACTAL_NZ f16 weights \
                     with N % 16 == 0; tboost keeps ND)",
                )
            }
            _ => {}
        }
        if soc == Ascend950
            && op.starts_with("aclnnFusedInferAttentionScore")
            && op != "aclnnFusedInferAttentionScoreV5"
        {
            return no("soc", &self.soc_name, format!("not Ascend950 for {op} (V1..V4 return 361001 there; V5 runs)"));
        }
        Ok(())
    }

    fn act(&self, act: DType) -> Result<(), Unsupported> {
        match act {
            DType::F16 => Ok(()),
            DType::BF16 if self.soc.supports_bf16() => Ok(()),
            DType::BF16 => no("soc", &self.soc_name, "a SoC with bf16 (Atlas A2/A3; 310P, 910A and 310B have none)"),
            other => no("act_dtype", other, "f16 or bf16"),
        }
    }

    fn matmul(&self, c: &MatMulCase) -> Result<(), Unsupported> {
        self.act(c.act_dtype)?;
        if c.precision != Precision::Exact {
            return no(
                "precision",
                c.precision.name(),
                "exact (no int8 activation path: the quantized matmuls are not declared)",
            );
        }
        if c.dtype.is_quantized() {
            return self.quant_matmul(c);
        }
        if c.dtype != c.act_dtype {
            return no(
                "weight_dtype",
                c.dtype,
                format!(
                    "{} like the activations (the plan converts weights at upload: aclnnMm would promote a mixed \
                     pair to f32)",
                    c.act_dtype
                ),
            );
        }
        self.ops(&["aclnnMm", "aclnnInplaceAdd", "aclnnCast"])
    }

    /// A GGUF block-type weight through aclnnWeightQuantBatchMatmulV2 (rules in the module docs).
    fn quant_matmul(&self, c: &MatMulCase) -> Result<(), Unsupported> {
        if !quant_kept(c.dtype) {
            return no(
                "weight_dtype",
                c.dtype,
                format!(
                    "q4_0, q4_1, q5_0, q5_1, q8_0, q4_k or q5_k for aclnnWeightQuantBatchMatmulV2 (one scale and \
                     min per 32 values), or {} (converted at upload)",
                    c.act_dtype
                ),
            );
        }
        self.op(WQBMM)?;
        if c.cols <= QUANT_GROUP || !c.cols.is_multiple_of(QUANT_GROUP) || c.cols > 65535 {
            return no(
                "cols",
                c.cols,
                "a multiple of 32 above 32 and at most 65535 (antiquantGroupSize 32 must lie in [32, k-1])",
            );
        }
        if c.rows > 65535 {
            return no("rows", c.rows, "at most 65535 (n of aclnnWeightQuantBatchMatmulV2)");
        }
        self.ops(&["aclnnInplaceAdd", "aclnnCast"])
    }

    fn attention(&self, kind: AttnKind, c: &AttentionCase) -> Result<(), Unsupported> {
        match kind {
            AttnKind::Standard => {
                return no(
                    "kind",
                    kind.name(),
                    "flash_attention or paged_decode_attention (materialized-score attention has no declared \
                     aclnn op; FusedInferAttentionScore is the attention op)",
                )
            }
            AttnKind::PagedDecode if c.phase == AttnPhase::Prefill => {
                return no("phase", "prefill", "decode (one query row per sequence)")
            }
            _ => {}
        }
        let Some(fia) = fused_infer_attention_version(&self.cann) else {
            let want = if self.soc == SocFamily::Ascend950 {
                "aclnnFusedInferAttentionScoreV5"
            } else {
                "aclnnFusedInferAttentionScoreV4/V3/V2"
            };
            return no("symbol", want, "present in libopapi (FusedInferAttentionScore is the attention op)");
        };
        self.op(fia.op_name())?;
        self.a2a3(fia.op_name())?;
        self.act(c.act_dtype)?;
        if c.kv_dtype != c.act_dtype {
            return no(
                "kv_dtype",
                c.kv_dtype,
                format!("{} (FIA takes query, key and value of one dtype)", c.act_dtype),
            );
        }
        if c.head_dim == 0 || c.head_dim > 512 || !c.head_dim.is_multiple_of(16) {
            return no("head_dim", c.head_dim, "a multiple of 16 of at most 512 (FIA, fp16/bf16)");
        }
        if c.n_heads == 0 || c.n_heads > 256 {
            return no("n_heads", c.n_heads, "1..=256 (FIA)");
        }
        if c.kv_heads == 0 || !c.n_heads.is_multiple_of(c.kv_heads) || c.n_heads / c.kv_heads > 64 {
            return no("kv_heads", c.kv_heads, format!("a divisor of {} with a group of at most 64 (FIA)", c.n_heads));
        }
        if c.kv_heads * c.head_dim > 65535 {
            return no("kv_heads*head_dim", c.kv_heads * c.head_dim, "at most 65535 (FIA with BnBsH caches)");
        }
        let bs = c.block_size;
        match c.phase {
            AttnPhase::Prefill if !(128..=512).contains(&bs) || !bs.is_multiple_of(128) => {
                no("block_size", bs, "a multiple of 128 in 128..=512 (FIA's paged prefill)")
            }
            AttnPhase::Decode if bs == 0 || bs > 512 || !bs.is_multiple_of(16) => {
                no("block_size", bs, "a multiple of 16 of at most 512 (FIA's paged decode)")
            }
            _ => Ok(()),
        }
    }

    pub fn supports(&self, q: &OpQuery) -> Result<(), Unsupported> {
        match *q {
            OpQuery::Embed { table, act } => {
                self.act(act)?;
                if table != act {
                    return no(
                        "table_dtype",
                        table,
                        format!("{act}, the activation dtype (aclnnEmbedding copies rows)"),
                    );
                }
                self.op("aclnnEmbedding")
            }
            OpQuery::RmsNorm { gain, act, fused_add } => {
                self.act(act)?;
                if gain != act {
                    return no("gain_dtype", gain, format!("{act}, the activation dtype (gamma of aclnnRmsNorm)"));
                }
                self.op(if fused_add { "aclnnAddRmsNorm" } else { "aclnnRmsNorm" })
            }
            OpQuery::Add { act } => self.act(act).and(self.op("aclnnInplaceAdd")),
            OpQuery::MatMul(c) => self.matmul(&c),
            OpQuery::MatMulFused { cases } => {
                let mut cols = None;
                for c in cases.iter().flatten() {
                    self.matmul(c)?;
                    if *cols.get_or_insert(c.cols) != c.cols {
                        return no("cols", c.cols, "equal for every fused weight");
                    }
                }
                Ok(())
            }
            OpQuery::MatMulSwiGlu { gate, up } => {
                self.matmul(&gate)?;
                self.matmul(&up)?;
                if (gate.dtype, gate.rows, gate.cols) != (up.dtype, up.rows, up.cols) {
                    return no("up", format!("{} {}x{}", up.dtype, up.rows, up.cols), "gate's dtype and shape");
                }
                self.op("aclnnSwiGlu")
            }
            OpQuery::SwiGlu { act } => self.act(act).and(self.op("aclnnSwiGlu")),
            OpQuery::GeGlu { act } => self.act(act).and(self.ops(&["aclnnGeluV2", "aclnnMul", "aclnnCast"])),
            OpQuery::Scale { act } => self.act(act).and(self.ops(&["aclnnMul", "aclnnCast"])),
            // Host tables (LongRoPE's factor lists read back once), uploaded: no kernel to ask for.
            OpQuery::RopeTables { rope } => {
                if rope.dim == 0 || !rope.dim.is_multiple_of(2) {
                    return no("rope_dim", rope.dim, "even and positive");
                }
                Ok(())
            }
            OpQuery::Rope { head_dim, rot_dim, act, .. } => {
                self.act(act)?;
                if rot_dim != head_dim {
                    return no(
                        "rot_dim",
                        rot_dim,
                        format!("head_dim {head_dim} (aclnnRotaryPositionEmbedding rotates the whole head)"),
                    );
                }
                if head_dim == 0 || !head_dim.is_multiple_of(2) || head_dim >= 896 {
                    return no("head_dim", head_dim, "even and below 896 (aclnnRotaryPositionEmbedding)");
                }
                self.ops(&["aclnnRotaryPositionEmbedding", "aclnnAdd"])
            }
            OpQuery::WriteKv { act, kv_dtype, .. } => {
                self.act(act)?;
                if kv_dtype != act {
                    return no("kv_dtype", kv_dtype, format!("{act} (aclnnScatterPaKvCache keeps the key's dtype)"));
                }
                self.op("aclnnScatterPaKvCache")?;
                self.a2a3("aclnnScatterPaKvCache")
            }
            OpQuery::Attention { kind, case } => self.attention(kind, &case),
            OpQuery::MoeRoute { experts, top_k } => {
                if top_k == 0 || top_k > experts || top_k > 1024 {
                    return no(
                        "top_k",
                        top_k,
                        format!("1..={} (aclnnMoeGatingTopKSoftmax: k <= 1024)", experts.min(1024)),
                    );
                }
                self.ops(&ROUTE)?;
                self.a2a3("aclnnMoeGatingTopKSoftmax")
            }
            OpQuery::MoeGrouped { experts, top_k, gate, down } => {
                if experts == 0 || experts > 1024 {
                    return no("experts", experts, "1..=1024 (aclnnGroupedMatmulV4 groups)");
                }
                if top_k == 0 || top_k > experts {
                    return no("top_k", top_k, format!("1..={experts}"));
                }
                for c in [&gate, &down] {
                    if c.dtype.is_quantized() {
                        // the grouped path stacks float experts for GroupedMatmulV4 (no antiquant inputs here)
                        return no(
                            "weight_dtype",
                            c.dtype,
                            format!("{} (aclnnGroupedMatmulV4 runs float experts; converted at upload)", c.act_dtype),
                        );
                    }
                }
                self.matmul(&gate)?;
                self.matmul(&down)?;
                self.ops(&GROUPED)
            }
            OpQuery::MoeScatterCombine { .. } => no(
                "op",
                "moe_scatter/moe_combine",
                "an aclnn op (the per-expert path's scatter and combine are not mapped on Ascend; moe_grouped \
                 runs MoE there)",
            ),
            OpQuery::GatherRows { act } => self.act(act).and(self.op("aclnnEmbedding")),
            OpQuery::Convert { from, to } => {
                for d in [from, to] {
                    if !d.is_float() {
                        return no("dtype", d, "f32, f16 or bf16 (aclnnCast)");
                    }
                    if d == DType::BF16 && !self.soc.supports_bf16() {
                        return no(
                            "soc",
                            &self.soc_name,
                            "a SoC with bf16 (Atlas A2/A3; 310P, 910A and 310B have none)",
                        );
                    }
                }
                self.op("aclnnCast")
            }
        }
    }

    /// The aclnn op(s) a supported query runs, for the plan report.
    pub fn kernel_name(&self, q: &OpQuery) -> Option<String> {
        let s = |v: &str| Some(v.to_string());
        match q {
            OpQuery::Embed { .. } | OpQuery::GatherRows { .. } => s("aclnnEmbedding"),
            OpQuery::RmsNorm { fused_add: true, .. } => s("aclnnAddRmsNorm"),
            OpQuery::RmsNorm { .. } => s("aclnnRmsNorm"),
            OpQuery::Add { .. } => s("aclnnInplaceAdd"),
            OpQuery::MatMul(c) if c.dtype.is_quantized() => s(WQBMM),
            OpQuery::MatMulFused { cases } if cases.iter().flatten().any(|c| c.dtype.is_quantized()) => s(WQBMM),
            OpQuery::MatMul(_) | OpQuery::MatMulFused { .. } => s("aclnnMm"),
            OpQuery::MatMulSwiGlu { gate, .. } if gate.dtype.is_quantized() => Some(format!("{WQBMM}+aclnnSwiGlu")),
            OpQuery::MatMulSwiGlu { .. } => s("aclnnMm+aclnnSwiGlu"),
            OpQuery::SwiGlu { .. } => s("aclnnSwiGlu"),
            OpQuery::GeGlu { .. } => s("aclnnGeluV2+aclnnMul+aclnnCast"),
            OpQuery::Scale { .. } => s("aclnnMul+aclnnCast"),
            OpQuery::RopeTables { .. } => None,
            OpQuery::Rope { .. } => s("aclnnRotaryPositionEmbedding"),
            OpQuery::WriteKv { .. } => s("aclnnScatterPaKvCache"),
            OpQuery::Attention { .. } => fused_infer_attention_version(&self.cann).map(|v| v.op_name().to_string()),
            OpQuery::MoeRoute { .. } => s("aclnnMoeGatingTopKSoftmax"),
            OpQuery::MoeGrouped { .. } => {
                s("aclnnMoeInitRoutingV2+aclnnGroupedMatmulV4+aclnnSwiGlu+aclnnMoeFinalizeRoutingV2")
            }
            OpQuery::MoeScatterCombine { .. } => None,
            OpQuery::Convert { .. } => s("aclnnCast"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_bad_specs_parse_and_bad_ones_name_the_item() {
        let v = parse_known_bad(" aclnnRmsNorm@8.0.RC1..8.0.RC3 ; aclnnMm@8.1.RC1..8.2.0").unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].op, "aclnnRmsNorm");
        assert!(CannVersion::parse("8.0.RC2").unwrap().in_range(&v[0].from, &v[0].until));
        assert!(!CannVersion::parse("8.0.RC3").unwrap().in_range(&v[0].from, &v[0].until));
        for bad in ["aclnnX", "aclnnX@8.0.RC1", "RmsNorm@8.0.RC1..8.1.RC1", "aclnnX@8.1.RC1..8.0.RC1", "aclnnX@a..b"] {
            let e = parse_known_bad(bad).unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
        assert_eq!(builtin_known_bad().len(), KNOWN_BAD.len(), "every built-in entry parses");
    }
}
