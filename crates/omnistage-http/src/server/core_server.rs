//! The per-core server state ([`CoreServer`]): the connection table (slots with generations),
//! this core's listeners, view of the live configuration, date cache, access-log buffer and
//! reused buffers. It lives in a thread-local: each worker runs the handlers of its own core
//! only, and handlers never call each other (they send messages), so a `RefCell` borrow is
//! never held across another.

use super::conn::Conn;
use super::deadlines::Deadlines;
use super::file_cache::CachedFile;
use super::send_sched::SendSched;
use super::shared::ServerShared;
use super::tenants::Live;
use super::work::ServeScratch;
use super::Stages;
use crate::request::Limits;
use crate::response::DateCache;
use omnistage::account::ActivityId;
use omnistage::exec::{Ctx, IoHandle};
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::SystemTime;

/// Access log bytes buffered per core before a write.
pub(super) const LOG_BUFFER_BYTES: usize = 32 * 1024;
/// How often each core flushes its access log buffer.
pub(super) const LOG_FLUSH_INTERVAL_NS: u64 = 1_000_000_000;

/// Longest `Date` value kept by [`DateText`] (an IMF-fixdate is 29 bytes).
const DATE_TEXT_BYTES_MAX: usize = 32;

/// A copy of the current `Date` value on the stack, so that a response can be written while
/// the core is borrowed (no `String` per response).
#[derive(Clone, Copy)]
pub(super) struct DateText {
    pub(super) bytes: [u8; DATE_TEXT_BYTES_MAX],
    pub(super) len: usize,
}

impl DateText {
    /// Copies `s`, cut at [`DATE_TEXT_BYTES_MAX`] bytes (on a char boundary).
    pub(super) fn new(s: &str) -> Self {
        let mut len = s.len().min(DATE_TEXT_BYTES_MAX);
        while !s.is_char_boundary(len) {
            len -= 1;
        }
        let mut bytes = [0u8; DATE_TEXT_BYTES_MAX];
        bytes[..len].copy_from_slice(&s.as_bytes()[..len]);
        DateText { bytes, len }
    }
}

impl std::ops::Deref for DateText {
    type Target = str;

    fn deref(&self) -> &str {
        // A prefix of a `str` cut on a char boundary.
        std::str::from_utf8(&self.bytes[..self.len]).unwrap_or_default()
    }
}

pub(super) struct CoreServer {
    pub(super) shared: Arc<ServerShared>,
    pub(super) stages: Stages,
    pub(super) live: Arc<Live>,
    pub(super) live_version: u64,
    /// The `ServerShared::send_version` the send scheduler's weights follow.
    pub(super) send_version: u64,
    pub(super) conns: Vec<Option<Conn>>,
    pub(super) free: Vec<u32>,
    pub(super) generations: Vec<u32>,
    /// This core's listeners: socket, poller handle, the address as configured, whether TLS.
    pub(super) listeners: Vec<(mio::net::TcpListener, IoHandle, SocketAddr, bool)>,
    pub(super) date: DateCache,
    pub(super) log: Vec<u8>,
    pub(super) limits: Limits,
    /// (tenant activity, decoded path) → open file; bounded by `FILE_CACHE_ENTRIES_MAX` (the
    /// tenant holding the most gives back its oldest), swept every second (idle entries,
    /// deleted files), emptied when the configuration changes (a docroot may have moved).
    pub(super) files: HashMap<(ActivityId, String), CachedFile>,
    /// Reused by every request served here: its file-cache key and decoding buffer.
    pub(super) serve_scratch: ServeScratch,
    /// This core's upstreams and its connections to them.
    pub(super) proxy: super::upstream_pool::ProxyCore,
    /// The send scheduler, when caps are configured; otherwise connections write directly.
    pub(super) send: Option<SendSched>,
    /// Bytes of file content cached on this core, and per activity.
    pub(super) cache_used: usize,
    pub(super) cache_by_activity: HashMap<ActivityId, usize>,
    pub(super) workers: usize,
    /// Every connection's pending deadlines, served by one runtime timer.
    pub(super) deadlines: Deadlines,
    /// Reused read buffer: sockets are read here and only the bytes received are appended to
    /// the connection's buffer (no zeroing of a fresh buffer per read).
    pub(super) scratch: Box<[u8]>,
    /// Connections accepted here that no tenant has claimed yet (no request naming a served
    /// Host: a TLS handshake, a head still arriving), by key, oldest first. At the server's
    /// `connections_max` the oldest of them is closed to make room for a new connection
    /// ([`CoreServer::oldest_unclaimed`]), so clients that hold connections without ever
    /// completing a request (slowloris) cannot lock everyone out until the header timeout.
    /// Entries of connections since claimed or closed are stale: dropped where they are met,
    /// and compacted away once they could outnumber this core's connections
    /// ([`CoreServer::note_unclaimed`]), so the list stays within about twice those.
    pub(super) unclaimed: VecDeque<u64>,
    /// The periodic log flush (which also retries a refused sweep) has a timer pending. A
    /// refused re-arm (the core's timer table full) is retried at the next sweep's arming
    /// ([`super::timer::arm_log_flush`]) instead of stopping the flushes for good.
    pub(super) log_flush_armed: bool,
    /// When this core began to drain (`Boot::Drain`, on the worker's clock); 0: not draining.
    pub(super) draining_since_ns: u64,
}

impl Drop for CoreServer {
    /// The worker stops (the runtime's shutdown, after a drain or a drop): the access log
    /// lines logged since the last flush are written out, not lost with the buffer.
    fn drop(&mut self) {
        self.flush_log();
    }
}

/// Entries [`CoreServer::unclaimed`] may hold beyond twice this core's connections before it
/// is compacted (so a core with few connections does not compact on every accept).
const UNCLAIMED_SLACK: usize = 64;

/// Whether `key` names a live connection no tenant has claimed (the test of the compaction
/// and of [`CoreServer::oldest_unclaimed`]; a free function so the compaction can call it while
/// it holds the list).
fn is_unclaimed(conns: &[Option<Conn>], key: u64) -> bool {
    let slot = (key & 0xFFFF_FFFF) as usize;
    let generation = (key >> 32) as u32;
    matches!(conns.get(slot), Some(Some(c)) if c.generation == generation && c.tenant.is_none())
}

thread_local! {
    pub(super) static CORE: RefCell<Option<CoreServer>> = const { RefCell::new(None) };
}

pub(super) fn with_core<R>(f: impl FnOnce(&mut CoreServer) -> R) -> Option<R> {
    CORE.with(|c| c.borrow_mut().as_mut().map(f))
}

pub(super) fn key_of(slot: u32, generation: u32) -> u64 {
    u64::from(generation) << 32 | u64::from(slot)
}

impl CoreServer {
    /// Picks up a reload: the new config and tenants, and an empty file cache (a docroot may
    /// have changed); idle connections to upstream servers no longer listed are closed. The
    /// send scheduler's buckets are reconfigured at the worker's clock (`Ctx::now_ns`).
    pub(super) fn refresh(&mut self, ctx: &mut Ctx<'_>) {
        let v = self.shared.live_version.load(Ordering::Acquire);
        if v != self.live_version {
            let now_ns = ctx.now_ns();
            // Clear under the old tenants, so each one's count goes back down.
            self.cache_clear();
            self.live = self.shared.live.read().expect("live lock").clone();
            self.live_version = v;
            for up in self.proxy.configure(&self.live.config, self.workers) {
                super::proxy::close_upstream(ctx, self, up);
            }
            SendSched::follow_reload(&mut self.send, &self.live, now_ns);
        }
        let sv = self.shared.send_version.load(Ordering::Acquire);
        if sv != self.send_version {
            self.send_version = sv;
            if let Some(ss) = &mut self.send {
                ss.reweight(&self.live);
            }
        }
    }

    pub(super) fn conn(&mut self, key: u64) -> Option<&mut Conn> {
        let slot = (key & 0xFFFF_FFFF) as usize;
        let generation = (key >> 32) as u32;
        match self.conns.get_mut(slot) {
            Some(Some(c)) if c.generation == generation => Some(c),
            _ => None,
        }
    }

    /// Reserves a connection slot; returns (slot, generation). Fill it or `release` it.
    pub(super) fn reserve(&mut self) -> (u32, u32) {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                self.conns.push(None);
                self.generations.push(0);
                (self.conns.len() - 1) as u32
            }
        };
        let generation = self.generations[slot as usize].wrapping_add(1);
        self.generations[slot as usize] = generation;
        (slot, generation)
    }

    /// Records a connection just accepted (no tenant yet) as the newest unclaimed one.
    /// Amortized O(1) and, once the list has grown to its bound, allocation-free: a compaction
    /// (at most twice this core's connections plus [`UNCLAIMED_SLACK`] entries, in place) comes
    /// only after at least as many accepts as it leaves entries, or after connections closed
    /// (the bound shrinks with them; its capacity is kept).
    pub(super) fn note_unclaimed(&mut self, key: u64) {
        let open_here = self.conns.len() - self.free.len();
        if self.unclaimed.len() >= 2 * open_here + UNCLAIMED_SLACK {
            let conns = &self.conns;
            self.unclaimed.retain(|&k| is_unclaimed(conns, k));
        }
        self.unclaimed.push_back(key);
        debug_assert!(self.unclaimed.len() <= 2 * open_here + UNCLAIMED_SLACK + 1);
    }

    /// Takes the oldest connection that no tenant has claimed: its key, for the caller to
    /// close. Such a connection has no work anywhere (a dispatched request, a body, a disk
    /// read, a send-scheduler entry or a proxied request all come with a tenant); at most an
    /// answer given without one (a 421 or a 400) is still being written, and closing it cuts
    /// that answer short. Stale entries met on the way are dropped. Bounded by the list's
    /// length.
    pub(super) fn oldest_unclaimed(&mut self) -> Option<u64> {
        while let Some(key) = self.unclaimed.pop_front() {
            if is_unclaimed(&self.conns, key) {
                return Some(key);
            }
        }
        None
    }

    pub(super) fn release(&mut self, slot: u32) {
        self.conns[slot as usize] = None;
        self.free.push(slot);
    }

    pub(super) fn date(&mut self) -> DateText {
        DateText::new(self.date.get(SystemTime::now()))
    }

    /// Whether access-log lines are written (as the core's view of the config says).
    pub(super) fn logging(&self) -> bool {
        !matches!(
            self.live.config.server.access_log,
            crate::config::AccessLog::Off
        )
    }

    pub(super) fn flush_log(&mut self) {
        if self.log.is_empty() {
            return;
        }
        if let Ok(mut w) = self.shared.log.lock() {
            if let Some(w) = w.as_mut() {
                let _ = w.write_all(&self.log);
            }
        }
        self.log.clear();
    }
}
