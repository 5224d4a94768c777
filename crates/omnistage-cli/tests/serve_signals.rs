//! `omnistage serve`'s flags and signals, end to end (the binary on loopback): each test failed
//! against the code its comment describes, and guards the fix. Every wait is bounded; a
//! server that does not exit in time is killed and the test fails.

mod common;

use common::{serve_config, BIN};
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Longest a wait of these tests lasts before it fails the test.
const WAIT: Duration = Duration::from_secs(20);

fn config(dir: &std::path::Path, extra_server: &str, extra_tenant: &str) -> std::path::PathBuf {
    std::fs::write(dir.join("index.html"), "hello\n").unwrap();
    let path = dir.join("omnistage.toml");
    std::fs::write(
        &path,
        format!(
            "[server]\nlisten = [\"127.0.0.1:0\"]\n{extra_server}\n[[tenant]]\nname = \"a\"\ndocroot = \"{}\"\n{extra_tenant}",
            dir.display()
        ),
    )
    .unwrap();
    path
}

fn signal(child: &Child, sig: &str) {
    assert!(Command::new("kill")
        .args([&format!("-{sig}"), &child.id().to_string()])
        .status()
        .unwrap()
        .success());
}

/// Waits up to `within` for the child to exit: its status code, or `None` (then it is
/// killed).
fn exit_code(child: &mut Child, within: Duration) -> Option<i32> {
    let end = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status.code().unwrap_or(-1));
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits for a line of serve's stderr that starts with `prefix`.
fn wait_line(lines: &std::sync::mpsc::Receiver<String>, prefix: &str) {
    let end = Instant::now() + WAIT;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        let line = lines
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("serve never said {prefix:?}"));
        if line.starts_with(prefix) {
            return;
        }
    }
}

/// Findings 4 and 11. Once: `--workers 0` panicked in the server's start (an empty list of
/// listeners indexed), and `--drain-s` near `u64::MAX` was taken (the drain's deadline then
/// overflowed at SIGTERM). Both are refused by the command line now, with status 2.
#[test]
fn workers_and_drain_flags_out_of_range_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "", "");
    for (flag, value) in [
        ("--workers", "0"),
        ("--workers", "257"),
        ("--drain-s", "18446744073709551615"),
    ] {
        let mut child = Command::new(BIN)
            .args(["serve", "--admin", "off", flag, value, "--config"])
            .arg(&cfg)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let code = exit_code(&mut child, WAIT);
        let mut err = String::new();
        let _ = child.stderr.take().unwrap().read_to_string(&mut err);
        assert_eq!(code, Some(2), "{flag} {value}: {err}");
        assert!(err.contains(flag) && !err.contains("panicked"), "{err}");
    }
}

/// Finding 5. Once: SIGTERM stopped the admin API first (which finishes the requests it has:
/// up to its 5 s receive timeout for a slow one) and only then began the server's drain, so
/// the server kept accepting connections all that while. Now the listeners close first.
#[test]
fn sigterm_closes_the_listeners_before_the_admin_api_stops() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "", "");
    let mut s = serve_config(&cfg, dir.path());
    let admin = s.admin.trim_start_matches("http://").to_string();
    // An admin request that never ends: a whole head promising a body that never comes, so
    // a handler waits for the rest of it (5 s; a head still arriving gets only 1 s).
    let mut slow = TcpStream::connect(&admin).unwrap();
    slow.write_all(b"GET /api/v1/tree HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10\r\n\r\n")
        .unwrap();
    // A whole request after it: once answered, the slow one is with a handler (both queues
    // are first in, first out).
    let mut quick = TcpStream::connect(&admin).unwrap();
    quick.set_read_timeout(Some(WAIT)).unwrap();
    quick
        .write_all(b"GET /api/v1/tree HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    let _ = quick.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    signal(&s.child, "TERM");
    wait_line(&s.lines, "omnistage: draining");
    let end = Instant::now() + WAIT;
    let refused = loop {
        match TcpStream::connect(&s.http) {
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => break true,
            _ if Instant::now() >= end => break false,
            _ => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    assert!(
        refused,
        "the server still accepts after {WAIT:?} of draining"
    );
    // The admin API is still stopping: the slow request's handler has not given up on it.
    slow.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 256];
    match slow.read(&mut buf) {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        other => panic!("the admin API finished stopping before the listeners closed: {other:?}"),
    }
    drop(slow);
    wait_line(&s.lines, "omnistage: stopped");
    assert_eq!(exit_code(&mut s.child, WAIT), Some(0));
}

/// Finding 11. Once: a second SIGTERM (or SIGINT) during the drain was ignored: the server
/// went on draining for all of `--drain-s`. Now it stops at once (status 128 + the signal).
#[test]
fn a_second_sigterm_during_the_drain_stops_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(
        dir.path(),
        "keepalive_timeout_ms = 60000\n",
        "synthetic = true\n",
    );
    let mut child = Command::new(BIN)
        .args([
            "serve",
            "--workers",
            "1",
            "--admin",
            "off",
            "--drain-s",
            "60",
            "--config",
        ])
        .arg(&cfg)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = read_lines(&mut child, None);
    let http = http_addr(&lines);
    // A client that asks for 500 MB and reads none of it: it holds the drain.
    let mut hog = TcpStream::connect(&http).unwrap();
    hog.write_all(b"GET /_bytes?n=500000000 HTTP/1.1\r\nHost: a\r\n\r\n")
        .unwrap();
    let mut first = [0u8; 1];
    hog.set_read_timeout(Some(WAIT)).unwrap();
    assert_eq!(hog.read(&mut first).unwrap(), 1, "the answer has begun");
    signal(&child, "TERM");
    wait_line(&lines, "omnistage: draining");
    signal(&child, "TERM");
    let code = exit_code(&mut child, WAIT);
    assert_eq!(
        code,
        Some(128 + 15),
        "a second SIGTERM did not stop the drain"
    );
}

/// serve's stderr as lines on a channel; with `until`, the reader stops (closing its end of
/// the pipe) once it has passed on a line starting with it.
fn read_lines(child: &mut Child, until: Option<&'static str>) -> std::sync::mpsc::Receiver<String> {
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let last = until.is_some_and(|u| line.starts_with(u));
            if tx.send(line).is_err() || last {
                return;
            }
        }
    });
    rx
}

/// The first plain-HTTP address serve says it serves on.
fn http_addr(lines: &std::sync::mpsc::Receiver<String>) -> String {
    let end = Instant::now() + WAIT;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        let line = lines
            .recv_timeout(left)
            .expect("serve says where it serves");
        if let Some((_, url)) = line.split_once(" on http://") {
            return url.split('/').next().unwrap().to_string();
        }
    }
}

/// Finding 10. Once: serve wrote its reload and drain messages with `eprintln!`, which panics
/// when stderr is gone (here a pipe whose reader closed): a SIGHUP then killed the server
/// (status 101) instead of reloading it. Now the messages are dropped and the server goes on.
#[test]
fn a_sighup_with_stderr_gone_reloads_and_the_server_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "", "hosts = [\"a.test\"]\n");
    let mut child = Command::new(BIN)
        .args([
            "serve",
            "--workers",
            "1",
            "--admin",
            "127.0.0.1:0",
            "--config",
        ])
        .arg(&cfg)
        .env_remove("OMNISTAGE_ADMIN_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read up to the admin line (the last one at start), then close the pipe.
    let lines = read_lines(&mut child, Some("omnistage: admin API"));
    let http = http_addr(&lines);
    wait_line(&lines, "omnistage: admin API");
    while lines.recv_timeout(WAIT).is_ok() {}
    let get = |host: &str| -> Option<String> {
        let mut s = TcpStream::connect(&http).ok()?;
        s.set_read_timeout(Some(WAIT)).ok()?;
        write!(
            s,
            "GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut r = String::new();
        s.read_to_string(&mut r).ok()?;
        Some(r)
    };
    assert!(get("a.test").is_some_and(|r| r.starts_with("HTTP/1.1 200")));
    // A reload that adds host b.test to the tenant.
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        text.replace("[\"a.test\"]", "[\"a.test\", \"b.test\"]"),
    )
    .unwrap();
    signal(&child, "HUP");
    let end = Instant::now() + WAIT;
    while !get("b.test").is_some_and(|r| r.starts_with("HTTP/1.1 200")) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        child.try_wait().unwrap().is_none(),
        "the server died at the SIGHUP"
    );
    assert!(get("b.test").is_some_and(|r| r.starts_with("HTTP/1.1 200")));
    signal(&child, "TERM");
    assert_eq!(exit_code(&mut child, WAIT), Some(0));
}
