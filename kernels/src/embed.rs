//! Embedding lookup: copies (and converts to f32) one table row per id.

use crate::WeightMat;

/// `out[i] = table[ids[i]]` as f32. Ids must be `< table.rows` (the orchestrator checks
/// them against the vocabulary first and reports bad ids as a user error).
pub fn embed(ids: &[u32], table: WeightMat<'_>, out: &mut [f32]) {
    let _ = (ids, table, out);
    unimplemented!()
}

/// Converts one weight row to f32 (any supported dtype).
pub fn row_to_f32(table: WeightMat<'_>, row: usize, out: &mut [f32]) {
    let _ = (table, row, out);
    unimplemented!()
}
