//! `server`: the multi-tenant HTTP server as stages on the omnistage runtime. This file is the
//! wiring: it creates the stages, starts the workers and stops them; each stage lives in the
//! file named after it, the state they share in files named for what it is.
//!
//! Stages (all per core; a connection lives on the core that accepted it):
//!
//! ```text
//! http.boot ──── takes this core's listening sockets and registers them   boot.rs    (/infra)
//! http.accept ── listener readiness: accept, register the connection      accept.rs  (/infra)
//! http.conn ──── connection readiness: read (lazily, in the connection's  conn.rs    (tenant)
//!                activity), parse, pick the tenant, queue the request,
//!                write what is pending
//! http.work ──── a request in its tenant's activity: files, synthetic     work.rs    (tenant)
//!                endpoints, errors; its gate turns overload into 503
//! http.timer ─── header and keep-alive deadlines; access-log flushes      timer.rs   (any)
//! http.send ──── the network send resource stage, when a link or tenant   send.rs    (/infra)
//!                net cap is configured: its own scheduler (SFQ by bytes
//!                under a link shaper, one node per tenant with its weight
//!                and cap, a leaf per connection, or one per tenant whose
//!                `send_order` heap picks the response; send_sched.rs)
//!                decides whose bytes go out next
//! http.cont ──── a connection's continuation (more body, more pipelined   cont.rs    (tenant)
//!                requests) after it yielded; never refused
//! http.disk ──── a disk read coming back from the disk stage's reader     disk.rs    (tenant)
//!                threads
//! http.proxy ─── a proxied request granted an upstream slot after it      proxy.rs   (tenant)
//!                waited; proxy.rs also owns the proxied request's life
//!                (slot, server choice, bytes both ways, 502/504)
//! http.upstream  readiness of the connections to backend servers        upstream.rs (tenant)
//! ```
//!
//! Shared state: `shared.rs` (server-wide state and counters), `tenants.rs` (the live
//! configuration, tenants' activities and admission, reload), `core_server.rs` (the per-core
//! state: connection table, listeners), `file_cache.rs` (the per-core open-file cache),
//! `output.rs` (a connection's pending output), `pool.rs` (per-thread buffer pools),
//! `upstream_pool.rs` (per core: each upstream's slots, servers' health, idle connections).
//!
//! Output is a queue of segments written with `sendmsg`, and with `sendfile` for large file
//! bodies when the `sendfile` key is on (`output.rs`); the disk stage is a pool of reader
//! threads behind a byte-fair scheduler (`disk.rs`).
//!
//! Receive is lazy (QLinux's LRP): the first request of a connection is read and parsed in
//! `/infra` (nobody knows the tenant before the Host header); from then on the connection's
//! readiness is delivered in its tenant's activity, so a tenant over its share leaves its bytes
//! in the kernel and TCP flow control slows its clients, not the others.
//!
//! Per-core server state lives in a thread-local: each worker thread runs the handlers of its
//! own core only, and handlers never call each other (they send messages), so a `RefCell`
//! borrow is never held across another.

mod accept;
mod boot;
mod conn;
mod cont;
mod core_server;
mod deadlines;
mod disk;
mod file_cache;
mod fleet;
mod output;
mod pool;
mod proxy;
mod relay;
mod send;
mod send_sched;
mod shared;
mod tenants;
mod timer;
mod tls;
mod upstream;
mod upstream_pool;
mod work;

pub use fleet::{FleetHooks, FleetStatus, FleetTenantStatus, LeasePool};
pub use send_sched::{net_cap_burst_bytes, net_cap_grain_bytes};
pub use shared::{ServerOptions, ServerStats};
pub use tenants::{FleetTenant, Reloaded, UpdateError};
pub use upstream_pool::UpstreamTenantStats;
pub use work::burn;

use accept::{bind_reuseport, on_accept};
use boot::{on_boot, Boot};
use conn::on_conn;
use cont::{on_cont, Cont};
use disk::{on_disk, DiskDone};
use proxy::{on_proxy, ProxyGo};
use send::{on_send, Pump};
use shared::ServerShared;
use tenants::{apply_tenants, Live, RestartOnly};
use timer::{on_tick, Tick};
use upstream::on_upstream;
use work::{calibrate_burn, on_work, Work};

use crate::config::Config;
use omnistage::account::StageId;
use omnistage::activity::INFRA;
use omnistage::exec::{Affinity, Ctx, IoEvent, Runtime, StageConfig, StageRef, WORKERS_MAX};
use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// Longest grace `Server::drain` gives open connections: a day, beyond any drain an operator
/// means, and small enough that the deadline (`Instant::now() + grace`) cannot overflow, which
/// panicked for a grace near `u64::MAX` seconds (`serve --drain-s`).
pub const DRAIN_GRACE_MAX: Duration = Duration::from_secs(24 * 60 * 60);

/// How long `drain` waits for the cores to write out their access-log buffers.
const LOG_FLUSH_WAIT: Duration = Duration::from_secs(1);

/// The number of workers a server starts with: `--workers` (`ServerOptions::workers`), else
/// the config's `workers`, else one per CPU; each must lie in 1..=[`WORKERS_MAX`] (the
/// runtime's limit), and the CPU count is capped at it. A count of 0 once made the server index
/// an empty list of listeners (a panic), and the CPU count was taken as it came.
fn worker_count(option: Option<usize>, config: Option<usize>) -> Result<usize, String> {
    for (what, n) in [("--workers", option), ("workers", config)] {
        if let Some(n) = n {
            if !(1..=WORKERS_MAX).contains(&n) {
                return Err(format!("{what} {n} is outside 1..={WORKERS_MAX}"));
            }
        }
    }
    Ok(option.or(config).unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(WORKERS_MAX)
    }))
}

/// The stages of one server, handed to handlers.
#[derive(Clone, Copy)]
struct Stages {
    accept: StageRef<IoEvent>,
    conn: StageRef<IoEvent>,
    work: StageRef<Work>,
    timer: StageRef<Tick>,
    send: StageRef<Pump>,
    disk: StageRef<DiskDone>,
    /// Continuations of a connection (more body, more pipelined requests): a stage whose
    /// queues hold one per connection and never refuse, unlike `work`'s admission gates.
    cont: StageRef<Cont>,
    /// Readiness of the connections to upstream servers.
    upstream: StageRef<IoEvent>,
    /// A proxied request granted a slot after it waited (never refuses, like `cont`).
    proxy: StageRef<ProxyGo>,
}

/// A running server.
pub struct Server {
    rt: Arc<Runtime>,
    /// Held by a reload (one at a time); it holds what a reload cannot change, as the server
    /// started with it.
    reloading: Mutex<RestartOnly>,
    shared: Arc<ServerShared>,
    boot: StageRef<Boot>,
    work: StageId,
    local_addrs: Vec<SocketAddr>,
}

impl Server {
    /// Binds the listeners and starts the workers.
    pub fn start(config: Config, opts: ServerOptions) -> Result<Server, String> {
        let workers = worker_count(opts.workers, config.server.workers)?;
        // One listening socket per (address, worker) with SO_REUSEPORT, so the kernel spreads
        // connections over the cores; a port 0 is resolved by the first bind.
        let mut per_core: Vec<Vec<TcpListener>> = (0..workers).map(|_| Vec::new()).collect();
        let mut local_addrs = Vec::new();
        for (addr, _) in config.server.listeners() {
            let first =
                bind_reuseport(addr).map_err(|e| format!("cannot listen on {addr}: {e}"))?;
            let actual = first.local_addr().map_err(|e| e.to_string())?;
            local_addrs.push(actual);
            per_core[0].push(first);
            for listeners in per_core.iter_mut().skip(1) {
                listeners.push(
                    bind_reuseport(actual)
                        .map_err(|e| format!("cannot listen on {actual}: {e}"))?,
                );
            }
        }
        let log = Mutex::new(tenants::open_access_log(&config.server.access_log)?);
        let shared = Arc::new(ServerShared {
            workers,
            disk: std::sync::OnceLock::new(),
            live: RwLock::new(Arc::new(Live {
                config: config.clone(),
                tenants: Vec::new(),
                classes: Vec::new(),
                tls: None,
            })),
            live_version: AtomicU64::new(0),
            send_version: AtomicU64::new(0),
            fleet_status: RwLock::new(None),
            stats: ServerStats::default(),
            listeners: Mutex::new(per_core),
            burn_iters_per_us: calibrate_burn(),
            draining: AtomicBool::new(false),
            upstream_counters: Default::default(),
            log,
        });
        let mut b = Runtime::builder()
            .workers(workers)
            .pin(opts.pin)
            .bypass(opts.bypass)
            .wake_credit_ns(config.server.wake_credit_us.saturating_mul(1_000));
        let stages_cell: Arc<std::sync::OnceLock<Stages>> = Arc::new(std::sync::OnceLock::new());
        let boot = {
            let shared = shared.clone();
            let cell = stages_cell.clone();
            b.stage::<Boot, _, _>("http.boot", StageConfig::default(), move |_core| {
                let shared = shared.clone();
                let cell = cell.clone();
                move |ctx: &mut Ctx<'_>, m: Boot| on_boot(ctx, m, &shared, &cell)
            })
            .map_err(|e| e.to_string())?
        };
        let accept = b
            .stage::<IoEvent, _, _>("http.accept", StageConfig::default(), |_| on_accept)
            .map_err(|e| e.to_string())?;
        let conn = b
            .stage::<IoEvent, _, _>(
                "http.conn",
                StageConfig {
                    batch_max: 4,
                    ..Default::default()
                },
                |_| on_conn,
            )
            .map_err(|e| e.to_string())?;
        let work_cfg = StageConfig {
            batch_max: 4,
            // A connection has at most one request with the work stage at a time, so a
            // tenant's queue never holds more than the server's connections: bounding it lower
            // would turn many well-behaved connections into 503s. Overload control is the
            // tenant's p90 target, not this bound.
            queue_limit: config
                .server
                .connections_max
                .clamp(1, omnistage::exec::QUEUE_LIMIT_MAX),
            ..Default::default()
        };
        let work = b
            .stage::<Work, _, _>("http.work", work_cfg, |_| on_work)
            .map_err(|e| e.to_string())?;
        // The timer and send stages' messages are bounded by the connections (at most two
        // deadlines and one pump per connection, and `CONNECTIONS_MAX` is 1,000,000), and
        // their queues must not refuse them: delayed sends pass their queue's gate, and a
        // refused sweep, log flush or pump timer is retried only when other work arms one.
        let bounded_by_connections = StageConfig {
            queue_limit: omnistage::exec::QUEUE_LIMIT_MAX,
            ..Default::default()
        };
        const _: () = assert!(
            3 * crate::config::CONNECTIONS_MAX as usize + 1024 <= omnistage::exec::QUEUE_LIMIT_MAX,
            "the timer and send queues must hold every connection's messages"
        );
        let timer = b
            .stage::<Tick, _, _>("http.timer", bounded_by_connections.clone(), |_| on_tick)
            .map_err(|e| e.to_string())?;
        let send = b
            .stage::<Pump, _, _>("http.send", bounded_by_connections, |_| on_send)
            .map_err(|e| e.to_string())?;
        // One finished read per dispatch: each writes its chunk (FLOW_CHUNK_BYTES) to the
        // socket at once, which on loopback holds the worker for tens to hundreds of µs (the
        // receiver's side of the copy runs in the sender's syscall). Eight of them in one
        // dispatch (the default batch) were the worker's longest stretches under exp
        // adversary's large-files attack (dispatch p99 372-425 µs, 80-96 with one).
        let disk_cfg = StageConfig {
            batch_max: 1,
            ..Default::default()
        };
        let disk_stage = b
            .stage::<DiskDone, _, _>("http.disk", disk_cfg, |_| on_disk)
            .map_err(|e| e.to_string())?;
        let cont_cfg = StageConfig {
            batch_max: 4,
            // At most one continuation per connection is queued, and connections are bounded
            // far below this: the gate never refuses.
            queue_limit: omnistage::exec::QUEUE_LIMIT_MAX,
            ..Default::default()
        };
        let cont = b
            .stage::<Cont, _, _>("http.cont", cont_cfg, |_| on_cont)
            .map_err(|e| e.to_string())?;
        let upstream = b
            .stage::<IoEvent, _, _>(
                "http.upstream",
                StageConfig {
                    batch_max: 4,
                    ..Default::default()
                },
                |_| on_upstream,
            )
            .map_err(|e| e.to_string())?;
        let proxy_cfg = StageConfig {
            batch_max: 4,
            // At most one message per waiting request, and those are bounded by connections.
            queue_limit: omnistage::exec::QUEUE_LIMIT_MAX,
            ..Default::default()
        };
        let proxy = b
            .stage::<ProxyGo, _, _>("http.proxy", proxy_cfg, |_| on_proxy)
            .map_err(|e| e.to_string())?;
        let stages = Stages {
            upstream,
            proxy,
            accept,
            conn,
            work,
            timer,
            send,
            disk: disk_stage,
            cont,
        };
        stages_cell.set(stages).map_err(|_| "stages set twice")?;
        let rt = Arc::new(b.start().map_err(|e| e.to_string())?);
        // From here on the server owns what runs: a step below that fails drops it, and its
        // `Drop` stops and joins the disk readers and the workers (they once kept running: the
        // readers hold the runtime, so a refused certificate left both behind).
        let server = Server {
            rt,
            reloading: Mutex::new(RestartOnly::of(&config.server, workers, opts.workers)),
            shared,
            boot,
            work: work.id(),
            local_addrs,
        };
        let server_cfg = &config.server;
        if server_cfg.disk_threads > 0 {
            let pool = disk::DiskPool::start(
                server_cfg.disk_threads,
                server_cfg.disk_cap_bytes_per_s,
                server.rt.clone(),
                stages,
            )?;
            let _ = server.shared.disk.set(pool);
        }
        let (live, _) = apply_tenants(&server.rt, config, None, work.id(), false)?;
        *server.shared.live.write().expect("live lock") = Arc::new(live);
        for core in 0..workers {
            server
                .rt
                .send(
                    &server.boot,
                    INFRA,
                    Affinity::Core(core as u16),
                    Boot::Start,
                )
                .map_err(|e| format!("cannot start core {core}: {e}"))?;
        }
        Ok(server)
    }

    /// The addresses actually listened on (port 0 resolved).
    pub fn local_addrs(&self) -> &[SocketAddr] {
        &self.local_addrs
    }

    pub fn runtime(&self) -> &Runtime {
        &self.rt
    }

    pub fn stats(&self) -> &ServerStats {
        &self.shared.stats
    }

    /// The stage that answers requests (its gates hold the tenants' admission control).
    pub fn work_stage(&self) -> StageId {
        self.work
    }

    /// Per upstream and tenant: requests in flight, queued and refused, slot-time and bytes
    /// to and from the backends (all cores), sorted by upstream then tenant.
    pub fn upstream_stats(&self) -> Vec<UpstreamTenantStats> {
        upstream_pool::snapshot(&self.shared.upstream_counters)
    }

    /// Starts the drain without waiting for it: every core closes its listeners (new
    /// connections are refused from then on) and its connections idle between requests, and
    /// answers from then on close their connections. For a caller that has other things to
    /// stop before it can call [`Server::drain`] (`omnistage serve` stops its admin API and
    /// fleet thread in between); calling it again, or `drain` after it, starts nothing new.
    pub fn stop_accepting(&self) {
        if self.shared.draining.swap(true, Ordering::AcqRel) {
            return;
        }
        for core in 0..self.rt.workers() {
            let _ = self
                .rt
                .send(&self.boot, INFRA, Affinity::Core(core as u16), Boot::Drain);
        }
    }

    /// Stops accepting ([`Server::stop_accepting`]), lets open connections finish for up to
    /// `grace` (at most [`DRAIN_GRACE_MAX`]), writes out the access log, then stops.
    pub fn drain(self, grace: Duration) {
        self.stop_accepting();
        let workers = self.rt.workers();
        let deadline = Instant::now() + grace.min(DRAIN_GRACE_MAX);
        while Instant::now() < deadline
            && self.shared.stats.open_connections.load(Ordering::Acquire) > 0
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let done = Arc::new(AtomicUsize::new(0));
        let mut asked = 0;
        for core in 0..workers {
            let flush = Boot::FlushLog(done.clone());
            if self
                .rt
                .send(&self.boot, INFRA, Affinity::Core(core as u16), flush)
                .is_ok()
            {
                asked += 1;
            }
        }
        // Bounded wait: a core stuck in a long handler must not hold shutdown forever.
        let deadline = Instant::now() + LOG_FLUSH_WAIT;
        while done.load(Ordering::Acquire) < asked && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        if let Some(pool) = self.shared.disk.get() {
            pool.stop();
        }
        self.rt.shutdown();
        flush_access_log(&self.shared);
    }
}

/// Flushes the access log's writer (the cores' buffers are written into it as they stop).
fn flush_access_log(shared: &ServerShared) {
    if let Ok(mut w) = shared.log.lock() {
        if let Some(w) = w.as_mut() {
            let _ = w.flush();
        }
    }
}

impl Drop for Server {
    /// A server dropped without `drain` still stops its disk readers and workers.
    fn drop(&mut self) {
        if let Some(pool) = self.shared.disk.get() {
            pool.stop();
        }
        self.rt.shutdown();
        flush_access_log(&self.shared);
    }
}
