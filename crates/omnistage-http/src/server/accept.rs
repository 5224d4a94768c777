//! `http.accept`: listener readiness. Accepts connections (a bounded number per event), holds
//! the server's `connections_max` (at it, closing the oldest connection no tenant has claimed
//! yet to make room, else refusing), registers each connection with this core's poller for the
//! `http.conn` stage and arms its header deadline. Also binds the listening sockets
//! (`SO_REUSEPORT`, one per address and worker). Runs in `/infra`.

use super::conn::{close, Conn};
use super::core_server::{key_of, with_core};
use super::deadlines::Kind;
use super::output::Output;
use super::timer::set_deadline;
use super::tls::TlsConn;
use omnistage::activity::INFRA;
use omnistage::exec::{Ctx, IoEvent};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::Ordering;

/// Most connections accepted per listener event before yielding.
const ACCEPTS_PER_EVENT_MAX: usize = 128;

/// Connections the kernel may hold for each listener before the worker accepts them (it
/// clamps this to `net.core.somaxconn`, 4096 by default since Linux 5.4), as `exp connections`
/// gives nginx. A SYN beyond a full queue is dropped and the client retries after a second.
/// (The p99 of about 1.1 s once seen there at 10,000 connections was not this: it stayed after
/// the change, and was the load generator timing a late connection's first request from the
/// run's start.)
pub(super) const LISTEN_BACKLOG: i32 = 4096;

pub(super) fn bind_reuseport(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let domain = socket2::Domain::for_address(addr);
    let s = socket2::Socket::new(domain, socket2::Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    s.set_reuse_port(true)?;
    s.set_nonblocking(true)?;
    // Linux copies the listener's TCP_NODELAY into every socket it accepts: set once here, it
    // saves a setsockopt per connection (the test below checks the kernel does so).
    s.set_nodelay(true)?;
    s.bind(&addr.into())?;
    s.listen(LISTEN_BACKLOG)?;
    Ok(s.into())
}

pub(super) fn on_accept(ctx: &mut Ctx<'_>, ev: IoEvent) {
    with_core(|cs| {
        cs.refresh(ctx);
        let idx = ev.user as usize;
        let now = ctx.now_ns();
        for n in 0..=ACCEPTS_PER_EVENT_MAX {
            if n == ACCEPTS_PER_EVENT_MAX {
                // More may be waiting: come back after others had their turn.
                let _ = ctx.send(&cs.stages.accept, ev);
                break;
            }
            let Some((listener, _, local, tls)) = cs.listeners.get(idx) else {
                return;
            };
            let (local, tls) = (*local, *tls);
            let (mut stream, peer) = match listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                // WouldBlock: drained. Other errors (EMFILE, ECONNABORTED): try again on the
                // next readiness rather than spin.
                Err(_) => break,
            };
            let shared = cs.shared.clone();
            let stats = &shared.stats;
            let max = cs.live.config.server.connections_max;
            // Take a place first, then check, so cores accepting at once cannot overshoot.
            let open_before = stats.open_connections.fetch_add(1, Ordering::AcqRel);
            if open_before >= max {
                stats.open_connections.fetch_sub(1, Ordering::AcqRel);
                // At the limit, the oldest connection here that no tenant has claimed (it
                // has not completed a request since it was accepted) makes room: a client
                // holding connections open without sending whole heads (slowloris) would
                // otherwise lock everyone out until the header timeout. Only exactly at the
                // limit: above it (a reload lowered `connections_max` below the connections
                // open, or another core's place-taking is in flight) one eviction would not
                // make room. With none to evict, or if another core took the freed place
                // first, refuse at once rather than let the new one wait unserved.
                let old = if open_before == max {
                    cs.oldest_unclaimed()
                } else {
                    None
                };
                let Some(old) = old else {
                    stats.refused_connections.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                close(ctx, cs, old);
                stats.evicted_connections.fetch_add(1, Ordering::Relaxed);
                if stats.open_connections.fetch_add(1, Ordering::AcqRel) >= max {
                    stats.open_connections.fetch_sub(1, Ordering::AcqRel);
                    stats.refused_connections.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            }
            debug_assert!(
                stream.nodelay().unwrap_or(true),
                "inherited from the listener"
            );
            let (slot, generation) = cs.reserve();
            let key = key_of(slot, generation);
            let interest = mio::Interest::READABLE | mio::Interest::WRITABLE;
            let handle = match ctx.io_register(&mut stream, interest, &cs.stages.conn, key) {
                Ok(h) => h,
                Err(_) => {
                    cs.release(slot);
                    stats.open_connections.fetch_sub(1, Ordering::AcqRel);
                    continue;
                }
            };
            stats.accepted.fetch_add(1, Ordering::Relaxed);
            cs.conns[slot as usize] = Some(Conn {
                stream,
                handle,
                peer,
                local,
                generation,
                tenant: None,
                activity: INFRA,
                inbuf: Vec::new(),
                read_stalled: false,
                out: Output::default(),
                body: None,
                send_blocked: false,
                busy: false,
                closing: false,
                read_eof: false,
                lingering_until_ns: 0,
                linger_on_close: false,
                cut: false,
                yielded: false,
                request_start_ns: now,
                last_progress_ns: now,
                last_active_ns: now,
                deadline_ns: 0,
                proxy_timer_ns: 0,
                requests: 0,
                tls: tls.then(|| Box::new(TlsConn::accepting())),
                proxy: None,
            });
            cs.note_unclaimed(key);
            let timeout_ns = cs.live.config.server.header_timeout.as_nanos() as u64;
            set_deadline(ctx, cs, key, Kind::Conn, now.saturating_add(timeout_ns));
        }
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn accepted_sockets_inherit_no_delay_from_the_listener() {
        let l = super::bind_reuseport("127.0.0.1:0".parse().unwrap()).unwrap();
        l.set_nonblocking(false).unwrap();
        let _c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (a, _) = l.accept().unwrap();
        assert!(
            a.nodelay().unwrap(),
            "Nagle would hold pipelined responses back"
        );
    }

    /// More clients than the old backlog (1,024) connect before the listener accepts any:
    /// every handshake completes at once (a dropped SYN would wait a second to be retried).
    #[test]
    fn clients_beyond_1024_queue_before_the_first_accept() {
        const CLIENTS: usize = 1_500;
        let somaxconn: usize = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        // "Max open files  <soft>  <hard>  files"
        let fds: usize = std::fs::read_to_string("/proc/self/limits")
            .ok()
            .and_then(|s| {
                let line = s.lines().find(|l| l.starts_with("Max open files"))?;
                line.split_whitespace().nth(3)?.parse().ok()
            })
            .unwrap_or(0);
        if somaxconn < CLIENTS || fds < 2 * CLIENTS + 64 {
            eprintln!(
                "skipped: somaxconn {somaxconn} or the descriptor limit is below what {CLIENTS} \
                 queued connections need"
            );
            return;
        }
        let l = super::bind_reuseport("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = l.local_addr().unwrap();
        let timeout = std::time::Duration::from_millis(500);
        let clients: Vec<_> = (0..CLIENTS)
            .map(|i| {
                std::net::TcpStream::connect_timeout(&addr, timeout)
                    .unwrap_or_else(|e| panic!("client {i} of {CLIENTS}: {e}"))
            })
            .collect();
        assert_eq!(clients.len(), CLIENTS);
    }
}
