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
//!
//! Layout: verdicts, the threshold and the bucket here; the response-time controllers in
//! `p90.rs`, the Little's-law bound in `little.rs`, batching in `batching.rs`, share-aware
//! shedding in `shared.rs`.

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

mod batching;
mod little;
mod p90;
mod shared;

pub use batching::*;
pub use little::*;
pub use p90::*;
pub use shared::*;

#[cfg(test)]
mod tests;
