//! Megatron-style tensor parallelism, decided per rank: which heads, which part of the MLP's
//! intermediate dimension and which vocabulary rows each rank holds, and the collectives
//! that join the partial results.
//!
//! - QKV and gate/up are column-parallel: a rank holds the rows of its heads (its part of
//!   the intermediate dimension). When there are fewer KV heads than ranks, each KV head is
//!   replicated on the ranks whose query heads read it.
//! - o_proj and down are row-parallel: a rank holds the columns that match its heads
//!   (intermediate part) and produces a partial sum, which an all-reduce completes.
//! - The embedding and lm_head are split by vocabulary rows: a rank embeds only the tokens
//!   it holds (the others' rows are zeroed before the all-reduce) and computes the logits of
//!   its rows, which an all-gather joins. Tied tables stay one set of bytes per rank.
//! - MoE: the router is replicated; every expert is split like a dense MLP.
//!
//! Splits of block-quantized columns must fall on block boundaries; the intermediate
//! dimension is split in whole blocks. A head boundary that is not on one (o_proj of a
//! quantized model whose heads per rank are not a multiple of the block) makes that rank's
//! o_proj columns dequantized to f32, which the report says.

use std::ops::Range;

use serde::Serialize;
use tboost_ops::{Precision, Unsupported};

use super::{Choice, Decision, Placement, Slot, Tried, Verdict, WeightMode};
use crate::model::{Mlp, ModelConfig, ModelWeights, Tensor};
use crate::{Error, Result};

/// What one rank holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ShardSpec {
    pub world: usize,
    pub rank: usize,
    /// Query heads of this rank.
    pub heads: Range<usize>,
    /// KV heads of this rank (shared with other ranks when `kv_replicated`).
    pub kv_heads: Range<usize>,
    pub kv_replicated: bool,
    /// Part of the MLP's (every expert's) intermediate dimension.
    pub intermediate: Range<usize>,
    /// Vocabulary rows of the embedding and lm_head, of every rank (this one's is
    /// `vocab_splits[rank]`).
    pub vocab_splits: Vec<Range<usize>>,
    /// o_proj's columns are dequantized to f32: the head boundary is not on a block boundary.
    pub o_proj_to_f32: bool,
}

impl ShardSpec {
    pub fn vocab(&self) -> Range<usize> {
        self.vocab_splits[self.rank].clone()
    }

    /// The largest vocabulary part (the all-gather's per-rank length per row).
    pub fn vocab_max(&self) -> usize {
        self.vocab_splits.iter().map(|r| r.len()).max().unwrap_or(0)
    }
}

/// `n` items in `parts` contiguous near-equal ranges (the first ranges one longer).
fn even(n: usize, parts: usize, i: usize) -> Range<usize> {
    let (q, r) = (n / parts, n % parts);
    let start = i * q + i.min(r);
    start..start + q + usize::from(i < r)
}

/// Query and KV heads of `rank`: with at least as many KV heads as ranks, whole GQA groups
/// are split between ranks; with fewer, each KV head's group is split between the ranks that
/// share it (it is replicated on them).
fn heads(cfg: &ModelConfig, world: usize, rank: usize) -> Result<(Range<usize>, Range<usize>, bool)> {
    let (h, kv) = (cfg.num_heads, cfg.num_kv_heads);
    if world > h {
        return Err(Error::invalid("tp", format!("{world} ranks but the model has only {h} attention heads")));
    }
    let group = h / kv.max(1);
    if world <= kv {
        let k = even(kv, world, rank);
        return Ok((k.start * group..k.end * group, k, false));
    }
    // Ranks per KV head, near-even; each rank takes a part of one head's group.
    let mut first = 0;
    for k in 0..kv {
        let ranks = even(world, kv, k).len();
        if rank < first + ranks {
            let part = even(group, ranks, rank - first);
            if part.is_empty() {
                return Err(Error::invalid(
                    "tp",
                    format!("{world} ranks: KV head {k} has {group} query heads for {ranks} ranks"),
                ));
            }
            return Ok((k * group + part.start..k * group + part.end, k..k + 1, true));
        }
        first += ranks;
    }
    Err(Error::invalid("tp", format!("rank {rank} is not below the world size {world}")))
}

/// The column-split block size of the tensors split along their inputs (down of every layer
/// and expert): the intermediate dimension is split in whole blocks of it.
fn down_block(w: &ModelWeights) -> usize {
    let downs = w.layers.iter().flat_map(|l| match &l.mlp {
        Mlp::Dense { down, .. } => vec![down],
        Mlp::Moe { experts, .. } => experts.iter().map(|e| &e.down).collect(),
    });
    downs.map(|t: &Tensor| t.dtype.block_elems()).max().unwrap_or(1)
}

/// What rank `rank` of `world` holds of the model.
pub fn decide(cfg: &ModelConfig, w: &ModelWeights, world: usize, rank: usize) -> Result<ShardSpec> {
    if world == 0 || rank >= world {
        return Err(Error::invalid("rank", format!("rank {rank} is not below the world size {world}")));
    }
    let (heads, kv_heads, kv_replicated) = self::heads(cfg, world, rank)?;
    let block = down_block(w);
    let units = cfg.intermediate_size / block;
    if units < world {
        return Err(Error::invalid(
            "tp",
            format!(
                "the intermediate size {} is {units} blocks of {block}, fewer than the {world} ranks",
                cfg.intermediate_size
            ),
        ));
    }
    let u = even(units, world, rank);
    let intermediate = u.start * block..u.end * block;
    if cfg.vocab_size < world {
        return Err(Error::invalid("tp", format!("the vocabulary of {} is below {world} ranks", cfg.vocab_size)));
    }
    let vocab_splits = (0..world).map(|r| even(cfg.vocab_size, world, r)).collect();
    let ob = w.layers.iter().map(|l| l.o.dtype.block_elems()).max().unwrap_or(1);
    let hd = cfg.head_dim;
    let o_proj_to_f32 = world > 1 && (!(heads.start * hd).is_multiple_of(ob) || !(heads.end * hd).is_multiple_of(ob));
    Ok(ShardSpec { world, rank, heads, kv_heads, kv_replicated, intermediate, vocab_splits, o_proj_to_f32 })
}

/// The tensor-parallel part of a plan: what this rank holds and what it exchanges.
#[derive(Clone, Debug, Serialize)]
pub struct TpReport {
    /// The communicator (`local`).
    pub comm: String,
    #[serde(flatten)]
    pub shard: ShardSpec,
    /// Bytes of the weights this rank holds (its shards plus the replicated norms and router).
    pub resident_weight_bytes: usize,
    /// Bytes of the whole model's weights (what one rank would hold alone).
    pub model_weight_bytes: usize,
    /// Bytes each rank sends into all-reduces per token: an f32 row of `hidden` after the
    /// embedding and after each layer's o_proj and MLP.
    pub all_reduce_bytes_per_token: usize,
    /// Bytes of logits each rank contributes per sampled row (its padded vocabulary part).
    pub all_gather_bytes_per_row: usize,
}

fn unavailable(candidate: Choice, backend: &str, param: &'static str, value: &str, need: &str) -> Tried {
    Tried {
        candidate,
        backend: backend.to_string(),
        verdict: Verdict::Unavailable { why: Unsupported::new(param, value, need) },
    }
}

/// What a rank's backend offers for the collectives (`collective_decisions`).
#[derive(Clone, Debug)]
pub struct CollectiveOffer<'a> {
    /// The backend's device collective (`hccl`), when it is a rank of a device group.
    pub device: Option<&'a str>,
    /// Whether that device fuses a matmul with the all-reduce (MC2), or why not.
    pub fused: std::result::Result<(), Unsupported>,
    /// Bytes of one activation value (the all-reduce's element).
    pub act_bytes: usize,
    /// Every rank's vocabulary part has the same length (the device all-gather needs no padding).
    pub even_vocab: bool,
}

/// The collective slots: the all-reduce after the embedding and after every row-parallel
/// matmul (o_proj and the MLP's down of every layer), and the all-gather of the logits. The
/// fused matmul + all-reduce (Ascend's MC2, `aclnnMatmulAllReduce`: not built) is tried first,
/// then a collective on device memory (HCCL, when the backend is a rank of a device group),
/// then the host path (read, reduce across ranks, write back).
pub fn collective_decisions(
    backend: &str,
    comm: &str,
    cfg: &ModelConfig,
    world: usize,
    offer: CollectiveOffer<'_>,
) -> Vec<Decision> {
    let fused = match (&offer.device, &offer.fused) {
        (Some(_), Ok(())) => None,
        (Some(_), Err(why)) => Some(Tried {
            candidate: Choice::MatmulAllReduce,
            backend: backend.to_string(),
            verdict: Verdict::Unavailable { why: why.clone() },
        }),
        (None, _) => Some(unavailable(
            Choice::MatmulAllReduce,
            backend,
            "backend",
            backend,
            "a device with a fused matmul + all-reduce (aclnnMatmulAllReduce over HCCL)",
        )),
    };
    let chosen = |c| Tried { candidate: c, backend: backend.to_string(), verdict: Verdict::Chosen };
    let decision = |slot, choice, tried: Vec<Tried>, reason: String| Decision {
        slot,
        choice,
        backend: backend.to_string(),
        kernel: None,
        placement: Placement::Primary,
        weights: WeightMode::Native,
        precision: Precision::Exact,
        // The host path is the expected one without a device group: not a warning.
        fallback: false,
        copy_bytes_per_token: 0,
        reason: {
            let no: Vec<String> =
                tried.iter().filter(|t| t.verdict != Verdict::Chosen).map(super::table::tried_text).collect();
            if no.is_empty() {
                reason
            } else {
                format!("{reason}; {}", no.join("; "))
            }
        },
        tried,
    };
    let reduces = 1 + 2 * cfg.num_layers;
    let layers = format!("the embedding and o_proj + mlp down of each of the {} layers", cfg.num_layers);
    match offer.device {
        Some(dev) => {
            let per_token = offer.act_bytes * cfg.hidden_size * reduces;
            let gather = if offer.even_vocab {
                decision(
                    Slot::AllGather,
                    Choice::DeviceAllGather,
                    vec![chosen(Choice::DeviceAllGather)],
                    format!("{dev} all-gather of each rank's logits on device memory, then one read to the host"),
                )
            } else {
                decision(
                    Slot::AllGather,
                    Choice::HostAllGather,
                    vec![
                        unavailable(
                            Choice::DeviceAllGather,
                            backend,
                            "vocab",
                            "uneven",
                            "vocabulary parts of one length (the device all-gather does not pad)",
                        ),
                        chosen(Choice::HostAllGather),
                    ],
                    format!(
                        "host all-gather of each rank's logits over `{comm}` ({} bytes a row; a step whose rows \
                         are all greedy gathers each rank's best candidate, 8 bytes a row)",
                        4 * cfg.vocab_size.div_ceil(world)
                    ),
                )
            };
            let device = format!(
                "{dev} all-reduce on device memory and the backend's stream ({world} ranks) after {layers}: \
                 {reduces} per token, {per_token} bytes per token per rank; host all-reduce not used (it would \
                 read and write every activation through the host)"
            );
            let reduce = match fused {
                Some(refused) => decision(
                    Slot::AllReduce,
                    Choice::DeviceAllReduce,
                    vec![refused, chosen(Choice::DeviceAllReduce)],
                    device,
                ),
                None => decision(
                    Slot::AllReduce,
                    Choice::MatmulAllReduce,
                    vec![chosen(Choice::MatmulAllReduce)],
                    format!(
                        "MC2 (aclnnMatmulAllReduce) fuses o_proj and mlp down with their all-reduce in prefill steps \
                         whose weights are in the activation dtype (the op takes no quantized weights); decode \
                         steps (its doc: incremental steps do not use MC2), the embedding and other weights take the \
                         {device}"
                    ),
                ),
            };
            vec![reduce, gather]
        }
        None => {
            let device =
                unavailable(Choice::DeviceAllReduce, backend, "comm", comm, "a communicator on device memory (hccl)");
            let per_token = 4 * cfg.hidden_size * reduces;
            vec![
                decision(
                    Slot::AllReduce,
                    Choice::HostAllReduce,
                    fused.into_iter().chain([device, chosen(Choice::HostAllReduce)]).collect(),
                    format!(
                        "host all-reduce over `{comm}` ({world} ranks) after {layers}: {per_token} bytes per token \
                         per rank"
                    ),
                ),
                decision(
                    Slot::AllGather,
                    Choice::HostAllGather,
                    vec![chosen(Choice::HostAllGather)],
                    format!(
                        "host all-gather of each rank's logits over `{comm}` ({} bytes a row; a step whose rows \
                         are all greedy gathers each rank's best candidate, 8 bytes a row)",
                        4 * cfg.vocab_size.div_ceil(world)
                    ),
                ),
            ]
        }
    }
}

impl TpReport {
    /// One line for the log and `tboost plan`.
    pub fn line(&self) -> String {
        let s = &self.shard;
        let r = |r: &Range<usize>| format!("{}..{}", r.start, r.end);
        format!(
            "tensor parallel: rank {} of {} over `{}`: heads {}, kv heads {}{}, intermediate {}, vocab {}{}; \
             {} weight bytes resident of {} ({:.2}x)",
            s.rank,
            s.world,
            self.comm,
            r(&s.heads),
            r(&s.kv_heads),
            if s.kv_replicated { " (replicated)" } else { "" },
            r(&s.intermediate),
            r(&s.vocab()),
            if s.o_proj_to_f32 { "; o_proj columns dequantized to f32 (head boundary inside a block)" } else { "" },
            self.resident_weight_bytes,
            self.model_weight_bytes,
            self.resident_weight_bytes as f64 / self.model_weight_bytes.max(1) as f64
        )
    }
}
