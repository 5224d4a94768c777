//! `http.conn`: a connection's readiness and everything done to a connection: reading (lazily,
//! in the connection's activity once its tenant is known), parsing pipelined requests and
//! picking their tenant and class, queueing them to `http.work` (or answering inline: errors,
//! 421, overload 503), writing what is pending (`flush`, bodies streamed under the credit
//! window), answering and logging (`finish`), and closing.

use super::cont::yield_conn;
use super::core_server::{with_core, CoreServer, LOG_BUFFER_BYTES};
use super::deadlines::Kind;
use super::disk::{submit_read, ChunkRead};
use super::file_cache::CACHE_FILE_BYTES_MAX;
use super::output::Output;
use super::pool;
use super::send::schedule_send;
use super::shared::ServerStats;
use super::tenants::TenantRuntime;
use super::tls::{self, TlsConn};
use super::work::Work;
use crate::config::ClassSelector;
use crate::request::{BodyFraming, Method, ParseOutcome, Request};
use crate::{request, response, HttpError};
use omnistage::account::ActivityId;
use omnistage::exec::{Ctx, IoEvent, IoHandle, SendError, SendOpts};
use std::fs::File;
use std::io::Read;
use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::SystemTime;

/// Bytes read from a socket per read call.
pub(super) const READ_CHUNK_BYTES: usize = 16 * 1024;

/// Bytes of a streamed body read from the file per step: the flow's credit window, so a
/// connection never has more than this (plus one response head) in memory, whatever the file;
/// twice this on the send scheduler's path, which reads the next chunk ahead (`send.rs`).
pub(super) const FLOW_CHUNK_BYTES: usize = 64 * 1024;
/// Most flow chunks sent per dispatch before yielding to the scheduler (fairness between
/// tenants streaming large files).
const FLOW_CHUNKS_PER_DISPATCH: usize = 4;
/// Most bytes of file segments (`sendfile`) one unscheduled flush writes before it yields to
/// the scheduler: a cached body of up to `CACHE_FILE_BYTES_MAX` goes out in one `writev`, so
/// a sendfile'd one may go out in one dispatch too; larger files yield between such steps.
const SENDFILE_BYTES_PER_DISPATCH_MAX: usize = CACHE_FILE_BYTES_MAX as usize;

/// Pending output above which a connection stops parsing pipelined requests (backpressure).
const OUT_PENDING_BYTES_MAX: usize = 1 << 20;

/// `Retry-After` seconds sent with 503.
const RETRY_AFTER_S: &str = "1";

/// Longest a connection closed after its answer keeps reading (and dropping) what its client
/// still sends ([`linger`]; nginx's `lingering_time` is 30 s with 5 s between reads).
const LINGER_NS: u64 = 5_000_000_000;

/// Most reads one readiness event of a lingering connection makes (a client sending fast is
/// read again at its next event, the dispatch stays bounded).
const LINGER_READS_PER_EVENT_MAX: usize = 64;

/// Generated body bytes for `/_bytes`.
const PATTERN: &[u8; 64] = b"omnistage-omnistage-omnistage-omnistage-omnistage-omnistage-omn\n";

/// Where a streamed body comes from.
pub(super) enum Source {
    File(Arc<File>),
    /// `/_bytes`: the repeating pattern.
    Pattern,
}

pub(super) struct Body {
    pub(super) source: Source,
    /// The file was opened with O_DIRECT.
    pub(super) direct: bool,
    pub(super) offset: u64,
    pub(super) remaining: u64,
    /// A read of the next chunk is with the disk stage.
    pub(super) in_flight: bool,
}

pub(super) struct Conn {
    pub(super) stream: mio::net::TcpStream,
    pub(super) handle: IoHandle,
    pub(super) peer: SocketAddr,
    /// The listen address as configured (tenants are bound to those).
    pub(super) local: SocketAddr,
    pub(super) generation: u32,
    pub(super) tenant: Option<Arc<TenantRuntime>>,
    pub(super) activity: ActivityId,
    /// Bytes received and not yet parsed; taken from the thread's pool when bytes arrive and
    /// given back when it empties, so an idle connection holds none (`pool.rs`).
    pub(super) inbuf: Vec<u8>,
    /// Reading stopped with the input buffer full: read again once a request is taken out
    /// (the socket will not signal again for bytes it already holds).
    pub(super) read_stalled: bool,
    pub(super) out: Output,
    /// A body being streamed (boxed: most connections have none, and the slot stays small).
    pub(super) body: Option<Box<Body>>,
    /// The send scheduler met `WouldBlock`: wait for the socket to be writable.
    pub(super) send_blocked: bool,
    /// A request is with the work stage; parse no further until it answers.
    pub(super) busy: bool,
    /// Close once the output is flushed.
    pub(super) closing: bool,
    /// The client has finished sending (a FIN: a half-close, or a close whose reset has not
    /// come yet). What it sent before is still answered, in order, and the connection closes
    /// after the last answer; the socket is not read again.
    pub(super) read_eof: bool,
    /// Its last answer is out and its write side shut down, and what the client still sends
    /// is read and dropped until it closes or this time comes (then it is closed): see
    /// [`linger`]. 0: not lingering.
    pub(super) lingering_until_ns: u64,
    /// Its client may still be sending when it closes (a parse error, a body refused or left
    /// unread): it lingers then, whether or not bytes wait in the socket at that moment.
    pub(super) linger_on_close: bool,
    /// Its response was cut (the proxy lost the backend mid-response): it closes without TLS
    /// close_notify, the one sign of the cut a client reading until the close has.
    pub(super) cut: bool,
    /// A continuation of it is queued in its activity ([`super::cont::yield_conn`]): its
    /// output waits for the tenant's turn, which is the server's wait, not the client's.
    pub(super) yielded: bool,
    /// When the request being received started (its first byte, or the accept).
    pub(super) request_start_ns: u64,
    /// When a write last made progress (or the send stage last offered bytes): a client that
    /// stops reading is closed after `keepalive_timeout` without progress. Time its output
    /// waits in the send scheduler does not count (`timer.rs`).
    pub(super) last_progress_ns: u64,
    pub(super) last_active_ns: u64,
    /// Its entry in the core's [`super::deadlines::Deadlines`] for header timeout, idleness
    /// and a stalled reader: when it falls due (0: none).
    pub(super) deadline_ns: u64,
    /// Its proxied request's entry in the core's deadlines: when it falls due (0: none).
    pub(super) proxy_timer_ns: u64,
    pub(super) requests: u64,
    /// The TLS side, on a TLS listener's connection (boxed: most connections have none).
    pub(super) tls: Option<Box<TlsConn>>,
    /// Its request is proxied to an upstream (boxed: most connections have none).
    pub(super) proxy: Option<Box<super::proxy::Proxied>>,
}

impl Conn {
    /// Writes up to `max` bytes of the pending output, through TLS on a TLS connection.
    pub(super) fn write_out(&mut self, max: usize) -> std::io::Result<usize> {
        match &mut self.tls {
            Some(t) => t.write_out(&mut self.out, &mut self.stream, max),
            None => self.out.write_to(&mut self.stream, max),
        }
    }

    /// Appends received bytes (plaintext) to the input buffer, taking one from the pool if it
    /// holds none; the first bytes of a request start its header clock.
    pub(super) fn take_input(&mut self, bytes: &[u8], now_ns: u64) {
        if self.inbuf.is_empty() {
            self.request_start_ns = now_ns;
        }
        if self.inbuf.capacity() == 0 {
            self.inbuf = pool::take_buf();
        }
        self.inbuf.extend_from_slice(bytes);
        self.last_active_ns = now_ns;
    }

    /// Whether it has nothing more to do: the client finished sending and everything it asked
    /// for is answered (see [`Conn::read_eof`]).
    pub(super) fn answered_all_after_eof(&self) -> bool {
        self.read_eof
            && !self.busy
            && self.out.is_empty()
            && self.body.is_none()
            && self.proxy.is_none()
            && self.inbuf.is_empty()
    }

    /// Whether bytes wait to be written: queued output, or records rustls holds.
    pub(super) fn sending(&self) -> bool {
        !self.out.is_empty() || self.tls.as_ref().is_some_and(|t| t.wants_write())
    }
}

/// Closes a connection and forgets it.
pub(super) fn close(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64) {
    let slot = (key & 0xFFFF_FFFF) as u32;
    if cs.conn(key).is_none() {
        return;
    }
    let Some(mut c) = cs.conns[slot as usize].take() else {
        return;
    };
    // Its deadlines go with it: nothing is left to fire for a slot that may be reused.
    cs.deadlines.remove(key, Kind::Conn, c.deadline_ns);
    cs.deadlines.remove(key, Kind::Proxy, c.proxy_timer_ns);
    // The socket is ours alone (accepted with CLOEXEC, never dup'd): closing it leaves epoll.
    let _ = ctx.io_close(c.handle, c.stream);
    if let Some(ss) = &mut cs.send {
        ss.forget(key);
        // Its tenant's link backlog for the fleet layer: whether output of it still waits.
        if let Some(t) = &c.tenant {
            t.fleet.note_send_waiting(ss.tenant_waits(t.activity));
        }
    }
    cs.free.push(slot);
    pool::give_buf(std::mem::take(&mut c.inbuf));
    cs.shared
        .stats
        .open_connections
        .fetch_sub(1, Ordering::AcqRel);
    if let Some(t) = c.tenant {
        t.open.fetch_sub(1, Ordering::AcqRel);
    }
    if let Some(p) = c.proxy {
        super::proxy::client_gone(ctx, cs, key, p);
    }
}

/// Reads what the socket holds, up to the input limit (through TLS on a TLS connection).
/// Returns false if the connection closed.
pub(super) fn read_more(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64) -> bool {
    read_more_then(ctx, cs, key, false)
}

/// [`read_more`], told whether the readiness event said the peer closed its side: then a read
/// that empties the socket's queue has also reached the FIN (it came after every byte), which
/// no later event would report (edge-triggered: data and FIN in one segment make one event).
pub(super) fn read_more_then(
    ctx: &mut Ctx<'_>,
    cs: &mut CoreServer,
    key: u64,
    peer_closed: bool,
) -> bool {
    if cs.conn(key).is_some_and(|c| c.lingering_until_ns != 0) {
        // Answered and shut down: what comes is dropped (false: nothing more to do with it).
        linger(ctx, cs, key);
        return false;
    }
    // A later request's head on a kept-alive connection starts the header clock as the first
    // one's does at the accept. The connection's deadline is then its keep-alive one (from
    // its last answer), which may be much later: a slow second head was given that long
    // (nginx-like 10 s / 75 s: 7.5 times the header timeout).
    let between_requests = cs
        .conn(key)
        .is_some_and(|c| c.requests > 0 && c.inbuf.is_empty());
    let open = read_into_buffer(ctx, cs, key, peer_closed);
    if open && between_requests {
        let header_ns = cs.live.config.server.header_timeout.as_nanos() as u64;
        if let Some(c) = cs.conn(key).filter(|c| !c.inbuf.is_empty()) {
            let due_ns = c.request_start_ns.saturating_add(header_ns);
            if c.deadline_ns == 0 || due_ns < c.deadline_ns {
                super::timer::set_deadline(ctx, cs, key, Kind::Conn, due_ns);
            }
        }
    }
    open
}

/// [`read_more_then`]'s reading.
fn read_into_buffer(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64, peer_closed: bool) -> bool {
    match cs.conn(key) {
        // Every later readiness event repeats the FIN; there is nothing more to read.
        Some(c) if c.read_eof => return true,
        Some(c) if c.tls.is_some() => return tls::read(ctx, cs, key),
        _ => {}
    }
    let limit = cs.limits.header_bytes_max + READ_CHUNK_BYTES;
    let now = ctx.now_ns();
    let CoreServer { conns, scratch, .. } = &mut *cs;
    let Some(c) = conns[(key & 0xFFFF_FFFF) as usize].as_mut() else {
        return false;
    };
    c.read_stalled = false;
    // Bounded: each round either fills the buffer toward `limit`, or ends.
    loop {
        if c.inbuf.len() >= limit {
            // TCP flow control holds the client until a request is taken out.
            c.read_stalled = true;
            return true;
        }
        match c.stream.read(scratch) {
            Ok(0) => {
                // A FIN. With nothing left to answer the connection closes now; else the
                // answers go out first (`printf ... | nc -N`: before, a response that needed a
                // second write was cut when the writable event repeated the FIN). A proxied
                // request is the exception: a client that gives up frees its slot or its place
                // in the queue (nginx's default, `proxy_ignore_client_abort off`).
                c.read_eof = true;
                if !c.answered_all_after_eof() && c.proxy.is_none() {
                    return true;
                }
                close(ctx, cs, key);
                return false;
            }
            Ok(n) => {
                c.take_input(&scratch[..n], now);
                // A short read means the kernel's queue is empty; new data makes a new edge.
                if n < scratch.len() {
                    if peer_closed {
                        c.read_eof = true;
                        if c.proxy.is_some() {
                            // As for a FIN read alone (`Ok(0)` above): a proxied request is
                            // abandoned.
                            close(ctx, cs, key);
                            return false;
                        }
                    }
                    return true;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => {
                close(ctx, cs, key);
                return false;
            }
        }
    }
}

/// Writes what is pending; streams the next chunks of a body under the credit window.
/// Returns false when the connection was closed.
pub(super) fn flush(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64) -> bool {
    let scheduled = cs.send.is_some();
    let pool = cs.shared.disk.get().cloned();
    let Some(c) = cs.conn(key) else { return false };
    if c.lingering_until_ns != 0 {
        // Everything went out before it began to linger.
        return false;
    }
    let pending = !c.out.is_empty() || c.body.is_some();
    if scheduled && pending {
        if let Some(tr) = c.tenant.clone() {
            // A tenant's bytes go out when the send scheduler says so (unless it cannot take
            // them: then they are written directly below).
            if c.send_blocked || schedule_send(ctx, cs, key, &tr) {
                return true;
            }
        }
    }
    let Some(c) = cs.conn(key) else { return false };
    let mut chunks = 0;
    let mut file_bytes_left = SENDFILE_BYTES_PER_DISPATCH_MAX;
    loop {
        while !c.out.is_empty() {
            let max = if c.out.front_is_file() {
                if file_bytes_left == 0 {
                    // Yield: the rest of the file goes out in a later dispatch.
                    let activity = c.activity;
                    yield_conn(ctx, cs, key, activity);
                    return true;
                }
                file_bytes_left
            } else {
                usize::MAX
            };
            let front_is_file = max != usize::MAX;
            match c.write_out(max) {
                Ok(0) => {
                    close(ctx, cs, key);
                    return false;
                }
                Ok(n) => {
                    c.last_progress_ns = ctx.now_ns();
                    if front_is_file {
                        file_bytes_left -= n;
                    }
                    if let Some(t) = &c.tenant {
                        let a = t.activity;
                        ctx.record_bytes_out(a, n as u64);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => {
                    close(ctx, cs, key);
                    return false;
                }
            }
        }
        let Some(body) = &mut c.body else { break };
        if body.remaining == 0 {
            c.body = None;
            break;
        }
        if chunks == FLOW_CHUNKS_PER_DISPATCH {
            // Yield: the rest goes out in a later dispatch of the same activity.
            let activity = c.activity;
            yield_conn(ctx, cs, key, activity);
            return true;
        }
        let n = (body.remaining as usize).min(FLOW_CHUNK_BYTES);
        match &body.source {
            Source::File(file) => {
                if let Some(pool) = &pool {
                    // The disk stage reads it; the bytes come back as a message.
                    if !body.in_flight {
                        let file = file.clone();
                        let (offset, tenant) = (body.offset, c.tenant.clone());
                        let read = ChunkRead {
                            file,
                            offset,
                            len: n,
                            direct: body.direct,
                        };
                        if !submit_read(ctx, cs, pool, key, tenant, read) {
                            close(ctx, cs, key);
                            return false;
                        }
                    }
                    return true;
                }
                let mut chunk = vec![0; n];
                if file.read_exact_at(&mut chunk, body.offset).is_err() {
                    // The file shrank under us: the length already sent cannot be honoured.
                    close(ctx, cs, key);
                    return false;
                }
                c.out.push_owned(chunk);
            }
            Source::Pattern => {
                let mut chunk = Vec::with_capacity(n);
                fill_pattern(&mut chunk, body.offset, n);
                c.out.push_owned(chunk);
            }
        }
        body.offset += n as u64;
        body.remaining -= n as u64;
        chunks += 1;
    }
    let done = c.closing || c.answered_all_after_eof();
    if let Some(t) = &mut c.tls {
        // Records rustls still holds (and, when closing, its close_notify) go out before the
        // connection is closed.
        if done && !c.cut {
            t.close_notify();
        }
        match t.push(&mut c.stream) {
            Ok(true) => {}
            // A writable event brings us back; the no-progress deadline bounds the wait.
            Ok(false) => return true,
            Err(_) => {
                close(ctx, cs, key);
                return false;
            }
        }
    }
    if done {
        linger_or_close(ctx, cs, key);
        return false;
    }
    true
}

/// Ends a connection whose last answer is out. If its client may still be sending (bytes of
/// it are unread: a body the server refused, pipelined requests after a `close`), the write
/// side is shut down and the connection lingers, reading and dropping what comes,
/// until the client closes or [`LINGER_NS`] passes. Closed at once instead, a socket with
/// unread bytes makes the kernel send a reset, not a FIN, and drop what of the answer it had
/// not sent: the client saw "connection reset" where the server had answered 400 or 413
/// (nginx's `lingering_close`).
fn linger_or_close(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64) {
    let now = ctx.now_ns();
    let Some(c) = cs.conn(key) else { return };
    if c.read_eof || c.proxy.is_some() || c.lingering_until_ns != 0 {
        close(ctx, cs, key);
        return;
    }
    // Only a client with bytes still unread may be sending more (nginx's heuristic too): one
    // that sent its request and nothing after is closed at once, as before, and holds no place
    // while it lingers. The socket is peeked (a system call) only when nothing cheaper says.
    let mut probe = [0u8; 1];
    let unread =
        c.linger_on_close || !c.inbuf.is_empty() || c.stream.peek(&mut probe).is_ok_and(|n| n > 0);
    if !unread {
        close(ctx, cs, key);
        return;
    }
    if c.stream.shutdown(std::net::Shutdown::Write).is_err() {
        close(ctx, cs, key);
        return;
    }
    c.lingering_until_ns = now.saturating_add(LINGER_NS);
    c.busy = false;
    pool::give_buf(std::mem::take(&mut c.inbuf));
    let until = c.lingering_until_ns;
    super::timer::set_deadline(ctx, cs, key, Kind::Conn, until);
    // Edge-triggered: what already waits in the socket makes no new event.
    linger(ctx, cs, key);
}

/// Reads and drops what a lingering connection's client sends; closes it at its EOF (or an
/// error). Returns false if it closed.
fn linger(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64) -> bool {
    let CoreServer { conns, scratch, .. } = &mut *cs;
    let Some(c) = conns[(key & 0xFFFF_FFFF) as usize].as_mut() else {
        return false;
    };
    debug_assert!(
        c.lingering_until_ns != 0,
        "linger on a connection that does not"
    );
    // Bounded per event: a client still sending after the last of these reads makes a new
    // event with its next bytes.
    for _ in 0..LINGER_READS_PER_EVENT_MAX {
        match c.stream.read(scratch) {
            Ok(0) => {
                close(ctx, cs, key);
                return false;
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => {
                close(ctx, cs, key);
                return false;
            }
        }
    }
    true
}

/// Appends `n` bytes of the `/_bytes` pattern starting at body offset `offset`.
pub(super) fn fill_pattern(out: &mut Vec<u8>, offset: u64, n: usize) {
    let mut at = (offset % PATTERN.len() as u64) as usize;
    let mut left = n;
    while left > 0 {
        let k = left.min(PATTERN.len() - at);
        out.extend_from_slice(&PATTERN[at..at + k]);
        left -= k;
        at = 0;
    }
}

/// What `step` did with the connection's input.
pub(super) enum Step {
    /// Nothing more to do now (waiting for bytes, for the work stage, or for the socket).
    Idle,
    /// Answered a request inline; there may be more.
    Answered,
    /// The connection is gone.
    Closed,
}

/// Parses and dispatches (or answers inline) the pipelined requests the connection holds, at
/// most `pipeline_depth_max` per call; if more remain, continues in a later dispatch of the
/// connection's activity. A loop, not recursion: a flood of pipelined requests costs no stack.
pub(super) fn drive(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64) {
    let depth_max = cs.live.config.server.pipeline_depth_max.max(1);
    for _ in 0..depth_max {
        match step(ctx, cs, key) {
            Step::Idle | Step::Closed => return,
            Step::Answered => {}
        }
    }
    if let Some(c) = cs.conn(key) {
        if !c.inbuf.is_empty() {
            let activity = c.activity;
            yield_conn(ctx, cs, key, activity);
        }
    }
}

pub(super) fn step(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64) -> Step {
    let limits = cs.limits;
    let Some(c) = cs.conn(key) else {
        return Step::Closed;
    };
    if c.lingering_until_ns != 0 {
        return Step::Closed;
    }
    if c.answered_all_after_eof() {
        // Through `flush`, not a bare close: over TLS, records rustls still holds and its
        // close_notify go out first (a client that half-closed waits for both).
        return if flush(ctx, cs, key) {
            Step::Idle
        } else {
            Step::Closed
        };
    }
    if c.busy
        || c.closing
        || c.body.is_some()
        || c.out.pending() > OUT_PENDING_BYTES_MAX
        || c.inbuf.is_empty()
    {
        return Step::Idle;
    }
    // Bodies are framed here and refused below where the route is not proxied.
    let (mut request, consumed) = match request::parse_with_body(&c.inbuf, &limits, pool::take_buf)
    {
        ParseOutcome::Partial if c.read_eof => {
            // Bytes the client's FIN cut short (half a head, or a stray line end after its last
            // request): they can never complete, but answers before them may still be going out.
            pool::give_buf(std::mem::take(&mut c.inbuf));
            c.closing = true;
            return if flush(ctx, cs, key) {
                Step::Idle
            } else {
                Step::Closed
            };
        }
        ParseOutcome::Partial => return Step::Idle,
        ParseOutcome::Error(e) => {
            pool::give_buf(std::mem::take(&mut c.inbuf));
            c.closing = true;
            c.linger_on_close = true;
            let date = cs.date();
            let c = cs.conn(key).expect("live");
            c.out
                .with_head(|b| response::error_response(b, e.status(), false, &date, &[]));
            count_status(&cs.shared.stats, e.status());
            flush(ctx, cs, key);
            return Step::Closed;
        }
        ParseOutcome::Complete { request, consumed } => (request, consumed),
    };
    if c.tenant.is_some() && c.sending() {
        // A pipelined request for another tenant waits, unconsumed, until the answers before
        // it are out (the end of that output drives this connection again): the bytes still
        // queued are the previous tenant's, to go out under its node and cap and be charged
        // to it, which moving the connection to the new tenant now would undo.
        let (prev, local) = (c.tenant.clone(), c.local);
        let live = cs.live.clone();
        let next = live
            .config
            .tenant_for(request.host(), local)
            .map(|t| &live.tenants[t]);
        if !matches!((&prev, next), (Some(p), Some(n)) if Arc::ptr_eq(p, n)) {
            recycle(request);
            return Step::Idle;
        }
    }
    let c = cs.conn(key).expect("live");
    c.inbuf.drain(..consumed);
    if c.inbuf.is_empty() {
        // Idle until the next request: the buffer goes back to the pool.
        pool::give_buf(std::mem::take(&mut c.inbuf));
        if c.read_eof {
            // The client's last request: its answer closes the connection.
            request.keep_alive = false;
        }
    }
    c.requests += 1;
    c.last_active_ns = ctx.now_ns();
    c.last_progress_ns = ctx.now_ns();
    c.request_start_ns = ctx.now_ns();
    let stalled = c.read_stalled;
    let local = c.local;
    if stalled && !read_more(ctx, cs, key) {
        return Step::Closed;
    }
    let live = cs.live.clone();
    let tenant = live.config.tenant_for(request.host(), local);
    let proxied = tenant.and_then(|t| live.config.tenants[t].upstream_for(request.target()));
    if proxied.is_none() {
        if let Some(e) = request.body_refusal() {
            // A body where none is served: we cannot step over it, so answer and close (what
            // the parser answers on a server without a proxy).
            let c = cs.conn(key).expect("live");
            pool::give_buf(std::mem::take(&mut c.inbuf));
            c.closing = true;
            c.linger_on_close = true;
            let date = cs.date();
            let c = cs.conn(key).expect("live");
            c.out
                .with_head(|b| response::error_response(b, e.status(), false, &date, &[]));
            count_status(&cs.shared.stats, e.status());
            recycle(request);
            flush(ctx, cs, key);
            return Step::Closed;
        }
    }
    // Answered here with a body still unread, the stream is out of step: close after (and
    // linger: the client may still be sending it).
    let keep = request.keep_alive
        && request.body == BodyFraming::None
        && !cs.shared.draining.load(Ordering::Relaxed);
    if request.body != BodyFraming::None && proxied.is_none() {
        cs.conn(key).expect("live").linger_on_close = true;
    }
    let Some(t) = tenant else {
        // No tenant serves this Host here.
        let step = answer_status(ctx, cs, key, &request, 421, keep);
        recycle(request);
        return step;
    };
    let tr = live.tenants[t].clone();
    let limit = live.config.tenants[t].connections_max;
    let c = cs.conn(key).expect("live");
    if !c.tenant.as_ref().is_some_and(|x| Arc::ptr_eq(x, &tr)) {
        if let Some(prev) = c.tenant.take() {
            prev.open.fetch_sub(1, Ordering::AcqRel);
            // Its send leaf hangs under the old tenant's node: start afresh.
            if let Some(ss) = &mut cs.send {
                ss.forget(key);
            }
        }
        let open = tr.open.fetch_add(1, Ordering::AcqRel);
        let c = cs.conn(key).expect("live");
        c.tenant = Some(tr.clone());
        if limit.is_some_and(|l| open >= l) {
            let step = answer_status(ctx, cs, key, &request, 503, false);
            recycle(request);
            return step;
        }
        c.activity = tr.activity;
        // From now on this connection's readiness is the tenant's work.
        let _ = ctx.io_set_activity(c.handle, tr.activity);
    }
    // A class of the tenant, if the request matches one (first match in config order);
    // a prefix is matched against the target as sent.
    let class = live.config.tenants[t]
        .classes
        .iter()
        .position(|c| match &c.selector {
            ClassSelector::Header { name, value } => {
                request.header_bytes(name) == Some(value.as_bytes())
            }
            ClassSelector::Prefix(p) => request.target().starts_with(p.as_str()),
        });
    let activity = class
        .and_then(|i| live.classes[t].get(i).copied())
        .unwrap_or(tr.activity);
    // Read before the request moves into the message: a refusal answers without it, and an
    // answer to HEAD has no body (one after a kept-alive HEAD is read as the next response).
    let head_only = request.method == Method::Head;
    // The tenant's fleet caps: a local lease pool, never a round trip to Redis.
    if !tr.fleet.admit() {
        recycle(request);
        return answer_overload(ctx, cs, key, keep, head_only);
    }
    let opts = SendOpts {
        activity: Some(activity),
        ..Default::default()
    };
    match ctx.send_with(&cs.stages.work, opts, Work { key, request }) {
        Ok(()) => {
            cs.conn(key).expect("live").busy = true;
            Step::Idle
        }
        Err(SendError::Rejected(_)) | Err(SendError::MailboxFull) => {
            answer_overload(ctx, cs, key, keep, head_only)
        }
        Err(_) => {
            let date = cs.date();
            let c = cs.conn(key).expect("live");
            c.out.with_head(|b| {
                let body_start = response::error_response(b, 500, false, &date, &[]);
                if head_only {
                    b.truncate(body_start);
                }
            });
            c.closing = true;
            count_status(&cs.shared.stats, 500);
            flush(ctx, cs, key);
            Step::Closed
        }
    }
}

/// Overload (an admission gate or a fleet cap said no): 503 + Retry-After at once, cheaply,
/// in the sender's context.
fn answer_overload(
    ctx: &mut Ctx<'_>,
    cs: &mut CoreServer,
    key: u64,
    keep: bool,
    head_only: bool,
) -> Step {
    let date = cs.date();
    let c = cs.conn(key).expect("live");
    c.out.with_head(|b| {
        let body_start =
            response::error_response(b, 503, keep, &date, &[("Retry-After", RETRY_AFTER_S)]);
        if head_only {
            b.truncate(body_start);
        }
    });
    c.closing |= !keep;
    cs.shared.stats.rejected_503.fetch_add(1, Ordering::Relaxed);
    count_status(&cs.shared.stats, 503);
    if flush(ctx, cs, key) {
        Step::Answered
    } else {
        Step::Closed
    }
}

/// Gives a served request's head buffer back to the worker's pool.
pub(super) fn recycle(request: Request) {
    pool::give_buf(request.into_buf());
}

fn count_status(stats: &ServerStats, status: u16) {
    stats.requests.fetch_add(1, Ordering::Relaxed);
    match status {
        400..=499 => stats.errors_4xx.fetch_add(1, Ordering::Relaxed),
        500..=599 => stats.errors_5xx.fetch_add(1, Ordering::Relaxed),
        _ => 0,
    };
}

pub(super) fn answer_error(
    ctx: &mut Ctx<'_>,
    cs: &mut CoreServer,
    key: u64,
    req: &Request,
    e: &HttpError,
    keep: bool,
) -> Step {
    let keep = keep && !e.closes_connection();
    let date = cs.date();
    let Some(c) = cs.conn(key) else {
        return Step::Closed;
    };
    let mut extra: Vec<(&str, &str)> = Vec::new();
    if let Some(l) = e.location() {
        extra.push(("Location", l));
    }
    let head_only = req.method == Method::Head;
    c.out.with_head(|b| {
        let body_start = response::error_response(b, e.status(), keep, &date, &extra);
        if head_only {
            b.truncate(body_start);
        }
    });
    c.closing |= !keep;
    finish(ctx, cs, key, req, e.status(), 0)
}

pub(super) fn answer_status(
    ctx: &mut Ctx<'_>,
    cs: &mut CoreServer,
    key: u64,
    req: &Request,
    status: u16,
    keep: bool,
) -> Step {
    let date = cs.date();
    let Some(c) = cs.conn(key) else {
        return Step::Closed;
    };
    let extra: &[(&str, &str)] = if status == 503 {
        &[("Retry-After", RETRY_AFTER_S)]
    } else {
        &[]
    };
    let head_only = req.method == Method::Head;
    c.out.with_head(|b| {
        let body_start = response::error_response(b, status, keep, &date, extra);
        if head_only {
            b.truncate(body_start);
        }
    });
    c.closing |= !keep;
    if status == 503 {
        cs.shared.stats.rejected_503.fetch_add(1, Ordering::Relaxed);
    }
    finish(ctx, cs, key, req, status, 0)
}

/// Logs the answer, marks the connection free for its next request, and writes.
pub(super) fn finish(
    ctx: &mut Ctx<'_>,
    cs: &mut CoreServer,
    key: u64,
    req: &Request,
    status: u16,
    bytes: u64,
) -> Step {
    let (method, target, minor) = (req.method_raw(), req.target(), req.version_minor);
    finish_logged(ctx, cs, key, method, target, minor, status, bytes)
}

/// [`finish`] for a request known by its method, target and version.
#[allow(clippy::too_many_arguments)]
pub(super) fn finish_logged(
    ctx: &mut Ctx<'_>,
    cs: &mut CoreServer,
    key: u64,
    method: &str,
    target: &str,
    version_minor: u8,
    status: u16,
    bytes: u64,
) -> Step {
    count_status(&cs.shared.stats, status);
    if cs.logging() {
        if let Some(c) = cs.conn(key) {
            let peer = c.peer.ip();
            let tenant = c.tenant.clone();
            let path = tenant.as_ref().map_or("/infra", |t| t.path.as_str());
            crate::log::clf_line(
                &mut cs.log,
                peer,
                SystemTime::now(),
                method,
                target,
                version_minor,
                status,
                bytes,
                path,
            );
            if cs.log.len() >= LOG_BUFFER_BYTES {
                cs.flush_log();
            }
        }
    }
    if let Some(c) = cs.conn(key) {
        c.busy = false;
        c.last_active_ns = ctx.now_ns();
    }
    if flush(ctx, cs, key) {
        Step::Answered
    } else {
        Step::Closed
    }
}

pub(super) fn on_conn(ctx: &mut Ctx<'_>, ev: IoEvent) {
    with_core(|cs| {
        cs.refresh(ctx);
        let key = ev.user;
        if cs.conn(key).is_none() {
            return;
        }
        if (ev.readable || ev.closed) && !read_more_then(ctx, cs, key, ev.closed) {
            return;
        }
        if ev.writable {
            if let Some(c) = cs.conn(key) {
                c.send_blocked = false;
            }
        }
        if flush(ctx, cs, key) {
            if cs.conn(key).is_some_and(|c| c.proxy.is_some()) {
                // Its request is proxied: move its body on, or the response once the client
                // made room.
                super::proxy::pump(ctx, cs, key);
            }
            drive(ctx, cs, key);
        }
    });
}
