//! `http.proxy`'s relay: moves a proxied request's bytes both ways under the credit window
//! (request body from the client to the backend, the response from the backend to the
//! client), and hands a request that ends (complete, failed, client gone) back to `proxy.rs`,
//! which owns its life: slots, servers, deadlines, failures.

use super::conn::{flush, read_more, Conn};
use super::core_server::CoreServer;
use super::output::Output;
use super::upstream_pool::{UpConn, UpState};
use crate::proxy::{
    parse_response_head, write_client_head, ChunkedDecoder, HeadOutcome, ResponseFraming,
};
use crate::request::BodyFraming;
use omnistage::exec::{Ctx, SendOpts};
use std::io::{Read, Write};
use std::sync::atomic::Ordering;

use super::proxy::{
    arm, complete, drop_upstream, fail, retry_or_fail, Phase, Proxied, ProxyGo, Resp,
    INTERIM_HEADS_MAX, PUMP_ROUNDS_MAX, WINDOW_BYTES,
};

/// What one round of [`pump`] did.
#[derive(Default)]
struct Moved {
    progress: bool,
    /// Bytes of the request reached the backend's socket before its response: the response
    /// deadline starts again from now.
    rearm: bool,
    /// Bytes of the response came from the backend.
    from_backend: bool,
    /// The request is over (completed, failed, or the client is gone).
    ended: bool,
}

/// Moves bytes both ways for a proxied request: request body from the client to the backend,
/// the request to the backend's socket, the response from the backend to the client. Called
/// on any readiness of either side.
pub(super) fn pump(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64) {
    let mut rearm = false;
    let mut from_backend = false;
    let mut moving = true;
    for _ in 0..PUMP_ROUNDS_MAX {
        let m = pump_once(ctx, cs, key);
        if m.ended {
            return;
        }
        rearm |= m.rearm;
        from_backend |= m.from_backend;
        moving = m.progress;
        if !moving {
            break;
        }
    }
    if moving {
        // Out of rounds with bytes still moving: no readiness edge may come for them (the
        // backend's bytes already wait in its socket, the client's socket never filled), so a
        // message goes on with the pump after the other work queued here. Without it a large
        // response could stall for good (a TLS test saw it about once in 30 runs).
        let activity = cs
            .conn(key)
            .and_then(|c| c.proxy.as_ref())
            .map(|p| p.activity);
        let proxy_stage = cs.stages.proxy;
        let sent = ctx
            .send_with(
                &proxy_stage,
                SendOpts {
                    activity,
                    ..Default::default()
                },
                ProxyGo { key, pump: true },
            )
            .is_ok();
        if !sent {
            // Refused only for a tenant removed by a reload: nothing would move its bytes on,
            // so the response is cut (the client sees it closed, never complete).
            fail(ctx, cs, key, 502);
        }
    }
    // Once the head is here, the same timeout runs from the backend's last bytes: a backend
    // that sends a head and then stalls must not hold the client and the slot for ever. (A
    // response that ends in the pump that brought it, the common case, returned above.)
    let body_pending = from_backend
        && cs
            .conn(key)
            .and_then(|c| c.proxy.as_ref())
            .is_some_and(|p| p.resp.is_some());
    // One timer message per pump that moved bytes (not per write).
    if rearm || body_pending {
        if let Some(up_i) = cs
            .conn(key)
            .and_then(|c| c.proxy.as_ref())
            .map(|p| p.upstream)
        {
            let timeout = cs.proxy.upstreams[up_i].config.response_timeout;
            arm(ctx, cs, key, timeout.as_nanos() as u64);
        }
    }
}

fn pump_once(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64) -> Moved {
    let mut m = Moved::default();
    let body_max = cs.live.config.server.body_bytes_max;
    let head_max = cs.limits.header_bytes_max;
    let now = ctx.now_ns();
    let CoreServer {
        conns,
        proxy,
        scratch,
        ..
    } = &mut *cs;
    let Some(c) = conns
        .get_mut((key & 0xFFFF_FFFF) as usize)
        .and_then(Option::as_mut)
        .filter(|c| key_matches(c, key))
    else {
        m.ended = true;
        return m;
    };
    let Some(p) = c.proxy.as_mut() else {
        m.ended = true;
        return m;
    };
    let Phase::Active { up } = p.phase else {
        m.ended = true;
        return m;
    };
    let Some(u) = proxy.conn(up) else {
        m.ended = true;
        return m;
    };
    // 1. Request body: client input → the upstream's output, within the window.
    let mut bad_body = false;
    // What the loop took from the input, drained once after it (a drain per chunk moved the
    // rest of the buffer each time: quadratic in the chunks a 32 KiB buffer holds).
    let mut taken = 0;
    while !p.body_done && taken < c.inbuf.len() && u.out.len() - u.out_pos < WINDOW_BYTES {
        let input = &c.inbuf[taken..];
        let room = WINDOW_BYTES - (u.out.len() - u.out_pos);
        match p.body {
            BodyFraming::Length(_) => {
                let n = (p.body_left as usize).min(input.len()).min(room);
                u.out.extend_from_slice(&input[..n]);
                taken += n;
                p.body_left -= n as u64;
                p.body_forwarded += n as u64;
                p.body_done = p.body_left == 0;
                m.progress |= n > 0;
            }
            BodyFraming::Chunked => {
                let avail = input.len().min(room);
                // Re-framed, not copied: the backend reads the body exactly as this decoder
                // did (see `ChunkedDecoder::step_plain`).
                let out_len = u.out.len();
                match p.body_chunks.step_plain(&input[..avail], &mut u.out) {
                    Ok(s) => {
                        if s.consumed == 0 && !s.done {
                            break;
                        }
                        p.body_forwarded += s.data.len() as u64;
                        if p.body_forwarded > body_max {
                            u.out.truncate(out_len);
                            bad_body = true;
                            break;
                        }
                        taken += s.consumed;
                        p.body_done = s.done;
                        m.progress = true;
                    }
                    Err(_) => {
                        bad_body = true;
                        break;
                    }
                }
            }
            BodyFraming::None | BodyFraming::UnknownCoding => p.body_done = true,
        }
        c.last_active_ns = now;
    }
    c.inbuf.drain(..taken);
    if c.inbuf.is_empty() && c.inbuf.capacity() > 0 {
        super::pool::give_buf(std::mem::take(&mut c.inbuf));
    }
    let stalled = c.read_stalled && !p.body_done;
    // 2. The request to the backend.
    let mut up_failed = false;
    if u.state == UpState::Busy {
        while u.out_pos < u.out.len() {
            match u.stream.write(&u.out[u.out_pos..]) {
                Ok(0) => {
                    up_failed = true;
                    break;
                }
                Ok(n) => {
                    u.out_pos += n;
                    p.counters
                        .bytes_to_backend
                        .fetch_add(n as u64, Ordering::Relaxed);
                    ctx.record_bytes_out(p.activity, n as u64);
                    m.progress = true;
                    m.rearm |= !p.request_sent && p.resp.is_none();
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => {
                    up_failed = true;
                    break;
                }
            }
        }
        if u.out_pos == u.out.len() && !u.out.is_empty() {
            u.out.clear();
            u.out_pos = 0;
        }
        if u.out.is_empty() && p.body_done {
            p.request_sent = true;
        }
    }
    // 3. The response, within the window.
    let mut eof = false;
    // The backend's connection failed (a reset): not the end of a body read until the close.
    let mut read_failed = false;
    let mut fwd = Fwd::default();
    if u.state == UpState::Busy && !up_failed {
        // Bounded: each round reads (up to a scratch buffer) or ends; the window bounds the
        // rounds that read.
        loop {
            let f = forward(&mut c.out, p, u, head_max);
            fwd.invalid |= f.invalid;
            fwd.done |= f.done;
            fwd.head_seen |= f.head_seen;
            if fwd.invalid || fwd.done || eof || c.out.pending() >= WINDOW_BYTES {
                break;
            }
            if u.inbuf.len() >= head_max + scratch.len() {
                // Only a head still partial can be this long; `forward` refuses it.
                break;
            }
            if !u.readable {
                // Nothing arrived since the socket was found empty: the next edge brings us.
                break;
            }
            match u.stream.read(scratch) {
                Ok(0) => eof = true,
                Ok(n) => {
                    // A short read emptied the socket's queue.
                    u.readable = n == scratch.len();
                    u.inbuf.extend_from_slice(&scratch[..n]);
                    p.counters
                        .bytes_from_backend
                        .fetch_add(n as u64, Ordering::Relaxed);
                    ctx.record_bytes_in(p.activity, n as u64);
                    m.progress = true;
                    m.from_backend = true;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    u.readable = false;
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => {
                    eof = true;
                    read_failed = true;
                }
            }
        }
    }
    let (invalid, done, head_seen) = (fwd.invalid, fwd.done, fwd.head_seen);
    let until_close = p
        .resp
        .as_ref()
        .is_some_and(|r| r.framing == ResponseFraming::UntilClose);
    let resp_seen = p.resp.is_some();
    let reused_fresh = u.reused && !resp_seen && u.inbuf.is_empty() && p.body_forwarded == 0;
    let up_i = p.upstream;
    let server = p.server;
    c.last_progress_ns = now;
    if head_seen {
        proxy.upstreams[up_i].succeeded(server);
        if let Some(d) = p.sample.take() {
            ctx.complete_response(d);
        }
    }
    if bad_body {
        // A chunked body that is malformed or over body_bytes_max: the stream is lost.
        m.ended = true;
        fail(ctx, cs, key, if resp_seen { 502 } else { 400 });
        return m;
    }
    if invalid {
        m.ended = true;
        fail(ctx, cs, key, 502);
        return m;
    }
    if done {
        m.ended = true;
        complete(ctx, cs, key);
        return m;
    }
    if up_failed || eof {
        m.ended = true;
        if until_close && eof && !read_failed {
            complete(ctx, cs, key);
        } else if reused_fresh {
            // A pooled connection the server had closed: once more on a new one.
            drop_upstream(ctx, cs, key, false);
            if let Some(p) = cs.conn(key).and_then(|c| c.proxy.as_mut()) {
                p.attempts = p.attempts.saturating_sub(1);
            }
            retry_or_fail(ctx, cs, key, 502);
        } else if !resp_seen {
            // The server took the connection and closed it (or reset it) without answering:
            // this request failed, not the server. No back-off: it is for servers that refuse
            // or time out a connect, and here any client could set one off (a request that
            // crashes the backend's handler, an upload the backend refuses by closing), taking
            // the upstream away from every tenant for up to 30 s.
            fail(ctx, cs, key, 502);
        } else {
            // Closed mid-body: the client's connection closes after what it was sent.
            fail(ctx, cs, key, 502);
        }
        return m;
    }
    if stalled && !read_more(ctx, cs, key) {
        m.ended = true;
        return m;
    }
    if !flush(ctx, cs, key) {
        m.ended = true;
    }
    m
}

fn key_matches(c: &Conn, key: u64) -> bool {
    c.generation == (key >> 32) as u32
}

/// What [`forward`] did.
#[derive(Default)]
struct Fwd {
    invalid: bool,
    done: bool,
    head_seen: bool,
}

/// Forwards what the upstream's buffer holds to the client's output: the response head (once
/// whole), then body bytes as its framing allows; what it took leaves the buffer at once.
fn forward(out: &mut Output, p: &mut Proxied, u: &mut UpConn, head_max: usize) -> Fwd {
    let mut taken = 0;
    let f = forward_from(out, p, &u.inbuf, head_max, &mut taken);
    // One drain for the whole call: a drain per chunk moved the rest of the buffer each time,
    // quadratic in the chunks a buffer holds (16 KiB of 1-byte chunks is ~3,000 of them).
    u.inbuf.drain(..taken);
    f
}

/// [`forward`] over `inbuf`, from `*taken` on; adds what it took to `*taken`.
fn forward_from(
    out: &mut Output,
    p: &mut Proxied,
    inbuf: &[u8],
    head_max: usize,
    taken: &mut usize,
) -> Fwd {
    let mut f = Fwd::default();
    // Bounded: each round consumes bytes of the buffer or ends.
    loop {
        let buf = &inbuf[*taken..];
        let Some(r) = p.resp.as_mut() else {
            match parse_response_head(buf, head_max, p.is_head) {
                HeadOutcome::Partial => return f,
                HeadOutcome::Invalid(_) => {
                    f.invalid = true;
                    return f;
                }
                HeadOutcome::Complete(h) if h.status < 200 => {
                    // Interim (100, 103): not forwarded, and only so many.
                    p.interim_heads = p.interim_heads.saturating_add(1);
                    if p.interim_heads > INTERIM_HEADS_MAX {
                        f.invalid = true;
                        return f;
                    }
                    *taken += h.head_len;
                    continue;
                }
                HeadOutcome::Complete(h) => {
                    let chunked_to_client =
                        h.framing == ResponseFraming::Chunked && p.client_minor == 1;
                    let keep = p.client_keep
                        && p.body_done
                        && match h.framing {
                            ResponseFraming::UntilClose => false,
                            ResponseFraming::Chunked => chunked_to_client,
                            _ => true,
                        };
                    let minor = p.client_minor;
                    let raw = &buf[..h.head_len];
                    out.with_head(|b| write_client_head(b, raw, chunked_to_client, keep, minor));
                    *taken += h.head_len;
                    p.resp = Some(Resp {
                        status: h.status,
                        framing: h.framing,
                        left: match h.framing {
                            ResponseFraming::Length(n) => n,
                            _ => 0,
                        },
                        chunks: ChunkedDecoder::default(),
                        chunked_to_client,
                        upstream_keep_alive: h.keep_alive,
                    });
                    super::pool::give_buf(std::mem::take(&mut p.head));
                    f.head_seen = true;
                    if h.framing == ResponseFraming::None || h.framing == ResponseFraming::Length(0)
                    {
                        f.done = true;
                        return f;
                    }
                    continue;
                }
            }
        };
        if buf.is_empty() {
            return f;
        }
        match r.framing {
            ResponseFraming::None => {
                f.done = true;
                return f;
            }
            ResponseFraming::Length(_) => {
                let n = (r.left as usize).min(buf.len());
                out.with_head(|b| b.extend_from_slice(&buf[..n]));
                *taken += n;
                r.left -= n as u64;
                p.response_bytes += n as u64;
                f.done = r.left == 0;
                return f;
            }
            ResponseFraming::UntilClose => {
                p.response_bytes += buf.len() as u64;
                out.with_head(|b| b.extend_from_slice(buf));
                *taken += buf.len();
                return f;
            }
            ResponseFraming::Chunked => match r.chunks.step(buf) {
                Ok(s) => {
                    if s.consumed == 0 && !s.done {
                        return f;
                    }
                    let to_client = if r.chunked_to_client {
                        0..s.consumed
                    } else {
                        s.data.clone()
                    };
                    out.with_head(|b| b.extend_from_slice(&buf[to_client]));
                    p.response_bytes += s.data.len() as u64;
                    *taken += s.consumed;
                    if s.done {
                        f.done = true;
                        return f;
                    }
                }
                Err(_) => {
                    f.invalid = true;
                    return f;
                }
            },
        }
    }
}
