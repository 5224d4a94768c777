//! [`BatchingController`]: SEDA's batching-factor controller.

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
pub(super) const BATCH_BEST_WINDOWS: usize = 16;

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
