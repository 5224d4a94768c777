//! A tenant's `send_order` end to end: one server worker, a small net cap, three responses of
//! different sizes queued at once; the order in which they complete at the clients, and that
//! every body arrives intact.
//!
//! Requests are sequenced by the server's request counter (a request is counted in the same
//! handler that queues its response), never by sleeping; the cap makes the three responses
//! overlap, and only the order of completion is asserted.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use omnistage_http::config::{parse_config, SendOrder};
use omnistage_http::server::{Server, ServerOptions};

/// Read timeout on the client sockets (a stuck server fails the test).
const IO_TIMEOUT: Duration = Duration::from_secs(20);
/// Bytes of the three files: the first to arrive is the medium one, then the large, then the
/// small, so FIFO, shortest-first and longest-first each finish them in a different order.
/// The cap is [`CAP`] (500 KB/s), so that neither a client thread's scheduling delay nor a
/// stalled machine can swap two:
/// - each order depends on the medium response, which starts alone, having sent less than
///   `MEDIUM − SMALL` (150 KB: 300 ms at the cap, less the cap's 16 KiB burst) before the small
///   request arrives (shortest-first and fair rank by what is left to send), or less than SMALL
///   before the large one arrives (longest-first); the requests go out a few ms apart;
/// - two completions are at least 200 ms of the cap apart in every order (the small file's
///   time).
///
/// With SMALL = 30 KB at 1 MB/s the last two completions were 30 ms apart, and with SMALL =
/// 150 KB an 80 ms stall of the test thread could swap the small and the medium. MEDIUM stays
/// under 256 KiB, so only the large body goes through the disk stage.
const MEDIUM: usize = 250_000;
const LARGE: usize = 600_000;
const SMALL: usize = 100_000;
const CAP: &str = "500KB/s";

/// Deterministic bytes for a file (different per seed, so a mix-up shows).
fn content(len: usize, seed: u64) -> Vec<u8> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ seed;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Reads one response with a Content-Length and returns its body.
fn read_body(s: &mut TcpStream) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 64 * 1024];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut chunk).expect("read head");
        assert!(n > 0, "closed before the head");
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .expect("content-length")
        .trim()
        .parse()
        .expect("length");
    while buf.len() < head_end + len {
        let n = s.read(&mut chunk).expect("read body");
        assert!(n > 0, "closed in the body");
        buf.extend_from_slice(&chunk[..n]);
    }
    buf[head_end..head_end + len].to_vec()
}

/// Serves medium, large, small (queued in that order) under `order`; returns the names in
/// the order their responses completed.
fn completion_order(order: &str, disk_threads: u32) -> Vec<&'static str> {
    completion_order_after(order, disk_threads, |_| {})
}

/// As [`completion_order`], with `change` applied to the running server before the requests.
fn completion_order_after(
    order: &str,
    disk_threads: u32,
    change: impl FnOnce(&Server),
) -> Vec<&'static str> {
    let dir = tempfile::tempdir().expect("tempdir");
    let files = [
        ("medium", MEDIUM, 1),
        ("large", LARGE, 2),
        ("small", SMALL, 3),
    ];
    for (name, len, seed) in files {
        std::fs::write(dir.path().join(name), content(len, seed)).unwrap();
    }
    let toml = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\ndisk_threads = {disk_threads}\n\n\
         [[tenant]]\nname = \"t\"\ndocroot = '{}'\nnet_cap = \"{CAP}\"\nsend_order = \"{order}\"\n",
        dir.path().display()
    );
    let config = parse_config(&toml).expect("config");
    let opts = ServerOptions {
        workers: Some(1),
        ..Default::default()
    };
    let server = Server::start(config, opts).expect("server");
    let addr: SocketAddr = server.local_addrs()[0];
    change(&server);
    let answered = server.stats().requests.load(Ordering::Relaxed);
    let done = Arc::new(Mutex::new(Vec::new()));
    let mut threads = Vec::new();
    for (i, (name, len, seed)) in files.into_iter().enumerate() {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        s.set_nodelay(true).unwrap();
        s.write_all(format!("GET /{name} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .unwrap();
        // The next request goes out once this one's response is queued.
        let deadline = Instant::now() + IO_TIMEOUT;
        while server.stats().requests.load(Ordering::Relaxed) < answered + i as u64 + 1 {
            assert!(Instant::now() < deadline, "request {name} not answered");
            std::thread::sleep(Duration::from_millis(1));
        }
        let done = done.clone();
        threads.push(std::thread::spawn(move || {
            let body = read_body(&mut s);
            done.lock().unwrap().push(name);
            assert!(body == content(len, seed), "{name}: body differs");
        }));
    }
    for t in threads {
        t.join().expect("client");
    }
    server.drain(Duration::from_millis(100));
    let order = done.lock().unwrap().clone();
    order
}

#[test]
fn fifo_finishes_in_arrival_order() {
    assert_eq!(completion_order("fifo", 0), ["medium", "large", "small"]);
}

#[test]
fn shortest_first_finishes_the_small_response_first() {
    assert_eq!(
        completion_order("shortest_first", 0),
        ["small", "medium", "large"]
    );
}

#[test]
fn longest_first_finishes_the_small_response_last() {
    assert_eq!(
        completion_order("longest_first", 0),
        ["large", "medium", "small"]
    );
}

#[test]
fn orders_hold_with_the_disk_stage() {
    // Bodies over 256 KiB are streamed through the disk stage: waiting for a read must not
    // lose a response its place.
    assert_eq!(completion_order("fifo", 2), ["medium", "large", "small"]);
    assert_eq!(
        completion_order("longest_first", 2),
        ["large", "medium", "small"]
    );
}

#[test]
fn a_changed_order_takes_effect_at_run_time() {
    let order = completion_order_after("fifo", 0, |s| {
        // One response under FIFO first, so the tenant's queue exists when its order changes.
        let mut c = TcpStream::connect(s.local_addrs()[0]).expect("connect");
        c.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        c.write_all(b"GET /small HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        assert!(read_body(&mut c) == content(SMALL, 3));
        s.update_tenant("t", |t| t.send_order = SendOrder::ShortestFirst)
            .expect("update");
    });
    assert_eq!(order, ["small", "medium", "large"]);
}

#[test]
fn fair_shares_between_responses() {
    // Byte round robin: the small response finishes first, the large one last.
    assert_eq!(completion_order("fair", 0), ["small", "medium", "large"]);
}
