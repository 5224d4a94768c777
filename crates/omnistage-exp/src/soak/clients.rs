//! The soak's clients, each on its own thread pinned to the load CPU: the share load, the
//! mixed load, the faults (gone mid-response, resets, half-closes, the mutation fuzzer), the
//! slowloris crowd and the fresh client; and what they count ([`Stats`]), every answer to a
//! correct request checked byte for byte.

use super::TENANTS;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub(super) const SMALL_BYTES: usize = 1024;
pub(super) const LARGE_BYTES: usize = 4 << 20;
pub(super) const BURN_US: u64 = 500;
pub(super) const BURN_BODY: &[u8] = b"burned\n";
pub(super) const SHARE_CONNS: usize = 4;
pub(super) const IO_TIMEOUT: Duration = Duration::from_secs(5);
pub(super) const HEAD_BYTES_MAX: usize = 64 * 1024;
/// Examples of each finding kept for the page.
pub(super) const EXAMPLES_MAX: usize = 5;

pub(super) const BURST: u8 = 0;
pub(super) const SETTLE: u8 = 1;
pub(super) const JUDGED: u8 = 2;

/// What the clients counted (all threads).
#[derive(Default)]
pub(super) struct Stats {
    pub(super) ok: AtomicU64,
    pub(super) wrong_bytes: AtomicU64,
    pub(super) status_500: AtomicU64,
    pub(super) status_503: AtomicU64,
    /// Client errors by (kind, client, phase): which client saw it and when says whether it
    /// is a fault the soak injected or a server bug.
    pub(super) errors: Mutex<BTreeMap<(&'static str, &'static str, &'static str), u64>>,
    pub(super) examples: Mutex<Vec<String>>,
    pub(super) share_judged: [AtomicU64; 3],
    pub(super) fresh_max_us: AtomicU64,
    pub(super) faults: AtomicU64,
    pub(super) fuzz_sent: AtomicU64,
    pub(super) admin_changes: AtomicU64,
    pub(super) sighups: AtomicU64,
}

impl Stats {
    pub(super) fn error(&self, kind: &'static str, client: &'static str, phase: u8) {
        let phase = match phase {
            BURST => "burst",
            SETTLE => "settle",
            _ => "judged",
        };
        *self
            .errors
            .lock()
            .expect("stats")
            .entry((kind, client, phase))
            .or_default() += 1;
    }
    pub(super) fn errors_total(&self) -> u64 {
        self.errors.lock().expect("stats").values().sum()
    }
    pub(super) fn example(&self, s: String) {
        let mut e = self.examples.lock().expect("stats");
        if e.len() < EXAMPLES_MAX {
            e.push(s);
        }
    }
    /// Checks one answer to a correct request.
    pub(super) fn check(
        &self,
        what: &'static str,
        phase: u8,
        r: &Resp,
        status: u16,
        body: &[u8],
    ) -> bool {
        match r.status {
            500 => {
                self.status_500.fetch_add(1, Ordering::Relaxed);
                self.example(format!("500 for {what}"));
                false
            }
            503 => {
                self.status_503.fetch_add(1, Ordering::Relaxed);
                false
            }
            s if s != status => {
                self.error("unexpected_status", what, phase);
                self.example(format!("{s} for {what} (want {status})"));
                false
            }
            _ if r.body != body => {
                self.wrong_bytes.fetch_add(1, Ordering::Relaxed);
                self.example(format!(
                    "wrong bytes for {what}: {} bytes, want {}",
                    r.body.len(),
                    body.len()
                ));
                false
            }
            _ => {
                self.ok.fetch_add(1, Ordering::Relaxed);
                true
            }
        }
    }
}

pub(super) struct Shared {
    pub(super) addr: SocketAddr,
    pub(super) stats: Stats,
    pub(super) phase: AtomicU8,
    pub(super) stop: AtomicBool,
    pub(super) small: Vec<u8>,
    pub(super) large: Vec<u8>,
}

impl Shared {
    /// Waits while the run is out of a burst; false once it stops.
    fn next_burst_round(&self) -> bool {
        while !self.stop.load(Ordering::Relaxed) {
            if self.phase.load(Ordering::Relaxed) == BURST {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// Checks one answer to a correct request (see [`Stats::check`]) in the current phase.
    fn check(&self, what: &'static str, r: &Resp, status: u16, body: &[u8]) -> bool {
        self.stats
            .check(what, self.phase.load(Ordering::Relaxed), r, status, body)
    }

    /// Counts a client error of `kind` seen by `client` in the current phase.
    fn error(&self, kind: &'static str, client: &'static str) {
        self.stats
            .error(kind, client, self.phase.load(Ordering::Relaxed));
    }
}

/// One response: status, body, and whether the server closes after it.
pub(super) struct Resp {
    pub(super) status: u16,
    pub(super) body: Vec<u8>,
    pub(super) close: bool,
}

/// Reads one response from `s`; `buf` keeps bytes read past it (pipelining).
pub(super) fn read_response(s: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<Resp> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    let mut chunk = [0u8; 64 * 1024];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > HEAD_BYTES_MAX {
            return Err(bad("response head too large"));
        }
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let status: u16 = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| bad("bad status line"))?;
    let mut len: Option<usize> = None;
    let mut close = false;
    for line in head.lines().skip(1) {
        if let Some((k, v)) = line.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                len = Some(v.trim().parse().map_err(|_| bad("bad Content-Length"))?);
            } else if k.eq_ignore_ascii_case("connection") && v.trim().eq_ignore_ascii_case("close")
            {
                close = true;
            }
        }
    }
    let len = len.ok_or_else(|| bad("no Content-Length"))?;
    while buf.len() < head_end + len {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = buf[head_end..head_end + len].to_vec();
    buf.drain(..head_end + len);
    Ok(Resp {
        status,
        body,
        close,
    })
}

pub(super) fn connect(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, IO_TIMEOUT)?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    s.set_nodelay(true)?;
    Ok(s)
}

pub(super) fn io_kind(e: &std::io::Error) -> &'static str {
    use std::io::ErrorKind::*;
    match e.kind() {
        WouldBlock | TimedOut => "timeout",
        UnexpectedEof | ConnectionReset | BrokenPipe | ConnectionAborted => "closed",
        ConnectionRefused => "refused",
        InvalidData => "bad_response",
        _ => "io",
    }
}

pub(super) fn request(host: &str, path: &str, extra: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: {host}.test\r\n{extra}\r\n")
}

/// A tiny deterministic generator (xorshift), for ranges, mutations and file bytes.
pub(super) struct Rng(pub(super) u64);
impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub(super) fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

pub(super) use crate::harness::pin_to_load_cpu;

/// The share load: one keep-alive connection of burn requests to tenant `t`.
pub(super) fn share_client(sh: &Shared, t: usize) {
    pin_to_load_cpu();
    let req = request(TENANTS[t].0, &format!("/_burn?us={BURN_US}"), "");
    while !sh.stop.load(Ordering::Relaxed) {
        let Ok(mut s) = connect(sh.addr) else {
            sh.error("connect", "burn");
            std::thread::sleep(Duration::from_millis(20));
            continue;
        };
        let mut buf = Vec::new();
        while !sh.stop.load(Ordering::Relaxed) {
            let r = s
                .write_all(req.as_bytes())
                .and_then(|()| read_response(&mut s, &mut buf));
            match r {
                Ok(r) => {
                    let judged = sh.phase.load(Ordering::Relaxed) == JUDGED;
                    if sh.check("burn", &r, 200, BURN_BODY) && judged {
                        sh.stats.share_judged[t].fetch_add(1, Ordering::Relaxed);
                    }
                    if r.close {
                        break;
                    }
                }
                Err(e) => {
                    sh.error(io_kind(&e), "burn");
                    break;
                }
            }
        }
    }
}

/// Mixed load of tenant `t` in the bursts: keep-alive, one request per connection, pipelined,
/// ranges and the large file, in turn.
pub(super) fn mixed_client(sh: &Shared, t: usize) {
    pin_to_load_cpu();
    let host = TENANTS[t].0;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ t as u64);
    let mut round = 0usize;
    while sh.next_burst_round() {
        round += 1;
        let (a, b) = {
            let x = rng.below(LARGE_BYTES);
            (x, (x + rng.below(256 * 1024)).min(LARGE_BYTES - 1))
        };
        let range = request(host, "/large.bin", &format!("Range: bytes={a}-{b}\r\n"));
        // (requests in one write, the answers expected)
        let (reqs, want): (Vec<String>, Vec<(u16, &[u8])>) = match round % 5 {
            0 => (
                vec![request(host, "/index.html", ""); 5],
                vec![(200, &sh.small[..]); 5],
            ),
            1 => (
                vec![request(host, "/index.html", "Connection: close\r\n")],
                vec![(200, &sh.small[..])],
            ),
            2 => (
                vec![
                    request(host, "/index.html", "")
                        + &range
                        + &request(host, &format!("/_burn?us={BURN_US}"), ""),
                ],
                vec![
                    (200, &sh.small[..]),
                    (206, &sh.large[a..=b]),
                    (200, BURN_BODY),
                ],
            ),
            3 => (vec![range], vec![(206, &sh.large[a..=b])]),
            _ => (
                vec![request(host, "/large.bin", "")],
                vec![(200, &sh.large[..])],
            ),
        };
        let Ok(mut s) = connect(sh.addr) else {
            sh.error("connect", "mixed");
            continue;
        };
        let mut buf = Vec::new();
        let mut answers = want.iter();
        'conn: for r in &reqs {
            if let Err(e) = s.write_all(r.as_bytes()) {
                sh.error(io_kind(&e), "mixed");
                break;
            }
            // A write holds one request, or all the pipelined ones.
            let n = if reqs.len() == 1 { want.len() } else { 1 };
            for _ in 0..n {
                let Some(&(status, body)) = answers.next() else {
                    break 'conn;
                };
                match read_response(&mut s, &mut buf) {
                    Ok(resp) => {
                        sh.check("mixed", &resp, status, body);
                    }
                    Err(e) => {
                        sh.error(io_kind(&e), "mixed");
                        break 'conn;
                    }
                }
            }
        }
    }
}

/// Valid requests the fuzzer mutates.
pub(super) const FUZZ_SEEDS: [&str; 4] = [
    "GET /index.html HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n",
    "GET /large.bin HTTP/1.1\r\nHost: b.test\r\nRange: bytes=10-20\r\nConnection: close\r\n\r\n",
    "GET /_burn?us=100 HTTP/1.1\r\nHost: c.test\r\nIf-None-Match: \"x\"\r\nConnection: close\r\n\r\n",
    "GET /index.html HTTP/1.1\r\nHost: a.test\r\nIf-Modified-Since: Sun, 06 Nov 1994 08:49:37 GMT\r\nIf-Range: \"y\"\r\nRange: bytes=0-0\r\nConnection: close\r\n\r\n",
];

pub(super) fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let mut v = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(v.len() + 1);
        match rng.below(3) {
            0 if !v.is_empty() => {
                let i = at.min(v.len() - 1);
                v[i] ^= 1 << rng.below(8);
            }
            1 => v.insert(at, rng.next() as u8),
            _ if at < v.len() => {
                v.remove(at);
            }
            _ => {}
        }
    }
    v
}

/// Faults in the bursts, in turn: a client gone mid-response, a reset, a half-closed request
/// (its answer checked), a mutated request (its status read: 500 is a finding).
pub(super) fn fault_client(sh: &Shared) {
    pin_to_load_cpu();
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut round = 0usize;
    while sh.next_burst_round() {
        round += 1;
        let Ok(mut s) = connect(sh.addr) else {
            sh.error("connect", "fault");
            continue;
        };
        let host = TENANTS[round % 3].0;
        sh.stats.faults.fetch_add(1, Ordering::Relaxed);
        match round % 4 {
            0 => {
                // Gone mid-response: read a little of the large file, then close.
                let _ = s.write_all(request(host, "/large.bin", "").as_bytes());
                let mut b = [0u8; 64 * 1024];
                let _ = s.read(&mut b);
            }
            1 => {
                // A reset: SO_LINGER 0, so close sends RST with the request still unanswered.
                let _ = s.write_all(request(host, "/large.bin", "").as_bytes());
                let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
            }
            2 => {
                // Half-closed after the request: the answer must still come, whole.
                let r = s
                    .write_all(request(host, "/index.html", "Connection: close\r\n").as_bytes())
                    .and_then(|()| s.shutdown(Shutdown::Write))
                    .and_then(|()| read_response(&mut s, &mut Vec::new()));
                match r {
                    Ok(r) => {
                        sh.check("half-closed", &r, 200, &sh.small);
                    }
                    Err(e) => sh.error(io_kind(&e), "fault"),
                }
            }
            _ => {
                let seed = FUZZ_SEEDS[rng.below(FUZZ_SEEDS.len())].as_bytes();
                let m = mutate(&mut rng, seed);
                sh.stats.fuzz_sent.fetch_add(1, Ordering::Relaxed);
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                if s.write_all(&m).is_ok() {
                    let mut b = [0u8; 64];
                    if let Ok(n) = s.read(&mut b) {
                        if b[..n].starts_with(b"HTTP/1.1 500") {
                            sh.stats.status_500.fetch_add(1, Ordering::Relaxed);
                            sh.stats
                                .example(format!("500 for {:?}", String::from_utf8_lossy(&m)));
                        }
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The slowloris crowd: up to `n` connections in each burst, each sending a header line every
/// 2 s and never ending its head (the server's header timeout closes them; they come back);
/// closed when the quiet window starts.
pub(super) fn slowloris(sh: &Shared, n: usize) {
    pin_to_load_cpu();
    let mut crowd: Vec<TcpStream> = Vec::new();
    let mut last_drip = Instant::now();
    while !sh.stop.load(Ordering::Relaxed) {
        if sh.phase.load(Ordering::Relaxed) != BURST {
            crowd.clear();
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        // Refill, at most 200 per 20 ms.
        for _ in 0..200.min(n.saturating_sub(crowd.len())) {
            match TcpStream::connect_timeout(&sh.addr, Duration::from_millis(500)) {
                Ok(mut s) => {
                    let _ = s.set_nonblocking(true);
                    if s.write_all(b"GET / HTTP/1.1\r\nHost: a.test\r\n").is_ok() {
                        crowd.push(s);
                    }
                }
                Err(_) => break,
            }
        }
        if last_drip.elapsed() >= Duration::from_secs(2) {
            last_drip = Instant::now();
            crowd.retain_mut(|s| s.write_all(b"X-Slow: 1\r\n").is_ok());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A fresh client every second: a new connection, `GET /`, answered whole; the slowest per
/// interval is kept (a failure counts as the timeout).
pub(super) fn fresh_client(sh: &Shared) {
    pin_to_load_cpu();
    while !sh.stop.load(Ordering::Relaxed) {
        let t0 = Instant::now();
        let r = connect(sh.addr).and_then(|mut s| {
            s.write_all(request("a", "/index.html", "Connection: close\r\n").as_bytes())?;
            read_response(&mut s, &mut Vec::new())
        });
        let us = match r {
            Ok(r) if sh.check("fresh", &r, 200, &sh.small) => t0.elapsed().as_micros(),
            Ok(_) => IO_TIMEOUT.as_micros(),
            Err(e) => {
                sh.error(io_kind(&e), "fresh");
                IO_TIMEOUT.as_micros()
            }
        };
        sh.stats
            .fresh_max_us
            .fetch_max(us as u64, Ordering::Relaxed);
        std::thread::sleep(Duration::from_secs(1).saturating_sub(t0.elapsed()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn responses_are_read_one_at_a_time() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.write_all(
                b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabcHTTP/1.1 206 Partial\r\ncontent-length: 1\r\nConnection: close\r\n\r\nz",
            )
            .unwrap();
        });
        let mut s = connect(addr).unwrap();
        let mut buf = Vec::new();
        let a = read_response(&mut s, &mut buf).unwrap();
        assert_eq!((a.status, &a.body[..], a.close), (200, &b"abc"[..], false));
        let b = read_response(&mut s, &mut buf).unwrap();
        assert_eq!((b.status, &b.body[..], b.close), (206, &b"z"[..], true));
        t.join().unwrap();
    }

    #[test]
    fn mutations_change_the_request() {
        let mut rng = Rng(7);
        let seed = FUZZ_SEEDS[0].as_bytes();
        assert!((0..20).any(|_| mutate(&mut rng, seed) != seed));
    }
}
