//! Samplers: logits → next token, per request, deterministic for a given seed (being written).
