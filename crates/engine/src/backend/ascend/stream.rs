//! The backend's one stream, beyond launching: events, asynchronous reads through page-locked
//! host memory, and the per-op device-time profile.
//!
//! Profile (`TBOOST_PROFILE=1`): every op is bracketed by two events on the stream and, after each
//! synchronize, `aclrtEventElapsedTime` gives its device time. A runtime without that function
//! gets host timing instead: the stream is synchronized after every op and the wall time of
//! launch + synchronize is counted (slower, and says so in the report). On the CANN SIMULATOR the
//! "device time" is the host time the simulator spent running the op.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use ascend_sys::{Context, Device, DeviceBuffer, Event, HostBuffer};

use super::{acl_err, be_err};
use crate::backend::{EventId, PendingRead};
use crate::Result;

/// What `op_started` hands to `op_finished`.
pub(super) enum OpTimer {
    Off,
    Events(Event),
    Host(Instant),
}

struct Profile {
    /// aclrtEventElapsedTime is exported (else: host timing with a synchronize per op).
    events: bool,
    pending: Vec<(&'static str, Event, Event)>,
    totals: BTreeMap<&'static str, (u64, f64)>,
}

struct Pending {
    host: HostBuffer,
    bytes: usize,
    done: Event,
}

#[derive(Default)]
pub(super) struct StreamState {
    profile: Option<Profile>,
    events: HashMap<u64, Event>,
    free_events: Vec<Event>,
    next_event: u64,
    reads: HashMap<u64, Pending>,
    free_hosts: Vec<HostBuffer>,
    next_read: u64,
}

impl StreamState {
    pub fn new(profile: bool) -> StreamState {
        StreamState {
            profile: profile.then(|| Profile { events: true, pending: Vec::new(), totals: BTreeMap::new() }),
            ..Default::default()
        }
    }

    fn event(&mut self, dev: &Device) -> Result<Event> {
        match self.free_events.pop() {
            Some(e) => Ok(e),
            None => dev.create_event().map_err(|e| acl_err("aclrtCreateEvent", e)),
        }
    }

    pub fn op_started(&mut self, dev: &Device, ctx: &Context) -> Result<OpTimer> {
        let Some(p) = &self.profile else { return Ok(OpTimer::Off) };
        if !p.events || !ctx.cann().has_event_timing() {
            if let Some(p) = self.profile.as_mut() {
                p.events = false;
            }
            return Ok(OpTimer::Host(Instant::now()));
        }
        let e = self.event(dev)?;
        e.record(ctx.stream()).map_err(|e| acl_err("profile: aclrtRecordEvent", e))?;
        Ok(OpTimer::Events(e))
    }

    pub fn op_finished(&mut self, t: OpTimer, name: &'static str, dev: &Device, ctx: &mut Context) -> Result<()> {
        match t {
            OpTimer::Off => Ok(()),
            OpTimer::Events(start) => {
                let end = self.event(dev)?;
                end.record(ctx.stream()).map_err(|e| acl_err("profile: aclrtRecordEvent", e))?;
                if let Some(p) = self.profile.as_mut() {
                    p.pending.push((name, start, end));
                }
                Ok(())
            }
            OpTimer::Host(t0) => {
                let r = ctx.synchronize().map_err(|e| acl_err("synchronize (profile)", e));
                if let Some(p) = self.profile.as_mut() {
                    let e = p.totals.entry(name).or_default();
                    e.0 += 1;
                    e.1 += t0.elapsed().as_secs_f64();
                }
                r
            }
        }
    }

    pub fn op_abandoned(&mut self, t: OpTimer) {
        if let OpTimer::Events(e) = t {
            self.free_events.push(e);
        }
    }

    /// After a synchronize: the bracketed ops' times (when it succeeded), events back to the pool.
    pub fn synchronized(&mut self, ok: bool) {
        let Some(p) = self.profile.as_mut() else { return };
        for (name, start, end) in p.pending.drain(..) {
            if ok {
                match end.elapsed_ms_since(&start) {
                    Ok(ms) => {
                        let e = p.totals.entry(name).or_default();
                        e.0 += 1;
                        e.1 += ms as f64 / 1e3;
                    }
                    Err(e) => log::debug!("ascend profile: aclrtEventElapsedTime: {e}"),
                }
            }
            self.free_events.push(start);
            self.free_events.push(end);
        }
    }

    pub fn print_profile(&self, device: &str) {
        let Some(p) = &self.profile else { return };
        let total: f64 = p.totals.values().map(|v| v.1).sum();
        let how = if p.events {
            "device time from aclrtEventElapsedTime"
        } else {
            "host time of launch + synchronize per op (aclrtEventElapsedTime is not exported)"
        };
        eprintln!("tboost profile (ascend backend, {device}; {how}): {total:.3} s in ops");
        let mut rows: Vec<_> = p.totals.iter().collect();
        rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        for (name, (n, secs)) in rows {
            eprintln!("  {name:<24} {n:>8} calls {:>10.3} ms {:>5.1}%", secs * 1e3, 100.0 * secs / total.max(1e-12));
        }
    }

    // ------------------------------------------------------------------ events

    pub fn record_event(&mut self, dev: &Device, ctx: &Context) -> Result<EventId> {
        let e = self.event(dev)?;
        e.record(ctx.stream()).map_err(|e| acl_err("aclrtRecordEvent", e))?;
        self.next_event += 1;
        self.events.insert(self.next_event, e);
        Ok(EventId(self.next_event))
    }

    pub fn wait_event(&mut self, id: EventId) -> Result<()> {
        // An event waited for before (or never recorded here) is in the past: nothing to wait for.
        let Some(e) = self.events.remove(&id.0) else { return Ok(()) };
        let r = e.synchronize().map_err(|e| acl_err("wait_event", e));
        self.free_events.push(e);
        r
    }

    // ------------------------------------------------------------------ reads

    pub fn read_async(
        &mut self,
        dev: &Device,
        ctx: &Context,
        src: &DeviceBuffer,
        at: usize,
        bytes: usize,
    ) -> Result<PendingRead> {
        let host = match self.free_hosts.iter().position(|h| h.len() >= bytes.max(1)) {
            Some(i) => self.free_hosts.swap_remove(i),
            None => dev
                .alloc_host(bytes.max(64).next_power_of_two())
                .map_err(|e| acl_err("read_async: aclrtMallocHost", e))?,
        };
        // SAFETY: `host` stays in `reads` (untouched) until finish_read waited for the event recorded
        // after the copy; `src` is an orchestrator buffer, freed only after a synchronize.
        if let Err(e) = unsafe { ctx.stream().copy_to_host_async(src, at, &host, 0, bytes) } {
            self.free_hosts.push(host);
            return Err(acl_err("read_async", e));
        }
        let done = self.event(dev)?;
        done.record(ctx.stream()).map_err(|e| acl_err("read_async: aclrtRecordEvent", e))?;
        self.next_read += 1;
        self.reads.insert(self.next_read, Pending { host, bytes, done });
        Ok(PendingRead { id: self.next_read, bytes })
    }

    pub fn finish_read(&mut self, read: PendingRead, dst: &mut [u8]) -> Result<()> {
        let p = self
            .reads
            .remove(&read.id)
            .ok_or_else(|| be_err(format!("read {} was never enqueued or already taken", read.id)))?;
        let r = p.done.synchronize().map_err(|e| acl_err("finish_read", e));
        let out = match r {
            Ok(()) if dst.len() == p.bytes => {
                dst.copy_from_slice(&p.host.as_slice()[..p.bytes]);
                Ok(())
            }
            Ok(()) => Err(be_err(format!("finish_read of {} bytes into {} bytes", p.bytes, dst.len()))),
            Err(e) => Err(e),
        };
        self.free_hosts.push(p.host);
        self.free_events.push(p.done);
        out
    }
}
