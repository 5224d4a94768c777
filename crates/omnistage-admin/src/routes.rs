//! The admin API's front door and its read-only views: the request and answer types, the
//! bearer token and browser guards, the dispatch of every path, and the documents that only
//! read the runtime (`/metrics`, `/api/v1/tree`, `/stages`, `/graph`, `/history`,
//! `/upstreams`). The routes that change the activity tree are in `activities` (and `put`
//! for `PUT`); shaped groups' `:attach` and `:report` in `shaped`.

use crate::activities;
use crate::http::Shared;
use crate::model;
use crate::sampler::Sample;
use crate::{metrics, view};
use omnistage::exec::Runtime;
use std::sync::PoisonError;

/// The dashboard page and its script, embedded in the binary.
const INDEX_HTML: &str = include_str!("../assets/index.html");
const DASHBOARD_JS: &str = include_str!("../assets/dashboard.js");

/// Where activity paths start in the URL.
pub(crate) const ACTIVITIES: &str = "/api/v1/activities";

/// Most entries a listing holds: nodes of `/api/v1/tree`, (stage, activity) rows of
/// `/api/v1/stages`, edges of `/api/v1/graph`. Past it the rest is left out and the document
/// says so (`"truncated": true, "omitted": N`); at ~1.5 KB a tree node, 10,000 is ~15 MB.
pub const LIST_ENTRIES_MAX: usize = 10_000;
/// Largest document the API answers with (every listing: the tree, stages, graph, history,
/// upstreams, one activity's sub-tree): past it, 507 with the reason instead of the document
/// (it is written into a bounded buffer, so the bound holds while it is built).
pub const DOCUMENT_BYTES_MAX: usize = 32 << 20;

/// The bounds in force ([`LIST_ENTRIES_MAX`], [`DOCUMENT_BYTES_MAX`]; tests lower them).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub(crate) entries: usize,
    pub(crate) bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            entries: LIST_ENTRIES_MAX,
            bytes: DOCUMENT_BYTES_MAX,
        }
    }
}

/// A `Vec` that takes at most `max` bytes; a write past it fails.
struct Capped {
    buf: Vec<u8>,
    max: usize,
    over: bool,
}

impl std::io::Write for Capped {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + b.len() > self.max {
            self.over = true;
            return Err(std::io::Error::other("document over its bound"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

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

    /// A listing as JSON, or 507 when it is larger than `max` bytes.
    pub(crate) fn listing<T: serde::Serialize>(v: &T, max: usize) -> Self {
        let mut w = Capped {
            buf: Vec::new(),
            max: max.saturating_sub(1),
            over: false,
        };
        match serde_json::to_writer(&mut w, v) {
            Ok(()) => {
                let mut body = w.buf;
                body.push(b'\n');
                Response::new(200, "application/json", body)
            }
            Err(_) if w.over => Response::too_large(max),
            Err(e) => Response::error(500, &format!("the document does not serialize: {e}")),
        }
    }

    /// 507: a document over the bound of `max` bytes.
    pub(crate) fn too_large(max: usize) -> Self {
        Response::error(
            507,
            &format!(
                "the document is larger than {max} bytes, the admin API's bound on an answer \
                 (DOCUMENT_BYTES_MAX); ask for less (one activity's sub-tree: \
                 /api/v1/activities/{{path}})"
            ),
        )
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

    pub(crate) fn method_not_allowed(allow: &'static str) -> Self {
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

pub(crate) fn query_get<'a>(q: &'a str, key: &str) -> Option<&'a str> {
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
            t.truncation = view::bound_tree(&mut t.root, shared.limits.entries);
            Response::listing(&t, shared.limits.bytes)
        }),
        "/api/v1/stages" => get_only(&|| {
            if let Err(r) = check_query(&req.query, &[]) {
                return r;
            }
            let (win, status) = sampled(shared, rt);
            let mut st = view::stages(rt, &Sample::take(rt), win.as_ref());
            st.sampler = status;
            view::bound_stages(&mut st, shared.limits.entries);
            Response::listing(&st, shared.limits.bytes)
        }),
        "/api/v1/graph" | "/api/v1/graph.dot" => get_only(&|| {
            if let Err(r) = check_query(&req.query, &["format"]) {
                return r;
            }
            let mut g = view::graph(rt, &Sample::take(rt), sampled(shared, rt).0.as_ref());
            view::bound_graph(&mut g, shared.limits.entries);
            let format = query_get(&req.query, "format").unwrap_or(if path.ends_with(".dot") {
                "dot"
            } else {
                "json"
            });
            match format {
                "json" => Response::listing(&g, shared.limits.bytes),
                "dot" => match view::dot(&g) {
                    d if d.len() > shared.limits.bytes => Response::too_large(shared.limits.bytes),
                    d => Response::new(200, "text/vnd.graphviz; charset=utf-8", d.into_bytes()),
                },
                other => Response::error(400, &format!("format {other:?}: want json or dot")),
            }
        }),
        "/api/v1/upstreams" => get_only(&|| {
            if let Err(r) = check_query(&req.query, &[]) {
                return r;
            }
            Response::listing(&upstreams(), shared.limits.bytes)
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
            Response::listing(
                &model::History {
                    interval_s: win.map(|w| w.dt_s()).unwrap_or(0.0),
                    points,
                    sampler,
                },
                shared.limits.bytes,
            )
        }),
        _ => activities::activity(shared, rt, req),
    }
}

/// The sampler's window at this moment (`None` before two samples and while the last one is
/// stale), and how current it is.
pub(crate) fn sampled(
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
pub(crate) fn shaped_list(shared: &Shared, rt: &Runtime) -> Vec<model::Shaped> {
    let now = rt.now_ns();
    shared
        .shaped
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .list(now)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activities::{persist_refused, wants_persist};

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
}
