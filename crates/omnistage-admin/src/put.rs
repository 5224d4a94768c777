//! `PUT /api/v1/activities/{path}`: creating or changing an activity (weight, policy,
//! priority, CPU cap, admission) and the HTTP server's settings of a tenant (network and disk
//! caps, cache budget, send order), every part of a request checked before any part is applied,
//! and `persist=true`'s edits of the config file. Changes go through `Runtime::create_activity`,
//! `set_activity` and `set_admission`.

use crate::activities::{activity_status, changed, runtime_error, wants_persist};
use crate::model::{ActivityChange, AdmissionChange, CapChange};
use crate::routes::{body_json, check_query, Request, Response};
use crate::{shaped, view};
use omnistage::activity::ActivitySpec;
use omnistage::admit::P90Params;
use omnistage::exec::{Predicate, Runtime};
use omnistage::sched::{PolicyKind, ShaperKind, ShaperSpec};
use omnistage_http::persist::{Edit, Setting};

/// Default burst of a CPU cap given in cores: 10 ms of its rate (as the HTTP config does).
const CAP_BURST_MS_DEFAULT: f64 = 10.0;
/// A p90 admission created through the API: up to this many admissions/s (SEDA's ceiling of
/// 5,000/s is too low for an HTTP server), starting there, additive step of a thousandth.
const P90_RATE_MAX_PER_S: f64 = 100_000.0;
const P90_BURST: u32 = 1_000;

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
pub(crate) fn put_activity(
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
    // Applied in this order, each step undone again when a later one fails (the checks
    // above refuse every value a client can send, so what still fails here is the server's
    // reload, the runtime's tree changed under the change, or the file's write): a failed
    // change leaves nothing of itself behind, and the answer says so.
    let mut undo = Undo {
        rt,
        path,
        tenant: None,
        activity: None,
        admission: None,
    };
    if let Some((t, c)) = server_change {
        let saved = t.saved_tenant(path);
        match t.set_tenant(path, &c) {
            Ok(()) => undo.tenant = Some((t, saved)),
            Err(crate::TenantError::NotATenant(_)) if fold_only => {}
            // One reload applies all of it or none (a certificate that no longer loads, say).
            Err(e) if persist => return server_error(e, "not changed, nor written to the file"),
            Err(e) => return server_error(e, "not changed"),
        }
    }
    let (id, action) = match &existing {
        Some((id, old)) => match rt.set_activity(path, spec) {
            Ok(()) => {
                undo.activity = Some(Some(old.clone()));
                (*id, "changed")
            }
            Err(e) => return undo.failed(runtime_error(&e, path)),
        },
        None => match rt.create_activity(path, spec) {
            Ok(id) => {
                undo.activity = Some(None);
                (id, "created")
            }
            Err(e) => return undo.failed(runtime_error(&e, path)),
        },
    };
    if let Some((stage, p)) = admission {
        // The override itself, not the predicate in force: with none set, the undo removes the
        // one set here instead of pinning the stage's predicate as one. (Putting it back still
        // restarts the gate's controller from its predicate's start.)
        let before = rt.admission_override(stage, id);
        if let Err(e) = rt.set_admission(stage, id, p) {
            return undo.failed(runtime_error(&e, path));
        }
        undo.admission = Some((stage, id, before));
    }
    if let (Some(edits), Some(t)) = (&edits, tenants) {
        if let Err(crate::TenantError::Refused(m) | crate::TenantError::NotATenant(m)) =
            t.persist(edits)
        {
            // Checked above under the same lock, so only a failed write or an edit of the file
            // by hand since gets here.
            return undo.failed(Response::error(
                500,
                &format!("the config file could not be written (it keeps what it had): {m}"),
            ));
        }
    }
    // Last: it cannot fail.
    if let Some(c) = shaped_change {
        c.apply(shaped_groups, path);
    }
    changed(rt, path, id, action)
}

/// What a `PUT` applied so far, to put back when a later step fails.
struct Undo<'a> {
    rt: &'a Runtime,
    path: &'a str,
    /// The tenant's settings were changed: the server, and its settings before (`None`: the
    /// server cannot give them back, and the answer says the change stays).
    tenant: Option<(
        &'a dyn crate::Tenants,
        Option<omnistage_http::config::TenantConfig>,
    )>,
    /// The activity was changed (`Some(spec before)`) or created (`None`).
    activity: Option<Option<ActivitySpec>>,
    /// The admission was set: stage, activity, the override before (`None`: none).
    admission: Option<(u32, u32, Option<Predicate>)>,
}

impl Undo<'_> {
    /// Undoes what was applied, latest first, and answers `failure` with that said: its own
    /// status when everything was put back, 500 when something could not be.
    fn failed(self, failure: Response) -> Response {
        let path = self.path;
        let mut left = Vec::new();
        if let Some((stage, id, before)) = self.admission {
            if let Err(e) = self.rt.set_admission(stage, id, before) {
                left.push(format!("its admission ({e})"));
            }
        }
        if let Some((t, saved)) = self.tenant {
            match saved {
                Some(saved) => {
                    if let Err(crate::TenantError::Refused(m) | crate::TenantError::NotATenant(m)) =
                        t.restore_tenant(path, &saved)
                    {
                        left.push(format!("the server's settings of the tenant ({m})"));
                    }
                }
                None => left.push("the server's settings of the tenant".into()),
            }
        }
        match self.activity {
            Some(Some(old)) => {
                if let Err(e) = self.rt.set_activity(path, old) {
                    left.push(format!("the activity's spec ({e})"));
                }
            }
            Some(None) => {
                if let Err(e) = self.rt.remove_activity(path) {
                    left.push(format!("the activity it created ({e})"));
                }
            }
            None => {}
        }
        let why = serde_json::from_slice::<crate::model::ErrorBody>(&failure.body)
            .map(|b| b.error)
            .unwrap_or_default();
        if left.is_empty() {
            Response::error(
                failure.status,
                &format!("{path} not changed (what was applied was undone): {why}"),
            )
        } else {
            Response::error(
                500,
                &format!(
                    "{path} changed in part: {why}; undoing it failed for {}, which keep the \
                     new values",
                    left.join(", ")
                ),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
