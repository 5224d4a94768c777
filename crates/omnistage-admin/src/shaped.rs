//! Shaped groups attached from outside the process (`omnistage shape --admin ADDR --activity
//! PATH`): which activities have one, the network and disk rates each should run at, and the
//! routes that attach a group, take its byte reports and change its rates.
//!
//! The shaping itself runs in the shaped processes (the preload library's buckets in the group's
//! shared segment). The admin API keeps the rates the group is to run at, and charges the bytes
//! the group reports to its activity's ledger (the `external` pseudo-stage, see
//! `Runtime::charge_external`), so they show in `/api/v1/tree`, `omnistage top` and `/metrics`
//! with the server's own. The launcher reports every quarter second and takes the rates from
//! the answer, so `omnistage set PATH cap_net=2MiB/s` reaches the group within one report.
//!
//! ```text
//! POST /api/v1/activities/{path}:attach   {"cap_net": R|null, "cap_disk": R|null}
//!                                         creates the activity if it is missing; an attached
//!                                         one keeps its rates (a `set` made since wins)
//! POST /api/v1/activities/{path}:report   {"bytes_in", "bytes_out", "disk_read_bytes",
//!                                          "disk_write_bytes"}: bytes since the last report
//! PUT  /api/v1/activities/{path}          cap_net / cap_disk change an attached group's rates
//! ```

use crate::activities::runtime_error;
use crate::model::{
    Shaped, ShapedAttach, ShapedReport, SHAPED_GROUPS_MAX, SHAPED_REPORT_BYTES_MAX,
};
use crate::put::bytes_setting;
use crate::routes::{body_json, check_query, Response};
use crate::TenantChange;
use omnistage::activity::ActivitySpec;
use omnistage::exec::{ExternalBytes, Runtime};
use omnistage::sched::ShaperSpec;
use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

#[derive(Clone, Copy, Debug, Default)]
struct Entry {
    cap_net: Option<u64>,
    cap_disk: Option<u64>,
    reports: u64,
    last_report_ns: u64,
}

/// The attached groups, by activity path.
#[derive(Debug, Default)]
pub(crate) struct Table {
    by_path: BTreeMap<String, Entry>,
}

impl Table {
    pub(crate) fn contains(&self, path: &str) -> bool {
        self.by_path.contains_key(path)
    }

    /// Whether `path` or an activity under it has a group attached.
    pub(crate) fn holds_under(&self, path: &str) -> bool {
        let prefix = format!("{path}/");
        self.by_path
            .keys()
            .any(|p| p == path || path == "/" || p.starts_with(&prefix))
    }

    pub(crate) fn remove(&mut self, path: &str) {
        self.by_path.remove(path);
    }

    /// Every attached group as the API shows it, at `now_ns`.
    pub(crate) fn list(&self, now_ns: u64) -> Vec<Shaped> {
        self.by_path
            .iter()
            .map(|(p, e)| shaped(p, e, now_ns))
            .collect()
    }
}

fn shaped(path: &str, e: &Entry, now_ns: u64) -> Shaped {
    Shaped {
        path: path.to_string(),
        cap_net: e.cap_net,
        cap_disk: e.cap_disk,
        reports: e.reports,
        last_report_age_s: now_ns.saturating_sub(e.last_report_ns) as f64 / 1e9,
    }
}

/// A rate a shaped group can run at: what `omnistage shape` itself accepts (a token bucket with
/// 10 ms of the rate as its burst must be valid).
fn check_rate(rate: Option<u64>, what: &str) -> Result<(), Response> {
    let Some(r) = rate else { return Ok(()) };
    if r == 0 {
        return Err(Response::error(
            409,
            &format!(
                "{what} of 0 B/s would stop the group for good: give a rate, or null for none"
            ),
        ));
    }
    ShaperSpec::token(r, (r / 100).max(1))
        .validate()
        .map_err(|e| Response::error(409, &format!("{what}: {e}")))
}

/// `POST {path}:attach`.
pub(crate) fn attach(
    table: &Mutex<Table>,
    rt: &Runtime,
    configured: &[String],
    req: &crate::routes::Request,
    path: &str,
) -> Response {
    if let Err(r) = check_query(&req.query, &[]) {
        return r;
    }
    let a: ShapedAttach = match body_json(req) {
        Ok(a) => a,
        Err(r) => return r,
    };
    let caps = bytes_setting(&a.cap_net, "cap_net")
        .and_then(|n| Ok((n, bytes_setting(&a.cap_disk, "cap_disk")?)));
    let (cap_net, cap_disk) = match caps {
        Ok(c) => c,
        Err(r) => return r,
    };
    if let Err(r) = check_rate(cap_net, "cap_net").and_then(|()| check_rate(cap_disk, "cap_disk")) {
        return r;
    }
    if path == "/" || path == "/infra" || path.starts_with("/infra/") {
        return Response::error(409, &format!("a shaped group cannot be attached to {path}"));
    }
    if configured.iter().any(|c| c == path) {
        return Response::error(
            409,
            &format!(
                "{path} is an activity of the running config, whose network and disk caps are \
                 the server's: attach the group under it (e.g. {path}/shaped)"
            ),
        );
    }
    // The runtime is called with the table unlocked (a panic in it must not poison the table
    // every tree read takes). Attaches are serialised by the changing routes' lock, so the
    // table cannot gain or lose this path meanwhile; it is checked again on insert anyway.
    let full = |t: &Table| !t.contains(path) && t.by_path.len() >= SHAPED_GROUPS_MAX;
    let refused_full = || {
        Response::error(
            409,
            &format!("{SHAPED_GROUPS_MAX} shaped groups are attached already: remove one's activity first"),
        )
    };
    if full(&table.lock().unwrap_or_else(PoisonError::into_inner)) {
        return refused_full();
    }
    if rt.activity_id(path).is_none() {
        if let Err(e) = rt.create_activity(path, ActivitySpec::default()) {
            return runtime_error(&e, path);
        }
    }
    let now = rt.now_ns();
    let mut t = table.lock().unwrap_or_else(PoisonError::into_inner);
    if full(&t) {
        return refused_full();
    }
    let (status, e) = match t.by_path.get(path) {
        Some(e) => (200, *e),
        None => {
            let e = Entry {
                cap_net,
                cap_disk,
                reports: 0,
                last_report_ns: now,
            };
            t.by_path.insert(path.to_string(), e);
            (201, e)
        }
    };
    drop(t);
    Response::json(status, &shaped(path, &e, now))
}

/// `POST {path}:report`.
pub(crate) fn report(
    table: &Mutex<Table>,
    rt: &Runtime,
    req: &crate::routes::Request,
    path: &str,
) -> Response {
    if let Err(r) = check_query(&req.query, &[]) {
        return r;
    }
    let r: ShapedReport = match body_json(req) {
        Ok(r) => r,
        Err(r) => return r,
    };
    let fields = [
        ("bytes_in", r.bytes_in),
        ("bytes_out", r.bytes_out),
        ("disk_read_bytes", r.disk_read_bytes),
        ("disk_write_bytes", r.disk_write_bytes),
    ];
    if let Some((name, v)) = fields.iter().find(|(_, v)| *v > SHAPED_REPORT_BYTES_MAX) {
        return Response::error(
            400,
            &format!("{name} = {v}: one report carries at most {SHAPED_REPORT_BYTES_MAX} bytes of each kind"),
        );
    }
    let not_attached = || {
        Response::error(
            404,
            &format!("no shaped group is attached to {path}: attach first"),
        )
    };
    // The runtime is called with the table unlocked (a panic in it must not poison the table).
    if !table
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .contains(path)
    {
        return not_attached();
    }
    let Some(id) = rt.activity_id(path) else {
        // Removed behind our back (the route that removes it drops the entry too).
        table
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(path);
        return Response::error(404, &format!("no activity {path}: attach again"));
    };
    let bytes = ExternalBytes {
        net_in: r.bytes_in,
        net_out: r.bytes_out,
        disk_read: r.disk_read_bytes,
        disk_write: r.disk_write_bytes,
    };
    if let Err(e) = rt.charge_external(id, bytes) {
        return runtime_error(&e, path);
    }
    let now = rt.now_ns();
    let mut t = table.lock().unwrap_or_else(PoisonError::into_inner);
    // Detached meanwhile (its activity removed): the bytes were charged, the entry is gone.
    let Some(e) = t.by_path.get_mut(path) else {
        drop(t);
        return not_attached();
    };
    e.reports += 1;
    e.last_report_ns = now;
    let e = *e;
    drop(t);
    Response::json(200, &shaped(path, &e, now))
}

/// A `PUT` change to an attached group's rates, checked: `Ok(None)` when `path` has no group
/// attached (the change is the server's business), `Ok(Some(apply))` when it has and the
/// change is one it can take.
pub(crate) fn check_change(
    table: &Mutex<Table>,
    path: &str,
    change: Option<&TenantChange>,
) -> Result<Option<ShapedChange>, Response> {
    if !table
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .contains(path)
    {
        return Ok(None);
    }
    let Some(tc) = change else {
        return Ok(Some(ShapedChange::default()));
    };
    if tc.cache_bytes.is_some() || tc.send_order.is_some() {
        return Err(Response::error(
            409,
            &format!(
                "{path} is a shaped group's activity: it has network and disk rates (cap_net, \
                 cap_disk), no cache budget or send order"
            ),
        ));
    }
    if let Some(r) = tc.net_cap_bytes_per_s {
        check_rate(r, "cap_net")?;
    }
    if let Some(r) = tc.disk_cap_bytes_per_s {
        check_rate(r, "cap_disk")?;
    }
    Ok(Some(ShapedChange {
        cap_net: tc.net_cap_bytes_per_s,
        cap_disk: tc.disk_cap_bytes_per_s,
    }))
}

/// A checked change to an attached group's rates (outer `Option`: change it; inner: the rate or
/// none).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ShapedChange {
    cap_net: Option<Option<u64>>,
    cap_disk: Option<Option<u64>>,
}

impl ShapedChange {
    pub(crate) fn apply(&self, table: &Mutex<Table>, path: &str) {
        let mut t = table.lock().unwrap_or_else(PoisonError::into_inner);
        // Detached meanwhile (its activity removed): nothing to change.
        let Some(e) = t.by_path.get_mut(path) else {
            return;
        };
        if let Some(n) = self.cap_net {
            e.cap_net = n;
        }
        if let Some(d) = self.cap_disk {
            e.cap_disk = d;
        }
    }
}
