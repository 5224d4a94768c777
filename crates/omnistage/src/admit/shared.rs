//! Share-aware shedding: [`over_share_ratio`] and [`SharedQueueLimit`].

use super::*;

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
