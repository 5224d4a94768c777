//! `http.cont`: a connection's continuation. When a connection yields (more of a body to
//! stream, more pipelined requests, a file to `sendfile` past the per-dispatch bound), a
//! [`Cont`] is queued in the connection's activity; its handler writes on and parses on. Its
//! queues hold at most one continuation per connection and never refuse, unlike `http.work`'s
//! admission gates.

use super::conn::{drive, flush, read_more};
use super::core_server::{with_core, CoreServer};
use super::tls;
use omnistage::account::ActivityId;
use omnistage::exec::{Ctx, SendOpts};

/// Continue a connection: stream more of a body, or answer more pipelined requests (after
/// yielding to the scheduler).
pub(super) struct Cont {
    pub(super) key: u64,
}

/// Asks the cont stage to continue this connection later, in its activity.
pub(super) fn yield_conn(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64, activity: ActivityId) {
    let opts = SendOpts {
        activity: Some(activity),
        ..Default::default()
    };
    // Refused only past 2^24 queued continuations (far above any connection limit); then the
    // connection's no-progress deadline closes it rather than leaving it stalled.
    if ctx.send_with(&cs.stages.cont, opts, Cont { key }).is_ok() {
        if let Some(c) = cs.conn(key) {
            c.yielded = true;
        }
    }
}

pub(super) fn on_cont(ctx: &mut Ctx<'_>, Cont { key }: Cont) {
    with_core(|cs| {
        cs.refresh(ctx);
        let now = ctx.now_ns();
        if let Some(c) = cs.conn(key).filter(|c| c.yielded) {
            // Its turn: the time its output waited for it was the server's, and the client's
            // no-progress clock starts from here.
            c.yielded = false;
            c.last_progress_ns = now;
        }
        // A TLS handshake whose ClientHello is in goes on here, in the tenant's activity.
        if cs.conn(key).is_some_and(|c| tls::awaiting(c)) && !read_more(ctx, cs, key) {
            return;
        }
        if flush(ctx, cs, key) {
            if cs.conn(key).is_some_and(|c| c.proxy.is_some()) {
                super::proxy::pump(ctx, cs, key);
            }
            drive(ctx, cs, key);
        }
    });
}
