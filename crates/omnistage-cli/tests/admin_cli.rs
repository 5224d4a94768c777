//! The admin commands end to end: `omnistage serve` with its admin listener on a free port,
//! then `omnistage set`, `tree`, `graph` and `top --once` against it, including refused
//! changes (their reason is printed and the exit code is 2), and a graceful stop on SIGTERM.

mod common;

use common::{run, serve};
use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn set_tree_graph_and_top_against_a_running_server() {
    let dir = std::env::temp_dir().join(format!("omnistage-admin-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut s = serve(&dir);
    let admin = s.admin.clone();
    let a = ["--admin", admin.as_str()];

    let (code, out, err) =
        run(&[&["set", "/tenants/a", "weight=70", "cap_cpu=0.5"], &a[..]].concat());
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("changed /tenants/a"), "{out}");
    let (code, out, err) = run(&[&["set", "/tenants/x", "weight=5"], &a[..]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("created /tenants/x"), "{out}");

    let (code, out, err) = run(&[&["tree"], &a[..]].concat());
    assert_eq!(code, 0, "{err}");
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("a "))
        .unwrap_or_else(|| panic!("a row for tenant a:\n{out}"));
    assert!(
        line.contains(" 70 ") && line.contains("0.50 cores"),
        "{line}"
    );
    assert!(
        out.lines().any(|l| l.trim_start().starts_with("x ")),
        "{out}"
    );
    // A reader that goes away (`omnistage tree | head -0`): the command ends quietly, status
    // 0, no panic. The pipe is closed before the command can have asked the server anything.
    for cmd in ["tree", "graph"] {
        let mut child = Command::new(common::BIN)
            .args([cmd, "--admin", admin.as_str()])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{cmd}: {err}");
        assert!(!err.contains("panicked"), "{cmd}: {err}");
    }
    let (code, out, _) = run(&[&["tree", "--json"], &a[..]].concat());
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["root"]["path"], "/");
    // Tenants of an HTTP server report their cache bytes; other nodes have none.
    fn find<'a>(n: &'a serde_json::Value, path: &str) -> Option<&'a serde_json::Value> {
        if n["path"] == path {
            return Some(n);
        }
        n["children"].as_array()?.iter().find_map(|c| find(c, path))
    }
    assert!(find(&v["root"], "/tenants/a").unwrap()["cache_bytes"].is_u64());
    assert!(find(&v["root"], "/infra").unwrap()["cache_bytes"].is_null());

    // Refused changes: the reason and exit code 2; nothing changes.
    for (args, needle) in [
        (vec!["set", "/tenants/a", "weight=0"], "409"),
        (vec!["set", "/infra", "cap_cpu=0"], "409"),
        (vec!["set", "/tenants/a", "cap_net=0B/s"], "400"),
        (vec!["set", "/tenants/a", "budget=100GiB"], "409"),
        (vec!["set", "/tenants/a", "cap_net=fast"], "400"),
        (vec!["set", "/tenants/a", "send_order=srpt"], "400"),
        (vec!["set", "/infra", "cap_net=10MB/s"], "404"),
        (
            vec!["set", "/tenants/x", "weight=5", "--persist"],
            "not in the config file",
        ),
        (vec!["set", "/tenants/a", "colour=red"], "unknown setting"),
        (vec!["set", "/nope/x", "weight=5"], "409"),
    ] {
        let (code, out, err) = run(&[&args[..], &a[..]].concat());
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    // Settings that live in the HTTP server (send stage, disk stage, cache) are changed too.
    let (code, out, err) = run(&[
        &[
            "set",
            "/tenants/a",
            "cap_net=10MB/s",
            "budget=1MiB",
            "send_order=shortest_first",
        ],
        &a[..],
    ]
    .concat());
    assert_eq!(code, 0, "{out}{err}");
    let (_, out, _) = run(&[&["tree"], &a[..]].concat());
    assert!(
        out.lines()
            .any(|l| l.trim_start().starts_with("a ") && l.contains(" 70 ")),
        "{out}"
    );

    // --persist writes the weight into the config file; a SIGHUP (the file's values win)
    // keeps it.
    let (code, out, err) =
        run(&[&["set", "/tenants/a", "weight=65", "--persist"], &a[..]].concat());
    assert_eq!(code, 0, "{out}{err}");
    let file = std::fs::read_to_string(dir.join("omnistage.toml")).unwrap();
    assert!(file.contains("weight = 65"), "{file}");
    let pid = s.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap()
        .success());
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let left = end.saturating_duration_since(Instant::now());
        let line = s.lines.recv_timeout(left).expect("serve says it reloaded");
        if line.starts_with("omnistage: reloaded") {
            break;
        }
    }
    let (_, out, _) = run(&[&["tree"], &a[..]].concat());
    assert!(
        out.lines()
            .any(|l| l.trim_start().starts_with("a ") && l.contains(" 65 ")),
        "{out}"
    );

    let (code, out, err) = run(&[&["graph"], &a[..]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with("digraph omnistage {") && out.contains("\"http.boot\""),
        "{out}"
    );
    let (code, out, _) = run(&[&["graph", "--json"], &a[..]].concat());
    assert_eq!(code, 0);
    assert!(serde_json::from_str::<serde_json::Value>(&out).unwrap()["edges"].is_array());

    let (code, out, err) = run(&[
        &["top", "--once", "--width", "100", "--height", "12"],
        &a[..],
    ]
    .concat());
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("ACTIVITY") && out.contains("tenants"), "{out}");
    let (code, _, err) = run(&["top", "--once", "--admin", "http://127.0.0.1:1"]);
    assert_eq!(code, 2);
    assert!(err.contains("cannot reach"), "{err}");

    // A graceful stop: the admin server lets go of the server, which drains.
    let pid = s.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let end = Instant::now() + Duration::from_secs(20);
    let mut stopped = false;
    while let Ok(line) = s
        .lines
        .recv_timeout(end.saturating_duration_since(Instant::now()))
    {
        if line == "omnistage: stopped" {
            stopped = true;
            break;
        }
    }
    assert!(stopped, "serve did not drain and stop");
    let status = s.child.wait().unwrap();
    assert!(status.success(), "{status}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `omnistage top` without a terminal (output to a pipe, as in a script or under CI) says to use
/// `--once` and exits with status 2, instead of panicking in the terminal library.
#[test]
fn top_without_a_terminal_says_to_use_once() {
    let mut child = Command::new(common::BIN)
        .args(["top", "--admin", "http://127.0.0.1:1"])
        .env_remove("OMNISTAGE_ADMIN_TOKEN")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let end = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let status = status.unwrap_or_else(|| panic!("top kept running without a terminal: {err}"));
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.contains("--once") && !err.contains("panicked"), "{err}");
}
