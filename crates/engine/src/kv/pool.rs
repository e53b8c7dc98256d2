//! Device-side KV pools: for every layer one K and one V buffer of
//! `[num_blocks, block_size, kv_heads, head_dim]` elements of the cache dtype.

use tboost_ops::DType;

use crate::backend::{Backend, KvLayer};
use crate::model::ModelConfig;
use crate::{Error, Result};

pub struct KvPools {
    pub layers: Vec<KvLayer>,
    pub num_blocks: usize,
    pub block_size: usize,
    pub dtype: DType,
}

impl KvPools {
    /// Bytes one token occupies in the cache across all layers (K and V).
    /// K and V bytes of one token over all layers (a q8_0 row whose head_dim is not whole
    /// blocks counts as f16, the type the plan falls back to).
    pub fn bytes_per_token(cfg: &ModelConfig, dtype: DType) -> usize {
        let row = dtype.bytes_for(cfg.head_dim).unwrap_or(2 * cfg.head_dim);
        2 * cfg.num_layers * cfg.num_kv_heads * row
    }

    pub fn new(
        be: &mut dyn Backend,
        cfg: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
        dtype: DType,
    ) -> Result<KvPools> {
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::Q8_0) {
            return Err(Error::invalid(
                "kv_dtype",
                format!("{dtype} is not a KV cache type (use f32, f16, bf16 or q8_0)"),
            ));
        }
        if dtype.bytes_for(cfg.head_dim).is_none() {
            return Err(Error::invalid(
                "kv_dtype",
                format!(
                    "a {dtype} KV cache needs head_dim a multiple of {}, the model has {}",
                    dtype.block_elems(),
                    cfg.head_dim
                ),
            ));
        }
        if block_size == 0 || num_blocks == 0 {
            return Err(Error::invalid("kv cache", format!("{num_blocks} blocks of {block_size} tokens is empty")));
        }
        let per_layer = num_blocks
            .checked_mul(block_size)
            .and_then(|n| n.checked_mul(cfg.num_kv_heads * cfg.head_dim))
            .ok_or_else(|| {
                Error::invalid("kv cache", format!("{num_blocks} blocks of {block_size} tokens overflow"))
            })?;
        let mut pools = KvPools { layers: Vec::with_capacity(cfg.num_layers), num_blocks, block_size, dtype };
        for _ in 0..cfg.num_layers {
            let k = be.alloc(dtype, per_layer);
            let v = be.alloc(dtype, per_layer);
            match (k, v) {
                (Ok(k), Ok(v)) => pools.layers.push(KvLayer {
                    k,
                    v,
                    dtype,
                    num_blocks,
                    block_size,
                    kv_heads: cfg.num_kv_heads,
                    head_dim: cfg.head_dim,
                }),
                (k, v) => {
                    for b in [k, v].into_iter().flatten() {
                        be.free(b);
                    }
                    pools.free(be);
                    return Err(Error::invalid(
                        "kv cache",
                        format!(
                            "cannot allocate {num_blocks} blocks of {block_size} tokens ({} bytes)",
                            num_blocks * block_size * Self::bytes_per_token(cfg, dtype)
                        ),
                    ));
                }
            }
        }
        Ok(pools)
    }

    /// Returns the buffers to the backend.
    pub fn free(&mut self, be: &mut dyn Backend) {
        for l in self.layers.drain(..) {
            be.free(l.k);
            be.free(l.v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The figures the README quotes.
    #[test]
    fn bytes_per_token_of_named_shapes() {
        // TinyLlama-1.1B's shape.
        let tiny = crate::model::config::llama_shape(2048, 22, 32, 4, 5632, 32000);
        assert_eq!(KvPools::bytes_per_token(&tiny, DType::F32), 45_056);
        assert_eq!(KvPools::bytes_per_token(&tiny, DType::F16), 22_528);
        assert_eq!(KvPools::bytes_per_token(&tiny, DType::BF16), 22_528);
        // 64 values per head row: two Q8_0 blocks of 34 bytes.
        assert_eq!(KvPools::bytes_per_token(&tiny, DType::Q8_0), 11_968);
        assert_eq!((1usize << 30) / 45_056, 23_831);
    }
}
