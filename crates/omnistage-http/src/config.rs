//! The server's configuration and its tenants, read from TOML and validated, and the mapping
//! from a request's Host (or the listener it came in on) to a tenant.
//!
//! # Schema
//!
//! ```toml
//! [server]                          # optional; every key has a default
//! listen = ["127.0.0.1:8080"]       # one or more listeners (default 127.0.0.1:8080), ≤ 64
//! workers = 2                       # optional, 1..=1024; omitted = one per CPU (the glue decides)
//! connections_max = 10000           # 1..=1,000,000; at the limit a new connection takes the
//!                                   # place of the oldest one on its worker that has not yet
//!                                   # completed a request for a tenant, else it is refused
//! header_timeout_ms = 10000         # 1 ms..=1 h; slowloris guard
//! keepalive_timeout_ms = 5000       # 1 ms..=1 h
//! pipeline_depth_max = 16           # 1..=1024
//! access_log = "-"                  # "-" stdout, a path, or omitted for none
//! cache_bytes_max = 268435456       # 0..=1 TiB
//! disk_threads = 2                  # 0..=64 reads in flight on the disk stage; 0 = files are
//!                                   # read inline by the worker (no disk scheduling)
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
//! [[tenant]]                        # at least one, at most 10,000
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
//! redis = "redis://127.0.0.1:6379"  # the fleet's Redis (redis://[user:pass@]host:port[/db])
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

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

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
/// Most worker threads.
pub const WORKERS_MAX: i64 = 1024;
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
/// Largest config file [`load_config`] reads: 4 MiB.
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
    let meta = std::fs::metadata(path).map_err(|e| plain(format!("cannot read: {e}")))?;
    if meta.len() > CONFIG_BYTES_MAX {
        return Err(plain(format!("larger than {CONFIG_BYTES_MAX} bytes")));
    }
    let text = std::fs::read_to_string(path).map_err(|e| plain(format!("cannot read: {e}")))?;
    parse_config_of_file(&text, path).map_err(with_path)
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

// ---- raw, spanned form as written in the file ----

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    server: Option<Spanned<RawServer>>,
    tenant: Option<Spanned<Vec<Spanned<RawTenant>>>>,
    cluster: Option<Spanned<RawCluster>>,
    upstream: Option<Spanned<Vec<Spanned<RawUpstream>>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    redis: Spanned<String>,
    node: Option<Spanned<String>>,
    sync_ms: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawUpstream {
    name: Spanned<String>,
    servers: Spanned<Vec<Spanned<String>>>,
    concurrency_max: Option<Spanned<i64>>,
    connect_timeout_ms: Option<Spanned<i64>>,
    response_timeout_ms: Option<Spanned<i64>>,
    idle_connections_max: Option<Spanned<i64>>,
    fair: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    listen: Option<Spanned<Vec<Spanned<String>>>>,
    workers: Option<Spanned<i64>>,
    connections_max: Option<Spanned<i64>>,
    header_timeout_ms: Option<Spanned<i64>>,
    keepalive_timeout_ms: Option<Spanned<i64>>,
    pipeline_depth_max: Option<Spanned<i64>>,
    access_log: Option<Spanned<String>>,
    cache_bytes_max: Option<Spanned<i64>>,
    net_link_cap: Option<Spanned<String>>,
    disk_threads: Option<Spanned<i64>>,
    disk_direct: Option<bool>,
    disk_cap: Option<Spanned<String>>,
    sendfile: Option<bool>,
    sendfile_min_bytes: Option<Spanned<i64>>,
    listen_tls: Option<Spanned<Vec<Spanned<String>>>>,
    tls_cert: Option<Spanned<String>>,
    tls_key: Option<Spanned<String>>,
    body_bytes_max: Option<Spanned<i64>>,
    wake_credit_us: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTenant {
    name: Spanned<String>,
    hosts: Option<Spanned<Vec<Spanned<String>>>>,
    listen: Option<Spanned<Vec<Spanned<String>>>>,
    weight: Option<Spanned<i64>>,
    docroot: Option<Spanned<String>>,
    index: Option<Spanned<Vec<Spanned<String>>>>,
    cpu_cap: Option<Spanned<NumberOrString>>,
    net_cap: Option<Spanned<String>>,
    disk_cap: Option<Spanned<String>>,
    cap_kind: Option<Spanned<String>>,
    send_order: Option<Spanned<String>>,
    cache_bytes: Option<Spanned<i64>>,
    p90_target_ms: Option<Spanned<i64>>,
    connections_max: Option<Spanned<i64>>,
    synthetic: Option<bool>,
    class: Option<Vec<Spanned<RawClass>>>,
    tls_cert: Option<Spanned<String>>,
    tls_key: Option<Spanned<String>>,
    fleet_rate_per_s: Option<Spanned<i64>>,
    fleet_net_cap: Option<Spanned<String>>,
    upstream: Option<Spanned<String>>,
    upstream_prefix: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClass {
    name: Spanned<String>,
    header: Option<Spanned<String>>,
    prefix: Option<Spanned<String>>,
    weight: Option<Spanned<i64>>,
    priority: Option<Spanned<i64>>,
    p90_target_ms: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum NumberOrString {
    Number(f64),
    String(String),
}

// ---- validation ----

struct Checker<'a> {
    text: &'a str,
}

impl Checker<'_> {
    fn err(&self, span: Range<usize>, message: impl Into<String>) -> ConfigError {
        let (line, column) = line_col(self.text, span.start);
        ConfigError {
            path: None,
            line: Some(line),
            column: Some(column),
            message: message.into(),
        }
    }

    fn int_in(&self, v: &Spanned<i64>, key: &str, min: i64, max: i64) -> Result<i64, ConfigError> {
        let n = *v.get_ref();
        if n < min || n > max {
            return Err(self.err(v.span(), format!("{key} {n} is outside {min}..={max}")));
        }
        Ok(n)
    }

    fn opt_int_in(
        &self,
        v: &Option<Spanned<i64>>,
        key: &str,
        min: i64,
        max: i64,
    ) -> Result<Option<i64>, ConfigError> {
        v.as_ref()
            .map(|v| self.int_in(v, key, min, max))
            .transpose()
    }

    fn name(&self, v: &Spanned<String>, what: &str) -> Result<String, ConfigError> {
        let s = v.get_ref();
        let ok = !s.is_empty()
            && s.len() <= NAME_BYTES_MAX
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
        if !ok {
            return Err(self.err(
                v.span(),
                format!("{what} name {s:?} must be 1..={NAME_BYTES_MAX} characters of [a-z0-9_-]"),
            ));
        }
        Ok(s.clone())
    }

    fn addr(&self, v: &Spanned<String>) -> Result<SocketAddr, ConfigError> {
        v.get_ref().parse().map_err(|_| {
            self.err(
                v.span(),
                format!(
                    "{:?} is not an address like 127.0.0.1:8080 or [::1]:8080",
                    v.get_ref()
                ),
            )
        })
    }

    /// `tls_cert` and `tls_key`: both or neither, non-empty, relative to the config's directory.
    fn cert_pair(
        &self,
        cert: &Option<Spanned<String>>,
        key: &Option<Spanned<String>>,
        base: Option<&Path>,
    ) -> Result<(Option<PathBuf>, Option<PathBuf>), ConfigError> {
        match (cert, key) {
            (None, None) => Ok((None, None)),
            (Some(c), Some(k)) => {
                for v in [c, k] {
                    if v.get_ref().trim().is_empty() {
                        return Err(self.err(v.span(), "a TLS file path is empty"));
                    }
                }
                Ok((
                    Some(rebase(base, Path::new(c.get_ref()))),
                    Some(rebase(base, Path::new(k.get_ref()))),
                ))
            }
            (Some(v), None) => Err(self.err(v.span(), "tls_cert needs tls_key")),
            (None, Some(v)) => Err(self.err(v.span(), "tls_key needs tls_cert")),
        }
    }

    fn rate(&self, v: &Option<Spanned<String>>, key: &str) -> Result<Option<u64>, ConfigError> {
        v.as_ref()
            .map(|v| parse_rate(v.get_ref()).map_err(|m| self.err(v.span(), format!("{key}: {m}"))))
            .transpose()
    }
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[line_start..].chars().count() + 1;
    (line, column)
}

/// Parses a rate such as `10MB/s`, `1.5 GiB/s`, `500B/s` into bytes per second.
pub fn parse_rate(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let Some(amount) = s.strip_suffix("/s") else {
        return Err(format!("rate {s:?} must end in /s, like \"10MB/s\""));
    };
    let split = amount
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(amount.len());
    let (number, unit) = (&amount[..split], amount[split..].trim());
    let multiplier: u64 = match unit {
        "B" => 1,
        "kB" | "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => {
            return Err(format!(
                "rate {s:?} has unit {unit:?}; use B, kB, KB, MB, GB, KiB, MiB or GiB"
            ))
        }
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("rate {s:?} does not start with a number"))?;
    let bytes = (value * multiplier as f64).round();
    if !(bytes >= 1.0 && bytes <= RATE_BYTES_PER_S_MAX as f64) {
        return Err(format!("rate {s:?} is outside 1 B/s..=1 TB/s"));
    }
    Ok(bytes as u64)
}

/// Normalizes a configured host: lowercase, no trailing dot, no port.
fn normalize_config_host(raw: &str) -> Result<String, String> {
    let lower = raw.trim().to_ascii_lowercase();
    let name = lower.strip_suffix('.').unwrap_or(&lower);
    if name.is_empty() || name.len() > HOST_BYTES_MAX {
        return Err(format!(
            "host {raw:?} must be 1..={HOST_BYTES_MAX} characters"
        ));
    }
    if let Some(inner) = name.strip_prefix('[') {
        let Some(inner) = inner.strip_suffix(']') else {
            return Err(format!(
                "host {raw:?}: an IPv6 literal is written [::1], without a port"
            ));
        };
        if inner.is_empty()
            || !inner
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
        {
            return Err(format!("host {raw:?} is not a valid IPv6 literal"));
        }
        return Ok(name.to_string());
    }
    if name.contains(':') {
        return Err(format!(
            "host {raw:?}: hosts are matched without their port; drop it"
        ));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=%".contains(&b))
    {
        return Err(format!(
            "host {raw:?} has characters a host name cannot have"
        ));
    }
    Ok(name.to_string())
}

fn parse_with_base(text: &str, base: Option<&Path>) -> Result<Config, ConfigError> {
    let c = Checker { text };
    let raw: RawConfig = toml::from_str(text).map_err(|e| {
        let (line, column) = match e.span() {
            Some(span) => {
                let (l, col) = line_col(text, span.start);
                (Some(l), Some(col))
            }
            None => (None, None),
        };
        ConfigError {
            path: None,
            line,
            column,
            message: e.message().trim().to_string(),
        }
    })?;

    let server = match &raw.server {
        Some(s) => server_config(&c, s.get_ref(), base)?,
        None => ServerConfig::default(),
    };

    let Some(raw_tenants) = &raw.tenant else {
        return Err(ConfigError {
            path: None,
            line: None,
            column: None,
            message: "no [[tenant]]: at least one tenant is required".into(),
        });
    };
    if raw_tenants.get_ref().is_empty() {
        return Err(c.err(
            raw_tenants.span(),
            "no [[tenant]]: at least one tenant is required",
        ));
    }
    if raw_tenants.get_ref().len() > TENANTS_MAX {
        return Err(c.err(
            raw_tenants.span(),
            format!("more than {TENANTS_MAX} tenants"),
        ));
    }

    let cluster = raw
        .cluster
        .as_ref()
        .map(|r| cluster_config(&c, r.get_ref()))
        .transpose()?;
    let mut upstreams: Vec<UpstreamConfig> = Vec::new();
    if let Some(list) = &raw.upstream {
        if list.get_ref().len() > UPSTREAMS_MAX {
            return Err(c.err(list.span(), format!("more than {UPSTREAMS_MAX} upstreams")));
        }
        for ru in list.get_ref() {
            let u = upstream_config(&c, ru.get_ref())?;
            if upstreams.iter().any(|x| x.name == u.name) {
                return Err(c.err(
                    ru.get_ref().name.span(),
                    format!("upstream name {:?} is used twice", u.name),
                ));
            }
            upstreams.push(u);
        }
    }

    let mut tenants = Vec::with_capacity(raw_tenants.get_ref().len());
    let mut names = HashSet::new();
    let mut hosts_seen: HashSet<String> = HashSet::new();
    let mut listeners_taken: HashSet<SocketAddr> = HashSet::new();
    let mut catch_all_seen = false;
    for raw_tenant in raw_tenants.get_ref() {
        let t = tenant_config(&c, raw_tenant, &server, &upstreams, base)?;
        let rt = raw_tenant.get_ref();
        if cluster.is_none() {
            let key = (rt
                .fleet_rate_per_s
                .as_ref()
                .map(|v| (v.span(), "fleet_rate_per_s")))
            .or(rt
                .fleet_net_cap
                .as_ref()
                .map(|v| (v.span(), "fleet_net_cap")));
            if let Some((span, key)) = key {
                return Err(c.err(
                    span,
                    format!("{key} needs a [cluster] section (a fleet to share it)"),
                ));
            }
        }
        if !names.insert(t.name.clone()) {
            return Err(c.err(
                rt.name.span(),
                format!("tenant name {:?} is used twice", t.name),
            ));
        }
        for (host, raw_host) in t
            .hosts
            .iter()
            .zip(rt.hosts.iter().flat_map(|h| h.get_ref()))
        {
            if !hosts_seen.insert(host.clone()) {
                return Err(c.err(
                    raw_host.span(),
                    format!("host {host:?} belongs to two tenants"),
                ));
            }
        }
        for (addr, raw_addr) in t
            .listen
            .iter()
            .zip(rt.listen.iter().flat_map(|l| l.get_ref()))
        {
            if !listeners_taken.insert(*addr) {
                return Err(c.err(
                    raw_addr.span(),
                    format!("listener {addr} is bound to two tenants"),
                ));
            }
        }
        if t.is_catch_all() {
            if catch_all_seen {
                return Err(c.err(
                    raw_tenant.span(),
                    format!(
                        "tenant {:?} has neither hosts nor listen, and another tenant is already the catch-all",
                        t.name
                    ),
                ));
            }
            catch_all_seen = true;
        }
        tenants.push(t);
    }
    Ok(Config {
        server,
        tenants,
        cluster,
        upstreams,
    })
}

fn cluster_config(c: &Checker<'_>, r: &RawCluster) -> Result<ClusterConfig, ConfigError> {
    let redis = r.redis.get_ref().trim();
    if !redis.starts_with("redis://")
        || redis.len() <= "redis://".len()
        || redis.len() > REDIS_URL_BYTES_MAX
        || redis
            .bytes()
            .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
    {
        return Err(c.err(
            r.redis.span(),
            format!(
                "redis {:?} must be a URL like \"redis://127.0.0.1:6379\" of at most {REDIS_URL_BYTES_MAX} bytes",
                r.redis.get_ref()
            ),
        ));
    }
    let node = match &r.node {
        None => None,
        Some(v) => {
            let s = v.get_ref();
            let ok = !s.is_empty()
                && s.len() <= NODE_NAME_BYTES_MAX
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
            if !ok {
                return Err(c.err(
                    v.span(),
                    format!(
                        "node {s:?} must be 1..={NODE_NAME_BYTES_MAX} characters of [A-Za-z0-9_.-]"
                    ),
                ));
            }
            Some(s.clone())
        }
    };
    let sync_ms = c
        .opt_int_in(&r.sync_ms, "sync_ms", SYNC_MS_MIN, SYNC_MS_MAX)?
        .map_or(SYNC_MS_DEFAULT, |n| n as u64);
    Ok(ClusterConfig {
        redis: redis.to_string(),
        node,
        sync: Duration::from_millis(sync_ms),
    })
}

fn server_config(
    c: &Checker<'_>,
    s: &RawServer,
    base: Option<&Path>,
) -> Result<ServerConfig, ConfigError> {
    let d = ServerConfig::default();
    let tls_listeners = s.listen_tls.as_ref().map_or(0, |l| l.get_ref().len());
    let listen = match &s.listen {
        Some(list) => {
            let n = list.get_ref().len();
            if (n == 0 && tls_listeners == 0) || n + tls_listeners > LISTENERS_MAX {
                return Err(c.err(
                    list.span(),
                    format!(
                        "listen must have 1..={LISTENERS_MAX} addresses (with listen_tls: 0..={LISTENERS_MAX} in all)"
                    ),
                ));
            }
            let mut out = Vec::new();
            for a in list.get_ref() {
                let addr = c.addr(a)?;
                if out.contains(&addr) {
                    return Err(c.err(a.span(), format!("listener {addr} is given twice")));
                }
                out.push(addr);
            }
            out
        }
        None => d.listen,
    };
    let mut listen_tls = Vec::new();
    if let Some(list) = &s.listen_tls {
        if listen.len() + list.get_ref().len() > LISTENERS_MAX {
            return Err(c.err(
                list.span(),
                format!("listen and listen_tls have more than {LISTENERS_MAX} addresses"),
            ));
        }
        for a in list.get_ref() {
            let addr = c.addr(a)?;
            if listen.contains(&addr) || listen_tls.contains(&addr) {
                return Err(c.err(a.span(), format!("listener {addr} is given twice")));
            }
            listen_tls.push(addr);
        }
    }
    let (tls_cert, tls_key) = c.cert_pair(&s.tls_cert, &s.tls_key, base)?;
    if !listen_tls.is_empty() && tls_cert.is_none() {
        let span = s.listen_tls.as_ref().map_or(0..0, |l| l.span());
        return Err(c.err(
            span,
            "listen_tls needs the default certificate: set tls_cert and tls_key in [server]",
        ));
    }
    let ms =
        |v: &Option<Spanned<i64>>, key: &str, default: Duration| -> Result<Duration, ConfigError> {
            Ok(c.opt_int_in(v, key, 1, TIMEOUT_MS_MAX)?
                .map_or(default, |n| Duration::from_millis(n as u64)))
        };
    let access_log = match &s.access_log {
        None => AccessLog::Off,
        Some(v) if v.get_ref() == "-" => AccessLog::Stdout,
        Some(v) if v.get_ref().trim().is_empty() => {
            return Err(c.err(
                v.span(),
                "access_log is empty: use \"-\" for stdout or omit it",
            ))
        }
        Some(v) => AccessLog::File(rebase(base, Path::new(v.get_ref()))),
    };
    Ok(ServerConfig {
        listen,
        workers: c
            .opt_int_in(&s.workers, "workers", 1, WORKERS_MAX)?
            .map(|n| n as usize),
        connections_max: c
            .opt_int_in(&s.connections_max, "connections_max", 1, CONNECTIONS_MAX)?
            .map_or(d.connections_max, |n| n as usize),
        header_timeout: ms(&s.header_timeout_ms, "header_timeout_ms", d.header_timeout)?,
        keepalive_timeout: ms(
            &s.keepalive_timeout_ms,
            "keepalive_timeout_ms",
            d.keepalive_timeout,
        )?,
        pipeline_depth_max: c
            .opt_int_in(
                &s.pipeline_depth_max,
                "pipeline_depth_max",
                1,
                PIPELINE_DEPTH_MAX,
            )?
            .map_or(d.pipeline_depth_max, |n| n as usize),
        access_log,
        cache_bytes_max: c
            .opt_int_in(&s.cache_bytes_max, "cache_bytes_max", 0, CACHE_BYTES_MAX)?
            .map_or(d.cache_bytes_max, |n| n as u64),
        net_link_cap_bytes_per_s: c.rate(&s.net_link_cap, "net_link_cap")?,
        disk_threads: c
            .opt_int_in(&s.disk_threads, "disk_threads", 0, DISK_THREADS_MAX)?
            .map_or(d.disk_threads, |n| n as usize),
        disk_direct: s.disk_direct.unwrap_or(d.disk_direct),
        disk_cap_bytes_per_s: c.rate(&s.disk_cap, "disk_cap")?,
        sendfile: s.sendfile.unwrap_or(d.sendfile),
        sendfile_min_bytes: c
            .opt_int_in(
                &s.sendfile_min_bytes,
                "sendfile_min_bytes",
                1,
                SENDFILE_MIN_BYTES_MAX,
            )?
            .map_or(d.sendfile_min_bytes, |n| n as u64),
        listen_tls,
        tls_cert,
        tls_key,
        body_bytes_max: c
            .opt_int_in(&s.body_bytes_max, "body_bytes_max", 0, BODY_BYTES_MAX)?
            .map_or(d.body_bytes_max, |n| n as u64),
        wake_credit_us: c
            .opt_int_in(&s.wake_credit_us, "wake_credit_us", 0, WAKE_CREDIT_US_MAX)?
            .map_or(d.wake_credit_us, |n| n as u64),
    })
}

fn upstream_config(c: &Checker<'_>, u: &RawUpstream) -> Result<UpstreamConfig, ConfigError> {
    let name = c.name(&u.name, "upstream")?;
    let list = &u.servers;
    if list.get_ref().is_empty() || list.get_ref().len() > UPSTREAM_SERVERS_MAX {
        return Err(c.err(
            list.span(),
            format!("servers must have 1..={UPSTREAM_SERVERS_MAX} addresses"),
        ));
    }
    let mut servers = Vec::new();
    for a in list.get_ref() {
        let addr = c.addr(a)?;
        if servers.contains(&addr) {
            return Err(c.err(a.span(), format!("server {addr} is given twice")));
        }
        servers.push(addr);
    }
    let ms =
        |v: &Option<Spanned<i64>>, key: &str, default_ms: u64| -> Result<Duration, ConfigError> {
            Ok(Duration::from_millis(
                c.opt_int_in(v, key, 1, TIMEOUT_MS_MAX)?
                    .map_or(default_ms, |n| n as u64),
            ))
        };
    Ok(UpstreamConfig {
        servers,
        concurrency_max: c
            .opt_int_in(
                &u.concurrency_max,
                "concurrency_max",
                1,
                UPSTREAM_CONCURRENCY_MAX,
            )?
            .map_or(256, |n| n as usize),
        connect_timeout: ms(&u.connect_timeout_ms, "connect_timeout_ms", 1000)?,
        response_timeout: ms(&u.response_timeout_ms, "response_timeout_ms", 30_000)?,
        idle_connections_max: c
            .opt_int_in(
                &u.idle_connections_max,
                "idle_connections_max",
                0,
                UPSTREAM_IDLE_CONNECTIONS_MAX,
            )?
            .map_or(64, |n| n as usize),
        fair: u.fair.unwrap_or(true),
        name,
    })
}

fn rebase(base: Option<&Path>, p: &Path) -> PathBuf {
    match base {
        Some(b) if p.is_relative() => b.join(p),
        _ => p.to_path_buf(),
    }
}

fn tenant_config(
    c: &Checker<'_>,
    table: &Spanned<RawTenant>,
    server: &ServerConfig,
    upstreams: &[UpstreamConfig],
    base: Option<&Path>,
) -> Result<TenantConfig, ConfigError> {
    let t = table.get_ref();
    let name = c.name(&t.name, "tenant")?;

    let mut hosts = Vec::new();
    if let Some(list) = &t.hosts {
        if list.get_ref().len() > HOSTS_PER_TENANT_MAX {
            return Err(c.err(
                list.span(),
                format!("more than {HOSTS_PER_TENANT_MAX} hosts"),
            ));
        }
        for h in list.get_ref() {
            let host = normalize_config_host(h.get_ref()).map_err(|m| c.err(h.span(), m))?;
            if hosts.contains(&host) {
                return Err(c.err(h.span(), format!("host {host:?} is given twice")));
            }
            hosts.push(host);
        }
    }

    let mut listen = Vec::new();
    for a in t.listen.iter().flat_map(|l| l.get_ref()) {
        let addr = c.addr(a)?;
        if !server.listen.contains(&addr) && !server.listen_tls.contains(&addr) {
            return Err(c.err(
                a.span(),
                format!("listener {addr} is not in server.listen or server.listen_tls"),
            ));
        }
        if listen.contains(&addr) {
            return Err(c.err(a.span(), format!("listener {addr} is given twice")));
        }
        listen.push(addr);
    }

    let weight = c
        .opt_int_in(&t.weight, "weight", WEIGHT_MIN, WEIGHT_MAX)?
        .map_or(WEIGHT_DEFAULT, |n| n as u32);

    let upstream = match &t.upstream {
        None => None,
        Some(v) => Some(
            upstreams
                .iter()
                .position(|u| &u.name == v.get_ref())
                .ok_or_else(|| {
                    c.err(v.span(), format!("no [[upstream]] named {:?}", v.get_ref()))
                })?,
        ),
    };
    let upstream_prefix = match &t.upstream_prefix {
        None => None,
        Some(v) if upstream.is_none() => {
            return Err(c.err(v.span(), "upstream_prefix needs an upstream"));
        }
        Some(v) if !v.get_ref().starts_with('/') => {
            return Err(c.err(v.span(), "upstream_prefix must start with \"/\""));
        }
        Some(v) => Some(v.get_ref().clone()),
    };
    // A tenant proxied whole needs no docroot; any other does.
    let docroot = match &t.docroot {
        None if upstream.is_some() && upstream_prefix.is_none() => PathBuf::new(),
        None => {
            return Err(c.err(
                table.span(),
                format!("tenant {name:?} has no docroot (only a tenant proxied whole may omit it)"),
            ))
        }
        Some(d) => {
            let docroot_raw = d.get_ref();
            if docroot_raw.trim().is_empty() {
                return Err(c.err(d.span(), "docroot is empty"));
            }
            let mut docroot = rebase(base, Path::new(docroot_raw));
            if base.is_some() {
                let canonical = docroot
                    .canonicalize()
                    .ok()
                    .filter(|p| p.is_dir())
                    .ok_or_else(|| {
                        c.err(
                            d.span(),
                            format!("docroot {} is not a directory", docroot.display()),
                        )
                    })?;
                docroot = canonical;
            }
            docroot
        }
    };

    let index = match &t.index {
        None => vec!["index.html".to_string()],
        Some(list) => {
            if list.get_ref().len() > INDEX_FILES_MAX {
                return Err(c.err(
                    list.span(),
                    format!("more than {INDEX_FILES_MAX} index files"),
                ));
            }
            let mut out = Vec::new();
            for f in list.get_ref() {
                let s = f.get_ref();
                if s.is_empty() || s == "." || s == ".." || s.contains(['/', '\\', '\0']) {
                    return Err(c.err(f.span(), format!("index {s:?} must be a plain file name")));
                }
                out.push(s.clone());
            }
            out
        }
    };

    let cpu_cap = match &t.cpu_cap {
        None => None,
        Some(v) => {
            let n = match v.get_ref() {
                NumberOrString::Number(n) => Some(*n),
                NumberOrString::String(s) => s.trim().parse::<f64>().ok(),
            };
            match n {
                Some(n) if n.is_finite() && n > 0.0 && n <= CPU_CAP_MAX => Some(n),
                _ => {
                    return Err(c.err(
                        v.span(),
                        format!(
                            "cpu_cap must be a number of cores in (0, {CPU_CAP_MAX}], like \"0.5\""
                        ),
                    ))
                }
            }
        }
    };

    let cap_kind = match &t.cap_kind {
        None => CapKind::Token,
        Some(v) => match v.get_ref().as_str() {
            "token" => CapKind::Token,
            "leaky" => CapKind::Leaky,
            other => {
                return Err(c.err(
                    v.span(),
                    format!("cap_kind {other:?} must be \"token\" or \"leaky\""),
                ))
            }
        },
    };

    let send_order = match &t.send_order {
        None => SendOrder::Fair,
        Some(v) => SendOrder::parse(v.get_ref()).map_err(|e| c.err(v.span(), e))?,
    };

    let cache_max = i64::try_from(server.cache_bytes_max).unwrap_or(CACHE_BYTES_MAX);
    let conn_max = i64::try_from(server.connections_max).unwrap_or(CONNECTIONS_MAX);

    let mut classes: Vec<ClassConfig> = Vec::new();
    if let Some(list) = &t.class {
        if list.len() > CLASSES_MAX {
            return Err(c.err(
                list[CLASSES_MAX].span(),
                format!("more than {CLASSES_MAX} classes"),
            ));
        }
        for rc in list {
            let class = class_config(c, rc)?;
            if classes.iter().any(|k| k.name == class.name) {
                return Err(c.err(
                    rc.get_ref().name.span(),
                    format!(
                        "class name {:?} is used twice in tenant {name:?}",
                        class.name
                    ),
                ));
            }
            classes.push(class);
        }
    }
    let p90_target = c
        .opt_int_in(&t.p90_target_ms, "p90_target_ms", 1, TIMEOUT_MS_MAX)?
        .map(|n| Duration::from_millis(n as u64));
    if let (Some(list), None) = (&t.class, p90_target) {
        for (rc, class) in list.iter().zip(&classes) {
            if class.priority.is_some() && class.p90_target.is_none() {
                return Err(c.err(
                    rc.span(),
                    format!(
                        "class {:?} has a priority but no target: set its p90_target_ms or the tenant's",
                        class.name
                    ),
                ));
            }
        }
    }

    let (tls_cert, tls_key) = c.cert_pair(&t.tls_cert, &t.tls_key, base)?;
    if let (Some(v), true) = (&t.tls_cert, server.listen_tls.is_empty()) {
        return Err(c.err(
            v.span(),
            "tls_cert is set but the server has no listen_tls to serve it on",
        ));
    }

    Ok(TenantConfig {
        tls_cert,
        tls_key,
        hosts,
        listen,
        weight,
        docroot,
        index,
        cpu_cap,
        net_cap_bytes_per_s: c.rate(&t.net_cap, "net_cap")?,
        disk_cap_bytes_per_s: c.rate(&t.disk_cap, "disk_cap")?,
        cap_kind,
        send_order,
        cache_bytes: c
            .opt_int_in(&t.cache_bytes, "cache_bytes", 0, cache_max)?
            .map(|n| n as u64),
        p90_target,
        connections_max: c
            .opt_int_in(&t.connections_max, "connections_max", 1, conn_max)?
            .map(|n| n as usize),
        synthetic: t.synthetic.unwrap_or(false),
        classes,
        upstream,
        upstream_prefix,
        name,
        fleet: TenantFleet {
            rate_per_s: c
                .opt_int_in(
                    &t.fleet_rate_per_s,
                    "fleet_rate_per_s",
                    1,
                    FLEET_RATE_PER_S_MAX,
                )?
                .map(|n| n as u64),
            net_cap_bytes_per_s: c.rate(&t.fleet_net_cap, "fleet_net_cap")?,
        },
    })
}

fn class_config(c: &Checker<'_>, rc: &Spanned<RawClass>) -> Result<ClassConfig, ConfigError> {
    let r = rc.get_ref();
    let name = c.name(&r.name, "class")?;
    let selector = match (&r.header, &r.prefix) {
        (Some(h), None) => {
            let Some((n, v)) = h.get_ref().split_once(':') else {
                return Err(c.err(h.span(), "header must be \"name: value\""));
            };
            let (n, v) = (n.trim(), v.trim());
            let token = !n.is_empty()
                && n.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
            if !token || v.is_empty() {
                return Err(c.err(
                    h.span(),
                    "header must be \"name: value\" with a token name and a value",
                ));
            }
            ClassSelector::Header {
                name: n.to_ascii_lowercase(),
                value: v.to_string(),
            }
        }
        (None, Some(p)) => {
            if !p.get_ref().starts_with('/') {
                return Err(c.err(p.span(), "prefix must start with /"));
            }
            ClassSelector::Prefix(p.get_ref().clone())
        }
        _ => {
            return Err(c.err(
                rc.span(),
                format!("class {name:?} needs exactly one of header or prefix"),
            ))
        }
    };
    let weight = c
        .opt_int_in(&r.weight, "weight", WEIGHT_MIN, WEIGHT_MAX)?
        .map_or(WEIGHT_DEFAULT, |n| n as u32);
    Ok(ClassConfig {
        name,
        selector,
        weight,
        priority: c
            .opt_int_in(&r.priority, "priority", 0, i64::from(CLASS_PRIORITY_MAX))?
            .map(|n| n as u32),
        p90_target: c
            .opt_int_in(&r.p90_target_ms, "p90_target_ms", 1, TIMEOUT_MS_MAX)?
            .map(|n| Duration::from_millis(n as u64)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: &str = r#"
[server]
listen = ["127.0.0.1:8080", "127.0.0.1:8081"]
workers = 2
connections_max = 10000
header_timeout_ms = 10000
keepalive_timeout_ms = 5000
pipeline_depth_max = 16
access_log = "-"
cache_bytes_max = 268435456

[[tenant]]
name = "a"
hosts = ["A.Example", "localhost."]
weight = 50
docroot = "./www/a"
index = ["index.html", "index.htm"]
cpu_cap = "0.5"
net_cap = "10MB/s"
disk_cap = "50MB/s"
cap_kind = "leaky"
send_order = "shortest_first"
cache_bytes = 67108864
p90_target_ms = 50
connections_max = 2000
synthetic = true
[[tenant.class]]
name = "gold"
header = "X-Class: gold"
weight = 80
priority = 0
p90_target_ms = 20
[[tenant.class]]
name = "api"
prefix = "/api/"

[[tenant]]
name = "b"
listen = ["127.0.0.1:8081"]
docroot = "/srv/b"
cpu_cap = 1.5

[[tenant]]
name = "c"
docroot = "www/c"
cpu_cap = 2
"#;

    fn err(text: &str) -> ConfigError {
        parse_config(text).expect_err("should be refused")
    }

    #[test]
    fn send_order_names_round_trip() {
        for o in SendOrder::ALL {
            assert_eq!(SendOrder::parse(o.name()), Ok(o));
        }
        assert!(SendOrder::parse("").is_err());
    }

    #[test]
    fn full_example() {
        let cfg = parse_config(FULL).unwrap();
        let s = &cfg.server;
        assert_eq!(
            s.listen,
            vec![
                "127.0.0.1:8080".parse().unwrap(),
                "127.0.0.1:8081".parse().unwrap()
            ]
        );
        assert_eq!(s.workers, Some(2));
        assert_eq!(s.connections_max, 10_000);
        assert_eq!(s.header_timeout, Duration::from_secs(10));
        assert_eq!(s.keepalive_timeout, Duration::from_secs(5));
        assert_eq!(s.pipeline_depth_max, 16);
        assert_eq!(s.access_log, AccessLog::Stdout);
        assert_eq!(s.cache_bytes_max, 268_435_456);
        assert!(!s.sendfile, "sendfile is off by default");
        assert_eq!(s.sendfile_min_bytes, 16 * 1024);
        let a = &cfg.tenants[0];
        assert_eq!(a.name, "a");
        assert_eq!(a.activity(), "/tenants/a");
        assert_eq!(a.hosts, vec!["a.example", "localhost"]);
        assert_eq!(a.weight, 50);
        assert_eq!(a.docroot, PathBuf::from("./www/a"));
        assert_eq!(a.index, vec!["index.html", "index.htm"]);
        assert_eq!(a.cpu_cap, Some(0.5));
        assert_eq!(a.net_cap_bytes_per_s, Some(10_000_000));
        assert_eq!(a.disk_cap_bytes_per_s, Some(50_000_000));
        assert_eq!(a.cap_kind, CapKind::Leaky);
        assert_eq!(a.send_order, SendOrder::ShortestFirst);
        assert_eq!(a.cache_bytes, Some(67_108_864));
        assert_eq!(a.p90_target, Some(Duration::from_millis(50)));
        assert_eq!(a.connections_max, Some(2000));
        assert!(a.synthetic);
        assert_eq!(
            a.classes,
            vec![
                ClassConfig {
                    name: "gold".into(),
                    selector: ClassSelector::Header {
                        name: "x-class".into(),
                        value: "gold".into()
                    },
                    weight: 80,
                    priority: Some(0),
                    p90_target: Some(Duration::from_millis(20)),
                },
                ClassConfig {
                    name: "api".into(),
                    selector: ClassSelector::Prefix("/api/".into()),
                    weight: 100,
                    priority: None,
                    p90_target: None,
                },
            ]
        );
        let b = &cfg.tenants[1];
        assert_eq!(b.weight, WEIGHT_DEFAULT);
        assert_eq!(b.send_order, SendOrder::Fair);
        assert_eq!(b.cpu_cap, Some(1.5));
        assert_eq!(b.cap_kind, CapKind::Token);
        assert!(!b.synthetic);
        assert_eq!(b.index, vec!["index.html"]);
        assert!(cfg.tenants[2].is_catch_all());
        assert_eq!(cfg.tenants[2].cpu_cap, Some(2.0));
    }

    #[test]
    fn minimal_uses_defaults() {
        let cfg = parse_config("[[tenant]]\nname = \"x\"\ndocroot = \".\"\n").unwrap();
        assert_eq!(cfg.server, ServerConfig::default());
        assert_eq!(cfg.server.access_log, AccessLog::Off);
        assert_eq!(cfg.tenants.len(), 1);
    }

    #[test]
    fn tenant_selection() {
        let cfg = parse_config(FULL).unwrap();
        let l0: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let l1: SocketAddr = "127.0.0.1:8081".parse().unwrap();
        assert_eq!(cfg.tenant_for(Some("a.example"), l0), Some(0));
        assert_eq!(
            cfg.tenant_for(Some("localhost"), l1),
            Some(0),
            "host beats listener"
        );
        assert_eq!(cfg.tenant_for(Some("other"), l1), Some(1));
        assert_eq!(cfg.tenant_for(None, l1), Some(1));
        assert_eq!(cfg.tenant_for(Some("other"), l0), Some(2), "catch-all");
        assert_eq!(cfg.tenant_for(None, l0), Some(2));

        let no_catch_all =
            parse_config("[[tenant]]\nname = \"a\"\nhosts = [\"a.test\"]\ndocroot = \".\"\n")
                .unwrap();
        assert_eq!(no_catch_all.tenant_for(Some("a.test"), l0), Some(0));
        assert_eq!(no_catch_all.tenant_for(Some("b.test"), l0), None);
        assert_eq!(no_catch_all.tenant_for(None, l0), None);
    }

    #[test]
    fn default_config_serves_cwd() {
        let cfg = default_config(Path::new("/tmp/site"));
        assert_eq!(
            cfg.server.listen,
            vec![SocketAddr::from(([127, 0, 0, 1], 8080))]
        );
        assert_eq!(cfg.tenants.len(), 1);
        let t = &cfg.tenants[0];
        assert_eq!(t.name, "default");
        assert_eq!(t.docroot, PathBuf::from("/tmp/site"));
        assert_eq!(t.weight, 100);
        assert!(!t.synthetic);
        assert!(t.hosts.is_empty());
        assert_eq!(
            cfg.tenant_for(Some("anything"), "10.0.0.1:1".parse().unwrap()),
            Some(0)
        );
    }

    #[test]
    fn errors_name_the_line() {
        let text = "[[tenant]]\nname = \"a\"\ndocroot = \".\"\nweight = 0\n";
        let e = err(text);
        assert_eq!(e.line, Some(4));
        assert_eq!(e.column, Some(10));
        assert_eq!(
            e.to_string(),
            "line 4, column 10: weight 0 is outside 1..=10000"
        );
    }

    #[test]
    fn unknown_keys_are_errors_with_lines() {
        let e = err("[server]\nlisten = [\"127.0.0.1:1\"]\nworkerz = 2\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n");
        assert_eq!(e.line, Some(3), "{e}");
        assert!(e.message.contains("workerz"), "{e}");
        let e = err("[[tenant]]\nname = \"a\"\ndocroot = \".\"\ncolour = \"red\"\n");
        assert_eq!(e.line, Some(4), "{e}");
        let e = err("[[tenant]]\nname = \"a\"\ndocroot = \".\"\n[[tenant.class]]\nname = \"g\"\nprefix = \"/\"\nx = 1\n");
        assert_eq!(e.line, Some(7), "{e}");
        let e = err("[serve]\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n");
        assert_eq!(e.line, Some(1), "{e}");
    }

    #[test]
    fn syntax_and_type_errors_have_lines() {
        let e = err("[[tenant]]\nname = \"a\"\ndocroot = \".\"\nweight = \"heavy\"\n");
        assert_eq!(e.line, Some(4), "{e}");
        let e = err("[[tenant]]\nname = \"a\"\ndocroot = \n");
        assert_eq!(e.line, Some(3), "{e}");
        let e = err("[[tenant]]\nname = \"a\"\n");
        assert_eq!(e.line, Some(1), "{e}");
        assert!(e.message.contains("docroot"), "{e}");
    }

    #[test]
    fn upstreams_defaults_and_rules() {
        let up = "[[upstream]]\nname = \"app\"\nservers = [\"127.0.0.1:9101\"]\n";
        let c = parse_config(&format!(
            "{up}[[tenant]]\nname = \"a\"\nupstream = \"app\"\n"
        ))
        .unwrap();
        let u = &c.upstreams[0];
        assert_eq!(
            (u.concurrency_max, u.idle_connections_max, u.fair),
            (256, 64, true)
        );
        assert_eq!(u.connect_timeout, Duration::from_millis(1000));
        assert_eq!(u.response_timeout, Duration::from_millis(30_000));
        assert_eq!(c.server.body_bytes_max, 10 << 20);
        assert_eq!(c.server.wake_credit_us, WAKE_CREDIT_US_DEFAULT);
        let t = &c.tenants[0];
        assert_eq!((t.upstream, t.upstream_for("/x")), (Some(0), Some(0)));
        let c = parse_config(&format!(
            "{up}[[tenant]]\nname = \"a\"\ndocroot = \".\"\nupstream = \"app\"\nupstream_prefix = \"/api/\"\n"
        ))
        .unwrap();
        assert_eq!(c.tenants[0].upstream_for("/api/x"), Some(0));
        assert_eq!(c.tenants[0].upstream_for("/x"), None);
        for (text, want) in [
            (
                format!("{up}[[tenant]]\nname = \"a\"\nupstream = \"nope\"\n"),
                "no [[upstream]] named",
            ),
            (
                format!("{up}[[tenant]]\nname = \"a\"\ndocroot = \".\"\nupstream_prefix = \"/a\"\n"),
                "needs an upstream",
            ),
            (
                format!("{up}[[tenant]]\nname = \"a\"\nupstream = \"app\"\nupstream_prefix = \"/a\"\n"),
                "no docroot",
            ),
            (
                format!("{up}[[tenant]]\nname = \"a\"\ndocroot = \".\"\nupstream = \"app\"\nupstream_prefix = \"a\"\n"),
                "must start with",
            ),
            (
                format!("{up}{up}[[tenant]]\nname = \"a\"\ndocroot = \".\"\n"),
                "used twice",
            ),
            (
                "[[upstream]]\nname = \"app\"\nservers = []\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n".into(),
                "servers must have",
            ),
            (
                "[[upstream]]\nname = \"app\"\nservers = [\"127.0.0.1:1\", \"127.0.0.1:1\"]\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n".into(),
                "given twice",
            ),
            (
                format!("{up}concurrency_max = 0\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n"),
                "concurrency_max 0 is outside",
            ),
            (
                format!("{up}response_timeout_ms = 0\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n"),
                "response_timeout_ms 0 is outside",
            ),
            (
                format!("{up}retries = 3\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n"),
                "unknown field",
            ),
            (
                "[server]\nbody_bytes_max = -1\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n".into(),
                "body_bytes_max -1 is outside",
            ),
            (
                "[server]\nwake_credit_us = 1000001\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n".into(),
                "wake_credit_us 1000001 is outside 0..=1000000",
            ),
            (
                "[server]\nwake_credit_us = -1\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n".into(),
                "wake_credit_us -1 is outside",
            ),
        ] {
            let e = err(&text);
            assert!(e.message.contains(want), "{e} for\n{text}");
            assert!(e.line.is_some(), "{e}");
        }
    }

    #[test]
    fn validation_rules() {
        let tenant = |extra: &str| format!("[[tenant]]\nname = \"a\"\ndocroot = \".\"\n{extra}\n");
        let cases: Vec<(String, usize, &str)> = vec![
            ("".into(), 0, "at least one tenant"),
            ("[server]\nworkers = 2\n".into(), 0, "at least one tenant"),
            ("tenant = []\n".into(), 1, "at least one tenant"),
            ("[[tenant]]\nname = \"A\"\ndocroot = \".\"\n".into(), 2, "[a-z0-9_-]"),
            ("[[tenant]]\nname = \"\"\ndocroot = \".\"\n".into(), 2, "[a-z0-9_-]"),
            ("[[tenant]]\nname = \"a b\"\ndocroot = \".\"\n".into(), 2, "[a-z0-9_-]"),
            (format!("{}{}", tenant("hosts = [\"x\"]"), "[[tenant]]\nname = \"a\"\ndocroot = \".\"\n"), 6, "used twice"),
            (
                format!("{}{}", tenant("hosts = [\"x.test\"]"), "[[tenant]]\nname = \"b\"\nhosts = [\"X.TEST\"]\ndocroot = \".\"\n"),
                7,
                "two tenants",
            ),
            (tenant("hosts = [\"x.test\", \"x.test\"]"), 4, "twice"),
            (tenant("hosts = [\"x.test:8080\"]"), 4, "port"),
            (tenant("hosts = [\"x/y\"]"), 4, "characters"),
            (tenant("hosts = [\"\"]"), 4, "1..=255"),
            (tenant("weight = 10001"), 4, "weight 10001 is outside 1..=10000"),
            (tenant("weight = -1"), 4, "outside"),
            (tenant("net_cap = \"10MB\""), 4, "/s"),
            (tenant("net_cap = \"10Mb/s\""), 4, "unit"),
            (tenant("disk_cap = \"fast/s\""), 4, "unit"),
            (tenant("disk_cap = \".MB/s\""), 4, "number"),
            (tenant("disk_cap = \"0MB/s\""), 4, "outside"),
            (tenant("net_cap = \"2TB/s\""), 4, "unit"),
            (tenant("net_cap = \"2000GB/s\""), 4, "outside"),
            (tenant("cpu_cap = \"half\""), 4, "cpu_cap"),
            (tenant("cpu_cap = 0"), 4, "cpu_cap"),
            (tenant("cpu_cap = -0.5"), 4, "cpu_cap"),
            (tenant("cpu_cap = 2000"), 4, "cpu_cap"),
            (tenant("cap_kind = \"bucket\""), 4, "token"),
            (tenant("send_order = \"srpt\""), 4, "shortest_first"),
            (tenant("send_order = \"Shortest_First\""), 4, "send_order"),
            (tenant("cache_bytes = 999999999999"), 4, "outside"),
            (tenant("p90_target_ms = 0"), 4, "outside"),
            (tenant("connections_max = 10001"), 4, "outside"),
            (tenant("index = [\"../x\"]"), 4, "plain file name"),
            (tenant("index = [\"\"]"), 4, "plain file name"),
            (tenant("listen = [\"127.0.0.1:9999\"]"), 4, "not in server.listen"),
            (tenant("listen = [\"nonsense\"]"), 4, "not an address"),
            ("[[tenant]]\nname = \"a\"\ndocroot = \"\"\n".into(), 3, "docroot is empty"),
            (format!("[server]\nlisten = [\"localhost:80\"]\n{}", tenant("")), 2, "not an address"),
            (format!("[server]\nlisten = []\n{}", tenant("")), 2, "1..=64"),
            (format!("[server]\nlisten = [\"127.0.0.1:1\", \"127.0.0.1:1\"]\n{}", tenant("")), 2, "twice"),
            (format!("[server]\nconnections_max = 1000001\n{}", tenant("")), 2, "outside 1..=1000000"),
            (format!("[server]\nconnections_max = 0\n{}", tenant("")), 2, "outside"),
            (format!("[server]\npipeline_depth_max = 1025\n{}", tenant("")), 2, "outside 1..=1024"),
            (format!("[server]\nheader_timeout_ms = 0\n{}", tenant("")), 2, "outside 1..=3600000"),
            (format!("[server]\nkeepalive_timeout_ms = 3600001\n{}", tenant("")), 2, "outside"),
            (format!("[server]\nworkers = 0\n{}", tenant("")), 2, "outside"),
            (format!("[server]\ncache_bytes_max = -1\n{}", tenant("")), 2, "outside"),
            (format!("[server]\nsendfile_min_bytes = 0\n{}", tenant("")), 2, "outside 1..=1073741824"),
            (format!("[server]\nsendfile_min_bytes = 1073741825\n{}", tenant("")), 2, "outside"),
            (format!("[server]\nsendfile = \"yes\"\n{}", tenant("")), 2, "expected a boolean"),
            (format!("[server]\naccess_log = \"\"\n{}", tenant("")), 2, "empty"),
            (format!("{}{}", tenant(""), "[[tenant]]\nname = \"b\"\ndocroot = \".\"\n"), 5, "catch-all"),
            (tenant("[[tenant.class]]\nname = \"g\"\nweight = 5"), 4, "exactly one"),
            (tenant("[[tenant.class]]\nname = \"g\"\nheader = \"a: b\"\nprefix = \"/\""), 4, "exactly one"),
            (tenant("[[tenant.class]]\nname = \"g\"\nheader = \"nocolon\""), 6, "name: value"),
            (tenant("[[tenant.class]]\nname = \"g\"\nheader = \"x:\""), 6, "name: value"),
            (tenant("[[tenant.class]]\nname = \"g\"\nprefix = \"api\""), 6, "start with /"),
            (tenant("[[tenant.class]]\nname = \"g\"\nprefix = \"/\"\nweight = 0"), 7, "outside"),
            (tenant("[[tenant.class]]\nname = \"g\"\nprefix = \"/\"\npriority = 15"), 7, "outside 0..=14"),
            (tenant("[[tenant.class]]\nname = \"g\"\nprefix = \"/\"\np90_target_ms = 0"), 7, "outside"),
            (tenant("[[tenant.class]]\nname = \"g\"\nprefix = \"/\"\npriority = 1"), 4, "no target"),
            (
                tenant("[[tenant.class]]\nname = \"g\"\nprefix = \"/a\"\n[[tenant.class]]\nname = \"g\"\nprefix = \"/b\""),
                8,
                "used twice",
            ),
        ];
        for (text, line, needle) in cases {
            check_error(&text, line, needle);
        }
    }

    fn check_error(text: &str, line: usize, needle: &str) {
        let e = err(text);
        let want_line = (line != 0).then_some(line);
        assert_eq!(e.line, want_line, "{text}\n→ {e}");
        assert!(
            e.message.contains(needle),
            "{text}\n→ {e} (wanted {needle:?})"
        );
    }

    #[test]
    fn tls_keys() {
        let t = |extra: &str| format!("[[tenant]]\nname = \"a\"\ndocroot = \".\"\n{extra}\n");
        let server = "[server]\nlisten = []\nlisten_tls = [\"127.0.0.1:8443\"]\ntls_cert = \"c.pem\"\ntls_key = \"k.pem\"\n";
        // A TLS-only server; a tenant bound to the TLS listener with its own certificate.
        let cfg = parse_config(&format!(
            "{server}{}",
            t("listen = [\"127.0.0.1:8443\"]\ntls_cert = \"a.pem\"\ntls_key = \"ak.pem\"")
        ))
        .unwrap();
        assert!(cfg.server.listen.is_empty());
        assert_eq!(
            cfg.server.listeners().collect::<Vec<_>>(),
            [("127.0.0.1:8443".parse().unwrap(), true)]
        );
        assert_eq!(cfg.server.tls_cert.as_deref(), Some(Path::new("c.pem")));
        assert_eq!(cfg.tenants[0].tls_key.as_deref(), Some(Path::new("ak.pem")));
        assert_eq!(
            cfg.tenant_for(None, "127.0.0.1:8443".parse().unwrap()),
            Some(0)
        );
        // Relative to the config file's directory when loaded from one.
        let dir = std::env::temp_dir().join(format!("omnistage-tls-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("c.toml");
        std::fs::write(&file, format!("{server}{}", t(""))).unwrap();
        let loaded = load_config(&file).unwrap();
        assert_eq!(loaded.server.tls_key, Some(dir.join("k.pem")));
        let _ = std::fs::remove_dir_all(&dir);
        let cases: Vec<(String, usize, &str)> = vec![
            (format!("[server]\nlisten_tls = [\"127.0.0.1:8443\"]\n{}", t("")), 2, "tls_cert and tls_key"),
            (format!("[server]\ntls_cert = \"c.pem\"\n{}", t("")), 2, "needs tls_key"),
            (format!("[server]\ntls_key = \"k.pem\"\n{}", t("")), 2, "needs tls_cert"),
            (format!("[server]\ntls_cert = \"\"\ntls_key = \"k\"\n{}", t("")), 2, "empty"),
            (
                format!("[server]\nlisten = [\"127.0.0.1:1\"]\nlisten_tls = [\"127.0.0.1:1\"]\ntls_cert = \"c\"\ntls_key = \"k\"\n{}", t("")),
                3,
                "twice",
            ),
            (format!("[server]\nlisten_tls = [\"x\"]\ntls_cert = \"c\"\ntls_key = \"k\"\n{}", t("")), 2, "not an address"),
            (format!("[server]\nlisten = []\n{}", t("")), 2, "1..=64"),
            (t("tls_cert = \"a.pem\"\ntls_key = \"k.pem\""), 4, "no listen_tls"),
            (format!("{server}{}", t("tls_cert = \"a.pem\"")), 9, "needs tls_key"),
            (format!("{server}{}", t("listen = [\"127.0.0.1:9\"]")), 9, "listen_tls"),
        ];
        for (text, line, needle) in cases {
            check_error(&text, line, needle);
        }
    }

    #[test]
    fn listeners_bind_once() {
        let text = "[server]\nlisten = [\"127.0.0.1:1\", \"[::1]:2\"]\n\
            [[tenant]]\nname = \"a\"\nlisten = [\"127.0.0.1:1\"]\ndocroot = \".\"\n\
            [[tenant]]\nname = \"b\"\nlisten = [\"127.0.0.1:1\"]\ndocroot = \".\"\n";
        let e = err(text);
        assert_eq!(e.line, Some(9), "{e}");
        assert!(e.message.contains("two tenants"), "{e}");
        let ok = text.replace(
            "name = \"b\"\nlisten = [\"127.0.0.1:1\"]",
            "name = \"b\"\nlisten = [\"[::1]:2\"]",
        );
        let cfg = parse_config(&ok).unwrap();
        assert_eq!(cfg.tenant_for(None, "[::1]:2".parse().unwrap()), Some(1));
    }

    #[test]
    fn rates() {
        assert_eq!(parse_rate("10MB/s"), Ok(10_000_000));
        assert_eq!(parse_rate("10 MB/s"), Ok(10_000_000));
        assert_eq!(parse_rate("1.5GiB/s"), Ok(1_610_612_736));
        assert_eq!(parse_rate("500B/s"), Ok(500));
        assert_eq!(parse_rate("64KiB/s"), Ok(65_536));
        assert_eq!(parse_rate("64kB/s"), Ok(64_000));
        assert_eq!(parse_rate("64KB/s"), Ok(64_000));
        assert_eq!(parse_rate("2MiB/s"), Ok(2_097_152));
        assert_eq!(parse_rate("1GB/s"), Ok(1_000_000_000));
        assert_eq!(parse_rate("1000GB/s"), Ok(RATE_BYTES_PER_S_MAX));
        for bad in [
            "",
            "/s",
            "MB/s",
            "10",
            "10MB",
            "10 mb/s",
            "0.1B/s",
            "1.2.3MB/s",
            "-1MB/s",
            "NaNMB/s",
        ] {
            assert!(parse_rate(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn load_resolves_relative_paths() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        std::fs::create_dir_all(root.join("www/a")).unwrap();
        let cfg_path = root.join("site.toml");
        std::fs::write(
            &cfg_path,
            "[server]\naccess_log = \"logs/access.log\"\n[[tenant]]\nname = \"a\"\ndocroot = \"./www/a\"\n",
        )
        .unwrap();
        let cfg = load_config(&cfg_path).unwrap();
        assert_eq!(cfg.tenants[0].docroot, root.join("www/a"));
        assert_eq!(
            cfg.server.access_log,
            AccessLog::File(root.join("logs/access.log"))
        );

        std::fs::write(
            &cfg_path,
            "[[tenant]]\nname = \"a\"\n\ndocroot = \"./www/missing\"\n",
        )
        .unwrap();
        let e = load_config(&cfg_path).unwrap_err();
        assert_eq!(e.line, Some(4));
        assert_eq!(e.path.as_deref(), Some(cfg_path.as_path()));
        assert!(
            e.to_string().starts_with(&format!(
                "{}: line 4, column 11: docroot",
                cfg_path.display()
            )),
            "{e}"
        );

        let e = load_config(&root.join("nope.toml")).unwrap_err();
        assert!(e.message.contains("cannot read"), "{e}");
    }

    #[test]
    fn line_columns() {
        assert_eq!(line_col("abc", 0), (1, 1));
        assert_eq!(line_col("abc\ndef", 5), (2, 2));
        assert_eq!(line_col("é\nx", 2), (1, 2));
        assert_eq!(line_col("ab", 99), (1, 3));
    }

    const FLEET: &str = r#"
[cluster]
redis = "redis://127.0.0.1:6379"
node = "n1"
sync_ms = 100

[[tenant]]
name = "a"
docroot = "."
fleet_rate_per_s = 1000
fleet_net_cap = "50MB/s"

[[tenant]]
name = "b"
hosts = ["b.test"]
docroot = "."
"#;

    #[test]
    fn cluster_and_fleet_caps_are_read() {
        let c = parse_config(FLEET).expect("valid");
        assert_eq!(
            c.cluster,
            Some(ClusterConfig {
                redis: "redis://127.0.0.1:6379".into(),
                node: Some("n1".into()),
                sync: Duration::from_millis(100),
            })
        );
        assert_eq!(
            c.tenants[0].fleet,
            TenantFleet {
                rate_per_s: Some(1000),
                net_cap_bytes_per_s: Some(50_000_000),
            }
        );
        assert_eq!(c.tenants[1].fleet, TenantFleet::default());
        // Without [cluster]: a single node, no fleet caps.
        assert_eq!(parse_config(FULL).expect("valid").cluster, None);
        let c = parse_config(&FLEET.replace("node = \"n1\"\nsync_ms = 100\n", "")).expect("valid");
        let cl = c.cluster.expect("cluster");
        assert_eq!(
            (cl.node, cl.sync),
            (None, Duration::from_millis(SYNC_MS_DEFAULT))
        );
    }

    #[test]
    fn cluster_limits_are_crossed_with_an_error_on_the_line() {
        let cases = [
            (
                "sync_ms = 100",
                "sync_ms = 9",
                "sync_ms 9 is outside 10..=60000",
            ),
            (
                "sync_ms = 100",
                "sync_ms = 60001",
                "sync_ms 60001 is outside",
            ),
            ("node = \"n1\"", "node = \"\"", "node \"\" must be"),
            (
                "node = \"n1\"",
                "node = \"a b\"",
                "must be 1..=64 characters",
            ),
            (
                "redis = \"redis://127.0.0.1:6379\"",
                "redis = \"http://x\"",
                "must be a URL",
            ),
            (
                "redis = \"redis://127.0.0.1:6379\"",
                "redis = \"redis://\"",
                "must be a URL",
            ),
            (
                "redis = \"redis://127.0.0.1:6379\"",
                "redis = \"redis://a b\"",
                "must be a URL",
            ),
            (
                "fleet_rate_per_s = 1000",
                "fleet_rate_per_s = 0",
                "fleet_rate_per_s 0 is outside",
            ),
            (
                "fleet_rate_per_s = 1000",
                "fleet_rate_per_s = 1000000001",
                "is outside 1..=1000000000",
            ),
            (
                "fleet_net_cap = \"50MB/s\"",
                "fleet_net_cap = \"50MB\"",
                "fleet_net_cap: rate",
            ),
            ("sync_ms = 100", "sync_ms = 100\nport = 1", "unknown field"),
        ];
        for (from, to, want) in cases {
            let text = FLEET.replace(from, to);
            let e = err(&text);
            assert!(e.message.contains(want), "{to}: {e}");
            assert!(e.line.is_some(), "{to}: {e}");
        }
        let node = format!("node = \"{}\"", "n".repeat(NODE_NAME_BYTES_MAX));
        assert!(parse_config(&FLEET.replace("node = \"n1\"", &node)).is_ok());
        let node = format!("node = \"{}\"", "n".repeat(NODE_NAME_BYTES_MAX + 1));
        assert!(parse_config(&FLEET.replace("node = \"n1\"", &node)).is_err());
        // Fleet caps need a fleet.
        let alone = FLEET.replace(
            "[cluster]\nredis = \"redis://127.0.0.1:6379\"\nnode = \"n1\"\nsync_ms = 100\n",
            "",
        );
        let e = err(&alone);
        assert!(
            e.message.contains("fleet_rate_per_s needs a [cluster]"),
            "{e}"
        );
        assert_eq!(e.line, Some(6));
        let e = err(&alone.replace("fleet_rate_per_s = 1000\n", ""));
        assert!(e.message.contains("fleet_net_cap needs a [cluster]"), "{e}");
    }
}
