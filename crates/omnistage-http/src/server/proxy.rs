//! `http.proxy`: a proxied request's life on the client's side, in its tenant's activity.
//!
//! A request whose tenant routes it to an `[[upstream]]` comes from `http.work` (so it passed
//! the tenant's admission gate) to [`start`]: it takes one of the upstream's slots on this core
//! or waits for one in its tenant's queue ([`FairSlots`](crate::fair_slots::FairSlots): freed
//! slots go to tenants by weight); a refused one is answered 503 with `Retry-After`. A granted
//! waiter is resumed by a [`ProxyGo`] message to this stage, sent in its own tenant's activity
//! (the tenant releasing the slot does not pay for it). [`dispatch`] picks a server (least in
//! flight, skipping those backing off), takes an idle keep-alive connection to it or opens one
//! (on this worker's poller, stage `http.upstream`), and [`pump`] moves bytes both ways under a
//! credit window: at most [`WINDOW_BYTES`] of request body wait for the backend and at most as
//! many of response wait for the client, whatever the bodies' sizes; a full window stops
//! reading that side (TCP flow control then holds the sender).
//!
//! Failures: unreachable (refused, connect timeout) → the next server, else 502 at once; an
//! invalid or oversized response head → 502, that upstream connection closed; no head within
//! `response_timeout_ms` → 504; the upstream closing mid-body → the client's connection is
//! closed (its framing shows the body incomplete). A request retried on another connection
//! never lost body bytes: only requests none of whose body was sent are retried.
//!
//! The bytes themselves are moved by `relay.rs` ([`pump`]); this file owns the request's life.

use super::conn::{answer_error, answer_status, drive, finish_logged, flush, Step};
use super::core_server::{with_core, CoreServer};
use super::deadlines::Kind;
use super::timer::set_deadline;
use super::upstream_pool::{UpConn, UpState, UpstreamCounters};
use crate::proxy::{write_upstream_head, ChunkedDecoder, ResponseFraming};
use crate::request::{BodyFraming, Method, Request};
use crate::{response, HttpError};
use omnistage::account::ActivityId;
use omnistage::activity::INFRA;
use omnistage::exec::{Ctx, SendOpts};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The credit window of each direction of a proxied request, bytes.
pub(super) const WINDOW_BYTES: usize = 64 * 1024;
/// Most requests of one tenant waiting for one upstream's slots on one core.
const QUEUE_PER_TENANT_MAX: usize = 1024;
/// Most rounds of [`pump`] per call (each moves up to a window each way), so a fast pair of
/// sockets cannot hold the worker; a message to `http.proxy` goes on after the others' turns.
pub(super) const PUMP_ROUNDS_MAX: usize = 16;
/// Most interim (1xx) response heads one request takes before its final head; past it the
/// response is invalid (502). Without a bound a backend writing `100 Continue` without end
/// kept one dispatch reading and dropping them: nothing reached the client's window, so
/// nothing else ended the loop, and the core's other tenants waited.
pub(super) const INTERIM_HEADS_MAX: u8 = 8;

/// Resume a request: one granted a slot while it waited, or one whose pump used its rounds
/// while its bytes still moved (`pump: true`).
pub(super) struct ProxyGo {
    pub(super) key: u64,
    pub(super) pump: bool,
}

/// Where a proxied request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// In its tenant's queue for a slot.
    Waiting,
    /// Holds a slot; a [`ProxyGo`] is on its way (or a retry is about to dispatch).
    Granted,
    /// On the upstream connection `up`.
    Active { up: u64 },
}

impl Proxied {
    /// On its upstream connection (not waiting for a slot).
    pub(super) fn is_active(&self) -> bool {
        matches!(self.phase, Phase::Active { .. })
    }
}

/// The response as it comes from the upstream.
pub(super) struct Resp {
    pub(super) status: u16,
    pub(super) framing: ResponseFraming,
    /// Bytes of a `Length` body still to come.
    pub(super) left: u64,
    pub(super) chunks: ChunkedDecoder,
    /// The chunked body goes to the client as it is (an HTTP/1.1 client); else it is
    /// de-chunked and the end is the connection's close.
    pub(super) chunked_to_client: bool,
    pub(super) upstream_keep_alive: bool,
}

/// A connection's proxied request.
pub(super) struct Proxied {
    /// Index into the core's upstreams.
    pub(super) upstream: usize,
    /// The server it was last sent to (by address: a reload may change the upstream's list
    /// and with it every index); `None` before its first dispatch.
    pub(super) server: Option<SocketAddr>,
    pub(super) activity: ActivityId,
    pub(super) counters: Arc<UpstreamCounters>,
    pub(super) phase: Phase,
    /// The request head for the backend (kept until a response head arrives, for a retry).
    pub(super) head: Vec<u8>,
    pub(super) body: BodyFraming,
    /// Bytes of a `Length` body still to forward.
    pub(super) body_left: u64,
    pub(super) body_chunks: ChunkedDecoder,
    /// Bytes of body taken from the client so far.
    pub(super) body_forwarded: u64,
    pub(super) body_done: bool,
    pub(super) expect_continue: bool,
    pub(super) is_head: bool,
    pub(super) client_minor: u8,
    pub(super) client_keep: bool,
    pub(super) resp: Option<Resp>,
    /// Interim (1xx) heads dropped so far ([`INTERIM_HEADS_MAX`]).
    pub(super) interim_heads: u8,
    pub(super) granted_ns: u64,
    pub(super) attempts: usize,
    /// Names the latest deadline armed; older ones are stale.
    pub(super) deadline_ns: u64,
    /// The whole request (head and body) is in the backend's socket: `response_timeout_ms`
    /// runs from here. Before, it runs from the last upload progress, so a slow upload that
    /// keeps moving is never a 504.
    pub(super) request_sent: bool,
    /// Method and target, for the access log (only when it is on).
    pub(super) log: Option<(String, String)>,
    pub(super) response_bytes: u64,
    /// The request's response-time sample, taken out of its `http.work` dispatch: the tenant's
    /// p90 controller gets it when the backend's head arrives (or the proxy answers 502/504),
    /// so the backend's time counts. `None` without a p90 target.
    pub(super) sample: Option<omnistage::exec::DeferredResponse>,
}

/// Starts a proxied request (from `http.work`): checks its body, then takes a slot or queues.
pub(super) fn start(
    ctx: &mut Ctx<'_>,
    cs: &mut CoreServer,
    key: u64,
    req: &Request,
    upstream_in_config: usize,
) -> Step {
    match req.body {
        BodyFraming::UnknownCoding => {
            return answer_error(ctx, cs, key, req, &HttpError::NotImplemented, false)
        }
        BodyFraming::Length(n) if n > cs.live.config.server.body_bytes_max => {
            return answer_error(ctx, cs, key, req, &HttpError::PayloadTooLarge, false)
        }
        _ => {}
    }
    let now = ctx.now_ns();
    let Some(&up_i) = cs.proxy.by_config.get(upstream_in_config) else {
        return answer_status(ctx, cs, key, req, 502, false);
    };
    let live = cs.live.clone();
    let Some(c) = cs.conn(key) else {
        return Step::Closed;
    };
    if c.read_eof {
        // The client finished sending before its request reached the proxy: as a FIN during
        // one abandons it (`conn::read_more_then`), this one is not sent on.
        super::conn::close(ctx, cs, key);
        return Step::Closed;
    }
    let Some(tr) = c.tenant.clone() else {
        return Step::Closed;
    };
    let peer = c.peer.ip();
    // The scheme the client used, for X-Forwarded-Proto.
    let proto = if c.tls.is_some() { "https" } else { "http" };
    let Some(tenant) = live.config.tenants.iter().find(|t| t.name == tr.name) else {
        return answer_status(ctx, cs, key, req, 421, false);
    };
    // From the thread's buffer pool, given back when the backend's head arrives.
    let mut head = super::pool::take_buf();
    head.reserve(256 + req.head().len());
    write_upstream_head(&mut head, req, peer, proto);
    let counters =
        cs.proxy.upstreams[up_i].counters(&cs.shared.upstream_counters, tr.activity, &tr.name);
    let body_left = match req.body {
        BodyFraming::Length(n) => n,
        _ => 0,
    };
    let p = Proxied {
        upstream: up_i,
        server: None,
        activity: tr.activity,
        counters: counters.clone(),
        phase: Phase::Waiting,
        head,
        body: req.body,
        body_left,
        body_chunks: ChunkedDecoder::default(),
        body_forwarded: 0,
        body_done: req.body == BodyFraming::None,
        expect_continue: req
            .header("expect")
            .is_some_and(|v| v.eq_ignore_ascii_case("100-continue")),
        is_head: req.method == Method::Head,
        client_minor: req.version_minor,
        client_keep: req.keep_alive && !cs.shared.draining.load(Ordering::Relaxed),
        resp: None,
        interim_heads: 0,
        granted_ns: now,
        attempts: 0,
        deadline_ns: 0,
        request_sent: false,
        log: cs
            .logging()
            .then(|| (req.method_raw().to_string(), req.target().to_string())),
        response_bytes: 0,
        sample: None,
    };
    let wait_max_ns = tenant.p90_target.map(|d| d.as_nanos() as u64);
    let outcome = cs.proxy.upstreams[up_i].slots.acquire(
        tr.activity,
        tenant.weight,
        key,
        QUEUE_PER_TENANT_MAX,
        wait_max_ns,
        now,
    );
    match outcome {
        crate::fair_slots::Acquire::Refused => {
            counters.refused.fetch_add(1, Ordering::Relaxed);
            // With a body still unread the stream is out of step: close after the answer.
            let keep = req.keep_alive && req.body == BodyFraming::None;
            answer_status(ctx, cs, key, req, 503, keep)
        }
        crate::fair_slots::Acquire::Queued => {
            counters.queued.fetch_add(1, Ordering::Relaxed);
            let mut p = p;
            p.sample = ctx.defer_response();
            let p = boxed(cs, p);
            if let Some(c) = cs.conn(key) {
                c.proxy = Some(p);
            }
            Step::Idle
        }
        crate::fair_slots::Acquire::Granted => {
            counters.in_flight.fetch_add(1, Ordering::Relaxed);
            counters.requests.fetch_add(1, Ordering::Relaxed);
            let mut p = p;
            p.sample = ctx.defer_response();
            p.phase = Phase::Granted;
            let p = boxed(cs, p);
            if let Some(c) = cs.conn(key) {
                c.proxy = Some(p);
            }
            dispatch(ctx, cs, key);
            Step::Idle
        }
    }
}

/// `http.proxy`: a waiter was granted a slot, or a pump goes on.
pub(super) fn on_proxy(ctx: &mut Ctx<'_>, ProxyGo { key, pump: go_on }: ProxyGo) {
    with_core(|cs| {
        cs.refresh(ctx);
        if go_on {
            if cs
                .conn(key)
                .and_then(|c| c.proxy.as_ref())
                .is_some_and(|p| matches!(p.phase, Phase::Active { .. }))
            {
                pump(ctx, cs, key);
            }
            return;
        }
        if cs
            .conn(key)
            .and_then(|c| c.proxy.as_ref())
            .is_some_and(|p| p.phase == Phase::Granted)
        {
            dispatch(ctx, cs, key);
        }
    });
}

/// Gives a slot back and hands it to the next waiter, who resumes in its own activity.
pub(super) fn release_slot(ctx: &mut Ctx<'_>, cs: &mut CoreServer, p: &Proxied) {
    let now = ctx.now_ns();
    let held = now.saturating_sub(p.granted_ns);
    p.counters.slot_ns.fetch_add(held, Ordering::Relaxed);
    p.counters.in_flight.fetch_sub(1, Ordering::Relaxed);
    let mut next = cs.proxy.upstreams[p.upstream]
        .slots
        .release(p.activity, held, now);
    // Bounded: each round grants a slot to a waiter or ends. Usually one grant (the slot just
    // freed); after a reload raised `concurrency_max`, every free slot goes to a waiter here
    // (before, each release granted one, so the queue kept the old limit in flight for as
    // long as it was not empty).
    while let Some((tenant, waiter)) = next {
        let proxy_stage = cs.stages.proxy;
        let granted = match cs.conn(waiter).and_then(|c| c.proxy.as_mut()) {
            Some(w) if w.phase == Phase::Waiting => {
                w.phase = Phase::Granted;
                w.granted_ns = now;
                w.counters.queued.fetch_sub(1, Ordering::Relaxed);
                w.counters.in_flight.fetch_add(1, Ordering::Relaxed);
                w.counters.requests.fetch_add(1, Ordering::Relaxed);
                true
            }
            _ => false,
        };
        let sent = granted
            && ctx
                .send_with(
                    &proxy_stage,
                    SendOpts {
                        activity: Some(tenant),
                        ..Default::default()
                    },
                    ProxyGo {
                        key: waiter,
                        pump: false,
                    },
                )
                .is_ok();
        if sent {
            next = cs.proxy.upstreams[p.upstream].slots.grant_next(now);
            continue;
        }
        if granted {
            // The message was refused (the stage refuses none, but a message to an activity
            // that a reload removed is): the grant is undone and the request answered 502, and the
            // slot goes to the next waiter in this loop. (`fail` on a granted request would
            // release the slot itself, and so call this function again: once per such waiter,
            // up to the queues' bound, deep enough to overflow the stack.)
            if let Some(w) = cs.conn(waiter).and_then(|c| c.proxy.as_mut()) {
                w.phase = Phase::Waiting;
                w.counters.in_flight.fetch_sub(1, Ordering::Relaxed);
            }
            fail(ctx, cs, waiter, 502);
        }
        next = cs.proxy.upstreams[p.upstream]
            .slots
            .give_back_unused(tenant, now);
    }
}

/// Sends the request to a server of its upstream (it holds a slot).
fn dispatch(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64) {
    let now = ctx.now_ns();
    let (up_i, activity, head, attempts) = match cs.conn(key).and_then(|c| c.proxy.as_mut()) {
        Some(p) => {
            p.attempts += 1;
            // Taken for the copy into the upstream connection's buffer and put back below: a
            // retry sends it again.
            (
                p.upstream,
                p.activity,
                std::mem::take(&mut p.head),
                p.attempts,
            )
        }
        None => return,
    };
    let upc = &mut cs.proxy.upstreams[up_i];
    let Some(server) = upc.choose(now) else {
        fail(ctx, cs, key, 502);
        return;
    };
    let addr = upc.servers[server].addr;
    let idle_pos = upc.idle.iter().rposition(|&k| {
        cs.proxy.conns[(k & 0xFFFF_FFFF) as usize]
            .as_ref()
            .is_some_and(|u| u.addr == addr)
    });
    let upstream_stage = cs.stages.upstream;
    let ukey = match idle_pos {
        Some(pos) => {
            let ukey = cs.proxy.upstreams[up_i].idle.remove(pos);
            let Some(u) = cs.proxy.conn(ukey) else {
                fail(ctx, cs, key, 502);
                return;
            };
            u.state = UpState::Busy;
            u.client = key;
            u.reused = true;
            // Into the pooled connection's own buffer (no allocation once it has grown).
            u.out.clear();
            u.out.extend_from_slice(&head);
            u.out_pos = 0;
            let _ = ctx.io_set_activity(u.handle, activity);
            ukey
        }
        None => {
            let mut stream = match mio::net::TcpStream::connect(addr) {
                Ok(s) => s,
                Err(_) => {
                    cs.proxy.upstreams[up_i].failed(Some(addr), now);
                    if let Some(p) = cs.conn(key).and_then(|c| c.proxy.as_mut()) {
                        p.head = head;
                    }
                    retry_or_fail(ctx, cs, key, 502);
                    return;
                }
            };
            let (slot, generation) = cs.proxy.reserve();
            let ukey = super::core_server::key_of(slot, generation);
            let interest = mio::Interest::READABLE | mio::Interest::WRITABLE;
            let handle = match ctx.io_register(&mut stream, interest, &upstream_stage, ukey) {
                Ok(h) => h,
                Err(_) => {
                    cs.proxy.free.push(slot);
                    fail(ctx, cs, key, 502);
                    return;
                }
            };
            cs.proxy.conns[slot as usize] = Some(UpConn {
                stream,
                addr,
                handle,
                generation,
                upstream: up_i,
                state: UpState::Connecting,
                client: key,
                reused: false,
                inbuf: Vec::new(),
                out: head.clone(),
                out_pos: 0,
                readable: false,
            });
            ukey
        }
    };
    cs.proxy.upstreams[up_i].servers[server].in_flight += 1;
    let connecting = cs
        .proxy
        .conn(ukey)
        .is_some_and(|u| u.state == UpState::Connecting);
    let (connect_timeout, response_timeout) = {
        let c = &cs.proxy.upstreams[up_i].config;
        (c.connect_timeout, c.response_timeout)
    };
    let Some(c) = cs.conn(key) else { return };
    let Some(p) = c.proxy.as_mut() else { return };
    p.head = head;
    p.phase = Phase::Active { up: ukey };
    p.server = Some(addr);
    let send_continue = attempts == 1
        && p.expect_continue
        && p.client_minor == 1
        && !p.body_done
        && c.inbuf.is_empty();
    if send_continue {
        // The client waits for this before it sends its body (RFC 9110 §10.1.1); `Expect`
        // itself is not forwarded.
        c.out
            .with_head(|b| b.extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n"));
    }
    let timeout = if connecting {
        connect_timeout
    } else {
        response_timeout
    };
    arm(ctx, cs, key, timeout.as_nanos() as u64);
    if !connecting {
        pump(ctx, cs, key);
    } else if send_continue {
        flush(ctx, cs, key);
    }
}

/// Sets the request's deadline `ns` from now (it replaces the one before).
pub(super) fn arm(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64, ns: u64) {
    let Some(c) = cs.conn(key) else { return };
    let Some(p) = c.proxy.as_mut() else { return };
    let due_ns = ctx.now_ns().saturating_add(ns);
    p.deadline_ns = due_ns;
    // One entry per connection in the core's deadlines, replaced here and removed when the
    // connection closes. Before, each request armed a 30 s runtime timer that nothing
    // cancelled; at 20,000 connections/s a worker held 600,000 of them.
    set_deadline(ctx, cs, key, Kind::Proxy, due_ns);
}

/// A proxied request's deadline fired: a connect that did not finish, a head that did not
/// come, or a response whose next bytes did not come.
pub(super) fn on_deadline(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64, due_ns: u64) {
    let now = ctx.now_ns();
    let Some(c) = cs.conn(key) else { return };
    if c.proxy_timer_ns != due_ns {
        // Replaced by a sooner one.
        return;
    }
    c.proxy_timer_ns = 0;
    let Some(p) = c.proxy.as_ref() else { return };
    if p.deadline_ns == 0 {
        return;
    }
    if now < p.deadline_ns {
        // The deadline moved on (progress, or a later request on this connection).
        let due_ns = p.deadline_ns;
        set_deadline(ctx, cs, key, Kind::Proxy, due_ns);
        return;
    }
    if p.resp.is_some() {
        let (up_i, delivering) = (p.upstream, c.sending());
        let timeout_ns = cs.proxy.upstreams[up_i].config.response_timeout.as_nanos() as u64;
        if delivering {
            // Bytes already forwarded still wait to go out (a client that reads slowly, or the
            // send scheduler holding them to a cap): not the backend's stall, and until they
            // are out the pump does not read it. The connection's own stalled-reader timeout
            // judges the client.
            arm(ctx, cs, key, timeout_ns);
            return;
        }
        // The backend sent a head, then nothing for the response timeout while the client
        // had taken everything: the response is cut and the slot freed (a client sees the cut
        // from the framing, except in a response that only the close ends).
        drop_upstream(ctx, cs, key, false);
        fail(ctx, cs, key, 504);
        return;
    }
    let Phase::Active { up } = p.phase else {
        return;
    };
    let (up_i, server) = (p.upstream, p.server);
    let connecting = cs
        .proxy
        .conn(up)
        .is_some_and(|u| u.state == UpState::Connecting);
    drop_upstream(ctx, cs, key, false);
    if connecting {
        cs.proxy.upstreams[up_i].failed(server, now);
        retry_or_fail(ctx, cs, key, 502);
    } else {
        fail(ctx, cs, key, 504);
    }
}

/// The request's upstream connection is connected: the response deadline starts, the request
/// goes out.
pub(super) fn on_connected(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64) {
    let Some(up_i) = cs
        .conn(key)
        .and_then(|c| c.proxy.as_ref())
        .map(|p| p.upstream)
    else {
        return;
    };
    let timeout = cs.proxy.upstreams[up_i].config.response_timeout;
    arm(ctx, cs, key, timeout.as_nanos() as u64);
    pump(ctx, cs, key);
}

/// The request's upstream connection could not connect: the server backs off, the request
/// goes to another one or is answered 502.
pub(super) fn on_connect_failed(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64) {
    let now = ctx.now_ns();
    let Some(p) = cs.conn(key).and_then(|c| c.proxy.as_ref()) else {
        return;
    };
    let (up_i, server) = (p.upstream, p.server);
    drop_upstream(ctx, cs, key, false);
    cs.proxy.upstreams[up_i].failed(server, now);
    retry_or_fail(ctx, cs, key, 502);
}

/// Closes the request's upstream connection (or pools it, with `reuse`) and counts it out of
/// its server.
pub(super) fn drop_upstream(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64, reuse: bool) {
    let Some(p) = cs.conn(key).and_then(|c| c.proxy.as_mut()) else {
        return;
    };
    let Phase::Active { up } = p.phase else {
        return;
    };
    p.phase = Phase::Granted;
    let (up_i, server) = (p.upstream, p.server);
    let draining = cs.shared.draining.load(Ordering::Relaxed);
    let upc = &mut cs.proxy.upstreams[up_i];
    if let Some(s) = upc.server_mut(server) {
        s.in_flight = s.in_flight.saturating_sub(1);
    }
    let idle_max = upc.config.idle_connections_max;
    let pool = reuse && !draining && upc.idle.len() < idle_max;
    if pool {
        if let Some(u) = cs.proxy.conn(up) {
            u.state = UpState::Idle;
            u.client = 0;
            u.out.clear();
            u.out_pos = 0;
            let _ = ctx.io_set_activity(u.handle, INFRA);
            cs.proxy.upstreams[up_i].idle.push(up);
            return;
        }
    }
    close_upstream(ctx, cs, up);
}

/// Closes an upstream connection and forgets it (and takes it out of an idle list).
pub(super) fn close_upstream(ctx: &mut Ctx<'_>, cs: &mut CoreServer, up: u64) {
    let Some(u) = cs.proxy.take(up) else {
        return;
    };
    // Connected here with CLOEXEC and never dup'd: closing it leaves epoll.
    let _ = ctx.io_close(u.handle, u.stream);
    if u.state == UpState::Idle {
        if let Some(upc) = cs.proxy.upstreams.get_mut(u.upstream) {
            upc.idle.retain(|&k| k != up);
        }
    }
}

/// A failure before the response head: another server, if the request can go again (none of
/// its body was sent and servers are left to try), else `status`.
pub(super) fn retry_or_fail(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64, status: u16) {
    let Some((up_i, again)) = cs
        .conn(key)
        .and_then(|c| c.proxy.as_ref())
        .map(|p| {
            (
                p.upstream,
                p.body_forwarded == 0 && p.resp.is_none(),
                p.attempts,
            )
        })
        .map(|(u, ok, attempts)| (u, (ok, attempts)))
    else {
        return;
    };
    let servers = cs.proxy.upstreams[up_i].servers.len();
    if again.0 && again.1 <= servers {
        dispatch(ctx, cs, key);
    } else {
        fail(ctx, cs, key, status);
    }
}

/// Ends a proxied request that failed: `status` if the client has no response head yet, else
/// the client's connection closes (its response cannot be completed).
pub(super) fn fail(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64, status: u16) {
    drop_upstream(ctx, cs, key, false);
    let Some(c) = cs.conn(key) else { return };
    let Some(mut p) = c.proxy.take() else { return };
    if let Some(d) = p.sample.take() {
        // The proxy's own answer ends the request's response time.
        ctx.complete_response(d);
    }
    match status {
        504 => p.counters.errors_504.fetch_add(1, Ordering::Relaxed),
        502 => p.counters.errors_502.fetch_add(1, Ordering::Relaxed),
        _ => 0,
    };
    if p.phase != Phase::Waiting {
        release_slot(ctx, cs, &p);
    }
    let Some(c) = cs.conn(key) else { return };
    if p.resp.is_some() {
        // Part of the response went out: the client must see it cut, never complete (its
        // length or chunked framing says so when the connection closes after it; over TLS,
        // so does the missing close_notify, which is all a body read until the close has).
        c.closing = true;
        c.cut = true;
        c.busy = false;
        flush(ctx, cs, key);
        return;
    }
    let keep = p.client_keep && p.body_done;
    let date = cs.date();
    let Some(c) = cs.conn(key) else { return };
    let head_only = p.is_head;
    c.out.with_head(|b| {
        let body_start = response::error_response(b, status, keep, &date, &[]);
        if head_only {
            b.truncate(body_start);
        }
    });
    c.closing |= !keep;
    let (method, target) = p
        .log
        .as_ref()
        .map_or(("", ""), |(m, t)| (m.as_str(), t.as_str()));
    if let Step::Answered = finish_logged(ctx, cs, key, method, target, p.client_minor, status, 0) {
        drive(ctx, cs, key);
    }
}

/// The client's connection closed (or was closed) while its request was proxied.
pub(super) fn client_gone(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64, p: Box<Proxied>) {
    match p.phase {
        Phase::Waiting => {
            if cs.proxy.upstreams[p.upstream]
                .slots
                .withdraw(p.activity, &key)
            {
                p.counters.queued.fetch_sub(1, Ordering::Relaxed);
            }
        }
        Phase::Granted => release_slot(ctx, cs, &p),
        Phase::Active { up } => {
            if let Some(s) = cs.proxy.upstreams[p.upstream].server_mut(p.server) {
                s.in_flight = s.in_flight.saturating_sub(1);
            }
            close_upstream(ctx, cs, up);
            release_slot(ctx, cs, &p);
        }
    }
}

/// The response is complete: the upstream connection goes back to the pool (if it may carry
/// another request), the slot to the next waiter, and the client on to its next request.
pub(super) fn complete(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64) {
    let Some(p) = cs.conn(key).and_then(|c| c.proxy.as_ref()) else {
        return;
    };
    let Phase::Active { up } = p.phase else {
        return;
    };
    let resp = p.resp.as_ref().expect("complete after the head");
    let reusable = resp.upstream_keep_alive
        && p.body_done
        && cs
            .proxy
            .conn(up)
            .is_some_and(|u| u.inbuf.is_empty() && u.out_pos == u.out.len());
    drop_upstream(ctx, cs, key, reusable);
    let Some(c) = cs.conn(key) else { return };
    let Some(p) = c.proxy.take() else { return };
    let resp = p.resp.as_ref().expect("complete after the head");
    let keep = p.client_keep
        && p.body_done
        && match resp.framing {
            ResponseFraming::UntilClose => false,
            ResponseFraming::Chunked => resp.chunked_to_client,
            _ => true,
        };
    c.closing |= !keep;
    release_slot(ctx, cs, &p);
    let (method, target) = p
        .log
        .as_ref()
        .map_or(("", ""), |(m, t)| (m.as_str(), t.as_str()));
    if let Step::Answered = finish_logged(
        ctx,
        cs,
        key,
        method,
        target,
        p.client_minor,
        resp.status,
        p.response_bytes,
    ) {
        recycle(cs, p);
        drive(ctx, cs, key);
    }
}

/// `p` in a box: a finished request's, or a new one.
fn boxed(cs: &mut CoreServer, p: Proxied) -> Box<Proxied> {
    match cs.proxy.spare.pop() {
        Some(mut b) => {
            *b = p;
            b
        }
        None => Box::new(p),
    }
}

/// Keeps a finished request's box for the next one (its head buffer goes back to the pool).
fn recycle(cs: &mut CoreServer, mut p: Box<Proxied>) {
    super::pool::give_buf(std::mem::take(&mut p.head));
    if cs.proxy.spare.len() < super::upstream_pool::SPARE_PROXIED_MAX {
        cs.proxy.spare.push(p);
    }
}

pub(super) use super::relay::pump;
