//! A connection gives its read buffer, response-head buffers and output queue back to its
//! worker's pool whenever they empty (an idle keep-alive connection holds none) and takes them
//! again for the next request. These tests walk one keep-alive connection (one worker, so every
//! buffer comes back from the same pool) through the cases that change a buffer's life: small
//! and large heads (a large buffer is freed, not pooled), pipelined requests split mid-head, and
//! the header limit crossed after buffers were reused.
use omnistage_http::config::parse_config;
use omnistage_http::server::{Server, ServerOptions};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

fn start(docroot: &std::path::Path) -> Server {
    let toml = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\nworkers = 1\n\n[[tenant]]\nname = \"t\"\nhosts = [\"t.test\"]\ndocroot = '{}'\n",
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

/// Reads one response (head and `Content-Length` body): (status, body).
fn read_response(s: &mut TcpStream, pending: &mut Vec<u8>) -> (u16, Vec<u8>) {
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&pending[..end]).to_string();
            let status: u16 = head[9..12].parse().unwrap();
            let len: usize = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().unwrap())
                })
                .unwrap_or(0);
            let total = end + 4 + len;
            if pending.len() >= total {
                let body = pending[end + 4..total].to_vec();
                pending.drain(..total);
                return (status, body);
            }
        }
        let n = s.read(&mut buf).expect("a response");
        assert!(n > 0, "closed before a whole response");
        pending.extend_from_slice(&buf[..n]);
    }
}

fn get(path: &str, extra_headers: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: t.test\r\n{extra_headers}\r\n")
}

#[test]
fn buffers_released_when_idle_are_reused_for_large_and_pipelined_requests() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.txt"), b"alpha").unwrap();
    std::fs::write(dir.path().join("b.txt"), b"bravo!").unwrap();
    let server = start(dir.path());
    let addr = server.local_addrs()[0];
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut pending = Vec::new();

    // A small request: its buffers go back to the pool once it is answered.
    s.write_all(get("/a.txt", "").as_bytes()).unwrap();
    assert_eq!(
        read_response(&mut s, &mut pending),
        (200, b"alpha".to_vec())
    );

    // A head of ~12 KiB (over the pooled buffer size, under the 16 KiB limit): the read buffer
    // grows past what the pool keeps; it is freed afterwards, and the next request still works.
    let big = format!("X-Filler: {}\r\n", "f".repeat(12 * 1024));
    s.write_all(get("/b.txt", &big).as_bytes()).unwrap();
    assert_eq!(
        read_response(&mut s, &mut pending),
        (200, b"bravo!".to_vec())
    );

    // Three pipelined requests, the second split in the middle of its head: the partial head
    // stays in the read buffer (not given back while it holds bytes).
    let three = format!(
        "{}{}{}",
        get("/a.txt", ""),
        get("/b.txt", ""),
        get("/missing", "")
    );
    let cut = get("/a.txt", "").len() + 10;
    s.write_all(&three.as_bytes()[..cut]).unwrap();
    assert_eq!(
        read_response(&mut s, &mut pending),
        (200, b"alpha".to_vec())
    );
    std::thread::sleep(Duration::from_millis(50));
    s.write_all(&three.as_bytes()[cut..]).unwrap();
    assert_eq!(
        read_response(&mut s, &mut pending),
        (200, b"bravo!".to_vec())
    );
    assert_eq!(read_response(&mut s, &mut pending).0, 404);

    // Many requests on the same connection: each takes and gives back pooled buffers.
    for i in 0..200 {
        let path = if i % 2 == 0 { "/a.txt" } else { "/b.txt" };
        s.write_all(get(path, "").as_bytes()).unwrap();
        let (status, body) = read_response(&mut s, &mut pending);
        assert_eq!(status, 200);
        assert_eq!(body.len(), if i % 2 == 0 { 5 } else { 6 });
    }
    assert!(pending.is_empty());

    // The header limit is still enforced on a reused buffer: over 16 KiB → 431 and close.
    let huge = format!("X-Filler: {}\r\n", "h".repeat(20 * 1024));
    s.write_all(get("/a.txt", &huge).as_bytes()).unwrap();
    assert_eq!(read_response(&mut s, &mut pending).0, 431);
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(rest.is_empty(), "the connection closes after the 431");

    // And a fresh connection on the same worker is served from the pool.
    let mut s2 = TcpStream::connect(addr).unwrap();
    s2.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut pending2 = Vec::new();
    s2.write_all(get("/b.txt", "").as_bytes()).unwrap();
    assert_eq!(
        read_response(&mut s2, &mut pending2),
        (200, b"bravo!".to_vec())
    );
    server.drain(Duration::from_millis(200));
}

#[test]
fn many_idle_keepalive_connections_are_each_served_again() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.txt"), b"alpha").unwrap();
    let server = start(dir.path());
    let addr = server.local_addrs()[0];
    // More connections than the pool keeps buffers (256): every one goes idle after its first
    // response and takes buffers again for its second.
    let n = 300;
    let mut conns: Vec<(TcpStream, Vec<u8>)> = (0..n)
        .map(|_| {
            let s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            (s, Vec::new())
        })
        .collect();
    for round in 0..2 {
        for (s, _) in conns.iter_mut() {
            s.write_all(get("/a.txt", "").as_bytes()).unwrap();
        }
        for (s, pending) in conns.iter_mut() {
            assert_eq!(
                read_response(s, pending),
                (200, b"alpha".to_vec()),
                "round {round}"
            );
        }
    }
    server.drain(Duration::from_millis(200));
}
