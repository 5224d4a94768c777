//! The server's configuration and its tenants, read from TOML and validated, and the mapping
//! from a request's Host (or the listener it came in on) to a tenant.
//!
//! # Schema
//!
//! ```toml
//! [server]                          # optional; every key has a default
//! listen = ["127.0.0.1:8080"]       # one or more listeners (default 127.0.0.1:8080), ≤ 64
//! workers = 2                       # optional, 1..=256; omitted = one per CPU, at most 256
//! connections_max = 10000           # 1..=1,000,000; at the limit a new connection takes the
//!                                   # place of the oldest one on its worker that has not yet
//!                                   # completed a request for a tenant, else it is refused
//! header_timeout_ms = 10000         # 1 ms..=1 h; slowloris guard
//! keepalive_timeout_ms = 5000       # 1 ms..=1 h
//! pipeline_depth_max = 16           # 1..=1024
//! access_log = "-"                  # "-" stdout, a path, or omitted for none; a file is
//!                                   # opened again at every reload (rotation by renaming)
//! cache_bytes_max = 268435456       # 0..=1 TiB
//! disk_threads = 2                  # 0..=64 reads in flight on the disk stage; 0 = files are
//!                                   # read inline by the worker (no disk scheduling); restart
//!                                   # only, as the server's disk_cap
//! disk_direct = false               # read files with O_DIRECT (bypass the page cache)
//! disk_cap = "200MB/s"              # optional: the disk read rate all tenants share (reads
//!                                   # that wait for the device; a chunk the page cache holds
//!                                   # is copied by the worker and charged as its tenant's CPU)
//! sendfile = false                  # true: file bodies of sendfile_min_bytes or more go out
//!                                   # with sendfile(2) (page cache → socket, no copy) and are
//!                                   # not cached; off by default: over loopback it measured
//!                                   # no cheaper than the cache (docs/design.md)
//! sendfile_min_bytes = 16384        # 1..=1 GiB; smaller files stay in the cache and go out
//!                                   # with their head in one writev
//! net_link_cap = "100MB/s"          # optional: the link rate all tenants share (as net_cap);
//!                                   # with it, or any tenant's net_cap, sends go through the
//!                                   # byte-fair send scheduler
//! listen_tls = ["127.0.0.1:8443"]   # TLS listeners (default none); with `listen`, ≤ 64 in all,
//!                                   # no address in both; `listen = []` is allowed with them
//! tls_cert = "cert.pem"             # required with listen_tls: the default certificate chain
//! tls_key = "key.pem"               # and its private key (PEM: PKCS#8, PKCS#1 or SEC1), used
//!                                   # when SNI names no tenant with its own; TLS 1.2 and 1.3,
//!                                   # ALPN http/1.1; re-read on reload (SIGHUP): a file that
//!                                   # does not load refuses the reload, the old keeps serving
//! body_bytes_max = 10485760         # 0..=1 TiB; a request body larger than this (on a proxied
//!                                   # route) is answered 413 before it reaches a backend
//! wake_credit_us = 1000             # 0..=1,000,000 µs of CPU a tenant that was idle may take
//!                                   # ahead of busy ones (its burst served at once, not at its
//!                                   # share; never more than its share over time); restart only
//!
//! [[upstream]]                      # optional, ≤ 256: backends that tenants are proxied to
//! name = "app"                      # [a-z0-9_-]{1,64}, unique; named by a tenant's `upstream`
//! servers = ["127.0.0.1:9101"]      # 1..=64 addresses, each once; least-in-flight choice, a
//!                                   # server that refuses or fails is skipped for a back-off
//! concurrency_max = 256             # 1..=100,000 requests in flight to this upstream, all
//!                                   # tenants together (split evenly between the workers);
//!                                   # beyond it requests wait in per-tenant queues
//! connect_timeout_ms = 1000         # 1 ms..=1 h; then the next server, or 502
//! response_timeout_ms = 30000       # 1 ms..=1 h from the request sent until the head: 504;
//!                                   # then the longest gap between the backend's bytes (the
//!                                   # response is cut)
//! idle_connections_max = 64         # 0..=10,000 keep-alive connections kept per worker
//! fair = true                       # true: a freed slot goes to the waiting tenants by weight
//!                                   # (SFQ), and with 16 or more slots per worker up to 1/16 of
//!                                   # them stay free for recently active tenants below their
//!                                   # share; false: one FIFO queue for all (a baseline)
//!
//! [[tenant]]                        # at least one, at most 10,000; tenants and their classes
//!                                   # together at most 32,752 (TENANT_ACTIVITIES_MAX)
//! name = "a"                        # [a-z0-9_-]{1,64}, unique; its activity is /tenants/<name>
//! hosts = ["a.example", "localhost"]  # Host values, matched without port; unique across tenants
//! listen = []                       # listeners (from server.listen or listen_tls) that map
//!                                   # to this tenant without a Host match; a listener belongs
//!                                   # to one tenant
//! tls_cert = "a-cert.pem"           # optional, with tls_key: the certificate served when the
//! tls_key = "a-key.pem"             # client's SNI is one of `hosts` (else the default); the
//!                                   # handshake's CPU is this tenant's once SNI names it
//! weight = 50                       # 1..=10000, default 100
//! docroot = "./www/a"               # relative paths: see below
//! index = ["index.html"]            # default ["index.html"]; plain file names, ≤ 16
//! cpu_cap = "0.5"                   # optional: cores, a number or a string, in (0, 1024]; the
//!                                   # server splits it evenly between its workers
//! net_cap = "10MB/s"                # optional: bytes/s; units B, kB/KB, MB, GB (decimal) and
//!                                   # KiB, MiB, GiB; "/s" required; in [1 B/s, 1 TB/s]
//! disk_cap = "50MB/s"               # optional, as net_cap; device reads only (as disk_cap)
//! cap_kind = "token"                # "token" (default) | "leaky"
//! send_order = "fair"               # under a send scheduler (a net cap), which of the tenant's
//!                                   # pending responses goes out next: "fair" (default; byte
//!                                   # round robin between connections) | "fifo" (arrival
//!                                   # order) | "shortest_first" (fewest bytes left, SRPT) |
//!                                   # "longest_first" (largest response first)
//! cache_bytes = 67108864            # optional budget, ≤ server.cache_bytes_max
//! p90_target_ms = 50                # optional admission target, 1 ms..=1 h (proxied: until the backend's head)
//! connections_max = 2000            # optional, ≤ server.connections_max
//! synthetic = true                  # enables /_burn?us=N and /_bytes?n=N (default false)
//! fleet_rate_per_s = 1000           # optional, needs [cluster]: requests/s for this tenant
//!                                   # across the fleet, 1..=10^9; leased from Redis in
//!                                   # batches, refused with 503 + Retry-After past it
//! fleet_net_cap = "50MB/s"          # optional, needs [cluster]: response bytes/s across the
//!                                   # fleet, units as net_cap; leased likewise
//! upstream = "app"                  # optional: requests are proxied to this [[upstream]]: all
//!                                   # of them (docroot then optional), or with
//! upstream_prefix = "/api/"         # only those whose target starts with this (the rest are
//!                                   # files from docroot); requires upstream
//!
//! [[tenant.class]]                  # optional classes within a tenant, ≤ 64
//! name = "gold"                     # [a-z0-9_-]{1,64}, unique within the tenant
//! header = "x-class: gold"          # exactly one of: header = "name: value" | prefix = "/api/"
//! weight = 80                       # 1..=10000, default 100
//! priority = 0                      # optional, 0..=14 (0 highest): SEDA's class-based admission;
//!                                   #   under overload lower priorities are cut first
//! p90_target_ms = 20                # optional, this class's target (default: the tenant's)
//!
//! [cluster]                         # optional; without it a node is alone (crate
//!                                   # omnistage-fleet, docs/fleet.md)
//! redis = "redis://127.0.0.1:6379"  # the fleet's Redis (redis://[user:pass@]host:port[/db]);
//!                                   # host an IP address (names are not resolved)
//! node = "n1"                       # unique per node, [A-Za-z0-9_.-]{1,64}; default the host
//!                                   # name
//! sync_ms = 100                     # 10..=60000: how often the node publishes its demand and
//!                                   # reads the fleet's (entries live 1.9 × sync_ms)
//! ```
//!
//! Unknown keys are errors. Every error names the line and column of the offending value (or
//! table), e.g. `line 12, column 10: weight 0 is outside 1..=10000`.
//!
//! Host names in `hosts` are lowercased, a trailing dot is dropped, and a port is refused (Host
//! matching ignores ports). A tenant with neither `hosts` nor `listen` is the catch-all; there is
//! at most one.
//!
//! **Relative paths** (`docroot`, `access_log`, `tls_cert`, `tls_key`): [`load_config`] resolves them against the
//! directory of the config file and checks that each docroot is a directory (and stores it
//! canonicalized). [`parse_config`] has no file, so it leaves them as written (relative to the
//! process's working directory) and does not touch the filesystem.
//!
//! **Tenant selection** ([`Config::tenant_for`]): a Host match first, then the tenant bound to the
//! listener, then the catch-all. `None` means no tenant serves this request: the glue answers
//! **421 Misdirected Request** (keep-alive allowed).
//!
//! **Layout**: this file holds the checked types and the entry points; `raw.rs` the form serde
//! reads (values with their spans), `check.rs` the checks of the file and of its `[server]`,
//! `[cluster]` and `[[upstream]]` tables, `tenant.rs` those of a `[[tenant]]` and its classes.

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Most reads in flight on the disk stage.
pub const DISK_THREADS_MAX: i64 = 64;
/// `wake_credit_us`'s bound: the scheduler's own ([`omnistage::sched::WAKE_CREDIT_MAX`], 1 s).
pub const WAKE_CREDIT_US_MAX: i64 = (omnistage::sched::WAKE_CREDIT_MAX / 1_000) as i64;
/// `wake_credit_us`'s default: 1 ms. Measured by `exp adversary` (many-conns and the combined
/// attack, equal weights): with no credit the victim's bursts alternate with the attacker's
/// dispatches and its send→kernel p99 under attack was 0.7-2.2× alone; with 300 µs 0.65-4.5×
/// (median ~1.0), with 1 ms 0.76-1.16× (docs/design.md, "Wake credit").
pub const WAKE_CREDIT_US_DEFAULT: u64 = 1_000;
/// Most listeners of the server.
pub const LISTENERS_MAX: usize = 64;
/// Most worker threads: the runtime's own limit ([`omnistage::exec::WORKERS_MAX`], 256), so a
/// config the check accepts is one the server can start (it accepted up to 1024, which the
/// runtime then refused at start).
pub const WORKERS_MAX: i64 = omnistage::exec::WORKERS_MAX as i64;
/// Most connections, server-wide.
pub const CONNECTIONS_MAX: i64 = 1_000_000;
/// Most pipelined requests per connection.
pub const PIPELINE_DEPTH_MAX: i64 = 1024;
/// Longest timeout: one hour.
pub const TIMEOUT_MS_MAX: i64 = 3_600_000;
/// Largest cache: 1 TiB.
pub const CACHE_BYTES_MAX: i64 = 1 << 40;
/// Largest `sendfile_min_bytes`: 1 GiB.
pub const SENDFILE_MIN_BYTES_MAX: i64 = 1 << 30;
/// Most tenants.
pub const TENANTS_MAX: usize = 10_000;
/// Most tenants and classes together (each is an activity of the runtime): half the runtime's
/// limit ([`omnistage::activity::ACTIVITIES_MAX`], 65,536) less room for its own (the root,
/// `/infra`, `/tenants`, a few the admin API may add), so that a reload replacing every
/// class by new ones still fits while the old ones are live (a reload removes the classes it
/// dropped only once the new configuration applied). [`TENANTS_MAX`] × [`CLASSES_MAX`] alone
/// would allow 650,000.
pub const TENANT_ACTIVITIES_MAX: usize = omnistage::activity::ACTIVITIES_MAX / 2 - 16;
/// Most hosts per tenant.
pub const HOSTS_PER_TENANT_MAX: usize = 1024;
/// Most index file names per tenant.
pub const INDEX_FILES_MAX: usize = 16;
/// Lowest class priority (0 is the highest): 15 levels, plus one for requests in no class,
/// fill the 16 levels of the class-based controller.
pub const CLASS_PRIORITY_MAX: u32 = 14;
/// Most classes per tenant.
pub const CLASSES_MAX: usize = 64;
/// Longest tenant or class name.
pub const NAME_BYTES_MAX: usize = 64;
/// Longest host name.
pub const HOST_BYTES_MAX: usize = 255;
/// Weights lie in `WEIGHT_MIN..=WEIGHT_MAX`.
pub const WEIGHT_MIN: i64 = 1;
/// See [`WEIGHT_MIN`].
pub const WEIGHT_MAX: i64 = 10_000;
/// Weight of a tenant or class that gives none.
pub const WEIGHT_DEFAULT: u32 = 100;
/// Largest `cpu_cap`, in cores.
pub const CPU_CAP_MAX: f64 = 1024.0;
/// Largest rate cap: 1 TB/s.
pub const RATE_BYTES_PER_S_MAX: u64 = 1_000_000_000_000;
/// Most `[[upstream]]` tables.
pub const UPSTREAMS_MAX: usize = 256;
/// Most servers of one upstream.
pub const UPSTREAM_SERVERS_MAX: usize = 64;
/// Largest `concurrency_max` of an upstream.
pub const UPSTREAM_CONCURRENCY_MAX: i64 = 100_000;
/// Largest `idle_connections_max` of an upstream.
pub const UPSTREAM_IDLE_CONNECTIONS_MAX: i64 = 10_000;
/// Largest `body_bytes_max`: 1 TiB.
pub const BODY_BYTES_MAX: i64 = 1 << 40;
/// Largest config file [`load_config`] and [`crate::persist::ConfigFile::load`] read (at start
/// and on every SIGHUP): 4 MiB. A larger one is refused after at most this many bytes plus one
/// are read, so the thread that also handles SIGTERM never reads without bound.
pub const CONFIG_BYTES_MAX: u64 = 4 << 20;

/// The whole configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Server-wide settings.
    pub server: ServerConfig,
    /// The tenants, in file order; [`Config::tenant_for`] returns indexes into this.
    pub tenants: Vec<TenantConfig>,
    /// The fleet this node belongs to (`[cluster]`); `None`: a single node.
    pub cluster: Option<ClusterConfig>,
    /// The upstreams (`[[upstream]]`), in file order; a tenant's `upstream` indexes this.
    pub upstreams: Vec<UpstreamConfig>,
}

/// A group of backend servers that tenants are proxied to (`[[upstream]]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamConfig {
    /// Unique name.
    pub name: String,
    /// The backends, each once.
    pub servers: Vec<SocketAddr>,
    /// Requests in flight to this upstream, all tenants together.
    pub concurrency_max: usize,
    /// Time allowed to connect to a server.
    pub connect_timeout: Duration,
    /// Time allowed from sending a request until its response head arrives (then 504), and
    /// then between two reads of the response (then the response is cut).
    pub response_timeout: Duration,
    /// Idle keep-alive connections kept per worker.
    pub idle_connections_max: usize,
    /// Per-tenant queues served by weight (true), or one FIFO queue (false).
    pub fair: bool,
}

/// Shortest `sync_ms`.
pub const SYNC_MS_MIN: i64 = 10;
/// Longest `sync_ms`.
pub const SYNC_MS_MAX: i64 = 60_000;
/// Default `sync_ms`.
pub const SYNC_MS_DEFAULT: u64 = 100;
/// Longest `redis` URL.
pub const REDIS_URL_BYTES_MAX: usize = 1024;
/// Longest node name.
pub const NODE_NAME_BYTES_MAX: usize = 64;
/// Largest `fleet_rate_per_s`.
pub const FLEET_RATE_PER_S_MAX: i64 = 1_000_000_000;

/// The fleet this node belongs to (`[cluster]`; crate `omnistage-fleet`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    /// The Redis URL (`redis://...`).
    pub redis: String,
    /// This node's name, unique in the fleet; `None`: the host name (the fleet layer reads it).
    pub node: Option<String>,
    /// How often the node publishes and reads the fleet's state.
    pub sync: Duration,
}

/// A tenant's caps across the fleet (enforced by the fleet layer with leases from Redis).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TenantFleet {
    /// Requests/s across the fleet.
    pub rate_per_s: Option<u64>,
    /// Response bytes/s across the fleet.
    pub net_cap_bytes_per_s: Option<u64>,
}

/// Server-wide settings (`[server]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Addresses to listen on.
    pub listen: Vec<SocketAddr>,
    /// Worker threads; `None` = one per CPU.
    pub workers: Option<usize>,
    /// Most open connections.
    pub connections_max: usize,
    /// Time allowed to receive a whole request head.
    pub header_timeout: Duration,
    /// Time an idle keep-alive connection is kept.
    pub keepalive_timeout: Duration,
    /// Most requests parsed ahead on one connection.
    pub pipeline_depth_max: usize,
    /// Where access log lines go.
    pub access_log: AccessLog,
    /// The file cache's global byte limit.
    pub cache_bytes_max: u64,
    /// The link rate all tenants share, bytes/s (enables the send scheduler).
    pub net_link_cap_bytes_per_s: Option<u64>,
    /// Reads in flight on the disk stage (threads of its pool); 0 reads inline.
    pub disk_threads: usize,
    /// Open files with O_DIRECT.
    pub disk_direct: bool,
    /// The disk read rate all tenants share, bytes/s.
    pub disk_cap_bytes_per_s: Option<u64>,
    /// Send file bodies of `sendfile_min_bytes` or more with `sendfile(2)`.
    pub sendfile: bool,
    /// Files at least this long go out with `sendfile` (and are not kept in the cache).
    pub sendfile_min_bytes: u64,
    /// TLS listeners.
    pub listen_tls: Vec<SocketAddr>,
    /// The default certificate chain (PEM), required with `listen_tls`.
    pub tls_cert: Option<PathBuf>,
    /// The default certificate's private key (PEM).
    pub tls_key: Option<PathBuf>,
    /// Largest request body accepted on a proxied route (413 beyond).
    pub body_bytes_max: u64,
    /// CPU time a tenant that was idle may take ahead of the busy ones, µs (the scheduler's
    /// wake credit, [`omnistage::sched::Tree::set_wake_credit`]).
    pub wake_credit_us: u64,
}

impl ServerConfig {
    /// Every listener, plaintext ones first, each with whether it speaks TLS (the order in
    /// which the server binds them).
    pub fn listeners(&self) -> impl Iterator<Item = (SocketAddr, bool)> + '_ {
        self.listen
            .iter()
            .map(|a| (*a, false))
            .chain(self.listen_tls.iter().map(|a| (*a, true)))
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: vec![SocketAddr::from(([127, 0, 0, 1], 8080))],
            workers: None,
            connections_max: 10_000,
            header_timeout: Duration::from_millis(10_000),
            keepalive_timeout: Duration::from_millis(5_000),
            pipeline_depth_max: 16,
            access_log: AccessLog::Off,
            cache_bytes_max: 256 << 20,
            net_link_cap_bytes_per_s: None,
            disk_threads: 2,
            disk_direct: false,
            disk_cap_bytes_per_s: None,
            sendfile: false,
            sendfile_min_bytes: 16 * 1024,
            listen_tls: Vec::new(),
            tls_cert: None,
            tls_key: None,
            body_bytes_max: 10 << 20,
            wake_credit_us: WAKE_CREDIT_US_DEFAULT,
        }
    }
}

/// Where access log lines go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccessLog {
    /// No access log.
    Off,
    /// Standard output (`"-"`).
    Stdout,
    /// Appended to this file.
    File(PathBuf),
}

/// How a rate cap is enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapKind {
    /// Token bucket: bursts up to the bucket, then the rate.
    Token,
    /// Leaky bucket: smooth, no bursts.
    Leaky,
}

/// Which of a tenant's pending responses the send scheduler serves next (`send_order`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SendOrder {
    /// Byte-fair between the tenant's connections (SFQ, one quantum each in turn).
    #[default]
    Fair,
    /// The response that became pending first is served until it is done.
    Fifo,
    /// The response with the fewest bytes left (shortest remaining processing time).
    ShortestFirst,
    /// The largest response (by its bytes when it became pending) until it is done.
    LongestFirst,
}

impl SendOrder {
    /// Every order, in the order the docs list them.
    pub const ALL: [SendOrder; 4] = [
        SendOrder::Fair,
        SendOrder::Fifo,
        SendOrder::ShortestFirst,
        SendOrder::LongestFirst,
    ];

    /// The config spelling.
    pub fn name(self) -> &'static str {
        match self {
            SendOrder::Fair => "fair",
            SendOrder::Fifo => "fifo",
            SendOrder::ShortestFirst => "shortest_first",
            SendOrder::LongestFirst => "longest_first",
        }
    }

    /// Parses the config spelling.
    pub fn parse(s: &str) -> Result<SendOrder, String> {
        SendOrder::ALL
            .into_iter()
            .find(|o| o.name() == s)
            .ok_or_else(|| {
                format!(
                    "send_order {s:?} must be \"fair\", \"fifo\", \"shortest_first\" or \"longest_first\""
                )
            })
    }
}

/// One tenant (`[[tenant]]`).
#[derive(Debug, Clone, PartialEq)]
pub struct TenantConfig {
    /// Unique name; the activity is `/tenants/<name>`.
    pub name: String,
    /// Host names (lowercase, no port) that select this tenant.
    pub hosts: Vec<String>,
    /// Listeners that select this tenant when no Host matched.
    pub listen: Vec<SocketAddr>,
    /// Share weight, 1..=10000.
    pub weight: u32,
    /// Directory served.
    pub docroot: PathBuf,
    /// Index file names tried, in order, for a directory.
    pub index: Vec<String>,
    /// CPU cap in cores (0.5 = half a core).
    pub cpu_cap: Option<f64>,
    /// Network send cap.
    pub net_cap_bytes_per_s: Option<u64>,
    /// Disk read cap.
    pub disk_cap_bytes_per_s: Option<u64>,
    /// How caps are enforced.
    pub cap_kind: CapKind,
    /// Which pending response the send scheduler serves next within the tenant.
    pub send_order: SendOrder,
    /// Cache budget.
    pub cache_bytes: Option<u64>,
    /// 90th-percentile response time target for admission control.
    pub p90_target: Option<Duration>,
    /// Most connections of this tenant.
    pub connections_max: Option<usize>,
    /// Whether `/_burn` and `/_bytes` are served.
    pub synthetic: bool,
    /// Request classes within the tenant.
    pub classes: Vec<ClassConfig>,
    /// The tenant's own certificate chain (PEM), served when SNI names one of its hosts.
    pub tls_cert: Option<PathBuf>,
    /// Its private key (PEM).
    pub tls_key: Option<PathBuf>,
    /// Caps across the fleet (`fleet_rate_per_s`, `fleet_net_cap`).
    pub fleet: TenantFleet,
    /// The upstream (index into [`Config::upstreams`]) this tenant's requests are proxied to.
    pub upstream: Option<usize>,
    /// Only targets starting with this are proxied (`None`: all of them).
    pub upstream_prefix: Option<String>,
}

impl TenantConfig {
    /// The upstream a request for `target` is proxied to, if any.
    pub fn upstream_for(&self, target: &str) -> Option<usize> {
        let u = self.upstream?;
        match &self.upstream_prefix {
            Some(p) if !target.starts_with(p.as_str()) => None,
            _ => Some(u),
        }
    }

    /// The tenant's activity path, `/tenants/<name>`.
    pub fn activity(&self) -> String {
        format!("/tenants/{}", self.name)
    }

    /// A tenant with neither hosts nor listeners: it takes whatever no other tenant takes.
    pub fn is_catch_all(&self) -> bool {
        self.hosts.is_empty() && self.listen.is_empty()
    }
}

/// A class of requests within a tenant (`[[tenant.class]]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassConfig {
    /// Unique within the tenant; the activity is `/tenants/<tenant>/<name>`.
    pub name: String,
    /// Which requests belong to the class.
    pub selector: ClassSelector,
    /// Share weight within the tenant, 1..=10000.
    pub weight: u32,
    /// Admission priority, 0 (highest) ..= [`CLASS_PRIORITY_MAX`]. When any class of a tenant
    /// has one, the tenant's classes share one class-based p90 controller (SEDA): a higher
    /// priority over its target cuts the lower ones first. Requests in no class rank below
    /// every class.
    pub priority: Option<u32>,
    /// The class's own p90 target (default: the tenant's `p90_target_ms`).
    pub p90_target: Option<Duration>,
}

/// How a request is put in a class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClassSelector {
    /// A header field `name` (lowercase) whose trimmed value equals `value`.
    Header {
        /// Header name, lowercase.
        name: String,
        /// Value compared exactly.
        value: String,
    },
    /// The decoded path starts with this prefix.
    Prefix(String),
}

impl Config {
    /// The index in `tenants` of the tenant for a request with this (normalized) Host that
    /// arrived on `listener` (the configured address from `server.listen`, not the socket's
    /// local address): Host match, then listener, then catch-all; `None` → answer 421.
    pub fn tenant_for(&self, host: Option<&str>, listener: SocketAddr) -> Option<usize> {
        if let Some(host) = host {
            if let Some(i) = self
                .tenants
                .iter()
                .position(|t| t.hosts.iter().any(|h| h == host))
            {
                return Some(i);
            }
        }
        if let Some(i) = self
            .tenants
            .iter()
            .position(|t| t.listen.contains(&listener))
        {
            return Some(i);
        }
        self.tenants.iter().position(TenantConfig::is_catch_all)
    }
}

/// A configuration that cannot be used, with where in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The file, when read by [`load_config`].
    pub path: Option<PathBuf>,
    /// 1-based line of the problem, when it has one.
    pub line: Option<usize>,
    /// 1-based column (in characters) of the problem, when it has one.
    pub column: Option<usize>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(path) = &self.path {
            write!(f, "{}: ", path.display())?;
        }
        match (self.line, self.column) {
            (Some(l), Some(c)) => write!(f, "line {l}, column {c}: ")?,
            (Some(l), None) => write!(f, "line {l}: ")?,
            _ => {}
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConfigError {}

/// The configuration used without a file: one tenant `default` serving `cwd` on
/// 127.0.0.1:8080 for any Host, weight 100, no caps, synthetic endpoints off.
pub fn default_config(cwd: &Path) -> Config {
    Config {
        server: ServerConfig::default(),
        tenants: vec![TenantConfig {
            name: "default".into(),
            hosts: Vec::new(),
            listen: Vec::new(),
            weight: WEIGHT_DEFAULT,
            docroot: cwd.to_path_buf(),
            index: vec!["index.html".into()],
            cpu_cap: None,
            net_cap_bytes_per_s: None,
            disk_cap_bytes_per_s: None,
            cap_kind: CapKind::Token,
            send_order: SendOrder::Fair,
            cache_bytes: None,
            p90_target: None,
            connections_max: None,
            synthetic: false,
            classes: Vec::new(),
            tls_cert: None,
            tls_key: None,
            fleet: TenantFleet::default(),
            upstream: None,
            upstream_prefix: None,
        }],
        cluster: None,
        upstreams: Vec::new(),
    }
}

/// Parses and validates a configuration; relative paths are kept as written.
pub fn parse_config(text: &str) -> Result<Config, ConfigError> {
    parse_with_base(text, None)
}

/// Reads, parses and validates a configuration file; relative docroots and access log paths
/// resolve against the file's directory, and docroots must be directories.
pub fn load_config(path: &Path) -> Result<Config, ConfigError> {
    let with_path = |mut e: ConfigError| {
        e.path = Some(path.to_path_buf());
        e
    };
    let plain = |message: String| ConfigError {
        path: Some(path.to_path_buf()),
        line: None,
        column: None,
        message,
    };
    let bytes = read_config_bytes(path).map_err(plain)?;
    let text = String::from_utf8(bytes).map_err(|_| plain("not UTF-8".into()))?;
    parse_config_of_file(&text, path).map_err(with_path)
}

/// The bytes of the config file at `path`, which must be a regular file of at most
/// [`CONFIG_BYTES_MAX`] bytes. Opened without blocking and checked on the open descriptor: a
/// FIFO (or `/dev/stdin` on a pipe or a terminal) would block the reader until someone writes
/// to it, for ever on a SIGHUP, and `/dev/zero` would be read until memory ran out. At most
/// `CONFIG_BYTES_MAX + 1` bytes are read, so a file that grows after the check is refused too.
/// The error is a sentence for [`ConfigError::message`].
pub fn read_config_bytes(path: &Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("cannot read: {e}"))?;
    let meta = file.metadata().map_err(|e| format!("cannot read: {e}"))?;
    if !meta.is_file() {
        return Err(
            "not a regular file (a config must be a file: not a FIFO, a device or a directory)"
                .into(),
        );
    }
    if meta.len() > CONFIG_BYTES_MAX {
        return Err(format!("larger than {CONFIG_BYTES_MAX} bytes"));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(CONFIG_BYTES_MAX + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read: {e}"))?;
    if bytes.len() as u64 > CONFIG_BYTES_MAX {
        return Err(format!("larger than {CONFIG_BYTES_MAX} bytes"));
    }
    Ok(bytes)
}

/// Parses and validates `text`, the contents of the config file at `path`: relative docroots,
/// access logs and certificate paths resolve against the file's directory (not the process's
/// working directory), and docroots must be directories. What [`load_config`] does after
/// reading the file; for callers that read it themselves (to keep its bytes, as
/// [`crate::persist::ConfigFile`] does).
pub fn parse_config_of_file(text: &str, path: &Path) -> Result<Config, ConfigError> {
    let base = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    parse_with_base(text, Some(&base))
}

mod check;
mod raw;
mod tenant;

use check::parse_with_base;
pub use check::{parse_rate, redis_host_ip};

#[cfg(test)]
mod tests;
