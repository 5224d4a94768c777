//! Counts heap allocations (a counting global allocator, for this test binary only) while one
//! keep-alive connection GETs a cached file again and again: after warm-up, parsing a request,
//! its trip through the server's stages and its answer must not allocate per request.
//!
//! The count covers every thread of the process (the server's workers and timers, and this
//! test's client, which reuses one buffer and so allocates nothing itself), so the bound is an
//! average well below one allocation per request rather than exactly zero: a background tick
//! may allocate now and then, but an allocation on the per-request path would show once per
//! request (before this work a request cost about twenty).
use omnistage_http::config::parse_config;
use omnistage_http::server::{Server, ServerOptions};
use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged; it only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Requests measured after warm-up.
const REQUESTS_MEASURED: u64 = 2000;
/// Requests sent before counting (fills the file cache and the buffer pools).
const REQUESTS_WARMUP: u64 = 200;

fn start(docroot: &std::path::Path, extra_server: &str, extra_tenant: &str) -> Server {
    let toml = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\nworkers = 1\n{extra_server}\n[[tenant]]\nname = \"t\"\nhosts = [\"t.test\"]\ndocroot = '{}'\n{extra_tenant}\n",
        docroot.display()
    );
    let config = parse_config(&toml).unwrap();
    Server::start(
        config,
        ServerOptions {
            workers: Some(1),
            ..Default::default()
        },
    )
    .unwrap()
}

/// Sends `req` and reads exactly `len` response bytes into `buf` (no allocation).
fn round_trip(s: &mut TcpStream, req: &[u8], buf: &mut [u8], len: usize) {
    s.write_all(req).unwrap();
    let mut got = 0;
    while got < len {
        let n = s.read(&mut buf[got..len]).unwrap();
        assert!(n > 0, "closed early");
        got += n;
    }
}

/// Allocations per request over `REQUESTS_MEASURED` keep-alive GETs of `req` (a cached file).
fn allocs_per_request(req: &[u8], extra_server: &str) -> f64 {
    allocs_per_request_with(req, extra_server, "")
}

/// [`allocs_per_request`] with keys added to the tenant's table.
fn allocs_per_request_with(req: &[u8], extra_server: &str, extra_tenant: &str) -> f64 {
    // The count is process-wide: one measurement at a time.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.html"), vec![b'x'; 600]).unwrap();
    let extra_server = extra_server.replace("{dir}", &dir.path().display().to_string());
    let server = start(dir.path(), &extra_server, extra_tenant);
    let mut s = TcpStream::connect(server.local_addrs()[0]).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // The first response tells the length of every later one (same headers, same sizes).
    s.write_all(req).unwrap();
    let mut first = Vec::new();
    let mut buf = [0u8; 8192];
    let len = loop {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0);
        first.extend_from_slice(&buf[..n]);
        if let Some(end) = first.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&first[..end]).to_string();
            assert!(head.starts_with("HTTP/1.1 200"), "{head}");
            let body: usize = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().unwrap())
                })
                .unwrap();
            let total = end + 4 + body;
            if first.len() >= total {
                break total;
            }
        }
    };
    for _ in 0..REQUESTS_WARMUP {
        round_trip(&mut s, req, &mut buf, len);
    }
    let before = ALLOCS.load(Ordering::Relaxed);
    for _ in 0..REQUESTS_MEASURED {
        round_trip(&mut s, req, &mut buf, len);
    }
    let after = ALLOCS.load(Ordering::Relaxed);
    drop(s);
    drop(server);
    let per = (after - before) as f64 / REQUESTS_MEASURED as f64;
    eprintln!(
        "allocations per request: {per:.3} ({} over {REQUESTS_MEASURED})",
        after - before
    );
    per
}

#[test]
fn keep_alive_get_of_a_cached_file_does_not_allocate() {
    let req =
        b"GET /a.html HTTP/1.1\r\nHost: t.test\r\nUser-Agent: alloc-test\r\nAccept: */*\r\n\r\n";
    let per = allocs_per_request(req, "");
    assert!(per < 0.1, "{per} allocations per request");
}

#[test]
fn derived_header_values_do_not_allocate_either() {
    // An uppercase host (lowercased into the request's buffer) and a list joined from two
    // fields (also written there): still no allocation per request.
    let req = b"GET /a.html HTTP/1.1\r\nHost: T.Test\r\nIf-None-Match: \"x\"\r\nIf-None-Match: \"y\"\r\n\r\n";
    let per = allocs_per_request(req, "");
    assert!(per < 0.1, "{per} allocations per request");
}

#[test]
fn the_access_log_does_not_allocate_per_request() {
    let req = b"GET /a.html HTTP/1.1\r\nHost: t.test\r\n\r\n";
    let per = allocs_per_request(req, "access_log = '{dir}/access.log'\n");
    assert!(per < 0.1, "{per} allocations per request");
}

#[test]
fn a_head_too_large_to_keep_inline_uses_a_pooled_buffer() {
    // Over `HEAD_INLINE_BYTES`: the head goes into a buffer from the worker's pool, which
    // comes back after the answer, so this is allocation-free too.
    let cookie = "c".repeat(omnistage_http::request::HEAD_INLINE_BYTES);
    let req = format!("GET /a.html HTTP/1.1\r\nHost: t.test\r\nCookie: {cookie}\r\n\r\n");
    let per = allocs_per_request(req.as_bytes(), "");
    assert!(per < 0.1, "{per} allocations per request");
}

/// A backend that answers every request on each connection with the same 600-byte response,
/// reading into a fixed buffer (so it allocates nothing per request itself).
fn fixed_backend() -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            std::thread::spawn(move || {
                let mut buf = [0u8; 8192];
                let mut have = 0;
                const HEAD: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 600\r\n\r\n";
                let mut resp = [b'x'; HEAD.len() + 600];
                resp[..HEAD.len()].copy_from_slice(HEAD);
                loop {
                    while let Some(end) = buf[..have].windows(4).position(|w| w == b"\r\n\r\n") {
                        if s.write_all(&resp).is_err() {
                            return;
                        }
                        buf.copy_within(end + 4..have, 0);
                        have -= end + 4;
                    }
                    match s.read(&mut buf[have..]) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => have += n,
                    }
                }
            });
        }
    });
    addr
}

#[test]
fn a_proxied_keep_alive_request_allocates_little() {
    let backend = fixed_backend();
    let per = allocs_per_request_with(
        b"GET /app HTTP/1.1\r\nHost: t.test\r\n\r\n",
        &format!("\n[[upstream]]\nname = \"app\"\nservers = [\"{backend}\"]\n"),
        "upstream = \"app\"\n",
    );
    assert!(per < 0.1, "{per} allocations per proxied request");
}
