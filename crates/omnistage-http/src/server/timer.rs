//! `http.timer`: a connection's deadlines (header timeout from a request's first byte, keep-alive
//! idleness, a client that stops reading), the sweep that hands them out when due (see
//! [`super::deadlines`]) and the periodic access-log flush.

use super::conn::{close, flush};
use super::core_server::{with_core, CoreServer, LOG_FLUSH_INTERVAL_NS};
use super::deadlines::{Kind, SWEEP_ENTRIES_MAX};
use super::pool;
use crate::response;
use omnistage::activity::INFRA;
use omnistage::exec::{Ctx, SendOpts};
use std::sync::atomic::Ordering;

/// During a drain, a connection's state is looked at again at least this often, so one that
/// was busy when the drain began (its answer kept it alive) closes within this of its answer
/// instead of after `keepalive_timeout`, which would hold `Server::drain` to its whole grace.
const DRAIN_RECHECK_NS: u64 = 100_000_000;
/// During a drain, a request head still arriving gets at most this long from the drain's start
/// (or its `header_timeout`, if sooner): enough for a head already on its way, and a client
/// that opened a connection and sent nothing does not hold the drain for `header_timeout`.
const DRAIN_HEADER_NS: u64 = 1_000_000_000;

/// Whether connection `c` is idle between requests: it has been answered and nothing of it
/// is in progress (no bytes of a next request, no answer, body, disk read or proxied request,
/// no continuation queued, not lingering). A drain closes these at once.
fn idle_between_requests(c: &super::conn::Conn) -> bool {
    c.requests > 0
        && c.inbuf.is_empty()
        && !c.busy
        && !c.closing
        && !c.yielded
        && c.body.is_none()
        && c.proxy.is_none()
        && c.lingering_until_ns == 0
        && !c.sending()
}

/// `Boot::Drain` on this core: connections idle between requests are closed now (through
/// `flush`, so a TLS one sends its close_notify), and every other one is looked at again
/// within [`DRAIN_RECHECK_NS`] (`handle`'s `Deadline` closes it once it is idle, and bounds
/// a head still arriving by [`DRAIN_HEADER_NS`]). Keep-alive clients idle after their answer
/// once held the drain for all of `keepalive_timeout`.
pub(super) fn start_drain(ctx: &mut Ctx<'_>, cs: &mut CoreServer) {
    let now = ctx.now_ns();
    cs.draining_since_ns = now.max(1);
    let keys: Vec<u64> = cs
        .conns
        .iter()
        .enumerate()
        .filter_map(|(slot, c)| {
            let c = c.as_ref()?;
            Some(super::core_server::key_of(slot as u32, c.generation))
        })
        .collect();
    for key in keys {
        let Some(c) = cs.conn(key) else { continue };
        if idle_between_requests(c) {
            c.closing = true;
            flush(ctx, cs, key);
        } else {
            let due = now.saturating_add(DRAIN_RECHECK_NS);
            if c.deadline_ns == 0 || due < c.deadline_ns {
                set_deadline(ctx, cs, key, Kind::Conn, due);
            }
        }
    }
}

pub(super) enum Tick {
    /// This core's earliest deadline, as armed when it was due at `due_ns`, has come: hand out
    /// the entries due (a stale sweep, replaced by a sooner one, does nothing).
    Sweep {
        due_ns: u64,
    },
    Deadline {
        key: u64,
    },
    /// A proxied request's connect or response deadline (`due_ns` names the one armed: an
    /// older one, since replaced, is ignored).
    Proxy {
        key: u64,
        due_ns: u64,
    },
    LogFlush,
}

/// Sets connection `key`'s deadline of `kind` at `due_ns` (absolute, on the runtime's clock),
/// replacing the one it had; arms a sweep if this is now the core's earliest.
pub(super) fn set_deadline(
    ctx: &mut Ctx<'_>,
    cs: &mut CoreServer,
    key: u64,
    kind: Kind,
    due_ns: u64,
) {
    let Some(c) = cs.conn(key) else { return };
    let stored = match kind {
        Kind::Conn => &mut c.deadline_ns,
        Kind::Proxy => &mut c.proxy_timer_ns,
    };
    // 0 means none: a deadline is never at the clock's origin.
    let due_ns = due_ns.max(1);
    let previous_ns = std::mem::replace(stored, due_ns);
    debug_assert!(
        cs.deadlines.len() < 2 * cs.conns.len() + 2,
        "at most one entry of each kind per connection"
    );
    if let Some(at) = cs.deadlines.insert(key, kind, previous_ns, due_ns) {
        arm_sweep(ctx, cs, at);
    }
}

/// Arms the runtime timer that sweeps at `due_ns`, in `/infra` (the sweep's own work is the
/// server's; each deadline it hands out runs in its connection's activity).
fn arm_sweep(ctx: &mut Ctx<'_>, cs: &mut CoreServer, due_ns: u64) {
    let opts = SendOpts {
        activity: Some(INFRA),
        // At least 1 ns: a timer takes no place in the timer stage's queue until it is due
        // (it is refused only by the core's timer bound, or by a queue full at this moment).
        // At most the runtime's longest delay (deadlines are at most an hour away anyway): a
        // sweep that comes early hands out nothing and arms the next.
        delay_ns: due_ns
            .saturating_sub(ctx.now_ns())
            .clamp(1, omnistage::exec::DELAY_MAX_NS),
        ..Default::default()
    };
    if ctx
        .send_with(&cs.stages.timer, opts, Tick::Sweep { due_ns })
        .is_ok()
    {
        cs.deadlines.armed(due_ns);
    }
    // Refused (the timer table full): the outstanding sweep, if any, still comes, and the
    // next arming or log flush (every second) tries again.
    if !cs.log_flush_armed {
        // The flush's own re-arm was refused: without this it would never come again (and
        // with it the retry of a refused sweep above).
        arm_log_flush(ctx, cs);
    }
}

/// Arms the next periodic log flush, [`LOG_FLUSH_INTERVAL_NS`] from now, unless one is
/// pending; a refusal (the core's timer table full) leaves `log_flush_armed` false for the
/// next sweep's arming to try again.
pub(super) fn arm_log_flush(ctx: &mut Ctx<'_>, cs: &mut CoreServer) {
    if !cs.log_flush_armed {
        // In `/infra` whoever arms it (a sweep may be armed from a proxied request's
        // dispatch): a tenant's cap must not hold the flush back, nor its removal lose it.
        let opts = SendOpts {
            activity: Some(INFRA),
            delay_ns: LOG_FLUSH_INTERVAL_NS,
            ..Default::default()
        };
        cs.log_flush_armed = ctx
            .send_with(&cs.stages.timer, opts, Tick::LogFlush)
            .is_ok();
    }
}

/// Hands out the deadlines due now, at most [`SWEEP_ENTRIES_MAX`], then arms the next sweep.
fn sweep(ctx: &mut Ctx<'_>, cs: &mut CoreServer, due_ns: u64) {
    if !cs.deadlines.sweep_fired(due_ns) {
        return;
    }
    let now = ctx.now_ns();
    let timer = cs.stages.timer;
    for _ in 0..SWEEP_ENTRIES_MAX {
        let Some((key, kind)) = cs.deadlines.pop_due(now) else {
            break;
        };
        // A closed connection's entries left the set with it.
        let Some(c) = cs.conn(key) else {
            debug_assert!(false, "a deadline outlived its connection");
            continue;
        };
        let (activity, proxy_due_ns) = match kind {
            Kind::Conn => {
                c.deadline_ns = 0;
                (INFRA, 0)
            }
            Kind::Proxy => {
                let activity = c.proxy.as_ref().map_or(c.activity, |p| p.activity);
                (activity, c.proxy_timer_ns)
            }
        };
        let tick = || match kind {
            Kind::Conn => Tick::Deadline { key },
            Kind::Proxy => Tick::Proxy {
                key,
                due_ns: proxy_due_ns,
            },
        };
        // Each deadline in a dispatch of its own, charged as before (a proxied request's to
        // its tenant); inline if the send is refused (the timer stage's queue full, or the
        // tenant removed by a reload), then in `/infra` like this sweep. A deadline it sets
        // (a re-arm, a retry's connect timeout) may arm a sweep later than the entries still
        // waiting here: `next_to_arm` below arms a sooner one for them.
        let opts = SendOpts {
            activity: Some(activity),
            ..Default::default()
        };
        if ctx.send_with(&timer, opts, tick()).is_err() {
            handle(ctx, cs, tick());
        }
    }
    if let Some(at) = cs.deadlines.next_to_arm() {
        arm_sweep(ctx, cs, at);
    }
}

pub(super) fn on_tick(ctx: &mut Ctx<'_>, t: Tick) {
    with_core(|cs| {
        cs.refresh(ctx);
        handle(ctx, cs, t);
    });
}

fn handle(ctx: &mut Ctx<'_>, cs: &mut CoreServer, t: Tick) {
    match t {
        Tick::Sweep { due_ns } => sweep(ctx, cs, due_ns),
        Tick::LogFlush => {
            cs.flush_log();
            let now = ctx.now_ns();
            cs.cache_sweep(now);
            cs.log_flush_armed = false;
            arm_log_flush(ctx, cs);
            // A sweep whose arming was refused is tried again here.
            if let Some(at) = cs.deadlines.next_to_arm() {
                arm_sweep(ctx, cs, at);
            }
        }
        Tick::Proxy { key, due_ns } => super::proxy::on_deadline(ctx, cs, key, due_ns),
        Tick::Deadline { key } => {
            let now = ctx.now_ns();
            let header_ns = cs.live.config.server.header_timeout.as_nanos() as u64;
            let idle_ns = cs.live.config.server.keepalive_timeout.as_nanos() as u64;
            let shared = cs.shared.clone();
            let held = cs.send.as_ref().is_some_and(|ss| ss.holds(key));
            let draining_since = cs.draining_since_ns;
            let Some(c) = cs.conn(key) else { return };
            if draining_since != 0 && idle_between_requests(c) {
                // Draining, and its last answer is out: closed now (not a timeout).
                c.closing = true;
                flush(ctx, cs, key);
                return;
            }
            if c.lingering_until_ns != 0 {
                // Lingering after its last answer (`conn::linger_or_close`): its time is up.
                let until = c.lingering_until_ns;
                if now < until {
                    set_deadline(ctx, cs, key, Kind::Conn, until);
                } else {
                    close(ctx, cs, key);
                }
                return;
            }
            let sending = c.sending() || c.body.as_ref().is_some_and(|b| !b.in_flight);
            let deadline = if sending && (held || c.yielded) {
                // Its output waits for its turn under the link's scheduler (a link cap, a
                // tenant's small share) or for its tenant's CPU turn (a continuation queued):
                // the server holds the bytes, the client is not to blame. Its clock restarts
                // when the send stage offers them, or the continuation runs.
                now + idle_ns
            } else if sending {
                // Bytes wait for the client: it must keep reading.
                c.last_progress_ns + idle_ns
            } else if let Some(p) = c.proxy.as_ref().filter(|p| !p.body_done) {
                if p.is_active() && c.inbuf.is_empty() {
                    // Sending a proxied request's body, all it sent taken: it must keep
                    // sending.
                    c.last_active_ns + idle_ns
                } else {
                    // In its tenant's queue for a slot, or its bytes waiting for the backend
                    // to take them: the server's wait, not the client's (such a POST was
                    // answered 408 after `keepalive_timeout` in the queue, where a GET waited).
                    now + idle_ns
                }
            } else if c.busy || c.body.is_some() {
                // The server is working on it (a queued request, a disk read): look again.
                now + idle_ns
            } else if !c.inbuf.is_empty() || c.requests == 0 {
                // Receiving a request head: bounded from its first byte (slowloris), and
                // during a drain from the drain's start too.
                let due = c.request_start_ns.saturating_add(header_ns);
                if draining_since != 0 {
                    due.min(draining_since.saturating_add(DRAIN_HEADER_NS))
                } else {
                    due
                }
            } else {
                c.last_active_ns + idle_ns
            };
            if now < deadline {
                let next = if draining_since != 0 {
                    // Looked at again soon: it closes once it is idle (`start_drain`).
                    deadline.min(now.saturating_add(DRAIN_RECHECK_NS))
                } else {
                    deadline
                };
                set_deadline(ctx, cs, key, Kind::Conn, next);
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
                    set_deadline(ctx, cs, key, Kind::Conn, now + idle_ns);
                }
            } else {
                close(ctx, cs, key);
            }
        }
    }
}
