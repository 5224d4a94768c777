//! Gates: the admission point of one (stage, activity) queue, checked in the sender's context.
//!
//! A gate is shared by every thread that sends to its queue, so everything on its send path is
//! a lock-free atomic: the queued count (the bound), the stage-wide occupancy used for
//! share-aware shedding, and the token bucket (a GCRA cell) that the threshold, token-bucket
//! and p90 predicates act through. The p90 controller itself is single-threaded; the worker
//! that dispatches the queue feeds it response times once per batch under a `try_lock`, and
//! sets the bucket's rate from what it decides.

use crate::admit::{GcraBucket, P90Controller, P90Params, RejectReason, SharedQueueLimit, Verdict};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Admission predicate of a queue.
#[derive(Clone, Debug, PartialEq)]
pub enum Predicate {
    /// Only the queue bound.
    Threshold,
    /// A token bucket: `rate_per_s` admissions per second, `burst` back to back.
    TokenBucket { rate_per_s: f64, burst: u32 },
    /// SEDA's 90th-percentile response-time controller driving a token bucket.
    P90 {
        params: P90Params,
        initial_rate_per_s: f64,
        burst: u32,
    },
}

/// Stage-wide occupancy, shared by the gates of every activity of one stage.
#[derive(Debug)]
pub(crate) struct StageLoad {
    pub(crate) queued: AtomicUsize,
    /// Sum of the weights of activities with queued work in this stage.
    pub(crate) active_weight: AtomicU64,
    pub(crate) limit: Option<SharedQueueLimit>,
}

impl StageLoad {
    pub(crate) fn new(limit: Option<SharedQueueLimit>) -> Self {
        StageLoad {
            queued: AtomicUsize::new(0),
            active_weight: AtomicU64::new(0),
            limit,
        }
    }
}

/// The gate of one (stage, activity).
#[derive(Debug)]
pub(crate) struct Gate {
    pub(crate) queued: AtomicUsize,
    pub(crate) limit: usize,
    /// The activity's weight, for shedding; changed at run time.
    weight: AtomicU64,
    /// The weight this gate added to its stage's `active_weight` when it became non-empty
    /// (so a weight change in between subtracts exactly what was added).
    weight_in_sum: AtomicU64,
    /// The token bucket that the token-bucket and p90 predicates act through; consulted only
    /// while `bucket_on` (the predicate can change at run time, in place, so that every
    /// sender's and queue's reference to this gate stays valid).
    bucket: GcraBucket,
    bucket_on: AtomicBool,
    controller: Mutex<Option<P90Controller>>,
    controller_on: AtomicBool,
    pub(crate) rejected: AtomicU64,
    /// Of `queued`, the messages admitted with a delay and still waiting for their time (on
    /// a timer or in transit to one); touched only on the timer path.
    pub(crate) delayed: AtomicUsize,
}

/// Rate of a bucket that is off (never consulted); any valid value.
const IDLE_RATE_PER_S: f64 = 1.0;

impl Gate {
    pub(crate) fn new(limit: usize, weight: u32, predicate: &Predicate) -> Self {
        let g = Gate {
            queued: AtomicUsize::new(0),
            limit,
            weight: AtomicU64::new(u64::from(weight)),
            weight_in_sum: AtomicU64::new(0),
            bucket: GcraBucket::new(IDLE_RATE_PER_S, 1),
            bucket_on: AtomicBool::new(false),
            controller: Mutex::new(None),
            controller_on: AtomicBool::new(false),
            rejected: AtomicU64::new(0),
            delayed: AtomicUsize::new(0),
        };
        g.set_predicate(predicate);
        g
    }

    /// Changes the predicate in place (validated by the caller).
    pub(crate) fn set_predicate(&self, predicate: &Predicate) {
        match predicate {
            Predicate::Threshold => {
                self.bucket_on.store(false, Ordering::Release);
                self.controller_on.store(false, Ordering::Release);
                *self.controller.lock().expect("controller lock") = None;
            }
            Predicate::TokenBucket { rate_per_s, burst } => {
                self.controller_on.store(false, Ordering::Release);
                *self.controller.lock().expect("controller lock") = None;
                self.bucket.set_rate(*rate_per_s);
                self.bucket.set_burst(*burst);
                self.bucket_on.store(true, Ordering::Release);
            }
            Predicate::P90 {
                params,
                initial_rate_per_s,
                burst,
            } => {
                self.bucket.set_rate(*initial_rate_per_s);
                self.bucket.set_burst(*burst);
                *self.controller.lock().expect("controller lock") =
                    Some(P90Controller::new(params.clone(), *initial_rate_per_s));
                self.controller_on.store(true, Ordering::Release);
                self.bucket_on.store(true, Ordering::Release);
            }
        }
    }

    /// Reserves a place for one message, or says why not. On `Admit` the caller must either
    /// enqueue the message or call [`Gate::release`].
    pub(crate) fn admit(&self, stage: &StageLoad, now_ns: u64) -> Verdict {
        // Only a sender that gets a place touches the count: a refused one changes nothing,
        // so a concurrent release always sees whether it took the last place.
        let limit_q = self.limit;
        let Ok(q) = self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                (q < limit_q).then_some(q + 1)
            })
        else {
            return self.reject(RejectReason::QueueFull);
        };
        if let Some(limit) = &stage.limit {
            // Stage-wide occupancy is kept only for stages that shed by share: the counters
            // are shared by every core and activity of the stage.
            let total = stage.queued.fetch_add(1, Ordering::AcqRel);
            if q == 0 {
                self.enter_sum(stage);
            }
            let weight = self.weight.load(Ordering::Relaxed);
            let active = stage.active_weight.load(Ordering::Acquire).max(weight);
            if let Verdict::Reject(r) = limit.verdict(total, q, weight as u32, active) {
                self.release(stage);
                return self.reject(r);
            }
        }
        if self.bucket_on.load(Ordering::Acquire) && !self.bucket.try_admit(now_ns) {
            self.release(stage);
            return self.reject(RejectReason::Predicate);
        }
        Verdict::Admit
    }

    /// Counts a message in without any check (I/O readiness, which must not be refused and is
    /// bounded by one per source).
    pub(crate) fn force_admit(&self, stage: &StageLoad) {
        let q = self.queued.fetch_add(1, Ordering::AcqRel);
        if stage.limit.is_some() {
            stage.queued.fetch_add(1, Ordering::AcqRel);
            if q == 0 {
                self.enter_sum(stage);
            }
        }
    }

    fn enter_sum(&self, stage: &StageLoad) {
        let w = self.weight.load(Ordering::Relaxed);
        self.weight_in_sum.store(w, Ordering::Relaxed);
        stage.active_weight.fetch_add(w, Ordering::AcqRel);
    }

    pub(crate) fn set_weight(&self, weight: u32) {
        self.weight.store(u64::from(weight), Ordering::Relaxed);
    }

    fn reject(&self, r: RejectReason) -> Verdict {
        self.rejected.fetch_add(1, Ordering::Relaxed);
        Verdict::Reject(r)
    }

    /// Gives back a place (the message was not enqueued after all).
    pub(crate) fn release(&self, stage: &StageLoad) {
        self.release_n(stage, 1);
    }

    /// Gives back `n` places (messages taken from the queue for a dispatch, or dropped).
    pub(crate) fn release_n(&self, stage: &StageLoad, n: usize) {
        let q = self.queued.fetch_sub(n, Ordering::AcqRel);
        debug_assert!(q >= n, "gate released more than admitted");
        if stage.limit.is_some() {
            stage.queued.fetch_sub(n, Ordering::AcqRel);
            if q == n {
                let w = self.weight_in_sum.load(Ordering::Relaxed);
                stage.active_weight.fetch_sub(w, Ordering::AcqRel);
            }
        }
    }

    /// A message admitted with a delay starts waiting for its time.
    pub(crate) fn delay_begin(&self) {
        self.delayed.fetch_add(1, Ordering::AcqRel);
    }

    /// A delayed message reached its queue (or was dropped).
    pub(crate) fn delay_end(&self) {
        self.delayed.fetch_sub(1, Ordering::AcqRel);
    }

    /// Messages admitted and waiting for a dispatch, not counting delayed ones.
    pub(crate) fn ready_queued(&self) -> usize {
        let delayed = self.delayed.load(Ordering::Acquire);
        self.queued.load(Ordering::Acquire).saturating_sub(delayed)
    }

    pub(crate) fn has_controller(&self) -> bool {
        self.controller_on.load(Ordering::Relaxed)
    }

    /// Feeds response times to the controller, if nobody else is feeding it right now
    /// (samples are dropped under contention: the controller works on a sample anyway).
    pub(crate) fn observe(&self, responses_ns: &[u64], now_ns: u64) {
        if let Ok(mut c) = self.controller.try_lock() {
            if let Some(c) = c.as_mut() {
                for &r in responses_ns {
                    if let Some(rate) = c.observe(r, now_ns) {
                        self.bucket.set_rate(rate);
                    }
                }
            }
        }
    }

    pub(crate) fn rate_per_s(&self) -> Option<f64> {
        self.bucket_on
            .load(Ordering::Acquire)
            .then(|| self.bucket.rate_per_s())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Once: a sender refused at the bound undid its increment with a bare `fetch_sub`, and a
    /// concurrent release that saw the transient increment never subtracted the weight, so the
    /// stage's active weight only grew.
    #[test]
    fn active_weight_returns_to_zero_when_the_queue_is_empty() {
        let limit = SharedQueueLimit::new(1000, 900).expect("valid limit");
        let stage = Arc::new(StageLoad::new(Some(limit)));
        let gate = Arc::new(Gate::new(1, 100, &Predicate::Threshold));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (stage, gate) = (stage.clone(), gate.clone());
                std::thread::spawn(move || {
                    for _ in 0..100_000 {
                        if let Verdict::Admit = gate.admit(&stage, 0) {
                            gate.release(&stage);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread");
        }
        assert_eq!(gate.queued.load(Ordering::SeqCst), 0);
        assert_eq!(stage.queued.load(Ordering::SeqCst), 0);
        assert_eq!(
            stage.active_weight.load(Ordering::SeqCst),
            0,
            "active weight leaked"
        );
    }
}
