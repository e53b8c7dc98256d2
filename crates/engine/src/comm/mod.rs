//! Collectives between the ranks of a tensor-parallel group: all-reduce (sum, f32),
//! all-gather, broadcast and barrier, each bounded by the communicator's timeout. A rank that
//! does not arrive in time, or leaves, fails the collective on every other rank with an
//! error naming it, and the group stays broken from then on: the ranks no longer agree on
//! where they are in the step, so the engine has to be re-created.
//!
//! - `local`: N ranks as threads of one process on shared host memory.
//! - `mpi`: one rank per process under `mpirun`, Open MPI loaded at run time.
//! - `hccl`: threads of one process, one Ascend device each; the activations' all-reduce and the
//!   logits' all-gather run as HCCL collectives on the devices, the step commands on the host.

pub mod hccl;
mod local;
pub mod mpi;

use std::time::Duration;

pub use local::{LocalComm, LocalGroup};

use crate::{Error, Result};

/// Which communicator a tensor-parallel engine uses (engine key `comm`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CommKind {
    /// Every rank a thread of this process (`local`).
    #[default]
    Local,
    /// One rank per process of `MPI_COMM_WORLD` (`mpi`, under `mpirun`).
    Mpi,
    /// Every rank a thread of this process on its own Ascend device, the data plane over HCCL
    /// (`hccl`).
    Hccl,
}

impl CommKind {
    pub const NAMES: &'static str = "local, mpi, hccl";

    pub fn parse(s: &str) -> Result<CommKind> {
        match s.trim() {
            "local" => Ok(CommKind::Local),
            "mpi" => Ok(CommKind::Mpi),
            "hccl" => Ok(CommKind::Hccl),
            other => Err(Error::invalid("comm", format!("`{other}` is not one of {}", Self::NAMES))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CommKind::Local => "local",
            CommKind::Mpi => "mpi",
            CommKind::Hccl => "hccl",
        }
    }
}

/// The collective timeout when none is configured.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// One rank's end of a group. Every rank must call the same collectives in the same order;
/// the results are identical on every rank (sums are taken in rank order).
pub trait Communicator: Send + Sync {
    /// The communicator's name (`local`).
    fn name(&self) -> &'static str;
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    fn timeout(&self) -> Duration;
    /// Sums `buf` element-wise over all ranks, in place.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()>;
    /// `out[r * local.len()..]` receives rank `r`'s `local`; every rank passes the same length.
    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<()>;
    /// Rank `root`'s `bytes` replace every other rank's.
    fn broadcast(&self, root: usize, bytes: &mut Vec<u8>) -> Result<()>;
    fn barrier(&self) -> Result<()>;
    /// Leaves the group for `why` (a failed load or step): the other ranks' collectives fail
    /// at once with this reason instead of waiting for the timeout.
    fn abandon(&self, why: &str);
    /// Another rank that has left the group, and why, when this end knows without waiting (a
    /// `local` group does; MPI does not say).
    fn departed(&self) -> Option<(usize, String)> {
        None
    }
}

/// The error of a collective on `rank`.
pub(crate) fn error(rank: usize, op: &str, msg: impl Into<String>) -> Error {
    Error::Comm { rank, op: op.to_string(), msg: msg.into() }
}
