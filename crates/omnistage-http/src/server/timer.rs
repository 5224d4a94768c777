//! `http.timer`: a connection's deadlines (header timeout from a request's first byte, keep-alive
//! idleness, a client that stops reading) and the periodic access-log flush.

use super::conn::{close, flush};
use super::core_server::{with_core, LOG_FLUSH_INTERVAL_NS};
use super::pool;
use crate::response;
use omnistage::exec::Ctx;
use std::sync::atomic::Ordering;

pub(super) enum Tick {
    Deadline {
        key: u64,
    },
    /// A proxied request's connect or response deadline (`seq` names the latest one armed).
    Proxy {
        key: u64,
        due_ns: u64,
    },
    LogFlush,
}

pub(super) fn on_tick(ctx: &mut Ctx<'_>, t: Tick) {
    with_core(|cs| {
        cs.refresh();
        match t {
            Tick::LogFlush => {
                cs.flush_log();
                let _ = ctx.send_after(&cs.stages.timer, LOG_FLUSH_INTERVAL_NS, Tick::LogFlush);
            }
            Tick::Proxy { key, due_ns } => super::proxy::on_deadline(ctx, cs, key, due_ns),
            Tick::Deadline { key } => {
                let now = ctx.now_ns();
                let header_ns = cs.live.config.server.header_timeout.as_nanos() as u64;
                let idle_ns = cs.live.config.server.keepalive_timeout.as_nanos() as u64;
                let timer = cs.stages.timer;
                let shared = cs.shared.clone();
                let held = cs.send.as_ref().is_some_and(|ss| ss.holds(key));
                let Some(c) = cs.conn(key) else { return };
                let sending = c.sending() || c.body.as_ref().is_some_and(|b| !b.in_flight);
                let deadline = if sending && held {
                    // Its output waits for its turn under the link's scheduler (a link cap, a
                    // tenant's small share): the server holds the bytes, the client is not to
                    // blame. Its clock restarts when the send stage offers them.
                    now + idle_ns
                } else if sending {
                    // Bytes wait for the client: it must keep reading.
                    c.last_progress_ns + idle_ns
                } else if c.proxy.as_ref().is_some_and(|p| !p.body_done) {
                    // Sending a proxied request's body: it must keep sending.
                    c.last_active_ns + idle_ns
                } else if c.busy || c.body.is_some() {
                    // The server is working on it (a queued request, a disk read): look again.
                    now + idle_ns
                } else if !c.inbuf.is_empty() || c.requests == 0 {
                    // Receiving a request head: bounded from its first byte (slowloris).
                    c.request_start_ns + header_ns
                } else {
                    c.last_active_ns + idle_ns
                };
                if now < deadline {
                    let _ = ctx.send_after(&timer, deadline - now, Tick::Deadline { key });
                    return;
                }
                shared.stats.timeouts.fetch_add(1, Ordering::Relaxed);
                if c.tls.as_ref().is_some_and(|t| t.handshaking()) {
                    // A slow (or stalled) handshake: closed under the header timeout.
                    shared
                        .stats
                        .tls_handshake_timeouts
                        .fetch_add(1, Ordering::Relaxed);
                }
                if !c.inbuf.is_empty() && !sending {
                    let date = cs.date();
                    let c = cs.conn(key).expect("live");
                    pool::give_buf(std::mem::take(&mut c.inbuf));
                    c.out
                        .with_head(|b| response::error_response(b, 408, false, &date, &[]));
                    c.closing = true;
                    c.last_progress_ns = now;
                    if flush(ctx, cs, key) {
                        // Not all of it went out: if the client never reads, the no-progress
                        // deadline closes the connection.
                        let _ = ctx.send_after(&timer, idle_ns, Tick::Deadline { key });
                    }
                } else {
                    close(ctx, cs, key);
                }
            }
        }
    });
}
