//! admit: admission predicates and the controllers that tune them (SEDA's overload control).
//!
//! This module owns the decision "may this message enter that queue?" and the feedback loops
//! that move the answer with load (ARCHITECTURE.md, "Overload"; seda.md 2.2–2.4):
//!
//! - [`Verdict`] and [`RejectReason`]: the answer every predicate gives.
//! - [`Threshold`]: a fixed queue-length bound.
//! - [`GcraBucket`]: a lock-free token bucket (the generic cell rate algorithm) shared by every
//!   sender of a queue; it is the actuator the rate controllers drive.
//! - [`P90Params`] and [`P90Controller`]: SEDA's 90th-percentile response-time controller
//!   (multiplicative decrease above target, additive increase well below it).
//! - [`ClassedP90`]: one such controller per class of requests; lower classes are cut first.
//! - [`LittleBound`]: a queue bound from Little's law (target × measured completion rate), so
//!   a backlog admitted before a rate controller reacts cannot hold the response time high.
//! - [`BatchingController`]: SEDA's batching-factor controller (smallest batch that keeps
//!   throughput high).
//! - [`over_share_ratio`] and [`SharedQueueLimit`]: share-aware shedding, so that when a shared
//!   queue fills the activity furthest above its weighted share is shed first.
//!
//! The layer is pure: it never reads a clock and owns no thread. Everything that needs time
//! takes `now_ns: u64` from the caller (`exec` reads the clock), so every rule here is tested
//! under simulated time with exact expectations. Only [`GcraBucket`] is shared between threads
//! (through `&self`, with atomics); the controllers are plain values owned by one worker, which
//! pushes their decisions into a bucket with [`GcraBucket::set_rate`].

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

const NS_PER_S: f64 = 1e9;

// ---------------------------------------------------------------------------------------------
// Verdicts
// ---------------------------------------------------------------------------------------------

/// Why a message was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    /// The queue (or the stage's shared queue) is at its bound.
    QueueFull,
    /// The admission predicate (token bucket, response-time controller) said no.
    Predicate,
    /// Shed because the activity is too far above its share of a filling shared queue.
    Shed,
}

/// The answer of an admission check, given at once in the sender's context (SEDA's `SinkIF`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Admit,
    Reject(RejectReason),
}

impl Verdict {
    pub fn is_admit(self) -> bool {
        matches!(self, Verdict::Admit)
    }
}

// ---------------------------------------------------------------------------------------------
// Threshold
// ---------------------------------------------------------------------------------------------

/// A fixed queue-length bound: admit while fewer than `limit` messages are queued.
/// `limit == 0` refuses everything (a closed queue).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Threshold {
    pub limit: usize,
}

impl Threshold {
    pub fn verdict(&self, queued: usize) -> Verdict {
        if queued >= self.limit {
            Verdict::Reject(RejectReason::QueueFull)
        } else {
            Verdict::Admit
        }
    }
}

// ---------------------------------------------------------------------------------------------
// GCRA token bucket
// ---------------------------------------------------------------------------------------------

/// Smallest rate a [`GcraBucket`] accepts: one admission per 1000 s. Slower than that is a
/// closed queue, and it keeps the emission interval (≤ 10^12 ns) far from overflow when it is
/// multiplied by the burst.
pub const GCRA_RATE_MIN_PER_S: f64 = 1e-3;
/// Largest rate a [`GcraBucket`] accepts: 10^9 per second, an emission interval of 1 ns (the
/// resolution of the clock); faster cannot be represented.
pub const GCRA_RATE_MAX_PER_S: f64 = 1e9;
/// Largest burst: 2^20. With the longest interval (10^12 ns) the tolerance `(burst - 1) *
/// interval` stays below 2^60, so the arithmetic on the arrival time cannot overflow.
pub const GCRA_BURST_MAX: u32 = 1 << 20;
/// Compare-and-swap attempts before [`GcraBucket::try_admit`] gives up and rejects. A CAS only
/// fails because another sender changed the arrival time first (we use the strong CAS, so there
/// are no spurious failures); 64 such changes during one attempt mean the bucket is being
/// drained as fast as it refills, and refusing is then the right answer anyway. The bound keeps
/// a sender's time in the bucket finite.
const GCRA_CAS_RETRIES: u32 = 64;

/// A token bucket shared by all senders of a queue: the generic cell rate algorithm (GCRA).
///
/// State is one `AtomicU64`, the theoretical arrival time (TAT) of the next conforming message,
/// plus the emission interval `T = ceil(10^9 / rate)` ns in a second `AtomicU64` so a controller
/// can change the rate while senders use the bucket. With tolerance `tau = (burst - 1) * T`, a
/// message arriving at `now` conforms if `now >= TAT - tau`, and then `TAT = max(now, TAT) + T`.
/// At a constant rate this admits at most `rate * W + burst` messages in any window of length
/// `W` (the interval is rounded up, so the effective rate never exceeds the requested one).
///
/// Rate changes: a bucket that was drained at a low rate holds a TAT far in the future, which
/// at a new, higher rate would mean a long stall (at 0.05/s and burst 10, 200 s). So the debt
/// is capped at two full buckets at the current rate: TAT is clamped to
/// `now + 2 * burst * T`. After a rate increase the first admission therefore comes at most
/// `tau + 2T` later. At a constant rate TAT never exceeds `now + burst * T`, so the cap never
/// acts there (even when senders pass times up to one bucket out of order).
///
/// All accesses are `Relaxed`: the bucket publishes no other memory, and read-modify-writes
/// of the one TAT location are totally ordered whatever the ordering argument.
#[derive(Debug)]
pub struct GcraBucket {
    tat_ns: AtomicU64,
    interval_ns: AtomicU64,
    burst: AtomicU32,
}

impl GcraBucket {
    /// Checks a rate and a burst against the limits; the message says which is wrong.
    pub fn validate(rate_per_s: f64, burst: u32) -> Result<(), String> {
        if !(GCRA_RATE_MIN_PER_S..=GCRA_RATE_MAX_PER_S).contains(&rate_per_s) {
            return Err(format!(
                "token bucket rate must be in {GCRA_RATE_MIN_PER_S}..={GCRA_RATE_MAX_PER_S} per s, got {rate_per_s}"
            ));
        }
        if !(1..=GCRA_BURST_MAX).contains(&burst) {
            return Err(format!(
                "token bucket burst must be in 1..={GCRA_BURST_MAX}, got {burst}"
            ));
        }
        Ok(())
    }

    /// A full bucket: `burst` admissions are possible at once (at any `now_ns`), then one per
    /// `1 / rate_per_s` seconds. Panics when [`GcraBucket::validate`] fails.
    pub fn new(rate_per_s: f64, burst: u32) -> Self {
        if let Err(e) = Self::validate(rate_per_s, burst) {
            panic!("{e}");
        }
        GcraBucket {
            // TAT 0 with any now >= 0 means the whole burst is available.
            tat_ns: AtomicU64::new(0),
            interval_ns: AtomicU64::new(interval_ns_for(rate_per_s)),
            burst: AtomicU32::new(burst),
        }
    }

    /// Takes one token at `now_ns` if there is one. Lock-free; callable from any thread.
    pub fn try_admit(&self, now_ns: u64) -> bool {
        let interval = self.interval_ns.load(Ordering::Relaxed);
        // interval <= 10^12 and burst <= 2^20, so both products are below 2^61 (no overflow).
        let tau = interval * u64::from(self.burst.load(Ordering::Relaxed) - 1);
        let debt_max = 2 * (tau + interval);
        let ceiling = now_ns.saturating_add(debt_max);
        let mut tat = self.tat_ns.load(Ordering::Relaxed);
        for _ in 0..GCRA_CAS_RETRIES {
            let capped = tat.min(ceiling);
            // Conforms iff now >= capped - tau, written without underflow.
            let (admit, next) = if now_ns.saturating_add(tau) >= capped {
                (true, capped.max(now_ns).saturating_add(interval))
            } else if capped < tat {
                // Refused, but write the capped debt back so the cap takes effect.
                (false, capped)
            } else {
                return false;
            };
            match self
                .tat_ns
                .compare_exchange(tat, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return admit,
                Err(seen) => tat = seen,
            }
        }
        false
    }

    /// Changes the rate; senders see it on their next call. Panics outside
    /// `GCRA_RATE_MIN_PER_S..=GCRA_RATE_MAX_PER_S`.
    pub fn set_rate(&self, rate_per_s: f64) {
        self.interval_ns
            .store(interval_ns_for(rate_per_s), Ordering::Relaxed);
    }

    /// The effective rate, `10^9 / interval_ns`: equal to the rate set when `10^9 / rate` is a
    /// whole number of ns, otherwise slightly below it (the interval is rounded up).
    pub fn rate_per_s(&self) -> f64 {
        NS_PER_S / self.interval_ns.load(Ordering::Relaxed) as f64
    }

    pub fn burst(&self) -> u32 {
        self.burst.load(Ordering::Relaxed)
    }

    /// Changes the burst; senders see it on their next call. Panics outside
    /// `1..=GCRA_BURST_MAX`.
    pub fn set_burst(&self, burst: u32) {
        assert!(
            (1..=GCRA_BURST_MAX).contains(&burst),
            "token bucket burst must be in 1..={GCRA_BURST_MAX}, got {burst}"
        );
        self.burst.store(burst, Ordering::Relaxed);
    }
}

fn interval_ns_for(rate_per_s: f64) -> u64 {
    // The range check also refuses NaN (every comparison with NaN is false).
    assert!(
        (GCRA_RATE_MIN_PER_S..=GCRA_RATE_MAX_PER_S).contains(&rate_per_s),
        "token bucket rate must be in {GCRA_RATE_MIN_PER_S}..={GCRA_RATE_MAX_PER_S} per s, got {rate_per_s}"
    );
    // In 1..=10^12, exact in both f64 and u64.
    (NS_PER_S / rate_per_s).ceil() as u64
}

// ---------------------------------------------------------------------------------------------
// 90th-percentile response-time controller
// ---------------------------------------------------------------------------------------------

/// Longest response-time target and controller timeout accepted: one hour. Anything longer is
/// a unit mistake (seconds written as ns the other way round), not a policy.
pub const P90_TIME_MAX_NS: u64 = 3_600 * 1_000_000_000;
/// Shortest controller timeout: 1 ms. The controller runs on a worker's dispatch loop; windows
/// shorter than that measure noise and spend the loop on sorting.
pub const P90_TIMEOUT_MIN_NS: u64 = 1_000_000;
/// Most samples per controller run. The buffer (8 bytes a sample) is allocated once per
/// controller and sorted on every run, so it must stay small: 10,000 is 80 KB and a sub-ms sort.
pub const P90_NREQ_MAX: u32 = 10_000;
/// Largest multiplicative decrease: dividing by more than 1000 in one step is a cliff, not a
/// controller.
pub const P90_ADJ_D_MAX: f64 = 1000.0;

/// Parameters of the 90th-percentile controller; names and defaults are SEDA's (Fig. 50,
/// seda.md 2.4). Rates are in admissions per second.
///
/// `target_ns` has no meaningful default in SEDA (the administrator sets it); the default here
/// is 1 s, the target of SEDA's Fig. 52 trace, and **should be set** for every stage.
// Not `Copy`: callers hold it in configuration enums and clone it explicitly.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct P90Params {
    /// Target for the smoothed 90th-percentile response time.
    pub target_ns: u64,
    /// Samples per controller run (and the size of the sample buffer).
    pub nreq: u32,
    /// Longest time between runs while samples are waiting.
    pub timeout_ns: u64,
    /// EWMA weight of the previous smoothed value.
    pub alpha: f64,
    /// The rate is increased only when the error is below this (−0.5: below half the target).
    pub err_i: f64,
    /// The rate is decreased whenever the error is above this (0: above the target).
    pub err_d: f64,
    /// Additive increase, in admissions/s per unit of error beyond `c_i`.
    pub adj_i: f64,
    /// Multiplicative decrease: the rate is divided by this.
    pub adj_d: f64,
    /// Error at which the additive increase would be zero.
    pub c_i: f64,
    /// Floor of the rate.
    pub rate_min_per_s: f64,
    /// Ceiling of the rate.
    pub rate_max_per_s: f64,
    /// Not SEDA's: when above 0, the queue is also bounded by Little's law to
    /// `queue_bound_fraction × target × measured completion rate` ([`LittleBound`]), so a
    /// backlog admitted before the controller reacts cannot hold the response time over the
    /// target. 0 (the default) leaves only SEDA's rate control.
    pub queue_bound_fraction: f64,
}

impl Default for P90Params {
    fn default() -> Self {
        P90Params {
            target_ns: 1_000_000_000,
            nreq: 100,
            timeout_ns: 1_000_000_000,
            alpha: 0.7,
            err_i: -0.5,
            err_d: 0.0,
            adj_i: 2.0,
            adj_d: 1.2,
            c_i: -0.1,
            rate_min_per_s: 0.05,
            rate_max_per_s: 5000.0,
            queue_bound_fraction: 0.0,
        }
    }
}

impl P90Params {
    /// Checks a controller's starting rate against these parameters' range (narrower than a
    /// token bucket's).
    pub fn validate_initial_rate(&self, initial_rate_per_s: f64) -> Result<(), String> {
        if !(self.rate_min_per_s..=self.rate_max_per_s).contains(&initial_rate_per_s) {
            return Err(format!(
                "p90: initial rate must be in {}..={} per s, got {initial_rate_per_s}",
                self.rate_min_per_s, self.rate_max_per_s
            ));
        }
        Ok(())
    }

    /// Checks every parameter against its limit; the message names the parameter.
    pub fn validate(&self) -> Result<(), String> {
        let p = self;
        if !(1..=P90_TIME_MAX_NS).contains(&p.target_ns) {
            return Err(format!(
                "p90: target_ns must be in 1..={P90_TIME_MAX_NS}, got {}",
                p.target_ns
            ));
        }
        if !(1..=P90_NREQ_MAX).contains(&p.nreq) {
            return Err(format!(
                "p90: nreq must be in 1..={P90_NREQ_MAX}, got {}",
                p.nreq
            ));
        }
        if !(P90_TIMEOUT_MIN_NS..=P90_TIME_MAX_NS).contains(&p.timeout_ns) {
            return Err(format!(
                "p90: timeout_ns must be in {P90_TIMEOUT_MIN_NS}..={P90_TIME_MAX_NS}, got {}",
                p.timeout_ns
            ));
        }
        // alpha = 1 would never move the smoothed value off its first sample.
        if !(0.0..1.0).contains(&p.alpha) {
            return Err(format!("p90: alpha must be in [0, 1), got {}", p.alpha));
        }
        // The error is (cur - target) / target >= -1, so err_i <= -1 would never increase.
        if !(p.err_i > -1.0 && p.err_i.is_finite()) {
            return Err(format!(
                "p90: err_i must be finite and > -1 (else the rate never increases), got {}",
                p.err_i
            ));
        }
        if !(p.err_d.is_finite() && p.err_d >= p.err_i) {
            return Err(format!(
                "p90: err_d must be finite and >= err_i ({}), got {}",
                p.err_i, p.err_d
            ));
        }
        // The increase adj_i * (c_i - err) for err < err_i is positive only if c_i >= err_i.
        if !(p.c_i.is_finite() && p.c_i >= p.err_i) {
            return Err(format!(
                "p90: c_i must be finite and >= err_i ({}) so increases are positive, got {}",
                p.err_i, p.c_i
            ));
        }
        if !(GCRA_RATE_MIN_PER_S..=GCRA_RATE_MAX_PER_S).contains(&p.rate_min_per_s) {
            return Err(format!(
                "p90: rate_min_per_s must be in {GCRA_RATE_MIN_PER_S}..={GCRA_RATE_MAX_PER_S} (the token bucket's range), got {}",
                p.rate_min_per_s
            ));
        }
        if !(p.rate_min_per_s..=GCRA_RATE_MAX_PER_S).contains(&p.rate_max_per_s) {
            return Err(format!(
                "p90: rate_max_per_s must be in rate_min_per_s ({})..={GCRA_RATE_MAX_PER_S}, got {}",
                p.rate_min_per_s, p.rate_max_per_s
            ));
        }
        if !(p.adj_i > 0.0 && p.adj_i <= p.rate_max_per_s) {
            return Err(format!(
                "p90: adj_i must be in (0, rate_max_per_s ({})], got {}",
                p.rate_max_per_s, p.adj_i
            ));
        }
        if !(0.0..=1.0).contains(&p.queue_bound_fraction) {
            return Err(format!(
                "p90: queue_bound_fraction must be in [0, 1] (0: no Little's-law bound), got {}",
                p.queue_bound_fraction
            ));
        }
        if !(p.adj_d > 1.0 && p.adj_d <= P90_ADJ_D_MAX) {
            return Err(format!(
                "p90: adj_d must be in (1, {P90_ADJ_D_MAX}] (the rate is divided by it), got {}",
                p.adj_d
            ));
        }
        Ok(())
    }
}

/// SEDA's 90th-percentile response-time controller (seda.md 2.4) for one queue. Single-threaded:
/// owned by the worker that measures response times; its output goes to a [`GcraBucket`].
///
/// A run happens when `nreq` samples have arrived, or when `timeout_ns` has passed since the last
/// run (since the first sample, before any run) and at least one sample is waiting:
///
/// ```text
/// samp = sorted(samples)[min(floor(0.9 * n), n - 1)]    n = samples in this window
/// cur  = alpha * cur + (1 - alpha) * samp                (cur = samp on the first run)
/// err  = (cur - target) / target
/// if err > err_d:      rate = rate / adj_d
/// elif err < err_i:    rate = rate + adj_i * -(err - c_i)
/// rate = clamp(rate, rate_min, rate_max)
/// ```
///
/// Two choices SEDA leaves open: the percentile index uses the number of samples actually in
/// the window (equal to SEDA's `0.9 * nreq` for a full window; a window cut short by the timeout
/// reports its own 90th percentile, and its maximum when it has 10 samples or fewer), and the
/// smoothed value starts at the first window's percentile rather than at 0 (which would hide
/// the first overload for several runs).
#[derive(Debug, Clone)]
pub struct P90Controller {
    params: P90Params,
    rate_per_s: f64,
    /// Smoothed 90th percentile; `None` until the first run.
    cur_ns: Option<f64>,
    /// Samples of the current window; never more than `nreq` (a run empties it).
    samples_ns: Vec<u64>,
    /// Time of the last run, or of the first sample before any run.
    window_start_ns: Option<u64>,
}

impl P90Controller {
    /// Panics with the message of [`P90Controller::try_new`] when the parameters or the initial
    /// rate are invalid.
    pub fn new(params: P90Params, initial_rate_per_s: f64) -> Self {
        match Self::try_new(params, initial_rate_per_s) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        }
    }

    /// A controller starting at `initial_rate_per_s`, which must lie in
    /// `rate_min_per_s..=rate_max_per_s`.
    pub fn try_new(params: P90Params, initial_rate_per_s: f64) -> Result<Self, String> {
        params.validate()?;
        params.validate_initial_rate(initial_rate_per_s)?;
        let nreq = params.nreq as usize;
        Ok(P90Controller {
            params,
            rate_per_s: initial_rate_per_s,
            cur_ns: None,
            samples_ns: Vec::with_capacity(nreq),
            window_start_ns: None,
        })
    }

    /// Records one response time measured at `now_ns`; returns the new rate when this sample
    /// completed a run (even if the rate did not change), else `None`.
    pub fn observe(&mut self, response_ns: u64, now_ns: u64) -> Option<f64> {
        self.record(response_ns, now_ns);
        self.tick(now_ns)
    }

    /// Runs the controller if a timeout has passed with samples waiting; returns the new rate
    /// when it ran.
    pub fn tick(&mut self, now_ns: u64) -> Option<f64> {
        if !self.due(now_ns) {
            return None;
        }
        let err = self.measure(now_ns);
        self.adjust(err, true);
        Some(self.rate_per_s)
    }

    pub fn rate_per_s(&self) -> f64 {
        self.rate_per_s
    }

    /// The smoothed 90th-percentile response time (`cur`), `None` before the first run.
    /// SEDA exposes this to applications for service degradation.
    pub fn p90_smoothed_ns(&self) -> Option<f64> {
        self.cur_ns
    }

    pub fn params(&self) -> &P90Params {
        &self.params
    }

    /// Samples waiting for the next run.
    pub fn pending_samples(&self) -> usize {
        self.samples_ns.len()
    }

    fn record(&mut self, response_ns: u64, now_ns: u64) {
        // A run empties the buffer as soon as it holds nreq samples, so this never grows it.
        assert!(
            self.samples_ns.len() < self.params.nreq as usize,
            "p90: sample buffer over nreq; the controller was not run when due"
        );
        self.window_start_ns.get_or_insert(now_ns);
        self.samples_ns.push(response_ns);
    }

    fn due(&self, now_ns: u64) -> bool {
        let Some(start) = self.window_start_ns else {
            return false;
        };
        !self.samples_ns.is_empty()
            && (self.samples_ns.len() >= self.params.nreq as usize
                || now_ns.saturating_sub(start) >= self.params.timeout_ns)
    }

    /// Closes the window: updates `cur` and returns the error against the target.
    fn measure(&mut self, now_ns: u64) -> f64 {
        let n = self.samples_ns.len();
        debug_assert!(n > 0, "p90: run without samples");
        self.samples_ns.sort_unstable();
        let samp = self.samples_ns[(n * 9 / 10).min(n - 1)] as f64;
        let a = self.params.alpha;
        let cur = match self.cur_ns {
            None => samp,
            Some(c) => a * c + (1.0 - a) * samp,
        };
        self.cur_ns = Some(cur);
        self.samples_ns.clear();
        self.window_start_ns = Some(now_ns);
        let target = self.params.target_ns as f64;
        (cur - target) / target
    }

    /// Applies SEDA's rule for `err`; `may_increase` is false while a higher class is over its
    /// target. Returns whether the rate changed.
    fn adjust(&mut self, err: f64, may_increase: bool) -> bool {
        let p = &self.params;
        let old = self.rate_per_s;
        let mut rate = old;
        if err > p.err_d {
            rate /= p.adj_d;
        } else if err < p.err_i && may_increase {
            rate += p.adj_i * -(err - p.c_i);
        }
        self.rate_per_s = rate.clamp(p.rate_min_per_s, p.rate_max_per_s);
        self.rate_per_s != old
    }

    /// Sets the rate from outside (class differentiation), clamped; returns whether it changed.
    fn set_rate_clamped(&mut self, rate_per_s: f64) -> bool {
        let old = self.rate_per_s;
        self.rate_per_s = rate_per_s.clamp(self.params.rate_min_per_s, self.params.rate_max_per_s);
        self.rate_per_s != old
    }

    /// Whether the last run found the response time over target (err > err_d) and that run is
    /// recent: within two timeouts, the longest a class with traffic can go without a run plus
    /// one timeout of slack. A class whose traffic stopped stops holding others back.
    fn over_target_recently(&self, over: bool, now_ns: u64) -> bool {
        over && self
            .window_start_ns
            .is_some_and(|t| now_ns.saturating_sub(t) <= 2 * self.params.timeout_ns)
    }
}

// ---------------------------------------------------------------------------------------------
// Class-based differentiation
// ---------------------------------------------------------------------------------------------

/// Most classes a [`ClassedP90`] holds. Each class run scans the classes below or above it, and
/// SEDA's examples use two; 16 priority levels is more than any configuration needs.
pub const CLASSES_MAX: usize = 16;
/// Lower classes are divided by this when a higher class is over its target (SEDA's adjlo_d).
pub const ADJLO_D: f64 = 10.0;
/// Over-target runs, with every lower class already at the floor, before a class cuts its own
/// rate (SEDA's lc_thresh).
pub const LC_THRESH: u32 = 20;

#[derive(Debug, Clone)]
struct ClassState {
    ctl: P90Controller,
    /// lc^c: over-target runs with every lower class at rate_min since the last own cut.
    lc: u32,
    /// Whether the last run was over target (err > err_d, or the class was shed).
    over: bool,
    /// The class's queue bound refused requests since its last run ([`ClassedP90::note_shed`]).
    shed: bool,
}

/// SEDA's class-based differentiation (seda.md 2.4): one response-time controller per class,
/// each with its own target; class 0 has the highest priority. Each class drives its own token
/// bucket (read [`ClassedP90::rate_per_s`] after a change).
///
/// When class `c` runs with `err > err_d`:
/// - if some lower class (`c+1..`) is above `rate_min`, every lower class is divided by
///   [`ADJLO_D`] (clamped at `rate_min`) and class `c` keeps its rate;
/// - otherwise `lc[c] += 1`, and when `lc[c] >= LC_THRESH` class `c` divides its own rate by
///   `adj_d` and `lc[c] = 0`;
/// - the lowest class has nobody to cut, so it follows the single-class rule (divide by
///   `adj_d` at once).
///
/// When class `c` runs with `err <= err_d`, `lc[c] = 0` (the count is of consecutive
/// over-target runs) and it may increase by the single-class rule, unless a higher class is
/// flagged over target. A flag lasts until that class's next run, and lapses if that run is
/// more than two timeouts old, so a class whose traffic stopped does not pin the others.
#[derive(Debug, Clone)]
pub struct ClassedP90 {
    classes: Vec<ClassState>,
}

impl ClassedP90 {
    /// One class per target (`targets_ns[0]` is class 0, the highest priority); every class
    /// shares `params` except the target, and starts at `initial_rate_per_s`.
    pub fn new(
        targets_ns: &[u64],
        params: P90Params,
        initial_rate_per_s: f64,
    ) -> Result<Self, String> {
        if !(1..=CLASSES_MAX).contains(&targets_ns.len()) {
            return Err(format!(
                "p90 classes: need 1..={CLASSES_MAX} classes, got {}",
                targets_ns.len()
            ));
        }
        let mut classes = Vec::with_capacity(targets_ns.len());
        for (c, &target_ns) in targets_ns.iter().enumerate() {
            let p = P90Params {
                target_ns,
                ..params
            };
            let ctl = P90Controller::try_new(p, initial_rate_per_s)
                .map_err(|e| format!("p90 class {c}: {e}"))?;
            classes.push(ClassState {
                ctl,
                lc: 0,
                over: false,
                shed: false,
            });
        }
        Ok(ClassedP90 { classes })
    }

    pub fn classes(&self) -> usize {
        self.classes.len()
    }

    /// Records a response time of class `class`; returns true when some class's rate changed.
    /// Panics if `class` is out of range.
    pub fn observe(&mut self, class: usize, response_ns: u64, now_ns: u64) -> bool {
        self.check(class);
        self.classes[class].ctl.record(response_ns, now_ns);
        if self.classes[class].ctl.due(now_ns) {
            self.run(class, now_ns)
        } else {
            false
        }
    }

    /// Records that `class`'s queue bound (Little's law, [`LittleBound`]) refused requests: its
    /// next run counts as over target even if the requests it did serve met the target (the
    /// bound is what kept them under it), so the lower classes are cut first. The lowest class
    /// has nobody to cut and ignores this. Panics if `class` is out of range.
    pub fn note_shed(&mut self, class: usize) {
        self.check(class);
        self.classes[class].shed = true;
    }

    /// Runs every class whose timeout has passed with samples waiting, highest first; returns
    /// true when some class's rate changed.
    pub fn tick(&mut self, now_ns: u64) -> bool {
        let mut changed = false;
        for c in 0..self.classes.len() {
            if self.classes[c].ctl.due(now_ns) {
                changed |= self.run(c, now_ns);
            }
        }
        changed
    }

    pub fn rate_per_s(&self, class: usize) -> f64 {
        self.check(class);
        self.classes[class].ctl.rate_per_s()
    }

    pub fn p90_smoothed_ns(&self, class: usize) -> Option<f64> {
        self.check(class);
        self.classes[class].ctl.p90_smoothed_ns()
    }

    /// The lc counter of `class`.
    pub fn low_count(&self, class: usize) -> u32 {
        self.check(class);
        self.classes[class].lc
    }

    /// Whether `class` was over its target at its last run.
    pub fn over_target(&self, class: usize) -> bool {
        self.check(class);
        self.classes[class].over
    }

    fn check(&self, class: usize) {
        assert!(
            class < self.classes.len(),
            "p90 class {class} out of range ({} classes)",
            self.classes.len()
        );
    }

    fn run(&mut self, c: usize, now_ns: u64) -> bool {
        let err = self.classes[c].ctl.measure(now_ns);
        let p = &self.classes[c].ctl.params;
        let (err_d, adj_d, rate_min_per_s) = (p.err_d, p.adj_d, p.rate_min_per_s);
        let lowest = c + 1 == self.classes.len();
        let over = err > err_d || (self.classes[c].shed && !lowest);
        self.classes[c].shed = false;
        self.classes[c].over = over;
        if !over {
            self.classes[c].lc = 0;
            let held = self.classes[..c]
                .iter()
                .any(|h| h.ctl.over_target_recently(h.over, now_ns));
            return self.classes[c].ctl.adjust(err, !held);
        }
        if lowest {
            return self.classes[c].ctl.adjust(err, true);
        }
        let lower = &mut self.classes[c + 1..];
        if lower.iter().all(|l| l.ctl.rate_per_s <= rate_min_per_s) {
            let me = &mut self.classes[c];
            me.lc += 1;
            if me.lc >= LC_THRESH {
                me.lc = 0;
                let r = me.ctl.rate_per_s / adj_d;
                return me.ctl.set_rate_clamped(r);
            }
            return false;
        }
        let mut changed = false;
        for l in lower {
            let r = l.ctl.rate_per_s / ADJLO_D;
            changed |= l.ctl.set_rate_clamped(r);
        }
        changed
    }
}

// ---------------------------------------------------------------------------------------------
// Little's-law queue bound
// ---------------------------------------------------------------------------------------------

/// Smallest bound [`LittleBound`] sets: a few requests may always wait.
pub const LITTLE_BOUND_MIN: usize = 4;
/// Window over which [`LittleBound`] measures the departure rate: short enough to follow a
/// load step within a tenth of a second, long enough to hold tens of completions at 1,000/s.
pub const LITTLE_WINDOW_NS: u64 = 50_000_000;
/// Backlogged time a window needs before its rate is trusted: 5 ms (a tenth of the window).
/// A window with less says nothing new (the queue was mostly empty) and keeps the bound.
pub const LITTLE_BUSY_MIN_NS: u64 = 5_000_000;
/// EWMA weight of the previous departure rate (the new window gets the rest).
const LITTLE_ALPHA: f64 = 0.5;

/// A queue bound from Little's law: a request that finds `L` requests ahead of it in a queue
/// served at `X` per second waits about `L / X`, so to keep the wait under `fraction × target`
/// the queue must hold at most `fraction × target × X`.
///
/// `X` is the departure rate *while the queue is backlogged*: the caller reports each batch
/// of completions with the longest response time in it; when that message was already
/// queued at the previous report (its response time reaches back past it), the queue was
/// non-empty all along in between, and only such intervals count (over windows of [`LITTLE_WINDOW_NS`], smoothed). That is the rate a
/// newly queued request is actually served at, whatever share of the CPU the queue gets; an
/// interval that began with an empty queue would measure the arrival rate instead, and with
/// clients that back off after a refusal a bound built on it would shrink itself. But a
/// bound no larger than a dispatch batch is emptied by every batch, so a queue held at a small
/// bound never looks backlogged: in a window where the bound refused requests (demand
/// exceeded it), the plain throughput of the window also counts, and `X` is the larger of the
/// two. A window with neither [`LITTLE_BUSY_MIN_NS`] of backlog nor a refusal says nothing
/// new and keeps the bound (`limit_max`, no bound, until the first one). Pure: the caller
/// passes the time.
#[derive(Debug, Clone)]
pub struct LittleBound {
    target_ns: u64,
    fraction: f64,
    limit_max: usize,
    window_start_ns: Option<u64>,
    last_ns: Option<u64>,
    busy_ns: u64,
    busy_completions: u64,
    window_completions: u64,
    window_refusals: u64,
    rate_per_s: Option<f64>,
    bound: usize,
}

impl LittleBound {
    /// A bound for `target_ns` (1..=[`P90_TIME_MAX_NS`]) and `fraction` in (0, 1], never above
    /// `limit_max` (the queue's fixed limit); it starts at `limit_max`.
    pub fn new(target_ns: u64, fraction: f64, limit_max: usize) -> Result<Self, String> {
        if !(1..=P90_TIME_MAX_NS).contains(&target_ns) {
            return Err(format!(
                "little bound: target_ns must be in 1..={P90_TIME_MAX_NS}, got {target_ns}"
            ));
        }
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(format!(
                "little bound: fraction must be in (0, 1], got {fraction}"
            ));
        }
        if limit_max == 0 {
            return Err("little bound: limit_max must be at least 1".into());
        }
        Ok(LittleBound {
            target_ns,
            fraction,
            limit_max,
            window_start_ns: None,
            last_ns: None,
            busy_ns: 0,
            busy_completions: 0,
            window_completions: 0,
            window_refusals: 0,
            rate_per_s: None,
            bound: limit_max,
        })
    }

    /// Counts `completions` finished at `now_ns`, the oldest of which took
    /// `oldest_response_ns` from enqueue to now, and `refusals` by the bound since the previous
    /// call. Returns the new bound when this closed a window that measured a rate.
    pub fn observe(
        &mut self,
        completions: u64,
        now_ns: u64,
        oldest_response_ns: u64,
        refusals: u64,
    ) -> Option<usize> {
        let start = *self.window_start_ns.get_or_insert(now_ns);
        self.window_completions = self.window_completions.saturating_add(completions);
        self.window_refusals = self.window_refusals.saturating_add(refusals);
        let backlogged = self
            .last_ns
            .is_some_and(|last| oldest_response_ns >= now_ns.saturating_sub(last));
        if let (Some(last), true) = (self.last_ns, backlogged) {
            self.busy_ns = self.busy_ns.saturating_add(now_ns.saturating_sub(last));
            self.busy_completions = self.busy_completions.saturating_add(completions);
        }
        self.last_ns = Some(now_ns);
        let window_ns = now_ns.saturating_sub(start);
        if window_ns < LITTLE_WINDOW_NS {
            return None;
        }
        let (busy_ns, done) = (self.busy_ns, self.busy_completions);
        let (all_done, refused) = (self.window_completions, self.window_refusals);
        self.window_start_ns = Some(now_ns);
        self.busy_ns = 0;
        self.busy_completions = 0;
        self.window_completions = 0;
        self.window_refusals = 0;
        let x_busy =
            (busy_ns >= LITTLE_BUSY_MIN_NS).then(|| done as f64 * NS_PER_S / busy_ns as f64);
        let x_refused = (refused > 0).then(|| all_done as f64 * NS_PER_S / window_ns as f64);
        let x = match (x_busy, x_refused) {
            (None, None) => return None,
            (a, b) => a.unwrap_or(0.0).max(b.unwrap_or(0.0)),
        };
        let rate = match self.rate_per_s {
            None => x,
            Some(r) => LITTLE_ALPHA * r + (1.0 - LITTLE_ALPHA) * x,
        };
        self.rate_per_s = Some(rate);
        let l = self.fraction * (self.target_ns as f64 / NS_PER_S) * rate;
        // `as usize` saturates; the clamp keeps it within [min, limit_max].
        self.bound = (l.floor() as usize)
            .max(LITTLE_BOUND_MIN)
            .min(self.limit_max);
        Some(self.bound)
    }

    /// The bound in force.
    pub fn bound(&self) -> usize {
        self.bound
    }

    /// The smoothed backlogged departure rate, `None` before the first trusted window.
    pub fn rate_per_s(&self) -> Option<f64> {
        self.rate_per_s
    }
}

// ---------------------------------------------------------------------------------------------
// Batching controller
// ---------------------------------------------------------------------------------------------

/// Largest batching factor accepted: 65,536 messages per handler call. A batch is held in the
/// worker while the handler runs, so it bounds per-dispatch memory and latency; SEDA's default
/// maximum is 1000.
pub const BATCH_MAX: u32 = 1 << 16;
/// Shrink step (SEDA: ×(1 − 0.20)).
const BATCH_SHRINK: f64 = 0.8;
/// Grow step (SEDA: ×(1 + 0.20)).
const BATCH_GROW: f64 = 1.2;
/// Shrinking continues while throughput stays at or above best × (1 − this) (SEDA: 10%).
const BATCH_SHRINK_TOLERANCE: f64 = 0.10;
/// Growing stops once throughput is back at or above best × (1 − this): "approaches best".
const BATCH_APPROACH_TOLERANCE: f64 = 0.05;
/// Throughput below best × this is a sudden drop: the optimum moved, start over at the maximum.
const BATCH_DROP_FRACTION: f64 = 0.5;
/// Windows over which "best recent throughput" is the maximum, so a permanent change of the
/// workload is forgotten after this many windows.
const BATCH_BEST_WINDOWS: usize = 16;

/// Phase of the [`BatchingController`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchPhase {
    Shrink,
    Grow,
}

/// SEDA's batching controller (seda.md 2.2): looks for the smallest batching factor that keeps
/// throughput high. Call [`BatchingController::observe`] once per measurement window with the
/// stage's throughput in that window; it returns the batching factor for the next window.
///
/// The rule, with `best` = the highest throughput of the last 16 windows (this one included):
/// - a window with zero throughput carries no information: nothing changes;
/// - sudden drop, `tput < 0.5 × best` (best before this window): batch = `batch_max`, phase =
///   shrink, and the history is forgotten (the new regime starts from this window);
/// - shrink phase: if `tput >= 0.9 × best`, batch ×= 0.8; else phase = grow, batch ×= 1.2;
/// - grow phase: if `tput >= 0.95 × best` (it approached best) or `tput` fell below the last
///   window's (growing went past the peak), phase = shrink, batch ×= 0.8; else batch ×= 1.2;
/// - the batch is kept as a real number in `[1, batch_max]` (so ×1.2 can climb from 1) and
///   returned rounded to the nearest integer.
///
/// As in SEDA, the response is undamped: it oscillates just below and around the optimum.
#[derive(Debug, Clone)]
pub struct BatchingController {
    batch_max: u32,
    batch: f64,
    phase: BatchPhase,
    recent: [f64; BATCH_BEST_WINDOWS],
    recent_len: usize,
    recent_next: usize,
    last_tput: f64,
}

impl BatchingController {
    /// Starts at `batch_max`, in the shrink phase. Panics unless `1 <= batch_max <= BATCH_MAX`.
    pub fn new(batch_max: u32) -> Self {
        assert!(
            (1..=BATCH_MAX).contains(&batch_max),
            "batch_max must be in 1..={BATCH_MAX}, got {batch_max}"
        );
        BatchingController {
            batch_max,
            batch: f64::from(batch_max),
            phase: BatchPhase::Shrink,
            recent: [0.0; BATCH_BEST_WINDOWS],
            recent_len: 0,
            recent_next: 0,
            last_tput: 0.0,
        }
    }

    /// Feeds one window's throughput (messages per second, finite and >= 0) and returns the
    /// batching factor to use next, in `1..=batch_max`.
    pub fn observe(&mut self, throughput_per_s: f64) -> u32 {
        let tput = throughput_per_s;
        assert!(
            tput.is_finite() && tput >= 0.0,
            "throughput must be finite and >= 0, got {tput}"
        );
        if tput == 0.0 {
            return self.batch();
        }
        let best_before = self.best();
        if tput < best_before * BATCH_DROP_FRACTION {
            self.batch = f64::from(self.batch_max);
            self.phase = BatchPhase::Shrink;
            self.recent_len = 0;
            self.recent_next = 0;
            self.push(tput);
            self.last_tput = tput;
            return self.batch();
        }
        self.push(tput);
        let best = self.best();
        match self.phase {
            BatchPhase::Shrink => {
                if tput >= best * (1.0 - BATCH_SHRINK_TOLERANCE) {
                    self.batch *= BATCH_SHRINK;
                } else {
                    self.phase = BatchPhase::Grow;
                    self.batch *= BATCH_GROW;
                }
            }
            BatchPhase::Grow => {
                if tput >= best * (1.0 - BATCH_APPROACH_TOLERANCE) || tput < self.last_tput {
                    self.phase = BatchPhase::Shrink;
                    self.batch *= BATCH_SHRINK;
                } else {
                    self.batch *= BATCH_GROW;
                }
            }
        }
        self.batch = self.batch.clamp(1.0, f64::from(self.batch_max));
        self.last_tput = tput;
        self.batch()
    }

    /// The current batching factor, in `1..=batch_max`.
    pub fn batch(&self) -> u32 {
        // batch is in [1, batch_max] and batch_max <= 2^16, so the cast is exact after rounding.
        (self.batch.round() as u32).clamp(1, self.batch_max)
    }

    pub fn batch_max(&self) -> u32 {
        self.batch_max
    }

    pub fn phase(&self) -> BatchPhase {
        self.phase
    }

    /// Best throughput of the recent windows (0 before the first).
    pub fn best_per_s(&self) -> f64 {
        self.best()
    }

    fn best(&self) -> f64 {
        self.recent[..self.recent_len]
            .iter()
            .fold(0.0, |m, &t| if t > m { t } else { m })
    }

    fn push(&mut self, tput: f64) {
        self.recent[self.recent_next] = tput;
        self.recent_next = (self.recent_next + 1) % BATCH_BEST_WINDOWS;
        self.recent_len = (self.recent_len + 1).min(BATCH_BEST_WINDOWS);
    }
}

// ---------------------------------------------------------------------------------------------
// Share-aware shedding
// ---------------------------------------------------------------------------------------------

/// How far an activity is above its weighted share: `(usage / total_usage) / (weight /
/// total_weight)`. 1.0 is exactly at share, 2.0 twice its share; 1.0 when nothing is used.
/// Panics when `weight == 0` or `total_weight < weight` (the activity's weight is part of the
/// total). `usage` is not checked against `total_usage`: callers read both from racing counters.
pub fn over_share_ratio(usage: u64, weight: u32, total_usage: u64, total_weight: u64) -> f64 {
    assert!(weight > 0, "over_share_ratio: weight must be >= 1");
    assert!(
        total_weight >= u64::from(weight),
        "over_share_ratio: total_weight {total_weight} below the activity's weight {weight}"
    );
    if total_usage == 0 {
        return 1.0;
    }
    (usage as f64 / total_usage as f64) / (f64::from(weight) / total_weight as f64)
}

/// Largest shared-queue capacity: 2^40 messages. Counts are compared as f64, exact below 2^53;
/// no process holds more messages than this.
pub const SHARED_QUEUE_CAPACITY_MAX: usize = 1 << 40;

/// A bound on a queue shared by several activities (a stage's total occupancy) that sheds the
/// activity furthest above its share first.
///
/// - `total_queued < high_water`: admit.
/// - `total_queued >= capacity`: reject, [`RejectReason::QueueFull`].
/// - in between, with `tolerance = 2 - (total_queued - high_water) / (capacity - high_water)`
///   (2.0 at the high-water mark, falling linearly towards 1.0 at capacity), reject with
///   [`RejectReason::Shed`] when
///   `activity_queued > tolerance * total_queued * activity_weight / active_weight_sum`,
///   i.e. when the activity holds more than `tolerance` times its weighted fair portion of the
///   queue. As occupancy rises the tolerance falls, so the activity furthest above its share is
///   shed first, and an activity under its share gets in until the queue is full.
// Not `Copy`, like `P90Params`: callers keep it in configuration and clone it explicitly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedQueueLimit {
    capacity: usize,
    high_water: usize,
}

impl SharedQueueLimit {
    /// Needs `1 <= capacity <= SHARED_QUEUE_CAPACITY_MAX` and `high_water <= capacity`
    /// (`high_water == capacity` makes it a plain bound with no shedding band).
    pub fn new(capacity: usize, high_water: usize) -> Result<Self, String> {
        if !(1..=SHARED_QUEUE_CAPACITY_MAX).contains(&capacity) {
            return Err(format!(
                "shared queue capacity must be in 1..={SHARED_QUEUE_CAPACITY_MAX}, got {capacity}"
            ));
        }
        if high_water > capacity {
            return Err(format!(
                "shared queue high_water ({high_water}) must be <= capacity ({capacity})"
            ));
        }
        Ok(SharedQueueLimit {
            capacity,
            high_water,
        })
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn high_water(&self) -> usize {
        self.high_water
    }

    /// Verdict for one more message of an activity. `total_queued` and `activity_queued` are the
    /// counts already queued (before this message); `active_weight_sum` is the sum of the
    /// weights of the activities with queued work, this one included. Panics when
    /// `activity_weight == 0` or `active_weight_sum < activity_weight`. The two counts may be
    /// read from racing counters, so they are not required to be consistent.
    pub fn verdict(
        &self,
        total_queued: usize,
        activity_queued: usize,
        activity_weight: u32,
        active_weight_sum: u64,
    ) -> Verdict {
        assert!(
            activity_weight > 0,
            "shared queue: activity weight must be >= 1"
        );
        assert!(
            active_weight_sum >= u64::from(activity_weight),
            "shared queue: active weight sum {active_weight_sum} below the activity's weight {activity_weight}"
        );
        if total_queued >= self.capacity {
            return Verdict::Reject(RejectReason::QueueFull);
        }
        if total_queued < self.high_water {
            return Verdict::Admit;
        }
        // high_water <= total_queued < capacity, so the band is not empty.
        let band = (self.capacity - self.high_water) as f64;
        let tolerance = 2.0 - (total_queued - self.high_water) as f64 / band;
        let fair = total_queued as f64 * f64::from(activity_weight) / active_weight_sum as f64;
        if activity_queued as f64 > tolerance * fair {
            Verdict::Reject(RejectReason::Shed)
        } else {
            Verdict::Admit
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: u64 = 1_000_000;
    const S: u64 = 1_000_000_000;

    /// Relative comparison for rates computed by the same formula in a different order.
    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    // --- Threshold ---------------------------------------------------------------------------

    #[test]
    fn threshold_rejects_at_limit() {
        let t = Threshold { limit: 3 };
        assert_eq!(t.verdict(2), Verdict::Admit);
        assert_eq!(t.verdict(3), Verdict::Reject(RejectReason::QueueFull));
        assert_eq!(t.verdict(4), Verdict::Reject(RejectReason::QueueFull));
        assert_eq!(
            Threshold { limit: 0 }.verdict(0),
            Verdict::Reject(RejectReason::QueueFull)
        );
    }

    // --- GcraBucket --------------------------------------------------------------------------

    #[test]
    fn gcra_burst_then_one_per_interval() {
        let b = GcraBucket::new(1000.0, 10);
        assert_eq!(b.rate_per_s(), 1000.0);
        let admitted = (0..100).filter(|_| b.try_admit(0)).count();
        assert_eq!(admitted, 10);
        // Just before 1 ms: nothing; at 1 ms: exactly one.
        assert!(!b.try_admit(MS - 1));
        assert!(b.try_admit(MS));
        assert!(!b.try_admit(MS));
        for k in 2..50 {
            assert!(!b.try_admit(k * MS - 1), "k={k}");
            assert!(b.try_admit(k * MS), "k={k}");
            assert!(!b.try_admit(k * MS), "k={k}");
        }
    }

    #[test]
    fn gcra_idle_refills_only_to_burst() {
        let b = GcraBucket::new(1000.0, 10);
        assert!(b.try_admit(0));
        // A long idle period banks at most `burst`.
        let t = 10 * S;
        assert_eq!((0..100).filter(|_| b.try_admit(t)).count(), 10);
    }

    #[test]
    fn gcra_burst_one_is_a_leaky_bucket() {
        let b = GcraBucket::new(1000.0, 1);
        assert!(b.try_admit(0));
        assert!(!b.try_admit(0));
        assert!(!b.try_admit(MS - 1));
        assert!(b.try_admit(MS));
    }

    #[test]
    fn gcra_rate_change_applies_and_debt_is_capped() {
        // Drain at a very low rate: TAT is 200 s ahead.
        let b = GcraBucket::new(0.05, 10);
        assert_eq!((0..20).filter(|_| b.try_admit(0)).count(), 10);
        // Raise to 1000/s: interval 1 ms, tau 9 ms; the debt is capped at 2 * 10 ms, so the
        // first admission comes tau + 2 ms = 11 ms later, not 200 s.
        b.set_rate(1000.0);
        assert_eq!(b.rate_per_s(), 1000.0);
        assert!(!b.try_admit(S));
        assert!(!b.try_admit(S + 11 * MS - 1));
        assert!(b.try_admit(S + 11 * MS));
        assert!(!b.try_admit(S + 11 * MS));
        assert!(b.try_admit(S + 12 * MS));
        // Lowering the rate slows admissions at once.
        b.set_rate(100.0);
        let t = 100 * S;
        assert_eq!((0..20).filter(|_| b.try_admit(t)).count(), 10);
        assert!(!b.try_admit(t + 10 * MS - 1));
        assert!(b.try_admit(t + 10 * MS));
    }

    #[test]
    fn gcra_effective_rate_rounds_interval_up() {
        let b = GcraBucket::new(3.0, 1);
        // 10^9 / 3 = 333,333,333.3 ns, rounded up to ...334.
        assert!(b.rate_per_s() <= 3.0 && b.rate_per_s() > 3.0 - 1e-7);
        assert!(b.try_admit(0));
        assert!(!b.try_admit(333_333_333));
        assert!(b.try_admit(333_333_334));
    }

    #[test]
    fn gcra_concurrent_senders_take_exactly_the_burst() {
        let b = std::sync::Arc::new(GcraBucket::new(1000.0, 100));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let b = b.clone();
                std::thread::spawn(move || (0..1000).filter(|_| b.try_admit(5 * MS)).count())
            })
            .collect();
        let total: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
        // Every CAS failure is another sender's admission, at most 100 of them, so nobody
        // runs out of retries: exactly the burst is admitted.
        assert_eq!(total, 100);
    }

    #[test]
    fn gcra_limits_are_enforced() {
        assert!(GcraBucket::validate(0.0, 1).is_err());
        assert!(GcraBucket::validate(GCRA_RATE_MIN_PER_S / 2.0, 1).is_err());
        assert!(GcraBucket::validate(GCRA_RATE_MAX_PER_S * 2.0, 1).is_err());
        assert!(GcraBucket::validate(f64::NAN, 1).is_err());
        assert!(GcraBucket::validate(f64::INFINITY, 1).is_err());
        assert!(GcraBucket::validate(1.0, 0).is_err());
        assert!(GcraBucket::validate(1.0, GCRA_BURST_MAX + 1).is_err());
        assert!(GcraBucket::validate(GCRA_RATE_MIN_PER_S, GCRA_BURST_MAX).is_ok());
        assert!(GcraBucket::validate(GCRA_RATE_MAX_PER_S, 1).is_ok());
        // The extremes do not overflow.
        let slow = GcraBucket::new(GCRA_RATE_MIN_PER_S, GCRA_BURST_MAX);
        assert!(slow.try_admit(u64::MAX - 1));
        let fast = GcraBucket::new(GCRA_RATE_MAX_PER_S, 1);
        assert!(fast.try_admit(0));
        assert!(fast.try_admit(1));
        assert!(!fast.try_admit(1));
    }

    #[test]
    #[should_panic(expected = "token bucket rate")]
    fn gcra_new_refuses_zero_rate() {
        let _ = GcraBucket::new(0.0, 10);
    }

    #[test]
    #[should_panic(expected = "burst")]
    fn gcra_new_refuses_zero_burst() {
        let _ = GcraBucket::new(10.0, 0);
    }

    #[test]
    #[should_panic(expected = "token bucket rate")]
    fn gcra_set_rate_refuses_nan() {
        GcraBucket::new(10.0, 1).set_rate(f64::NAN);
    }

    /// Checks that over every window between two admissions, count <= rate * W + burst.
    fn check_window_bound(admitted: &[u64], rate_per_s: f64, burst: u32) -> Result<(), String> {
        for i in 0..admitted.len() {
            for j in i..admitted.len() {
                let count = (j - i + 1) as f64;
                let w_s = (admitted[j] - admitted[i]) as f64 / 1e9;
                let bound = rate_per_s * w_s + f64::from(burst);
                if count > bound + 1e-9 {
                    return Err(format!(
                        "{count} admissions in [{}, {}] > bound {bound}",
                        admitted[i], admitted[j]
                    ));
                }
            }
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn gcra_window_bound_1000_per_s_burst_10(
            mut arrivals in proptest::collection::vec(0u64..200 * MS, 1..600)
        ) {
            arrivals.sort_unstable();
            let b = GcraBucket::new(1000.0, 10);
            let admitted: Vec<u64> = arrivals.into_iter().filter(|&t| b.try_admit(t)).collect();
            prop_assert!(check_window_bound(&admitted, 1000.0, 10).is_ok(),
                "{:?}", check_window_bound(&admitted, 1000.0, 10));
        }

        #[test]
        fn gcra_window_bound_any_rate(
            rate in 1.0f64..100_000.0,
            burst in 1u32..50,
            mut arrivals in proptest::collection::vec(0u64..S, 1..600)
        ) {
            arrivals.sort_unstable();
            let b = GcraBucket::new(rate, burst);
            let admitted: Vec<u64> = arrivals.into_iter().filter(|&t| b.try_admit(t)).collect();
            let r = check_window_bound(&admitted, rate, burst);
            prop_assert!(r.is_ok(), "{:?}", r);
        }

        #[test]
        fn gcra_admits_whenever_a_token_is_due(gaps in proptest::collection::vec(0u64..3 * MS, 1..300)) {
            // With arrivals spaced at least one interval apart, every one is admitted.
            let b = GcraBucket::new(1000.0, 1);
            let mut t = 0;
            for g in gaps {
                prop_assert!(b.try_admit(t));
                t += MS + g;
            }
        }
    }

    // --- P90Params ---------------------------------------------------------------------------

    #[test]
    fn p90_defaults_are_sedas() {
        let p = P90Params::default();
        assert_eq!(p.nreq, 100);
        assert_eq!(p.timeout_ns, S);
        assert_eq!(p.alpha, 0.7);
        assert_eq!(p.err_i, -0.5);
        assert_eq!(p.err_d, 0.0);
        assert_eq!(p.adj_i, 2.0);
        assert_eq!(p.adj_d, 1.2);
        assert_eq!(p.c_i, -0.1);
        assert_eq!(p.rate_min_per_s, 0.05);
        assert_eq!(p.rate_max_per_s, 5000.0);
        assert!(p.validate().is_ok());
    }

    #[test]
    fn p90_params_limits_are_enforced() {
        let d = P90Params::default();
        let bad = |p: P90Params, field: &str| {
            let e = p.validate().expect_err(field);
            assert!(e.contains(field), "{e:?} should name {field}");
        };
        bad(P90Params { target_ns: 0, ..d }, "target_ns");
        bad(
            P90Params {
                target_ns: P90_TIME_MAX_NS + 1,
                ..d
            },
            "target_ns",
        );
        bad(P90Params { nreq: 0, ..d }, "nreq");
        bad(
            P90Params {
                nreq: P90_NREQ_MAX + 1,
                ..d
            },
            "nreq",
        );
        bad(
            P90Params {
                timeout_ns: P90_TIMEOUT_MIN_NS - 1,
                ..d
            },
            "timeout_ns",
        );
        bad(
            P90Params {
                timeout_ns: P90_TIME_MAX_NS + 1,
                ..d
            },
            "timeout_ns",
        );
        bad(P90Params { alpha: 1.0, ..d }, "alpha");
        bad(P90Params { alpha: -0.1, ..d }, "alpha");
        bad(
            P90Params {
                alpha: f64::NAN,
                ..d
            },
            "alpha",
        );
        bad(P90Params { err_i: -1.0, ..d }, "err_i");
        bad(P90Params { err_d: -0.6, ..d }, "err_d");
        bad(
            P90Params {
                err_d: f64::INFINITY,
                ..d
            },
            "err_d",
        );
        bad(P90Params { c_i: -0.6, ..d }, "c_i");
        bad(P90Params { adj_i: 0.0, ..d }, "adj_i");
        bad(P90Params { adj_i: 6000.0, ..d }, "adj_i");
        bad(P90Params { adj_d: 1.0, ..d }, "adj_d");
        bad(
            P90Params {
                adj_d: P90_ADJ_D_MAX * 2.0,
                ..d
            },
            "adj_d",
        );
        bad(
            P90Params {
                rate_min_per_s: 0.0,
                ..d
            },
            "rate_min_per_s",
        );
        bad(
            P90Params {
                rate_max_per_s: 0.01,
                ..d
            },
            "rate_max_per_s",
        );
        bad(
            P90Params {
                rate_max_per_s: 2e9,
                ..d
            },
            "rate_max_per_s",
        );
        // The boundaries themselves are accepted.
        let edge = P90Params {
            target_ns: P90_TIME_MAX_NS,
            nreq: P90_NREQ_MAX,
            timeout_ns: P90_TIMEOUT_MIN_NS,
            alpha: 0.0,
            err_d: d.err_i,
            c_i: d.err_i,
            adj_d: P90_ADJ_D_MAX,
            rate_min_per_s: GCRA_RATE_MIN_PER_S,
            rate_max_per_s: GCRA_RATE_MAX_PER_S,
            ..d
        };
        assert!(edge.validate().is_ok(), "{:?}", edge.validate());
    }

    #[test]
    fn p90_initial_rate_must_be_in_range() {
        let p = P90Params::default();
        assert!(P90Controller::try_new(p.clone(), 0.01).is_err());
        assert!(P90Controller::try_new(p.clone(), 5001.0).is_err());
        assert!(P90Controller::try_new(p.clone(), f64::NAN).is_err());
        assert!(P90Controller::try_new(P90Params { nreq: 0, ..p }, 1.0).is_err());
        assert!(P90Controller::try_new(p, 0.05).is_ok());
    }

    #[test]
    #[should_panic(expected = "initial rate")]
    fn p90_new_panics_on_bad_rate() {
        let _ = P90Controller::new(P90Params::default(), 0.0);
    }

    // --- P90Controller -----------------------------------------------------------------------

    fn params_ms(target_ms: u64, nreq: u32) -> P90Params {
        P90Params {
            target_ns: target_ms * MS,
            nreq,
            ..P90Params::default()
        }
    }

    #[test]
    fn p90_percentile_index_of_a_full_window() {
        let mut c = P90Controller::new(params_ms(1000, 100), 100.0);
        // 100 samples 100, 99, ..., 1 ns: sorted[90] = 91.
        for (i, r) in (1..=100u64).rev().enumerate() {
            let out = c.observe(r, i as u64);
            assert_eq!(out.is_some(), i == 99, "runs exactly on the 100th sample");
        }
        assert_eq!(c.p90_smoothed_ns(), Some(91.0));
        assert_eq!(c.pending_samples(), 0);
    }

    #[test]
    fn p90_decrease_steps_by_hand() {
        // target 1 ms, nreq 10, alpha 0.7, start at 100/s.
        let mut c = P90Controller::new(params_ms(1, 10), 100.0);
        assert_eq!(c.p90_smoothed_ns(), None);
        // Window 1: 1..=10 ms; sorted[9] = 10 ms. cur = 10 ms (first run), err = 9 > 0.
        for k in 1..=9 {
            assert_eq!(c.observe(k * MS, 0), None);
        }
        let r1 = c.observe(10 * MS, 0).unwrap();
        assert_eq!(c.p90_smoothed_ns(), Some(10_000_000.0));
        assert_eq!(r1, 100.0 / 1.2);
        // Window 2: all 0.1 ms. cur = 0.7 * 10 ms + 0.3 * 0.1 ms = 7.03 ms, err = 6.03 > 0.
        let mut r2 = None;
        for _ in 0..10 {
            r2 = c.observe(100_000, 0);
        }
        assert!(close(c.p90_smoothed_ns().unwrap(), 7_030_000.0));
        assert_eq!(r2.unwrap(), 100.0 / 1.2 / 1.2);
        assert_eq!(c.rate_per_s(), r2.unwrap());
    }

    #[test]
    fn p90_increase_and_deadband_by_hand() {
        // Window at 0.2 ms against 1 ms: err = -0.8 < -0.5, increase 2.0 * (0.8 - 0.1) = 1.4.
        let mut c = P90Controller::new(params_ms(1, 10), 100.0);
        let mut r = None;
        for _ in 0..10 {
            r = c.observe(200_000, 0);
        }
        assert!(close(r.unwrap(), 101.4), "{r:?}");
        // Next window at 0.9 ms: cur = 0.7 * 0.2 + 0.3 * 0.9 = 0.41 ms, err = -0.59:
        // increase 2.0 * (0.59 - 0.1) = 0.98.
        for _ in 0..10 {
            r = c.observe(900_000, 0);
        }
        assert!(close(c.p90_smoothed_ns().unwrap(), 410_000.0));
        assert!(close(r.unwrap(), 101.4 + 0.98), "{r:?}");
        // Next at 0.9 ms: cur = 0.7 * 0.41 + 0.3 * 0.9 = 0.557 ms, err = -0.443: deadband.
        let before = c.rate_per_s();
        for _ in 0..10 {
            r = c.observe(900_000, 0);
        }
        assert!(close(c.p90_smoothed_ns().unwrap(), 557_000.0));
        assert_eq!(r, Some(before));
    }

    #[test]
    fn p90_rate_is_clamped() {
        let p = params_ms(1, 1);
        let mut c = P90Controller::new(p.clone(), 0.06);
        // One sample per run (nreq 1), far over target: 0.06 / 1.2 = 0.05, then stays at 0.05.
        assert!(close(c.observe(10 * MS, 0).unwrap(), 0.05));
        assert_eq!(c.observe(10 * MS, 0), Some(0.05));
        let mut c = P90Controller::new(p, 4999.0);
        // Far under target with alpha 0.7: cur = 0 -> err = -1, increase 1.8, clamped at 5000.
        assert_eq!(c.observe(0, 0), Some(5000.0));
        assert_eq!(c.observe(0, 0), Some(5000.0));
    }

    #[test]
    fn p90_timeout_runs_a_partial_window() {
        let mut c = P90Controller::new(params_ms(1, 100), 100.0);
        assert_eq!(c.tick(5 * S), None, "no samples: nothing to run");
        // Window opens at the first sample (t = 1 s).
        assert_eq!(c.observe(3 * MS, S), None);
        assert_eq!(c.observe(2 * MS, S + 300 * MS), None);
        assert_eq!(c.observe(5 * MS, S + 600 * MS), None);
        assert_eq!(c.tick(2 * S - 1), None);
        // 3 samples: index min(27 / 10, 2) = 2, the max (5 ms). err = 4: decrease.
        assert_eq!(c.tick(2 * S), Some(100.0 / 1.2));
        assert_eq!(c.p90_smoothed_ns(), Some(5_000_000.0));
        // Next window measured from the run at 2 s; a sample arriving after the timeout runs
        // at once (it is the only sample of a window that lasted > timeout).
        assert_eq!(c.tick(3 * S), None);
        assert!(c.observe(5 * MS, 3 * S + 1).is_some());
        // Observe also triggers on timeout, not only tick.
        assert_eq!(c.observe(5 * MS, 3 * S + 2), None);
        assert!(c.observe(5 * MS, 4 * S + 1).is_some());
    }

    #[test]
    fn p90_tolerates_time_going_backwards() {
        let mut c = P90Controller::new(params_ms(1, 100), 100.0);
        assert_eq!(c.observe(MS, 10 * S), None);
        assert_eq!(c.observe(MS, 5 * S), None);
        assert_eq!(c.tick(0), None);
    }

    // --- ClassedP90 --------------------------------------------------------------------------

    fn classed_params() -> P90Params {
        // alpha 0 makes cur equal to each window's percentile, so each step is visible.
        P90Params {
            nreq: 10,
            alpha: 0.0,
            ..P90Params::default()
        }
    }

    /// Feeds one full window of `class` at `response_ns`; returns what the last observe said.
    fn window(c: &mut ClassedP90, class: usize, response_ns: u64, now_ns: u64) -> bool {
        let mut changed = false;
        for _ in 0..10 {
            changed = c.observe(class, response_ns, now_ns);
        }
        changed
    }

    #[test]
    fn classed_limits_are_enforced() {
        let p = classed_params();
        assert!(ClassedP90::new(&[], p.clone(), 100.0)
            .unwrap_err()
            .contains("classes"));
        assert!(ClassedP90::new(&[MS; CLASSES_MAX + 1], p.clone(), 100.0)
            .unwrap_err()
            .contains("classes"));
        assert_eq!(
            ClassedP90::new(&[MS; CLASSES_MAX], p.clone(), 100.0)
                .unwrap()
                .classes(),
            16
        );
        let e = ClassedP90::new(&[MS, 0], p.clone(), 100.0).unwrap_err();
        assert!(e.contains("class 1") && e.contains("target_ns"), "{e}");
        assert!(ClassedP90::new(&[MS], p, 0.0)
            .unwrap_err()
            .contains("initial rate"));
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn classed_class_out_of_range_panics() {
        let mut c = ClassedP90::new(&[MS, MS], classed_params(), 100.0).unwrap();
        c.observe(2, MS, 0);
    }

    #[test]
    fn classed_high_over_target_cuts_lower_classes_by_ten() {
        let mut c = ClassedP90::new(&[MS, MS, MS], classed_params(), 100.0).unwrap();
        assert!(window(&mut c, 0, 5 * MS, 0));
        assert!(c.over_target(0));
        assert_eq!(c.rate_per_s(0), 100.0, "the high class keeps its rate");
        assert_eq!(c.rate_per_s(1), 10.0);
        assert_eq!(c.rate_per_s(2), 10.0);
        // The middle class over target cuts only the class below it.
        assert!(window(&mut c, 1, 5 * MS, 0));
        assert_eq!(c.rate_per_s(0), 100.0);
        assert_eq!(c.rate_per_s(1), 10.0);
        assert_eq!(c.rate_per_s(2), 1.0);
    }

    #[test]
    fn classed_lowest_class_follows_single_class_rule() {
        let mut c = ClassedP90::new(&[MS, MS], classed_params(), 100.0).unwrap();
        assert!(window(&mut c, 1, 5 * MS, 0));
        assert_eq!(c.rate_per_s(1), 100.0 / 1.2);
        assert_eq!(c.rate_per_s(0), 100.0);
    }

    #[test]
    fn classed_low_class_cannot_increase_while_high_class_is_over() {
        let mut c = ClassedP90::new(&[MS, MS], classed_params(), 100.0).unwrap();
        window(&mut c, 0, 5 * MS, 0);
        assert_eq!(c.rate_per_s(1), 10.0);
        // Class 1 far under target (err = -0.9) would increase, but class 0 is over.
        assert!(!window(&mut c, 1, 100_000, 100 * MS));
        assert_eq!(c.rate_per_s(1), 10.0);
        // Class 0 back at half its target: err = -0.5, not over (and no increase for it).
        assert!(!window(&mut c, 0, 500_000, 200 * MS));
        assert!(!c.over_target(0));
        // Now class 1 increases by 2.0 * (0.9 - 0.1) = 1.6.
        assert!(window(&mut c, 1, 100_000, 300 * MS));
        assert!(close(c.rate_per_s(1), 11.6));
    }

    #[test]
    fn classed_over_flag_lapses_when_high_class_goes_quiet() {
        let mut c = ClassedP90::new(&[MS, MS], classed_params(), 100.0).unwrap();
        window(&mut c, 0, 5 * MS, 0);
        // Within two timeouts of class 0's last run: held.
        assert!(!window(&mut c, 1, 100_000, 2 * S));
        assert_eq!(c.rate_per_s(1), 10.0);
        // Class 0 has not run for more than two timeouts: its flag no longer holds class 1.
        assert!(window(&mut c, 1, 100_000, 2 * S + 1));
        assert!(close(c.rate_per_s(1), 11.6));
    }

    #[test]
    fn classed_shed_high_class_counts_as_over_and_cuts_the_lower_class() {
        let mut c = ClassedP90::new(&[MS, MS], classed_params(), 100.0).unwrap();
        // Class 0 served its requests at a quarter of its target (err = -0.75) ...
        c.note_shed(0);
        // ... but its queue bound refused some: the lower class is cut, class 0 keeps its rate.
        assert!(window(&mut c, 0, 250_000, 0));
        assert!(c.over_target(0));
        assert_eq!(c.rate_per_s(0), 100.0);
        assert_eq!(c.rate_per_s(1), 10.0);
        // The flag is for one run only: the next clean run is under target and increases.
        assert!(window(&mut c, 0, 250_000, 0));
        assert!(!c.over_target(0));
        assert!(close(c.rate_per_s(0), 100.0 + 2.0 * 0.65));
        // The lowest class has nobody to cut: a shed alone does not count as over there.
        c.note_shed(1);
        assert!(window(&mut c, 1, 250_000, 10 * S));
        assert!(!c.over_target(1));
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn classed_note_shed_out_of_range_panics() {
        let mut c = ClassedP90::new(&[MS, MS], classed_params(), 100.0).unwrap();
        c.note_shed(2);
    }

    // --- LittleBound --------------------------------------------------------------------------

    #[test]
    fn little_bound_limits_are_enforced() {
        assert!(LittleBound::new(0, 0.5, 100)
            .unwrap_err()
            .contains("target_ns"));
        assert!(LittleBound::new(P90_TIME_MAX_NS + 1, 0.5, 100).is_err());
        assert!(LittleBound::new(MS, 0.0, 100)
            .unwrap_err()
            .contains("fraction"));
        assert!(LittleBound::new(MS, 1.5, 100)
            .unwrap_err()
            .contains("fraction"));
        assert!(LittleBound::new(MS, f64::NAN, 100).is_err());
        assert!(LittleBound::new(MS, 0.5, 0)
            .unwrap_err()
            .contains("limit_max"));
        let p = |f| P90Params {
            queue_bound_fraction: f,
            ..P90Params::default()
        };
        assert!(p(1.5)
            .validate()
            .unwrap_err()
            .contains("queue_bound_fraction"));
        assert!(p(0.5).validate().is_ok());
    }

    #[test]
    fn little_bound_is_fraction_of_target_times_backlogged_departure_rate() {
        // Target 20 ms, half of it: at 2,000 departures/s the queue may hold 20.
        let mut b = LittleBound::new(20 * MS, 0.5, 10_000).unwrap();
        assert_eq!(b.bound(), 10_000, "no bound before the first window");
        assert_eq!(b.observe(0, 0, u64::MAX, 0), None);
        // 100 completions over 50 ms of backlog = 2,000/s.
        assert_eq!(b.observe(99, 49 * MS, u64::MAX, 0), None);
        assert_eq!(b.observe(1, 50 * MS, u64::MAX, 0), Some(20));
        assert_eq!(b.rate_per_s(), Some(2_000.0));
        // Next window at 4,000/s: smoothed to 3,000/s, bound 30.
        assert_eq!(b.observe(200, 100 * MS, u64::MAX, 0), Some(30));
        // Idle intervals do not count (the oldest message of the batch was queued after the
        // previous report): 40 completions in 20 ms of backlog, in a window whose first 30 ms
        // began with an empty queue, is 2,000/s (smoothed with 3,000: 2,500/s).
        assert_eq!(b.observe(5, 130 * MS, 0, 0), None);
        assert_eq!(b.observe(20, 140 * MS, 10 * MS, 0), None);
        assert_eq!(b.observe(20, 150 * MS, u64::MAX, 0), Some(25));
        // A window with under 5 ms of backlog keeps the bound.
        assert_eq!(b.observe(1, 300 * MS, 0, 0), None);
        assert_eq!(b.bound(), 25);
        // A slow backlogged window lowers it, down to the floor.
        assert_eq!(b.observe(1, 10 * S, u64::MAX, 0), Some(12));
        assert_eq!(b.observe(1, 20 * S, u64::MAX, 0), Some(6));
        assert_eq!(b.observe(1, 30 * S, u64::MAX, 0), Some(LITTLE_BOUND_MIN));
    }

    #[test]
    fn little_bound_counts_throughput_when_it_refused() {
        // A queue kept at a bound no larger than a batch is emptied by every batch, so it
        // never looks backlogged; refusals show that demand exceeded it.
        let mut b = LittleBound::new(20 * MS, 0.5, 10_000).unwrap();
        b.observe(0, 0, 0, 0);
        // 100 completions in 50 ms, never backlogged, no refusal: nothing learnt.
        assert_eq!(b.observe(100, 50 * MS, 0, 0), None);
        // The same with refusals: 2,000/s, bound 20.
        assert_eq!(b.observe(100, 100 * MS, 0, 3), Some(20));
        // The larger of the two estimates wins: backlogged 4,000/s vs throughput 1,000/s.
        assert_eq!(b.observe(10, 140 * MS, 0, 1), None);
        assert_eq!(b.observe(40, 150 * MS, u64::MAX, 0), Some(30));
    }

    #[test]
    fn little_bound_never_exceeds_the_queue_limit() {
        let mut b = LittleBound::new(S, 1.0, 50).unwrap();
        b.observe(0, 0, u64::MAX, 0);
        // 1e6/s × 1 s would be a million: capped at the queue's own limit.
        assert_eq!(b.observe(50_000, 50 * MS, u64::MAX, 0), Some(50));
        // A huge count saturates instead of overflowing.
        assert_eq!(b.observe(u64::MAX, 100 * MS, u64::MAX, 0), Some(50));
    }

    #[test]
    fn classed_lc_thresh_cuts_the_high_class_itself() {
        let mut c = ClassedP90::new(&[MS, MS], classed_params(), 1.0).unwrap();
        // Run 1: class 1 from 1.0 to 0.1; run 2: to 0.05 (0.01 clamped at rate_min).
        assert!(window(&mut c, 0, 5 * MS, 0));
        assert!(close(c.rate_per_s(1), 0.1));
        assert!(window(&mut c, 0, 5 * MS, 0));
        assert_eq!(c.rate_per_s(1), 0.05);
        assert_eq!(c.low_count(0), 0);
        // Runs 3..=21: lower class at the floor, lc counts up to 19, class 0 untouched.
        for k in 1..LC_THRESH {
            assert!(!window(&mut c, 0, 5 * MS, 0));
            assert_eq!(c.low_count(0), k);
            assert_eq!(c.rate_per_s(0), 1.0);
        }
        // Run 22: lc reaches 20, class 0 divides its own rate by adj_d, lc resets.
        assert!(window(&mut c, 0, 5 * MS, 0));
        assert_eq!(c.rate_per_s(0), 1.0 / 1.2);
        assert_eq!(c.low_count(0), 0);
        // An under-target run also resets the count.
        assert!(!window(&mut c, 0, 5 * MS, 0));
        assert_eq!(c.low_count(0), 1);
        window(&mut c, 0, 800_000, 0);
        assert_eq!(c.low_count(0), 0);
    }

    #[test]
    fn classed_tick_runs_on_timeout() {
        let mut c = ClassedP90::new(&[MS, MS], classed_params(), 100.0).unwrap();
        assert!(!c.observe(0, 5 * MS, 0));
        assert!(!c.tick(S - 1));
        assert!(c.tick(S));
        assert_eq!(c.rate_per_s(1), 10.0);
        assert_eq!(c.p90_smoothed_ns(0), Some(5_000_000.0));
        assert_eq!(c.p90_smoothed_ns(1), None);
    }

    // --- BatchingController ------------------------------------------------------------------

    /// Throughput as a function of batch size with its optimum at 200, shaped like SEDA's
    /// Fig. 32: below 200 an expensive per-batch operation is amortized over fewer events
    /// (throughput roughly proportional to the batch), above 200 it falls off slowly.
    fn fig32(batch: u32) -> f64 {
        let b = f64::from(batch);
        let peak = 100_000.0;
        if b <= 200.0 {
            peak * b * 10_200.0 / (200.0 * (10_000.0 + b))
        } else {
            peak * (200.0 / b).sqrt()
        }
    }

    #[test]
    fn batching_settles_near_the_optimum() {
        let mut c = BatchingController::new(1000);
        assert_eq!(c.batch(), 1000);
        let mut b = c.batch();
        let mut trace = Vec::new();
        for _ in 0..300 {
            b = c.observe(fig32(b));
            trace.push(b);
        }
        let tail = &trace[50..];
        for &x in tail {
            assert!(
                (120..=280).contains(&x),
                "batch {x} strays from 200: {tail:?}"
            );
        }
        let mean = tail.iter().map(|&x| f64::from(x)).sum::<f64>() / tail.len() as f64;
        assert!((160.0..=240.0).contains(&mean), "mean {mean}");
    }

    #[test]
    fn batching_shrink_then_grow_by_hand() {
        let mut c = BatchingController::new(1000);
        // Constant throughput: shrink ×0.8 each window.
        assert_eq!(c.observe(100.0), 800);
        assert_eq!(c.observe(100.0), 640);
        assert_eq!(c.phase(), BatchPhase::Shrink);
        // 89 < 0.9 * 100: grow ×1.2 (640 * 1.2 = 768).
        assert_eq!(c.observe(89.0), 768);
        assert_eq!(c.phase(), BatchPhase::Grow);
        // 92 < 0.95 * 100 and better than 89: keep growing.
        assert_eq!(c.observe(92.0), 922);
        // 96 >= 95: approached best, shrink again.
        assert_eq!(c.observe(96.0), 737);
        assert_eq!(c.phase(), BatchPhase::Shrink);
        // Idle window: nothing changes.
        assert_eq!(c.observe(0.0), 737);
        // Grow phase that gets worse turns back to shrinking.
        assert_eq!(c.observe(80.0), 885);
        assert_eq!(c.observe(70.0), 708);
        assert_eq!(c.phase(), BatchPhase::Shrink);
    }

    #[test]
    fn batching_resets_on_sudden_drop() {
        let mut c = BatchingController::new(1000);
        for _ in 0..10 {
            c.observe(1000.0);
        }
        assert!(c.batch() < 200);
        assert_eq!(c.observe(499.0), 1000);
        assert_eq!(c.phase(), BatchPhase::Shrink);
        assert_eq!(
            c.best_per_s(),
            499.0,
            "history restarts from the new regime"
        );
        // The new regime is not a drop from itself: shrinking resumes.
        assert_eq!(c.observe(499.0), 800);
    }

    #[test]
    fn batching_best_is_forgotten_after_the_window() {
        let mut c = BatchingController::new(1000);
        c.observe(1000.0);
        for _ in 0..BATCH_BEST_WINDOWS {
            c.observe(600.0);
        }
        assert_eq!(c.best_per_s(), 600.0);
    }

    #[test]
    fn batching_climbs_from_one() {
        let mut c = BatchingController::new(1000);
        for _ in 0..40 {
            c.observe(100.0);
        }
        assert_eq!(c.batch(), 1, "bottoms out at 1");
        // Throughput falls below 90% of best: grow; the real-valued batch climbs past 1.
        let mut seen = vec![c.observe(85.0)];
        for t in [86.0, 87.0, 88.0, 89.0, 90.0, 91.0] {
            seen.push(c.observe(t));
        }
        assert!(seen.windows(2).all(|w| w[0] <= w[1]), "{seen:?}");
        assert!(*seen.last().unwrap() >= 3, "{seen:?}");
    }

    #[test]
    #[should_panic(expected = "batch_max")]
    fn batching_refuses_zero_max() {
        let _ = BatchingController::new(0);
    }

    #[test]
    #[should_panic(expected = "batch_max")]
    fn batching_refuses_huge_max() {
        let _ = BatchingController::new(BATCH_MAX + 1);
    }

    #[test]
    #[should_panic(expected = "throughput")]
    fn batching_refuses_nan_throughput() {
        BatchingController::new(10).observe(f64::NAN);
    }

    proptest! {
        #[test]
        fn batching_stays_in_range(
            max in 1u32..5000,
            tputs in proptest::collection::vec(0.0f64..1e6, 1..200)
        ) {
            let mut c = BatchingController::new(max);
            for t in tputs {
                let b = c.observe(t);
                prop_assert!((1..=max).contains(&b));
            }
        }
    }

    // --- Share-aware shedding ----------------------------------------------------------------

    #[test]
    fn over_share_ratio_examples() {
        // Half the usage with a quarter of the weight: twice its share.
        assert_eq!(over_share_ratio(50, 1, 100, 4), 2.0);
        assert_eq!(over_share_ratio(25, 1, 100, 4), 1.0);
        assert_eq!(over_share_ratio(0, 1, 100, 4), 0.0);
        assert_eq!(over_share_ratio(0, 3, 0, 4), 1.0);
    }

    #[test]
    #[should_panic(expected = "weight must be >= 1")]
    fn over_share_ratio_refuses_zero_weight() {
        over_share_ratio(1, 0, 1, 1);
    }

    #[test]
    #[should_panic(expected = "below the activity's weight")]
    fn over_share_ratio_refuses_total_below_weight() {
        over_share_ratio(1, 5, 1, 4);
    }

    #[test]
    fn shared_queue_limits_are_enforced() {
        assert!(SharedQueueLimit::new(0, 0)
            .unwrap_err()
            .contains("capacity"));
        assert!(SharedQueueLimit::new(SHARED_QUEUE_CAPACITY_MAX + 1, 1)
            .unwrap_err()
            .contains("capacity"));
        assert!(SharedQueueLimit::new(10, 11)
            .unwrap_err()
            .contains("high_water"));
        let l = SharedQueueLimit::new(10, 10).unwrap();
        assert_eq!((l.capacity(), l.high_water()), (10, 10));
        // No shedding band: a plain bound.
        assert_eq!(l.verdict(9, 9, 1, 2), Verdict::Admit);
        assert_eq!(
            l.verdict(10, 0, 1, 2),
            Verdict::Reject(RejectReason::QueueFull)
        );
    }

    #[test]
    fn shared_queue_sheds_over_share_first() {
        let l = SharedQueueLimit::new(100, 50).unwrap();
        // Below high water: everyone, even a hog.
        assert_eq!(l.verdict(49, 49, 1, 2), Verdict::Admit);
        // At 80 queued: tolerance = 2 - 30/50 = 1.4; fair portion of each of two equal
        // activities = 40, so the limit is 56.
        assert_eq!(l.verdict(80, 60, 1, 2), Verdict::Reject(RejectReason::Shed));
        assert_eq!(l.verdict(80, 56, 1, 2), Verdict::Admit);
        assert_eq!(l.verdict(80, 20, 1, 2), Verdict::Admit);
        // Weights count: with weights 1 and 3 (sum 4), at 80 the weight-3 activity's fair
        // portion is 60, limit 84: 70 queued still gets in; the weight-1 one's limit is 28.
        assert_eq!(l.verdict(80, 70, 3, 4), Verdict::Admit);
        assert_eq!(l.verdict(80, 29, 1, 4), Verdict::Reject(RejectReason::Shed));
        // Near capacity the under-share activity still gets in; at capacity nobody does.
        assert_eq!(l.verdict(99, 10, 1, 2), Verdict::Admit);
        for (q, w) in [(0, 1), (10, 1), (99, 3)] {
            assert_eq!(
                l.verdict(100, q, w, 4),
                Verdict::Reject(RejectReason::QueueFull)
            );
            assert_eq!(
                l.verdict(150, q, w, 4),
                Verdict::Reject(RejectReason::QueueFull)
            );
        }
    }

    #[test]
    fn shared_queue_sheds_the_furthest_above_share_at_lowest_occupancy() {
        // Three equal activities holding 60%, 40% and 0% of the queue (ratios 1.8, 1.2, 0):
        // find the occupancy at which each is first shed.
        let l = SharedQueueLimit::new(1000, 500).unwrap();
        let first_shed = |fraction: f64| {
            (500..1000).find(|&total| {
                let q = (total as f64 * fraction) as usize;
                l.verdict(total, q, 1, 3) == Verdict::Reject(RejectReason::Shed)
            })
        };
        let hog = first_shed(0.6).unwrap();
        let over = first_shed(0.4).unwrap();
        assert!(hog < over, "hog shed at {hog}, lesser offender at {over}");
        assert_eq!(first_shed(0.0), None, "an idle activity is never shed");
    }

    #[test]
    #[should_panic(expected = "activity weight")]
    fn shared_queue_refuses_zero_weight() {
        SharedQueueLimit::new(10, 5).unwrap().verdict(6, 1, 0, 1);
    }

    #[test]
    #[should_panic(expected = "active weight sum")]
    fn shared_queue_refuses_sum_below_weight() {
        SharedQueueLimit::new(10, 5).unwrap().verdict(6, 1, 3, 2);
    }
}
