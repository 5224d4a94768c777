//! The `admin` target: requests to the admin API (its head parsing, JSON bodies, and every
//! route's checks) answered in-process ([`omnistage_admin::InProcess`]) by one HTTP server per
//! process with three configured tenants (one with prioritized classes, one with a p90 target
//! and a network cap). After each request the server is put back as it was, so inputs do not
//! depend on each other.
//!
//! What must hold, whatever the bytes:
//! - no panic, and never 500 or 503 (the routes make no I/O that could fail);
//! - a refused request (4xx, 501) has a JSON body `{"status": N, "error": "why"}` with N its
//!   status and a reason, and changed nothing: the activity tree, the admission predicates of
//!   the configured tenants, and the server's running configuration are as before;
//! - an accepted one leaves a valid configuration: every activity the running config owns
//!   still exists, and every node's settings pass the tree's own checks.
//!
//! Input: byte 0 picks the method (bits 0-1: GET, PUT, DELETE, POST), whether the body is
//! sent as JSON (bit 2) and whether the rest is sent as it is, head and all (bit 3); else the
//! rest is the request target up to the first `\n` and the body after it, framed by a
//! well-formed head.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use omnistage::activity::ActivitySpec;
use omnistage_admin::InProcess;
use omnistage_http::config::{parse_config, Config};
use omnistage_http::server::{Server, ServerOptions};

/// The server and its admin API, made once per process.
struct Rig {
    server: Arc<Server>,
    admin: InProcess,
    /// The state to return to after each input.
    initial: Snapshot,
    config: Config,
}

/// What a refused request must leave unchanged.
#[derive(Debug, PartialEq)]
struct Snapshot {
    /// Every activity's path and settings, by path.
    tree: Vec<(String, ActivitySpec)>,
    /// The work stage's predicate of each configured activity, as its `Debug` text: a class
    /// group compares by identity, and a reload makes a new one with the same settings.
    admissions: Vec<(String, Option<String>)>,
    config: Config,
}

fn config_text(docroot: &str) -> String {
    format!(
        r#"[server]
listen = ["127.0.0.1:0"]
workers = 1

[[tenant]]
name = "a"
hosts = ["a.test"]
docroot = '{docroot}'
weight = 50
p90_target_ms = 50
[[tenant.class]]
name = "gold"
header = "X-Class: gold"
priority = 0
[[tenant.class]]
name = "bronze"
prefix = "/api/"
priority = 1
p90_target_ms = 200

[[tenant]]
name = "b"
hosts = ["b.test"]
docroot = '{docroot}'
weight = 33
p90_target_ms = 20
net_cap = "10MB/s"

[[tenant]]
name = "c"
hosts = ["c.test"]
docroot = '{docroot}'
weight = 17
cpu_cap = 0.5
"#
    )
}

fn rig() -> &'static Rig {
    static RIG: OnceLock<Rig> = OnceLock::new();
    RIG.get_or_init(|| {
        let dir: PathBuf =
            std::env::temp_dir().join(format!("omnistage-fuzz-admin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("make the fuzz docroot");
        std::fs::write(dir.join("index.html"), "index").expect("write");
        let config = parse_config(&config_text(&dir.display().to_string())).expect("valid");
        let server = Arc::new(
            Server::start(
                config.clone(),
                ServerOptions {
                    workers: Some(1),
                    ..Default::default()
                },
            )
            .expect("start the server"),
        );
        let admin = InProcess::with_tenants(server.clone(), Server::runtime, None);
        let initial = snapshot(&server);
        Rig {
            server,
            admin,
            initial,
            config,
        }
    })
}

fn snapshot(server: &Server) -> Snapshot {
    let rt = server.runtime();
    let mut tree: Vec<(String, ActivitySpec)> =
        rt.with_activities(|t| t.iter().map(|a| (a.path.clone(), a.spec.clone())).collect());
    tree.sort_by(|x, y| x.0.cmp(&y.0));
    let mut admissions = Vec::new();
    for path in server.configured_activities() {
        let id = rt.with_activities(|t| t.lookup(&path));
        admissions.push((
            path,
            id.and_then(|id| rt.admission(server.work_stage(), id))
                .map(|p| format!("{p:?}")),
        ));
    }
    admissions.sort_by(|x, y| x.0.cmp(&y.0));
    Snapshot {
        tree,
        admissions,
        config: server.config(),
    }
}

/// Puts the server back as `rig.initial` has it: activities the input made are removed
/// (deepest first), settings and predicates restored, the configuration reloaded.
fn restore(rig: &Rig) {
    let rt = rig.server.runtime();
    let now = snapshot(&rig.server);
    if now == rig.initial {
        return;
    }
    let mut extra: Vec<&String> = now
        .tree
        .iter()
        .map(|(p, _)| p)
        .filter(|p| !rig.initial.tree.iter().any(|(q, _)| q == *p))
        .collect();
    extra.sort_by_key(|p| std::cmp::Reverse(p.matches('/').count()));
    for p in extra {
        rt.remove_activity(p)
            .expect("remove an activity the input made");
    }
    for (path, spec) in &rig.initial.tree {
        if rt
            .with_activities(|t| {
                t.lookup(path)
                    .and_then(|id| t.get(id).map(|a| a.spec.clone()))
            })
            .as_ref()
            != Some(spec)
        {
            rt.set_activity(path, spec.clone())
                .expect("restore a setting");
        }
    }
    // A reload sets the configured tenants' settings and predicates again.
    let _ = rig.server.reload(rig.config.clone());
    assert_eq!(
        snapshot(&rig.server),
        rig.initial,
        "the rig did not restore"
    );
}

/// The request bytes `data` stands for (see the module doc).
fn request_bytes(data: &[u8]) -> Vec<u8> {
    let Some((&control, rest)) = data.split_first() else {
        return Vec::new();
    };
    if control & 8 != 0 {
        return rest.to_vec();
    }
    let method = ["GET", "PUT", "DELETE", "POST"][usize::from(control & 3)];
    let (target, body) = match rest.iter().position(|&b| b == b'\n') {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, &[][..]),
    };
    let mut raw = format!("{method} ").into_bytes();
    raw.extend_from_slice(target);
    raw.extend_from_slice(b" HTTP/1.1\r\nHost: 127.0.0.1:9090\r\n");
    if control & 4 == 0 {
        raw.extend_from_slice(b"Content-Type: application/json\r\n");
    }
    raw.extend_from_slice(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
    raw.extend_from_slice(body);
    raw
}

/// Admin API requests (see the module doc for what is checked).
pub fn admin(data: &[u8]) {
    // One input at a time: the rig is one server shared by every caller in the process, and
    // the test suite runs the proptest and the seeds in parallel threads; one input's accepted
    // change seen between another's "before" and "after" made that one fail (about once in
    // five workspace runs). A caller that panicked left the rig as its input made it: put back
    // first.
    static TURN: Mutex<()> = Mutex::new(());
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let rig = rig();
    restore(rig);
    let raw = request_bytes(data);
    let before = snapshot(&rig.server);
    let Some(answer) = rig.admin.answer(&raw) else {
        return; // an incomplete request: the listener waits for more or times out (408)
    };
    let status = answer.status;
    assert!(
        status != 500 && status != 503,
        "{status}: {}",
        String::from_utf8_lossy(&answer.body)
    );
    if status >= 400 {
        let v: serde_json::Value = serde_json::from_slice(&answer.body)
            .unwrap_or_else(|e| panic!("a {status} without a JSON body: {e}"));
        assert_eq!(v["status"].as_u64(), Some(u64::from(status)), "{v}");
        let reason = v["error"].as_str().unwrap_or_default();
        assert!(!reason.is_empty(), "a {status} without a reason: {v}");
        assert_eq!(
            snapshot(&rig.server),
            before,
            "a refused request ({status}: {reason}) changed something"
        );
    } else {
        assert!((200..300).contains(&status), "{status}");
        let rt = rig.server.runtime();
        for path in rig.server.configured_activities() {
            assert!(
                rt.with_activities(|t| t.lookup(&path)).is_some(),
                "an accepted request ({status}) removed {path}, which the config owns"
            );
        }
        rt.with_activities(|t| {
            for a in t.iter() {
                a.spec
                    .validate()
                    .unwrap_or_else(|e| panic!("{} was left invalid: {e}", a.path));
            }
        });
    }
    restore(rig);
}
