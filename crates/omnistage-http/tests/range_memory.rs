//! Memory a client costs by asking for small ranges of a file.
//!
//! A response body that is a slice of a file's bytes (`Bytes`) keeps the whole buffer alive,
//! while the connection's output bound (`OUT_PENDING_BYTES_MAX`) counts only the slice. Before
//! the fix a miss the cache refused read the whole file into a fresh buffer and queued a
//! one-byte slice of it: every `Range: bytes=0-0` cost a whole file's read and allocation,
//! and a client that pipelines them without reading (once the kernel's buffers are full)
//! pinned a whole file per ~300 counted bytes, which a few connections could use to run the
//! server out of memory (with 1 MiB files, gigabytes). Now a miss the cache refuses reads only
//! the range, and a small range of cached bytes is copied out instead of shared.
//!
//! What is asserted is the bytes allocated (a counting global allocator, this test binary
//! only, every thread of the process) while the server answers the ranges: ~200 MB before the
//! fix for 3,000 ranges of a 64 KiB file, a few MB after. (Whether the kernel's buffers fill
//! first depends on its send-buffer autotuning, so the live peak is not what is asserted.)
use omnistage_http::config::parse_config;
use omnistage_http::server::{Server, ServerOptions};
use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

struct Counting;

static ALLOCATED_BYTES: AtomicI64 = AtomicI64::new(0);

// SAFETY: forwards every call to the system allocator unchanged; it only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED_BYTES.fetch_add(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATED_BYTES.fetch_add(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATED_BYTES.fetch_add(
            new_size.saturating_sub(layout.size()) as i64,
            Ordering::Relaxed,
        );
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

/// Size of the file asked for: more than the cache's whole limit, so every request misses.
const FILE_BYTES: usize = 64 * 1024;
/// Pipelined one-byte range requests (their answers, ~300 bytes each, stay under the
/// connection's 1 MiB output bound, so the server parses and answers every one).
const REQUESTS: usize = 3_000;
/// Most the process may allocate while the server answers them: their heads and bytes
/// (~1 MB) and the server's buffers, far below one file per response (~200 MB).
const ALLOCATED_BYTES_MAX: i64 = 32 << 20;

fn start(docroot: &std::path::Path, extra_server: &str) -> Server {
    let toml = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\nworkers = 1\n{extra_server}\n[[tenant]]\nname = \"t\"\nhosts = [\"t.test\"]\ndocroot = '{}'\n",
        docroot.display()
    );
    Server::start(
        parse_config(&toml).unwrap(),
        ServerOptions {
            workers: Some(1),
            ..Default::default()
        },
    )
    .unwrap()
}

/// Sends the pipelined ranges on a connection with a small receive buffer that it never reads,
/// and returns the bytes the process allocated until the server had answered them all
/// (waiting for that at most 20 s).
fn allocated_for_unread_ranges(extra_server: &str) -> i64 {
    // The count is the whole process's: one test at a time.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("f.bin"), vec![b'f'; FILE_BYTES]).unwrap();
    let server = start(dir.path(), extra_server);
    let addr = server.local_addrs()[0];
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    sock.connect(&addr.into()).unwrap();
    let mut stream: std::net::TcpStream = sock.into();
    let mut requests = Vec::new();
    for _ in 0..REQUESTS {
        requests
            .extend_from_slice(b"GET /f.bin HTTP/1.1\r\nHost: t.test\r\nRange: bytes=0-0\r\n\r\n");
    }
    let rt = server.runtime();
    let work = server.work_stage();
    let tenant = rt.activity_id("/tenants/t").expect("the tenant's activity");
    // Requests the work stage has answered for the tenant (a message each).
    let answered = || -> u64 {
        rt.snapshot()
            .rows
            .iter()
            .filter(|r| r.activity == tenant && r.stage == work)
            .map(|r| r.messages)
            .sum()
    };
    let answered_before = answered();
    let before = ALLOCATED_BYTES.load(Ordering::Relaxed);
    // The server may stop reading once its output bound is reached; the writer then blocks,
    // so it runs on its own thread (it ends when the connection closes at the end).
    let writer = std::thread::spawn(move || {
        let _ = stream.write_all(&requests);
        stream
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline && answered() - answered_before < REQUESTS as u64 {
        std::thread::sleep(Duration::from_millis(5));
    }
    let allocated = ALLOCATED_BYTES.load(Ordering::Relaxed) - before;
    assert_eq!(
        answered() - answered_before,
        REQUESTS as u64,
        "the server answers every range (its output bound is not reached)"
    );
    server.drain(Duration::from_millis(100));
    drop(writer);
    allocated
}

#[test]
fn one_byte_ranges_of_a_file_the_cache_refuses_read_only_the_range() {
    // The cache's limit is below the file's size: every request is a miss it refuses.
    let allocated = allocated_for_unread_ranges("cache_bytes_max = 16384\ndisk_threads = 0\n");
    assert!(
        allocated < ALLOCATED_BYTES_MAX,
        "{allocated} bytes allocated for {REQUESTS} one-byte ranges"
    );
}

#[test]
fn one_byte_ranges_of_a_cached_file_allocate_no_file() {
    // The file is cached (one read, one copy; its slices shared that copy before the fix as
    // well): this guards the copying path (the ranges now go after their heads), not the bug.
    let allocated = allocated_for_unread_ranges("cache_bytes_max = 1048576\n");
    assert!(
        allocated < ALLOCATED_BYTES_MAX,
        "{allocated} bytes allocated for {REQUESTS} one-byte ranges"
    );
}
