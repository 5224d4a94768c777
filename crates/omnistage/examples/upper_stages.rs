//! The `upper` service written as stages with messages (the guide's first style; see
//! docs/guide.md).
//!
//! Each tenant has a port; a line sent there comes back in capitals. Three stages:
//!
//! ```text
//! listen (a listener, sent in the tenant's activity) ── registers it with the core's poller
//! net    (IoEvent: readiness, in the source's activity) ── accepts; reads whole lines
//!        └── Line ──> upper (the work) ── Reply ──> write (sends the answer)
//! ```
//!
//! Readiness of a source arrives as an `IoEvent` message in the activity it was registered
//! in, so a connection accepted from a tenant's listener works for that tenant, and every
//! message it causes inherits the activity. Sockets are per-core state, kept in a
//! thread-local table that the `net` and `write` stages of one core share.
//!
//! `cargo run -p omnistage --example upper_stages`

mod upper_common;

use omnistage::exec::{Affinity, Ctx, IoEvent, IoHandle, Runtime, StageConfig, StageRef};
use std::cell::RefCell;
use std::io::{ErrorKind, Read, Write};
use upper_common::{upper, LINE_MAX};

/// `IoEvent::user` of a listener has this bit; a connection's is its slot.
const LISTENER: u64 = 1 << 63;

struct Conn {
    stream: mio::net::TcpStream,
    handle: IoHandle,
    buf: Vec<u8>,
}

/// This core's sockets.
#[derive(Default)]
struct Sockets {
    listeners: Vec<mio::net::TcpListener>,
    conns: Vec<Option<Conn>>,
}

thread_local! {
    static SOCKETS: RefCell<Sockets> = RefCell::new(Sockets::default());
}

/// A whole line read from connection `conn`.
struct Line {
    conn: usize,
    text: Vec<u8>,
}

/// The answer to write on connection `conn`.
struct Reply {
    conn: usize,
    text: Vec<u8>,
}

fn close(ctx: &mut Ctx<'_>, s: &mut Sockets, conn: usize) {
    if let Some(mut c) = s.conns.get_mut(conn).and_then(Option::take) {
        let _ = ctx.io_deregister(c.handle, &mut c.stream);
    }
}

/// Readiness: accept on a listener, or read whole lines from a connection.
fn on_io(ctx: &mut Ctx<'_>, ev: IoEvent, net: &StageRef<IoEvent>, to_upper: &StageRef<Line>) {
    SOCKETS.with(|s| {
        let s = &mut *s.borrow_mut();
        if ev.user & LISTENER != 0 {
            let l = &s.listeners[(ev.user & !LISTENER) as usize];
            while let Ok((mut stream, _)) = l.accept() {
                let slot = s.conns.len();
                // In the listener's activity: the connection works for the same tenant.
                match ctx.io_register(&mut stream, mio::Interest::READABLE, net, slot as u64) {
                    Ok(handle) => s.conns.push(Some(Conn {
                        stream,
                        handle,
                        buf: Vec::new(),
                    })),
                    Err(e) => eprintln!("upper_stages: register: {e}"),
                }
            }
            return;
        }
        let conn = ev.user as usize;
        let Some(c) = s.conns.get_mut(conn).and_then(Option::as_mut) else {
            return;
        };
        // Edge-triggered: read until the kernel has nothing more.
        let mut chunk = [0u8; 1024];
        let mut closed = ev.closed;
        loop {
            match c.stream.read(&mut chunk) {
                Ok(0) => {
                    closed = true;
                    break;
                }
                Ok(n) => c.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => {
                    closed = true;
                    break;
                }
            }
        }
        while let Some(end) = c.buf.iter().position(|&b| b == b'\n') {
            let text = c.buf.drain(..=end).take(end).collect();
            if ctx.send(to_upper, Line { conn, text }).is_err() {
                closed = true; // refused: shed this connection rather than queue without bound
                break;
            }
        }
        if closed || c.buf.len() > LINE_MAX {
            close(ctx, s, conn);
        }
    });
}

/// Writes an answer (small: it fits in the socket's buffer, or the connection is closed).
fn on_reply(ctx: &mut Ctx<'_>, r: Reply) {
    SOCKETS.with(|s| {
        let s = &mut *s.borrow_mut();
        let Some(c) = s.conns.get_mut(r.conn).and_then(Option::as_mut) else {
            return;
        };
        if c.stream.write_all(&r.text).is_err() {
            close(ctx, s, r.conn);
        }
    });
}

fn main() {
    let b = Runtime::builder().workers(1);
    let (mut b, tenants) = upper_common::tenants(b);
    let write: StageRef<Reply> = b
        .stage("write", StageConfig::default(), |_| on_reply)
        .expect("stage");
    let to_upper: StageRef<Line> = b
        .stage("upper", StageConfig::default(), move |_| {
            move |ctx: &mut Ctx<'_>, line: Line| {
                let reply = Reply {
                    conn: line.conn,
                    text: upper(&line.text),
                };
                // The reply inherits the line's activity.
                let _ = ctx.send(&write, reply);
            }
        })
        .expect("stage");
    // A stage's handler may name its own stage: the id is known before the builder starts.
    let net_slot: std::sync::Arc<std::sync::OnceLock<StageRef<IoEvent>>> = Default::default();
    let slot = net_slot.clone();
    let net: StageRef<IoEvent> = b
        .stage("net", StageConfig::default(), move |_| {
            let net = *slot.get().expect("set before start");
            move |ctx: &mut Ctx<'_>, ev: IoEvent| on_io(ctx, ev, &net, &to_upper)
        })
        .expect("stage");
    net_slot.set(net).ok().expect("once");
    let listen: StageRef<std::net::TcpListener> = b
        .stage("listen", StageConfig::default(), move |_| {
            move |ctx: &mut Ctx<'_>, l: std::net::TcpListener| {
                l.set_nonblocking(true).expect("nonblocking");
                let mut l = mio::net::TcpListener::from_std(l);
                SOCKETS.with(|s| {
                    let s = &mut *s.borrow_mut();
                    let user = LISTENER | s.listeners.len() as u64;
                    ctx.io_register(&mut l, mio::Interest::READABLE, &net, user)
                        .expect("register the listener");
                    s.listeners.push(l);
                });
            }
        })
        .expect("stage");
    let rt = b.start().expect("start");
    let mut addrs = Vec::new();
    for (activity, listener) in tenants {
        addrs.push(listener.local_addr().expect("addr"));
        // Sent in the tenant's activity: its readiness, and all that follows, is the tenant's.
        rt.send(&listen, activity, Affinity::Core(0), listener)
            .expect("send");
    }
    upper_common::check(&rt, &addrs);
}
