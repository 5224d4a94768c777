//! The `/api/v1/activities[/{path}][:verb]` routes: one node of the tree (`GET`), and the
//! changes that are not a `PUT` (`DELETE`, `:move`; `:attach` and `:report` are `shaped`'s);
//! the changing routes run one at a time. Also the pieces every changing route shares: how a
//! refused change is answered, `persist=` and the configured-activity refusals.

use crate::http::Shared;
use crate::model::{Changed, MoveRequest};
use crate::routes::{
    body_json, check_query, query_get, sampled, shaped_list, Request, Response, ACTIVITIES,
};
use crate::sampler::Sample;
use crate::{put, shaped, view};
use omnistage::activity::{parse_path, ActivityError};
use omnistage::exec::{Runtime, RuntimeError};
use std::sync::PoisonError;

/// The verbs that may follow an activity's path after `:` (which never occurs in a path):
/// move a sub-tree, attach a shaped group, take a shaped group's report.
const VERBS: [&str; 3] = ["move", "attach", "report"];

/// `/api/v1/activities[/{path}][:move]`.
pub(crate) fn activity(shared: &Shared, rt: &Runtime, req: &Request) -> Response {
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
    // And the owner's lock, which its own reloads (SIGHUP) take too: a reload waits until a
    // change is applied and written, and a change until a reload is done.
    let _owner = changing
        .then(|| shared.source.tenants().and_then(|t| t.changes()))
        .flatten()
        .map(|m| m.lock().unwrap_or_else(PoisonError::into_inner));
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
                Some(n) => Response::listing(n, shared.limits.bytes),
                None => Response::error(404, &format!("no activity {path}")),
            }
        }
        "PUT" => put::put_activity(rt, shared.source.tenants(), &shared.shaped, req, path),
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

pub(crate) fn changed(rt: &Runtime, path: &str, id: u32, action: &str) -> Response {
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
pub(crate) fn wants_persist(query: &str) -> Result<bool, Response> {
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
pub(crate) fn persist_refused(query: &str) -> Option<Response> {
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

/// Status of a refused activity change: 404 when `path` itself is missing, 400 for a path
/// that is not one, 409 for everything the tree's invariants refuse.
pub(crate) fn activity_status(e: &ActivityError, path: &str) -> u16 {
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
