//! Regressions found in review of the runtime: each test once failed against the code its
//! comment describes, and guards the fix.
use omnistage::activity::{ActivitySpec, INFRA};
use omnistage::exec::{Affinity, Ctx, Runtime, SendError, SendOpts, StageConfig, StageRef};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(10);

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + DEADLINE;
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A pending timer holds a place in its (stage, activity) gate for its whole delay. In the
/// server every connection's deadline timer lives in the one (http.timer, /infra) gate
/// (65,536 places machine-wide), so with connections_max > 65,536 later deadlines (and the
/// per-core LogFlush re-arm) are refused and silently dropped (`let _ = send_after`).
#[test]
fn pending_timers_do_not_use_up_the_queue_bound() {
    let mut b = Runtime::builder().workers(1);
    let t = b
        .stage::<u32, _, _>(
            "timer",
            StageConfig {
                queue_limit: 2,
                ..Default::default()
            },
            |_| |_: &mut Ctx<'_>, _: u32| {},
        )
        .unwrap();
    let rt = b.start().unwrap();
    let later = SendOpts {
        activity: Some(INFRA),
        delay_ns: 10_000_000_000,
        ..Default::default()
    };
    rt.send_with(&t, later, 1).unwrap();
    rt.send_with(&t, later, 2).unwrap();
    // Nothing is queued; two timers are merely pending.
    assert_eq!(
        rt.send_with(&t, later, 3),
        Ok(()),
        "a third timer is refused by the queue bound"
    );
}

/// `CoreState::learn` upserts only the activity asked for; `ensure_node` then walks to a parent
/// this core has not heard of yet and returns None: a send to a freshly created child whose
/// parent is also fresh fails with NoSuchActivity until the worker applies its control messages
/// (in the server: a reload adding tenant `n` with class `n/c`, and a request routed to the class
/// on a core that is mid-dispatch, gets 500 + close).
#[test]
fn a_handler_can_send_to_a_fresh_child_of_a_fresh_parent() {
    let rt_cell: Arc<OnceLock<Arc<Runtime>>> = Arc::new(OnceLock::new());
    let result: Arc<Mutex<Option<Result<(), SendError>>>> = Arc::default();
    let mut b = Runtime::builder().workers(1);
    let sink = b
        .stage::<u8, _, _>("sink", StageConfig::default(), |_| {
            |_: &mut Ctx<'_>, _: u8| {}
        })
        .unwrap();
    let driver = {
        let (rt_cell, result) = (rt_cell.clone(), result.clone());
        b.stage::<u8, _, _>("driver", StageConfig::default(), move |_| {
            let (rt_cell, result) = (rt_cell.clone(), result.clone());
            move |ctx: &mut Ctx<'_>, _: u8| {
                let rt = rt_cell.get().unwrap();
                rt.create_activity("/p", ActivitySpec::default()).unwrap();
                let c = rt.create_activity("/p/c", ActivitySpec::default()).unwrap();
                let opts = SendOpts {
                    activity: Some(c),
                    ..Default::default()
                };
                *result.lock().unwrap() = Some(ctx.send_with(&sink, opts, 0));
            }
        })
        .unwrap()
    };
    let rt = Arc::new(b.start().unwrap());
    rt_cell.set(rt.clone()).ok().unwrap();
    rt.send(&driver, INFRA, Affinity::Core(0), 0).unwrap();
    wait_for("the driver", || result.lock().unwrap().is_some());
    let r = result.lock().unwrap().take().unwrap();
    rt.shutdown();
    assert_eq!(r, Ok(()), "send to an existing activity refused");
}

/// `remove_activity` says "a later send to the id is refused instead of half-accepted", but a
/// handler on a core that already has a queue for the activity still gets Ok (queue_index hits
/// its cached queue and the queue's own Arc<Gate>). The existing test only sends from outside.
#[test]
fn a_handler_send_to_a_removed_activity_is_refused_on_a_core_that_knew_it() {
    let result: Arc<Mutex<Vec<Result<(), SendError>>>> = Arc::default();
    let target = Arc::new(AtomicU64::new(0));
    let mut b = Runtime::builder().workers(1);
    let sink = b
        .stage::<u8, _, _>("sink", StageConfig::default(), |_| {
            |_: &mut Ctx<'_>, _: u8| {}
        })
        .unwrap();
    let driver = {
        let (result, target) = (result.clone(), target.clone());
        b.stage::<u8, _, _>("driver", StageConfig::default(), move |_| {
            let (result, target) = (result.clone(), target.clone());
            move |ctx: &mut Ctx<'_>, _: u8| {
                let a = target.load(Ordering::SeqCst) as u32;
                let opts = SendOpts {
                    activity: Some(a),
                    ..Default::default()
                };
                result.lock().unwrap().push(ctx.send_with(&sink, opts, 0));
            }
        })
        .unwrap()
    };
    let rt = b.start().unwrap();
    let r = rt.create_activity("/r", ActivitySpec::default()).unwrap();
    target.store(u64::from(r), Ordering::SeqCst);
    rt.send(&driver, INFRA, Affinity::Core(0), 0).unwrap();
    wait_for("first", || result.lock().unwrap().len() == 1);
    rt.remove_activity("/r").unwrap();
    rt.send(&driver, INFRA, Affinity::Core(0), 0).unwrap();
    wait_for("second", || result.lock().unwrap().len() == 2);
    let v = result.lock().unwrap().clone();
    assert_eq!(v[0], Ok(()));
    assert_eq!(
        v[1],
        Err(SendError::NoSuchActivity(r)),
        "send after removal"
    );
}

/// What the stages of [`HoldRig`] handled, in order: (stage, value).
type Log = Arc<Mutex<Vec<(&'static str, u32)>>>;

/// One worker with a `tick` stage whose message 0 holds the core (it says so, then waits to be
/// let go) and whose message n sends n + 1 up to `chain`, and a `probe` stage; both log what
/// they handle. The test sends to the worker while it is held: its loop's last clock reading
/// is then older than the stamps of those messages.
struct HoldRig {
    rt: Runtime,
    tick: StageRef<u32>,
    probe: StageRef<u32>,
    log: Log,
    held: Receiver<()>,
    go: Sender<()>,
}

impl HoldRig {
    fn new(bypass: bool, chain: u32) -> Self {
        let mut b = Runtime::builder().workers(1).bypass(bypass);
        let log: Log = Arc::default();
        let (held_tx, held) = channel::<()>();
        let (go, go_rx) = channel::<()>();
        let held_tx = Arc::new(Mutex::new(held_tx));
        let go_rx = Arc::new(Mutex::new(go_rx));
        let me: Arc<OnceLock<StageRef<u32>>> = Arc::default();
        let tick = {
            let (log, me) = (log.clone(), me.clone());
            b.stage::<u32, _, _>("tick", StageConfig::default(), move |_| {
                let (log, me) = (log.clone(), me.clone());
                let (held_tx, go_rx) = (held_tx.clone(), go_rx.clone());
                move |ctx: &mut Ctx<'_>, n: u32| {
                    log.lock().unwrap().push(("tick", n));
                    if n == 0 {
                        held_tx.lock().unwrap().send(()).unwrap();
                        go_rx.lock().unwrap().recv_timeout(DEADLINE).unwrap();
                    }
                    if n < chain {
                        ctx.send(me.get().unwrap(), n + 1).unwrap();
                    }
                }
            })
            .unwrap()
        };
        me.set(tick).ok().unwrap();
        let probe = {
            let log = log.clone();
            b.stage::<u32, _, _>("probe", StageConfig::default(), move |_| {
                let log = log.clone();
                move |_: &mut Ctx<'_>, v: u32| log.lock().unwrap().push(("probe", v))
            })
            .unwrap()
        };
        let rt = b.start().unwrap();
        HoldRig {
            rt,
            tick,
            probe,
            log,
            held,
            go,
        }
    }

    /// Holds the worker in tick 0.
    fn hold(&self) {
        self.rt
            .send(&self.tick, INFRA, Affinity::Core(0), 0)
            .unwrap();
        self.held.recv_timeout(DEADLINE).unwrap();
    }

    fn release(&self) {
        self.go.send(()).unwrap();
    }

    fn probes(&self) -> Vec<u32> {
        let log = self.log.lock().unwrap();
        log.iter()
            .filter(|(s, _)| *s == "probe")
            .map(|&(_, v)| v)
            .collect()
    }
}

/// The worker loop empties its mailbox before it reads its clock, so a message sent without a
/// delay by a sender whose clock reading came later than the loop's last one (any message sent
/// while the worker was busy) went on a timer all the same: a heap push and pop per message,
/// and dropped, after its sender was told Ok, when the timer table was full. In the bypass,
/// which reads its clock once every 32 dispatches, it also waited for that reading: here the
/// probe, sent while tick 0 holds the core, was handled only after about 32 more ticks of the
/// chain (the ticks are queued behind it in the bypass's FIFO once it is queued). Now a message
/// without a delay is queued as it is taken from the mailbox: it comes right after tick 1.
#[test]
fn a_message_without_a_delay_is_queued_at_once_not_put_on_a_timer() {
    const CHAIN: u32 = 64;
    let rig = HoldRig::new(true, CHAIN);
    rig.hold();
    rig.rt
        .send(&rig.probe, INFRA, Affinity::Core(0), 7)
        .unwrap();
    rig.release();
    wait_for("the chain and the probe", || {
        rig.log.lock().unwrap().len() == CHAIN as usize + 2
    });
    let log = rig.log.lock().unwrap().clone();
    let at = log
        .iter()
        .position(|&e| e == ("probe", 7))
        .expect("the probe was handled");
    assert!(
        at <= 2,
        "the probe was handled after {at} ticks: {:?}",
        &log[..at + 1]
    );
}

/// A message sent with a delay that was due before a message sent after it without one is
/// still handled first (the order the timer heap gave both when both went through it): a
/// message without a delay that is queued at once first delivers the timers due by its stamp.
/// Checked in both loops.
#[test]
fn a_delayed_message_due_before_a_later_plain_one_is_still_handled_first() {
    for bypass in [false, true] {
        let rig = HoldRig::new(bypass, 0);
        rig.hold();
        const DELAY_NS: u64 = 1_000;
        let soon = SendOpts {
            activity: Some(INFRA),
            affinity: Affinity::Core(0),
            delay_ns: DELAY_NS,
            ..Default::default()
        };
        rig.rt.send_with(&rig.probe, soon, 1).unwrap();
        // Its due time (at most this reading plus the delay) passes before the plain send's
        // stamp: a precondition on the clock, waited for, not an assertion on time.
        let due_by = rig.rt.now_ns() + DELAY_NS;
        let end = Instant::now() + DEADLINE;
        while rig.rt.now_ns() <= due_by {
            assert!(Instant::now() < end, "the runtime's clock did not move");
            std::hint::spin_loop();
        }
        rig.rt
            .send(&rig.probe, INFRA, Affinity::Core(0), 2)
            .unwrap();
        rig.release();
        wait_for("both probes", || rig.probes().len() == 2);
        assert_eq!(rig.probes(), vec![1, 2], "bypass {bypass}");
    }
}

/// A `StageRef` of another runtime whose stage id exists here with another message type
/// passed every check (only a `debug_assert` on the send from outside) and reached the typed
/// queues' downcast on the destination worker, outside any handler's `catch_unwind`: the
/// worker thread died (in a release build), and with it everything queued or sent to its core.
/// Runtime A's stage 0 takes `u32`, B's takes `String`; A's ref is used on B, from a handler
/// (to another core) and from outside.
#[test]
fn a_stage_ref_of_another_runtime_is_refused() {
    let mut a = Runtime::builder().workers(1);
    let foreign: StageRef<u32> = a
        .stage("numbers", StageConfig::default(), |_| {
            |_: &mut Ctx<'_>, _: u32| {}
        })
        .unwrap();
    let got: Arc<Mutex<Vec<String>>> = Arc::default();
    let result: Arc<Mutex<Option<Result<(), SendError>>>> = Arc::default();
    let mut b = Runtime::builder().workers(2);
    let words: StageRef<String> = {
        let got = got.clone();
        b.stage("words", StageConfig::default(), move |_| {
            let got = got.clone();
            move |_: &mut Ctx<'_>, w: String| got.lock().unwrap().push(w)
        })
        .unwrap()
    };
    let driver: StageRef<u8> = {
        let result = result.clone();
        b.stage("driver", StageConfig::default(), move |_| {
            let result = result.clone();
            move |ctx: &mut Ctx<'_>, _: u8| {
                let to_core_1 = SendOpts {
                    affinity: Affinity::Core(1),
                    ..Default::default()
                };
                *result.lock().unwrap() = Some(ctx.send_with(&foreign, to_core_1, 7));
            }
        })
        .unwrap()
    };
    let _a = a.start().unwrap();
    let b = b.start().unwrap();
    b.send(&driver, INFRA, Affinity::Core(0), 0).unwrap();
    wait_for("the driver", || result.lock().unwrap().is_some());
    assert_eq!(
        result.lock().unwrap().take(),
        Some(Err(SendError::NoSuchStage(foreign.id())))
    );
    assert_eq!(
        b.send(&foreign, INFRA, Affinity::Core(1), 8),
        Err(SendError::NoSuchStage(foreign.id()))
    );
    // Core 1 is alive and handles a valid message.
    b.send(&words, INFRA, Affinity::Core(1), "still here".into())
        .unwrap();
    wait_for("the valid message", || got.lock().unwrap().len() == 1);
}

/// A handler's send to another core did not look at `stopping`: once `shutdown` had begun
/// (and the destination worker may have ended), it still pushed into that core's mailbox and
/// said `Ok`, for a message nobody would handle. The handler here runs while `shutdown`
/// waits for its worker, and sends once the runtime says it is stopping.
#[test]
fn a_handler_send_to_another_core_after_shutdown_began_says_stopped() {
    let rt_cell: Arc<OnceLock<Arc<Runtime>>> = Arc::new(OnceLock::new());
    let result: Arc<Mutex<Option<Result<(), SendError>>>> = Arc::default();
    let (running_tx, running_rx) = channel::<()>();
    let mut b = Runtime::builder().workers(2);
    let sink = b
        .stage::<u8, _, _>("sink", StageConfig::default(), |_| {
            |_: &mut Ctx<'_>, _: u8| {}
        })
        .unwrap();
    let driver = {
        let (rt_cell, result) = (rt_cell.clone(), result.clone());
        let running_tx = Mutex::new(running_tx);
        let running_tx = Arc::new(running_tx);
        b.stage::<u8, _, _>("driver", StageConfig::default(), move |_| {
            let (rt_cell, result, running_tx) =
                (rt_cell.clone(), result.clone(), running_tx.clone());
            move |ctx: &mut Ctx<'_>, _: u8| {
                let rt = rt_cell.get().unwrap();
                running_tx.lock().unwrap().send(()).unwrap();
                // Until `shutdown` has begun: a send from outside says so.
                let end = Instant::now() + DEADLINE;
                while rt.send(&sink, INFRA, Affinity::Core(0), 0) != Err(SendError::Stopped) {
                    assert!(Instant::now() < end, "shutdown did not begin");
                    std::thread::sleep(Duration::from_millis(1));
                }
                let to_core_1 = SendOpts {
                    affinity: Affinity::Core(1),
                    ..Default::default()
                };
                *result.lock().unwrap() = Some(ctx.send_with(&sink, to_core_1, 1));
            }
        })
        .unwrap()
    };
    let rt = Arc::new(b.start().unwrap());
    rt_cell.set(rt.clone()).ok().unwrap();
    rt.send(&driver, INFRA, Affinity::Core(0), 0).unwrap();
    running_rx.recv_timeout(DEADLINE).expect("the driver runs");
    // Waits for the driver's worker, which ends once the driver has sent.
    rt.shutdown();
    assert_eq!(result.lock().unwrap().take(), Some(Err(SendError::Stopped)));
}

/// A worker that could not start (here a stage's factory panics on core 1; the loop's own
/// early returns, tasks or the poll registry that cannot be set up, take the same path) once
/// left `start` returning `Ok` with a core whose mailbox took messages nobody would handle.
#[test]
fn start_fails_when_a_worker_does_not_start() {
    let mut b = Runtime::builder().workers(2);
    b.stage::<u8, _, _>("fragile-factory", StageConfig::default(), |core| {
        assert_ne!(core, 1, "this core's state cannot be made");
        |_: &mut Ctx<'_>, _: u8| {}
    })
    .unwrap();
    assert!(b.start().is_err(), "started with a worker that did not");
}

/// A delayed message was queued with its send-time stamp when its timer fired, so the delay
/// it asked for counted as queue wait: in the latency histograms and the ledger's wait sum,
/// and as response time in the p90 controller's samples (a stage fed by timers looked
/// overloaded). Its wait starts when it is due.
#[test]
fn a_delayed_message_waits_from_its_due_time_not_its_send() {
    const DELAY_NS: u64 = 50_000_000;
    let mut b = Runtime::builder().workers(1);
    let later = b
        .stage::<u32, _, _>("later", StageConfig::default(), |_| {
            |_: &mut Ctx<'_>, _: u32| {}
        })
        .unwrap();
    let rt = b.start().unwrap();
    let o = SendOpts {
        activity: Some(INFRA),
        delay_ns: DELAY_NS,
        ..Default::default()
    };
    rt.send_with(&later, o, 1).unwrap();
    let row = || {
        rt.snapshot()
            .rows
            .into_iter()
            .find(|r| r.stage == later.id() && r.activity == INFRA && r.messages > 0)
    };
    wait_for("the delayed message", || row().is_some());
    let wait = row().unwrap().queue_wait_ns;
    assert!(
        wait < DELAY_NS,
        "the delay counted as queue wait: {wait} ns"
    );
}

/// Delayed sends skipped admission: any `delay_ns > 0` was counted in without a check, past
/// the queue bound, the token bucket (or p90 controller) and the stage's shedding; here a
/// queue of 2 places behind a bucket of 1 message a second took 1,000 delayed sends. Each
/// now passes the gate when it is sent (the bucket takes its token).
#[test]
fn delayed_sends_pass_the_gate() {
    use omnistage::admit::RejectReason;
    use omnistage::exec::Predicate;
    const SENDS: usize = 1000;
    let mut b = Runtime::builder().workers(1);
    let s = b
        .stage::<u32, _, _>(
            "limited",
            StageConfig {
                queue_limit: 2,
                predicate: Predicate::TokenBucket {
                    rate_per_s: 1.0,
                    burst: 1,
                },
                ..Default::default()
            },
            |_| |_: &mut Ctx<'_>, _: u32| {},
        )
        .unwrap();
    let rt = b.start().unwrap();
    let o = SendOpts {
        activity: Some(INFRA),
        affinity: Affinity::Core(0),
        delay_ns: 1,
        ..Default::default()
    };
    let mut ok = 0;
    for i in 0..SENDS {
        match rt.send_with(&s, o, i as u32) {
            Ok(()) => ok += 1,
            Err(e) => assert_eq!(e, SendError::Rejected(RejectReason::Predicate)),
        }
        assert!(rt.queued(s.id(), INFRA) <= 2);
    }
    assert!(ok <= 2, "{ok} of {SENDS} delayed sends admitted");
}

/// A delayed message held its queue place for its whole delay, so as many delayed sends as
/// the queue bound (here 2, an hour away; `u64::MAX` once meant never) refused every immediate
/// send to the queue with `QueueFull` until they fired. A delayed message now takes its place
/// when it is due, and a delay is at most `DELAY_MAX_NS`.
#[test]
fn long_delays_do_not_keep_immediate_sends_out() {
    use omnistage::exec::DELAY_MAX_NS;
    let mut b = Runtime::builder().workers(1);
    let s = b
        .stage::<u32, _, _>(
            "small",
            StageConfig {
                queue_limit: 2,
                ..Default::default()
            },
            |_| |_: &mut Ctx<'_>, _: u32| {},
        )
        .unwrap();
    let rt = b.start().unwrap();
    let later = SendOpts {
        activity: Some(INFRA),
        delay_ns: DELAY_MAX_NS,
        ..Default::default()
    };
    rt.send_with(&s, later, 1).unwrap();
    rt.send_with(&s, later, 2).unwrap();
    assert_eq!(rt.send(&s, INFRA, Affinity::Any, 3), Ok(()));
    let never = SendOpts {
        delay_ns: DELAY_MAX_NS + 1,
        ..later
    };
    assert_eq!(rt.send_with(&s, never, 4), Err(SendError::DelayTooLong));
    let q = rt.queues();
    let q = q.iter().find(|q| q.stage == s.id()).unwrap();
    assert_eq!(q.delayed, 2);
    assert!(q.queued <= 1, "{q:?}");
}
