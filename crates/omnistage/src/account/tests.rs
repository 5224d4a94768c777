//! Tests of the ledger, its cells, histograms, edges, snapshots and retirement.

use super::*;

/// Rows fed from outside (`:report` bytes) can hold any value: their sums wrap as the
/// cells' counters do instead of panicking.
#[test]
fn row_sums_wrap() {
    let mut a = Row {
        bytes_out: u64::MAX,
        cpu_ns: 5,
        ..Default::default()
    };
    a.add(&Row {
        bytes_out: 2,
        cpu_ns: 7,
        ..Default::default()
    });
    assert_eq!((a.bytes_out, a.cpu_ns), (1, 12));
}

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
fn core_row_since_is_the_interval() {
    let a = CoreRow {
        elapsed_ns: 100,
        idle_ns: 40,
        infra_ns: 10,
        wake_ns: 4,
        ..Default::default()
    };
    let b = CoreRow {
        elapsed_ns: 300,
        idle_ns: 90,
        infra_ns: 30,
        wake_ns: 9,
        ..Default::default()
    };
    let d = b.since(&a);
    assert_eq!(
        (d.elapsed_ns, d.idle_ns, d.infra_ns, d.wake_ns),
        (200, 50, 20, 5)
    );
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
fn histogram_buckets_tile_the_range() {
    assert_eq!(Histogram::bucket_of(0), 0);
    assert_eq!(Histogram::bucket_of(63), 0);
    assert_eq!(Histogram::bucket_of(64), 1);
    assert_eq!(Histogram::bucket_of(95), 1);
    assert_eq!(Histogram::bucket_of(96), 2);
    assert_eq!(Histogram::bucket_of(128), 3);
    assert_eq!(Histogram::bucket_of(u64::MAX), HIST_BUCKETS - 1);
    // Bounds are contiguous and every value lands in the bucket whose bounds hold it.
    let mut prev_hi = 0;
    for i in 0..HIST_BUCKETS {
        let (lo, hi) = Histogram::bounds(i);
        assert_eq!(lo, prev_hi, "bucket {i}");
        assert!(hi > lo);
        assert_eq!(Histogram::bucket_of(lo), i);
        if hi != u64::MAX {
            assert_eq!(Histogram::bucket_of(hi - 1), i);
        }
        prev_hi = hi;
    }
    assert_eq!(prev_hi, u64::MAX);
    assert_eq!(Histogram::bounds(HIST_BUCKETS - 1).0, 1 << 37);
}

#[test]
fn histogram_percentiles_are_within_their_bucket() {
    let h = Histogram::default();
    assert_eq!(h.snapshot().percentile(0.5), None);
    // 1..=1000 µs.
    for us in 1..=1000u64 {
        h.record(us * 1000);
    }
    let s = h.snapshot();
    assert_eq!(s.count(), 1000);
    assert_eq!(s.sum, 500_500_000);
    for (q, truth) in [(0.5, 500_000u64), (0.9, 900_000), (0.99, 990_000)] {
        let p = s.percentile(q).unwrap();
        let (lo, hi) = Histogram::bounds(Histogram::bucket_of(truth));
        assert!(
            p >= lo && p <= hi,
            "p{q} = {p}, truth {truth} in [{lo}, {hi})"
        );
        // Interpolation keeps it close for a uniform spread.
        let err = (p as f64 - truth as f64).abs() / truth as f64;
        assert!(err < 0.1, "p{q} = {p}, truth {truth}");
    }
    assert_eq!(s.percentile(1.0), s.percentile(2.0));
    // One huge value reads as the open bucket's lower bound.
    let big = Histogram::default();
    big.record(u64::MAX / 2);
    assert_eq!(big.snapshot().percentile(0.5), Some(1 << 37));
}

#[test]
fn histogram_snapshots_merge_and_subtract() {
    let h = Histogram::default();
    h.record(100);
    let before = h.snapshot();
    h.record(10_000);
    h.record(10_000);
    let after = h.snapshot();
    let d = after.since(&before);
    assert_eq!(d.count(), 2);
    assert_eq!(d.sum, 20_000);
    assert_eq!(d.counts[Histogram::bucket_of(10_000)], 2);
    let mut m = before;
    m.add(&d);
    assert_eq!(m, after);
}

#[test]
fn ledger_lists_latencies_of_cells_that_recorded() {
    let l = Ledger::new(2);
    l.cell(0, 1, 0).unwrap().bytes_out.add(5);
    let c = l.cell(1, 2, 3).unwrap();
    c.wait_hist.record(1_000);
    c.response_hist.record(5_000);
    let rows = l.latencies();
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].activity, rows[0].stage, rows[0].core), (2, 3, 1));
    assert_eq!(rows[0].wait.sum, 1_000);
    assert_eq!(rows[0].response.sum, 5_000);
}

#[test]
fn edges_sum_over_cores_and_sources() {
    let e = EdgeCounts::new(2, 3);
    e.record(0, EdgeFrom::Stage(0), 1);
    e.record(1, EdgeFrom::Stage(0), 1);
    e.record(1, EdgeFrom::Stage(1), 2);
    e.record(0, EdgeFrom::Io, 0);
    e.record(0, EdgeFrom::External, 2);
    e.record(0, EdgeFrom::Stage(99), 2); // unknown source: counted as external
    e.record(0, EdgeFrom::Stage(0), 7); // unknown destination: ignored
    assert_eq!(
        e.edges(),
        vec![
            EdgeRow {
                from: EdgeFrom::Stage(0),
                to: 1,
                messages: 2
            },
            EdgeRow {
                from: EdgeFrom::Stage(1),
                to: 2,
                messages: 1
            },
            EdgeRow {
                from: EdgeFrom::Io,
                to: 0,
                messages: 1
            },
            EdgeRow {
                from: EdgeFrom::External,
                to: 2,
                messages: 2
            },
        ]
    );
}

/// Retiring an activity frees its cells and moves every count into the retired aggregate
/// of its core, stage by stage: totals, per-stage sums and latency histograms are unchanged.
#[test]
fn retiring_folds_cells_into_the_aggregate_and_keeps_totals() {
    let l = Ledger::new(2);
    let fill = |c: &Cell, k: u64| {
        c.cpu_ns.add(100 * k);
        c.dispatches.add(k);
        c.messages.add(2 * k);
        c.queue_wait_ns.add(7 * k);
        c.panics.add(k);
        c.bytes_in.add(3 * k);
        c.bytes_out.add(5 * k);
        c.disk_bytes.add(11 * k);
        c.disk_write_bytes.add(13 * k);
        c.wait_hist.record(1_000 * k);
        c.response_hist.record(9_000 * k);
    };
    for (a, k) in [(5u32, 1u64), (6, 2), (7, 3)] {
        fill(&l.cell(0, a, 0).unwrap(), k);
        fill(&l.cell(0, a, 1).unwrap(), k);
        fill(&l.cell(1, a, 0).unwrap(), k);
    }
    let before = l.snapshot();
    let lat_before = l.latencies();
    let sum = |s: &Snapshot| {
        let mut t = Row::default();
        for r in &s.rows {
            t.add(r);
        }
        (
            t.cpu_ns,
            t.dispatches,
            t.messages,
            t.queue_wait_ns,
            t.panics,
        )
    };
    let sum_bytes = |s: &Snapshot| {
        let mut t = Row::default();
        for r in &s.rows {
            t.add(r);
        }
        (t.bytes_in, t.bytes_out, t.disk_bytes, t.disk_write_bytes)
    };
    let hist_total = |rows: &[LatencyRow]| {
        let (mut w, mut r) = (HistSnapshot::default(), HistSnapshot::default());
        for x in rows {
            w.add(&x.wait);
            r.add(&x.response);
        }
        (w, r)
    };
    assert_eq!(l.cell_count(0), 6);
    assert_eq!(l.retire(0, 5), 2);
    assert_eq!(l.retire(0, 6), 2);
    assert_eq!(l.retire(1, 5), 1);
    assert_eq!(l.retire(1, 9), 0);
    // Activity 7's two cells stay; 5's and 6's became one retired cell per stage.
    assert_eq!(l.cell_count(0), 4);
    assert_eq!(l.cell_count(1), 3);
    let after = l.snapshot();
    assert_eq!(sum(&after), sum(&before));
    assert_eq!(sum_bytes(&after), sum_bytes(&before));
    assert_eq!(after.cpu_ns_total(), before.cpu_ns_total());
    assert_eq!(hist_total(&l.latencies()), hist_total(&lat_before));
    // Per stage too.
    let stage_cpu = |s: &Snapshot, st: StageId| -> u64 {
        s.rows
            .iter()
            .filter(|r| r.stage == st)
            .map(|r| r.cpu_ns)
            .sum()
    };
    for st in [0, 1] {
        assert_eq!(stage_cpu(&after, st), stage_cpu(&before, st));
    }
    let r0 = after
        .rows
        .iter()
        .find(|r| (r.activity, r.stage, r.core) == (RETIRED, 0, 0))
        .unwrap();
    assert_eq!((r0.cpu_ns, r0.messages, r0.disk_write_bytes), (300, 6, 39));
    let by: BTreeMap<ActivityId, Row> = after.by_activity().into_iter().collect();
    // 5 is gone everywhere; 6 keeps its cell on core 1, which was not retired.
    assert!(!by.contains_key(&5));
    assert_eq!(by[&6].cpu_ns, 200);
    assert_eq!(by[&RETIRED].cpu_ns, 100 + 100 + 100 + 200 + 200);
    // Retiring the same id again finds nothing; a new cell for it would start fresh.
    assert_eq!(l.retire(0, 5), 0);
    assert_eq!(l.cell(0, 5, 0).unwrap().cpu_ns.get(), 0);
}

#[test]
#[should_panic(expected = "parent chain")]
fn rollup_guards_against_cycles() {
    let l = Ledger::new(1);
    l.cell(0, 1, 0).unwrap().cpu_ns.add(1);
    l.snapshot().rolled_up(Some, 4);
}
