//! The admin listener: a small blocking HTTP/1.1 server on its own threads, parsed with
//! `httparse`.
//!
//! One acceptor thread hands connections to a fixed pool of handler threads through a bounded
//! queue; when the queue is full, or the peer's address already has [`PEER_CONNECTIONS_MAX`]
//! connections accepted and not yet done, the acceptor answers 503 itself and closes. Each
//! connection carries one request (`Connection: close`), so an idle browser connection never
//! holds a handler thread. Limits: request head [`HEAD_BYTES_MAX`], [`HEADERS_MAX`] headers,
//! body [`BODY_BYTES_MAX`]; [`HEAD_TIMEOUT`] to receive the head and [`REQUEST_TIMEOUT`] the
//! whole request, both counted from the accept; [`WRITE_DEADLINE`] to write the whole answer.
//! At stop, connections still queued are answered 503 at once; only those in a handler are
//! finished.

use crate::routes::{self, Headers, Request, Response};
use crate::sampler::{self, State};
use crate::{AdminConfig, Source};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Largest request head (request line and headers).
pub(crate) const HEAD_BYTES_MAX: usize = 16 * 1024;
/// Most request headers.
pub(crate) const HEADERS_MAX: usize = 64;
/// Largest request body.
pub(crate) const BODY_BYTES_MAX: usize = 64 * 1024;
/// Time allowed to receive the request head, from the accept: a connection that sends nothing
/// holds a handler thread until then, so this bounds how long a request waits behind idle
/// connections (at 5 s, as long as the whole request may take, ~68 idle connections renewed
/// every 5 s kept every other client out). Every client of ours sends its head at once.
pub(crate) const HEAD_TIMEOUT: Duration = Duration::from_secs(1);
/// Time allowed to receive a whole request (head and body), from the accept.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Time allowed to write a whole answer: a client that reads it slowly (a few bytes at a time,
/// each write progressing) is cut off then rather than holding a handler thread for as long as
/// it likes.
pub(crate) const WRITE_DEADLINE: Duration = Duration::from_secs(5);
/// Time the acceptor spends writing a 503 itself (it accepts nothing meanwhile).
const REFUSAL_WRITE_DEADLINE: Duration = Duration::from_millis(100);
/// Accepted connections waiting for a handler thread.
pub(crate) const ACCEPT_QUEUE: usize = 64;
/// Most connections one peer address may have accepted and not yet done (waiting or being
/// served); past it the acceptor answers 503. Half the accept queue: one address cannot fill
/// it, so clients at other addresses still get in. Clients on the same host (loopback: `top`,
/// shaped launchers, a scraper) share one address and this bound; they hold a connection for a
/// request each, milliseconds.
pub(crate) const PEER_CONNECTIONS_MAX: usize = ACCEPT_QUEUE / 2;

pub(crate) struct Shared {
    pub(crate) source: Arc<dyn Source>,
    pub(crate) state: Arc<Mutex<State>>,
    pub(crate) token: Option<String>,
    /// Shaped groups attached from outside (`omnistage shape --admin`).
    pub(crate) shaped: Mutex<crate::shaped::Table>,
    /// Held by the routes that change the tree (`PUT`, `DELETE`, `:move`, `:attach`) from
    /// reading what they change to writing it: a `PUT` copies the activity's whole spec,
    /// changes its fields and writes the copy back, so two at once lost one's change.
    pub(crate) changes: Mutex<()>,
    /// The bounds of listings (entries, bytes).
    pub(crate) limits: routes::Limits,
}

/// The threads of a running admin server.
pub(crate) struct Running {
    addr: SocketAddr,
    stopping: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
    handlers: Vec<JoinHandle<()>>,
    sampler: Option<(JoinHandle<()>, SyncSender<()>)>,
}

impl Running {
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub(crate) fn stop(mut self) {
        self.stopping.store(true, Ordering::Release);
        // Wake the acceptor out of `accept` with a connection of our own.
        let wake = if self.addr.ip().is_unspecified() {
            SocketAddr::new(
                if self.addr.is_ipv4() {
                    std::net::Ipv4Addr::LOCALHOST.into()
                } else {
                    std::net::Ipv6Addr::LOCALHOST.into()
                },
                self.addr.port(),
            )
        } else {
            self.addr
        };
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(a) = self.acceptor.take() {
            // The acceptor owns the queue's sender: when it ends, the handlers see the queue
            // close and end after the requests in progress.
            let _ = a.join();
        }
        for h in self.handlers.drain(..) {
            let _ = h.join();
        }
        if let Some((t, stop)) = self.sampler.take() {
            let _ = stop.send(());
            let _ = t.join();
        }
    }
}

pub(crate) fn start(source: Arc<dyn Source>, cfg: AdminConfig) -> Result<Running, String> {
    let listener = TcpListener::bind(cfg.listen)
        .map_err(|e| format!("admin: cannot listen on {}: {e}", cfg.listen))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let state = Arc::new(Mutex::new(State::new(cfg.sample_interval)));
    // A first sample now, so rates exist one interval after start.
    sampler::tick_contained(&*source, &state);
    let shared = Arc::new(Shared {
        source: source.clone(),
        state: state.clone(),
        token: cfg.token.clone(),
        shaped: Default::default(),
        changes: Default::default(),
        limits: Default::default(),
    });
    let stopping = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::sync_channel::<Conn>(ACCEPT_QUEUE);
    let rx = Arc::new(Mutex::new(rx));
    let mut handlers = Vec::with_capacity(cfg.threads);
    for i in 0..cfg.threads {
        let rx = rx.clone();
        let shared = shared.clone();
        let stopping = stopping.clone();
        handlers.push(
            std::thread::Builder::new()
                .name(format!("omnistage-admin-{i}"))
                .spawn(move || handler_loop(&rx, &shared, &stopping))
                .map_err(|e| format!("admin: cannot start a thread: {e}"))?,
        );
    }
    let acceptor = {
        let stopping = stopping.clone();
        std::thread::Builder::new()
            .name("omnistage-admin-accept".into())
            .spawn(move || accept_loop(listener, tx, &stopping))
            .map_err(|e| format!("admin: cannot start a thread: {e}"))?
    };
    let (stop_tx, stop_rx) = mpsc::sync_channel::<()>(1);
    let sampler = {
        let interval = cfg.sample_interval;
        std::thread::Builder::new()
            .name("omnistage-admin-sampler".into())
            .spawn(move || sampler::run(source, state, interval, stop_rx))
            .map_err(|e| format!("admin: cannot start a thread: {e}"))?
    };
    Ok(Running {
        addr,
        stopping,
        acceptor: Some(acceptor),
        handlers,
        sampler: Some((sampler, stop_tx)),
    })
}

/// Connections accepted and not yet done, by peer address.
#[derive(Default)]
struct Peers(Mutex<HashMap<IpAddr, usize>>);

impl Peers {
    /// A slot for one more connection of `ip`, or `None` at [`PEER_CONNECTIONS_MAX`].
    fn take(self: &Arc<Self>, ip: IpAddr) -> Option<PeerSlot> {
        let mut m = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let n = m.entry(ip).or_insert(0);
        if *n >= PEER_CONNECTIONS_MAX {
            return None;
        }
        *n += 1;
        Some(PeerSlot {
            peers: self.clone(),
            ip,
        })
    }
}

/// One connection's place in [`Peers`], given back when it is done.
struct PeerSlot {
    peers: Arc<Peers>,
    ip: IpAddr,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut m = self.peers.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = m.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
    }
}

/// An accepted connection on its way to a handler.
struct Conn {
    stream: TcpStream,
    /// When it was accepted: the request's deadlines count from here, so time spent waiting in
    /// the queue is not given again.
    accepted: Instant,
    _slot: PeerSlot,
}

fn refuse(mut s: TcpStream, msg: &str) {
    let r = Response::error(503, msg);
    let _ = write_response_by(&mut s, &r, Instant::now() + REFUSAL_WRITE_DEADLINE);
    let _ = s.shutdown(Shutdown::Both);
}

/// At most one line about accept errors per this long.
pub(crate) const ACCEPT_ERROR_EVERY: Duration = Duration::from_secs(1);

/// How the acceptor reports its errors on stderr: an error that repeats (out of descriptors,
/// EMFILE, comes back every 10 ms) writes at most one line per [`ACCEPT_ERROR_EVERY`], which
/// counts the errors left out since the previous line.
#[derive(Default)]
struct AcceptErrors {
    /// When the last line was written.
    last_line: Option<Instant>,
    /// Errors since then not written.
    suppressed: u64,
}

impl AcceptErrors {
    /// Reports `e`, seen at `now`, on `out` (a failed write is ignored: `eprintln!` panics
    /// then).
    fn report(&mut self, e: &std::io::Error, now: Instant, out: &mut dyn Write) {
        if self
            .last_line
            .is_some_and(|t| now.saturating_duration_since(t) < ACCEPT_ERROR_EVERY)
        {
            self.suppressed += 1;
            return;
        }
        let _ = if self.suppressed > 0 {
            writeln!(
                out,
                "omnistage admin: accept: {e} ({} more suppressed since the last line)",
                self.suppressed
            )
        } else {
            writeln!(out, "omnistage admin: accept: {e}")
        };
        self.last_line = Some(now);
        self.suppressed = 0;
    }
}

fn accept_loop(listener: TcpListener, tx: SyncSender<Conn>, stopping: &AtomicBool) {
    let peers = Arc::new(Peers::default());
    let mut errors = AcceptErrors::default();
    loop {
        let conn = listener.accept();
        if stopping.load(Ordering::Acquire) {
            return;
        }
        let (stream, peer) = match conn {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors and the like: back off briefly rather than spin.
                errors.report(&e, Instant::now(), &mut std::io::stderr().lock());
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let Some(slot) = peers.take(peer.ip()) else {
            refuse(
                stream,
                &format!(
                    "{PEER_CONNECTIONS_MAX} connections from {} are open already; try again",
                    peer.ip()
                ),
            );
            continue;
        };
        let conn = Conn {
            stream,
            accepted: Instant::now(),
            _slot: slot,
        };
        match tx.try_send(conn) {
            Ok(()) => {}
            Err(TrySendError::Full(c)) => {
                refuse(c.stream, "the admin server is busy; try again");
            }
            Err(TrySendError::Disconnected(_)) => return,
        }
    }
}

fn handler_loop(rx: &Mutex<Receiver<Conn>>, shared: &Shared, stopping: &AtomicBool) {
    // A panic in a handler is reported (and counted in /metrics) as the admin stage's.
    omnistage::exec::panic::set_thread_stage("admin");
    loop {
        let next = rx.lock().unwrap_or_else(PoisonError::into_inner).recv();
        match next {
            // Connections still queued at stop are answered 503 and closed at once: serving
            // them (each up to its read and write deadlines) kept a stopped server answering
            // for over a minute.
            Ok(c) if stopping.load(Ordering::Acquire) => refuse_at_once(c.stream),
            Ok(mut c) => serve(&mut c.stream, c.accepted, shared),
            Err(_) => return,
        }
    }
}

/// 503 "stopping" without waiting for the peer: one non-blocking write (a fresh connection's
/// send buffer takes the few hundred bytes), then close.
fn refuse_at_once(s: TcpStream) {
    let r = Response::error(503, "the admin server is stopping");
    if s.set_nonblocking(true).is_ok() {
        let mut s = s;
        let _ = s.write(&response_bytes(&r));
        let _ = s.shutdown(Shutdown::Both);
    }
}

/// Why a request could not be read.
#[derive(Debug)]
enum ReadError {
    /// Answer with this and close.
    Answer(Response),
    /// The peer went away or timed out: close without answering.
    Gone,
}

fn serve(s: &mut TcpStream, accepted: Instant, shared: &Shared) {
    let _ = s.set_nodelay(true);
    let resp = match read_request(s, accepted) {
        Ok(req) => {
            // A handler that panics answers 500 and the thread goes on.
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                routes::handle(shared, &req)
            }))
            .unwrap_or_else(|_| Response::error(500, "internal error"))
        }
        Err(ReadError::Answer(r)) => r,
        Err(ReadError::Gone) => return,
    };
    let _ = write_response(s, &resp);
    let _ = s.shutdown(Shutdown::Write);
    // Let the peer read the answer before the socket closes (bounded, small).
    let _ = s.set_read_timeout(Some(Duration::from_millis(50)));
    let mut sink = [0u8; 1024];
    for _ in 0..4 {
        match s.read(&mut sink) {
            Ok(n) if n > 0 => continue,
            _ => break,
        }
    }
}

/// A request head: its length in bytes, the request without its body, and the body's length.
pub(crate) struct Head {
    pub(crate) len: usize,
    pub(crate) request: Request,
    pub(crate) content_length: usize,
}

/// Parses the request head at the front of `buf`: `Ok(None)` while it is incomplete (and
/// within [`HEAD_BYTES_MAX`]), `Err` with the answer for a head that is refused.
pub(crate) fn parse_head(buf: &[u8]) -> Result<Option<Head>, Response> {
    let mut headers = [httparse::EMPTY_HEADER; HEADERS_MAX];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => {
            let method = req.method.unwrap_or("").to_string();
            let target = req.path.unwrap_or("").to_string();
            let mut cl: Option<usize> = None;
            let mut hdrs = Headers::default();
            let text = |v: &[u8]| String::from_utf8_lossy(v).trim().to_string();
            for h in req.headers.iter() {
                if h.name.eq_ignore_ascii_case("content-length") {
                    let v = std::str::from_utf8(h.value)
                        .ok()
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .ok_or_else(|| Response::error(400, "bad Content-Length"))?;
                    if cl.is_some_and(|c| c != v) {
                        return Err(Response::error(400, "conflicting Content-Length headers"));
                    }
                    cl = Some(v);
                } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                    return Err(Response::error(
                        411,
                        "send the body with Content-Length (no Transfer-Encoding)",
                    ));
                } else if h.name.eq_ignore_ascii_case("authorization") {
                    hdrs.authorization = Some(text(h.value));
                } else if h.name.eq_ignore_ascii_case("host") {
                    hdrs.host = Some(text(h.value));
                } else if h.name.eq_ignore_ascii_case("origin") {
                    hdrs.origin = Some(text(h.value));
                } else if h.name.eq_ignore_ascii_case("content-type") {
                    hdrs.content_type = Some(text(h.value));
                }
            }
            let content_length = cl.unwrap_or(0);
            if content_length > BODY_BYTES_MAX {
                return Err(Response::error(413, "request body larger than 64 KiB"));
            }
            let (path, query) = match target.split_once('?') {
                Some((p, q)) => (p.to_string(), q.to_string()),
                None => (target, String::new()),
            };
            Ok(Some(Head {
                len: n,
                request: Request {
                    method,
                    path,
                    query,
                    headers: hdrs,
                    body: Vec::new(),
                },
                content_length,
            }))
        }
        Ok(httparse::Status::Partial) if buf.len() >= HEAD_BYTES_MAX => {
            Err(Response::error(431, "request head larger than 16 KiB"))
        }
        Ok(httparse::Status::Partial) => Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            Err(Response::error(431, "more than 64 request headers"))
        }
        Err(e) => Err(Response::error(400, &format!("malformed request: {e}"))),
    }
}

/// Reads one request: its head by `accepted` + [`HEAD_TIMEOUT`], all of it by `accepted` +
/// [`REQUEST_TIMEOUT`].
fn read_request(s: &mut TcpStream, accepted: Instant) -> Result<Request, ReadError> {
    let head_deadline = accepted + HEAD_TIMEOUT;
    let deadline = accepted + REQUEST_TIMEOUT;
    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    let head = loop {
        match parse_head(&buf) {
            Ok(Some(h)) => break h,
            Ok(None) => read_some(s, &mut buf, &mut chunk, head_deadline, HEAD_BYTES_MAX)?,
            Err(r) => return Err(ReadError::Answer(r)),
        }
    };
    let end = head.len + head.content_length;
    while buf.len() < end {
        read_some(s, &mut buf, &mut chunk, deadline, end)?;
    }
    let mut req = head.request;
    req.body = buf[head.len..end].to_vec();
    Ok(req)
}

fn timed_out() -> ReadError {
    ReadError::Answer(Response::error(408, "request not received in time"))
}

/// Reads more bytes (at most up to `limit` in `buf`) before the deadline. Past it (a
/// connection that waited in the queue longer than its deadline), only bytes that have arrived
/// already are read: a request sent at once is still served, an idle connection is answered at
/// once.
fn read_some(
    s: &mut TcpStream,
    buf: &mut Vec<u8>,
    chunk: &mut [u8],
    deadline: Instant,
    limit: usize,
) -> Result<(), ReadError> {
    let left = deadline.saturating_duration_since(Instant::now());
    let late = left.is_zero();
    if late {
        s.set_nonblocking(true).map_err(|_| ReadError::Gone)?;
    } else {
        let _ = s.set_read_timeout(Some(left));
    }
    let want = limit.saturating_sub(buf.len()).clamp(1, chunk.len());
    let res = s.read(&mut chunk[..want]);
    if late {
        s.set_nonblocking(false).map_err(|_| ReadError::Gone)?;
    }
    match res {
        Ok(0) => Err(ReadError::Gone),
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted && !late => Ok(()),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock
                    | std::io::ErrorKind::TimedOut
                    | std::io::ErrorKind::Interrupted
            ) =>
        {
            Err(timed_out())
        }
        Err(_) => Err(ReadError::Gone),
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        204 => "No Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Content Too Large",
        415 => "Unsupported Media Type",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        507 => "Insufficient Storage",
        _ => "",
    }
}

/// Writes `r` within [`WRITE_DEADLINE`].
fn write_response(s: &mut TcpStream, r: &Response) -> std::io::Result<()> {
    write_response_by(s, r, Instant::now() + WRITE_DEADLINE)
}

/// Writes `r` by `deadline`, however slowly the peer reads.
fn write_response_by(s: &mut TcpStream, r: &Response, deadline: Instant) -> std::io::Result<()> {
    write_all_by(s, &response_bytes(r), deadline)
}

/// `r` as it goes on the wire.
fn response_bytes(r: &Response) -> Vec<u8> {
    let mut head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\nCache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n",
        r.status,
        reason(r.status),
        r.content_type,
        r.body.len()
    );
    for (k, v) in &r.headers {
        head.push_str(k);
        head.push_str(": ");
        head.push_str(v);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(&r.body);
    out
}

/// `write_all` that gives up at `deadline`: each write may block only for the time left (a
/// per-call timeout alone restarts with every write that progresses).
fn write_all_by(s: &mut TcpStream, mut bytes: &[u8], deadline: Instant) -> std::io::Result<()> {
    while !bytes.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "answer not written by its deadline",
            ));
        }
        s.set_write_timeout(Some(left))?;
        match s.write(bytes) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use omnistage::exec::Runtime;
    use std::sync::atomic::{AtomicU64, AtomicUsize};

    /// A source whose runtime the sampler thread can reach once; from its second call on, it
    /// panics there (the first sample, taken at start on the caller's thread, and the request
    /// handlers are served).
    struct Flaky {
        rt: Runtime,
        sampler_calls: AtomicUsize,
        /// `Runtime::now_ns` at the first panic (0: none yet).
        first_panic_ns: AtomicU64,
    }

    impl Source for Flaky {
        fn runtime(&self) -> &Runtime {
            if std::thread::current().name() == Some("omnistage-admin-sampler")
                && self.sampler_calls.fetch_add(1, Ordering::SeqCst) >= 1
            {
                let _ = self.first_panic_ns.compare_exchange(
                    0,
                    self.rt.now_ns().max(1),
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                );
                panic!("the sampler's source fails (expected by the test)");
            }
            &self.rt
        }
    }

    fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
        let end = Instant::now() + Duration::from_secs(20);
        while !f() {
            assert!(Instant::now() < end, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    struct Plain(Runtime);

    impl Source for Plain {
        fn runtime(&self) -> &Runtime {
            &self.0
        }
    }

    /// One address has at most [`PEER_CONNECTIONS_MAX`] connections in: the next one is
    /// answered 503 by the acceptor at once, and once they are done the address gets in again.
    #[test]
    fn one_address_has_at_most_its_share_of_the_connections() {
        let cfg = AdminConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            token: None,
            sample_interval: Duration::from_secs(1),
            threads: 1,
        };
        let running = start(
            Arc::new(Plain(Runtime::builder().workers(1).start().unwrap())),
            cfg,
        )
        .unwrap();
        let addr = running.local_addr();
        // Idle (each is answered 408 a second after its accept; these take milliseconds).
        let idle: Vec<TcpStream> = (0..PEER_CONNECTIONS_MAX)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        let mut extra = TcpStream::connect(addr).unwrap();
        extra
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut out = Vec::new();
        let _ = extra.read_to_end(&mut out);
        let text = String::from_utf8_lossy(&out);
        assert!(text.starts_with("HTTP/1.1 503 "), "{text}");
        assert!(
            text.contains(&format!(
                "{PEER_CONNECTIONS_MAX} connections from 127.0.0.1"
            )),
            "{text}"
        );
        drop(idle);
        let c = crate::client::Client::new(&format!("http://{addr}"), None).unwrap();
        wait_for("the address to get in again", || {
            c.request("GET", "/api/v1/tree", None)
                .is_ok_and(|r| r.status == 200)
        });
        running.stop();
    }

    /// A sampler that panics goes on sampling (each failure counted), and once its last good
    /// sample is stale the tree gives no rates instead of that sample's as current (the thread
    /// once died, and the API served its last window as current for good).
    #[test]
    fn a_panicking_sampler_is_reported_stale() {
        let flaky = Arc::new(Flaky {
            rt: Runtime::builder().workers(1).start().unwrap(),
            sampler_calls: AtomicUsize::new(0),
            first_panic_ns: AtomicU64::new(0),
        });
        let cfg = AdminConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            token: None,
            sample_interval: Duration::from_millis(50),
            threads: 1,
        };
        let running = start(flaky.clone(), cfg).unwrap();
        let c =
            crate::client::Client::new(&format!("http://{}", running.local_addr()), None).unwrap();
        let tree = || -> serde_json::Value {
            let r = c.request("GET", "/api/v1/tree", None).unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
            serde_json::from_slice(&r.body).unwrap()
        };
        wait_for("the sampler's first panic", || {
            flaky.first_panic_ns.load(Ordering::SeqCst) != 0
        });
        // The last good sample is older than the panic; wait (on the runtime's clock) until it
        // is older than the staleness bound: two intervals, at least one second.
        let panic_ns = flaky.first_panic_ns.load(Ordering::SeqCst);
        wait_for("the last sample to grow stale", || {
            flaky.rt.now_ns() > panic_ns + 2_000_000_000
        });
        let t = tree();
        assert!(t["root"]["rate"].is_null(), "stale rates served: {t}");
        assert!(t["interval_s"].is_null(), "{t}");
        assert!(t["sample_age_s"].as_f64().unwrap() >= 2.0, "{t}");
        // The sampler thread is alive and counts each failure.
        let failures = t["sampler_failures"].as_u64().unwrap();
        assert!(failures >= 1, "{t}");
        wait_for("another failure counted", || {
            tree()["sampler_failures"].as_u64().unwrap() > failures
        });
        running.stop();
    }
}

#[cfg(test)]
mod accept_error_tests {
    use super::*;

    /// An accept error that repeats (EMFILE: every 10 ms while descriptors are short) writes at
    /// most one line a second, which counts the ones left out since the last line. (Each was
    /// written: a hundred lines a second.) Times are given, not waited for.
    #[test]
    fn a_repeating_accept_error_is_reported_once_a_second() {
        let mut errors = AcceptErrors::default();
        let mut out: Vec<u8> = Vec::new();
        let t0 = Instant::now();
        let e = std::io::Error::from_raw_os_error(24); // EMFILE
                                                       // Two seconds of errors every 10 ms, then one more after a pause.
        for i in 0..200u64 {
            errors.report(&e, t0 + Duration::from_millis(10 * i), &mut out);
        }
        errors.report(&e, t0 + Duration::from_secs(5), &mut out);
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(
            lines
                .iter()
                .all(|l| l.starts_with("omnistage admin: accept: ")),
            "{text}"
        );
        assert!(!lines[0].contains("suppressed"), "{text}");
        // At 1 s: the 99 since the first; at 5 s: the 99 after 1 s up to 1.99 s.
        assert!(lines[1].contains("99 more suppressed"), "{text}");
        assert!(lines[2].contains("99 more suppressed"), "{text}");
    }
}

#[cfg(test)]
mod stop_tests {
    use super::*;
    use omnistage::exec::Runtime;
    use std::sync::mpsc;

    /// A source whose handler thread stops in its first request until the test lets it go.
    struct Gated {
        rt: Runtime,
        gate: Mutex<Option<(mpsc::Sender<()>, mpsc::Receiver<()>)>>,
    }

    impl Source for Gated {
        fn runtime(&self) -> &Runtime {
            if std::thread::current().name() == Some("omnistage-admin-0") {
                let gate = self.gate.lock().unwrap().take();
                if let Some((entered, release)) = gate {
                    entered.send(()).unwrap();
                    release
                        .recv_timeout(Duration::from_secs(20))
                        .expect("released by the test");
                }
            }
            &self.rt
        }
    }

    fn send_tree(addr: SocketAddr) -> TcpStream {
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(b"GET /api/v1/tree HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            .unwrap();
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        c
    }

    fn answer(mut c: TcpStream) -> String {
        let mut out = Vec::new();
        let _ = c.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    }

    /// Connections waiting in the accept queue when the server stops are answered 503 at once,
    /// not served; the request in progress is finished. (They were served one after another,
    /// each up to its read and write deadlines: a stopped server answered for over a minute.)
    #[test]
    fn stop_answers_the_queued_connections_at_once() {
        let (entered_tx, entered_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel();
        let src = Arc::new(Gated {
            rt: Runtime::builder().workers(1).start().unwrap(),
            gate: Mutex::new(Some((entered_tx, release_rx))),
        });
        let cfg = AdminConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            token: None,
            sample_interval: Duration::from_secs(1),
            threads: 1,
        };
        let running = start(src, cfg).unwrap();
        let addr = running.local_addr();
        let stopping = running.stopping.clone();
        // The one handler is busy with this request until released.
        let busy = send_tree(addr);
        entered_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the handler took the first request");
        // These wait in the queue.
        let queued: Vec<TcpStream> = (0..3).map(|_| send_tree(addr)).collect();
        let (stopped_tx, stopped_rx) = mpsc::channel();
        let stopper = std::thread::spawn(move || {
            running.stop();
            let _ = stopped_tx.send(());
        });
        let end = Instant::now() + Duration::from_secs(20);
        while !stopping.load(Ordering::Acquire) {
            assert!(Instant::now() < end, "stop did not begin");
            std::thread::sleep(Duration::from_millis(2));
        }
        release_tx.send(()).unwrap();
        let first = answer(busy);
        assert!(first.starts_with("HTTP/1.1 200 "), "{first}");
        for c in queued {
            let text = answer(c);
            // 503, or nothing at all (a connection the acceptor had not taken yet is reset
            // when the listener closes): never served.
            assert!(
                text.is_empty() || text.starts_with("HTTP/1.1 503 "),
                "a connection queued at stop was served: {text}"
            );
        }
        stopped_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("stop returned");
        stopper.join().unwrap();
    }
}

#[cfg(test)]
mod write_tests {
    use super::*;
    use std::sync::mpsc;

    /// A client that reads its answer slowly (64 KiB every 100 ms: steady progress, so no single
    /// write ever waits long) holds the handler only until the answer's deadline, not for as
    /// long as it takes to read it all.
    #[test]
    fn a_slow_reader_is_cut_off_at_the_write_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut c = TcpStream::connect(addr).unwrap();
                let mut buf = vec![0u8; 64 * 1024];
                while !stop.load(Ordering::Relaxed) {
                    match c.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(_) => std::thread::sleep(Duration::from_millis(100)),
                    }
                }
            })
        };
        let (mut s, _) = listener.accept().unwrap();
        // Far more than the socket buffers hold: 64 MiB at 640 KiB/s would take 100 s.
        let r = Response {
            status: 200,
            content_type: "text/plain",
            headers: Vec::new(),
            body: vec![b'x'; 64 << 20],
        };
        let (tx, rx) = mpsc::channel();
        let writer = std::thread::spawn(move || {
            let t = Instant::now();
            let res = write_response(&mut s, &r);
            let _ = tx.send((res.is_ok(), t.elapsed()));
        });
        let got = rx.recv_timeout(Duration::from_secs(8));
        stop.store(true, Ordering::Relaxed);
        reader.join().unwrap();
        writer.join().unwrap();
        let (ok, took) = got.expect("the write ended within its deadline and a margin");
        assert!(
            !ok,
            "a 64 MiB answer was written to a slow reader in {took:?}"
        );
        assert!(took >= WRITE_DEADLINE, "{took:?}");
    }
}
