//! Tests of what the runtime exposes for observation (the admin API's sources): queue lengths
//! per (stage, activity), the stage graph as measured (edges counted per message), and the
//! latency histograms per (activity, stage, core).
//!
//! No assertion rests on a sleep: tests wait for conditions under a generous deadline, then
//! assert exact counts.

use omnistage::account::{EdgeFrom, EdgeRow, StageId};
use omnistage::activity::ActivitySpec;
use omnistage::exec::{Affinity, Ctx, Predicate, Runtime, StageConfig, StageRef};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(10);

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + DEADLINE;
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn queued_counts_what_waits_and_queues_lists_gates() {
    // One worker: while its only thread is held in `hold`'s handler, messages for `sink`
    // can only wait in the queue.
    let release = Arc::new(AtomicBool::new(false));
    let entered = Arc::new(AtomicBool::new(false));
    let mut b = Runtime::builder().workers(1);
    let hold: StageRef<()> = {
        let (release, entered) = (release.clone(), entered.clone());
        b.stage("hold", StageConfig::default(), move |_| {
            let (release, entered) = (release.clone(), entered.clone());
            move |_: &mut Ctx<'_>, ()| {
                entered.store(true, Ordering::Release);
                let end = Instant::now() + DEADLINE;
                while !release.load(Ordering::Acquire) && Instant::now() < end {
                    std::thread::yield_now();
                }
            }
        })
        .unwrap()
    };
    let sink: StageRef<u32> = b
        .stage(
            "sink",
            StageConfig {
                queue_limit: 5,
                ..Default::default()
            },
            |_| |_: &mut Ctx<'_>, _m: u32| {},
        )
        .unwrap();
    let (b, a) = b.activity("/t/a", ActivitySpec::weight(10)).unwrap();
    let rt = b.start().unwrap();
    assert_eq!(rt.queued(sink.id(), a), 0);
    rt.send(&hold, a, Affinity::Any, ()).unwrap();
    wait_for("the worker to be held", || entered.load(Ordering::Acquire));
    for i in 0..7 {
        let r = rt.send(&sink, a, Affinity::Any, i);
        assert_eq!(r.is_ok(), i < 5, "send {i}: {r:?}");
    }
    // Sends from outside pass the gate at once: 5 admitted, 2 refused.
    assert_eq!(rt.queued(sink.id(), a), 5);
    assert_eq!(rt.rejected(sink.id(), a), 2);
    let qs = rt.queues();
    let q = qs
        .iter()
        .find(|q| q.stage == sink.id() && q.activity == a)
        .expect("sink's gate is listed");
    assert_eq!((q.queued, q.rejected, q.rate_per_s), (5, 2, None));
    release.store(true, Ordering::Release);
    wait_for("the queue to drain", || rt.pending() == 0);
    assert_eq!(rt.queued(sink.id(), a), 0);
    assert_eq!(rt.stage_count(), 2);
    assert_eq!(rt.stage_config(sink.id()).unwrap().queue_limit, 5);
    assert!(rt.stage_config(99).is_none());
}

#[test]
fn the_stage_graph_counts_every_admitted_message_per_edge() {
    let cell: Arc<OnceLock<StageRef<u32>>> = Arc::new(OnceLock::new());
    let mut b = Runtime::builder().workers(2);
    let front: StageRef<u32> = {
        let cell = cell.clone();
        b.stage("front", StageConfig::default(), move |_| {
            let cell = cell.clone();
            move |ctx: &mut Ctx<'_>, m: u32| {
                let back = *cell.get().expect("set before start");
                // Two messages per input, one to a core chosen by key (often the other one).
                ctx.send(&back, m).unwrap();
                ctx.send_with(
                    &back,
                    omnistage::exec::SendOpts {
                        affinity: Affinity::Key(u64::from(m)),
                        ..Default::default()
                    },
                    m,
                )
                .unwrap();
            }
        })
        .unwrap()
    };
    let back: StageRef<u32> = b
        .stage("back", StageConfig::default(), |_| {
            |ctx: &mut Ctx<'_>, _m: u32| {
                // Burn a little so response times exceed queue waits visibly.
                let t = Instant::now();
                while t.elapsed() < Duration::from_micros(2) {}
                let _ = ctx.now_ns();
            }
        })
        .unwrap();
    cell.set(back).ok().unwrap();
    let (b, a) = b.activity("/t/a", ActivitySpec::default()).unwrap();
    let rt = b.start().unwrap();
    const N: u64 = 500;
    for i in 0..N {
        loop {
            match rt.send(&front, a, Affinity::Any, i as u32) {
                Ok(()) => break,
                Err(_) => std::thread::yield_now(),
            }
        }
    }
    wait_for("all messages handled", || rt.pending() == 0);
    let (f, k): (StageId, StageId) = (front.id(), back.id());
    assert_eq!(
        rt.edges(),
        vec![
            EdgeRow {
                from: EdgeFrom::Stage(f),
                to: k,
                messages: 2 * N
            },
            EdgeRow {
                from: EdgeFrom::External,
                to: f,
                messages: N
            },
        ]
    );

    // Latency histograms: one record per message, and the wait histogram's sum is exactly the
    // ledger's queue-wait counter of the same cells.
    let snap = rt.snapshot();
    let lat = rt.latencies();
    // Stretches: one record per dispatch, whose sum is exactly the CPU the ledger charged to
    // dispatches (the loop's own cell holds its infra time, not dispatches).
    let stretches = rt.stretches();
    let dispatched = snap
        .rows
        .iter()
        .filter(|r| r.stage != omnistage::exec::LOOP_STAGE);
    assert_eq!(
        stretches.iter().map(|r| r.dispatch.count()).sum::<u64>(),
        dispatched.clone().map(|r| r.dispatches).sum::<u64>()
    );
    assert_eq!(
        stretches.iter().map(|r| r.dispatch.sum).sum::<u64>(),
        dispatched.map(|r| r.cpu_ns).sum::<u64>()
    );
    for stage in [f, k] {
        let rows: Vec<_> = lat
            .iter()
            .filter(|r| r.stage == stage && r.activity == a)
            .collect();
        let count: u64 = rows.iter().map(|r| r.wait.count()).sum();
        let resp: u64 = rows.iter().map(|r| r.response.count()).sum();
        let expect = if stage == f { N } else { 2 * N };
        assert_eq!((count, resp), (expect, expect), "stage {stage}");
        for r in &rows {
            let ledger = snap
                .rows
                .iter()
                .find(|x| (x.activity, x.stage, x.core) == (r.activity, r.stage, r.core))
                .expect("a ledger row for every histogram");
            assert_eq!(r.wait.sum, ledger.queue_wait_ns);
            assert_eq!(r.wait.count(), ledger.messages);
            // A message's response time includes its wait and its dispatch.
            assert!(r.response.sum >= r.wait.sum);
        }
        let mut all = omnistage::account::HistSnapshot::default();
        for r in &rows {
            all.add(&r.response);
        }
        assert!(all.percentile(0.99).unwrap() >= all.percentile(0.5).unwrap());
    }
}

#[test]
fn admission_reports_the_predicate_in_force() {
    let mut b = Runtime::builder().workers(1);
    let s: StageRef<u32> = b
        .stage("s", StageConfig::default(), |_| {
            |_: &mut Ctx<'_>, _m: u32| {}
        })
        .unwrap();
    let (b, a) = b.activity("/t/a", ActivitySpec::default()).unwrap();
    let rt = b.start().unwrap();
    assert_eq!(rt.admission(s.id(), a), Some(Predicate::Threshold));
    let tb = Predicate::TokenBucket {
        rate_per_s: 100.0,
        burst: 10,
    };
    rt.set_admission(s.id(), a, Some(tb.clone())).unwrap();
    assert_eq!(rt.admission(s.id(), a), Some(tb));
    rt.set_admission(s.id(), a, None).unwrap();
    assert_eq!(rt.admission(s.id(), a), Some(Predicate::Threshold));
    assert_eq!(rt.admission(42, a), None);
}

#[test]
fn delayed_messages_are_counted_apart_from_queued_ones() {
    use std::sync::atomic::AtomicU64;
    const LONG: u64 = 3_600_000_000_000; // an hour: never fires during the test
    let handled = Arc::new(AtomicU64::new(0));
    let cell: Arc<OnceLock<StageRef<u32>>> = Arc::new(OnceLock::new());
    let mut b = Runtime::builder().workers(2);
    let kick: StageRef<u32> = {
        let cell = cell.clone();
        b.stage("kick", StageConfig::default(), move |_| {
            let cell = cell.clone();
            move |ctx: &mut Ctx<'_>, m: u32| {
                let sink = *cell.get().expect("set before start");
                // Same-core timers: one that fires soon, one that never does here.
                ctx.send_after(&sink, 1_000_000, m).unwrap();
                ctx.send_after(&sink, LONG, m).unwrap();
            }
        })
        .unwrap()
    };
    let sink: StageRef<u32> = {
        let handled = handled.clone();
        b.stage("sink", StageConfig::default(), move |_| {
            let handled = handled.clone();
            move |_: &mut Ctx<'_>, _m: u32| {
                handled.fetch_add(1, Ordering::Relaxed);
            }
        })
        .unwrap()
    };
    cell.set(sink).ok().unwrap();
    let (b, a) = b.activity("/t/a", ActivitySpec::default()).unwrap();
    let rt = b.start().unwrap();
    for i in 0..10 {
        rt.send(&kick, a, Affinity::Any, i).unwrap();
        // Timers sent from outside, through the mailboxes.
        rt.send_with(
            &sink,
            omnistage::exec::SendOpts {
                activity: Some(a),
                delay_ns: LONG,
                ..Default::default()
            },
            i,
        )
        .unwrap();
        rt.send_with(
            &sink,
            omnistage::exec::SendOpts {
                activity: Some(a),
                delay_ns: 1_000_000,
                ..Default::default()
            },
            i,
        )
        .unwrap();
    }
    wait_for("the short timers to fire", || {
        handled.load(Ordering::Relaxed) == 20
    });
    wait_for("the counts to settle", || {
        let q = rt.queues();
        let s = q.iter().find(|q| q.stage == sink.id()).unwrap();
        s.delayed == 20 && s.queued == 0
    });
    assert_eq!(rt.queued(sink.id(), a), 0);
    // Still pending (admitted, not handled), though they hold no queue place until due.
    assert_eq!(rt.pending(), 20);
}

/// A handler that takes its message's response sample (`defer_response`) feeds the stage's p90
/// controller when it completes the response, with the time from the message's enqueue: here
/// every response completes at least 20 ms after its message was sent, 20 times the target,
/// so the controller's first run (10 samples) must cut the rate. Had the samples come from
/// the dispatches (microseconds, far under the target), the rate would stay at its ceiling.
/// A stage with no controller gives no sample to take.
#[test]
fn a_deferred_response_feeds_the_p90_controller_when_it_completes() {
    use omnistage::admit::P90Params;
    use omnistage::exec::DeferredResponse;
    use std::sync::Mutex;
    const MESSAGES: u32 = 10;
    const RATE_MAX_PER_S: f64 = 1000.0;
    let held: Arc<Mutex<Vec<DeferredResponse>>> = Arc::default();
    let deferred = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let unsampled = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let mut b = Runtime::builder().workers(1);
    let front: StageRef<bool> = {
        let (held, deferred, unsampled) = (held.clone(), deferred.clone(), unsampled.clone());
        b.stage("front", StageConfig::default(), move |_| {
            let (held, deferred, unsampled) = (held.clone(), deferred.clone(), unsampled.clone());
            move |ctx: &mut Ctx<'_>, sampled: bool| match ctx.defer_response() {
                Some(d) => {
                    assert!(sampled, "a sample from a gate without a controller");
                    held.lock().unwrap().push(d);
                    deferred.fetch_add(1, Ordering::Release);
                }
                None => {
                    assert!(!sampled, "no sample from a gate with a controller");
                    unsampled.fetch_add(1, Ordering::Release);
                }
            }
        })
        .unwrap()
    };
    let done: StageRef<()> = {
        let held = held.clone();
        b.stage("done", StageConfig::default(), move |_| {
            let held = held.clone();
            move |ctx: &mut Ctx<'_>, ()| {
                let taken: Vec<_> = held.lock().unwrap().drain(..).collect();
                for d in taken {
                    ctx.complete_response(d);
                }
            }
        })
        .unwrap()
    };
    let (b, a) = b.activity("/t/a", ActivitySpec::weight(10)).unwrap();
    let (b, plain) = b.activity("/t/plain", ActivitySpec::weight(10)).unwrap();
    let rt = b.start().unwrap();
    let p90 = Predicate::P90 {
        params: P90Params {
            target_ns: 1_000_000,
            nreq: MESSAGES,
            timeout_ns: 60_000_000_000,
            rate_min_per_s: 1.0,
            rate_max_per_s: RATE_MAX_PER_S,
            ..P90Params::default()
        },
        initial_rate_per_s: RATE_MAX_PER_S,
        burst: MESSAGES,
    };
    rt.set_admission(front.id(), a, Some(p90)).unwrap();
    let sent_at = Instant::now();
    for _ in 0..MESSAGES {
        rt.send(&front, a, Affinity::Any, true).unwrap();
    }
    rt.send(&front, plain, Affinity::Any, false).unwrap();
    wait_for("the handlers", || {
        deferred.load(Ordering::Acquire) == MESSAGES && unsampled.load(Ordering::Acquire) == 1
    });
    // The input, not an assertion: the responses complete no sooner than 20 ms after sending.
    std::thread::sleep(Duration::from_millis(20).saturating_sub(sent_at.elapsed()));
    assert_eq!(rt.admission_rate(front.id(), a), Some(RATE_MAX_PER_S));
    rt.send(&done, a, Affinity::Any, ()).unwrap();
    wait_for("the controller's run", || {
        rt.admission_rate(front.id(), a)
            .is_some_and(|r| r < RATE_MAX_PER_S)
    });
    assert!(held.lock().unwrap().is_empty());
}
