//! An engine shared by threads: one thread steps, any thread reads or waits for the events
//! the steps produce.
//!
//! [`Engine::step`] returns its events to the caller; a host that steps on one thread and
//! serves each request on another wants them queued instead. [`EventEngine`] wraps an
//! engine with that queue: `step` appends every event, `read` takes them (of one request or
//! of all) oldest first, and `wait` blocks until one is ready or a timeout passes. The C
//! ABI's `tboost_engine` is this type plus the conversion to `tboost_event`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{Engine, Event};
use crate::sched::RequestId;
use crate::{Error, Result};

/// A queued event and the position of its token in the request's output (on an event
/// without a token: the number of tokens the request produced).
#[derive(Clone, Debug, PartialEq)]
pub struct QueuedEvent {
    pub event: Event,
    pub index: u32,
}

/// Events produced by steps and not yet read, in production order.
#[derive(Default)]
struct Queue {
    events: VecDeque<QueuedEvent>,
    /// Tokens delivered so far per unfinished request (for `QueuedEvent::index`).
    produced: HashMap<RequestId, u32>,
    /// Requests whose finish event was queued (the newest `ended_kept`), so that `wait` on
    /// one whose events were all read returns at once instead of at its timeout.
    ended: HashSet<RequestId>,
    ended_order: VecDeque<RequestId>,
}

impl Queue {
    fn count(&self, id: Option<RequestId>) -> usize {
        match id {
            None => self.events.len(),
            Some(id) => self.events.iter().filter(|e| e.event.id == id).count(),
        }
    }
}

/// Testing only: faults a step injects inside the stepping guard, so that a concurrent step
/// sees `Busy` and a panic poisons the engine as a real one would.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepFaults {
    /// The n-th step panics (0 = never).
    pub panic_at_step: u64,
    /// Every step first holds the engine this long.
    pub step_delay: Duration,
}

/// An [`Engine`] plus the queue of the events its steps produced. `step` runs on one thread
/// at a time (a concurrent call is `Error::Busy`); every other method may be called from
/// any thread, also while a step runs.
pub struct EventEngine {
    engine: Engine,
    queue: Mutex<Queue>,
    ready: Condvar,
    /// Ended requests remembered for `wait`: as many as the engine keeps records of.
    ended_kept: usize,
    /// Set by `poison`: waiters return `Error::Poisoned`.
    poisoned: AtomicBool,
    /// Set by `close`: waiters return `Error::Interrupted`.
    closed: AtomicBool,
    steps: std::sync::atomic::AtomicU64,
    faults: StepFaults,
}

impl EventEngine {
    pub fn new(engine: Engine) -> EventEngine {
        let ended_kept = engine.config().finished_records.max(1);
        EventEngine {
            engine,
            queue: Mutex::new(Queue::default()),
            ready: Condvar::new(),
            ended_kept,
            poisoned: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            steps: Default::default(),
            faults: StepFaults::default(),
        }
    }

    /// Testing only: this engine's steps inject `faults`.
    #[doc(hidden)]
    pub fn with_step_faults(mut self, faults: StepFaults) -> EventEngine {
        self.faults = faults;
        self
    }

    /// The engine (enqueue, cancel, output, stats, tokenizer: all safe from any thread).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    fn queue(&self) -> MutexGuard<'_, Queue> {
        // Queue operations cannot panic halfway; a poisoned lock still holds a valid queue.
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One continuous-batching iteration ([`Engine::step`]); its events go to the queue and
    /// wake the waiters. Returns how many events it queued.
    pub fn step(&self) -> Result<usize> {
        let faults = self.faults;
        let out = self.engine.step_with(|| {
            let n = self.steps.fetch_add(1, Ordering::SeqCst) + 1;
            if n == faults.panic_at_step {
                panic!("test.panic_at_step: step {n} panics on purpose");
            }
            if !faults.step_delay.is_zero() {
                std::thread::sleep(faults.step_delay);
            }
        })?;
        Ok(self.push(out.events))
    }

    fn push(&self, events: Vec<Event>) -> usize {
        let n = events.len();
        if n == 0 {
            return 0;
        }
        let mut q = self.queue();
        for e in events {
            let count = q.produced.entry(e.id).or_insert(0);
            let index = *count;
            if e.token.is_some() {
                *count += 1;
            }
            if e.finish.is_some() {
                q.produced.remove(&e.id);
                q.ended.insert(e.id);
                q.ended_order.push_back(e.id);
                while q.ended_order.len() > self.ended_kept {
                    if let Some(old) = q.ended_order.pop_front() {
                        q.ended.remove(&old);
                    }
                }
            }
            q.events.push_back(QueuedEvent { event: e, index });
        }
        self.ready.notify_all();
        n
    }

    /// `NotFound` for an id the engine never issued (or whose record it has forgotten),
    /// asked only when the queue holds nothing of it.
    fn check_known(&self, q: &Queue, id: Option<RequestId>) -> Result<()> {
        match id {
            Some(id) if q.count(Some(id)) == 0 => self.engine.output(id).map(|_| ()),
            _ => Ok(()),
        }
    }

    /// Events ready to read: of request `id`, or of every request for `None`.
    pub fn ready(&self, id: Option<RequestId>) -> Result<usize> {
        let q = self.queue();
        self.check_known(&q, id)?;
        Ok(q.count(id))
    }

    /// Every queued event, of every request.
    pub fn pending(&self) -> usize {
        self.queue().events.len()
    }

    /// Takes up to `max` events of request `id` (or of every request for `None`), oldest
    /// first. Each event is read once. `NotFound` for an id the engine never issued.
    pub fn read(&self, id: Option<RequestId>, max: usize) -> Result<Vec<QueuedEvent>> {
        let mut q = self.queue();
        self.check_known(&q, id)?;
        let mut taken = Vec::new();
        match id {
            None => {
                let n = max.min(q.events.len());
                taken.extend(q.events.drain(..n));
            }
            Some(id) => {
                let mut rest = VecDeque::with_capacity(q.events.len());
                for e in q.events.drain(..) {
                    if e.event.id == id && taken.len() < max {
                        taken.push(e);
                    } else {
                        rest.push_back(e);
                    }
                }
                q.events = rest;
            }
        }
        Ok(taken)
    }

    /// Blocks until at least one event of request `id` (or of any request, for `None`) is
    /// ready, or `timeout` passes; returns the number ready (0: the timeout passed). Another
    /// thread must be stepping for events to come.
    ///
    /// `NotFound` at once for an id never issued, or for a request that has ended and whose
    /// events were all read (nothing more will come); `Interrupted` when the engine is
    /// closed meanwhile, `Poisoned` when it is poisoned.
    pub fn wait(&self, id: Option<RequestId>, timeout: Duration) -> Result<usize> {
        let deadline = Instant::now() + timeout;
        let mut q = self.queue();
        self.check_known(&q, id)?;
        if let Some(id) = id {
            if q.count(Some(id)) == 0 && q.ended.contains(&id) {
                return Err(Error::NotFound(format!(
                    "request {id} has ended and all its events were read: nothing more will come"
                )));
            }
        }
        loop {
            if self.closed.load(Ordering::SeqCst) {
                return Err(Error::Interrupted);
            }
            if self.poisoned.load(Ordering::SeqCst) {
                return Err(Error::Poisoned);
            }
            let n = q.count(id);
            let now = Instant::now();
            if n > 0 || now >= deadline {
                return Ok(n);
            }
            q = self.ready.wait_timeout(q, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Marks the engine unusable (after a panic in a call on it) and wakes the waiters.
    pub fn poison(&self) {
        self.poisoned.store(true, Ordering::SeqCst);
        let _q = self.queue();
        self.ready.notify_all();
    }

    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::SeqCst)
    }

    /// For a host tearing the engine down: a running step stops at its next op, and threads
    /// blocked in `wait` return `Interrupted`.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.engine.interrupt();
        let _q = self.queue();
        self.ready.notify_all();
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }
}
