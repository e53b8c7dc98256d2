//! Tokenizers (GGUF SentencePiece / byte-level BPE, HF tokenizer.json) and chat templates
//! (being written).
