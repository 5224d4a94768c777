//! `account`: records, the ledger, and snapshots.
//!
//! Every dispatch is measured by `exec` and written here as a record charged to
//! (activity, stage, core). Each core writes only its own cells (single writer: a relaxed load
//! and store, no read-modify-write, no lock on the hot path); any thread may read a
//! [`Snapshot`] at any time while workers run. Cells are registered once per (activity, stage,
//! core) under a mutex — the only lock here, taken when a leaf is first created on a core, never
//! per message.
//!
//! Per core the ledger also keeps where the loop's own time went: idle (blocked waiting for
//! work), infra (polling, mailboxes, scheduling decisions), and the OS's own count of the worker
//! thread's CPU time, so that "unattributed" is measured against an independent clock.
//!
//! Each cell also keeps two latency [`Histogram`]s (queue wait and response time per message,
//! 64 fixed half-octave buckets, single writer), and an [`EdgeCounts`] table counts messages
//! per (source stage, destination stage) edge per core (SEDA's profiler): the stage graph as
//! measured.
//!
//! A removed activity's cells are folded into its core's aggregate of retired activities
//! ([`Ledger::retire`]): one cell per (stage, core) under the reserved id [`RETIRED`], so every
//! total stays what it was and a server that adds and removes tenants for months keeps at most
//! one retired cell per stage per core instead of every removed tenant's.
//!
//! This layer is pure: it never reads a clock; costs arrive as numbers.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Dense id of an activity (index in the activity table).
pub type ActivityId = u32;
/// Dense id of a stage (index in the stage table).
pub type StageId = u32;

/// The reserved activity id under which the ledger keeps what removed activities were charged
/// ([`Ledger::retire`]): snapshots and latencies show it as one row per (stage, core), and
/// `by_activity` as one more activity. The activity table never gives out this id.
pub const RETIRED: ActivityId = ActivityId::MAX;

/// A counter written by one thread and read by any.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds `v`. Only the owning thread may call this (single writer); readers see a value that
    /// is at most one update old.
    #[inline]
    pub fn add(&self, v: u64) {
        let cur = self.0.load(Ordering::Relaxed);
        self.0.store(cur.wrapping_add(v), Ordering::Relaxed);
    }
    /// Adds `v` from any thread (read-modify-write); for counters several threads write.
    #[inline]
    pub fn add_shared(&self, v: u64) {
        self.0.fetch_add(v, Ordering::Relaxed);
    }
    #[inline]
    pub fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
    }
    #[inline]
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// The record kinds counted per (activity, stage, core).
#[derive(Debug, Default)]
pub struct Cell {
    /// CPU time of dispatches, ns.
    pub cpu_ns: Counter,
    /// Handler calls (one per batch).
    pub dispatches: Counter,
    /// Messages handled.
    pub messages: Counter,
    /// Time messages waited in queue before their dispatch started, ns (sum).
    pub queue_wait_ns: Counter,
    /// Handler panics contained.
    pub panics: Counter,
    /// Bytes received, sent, read from disk (charged by I/O stages).
    pub bytes_in: Counter,
    pub bytes_out: Counter,
    pub disk_bytes: Counter,
    /// Bytes written to disk (reported from outside: a shaped program's writes).
    pub disk_write_bytes: Counter,
    /// Per message: time from enqueue to the start of its dispatch, ns.
    pub wait_hist: Histogram,
    /// Per message: time from enqueue to the end of its dispatch (its batch's), ns.
    pub response_hist: Histogram,
}

impl Cell {
    /// Adds everything `other` counted to this cell. Only this cell's writer may call it
    /// (single writer), and `other` must have no writer left (it is being retired).
    fn absorb(&self, other: &Cell) {
        self.cpu_ns.add(other.cpu_ns.get());
        self.dispatches.add(other.dispatches.get());
        self.messages.add(other.messages.get());
        self.queue_wait_ns.add(other.queue_wait_ns.get());
        self.panics.add(other.panics.get());
        self.bytes_in.add(other.bytes_in.get());
        self.bytes_out.add(other.bytes_out.get());
        self.disk_bytes.add(other.disk_bytes.get());
        self.disk_write_bytes.add(other.disk_write_bytes.get());
        self.wait_hist.absorb(&other.wait_hist.snapshot());
        self.response_hist.absorb(&other.response_hist.snapshot());
    }
}

/// Buckets of a latency [`Histogram`].
pub const HIST_BUCKETS: usize = 64;
/// Values below this (ns) fall into bucket 0.
const HIST_FIRST_BOUND: u64 = 64;
/// log2 of [`HIST_FIRST_BOUND`].
const HIST_FIRST_EXP: u32 = 6;

/// A latency histogram with fixed half-octave buckets, written by one thread and read by any.
///
/// Bucket 0 holds `[0, 64)` ns; above that every power of two is split in two halves:
/// bucket `1 + 2(e-6) + h` holds `[2^e + h·2^(e-1), 2^e + (h+1)·2^(e-1))`. The last bucket
/// (63) holds everything from `2^37` ns (about 137 s) up. A percentile read from it is
/// interpolated inside its bucket, so it is within a factor 1.5 of the truth (within a
/// quarter of an octave for most values). Recording is a leading-zero count and two relaxed
/// load/store pairs: no allocation, no read-modify-write.
#[derive(Debug)]
pub struct Histogram {
    buckets: [Counter; HIST_BUCKETS],
    sum: Counter,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: std::array::from_fn(|_| Counter::default()),
            sum: Counter::default(),
        }
    }
}

impl Histogram {
    /// The bucket of a value.
    #[inline]
    pub fn bucket_of(v: u64) -> usize {
        if v < HIST_FIRST_BOUND {
            return 0;
        }
        let e = 63 - v.leading_zeros();
        let half = ((v >> (e - 1)) & 1) as usize;
        (1 + 2 * (e - HIST_FIRST_EXP) as usize + half).min(HIST_BUCKETS - 1)
    }

    /// `[lower, upper)` of bucket `i`; the last bucket's upper bound is `u64::MAX`.
    pub fn bounds(i: usize) -> (u64, u64) {
        assert!(i < HIST_BUCKETS, "bucket {i} out of range");
        if i == 0 {
            return (0, HIST_FIRST_BOUND);
        }
        let e = HIST_FIRST_EXP + ((i - 1) / 2) as u32;
        let half = ((i - 1) % 2) as u64;
        let lower = (1u64 << e) + half * (1u64 << (e - 1));
        if i == HIST_BUCKETS - 1 {
            return (lower, u64::MAX);
        }
        (lower, lower + (1u64 << (e - 1)))
    }

    /// Records one value. Only the owning thread may call this (single writer).
    #[inline]
    pub fn record(&self, v: u64) {
        self.buckets[Self::bucket_of(v)].add(1);
        self.sum.add(v);
    }

    /// Adds a snapshot's counts and sum (wrapping, as recording does). Single writer, as
    /// [`Histogram::record`].
    pub fn absorb(&self, s: &HistSnapshot) {
        for (b, &c) in self.buckets.iter().zip(s.counts.iter()) {
            if c != 0 {
                b.add(c);
            }
        }
        self.sum.add(s.sum);
    }

    /// A copy of the counts (each bucket exact to within the record in progress).
    pub fn snapshot(&self) -> HistSnapshot {
        HistSnapshot {
            counts: std::array::from_fn(|i| self.buckets[i].get()),
            sum: self.sum.get(),
        }
    }
}

/// A copy of a [`Histogram`]: counts per bucket and the exact sum of the values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HistSnapshot {
    pub counts: [u64; HIST_BUCKETS],
    pub sum: u64,
}

impl Default for HistSnapshot {
    fn default() -> Self {
        HistSnapshot {
            counts: [0; HIST_BUCKETS],
            sum: 0,
        }
    }
}

impl HistSnapshot {
    /// Number of values recorded.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Adds another histogram's counts (merging cores, stages or activities). Wrapping, as
    /// the cells themselves do: a sum of nanoseconds can pass 2^64 (each cell's sum wraps by
    /// design), and two cells near the top must add without a panic; an interval in which one
    /// wrapped reads as 0 ([`HistSnapshot::since`] saturates).
    pub fn add(&mut self, o: &HistSnapshot) {
        for (a, b) in self.counts.iter_mut().zip(o.counts.iter()) {
            *a = a.wrapping_add(*b);
        }
        self.sum = self.sum.wrapping_add(o.sum);
    }

    /// What was recorded since `earlier` (a snapshot of the same histograms taken before).
    pub fn since(&self, earlier: &HistSnapshot) -> HistSnapshot {
        HistSnapshot {
            counts: std::array::from_fn(|i| self.counts[i].saturating_sub(earlier.counts[i])),
            sum: self.sum.saturating_sub(earlier.sum),
        }
    }

    /// The `q`-quantile (0 < q <= 1), interpolated linearly inside its bucket; `None` when
    /// nothing was recorded. A value in the open-ended last bucket reads as its lower bound.
    pub fn percentile(&self, q: f64) -> Option<u64> {
        let n = self.count();
        if n == 0 {
            return None;
        }
        let q = if q.is_nan() { 1.0 } else { q.clamp(0.0, 1.0) };
        let rank = ((q * n as f64).ceil() as u64).clamp(1, n);
        let mut before = 0u64;
        for (i, &c) in self.counts.iter().enumerate() {
            if c == 0 {
                continue;
            }
            if before + c >= rank {
                let (lo, hi) = Histogram::bounds(i);
                if hi == u64::MAX {
                    return Some(lo);
                }
                let frac = (rank - before) as f64 / c as f64;
                return Some(lo + ((hi - lo) as f64 * frac) as u64);
            }
            before += c;
        }
        unreachable!("rank is at most the count")
    }
}

/// Latency histograms of one (activity, stage, core).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LatencyRow {
    pub activity: ActivityId,
    pub stage: StageId,
    pub core: u32,
    /// Queue wait per message, ns.
    pub wait: HistSnapshot,
    /// Response time per message (enqueue to end of its dispatch), ns.
    pub response: HistSnapshot,
}

/// Where a message on an edge of the stage graph came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EdgeFrom {
    /// Sent by a handler of this stage.
    Stage(StageId),
    /// I/O readiness turned into a message by a worker.
    Io,
    /// Sent from outside the workers (`Runtime::send`).
    External,
}

/// Messages counted on one edge of the stage graph, summed over cores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EdgeRow {
    pub from: EdgeFrom,
    pub to: StageId,
    pub messages: u64,
}

/// Messages per (source, destination stage) edge, per core: SEDA's profiler of the stage
/// graph. Each core writes only its own rows (single writer); a source's row of destination
/// counters is allocated when that source first sends on that core, never per message.
/// Sends from outside the workers go to one shared row (read-modify-write; not the hot path).
#[derive(Debug)]
pub struct EdgeCounts {
    stages: usize,
    /// Per core: one lazily allocated row per source (stages, then `Io`).
    cores: Vec<Vec<OnceLock<Box<[Counter]>>>>,
    external: Box<[Counter]>,
}

impl EdgeCounts {
    pub fn new(cores: usize, stages: usize) -> Self {
        EdgeCounts {
            stages,
            cores: (0..cores)
                .map(|_| (0..=stages).map(|_| OnceLock::new()).collect())
                .collect(),
            external: (0..stages).map(|_| Counter::default()).collect(),
        }
    }

    fn row(&self, core: usize, from: usize) -> &[Counter] {
        self.cores[core][from]
            .get_or_init(|| (0..self.stages).map(|_| Counter::default()).collect())
    }

    /// Counts a message sent on `core` from `from` to stage `to`. Only `core`'s worker may call
    /// this (single writer). Out-of-range stages are ignored.
    #[inline]
    pub fn record(&self, core: usize, from: EdgeFrom, to: StageId) {
        let to = to as usize;
        if to >= self.stages {
            return;
        }
        match from {
            EdgeFrom::Stage(s) if (s as usize) < self.stages => {
                self.row(core, s as usize)[to].add(1)
            }
            EdgeFrom::Io => self.row(core, self.stages)[to].add(1),
            EdgeFrom::Stage(_) | EdgeFrom::External => self.external[to].add_shared(1),
        }
    }

    /// Every edge that carried a message, summed over cores, in (from, to) order.
    pub fn edges(&self) -> Vec<EdgeRow> {
        let mut sum: BTreeMap<(EdgeFrom, StageId), u64> = BTreeMap::new();
        for rows in &self.cores {
            for (from, row) in rows.iter().enumerate() {
                let Some(row) = row.get() else { continue };
                let from = if from == self.stages {
                    EdgeFrom::Io
                } else {
                    EdgeFrom::Stage(from as StageId)
                };
                for (to, c) in row.iter().enumerate() {
                    let v = c.get();
                    if v > 0 {
                        *sum.entry((from, to as StageId)).or_default() += v;
                    }
                }
            }
        }
        for (to, c) in self.external.iter().enumerate() {
            let v = c.get();
            if v > 0 {
                *sum.entry((EdgeFrom::External, to as StageId)).or_default() += v;
            }
        }
        sum.into_iter()
            .map(|((from, to), messages)| EdgeRow { from, to, messages })
            .collect()
    }
}

/// Loop-level counters of one core.
#[derive(Debug, Default)]
pub struct CoreCounters {
    /// Wall time since the worker started, ns (updated by the worker as it goes).
    pub elapsed_ns: Counter,
    /// Time blocked waiting for work, ns.
    pub idle_ns: Counter,
    /// The loop's own work (mailboxes, timers, scheduling), charged to `/infra`, ns.
    pub infra_ns: Counter,
    /// Sum of dispatch costs on this core, ns (equals the sum of its cells' `cpu_ns`).
    pub dispatch_ns: Counter,
    /// The worker thread's CPU time as the OS counts it (CLOCK_THREAD_CPUTIME_ID), ns.
    pub os_cpu_ns: Counter,
    /// Time the thread was runnable but waiting for a CPU, as the OS counts it
    /// (`/proc/thread-self/schedstat`), ns; 0 where unavailable.
    pub os_runqueue_ns: Counter,
    /// Hypervisor steal time of the CPU the worker is pinned to (`/proc/stat`, tick
    /// resolution), ns; 0 when the worker is not pinned or where unavailable.
    pub os_steal_ns: Counter,
    /// The part of `infra_ns` spent around sleeps, by the OS's clocks: CPU inside the blocking
    /// poll (entering and leaving it, the wake-up) and run-queue wait after a wake-up. The CPU
    /// is read from the thread's CPU clock on each side of every sleep; the run-queue wait from
    /// schedstat at each 10 ms flush, less the wait inside the loop's own segments (their wall
    /// time beyond their CPU time), at most what the interval's sleeps left idle. Moved from
    /// idle to infra, so a lightly loaded worker's wake-ups are attributed, not lost.
    pub wake_ns: Counter,
    /// How far the loop's stamps of the OS CPU-clock readings can be from the instants the OS
    /// took them, summed, ns: each reading is stamped at the midpoint of its system call (a
    /// clock read on each side), and the OS samples somewhere inside it, so each stamp is off
    /// by at most half the call. The finest gap between the OS's CPU clock and the charged
    /// time that the readings can resolve.
    pub os_read_uncertainty_ns: Counter,
    /// Messages dropped because a handler panicked.
    pub panics: Counter,
    /// Messages handled (in both scheduled and bypass modes; updated per dispatch).
    pub handled: Counter,
    /// Admitted messages dropped before their handler ran (activity removed meanwhile, timer
    /// table full).
    pub dropped: Counter,
    /// Stretches in which the loop could not pick another queue, ns: each dispatch (scheduled
    /// mode; its cost as charged)...
    pub dispatch_hist: Histogram,
    /// ...and each I/O round (`epoll_wait` calls and classifying their ready lists into the
    /// activities' queues), stamped by the loop's clock on each side.
    pub io_round_hist: Histogram,
}

#[derive(Debug, Default)]
struct CoreLedger {
    counters: CoreCounters,
    cells: Mutex<BTreeMap<(ActivityId, StageId), Arc<Cell>>>,
}

/// Largest number of cells on one core: a bound on memory that a flood of new activities can
/// cost. `exec` refuses new (stage, activity) queues on a core past it.
pub const CELLS_PER_CORE_MAX: usize = 1 << 20;

/// The ledger of one runtime: one part per core.
#[derive(Debug)]
pub struct Ledger {
    cores: Vec<CoreLedger>,
}

impl Ledger {
    pub fn new(cores: usize) -> Self {
        assert!(cores > 0);
        Ledger {
            cores: (0..cores).map(|_| CoreLedger::default()).collect(),
        }
    }

    pub fn cores(&self) -> usize {
        self.cores.len()
    }

    /// The cell for (activity, stage) on `core`, created on first use. Not for the per-message
    /// path: callers keep the returned `Arc` with their queue.
    pub fn cell(&self, core: usize, activity: ActivityId, stage: StageId) -> Option<Arc<Cell>> {
        let mut cells = self.cores[core].cells.lock().expect("ledger lock");
        if let Some(cell) = cells.get(&(activity, stage)) {
            return Some(cell.clone());
        }
        if cells.len() >= CELLS_PER_CORE_MAX {
            return None;
        }
        let cell = Arc::new(Cell::default());
        cells.insert((activity, stage), cell.clone());
        Some(cell)
    }

    /// Folds every cell of `activity` on `core` into that core's cell of (`RETIRED`, stage),
    /// stage by stage, and frees them: every total the ledger reports (snapshot rows summed
    /// over activities, latencies, per-stage sums) stays exactly what it was. Returns how many
    /// cells were freed. Only `core`'s worker may call this (it writes the retired cells as
    /// their single writer), once nothing writes the activity's cells any more (a debug
    /// assertion checks that no one else holds them). The retired cells are outside
    /// [`CELLS_PER_CORE_MAX`]'s check: there is at most one per stage.
    pub fn retire(&self, core: usize, activity: ActivityId) -> usize {
        assert_ne!(activity, RETIRED, "the retired aggregate cannot be retired");
        let mut cells = self.cores[core].cells.lock().expect("ledger lock");
        let keys: Vec<(ActivityId, StageId)> = cells
            .range((activity, 0)..=(activity, StageId::MAX))
            .map(|(k, _)| *k)
            .collect();
        for &(a, stage) in &keys {
            let cell = cells.remove(&(a, stage)).expect("listed just above");
            debug_assert_eq!(
                Arc::strong_count(&cell),
                1,
                "a retired cell of activity {a} (stage {stage}) is still held by a writer"
            );
            cells
                .entry((RETIRED, stage))
                .or_insert_with(|| Arc::new(Cell::default()))
                .absorb(&cell);
        }
        keys.len()
    }

    /// The cell of (`RETIRED`, stage) on `core`, created on first use: where a record for an
    /// activity that is gone is charged (only `core`'s worker writes it).
    pub fn retired_cell(&self, core: usize, stage: StageId) -> Arc<Cell> {
        self.cores[core]
            .cells
            .lock()
            .expect("ledger lock")
            .entry((RETIRED, stage))
            .or_insert_with(|| Arc::new(Cell::default()))
            .clone()
    }

    /// Cells on `core` now (the retired aggregate's included).
    pub fn cell_count(&self, core: usize) -> usize {
        self.cores[core].cells.lock().expect("ledger lock").len()
    }

    /// Loop counters of `core` (written by that core's worker only).
    pub fn core(&self, core: usize) -> &CoreCounters {
        &self.cores[core].counters
    }

    /// A copy of every counter, taken while workers run. Rows are read one counter at a time,
    /// so a snapshot is not atomic across counters; each counter is exact to within the
    /// dispatch in progress.
    pub fn snapshot(&self) -> Snapshot {
        let mut rows = Vec::new();
        let mut cores = Vec::with_capacity(self.cores.len());
        for (core, c) in self.cores.iter().enumerate() {
            for (&(activity, stage), cell) in c.cells.lock().expect("ledger lock").iter() {
                rows.push(Row {
                    activity,
                    stage,
                    core: core as u32,
                    cpu_ns: cell.cpu_ns.get(),
                    dispatches: cell.dispatches.get(),
                    messages: cell.messages.get(),
                    queue_wait_ns: cell.queue_wait_ns.get(),
                    panics: cell.panics.get(),
                    bytes_in: cell.bytes_in.get(),
                    bytes_out: cell.bytes_out.get(),
                    disk_bytes: cell.disk_bytes.get(),
                    disk_write_bytes: cell.disk_write_bytes.get(),
                });
            }
            let k = &c.counters;
            cores.push(CoreRow {
                core: core as u32,
                elapsed_ns: k.elapsed_ns.get(),
                idle_ns: k.idle_ns.get(),
                infra_ns: k.infra_ns.get(),
                dispatch_ns: k.dispatch_ns.get(),
                os_cpu_ns: k.os_cpu_ns.get(),
                os_runqueue_ns: k.os_runqueue_ns.get(),
                os_steal_ns: k.os_steal_ns.get(),
                wake_ns: k.wake_ns.get(),
                os_read_uncertainty_ns: k.os_read_uncertainty_ns.get(),
                panics: k.panics.get(),
            });
        }
        Snapshot { rows, cores }
    }

    /// Each core's stretch histograms (longest things the loop does between two picks).
    pub fn stretches(&self) -> Vec<StretchRow> {
        self.cores
            .iter()
            .enumerate()
            .map(|(core, c)| StretchRow {
                core: core as u32,
                dispatch: c.counters.dispatch_hist.snapshot(),
                io_round: c.counters.io_round_hist.snapshot(),
            })
            .collect()
    }

    /// Latency histograms of every cell that has recorded a message.
    pub fn latencies(&self) -> Vec<LatencyRow> {
        let mut out = Vec::new();
        for (core, c) in self.cores.iter().enumerate() {
            for (&(activity, stage), cell) in c.cells.lock().expect("ledger lock").iter() {
                let wait = cell.wait_hist.snapshot();
                if wait.count() == 0 {
                    continue;
                }
                out.push(LatencyRow {
                    activity,
                    stage,
                    core: core as u32,
                    wait,
                    response: cell.response_hist.snapshot(),
                });
            }
        }
        out
    }
}

/// One core's stretches: how long each dispatch and each I/O round held the loop, ns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StretchRow {
    pub core: u32,
    pub dispatch: HistSnapshot,
    pub io_round: HistSnapshot,
}

/// Counters of one (activity, stage, core).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Row {
    pub activity: ActivityId,
    pub stage: StageId,
    pub core: u32,
    pub cpu_ns: u64,
    pub dispatches: u64,
    pub messages: u64,
    pub queue_wait_ns: u64,
    pub panics: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub disk_bytes: u64,
    pub disk_write_bytes: u64,
}

impl Row {
    /// Sums wrap, as the cells' counters do (bytes reported from outside can reach 2^64), so
    /// no sum panics.
    fn add(&mut self, o: &Row) {
        self.cpu_ns = self.cpu_ns.wrapping_add(o.cpu_ns);
        self.dispatches = self.dispatches.wrapping_add(o.dispatches);
        self.messages = self.messages.wrapping_add(o.messages);
        self.queue_wait_ns = self.queue_wait_ns.wrapping_add(o.queue_wait_ns);
        self.panics = self.panics.wrapping_add(o.panics);
        self.bytes_in = self.bytes_in.wrapping_add(o.bytes_in);
        self.bytes_out = self.bytes_out.wrapping_add(o.bytes_out);
        self.disk_bytes = self.disk_bytes.wrapping_add(o.disk_bytes);
        self.disk_write_bytes = self.disk_write_bytes.wrapping_add(o.disk_write_bytes);
    }
}

/// Loop counters of one core, and what they imply.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct CoreRow {
    pub core: u32,
    pub elapsed_ns: u64,
    pub idle_ns: u64,
    pub infra_ns: u64,
    pub dispatch_ns: u64,
    pub os_cpu_ns: u64,
    pub os_runqueue_ns: u64,
    pub os_steal_ns: u64,
    /// The part of `infra_ns` spent around sleeps (see [`CoreCounters::wake_ns`]).
    pub wake_ns: u64,
    /// See [`CoreCounters::os_read_uncertainty_ns`].
    pub os_read_uncertainty_ns: u64,
    pub panics: u64,
}

impl CoreRow {
    /// This row minus an `earlier` one of the same core: the counters over the interval.
    pub fn since(&self, earlier: &CoreRow) -> CoreRow {
        debug_assert_eq!(self.core, earlier.core);
        CoreRow {
            core: self.core,
            elapsed_ns: self.elapsed_ns.saturating_sub(earlier.elapsed_ns),
            idle_ns: self.idle_ns.saturating_sub(earlier.idle_ns),
            infra_ns: self.infra_ns.saturating_sub(earlier.infra_ns),
            dispatch_ns: self.dispatch_ns.saturating_sub(earlier.dispatch_ns),
            os_cpu_ns: self.os_cpu_ns.saturating_sub(earlier.os_cpu_ns),
            os_runqueue_ns: self.os_runqueue_ns.saturating_sub(earlier.os_runqueue_ns),
            os_steal_ns: self.os_steal_ns.saturating_sub(earlier.os_steal_ns),
            wake_ns: self.wake_ns.saturating_sub(earlier.wake_ns),
            os_read_uncertainty_ns: self
                .os_read_uncertainty_ns
                .saturating_sub(earlier.os_read_uncertainty_ns),
            panics: self.panics.saturating_sub(earlier.panics),
        }
    }

    /// Time the runtime says the worker was busy: dispatches plus the loop's own work.
    pub fn charged_ns(&self) -> u64 {
        self.dispatch_ns + self.infra_ns
    }

    /// Busy time by the OS's clocks: on a CPU, runnable and waiting for one, or with its CPU
    /// stolen by the hypervisor (all are "busy" by the runtime's wall clock).
    pub fn os_busy_ns(&self) -> u64 {
        self.os_cpu_ns + self.os_runqueue_ns + self.os_steal_ns
    }

    /// Unattributed time: what the OS saw the worker busy with that the runtime did not charge
    /// to anything (positive), or charged time the OS did not see (negative), in ns. Because
    /// the two sides come from different clocks, a bug that loses or double-counts time shows.
    pub fn unattributed_ns(&self) -> i64 {
        self.os_busy_ns() as i64 - self.charged_ns() as i64
    }
}

/// A copy of the ledger at one moment. What removed activities were charged shows in rows of
/// the reserved activity [`RETIRED`] (one per stage and core that had any), so sums over
/// `rows` keep every record ever charged.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Snapshot {
    pub rows: Vec<Row>,
    pub cores: Vec<CoreRow>,
}

impl Snapshot {
    /// Totals per activity (own records only, all stages and cores).
    pub fn by_activity(&self) -> Vec<(ActivityId, Row)> {
        let mut out: BTreeMap<ActivityId, Row> = BTreeMap::new();
        for r in &self.rows {
            out.entry(r.activity)
                .or_insert(Row {
                    activity: r.activity,
                    stage: StageId::MAX,
                    core: u32::MAX,
                    ..Default::default()
                })
                .add(r);
        }
        out.into_iter().collect()
    }

    /// Totals per activity including everything charged below it in the activity tree.
    /// `parent_of(a)` gives an activity's parent (`None` for a top-level one); a parent chain is
    /// followed for at most `depth_max` steps, a guard against a cycle in the caller's data.
    pub fn rolled_up(
        &self,
        parent_of: impl Fn(ActivityId) -> Option<ActivityId>,
        depth_max: usize,
    ) -> Vec<(ActivityId, Row)> {
        let mut out: BTreeMap<ActivityId, Row> = BTreeMap::new();
        for (a, row) in &self.by_activity() {
            let mut cur = Some(*a);
            let mut steps = 0;
            while let Some(x) = cur {
                out.entry(x)
                    .or_insert(Row {
                        activity: x,
                        stage: StageId::MAX,
                        core: u32::MAX,
                        ..Default::default()
                    })
                    .add(row);
                steps += 1;
                assert!(
                    steps <= depth_max,
                    "activity parent chain longer than {depth_max}"
                );
                cur = parent_of(x);
            }
        }
        out.into_iter().collect()
    }

    /// Sum of dispatch CPU over all rows, ns.
    pub fn cpu_ns_total(&self) -> u64 {
        self.rows.iter().map(|r| r.cpu_ns).sum()
    }
}

#[cfg(test)]
mod tests;
