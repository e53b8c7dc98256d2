//! Caps on every size a model file can state, in one place.
//!
//! A model file is untrusted input: one metadata value (`block_count = 2^40`) must not make
//! the loader allocate 2^40 of anything, and no product of two stated sizes may wrap. Each
//! loader checks a value against its cap **before** it allocates anything proportional to
//! it, and the error names the file, the field and the value.
//!
//! The caps are far above every published checkpoint (largest values seen in brackets), so a
//! real model never meets them, and low enough that every product the engine computes from a
//! validated config fits in 64 bits with room to spare (see [`ModelConfig::validate`]'s
//! invariant). Raising one is fine as long as that invariant still holds: the test
//! `caps_keep_every_product_in_range` in `config.rs` recomputes the worst cases.
//!
//! [`ModelConfig::validate`]: super::ModelConfig::validate

/// Decoder layers (Llama-3.1-405B: 126).
pub const MAX_LAYERS: usize = 1024;
/// Query heads per layer (Llama-3.1-405B: 128).
pub const MAX_HEADS: usize = 1024;
/// KV heads per layer; also at most the query heads (they must divide them).
pub const MAX_KV_HEADS: usize = MAX_HEADS;
/// Dimensions per head (Gemma: 256). FlashAttention's per-thread scratch grows with
/// head_dim × the GQA group, so this also bounds that scratch (about 64 MiB at the caps).
pub const MAX_HEAD_DIM: usize = 1024;
/// Hidden size (Nemotron-4-340B: 18432).
pub const MAX_HIDDEN: usize = 1 << 16;
/// MLP intermediate size (Nemotron-4-340B: 73728).
pub const MAX_INTERMEDIATE: usize = 1 << 18;
/// Experts per MoE layer (Qwen3-Next: 512).
pub const MAX_EXPERTS: usize = 1024;
/// Experts each token is routed to (Qwen3-Next: 10). The MoE kernel's scratch is
/// tokens × experts_per_token × hidden floats, so this bounds it too.
pub const MAX_EXPERTS_PER_TOKEN: usize = 64;
/// Vocabulary size (Gemma 3: 262,144). Also the most entries a tokenizer may define.
pub const MAX_VOCAB: usize = 1 << 22;
/// Context length, `max_position_embeddings` / `{arch}.context_length` (Llama 4 Scout: 10M).
pub const MAX_CONTEXT: usize = 1 << 24;

/// Tokens in one step's batch. Not a model-file value: the engine config's
/// `max_batched_tokens` must stay at or below it for the products of
/// [`ModelConfig::validate`]'s invariant to hold.
///
/// [`ModelConfig::validate`]: super::ModelConfig::validate
pub const MAX_BATCH_TOKENS: usize = 1 << 24;

/// Tensors in one checkpoint, over all shards (DeepSeek-V3 with per-expert tensors: ~92k).
pub const MAX_TENSORS: usize = 1 << 20;
/// Dimensions of one tensor (GGUF allows 4; safetensors has no limit; checkpoints use ≤ 3).
pub const MAX_TENSOR_DIMS: usize = 8;
/// Elements of one tensor (the largest stacked expert tensors hold ~2^32). With at most 8
/// bytes per element every tensor's byte size then fits in an `isize`, as slices require.
pub const MAX_TENSOR_ELEMENTS: u64 = 1 << 40;

/// GGUF metadata key/value pairs (real files: ~40).
pub const MAX_METADATA_KEYS: usize = 1 << 16;
/// Values in one GGUF metadata array (a vocabulary and its scores, types and merges each
/// have one entry per token).
pub const MAX_ARRAY_LEN: usize = MAX_VOCAB;
/// Values over all GGUF metadata arrays of a file (a 256k vocabulary with scores, types and
/// merges is about 1M). Each parsed value takes 32 bytes, so this bounds the metadata's
/// memory at 512 MiB, and only for a file that itself holds 2^24 values.
pub const MAX_METADATA_VALUES: usize = 1 << 24;
/// Bytes of one GGUF string: a key, a token, a tensor name or a chat template (real chat
/// templates: < 100 KB).
pub const MAX_STRING_BYTES: usize = 1 << 24;
/// Nesting depth of GGUF metadata arrays (real files: 1).
pub const MAX_ARRAY_DEPTH: usize = 8;

/// Bytes of `tokenizer.json` (Gemma's: 34 MB).
pub const MAX_TOKENIZER_JSON_BYTES: u64 = 1 << 28;
/// Bytes of every other small file a load reads whole: `config.json`,
/// `generation_config.json`, `tokenizer_config.json`, `model.safetensors.index.json`,
/// `chat_template.jinja` (real ones: < 10 MB).
pub const MAX_SMALL_FILE_BYTES: u64 = 1 << 26;

/// Fuel of one chat-template render before it counts the messages (minijinja: one fuel per
/// instruction or per 64 bytes of data). A chat template comes from the model file, and
/// Jinja can loop (`{% for a in range(99999) %}{% for b in range(99999) %}`) or build
/// strings without end; fuel bounds both time and memory. Real templates use a few
/// thousand per conversation; [`CHAT_TEMPLATE_FUEL_PER_BYTE`] more is granted per byte of
/// the messages, so long conversations always fit.
pub const CHAT_TEMPLATE_FUEL: u64 = 10_000_000;
/// Extra fuel per byte of the rendered messages' text (each byte may be copied, escaped,
/// stripped and compared a few times).
pub const CHAT_TEMPLATE_FUEL_PER_BYTE: u64 = 4;

/// Checks `value <= cap`; the error names the source, the field and both numbers.
pub(crate) fn check_cap(source: &str, field: &str, value: u64, cap: u64) -> crate::Result<()> {
    if value > cap {
        return Err(crate::Error::config(
            source,
            field,
            format!("{value} is above tboost's limit of {cap} (no real model comes near it; the file is corrupt or hostile)"),
        ));
    }
    Ok(())
}
