//! Clients that hold the admin server's handler threads: connections that send nothing hold one
//! only until the request head's deadline, so a request behind them (a dashboard, a shaped
//! launcher's report) is still answered, within about that deadline.

mod common;

use common::{admin, rig};
use std::net::TcpStream;
use std::time::{Duration, Instant};

#[test]
fn idle_connections_past_the_handler_count_do_not_lock_out_a_request() {
    let r = rig(1);
    // Two handler threads, a token (as off a loopback address).
    let (h, c) = admin(&r.rt, Some("secret"));
    // Three times as many connections as handlers, all idle: each takes a handler in turn.
    let idle: Vec<TcpStream> = (0..6)
        .map(|_| TcpStream::connect(h.local_addr()).unwrap())
        .collect();
    let t = Instant::now();
    let reply = c
        .request("GET", "/api/v1/tree", None)
        .expect("answered behind the idle connections");
    let took = t.elapsed();
    assert_eq!(reply.status, 200, "{}", reply.text());
    // The head's deadline (1 s, counted from the accept) and a margin for a slow machine; the
    // idle connections once held a handler 5 s each, 15 s in all here.
    assert!(took < Duration::from_secs(10), "answered after {took:?}");
    drop(idle);
}
