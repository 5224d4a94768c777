//! Tests of activity churn: a removed activity's per-core state (its entry on each worker, its
//! tree node and leaves, its queues, its ledger cells) is freed once its queued work has
//! drained, the ledger's totals stay what they were, and a path removed and created again
//! starts fresh.
//!
//! Real worker threads run here, but no assertion rests on a wall-clock sleep: each test waits
//! for a condition (the messages handled, the counts back at their baseline) under a generous
//! deadline and then asserts exact values. A worker is held inside a handler (a latch) when a
//! test needs messages queued at the moment of a removal.

use omnistage::account::{ActivityId, HistSnapshot, Snapshot, RETIRED};
use omnistage::activity::{ActivitySpec, INFRA};
use omnistage::exec::{
    Affinity, CoreFootprint, Ctx, Runtime, SendError, StageConfig, StageRef, LOOP_STAGE,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(20);
const WORKERS: usize = 2;

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + DEADLINE;
    while !f() {
        assert!(
            Instant::now() < end,
            "timed out after {DEADLINE:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Holds every worker inside a handler until released.
#[derive(Default)]
struct Latch {
    closed: Mutex<bool>,
    cv: Condvar,
    inside: AtomicUsize,
}

impl Latch {
    fn wait(&self) {
        self.inside.fetch_add(1, Ordering::SeqCst);
        let mut closed = self.closed.lock().unwrap();
        while *closed {
            closed = self.cv.wait(closed).unwrap();
        }
        self.inside.fetch_sub(1, Ordering::SeqCst);
    }
    fn release(&self) {
        *self.closed.lock().unwrap() = false;
        self.cv.notify_all();
    }
}

/// A runtime with a `work` stage that counts its messages per activity and forwards the ones
/// marked so to a `sink` stage on the same core (a second queue per activity), and a `hold`
/// stage that blocks its worker on the latch.
struct Rig {
    rt: Runtime,
    work: StageRef<bool>,
    hold: StageRef<()>,
    counts: Arc<Mutex<HashMap<ActivityId, u64>>>,
    refused_forwards: Arc<AtomicUsize>,
    latch: Arc<Latch>,
}

impl Drop for Rig {
    /// A failed assertion while the workers are held must not leave the runtime's shutdown
    /// waiting for them.
    fn drop(&mut self) {
        self.latch.release();
    }
}

impl Rig {
    fn new(bypass: bool) -> Rig {
        let (mut b, _) = Runtime::builder()
            .workers(WORKERS)
            .bypass(bypass)
            .activity("/t", ActivitySpec::default())
            .unwrap();
        let counts: Arc<Mutex<HashMap<ActivityId, u64>>> = Arc::default();
        let refused_forwards = Arc::new(AtomicUsize::new(0));
        let latch = Arc::new(Latch::default());
        let sink = {
            let counts = counts.clone();
            b.stage::<(), _, _>("sink", StageConfig::default(), move |_| {
                let counts = counts.clone();
                move |ctx: &mut Ctx<'_>, ()| {
                    // Counted apart from `work` (activity ids are below 2^31 in a test).
                    *counts
                        .lock()
                        .unwrap()
                        .entry(ctx.activity() | 1 << 31)
                        .or_default() += 1;
                }
            })
            .unwrap()
        };
        let work = {
            let counts = counts.clone();
            let refused = refused_forwards.clone();
            b.stage::<bool, _, _>("work", StageConfig::default(), move |_| {
                let counts = counts.clone();
                let refused = refused.clone();
                move |ctx: &mut Ctx<'_>, forward: bool| {
                    *counts.lock().unwrap().entry(ctx.activity()).or_default() += 1;
                    // Explicit records go to the activity's cell too.
                    let a = ctx.activity();
                    ctx.record_bytes_out(a, 10);
                    if forward {
                        match ctx.send(&sink, ()) {
                            Ok(()) => {}
                            Err(SendError::NoSuchActivity(_)) => {
                                refused.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => panic!("forward failed: {e}"),
                        }
                    }
                }
            })
            .unwrap()
        };
        let hold = {
            let latch = latch.clone();
            b.stage::<(), _, _>("hold", StageConfig::default(), move |_| {
                let latch = latch.clone();
                move |_: &mut Ctx<'_>, ()| latch.wait()
            })
            .unwrap()
        };
        let rt = b.start().unwrap();
        Rig {
            rt,
            work,
            hold,
            counts,
            refused_forwards,
            latch,
        }
    }

    fn count(&self, a: ActivityId) -> u64 {
        self.counts.lock().unwrap().get(&a).copied().unwrap_or(0)
    }

    /// Holds every worker inside `hold` (in /infra).
    fn hold_workers(&self) {
        *self.latch.closed.lock().unwrap() = true;
        for c in 0..WORKERS {
            self.rt
                .send(&self.hold, INFRA, Affinity::Core(c as u16), ())
                .unwrap();
        }
        wait_for("every worker held", || {
            self.latch.inside.load(Ordering::SeqCst) == WORKERS
        });
    }

    fn drain(&self) {
        wait_for("nothing pending", || self.rt.pending() == 0);
    }

    /// Sends `n` messages to `work` in `a` on every core.
    fn send_everywhere(&self, a: ActivityId, n: usize, forward: bool) {
        for c in 0..WORKERS {
            for _ in 0..n {
                self.rt
                    .send(&self.work, a, Affinity::Core(c as u16), forward)
                    .unwrap();
            }
        }
    }

    /// One cycle: create an activity, use both stages on every core, then remove it either
    /// idle or with `queued` messages per core still waiting (workers held at the removal).
    fn cycle(&self, i: usize, queued: usize) -> ActivityId {
        let path = format!("/t/x{i}");
        let a = self
            .rt
            .create_activity(&path, ActivitySpec::default())
            .unwrap();
        self.send_everywhere(a, 1, true);
        self.drain();
        if queued > 0 {
            self.hold_workers();
            self.send_everywhere(a, queued, true);
            self.rt.remove_activity(&path).unwrap();
            self.latch.release();
        } else {
            self.rt.remove_activity(&path).unwrap();
        }
        a
    }
}

/// The sums every consumer of a snapshot reads: CPU, dispatches, messages, queue wait, bytes.
fn totals(s: &Snapshot) -> [u64; 5] {
    let mut t = [0u64; 5];
    for r in &s.rows {
        t[0] += r.cpu_ns;
        t[1] += r.dispatches;
        t[2] += r.messages;
        t[3] += r.queue_wait_ns;
        t[4] += r.bytes_out;
    }
    t
}

/// Counts per core that must come back to their baseline (cells by rows of the snapshot too).
fn shape(rt: &Runtime) -> (Vec<CoreFootprint>, usize) {
    (rt.footprint(), rt.snapshot().rows.len())
}

fn churn(bypass: bool) {
    let rig = Rig::new(bypass);
    let rt = &rig.rt;
    // Warm-up: the /infra queues of `hold`, /t's node on each core, the retired aggregate's
    // cells of both stages on each core.
    rig.cycle(0, 0);
    rig.hold_workers();
    rig.latch.release();
    rig.drain();
    let baseline = shape(rt);
    wait_for("the warm-up's activity retired", || shape(rt) == baseline);
    let baseline = shape(rt);
    for f in &baseline.0 {
        // Root and /infra and /t, nothing of x0.
        assert_eq!(f.activities, 3, "{f:?}");
    }
    const CYCLES: usize = 200;
    const QUEUED: usize = 5;
    let mut sent_after_removal = 0;
    let mut ids = Vec::new();
    for i in 1..=CYCLES {
        // Every other cycle removes the activity with messages queued on every core.
        let queued = if i % 2 == 0 { QUEUED } else { 0 };
        ids.push((rig.cycle(i, queued), queued));
        sent_after_removal += queued * WORKERS;
    }
    rig.drain();
    // Every message admitted before a removal was handled, even the queued ones.
    for &(a, queued) in &ids {
        assert_eq!(
            rig.count(a),
            (WORKERS * (1 + queued)) as u64,
            "activity {a}"
        );
    }
    // Their forwards after the removal were refused (new sends), the ones before handled.
    assert_eq!(
        rig.refused_forwards.load(Ordering::Relaxed),
        sent_after_removal
    );
    // Every core lets go of all of it: entries, tree nodes, queues, ledger cells.
    wait_for("every core back to its baseline", || shape(rt) == baseline);
    assert_eq!(shape(rt), baseline);
    // And the ledger still counts every message ever handled (bypass: no per-dispatch
    // accounting, only the explicit records).
    let s = rt.snapshot();
    let t = totals(&s);
    // The cycles' activities, and the warm-up's x0 (one message per core).
    let work_messages: u64 = ids.iter().map(|&(a, _)| rig.count(a)).sum::<u64>() + WORKERS as u64;
    assert_eq!(t[4], 10 * work_messages, "bytes recorded by `work`");
    if !bypass {
        let sink_messages = (WORKERS * (CYCLES + 1)) as u64;
        // The warm-up's hold and every other cycle's.
        let hold_messages = (WORKERS + WORKERS * CYCLES / 2) as u64;
        assert_eq!(t[2], work_messages + sink_messages + hold_messages);
        // No row of a removed activity is left; the retired aggregate holds theirs.
        for &(a, _) in &ids {
            assert!(
                s.rows.iter().all(|r| r.activity != a),
                "a row of {a} is left"
            );
        }
        let retired: u64 = s
            .rows
            .iter()
            .filter(|r| r.activity == RETIRED)
            .map(|r| r.messages)
            .sum();
        assert_eq!(retired, work_messages + sink_messages);
    }
}

/// Activities created, used on every core, and removed (idle, or with messages queued on every
/// core) 200 times: every core's activity entries, tree nodes, queues and ledger cells come
/// back to what they were, and every message admitted before a removal was handled.
#[test]
fn churn_returns_every_core_to_its_baseline() {
    churn(false);
}

/// The same through the bypass (its own copy of the loop).
#[test]
fn churn_returns_every_core_to_its_baseline_in_the_bypass() {
    churn(true);
}

/// Retiring folds a removed activity's cells into the retired aggregate: CPU, dispatches,
/// messages, queue wait, bytes and the latency histograms summed over the ledger are the same
/// before and after; the activity's own rows are gone.
#[test]
fn retiring_keeps_the_ledger_totals() {
    let rig = Rig::new(false);
    let rt = &rig.rt;
    let a = rt.create_activity("/t/a", ActivitySpec::default()).unwrap();
    rig.send_everywhere(a, 50, true);
    rig.drain();
    // Every dispatch's charge is written before its messages stop being pending, but the
    // loop's own cell (/infra) moves on its own: compare everything else.
    let settled = |s: &Snapshot| {
        let mut s = s.clone();
        s.rows.retain(|r| r.stage != LOOP_STAGE);
        s
    };
    let hist_totals = || {
        let (mut w, mut r) = (HistSnapshot::default(), HistSnapshot::default());
        for l in rt.latencies() {
            w.add(&l.wait);
            r.add(&l.response);
        }
        (w, r)
    };
    let before = settled(&rt.snapshot());
    let hist_before = hist_totals();
    assert!(before.rows.iter().any(|r| r.activity == a));
    assert!(totals(&before)[0] > 0);
    rt.remove_activity("/t/a").unwrap();
    wait_for("the activity's rows folded", || {
        rt.snapshot().rows.iter().all(|r| r.activity != a)
    });
    let after = settled(&rt.snapshot());
    assert_eq!(totals(&after), totals(&before));
    assert_eq!(hist_totals(), hist_before);
    let by: HashMap<ActivityId, _> = after.by_activity().into_iter().collect();
    assert_eq!(by[&RETIRED].messages, 2 * 50 * WORKERS as u64);
    assert_eq!(by[&RETIRED].bytes_out, 10 * 50 * WORKERS as u64);
    assert!(!by.contains_key(&a));
}

/// A removed activity with messages queued on every core has them all handled (their sends
/// onward refused, as any new send to it), and is then retired on every core.
#[test]
fn queued_messages_of_a_removed_activity_are_handled_then_retired() {
    let rig = Rig::new(false);
    let rt = &rig.rt;
    rig.hold_workers();
    rig.latch.release();
    rig.drain();
    let baseline_activities: Vec<usize> = rt.footprint().iter().map(|f| f.activities).collect();
    let a = rt.create_activity("/t/q", ActivitySpec::default()).unwrap();
    rig.hold_workers();
    rig.send_everywhere(a, 100, false);
    rt.remove_activity("/t/q").unwrap();
    assert_eq!(
        rt.send(&rig.work, a, Affinity::Core(0), false),
        Err(SendError::NoSuchActivity(a))
    );
    rig.latch.release();
    rig.drain();
    assert_eq!(rig.count(a), 100 * WORKERS as u64);
    wait_for("the activity retired on every core", || {
        rt.footprint()
            .iter()
            .zip(&baseline_activities)
            .all(|(f, &b)| f.activities == b && f.queues == 1)
    });
    assert!(rt.snapshot().rows.iter().all(|r| r.activity != a));
}

/// A path removed and created again is a new activity: a new id, its own spec, counts from
/// zero; the old id stays refused and its rows are folded away.
#[test]
fn recreating_a_removed_path_starts_fresh() {
    let rig = Rig::new(false);
    let rt = &rig.rt;
    let old = rt
        .create_activity("/t/same", ActivitySpec::weight(500))
        .unwrap();
    rig.send_everywhere(old, 7, true);
    rig.drain();
    rt.remove_activity("/t/same").unwrap();
    wait_for("the old activity's rows folded", || {
        rt.snapshot().rows.iter().all(|r| r.activity != old)
    });
    let new = rt
        .create_activity("/t/same", ActivitySpec::default())
        .unwrap();
    assert_ne!(new, old);
    assert_eq!(rt.activity_id("/t/same"), Some(new));
    rt.with_activities(|t| {
        assert_eq!(
            t.get(new).unwrap().spec.weight,
            ActivitySpec::default().weight
        );
        assert!(t.get(old).is_none());
    });
    assert_eq!(
        rt.send(&rig.work, old, Affinity::Core(1), false),
        Err(SendError::NoSuchActivity(old))
    );
    rig.send_everywhere(new, 3, true);
    rig.drain();
    assert_eq!(rig.count(new), 3 * WORKERS as u64);
    let s = rt.snapshot();
    let by: HashMap<ActivityId, _> = s.by_activity().into_iter().collect();
    assert_eq!(by[&new].messages, 2 * 3 * WORKERS as u64);
    assert_eq!(by[&new].bytes_out, 10 * 3 * WORKERS as u64);
    assert_eq!(by[&RETIRED].messages, 2 * 7 * WORKERS as u64);
    assert!(!by.contains_key(&old));
}
