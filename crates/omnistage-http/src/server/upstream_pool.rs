//! A core's view of the upstreams ([`ProxyCore`]): per upstream its share of the concurrency
//! slots ([`FairSlots`]), its servers' health (in flight, failures and back-off), the idle
//! keep-alive connections kept for reuse, and the table of this core's upstream connections.
//! Also the per-(upstream, tenant) counters shared by all cores ([`UpstreamCounters`]), read by
//! the admin API and `/metrics`.
//!
//! `concurrency_max` is split evenly between the workers (at least one slot each), as CPU caps
//! are: each core shares its part fairly between the tenants whose connections it serves.

use crate::config::{Config, UpstreamConfig};
use crate::fair_slots::FairSlots;
use omnistage::account::ActivityId;
use omnistage::exec::IoHandle;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Back-off of a server after its first failure; doubled per failure up to the maximum.
const BACKOFF_MIN_NS: u64 = 1_000_000_000;
/// Longest back-off of a failing server.
const BACKOFF_MAX_NS: u64 = 30_000_000_000;

/// Counters of one tenant on one upstream, all cores together.
#[derive(Debug, Default)]
pub(super) struct UpstreamCounters {
    pub(super) in_flight: AtomicI64,
    pub(super) queued: AtomicI64,
    pub(super) refused: AtomicU64,
    pub(super) requests: AtomicU64,
    pub(super) slot_ns: AtomicU64,
    pub(super) bytes_to_backend: AtomicU64,
    pub(super) bytes_from_backend: AtomicU64,
    pub(super) errors_502: AtomicU64,
    pub(super) errors_504: AtomicU64,
}

/// A snapshot of [`UpstreamCounters`] (see `Server::upstream_stats`).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct UpstreamTenantStats {
    pub upstream: String,
    pub tenant: String,
    /// Requests holding a slot now.
    pub in_flight: u64,
    /// Requests waiting for a slot now.
    pub queued: u64,
    /// Requests refused (503) for a full or too slow queue.
    pub refused: u64,
    /// Requests that got a slot.
    pub requests: u64,
    /// Slot-time held, ns.
    pub slot_ns: u64,
    pub bytes_to_backend: u64,
    pub bytes_from_backend: u64,
    /// Answered 502 (unreachable, invalid response) and 504 (no head in time).
    pub errors_502: u64,
    pub errors_504: u64,
}

/// (upstream, tenant) → counters, shared by the cores (each caches its `Arc`s; the lock is
/// taken once per pair per core).
pub(super) type CounterTable = Mutex<HashMap<(String, String), Arc<UpstreamCounters>>>;

pub(super) fn snapshot(table: &CounterTable) -> Vec<UpstreamTenantStats> {
    let t = table.lock().expect("upstream counters lock");
    let mut rows: Vec<UpstreamTenantStats> = t
        .iter()
        .map(|((u, n), c)| UpstreamTenantStats {
            upstream: u.clone(),
            tenant: n.clone(),
            in_flight: c.in_flight.load(Ordering::Relaxed).max(0) as u64,
            queued: c.queued.load(Ordering::Relaxed).max(0) as u64,
            refused: c.refused.load(Ordering::Relaxed),
            requests: c.requests.load(Ordering::Relaxed),
            slot_ns: c.slot_ns.load(Ordering::Relaxed),
            bytes_to_backend: c.bytes_to_backend.load(Ordering::Relaxed),
            bytes_from_backend: c.bytes_from_backend.load(Ordering::Relaxed),
            errors_502: c.errors_502.load(Ordering::Relaxed),
            errors_504: c.errors_504.load(Ordering::Relaxed),
        })
        .collect();
    rows.sort_by(|a, b| (&a.upstream, &a.tenant).cmp(&(&b.upstream, &b.tenant)));
    rows
}

/// One backend server as this core sees it.
#[derive(Clone, Copy)]
pub(super) struct ServerState {
    pub(super) addr: SocketAddr,
    pub(super) in_flight: usize,
    /// Skipped until then (a back-off after a failure).
    pub(super) fail_until_ns: u64,
    pub(super) backoff_ns: u64,
}

/// One upstream on this core.
pub(super) struct UpstreamCore {
    pub(super) config: UpstreamConfig,
    pub(super) slots: FairSlots<u64>,
    pub(super) servers: Vec<ServerState>,
    /// Idle keep-alive connections (keys into [`ProxyCore::conns`]), newest last.
    pub(super) idle: Vec<u64>,
    /// Where the least-in-flight choice starts looking (rotates, so ties spread).
    pub(super) next: usize,
    pub(super) counters: HashMap<ActivityId, Arc<UpstreamCounters>>,
}

impl UpstreamCore {
    fn new(config: &UpstreamConfig, workers: usize) -> UpstreamCore {
        UpstreamCore {
            slots: FairSlots::new(slots_per_core(config, workers), config.fair),
            servers: config
                .servers
                .iter()
                .map(|&addr| ServerState {
                    addr,
                    in_flight: 0,
                    fail_until_ns: 0,
                    backoff_ns: 0,
                })
                .collect(),
            idle: Vec::new(),
            next: 0,
            counters: HashMap::new(),
            config: config.clone(),
        }
    }

    /// The server to send to: the fewest requests in flight among those not backing off;
    /// `None` if every server is backing off (the request is answered 502 at once).
    pub(super) fn choose(&mut self, now_ns: u64) -> Option<usize> {
        let n = self.servers.len();
        let start = self.next % n.max(1);
        let best = (0..n)
            .map(|i| (start + i) % n)
            .filter(|&i| self.servers[i].fail_until_ns <= now_ns)
            .min_by_key(|&i| self.servers[i].in_flight)?;
        self.next = best + 1;
        Some(best)
    }

    /// The server at `addr`, if the upstream still lists it. Requests and connections name
    /// their server by address, not by its index: a reload may change the list under them
    /// (an index then named another server, or none).
    pub(super) fn server_mut(&mut self, addr: Option<SocketAddr>) -> Option<&mut ServerState> {
        let addr = addr?;
        self.servers.iter_mut().find(|s| s.addr == addr)
    }

    /// A server refused or timed out a connect: skip it for a back-off, doubled from the last
    /// one. Failures while it is already backing off (the other connects that were out at
    /// once) do not double it again: a burst of requests to a server that just went down is
    /// one failure, not a 30 s one.
    pub(super) fn failed(&mut self, server: Option<SocketAddr>, now_ns: u64) {
        if let Some(s) = self.server_mut(server) {
            if now_ns < s.fail_until_ns {
                return;
            }
            s.backoff_ns = (s.backoff_ns * 2).clamp(BACKOFF_MIN_NS, BACKOFF_MAX_NS);
            s.fail_until_ns = now_ns + s.backoff_ns;
        }
    }

    /// A server answered: its back-off starts over.
    pub(super) fn succeeded(&mut self, server: Option<SocketAddr>) {
        if let Some(s) = self.server_mut(server) {
            s.backoff_ns = 0;
            s.fail_until_ns = 0;
        }
    }

    /// The counters of `tenant` here, from the shared table on first use.
    pub(super) fn counters(
        &mut self,
        table: &CounterTable,
        tenant: ActivityId,
        tenant_name: &str,
    ) -> Arc<UpstreamCounters> {
        self.counters
            .entry(tenant)
            .or_insert_with(|| {
                table
                    .lock()
                    .expect("upstream counters lock")
                    .entry((self.config.name.clone(), tenant_name.to_string()))
                    .or_default()
                    .clone()
            })
            .clone()
    }
}

fn slots_per_core(config: &UpstreamConfig, workers: usize) -> usize {
    (config.concurrency_max / workers.max(1)).max(1)
}

/// Where an upstream connection is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum UpState {
    /// Connecting (non-blocking); writable readiness says how it went.
    Connecting,
    /// Carrying the request of `client`.
    Busy,
    /// Kept for reuse, in its upstream's idle list.
    Idle,
}

/// One connection to a backend server.
pub(super) struct UpConn {
    pub(super) stream: mio::net::TcpStream,
    /// The server's address (its index may change with a reload).
    pub(super) addr: SocketAddr,
    pub(super) handle: IoHandle,
    pub(super) generation: u32,
    pub(super) upstream: usize,
    pub(super) state: UpState,
    /// The client connection whose request it carries.
    pub(super) client: u64,
    /// It carried a request before (a failure before any response byte may be its idle close
    /// racing our request: the request is retried once on a new connection).
    pub(super) reused: bool,
    /// Bytes of the response read and not yet forwarded.
    pub(super) inbuf: Vec<u8>,
    /// Bytes of the request not yet written (from `out_pos`).
    pub(super) out: Vec<u8>,
    pub(super) out_pos: usize,
    /// The socket may hold response bytes: a readiness edge came since a read last found it
    /// empty (WouldBlock, or a short read: under edge-triggered readiness new bytes make a new
    /// edge). Without it the proxy's pump would try a read after every request it sends and
    /// meet WouldBlock: one wasted syscall per proxied request.
    pub(super) readable: bool,
}

/// This core's upstreams and upstream connections.
#[derive(Default)]
pub(super) struct ProxyCore {
    pub(super) upstreams: Vec<UpstreamCore>,
    /// The configuration's upstream `i` is `upstreams[by_config[i]]`.
    pub(super) by_config: Vec<usize>,
    pub(super) conns: Vec<Option<UpConn>>,
    pub(super) free: Vec<u32>,
    pub(super) generations: Vec<u32>,
    /// Boxes of finished proxied requests, reused by the next ones (at most
    /// [`SPARE_PROXIED_MAX`]): no allocation per proxied request. Boxed because the
    /// connection holds its request boxed (most connections have none).
    #[allow(clippy::vec_box)]
    pub(super) spare: Vec<Box<super::proxy::Proxied>>,
}

/// Most finished requests' boxes kept for reuse per worker.
pub(super) const SPARE_PROXIED_MAX: usize = 64;

impl ProxyCore {
    pub(super) fn new(config: &Config, workers: usize) -> ProxyCore {
        let mut p = ProxyCore::default();
        // A new core has no connection to close.
        let _ = p.configure(config, workers);
        p
    }

    /// After a reload: upstreams keep their state by name (slots, queues, connections); a
    /// server still listed keeps its state (requests in flight, back-off), a new one starts
    /// afresh; new upstreams are added. The list only grows (an upstream the reload removed
    /// stays, unused, so the index a request holds stays valid); `by_config` maps the
    /// configuration's upstreams to it.
    ///
    /// Returns the idle connections to servers no longer listed (and all of a removed
    /// upstream's), for the caller to close: kept, they were never reused and filled
    /// `idle_connections_max`, so that no connection to the new servers could be kept.
    pub(super) fn configure(&mut self, config: &Config, workers: usize) -> Vec<u64> {
        self.by_config.clear();
        for u in &config.upstreams {
            let i = match self.upstreams.iter().position(|o| o.config.name == u.name) {
                Some(i) => {
                    let p = &mut self.upstreams[i];
                    p.slots.configure(slots_per_core(u, workers), u.fair);
                    if p.config.servers != u.servers {
                        let mut servers = UpstreamCore::new(u, workers).servers;
                        for s in &mut servers {
                            if let Some(o) = p.servers.iter().find(|o| o.addr == s.addr) {
                                *s = *o;
                            }
                        }
                        p.servers = servers;
                    }
                    p.config = u.clone();
                    i
                }
                None => {
                    self.upstreams.push(UpstreamCore::new(u, workers));
                    self.upstreams.len() - 1
                }
            };
            self.by_config.push(i);
        }
        let mut stale = Vec::new();
        for (i, upc) in self.upstreams.iter().enumerate() {
            let listed = self.by_config.contains(&i);
            for &k in &upc.idle {
                let addr = self.conns[(k & 0xFFFF_FFFF) as usize]
                    .as_ref()
                    .map(|c| c.addr);
                if !listed || !addr.is_some_and(|a| upc.servers.iter().any(|s| s.addr == a)) {
                    stale.push(k);
                }
            }
        }
        stale
    }

    pub(super) fn conn(&mut self, key: u64) -> Option<&mut UpConn> {
        let slot = (key & 0xFFFF_FFFF) as usize;
        let generation = (key >> 32) as u32;
        match self.conns.get_mut(slot) {
            Some(Some(c)) if c.generation == generation => Some(c),
            _ => None,
        }
    }

    /// Reserves a connection slot: (slot, generation).
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

    /// Takes a connection out of the table (the caller deregisters and drops it).
    pub(super) fn take(&mut self, key: u64) -> Option<UpConn> {
        self.conn(key)?;
        let slot = (key & 0xFFFF_FFFF) as usize;
        let c = self.conns[slot].take();
        self.free.push(slot as u32);
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn upstream(servers: usize) -> UpstreamCore {
        let config = UpstreamConfig {
            name: "app".into(),
            servers: (0..servers)
                .map(|i| SocketAddr::from(([127, 0, 0, 1], 9000 + i as u16)))
                .collect(),
            concurrency_max: 16,
            connect_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(30),
            idle_connections_max: 4,
            fair: true,
        };
        UpstreamCore::new(&config, 1)
    }

    /// Once: every failure doubled the back-off, so the connects that were out together when
    /// a server went down (five at once) put it away for 16–30 s instead of 1 s.
    #[test]
    fn failures_while_backing_off_do_not_double_the_back_off() {
        let mut u = upstream(1);
        let t0 = 5_000_000_000;
        let s0 = Some(u.servers[0].addr);
        for _ in 0..5 {
            u.failed(s0, t0);
        }
        assert_eq!(u.servers[0].fail_until_ns, t0 + BACKOFF_MIN_NS);
        assert_eq!(u.choose(t0 + BACKOFF_MIN_NS - 1), None, "backing off");
        assert_eq!(u.choose(t0 + BACKOFF_MIN_NS), Some(0), "back after 1 s");
        // A failure after the back-off ran out doubles it; a response resets it.
        let t1 = t0 + BACKOFF_MIN_NS;
        u.failed(s0, t1);
        assert_eq!(u.servers[0].fail_until_ns, t1 + 2 * BACKOFF_MIN_NS);
        u.succeeded(s0);
        assert_eq!(u.choose(t1), Some(0));
    }
}
