//! Weights made resident on the backend of the slot that reads them, in the form the plan
//! chose (as stored, or converted once at upload).

use std::borrow::Cow;

use crate::backend::cpu::{convert_weight, CpuBackend};
use crate::backend::{Backend, ExpertSet, WeightId};
use crate::model::{Mlp, ModelWeights, Tensor};
use crate::plan::{Decision, Placement, Plan, Slot, WeightMode};
use crate::{Error, Result};

pub(crate) struct LayerIds {
    pub attn_norm: WeightId,
    pub q: WeightId,
    pub k: WeightId,
    pub v: WeightId,
    pub q_bias: Option<WeightId>,
    pub k_bias: Option<WeightId>,
    pub v_bias: Option<WeightId>,
    pub o: WeightId,
    pub ffn_norm: WeightId,
    pub mlp: MlpIds,
    /// q and k norm gains (Qwen3, Gemma 3).
    pub qk_norm: Option<(WeightId, WeightId)>,
    pub post_attn_norm: Option<WeightId>,
    pub post_ffn_norm: Option<WeightId>,
}

pub(crate) enum MlpIds {
    Dense { gate: WeightId, up: WeightId, down: WeightId },
    Moe { router: WeightId, experts: ExpertSet },
}

pub(crate) struct WeightIds {
    pub embed: WeightId,
    pub layers: Vec<LayerIds>,
    pub norm: WeightId,
    pub lm_head: WeightId,
    /// LongRoPE's short and long factors, on the rope_tables slot's backend.
    pub rope_factors: Option<(WeightId, WeightId)>,
    /// The embedding scale (Gemma), rounded to the table's dtype.
    pub embed_scale: Option<f32>,
}

struct Uploader<'b> {
    primary: &'b mut dyn Backend,
    cpu: Option<&'b mut CpuBackend>,
}

impl Uploader<'_> {
    fn backend(&mut self, d: &Decision) -> Result<&mut dyn Backend> {
        match (d.placement, self.cpu.as_deref_mut()) {
            (Placement::Primary, _) => Ok(&mut *self.primary),
            (Placement::Cpu, Some(c)) => Ok(c),
            (Placement::Cpu, None) => Err(Error::invalid("plan", "a slot is planned on a CPU that was not made")),
        }
    }

    /// `t` as decision `d` wants it, on `d`'s backend.
    fn up(&mut self, d: &Decision, t: &Tensor) -> Result<WeightId> {
        let t = match d.weights {
            // `convert_weight` reads the stored rows with `pread`.
            WeightMode::Convert(to) if t.dtype != to => Cow::Owned(convert_weight(t, to)?),
            WeightMode::Packed => {
                let be = self.backend(d)?;
                let t = staged(be, t)?;
                return be.upload_packed(&t, d.precision);
            }
            _ => Cow::Borrowed(t),
        };
        self.plain(d, &t)
    }

    /// `t` as stored (LongRoPE's factors), on `d`'s backend.
    fn plain(&mut self, d: &Decision, t: &Tensor) -> Result<WeightId> {
        let be = self.backend(d)?;
        let t = staged(be, t)?;
        be.upload_weight(&t)
    }

    /// `t` as stored (biases), on `d`'s backend.
    fn raw(&mut self, d: &Decision, t: &Option<Tensor>) -> Result<Option<WeightId>> {
        t.as_ref().map(|t| self.plain(d, t)).transpose()
    }
}

/// `t` as backend `be` may read it: a mapped tensor read into memory tboost owns with `pread`
/// (`Tensor::owned_copy`) unless the backend reads it so itself
/// ([`Backend::reads_mapped_weights`]). One tensor at a time: the copy is dropped after its
/// upload, so a device backend's load holds at most one tensor twice.
fn staged<'t>(be: &dyn Backend, t: &'t Tensor) -> Result<Cow<'t, Tensor>> {
    Ok(if t.is_mapped() && !be.reads_mapped_weights() { Cow::Owned(t.owned_copy()?) } else { Cow::Borrowed(t) })
}

/// Whether the embedding table is also the lm_head (tied, and not split differently).
fn tied_table(w: &ModelWeights) -> bool {
    let (e, h) = (&w.embed, &w.lm_head);
    e.name == h.name && e.dtype == h.dtype && e.shape == h.shape
}

fn slot<'p>(decisions: impl Fn(Slot) -> Option<&'p Decision>, s: Slot) -> Result<&'p Decision> {
    decisions(s).ok_or_else(|| Error::invalid("plan", format!("no decision for slot {}", s.name())))
}

impl WeightIds {
    pub fn upload(
        plan: &Plan,
        w: &ModelWeights,
        primary: &mut dyn Backend,
        cpu: Option<&mut CpuBackend>,
    ) -> Result<WeightIds> {
        let mut u = Uploader { primary, cpu };
        let m = |s| plan.model_slot(s);
        let (embed_d, head_d) = (slot(m, Slot::Embed)?, slot(m, Slot::LmHead)?);
        // A tied table whose lm_head panels the embedding lookup can read is uploaded once.
        let tied = tied_table(w) && embed_d.placement == head_d.placement && head_d.weights == WeightMode::Packed && {
            let be = u.backend(head_d)?;
            be.packs(w.lm_head.dtype, head_d.precision) && be.embeds_packed(w.lm_head.dtype, head_d.precision)
        };
        let shared_head = if tied {
            log::info!(target: "tboost::plan", "model: embed: reads rows of the lm_head's packed panels (tied table, one copy)");
            Some(u.up(head_d, &w.lm_head)?)
        } else {
            None
        };
        let embed = match shared_head {
            Some(id) => id,
            None => u.up(embed_d, &w.embed)?,
        };
        let mut layers = Vec::with_capacity(w.layers.len());
        for (lp, lw) in plan.layers.iter().zip(&w.layers) {
            let d = |s| lp.get(s);
            let qkv = slot(d, Slot::Qkv)?;
            let mlp = slot(d, Slot::Mlp)?;
            let x = &lw.extra;
            let qk_norm = match (&x.q_norm, &x.k_norm) {
                (Some(qn), Some(kn)) => {
                    let dq = slot(d, Slot::QkNorm)?;
                    Some((u.up(dq, qn)?, u.up(dq, kn)?))
                }
                _ => None,
            };
            let post_attn_norm =
                x.post_attn_norm.as_ref().map(|t| u.up(slot(d, Slot::PostAttnNorm)?, t)).transpose()?;
            let post_ffn_norm = x.post_ffn_norm.as_ref().map(|t| u.up(slot(d, Slot::PostFfnNorm)?, t)).transpose()?;
            layers.push(LayerIds {
                qk_norm,
                post_attn_norm,
                post_ffn_norm,
                attn_norm: u.up(slot(d, Slot::AttnNorm)?, &lw.attn_norm)?,
                q: u.up(qkv, &lw.q)?,
                k: u.up(qkv, &lw.k)?,
                v: u.up(qkv, &lw.v)?,
                q_bias: u.raw(qkv, &lw.q_bias)?,
                k_bias: u.raw(qkv, &lw.k_bias)?,
                v_bias: u.raw(qkv, &lw.v_bias)?,
                o: u.up(slot(d, Slot::OProj)?, &lw.o)?,
                ffn_norm: u.up(slot(d, Slot::FfnNorm)?, &lw.ffn_norm)?,
                mlp: match &lw.mlp {
                    Mlp::Dense { gate, up, down } => {
                        MlpIds::Dense { gate: u.up(mlp, gate)?, up: u.up(mlp, up)?, down: u.up(mlp, down)? }
                    }
                    Mlp::Moe { router, experts } => {
                        let router = u.up(slot(d, Slot::MoeRouting)?, router)?;
                        // Consecutive ids: gate_0, up_0, down_0, gate_1, ... (what `ExpertSet` names).
                        let mut first = None;
                        for (e, ex) in experts.iter().enumerate() {
                            let g = u.up(mlp, &ex.gate)?;
                            let up = u.up(mlp, &ex.up)?;
                            let dn = u.up(mlp, &ex.down)?;
                            let f = *first.get_or_insert(g);
                            if (g.0, up.0, dn.0) != (f.0 + 3 * e as u32, f.0 + 3 * e as u32 + 1, f.0 + 3 * e as u32 + 2)
                            {
                                return Err(Error::invalid("weights", "expert weights were not given consecutive ids"));
                            }
                        }
                        let first = first.ok_or_else(|| Error::invalid("weights", "an MoE layer without experts"))?;
                        MlpIds::Moe { router, experts: ExpertSet { first, count: experts.len() } }
                    }
                },
            });
        }
        let rope_factors = match &w.rope_factors {
            Some(f) => {
                let d = slot(m, Slot::RopeTables)?;
                Some((u.plain(d, &f.short)?, u.plain(d, &f.long)?))
            }
            None => None,
        };
        Ok(WeightIds {
            embed,
            layers,
            norm: u.up(slot(m, Slot::FinalNorm)?, &w.norm)?,
            lm_head: match shared_head {
                Some(id) => id,
                None => u.up(head_d, &w.lm_head)?,
            },
            rope_factors,
            embed_scale: None,
        })
    }
}
