//! The sampler: one copy of everything the runtime measures, taken every interval on its own
//! thread, so that rates and interval percentiles cover the last complete interval, plus a
//! bounded history of shares for the dashboard's chart.

use crate::model::HistoryPoint;
use crate::view;
use crate::Source;
use omnistage::account::{EdgeRow, LatencyRow, Snapshot, StretchRow};
use omnistage::exec::{QueueStat, Runtime};
use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Points of share history kept (five minutes at the default one-second interval).
pub(crate) const HISTORY_POINTS: usize = 300;

/// Everything measured, at one moment (each part read while workers run; see
/// `Ledger::snapshot` for how exact that is).
#[derive(Debug)]
pub(crate) struct Sample {
    /// `Runtime::now_ns` when the sample was taken.
    pub(crate) at_ns: u64,
    pub(crate) snap: Snapshot,
    pub(crate) lat: Vec<LatencyRow>,
    /// Per core: how long each dispatch and I/O round held the loop.
    pub(crate) stretches: Vec<StretchRow>,
    pub(crate) queues: Vec<QueueStat>,
    pub(crate) edges: Vec<EdgeRow>,
}

impl Sample {
    pub(crate) fn take(rt: &Runtime) -> Sample {
        Sample {
            at_ns: rt.now_ns(),
            snap: rt.snapshot(),
            lat: rt.latencies(),
            stretches: rt.stretches(),
            queues: rt.queues(),
            edges: rt.edges(),
        }
    }
}

/// The last two samples: rates are taken between them.
#[derive(Clone, Debug)]
pub(crate) struct Window {
    pub(crate) prev: Arc<Sample>,
    pub(crate) last: Arc<Sample>,
}

impl Window {
    pub(crate) fn dt_s(&self) -> f64 {
        (self.last.at_ns.saturating_sub(self.prev.at_ns) as f64 / 1e9).max(1e-9)
    }
}

/// A window is stale, and the API gives no rates from it, once its last sample is older than
/// this many intervals: the sampler has stopped sampling (a tick that panics each time), and
/// the last interval's rates are not the current ones.
pub(crate) const STALE_INTERVALS: u32 = 2;
/// ...and never sooner than this: at a short interval a sampler thread kept off the CPU for a
/// while (CI's hypervisor takes the CPUs for up to 250 ms) is late, not stopped.
pub(crate) const STALE_AFTER_MIN: Duration = Duration::from_secs(1);

#[derive(Default)]
pub(crate) struct State {
    prev: Option<Arc<Sample>>,
    last: Option<Arc<Sample>>,
    history: VecDeque<HistoryPoint>,
    /// The sampler's interval (zero without a sampler thread).
    interval: Duration,
    /// Ticks that panicked since start.
    failures: u64,
}

impl State {
    pub(crate) fn new(interval: Duration) -> State {
        State {
            interval,
            ..State::default()
        }
    }

    /// The last two samples, however old (the history's point is taken from them).
    fn pair(&self) -> Option<Window> {
        Some(Window {
            prev: self.prev.clone()?,
            last: self.last.clone()?,
        })
    }

    /// How old the last sample may be for its window to be current.
    pub(crate) fn stale_after(&self) -> Duration {
        (self.interval * STALE_INTERVALS).max(STALE_AFTER_MIN)
    }

    /// Seconds since the last sample at `now_ns` (`Runtime::now_ns`); `None` before the first.
    pub(crate) fn age_s(&self, now_ns: u64) -> Option<f64> {
        self.last
            .as_ref()
            .map(|l| now_ns.saturating_sub(l.at_ns) as f64 / 1e9)
    }

    /// The window rates are taken over, at `now_ns`: `None` before two samples exist, and when
    /// the last one is older than [`State::stale_after`] (rates are then `null`, not old ones
    /// passed off as current).
    pub(crate) fn window(&self, now_ns: u64) -> Option<Window> {
        let w = self.pair()?;
        let age = now_ns.saturating_sub(w.last.at_ns);
        (u128::from(age) <= self.stale_after().as_nanos()).then_some(w)
    }

    /// Ticks that panicked since start.
    pub(crate) fn failures(&self) -> u64 {
        self.failures
    }

    pub(crate) fn history(&self) -> Vec<HistoryPoint> {
        self.history.iter().cloned().collect()
    }
}

/// Takes one sample now (called at start, then every interval).
fn tick(rt: &Runtime, state: &Mutex<State>) {
    let sample = Arc::new(Sample::take(rt));
    let window = {
        let mut st = state.lock().unwrap_or_else(PoisonError::into_inner);
        st.prev = st.last.take();
        st.last = Some(sample);
        st.pair()
    };
    if let Some(w) = window {
        let point = view::history_point(rt, &w);
        let mut st = state.lock().unwrap_or_else(PoisonError::into_inner);
        st.history.push_back(point);
        while st.history.len() > HISTORY_POINTS {
            st.history.pop_front();
        }
    }
}

/// [`tick`] with a panic contained and counted: the sampler goes on at the next interval, and
/// while it keeps failing its last window goes stale ([`State::window`]).
pub(crate) fn tick_contained(source: &dyn Source, state: &Mutex<State>) {
    let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        tick(source.runtime(), state)
    }))
    .is_ok();
    if !ok {
        state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .failures += 1;
    }
}

/// The sampler thread's body: a sample every `interval` until `stop` says so (or closes).
pub(crate) fn run(
    source: Arc<dyn Source>,
    state: Arc<Mutex<State>>,
    interval: Duration,
    stop: Receiver<()>,
) {
    // A panic in a tick is reported (and counted in /metrics) as the admin stage's.
    omnistage::exec::panic::set_thread_stage("admin");
    loop {
        match stop.recv_timeout(interval) {
            Err(RecvTimeoutError::Timeout) => tick_contained(&*source, &state),
            _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ns: u64) -> Arc<Sample> {
        Arc::new(Sample {
            at_ns: ns,
            snap: Default::default(),
            lat: Vec::new(),
            stretches: Vec::new(),
            queues: Vec::new(),
            edges: Vec::new(),
        })
    }

    #[test]
    fn a_window_goes_stale_past_two_intervals_and_not_before_the_floor() {
        let mut st = State::new(Duration::from_secs(2));
        assert!(st.window(0).is_none() && st.age_s(0).is_none());
        st.prev = Some(at(1_000_000_000));
        st.last = Some(at(3_000_000_000));
        // Two intervals of 2 s: fresh up to 4 s after the last sample, stale past it.
        assert!(st.window(7_000_000_000).is_some());
        assert!(st.window(7_000_000_001).is_none());
        assert_eq!(st.age_s(7_000_000_001), Some(4.000000001));
        // At 50 ms, two intervals are 100 ms: the floor of a second holds instead.
        st.interval = Duration::from_millis(50);
        assert_eq!(st.stale_after(), STALE_AFTER_MIN);
        assert!(st.window(4_000_000_000).is_some());
        assert!(st.window(4_000_000_001).is_none());
    }
}
