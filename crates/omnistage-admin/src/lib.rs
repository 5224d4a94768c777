//! `omnistage-admin`: seeing and steering a running runtime over HTTP.
//!
//! A separate listener (default `127.0.0.1:9090`) serves, from its own threads:
//!
//! ```text
//! GET    /                                   the dashboard (embedded page, no build step)
//! GET    /api/v1/tree                        the activity tree with counters, rates, shares,
//!                                            latency percentiles
//! GET    /api/v1/stages                      per stage and per (stage, activity)
//! GET    /api/v1/graph[?format=dot]          the stage graph as measured (JSON, or Graphviz)
//! GET    /api/v1/graph.dot                   the same as Graphviz dot
//! GET    /api/v1/history                     shares of the last minutes (for charts)
//! GET    /api/v1/upstreams                   per upstream and tenant: proxied requests in
//!                                            flight, queued, refused; slot-time; bytes
//! GET    /api/v1/activities/{path}           one node of the tree
//! PUT    /api/v1/activities/{path}           create or change (weight, cap, policy, admission)
//! DELETE /api/v1/activities/{path}           remove one without children
//! POST   /api/v1/activities/{path}:move      move the sub-tree: {"to": "/new/parent"}
//! POST   /api/v1/activities/{path}:attach    a shaped group joins the tree (`omnistage shape
//!                                            --admin`; see `shaped`)
//! POST   /api/v1/activities/{path}:report    a shaped group's bytes since its last report;
//!                                            answers with the rates it is to run at
//! GET    /metrics                            Prometheus (OpenMetrics text) via prometheus-client
//! ```
//!
//! The admin server talks to the runtime only through [`omnistage::exec::Runtime`]'s public
//! API: snapshots of the ledger, the gates' queue lengths and rejections, the latency
//! histograms, the stage-graph edge counts, and the activity changes (which every worker
//! applies before its next scheduling decision). A sampler thread takes a sample every
//! interval (one second by default) so that rates, shares and interval percentiles cover the
//! last complete interval; totals are read fresh on every request.
//!
//! Answers: 400 for a malformed request (with the reason), 401 without the bearer token when
//! one is configured, 403 from the browser guards below, 404 for unknown paths and
//! activities, 405 for a wrong method, 409 for a change the activity tree refuses (weight out
//! of range, removing `/infra`, a cycle, a node with children, removing or moving an activity
//! the server's running config owns (a tenant's or a class's: the reason says to edit the
//! config file and reload instead), a p90 change to an activity under its tenant's
//! class-priority controller, a network or disk cap of 0 B/s, a cache budget over the server's
//! `cache_bytes_max`, a reload of the server that fails...; nothing changes: every part of a
//! request is checked before any part is applied, the file is written only after the change
//! is applied, and a step that fails after others were applied has them undone), 411/413/
//! 431 for chunked bodies and past the size limits, 415 for a body that is not
//! `application/json`, 501 for what the runtime cannot change (`persist=true` without an HTTP
//! server, or on a removal or move; network and
//! disk caps, cache budgets, send orders, moving connections), 500 when the config file could
//! not be written after all (the change is undone; the reason says so), 503 when all
//! handler threads are busy and the accept queue is full or the client's address has 32
//! connections open already, 408 for a request head not received within a second of the
//! accept (or a whole request within 5 s), 507 for a document larger than
//! [`DOCUMENT_BYTES_MAX`] (32 MiB). Every error body is `{"status": N, "error": "reason"}`.
//!
//! Listings are bounded: the tree holds at most [`LIST_ENTRIES_MAX`] (10,000) nodes (the root,
//! then depth-first in path order), `/stages` as many (stage, activity) rows, `/graph` as many
//! edges; past it the rest is left out and the document says `"truncated": true, "omitted": N`
//! (totals, shares and targets still count what was left out). One activity's sub-tree
//! (`GET /api/v1/activities/{path}`) is not cut by the tree's bound, only by the byte bound.
//!
//! Off a loopback address the server refuses to start without a bearer token; with a token
//! every API path and `/metrics` require `Authorization: Bearer <token>` (the dashboard page
//! itself carries no data and is served without it; it reads the token from `#token=...`).
//! Browser guards: bodies must be JSON (so a page of another origin cannot send a change
//! without a CORS preflight, which is refused), a change whose `Origin` is not this server is
//! refused, and without a token only an IP literal or `localhost` may stand in `Host` (DNS
//! rebinding).

mod activities;
pub mod client;
mod http;
mod metrics;
pub mod model;
mod put;
mod routes;
mod sampler;
mod served;
mod shaped;
mod view;

use omnistage::exec::Runtime;
pub use routes::{DOCUMENT_BYTES_MAX, LIST_ENTRIES_MAX};
pub use served::{Served, RELOAD_REFUSED};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// Default listen address of the admin server.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:9090";
/// Environment variable the command line reads the bearer token from.
pub const TOKEN_ENV: &str = "OMNISTAGE_ADMIN_TOKEN";
/// Longest bearer token accepted.
pub const TOKEN_BYTES_MAX: usize = 256;
/// Most handler threads.
pub const THREADS_MAX: usize = 64;

/// Settings of the admin server.
#[derive(Clone, Debug)]
pub struct AdminConfig {
    /// Where to listen (port 0: any free port; see [`AdminHandle::local_addr`]).
    pub listen: SocketAddr,
    /// Bearer token required on the API; mandatory off a loopback address.
    pub token: Option<String>,
    /// How often the sampler takes a sample (rates cover one interval), 10 ms..=60 s.
    pub sample_interval: Duration,
    /// Threads that answer requests (1..=THREADS_MAX); connections beyond them wait in a
    /// bounded queue, and past that get 503.
    pub threads: usize,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: DEFAULT_LISTEN.parse().expect("valid default"),
            token: None,
            sample_interval: Duration::from_secs(1),
            threads: 4,
        }
    }
}

impl AdminConfig {
    /// Why the admin server would refuse to start with these settings (checked again when it
    /// starts): a caller can check before it starts anything else.
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=THREADS_MAX).contains(&self.threads) {
            return Err(format!("admin threads must be in 1..={THREADS_MAX}"));
        }
        if self.sample_interval < Duration::from_millis(10)
            || self.sample_interval > Duration::from_secs(60)
        {
            return Err("admin sample interval must be in 10 ms..=60 s".into());
        }
        match &self.token {
            Some(t) if t.is_empty() || t.len() > TOKEN_BYTES_MAX => {
                Err(format!("admin token must be 1..={TOKEN_BYTES_MAX} bytes"))
            }
            Some(t) if !t.bytes().all(|b| b.is_ascii_graphic()) => {
                Err("admin token must be printable ASCII without spaces".into())
            }
            Some(_) => Ok(()),
            None if !self.listen.ip().is_loopback() => Err(format!(
                "the admin API on {} (not a loopback address) needs a bearer token \
                 (--admin-token or {TOKEN_ENV})",
                self.listen
            )),
            None => Ok(()),
        }
    }
}

/// Gives the admin server's threads a [`Runtime`]: anything that owns one (an
/// `Arc<Runtime>`, a server) plus how to reach it.
pub(crate) trait Source: Send + Sync + 'static {
    fn runtime(&self) -> &Runtime;
    /// The HTTP server's per-tenant settings, when the owner is a server.
    fn tenants(&self) -> Option<&dyn Tenants> {
        None
    }
}

/// A change to settings that live in the HTTP server rather than in the activity tree: the
/// outer `Option` says whether to change it, the inner one sets or removes it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantChange {
    /// Network send cap, bytes/s.
    pub net_cap_bytes_per_s: Option<Option<u64>>,
    /// Disk read cap, bytes/s.
    pub disk_cap_bytes_per_s: Option<Option<u64>>,
    /// Cache budget, bytes.
    pub cache_bytes: Option<Option<u64>>,
    /// Which pending response the send stage serves next within the tenant.
    pub send_order: Option<omnistage_http::config::SendOrder>,
    /// The CPU weight the API set on the tenant's activity, for the running configuration
    /// (which the send scheduler takes link weights from).
    pub weight: Option<u32>,
    /// The CPU cap the API set on the tenant's activity (each worker's shaper, as the runtime
    /// holds it), for the running configuration, so that a later change of the tenant keeps it.
    pub cpu_cap: Option<Option<omnistage::sched::ShaperSpec>>,
}

/// What an HTTP server lets the admin API change about its tenants (implemented by the
/// owner passed to [`start_admin_with_tenants`]).
pub trait Tenants: Send + Sync {
    /// Applies `change` to the tenant whose activity is `path`. `Err` names the problem: no
    /// such tenant (the API answers 404) or a refused value (409).
    fn set_tenant(&self, path: &str, change: &TenantChange) -> Result<(), TenantError>;
    /// Whether [`Tenants::set_tenant`] would take `change`, without applying it: the API checks
    /// every part of a request before it changes anything or writes the config file.
    fn check_tenant(&self, _path: &str, _change: &TenantChange) -> Result<(), TenantError> {
        Ok(())
    }
    /// Bytes each tenant has in the cache, by activity path.
    fn cache_bytes(&self) -> Vec<(String, u64)> {
        Vec::new()
    }
    /// The server's own counters for `/metrics` (name, help, value), e.g. TLS handshakes.
    fn server_counters(&self) -> Vec<(&'static str, &'static str, u64)> {
        Vec::new()
    }
    /// Activity paths the running configuration owns (tenants and their classes): the API
    /// refuses to remove or move them, and says to edit the config file and reload instead.
    fn configured_activities(&self) -> Vec<String> {
        Vec::new()
    }
    /// Writes `edits` to the config file the server runs from (`?persist=true`); refused
    /// without one (the embedded default), or when the file changed on disk since it was
    /// loaded, or when the edit would make it invalid.
    fn persist(&self, _edits: &[omnistage_http::persist::Edit]) -> Result<(), TenantError> {
        Err(TenantError::Refused(
            "this server keeps no config file to write changes to".into(),
        ))
    }
    /// Whether [`Tenants::persist`] would take `edits` now, without writing: the API checks
    /// before it changes the server, and writes the file only once the change is applied.
    fn check_persist(&self, _edits: &[omnistage_http::persist::Edit]) -> Result<(), TenantError> {
        Err(TenantError::Refused(
            "this server keeps no config file to write changes to".into(),
        ))
    }
    /// The lock that makes the admin API's changes and the owner's own reloads of its config
    /// (SIGHUP: [`Served::reload_file`]) one at a time: a change holds it from its checks to
    /// its file write, so a reload never runs in the middle of one (it undid a change the API
    /// had just reported as applied, or the file got the change while the server ran without
    /// it). `None`: the owner has no reloads of its own.
    fn changes(&self) -> Option<&std::sync::Mutex<()>> {
        None
    }
    /// The tenant's settings as the running configuration has them, for
    /// [`Tenants::restore_tenant`] when a later step of the same change fails; `None` when
    /// there is no such tenant or the owner cannot put them back.
    fn saved_tenant(&self, _path: &str) -> Option<omnistage_http::config::TenantConfig> {
        None
    }
    /// Puts back the settings [`Tenants::saved_tenant`] gave.
    fn restore_tenant(
        &self,
        path: &str,
        _saved: &omnistage_http::config::TenantConfig,
    ) -> Result<(), TenantError> {
        Err(TenantError::Refused(format!(
            "{path}: this server cannot put a tenant's settings back"
        )))
    }
    /// What the fleet layer last computed, when the server is a node of a fleet.
    fn fleet(&self) -> Option<model::Fleet> {
        None
    }
    /// Per upstream and tenant: requests in flight, queued, refused, slot-time and bytes.
    fn upstreams(&self) -> Vec<omnistage_http::server::UpstreamTenantStats> {
        Vec::new()
    }
}

/// Why a tenant change was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TenantError {
    NotATenant(String),
    Refused(String),
}

struct Owned<S, F> {
    owner: Arc<S>,
    get: F,
}

impl<S, F> Source for Owned<S, F>
where
    S: Send + Sync + 'static,
    F: Fn(&S) -> &Runtime + Send + Sync + 'static,
{
    fn runtime(&self) -> &Runtime {
        (self.get)(&self.owner)
    }
}

/// A running admin server; dropping it stops it.
pub struct AdminHandle {
    inner: Option<http::Running>,
    local_addr: SocketAddr,
}

impl AdminHandle {
    /// The address actually listened on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting, answers the connections still queued 503 at once, finishes the
    /// requests in progress (each bounded by its read and write deadlines, 5 s each), and joins
    /// every thread (so the owner passed to [`start_admin`] is no longer referenced
    /// afterwards). Idempotent.
    pub fn stop(&mut self) {
        if let Some(r) = self.inner.take() {
            r.stop();
        }
    }
}

impl Drop for AdminHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Starts the admin server for the runtime that `owner` holds; `get` reaches it (a function
/// such as `Server::runtime` for an HTTP server; see [`start_admin_rt`] for an
/// `Arc<Runtime>`).
pub fn start_admin<S, F>(owner: Arc<S>, get: F, cfg: AdminConfig) -> Result<AdminHandle, String>
where
    S: Send + Sync + 'static,
    F: Fn(&S) -> &Runtime + Send + Sync + 'static,
{
    cfg.validate()?;
    let source: Arc<dyn Source> = Arc::new(Owned { owner, get });
    let running = http::start(source, cfg)?;
    let local_addr = running.local_addr();
    Ok(AdminHandle {
        inner: Some(running),
        local_addr,
    })
}

struct WithTenants<S, F> {
    owner: Arc<S>,
    get: F,
}

impl<S, F> Source for WithTenants<S, F>
where
    S: Tenants + Send + Sync + 'static,
    F: Fn(&S) -> &Runtime + Send + Sync + 'static,
{
    fn runtime(&self) -> &Runtime {
        (self.get)(&self.owner)
    }
    fn tenants(&self) -> Option<&dyn Tenants> {
        Some(&*self.owner)
    }
}

/// Starts the admin server for an owner that also has tenants (an HTTP server): the API can
/// then change their network and disk caps and cache budgets too.
pub fn start_admin_with_tenants<S, F>(
    owner: Arc<S>,
    get: F,
    cfg: AdminConfig,
) -> Result<AdminHandle, String>
where
    S: Tenants + Send + Sync + 'static,
    F: Fn(&S) -> &Runtime + Send + Sync + 'static,
{
    cfg.validate()?;
    let source: Arc<dyn Source> = Arc::new(WithTenants { owner, get });
    let running = http::start(source, cfg)?;
    let local_addr = running.local_addr();
    Ok(AdminHandle {
        inner: Some(running),
        local_addr,
    })
}

/// The admin API without its listener and threads: answers the bytes of one request the way a
/// handler thread does (the same head parsing, limits and routes), for the fuzz target and for
/// tests that want no sockets. A panic in a route is not caught here (the listener answers it
/// with 500): a fuzzer is to see it.
pub struct InProcess {
    shared: http::Shared,
}

/// What [`InProcess::answer`] answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub content_type: String,
    pub body: Vec<u8>,
}

impl InProcess {
    /// For an owner with tenants (an HTTP server), as [`start_admin_with_tenants`] serves it;
    /// `token` as in [`AdminConfig::token`].
    pub fn with_tenants<S, F>(owner: Arc<S>, get: F, token: Option<String>) -> InProcess
    where
        S: Tenants + Send + Sync + 'static,
        F: Fn(&S) -> &Runtime + Send + Sync + 'static,
    {
        let source: Arc<dyn Source> = Arc::new(WithTenants { owner, get });
        InProcess {
            shared: http::Shared {
                source,
                state: Default::default(),
                token,
                shaped: Default::default(),
                changes: Default::default(),
                limits: Default::default(),
            },
        }
    }

    /// The answer to `raw` (a request head and its body), or `None` when `raw` holds less than
    /// a whole request (the listener would wait for more, then time out with 408). Bytes past
    /// the request are ignored (the listener reads one request per connection).
    pub fn answer(&self, raw: &[u8]) -> Option<Answer> {
        let r = match http::parse_head(raw) {
            Ok(None) => return None,
            Err(r) => r,
            Ok(Some(head)) => {
                let end = head.len + head.content_length;
                let body = raw.get(head.len..end)?;
                let mut req = head.request;
                req.body = body.to_vec();
                routes::handle(&self.shared, &req)
            }
        };
        Some(Answer {
            status: r.status,
            content_type: r.content_type.to_string(),
            body: r.body,
        })
    }
}

/// Starts the admin server for an `Arc<Runtime>`.
pub fn start_admin_rt(rt: Arc<Runtime>, cfg: AdminConfig) -> Result<AdminHandle, String> {
    fn itself(r: &Runtime) -> &Runtime {
        r
    }
    start_admin(rt, itself, cfg)
}

/// An HTTP server's tenants through the admin API: a change is applied as a reload of the
/// server's configuration with that tenant's settings changed (so it reaches the send and
/// disk stages and the cache the same way a SIGHUP does), and is not written to the file.
/// The tenant name of `path` (`/tenants/NAME`), or why it is not a tenant's.
fn tenant_name(path: &str) -> Result<&str, TenantError> {
    path.strip_prefix("/tenants/")
        .filter(|n| !n.contains('/'))
        .ok_or_else(|| TenantError::NotATenant(format!("{path} is not a tenant")))
}

/// `change` applied to a tenant's settings (`workers`: the runtime's, which a CPU cap is split
/// between).
fn apply_change(
    change: &TenantChange,
    workers: usize,
    t: &mut omnistage_http::config::TenantConfig,
) {
    if let Some(v) = change.net_cap_bytes_per_s {
        t.net_cap_bytes_per_s = v;
    }
    if let Some(v) = change.disk_cap_bytes_per_s {
        t.disk_cap_bytes_per_s = v;
    }
    if let Some(v) = change.cache_bytes {
        t.cache_bytes = v;
    }
    if let Some(v) = change.send_order {
        t.send_order = v;
    }
    if let Some(w) = change.weight {
        t.weight = w;
    }
    if let Some(cap) = change.cpu_cap {
        // The config's cap is machine-wide, in cores; the runtime's is each worker's part.
        t.cpu_cap = cap.map(|c| c.rate_per_s as f64 * workers as f64 / 1e9);
        if let Some(c) = cap {
            t.cap_kind = match c.kind {
                omnistage::sched::ShaperKind::Token => omnistage_http::config::CapKind::Token,
                omnistage::sched::ShaperKind::Leaky => omnistage_http::config::CapKind::Leaky,
            };
        }
    }
}

fn update_error(e: omnistage_http::server::UpdateError) -> TenantError {
    match e {
        omnistage_http::server::UpdateError::NoTenant(m) => TenantError::NotATenant(m),
        omnistage_http::server::UpdateError::Refused(m) => TenantError::Refused(m),
    }
}

impl Tenants for omnistage_http::server::Server {
    fn set_tenant(&self, path: &str, change: &TenantChange) -> Result<(), TenantError> {
        let workers = self.runtime().workers();
        self.update_tenant(tenant_name(path)?, |t| apply_change(change, workers, t))
            .map_err(update_error)
    }

    fn check_tenant(&self, path: &str, change: &TenantChange) -> Result<(), TenantError> {
        let workers = self.runtime().workers();
        self.check_tenant_update(tenant_name(path)?, |t| apply_change(change, workers, t))
            .map_err(update_error)
    }

    fn server_counters(&self) -> Vec<(&'static str, &'static str, u64)> {
        self.stats().counters()
    }
    fn saved_tenant(&self, path: &str) -> Option<omnistage_http::config::TenantConfig> {
        let name = tenant_name(path).ok()?;
        self.config().tenants.into_iter().find(|t| t.name == name)
    }

    fn restore_tenant(
        &self,
        path: &str,
        saved: &omnistage_http::config::TenantConfig,
    ) -> Result<(), TenantError> {
        self.update_tenant(tenant_name(path)?, |t| *t = saved.clone())
            .map_err(update_error)
    }

    fn configured_activities(&self) -> Vec<String> {
        omnistage_http::server::Server::configured_activities(self)
    }

    fn fleet(&self) -> Option<model::Fleet> {
        self.fleet_status().map(|s| (*s).clone())
    }

    fn upstreams(&self) -> Vec<omnistage_http::server::UpstreamTenantStats> {
        self.upstream_stats()
    }

    fn cache_bytes(&self) -> Vec<(String, u64)> {
        omnistage_http::server::Server::cache_bytes(self)
            .into_iter()
            .map(|(name, b)| (format!("/tenants/{name}"), b))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An owner with tenants that has none: just the runtime.
    struct Bare(Arc<Runtime>);

    impl Tenants for Bare {
        fn set_tenant(&self, path: &str, _: &TenantChange) -> Result<(), TenantError> {
            Err(TenantError::NotATenant(path.into()))
        }
    }

    fn bare() -> InProcess {
        let rt = Arc::new(Runtime::builder().workers(1).start().unwrap());
        InProcess::with_tenants(Arc::new(Bare(rt)), |b: &Bare| &*b.0, None)
    }

    const TREE: &[u8] = b"GET /api/v1/tree HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";

    /// Every listing over the byte bound answers 507 with the reason, not the document; the
    /// graph's edges past the entry bound are left out and it says so. (Bounds lowered here;
    /// `tests/bounds.rs` crosses the real entry bound.)
    #[test]
    fn listings_past_the_byte_bound_answer_507() {
        let mut ip = bare();
        ip.shared.limits.bytes = 40;
        for path in [
            "/api/v1/tree",
            "/api/v1/stages",
            "/api/v1/history",
            "/api/v1/activities/infra",
        ] {
            let raw = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
            let a = ip.answer(raw.as_bytes()).unwrap();
            let body = String::from_utf8_lossy(&a.body);
            assert_eq!(a.status, 507, "{path}: {body}");
            assert!(body.contains("larger than 40 bytes"), "{path}: {body}");
        }
        ip.shared.limits.bytes = routes::DOCUMENT_BYTES_MAX;
        ip.shared.limits.entries = 0;
        let a = ip
            .answer(b"GET /api/v1/graph HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            .unwrap();
        assert_eq!(a.status, 200);
        let g: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
        assert_eq!(g["edges"].as_array().map(Vec::len), Some(0), "{g}");
        let omitted = g["omitted"].as_u64().unwrap();
        assert_eq!(g["truncated"], omitted > 0, "{g}");
    }

    /// A panic while the shaped groups' table or the sampler's state is locked leaves the lock
    /// poisoned; the tree is still served (it once answered 500 from then on, until a restart).
    #[test]
    fn a_poisoned_lock_does_not_take_the_tree_down() {
        let ip = bare();
        assert_eq!(ip.answer(TREE).unwrap().status, 200);
        std::thread::scope(|s| {
            let _ = s
                .spawn(|| {
                    let _g = ip.shared.shaped.lock();
                    panic!("a panic under the shaped lock (expected by the test)");
                })
                .join();
            let _ = s
                .spawn(|| {
                    let _g = ip.shared.state.lock();
                    panic!("a panic under the sampler lock (expected by the test)");
                })
                .join();
        });
        assert!(ip.shared.shaped.is_poisoned() && ip.shared.state.is_poisoned());
        let r = ip.answer(TREE).unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let hist = ip
            .answer(b"GET /api/v1/history HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            .unwrap();
        assert_eq!(hist.status, 200);
    }
}
