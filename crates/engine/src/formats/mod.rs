//! The files a load reads, shared by `model` and `tokenizer` so that neither reaches into the
//! other: the GGUF container (`gguf`), opening and mapping files safely (`files`), and the caps
//! on every size a file states (`limits`: model files are untrusted input).

pub mod files;
pub mod gguf;
/// Rust-side caps, not part of the C ABI.
pub mod limits;
