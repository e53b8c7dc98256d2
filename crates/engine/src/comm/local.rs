//! The `local` communicator: the ranks are threads of one process and every collective is a
//! rendezvous on host memory. Each collective is one exchange round: every rank deposits
//! its bytes, the last to arrive publishes all contributions, and each rank combines them
//! itself (in rank order, so every rank computes the same sum).
//!
//! A rank that arrives early spins (yielding) for a short while before it sleeps on the
//! condition variable: ranks of a step arrive within microseconds of each other, and waking a
//! sleeping thread costs far more than that on a VM (the woken vCPU has to be scheduled),
//! which with two collectives per layer dominated the `local` decode step.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{error, Communicator};
use crate::Result;

struct State {
    /// Rounds completed so far.
    round: u64,
    /// The collective the current round is (every rank must be in the same one).
    op: Option<&'static str>,
    arrived: Vec<Option<Vec<u8>>>,
    /// Every rank's contribution to round `round` (the last completed one).
    result: Arc<Vec<Vec<u8>>>,
    /// Why the group can no longer be used (a timeout, a rank that left).
    broken: Option<String>,
    /// Ranks that left the group, with their reason.
    gone: Vec<Option<String>>,
}

struct Group {
    state: Mutex<State>,
    cv: Condvar,
    /// Bumped (under the lock) at every change a waiter may be waiting for, beside each
    /// `notify_all`, so a spinning waiter sees it without the lock.
    changes: AtomicU64,
    timeout: Duration,
}

/// How long an early rank spins before it sleeps.
const SPIN: Duration = Duration::from_micros(500);

impl Group {
    fn notify(&self) {
        self.changes.fetch_add(1, Ordering::Release);
        self.cv.notify_all();
    }
}

/// Makes the ranks of a local group.
pub struct LocalGroup;

impl LocalGroup {
    /// `world` communicators, rank 0 first, whose collectives wait at most `timeout`.
    // The group is nothing but its ranks' ends: `LocalGroup` only names what makes them.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(world: usize, timeout: Duration) -> Vec<LocalComm> {
        let group = Arc::new(Group {
            state: Mutex::new(State {
                round: 0,
                op: None,
                arrived: vec![None; world],
                result: Arc::new(Vec::new()),
                broken: None,
                gone: vec![None; world],
            }),
            cv: Condvar::new(),
            changes: AtomicU64::new(0),
            timeout,
        });
        (0..world).map(|rank| LocalComm { rank, world, group: group.clone() }).collect()
    }
}

/// One rank of a local group. Dropping it leaves the group.
pub struct LocalComm {
    rank: usize,
    world: usize,
    group: Arc<Group>,
}

impl LocalComm {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves only plain data behind: keep using it.
        self.group.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn leave(&self, why: String) {
        let mut s = self.lock();
        if s.gone[self.rank].is_none() {
            s.gone[self.rank] = Some(why);
        }
        self.group.notify();
    }

    /// One round: deposits `mine`, returns every rank's contribution.
    fn exchange(&self, op: &'static str, mine: Vec<u8>) -> Result<Arc<Vec<Vec<u8>>>> {
        let (rank, g) = (self.rank, &*self.group);
        let mut s = self.lock();
        if let Some(b) = &s.broken {
            return Err(error(rank, op, format!("the group is broken: {b}; re-create the engine")));
        }
        match s.op {
            Some(other) if other != op => {
                let why = format!("rank {rank} called {op} while the others are in {other}");
                s.broken = Some(why.clone());
                g.notify();
                return Err(error(rank, op, why));
            }
            _ => s.op = Some(op),
        }
        s.arrived[rank] = Some(mine);
        let round = s.round;
        if s.arrived.iter().all(Option::is_some) {
            s.result = Arc::new(s.arrived.iter_mut().map(|a| a.take().unwrap_or_default()).collect());
            s.round += 1;
            s.op = None;
            g.notify();
            return Ok(s.result.clone());
        }
        let deadline = Instant::now() + g.timeout;
        let spin_until = Instant::now() + SPIN;
        loop {
            if s.round > round {
                return Ok(s.result.clone());
            }
            if let Some(b) = &s.broken {
                return Err(error(rank, op, format!("the group is broken: {b}; re-create the engine")));
            }
            let missing: Vec<usize> = (0..self.world).filter(|&r| s.arrived[r].is_none()).collect();
            if let Some((r, why)) = missing.iter().find_map(|&r| s.gone[r].as_ref().map(|w| (r, w.clone()))) {
                let why = format!("rank {r} left the group ({why})");
                s.broken = Some(why.clone());
                g.notify();
                return Err(error(rank, op, why));
            }
            let now = Instant::now();
            if now >= deadline {
                let names: Vec<String> = missing.iter().map(|r| format!("rank {r}")).collect();
                let why = format!("{} did not join {op} within {:?}", names.join(", "), g.timeout);
                s.broken = Some(why.clone());
                g.notify();
                return Err(error(rank, op, why));
            }
            if now < spin_until {
                let seen = g.changes.load(Ordering::Acquire);
                drop(s);
                while g.changes.load(Ordering::Acquire) == seen && Instant::now() < spin_until {
                    std::thread::yield_now();
                }
                s = self.lock();
                continue;
            }
            s = g.cv.wait_timeout(s, deadline - now).map(|(s, _)| s).unwrap_or_else(|p| p.into_inner().0);
        }
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        self.leave("its communicator was dropped".into());
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32_at(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}

impl Communicator for LocalComm {
    fn name(&self) -> &'static str {
        "local"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn timeout(&self) -> Duration {
        self.group.timeout
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        const OP: &str = "all_reduce";
        let all = self.exchange(OP, f32_bytes(buf))?;
        if let Some((r, _)) = all.iter().enumerate().find(|(_, b)| b.len() != 4 * buf.len()) {
            return Err(error(
                self.rank,
                OP,
                format!("rank {r} gave {} bytes, this rank {}", all[r].len(), 4 * buf.len()),
            ));
        }
        for (i, x) in buf.iter_mut().enumerate() {
            *x = all.iter().fold(0.0f32, |acc, b| acc + f32_at(b, i));
        }
        Ok(())
    }

    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<()> {
        const OP: &str = "all_gather";
        if out.len() != local.len() * self.world {
            return Err(error(
                self.rank,
                OP,
                format!("an output of {} values for {} ranks of {}", out.len(), self.world, local.len()),
            ));
        }
        let all = self.exchange(OP, f32_bytes(local))?;
        for (r, b) in all.iter().enumerate() {
            if b.len() != 4 * local.len() {
                return Err(error(
                    self.rank,
                    OP,
                    format!("rank {r} gave {} bytes, this rank {}", b.len(), 4 * local.len()),
                ));
            }
            for (i, o) in out[r * local.len()..(r + 1) * local.len()].iter_mut().enumerate() {
                *o = f32_at(b, i);
            }
        }
        Ok(())
    }

    fn broadcast(&self, root: usize, bytes: &mut Vec<u8>) -> Result<()> {
        const OP: &str = "broadcast";
        if root >= self.world {
            return Err(error(self.rank, OP, format!("root {root} is not a rank of a group of {}", self.world)));
        }
        let mine = if self.rank == root { std::mem::take(bytes) } else { Vec::new() };
        let all = self.exchange(OP, mine)?;
        bytes.clear();
        bytes.extend_from_slice(&all[root]);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.exchange("barrier", Vec::new()).map(drop)
    }

    fn abandon(&self, why: &str) {
        self.leave(why.to_string());
    }
    fn departed(&self) -> Option<(usize, String)> {
        let s = self.lock();
        s.gone.iter().enumerate().find_map(|(r, why)| why.as_ref().filter(|_| r != self.rank).map(|w| (r, w.clone())))
    }
}
