//! State shared by every core of one server ([`ServerShared`]), the server-wide counters
//! ([`ServerStats`]) and the operator's options ([`ServerOptions`]).

use super::disk;
use super::tenants::Live;
use std::io::Write;
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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
    /// Connections no tenant had claimed yet (no complete request naming a served Host),
    /// closed, oldest first, to make room for a new one at `connections_max`.
    pub evicted_connections: AtomicU64,
    pub open_connections: AtomicUsize,
    pub requests: AtomicU64,
    pub rejected_503: AtomicU64,
    pub errors_4xx: AtomicU64,
    pub errors_5xx: AtomicU64,
    pub timeouts: AtomicU64,
    /// Requests whose handler panicked (answered 500).
    pub panics: AtomicU64,
    /// TLS handshakes completed.
    pub tls_handshakes: AtomicU64,
    /// TLS handshakes refused: bytes that are not TLS, a protocol error, no common version,
    /// cipher suite or ALPN protocol.
    pub tls_handshake_errors: AtomicU64,
    /// TLS handshakes the client cut short (the connection closed mid-handshake).
    pub tls_handshake_eof: AtomicU64,
    /// TLS handshakes closed by the header timeout (slow or stalled).
    pub tls_handshake_timeouts: AtomicU64,
    /// TLS connections closed on a bad record after their handshake (a decrypt or MAC
    /// failure, a protocol error).
    pub tls_record_errors: AtomicU64,
}

impl ServerStats {
    /// The counters for a metrics page: name (without `_total`), help, value.
    pub fn counters(&self) -> Vec<(&'static str, &'static str, u64)> {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        vec![
            (
                "omnistage_http_connections_accepted",
                "Connections accepted.",
                get(&self.accepted),
            ),
            (
                "omnistage_http_connections_refused",
                "Connections refused over connections_max.",
                get(&self.refused_connections),
            ),
            (
                "omnistage_http_connections_evicted",
                "Connections no tenant had claimed yet (no complete request), closed oldest first to make room at connections_max.",
                get(&self.evicted_connections),
            ),
            (
                "omnistage_http_timeouts",
                "Connections closed (or answered 408) by a header, keep-alive or no-progress deadline.",
                get(&self.timeouts),
            ),
            (
                "omnistage_http_tls_handshakes",
                "TLS handshakes completed.",
                get(&self.tls_handshakes),
            ),
            (
                "omnistage_http_tls_handshake_errors",
                "TLS handshakes refused: not TLS, a protocol error, nothing in common (version, suite, ALPN).",
                get(&self.tls_handshake_errors),
            ),
            (
                "omnistage_http_tls_handshake_eof",
                "TLS handshakes the client cut short (closed mid-handshake).",
                get(&self.tls_handshake_eof),
            ),
            (
                "omnistage_http_tls_handshake_timeouts",
                "TLS handshakes closed by the header timeout (slow or stalled).",
                get(&self.tls_handshake_timeouts),
            ),
            (
                "omnistage_http_tls_record_errors",
                "TLS connections closed on a bad record after the handshake (decrypt or MAC failure, protocol error).",
                get(&self.tls_record_errors),
            ),
        ]
    }
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
    /// Where access-log lines go (`None`: off). Replaced by a reload, which opens the file
    /// again (`tenants::open_access_log`), so a log rotated by renaming is followed.
    pub(super) log: Mutex<Option<Box<dyn Write + Send>>>,
    /// Per (upstream, tenant): slots, queues, refusals, bytes (all cores).
    pub(super) upstream_counters: super::upstream_pool::CounterTable,
}
