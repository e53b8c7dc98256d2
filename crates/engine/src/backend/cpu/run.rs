//! Executing one op on host memory: resolve its views, check its shapes, call the kernel.
//! Shapes are checked here so that a graph-builder bug is an error, never a kernel panic.

use tboost_kernels::attention::{self, SeqSpan};
use tboost_kernels::gemm::{self, MatSeg};
use tboost_kernels::{activation, convert, embed, moe, norm, rope};

use super::views::Views;
use super::weights::{mat, vec};
use super::CpuBackend;
use crate::backend::op::{AttnKind, Op};
use crate::{Error, Result};
use tboost_ops::Tiling;

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(CpuBackend::err(format!(
            "{what}: {got} elements where {want} were expected (a bug in the graph builder)"
        )));
    }
    Ok(())
}

/// Packed panels have kernels at one precision: `Fast` for block types, `Exact` for dense
/// ones (the plan packs a slot's weights only for the precision it runs at).
fn packed_precision(w: &tboost_kernels::WeightMat<'_>, precision: tboost_ops::Precision) -> Result<()> {
    use tboost_kernels::Layout;
    use tboost_ops::Precision;
    let want = match w.layout {
        Layout::Rows => return Ok(()),
        Layout::PairPanels => Precision::Fast,
        Layout::Panels if w.dtype.is_quantized() => Precision::Fast,
        Layout::Panels => Precision::Exact,
    };
    if precision != want {
        return Err(CpuBackend::err(format!(
            "matmul: a {} weight repacked into panels needs precision {}, not {} (a bug in the plan)",
            w.dtype,
            want.name(),
            precision.name()
        )));
    }
    Ok(())
}

impl CpuBackend {
    pub(super) fn run_op(&self, op: &Op) -> Result<()> {
        let mut vs = Views::new(self);
        match *op {
            Op::Embed { ids, table, out } => {
                let t = self.weight(table)?.rows("embed")?;
                check_len("embed out", out.len, ids.len * t.cols)?;
                let ids = vs.u32(ids)?;
                if let Some(&bad) = ids.iter().find(|&&id| id as usize >= t.rows) {
                    return Err(Error::invalid(
                        "token id",
                        format!("{bad} is not below the vocabulary size {}", t.rows),
                    ));
                }
                let out = vs.f32_mut(out)?;
                embed::embed(ids, t, out);
            }
            Op::RmsNorm { x, w, eps, out } => {
                let w = vec(self.weight(w)?.stored("norm")?);
                check_len("rmsnorm", x.len, out.len)?;
                if w.len == 0 || !x.len.is_multiple_of(w.len) {
                    return Err(CpuBackend::err(format!("rmsnorm: {} values are not rows of {}", x.len, w.len)));
                }
                let (x, out) = (vs.f32(x)?, vs.f32_mut(out)?);
                norm::rmsnorm(x, w, eps, out);
            }
            Op::AddRmsNorm { residual, x, w, eps, out } => {
                let w = vec(self.weight(w)?.stored("norm")?);
                check_len("add_rmsnorm", x.len, residual.len)?;
                check_len("add_rmsnorm", out.len, residual.len)?;
                if w.len == 0 || !x.len.is_multiple_of(w.len) {
                    return Err(CpuBackend::err(format!("add_rmsnorm: {} values are not rows of {}", x.len, w.len)));
                }
                let (r, x, out) = (vs.f32_mut(residual)?, vs.f32(x)?, vs.f32_mut(out)?);
                norm::add_rmsnorm(r, x, w, eps, out);
            }
            Op::Add { dst, src } => {
                check_len("add", src.len, dst.len)?;
                let (d, s) = (vs.f32_mut(dst)?, vs.f32(src)?);
                norm::add(d, s);
            }
            Op::MatMul { x, m, segs, precision, tiling } => {
                tiling.check().map_err(|u| CpuBackend::err(format!("matmul: tiling: {u}")))?;
                let xs = vs.f32(x)?;
                let mut ms = tboost_kernels::Few::with_capacity(segs.len());
                let mut cols = None;
                for s in segs.iter() {
                    let w = self.weight(s.w)?.matmul();
                    packed_precision(&w, precision)?;
                    if *cols.get_or_insert(w.cols) != w.cols {
                        return Err(CpuBackend::err("matmul: fused weights of different widths"));
                    }
                    check_len("matmul x", xs.len(), m * w.cols)?;
                    check_len("matmul out", s.out.len, m * w.rows)?;
                    let bias = match s.bias {
                        Some(b) => {
                            let b = vec(self.weight(b)?.stored("matmul bias")?);
                            check_len("matmul bias", b.len, w.rows)?;
                            Some(b)
                        }
                        None => None,
                    };
                    ms.push(MatSeg { w, bias, out: vs.f32_mut(s.out)? });
                }
                gemm::matmul_prec_tiled(precision, &tiling, xs, m, &mut ms)
            }
            Op::MatMulSwiGlu { x, m, gate, up, out, precision, tiling } => {
                tiling.check().map_err(|u| CpuBackend::err(format!("matmul_swiglu: tiling: {u}")))?;
                let (g, u) = (self.weight(gate)?.matmul(), self.weight(up)?.matmul());
                packed_precision(&g, precision)?;
                packed_precision(&u, precision)?;
                if (g.rows, g.cols) != (u.rows, u.cols) || !moe::swiglu_fusable(&g, &u) {
                    return Err(CpuBackend::err(
                        "matmul_swiglu: gate and up differ in shape or in a dtype pair it takes",
                    ));
                }
                check_len("matmul_swiglu x", x.len, m * g.cols)?;
                check_len("matmul_swiglu out", out.len, m * g.rows)?;
                let (xs, out) = (vs.f32(x)?, vs.f32_mut(out)?);
                gemm::matmul_swiglu_prec_tiled(precision, &tiling, xs, m, g, u, out)
            }
            Op::SwiGlu { gate, up, out } => {
                check_len("swiglu", up.len, gate.len)?;
                check_len("swiglu", out.len, gate.len)?;
                let (g, u, o) = (vs.f32(gate)?, vs.f32(up)?, vs.f32_mut(out)?);
                activation::swiglu(g, u, o);
            }
            Op::GeGlu { gate, up, out } => {
                check_len("geglu", up.len, gate.len)?;
                check_len("geglu", out.len, gate.len)?;
                let (g, u, o) = (vs.f32(gate)?, vs.f32(up)?, vs.f32_mut(out)?);
                activation::geglu_tanh(g, u, o);
            }
            Op::Scale { x, s } => {
                for v in vs.f32_mut(x)? {
                    *v *= s;
                }
            }
            Op::RopeTables { positions, rope: params, cos, sin } => {
                let half = params.dim / 2;
                check_len("rope cos", cos.len, positions.len * half)?;
                check_len("rope sin", sin.len, positions.len * half)?;
                let inv_freq = params.inv_freq();
                let (p, c, s) = (vs.u32(positions)?, vs.f32_mut(cos)?, vs.f32_mut(sin)?);
                rope::cos_sin_scaled_into(p, &inv_freq, params.attention_factor(), c, s);
            }
            Op::RopeTablesScaled { positions, rope: params, factors, cos, sin } => {
                let half = params.dim / 2;
                check_len("rope cos", cos.len, positions.len * half)?;
                check_len("rope sin", sin.len, positions.len * half)?;
                let f = vec(self.weight(factors)?.stored("rope factors")?);
                check_len("rope factors", f.len, half)?;
                let f = f.to_f32();
                let inv_freq = params.inv_freq_with(Some(&f));
                let (p, c, s) = (vs.u32(positions)?, vs.f32_mut(cos)?, vs.f32_mut(sin)?);
                rope::cos_sin_scaled_into(p, &inv_freq, params.attention_factor(), c, s);
            }
            Op::Rope { x, heads, head_dim, cos, sin, style } => {
                let row = heads * head_dim;
                if row == 0 || !x.len.is_multiple_of(row) || cos.len != sin.len {
                    return Err(CpuBackend::err(format!("rope: {} values are not rows of {heads}x{head_dim}", x.len)));
                }
                let rows = x.len / row;
                if rows > 0 && (!cos.len.is_multiple_of(rows) || 2 * (cos.len / rows) > head_dim) {
                    return Err(CpuBackend::err(format!("rope: tables of {} values for {rows} rows", cos.len)));
                }
                let (c, s, x) = (vs.f32(cos)?, vs.f32(sin)?, vs.f32_mut(x)?);
                rope::apply(x, heads, head_dim, c, s, style);
            }
            Op::WriteKv { k, v, slots, cache } => {
                let row = cache.kv_heads * cache.head_dim;
                check_len("write_kv k", k.len, slots.len * row)?;
                check_len("write_kv v", v.len, slots.len * row)?;
                let (k, v, slots, mut pool) = (vs.f32(k)?, vs.f32(v)?, vs.u32(slots)?, vs.pool_mut(&cache)?);
                let capacity = cache.num_blocks * cache.block_size;
                if let Some(&bad) = slots.iter().find(|&&s| s as usize >= capacity) {
                    return Err(CpuBackend::err(format!("KV slot {bad} beyond the pool's {capacity} slots")));
                }
                attention::write_kv(k, v, slots, &mut pool);
            }
            Op::Attention { kind, q, cache, seqs, params, out } => {
                check_len("attention seq table", seqs.seqs.len, seqs.count * 3)?;
                check_len("attention block tables", seqs.block_tables.len, seqs.count * seqs.max_blocks)?;
                check_len("attention out", out.len, q.len)?;
                let width = params.n_heads * params.head_dim;
                let table = vs.u32(seqs.seqs)?;
                let bt = vs.u32(seqs.block_tables)?;
                let (q, pool, out) = (vs.f32(q)?, vs.pool(&cache)?, vs.f32_mut(out)?);
                let mut spans = Vec::with_capacity(seqs.count);
                for (i, s) in table.chunks_exact(3).enumerate() {
                    let (q_start, q_len, ctx_len) = (s[0] as usize, s[1] as usize, s[2] as usize);
                    let used = ctx_len.div_ceil(cache.block_size.max(1));
                    let blocks = &bt[i * seqs.max_blocks..(i + 1) * seqs.max_blocks];
                    if q_len == 0 || q_len > ctx_len || used > seqs.max_blocks || (q_start + q_len) * width > q.len() {
                        return Err(CpuBackend::err(format!(
                            "sequence {i}: rows {q_start}+{q_len} of context {ctx_len} do not fit the step"
                        )));
                    }
                    // Blocks behind the sliding window of the first row are not read.
                    let skip = (params.first_visible(ctx_len - q_len) / cache.block_size.max(1)).min(used);
                    if let Some(&b) = blocks[skip..used].iter().find(|&&b| b as usize >= cache.num_blocks) {
                        return Err(CpuBackend::err(format!(
                            "sequence {i}: block {b} is beyond the pool's {}",
                            cache.num_blocks
                        )));
                    }
                    spans.push(SeqSpan { q_start, q_len, ctx_len, block_table: &blocks[..used] });
                }
                match kind {
                    AttnKind::Flash | AttnKind::PagedDecode => {
                        attention::flash_tile_supports(params.tile_kv)
                            .map_err(|u| CpuBackend::err(format!("{}: {u}", kind.name())))?;
                        attention::flash_attention(q, &pool, &spans, &params, out)
                    }
                    AttnKind::Standard => attention::standard_attention(q, &pool, &spans, &params, out),
                }
            }
            Op::MoeRoute { logits, m, experts, top_k, ids, weights } => {
                check_len("moe_route logits", logits.len, m * experts)?;
                check_len("moe_route ids", ids.len, m * top_k)?;
                check_len("moe_route weights", weights.len, m * top_k)?;
                moe::supports(experts, top_k).map_err(|u| CpuBackend::err(format!("moe_route: {u}")))?;
                let lg = vs.f32(logits)?;
                let (i, w) = moe::route_topk(lg, experts, top_k, true);
                vs.u32_mut(ids)?.copy_from_slice(&i);
                vs.f32_mut(weights)?.copy_from_slice(&w);
            }
            Op::MoeGrouped { x, m, experts, top_k, ids, weights, out, tiling } => {
                tiling.check().map_err(|u| CpuBackend::err(format!("moe_grouped: tiling: {u}")))?;
                let mut ex = Vec::with_capacity(experts.count);
                for e in 0..experts.count {
                    let (g, u, d) = experts.expert(e);
                    ex.push(moe::Expert {
                        gate: mat(self.weight(g)?.stored("moe")?),
                        up: mat(self.weight(u)?.stored("moe")?),
                        down: mat(self.weight(d)?.stored("moe")?),
                    });
                }
                let hidden = ex.first().map_or(0, |e| e.gate.cols);
                check_len("moe x", x.len, m * hidden)?;
                check_len("moe out", out.len, m * hidden)?;
                check_len("moe ids", ids.len, m * top_k)?;
                check_len("moe weights", weights.len, m * top_k)?;
                let (xs, ids, wts, out) = (vs.f32(x)?, vs.u32(ids)?, vs.f32(weights)?, vs.f32_mut(out)?);
                if let Some(&bad) = ids.iter().find(|&&e| e as usize >= experts.count) {
                    return Err(CpuBackend::err(format!("moe: expert {bad} of {}", experts.count)));
                }
                moe::moe_ffn(xs, m, &ex, ids, wts, top_k, out, &tiling);
            }
            Op::MoeScatter { y, m, expert, top_k, ids, ys } => {
                check_len("moe_scatter ids", ids.len, m * top_k)?;
                let hidden = y.len.checked_div(m).unwrap_or(0);
                check_len("moe_scatter y", y.len, m * hidden)?;
                check_len("moe_scatter ys", ys.len, m * top_k * hidden)?;
                let (y, ids, ys) = (vs.f32(y)?, vs.u32(ids)?, vs.f32_mut(ys)?);
                for (slot, &e) in ids.iter().enumerate() {
                    if e == expert {
                        let t = slot / top_k;
                        ys[slot * hidden..(slot + 1) * hidden].copy_from_slice(&y[t * hidden..(t + 1) * hidden]);
                    }
                }
            }
            Op::MoeCombine { ys, m, top_k, weights, out } => {
                let hidden = out.len.checked_div(m).unwrap_or(0);
                check_len("moe_combine out", out.len, m * hidden)?;
                check_len("moe_combine ys", ys.len, m * top_k * hidden)?;
                check_len("moe_combine weights", weights.len, m * top_k)?;
                let (ys, w, out) = (vs.f32(ys)?, vs.f32(weights)?, vs.f32_mut(out)?);
                moe::combine(ys, w, top_k, hidden, out);
            }
            Op::GatherRows { x, cols, rows, out } => {
                check_len("gather out", out.len, rows.len * cols)?;
                let (xs, rows, o) = (vs.f32(x)?, vs.u32(rows)?, vs.f32_mut(out)?);
                for (i, &r) in rows.iter().enumerate() {
                    let src = xs
                        .get(r as usize * cols..(r as usize + 1) * cols)
                        .ok_or_else(|| CpuBackend::err(format!("gather: row {r} out of range")))?;
                    o[i * cols..(i + 1) * cols].copy_from_slice(src);
                }
            }
            Op::Convert { src, dst } => {
                check_len("convert", dst.len, src.len)?;
                let (from, to) = (vs.dtype(src)?, vs.dtype(dst)?);
                convert::supports(from, to).map_err(|u| CpuBackend::err(format!("convert: {u}")))?;
                let (s, d) = (vs.bytes(src)?, vs.bytes_mut(dst)?);
                convert::convert(from, s, to, d, src.len);
            }
            Op::Zero { dst } => vs.bytes_mut(dst)?.fill(0),
        }
        Ok(())
    }
}
