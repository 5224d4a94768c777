//! The kernel's cost of one response-sized send on each of N connected loopback TCP sockets,
//! taken in turn (as a server with N keep-alive connections sends), by the thread's CPU clock,
//! two ways alternating round by round: std's `write_vectored` (`writev` through the C
//! library: what the server used) and rustix's `sendmsg` with `MSG_NOSIGNAL` (a direct system
//! call: what it uses). Over loopback the receiving socket's processing runs inside the
//! sender's call (the softirq of the send), so the figure includes the peer's receive;
//! steering loopback's receive to another CPU (`echo 1 > /sys/class/net/lo/queues/rx-0/rps_cpus`
//! with this pinned to CPU 1, `echo 0` after) leaves the sender's own part.
//!
//! What it showed (docs/design.md, "Where the CPU per request goes at 10,000 connections"):
//! the rise of a send's cost from 100 to 9,000 connections is mostly the peer's receive, and
//! `sendmsg` ran at 0.71-0.90x `writev`'s cost here, a gap that is the C library's call path
//! rather than the system call (rustix's own `writev` shows it too), that vanished under `perf
//! record` and that a C program calling both through glibc does not show: read it as this
//! harness's, not as a property of the server.
//!
//! `cargo run --release -p omnistage-http --example send_cost -- CONNECTIONS ROUNDS`
//! (e.g. `100 3600` and `9000 40`: the same number of calls; 9,000 keeps both ends of every
//! connection within a 20,000-descriptor limit).

use omnistage::exec::thread_cpu_ns as cpu_ns;
use rustix::net::{SendAncillaryBuffer, SendFlags};
use std::io::{IoSlice, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

fn main() -> std::io::Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("CONNECTIONS ROUNDS as numbers"))
        .collect();
    let (conns, rounds) = match args[..] {
        [c, r] if (1..=50_000).contains(&c) && (2..=1_000_000).contains(&r) => (c, r),
        _ => panic!("usage: send_cost CONNECTIONS(1..=50000) ROUNDS(2..=1000000)"),
    };
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let mut pairs = Vec::with_capacity(conns);
    for _ in 0..conns {
        let client = TcpStream::connect(addr)?;
        let (server, _) = listener.accept()?;
        server.set_nodelay(true)?;
        client.set_read_timeout(Some(Duration::from_secs(5)))?;
        pairs.push((server, client));
    }
    // A response: a 100-byte head and a 128-byte body in two slices, as the server sends one.
    let (head, body) = ([b'h'; 100], [b'b'; 128]);
    let bufs = [IoSlice::new(&head), IoSlice::new(&body)];
    let mut spent_ns = [0u64; 2];
    let mut drain = [0u8; 4096];
    for round in 0..rounds {
        let use_sendmsg = round % 2 == 1;
        let t0 = cpu_ns();
        for (server, _) in &mut pairs {
            let sent = if use_sendmsg {
                rustix::net::sendmsg(
                    &*server,
                    &bufs,
                    &mut SendAncillaryBuffer::default(),
                    SendFlags::NOSIGNAL,
                )?
            } else {
                server.write_vectored(&bufs)?
            };
            assert_eq!(
                sent,
                head.len() + body.len(),
                "a short send on an empty socket"
            );
        }
        spent_ns[usize::from(use_sendmsg)] += cpu_ns() - t0;
        // Untimed: the peers read what they got, so no socket's buffer fills.
        for (_, client) in &mut pairs {
            let mut got = 0;
            while got < head.len() + body.len() {
                got += client.read(&mut drain)?;
            }
        }
    }
    // Rounds alternate from writev: with an odd count it ran one round more.
    let calls = [rounds.div_ceil(2), rounds / 2].map(|r| (conns * r) as f64);
    let (writev, sendmsg) = (spent_ns[0] as f64 / calls[0], spent_ns[1] as f64 / calls[1]);
    println!(
        "{conns} connections: writev {writev:.0} ns per call, sendmsg {sendmsg:.0} ns per call, \
         sendmsg / writev {:.3}",
        sendmsg / writev
    );
    Ok(())
}
