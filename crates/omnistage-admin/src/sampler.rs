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

#[derive(Default)]
pub(crate) struct State {
    prev: Option<Arc<Sample>>,
    last: Option<Arc<Sample>>,
    history: VecDeque<HistoryPoint>,
}

impl State {
    pub(crate) fn window(&self) -> Option<Window> {
        Some(Window {
            prev: self.prev.clone()?,
            last: self.last.clone()?,
        })
    }

    pub(crate) fn history(&self) -> Vec<HistoryPoint> {
        self.history.iter().cloned().collect()
    }
}

/// Takes one sample now (called at start, then every interval).
pub(crate) fn tick(rt: &Runtime, state: &Mutex<State>) {
    let sample = Arc::new(Sample::take(rt));
    let window = {
        let mut st = state.lock().unwrap_or_else(PoisonError::into_inner);
        st.prev = st.last.take();
        st.last = Some(sample);
        st.window()
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

/// The sampler thread's body: a sample every `interval` until `stop` says so (or closes).
pub(crate) fn run(
    source: Arc<dyn Source>,
    state: Arc<Mutex<State>>,
    interval: Duration,
    stop: Receiver<()>,
) {
    loop {
        match stop.recv_timeout(interval) {
            Err(RecvTimeoutError::Timeout) => tick(source.runtime(), &state),
            _ => return,
        }
    }
}
