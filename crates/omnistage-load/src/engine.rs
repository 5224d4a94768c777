//! The generator's event loop: one `mio` poll per thread driving many keep-alive connections.
//!
//! Owns connection slots and their life cycle (connect, send, read, reconnect), request pacing
//! (closed loop with think time; open loop on a fixed schedule, with latency measured from each
//! request's *intended* send time, as wrk2 does, so a busy connection or a slow server cannot hide
//! queueing), timeouts, the per-tenant request budget, and recording into [`TenantStats`].
//!
//! Each slot keeps at most one request outstanding. A slot's life:
//!
//! ```text
//! Disconnected --connect--> Connecting --established--> Idle --due--> Busy --response--> Idle
//!      ^  (backoff after a failed connect)                 ^                     |
//!      +--- close: Connection: close, --requests-per-conn, error, timeout ------+
//! ```
//!
//! and ends in `Done` when its tenant's `--requests` budget is spent. Every loop is bounded: the
//! run stops at its deadline whatever the server does, reads per readiness event are capped
//! ([`MAX_READS_PER_TURN`]) so one fast connection cannot starve the rest, and failed connects
//! back off from [`CONNECT_BACKOFF_MIN`] to [`CONNECT_BACKOFF_MAX`].
//!
//! Timing: epoll sleeps in whole milliseconds, so the loop busy-polls when the next timer is
//! within `--spin-us` (default 1 ms) and sleeps otherwise. Requests then leave within microseconds
//! of their schedule rather than up to a millisecond late, which in open loop would count as
//! server latency.

use crate::args::Plan;
use crate::mix::{Mix, Pacing};
use crate::parse::{Feed, Response, ResponseReader};
use crate::segments::{self, SegmentTotals, SegmentsIn};
use crate::stats::{classify, Outcome, TenantStats};
use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Bytes read from a socket at a time (one buffer per thread).
pub const READ_BUFFER_BYTES: usize = 64 * 1024;
/// Reads from one connection per readiness event before it yields to the others.
pub const MAX_READS_PER_TURN: usize = 16;
/// Readiness events taken from the poll at a time.
pub const EVENTS_CAPACITY: usize = 1024;
/// First wait after a failed connection attempt.
pub const CONNECT_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// Longest wait between connection attempts.
pub const CONNECT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Timeouts are checked every timeout/[`TIMEOUT_SWEEP_DIVISOR`], within the bounds below.
pub const TIMEOUT_SWEEP_DIVISOR: u32 = 20;
/// Most frequent timeout sweep.
pub const TIMEOUT_SWEEP_MIN: Duration = Duration::from_millis(1);
/// Least frequent timeout sweep.
pub const TIMEOUT_SWEEP_MAX: Duration = Duration::from_millis(100);
/// Identifies this client to the server.
pub const USER_AGENT: &str = "omnistage-load";

/// A tenant's request budget, shared by all threads (`--requests`).
#[derive(Debug)]
pub(crate) struct Budget(Option<AtomicU64>);

impl Budget {
    pub fn new(limit: Option<u64>) -> Self {
        Budget(limit.map(AtomicU64::new))
    }

    /// Takes one request from the budget; false when it is spent.
    fn take(&self) -> bool {
        match &self.0 {
            None => true,
            Some(a) => a
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| r.checked_sub(1))
                .is_ok(),
        }
    }

    fn spent(&self) -> bool {
        self.0
            .as_ref()
            .is_some_and(|a| a.load(Ordering::Relaxed) == 0)
    }

    /// Requests left; `u64::MAX` without a limit.
    fn remaining(&self) -> u64 {
        self.0
            .as_ref()
            .map_or(u64::MAX, |a| a.load(Ordering::Relaxed))
    }
}

/// What all generator threads share.
pub(crate) struct Run<'a> {
    pub plan: &'a Plan,
    pub budgets: Vec<Budget>,
    /// Time zero of every schedule; connections open here.
    pub start: Instant,
    /// End of warmup: events from here on are recorded.
    pub measure_start: Instant,
    /// Deadline: the run stops here.
    pub end: Instant,
}

impl Run<'_> {
    fn measured(&self, now: Instant) -> bool {
        now >= self.measure_start && now < self.end
    }
}

/// What one thread hands back.
pub(crate) struct ThreadResult {
    /// Per tenant; `None` for tenants with no connection on this thread.
    pub stats: Vec<Option<TenantStats>>,
    /// When the thread stopped (at most the deadline).
    pub finished: Instant,
    /// Segments its streams received in the measured window.
    pub segments: SegmentTotals,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No socket; a connection attempt is due at `retry_at`.
    Disconnected,
    /// Non-blocking connect in progress since `since`.
    Connecting,
    /// Connected, no request outstanding; the next is due at `due`.
    Idle,
    /// A request outstanding since `since` (being written and/or awaiting its response).
    Busy,
    /// The tenant's budget is spent; the slot is closed.
    Done,
}

/// A failure that uses up the outstanding request.
#[derive(Debug, Clone, Copy)]
enum Failure {
    Reset,
    Timeout,
    Parse,
}

/// One connection slot: a logical keep-alive connection that reconnects as needed.
struct Conn {
    tenant: usize,
    /// Index among the tenant's connections (fixes its place in the open-loop schedule).
    slot: usize,
    stream: Option<TcpStream>,
    phase: Phase,
    /// Intended send time of the next (or the outstanding) request.
    due: Instant,
    /// Open loop: the slot's schedule index of the request due at `due`.
    seq: u64,
    /// Start of the connect attempt (Connecting) or of the request (Busy), for timeouts.
    since: Instant,
    retry_at: Instant,
    backoff: Duration,
    connected_once: bool,
    /// Requests sent on the current TCP connection.
    on_conn: u64,
    /// The outstanding request is the last on this TCP connection (it asked for close).
    last_on_conn: bool,
    out: Vec<u8>,
    out_pos: usize,
    reader: ResponseReader,
    /// `--kernel-stamps`: the wall clock just before the outstanding request's first write,
    /// and the kernel's latest receive stamp on its response (ns since the epoch; 0: none).
    sent_ns: u64,
    received_ns: u64,
    /// The stream's segment counters when the measured window began (zero for a stream
    /// opened in it): see [`crate::segments`].
    segments_base: SegmentsIn,
    /// The slot's own path chooser, seeded from (`--seed`, tenant, slot): the paths a slot
    /// requests do not depend on how the server's answers interleave the slots.
    rng: SmallRng,
}

/// Per-tenant data a thread needs to build requests and pace them.
struct TenantLocal<'a> {
    mix: &'a Mix,
    pacing: Pacing,
    connections: usize,
    /// ` HTTP/1.1`, Host and User-Agent headers, blank line.
    tail: Vec<u8>,
    /// As `tail`, asking the server to close after responding.
    tail_close: Vec<u8>,
}

/// The seed of one slot's path chooser: `seed` mixed with the tenant and the slot (SplitMix64's
/// finaliser, so neighbouring slots get unrelated streams).
fn slot_seed(seed: u64, tenant: usize, slot: usize) -> u64 {
    let mut z = seed
        .wrapping_add((tenant as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add((slot as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

struct Worker<'r, 'p> {
    run: &'r Run<'p>,
    poll: Poll,
    conns: Vec<Conn>,
    tenants: Vec<TenantLocal<'p>>,
    stats: Vec<Option<TenantStats>>,
    /// (when, slot index): connection retries and requests due later. Entries may be stale; the
    /// slot's state decides when one fires.
    timers: BinaryHeap<Reverse<(Instant, usize)>>,
    /// Slots with unread data left after [`MAX_READS_PER_TURN`].
    rerun: Vec<usize>,
    read_buf: Vec<u8>,
    /// Per tenant: its spent budget has ended this thread's idle slots
    /// ([`Worker::end_spent_tenants`]).
    ended: Vec<bool>,
    /// Slots not yet Done.
    active: usize,
    /// The measured window has begun: every open stream's `segments_base` was read.
    segments_counting: bool,
    /// Segments received in the measured window by streams closed in it, and (at the end)
    /// by those still open.
    segments: SegmentTotals,
}

/// Runs one generator thread over `slots` ((tenant, slot) pairs) until the deadline or until
/// every slot is done.
pub(crate) fn run_thread(
    run: &Run<'_>,
    index: usize,
    slots: &[(usize, usize)],
) -> Result<ThreadResult, String> {
    if !run.plan.cpus.is_empty() {
        crate::affinity::pin_current_thread(run.plan.cpus[index % run.plan.cpus.len()])?;
    }
    let mut w = Worker::new(run, slots)?;
    w.event_loop()?;
    let finished = Instant::now().min(run.end);
    w.count_unfinished();
    w.finish_counting_segments();
    Ok(ThreadResult {
        stats: w.stats,
        finished,
        segments: w.segments,
    })
}

fn request_tail(host: &str, header: Option<&(String, String)>, close: bool) -> Vec<u8> {
    let connection = if close { "Connection: close\r\n" } else { "" };
    let extra = header
        .map(|(n, v)| format!("{n}: {v}\r\n"))
        .unwrap_or_default();
    format!(" HTTP/1.1\r\nHost: {host}\r\nUser-Agent: {USER_AGENT}\r\n{extra}{connection}\r\n")
        .into_bytes()
}

impl<'r, 'p> Worker<'r, 'p> {
    fn new(run: &'r Run<'p>, slots: &[(usize, usize)]) -> Result<Self, String> {
        let poll = Poll::new().map_err(|e| format!("cannot create a poll: {e}"))?;
        let plan = run.plan;
        let tenants = plan
            .tenants
            .iter()
            .map(|t| TenantLocal {
                mix: &t.mix,
                pacing: t.pacing,
                connections: t.connections,
                tail: request_tail(&t.host, t.header.as_ref(), false),
                tail_close: request_tail(&t.host, t.header.as_ref(), true),
            })
            .collect();
        let mut stats: Vec<Option<TenantStats>> = plan.tenants.iter().map(|_| None).collect();
        let conns: Vec<Conn> = slots
            .iter()
            .map(|&(tenant, slot)| {
                stats[tenant]
                    .get_or_insert_with(|| TenantStats::new(plan.tenants[tenant].connections));
                let mut c = Conn {
                    tenant,
                    slot,
                    stream: None,
                    phase: Phase::Disconnected,
                    due: run.start,
                    seq: 0,
                    since: run.start,
                    retry_at: run.start,
                    backoff: CONNECT_BACKOFF_MIN,
                    connected_once: false,
                    on_conn: 0,
                    last_on_conn: false,
                    out: Vec::new(),
                    out_pos: 0,
                    reader: ResponseReader::new(),
                    sent_ns: 0,
                    received_ns: 0,
                    segments_base: SegmentsIn::default(),
                    rng: SmallRng::seed_from_u64(slot_seed(plan.seed, tenant, slot)),
                };
                if let Pacing::Open { rate_per_s } = plan.tenants[tenant].pacing {
                    c.due = scheduled(
                        run.start,
                        rate_per_s,
                        plan.tenants[tenant].connections,
                        slot,
                        0,
                    );
                }
                c
            })
            .collect();
        Ok(Worker {
            run,
            poll,
            active: conns.len(),
            conns,
            tenants,
            stats,
            timers: BinaryHeap::new(),
            rerun: Vec::new(),
            read_buf: vec![0; READ_BUFFER_BYTES],
            ended: vec![false; plan.tenants.len()],
            segments_counting: false,
            segments: SegmentTotals::default(),
        })
    }

    /// The window `now` falls in, when the run has windows (bounded: `plan` caps the windows
    /// and `now` is inside the measured window).
    fn window_of(&self, now: Instant) -> Option<usize> {
        self.run.plan.window.map(|w| {
            (now.saturating_duration_since(self.run.measure_start)
                .as_nanos()
                / w.as_nanos().max(1)) as usize
        })
    }

    fn stats(&mut self, tenant: usize) -> &mut TenantStats {
        self.stats[tenant]
            .as_mut()
            .expect("a tenant with a slot on this thread has stats here")
    }

    fn event_loop(&mut self) -> Result<(), String> {
        let mut events = Events::with_capacity(EVENTS_CAPACITY);
        let now = Instant::now();
        for idx in 0..self.conns.len() {
            self.start_connect(idx, now);
        }
        let sweep_every = (self.run.plan.timeout / TIMEOUT_SWEEP_DIVISOR)
            .clamp(TIMEOUT_SWEEP_MIN, TIMEOUT_SWEEP_MAX);
        let mut next_sweep = now + sweep_every;
        loop {
            let now = Instant::now();
            if now >= self.run.end || self.active == 0 {
                return Ok(());
            }
            if !self.segments_counting && now >= self.run.measure_start {
                self.begin_counting_segments();
            }
            if self.run.plan.requests.is_some() {
                self.end_spent_tenants();
            }
            let mut wake = self.run.end.min(next_sweep);
            if let Some(Reverse((t, _))) = self.timers.peek() {
                wake = wake.min(*t);
            }
            if !self.segments_counting {
                // Wake at the window's start to read every stream's segment counters then, not
                // up to a timeout sweep later (the responses in between would count without
                // their segments).
                wake = wake.min(self.run.measure_start);
            }
            // Busy-poll within `spin` of the next timer; otherwise sleep until `spin` before it
            // (mio rounds the sleep up to whole milliseconds). See the module doc.
            let remaining = wake.saturating_duration_since(now);
            let timeout = if !self.rerun.is_empty() || remaining <= self.run.plan.spin {
                Duration::ZERO
            } else {
                remaining - self.run.plan.spin
            };
            match self.poll.poll(&mut events, Some(timeout)) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("poll failed: {e}")),
            }
            for ev in events.iter() {
                let readable = ev.is_readable() || ev.is_read_closed() || ev.is_error();
                let writable = ev.is_writable() || ev.is_write_closed() || ev.is_error();
                self.on_event(ev.token().0, readable, writable, Instant::now());
            }
            if !self.rerun.is_empty() {
                for idx in std::mem::take(&mut self.rerun) {
                    if self.conns[idx].phase == Phase::Busy {
                        self.on_readable(idx);
                    }
                }
            }
            let now = Instant::now();
            while let Some(&Reverse((t, idx))) = self.timers.peek() {
                if t > now {
                    break;
                }
                self.timers.pop();
                self.on_timer(idx, now);
            }
            if now >= next_sweep {
                self.sweep(now);
                next_sweep = now + sweep_every;
            }
        }
    }

    fn on_event(&mut self, idx: usize, readable: bool, writable: bool, now: Instant) {
        // Events may be stale (for a socket this slot has since replaced); every handler only
        // acts on what the socket says now, so a stale event is harmless.
        match self.conns[idx].phase {
            Phase::Connecting if readable || writable => self.check_connect(idx, now),
            Phase::Idle if readable => self.on_idle_readable(idx, now),
            Phase::Busy => {
                if writable {
                    self.flush(idx, now);
                }
                if readable && self.conns[idx].phase == Phase::Busy {
                    self.on_readable(idx);
                }
            }
            _ => {}
        }
    }

    fn on_timer(&mut self, idx: usize, now: Instant) {
        let c = &self.conns[idx];
        match c.phase {
            Phase::Disconnected if c.retry_at <= now => self.start_connect(idx, now),
            Phase::Idle if c.due <= now => self.next_request(idx, now),
            _ => {}
        }
    }

    /// Times out requests and connection attempts older than `--timeout-ms`.
    fn sweep(&mut self, now: Instant) {
        let timeout = self.run.plan.timeout;
        for idx in 0..self.conns.len() {
            let c = &self.conns[idx];
            if now.saturating_duration_since(c.since) < timeout {
                continue;
            }
            match c.phase {
                Phase::Busy => self.fail(idx, Failure::Timeout, now),
                Phase::Connecting => self.connect_failed(idx, now),
                _ => {}
            }
        }
    }

    fn start_connect(&mut self, idx: usize, now: Instant) {
        let tenant = self.conns[idx].tenant;
        if self.run.budgets[tenant].spent() {
            self.done(idx);
            return;
        }
        let mut stream = match TcpStream::connect(self.run.plan.addr) {
            Ok(s) => s,
            Err(_) => return self.connect_failed(idx, now),
        };
        if self
            .poll
            .registry()
            .register(
                &mut stream,
                Token(idx),
                Interest::READABLE | Interest::WRITABLE,
            )
            .is_err()
        {
            return self.connect_failed(idx, now);
        }
        let c = &mut self.conns[idx];
        c.stream = Some(stream);
        c.segments_base = SegmentsIn::default();
        c.phase = Phase::Connecting;
        c.since = now;
    }

    fn check_connect(&mut self, idx: usize, now: Instant) {
        let Some(s) = self.conns[idx].stream.as_mut() else {
            return;
        };
        match s.take_error() {
            Ok(None) => {}
            Ok(Some(_)) | Err(_) => return self.connect_failed(idx, now),
        }
        match s.peer_addr() {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotConnected => return,
            Err(_) => return self.connect_failed(idx, now),
        }
        // Requests are small and latency-sensitive: never wait to coalesce.
        let _ = s.set_nodelay(true);
        if self.run.plan.kernel_stamps {
            // If the kernel refuses, this connection's reads carry no stamps and its responses
            // add no kernel figure; the usual latency is still recorded.
            let _ = crate::stamps::enable(s);
        }
        let c = &mut self.conns[idx];
        c.phase = Phase::Idle;
        c.backoff = CONNECT_BACKOFF_MIN;
        c.on_conn = 0;
        let reconnect = std::mem::replace(&mut c.connected_once, true);
        c.due = due_when_connected(&self.tenants[c.tenant].pacing, c.due, now);
        let tenant = c.tenant;
        if reconnect && self.run.measured(now) {
            self.stats(tenant).reconnects += 1;
        }
        self.next_request(idx, now);
    }

    fn connect_failed(&mut self, idx: usize, now: Instant) {
        self.close_stream(idx);
        let tenant = self.conns[idx].tenant;
        if self.run.measured(now) {
            self.stats(tenant).errors.connect += 1;
        }
        let c = &mut self.conns[idx];
        c.retry_at = now + c.backoff;
        c.backoff = (c.backoff * 2).min(CONNECT_BACKOFF_MAX);
        self.timers.push(Reverse((c.retry_at, idx)));
    }

    /// Drops the socket (if any); the slot is Disconnected with a clean reader.
    fn close_stream(&mut self, idx: usize) {
        let c = &mut self.conns[idx];
        if let Some(mut s) = c.stream.take() {
            if self.segments_counting {
                count_segments(&mut self.segments, &s, c.segments_base);
            }
            let _ = self.poll.registry().deregister(&mut s);
        }
        c.phase = Phase::Disconnected;
        c.reader.reset();
        c.out.clear();
        c.out_pos = 0;
    }

    /// Closes the slot for good.
    fn done(&mut self, idx: usize) {
        if self.conns[idx].phase == Phase::Done {
            return;
        }
        self.close_stream(idx);
        self.conns[idx].phase = Phase::Done;
        self.active -= 1;
    }

    /// Ends at once the slots of tenants whose `--requests` budget is spent (on any thread) and
    /// that have no request outstanding: a slot waiting for its next due time would otherwise
    /// keep the run going until then, and the run's length (every rate's divisor) with it.
    /// Slots with a request outstanding end when it does.
    fn end_spent_tenants(&mut self) {
        for tenant in 0..self.tenants.len() {
            if self.ended[tenant] || !self.run.budgets[tenant].spent() {
                continue;
            }
            self.ended[tenant] = true;
            for idx in 0..self.conns.len() {
                let c = &self.conns[idx];
                if c.tenant == tenant && c.phase != Phase::Busy {
                    self.done(idx);
                }
            }
        }
    }

    /// Replaces the slot's connection (or ends the slot if its budget is spent).
    fn reconnect(&mut self, idx: usize, now: Instant) {
        self.close_stream(idx);
        // Past the deadline the loop ends at its next turn: a connection opened now would only
        // add its handshake to the segments read at the end.
        if now < self.run.end {
            self.start_connect(idx, now);
        }
    }

    /// On an Idle slot: sends the next request if it is due, or sets a timer for it.
    fn next_request(&mut self, idx: usize, now: Instant) {
        let tenant = self.conns[idx].tenant;
        if self.run.budgets[tenant].spent() {
            return self.done(idx);
        }
        let due = self.conns[idx].due;
        if due > now {
            self.timers.push(Reverse((due, idx)));
        } else if now < self.run.end {
            self.dispatch(idx, now);
        }
    }

    fn dispatch(&mut self, idx: usize, now: Instant) {
        let tenant = self.conns[idx].tenant;
        if !self.run.budgets[tenant].take() {
            return self.done(idx);
        }
        let t = &self.tenants[tenant];
        let c = &mut self.conns[idx];
        c.on_conn += 1;
        c.last_on_conn = self
            .run
            .plan
            .requests_per_conn
            .is_some_and(|n| c.on_conn >= n);
        c.out.clear();
        c.out.extend_from_slice(b"GET ");
        t.mix.write_path(&mut c.rng, &mut c.out);
        c.out.extend_from_slice(if c.last_on_conn {
            &t.tail_close
        } else {
            &t.tail
        });
        c.out_pos = 0;
        c.phase = Phase::Busy;
        c.since = now;
        if self.run.plan.kernel_stamps {
            c.sent_ns = crate::stamps::realtime_ns();
            c.received_ns = 0;
        }
        self.flush(idx, now);
    }

    /// Writes as much of the outstanding request as the socket takes.
    fn flush(&mut self, idx: usize, now: Instant) {
        let c = &mut self.conns[idx];
        let Some(s) = c.stream.as_mut() else {
            return;
        };
        while c.out_pos < c.out.len() {
            match s.write(&c.out[c.out_pos..]) {
                Ok(0) => return self.fail(idx, Failure::Reset, now),
                Ok(n) => c.out_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return self.fail(idx, Failure::Reset, now),
            }
        }
    }

    /// Reads the response of a Busy slot; at most [`MAX_READS_PER_TURN`] reads, then the slot
    /// waits its turn on the rerun list.
    fn on_readable(&mut self, idx: usize) {
        let mut buf = std::mem::take(&mut self.read_buf);
        let mut reads = 0;
        while self.conns[idx].phase == Phase::Busy {
            if reads == MAX_READS_PER_TURN {
                self.rerun.push(idx);
                break;
            }
            reads += 1;
            let Some(s) = self.conns[idx].stream.as_mut() else {
                break;
            };
            let result = if self.run.plan.kernel_stamps {
                let result = crate::stamps::read_stamped(s, &mut buf);
                if let Ok((_, stamp)) = result {
                    // The figure is the read that completes the response: one without a stamp
                    // (the kernel's stamping not on yet, or the end of the stream) gives none.
                    self.conns[idx].received_ns = stamp.unwrap_or(0);
                }
                result.map(|(n, _)| n)
            } else {
                s.read(&mut buf)
            };
            let now = Instant::now();
            match result {
                Ok(0) => {
                    match self.conns[idx].reader.eof() {
                        Ok(Some(resp)) => self.complete(idx, resp, now),
                        Ok(None) | Err(_) => self.fail(idx, Failure::Reset, now),
                    }
                    break;
                }
                Ok(n) => {
                    if self.run.measured(now) {
                        let tenant = self.conns[idx].tenant;
                        let window = self.window_of(now);
                        let st = self.stats(tenant);
                        st.received_bytes += n as u64;
                        if let Some(w) = window {
                            st.window(w).received_bytes += n as u64;
                        }
                    }
                    self.on_bytes(idx, &buf[..n], now)
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.fail(idx, Failure::Reset, now);
                    break;
                }
            }
        }
        self.read_buf = buf;
    }

    fn on_bytes(&mut self, idx: usize, data: &[u8], now: Instant) {
        match self.conns[idx].reader.feed(data) {
            Err(_) => self.fail(idx, Failure::Parse, now),
            Ok(Feed::NeedMore) => {}
            // With one request outstanding, bytes after its response are a protocol error.
            Ok(Feed::Done { consumed, .. }) if consumed < data.len() => {
                self.fail(idx, Failure::Parse, now)
            }
            Ok(Feed::Done { response, .. }) => self.complete(idx, response, now),
        }
    }

    /// The server spoke (or closed) while no request was outstanding.
    fn on_idle_readable(&mut self, idx: usize, now: Instant) {
        let mut buf = std::mem::take(&mut self.read_buf);
        let tenant = self.conns[idx].tenant;
        let measured = self.run.measured(now);
        while let Some(s) = self.conns[idx].stream.as_mut() {
            match s.read(&mut buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(0) | Err(_) => {
                    if measured {
                        self.stats(tenant).idle_closes += 1;
                    }
                    self.reconnect(idx, now);
                    break;
                }
                Ok(_) => {
                    if measured {
                        self.stats(tenant).errors.unsolicited += 1;
                    }
                    self.reconnect(idx, now);
                    break;
                }
            }
        }
        self.read_buf = buf;
    }

    /// Moves the slot's schedule past the request that just ended.
    fn advance(&mut self, idx: usize, now: Instant) {
        let c = &mut self.conns[idx];
        let t = &self.tenants[c.tenant];
        match t.pacing {
            Pacing::Open { rate_per_s } => {
                c.seq += 1;
                c.due = scheduled(self.run.start, rate_per_s, t.connections, c.slot, c.seq);
            }
            Pacing::Closed { think_ms } => {
                c.due = now + Duration::from_secs_f64(think_ms / 1000.0);
            }
        }
    }

    fn complete(&mut self, idx: usize, resp: Response, now: Instant) {
        let (tenant, slot, due, kernel_us) = {
            let c = &self.conns[idx];
            let stamped = c.sent_ns > 0 && c.received_ns >= c.sent_ns;
            let kernel_us = stamped.then(|| (c.received_ns - c.sent_ns) / 1_000);
            (c.tenant, c.slot, c.due, kernel_us)
        };
        if self.run.measured(now) {
            let window = self.window_of(now);
            let st = self.stats(tenant);
            st.responses += 1;
            st.retry_after += u64::from(resp.retry_after);
            match classify(resp.status) {
                Outcome::Ok => {
                    let latency_us = now.saturating_duration_since(due).as_micros();
                    let latency_us = u64::try_from(latency_us).unwrap_or(u64::MAX);
                    st.latency_us.saturating_record(latency_us);
                    if let Some(us) = kernel_us {
                        st.kernel_latency_us.saturating_record(us);
                    }
                    st.ok += 1;
                    st.body_bytes += resp.body_bytes;
                    st.ok_per_connection[slot] += 1;
                    if let Some(w) = window {
                        let ws = st.window(w);
                        ws.latency_us.saturating_record(latency_us);
                        ws.ok += 1;
                    }
                }
                Outcome::Rejected503 => {
                    st.errors.rejected_503 += 1;
                    if let Some(w) = window {
                        st.window(w).rejected_503 += 1;
                    }
                }
                Outcome::Http4xx => st.errors.http_4xx += 1,
                Outcome::Http5xx => st.errors.http_5xx += 1,
                Outcome::HttpOther => st.errors.http_other += 1,
            }
        } else if now >= self.run.end {
            self.count_one_unfinished(tenant, due);
        }
        let c = &mut self.conns[idx];
        let close = resp.close || c.last_on_conn || c.out_pos < c.out.len();
        c.phase = Phase::Idle;
        self.advance(idx, now);
        if close {
            self.reconnect(idx, now);
        } else {
            self.next_request(idx, now);
        }
    }

    /// The outstanding request failed; the connection is replaced.
    fn fail(&mut self, idx: usize, kind: Failure, now: Instant) {
        let (tenant, due) = (self.conns[idx].tenant, self.conns[idx].due);
        if self.run.measured(now) {
            let e = &mut self.stats(tenant).errors;
            match kind {
                Failure::Reset => e.reset += 1,
                Failure::Timeout => e.timeout += 1,
                Failure::Parse => e.parse += 1,
            }
        } else if now >= self.run.end {
            self.count_one_unfinished(tenant, due);
        }
        self.advance(idx, now);
        self.reconnect(idx, now);
    }

    /// At the start of the measured window: reads every open stream's segment counters.
    fn begin_counting_segments(&mut self) {
        self.segments_counting = true;
        for c in &mut self.conns {
            if let Some(s) = &c.stream {
                match segments::read(s) {
                    Some(base) => c.segments_base = base,
                    // Counted as unread at the end (its counters then fail the same way).
                    None => c.segments_base = SegmentsIn::default(),
                }
            }
        }
    }

    /// At the deadline: adds what the streams still open received in the window.
    fn finish_counting_segments(&mut self) {
        if !self.segments_counting {
            return;
        }
        for c in &self.conns {
            if let Some(s) = &c.stream {
                count_segments(&mut self.segments, s, c.segments_base);
            }
        }
    }

    /// How long a request due at `due` had waited at the deadline, µs.
    fn age_at_end_us(&self, due: Instant) -> u64 {
        u64::try_from(self.run.end.saturating_duration_since(due).as_micros()).unwrap_or(u64::MAX)
    }

    /// Counts one request of `tenant`, intended at `due`, that ended after the deadline.
    fn count_one_unfinished(&mut self, tenant: usize, due: Instant) {
        let age = self.age_at_end_us(due);
        let st = self.stats(tenant);
        st.unfinished += 1;
        st.unfinished_oldest_us = st.unfinished_oldest_us.max(age);
    }

    /// At the deadline: counts requests in flight, and open-loop requests that were due by the
    /// deadline but not sent (capped by what is left of the tenant's budget), and how long the
    /// oldest of them had waited (a slot's oldest is the one due at its `due`: the request in
    /// flight, or the first of its backlog).
    fn count_unfinished(&mut self) {
        let horizon_s = self
            .run
            .end
            .saturating_duration_since(self.run.start)
            .as_secs_f64();
        let mut backlog = vec![0u64; self.tenants.len()];
        let mut in_flight = vec![0u64; self.tenants.len()];
        // The oldest age (µs) among the tenant's requests in flight, and among its backlog.
        let mut oldest_in_flight = vec![0u64; self.tenants.len()];
        let mut oldest_backlog = vec![0u64; self.tenants.len()];
        for c in &self.conns {
            if c.phase == Phase::Done {
                continue;
            }
            let busy = c.phase == Phase::Busy;
            let age = self.age_at_end_us(c.due);
            in_flight[c.tenant] += u64::from(busy);
            if busy {
                oldest_in_flight[c.tenant] = oldest_in_flight[c.tenant].max(age);
            }
            let t = &self.tenants[c.tenant];
            let due_unsent = match t.pacing {
                Pacing::Open { rate_per_s } => {
                    // Schedule entries k with (slot + k*connections)/rate <= horizon.
                    let first = c.seq + u64::from(busy);
                    let span = horizon_s * rate_per_s - c.slot as f64;
                    if span < 0.0 {
                        0
                    } else {
                        let last = (span / t.connections as f64).floor() as u64;
                        (last + 1).saturating_sub(first)
                    }
                }
                Pacing::Closed { .. } => u64::from(!busy && c.due <= self.run.end),
            };
            backlog[c.tenant] += due_unsent;
            if due_unsent > 0 && !busy {
                oldest_backlog[c.tenant] = oldest_backlog[c.tenant].max(age);
            }
        }
        for tenant in 0..self.tenants.len() {
            if self.stats[tenant].is_none() {
                continue;
            }
            let left = self.run.budgets[tenant].remaining();
            let unsent = backlog[tenant].min(left);
            let unfinished = in_flight[tenant] + unsent;
            let mut oldest = oldest_in_flight[tenant];
            if unsent > 0 {
                oldest = oldest.max(oldest_backlog[tenant]);
            }
            let st = self.stats(tenant);
            st.unfinished += unfinished;
            if unfinished > 0 {
                st.unfinished_oldest_us = st.unfinished_oldest_us.max(oldest);
            }
        }
    }
}

/// Adds what `s` received since `base` to `totals` (or counts it unread).
fn count_segments(totals: &mut SegmentTotals, s: &TcpStream, base: SegmentsIn) {
    match segments::read(s) {
        Some(now) => totals.add(now.since(base)),
        None => totals.unread += 1,
    }
}

/// Intended send time of schedule entry `seq` of `slot`: the tenant's requests are spread evenly,
/// `1/rate` apart, and the slots take them in turn.
fn scheduled(
    start: Instant,
    rate_per_s: f64,
    connections: usize,
    slot: usize,
    seq: u64,
) -> Instant {
    let index = slot as f64 + seq as f64 * connections as f64;
    start + Duration::from_secs_f64(index / rate_per_s)
}

/// When a slot's next request is due once its connection is established at `now`. A closed-loop
/// client sends when it can: its first request on a connection (due at the run's start, or when
/// the one before it ended) cannot leave before the connection exists, and its latency runs from
/// that send. (Before, a connection established a second late counted that second in its first
/// request's latency: at 10,000 connections the p99 was the connect burst's.) An open-loop
/// request keeps its intended time, as wrk2 does: a late connect is part of its latency.
fn due_when_connected(pacing: &Pacing, due: Instant, now: Instant) -> Instant {
    match pacing {
        Pacing::Closed { .. } => due.max(now),
        Pacing::Open { .. } => due,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_slot_has_its_own_seed() {
        let mut seen = std::collections::HashSet::new();
        for tenant in 0..8 {
            for slot in 0..1_000 {
                assert!(seen.insert(slot_seed(1, tenant, slot)), "{tenant} {slot}");
            }
        }
        assert_eq!(slot_seed(7, 2, 3), slot_seed(7, 2, 3));
        assert_ne!(slot_seed(7, 2, 3), slot_seed(8, 2, 3));
    }

    #[test]
    fn a_closed_loop_request_is_due_no_earlier_than_its_connection() {
        let start = Instant::now();
        let connected = start + Duration::from_millis(1_000);
        let closed = Pacing::Closed { think_ms: 1.0 };
        let open = Pacing::Open { rate_per_s: 100.0 };
        assert_eq!(due_when_connected(&closed, start, connected), connected);
        // A request due later than the connect keeps its time (think time after a reconnect).
        let later = connected + Duration::from_millis(5);
        assert_eq!(due_when_connected(&closed, later, connected), later);
        assert_eq!(due_when_connected(&open, start, connected), start);
    }

    #[test]
    fn schedule_spreads_a_tenant_evenly() {
        let t0 = Instant::now();
        // 4 connections at 1000/s: one request every ms, slot i takes every 4th.
        let ms = |i: usize, k: u64| {
            scheduled(t0, 1000.0, 4, i, k)
                .duration_since(t0)
                .as_secs_f64()
                * 1e3
        };
        assert!((ms(0, 0) - 0.0).abs() < 1e-6);
        assert!((ms(1, 0) - 1.0).abs() < 1e-6);
        assert!((ms(3, 0) - 3.0).abs() < 1e-6);
        assert!((ms(0, 1) - 4.0).abs() < 1e-6);
        assert!((ms(2, 5) - 22.0).abs() < 1e-6);
    }

    #[test]
    fn budget() {
        let b = Budget::new(Some(2));
        assert!(!b.spent());
        assert!(b.take() && b.take());
        assert!(b.spent() && !b.take());
        assert_eq!(b.remaining(), 0);
        let u = Budget::new(None);
        assert!(u.take() && !u.spent());
        assert_eq!(u.remaining(), u64::MAX);
    }

    #[test]
    fn request_tails() {
        assert_eq!(
            request_tail("a.test", None, false),
            b" HTTP/1.1\r\nHost: a.test\r\nUser-Agent: omnistage-load\r\n\r\n"
        );
        assert_eq!(
            request_tail("a.test", Some(&("X-Class".into(), "high".into())), false),
            b" HTTP/1.1\r\nHost: a.test\r\nUser-Agent: omnistage-load\r\nX-Class: high\r\n\r\n"
        );
        assert!(String::from_utf8(request_tail("a", None, true))
            .unwrap()
            .ends_with("Connection: close\r\n\r\n"));
    }
}
