//! State shared by every core of one server ([`ServerShared`]), the server-wide counters
//! ([`ServerStats`]) and the operator's options ([`ServerOptions`]).

use super::disk;
use super::tenants::Live;
use std::io::Write;
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, RwLock};

/// What the operator may set beyond the config file.
#[derive(Clone, Debug, Default)]
pub struct ServerOptions {
    /// Pin workers to CPUs.
    pub pin: bool,
    /// Override the worker count of the config.
    pub workers: Option<usize>,
    /// Scheduling bypass (FIFO, no accounting): the baseline for overhead experiments.
    pub bypass: bool,
}

/// Counters of the whole server (all cores).
#[derive(Debug, Default)]
pub struct ServerStats {
    pub accepted: AtomicU64,
    pub refused_connections: AtomicU64,
    pub open_connections: AtomicUsize,
    pub requests: AtomicU64,
    pub rejected_503: AtomicU64,
    pub errors_4xx: AtomicU64,
    pub errors_5xx: AtomicU64,
    pub timeouts: AtomicU64,
    /// Requests whose handler panicked (answered 500).
    pub panics: AtomicU64,
}

/// State shared by every core of one server.
pub(super) struct ServerShared {
    pub(super) workers: usize,
    /// The disk stage, when `disk_threads` > 0 (set once the runtime runs).
    pub(super) disk: std::sync::OnceLock<Arc<disk::DiskPool>>,
    pub(super) live: RwLock<Arc<Live>>,
    pub(super) live_version: AtomicU64,
    /// Bumped when a tenant's send weight override changes (the send schedulers re-weight
    /// their tenant nodes, nothing else).
    pub(super) send_version: AtomicU64,
    /// What the fleet layer last computed, for the admin API.
    pub(super) fleet_status: RwLock<Option<Arc<super::FleetStatus>>>,
    pub(super) stats: ServerStats,
    /// Listening sockets, per core, taken by that core's boot message.
    pub(super) listeners: Mutex<Vec<Vec<TcpListener>>>,
    pub(super) burn_iters_per_us: f64,
    pub(super) draining: AtomicBool,
    pub(super) log: Option<Mutex<Box<dyn Write + Send>>>,
    /// Per (upstream, tenant): slots, queues, refusals, bytes (all cores).
    pub(super) upstream_counters: super::upstream_pool::CounterTable,
}
