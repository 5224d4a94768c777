//! Gates: the admission point of one (stage, activity) queue, checked in the sender's context.
//!
//! A gate is shared by every thread that sends to its queue, so everything on its send path is
//! a lock-free atomic: the queued count (the bound), the stage-wide occupancy used for
//! share-aware shedding, and the token bucket (a GCRA cell) that the threshold, token-bucket
//! and p90 predicates act through. The p90 controller itself is single-threaded; the worker
//! that dispatches the queue feeds it response times once per batch under a `try_lock`, and
//! sets the bucket's rate from what it decides.

use crate::admit::{GcraBucket, P90Controller, P90Params, RejectReason, SharedQueueLimit, Verdict};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
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
    bucket: Option<GcraBucket>,
    controller: Option<Mutex<P90Controller>>,
    pub(crate) rejected: AtomicU64,
}

impl Gate {
    pub(crate) fn new(limit: usize, weight: u32, predicate: &Predicate) -> Self {
        let (bucket, controller) = match predicate {
            Predicate::Threshold => (None, None),
            Predicate::TokenBucket { rate_per_s, burst } => {
                (Some(GcraBucket::new(*rate_per_s, *burst)), None)
            }
            Predicate::P90 {
                params,
                initial_rate_per_s,
                burst,
            } => (
                Some(GcraBucket::new(*initial_rate_per_s, *burst)),
                Some(Mutex::new(P90Controller::new(
                    params.clone(),
                    *initial_rate_per_s,
                ))),
            ),
        };
        Gate {
            queued: AtomicUsize::new(0),
            limit,
            weight: AtomicU64::new(u64::from(weight)),
            weight_in_sum: AtomicU64::new(0),
            bucket,
            controller,
            rejected: AtomicU64::new(0),
        }
    }

    /// Reserves a place for one message, or says why not. On `Admit` the caller must either
    /// enqueue the message or call [`Gate::release`].
    pub(crate) fn admit(&self, stage: &StageLoad, now_ns: u64) -> Verdict {
        let q = self.queued.fetch_add(1, Ordering::AcqRel);
        if q >= self.limit {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return self.reject(RejectReason::QueueFull);
        }
        let total = stage.queued.fetch_add(1, Ordering::AcqRel);
        if q == 0 {
            self.enter_sum(stage);
        }
        if let Some(limit) = &stage.limit {
            let weight = self.weight.load(Ordering::Relaxed);
            let active = stage.active_weight.load(Ordering::Acquire).max(weight);
            if let Verdict::Reject(r) = limit.verdict(total, q, weight as u32, active) {
                self.release(stage);
                return self.reject(r);
            }
        }
        if let Some(b) = &self.bucket {
            if !b.try_admit(now_ns) {
                self.release(stage);
                return self.reject(RejectReason::Predicate);
            }
        }
        Verdict::Admit
    }

    /// Counts a message in without any check (I/O readiness, which must not be refused and is
    /// bounded by one per source).
    pub(crate) fn force_admit(&self, stage: &StageLoad) {
        let q = self.queued.fetch_add(1, Ordering::AcqRel);
        stage.queued.fetch_add(1, Ordering::AcqRel);
        if q == 0 {
            self.enter_sum(stage);
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
        stage.queued.fetch_sub(n, Ordering::AcqRel);
        if q == n {
            let w = self.weight_in_sum.load(Ordering::Relaxed);
            stage.active_weight.fetch_sub(w, Ordering::AcqRel);
        }
    }

    pub(crate) fn has_controller(&self) -> bool {
        self.controller.is_some()
    }

    /// Feeds response times to the controller, if nobody else is feeding it right now
    /// (samples are dropped under contention: the controller works on a sample anyway).
    pub(crate) fn observe(&self, responses_ns: &[u64], now_ns: u64) {
        let (Some(c), Some(b)) = (&self.controller, &self.bucket) else {
            return;
        };
        if let Ok(mut c) = c.try_lock() {
            for &r in responses_ns {
                if let Some(rate) = c.observe(r, now_ns) {
                    b.set_rate(rate);
                }
            }
        }
    }

    pub(crate) fn rate_per_s(&self) -> Option<f64> {
        self.bucket.as_ref().map(|b| b.rate_per_s())
    }
}
