//! The step's index arrays: uploaded once into the views the runner named (staged, queued on
//! the stream), and the host copies the ops need — FIA takes sequence lengths as host
//! `aclIntArray`s (`actualSeqLengths`, `actualSeqLengthsKv`), the RoPE tables are computed on the
//! host from the positions, and block ids are checked against the pool before a kernel could read
//! out of bounds.

use super::{be_err, AscendBackend};
use crate::backend::{StepHost, StepViews, View};
use crate::Result;

#[derive(Default)]
pub(super) struct StepState {
    pub views: Option<StepViews>,
    pub ids: Vec<u32>,
    pub positions: Vec<u32>,
    pub slots: Vec<u32>,
    /// Per sequence `[q_start, q_len, ctx_len]`.
    pub seqs: Vec<[u32; 3]>,
    pub block_tables: Vec<u32>,
    pub logit_rows: Vec<u32>,
}

/// The u32 arrays go to aclnn as INT32 (memory.rs): every id must be below 2^31. `u32::MAX` is the
/// block tables' "no block" (-1 as INT32), so it is allowed there.
fn check_i32(what: &str, v: &[u32], allow_max: bool) -> Result<()> {
    match v.iter().find(|&&x| x > i32::MAX as u32 && !(allow_max && x == u32::MAX)) {
        Some(bad) => Err(be_err(format!(
            "set_step: {what} holds {bad}, which aclnn's INT32 index tensors cannot hold (ids must be below 2^31)"
        ))),
        None => Ok(()),
    }
}

impl AscendBackend {
    pub(super) fn upload_step(&mut self, host: &StepHost<'_>, v: &StepViews) -> Result<()> {
        check_i32("ids", host.ids, false)?;
        check_i32("slots", host.slots, false)?;
        check_i32("logit_rows", host.logit_rows, false)?;
        check_i32("block_tables", host.block_tables, true)?;
        let seqs: &[u32] = host.seqs.as_flattened();
        check_i32("seqs", seqs, false)?;
        if v.max_blocks > 0 && host.block_tables.len() != host.seqs.len() * v.max_blocks {
            return Err(be_err(format!(
                "set_step: {} block-table entries for {} sequences of {} blocks",
                host.block_tables.len(),
                host.seqs.len(),
                v.max_blocks
            )));
        }
        for (view, data) in [
            (v.ids, host.ids),
            (v.positions, host.positions),
            (v.slots, host.slots),
            (v.seqs, seqs),
            (v.block_tables, host.block_tables),
            (v.logit_rows, host.logit_rows),
        ] {
            if view.len != data.len() {
                return Err(be_err(format!("set_step: a view of {} elements for {} values", view.len, data.len())));
            }
            if !data.is_empty() {
                let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
                use crate::backend::Backend;
                self.write_async(view, &bytes)?;
            }
        }
        let s = &mut self.step;
        s.views = Some(*v);
        s.ids.clear();
        s.ids.extend_from_slice(host.ids);
        s.positions.clear();
        s.positions.extend_from_slice(host.positions);
        s.slots.clear();
        s.slots.extend_from_slice(host.slots);
        s.seqs.clear();
        s.seqs.extend_from_slice(host.seqs);
        s.block_tables.clear();
        s.block_tables.extend_from_slice(host.block_tables);
        s.logit_rows.clear();
        s.logit_rows.extend_from_slice(host.logit_rows);
        Ok(())
    }

    /// The host copy of `v` when it is (part of) one of the step's arrays `pick` selects.
    pub(super) fn step_host<'s>(
        &'s self,
        v: View,
        pick: impl Fn(&StepViews) -> View,
        data: impl Fn(&'s StepState) -> &'s [u32],
    ) -> Option<&'s [u32]> {
        let sv = pick(self.step.views.as_ref()?);
        let d = data(&self.step);
        (v.buf == sv.buf && v.offset >= sv.offset && v.offset + v.len <= sv.offset + sv.len)
            .then(|| d.get(v.offset - sv.offset..v.offset - sv.offset + v.len))
            .flatten()
    }
}
