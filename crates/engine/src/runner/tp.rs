//! A tensor-parallel rank inside the runner: the collectives of a step, the commands the
//! leader (rank 0) broadcasts to the followers, and the follower threads of a `local` group.
//!
//! The leader owns the scheduler and the KV manager. Before every KV allocation, buffer
//! reservation and forward pass it broadcasts the command with its inputs (tokens, positions,
//! slot mapping, sequences, block tables, logit rows), so every rank runs the same step on its
//! own shard; block tables are the same everywhere, each rank's pools hold its own KV heads.

use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use super::exec::Exec;
use super::ModelRunner;
use crate::backend::{Backend, BackendExt, Op, View, WeightId};
use crate::comm::Communicator;
use crate::kv::StepLayout;
use crate::model::{ModelConfig, ModelWeights};
use crate::plan::{PlanOptions, ShardSpec};
use crate::{Error, Result};

/// The collectives one forward pass of a rank makes.
pub(super) struct StepComm<'a> {
    pub comm: &'a dyn Communicator,
    /// Per token: whether this rank holds its embedding row.
    pub held: &'a [bool],
    /// The all-reduce runs on the device (the backend's `DeviceCollective`, HCCL) instead of
    /// through the host.
    pub device: bool,
    /// Row-parallel matmuls fuse their all-reduce (MC2) this step.
    pub mc2: bool,
}

impl StepComm<'_> {
    /// `out = x · wᵀ` summed over the ranks as one fused device op (MC2), when this step and weight
    /// allow it on the primary; false when the caller must run the matmul and [`Self::all_reduce`].
    pub fn matmul_all_reduce(&self, ex: &mut Exec<'_>, x: View, m: usize, w: WeightId, out: View) -> Result<bool> {
        if !self.mc2 {
            return Ok(false);
        }
        let rank = self.comm.rank();
        let dc = ex.primary.device_collective().ok_or_else(|| {
            crate::comm::error(rank, "matmul_all_reduce", "the backend lost its device collective (a bug)")
        })?;
        dc.matmul_all_reduce(x, m, w, out)
            .map_err(|e| crate::comm::error(rank, "matmul_all_reduce (MC2)", e.to_string()))
    }

    /// Sums `v` (f32, on the primary) over the ranks through the host. With `row`, the rows
    /// of tokens this rank does not hold are zeroed first (they were embedded from a
    /// placeholder row).
    pub fn all_reduce(&self, ex: &mut Exec<'_>, v: View, row: Option<usize>) -> Result<()> {
        if self.device {
            if let Some(n) = row {
                for (i, held) in self.held.iter().enumerate() {
                    if !held {
                        ex.primary.launch(&Op::Zero { dst: View::new(v.buf, v.offset + i * n, n) })?;
                    }
                }
            }
            let rank = self.comm.rank();
            let dc = ex.primary.device_collective().ok_or_else(|| {
                crate::comm::error(rank, "all_reduce", "the backend lost its device collective (a bug)")
            })?;
            return dc.all_reduce_sum(v).map_err(|e| crate::comm::error(rank, "all_reduce (hccl)", e.to_string()));
        }
        let mut host = vec![0f32; v.len];
        ex.primary.read_typed(v, &mut host)?;
        if let Some(n) = row {
            for (r, held) in host.chunks_mut(n).zip(self.held) {
                if !held {
                    r.fill(0.0);
                }
            }
        }
        self.comm.all_reduce_sum(&mut host)?;
        ex.primary.write_typed(v, &host)
    }
}

/// What the leader asks every follower to do.
pub(super) enum Cmd {
    Stop,
    AllocKv { blocks: usize, block_size: usize },
    Reserve { tokens: usize, rows: usize, seqs: usize, max_blocks: usize },
    Forward { tokens: Vec<u32>, layout: StepLayout, logit_rows: Vec<u32>, argmax_only: bool },
}

fn put(out: &mut Vec<u8>, v: &[u32]) {
    out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

struct Reader<'b>(&'b [u8]);

impl Reader<'_> {
    fn u32(&mut self) -> Result<u32> {
        let (h, t) = self.0.split_at_checked(4).ok_or_else(|| Error::invalid("tp command", "truncated"))?;
        self.0 = t;
        Ok(u32::from_le_bytes([h[0], h[1], h[2], h[3]]))
    }

    fn vec(&mut self) -> Result<Vec<u32>> {
        let n = self.u32()? as usize;
        if n * 4 > self.0.len() {
            return Err(Error::invalid("tp command", format!("an array of {n} beyond the message")));
        }
        (0..n).map(|_| self.u32()).collect()
    }
}

impl Cmd {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Cmd::Stop => put(&mut out, &[0]),
            Cmd::AllocKv { blocks, block_size } => put(&mut out, &[1, *blocks as u32, *block_size as u32]),
            Cmd::Reserve { tokens, rows, seqs, max_blocks } => {
                put(&mut out, &[2, *tokens as u32, *rows as u32, *seqs as u32, *max_blocks as u32])
            }
            Cmd::Forward { tokens, layout: l, logit_rows, argmax_only } => {
                put(&mut out, &[3, l.max_blocks as u32, *argmax_only as u32]);
                put(&mut out, tokens);
                put(&mut out, &l.positions);
                put(&mut out, &l.slots);
                put(&mut out, &l.seqs.iter().flatten().copied().collect::<Vec<u32>>());
                put(&mut out, &l.block_tables);
                put(&mut out, logit_rows);
            }
        }
        out
    }

    pub fn decode(b: &[u8]) -> Result<Cmd> {
        let mut r = Reader(b);
        let head = r.vec()?;
        let at =
            |i: usize| head.get(i).map(|&x| x as usize).ok_or_else(|| Error::invalid("tp command", "short header"));
        Ok(match at(0)? {
            0 => Cmd::Stop,
            1 => Cmd::AllocKv { blocks: at(1)?, block_size: at(2)? },
            2 => Cmd::Reserve { tokens: at(1)?, rows: at(2)?, seqs: at(3)?, max_blocks: at(4)? },
            3 => {
                let (max_blocks, argmax_only) = (at(1)?, at(2)? != 0);
                let tokens = r.vec()?;
                let positions = r.vec()?;
                let slots = r.vec()?;
                let seqs = r.vec()?.chunks_exact(3).map(|c| [c[0], c[1], c[2]]).collect();
                let block_tables = r.vec()?;
                let logit_rows = r.vec()?;
                let layout = StepLayout { positions, slots, seqs, block_tables, max_blocks };
                Cmd::Forward { tokens, layout, logit_rows, argmax_only }
            }
            other => return Err(Error::invalid("tp command", format!("unknown command {other}"))),
        })
    }
}

/// Opens rank `r`'s backend (a follower's, in its own thread).
pub type OpenBackend = Arc<dyn Fn(usize) -> Result<Box<dyn Backend>> + Send + Sync>;

/// A rank's link to its group.
pub(super) struct TpLink {
    pub comm: Arc<dyn Communicator>,
    pub spec: ShardSpec,
    /// The all-reduce and the logits all-gather run on the device (`DeviceCollective`).
    pub device_reduce: bool,
    pub device_gather: bool,
    /// The device fuses row-parallel matmuls with their all-reduce (MC2; the plan chose it).
    pub mc2: bool,
    /// The follower threads of a `local` group (on the leader), and the channel each one's
    /// end is reported on.
    pub followers: Vec<JoinHandle<()>>,
    pub ended: Option<mpsc::Receiver<()>>,
}

impl TpLink {
    /// Broadcasts `cmd` from the leader.
    pub fn send(&self, cmd: &Cmd) -> Result<()> {
        self.comm.broadcast(0, &mut cmd.encode())
    }

    /// Stops the followers and waits for them, at most one collective timeout.
    pub fn stop(&mut self) {
        if self.comm.rank() != 0 {
            return;
        }
        if let Err(e) = self.send(&Cmd::Stop) {
            log::warn!("tensor parallel: stopping the followers: {e}");
        }
        let Some(ended) = self.ended.take() else { return };
        let deadline = Instant::now() + self.comm.timeout();
        let mut done = 0;
        while done < self.followers.len() {
            match ended.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(()) => done += 1,
                Err(_) => {
                    log::error!(
                        "tensor parallel: {} follower(s) did not stop in time; left running",
                        self.followers.len() - done
                    );
                    self.followers.clear();
                    return;
                }
            }
        }
        for h in self.followers.drain(..) {
            let _ = h.join();
        }
    }
}

/// Starts ranks `1..` of a `local` group as threads: each opens its backend, makes its
/// shard resident and then follows the leader until it says stop. A rank that fails leaves
/// the group with its error, which the leader's next collective reports.
pub(super) fn spawn_followers(
    cfg: &ModelConfig,
    w: &ModelWeights,
    opts: &PlanOptions,
    cpu_threads: usize,
    open: OpenBackend,
    comms: Vec<Arc<dyn Communicator>>,
) -> Result<(Vec<JoinHandle<()>>, mpsc::Receiver<()>)> {
    let (tx, rx) = mpsc::channel();
    let mut handles = Vec::new();
    for comm in comms {
        let (cfg, w, opts, open, tx) = (cfg.clone(), w.clone(), opts.clone(), open.clone(), tx.clone());
        let rank = comm.rank();
        let h = std::thread::Builder::new()
            .name(format!("tboost-tp-rank{rank}"))
            .spawn(move || {
                let run = || -> Result<()> {
                    let be = open(rank)?;
                    let mut r = ModelRunner::new_rank(&cfg, &w, be, &opts, cpu_threads, comm.clone())?;
                    r.follow()
                };
                if let Err(e) = run() {
                    log::error!("tensor-parallel rank {rank}: {e}");
                    comm.abandon(&e.to_string());
                }
                let _ = tx.send(());
            })
            .map_err(|e| Error::invalid("tp", format!("cannot start the thread of rank {rank}: {e}")))?;
        handles.push(h);
    }
    Ok((handles, rx))
}
