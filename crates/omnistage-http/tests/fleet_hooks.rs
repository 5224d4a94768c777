//! The server's hooks for the fleet layer, end to end over loopback: a tenant whose fleet lease
//! pool is limited is refused with 503 + Retry-After when the pool is empty and served while it
//! holds tokens (one per request); a byte pool admits while positive; the send scheduler's
//! weights follow `set_send_weights`; the fleet status is kept for the admin API.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use omnistage_http::config::parse_config;
use omnistage_http::server::{FleetStatus, Server, ServerOptions};

const IO_TIMEOUT: Duration = Duration::from_secs(20);

fn start() -> Server {
    let text = r#"
[server]
listen = ["127.0.0.1:0"]
workers = 1
net_link_cap = "100MB/s"

[cluster]
redis = "redis://127.0.0.1:1"
node = "t1"

[[tenant]]
name = "a"
hosts = ["a.test"]
docroot = "."
synthetic = true
fleet_rate_per_s = 100

[[tenant]]
name = "b"
hosts = ["b.test"]
docroot = "."
synthetic = true
weight = 30
"#;
    Server::start(
        parse_config(text).expect("config"),
        ServerOptions::default(),
    )
    .expect("start")
}

/// Sends one keep-alive request and returns the status line and the head.
fn get(s: &mut TcpStream, host: &str, path: &str) -> String {
    write!(s, "GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n").expect("write");
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        let n = s.read(&mut byte).expect("read");
        assert!(n > 0, "closed");
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).to_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse().expect("length"));
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).expect("body");
    head
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
    s
}

#[test]
fn a_limited_pool_refuses_with_503_when_empty_and_spends_one_token_per_request() {
    let server = start();
    let addr = server.local_addrs()[0];
    let tenants = server.fleet_tenants();
    assert_eq!(tenants.len(), 2);
    assert_eq!(tenants[0].caps.rate_per_s, Some(100));
    let a = tenants[0].hooks.clone();
    let mut s = connect(addr);
    // Off: served (the fleet layer has not limited it).
    assert!(get(&mut s, "a.test", "/_bytes?n=10").starts_with("http/1.1 200"));
    a.requests.set_limited(true);
    let head = get(&mut s, "a.test", "/_bytes?n=10");
    assert!(head.starts_with("http/1.1 503"), "{head}");
    assert!(head.contains("retry-after: 1"), "{head}");
    a.requests.add(2);
    for _ in 0..2 {
        assert!(get(&mut s, "a.test", "/_bytes?n=10").starts_with("http/1.1 200"));
    }
    assert!(get(&mut s, "a.test", "/_bytes?n=10").starts_with("http/1.1 503"));
    assert_eq!((a.requests.attempts(), a.requests.refused()), (4, 2));
    // The other tenant is not touched.
    assert!(get(&mut s, "b.test", "/_bytes?n=10").starts_with("http/1.1 200"));
    // Bytes: admitted while the pool is positive.
    a.requests.set_limited(false);
    a.bytes.set_limited(true);
    assert!(get(&mut s, "a.test", "/_bytes?n=10").starts_with("http/1.1 503"));
    a.bytes.add(1);
    assert!(get(&mut s, "a.test", "/_bytes?n=10").starts_with("http/1.1 200"));
    assert!(
        server
            .stats()
            .rejected_503
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 3
    );
    drop(s);
    server.drain(Duration::from_secs(1));
}

#[test]
fn send_weights_and_picks_and_status() {
    let server = start();
    let addr = server.local_addrs()[0];
    let b = server.fleet_tenants()[1].hooks.clone();
    assert_eq!(b.send_weight(), None);
    server.set_send_weights(&[("b", Some(9000)), ("nobody", Some(5))]);
    assert_eq!(b.send_weight(), Some(9000));
    server.set_send_weights(&[("b", Some(0))]);
    assert_eq!(b.send_weight(), Some(1), "clamped into 1..=10000");
    server.set_send_weights(&[("b", None)]);
    assert_eq!(b.send_weight(), None);
    // Through the send scheduler (the link cap puts every response there): each response is
    // at least one pick; a 200 KB one is several, most of them leaving output waiting.
    let mut s = connect(addr);
    assert!(get(&mut s, "b.test", "/_bytes?n=200000").starts_with("http/1.1 200"));
    // The weight override reaches a running send scheduler without a reload. (This second
    // response also orders the counts: the first one's last pick is counted after its last
    // write, on the same core, before this one's.)
    server.set_send_weights(&[("b", Some(50))]);
    assert!(get(&mut s, "b.test", "/_bytes?n=1000").starts_with("http/1.1 200"));
    let (picks, backlogged) = b.send_picks();
    assert!(picks >= 2, "{picks}");
    assert!(
        backlogged >= 1 && backlogged < picks,
        "{backlogged} of {picks}"
    );
    assert_eq!(server.fleet_status(), None);
    let st = Arc::new(FleetStatus {
        node: "t1".into(),
        connected: true,
        ..Default::default()
    });
    server.set_fleet_status(Some(st.clone()));
    assert_eq!(server.fleet_status(), Some(st));
    drop(s);
    server.drain(Duration::from_secs(1));
}
