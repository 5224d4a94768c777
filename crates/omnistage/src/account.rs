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
//! This layer is pure: it never reads a clock; costs arrive as numbers.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Dense id of an activity (index in the activity table).
pub type ActivityId = u32;
/// Dense id of a stage (index in the stage table).
pub type StageId = u32;

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
    /// Messages dropped because a handler panicked.
    pub panics: Counter,
    /// Messages handled (in both scheduled and bypass modes; updated per dispatch).
    pub handled: Counter,
    /// Admitted messages dropped before their handler ran (activity removed meanwhile, timer
    /// table full).
    pub dropped: Counter,
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
                panics: k.panics.get(),
            });
        }
        Snapshot { rows, cores }
    }
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
}

impl Row {
    fn add(&mut self, o: &Row) {
        self.cpu_ns += o.cpu_ns;
        self.dispatches += o.dispatches;
        self.messages += o.messages;
        self.queue_wait_ns += o.queue_wait_ns;
        self.panics += o.panics;
        self.bytes_in += o.bytes_in;
        self.bytes_out += o.bytes_out;
        self.disk_bytes += o.disk_bytes;
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
    pub panics: u64,
}

impl CoreRow {
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

/// A copy of the ledger at one moment.
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
mod tests {
    use super::*;

    #[test]
    fn cells_are_per_activity_stage_core_and_sum_up() {
        let l = Ledger::new(2);
        let a0 = l.cell(0, 1, 7).unwrap();
        let a1 = l.cell(1, 1, 7).unwrap();
        let b0 = l.cell(0, 2, 7).unwrap();
        assert!(Arc::ptr_eq(&a0, &l.cell(0, 1, 7).unwrap()));
        a0.cpu_ns.add(100);
        a1.cpu_ns.add(50);
        b0.cpu_ns.add(30);
        let s = l.snapshot();
        let by = s.by_activity();
        assert_eq!(
            by,
            vec![
                (
                    1,
                    Row {
                        activity: 1,
                        stage: u32::MAX,
                        core: u32::MAX,
                        cpu_ns: 150,
                        ..Default::default()
                    }
                ),
                (
                    2,
                    Row {
                        activity: 2,
                        stage: u32::MAX,
                        core: u32::MAX,
                        cpu_ns: 30,
                        ..Default::default()
                    }
                ),
            ]
        );
        // 1 and 2 are children of 0.
        let up = s.rolled_up(|a| if a == 0 { None } else { Some(0) }, 8);
        assert_eq!(up.iter().find(|(a, _)| *a == 0).unwrap().1.cpu_ns, 180);
        assert_eq!(s.cpu_ns_total(), 180);
    }

    #[test]
    fn unattributed_compares_against_the_os_clock() {
        let row = CoreRow {
            dispatch_ns: 900,
            infra_ns: 50,
            os_cpu_ns: 990,
            os_runqueue_ns: 10,
            ..Default::default()
        };
        assert_eq!(row.unattributed_ns(), 50);
    }

    #[test]
    #[should_panic(expected = "parent chain")]
    fn rollup_guards_against_cycles() {
        let l = Ledger::new(1);
        l.cell(0, 1, 0).unwrap().cpu_ns.add(1);
        l.snapshot().rolled_up(Some, 4);
    }
}
