//! `http.cont`: a connection's continuation. When a connection yields (more of a body to
//! stream, more pipelined requests, a file to `sendfile` past the per-dispatch bound), a
//! [`Cont`] is queued in the connection's activity; its handler writes on and parses on. Its
//! queues hold at most one continuation per connection and never refuse, unlike `http.work`'s
//! admission gates.

use super::conn::{drive, flush};
use super::core_server::{with_core, CoreServer};
use omnistage::account::ActivityId;
use omnistage::exec::{Ctx, SendOpts};

/// Continue a connection: stream more of a body, or answer more pipelined requests (after
/// yielding to the scheduler).
pub(super) struct Cont {
    pub(super) key: u64,
}

/// Asks the cont stage to continue this connection later, in its activity.
pub(super) fn yield_conn(ctx: &mut Ctx<'_>, cs: &CoreServer, key: u64, activity: ActivityId) {
    let opts = SendOpts {
        activity: Some(activity),
        ..Default::default()
    };
    // Refused only past 2^24 queued continuations (far above any connection limit); then the
    // connection's no-progress deadline closes it rather than leaving it stalled.
    let _ = ctx.send_with(&cs.stages.cont, opts, Cont { key });
}

pub(super) fn on_cont(ctx: &mut Ctx<'_>, Cont { key }: Cont) {
    with_core(|cs| {
        cs.refresh();
        if flush(ctx, cs, key) {
            if cs.conn(key).is_some_and(|c| c.proxy.is_some()) {
                super::proxy::pump(ctx, cs, key);
            }
            drive(ctx, cs, key);
        }
    });
}
