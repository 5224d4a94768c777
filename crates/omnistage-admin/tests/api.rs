//! The admin API's endpoints against a real runtime: reads (tree, stages, graph, history, one
//! node), changes (create, change, move, remove, admission, caps), every refusal (400, 401,
//! 403, 404, 405, 409, 411, 413, 415, 431, 501) and that a refused change changes nothing.

mod common;

use common::{admin, find_node, json, req, rig, wait_for};
use omnistage::account::{EdgeFrom, EdgeRow};
use omnistage::exec::Predicate;
use omnistage_admin::model::{Graph, Stages, Tree};
use omnistage_admin::{start_admin_rt, AdminConfig};
use std::io::{Read, Write};
use std::net::TcpStream;

#[test]
fn reads_describe_the_runtime() {
    let r = rig(2);
    let (_h, c) = admin(&r.rt, None);
    r.pipeline(r.a, 100);
    r.pipeline(r.b, 10);
    // Rates exist once the sampler has two samples after the work.
    wait_for("a window covering the work", || {
        let t: Tree = c.get_json("/api/v1/tree").unwrap();
        let a = find_node(&t, "/t/a");
        a.rate.is_some() && t.interval_s.is_some() && a.total.messages == 300
    });
    let t: Tree = c.get_json("/api/v1/tree").unwrap();
    assert_eq!(t.root.path, "/");
    assert_eq!(t.workers, 2);
    let names: Vec<&str> = t.root.children.iter().map(|n| n.path.as_str()).collect();
    assert_eq!(names, ["/infra", "/t"]);
    let a = find_node(&t, "/t/a");
    assert_eq!(
        (a.weight, a.policy.as_str(), a.cap.is_none()),
        (60, "sfq", true)
    );
    // 100 through front, 200 through back.
    assert_eq!(a.total.messages, 300);
    assert_eq!(a.own, a.total);
    assert_eq!(a.latency.response_ns.count, 300);
    assert!(a.latency.response_ns.p99 >= a.latency.response_ns.p50);
    let tt = find_node(&t, "/t");
    assert_eq!(tt.total.messages, 330, "/t rolls up its children");
    assert_eq!(tt.own.messages, 0);
    // The totals agree with the ledger.
    let snap = r.rt.snapshot();
    let ledger_a: u64 = snap
        .rows
        .iter()
        .filter(|x| x.activity == r.a)
        .map(|x| x.cpu_ns)
        .sum();
    assert!(a.total.cpu_ns >= ledger_a);
    // Shares and targets are fractions.
    for n in [a, tt] {
        let s = n.share.unwrap();
        assert!((0.0..=1.0).contains(&s));
        assert!((0.0..=1.0 + 1e-9).contains(&n.target_share.unwrap()));
    }
    assert_eq!(t.cores.len(), 2);

    // One node.
    let one = req(&c, "GET", "/api/v1/activities/t/a", None);
    assert_eq!(one.status, 200);
    assert_eq!(json(&one)["path"], "/t/a");
    assert_eq!(req(&c, "GET", "/api/v1/activities/t/zz", None).status, 404);
    assert_eq!(req(&c, "GET", "/api/v1/activities", None).status, 200);

    // Stages.
    let s: Stages = c.get_json("/api/v1/stages").unwrap();
    let front = s.stages.iter().find(|x| x.name == "front").unwrap();
    assert_eq!(front.total.messages, 110);
    assert_eq!(front.batch_max, Some(8));
    assert_eq!(front.batch_now, vec![8, 8]);
    assert_eq!(front.admission.as_ref().unwrap().predicate, "threshold");
    let fa = front
        .activities
        .iter()
        .find(|x| x.activity == "/t/a")
        .unwrap();
    assert_eq!(
        (fa.total.messages, fa.queued, fa.total.rejected),
        (100, 0, 0)
    );
    assert_eq!(fa.latency.queue_ns.count, 100);
    let back = s.stages.iter().find(|x| x.name == "back").unwrap();
    assert_eq!(back.total.messages, 220);
    assert!(
        s.stages.iter().any(|x| x.name == "loop"),
        "the loop's own work is listed"
    );

    // The graph, as JSON and as dot.
    assert_eq!(
        r.rt.edges(),
        vec![
            EdgeRow {
                from: EdgeFrom::Stage(r.front.id()),
                to: r.back.id(),
                messages: 220
            },
            EdgeRow {
                from: EdgeFrom::External,
                to: r.front.id(),
                messages: 110
            },
        ]
    );
    let g: Graph = c.get_json("/api/v1/graph").unwrap();
    let e = g.edges.iter().find(|e| e.from == "front").unwrap();
    assert_eq!((e.to.as_str(), e.messages), ("back", 220));
    assert!(g
        .edges
        .iter()
        .any(|e| e.from == "external" && e.to == "front" && e.messages == 110));
    assert!(g
        .nodes
        .iter()
        .any(|n| n.name == "external" && n.kind == "external"));
    for url in ["/api/v1/graph.dot", "/api/v1/graph?format=dot"] {
        let d = req(&c, "GET", url, None);
        assert_eq!(d.status, 200);
        let text = d.text();
        assert!(text.starts_with("digraph omnistage {"), "{text}");
        assert!(
            text.contains("\"front\" -> \"back\" [label=\"220"),
            "{text}"
        );
    }
    assert_eq!(req(&c, "GET", "/api/v1/graph?format=svg", None).status, 400);

    // History and the dashboard assets.
    wait_for("a history point", || {
        json(&req(&c, "GET", "/api/v1/history", None))["points"]
            .as_array()
            .is_some_and(|p| !p.is_empty())
    });
    let page = req(&c, "GET", "/", None);
    assert_eq!(page.status, 200);
    assert!(page.text().contains("<script src=\"/dashboard.js\">"));
    assert_eq!(req(&c, "GET", "/dashboard.js", None).status, 200);
}

#[test]
fn changes_apply_and_refused_changes_change_nothing() {
    let r = rig(2);
    let rt = &r.rt;
    let (_h, c) = admin(rt, None);
    let version = || rt.with_activities(|t| t.version());
    let weight =
        |p: &str| rt.with_activities(|t| t.lookup(p).map(|id| t.get(id).unwrap().spec.weight));

    // Create, then change.
    let created = req(
        &c,
        "PUT",
        "/api/v1/activities/t/c",
        Some(r#"{"weight": 30}"#),
    );
    assert_eq!(created.status, 201, "{}", created.text());
    assert_eq!(json(&created)["action"], "created");
    assert_eq!(weight("/t/c"), Some(30));
    let ch = req(
        &c,
        "PUT",
        "/api/v1/activities/t/c",
        Some(r#"{"weight": 40, "policy": "drr"}"#),
    );
    assert_eq!(ch.status, 200, "{}", ch.text());
    assert_eq!(weight("/t/c"), Some(40));
    assert_eq!(
        rt.with_activities(|t| t.get(t.lookup("/t/c").unwrap()).unwrap().spec.policy.name()),
        "drr"
    );
    // A CPU cap in cores, then none.
    assert_eq!(
        req(
            &c,
            "PUT",
            "/api/v1/activities/t/c",
            Some(r#"{"cap": {"cores": 0.5}}"#)
        )
        .status,
        200
    );
    // Half a core of the machine: each of the two workers' trees holds a quarter.
    let cap = rt.with_activities(|t| t.get(t.lookup("/t/c").unwrap()).unwrap().spec.cap);
    assert_eq!(cap.map(|c| c.rate_per_s), Some(250_000_000));
    assert_eq!(weight("/t/c"), Some(40), "fields left out keep their value");
    assert_eq!(
        req(
            &c,
            "PUT",
            "/api/v1/activities/t/c",
            Some(r#"{"cap": null}"#)
        )
        .status,
        200
    );
    assert!(rt.with_activities(|t| t.get(t.lookup("/t/c").unwrap()).unwrap().spec.cap.is_none()));
    // Admission of one (stage, activity).
    let put = req(
        &c,
        "PUT",
        "/api/v1/activities/t/a",
        Some(
            r#"{"admission": {"stage": "back", "predicate": "token", "rate_per_s": 100, "burst": 10}}"#,
        ),
    );
    assert_eq!(put.status, 200, "{}", put.text());
    assert_eq!(
        rt.admission(r.back.id(), r.a),
        Some(Predicate::TokenBucket {
            rate_per_s: 100.0,
            burst: 10
        })
    );
    let put = req(
        &c,
        "PUT",
        "/api/v1/activities/t/a",
        Some(r#"{"admission": {"stage": "back", "predicate": "p90", "target_ms": 20}}"#),
    );
    assert_eq!(put.status, 200, "{}", put.text());
    match rt.admission(r.back.id(), r.a) {
        Some(Predicate::P90 { params, .. }) => assert_eq!(params.target_ns, 20_000_000),
        other => panic!("{other:?}"),
    }
    let s: Stages = c.get_json("/api/v1/stages").unwrap();
    let _ = s; // the stage listing carries admission per (stage, activity) once used
    assert_eq!(
        req(
            &c,
            "PUT",
            "/api/v1/activities/t/a",
            Some(r#"{"admission": {"stage": "back", "predicate": "inherit"}}"#)
        )
        .status,
        200
    );
    assert_eq!(rt.admission(r.back.id(), r.a), Some(Predicate::Threshold));

    // Refusals: each leaves the table (and admission) as it was.
    let v = version();
    let refused: &[(&str, &str, Option<&str>, u16)] = &[
        (
            "PUT",
            "/api/v1/activities/t/c",
            Some(r#"{"weight": 0}"#),
            409,
        ),
        (
            "PUT",
            "/api/v1/activities/t/c",
            Some(r#"{"weight": 10001}"#),
            409,
        ),
        (
            "PUT",
            "/api/v1/activities/t/c",
            Some(r#"{"cap": {"cores": 0}}"#),
            409,
        ),
        (
            "PUT",
            "/api/v1/activities/x/y",
            Some(r#"{"weight": 5}"#),
            409,
        ),
        (
            "PUT",
            "/api/v1/activities/",
            Some(r#"{"cap": {"cores": 1}}"#),
            409,
        ),
        (
            "PUT",
            "/api/v1/activities/t/a",
            Some(
                r#"{"weight": 5, "admission": {"stage": "back", "predicate": "token", "rate_per_s": 0, "burst": 1}}"#,
            ),
            409,
        ),
        // A p90 controller's starting rate above its own range (which is narrower than the
        // bucket's): refused here, not left to panic where the gate is built, under the
        // runtime's gates lock.
        (
            "PUT",
            "/api/v1/activities/t/a",
            Some(
                r#"{"admission": {"stage": "back", "predicate": "p90", "target_ms": 50, "rate_per_s": 1000000}}"#,
            ),
            409,
        ),
        (
            "PUT",
            "/api/v1/activities/t/a",
            Some(r#"{"weight": 5, "admission": {"stage": "nope", "predicate": "threshold"}}"#),
            400,
        ),
        (
            "PUT",
            "/api/v1/activities/t/a",
            Some(r#"{"weight": 5, "admission": {"stage": "back", "predicate": "sometimes"}}"#),
            400,
        ),
        (
            "PUT",
            "/api/v1/activities/t/c",
            Some(r#"{"weight": "heavy"}"#),
            400,
        ),
        (
            "PUT",
            "/api/v1/activities/t/c",
            Some(r#"{"wieght": 5}"#),
            400,
        ),
        ("PUT", "/api/v1/activities/t/c", Some("{"), 400),
        ("PUT", "/api/v1/activities/t/c", None, 415),
        (
            "PUT",
            "/api/v1/activities/t/c",
            Some(r#"{"policy": "lottery"}"#),
            400,
        ),
        (
            "PUT",
            "/api/v1/activities/t/a%20b",
            Some(r#"{"weight": 5}"#),
            400,
        ),
        (
            "PUT",
            "/api/v1/activities/t/c/",
            Some(r#"{"weight": 5}"#),
            400,
        ),
        (
            "PUT",
            "/api/v1/activities/t/c?persist=true",
            Some(r#"{"weight": 5}"#),
            501,
        ),
        (
            "PUT",
            "/api/v1/activities/t/c?persist=yes",
            Some(r#"{"weight": 5}"#),
            400,
        ),
        (
            "PUT",
            "/api/v1/activities/t/c?dry=1",
            Some(r#"{"weight": 5}"#),
            400,
        ),
        (
            "PUT",
            "/api/v1/activities/t/c",
            Some(r#"{"weight": 5, "cap_net": "10MB/s"}"#),
            501,
        ),
        (
            "PUT",
            "/api/v1/activities/t/c",
            Some(r#"{"weight": 5, "budget": 1000}"#),
            501,
        ),
        (
            "PUT",
            "/api/v1/activities/t/c",
            Some(r#"{"send_order": "fifo"}"#),
            501,
        ),
        ("DELETE", "/api/v1/activities/infra", None, 409),
        ("DELETE", "/api/v1/activities/", None, 409),
        ("DELETE", "/api/v1/activities/t", None, 409),
        ("DELETE", "/api/v1/activities/t/zz", None, 404),
        ("DELETE", "/api/v1/activities/t/c?persist=true", None, 501),
        (
            "POST",
            "/api/v1/activities/t:move",
            Some(r#"{"to": "/t/a"}"#),
            409,
        ),
        (
            "POST",
            "/api/v1/activities/infra:move",
            Some(r#"{"to": "/t"}"#),
            409,
        ),
        (
            "POST",
            "/api/v1/activities/t/c:move",
            Some(r#"{"to": "/nowhere"}"#),
            409,
        ),
        (
            "POST",
            "/api/v1/activities/t/zz:move",
            Some(r#"{"to": "/"}"#),
            404,
        ),
        (
            "POST",
            "/api/v1/activities/t/c:move",
            Some(r#"{"connections_to": "/t/a"}"#),
            501,
        ),
        ("POST", "/api/v1/activities/t/c:move", Some(r#"{}"#), 400),
        ("POST", "/api/v1/activities/t/c:copy", Some(r#"{}"#), 400),
        ("GET", "/api/v1/activities/t/c:move", None, 405),
        ("POST", "/api/v1/activities/t/c", None, 405),
        ("POST", "/api/v1/tree", None, 405),
        ("DELETE", "/metrics", None, 405),
        ("GET", "/api/v2/tree", None, 404),
        ("GET", "/nothing", None, 404),
        ("GET", "/api/v1/tree?x=1", None, 400),
    ];
    for (method, path, body, status) in refused {
        let got = req(&c, method, path, *body);
        assert_eq!(
            got.status,
            *status,
            "{method} {path} {body:?}: {}",
            got.text()
        );
        let e = json(&got);
        assert_eq!(e["status"], *status);
        assert!(
            !e["error"].as_str().unwrap().is_empty(),
            "a reason is given"
        );
        assert_eq!(version(), v, "{method} {path} changed the table");
    }
    assert_eq!(weight("/t/c"), Some(40));
    assert_eq!(weight("/t/a"), Some(60));
    assert_eq!(rt.admission(r.back.id(), r.a), Some(Predicate::Threshold));
    let wrong = req(&c, "POST", "/api/v1/tree", None);
    assert!(wrong.text().contains("GET"));

    // Move a sub-tree, then remove it.
    let mv = req(
        &c,
        "POST",
        "/api/v1/activities/t/c:move",
        Some(r#"{"to": "/"}"#),
    );
    assert_eq!(mv.status, 200, "{}", mv.text());
    assert_eq!(json(&mv)["path"], "/c");
    assert_eq!(weight("/c"), Some(40));
    assert_eq!(weight("/t/c"), None);
    let del = req(&c, "DELETE", "/api/v1/activities/c", None);
    assert_eq!(del.status, 200, "{}", del.text());
    assert_eq!(weight("/c"), None);
    assert_eq!(req(&c, "DELETE", "/api/v1/activities/c", None).status, 404);

    // Changes reach the workers: a weight change shows in the next tree read.
    assert_eq!(
        req(
            &c,
            "PUT",
            "/api/v1/activities/t/b",
            Some(r#"{"weight": 77}"#)
        )
        .status,
        200
    );
    let t: Tree = c.get_json("/api/v1/tree").unwrap();
    assert_eq!(find_node(&t, "/t/b").weight, 77);
    r.pipeline(r.b, 5);
}

#[test]
fn a_token_guards_the_api_but_not_the_page() {
    let r = rig(1);
    let (_h, c) = admin(&r.rt, Some("s3cret"));
    assert_eq!(req(&c, "GET", "/api/v1/tree", None).status, 200);
    assert_eq!(req(&c, "GET", "/metrics", None).status, 200);
    let addr = _h.local_addr();
    let anon = omnistage_admin::client::Client::new(&format!("http://{addr}"), None).unwrap();
    let wrong =
        omnistage_admin::client::Client::new(&format!("http://{addr}"), Some("s3creT".into()))
            .unwrap();
    for cl in [&anon, &wrong] {
        for p in ["/api/v1/tree", "/metrics", "/api/v1/activities/t/a"] {
            assert_eq!(req(cl, "GET", p, None).status, 401, "{p}");
        }
        assert_eq!(
            req(
                cl,
                "PUT",
                "/api/v1/activities/t/a",
                Some(r#"{"weight": 1}"#)
            )
            .status,
            401
        );
        assert_eq!(req(cl, "GET", "/", None).status, 200);
    }
    assert_eq!(
        r.rt.with_activities(|t| t.get(r.a).unwrap().spec.weight),
        60
    );
    // Off a loopback address a token is required.
    let cfg = AdminConfig {
        listen: "0.0.0.0:0".parse().unwrap(),
        ..Default::default()
    };
    let err = start_admin_rt(r.rt.clone(), cfg).err().expect("refused");
    assert!(err.contains("token"), "{err}");
}

/// Sends raw bytes and returns the status of the answer.
fn raw(addr: std::net::SocketAddr, bytes: &[u8]) -> u16 {
    let mut s = TcpStream::connect(addr).unwrap();
    // The server may answer (and close) before it has read everything we send.
    let _ = s.write_all(bytes);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out);
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

#[test]
fn requests_past_the_limits_are_refused() {
    let r = rig(1);
    let (h, _c) = admin(&r.rt, None);
    let addr = h.local_addr();
    let big_head = format!(
        "GET /api/v1/tree HTTP/1.1\r\nX-Pad: {}\r\n\r\n",
        "a".repeat(20_000)
    );
    assert_eq!(raw(addr, big_head.as_bytes()), 431);
    let many: String = (0..70).map(|i| format!("X-{i}: 1\r\n")).collect();
    assert_eq!(
        raw(addr, format!("GET / HTTP/1.1\r\n{many}\r\n").as_bytes()),
        431
    );
    let big_body = format!(
        "PUT /api/v1/activities/t/a HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
        100_000
    );
    assert_eq!(raw(addr, big_body.as_bytes()), 413);
    assert_eq!(
        raw(
            addr,
            b"PUT /api/v1/activities/t/a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        ),
        411
    );
    assert_eq!(raw(addr, b"GARBAGE\x01 / HTTP/1.1\r\n\r\n"), 400);
    assert_eq!(
        raw(
            addr,
            b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nxx"
        ),
        400
    );
    // Browser guards: JSON bodies only, no changes from another origin, no Host names but
    // IP literals and localhost (without a token).
    let body = r#"{"weight": 5}"#;
    let put = |headers: &str| {
        format!(
            "PUT /api/v1/activities/t/a HTTP/1.1\r\nHost: {addr}\r\n{headers}Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    assert_eq!(
        raw(addr, put("Content-Type: text/plain\r\n").as_bytes()),
        415
    );
    let cross = put("Content-Type: application/json\r\nOrigin: http://evil.example\r\n");
    assert_eq!(raw(addr, cross.as_bytes()), 403);
    assert_eq!(
        raw(
            addr,
            b"GET /api/v1/tree HTTP/1.1\r\nHost: evil.example:9090\r\n\r\n"
        ),
        403
    );
    assert_eq!(
        raw(
            addr,
            b"GET /api/v1/tree HTTP/1.1\r\nHost: localhost:9090\r\n\r\n"
        ),
        200
    );
    assert_eq!(
        r.rt.with_activities(|t| t.get(r.a).unwrap().spec.weight),
        60
    );
    // Same origin is fine.
    let same = put(&format!(
        "Content-Type: application/json; charset=utf-8\r\nOrigin: http://{addr}\r\n"
    ));
    assert_eq!(raw(addr, same.as_bytes()), 200);
    assert_eq!(r.rt.with_activities(|t| t.get(r.a).unwrap().spec.weight), 5);
    // And the server still answers.
    assert_eq!(raw(addr, b"GET /api/v1/tree HTTP/1.1\r\n\r\n"), 200);
}

/// A removed activity's rows leave `/api/v1/stages` (its work stays in the stages' totals).
#[test]
fn removed_activities_leave_the_stages() {
    let r = rig(1);
    let (_h, c) = admin(&r.rt, None);
    let x =
        r.rt.create_activity("/t/x", omnistage::activity::ActivitySpec::default())
            .unwrap();
    r.pipeline(x, 5);
    let front = |s: &Stages| {
        s.stages
            .iter()
            .find(|st| st.name == "front")
            .unwrap()
            .clone()
    };
    let s: Stages = c.get_json("/api/v1/stages").unwrap();
    assert!(front(&s).activities.iter().any(|a| a.id == x));
    let before = front(&s).total.messages;
    assert_eq!(
        req(&c, "DELETE", "/api/v1/activities/t/x", None).status,
        200
    );
    let s: Stages = c.get_json("/api/v1/stages").unwrap();
    for st in &s.stages {
        assert!(
            st.activities.iter().all(|a| a.id != x),
            "{}: {:?}",
            st.name,
            st.activities
        );
    }
    assert_eq!(front(&s).total.messages, before);
}
