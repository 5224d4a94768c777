//! `http.send`: the network send resource stage, when a link or tenant net cap is configured.
//! A connection with pending output becomes a client of this core's [`SendSched`]; a `Pump`
//! picks whose bytes go next, writes one quantum of them and charges the tree in bytes, and
//! comes back when a shaper allows. Runs in `/infra`.

use super::conn::{close, fill_pattern, Conn, Source, FLOW_CHUNK_BYTES};
use super::cont::yield_conn;
use super::core_server::{with_core, CoreServer};
use super::disk::{submit_read, ChunkRead};
use super::send_sched::{Sent, SEND_PICKS_PER_DISPATCH, SEND_QUANTUM_BYTES};
use super::tenants::TenantRuntime;
use crate::config::SendOrder;
use omnistage::activity::INFRA;
use omnistage::exec::{Ctx, SendOpts};
use omnistage::sched::ClientParams;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;

/// Wakes the send stage of this core: now, or when a shaper allows (`timer`).
pub(super) struct Pump {
    pub(super) timer: bool,
}

/// Makes a connection's pending output a client of the send scheduler, and wakes the pump.
/// False if the scheduler cannot take it (its tenant is gone from the config and it has no
/// leaf yet, or the tree is full): the caller writes directly.
pub(super) fn schedule_send(
    ctx: &mut Ctx<'_>,
    cs: &mut CoreServer,
    key: u64,
    tr: &TenantRuntime,
) -> bool {
    let now = ctx.now_ns();
    let live = cs.live.clone();
    let send_stage = cs.stages.send;
    let remaining = cs.conn(key).map_or(0, remaining_bytes);
    let Some(ss) = cs.send.as_mut() else {
        return false;
    };
    // The order is cached per activity by `configure` (no scan of the tenants per send).
    let order = ss.order_of.get(&tr.activity).copied();
    let leaf = match (order, ss.leaves.get(&key)) {
        // In a tenant with a send order: the tenant's queue leaf, the queue ranks it.
        (Some(order), _) if order != SendOrder::Fair => {
            let l = match ss.queue_leaf.get(&tr.activity) {
                Some(&l) => l,
                None => {
                    let Some(tenant) = live.config.tenants.iter().find(|t| t.name == tr.name)
                    else {
                        return false;
                    };
                    let Some(node) = ss.tenant_node(tr, tenant, now) else {
                        return false;
                    };
                    let Some(l) = ss.queue_leaf(tr.activity, node, order) else {
                        return false;
                    };
                    l
                }
            };
            // After a change of order, its own leaf (not in service here) goes.
            ss.forget_leaf(key);
            ss.enqueue(l, key, remaining);
            l
        }
        // Its tenant left the configuration while it waited in the tenant's queue: it stays.
        (None, None) if ss.queued.contains_key(&key) => return true,
        (_, Some(&l)) => l,
        (_, None) => {
            let Some(tenant) = live.config.tenants.iter().find(|t| t.name == tr.name) else {
                return false;
            };
            let Some(node) = ss.tenant_node(tr, tenant, now) else {
                return false;
            };
            let Ok(l) = ss.tree.add_leaf(node, ClientParams::default()) else {
                return false;
            };
            // After a change of order, it leaves the tenant's queue.
            ss.dequeue(key);
            ss.leaves.insert(key, l);
            ss.conn_of.insert(l, key);
            l
        }
    };
    ss.tree.leaf_ready(leaf, now);
    tr.fleet.note_send_waiting(true);
    if !ss.pump_queued {
        let opts = SendOpts {
            activity: Some(INFRA),
            ..Default::default()
        };
        ss.pump_queued = ctx
            .send_with(&send_stage, opts, Pump { timer: false })
            .is_ok();
    }
    true
}

/// Bytes of a connection's output still to send: what is queued plus the rest of its body.
pub(super) fn remaining_bytes(c: &mut Conn) -> u64 {
    c.out.pending() as u64 + c.body.as_ref().map_or(0, |b| b.remaining)
}

/// Writes up to `max_bytes` (at most one quantum) of a connection's pending output (response
/// heads, then body chunks under the credit window).
fn send_some(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64, max_bytes: usize) -> Sent {
    debug_assert!((1..=SEND_QUANTUM_BYTES).contains(&max_bytes));
    let pool = cs.shared.disk.get().cloned();
    let mut sent = Sent {
        bytes: 0,
        more: false,
        blocked: false,
        failed: false,
        waiting: false,
    };
    let Some(c) = cs.conn(key) else {
        sent.failed = true;
        return sent;
    };
    // The client's no-progress clock runs from when the server offers bytes: the time its
    // output waited for this turn was the server's (`timer.rs`).
    c.last_progress_ns = ctx.now_ns();
    while sent.bytes < max_bytes {
        if !c.out.is_empty() {
            match c.write_out(max_bytes - sent.bytes) {
                Ok(0) => {
                    sent.failed = true;
                    break;
                }
                Ok(n) => {
                    sent.bytes += n;
                    c.last_progress_ns = ctx.now_ns();
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    sent.blocked = true;
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => {
                    sent.failed = true;
                    break;
                }
            }
            continue;
        }
        let Some(body) = &mut c.body else { break };
        if body.remaining == 0 {
            c.body = None;
            break;
        }
        let n = (body.remaining as usize).min(FLOW_CHUNK_BYTES);
        let mut chunk = Vec::new();
        match &body.source {
            Source::File(file) => {
                if let Some(pool) = &pool {
                    if !body.in_flight {
                        let file = file.clone();
                        let (offset, tenant) = (body.offset, c.tenant.clone());
                        let activity = tenant.as_ref().map(|t| t.activity);
                        let read = ChunkRead {
                            file,
                            offset,
                            len: n,
                            direct: body.direct,
                        };
                        if !submit_read(ctx, cs, pool, key, tenant, read) {
                            sent.failed = true;
                        }
                        if let Some(a) = activity {
                            ctx.record_bytes_out(a, sent.bytes as u64);
                        }
                        sent.waiting = !sent.failed;
                        return sent;
                    }
                    sent.waiting = true;
                    if let Some(a) = c.tenant.as_ref().map(|t| t.activity) {
                        ctx.record_bytes_out(a, sent.bytes as u64);
                    }
                    return sent;
                }
                chunk.resize(n, 0);
                if file.read_exact_at(&mut chunk, body.offset).is_err() {
                    sent.failed = true;
                    break;
                }
            }
            Source::Pattern => fill_pattern(&mut chunk, body.offset, n),
        }
        c.out.push_owned(chunk);
        body.offset += n as u64;
        body.remaining -= n as u64;
    }
    sent.more = !c.out.is_empty() || c.body.is_some();
    if let Some(t) = &c.tenant {
        let a = t.activity;
        ctx.record_bytes_out(a, sent.bytes as u64);
    }
    // Read ahead: with at most one chunk left to write, the disk read of the next one starts
    // now, so the connection does not wait for the disk stage with nothing to send (a leaky
    // bucket earns nothing while its node has no output: one download from the disk stage got
    // 0.80 of an 8 MB/s cap, 0.95 with files read inline). At most two chunks per connection
    // are then in memory on this path.
    let ahead = match (&pool, &c.body) {
        (Some(_), Some(body))
            if !body.in_flight
                && body.remaining > 0
                && !c.out.is_empty()
                && c.out.pending() <= FLOW_CHUNK_BYTES =>
        {
            match &body.source {
                Source::File(file) => Some((
                    ChunkRead {
                        file: file.clone(),
                        offset: body.offset,
                        len: (body.remaining as usize).min(FLOW_CHUNK_BYTES),
                        direct: body.direct,
                    },
                    c.tenant.clone(),
                )),
                Source::Pattern => None,
            }
        }
        _ => None,
    };
    if let (Some(pool), Some((read, tenant))) = (&pool, ahead) {
        // Refused (the pool is full): the read starts when the chunk in memory is spent.
        let _ = submit_read(ctx, cs, pool, key, tenant, read);
    }
    sent
}

pub(super) fn on_send(ctx: &mut Ctx<'_>, pump: Pump) {
    with_core(|cs| {
        cs.refresh(ctx);
        let now = ctx.now_ns();
        let send_stage = cs.stages.send;
        match cs.send.as_mut() {
            Some(ss) => {
                if pump.timer {
                    ss.pump_timer = false;
                } else {
                    ss.pump_queued = false;
                }
            }
            None => return,
        }
        for _ in 0..SEND_PICKS_PER_DISPATCH {
            let ss = cs.send.as_mut().expect("checked");
            let Some(leaf) = ss.tree.pick(now) else { break };
            // A connection's own leaf (`fair`), or its tenant's ordered queue.
            let (key, ordered) = match ss.conn_of.get(&leaf) {
                Some(&key) => (key, false),
                None => match ss.pop_queued(leaf) {
                    Some(key) => (key, true),
                    None => {
                        ss.tree.charge(leaf, 1, false, now);
                        continue;
                    }
                },
            };
            // A shaped tenant (or link) takes no more than its bucket holds, so a leaky bucket
            // is never in debt by a whole quantum (at least one byte: the pick was eligible).
            let max_bytes = ss
                .tree
                .shaped_room(leaf, now)
                .map_or(SEND_QUANTUM_BYTES, |r| {
                    (r.min(SEND_QUANTUM_BYTES as u64) as usize).max(1)
                });
            let sent = send_some(ctx, cs, key, max_bytes);
            let remaining = match cs.conn(key) {
                Some(c) if ordered && sent.goes_on() => remaining_bytes(c),
                _ => 0,
            };
            let ss = cs.send.as_mut().expect("checked");
            ss.settle_pick(leaf, key, ordered, &sent, remaining, now);
            // The tenant's backlog on the link, for the fleet layer: whether its node (the
            // leaf's parent) still has output waiting on this core after the pick.
            let tenant_node = ss.tree.parent(leaf);
            let tenant_waits = tenant_node.is_some_and(|n| ss.tree.has_work(n));
            let lost = tenant_node.map(|n| ss.take_lost(n)).unwrap_or_default();
            if let Some(t) = cs.conn(key).and_then(|c| c.tenant.as_ref()) {
                t.fleet.note_pick(tenant_waits);
                // What its net_cap bucket discarded, for `Server::net_cap_lost_bytes`.
                if lost.backlogged > 0 {
                    t.net_cap_lost_backlogged_bytes
                        .fetch_add(lost.backlogged, Ordering::Relaxed);
                }
                if lost.idle > 0 {
                    t.net_cap_lost_idle_bytes
                        .fetch_add(lost.idle, Ordering::Relaxed);
                }
            }
            if sent.failed {
                close(ctx, cs, key);
                continue;
            }
            if sent.blocked {
                if let Some(c) = cs.conn(key) {
                    c.send_blocked = true;
                }
                continue;
            }
            if sent.waiting {
                // The disk stage's answer makes the connection ready again.
                continue;
            }
            if !sent.more {
                let Some(c) = cs.conn(key) else { continue };
                if c.closing {
                    // As the direct path ends it (`flush`): records rustls still holds and its
                    // close_notify go out, and a client still sending gets a lingering close.
                    super::conn::flush(ctx, cs, key);
                } else {
                    // Output done: its next pipelined request, in its own activity.
                    let activity = c.activity;
                    yield_conn(ctx, cs, key, activity);
                }
            }
        }
        let ss = cs.send.as_mut().expect("checked");
        let opts = SendOpts {
            activity: Some(INFRA),
            ..Default::default()
        };
        match ss.tree.next_decision_ns(now) {
            Some(0) if !ss.pump_queued => {
                ss.pump_queued = ctx
                    .send_with(&send_stage, opts, Pump { timer: false })
                    .is_ok();
            }
            // Shaped: come back when a bucket allows the next write (at most the runtime's
            // longest delay away: a slow bucket in debt can be further; an early pump finds
            // nothing to send and arms the next).
            Some(d) if d > 0 && !ss.pump_timer => {
                let opts = SendOpts {
                    delay_ns: d.min(omnistage::exec::DELAY_MAX_NS),
                    ..opts
                };
                ss.pump_timer = ctx
                    .send_with(&send_stage, opts, Pump { timer: true })
                    .is_ok();
            }
            _ => {}
        }
    });
}
