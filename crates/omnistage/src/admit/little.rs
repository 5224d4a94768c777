//! [`LittleBound`]: a queue bound from Little's law (target × measured completion rate).

use super::*;

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
