//! File bodies sent with `sendfile` (the `sendfile` and `sendfile_min_bytes` server keys) end
//! to end: bodies intact around the threshold, ranges, HEAD, pipelined mixes of cached small
//! files and sendfile'd large ones, bytes charged to the tenant under a net cap, the cache
//! holding only the small files, a client that stops reading, and a file that shrinks while
//! its response is being sent.
//!
//! Every assertion is on bytes, statuses and counters; waits are for conditions (with a
//! deadline that fails the test), never measurements of time.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use omnistage_http::config::parse_config;
use omnistage_http::server::{Server, ServerOptions};

/// Read timeout on the client sockets (a stuck server fails the test).
const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// The threshold the tests configure.
const MIN: usize = 16 * 1024;
/// A file larger than the cache takes (1 MiB) and than one dispatch's sendfile budget.
const HUGE: usize = 3 << 20;

/// Deterministic, non-repeating bytes, different per seed.
fn content(len: usize, seed: u64) -> Vec<u8> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ seed.wrapping_mul(0x2545_F491_4F6C_DD1D);
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

/// The files: name, length, seed.
fn files() -> Vec<(String, usize, u64)> {
    let mut v = Vec::new();
    for (i, len) in [1, 100, MIN - 1, MIN, MIN + 1, 100_000, 1 << 20, HUGE]
        .into_iter()
        .enumerate()
    {
        v.push((format!("f{len}.bin"), len, i as u64 + 1));
    }
    v
}

fn write_files(dir: &Path) {
    for (name, len, seed) in files() {
        std::fs::write(dir.join(name), content(len, seed)).unwrap();
    }
}

fn start(dir: &Path, server_extra: &str, tenant_extra: &str) -> Server {
    // On unless the test turns it off.
    let on = if server_extra.contains("sendfile =") {
        ""
    } else {
        "sendfile = true"
    };
    let toml = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\nsendfile_min_bytes = {MIN}\n{on}\n{server_extra}\n\n\
         [[tenant]]\nname = \"t\"\ndocroot = '{}'\n{tenant_extra}\n",
        dir.display()
    );
    let config = parse_config(&toml).unwrap_or_else(|e| panic!("bad config: {e}\n{toml}"));
    let opts = ServerOptions {
        workers: Some(1),
        ..Default::default()
    };
    Server::start(config, opts).expect("server")
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    s
}

/// One response: status, Content-Length, body, and how many bytes it took on the wire.
struct Resp {
    status: u16,
    content_length: usize,
    content_range: Option<String>,
    body: Vec<u8>,
    wire_bytes: usize,
}

/// A client's receive buffer (responses may arrive coalesced).
struct Reader {
    buf: Vec<u8>,
}

impl Reader {
    fn new() -> Reader {
        Reader { buf: Vec::new() }
    }

    fn fill(&mut self, s: &mut TcpStream) -> usize {
        let mut chunk = [0u8; 64 * 1024];
        let n = s.read(&mut chunk).expect("read");
        self.buf.extend_from_slice(&chunk[..n]);
        n
    }

    /// Reads one response; `head_only` for a HEAD (no body follows its Content-Length).
    fn response(&mut self, s: &mut TcpStream, head_only: bool) -> Resp {
        let head_end = loop {
            if let Some(i) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            assert!(self.fill(s) > 0, "closed before the head");
        };
        let head = String::from_utf8_lossy(&self.buf[..head_end]).to_lowercase();
        let status: u16 = head[9..12].parse().expect("status");
        let field = |name: &str| {
            head.lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.trim().to_string())
        };
        let content_length: usize = field("content-length:")
            .expect("content-length")
            .parse()
            .expect("length");
        let content_range = field("content-range:");
        let body_len = if head_only { 0 } else { content_length };
        while self.buf.len() < head_end + body_len {
            assert!(self.fill(s) > 0, "closed in the body");
        }
        let body = self.buf[head_end..head_end + body_len].to_vec();
        self.buf.drain(..head_end + body_len);
        Resp {
            status,
            content_length,
            content_range,
            body,
            wire_bytes: head_end + body_len,
        }
    }
}

fn get(path: &str) -> String {
    format!("GET /{path} HTTP/1.1\r\nHost: x\r\n\r\n")
}

/// Every file, one request at a time on one connection, with `server_extra`.
fn every_file_intact(server_extra: &str) {
    let dir = tempfile::tempdir().unwrap();
    write_files(dir.path());
    let server = start(dir.path(), server_extra, "");
    let mut s = connect(server.local_addrs()[0]);
    let mut r = Reader::new();
    // Twice: the second round is served from the cache (small files) or sendfile again.
    for _ in 0..2 {
        for (name, len, seed) in files() {
            s.write_all(get(&name).as_bytes()).unwrap();
            let resp = r.response(&mut s, false);
            assert_eq!(resp.status, 200, "{name}");
            assert_eq!(resp.content_length, len, "{name}");
            assert!(resp.body == content(len, seed), "{name}: body differs");
        }
    }
    server.drain(Duration::from_millis(100));
}

#[test]
fn bodies_around_the_threshold_are_intact() {
    every_file_intact("");
    every_file_intact("disk_threads = 0");
    every_file_intact("sendfile = false");
    every_file_intact("sendfile = false\ndisk_threads = 0");
}

#[test]
fn only_files_below_the_threshold_are_cached() {
    let dir = tempfile::tempdir().unwrap();
    write_files(dir.path());
    let server = start(dir.path(), "", "");
    let mut s = connect(server.local_addrs()[0]);
    let mut r = Reader::new();
    for (name, _, _) in files() {
        s.write_all(get(&name).as_bytes()).unwrap();
        assert_eq!(r.response(&mut s, false).status, 200);
    }
    let cached: u64 = server.cache_bytes().iter().map(|(_, b)| *b).sum();
    let small: u64 = files()
        .iter()
        .filter(|(_, len, _)| *len < MIN)
        .map(|(_, len, _)| *len as u64)
        .sum();
    assert_eq!(cached, small, "only the files below sendfile_min_bytes");
    server.drain(Duration::from_millis(100));

    // With sendfile off, the ones up to the cache's file limit are cached too.
    let server = start(dir.path(), "sendfile = false", "");
    let mut s = connect(server.local_addrs()[0]);
    for (name, _, _) in files() {
        s.write_all(get(&name).as_bytes()).unwrap();
        assert_eq!(r.response(&mut s, false).status, 200);
    }
    let cached: u64 = server.cache_bytes().iter().map(|(_, b)| *b).sum();
    let upto_1m: u64 = files()
        .iter()
        .filter(|(_, len, _)| *len <= 1 << 20)
        .map(|(_, len, _)| *len as u64)
        .sum();
    assert_eq!(cached, upto_1m);
    server.drain(Duration::from_millis(100));
}

#[test]
fn ranges_and_head_of_sendfiled_files() {
    let dir = tempfile::tempdir().unwrap();
    write_files(dir.path());
    let server = start(dir.path(), "disk_threads = 0", "");
    let mut s = connect(server.local_addrs()[0]);
    let mut r = Reader::new();
    for (name, len, seed) in files().into_iter().filter(|f| f.1 >= MIN) {
        let all = content(len, seed);
        let cases = [
            (format!("bytes=0-{}", len / 2), 0, len / 2 + 1),
            (format!("bytes={}-", len - 7), len - 7, 7),
            ("bytes=-1000".to_string(), len - 1000, 1000),
            (
                format!("bytes={}-{}", MIN - 3, MIN + 3),
                MIN - 3,
                7.min(len - (MIN - 3)),
            ),
        ];
        for (range, start, n) in cases {
            write!(
                s,
                "GET /{name} HTTP/1.1\r\nHost: x\r\nRange: {range}\r\n\r\n"
            )
            .unwrap();
            let resp = r.response(&mut s, false);
            assert_eq!(resp.status, 206, "{name} {range}");
            assert_eq!(resp.content_length, n, "{name} {range}");
            assert_eq!(
                resp.content_range.as_deref(),
                Some(format!("bytes {}-{}/{}", start, start + n - 1, len).as_str())
            );
            assert!(resp.body == all[start..start + n], "{name} {range}");
        }
        write!(s, "HEAD /{name} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let resp = r.response(&mut s, true);
        assert_eq!(resp.status, 200);
        assert_eq!(resp.content_length, len);
        // A GET right after: nothing of a body was sent for the HEAD.
        s.write_all(get(&name).as_bytes()).unwrap();
        let resp = r.response(&mut s, false);
        assert!(resp.body == all, "{name} after HEAD");
    }
    server.drain(Duration::from_millis(100));
}

/// All requests in one write: each response's head and body in order, small (cached) and
/// large (sendfile) bodies interleaved, HEAD and ranges among them.
fn pipelined_mix(server_extra: &str, tenant_extra: &str) -> (Server, usize) {
    let dir = tempfile::tempdir().unwrap();
    write_files(dir.path());
    let server = start(dir.path(), server_extra, tenant_extra);
    let mut s = connect(server.local_addrs()[0]);
    let mut r = Reader::new();
    let fs = files();
    let mut all = String::new();
    // Served twice: a miss, then a hit for the small ones.
    for round in 0..2 {
        for (name, _, _) in &fs {
            all.push_str(&get(name));
            if round == 1 {
                all.push_str(&format!("HEAD /{name} HTTP/1.1\r\nHost: x\r\n\r\n"));
                all.push_str(&format!(
                    "GET /{name} HTTP/1.1\r\nHost: x\r\nRange: bytes=-1\r\n\r\n"
                ));
            }
        }
    }
    s.write_all(all.as_bytes()).unwrap();
    let mut wire = 0;
    for round in 0..2 {
        for (name, len, seed) in &fs {
            let body = content(*len, *seed);
            let resp = r.response(&mut s, false);
            wire += resp.wire_bytes;
            assert_eq!(resp.status, 200, "{name}");
            assert!(resp.body == body, "{name}: body differs (round {round})");
            if round == 1 {
                let head = r.response(&mut s, true);
                wire += head.wire_bytes;
                assert_eq!(head.content_length, *len);
                let last = r.response(&mut s, false);
                wire += last.wire_bytes;
                assert_eq!(last.status, 206);
                assert_eq!(last.body, body[len - 1..], "{name}: last byte");
            }
        }
    }
    assert!(r.buf.is_empty(), "nothing follows the last response");
    (server, wire)
}

#[test]
fn pipelined_small_and_large_bodies_stay_in_order() {
    let (server, _) = pipelined_mix("", "");
    server.drain(Duration::from_millis(100));
    let (server, _) = pipelined_mix("disk_threads = 0", "");
    server.drain(Duration::from_millis(100));
}

#[test]
fn under_a_net_cap_the_tenant_is_charged_what_was_sent() {
    for order in ["fair", "fifo", "shortest_first"] {
        let (server, wire) = pipelined_mix(
            "disk_threads = 0\nnet_link_cap = \"500MB/s\"",
            &format!("net_cap = \"200MB/s\"\nsend_order = \"{order}\""),
        );
        let rt = server.runtime();
        let id = rt.activity_id("/tenants/t").expect("tenant");
        let charged = || -> u64 {
            rt.snapshot()
                .rows
                .iter()
                .filter(|r| r.activity == id)
                .map(|r| r.bytes_out)
                .sum()
        };
        let deadline = Instant::now() + IO_TIMEOUT;
        while charged() != wire as u64 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            charged(),
            wire as u64,
            "{order}: bytes charged = bytes sent"
        );
        server.drain(Duration::from_millis(100));
    }
}

#[test]
fn a_client_that_stops_reading_a_sendfiled_body_is_timed_out() {
    let dir = tempfile::tempdir().unwrap();
    let len = 64 << 20;
    std::fs::write(dir.path().join("big.bin"), vec![7u8; len]).unwrap();
    // The no-progress timeout under test is short; the header timeout is not (a test thread
    // stalled 200 ms between its connect and its request was closed as a slow client and the
    // request never answered). It is not long either: a connection's deadline is first checked
    // a header timeout after its accept, so this is also when the close can come at the
    // earliest, well inside IO_TIMEOUT.
    let server = start(
        dir.path(),
        "disk_threads = 0\nheader_timeout_ms = 1000\nkeepalive_timeout_ms = 200",
        "",
    );
    let mut s = connect(server.local_addrs()[0]);
    s.write_all(get("big.bin").as_bytes()).unwrap();
    let deadline = Instant::now() + IO_TIMEOUT;
    // Answered (its head and the start of its body are queued) ...
    while server.stats().requests.load(Ordering::Relaxed) == 0 {
        assert!(Instant::now() < deadline, "the request is not answered");
        std::thread::sleep(Duration::from_millis(5));
    }
    // ... then closed for making no progress.
    while server.stats().open_connections.load(Ordering::Relaxed) > 0 {
        assert!(
            Instant::now() < deadline,
            "a connection that stopped reading is still open"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(server.stats().timeouts.load(Ordering::Relaxed) >= 1);
    // It got part of the body at most, then the close.
    let mut got = 0;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    assert!(got < len, "{got} bytes of {len}");
    server.drain(Duration::from_millis(100));
}

#[test]
fn a_file_that_shrinks_mid_response_closes_the_connection() {
    let dir = tempfile::tempdir().unwrap();
    let len = 64 << 20;
    let path = dir.path().join("big.bin");
    std::fs::write(&path, vec![7u8; len]).unwrap();
    let server = start(dir.path(), "disk_threads = 0", "");
    let mut s = connect(server.local_addrs()[0]);
    s.write_all(get("big.bin").as_bytes()).unwrap();
    let mut r = Reader::new();
    // The head, then shrink the file while the body is far from sent (the socket buffers
    // hold a few MB at most).
    while !r.buf.windows(4).any(|w| w == b"\r\n\r\n") {
        assert!(r.fill(&mut s) > 0);
    }
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let mut got = r.buf.len();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) => panic!("expected a close, got {e} after {got} bytes"),
        }
    }
    assert!(
        got < len,
        "the connection closed short of the promised length"
    );
    // The server goes on serving.
    std::fs::write(dir.path().join("small"), b"small").unwrap();
    let mut s = connect(server.local_addrs()[0]);
    s.write_all(get("small").as_bytes()).unwrap();
    assert_eq!(Reader::new().response(&mut s, false).body, b"small");
    server.drain(Duration::from_millis(100));
}
