//! Shaped groups attached from outside (`omnistage shape --admin`): attaching creates the
//! activity and keeps the rates a `set` gave it, reports are charged to the activity's ledger
//! (tree, rates, `/metrics`), `PUT cap_net/cap_disk` changes the rates the next report answers
//! with, and every limit and misuse is refused with nothing changed.

mod common;

use common::{admin, find_node, json, req, rig};
use omnistage_admin::model::{Shaped, Tree, SHAPED_GROUPS_MAX, SHAPED_REPORT_BYTES_MAX};

fn shaped(r: &omnistage_admin::client::Reply) -> Shaped {
    serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("{e}: {}", r.text()))
}

#[test]
fn a_group_attaches_reports_and_takes_its_new_rates() {
    let r = rig(1);
    let (_h, c) = admin(&r.rt, None);
    // The parent must exist (409, as for PUT); the activity itself is created.
    let x = req(&c, "POST", "/api/v1/activities/shape/x:attach", Some("{}"));
    assert_eq!(x.status, 409, "{}", x.text());
    assert!(r.rt.activity_id("/shape/x").is_none());
    let x = req(&c, "PUT", "/api/v1/activities/shape", Some("{}"));
    assert_eq!(x.status, 201, "{}", x.text());
    let x = req(
        &c,
        "POST",
        "/api/v1/activities/shape/x:attach",
        Some(r#"{"cap_net": "1MiB/s", "cap_disk": 500000}"#),
    );
    assert_eq!(x.status, 201, "{}", x.text());
    let s = shaped(&x);
    assert_eq!(
        (s.path.as_str(), s.cap_net, s.cap_disk, s.reports),
        ("/shape/x", Some(1 << 20), Some(500_000), 0)
    );
    let id = r.rt.activity_id("/shape/x").expect("created");

    // Reports are charged to the activity, in the `external` pseudo-stage.
    let body =
        r#"{"bytes_in": 1000, "bytes_out": 20, "disk_read_bytes": 300, "disk_write_bytes": 4000}"#;
    for _ in 0..3 {
        let x = req(&c, "POST", "/api/v1/activities/shape/x:report", Some(body));
        assert_eq!(x.status, 200, "{}", x.text());
    }
    let rows: Vec<_> =
        r.rt.snapshot()
            .rows
            .into_iter()
            .filter(|row| row.activity == id)
            .collect();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(r.rt.stage_name(rows[0].stage), Some("external"));
    assert_eq!(
        (
            rows[0].bytes_in,
            rows[0].bytes_out,
            rows[0].disk_bytes,
            rows[0].disk_write_bytes,
            rows[0].cpu_ns,
            rows[0].messages
        ),
        (3000, 60, 900, 12_000, 0, 0)
    );
    let t: Tree = c.get_json("/api/v1/tree").unwrap();
    let n = find_node(&t, "/shape/x");
    assert_eq!(
        (
            n.total.bytes_in,
            n.total.bytes_out,
            n.total.disk_bytes,
            n.total.disk_write_bytes
        ),
        (3000, 60, 900, 12_000)
    );
    let g = n.shaped.as_ref().expect("the tree shows the group");
    assert_eq!((g.cap_net, g.reports), (Some(1 << 20), 3));
    assert_eq!(
        find_node(&t, "/shape").total.bytes_in,
        3000,
        "the parent rolls the group's bytes up"
    );
    assert!(find_node(&t, "/shape").shaped.is_none());
    let m = req(&c, "GET", "/metrics", None).text();
    for line in [
        "omnistage_activity_received_bytes_total{activity=\"/shape/x\"} 3000",
        "omnistage_activity_sent_bytes_total{activity=\"/shape/x\"} 60",
        "omnistage_activity_disk_read_bytes_total{activity=\"/shape/x\"} 900",
        "omnistage_activity_disk_written_bytes_total{activity=\"/shape/x\"} 12000",
    ] {
        assert!(m.contains(line), "{line} not in /metrics");
    }

    // `omnistage set /shape/x cap_net=2MiB/s cap_disk=null` reaches the next report's answer.
    let x = req(
        &c,
        "PUT",
        "/api/v1/activities/shape/x",
        Some(r#"{"cap_net": "2MiB/s", "cap_disk": null, "weight": 7}"#),
    );
    assert_eq!(x.status, 200, "{}", x.text());
    let x = req(&c, "POST", "/api/v1/activities/shape/x:report", Some("{}"));
    let s = shaped(&x);
    assert_eq!((s.cap_net, s.cap_disk, s.reports), (Some(2 << 20), None, 4));
    assert_eq!(r.rt.with_activities(|t| t.get(id).unwrap().spec.weight), 7);
    // A launcher attaching again (restarted, or a second member) keeps the rates set since.
    let x = req(
        &c,
        "POST",
        "/api/v1/activities/shape/x:attach",
        Some(r#"{"cap_net": 1000}"#),
    );
    assert_eq!(x.status, 200, "{}", x.text());
    assert_eq!(shaped(&x).cap_net, Some(2 << 20));

    // Removing the activity detaches the group: its launcher's next report gets 404.
    let x = req(&c, "DELETE", "/api/v1/activities/shape/x", None);
    assert_eq!(x.status, 200, "{}", x.text());
    let x = req(&c, "POST", "/api/v1/activities/shape/x:report", Some("{}"));
    assert_eq!(x.status, 404, "{}", x.text());
}

#[test]
fn misuse_and_limits_are_refused_and_change_nothing() {
    let r = rig(1);
    let (_h, c) = admin(&r.rt, None);
    let x = req(&c, "PUT", "/api/v1/activities/shape", Some("{}"));
    assert_eq!(x.status, 201);
    // Reports before an attach, and verbs that are not POST.
    let x = req(&c, "POST", "/api/v1/activities/t/a:report", Some("{}"));
    assert_eq!(x.status, 404, "{}", x.text());
    let x = req(&c, "GET", "/api/v1/activities/t/a:attach", None);
    assert_eq!(x.status, 405);
    let x = req(&c, "POST", "/api/v1/activities/t/a:detach", Some("{}"));
    assert_eq!(x.status, 400, "{}", x.text());
    // Not where the runtime's own work is charged.
    for p in ["/infra", "/"] {
        let x = req(
            &c,
            "POST",
            &format!("/api/v1/activities{p}:attach"),
            Some("{}"),
        );
        assert_eq!(x.status, 409, "{p}: {}", x.text());
    }
    // Rates a shaper cannot run at.
    for bad in [
        r#"{"cap_net": 0}"#,
        r#"{"cap_disk": "0B/s"}"#,
        r#"{"cap_net": "fast"}"#,
        r#"{"cap_net": -1}"#,
        r#"{"rate": 1}"#,
    ] {
        let x = req(&c, "POST", "/api/v1/activities/shape/y:attach", Some(bad));
        assert!(matches!(x.status, 400 | 409), "{bad}: {}", x.text());
    }
    assert!(
        r.rt.activity_id("/shape/y").is_none(),
        "a refused attach creates nothing"
    );
    let x = req(&c, "POST", "/api/v1/activities/shape/y:attach", Some("{}"));
    assert_eq!(x.status, 201, "{}", x.text());
    assert_eq!(shaped(&x).cap_net, None);
    // A report past the per-kind bound is refused and charges nothing.
    let big = format!(
        "{{\"bytes_in\": 5, \"bytes_out\": {}}}",
        SHAPED_REPORT_BYTES_MAX + 1
    );
    let x = req(&c, "POST", "/api/v1/activities/shape/y:report", Some(&big));
    assert_eq!(x.status, 400, "{}", x.text());
    let at_max = format!("{{\"bytes_out\": {SHAPED_REPORT_BYTES_MAX}}}");
    let x = req(
        &c,
        "POST",
        "/api/v1/activities/shape/y:report",
        Some(&at_max),
    );
    assert_eq!(x.status, 200, "{}", x.text());
    let id = r.rt.activity_id("/shape/y").unwrap();
    let (bytes_in, bytes_out) =
        r.rt.snapshot()
            .rows
            .iter()
            .filter(|row| row.activity == id)
            .fold((0, 0), |(i, o), row| (i + row.bytes_in, o + row.bytes_out));
    assert_eq!((bytes_in, bytes_out), (0, SHAPED_REPORT_BYTES_MAX));
    // A shaped group has no cache budget or send order; a refused PUT changes nothing else.
    let x = req(
        &c,
        "PUT",
        "/api/v1/activities/shape/y",
        Some(r#"{"weight": 9, "budget": 1000}"#),
    );
    assert_eq!(x.status, 409, "{}", x.text());
    let x = req(
        &c,
        "PUT",
        "/api/v1/activities/shape/y",
        Some(r#"{"weight": 9, "cap_net": 0}"#),
    );
    assert_eq!(x.status, 409, "{}", x.text());
    assert_ne!(r.rt.with_activities(|t| t.get(id).unwrap().spec.weight), 9);
    // An attached group's activity (or its parent) cannot be moved from under its launcher.
    let x = req(
        &c,
        "POST",
        "/api/v1/activities/shape:move",
        Some(r#"{"to": "/t"}"#),
    );
    assert_eq!(x.status, 409, "{}", x.text());
    // Without an HTTP server, caps of an activity with no group stay refused as before.
    let x = req(
        &c,
        "PUT",
        "/api/v1/activities/t/a",
        Some(r#"{"cap_net": "1MB/s"}"#),
    );
    assert_eq!(x.status, 501, "{}", x.text());
    let _ = json(&req(&c, "GET", "/api/v1/tree", None));
}

#[test]
fn attached_groups_are_bounded() {
    let r = rig(1);
    let (_h, c) = admin(&r.rt, None);
    let x = req(&c, "PUT", "/api/v1/activities/shape", Some("{}"));
    assert_eq!(x.status, 201);
    for i in 0..SHAPED_GROUPS_MAX {
        let x = req(
            &c,
            "POST",
            &format!("/api/v1/activities/shape/g{i}:attach"),
            Some("{}"),
        );
        assert_eq!(x.status, 201, "{i}: {}", x.text());
    }
    let x = req(
        &c,
        "POST",
        "/api/v1/activities/shape/over:attach",
        Some("{}"),
    );
    assert_eq!(x.status, 409, "{}", x.text());
    assert!(r.rt.activity_id("/shape/over").is_none());
    // Attaching again to one that is attached is still fine; removing one makes room.
    let x = req(&c, "POST", "/api/v1/activities/shape/g0:attach", Some("{}"));
    assert_eq!(x.status, 200, "{}", x.text());
    let x = req(&c, "DELETE", "/api/v1/activities/shape/g1", None);
    assert_eq!(x.status, 200, "{}", x.text());
    let x = req(
        &c,
        "POST",
        "/api/v1/activities/shape/over:attach",
        Some("{}"),
    );
    assert_eq!(x.status, 201, "{}", x.text());
}
