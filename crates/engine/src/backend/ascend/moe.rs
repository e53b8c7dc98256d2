//! Mixture of experts.
//!
//! - `MoeRoute`: router logits cast to f32 (`aclnnCast`), `aclnnMoeGatingTopKSoftmax` (softmax, the k
//!   largest, INT32 expert ids into the runner's u32 buffer; ties go to the lower expert id, which the
//!   plan relies on — the simulator does exactly that; the doc does not say, see the README), then
//!   the renormalisation over the top k the op does not do: row sums with `aclnnMm` against ones and
//!   `aclnnDiv`, cast to the weights' dtype.
//! - `MoeGrouped`: `aclnnMoeInitRoutingV2` (dropless: rows sorted by expert, per-expert counts),
//!   `aclnnGroupedMatmulV4` over the experts' gate and up weights stacked as `[experts, 2·inter,
//!   hidden]` (one grouped call writes `[gate | up]` per row), `aclnnSwiGlu`, `aclnnGroupedMatmulV4`
//!   over the stacked down weights, and `aclnnMoeFinalizeRoutingV2` (dropPadMode 2: the weighted sum
//!   over each token's k rows, in rank order).
//!
//! The experts' weights are stacked on the device at the layer's first grouped call (stream copies;
//! the experts' ids then name the stack, their own memory is freed).

use ascend_sys::aclnn::{self, CubeMathType, ExpertTokens, GroupListType, MoeFinalizeRouting, MoeInitRouting};
use tboost_ops::DType;

use super::memory::{Const, Scratch};
use super::{acl_err, be_err, AscendBackend};
use crate::backend::{ExpertSet, View};
use crate::Result;

impl AscendBackend {
    pub(super) fn moe_route(
        &mut self,
        logits: View,
        m: usize,
        experts: usize,
        top_k: usize,
        ids: View,
        weights: View,
    ) -> Result<()> {
        if logits.len != m * experts || ids.len != m * top_k || weights.len != m * top_k {
            return Err(be_err(format!("moe_route: views do not fit m={m} experts={experts} top_k={top_k}")));
        }
        if top_k == 0 || top_k > experts || top_k > 1024 {
            return Err(be_err(format!("moe_route: top_k {top_k} of {experts} experts")));
        }
        if m == 0 {
            return Ok(());
        }
        let wd = self.mem.dtype(weights)?;
        self.mem.ensure(Scratch::RouteLogits, m * experts * 4)?;
        self.mem.ensure(Scratch::RouteProbs, m * top_k * 4)?;
        self.mem.ensure(Scratch::RouteRowIdx, m * top_k * 4)?;
        self.mem.ensure(Scratch::RouteSum, m * 4)?;
        self.mem.ensure(Scratch::RouteNorm, m * top_k * 4)?;
        self.mem.ensure_const(Const::OnesF32)?;
        let (ctx, mm) = (&mut self.ctx, &self.mem);
        let lf = mm.scratch(Scratch::RouteLogits, DType::F32, 0, &[m, experts])?;
        let lt = mm.tensor(logits, &[m, experts])?;
        aclnn::cast(ctx, &lt, &lf).map_err(|e| acl_err("aclnnCast (router logits to f32)", e))?;
        let y = mm.scratch(Scratch::RouteProbs, DType::F32, 0, &[m, top_k])?;
        let it = mm.tensor(ids, &[m, top_k])?;
        let ri = mm.scratch(Scratch::RouteRowIdx, DType::I32, 0, &[m, top_k])?;
        aclnn::moe_gating_top_k_softmax(ctx, &lf, None, top_k as i64, &y, &it, &ri)
            .map_err(|e| acl_err("aclnnMoeGatingTopKSoftmax", e))?;
        let sum = mm.scratch(Scratch::RouteSum, DType::F32, 0, &[m, 1])?;
        let ones = mm.constant(Const::OnesF32, DType::F32, &[top_k, 1])?;
        aclnn::mm(ctx, &y, &ones, &sum, CubeMathType::KeepDtype).map_err(|e| acl_err("aclnnMm (top-k sums)", e))?;
        let wt = mm.tensor(weights, &[m, top_k])?;
        if wd == DType::F32 {
            aclnn::div(ctx, &y, &sum, &wt).map_err(|e| acl_err("aclnnDiv (renormalisation)", e))
        } else {
            let yn = mm.scratch(Scratch::RouteNorm, DType::F32, 0, &[m, top_k])?;
            aclnn::div(ctx, &y, &sum, &yn).map_err(|e| acl_err("aclnnDiv (renormalisation)", e))?;
            aclnn::cast(ctx, &yn, &wt).map_err(|e| acl_err("aclnnCast (routing weights)", e))
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_grouped(
        &mut self,
        x: View,
        m: usize,
        experts: &ExpertSet,
        top_k: usize,
        ids: View,
        weights: View,
        out: View,
    ) -> Result<()> {
        let e = experts.count;
        if e == 0 || top_k == 0 || top_k > e {
            return Err(be_err(format!("moe_grouped: top_k {top_k} of {e} experts")));
        }
        let stack = self.mem.moe_stack(&mut self.ctx, experts.first, e)?;
        let (h, inter, act) = (stack.hidden, stack.inter, self.mem.dtype(x)?);
        if x.len != m * h || out.len != m * h || ids.len != m * top_k || weights.len != m * top_k {
            return Err(be_err(format!("moe_grouped: views do not fit m={m} hidden={h} top_k={top_k}")));
        }
        if stack.dtype != act || self.mem.dtype(out)? != act || self.mem.dtype(weights)? != act {
            return Err(be_err(format!(
                "moe_grouped: experts {} / weights {} with {act} activations (one dtype)",
                stack.dtype,
                self.mem.dtype(weights)?
            )));
        }
        if m == 0 {
            return Ok(());
        }
        let nk = m * top_k;
        let esz = act.block_bytes();
        self.mem.ensure(Scratch::MoeExpanded, nk * h * esz)?;
        self.mem.ensure(Scratch::MoeRowIdx, nk * 4)?;
        self.mem.ensure(Scratch::MoeCounts, e * 4)?;
        self.mem.ensure(Scratch::MoeCounts64, e * 8)?;
        self.mem.ensure(Scratch::MoeGateUp, nk * 2 * inter * esz)?;
        self.mem.ensure(Scratch::MoeAct, nk * inter * esz)?;
        self.mem.ensure(Scratch::MoeDown, nk * h * esz)?;
        let (ctx, mm) = (&mut self.ctx, &self.mem);
        let expanded = mm.scratch(Scratch::MoeExpanded, act, 0, &[nk, h])?;
        let row_idx = mm.scratch(Scratch::MoeRowIdx, DType::I32, 0, &[nk])?;
        let counts = mm.scratch(Scratch::MoeCounts, DType::I32, 0, &[e])?;
        let idt = mm.tensor(ids, &[m, top_k])?;
        aclnn::moe_init_routing_v2(
            ctx,
            &MoeInitRouting {
                x: mm.tensor(x, &[m, h])?,
                expert_idx: idt,
                active_num: 0,
                expert_capacity: 0,
                expert_num: e as i64,
                drop_pad_mode: 0,
                expert_tokens: ExpertTokens::Count,
                expanded_x: expanded,
                expanded_row_idx: row_idx,
                expert_tokens_out: Some(counts),
                expert_tokens_before_capacity: None,
            },
        )
        .map_err(|err| acl_err("aclnnMoeInitRoutingV2", err))?;
        let counts64 = mm.scratch(Scratch::MoeCounts64, DType::I64, 0, &[e])?;
        aclnn::cast(ctx, &counts, &counts64).map_err(|err| acl_err("aclnnCast (group list)", err))?;
        let wgu = mm
            .store_tensor(stack.gate_up, act, &[e, 2 * inter, h])?
            .transpose(1, 2)
            .map_err(|err| acl_err("moe", err))?;
        let gu = mm.scratch(Scratch::MoeGateUp, act, 0, &[nk, 2 * inter])?;
        aclnn::grouped_matmul_v4(ctx, &expanded, &wgu, None, &counts64, GroupListType::Count, &gu)
            .map_err(|err| acl_err("aclnnGroupedMatmulV4 (gate/up)", err))?;
        let a = mm.scratch(Scratch::MoeAct, act, 0, &[nk, inter])?;
        aclnn::swi_glu(ctx, &gu, -1, &a).map_err(|err| acl_err("aclnnSwiGlu", err))?;
        let wd =
            mm.store_tensor(stack.down, act, &[e, h, inter])?.transpose(1, 2).map_err(|err| acl_err("moe", err))?;
        let dn = mm.scratch(Scratch::MoeDown, act, 0, &[nk, h])?;
        aclnn::grouped_matmul_v4(ctx, &a, &wd, None, &counts64, GroupListType::Count, &dn)
            .map_err(|err| acl_err("aclnnGroupedMatmulV4 (down)", err))?;
        aclnn::moe_finalize_routing_v2(
            ctx,
            &MoeFinalizeRouting {
                expanded_x: dn,
                expanded_row_idx: row_idx,
                x1: None,
                x2: None,
                bias: None,
                scales: Some(mm.tensor(weights, &[m, top_k])?),
                expert_idx: Some(idt),
                drop_pad_mode: 2,
                out: mm.tensor(out, &[m, h])?,
            },
        )
        .map_err(|err| acl_err("aclnnMoeFinalizeRoutingV2", err))
    }
}
