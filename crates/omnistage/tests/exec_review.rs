//! Regressions found in review of the runtime: each test once failed against the code its
//! comment describes, and guards the fix.
use omnistage::activity::{ActivitySpec, INFRA};
use omnistage::exec::{Affinity, Ctx, Runtime, SendError, SendOpts, StageConfig};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
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
