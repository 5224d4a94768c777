//! The backend the proxy experiments put behind omnistage and nginx: one thread, one mio event
//! loop, pinned to a CPU, answering every request with the same fixed response over HTTP/1.1
//! keep-alive. It is deliberately cheap and identical for both proxies, so the proxies' own
//! costs are what differ.
//!
//! With a `delay`, each request is held that long before its response is written (a timer
//! heap, never a thread per request), and the backend does not limit how many it holds: it is
//! a slow service whose concurrency is whatever its callers send. It counts the requests it
//! holds itself ([`Backend::tally`]: the time-weighted mean of requests in flight between two
//! readings), so "the backend stays busy" is measured by the backend, not by the proxy in
//! front of it.
//!
//! It reads request heads only (the proxies here send GETs without bodies); a request with a
//! body, a head over [`HEAD_BYTES_MAX`] or a connection over [`CONNECTIONS_MAX`] is closed.

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::io::{ErrorKind, Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Longest request head read; a longer one closes the connection.
pub const HEAD_BYTES_MAX: usize = 16 * 1024;
/// Most connections at once; more are closed at accept.
pub const CONNECTIONS_MAX: usize = 65_536;
/// The event loop looks at the stop flag at least this often.
const STOP_CHECK: Duration = Duration::from_millis(50);
const LISTENER: Token = Token(usize::MAX);

/// What the backend has done, as counted by itself.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Tally {
    /// Responses written in full.
    pub responses: u64,
    /// Requests held now (only with a delay).
    pub in_flight: u64,
    /// Most requests held at once since the last [`Backend::tally_window`] (or the start).
    pub in_flight_max: u64,
    /// ∫ in_flight dt, request-seconds, up to the reading.
    pub in_flight_area_s: f64,
}

impl Tally {
    /// Mean requests in flight between an earlier reading `a` and this one, `seconds` apart.
    pub fn mean_in_flight_since(&self, a: &Tally, seconds: f64) -> f64 {
        if seconds <= 0.0 {
            return 0.0;
        }
        (self.in_flight_area_s - a.in_flight_area_s) / seconds
    }
}

struct Counts {
    tally: Tally,
    /// When `in_flight` last changed.
    since: Instant,
}

impl Counts {
    fn add_in_flight(&mut self, delta: i64, now: Instant) {
        let t = &mut self.tally;
        t.in_flight_area_s += t.in_flight as f64 * now.duration_since(self.since).as_secs_f64();
        self.since = now;
        t.in_flight = (t.in_flight as i64 + delta).max(0) as u64;
        t.in_flight_max = t.in_flight_max.max(t.in_flight);
    }
}

/// A running backend; stopped (and its thread joined) on drop.
pub struct Backend {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    counts: Arc<Mutex<Counts>>,
    thread: Option<JoinHandle<()>>,
}

impl Backend {
    /// Starts a backend on `127.0.0.1:0` answering `body_bytes` bytes after `delay`, its thread
    /// pinned to `cpu`.
    pub fn start(body_bytes: usize, delay: Duration, cpu: usize) -> Result<Backend, String> {
        let std_listener =
            std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("backend: {e}"))?;
        std_listener
            .set_nonblocking(true)
            .map_err(|e| e.to_string())?;
        let addr = std_listener.local_addr().map_err(|e| e.to_string())?;
        let mut listener = TcpListener::from_std(std_listener);
        let poll = Poll::new().map_err(|e| e.to_string())?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)
            .map_err(|e| e.to_string())?;
        let mut response = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {body_bytes}\r\n\r\n"
        )
        .into_bytes();
        response.extend((0..body_bytes).map(|i| b'a' + (i % 26) as u8));
        let stop = Arc::new(AtomicBool::new(false));
        let counts = Arc::new(Mutex::new(Counts {
            tally: Tally::default(),
            since: Instant::now(),
        }));
        let mut lp = Loop {
            poll,
            listener,
            conns: HashMap::new(),
            next_token: 0,
            due: BinaryHeap::new(),
            response,
            delay,
            counts: counts.clone(),
        };
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("exp-backend".into())
            .spawn(move || {
                pin(cpu);
                lp.run(&stop2);
            })
            .map_err(|e| e.to_string())?;
        Ok(Backend {
            addr,
            stop,
            counts,
            thread: Some(thread),
        })
    }

    /// As [`Backend::tally`], and starts a new window for `in_flight_max` (the most held from
    /// now on).
    pub fn tally_window(&self) -> Tally {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        c.add_in_flight(0, Instant::now());
        let t = c.tally;
        c.tally.in_flight_max = c.tally.in_flight;
        t
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The counts now, the in-flight area brought up to this instant.
    pub fn tally(&self) -> Tally {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        c.add_in_flight(0, Instant::now());
        c.tally
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

use super::harness::pin_this_thread as pin;

struct Conn {
    stream: TcpStream,
    inbuf: Vec<u8>,
    out_pos: Option<usize>,
    /// A request is held until its due time.
    held: bool,
    close_after: bool,
}

struct Loop {
    poll: Poll,
    listener: TcpListener,
    conns: HashMap<usize, Conn>,
    /// Tokens are never reused, so a due entry of a closed connection finds nothing.
    next_token: usize,
    due: BinaryHeap<Reverse<(Instant, usize)>>,
    response: Vec<u8>,
    delay: Duration,
    counts: Arc<Mutex<Counts>>,
}

enum Step {
    Keep,
    Close,
}

impl Loop {
    fn run(&mut self, stop: &AtomicBool) {
        let mut events = Events::with_capacity(1024);
        while !stop.load(Ordering::Relaxed) {
            let now = Instant::now();
            let timeout = self
                .due
                .peek()
                .map(|Reverse((t, _))| t.saturating_duration_since(now))
                .unwrap_or(STOP_CHECK)
                .min(STOP_CHECK);
            if let Err(e) = self.poll.poll(&mut events, Some(timeout)) {
                if e.kind() == ErrorKind::Interrupted {
                    continue;
                }
                return;
            }
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => self.accept(),
                    Token(t) => {
                        if let Step::Close = self.serve(t) {
                            self.close(t);
                        }
                    }
                }
            }
            let now = Instant::now();
            while let Some(&Reverse((at, t))) = self.due.peek() {
                if at > now {
                    break;
                }
                self.due.pop();
                self.counts
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .add_in_flight(-1, now);
                let step = match self.conns.get_mut(&t) {
                    Some(c) => {
                        c.held = false;
                        c.out_pos = Some(0);
                        self.serve(t)
                    }
                    None => Step::Keep,
                };
                if let Step::Close = step {
                    self.close(t);
                }
            }
        }
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((mut stream, _)) => {
                    if self.conns.len() >= CONNECTIONS_MAX {
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    let t = self.next_token;
                    self.next_token += 1;
                    if self
                        .poll
                        .registry()
                        .register(
                            &mut stream,
                            Token(t),
                            Interest::READABLE | Interest::WRITABLE,
                        )
                        .is_ok()
                    {
                        self.conns.insert(
                            t,
                            Conn {
                                stream,
                                inbuf: Vec::with_capacity(1024),
                                out_pos: None,
                                held: false,
                                close_after: false,
                            },
                        );
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return,
            }
        }
    }

    fn close(&mut self, t: usize) {
        if let Some(mut c) = self.conns.remove(&t) {
            let _ = self.poll.registry().deregister(&mut c.stream);
        }
    }

    /// Reads what there is, writes what is due, takes the next request: until the socket
    /// would block or a request is held.
    fn serve(&mut self, t: usize) -> Step {
        let Some(c) = self.conns.get_mut(&t) else {
            return Step::Keep;
        };
        let mut buf = [0u8; 4096];
        loop {
            match c.stream.read(&mut buf) {
                Ok(0) => return Step::Close,
                Ok(n) => {
                    if c.inbuf.len() + n > HEAD_BYTES_MAX {
                        return Step::Close;
                    }
                    c.inbuf.extend_from_slice(&buf[..n]);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return Step::Close,
            }
        }
        loop {
            if let Some(pos) = c.out_pos {
                let mut pos = pos;
                while pos < self.response.len() {
                    match c.stream.write(&self.response[pos..]) {
                        Ok(0) => return Step::Close,
                        Ok(n) => pos += n,
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {
                            c.out_pos = Some(pos);
                            return Step::Keep;
                        }
                        Err(e) if e.kind() == ErrorKind::Interrupted => {}
                        Err(_) => return Step::Close,
                    }
                }
                c.out_pos = None;
                self.counts
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .tally
                    .responses += 1;
                if c.close_after {
                    return Step::Close;
                }
            }
            if c.held {
                return Step::Keep;
            }
            let Some(end) = c.inbuf.windows(4).position(|w| w == b"\r\n\r\n") else {
                return Step::Keep;
            };
            let head = String::from_utf8_lossy(&c.inbuf[..end]).to_ascii_lowercase();
            c.inbuf.drain(..end + 4);
            let field = |name: &str| {
                head.lines()
                    .skip(1)
                    .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_string()))
            };
            if field("transfer-encoding:").is_some()
                || field("content-length:").is_some_and(|v| v != "0")
            {
                return Step::Close;
            }
            let http10 = head.lines().next().is_some_and(|l| l.ends_with("http/1.0"));
            let conn = field("connection:").unwrap_or_default();
            c.close_after = conn.contains("close") || (http10 && !conn.contains("keep-alive"));
            if self.delay.is_zero() {
                c.out_pos = Some(0);
            } else {
                let now = Instant::now();
                c.held = true;
                self.due.push(Reverse((now + self.delay, t)));
                self.counts
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .add_in_flight(1, now);
                return Step::Keep;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(s: &mut std::net::TcpStream, close: bool) -> Vec<u8> {
        let req: &[u8] = if close {
            b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        } else {
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
        };
        std::io::Write::write_all(s, req).unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !got.ends_with(b"z") && got.len() < 26 + 200 {
            let n = std::io::Read::read(s, &mut buf).unwrap();
            assert!(n > 0, "closed early");
            got.extend_from_slice(&buf[..n]);
        }
        got
    }

    #[test]
    fn answers_over_keep_alive_and_closes_when_asked() {
        let b = Backend::start(26, Duration::ZERO, 0).unwrap();
        let mut s = std::net::TcpStream::connect(b.addr()).unwrap();
        for _ in 0..3 {
            let r = get(&mut s, false);
            assert!(r.starts_with(b"HTTP/1.1 200 OK\r\n"));
            assert!(r.ends_with(b"\r\n\r\nabcdefghijklmnopqrstuvwxyz"));
        }
        get(&mut s, true);
        let mut buf = [0u8; 16];
        assert_eq!(std::io::Read::read(&mut s, &mut buf).unwrap(), 0);
        assert_eq!(b.tally().responses, 4);
        assert_eq!(b.tally().in_flight_max, 0);
    }

    /// Eight clients at once against a 1 s delay: all eight are held together (the backend
    /// does not limit its concurrency), counted by the backend. The clients connect first and
    /// send together after a barrier, and the delay is long, so a busy machine that is slow to
    /// start the threads still has them overlap.
    #[test]
    fn a_delay_holds_requests_without_limiting_them() {
        let b = Backend::start(26, Duration::from_millis(1000), 0).unwrap();
        let before = b.tally();
        let t0 = Instant::now();
        let together = std::sync::Arc::new(std::sync::Barrier::new(8));
        let clients: Vec<_> = (0..8)
            .map(|_| {
                let addr = b.addr();
                let together = together.clone();
                std::thread::spawn(move || {
                    let mut s = std::net::TcpStream::connect(addr).unwrap();
                    together.wait();
                    get(&mut s, false);
                })
            })
            .collect();
        for c in clients {
            c.join().unwrap();
        }
        let elapsed = t0.elapsed();
        // The backend counts a response once its last byte is written, which a client may see
        // (and return) first: wait for the count, bounded, rather than race it (CI read 7).
        let mut after = b.tally();
        for _ in 0..500 {
            if after.responses == 8 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
            after = b.tally();
        }
        assert!(elapsed >= Duration::from_millis(1000), "{elapsed:?}");
        assert_eq!(after.responses, 8);
        assert_eq!(after.in_flight, 0);
        assert_eq!(after.in_flight_max, 8);
        // Eight requests held at least 1 s each, never more than eight over the run.
        let area = after.in_flight_area_s - before.in_flight_area_s;
        assert!(area >= 8.0 && area <= 8.0 * elapsed.as_secs_f64(), "{area}");
    }
}
