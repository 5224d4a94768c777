//! node: the thread that makes one server a node of the fleet.
//!
//! Every `sync_ms` it samples the server (the ledger's CPU and bytes per tenant, the work
//! queues, the send scheduler's backlog counts, the lease pools' demand), publishes its entry
//! and reads the fleet's ([`Store::sync`]), water-fills CPU and link bytes ([`water`]), sets
//! the local weights (CPU through `Runtime::set_activity`, as the admin API does; link bytes
//! through `Server::set_send_weights`), renews the fleet caps' leases, and records what it
//! computed in the server's [`FleetStatus`] for the admin API.
//!
//! When a sync fails (Redis down, slow past its deadline, restarted, refusing), the node is in
//! a *fallback episode*: the configured weights come back, each cap's pool is refilled locally
//! at `fleet cap / nodes last seen` for the time since its last refill (measured), one line is
//! logged when the episode starts and one when it ends, and the episode is counted. When the
//! sync goes through but a lease renewal fails, the episode is the caps' only: the fill's
//! weights stay, and only the pools whose renewal failed are refilled locally (one renewed in
//! the same tick is not). The first tick that succeeds again resynchronises: entries are
//! published and the fill and leases take over at once.
//!
//! Every Redis call waits for Redis at most its deadline ([`NodeConfig::timeout`]) and ends
//! within twice it ([`crate::conn`]), so a tick ends too; and [`FleetNode::stop`] waits for
//! the thread only so long.
//!
//! Nothing here is on the request path: requests only read the pools' atomics.

use crate::entry::{self, NodeEntry, TenantEntry};
use crate::lease;
use crate::store::{LeaseAsk, Store};
use crate::water::{self, Demand, NodeDemand};
use omnistage::account::ActivityId;
use omnistage::activity::DEPTH_MAX;
use omnistage_http::config::{ClusterConfig, Config};
use omnistage_http::server::{FleetStatus, FleetTenant, FleetTenantStatus, LeasePool, Server};
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Key prefix of the fleet's state in Redis.
pub const KEY_PREFIX: &str = "omnistage:fleet:";

/// Settings of a fleet node (from `[cluster]`).
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub redis: String,
    /// This node's name (unique in the fleet).
    pub node: String,
    pub sync: Duration,
    /// Prefix of every key (tests use their own).
    pub prefix: String,
}

impl NodeConfig {
    /// From the config's `[cluster]`; a missing node name is the host name.
    pub fn from_cluster(c: &ClusterConfig) -> Result<NodeConfig, String> {
        let node = match &c.node {
            Some(n) => n.clone(),
            None => host_name().ok_or(
                "[cluster] has no node and the host name is not a valid node name; set node",
            )?,
        };
        Ok(NodeConfig {
            redis: c.redis.clone(),
            node,
            sync: c.sync,
            prefix: KEY_PREFIX.to_string(),
        })
    }

    /// Deadline of each Redis call, for its whole exchange (connecting with its handshake, one
    /// command, one pipeline, one script): half an interval, within 5 ms..=1 s.
    pub fn timeout(&self) -> Duration {
        (self.sync / 2).clamp(Duration::from_millis(5), Duration::from_secs(1))
    }

    /// TTL of the node's entry ([`entry_ttl_ms`]).
    pub fn ttl_ms(&self) -> u64 {
        entry_ttl_ms(self.sync.as_millis().min(u128::from(u64::MAX)) as u64)
    }
}

/// The shortest sync interval a node runs at: the entry's TTL, the buckets' burst and the
/// lease targets are whole milliseconds of an interval, and are 0 (or, for the TTL, underflow)
/// under 1 ms. The config allows 10 ms and up; this is the bound of [`FleetNode::start`].
pub const SYNC_MIN: Duration = Duration::from_millis(1);
/// The longest sync interval a node runs at: the config's `sync_ms` bound. Every node reads
/// an entry with a TTL longer than the one this interval gives
/// ([`crate::store::ENTRY_TTL_MAX_MS`]) as garbage, so a node syncing less often would have
/// its entries removed by the others.
pub const SYNC_MAX: Duration = Duration::from_millis(omnistage_http::config::SYNC_MS_MAX as u64);

/// TTL of a node's entry for an interval of `sync_ms`: 2 × sync_ms less a tenth of an interval
/// (at least 1 ms less; the result at least 1 ms). A dead node's entry then expires within 1.9
/// intervals of its last publish and the others' next sync drops it within 2.9. With exactly
/// 2 × sync_ms that worst case was the 3 × sync_ms the fleet promises, with nothing left for
/// the sync's own time (`exp fleet` measured reclaims of 272–288 ms against 300). A live node's
/// entry still outlives a publish late by 0.9 of an interval.
pub const fn entry_ttl_ms(sync_ms: u64) -> u64 {
    let cut = if sync_ms / 10 > 1 { sync_ms / 10 } else { 1 };
    let ttl = sync_ms.saturating_mul(2).saturating_sub(cut);
    if ttl > 1 {
        ttl
    } else {
        1
    }
}

/// The host name, if it is a valid node name.
pub fn host_name() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into the buffer we own.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if r != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let s = std::str::from_utf8(&buf[..end]).ok()?.to_string();
    entry::valid_node(&s).then_some(s)
}

/// Counters of the node since it started (also in its [`FleetStatus`]).
#[derive(Debug, Default)]
pub struct NodeCounters {
    pub syncs: AtomicU64,
    pub episodes: AtomicU64,
    pub garbage: AtomicU64,
    /// Panics of the fleet thread caught and recovered from ([`RESTART_MIN`]).
    pub restarts: AtomicU64,
}

/// After a panic in a tick, the fleet thread puts the local state back (configured weights,
/// caps off) and runs its next tick after at least this long, or one interval if longer;
/// each further panic in a row doubles the wait, up to [`RESTART_MAX`]. A tick that completes
/// resets it. A panic is a bug: the node then serves as if alone rather than spin on it.
pub const RESTART_MIN: Duration = Duration::from_secs(1);
/// The longest wait before the tick after a run of panics.
pub const RESTART_MAX: Duration = Duration::from_secs(30);

/// The wait before the next tick after `panics` panics in a row (at least 1).
pub fn restart_delay(sync: Duration, panics: u32) -> Duration {
    let doublings = panics.saturating_sub(1).min(16);
    sync.max(RESTART_MIN)
        .saturating_mul(1u32 << doublings)
        .min(RESTART_MAX.max(sync))
}

/// How long [`FleetNode::stop`] waits for the thread, in Redis deadlines
/// ([`NodeConfig::timeout`]): a tick makes at most 7 calls (connect, the sync script and the
/// lease pipeline, the last two loaded and run again after a `NOSCRIPT`) and the stop's
/// withdrawal 2 more, each ended within `1 + conn::LATE_TIMEOUTS` (2) deadlines: 18; the rest
/// is the fill's CPU time.
const STOP_WAIT_TIMEOUTS: u32 = 20;
/// The least [`FleetNode::stop`] waits for the thread, whatever the deadline: room for the
/// fill's CPU time on a loaded machine with a short interval.
const STOP_WAIT_MIN: Duration = Duration::from_secs(1);

/// A running fleet node; dropping it stops the thread.
pub struct FleetNode {
    stop: Option<mpsc::Sender<()>>,
    /// Disconnected when the thread ends (its sender is dropped with the thread's state, on
    /// a return or a panic).
    done: mpsc::Receiver<()>,
    thread: Option<JoinHandle<()>>,
    stop_wait: Duration,
    /// Taken by [`FleetNode::stop`], so that a stopped node no longer holds the server (the
    /// CLI drains the server only once it holds it alone).
    server: Option<Arc<Server>>,
    base: Arc<Mutex<HashMap<String, u32>>>,
    counters: Arc<NodeCounters>,
    /// Test hook: the next tick that reaches the fill panics.
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    panic_once: Arc<AtomicBool>,
}

impl FleetNode {
    /// Starts the node's thread for `server` (it publishes within one interval). Refuses a
    /// node name that is not one and an interval outside [`SYNC_MIN`]..=[`SYNC_MAX`].
    pub fn start(server: Arc<Server>, cfg: NodeConfig) -> Result<FleetNode, String> {
        if !entry::valid_node(&cfg.node) {
            return Err(format!("node name {:?} is not valid", cfg.node));
        }
        if cfg.sync < SYNC_MIN || cfg.sync > SYNC_MAX {
            return Err(format!(
                "sync interval {:?} is outside {:?}..={:?}",
                cfg.sync, SYNC_MIN, SYNC_MAX
            ));
        }
        let mut store = Store::new(&cfg.redis, cfg.timeout(), &cfg.prefix)?;
        store.set_backoff_base(cfg.sync);
        let base = Arc::new(Mutex::new(base_weights(&server.config())));
        let counters = Arc::new(NodeCounters::default());
        let (tx, rx) = mpsc::channel();
        let (done_tx, done) = mpsc::channel::<()>();
        let stop_wait = (cfg.timeout() * STOP_WAIT_TIMEOUTS).max(STOP_WAIT_MIN);
        let panic_once = Arc::new(AtomicBool::new(false));
        let mut state = State::new(server.clone(), cfg, store, base.clone(), counters.clone());
        state.panic_once = panic_once.clone();
        let thread = std::thread::Builder::new()
            .name("fleet".into())
            .spawn(move || {
                let _done = done_tx;
                let sync = state.cfg.sync;
                let mut next = Instant::now();
                let mut panics = 0u32;
                loop {
                    // A panic in a tick is caught here, the local state put back and the
                    // thread goes on (after a pause): otherwise nobody would sync, and the
                    // pools and weights would stay as the panic left them until `stop`.
                    match catch_unwind(AssertUnwindSafe(|| state.tick())) {
                        Ok(()) => {
                            panics = 0;
                            next += sync;
                        }
                        Err(payload) => {
                            panics = panics.saturating_add(1);
                            let delay = restart_delay(sync, panics);
                            let recovered =
                                catch_unwind(AssertUnwindSafe(|| state.recover(&*payload, delay)));
                            if recovered.is_err() {
                                // The recovery itself panicked: end the thread; `stop` puts
                                // the local state back for a thread that ended in a panic.
                                std::panic::resume_unwind(payload);
                            }
                            next = Instant::now() + delay;
                        }
                    }
                    let now = Instant::now();
                    if next < now {
                        next = now + sync;
                    }
                    match rx.recv_timeout(next - now) {
                        Err(RecvTimeoutError::Timeout) => {}
                        _ => break,
                    }
                }
                state.leave();
            })
            .map_err(|e| format!("cannot start the fleet thread: {e}"))?;
        Ok(FleetNode {
            stop: Some(tx),
            done,
            thread: Some(thread),
            stop_wait,
            server: Some(server),
            base,
            counters,
            panic_once,
        })
    }

    /// Test hook: makes the thread's next tick that reaches the fill (a sync that went
    /// through) panic, once.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn panic_once(&self) {
        self.panic_once.store(true, Ordering::Relaxed);
    }

    /// Takes the configured weights of a reloaded configuration (the weights the node goes
    /// back to without Redis, and the fill's weights).
    pub fn reload(&self, config: &Config) {
        *self.base.lock().expect("base lock") = base_weights(config);
    }

    pub fn counters(&self) -> &NodeCounters {
        &self.counters
    }

    /// Stops the thread (its last act puts the configured weights back and withdraws the
    /// entry); idempotent. Returns within a bound ([`STOP_WAIT_TIMEOUTS`] Redis deadlines, at
    /// least [`STOP_WAIT_MIN`]) even if the thread is stuck: it is then left to end on its own
    /// (it stops after its current tick), and the configured weights are put back and the caps
    /// lifted here. Such a thread still holds the server. A thread that ended in a panic
    /// never put the local state back: that is done here too. The node lets go of the server.
    pub fn stop(&mut self) {
        self.stop.take();
        let server = self.server.take();
        if let Some(t) = self.thread.take() {
            let restore = match self.done.recv_timeout(self.stop_wait) {
                Err(RecvTimeoutError::Timeout) => {
                    warn(format_args!(
                        "omnistage: fleet: the fleet thread did not stop within {:?}; left \
                         running, configured weights back and fleet caps off",
                        self.stop_wait
                    ));
                    true
                }
                _ => t.join().is_err(),
            };
            if let (true, Some(server)) = (restore, &server) {
                restore_local(server, &self.base);
            }
        }
    }
}

impl Drop for FleetNode {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Writes one line to stderr, ignoring a failure: `eprintln!` panics when stderr is gone (a
/// closed pipe), which would end the fleet thread and leave the caps without refills.
fn warn(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{args}");
}

/// The node's local state without the fleet: configured weights (CPU and link), caps off, no
/// fleet status.
fn restore_local(server: &Server, base: &Mutex<HashMap<String, u32>>) {
    let base = base.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut send = Vec::new();
    for t in server.fleet_tenants() {
        set_cpu_weight(
            server,
            &t.path,
            base.get(&t.name).copied().unwrap_or(t.weight),
        );
        send.push((t.name.clone(), None));
        t.hooks.requests.set_limited(false);
        t.hooks.bytes.set_limited(false);
    }
    let send: Vec<(&str, Option<u32>)> = send.iter().map(|(n, w)| (n.as_str(), *w)).collect();
    server.set_send_weights(&send);
    server.set_fleet_status(None);
}

/// Sets an activity's weight through the runtime (as the admin API does), if it differs.
fn set_cpu_weight(server: &Server, path: &str, weight: u32) {
    let rt = server.runtime();
    let spec = rt.with_activities(|tab| {
        tab.lookup(path)
            .and_then(|id| tab.get(id))
            .map(|a| a.spec.clone())
    });
    if let Some(mut spec) = spec {
        if spec.weight != weight {
            spec.weight = weight;
            if let Err(e) = rt.set_activity(path, spec) {
                warn(format_args!(
                    "omnistage: fleet: cannot set the weight of {path}: {e}"
                ));
            }
        }
    }
}

fn base_weights(config: &Config) -> HashMap<String, u32> {
    config
        .tenants
        .iter()
        .map(|t| (t.name.clone(), t.weight))
        .collect()
}

/// A tenant's counters at the last sample.
#[derive(Clone, Copy, Default)]
struct Sample {
    cpu_ns: u64,
    bytes_out: u64,
    picks: u64,
    picks_backlogged: u64,
    rejected: u64,
    req_attempts: u64,
    bytes_attempts: u64,
    bytes_refused: u64,
}

struct State {
    server: Arc<Server>,
    cfg: NodeConfig,
    store: Store,
    base: Arc<Mutex<HashMap<String, u32>>>,
    counters: Arc<NodeCounters>,
    last: HashMap<String, Sample>,
    last_at: Option<Instant>,
    /// Whether each tenant had work queued at the last sample (backlog is taken over two).
    queued_before: HashMap<String, bool>,
    /// In a fallback episode since this instant.
    down_since: Option<Instant>,
    nodes_last_seen: usize,
    refills: Refills,
    /// Test hook ([`FleetNode::panic_once`]).
    panic_once: Arc<AtomicBool>,
}

/// When each capped pool (tenant, `req` or `bytes`) was last given tokens, by a renewal or a
/// local refill: the local refill credits the time since, measured, rather than one interval
/// per tick (a tick that met a slow Redis lasts longer than an interval).
#[derive(Debug, Default)]
struct Refills {
    last: HashMap<(String, &'static str), Instant>,
}

impl Refills {
    /// The pool was given tokens at `now`.
    fn mark(&mut self, tenant: &str, kind: &'static str, now: Instant) {
        self.last.insert((tenant.to_string(), kind), now);
    }

    /// The time to credit the pool at `now`: since it was last given tokens, or one interval
    /// (`sync`) if it never was; marks it given at `now`.
    fn take(&mut self, tenant: &str, kind: &'static str, now: Instant, sync: Duration) -> Duration {
        self.last
            .insert((tenant.to_string(), kind), now)
            .map_or(sync, |t| now.saturating_duration_since(t))
    }

    /// The pool's cap is off.
    fn forget(&mut self, tenant: &str, kind: &'static str) {
        self.last.remove(&(tenant.to_string(), kind));
    }
}

/// Tokens a capped pool holding `held` gets without Redis after `elapsed`: the cap split over
/// the nodes last seen, for that time, up to two intervals of that rate.
fn local_refill(
    cap: u64,
    nodes_last_seen: usize,
    sync: Duration,
    held: i64,
    elapsed: Duration,
) -> i64 {
    let rate = lease::fallback_rate(cap, nodes_last_seen);
    let ceiling = lease::bucket_burst(rate.ceil() as u64, sync.as_millis() as u64);
    let elapsed_ns = elapsed.as_nanos().min(u128::from(u64::MAX)) as u64;
    lease::fallback_refill(rate, elapsed_ns, held, ceiling)
}

/// What the node measured for one tenant over the interval.
struct Measured {
    t: FleetTenant,
    weight: u32,
    cpu: Demand,
    link: Demand,
    req_demand_per_s: f64,
    bytes_demand_per_s: f64,
    bytes_sent: u64,
}

impl State {
    fn new(
        server: Arc<Server>,
        cfg: NodeConfig,
        store: Store,
        base: Arc<Mutex<HashMap<String, u32>>>,
        counters: Arc<NodeCounters>,
    ) -> State {
        State {
            server,
            cfg,
            store,
            base,
            counters,
            last: HashMap::new(),
            last_at: None,
            queued_before: HashMap::new(),
            down_since: None,
            nodes_last_seen: 1,
            refills: Refills::default(),
            panic_once: Arc::new(AtomicBool::new(false)),
        }
    }

    fn cpu_capacity(&self) -> u64 {
        self.server.runtime().workers() as u64 * 1_000_000_000
    }

    fn link_capacity(&self, config: &Config) -> u64 {
        config.server.net_link_cap_bytes_per_s.unwrap_or(0)
    }

    /// Samples the server: per tenant, its use and backlog over the interval since the last
    /// sample.
    fn measure(&mut self, config: &Config) -> Vec<Measured> {
        let server = self.server.clone();
        let rt = server.runtime();
        let now = Instant::now();
        let dt = self
            .last_at
            .map_or(0.0, |t| now.duration_since(t).as_secs_f64());
        self.last_at = Some(now);
        let snap = rt.snapshot();
        let rolled: HashMap<ActivityId, omnistage::account::Row> = rt.with_activities(|tab| {
            snap.rolled_up(|a| tab.parent_of(a), DEPTH_MAX + 1)
                .into_iter()
                .collect()
        });
        let queues = rt.queues();
        let cpu_cap = self.cpu_capacity();
        let link_cap = self.link_capacity(config);
        let base = self.base.lock().expect("base lock").clone();
        let mut out = Vec::new();
        for t in server.fleet_tenants() {
            let row = rolled.get(&t.activity).copied().unwrap_or_default();
            // The tenant's own queues and its classes' (their paths are below its own).
            let class_prefix = format!("{}/", t.path);
            let (queued, rejected) = rt.with_activities(|tab| {
                queues
                    .iter()
                    .filter(|q| {
                        q.activity == t.activity
                            || tab
                                .get(q.activity)
                                .is_some_and(|a| a.path.starts_with(&class_prefix))
                    })
                    .fold((0usize, 0u64), |(n, r), q| (n + q.queued, r + q.rejected))
            });
            let (picks, picks_backlogged) = t.hooks.send_picks();
            let s = Sample {
                cpu_ns: row.cpu_ns,
                bytes_out: row.bytes_out,
                picks,
                picks_backlogged,
                rejected,
                req_attempts: t.hooks.requests.attempts(),
                bytes_attempts: t.hooks.bytes.attempts(),
                bytes_refused: t.hooks.bytes.refused(),
            };
            let p = self.last.insert(t.name.clone(), s).unwrap_or(s);
            let per_s = |now: u64, before: u64| {
                if dt > 0.0 {
                    (now.saturating_sub(before) as f64 / dt) as u64
                } else {
                    0
                }
            };
            let cpu_used = per_s(s.cpu_ns, p.cpu_ns);
            let link_used = per_s(s.bytes_out, p.bytes_out);
            let was_queued = self.queued_before.insert(t.name.clone(), queued > 0);
            let cpu_backlogged = queued > 0 || was_queued == Some(true) || s.rejected > p.rejected;
            let d_picks = s.picks.saturating_sub(p.picks);
            let d_backlogged = s.picks_backlogged.saturating_sub(p.picks_backlogged);
            let link_backlogged =
                water::link_backlogged(d_picks, d_backlogged, t.hooks.send_waiting());
            let req_demand_per_s = per_s(s.req_attempts, p.req_attempts) as f64;
            // Bytes wanted: what was sent, scaled up by the share of requests the byte pool
            // refused (they would have sent about as much each).
            let d_att = s.bytes_attempts.saturating_sub(p.bytes_attempts);
            let d_ref = s.bytes_refused.saturating_sub(p.bytes_refused).min(d_att);
            let served = d_att - d_ref;
            let bytes_demand_per_s = if d_ref > 0 {
                link_used as f64 * d_att as f64 / served.max(1) as f64
            } else {
                link_used as f64
            };
            out.push(Measured {
                weight: base.get(&t.name).copied().unwrap_or(t.weight),
                cpu: Demand {
                    backlogged: cpu_backlogged,
                    want: if cpu_backlogged { cpu_cap } else { cpu_used },
                    used: cpu_used,
                },
                link: Demand {
                    backlogged: link_backlogged && link_cap > 0,
                    want: if link_backlogged { link_cap } else { link_used },
                    used: link_used,
                },
                req_demand_per_s,
                bytes_demand_per_s,
                bytes_sent: s.bytes_out.saturating_sub(p.bytes_out),
                t,
            });
        }
        out
    }

    fn own_entry(&self, m: &[Measured], config: &Config) -> NodeEntry {
        NodeEntry {
            node: self.cfg.node.clone(),
            cpu_capacity: self.cpu_capacity(),
            link_capacity: self.link_capacity(config),
            tenants: m
                .iter()
                .filter(|x| {
                    x.cpu.backlogged || x.cpu.used > 0 || x.link.backlogged || x.link.used > 0
                })
                .map(|x| TenantEntry {
                    name: x.t.name.clone(),
                    weight: x.weight,
                    cpu: x.cpu,
                    link: x.link,
                })
                .collect(),
        }
    }

    fn tick(&mut self) {
        let config = self.server.config();
        let measured = self.measure(&config);
        Self::debit_bytes(&measured);
        let own = self.own_entry(&measured, &config);
        let text = entry::encode(&own);
        let read = match self.store.sync(&self.cfg.node, &text, self.cfg.ttl_ms()) {
            Ok(r) => r,
            Err(e) => {
                let what = format!(
                    "configured weights and fleet caps / {} node(s)",
                    self.nodes_last_seen
                );
                self.episode(Err((e.to_string(), &what)));
                self.fallback(&measured);
                return;
            }
        };
        let mut garbage = read.garbage;
        let mut entries: Vec<NodeEntry> = vec![own];
        for (node, value) in &read.entries {
            if *node == self.cfg.node {
                continue;
            }
            let p = entry::parse(node, value);
            garbage = garbage.saturating_add(p.garbage);
            entries.extend(p.entry);
        }
        self.counters.garbage.fetch_add(garbage, Ordering::Relaxed);
        self.nodes_last_seen = entries.len();
        let status = self.apply_fill(&measured, &entries);
        if self.panic_once.swap(false, Ordering::Relaxed) {
            panic!("fleet test hook: a panic after the fill");
        }
        match self.renew_leases(&measured) {
            Ok(()) => {
                self.counters.syncs.fetch_add(1, Ordering::Relaxed);
                self.episode(Ok(()));
                self.publish_status(status, &measured, true);
            }
            Err(e) => {
                // The sync itself went through: the fill stands (weights and targets from the
                // entries just read); only the caps whose renewal failed were refilled locally.
                let what = format!(
                    "the fleet's weights, and the caps not renewed at fleet cap / {} node(s)",
                    self.nodes_last_seen
                );
                self.episode(Err((format!("lease: {e}"), &what)));
                self.publish_status(status, &measured, false);
            }
        }
    }

    /// Water-fills both resources over `entries` (this node's first) and sets the local
    /// weights; returns the per-tenant status rows (leases filled in later).
    fn apply_fill(
        &mut self,
        measured: &[Measured],
        entries: &[NodeEntry],
    ) -> Vec<FleetTenantStatus> {
        // Tenants: this node's in config order, then others seen in the entries.
        let mut names: Vec<String> = measured.iter().map(|m| m.t.name.clone()).collect();
        let mut weights: Vec<u32> = measured.iter().map(|m| m.weight).collect();
        let mut index: HashMap<String, usize> = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), i))
            .collect();
        for e in entries {
            for t in &e.tenants {
                if !index.contains_key(&t.name) {
                    index.insert(t.name.clone(), names.len());
                    names.push(t.name.clone());
                    weights.push(t.weight.clamp(1, water::WEIGHT_SCALE));
                }
            }
        }
        let demands = |pick: fn(&TenantEntry) -> Demand, cap: fn(&NodeEntry) -> u64| {
            entries
                .iter()
                .map(|e| NodeDemand {
                    capacity: cap(e),
                    tenants: e
                        .tenants
                        .iter()
                        .map(|t| (index[&t.name], pick(t)))
                        .collect(),
                })
                .collect::<Vec<_>>()
        };
        let cpu_nodes = demands(|t| t.cpu, |e| e.cpu_capacity);
        let link_nodes = demands(|t| t.link, |e| e.link_capacity);
        let cpu = water::water_fill(&weights, &cpu_nodes);
        let link = water::water_fill(&weights, &link_nodes);
        let cpu_total: u64 = entries.iter().map(|e| e.cpu_capacity).sum();
        let link_total: u64 = entries.iter().map(|e| e.link_capacity).sum();
        // The configured shares of the tenants without demand here are shares among this
        // node's tenants (the first `measured.len()` weights): a tenant known only from other
        // nodes' entries has no weight here to share with. This node's entry names only its
        // own tenants, so its part of the fill indexes only those.
        let local = &weights[..measured.len()];
        let cpu_w = water::local_weights(local, cpu_nodes[0].capacity, &cpu.alloc[0]);
        let link_w = water::local_weights(local, link_nodes[0].capacity, &link.alloc[0]);
        let mut send = Vec::new();
        let mut rows = Vec::with_capacity(measured.len());
        for (i, m) in measured.iter().enumerate() {
            self.set_cpu_weight(&m.t.path, cpu_w[i]);
            let lw = (link_nodes[0].capacity > 0).then_some(link_w[i]);
            send.push((m.t.name.as_str(), lw));
            rows.push(FleetTenantStatus {
                name: m.t.name.clone(),
                cpu_share_target: cpu.share_target(i, cpu_total),
                link_share_target: link.share_target(i, link_total),
                cpu_fleet_used_ns_per_s: cpu.used[i],
                link_fleet_used_bytes_per_s: link.used[i],
                cpu_weight: cpu_w[i],
                link_weight: lw.unwrap_or(m.weight),
                ..Default::default()
            });
        }
        self.server.set_send_weights(&send);
        rows
    }

    fn set_cpu_weight(&self, path: &str, weight: u32) {
        set_cpu_weight(&self.server, path, weight);
    }

    /// Debits what each tenant with `fleet_net_cap` sent over the interval from its bytes
    /// pool: once per tick, before the renewal or the fallback refill (a tick that renews some
    /// leases and then falls back must not pay twice). Only while the pool is on: bytes sent
    /// without a cap are owed to no one, and a pool switched on (the cap just added, the node
    /// just started) starts from nothing rather than from a debt of everything sent before.
    fn debit_bytes(measured: &[Measured]) {
        for m in measured {
            let pool = &m.t.hooks.bytes;
            if m.t.caps.net_cap_bytes_per_s.is_some() && pool.is_limited() {
                pool.add(-(m.bytes_sent.min(i64::MAX as u64) as i64));
            }
        }
    }

    /// Renews every fleet cap's lease through Redis, in one pipeline. A pool at its target
    /// asks for nothing; a pool whose renewal fails (the pipeline, or its own script) is
    /// refilled locally as in a fallback, and only such a pool: one renewed in this tick is
    /// not paid twice. Err: the first failure.
    fn renew_leases(&mut self, measured: &[Measured]) -> Result<(), String> {
        let sync_ms = self.cfg.sync.as_millis() as u64;
        let now = Instant::now();
        // (tenant, pool kind) per ask, beside the asks.
        let mut who: Vec<(usize, usize)> = Vec::new();
        let mut asks: Vec<LeaseAsk> = Vec::new();
        for (i, m) in measured.iter().enumerate() {
            for (k, (cap, pool, demand, kind)) in Self::pools(m).into_iter().enumerate() {
                let Some(cap) = cap else {
                    pool.set_limited(false);
                    self.refills.forget(&m.t.name, kind);
                    continue;
                };
                pool.set_limited(true);
                let target = lease::lease_target(demand, cap, sync_ms);
                let ask = lease::lease_delta(target, pool.tokens());
                if ask == 0 {
                    // At its target (two intervals of demand): as good as renewed.
                    self.refills.mark(&m.t.name, kind, now);
                    continue;
                }
                who.push((i, k));
                asks.push(LeaseAsk {
                    key: self.store.cap_key(&m.t.name, kind),
                    rate_per_s: cap,
                    burst: lease::bucket_burst(cap, sync_ms),
                    ask,
                });
            }
        }
        let replies = match self.store.leases(&asks) {
            Ok(r) => r
                .into_iter()
                .map(|r| r.map_err(|e| e.to_string()))
                .collect(),
            Err(e) => vec![Err(e.to_string()); asks.len()],
        };
        let mut first_error = None;
        for ((i, k), reply) in who.into_iter().zip(replies) {
            let m = &measured[i];
            let (cap, pool, _, kind) = Self::pools(m)[k];
            match reply {
                Ok((granted, garbage)) => {
                    if garbage {
                        self.counters.garbage.fetch_add(1, Ordering::Relaxed);
                    }
                    pool.add(granted);
                    self.refills.mark(&m.t.name, kind, now);
                }
                Err(e) => {
                    let cap = cap.expect("asked for a cap");
                    self.refill_locally(&m.t.name, kind, cap, pool, now);
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// A tenant's two pools with their caps, recent demand and key kind.
    fn pools(m: &Measured) -> [(Option<u64>, &LeasePool, f64, &'static str); 2] {
        let h = &m.t.hooks;
        [
            (m.t.caps.rate_per_s, &h.requests, m.req_demand_per_s, "req"),
            (
                m.t.caps.net_cap_bytes_per_s,
                &h.bytes,
                m.bytes_demand_per_s,
                "bytes",
            ),
        ]
    }

    /// Refills a capped pool without Redis: at `cap / nodes last seen` for the time since it
    /// was last refilled or renewed, up to two intervals of that rate.
    fn refill_locally(
        &mut self,
        tenant: &str,
        kind: &'static str,
        cap: u64,
        pool: &LeasePool,
        now: Instant,
    ) {
        let elapsed = self.refills.take(tenant, kind, now, self.cfg.sync);
        pool.add(local_refill(
            cap,
            self.nodes_last_seen,
            self.cfg.sync,
            pool.tokens(),
            elapsed,
        ));
    }

    /// Without Redis: configured weights, and each cap's pool refilled locally at
    /// `cap / nodes last seen` for the time since its last refill.
    fn fallback(&mut self, measured: &[Measured]) {
        let now = Instant::now();
        let mut send = Vec::new();
        let mut rows = Vec::new();
        for m in measured {
            self.set_cpu_weight(&m.t.path, m.weight);
            send.push((m.t.name.as_str(), None));
            for (cap, pool, _, kind) in Self::pools(m) {
                let Some(cap) = cap else {
                    pool.set_limited(false);
                    self.refills.forget(&m.t.name, kind);
                    continue;
                };
                pool.set_limited(true);
                self.refill_locally(&m.t.name, kind, cap, pool, now);
            }
            rows.push(FleetTenantStatus {
                name: m.t.name.clone(),
                cpu_weight: m.weight,
                link_weight: m.weight,
                cpu_fleet_used_ns_per_s: m.cpu.used,
                link_fleet_used_bytes_per_s: m.link.used,
                ..Default::default()
            });
        }
        self.server.set_send_weights(&send);
        self.publish_status(rows, measured, false);
    }

    /// Starts or ends a fallback episode (logged once each way, counted when it starts);
    /// `Err((error, what falls back))`.
    fn episode(&mut self, r: Result<(), (String, &str)>) {
        match (r, self.down_since) {
            (Err((e, what)), None) => {
                self.down_since = Some(Instant::now());
                self.counters.episodes.fetch_add(1, Ordering::Relaxed);
                self.store.reset();
                warn(format_args!(
                    "omnistage: fleet: node {}: redis {} failed ({e}); {what} until it answers",
                    self.cfg.node, self.cfg.redis
                ));
            }
            (Err(_), Some(_)) => self.store.reset(),
            (Ok(()), Some(since)) => {
                self.down_since = None;
                warn(format_args!(
                    "omnistage: fleet: node {}: redis answers again after {:.1} s; resynchronised",
                    self.cfg.node,
                    since.elapsed().as_secs_f64()
                ));
            }
            (Ok(()), None) => {}
        }
    }

    fn publish_status(&self, mut rows: Vec<FleetTenantStatus>, measured: &[Measured], ok: bool) {
        for (r, m) in rows.iter_mut().zip(measured) {
            r.lease_requests = m.t.hooks.requests.tokens();
            r.lease_bytes = m.t.hooks.bytes.tokens();
        }
        self.server.set_fleet_status(Some(Arc::new(FleetStatus {
            node: self.cfg.node.clone(),
            connected: ok,
            episodes: self.counters.episodes.load(Ordering::Relaxed),
            garbage: self.counters.garbage.load(Ordering::Relaxed),
            syncs: self.counters.syncs.load(Ordering::Relaxed),
            restarts: self.counters.restarts.load(Ordering::Relaxed),
            nodes_seen: self.nodes_last_seen,
            tenants: rows,
        })));
    }

    /// After a panic in a tick: counts it, drops the connection (a call may have been cut
    /// mid-exchange), puts the local state back (configured weights, caps off), logs it and
    /// publishes a status that says so (not connected, the restart counted, the weights now
    /// in force). The next tick, `delay` later, starts afresh from Redis.
    fn recover(&mut self, payload: &(dyn std::any::Any + Send), delay: Duration) {
        let n = self.counters.restarts.fetch_add(1, Ordering::Relaxed) + 1;
        self.store.reset();
        self.last_at = None;
        self.last.clear();
        self.queued_before.clear();
        restore_local(&self.server, &self.base);
        for t in self.server.fleet_tenants() {
            self.refills.forget(&t.name, "req");
            self.refills.forget(&t.name, "bytes");
        }
        let what = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("a panic");
        warn(format_args!(
            "omnistage: fleet: node {}: the fleet thread panicked ({what}; restart {n}); \
             configured weights back and fleet caps off, next sync in {:.1} s",
            self.cfg.node,
            delay.as_secs_f64()
        ));
        let rt = self.server.runtime();
        let rows = self
            .server
            .fleet_tenants()
            .into_iter()
            .map(|t| {
                let w = rt.with_activities(|tab| {
                    tab.lookup(&t.path)
                        .and_then(|id| tab.get(id))
                        .map_or(t.weight, |a| a.spec.weight)
                });
                FleetTenantStatus {
                    name: t.name.clone(),
                    cpu_weight: w,
                    link_weight: w,
                    lease_requests: t.hooks.requests.tokens(),
                    lease_bytes: t.hooks.bytes.tokens(),
                    ..Default::default()
                }
            })
            .collect();
        self.server.set_fleet_status(Some(Arc::new(FleetStatus {
            node: self.cfg.node.clone(),
            connected: false,
            episodes: self.counters.episodes.load(Ordering::Relaxed),
            garbage: self.counters.garbage.load(Ordering::Relaxed),
            syncs: self.counters.syncs.load(Ordering::Relaxed),
            restarts: n,
            nodes_seen: self.nodes_last_seen,
            tenants: rows,
        })));
    }

    /// On stop: the configured weights back, caps off, and the entry withdrawn (best effort).
    fn leave(&mut self) {
        restore_local(&self.server, &self.base);
        let _ = self.store.withdraw(&self.cfg.node);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(sync_ms: u64) -> NodeConfig {
        NodeConfig {
            redis: String::new(),
            node: "n".into(),
            sync: Duration::from_millis(sync_ms),
            prefix: KEY_PREFIX.into(),
        }
    }

    #[test]
    fn the_ttl_is_under_two_intervals_and_over_one() {
        assert_eq!(cfg(100).ttl_ms(), 190);
        assert_eq!(cfg(10).ttl_ms(), 19);
        assert_eq!(cfg(60_000).ttl_ms(), 114_000);
        for sync_ms in [1, 2, 5, 10, 99, 100, 1_000, 60_000] {
            let ttl = cfg(sync_ms).ttl_ms();
            assert!(ttl < 2 * sync_ms && ttl > sync_ms - 1, "{sync_ms}: {ttl}");
        }
    }

    #[test]
    fn the_ttl_of_an_interval_under_a_millisecond_is_1_ms_not_an_underflow() {
        assert_eq!(entry_ttl_ms(0), 1);
        assert_eq!(entry_ttl_ms(1), 1);
        assert_eq!(entry_ttl_ms(u64::MAX), u64::MAX - u64::MAX / 10);
        let sub_ms = NodeConfig {
            sync: Duration::from_micros(500),
            ..cfg(0)
        };
        assert_eq!(sub_ms.ttl_ms(), 1);
        assert_eq!(
            crate::store::ENTRY_TTL_MAX_MS,
            cfg(SYNC_MAX.as_millis() as u64).ttl_ms()
        );
    }

    #[test]
    fn a_restart_waits_at_least_a_second_and_doubles_up_to_its_bound() {
        let ms = Duration::from_millis;
        assert_eq!(restart_delay(ms(50), 1), RESTART_MIN);
        assert_eq!(restart_delay(ms(50), 2), 2 * RESTART_MIN);
        assert_eq!(restart_delay(ms(50), 5), 16 * RESTART_MIN);
        assert_eq!(restart_delay(ms(50), 6), RESTART_MAX);
        assert_eq!(restart_delay(ms(50), u32::MAX), RESTART_MAX);
        // Never under one interval.
        assert_eq!(restart_delay(ms(5_000), 1), ms(5_000));
        assert_eq!(restart_delay(ms(60_000), 3), ms(60_000));
    }

    #[test]
    fn the_local_refill_credits_the_time_since_the_last_refill() {
        let sync = Duration::from_millis(50);
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut r = Refills::default();
        // Never refilled: one interval.
        assert_eq!(r.take("c", "req", ms(0), sync), sync);
        // Ticks that met a slow Redis: 300 ms, then 20 ms, measured, not 50 ms a tick.
        assert_eq!(
            r.take("c", "req", ms(300), sync),
            Duration::from_millis(300)
        );
        assert_eq!(r.take("c", "req", ms(320), sync), Duration::from_millis(20));
        // A renewal counts as a refill; the other pool has its own time.
        r.mark("c", "req", ms(400));
        assert_eq!(r.take("c", "req", ms(450), sync), sync);
        assert_eq!(r.take("c", "bytes", ms(450), sync), sync);
        // A cap switched off and on starts again from one interval.
        r.forget("c", "req");
        assert_eq!(r.take("c", "req", ms(10_000), sync), sync);
        // What that time is worth: 1,000/s over 2 nodes is 500/s; 300 ms give 150 tokens,
        // 20 ms 10; the ceiling is two intervals of that rate (50), less what is held.
        let at =
            |elapsed_ms, held| local_refill(1000, 2, sync, held, Duration::from_millis(elapsed_ms));
        assert_eq!(at(20, 0), 10);
        assert_eq!(at(50, 0), 25);
        assert_eq!(at(300, 0), 50);
        assert_eq!(at(300, 45), 5);
        assert_eq!(at(300, -20), 70);
        assert_eq!(at(0, 0), 0);
    }
}
