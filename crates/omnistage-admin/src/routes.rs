//! Routing and the handlers of the admin API: reads build documents with `view`, changes go
//! through `Runtime::create_activity`, `set_activity`, `move_activity`, `remove_activity` and
//! `set_admission` after every part of the request has been checked, so a refused request
//! changes nothing.

use crate::http::Shared;
use crate::model::{self, ActivityChange, AdmissionChange, CapChange, Changed, MoveRequest};
use crate::sampler::Sample;
use crate::{metrics, shaped, view};
use omnistage::activity::{parse_path, ActivityError};
use omnistage::admit::P90Params;
use omnistage::exec::{Predicate, Runtime, RuntimeError};
use omnistage::sched::{PolicyKind, ShaperKind, ShaperSpec};
use omnistage_http::persist::{Edit, Setting};
use std::sync::PoisonError;

/// The dashboard page and its script, embedded in the binary.
const INDEX_HTML: &str = include_str!("../assets/index.html");
const DASHBOARD_JS: &str = include_str!("../assets/dashboard.js");

/// Where activity paths start in the URL.
const ACTIVITIES: &str = "/api/v1/activities";
/// The verbs that may follow an activity's path after `:` (which never occurs in a path):
/// move a sub-tree, attach a shaped group, take a shaped group's report.
const VERBS: [&str; 3] = ["move", "attach", "report"];

/// Default burst of a CPU cap given in cores: 10 ms of its rate (as the HTTP config does).
const CAP_BURST_MS_DEFAULT: f64 = 10.0;
/// A p90 admission created through the API: up to this many admissions/s (SEDA's ceiling of
/// 5,000/s is too low for an HTTP server), starting there, additive step of a thousandth.
const P90_RATE_MAX_PER_S: f64 = 100_000.0;
const P90_BURST: u32 = 1_000;

/// The request headers the API looks at.
#[derive(Debug, Default)]
pub(crate) struct Headers {
    pub(crate) authorization: Option<String>,
    pub(crate) host: Option<String>,
    pub(crate) origin: Option<String>,
    pub(crate) content_type: Option<String>,
}

/// A parsed request.
#[derive(Debug)]
pub(crate) struct Request {
    pub(crate) method: String,
    pub(crate) path: String,
    pub(crate) query: String,
    pub(crate) headers: Headers,
    pub(crate) body: Vec<u8>,
}

/// An answer.
#[derive(Debug)]
pub(crate) struct Response {
    pub(crate) status: u16,
    pub(crate) content_type: &'static str,
    pub(crate) headers: Vec<(&'static str, String)>,
    pub(crate) body: Vec<u8>,
}

impl Response {
    fn new(status: u16, content_type: &'static str, body: Vec<u8>) -> Self {
        Response {
            status,
            content_type,
            headers: Vec::new(),
            body,
        }
    }

    pub(crate) fn json<T: serde::Serialize>(status: u16, v: &T) -> Self {
        let mut body = serde_json::to_vec(v).expect("documents serialize");
        body.push(b'\n');
        Response::new(status, "application/json", body)
    }

    pub(crate) fn error(status: u16, msg: &str) -> Self {
        Response::json(
            status,
            &model::ErrorBody {
                status,
                error: msg.to_string(),
            },
        )
    }

    fn method_not_allowed(allow: &'static str) -> Self {
        let mut r = Response::error(405, &format!("method not allowed here; allowed: {allow}"));
        r.headers.push(("Allow", allow.to_string()));
        r
    }
}

/// Compares without stopping at the first difference (the token is a secret).
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= usize::from(x ^ y);
    }
    diff == 0
}

fn authorized(shared: &Shared, req: &Request) -> bool {
    let Some(token) = &shared.token else {
        return true;
    };
    let Some(h) = &req.headers.authorization else {
        return false;
    };
    let mut parts = h.splitn(2, ' ');
    let scheme = parts.next().unwrap_or("");
    let given = parts.next().unwrap_or("").trim();
    scheme.eq_ignore_ascii_case("bearer") && same_secret(given.as_bytes(), token.as_bytes())
}

/// Query parameters (no percent-decoding: none of ours need it).
fn query_pairs(q: &str) -> Vec<(&str, &str)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| p.split_once('=').unwrap_or((p, "")))
        .collect()
}

pub(crate) fn check_query(q: &str, allowed: &[&str]) -> Result<(), Response> {
    for (k, _) in query_pairs(q) {
        if !allowed.contains(&k) {
            return Err(Response::error(
                400,
                &format!("unknown query parameter {k:?}"),
            ));
        }
    }
    Ok(())
}

fn query_get<'a>(q: &'a str, key: &str) -> Option<&'a str> {
    query_pairs(q)
        .into_iter()
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
}

/// The host part of a `Host` header value (`[::1]:9090` → `::1`, `a.b:80` → `a.b`).
fn host_name(h: &str) -> &str {
    if let Some(rest) = h.strip_prefix('[') {
        return rest.split(']').next().unwrap_or("");
    }
    h.rsplit_once(':').map(|(n, _)| n).unwrap_or(h)
}

/// Browser guards: without a token, only IP literals and `localhost` may name the server
/// (a page cannot rebind a name of its own to 127.0.0.1 and read or change the API), and a
/// change coming from a page of another origin is refused.
fn browser_guard(shared: &Shared, req: &Request) -> Option<Response> {
    if shared.token.is_none() {
        if let Some(h) = &req.headers.host {
            let name = host_name(h);
            if name.parse::<std::net::IpAddr>().is_err() && !name.eq_ignore_ascii_case("localhost")
            {
                return Some(Response::error(
                    403,
                    "without a token the admin API answers only to an IP address or localhost \
                     in Host (a DNS rebinding guard)",
                ));
            }
        }
    }
    if req.method != "GET" {
        if let (Some(origin), Some(host)) = (&req.headers.origin, &req.headers.host) {
            let same = origin
                .strip_prefix("http://")
                .is_some_and(|o| o.eq_ignore_ascii_case(host));
            if !same {
                return Some(Response::error(
                    403,
                    &format!("a change from another origin ({origin}) is refused"),
                ));
            }
        }
    }
    None
}

pub(crate) fn handle(shared: &Shared, req: &Request) -> Response {
    if let Some(r) = browser_guard(shared, req) {
        return r;
    }
    let path = req.path.as_str();
    let get_only = |f: &dyn Fn() -> Response| {
        if req.method == "GET" {
            f()
        } else {
            Response::method_not_allowed("GET")
        }
    };
    match path {
        "/" | "/index.html" => {
            return get_only(&|| {
                Response::new(
                    200,
                    "text/html; charset=utf-8",
                    INDEX_HTML.as_bytes().to_vec(),
                )
            })
        }
        "/dashboard.js" => {
            return get_only(&|| {
                Response::new(
                    200,
                    "text/javascript; charset=utf-8",
                    DASHBOARD_JS.as_bytes().to_vec(),
                )
            })
        }
        _ => {}
    }
    let known = matches!(
        path,
        "/metrics"
            | "/api/v1/tree"
            | "/api/v1/stages"
            | "/api/v1/graph"
            | "/api/v1/graph.dot"
            | "/api/v1/history"
            | "/api/v1/upstreams"
    ) || path == ACTIVITIES
        || path.starts_with("/api/v1/activities/");
    if !known {
        return Response::error(404, &format!("no such path {path:?}"));
    }
    if !authorized(shared, req) {
        let mut r = Response::error(401, "this admin API needs Authorization: Bearer <token>");
        r.headers.push(("WWW-Authenticate", "Bearer".into()));
        return r;
    }
    let rt = shared.source.runtime();
    // The proxy's counters, when the owner is an HTTP server.
    let upstreams = || {
        shared
            .source
            .tenants()
            .map(|t| t.upstreams())
            .unwrap_or_default()
    };
    match path {
        "/metrics" => get_only(&|| {
            if let Err(r) = check_query(&req.query, &[]) {
                return r;
            }
            let mut server = shared
                .source
                .tenants()
                .map(|t| t.server_counters())
                .unwrap_or_default();
            server.push((
                "omnistage_admin_sampler_failures",
                "Samples the admin API's sampler failed to take (a panic while sampling); while \
                 its last sample is older than two intervals (and a second) the API's rates are \
                 null.",
                sampled(shared, rt).1.sampler_failures,
            ));
            let fleet = shared.source.tenants().and_then(|t| t.fleet());
            let body =
                metrics::render(rt, &Sample::take(rt), &upstreams(), &server, fleet.as_ref());
            Response::new(200, metrics::CONTENT_TYPE, body.into_bytes())
        }),
        "/api/v1/tree" => get_only(&|| {
            if let Err(r) = check_query(&req.query, &[]) {
                return r;
            }
            let (win, status) = sampled(shared, rt);
            let mut t = view::tree(rt, &Sample::take(rt), win.as_ref());
            t.sampler = status;
            if let Some(ten) = shared.source.tenants() {
                view::fill_cache_bytes(&mut t.root, &ten.cache_bytes());
                t.fleet = ten.fleet();
            }
            view::fill_shaped(&mut t.root, &shaped_list(shared, rt));
            Response::json(200, &t)
        }),
        "/api/v1/stages" => get_only(&|| {
            if let Err(r) = check_query(&req.query, &[]) {
                return r;
            }
            let (win, status) = sampled(shared, rt);
            let mut st = view::stages(rt, &Sample::take(rt), win.as_ref());
            st.sampler = status;
            Response::json(200, &st)
        }),
        "/api/v1/graph" | "/api/v1/graph.dot" => get_only(&|| {
            if let Err(r) = check_query(&req.query, &["format"]) {
                return r;
            }
            let g = view::graph(rt, &Sample::take(rt), sampled(shared, rt).0.as_ref());
            let format = query_get(&req.query, "format").unwrap_or(if path.ends_with(".dot") {
                "dot"
            } else {
                "json"
            });
            match format {
                "json" => Response::json(200, &g),
                "dot" => Response::new(
                    200,
                    "text/vnd.graphviz; charset=utf-8",
                    view::dot(&g).into_bytes(),
                ),
                other => Response::error(400, &format!("format {other:?}: want json or dot")),
            }
        }),
        "/api/v1/upstreams" => get_only(&|| {
            if let Err(r) = check_query(&req.query, &[]) {
                return r;
            }
            Response::json(200, &upstreams())
        }),
        "/api/v1/history" => get_only(&|| {
            if let Err(r) = check_query(&req.query, &[]) {
                return r;
            }
            let (win, sampler) = sampled(shared, rt);
            let points = shared
                .state
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .history();
            Response::json(
                200,
                &model::History {
                    interval_s: win.map(|w| w.dt_s()).unwrap_or(0.0),
                    points,
                    sampler,
                },
            )
        }),
        _ => activity(shared, rt, req),
    }
}

/// `/api/v1/activities[/{path}][:move]`.
fn activity(shared: &Shared, rt: &Runtime, req: &Request) -> Response {
    let rest = &req.path[ACTIVITIES.len()..];
    // A verb follows the path after `:` (which never occurs in an activity path).
    let (rest, verb) = match rest.rsplit_once(':') {
        Some((r, v)) => (r, Some(v)),
        None => (rest, None),
    };
    if verb.is_some_and(|v| !VERBS.contains(&v)) || rest.contains(':') {
        return Response::error(
            400,
            "unknown verb: the verbs are :move, :attach and :report",
        );
    }
    let path = if rest.is_empty() { "/" } else { rest };
    if let Err(e) = parse_path(path) {
        return Response::error(400, &e.to_string());
    }
    // The changing routes one at a time (see `Shared::changes`); reads and `:report` (which
    // only adds to counters) are not held up.
    let changing = matches!(
        (req.method.as_str(), verb),
        ("POST", Some("move" | "attach")) | ("PUT" | "DELETE", None)
    );
    let _changing = changing.then(|| {
        shared
            .changes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    });
    if let Some(verb) = verb {
        if req.method != "POST" {
            return Response::method_not_allowed("POST");
        }
        return match verb {
            "move" => {
                if let Some(r) = configured_refusal(shared, path, "move") {
                    return r;
                }
                if shared
                    .shaped
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .holds_under(path)
                {
                    return Response::error(
                        409,
                        &format!(
                            "cannot move {path}: a shaped group is attached at or under it (its \
                             launcher reports to that path); stop the group first"
                        ),
                    );
                }
                move_activity(rt, req, path)
            }
            "attach" => {
                let configured = shared
                    .source
                    .tenants()
                    .map(|t| t.configured_activities())
                    .unwrap_or_default();
                shaped::attach(&shared.shaped, rt, &configured, req, path)
            }
            _ => shaped::report(&shared.shaped, rt, req, path),
        };
    }
    match req.method.as_str() {
        "GET" => {
            if let Err(r) = check_query(&req.query, &[]) {
                return r;
            }
            let window = sampled(shared, rt).0;
            let mut t = view::tree(rt, &Sample::take(rt), window.as_ref());
            if let Some(ten) = shared.source.tenants() {
                view::fill_cache_bytes(&mut t.root, &ten.cache_bytes());
            }
            view::fill_shaped(&mut t.root, &shaped_list(shared, rt));
            match view::find(&t.root, path) {
                Some(n) => Response::json(200, n),
                None => Response::error(404, &format!("no activity {path}")),
            }
        }
        "PUT" => put_activity(rt, shared.source.tenants(), &shared.shaped, req, path),
        "DELETE" => {
            if let Err(r) = check_query(&req.query, &["persist"]) {
                return r;
            }
            if let Some(r) = persist_refused(&req.query) {
                return r;
            }
            if let Some(r) = configured_refusal(shared, path, "remove") {
                return r;
            }
            match rt.remove_activity(path) {
                Ok(()) => {
                    shared
                        .shaped
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .remove(path);
                    changed(rt, path, 0, "removed")
                }
                Err(e) => runtime_error(&e, path),
            }
        }
        _ => Response::method_not_allowed("GET, PUT, DELETE"),
    }
}

/// The sampler's window at this moment (`None` before two samples and while the last one is
/// stale), and how current it is.
fn sampled(
    shared: &Shared,
    rt: &Runtime,
) -> (Option<crate::sampler::Window>, model::SamplerStatus) {
    let now = rt.now_ns();
    let st = shared.state.lock().unwrap_or_else(PoisonError::into_inner);
    (
        st.window(now),
        model::SamplerStatus {
            sample_age_s: st.age_s(now),
            sampler_failures: st.failures(),
        },
    )
}

/// The attached shaped groups, for the tree.
fn shaped_list(shared: &Shared, rt: &Runtime) -> Vec<model::Shaped> {
    let now = rt.now_ns();
    shared
        .shaped
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .list(now)
}

/// 409 when `path` is, or holds, an activity the server's running configuration owns: the
/// server keeps using those, so removing or moving one would break its tenant until a restart.
/// The config file is where tenants and classes are made and removed.
fn configured_refusal(shared: &Shared, path: &str, action: &str) -> Option<Response> {
    let owned = shared.source.tenants()?.configured_activities();
    let inside = |a: &str| a == path || path == "/" || a.starts_with(&format!("{path}/"));
    // The activity itself first, else the first one it holds.
    let hit = owned
        .iter()
        .find(|a| *a == path)
        .or_else(|| owned.iter().find(|a| inside(a)))?;
    let what = match hit.strip_prefix("/tenants/") {
        Some(rest) if !rest.contains('/') => format!("tenant {rest:?}"),
        _ => format!("the class {hit}"),
    };
    let how = if action == "remove" {
        "remove"
    } else {
        "rename or move"
    };
    Some(Response::error(
        409,
        &format!(
            "cannot {action} {path}: {hit} is the activity of {what} in the running config; to \
             {how} it, edit the config file (its [[tenant]] or [[tenant.class]] table) and \
             reload (SIGHUP)"
        ),
    ))
}

fn changed(rt: &Runtime, path: &str, id: u32, action: &str) -> Response {
    let (version, id) = rt.with_activities(|t| (t.version(), t.lookup(path).unwrap_or(id)));
    Response::json(
        if action == "created" { 201 } else { 200 },
        &Changed {
            path: path.to_string(),
            id,
            action: action.to_string(),
            version,
        },
    )
}

/// Whether the query asks to persist (`persist=true|1`); 400 for any other value.
fn wants_persist(query: &str) -> Result<bool, Response> {
    match query_get(query, "persist") {
        None | Some("false") | Some("0") => Ok(false),
        Some("true") | Some("1") => Ok(true),
        Some(v) => Err(Response::error(
            400,
            &format!("persist={v:?}: want true or false"),
        )),
    }
}

/// `persist=true` on a removal or a move: 501 (only `PUT` changes to the config's tenants and
/// classes are written back; what exists is the config file's business).
fn persist_refused(query: &str) -> Option<Response> {
    match wants_persist(query) {
        Ok(false) => None,
        Ok(true) => Some(Response::error(
            501,
            "persist=true applies to PUT changes of the config's tenants and classes only: \
             to remove or move one, edit the config file and send SIGHUP",
        )),
        Err(r) => Some(r),
    }
}

/// The config-file edits that persist `change` to `path`, or why it cannot be persisted:
/// only the keys the file has for a tenant (weight, cpu_cap, cap_kind, net_cap, disk_cap,
/// cache_bytes, send_order) or a class (weight).
fn persist_edits(
    tenants: Option<&dyn crate::Tenants>,
    path: &str,
    change: &ActivityChange,
) -> Result<Vec<Edit>, Response> {
    let Some(tenants) = tenants else {
        return Err(Response::error(
            501,
            "persist=true needs an HTTP server with a config file: this admin server runs \
             without one",
        ));
    };
    let not_in_file = || {
        Response::error(
            409,
            &format!(
                "{path} is not in the config file: only its tenants and classes persist; \
                 apply the change without persist=true"
            ),
        )
    };
    if !tenants.configured_activities().iter().any(|a| a == path) {
        return Err(not_in_file());
    }
    let rest = path.strip_prefix("/tenants/").ok_or_else(not_in_file)?;
    let (tenant, class) = match rest.split_once('/') {
        Some((t, c)) => (t.to_string(), Some(c.to_string())),
        None => (rest.to_string(), None),
    };
    let mut edits = Vec::new();
    let mut set = |key: &str, value: Setting| {
        edits.push(Edit {
            tenant: tenant.clone(),
            class: class.clone(),
            key: key.to_string(),
            value,
        })
    };
    let no_key = |what: &str| {
        Response::error(
            409,
            &format!(
                "{what} has no key in the config file for {path}: apply it without \
                 persist=true, or edit the file"
            ),
        )
    };
    if let Some(w) = change.weight {
        set("weight", Setting::Int(i64::from(w)));
    }
    if change.policy.is_some() {
        return Err(no_key("policy"));
    }
    if change.priority.is_some() {
        return Err(no_key("priority"));
    }
    if change.admission.is_some() {
        return Err(no_key("admission"));
    }
    let tenant_only = change.cap.is_some()
        || change.cap_net.is_some()
        || change.cap_disk.is_some()
        || change.budget.is_some()
        || change.send_order.is_some();
    if class.is_some() && tenant_only {
        return Err(no_key("a class's cap, budget or send order"));
    }
    match &change.cap {
        None => {}
        Some(None) => {
            set("cpu_cap", Setting::Remove);
            set("cap_kind", Setting::Remove);
        }
        Some(Some(c)) => {
            if c.burst_ms.is_some() {
                return Err(no_key("cap.burst_ms"));
            }
            set("cpu_cap", Setting::Float(c.cores));
            if let Some(k) = &c.kind {
                set("cap_kind", Setting::Str(k.clone()));
            }
        }
    }
    for (value, key, what) in [
        (&change.cap_net, "net_cap", "cap_net"),
        (&change.cap_disk, "disk_cap", "cap_disk"),
    ] {
        if let Some(v) = value {
            set(
                key,
                match bytes_setting(v, what)? {
                    None => Setting::Remove,
                    Some(n) => Setting::Str(format!("{n}B/s")),
                },
            );
        }
    }
    if let Some(v) = &change.budget {
        set(
            "cache_bytes",
            match bytes_setting(v, "budget")? {
                None => Setting::Remove,
                Some(n) => Setting::Int(i64::try_from(n).unwrap_or(i64::MAX)),
            },
        );
    }
    if let Some(o) = &change.send_order {
        set("send_order", Setting::Str(o.clone()));
    }
    Ok(edits)
}

/// Status of a refused activity change: 404 when `path` itself is missing, 400 for a path
/// that is not one, 409 for everything the tree's invariants refuse.
fn activity_status(e: &ActivityError, path: &str) -> u16 {
    match e {
        ActivityError::BadPath(_) => 400,
        ActivityError::NotFound(p) if p == path => 404,
        _ => 409,
    }
}

pub(crate) fn runtime_error(e: &RuntimeError, path: &str) -> Response {
    match e {
        RuntimeError::Activity(a) => Response::error(activity_status(a, path), &a.to_string()),
        RuntimeError::Config(s) => Response::error(409, s),
        RuntimeError::Io(e) => Response::error(500, &e.to_string()),
    }
}

pub(crate) fn body_json<T: serde::de::DeserializeOwned>(req: &Request) -> Result<T, Response> {
    // JSON only: a cross-origin page can send text/plain without asking (no CORS preflight).
    let json = req.headers.content_type.as_deref().is_some_and(|t| {
        t.split(';')
            .next()
            .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
    });
    if !json {
        return Err(Response::error(
            415,
            "send the body as Content-Type: application/json",
        ));
    }
    if req.body.is_empty() {
        return Err(Response::error(400, "want a JSON object in the body"));
    }
    serde_json::from_slice(&req.body).map_err(|e| Response::error(400, &format!("body: {e}")))
}

/// The bucket each of `workers` trees holds for a machine-wide cap of `c.cores` (split evenly,
/// as the HTTP server splits the config file's `cpu_cap`, so a cap set here and persisted means
/// the same in the file).
fn cap_spec(c: &CapChange, workers: usize) -> Result<ShaperSpec, Response> {
    if !c.cores.is_finite() {
        return Err(Response::error(400, "cap.cores must be a number"));
    }
    let kind = match c.kind.as_deref() {
        None | Some("token") => ShaperKind::Token,
        Some("leaky") => ShaperKind::Leaky,
        Some(k) => {
            return Err(Response::error(
                400,
                &format!("cap.kind {k:?}: want token or leaky"),
            ))
        }
    };
    let burst_ms = c.burst_ms.unwrap_or(CAP_BURST_MS_DEFAULT);
    if !burst_ms.is_finite() || burst_ms < 0.0 {
        return Err(Response::error(400, "cap.burst_ms must be a number >= 0"));
    }
    // Out-of-range values (0 cores, a huge rate) are left for the tree's validation: 409.
    let rate = (c.cores * 1e9 / workers.max(1) as f64).max(0.0);
    Ok(ShaperSpec {
        kind,
        rate_per_s: rate as u64,
        burst: match kind {
            ShaperKind::Token => ((rate * burst_ms / 1e3) as u64).max(1),
            ShaperKind::Leaky => 0,
        },
        grain: 0,
    })
}

/// The predicate an admission change asks for (`None`: back to the stage's), validated.
fn admission_predicate(
    rt: &Runtime,
    stage: u32,
    activity: Option<u32>,
    a: &AdmissionChange,
) -> Result<Option<Predicate>, Response> {
    let bad = |m: &str| Err(Response::error(409, m));
    let p = match a.predicate.as_str() {
        "inherit" => return Ok(None),
        "threshold" => Predicate::Threshold,
        "token" => {
            let (Some(rate_per_s), Some(burst)) = (a.rate_per_s, a.burst) else {
                return Err(Response::error(
                    400,
                    "a token predicate needs rate_per_s and burst",
                ));
            };
            Predicate::TokenBucket { rate_per_s, burst }
        }
        "p90" => {
            let Some(ms) = a.target_ms else {
                return Err(Response::error(400, "a p90 predicate needs target_ms"));
            };
            if !ms.is_finite() || ms <= 0.0 {
                return bad("target_ms must be > 0");
            }
            // Changing the target of a p90 predicate in force keeps its other parameters.
            let current = activity.and_then(|id| rt.admission(stage, id));
            let (mut params, initial, burst) = match current {
                Some(Predicate::P90 {
                    params,
                    initial_rate_per_s,
                    burst,
                }) => (params, initial_rate_per_s, burst),
                _ => (
                    P90Params {
                        rate_max_per_s: P90_RATE_MAX_PER_S,
                        adj_i: P90_RATE_MAX_PER_S / 1000.0,
                        ..P90Params::default()
                    },
                    P90_RATE_MAX_PER_S,
                    P90_BURST,
                ),
            };
            params.target_ns = (ms * 1e6) as u64;
            Predicate::P90 {
                params,
                initial_rate_per_s: a.rate_per_s.unwrap_or(initial),
                burst: a.burst.unwrap_or(burst),
            }
        }
        other => {
            return Err(Response::error(
                400,
                &format!("admission.predicate {other:?}: want threshold, token, p90 or inherit"),
            ))
        }
    };
    if let Err(e) = p.validate() {
        return bad(&e);
    }
    Ok(Some(p))
}

/// A rate or size from JSON: a number (bytes), a string with units ("10MB/s", "64MiB"), or
/// null to remove the setting.
pub(crate) fn bytes_setting(v: &serde_json::Value, what: &str) -> Result<Option<u64>, Response> {
    match v {
        serde_json::Value::Null => Ok(None),
        serde_json::Value::Number(n) => {
            let n = n.as_u64().ok_or_else(|| {
                Response::error(400, &format!("{what} must be a whole number of bytes"))
            })?;
            // The ceiling a string ("1000GB/s") has: past it a shaper refuses the rate, and
            // the server would keep the old cap while its config said the new one.
            let max = omnistage_http::config::RATE_BYTES_PER_S_MAX;
            if n > max {
                return Err(Response::error(
                    400,
                    &format!("{what} {n} is above {max} (1 TB)"),
                ));
            }
            Ok(Some(n))
        }
        serde_json::Value::String(s) => {
            let t = s.trim();
            let rate = if t.ends_with("/s") {
                t.to_string()
            } else {
                format!("{t}/s")
            };
            omnistage_http::config::parse_rate(&rate)
                .map(Some)
                .map_err(|e| Response::error(400, &format!("{what}: {e}")))
        }
        _ => Err(Response::error(
            400,
            &format!("{what} must be a number, a string like \"10MB/s\", or null"),
        )),
    }
}

/// The server-side part of a change (network and disk caps, cache budget, send order),
/// parsed; `None` when the change has none.
fn tenant_change(change: &ActivityChange) -> Result<Option<crate::TenantChange>, Response> {
    let server_side = change.cap_net.is_some()
        || change.cap_disk.is_some()
        || change.budget.is_some()
        || change.send_order.is_some();
    if !server_side {
        return Ok(None);
    }
    let mut tc = crate::TenantChange::default();
    if let Some(v) = &change.cap_net {
        tc.net_cap_bytes_per_s = Some(bytes_setting(v, "cap_net")?);
    }
    if let Some(v) = &change.cap_disk {
        tc.disk_cap_bytes_per_s = Some(bytes_setting(v, "cap_disk")?);
    }
    if let Some(v) = &change.budget {
        tc.cache_bytes = Some(bytes_setting(v, "budget")?);
    }
    if let Some(v) = &change.send_order {
        tc.send_order = Some(
            omnistage_http::config::SendOrder::parse(v).map_err(|e| Response::error(400, &e))?,
        );
    }
    Ok(Some(tc))
}

/// `PUT /api/v1/activities/{path}`: every part of the change is parsed and checked first (the
/// body, the server-side settings, the activity's settings, the admission predicate, whether
/// the file takes it), then the change is applied, then the file is written (`persist=true`);
/// so a refused request changes nothing, and the file never holds a change that did not run.
fn put_activity(
    rt: &Runtime,
    tenants: Option<&dyn crate::Tenants>,
    shaped_groups: &std::sync::Mutex<shaped::Table>,
    req: &Request,
    path: &str,
) -> Response {
    if let Err(r) = check_query(&req.query, &["persist"]) {
        return r;
    }
    let persist = match wants_persist(&req.query) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let change: ActivityChange = match body_json(req) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let tenant_change = match tenant_change(&change) {
        Ok(tc) => tc,
        Err(r) => return r,
    };
    // An attached shaped group's rates are kept here, not by the HTTP server.
    let shaped_change = match shaped::check_change(shaped_groups, path, tenant_change.as_ref()) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let tenant_change = if shaped_change.is_some() {
        None
    } else {
        tenant_change
    };
    if tenant_change.is_some() && tenants.is_none() {
        return Response::error(
            501,
            "network and disk caps, cache budgets and send orders live in the HTTP server: \
             this admin server runs without one",
        );
    }
    let existing = rt.with_activities(|t| {
        t.lookup(path)
            .and_then(|id| t.get(id).map(|a| (id, a.spec.clone())))
    });
    let mut spec = existing
        .as_ref()
        .map(|(_, s)| s.clone())
        .unwrap_or_default();
    if let Some(w) = change.weight {
        spec.weight = w;
    }
    if let Some(p) = &change.policy {
        match PolicyKind::parse(p) {
            Some(k) => spec.policy = k,
            None => {
                return Response::error(
                    400,
                    &format!("policy {p:?}: want fifo, rr, priority, wfq, sfq or drr"),
                )
            }
        }
    }
    if let Some(p) = change.priority {
        spec.priority = p;
    }
    if let Some(cap) = &change.cap {
        spec.cap = match cap {
            None => None,
            Some(c) => match cap_spec(c, rt.workers()) {
                Ok(s) => Some(s),
                Err(r) => return r,
            },
        };
    }
    if let Err(e) = spec.validate() {
        return Response::error(activity_status(&e, path), &e.to_string());
    }
    let admission = match &change.admission {
        None => None,
        Some(a) => {
            let Some(stage) = view::stage_by_name(rt, &a.stage) else {
                return Response::error(400, &format!("no stage named {:?}", a.stage));
            };
            let current = existing
                .as_ref()
                .and_then(|(id, _)| rt.admission(stage, *id));
            if let Some(Predicate::ClassedP90 { .. }) = current {
                return Response::error(
                    409,
                    &format!(
                        "{path}'s admission on {} is a level of its tenant's class-priority \
                         controller (the config's [[tenant.class]] priorities): changing it \
                         alone would take it out of its classes' controller; change the \
                         p90_target_ms of the tenant or its classes in the config file and \
                         reload (SIGHUP)",
                        a.stage
                    ),
                );
            }
            match admission_predicate(rt, stage, existing.as_ref().map(|(id, _)| *id), a) {
                Ok(p) => Some((stage, p)),
                Err(r) => return r,
            }
        }
    };
    let weight_changed = existing
        .as_ref()
        .is_some_and(|(_, old)| old.weight != spec.weight);
    let cap_changed = existing
        .as_ref()
        .is_some_and(|(_, old)| old.cap != spec.cap);
    // What the file would get (refusals here are the file's: no key, not in it).
    let edits = if persist {
        match persist_edits(tenants, path, &change) {
            Ok(e) => Some(e),
            Err(r) => return r,
        }
    } else {
        None
    };
    if let (Some(t), Some(_)) = (tenants, &tenant_change) {
        // Only a configured tenant has these settings: refuse before anything is changed.
        let is_tenant = path
            .strip_prefix("/tenants/")
            .is_some_and(|n| !n.contains('/'))
            && t.configured_activities().iter().any(|a| a == path);
        if !is_tenant {
            return Response::error(
                404,
                &format!(
                    "{path} is not a tenant of the running config: network and disk caps, \
                     cache budgets and send orders are a configured tenant's settings"
                ),
            );
        }
    }
    // A configured tenant's weight is also its weight on the link (the HTTP server's send
    // scheduler takes it from the running configuration), and the running configuration is
    // what a later change of the tenant applies again: a new weight or CPU cap goes into it,
    // as this change's own (the server does not read weights back from the runtime, where a
    // fleet node's are the fleet's). It goes with the server-side settings, as one change of
    // the running configuration, checked here and applied before the activity is set (so the
    // activity ends with this request's spec exactly: the config rebuilds a cap's burst its
    // own way). An activity the configuration does not own has no node on the link
    // (NotATenant when only the weight or cap changed: nothing to do there).
    let fold_only = tenant_change.is_none();
    let server_change = if tenant_change.is_some() || weight_changed || cap_changed {
        let mut c = tenant_change.clone().unwrap_or_default();
        if weight_changed {
            c.weight = Some(spec.weight);
        }
        if cap_changed {
            c.cpu_cap = Some(spec.cap);
        }
        tenants.map(|t| (t, c))
    } else {
        None
    };
    let server_error = |e: crate::TenantError, refused: &str| match e {
        crate::TenantError::NotATenant(m) => Response::error(404, &m),
        crate::TenantError::Refused(m) => Response::error(409, &format!("{refused}: {m}")),
    };
    let server_change = match server_change {
        Some((t, c)) => match t.check_tenant(path, &c) {
            Ok(()) => Some((t, c)),
            Err(crate::TenantError::NotATenant(_)) if fold_only => None,
            Err(e) => return server_error(e, "refused, nothing changed"),
        },
        None => None,
    };
    if let (Some(edits), Some(t)) = (&edits, tenants) {
        // Whether the file takes the change (changed on disk, invalid, embedded default) is
        // checked before anything changes; it is written last, once the change runs, so a
        // change the server then fails to apply is not in the file either.
        if let Err(crate::TenantError::Refused(m) | crate::TenantError::NotATenant(m)) =
            t.check_persist(edits)
        {
            return Response::error(409, &format!("not persisted, nothing changed: {m}"));
        }
    }
    if let Some((t, c)) = server_change {
        match t.set_tenant(path, &c) {
            Ok(()) => {}
            Err(crate::TenantError::NotATenant(_)) if fold_only => {}
            // One reload applies all of it or none (a certificate that no longer loads, say).
            Err(e) if persist => return server_error(e, "not changed, nor written to the file"),
            Err(e) => return server_error(e, "not changed"),
        }
    }
    let (id, action) = match &existing {
        Some((id, _)) => match rt.set_activity(path, spec) {
            Ok(()) => (*id, "changed"),
            Err(e) => return runtime_error(&e, path),
        },
        None => match rt.create_activity(path, spec) {
            Ok(id) => (id, "created"),
            Err(e) => return runtime_error(&e, path),
        },
    };
    if let Some((stage, p)) = admission {
        if let Err(e) = rt.set_admission(stage, id, p) {
            return runtime_error(&e, path);
        }
    }
    if let Some(c) = shaped_change {
        c.apply(shaped_groups, path);
    }
    if let (Some(edits), Some(t)) = (&edits, tenants) {
        if let Err(crate::TenantError::Refused(m) | crate::TenantError::NotATenant(m)) =
            t.persist(edits)
        {
            // Checked above, so only a failed write or an edit of the file since gets here;
            // the change runs, and the answer says so.
            return Response::error(
                500,
                &format!(
                    "{path} was {action} and runs, but the config file was not written (it \
                     keeps what it had): {m}"
                ),
            );
        }
    }
    changed(rt, path, id, action)
}

fn move_activity(rt: &Runtime, req: &Request, path: &str) -> Response {
    if let Err(r) = check_query(&req.query, &["persist"]) {
        return r;
    }
    if let Some(r) = persist_refused(&req.query) {
        return r;
    }
    let m: MoveRequest = match body_json(req) {
        Ok(m) => m,
        Err(r) => return r,
    };
    if m.connections_to.is_some() {
        return Response::error(
            501,
            "moving connections is not implemented: a connection's activity is set by the HTTP \
             server's stages (by Host and class); move the sub-tree instead",
        );
    }
    let Some(to) = m.to else {
        return Response::error(400, "want {\"to\": \"/new/parent\"}");
    };
    if let Err(e) = parse_path(&to) {
        return Response::error(400, &e.to_string());
    }
    match rt.move_activity(path, &to) {
        Ok(()) => {
            let new_path = if to == "/" {
                format!("/{}", path.rsplit('/').next().unwrap_or(""))
            } else {
                format!("{to}/{}", path.rsplit('/').next().unwrap_or(""))
            };
            changed(rt, &new_path, 0, "moved")
        }
        Err(e) => runtime_error(&e, path),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abc", b"abd"));
        assert!(!same_secret(b"abc", b"abcd"));
        assert!(!same_secret(b"", b"a"));
    }

    #[test]
    fn queries_split() {
        assert_eq!(
            query_pairs("a=1&b&&c=x=y"),
            vec![("a", "1"), ("b", ""), ("c", "x=y")]
        );
        assert!(check_query("format=dot", &["format"]).is_ok());
        assert_eq!(check_query("x=1", &["format"]).unwrap_err().status, 400);
        assert!(persist_refused("persist=false").is_none());
        assert_eq!(persist_refused("persist=true").unwrap().status, 501);
        assert_eq!(wants_persist("persist=1").ok(), Some(true));
        assert_eq!(persist_refused("persist=maybe").unwrap().status, 400);
    }

    #[test]
    fn host_names() {
        assert_eq!(host_name("127.0.0.1:9090"), "127.0.0.1");
        assert_eq!(host_name("[::1]:9090"), "::1");
        assert_eq!(host_name("localhost"), "localhost");
        assert_eq!(host_name("evil.example:80"), "evil.example");
    }

    fn cap(cores: f64, kind: Option<&str>) -> CapChange {
        CapChange {
            cores,
            kind: kind.map(str::to_string),
            burst_ms: None,
        }
    }

    #[test]
    fn caps_in_cores() {
        let c = cap_spec(&cap(0.5, None), 1).unwrap();
        assert_eq!(c, ShaperSpec::token(500_000_000, 5_000_000));
        let l = cap_spec(&cap(2.0, Some("leaky")), 1).unwrap();
        assert_eq!(l, ShaperSpec::leaky(2_000_000_000));
        assert_eq!(
            cap_spec(&cap(1.0, Some("bucket")), 1).unwrap_err().status,
            400
        );
    }

    #[test]
    fn a_cap_is_for_the_machine_and_split_between_the_workers() {
        // Half a core on four workers: each tree holds an eighth of a core, and 10 ms of that
        // rate as its burst (the default).
        let c = cap_spec(&cap(0.5, None), 4).unwrap();
        assert_eq!(c, ShaperSpec::token(125_000_000, 1_250_000));
    }
}
