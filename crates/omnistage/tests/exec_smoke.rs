use omnistage::activity::ActivitySpec;
use omnistage::exec::{Affinity, Runtime, StageConfig};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn wait_until(deadline: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + deadline;
    while Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    f()
}

#[test]
fn messages_are_handled_and_charged() {
    let mut b = Runtime::builder().workers(2);
    let count = Arc::new(AtomicU64::new(0));
    let c2 = count.clone();
    let stage = b
        .stage::<u64, _, _>("count", StageConfig::default(), move |_core| {
            let c = c2.clone();
            move |_ctx, v| {
                c.fetch_add(v, Ordering::Relaxed);
            }
        })
        .unwrap();
    let rt = b.start().unwrap();
    let a = rt.create_activity("/a", ActivitySpec::weight(50)).unwrap();
    for i in 0..1000u64 {
        rt.send(&stage, a, Affinity::Core((i % 2) as u16), 1)
            .unwrap();
    }
    assert!(wait_until(Duration::from_secs(10), || rt.pending() == 0));
    assert_eq!(count.load(Ordering::Relaxed), 1000);
    std::thread::sleep(Duration::from_millis(30));
    let snap = rt.snapshot();
    let by = snap.by_activity();
    let row = by.iter().find(|(x, _)| *x == a).unwrap().1;
    assert_eq!(row.messages, 1000);
    eprintln!("{:?}", snap.cores);
}

/// An idle worker sleeps; what the OS's clocks find around each sleep (its CPU clock; the
/// run-queue wait at each flush) is moved from idle to the loop's time (`wake_ns`, a part of
/// `infra_ns`), and the three parts still tile elapsed time.
#[test]
fn sleeps_charge_their_wake_ups_to_the_loop() {
    let mut b = Runtime::builder().workers(1);
    b.stage::<u64, _, _>("noop", StageConfig::default(), |_core| |_ctx, _v| {})
        .unwrap();
    let rt = b.start().unwrap();
    // Counters are flushed every 10 ms; wait until several flushes have happened while idle.
    assert!(wait_until(Duration::from_secs(10), || {
        rt.snapshot().cores[0].elapsed_ns >= 50_000_000
    }));
    let c = rt.snapshot().cores[0];
    assert!(c.wake_ns > 0, "{c:?}");
    assert!(c.wake_ns <= c.infra_ns, "{c:?}");
    // Every sleep's two CPU-clock reads were stamped, each with its own uncertainty.
    assert!(c.os_read_uncertainty_ns > 0, "{c:?}");
    assert!(c.idle_ns > 0, "{c:?}");
    // idle + infra + dispatch tile elapsed (each piece is converted to ns on its own, so allow
    // a rounding nanosecond per piece: far less than a millisecond).
    let parts = c.idle_ns + c.infra_ns + c.dispatch_ns;
    assert!(parts.abs_diff(c.elapsed_ns) < 1_000_000, "{c:?}");
}
