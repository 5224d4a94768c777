//! End-to-end tests against a tiny HTTP server on 127.0.0.1 (std only, one thread per
//! connection). Every run is bounded by `--requests` (and by `--seconds` as a backstop); the
//! assertions are on counts, never on timing.

use clap::Parser;
use omnistage_load::{run, LoadArgs, Report, TenantReport};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    load: LoadArgs,
}

/// What the test server saw.
#[derive(Default)]
struct Seen {
    accepted: AtomicUsize,
    requests: AtomicUsize,
    close_requests: AtomicUsize,
    paths: Mutex<HashMap<String, usize>>,
    hosts: Mutex<HashMap<String, usize>>,
}

struct Server {
    addr: SocketAddr,
    seen: Arc<Seen>,
}

fn server() -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Seen::default());
    let s = seen.clone();
    thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            s.accepted.fetch_add(1, Ordering::SeqCst);
            let s = s.clone();
            thread::spawn(move || serve(stream, &s));
        }
    });
    Server { addr, seen }
}

/// Writes `bytes` in small pieces with pauses, so the client sees them in separate reads.
fn dribble(s: &mut TcpStream, bytes: &[u8]) {
    for piece in bytes.chunks(3) {
        if s.write_all(piece).is_err() {
            return;
        }
        thread::sleep(Duration::from_millis(1));
    }
}

fn serve(mut s: TcpStream, seen: &Seen) {
    let _ = s.set_nodelay(true);
    let mut buf: Vec<u8> = Vec::new();
    let mut tmp = [0u8; 4096];
    loop {
        let end = loop {
            if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break p + 4;
            }
            match s.read(&mut tmp) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&tmp[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_string();
        buf.drain(..end);
        seen.requests.fetch_add(1, Ordering::SeqCst);
        let path = head.split(' ').nth(1).unwrap_or("").to_string();
        let lower = head.to_ascii_lowercase();
        let host = lower
            .lines()
            .find_map(|l| l.strip_prefix("host: "))
            .unwrap_or("")
            .to_string();
        let close = lower.contains("\r\nconnection: close\r\n");
        if close {
            seen.close_requests.fetch_add(1, Ordering::SeqCst);
        }
        *seen.paths.lock().unwrap().entry(path.clone()).or_default() += 1;
        *seen.hosts.lock().unwrap().entry(host).or_default() += 1;
        let reply: &[u8] = match path.as_str() {
            "/ok" => b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
            "/503" => b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 4\r\n\r\nbusy",
            "/404" => b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n",
            "/500" => b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n",
            "/close" => {
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok");
                return;
            }
            "/split" => {
                dribble(
                    &mut s,
                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nwiki\r\n5\r\npedia\r\n0\r\n\r\n",
                );
                continue;
            }
            "/eof" => {
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\nuntil-close");
                return;
            }
            "/garbage" => b"NOT HTTP AT ALL\r\n\r\n",
            "/then-408" => {
                // An answer, then (as a server closing an idle connection says) a 408 that no
                // request asked for.
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
                std::thread::sleep(std::time::Duration::from_millis(20));
                let _ = s.write_all(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n");
                return;
            }
            "/drop" => return,
            "/hang" => {
                // Never answer; wait for the client to give up.
                while matches!(s.read(&mut tmp), Ok(n) if n > 0) {}
                return;
            }
            p if p.starts_with("/f/") && p.ends_with(".bin") => {
                b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nbin"
            }
            _ => b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n",
        };
        if s.write_all(reply).is_err() {
            return;
        }
        if close {
            return;
        }
    }
}

fn args(addr: SocketAddr, rest: &[&str]) -> LoadArgs {
    let addr = addr.to_string();
    let mut argv = vec!["load", "--addr", &addr, "--seconds", "60"];
    argv.extend_from_slice(rest);
    Cli::try_parse_from(argv).unwrap().load
}

fn load(addr: SocketAddr, rest: &[&str]) -> Report {
    run(&args(addr, rest)).unwrap()
}

fn tenant<'a>(r: &'a Report, name: &str) -> &'a TenantReport {
    r.tenants.iter().find(|t| t.name == name).unwrap()
}

/// Asserts a tenant that only succeeded.
fn assert_clean(t: &TenantReport, requests: u64, body_bytes: u64) {
    assert_eq!(t.requests, requests, "{t:?}");
    assert_eq!(t.responses, requests, "{t:?}");
    assert_eq!(t.bytes, body_bytes, "{t:?}");
    assert_eq!(t.errors, Default::default(), "{t:?}");
    assert_eq!(t.unfinished, 0, "{t:?}");
}

#[test]
fn counts_keep_alive_requests_exactly() {
    let srv = server();
    let r = load(
        srv.addr,
        &["--tenant", "a:a.test:4:path=/ok", "--requests", "100"],
    );
    let a = tenant(&r, "a");
    assert_clean(a, 100, 500);
    // Every byte of the 100 responses arrived in the measured window (no warmup), counted as
    // it was read.
    let reply = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello".len() as u64;
    assert_eq!(a.received_bytes, 100 * reply);
    assert_eq!(r.total.received_bytes, 100 * reply);
    assert_eq!(a.connections, 4);
    assert_eq!(a.reconnects, 0);
    assert!(a.jain_fairness.is_some_and(|j| j > 0.0 && j <= 1.0));
    assert!(a.p50_ms <= a.p90_ms && a.p90_ms <= a.p99_ms && a.p99_ms <= a.max_ms);
    assert_eq!(srv.seen.requests.load(Ordering::SeqCst), 100);
    assert_eq!(srv.seen.accepted.load(Ordering::SeqCst), 4);
    assert_eq!(srv.seen.hosts.lock().unwrap().get("a.test"), Some(&100));
    assert_eq!(r.total.requests, 100);
    assert!(r.seconds > 0.0 && r.seconds <= 60.0);
}

#[test]
fn reconnects_after_requests_per_conn() {
    let srv = server();
    let r = load(
        srv.addr,
        &[
            "--tenant",
            "a:a:1:path=/ok",
            "--requests",
            "50",
            "--requests-per-conn",
            "7",
        ],
    );
    let a = tenant(&r, "a");
    assert_clean(a, 50, 250);
    // 7 full connections of 7 requests, then one more for the 50th.
    assert_eq!(srv.seen.accepted.load(Ordering::SeqCst), 8);
    assert_eq!(a.reconnects, 7);
    // The last request on each full connection asks the server to close.
    assert_eq!(srv.seen.close_requests.load(Ordering::SeqCst), 7);
    assert_eq!(a.jain_fairness, Some(1.0));
}

#[test]
fn connection_close_responses_reconnect() {
    let srv = server();
    let r = load(
        srv.addr,
        &["--tenant", "c:c:1:path=/close", "--requests", "5"],
    );
    let c = tenant(&r, "c");
    assert_clean(c, 5, 10);
    assert_eq!(srv.seen.accepted.load(Ordering::SeqCst), 5);
    assert_eq!(c.reconnects, 4);
}

#[test]
fn rejections_and_http_errors_by_class() {
    let srv = server();
    let r = load(
        srv.addr,
        &[
            "--tenant",
            "r:r:2:path=/503",
            "--tenant",
            "n:n:1:path=/404",
            "--tenant",
            "e:e:1:path=/500",
            "--requests",
            "10",
        ],
    );
    let (rej, nf, ise) = (tenant(&r, "r"), tenant(&r, "n"), tenant(&r, "e"));
    assert_eq!(
        (
            rej.requests,
            rej.responses,
            rej.errors.rejected_503,
            rej.retry_after
        ),
        (0, 10, 10, 10)
    );
    assert_eq!((nf.requests, nf.responses, nf.errors.http_4xx), (0, 10, 10));
    assert_eq!(
        (ise.requests, ise.responses, ise.errors.http_5xx),
        (0, 10, 10)
    );
    for t in [rej, nf, ise] {
        assert_eq!(t.errors.failed_requests(), 10);
        assert_eq!(t.jain_fairness, None);
        assert_eq!(t.bytes, 0);
    }
    assert_eq!(r.total.errors.failed_requests(), 30);
    assert_eq!(r.total.responses, 30);
}

#[test]
fn partial_chunked_and_close_delimited_bodies() {
    let srv = server();
    let r = load(
        srv.addr,
        &[
            "--tenant",
            "s:s:1:path=/split",
            "--tenant",
            "e:e:2:path=/eof",
            "--requests",
            "4",
        ],
    );
    assert_clean(tenant(&r, "s"), 4, 4 * 9);
    let e = tenant(&r, "e");
    assert_clean(e, 4, 4 * "until-close".len() as u64);
    // Every response closes its connection: requests 3 and 4 need two new ones (a third may open
    // just before the last request is taken by the other slot).
    assert!((2..=3).contains(&e.reconnects), "{e:?}");
}

#[test]
fn errors_by_kind() {
    let srv = server();
    let r = load(
        srv.addr,
        &[
            "--tenant",
            "g:g:1:path=/garbage",
            "--tenant",
            "d:d:2:path=/drop",
            "--requests",
            "5",
        ],
    );
    let (g, d) = (tenant(&r, "g"), tenant(&r, "d"));
    assert_eq!(
        (g.requests, g.errors.parse, g.errors.failed_requests()),
        (0, 5, 5)
    );
    assert_eq!(
        (d.requests, d.errors.reset, d.errors.failed_requests()),
        (0, 5, 5)
    );
    // The server never answers /hang, so every request times out however slow the machine is.
    let r = load(
        srv.addr,
        &[
            "--tenant",
            "h:h:2:path=/hang",
            "--requests",
            "5",
            "--timeout-ms",
            "50",
        ],
    );
    let h = tenant(&r, "h");
    assert_eq!(
        (h.requests, h.errors.timeout, h.errors.failed_requests()),
        (0, 5, 5)
    );
    for t in [g, d, h] {
        assert_eq!(t.unfinished, 0);
        assert_eq!(t.errors.connect, 0);
    }
}

#[test]
fn unfinished_requests_carry_their_age_at_the_deadline() {
    // The server never answers /hang: at the deadline both open-loop requests due at the start
    // are still in flight, waiting since the start (their intended time, not their send).
    let srv = server();
    let mut a = args(
        srv.addr,
        &["--tenant", "h:h:2:path=/hang,rate=10", "--warmup-s", "0"],
    );
    a.seconds = 0.5;
    let r = run(&a).unwrap();
    let h = tenant(&r, "h");
    assert_eq!(h.requests, 0);
    assert!(h.unfinished >= 2, "{h:?}");
    // Ages are reckoned from the run's start and its deadline, not measured: 500 ms.
    let oldest = h
        .unfinished_oldest_ms
        .expect("unfinished requests have an age");
    assert!((oldest - 500.0).abs() < 0.01, "{oldest}");
    assert_eq!(r.total.unfinished_oldest_ms, Some(oldest));
    // Nothing left over: no age.
    let r = load(srv.addr, &["--tenant", "a:a:1:path=/ok", "--requests", "3"]);
    assert_eq!(tenant(&r, "a").unfinished_oldest_ms, None);
}

#[test]
fn refused_connections_are_connect_errors() {
    // A port that was just free: nothing listens there.
    let addr = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut a = args(addr, &["--tenant", "a:a:2:path=/ok"]);
    a.seconds = 0.3;
    let r = run(&a).unwrap();
    let t = tenant(&r, "a");
    assert!(t.errors.connect > 0, "{t:?}");
    assert_eq!(
        (t.requests, t.responses, t.errors.failed_requests()),
        (0, 0, 0)
    );
}

#[test]
fn open_loop_counts_exactly() {
    let srv = server();
    let r = load(
        srv.addr,
        &[
            "--tenant",
            "o:o:4:path=/ok",
            "--rate",
            "5000",
            "--requests",
            "40",
        ],
    );
    let o = tenant(&r, "o");
    assert_clean(o, 40, 200);
    assert_eq!(o.pacing, "open");
    assert_eq!(o.rate_per_s, Some(5000.0));
    assert_eq!(srv.seen.requests.load(Ordering::SeqCst), 40);
}

#[test]
fn per_tenant_pacing_and_threads() {
    let srv = server();
    let r = load(
        srv.addr,
        &[
            "--tenant",
            "a:a.test:3:path=/ok,rate=4000",
            "--tenant",
            "b:b.test:3:path=/ok,think-ms=0",
            "--requests",
            "30",
            "--threads",
            "2",
        ],
    );
    assert_clean(tenant(&r, "a"), 30, 150);
    assert_clean(tenant(&r, "b"), 30, 150);
    assert_eq!(tenant(&r, "a").pacing, "open");
    assert_eq!(tenant(&r, "b").pacing, "closed");
    assert_eq!(r.threads, 2);
    let hosts = srv.seen.hosts.lock().unwrap();
    assert_eq!(
        (hosts.get("a.test"), hosts.get("b.test")),
        (Some(&30), Some(&30))
    );
    assert_eq!(r.total.requests, 60);
    assert_eq!(r.total.connections, 6);
}

#[test]
fn zipf_mix_requests_its_file_set() {
    let srv = server();
    let r = load(
        srv.addr,
        &[
            "--tenant",
            "z:z:1:zipf=50:1.0:/f",
            "--requests",
            "300",
            "--seed",
            "3",
        ],
    );
    assert_clean(tenant(&r, "z"), 300, 900);
    let paths = srv.seen.paths.lock().unwrap();
    assert_eq!(paths.values().sum::<usize>(), 300);
    for p in paths.keys() {
        let k: u64 = p
            .strip_prefix("/f/")
            .and_then(|s| s.strip_suffix(".bin"))
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("unexpected path {p}"));
        assert!(k < 50);
    }
    let most = paths.iter().max_by_key(|(_, &n)| n).unwrap().0;
    assert_eq!(most, "/f/0.bin");
}

#[test]
fn weighted_mix_requests_only_its_paths() {
    let srv = server();
    let dir = std::env::temp_dir().join(format!("omnistage-load-wl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("w.txt");
    std::fs::write(&file, "3 /ok\n1 /f/1.bin\n").unwrap();
    let spec = format!("w:w:1:weighted={}", file.display());
    let r = load(
        srv.addr,
        &["--tenant", &spec, "--requests", "400", "--seed", "5"],
    );
    std::fs::remove_dir_all(&dir).unwrap();
    let w = tenant(&r, "w");
    assert_eq!((w.requests, w.errors), (400, Default::default()));
    let paths = srv.seen.paths.lock().unwrap();
    assert_eq!(paths.len(), 2, "{paths:?}");
    assert!(paths["/ok"] > paths["/f/1.bin"], "{paths:?}");
}

#[test]
fn client_counts_cover_every_slot_of_every_tenant() {
    let srv = server();
    // Two tenants of one connection each, three requests each: two clients, three apiece.
    let r = load(
        srv.addr,
        &[
            "--tenant",
            "a:a:1:path=/ok",
            "--tenant",
            "b:b:1:path=/ok",
            "--requests",
            "3",
        ],
    );
    let c = r.client_requests;
    assert_eq!(c.clients, 2);
    assert_eq!(
        (c.requests_min, c.requests_median, c.requests_max),
        (3, 3, 3)
    );
    assert_eq!(c.starved, 0);
    assert_eq!(r.client_jain, Some(1.0));
    assert_eq!(r.client_jain, r.total.jain_fairness);
}

#[test]
fn timed_run_stops_by_itself() {
    let srv = server();
    let mut a = args(
        srv.addr,
        &["--tenant", "a:a:2:path=/ok", "--warmup-s", "0.1"],
    );
    a.seconds = 0.3;
    let r = run(&a).unwrap();
    let t = tenant(&r, "a");
    assert!(t.requests > 0);
    assert!(t.unfinished <= 2);
    assert_eq!(t.errors, Default::default());
    assert!((r.warmup_s - 0.1).abs() < 1e-9);
}

#[test]
fn report_json_and_table() {
    let srv = server();
    let r = load(srv.addr, &["--tenant", "a:a:1:bytes=10", "--requests", "3"]);
    let v = serde_json::to_value(&r).unwrap();
    for k in [
        "addr",
        "threads",
        "seconds",
        "warmup_s",
        "tenants",
        "total",
        "client_jain",
        "client_requests",
    ] {
        assert!(v.get(k).is_some(), "{k}");
    }
    for k in [
        "clients",
        "jain",
        "requests_min",
        "requests_median",
        "requests_max",
        "starved",
    ] {
        assert!(v["client_requests"].get(k).is_some(), "{k}");
    }
    let t = &v["tenants"][0];
    for k in [
        "name",
        "host",
        "connections",
        "mix",
        "pacing",
        "rate_per_s",
        "think_ms",
        "requests",
        "responses",
        "req_per_s",
        "bytes",
        "bytes_per_s",
        "received_bytes",
        "received_bytes_per_s",
        "p50_ms",
        "p90_ms",
        "p99_ms",
        "p999_ms",
        "max_ms",
        "mean_ms",
        "errors",
        "retry_after",
        "reconnects",
        "idle_closes",
        "unfinished",
        "unfinished_oldest_ms",
        "jain_fairness",
    ] {
        assert!(t.get(k).is_some(), "{k}");
    }
    for k in [
        "connect",
        "reset",
        "timeout",
        "rejected_503",
        "http_4xx",
        "http_5xx",
        "http_other",
        "parse",
    ] {
        assert!(t["errors"].get(k).is_some(), "{k}");
    }
    assert_eq!(t["mix"], "bytes=10");
    assert_eq!(srv.seen.paths.lock().unwrap().get("/_bytes?n=10"), Some(&3));
    // Each of the 3 responses came in at least one segment with data, counted on the
    // generator's own sockets (the window holds them all: no warmup).
    let g = r.server_segments.as_ref().expect("TCP_INFO on Linux");
    assert!(g.data >= 3 && g.unread_sockets == 0, "{g:?}");
    let table = omnistage_load::format_table(&r);
    assert!(table.lines().count() == 6, "{table}");
    assert!(table.contains("server's TCP segments"), "{table}");
    assert!(table.contains("clients: 1"), "{table}");
    assert!(table.contains("total"));
}

#[test]
fn windows_add_up_to_the_run() {
    let srv = server();
    let r = load(
        srv.addr,
        &[
            "--tenant",
            "a:a.test:4:path=/ok",
            "--requests",
            "300",
            "--window-ms",
            "10",
        ],
    );
    let a = tenant(&r, "a");
    assert_clean(a, 300, 1500);
    assert_eq!(r.window_s, Some(0.01));
    // Every success is in exactly one window, in order, each with quantiles when not empty.
    assert_eq!(a.windows.iter().map(|w| w.requests).sum::<u64>(), 300);
    for (i, w) in a.windows.iter().enumerate() {
        assert_eq!(w.index, i);
        assert_eq!(w.p90_ms.is_some(), w.requests > 0);
    }
    // Without --window-ms there are none.
    let r = load(
        srv.addr,
        &["--tenant", "a:a.test:1:path=/ok", "--requests", "5"],
    );
    assert!(r.window_s.is_none() && tenant(&r, "a").windows.is_empty());
}

#[test]
fn argument_errors_are_clear() {
    let ok = |rest: &[&str]| -> Result<LoadArgs, clap::Error> {
        let mut argv = vec!["load"];
        argv.extend_from_slice(rest);
        Cli::try_parse_from(argv).map(|c| c.load)
    };
    let t = ["--tenant", "a:a:1:path=/"];
    let cases: &[(&[&str], &str)] = &[
        (&["--addr", "localhost:8080"], "names are not resolved"),
        (&["--addr", "192.168.1.1:80"], "only loopback"),
        (&["--seconds", "0"], "--seconds must be in"),
        (&["--seconds", "3601"], "--seconds must be in"),
        (&["--warmup-s=-1"], "--warmup-s must be in"),
        (&["--threads", "0"], "--threads must be in"),
        (&["--threads", "2"], "more than the 1 connections"),
        (&["--timeout-ms", "0"], "--timeout-ms must be in"),
        (&["--rate", "0"], "--rate"),
        (&["--think-ms=-5"], "--think-ms"),
        (&["--cpu", "x"], "not a CPU index"),
        (&["--cpu", "5000"], "CPU index must be below"),
        (&["--spin-us", "5000"], "--spin-us"),
        (&["--window-ms", "5"], "--window-ms must be 0 or in"),
        (&["--window-ms", "10", "--seconds", "200"], "at most 10000"),
        (
            &["--requests", "1000000000001"],
            "--requests must be at most",
        ),
        (&["--tenant", "a:b:1:path=/"], "used twice"),
        (
            &["--tenant", "b:b:99999:path=/", "--tenant", "c:c:2:path=/"],
            "at most 100000",
        ),
    ];
    for (rest, needle) in cases {
        let mut argv: Vec<&str> = t.to_vec();
        argv.extend_from_slice(rest);
        let a = ok(&argv).unwrap();
        let e = run(&a).unwrap_err();
        assert!(e.contains(needle), "{rest:?}: {e}");
    }
    // Parse-time errors from clap itself.
    assert!(ok(&["--seconds", "1"]).is_err(), "a tenant is required");
    assert!(ok(&["--tenant", "a:a:1:path=/", "--rate", "5", "--think-ms", "1"]).is_err());
    assert!(ok(&["--tenant", "a:a:1:path=/", "--requests", "-1"]).is_err());
}

#[test]
fn bytes_a_server_sends_with_no_request_outstanding_fail_no_request() {
    let srv = server();
    // 100 ms of think time: the 408 arrives while the slot waits, not with a request out.
    let r = load(
        srv.addr,
        &[
            "--tenant",
            "a:a.test:1:path=/then-408",
            "--requests",
            "3",
            "--think-ms",
            "100",
        ],
    );
    let a = tenant(&r, "a");
    assert_eq!((a.requests, a.responses), (3, 3), "{a:?}");
    assert_eq!(a.errors.failed_requests(), 0, "{a:?}");
    assert!(a.errors.unsolicited >= 1, "{a:?}");
}

#[test]
fn a_spent_budget_ends_the_slots_waiting_for_their_next_request() {
    let srv = server();
    // 10 slots at 2 requests/s in all: slot i is due at i × 0.5 s. With 2 requests the budget is
    // spent at 0.5 s; the eight slots still waiting (due up to 4.5 s) end then, so the run
    // lasts about 0.5 s, not 4.5 s (and its rates are over that).
    let r = load(
        srv.addr,
        &[
            "--tenant",
            "a:a.test:10:path=/ok",
            "--requests",
            "2",
            "--rate",
            "2",
        ],
    );
    assert_clean(tenant(&r, "a"), 2, 10);
    assert!(r.seconds < 3.0, "the run lasted {} s", r.seconds);
}
