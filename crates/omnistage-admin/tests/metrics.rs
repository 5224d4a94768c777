//! `/metrics` while the workers are loaded: the per-activity counters of every scrape lie
//! between a ledger snapshot taken just before the scrape and one taken just after, and the
//! exposition is well-formed (names, labels, histogram buckets, `# EOF`).

mod common;

use common::{admin, req, rig, wait_for};
use omnistage::account::Snapshot;
use std::collections::BTreeMap;

/// Samples of one metric family: labels (as written) → value.
fn family(text: &str, name: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let Some(rest) = rest.strip_prefix('{') else {
            continue;
        };
        let (labels, value) = rest.split_once("} ").expect("name{labels} value");
        out.insert(labels.to_string(), value.parse::<f64>().expect("a number"));
    }
    out
}

fn own(s: &Snapshot, activity: u32) -> (f64, u64, u64) {
    let rows = s.rows.iter().filter(|r| r.activity == activity);
    let (mut cpu, mut msgs, mut disp) = (0u64, 0u64, 0u64);
    for r in rows {
        cpu += r.cpu_ns;
        msgs += r.messages;
        disp += r.dispatches;
    }
    (cpu as f64 / 1e9, msgs, disp)
}

#[test]
fn scrapes_under_load_agree_with_the_ledger() {
    let r = rig(2);
    let (_h, c) = admin(&r.rt, None);
    r.load(8);
    // Wait until both activities have been served (so their series exist).
    wait_for("load on both activities", || {
        let s = r.rt.snapshot();
        own(&s, r.a).1 > 1000 && own(&s, r.b).1 > 1000
    });
    let mut last_msgs = 0.0;
    for round in 0..5 {
        let before = r.rt.snapshot();
        let scrape = req(&c, "GET", "/metrics", None);
        let after = r.rt.snapshot();
        assert_eq!(scrape.status, 200);
        let text = scrape.text();
        assert!(text.ends_with("# EOF\n"), "OpenMetrics ends with # EOF");
        let cpu = family(&text, "omnistage_activity_cpu_seconds_total");
        let msgs = family(&text, "omnistage_activity_messages_total");
        let disp = family(&text, "omnistage_activity_dispatches_total");
        for (id, path) in [(r.a, "/t/a"), (r.b, "/t/b")] {
            let key = format!("activity=\"{path}\"");
            let (b_cpu, b_msgs, b_disp) = own(&before, id);
            let (a_cpu, a_msgs, a_disp) = own(&after, id);
            let m_cpu = cpu[&key];
            let m_msgs = msgs[&key];
            let m_disp = disp[&key];
            assert!(
                b_cpu <= m_cpu && m_cpu <= a_cpu,
                "round {round} {path}: cpu {b_cpu} <= {m_cpu} <= {a_cpu}"
            );
            assert!(
                b_msgs as f64 <= m_msgs && m_msgs <= a_msgs as f64,
                "round {round} {path}: messages {b_msgs} <= {m_msgs} <= {a_msgs}"
            );
            assert!(
                b_disp as f64 <= m_disp && m_disp <= a_disp as f64,
                "round {round} {path}: dispatches"
            );
            if id == r.a {
                // Still under load: the counters move between scrapes.
                assert!(m_msgs >= last_msgs);
                last_msgs = m_msgs;
            }
        }
    }
    let text = req(&c, "GET", "/metrics", None).text();
    // Every sample line is `name{labels} value` or `name value`, with a known prefix.
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        assert!(line.starts_with("omnistage_"), "{line}");
        let value = line.rsplit(' ').next().unwrap();
        assert!(value.parse::<f64>().is_ok() || value == "+Inf", "{line}");
    }
    for needle in [
        "# TYPE omnistage_activity_cpu_seconds counter",
        "omnistage_stage_messages_total{stage=\"spin\",activity=\"/t/a\"}",
        "omnistage_stage_response_seconds_bucket{le=\"+Inf\",stage=\"spin\",activity=\"/t/b\"}",
        "omnistage_stage_queue_wait_seconds_count{stage=\"spin\",activity=\"/t/a\"}",
        "omnistage_edge_messages_total{from=\"spin\",to=\"spin\"}",
        "omnistage_edge_messages_total{from=\"external\",to=\"spin\"}",
        "omnistage_stage_batch_size{stage=\"spin\",core=\"1\"} 8",
        "omnistage_activity_weight{activity=\"/t/b\"} 30",
        "omnistage_worker_idle_seconds_total{core=\"0\"}",
        "omnistage_stage_queued_messages{stage=\"spin\",activity=\"/t/a\"}",
    ] {
        assert!(text.contains(needle), "missing {needle}");
    }
    // Histogram buckets are cumulative: none above +Inf, which equals _count.
    let buckets = family(&text, "omnistage_stage_response_seconds_bucket");
    let series: Vec<(&String, &f64)> = buckets
        .iter()
        .filter(|(k, _)| k.ends_with(",stage=\"spin\",activity=\"/t/a\""))
        .collect();
    assert!(series.len() > 10);
    let count =
        family(&text, "omnistage_stage_response_seconds_count")["stage=\"spin\",activity=\"/t/a\""];
    let inf = buckets["le=\"+Inf\",stage=\"spin\",activity=\"/t/a\""];
    assert_eq!(inf, count);
    assert!(series.iter().all(|(_, v)| **v <= inf));
    r.stop_load();
}

/// An HTTP server's own counters (connections, timeouts, TLS handshakes) are on `/metrics`
/// beside the ledger, with the values the server counts.
#[test]
fn an_http_servers_counters_are_exposed() {
    use omnistage_admin::{start_admin_with_tenants, AdminConfig};
    use omnistage_http::server::{Server, ServerOptions};
    use std::io::{Read, Write};
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    let dir = std::env::temp_dir();
    let config = omnistage_http::config::parse_config(&format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\n[[tenant]]\nname = \"t\"\ndocroot = '{}'\n",
        dir.display()
    ))
    .unwrap();
    let opts = ServerOptions {
        workers: Some(1),
        ..Default::default()
    };
    let server = Arc::new(Server::start(config, opts).unwrap());
    let mut s = std::net::TcpStream::connect(server.local_addrs()[0]).unwrap();
    s.write_all(b"GET /nope HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        .unwrap();
    let _ = s.read_to_end(&mut Vec::new());
    let cfg = AdminConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        token: None,
        sample_interval: std::time::Duration::from_millis(50),
        threads: 1,
    };
    let h = start_admin_with_tenants(server.clone(), |s: &Server| s.runtime(), cfg).unwrap();
    let c =
        omnistage_admin::client::Client::new(&format!("http://{}", h.local_addr()), None).unwrap();
    let text = req(&c, "GET", "/metrics", None).text();
    let value = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing from /metrics"))
    };
    let accepted = server.stats().accepted.load(Ordering::Relaxed);
    assert!(accepted >= 1);
    assert_eq!(value("omnistage_http_connections_accepted_total"), accepted);
    assert_eq!(value("omnistage_http_tls_handshakes_total"), 0);
    assert_eq!(value("omnistage_http_tls_handshake_errors_total"), 0);
    assert!(text.contains("# HELP omnistage_http_tls_handshake_timeouts"));
}

/// Panics are counted per stage by the process's panic hook (installed when a runtime starts):
/// every stage of the runtime has a series (zero until it panics), and a named thread that
/// panicked gets one too.
#[test]
fn panics_are_counted_per_stage() {
    let r = rig(1);
    let (_h, c) = admin(&r.rt, None);
    let scrape = |c| {
        family(
            &req(c, "GET", "/metrics", None).text(),
            "omnistage_stage_panics_total",
        )
    };
    assert_eq!(scrape(&c).get("stage=\"spin\""), Some(&0.0));
    let t = std::thread::spawn(|| {
        omnistage::exec::panic::set_thread_stage("metrics-test");
        for _ in 0..3 {
            let caught = std::panic::catch_unwind(|| panic!("counted test panic"));
            assert!(caught.is_err());
        }
    });
    t.join().unwrap();
    assert_eq!(scrape(&c).get("stage=\"metrics-test\""), Some(&3.0));
}

/// Each metric family is declared once: OpenMetrics forbids a second `# TYPE` line for a name,
/// and a strict parser rejects the whole scrape for it. (The per-dispatch stretch histogram
/// once shared `omnistage_worker_dispatch_seconds` with the workers' dispatch-time counter.)
#[test]
fn no_family_is_declared_twice() {
    let r = rig(1);
    let (_h, c) = admin(&r.rt, None);
    let text = req(&c, "GET", "/metrics", None).text();
    let mut seen = std::collections::BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let name = rest.split(' ').next().expect("a name");
            assert!(seen.insert(name.to_string()), "# TYPE {name} twice");
        }
    }
    // Both families that shared the name are there.
    assert!(seen.contains("omnistage_worker_dispatch_seconds"));
    assert!(seen.contains("omnistage_worker_dispatch_stretch_seconds"));
}

/// A removed activity's counters are not lost from `/metrics` once the runtime folds them into
/// its aggregate of retired activities: they show under `activity="(retired)"`, so a sum over
/// activities does not drop when a tenant goes.
#[test]
fn a_removed_activitys_counters_show_as_retired() {
    use omnistage::activity::ActivitySpec;
    use omnistage::exec::Affinity;
    let r = rig(2);
    let (_h, c) = admin(&r.rt, None);
    let gone =
        r.rt.create_activity("/t/gone", ActivitySpec::default())
            .unwrap();
    for i in 0..20 {
        r.rt.send(&r.front, gone, Affinity::Any, i).unwrap();
    }
    r.drain();
    let text = req(&c, "GET", "/metrics", None).text();
    let msgs = family(&text, "omnistage_activity_messages_total");
    // front, then two sends to back each.
    assert_eq!(msgs["activity=\"/t/gone\""], 60.0);
    assert!(!msgs.contains_key("activity=\"(retired)\""));
    r.rt.remove_activity("/t/gone").unwrap();
    wait_for("/t/gone's rows folded", || {
        r.rt.snapshot().rows.iter().all(|row| row.activity != gone)
    });
    let text = req(&c, "GET", "/metrics", None).text();
    let msgs = family(&text, "omnistage_activity_messages_total");
    assert_eq!(msgs["activity=\"(retired)\""], 60.0);
    assert!(!msgs.contains_key("activity=\"/t/gone\""));
}
