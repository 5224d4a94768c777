//! Tests of `omnistage::task`: wakes, poll accounting, abort, panics, cross-core spawn, the
//! bridge between tasks and stages, timers, the long-poll counter, spawn admission, sockets
//! and shares between weighted activities judged by counts.
//!
//! Real worker threads run here, but no assertion rests on a wall-clock sleep: each test waits
//! for a condition under a generous deadline and then asserts exact counts. Shares are judged
//! with a large minimum charge per dispatch (`Builder::min_cost_ns`), so every poll weighs the
//! same in the tree whatever the machine's speed, and the expected counts are exact up to the
//! tasks' granularity.

use futures_executor::block_on;
use omnistage::account::ActivityId;
use omnistage::activity::{ActivitySpec, INFRA};
use omnistage::admit::{RejectReason, SharedQueueLimit};
use omnistage::exec::{Affinity, Ctx, Runtime, SendError, StageConfig, StageRef};
use omnistage::task::{self, JoinError, JoinHandle, Reply, SpawnError, TaskConfig};
use std::cell::Cell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(10);

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + DEADLINE;
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Waits for a task from the test thread (never blocks past the deadline).
fn join<T>(h: JoinHandle<T>) -> Result<T, JoinError> {
    wait_for("the task to end", || h.is_finished());
    block_on(h)
}

fn runtime(workers: usize, config: TaskConfig) -> (Runtime, ActivityId, ActivityId) {
    let (b, a) = Runtime::builder()
        .workers(workers)
        .tasks(config)
        .unwrap()
        .activity("/a", ActivitySpec::weight(2))
        .unwrap();
    let (b, bb) = b.activity("/b", ActivitySpec::weight(1)).unwrap();
    (b.start().unwrap(), a, bb)
}

/// The task stage's row of `activity`, summed over cores: (dispatches, messages).
fn polls(rt: &Runtime, activity: ActivityId) -> (u64, u64) {
    let stage = rt.task_stage().unwrap();
    rt.snapshot()
        .rows
        .iter()
        .filter(|r| r.stage == stage && r.activity == activity)
        .fold((0, 0), |(d, m), r| (d + r.dispatches, m + r.messages))
}

#[test]
fn a_task_runs_and_its_output_is_joined() {
    let (rt, a, _) = runtime(1, TaskConfig::default());
    let h = rt
        .spawn(a, Affinity::Any, async { task::activity() })
        .unwrap();
    assert_eq!(join(h), Ok(Some(a)));
    assert_eq!(rt.task_stats().completed, 1);
}

#[test]
fn spawn_off_a_worker_or_without_tasks_is_refused() {
    assert_eq!(task::spawn(async {}).err(), Some(SpawnError::NotOnWorker));
    let rt = Runtime::builder().workers(1).start().unwrap();
    assert_eq!(
        rt.spawn(INFRA, Affinity::Any, async {}).err(),
        Some(SpawnError::TasksDisabled)
    );
    // The task stage's batch is checked like any stage's.
    let batch = |batch_max| TaskConfig {
        stage: StageConfig {
            batch_max,
            ..Default::default()
        },
        ..Default::default()
    };
    assert!(Runtime::builder().tasks(batch(0)).is_err());
    assert!(Runtime::builder()
        .tasks(batch(omnistage::exec::BATCH_MAX + 1))
        .is_err());
    assert!(Runtime::builder().tasks(batch(4)).is_ok());
}

/// Each poll is one dispatch of the task stage, charged to the task's activity: a task that
/// yields n times is polled n + 1 times, all in its activity, none in the other.
#[test]
fn every_poll_is_one_dispatch_charged_to_the_tasks_activity() {
    let (rt, a, b) = runtime(1, TaskConfig::default());
    const YIELDS: u64 = 50;
    let h = rt
        .spawn(a, Affinity::Any, async {
            for _ in 0..YIELDS {
                task::yield_now().await;
            }
        })
        .unwrap();
    join(h).unwrap();
    wait_for("the ledger", || polls(&rt, a).0 == YIELDS + 1);
    assert_eq!(polls(&rt, a), (YIELDS + 1, YIELDS + 1));
    assert_eq!(polls(&rt, b), (0, 0));
    let stage = rt.task_stage().unwrap();
    let cpu: u64 = rt
        .snapshot()
        .rows
        .iter()
        .filter(|r| r.stage == stage && r.activity == a)
        .map(|r| r.cpu_ns)
        .sum();
    assert!(cpu > 0, "polls are measured");
}

/// Spawned tasks inherit the spawner's activity; `spawn_in` and `set_activity` re-tag
/// explicitly, and the re-tagged task's later polls are charged to the new activity.
#[test]
fn children_inherit_the_activity_and_retagging_is_explicit() {
    let (rt, a, b) = runtime(1, TaskConfig::default());
    let h = rt
        .spawn(a, Affinity::Any, async move {
            let child = task::spawn(async { task::activity() }).unwrap().await;
            let other = task::spawn_in(b, async { task::activity() }).unwrap().await;
            // Re-tag this task: the next polls go to /b.
            task::set_activity(b).unwrap();
            task::yield_now().await;
            let after = task::activity();
            let grandchild = task::spawn(async { task::activity() }).unwrap().await;
            (child, other, after, grandchild)
        })
        .unwrap();
    let (child, other, after, grandchild) = join(h).unwrap();
    assert_eq!(child.unwrap(), Some(a));
    assert_eq!(other.unwrap(), Some(b));
    assert_eq!(after, Some(b));
    assert_eq!(grandchild.unwrap(), Some(b));
    // /a: the parent's first three polls (start, after child, after other) and the child;
    // /b: `other`, the parent's two last polls, the grandchild.
    wait_for("the ledger", || polls(&rt, a).0 + polls(&rt, b).0 == 8);
    assert_eq!(polls(&rt, a).0, 4);
    assert_eq!(polls(&rt, b).0, 4);
    assert_eq!(task::set_activity(a), Err(task::NotInTask));
}

/// A waker called on the task's core, from another task, queues it again; one called from a
/// thread outside the runtime goes through the control channel.
#[test]
fn wakes_from_the_same_core_and_from_outside() {
    let (rt, a, _) = runtime(1, TaskConfig::default());
    let slot: Arc<std::sync::Mutex<Option<Waker>>> = Default::default();
    let flag = Arc::new(AtomicBool::new(false));
    let (s2, f2) = (slot.clone(), flag.clone());
    // Waits until `flag` is set, leaving its waker in `slot`.
    let waiter = rt
        .spawn(a, Affinity::Core(0), async move {
            let mut polls = 0u32;
            std::future::poll_fn(|cx| {
                polls += 1;
                if f2.load(Ordering::Acquire) {
                    return Poll::Ready(());
                }
                *s2.lock().unwrap() = Some(cx.waker().clone());
                Poll::Pending
            })
            .await;
            polls
        })
        .unwrap();
    wait_for("the waker", || slot.lock().unwrap().is_some());
    // A same-core wake: another task sets the flag and wakes it.
    let (s3, f3) = (slot.clone(), flag.clone());
    let waker_task = rt
        .spawn(a, Affinity::Core(0), async move {
            f3.store(true, Ordering::Release);
            s3.lock().unwrap().take().unwrap().wake();
        })
        .unwrap();
    join(waker_task).unwrap();
    assert_eq!(join(waiter), Ok(2));

    // From outside: the test thread wakes a waiting task.
    let flag = Arc::new(AtomicBool::new(false));
    let (s2, f2) = (slot.clone(), flag.clone());
    let waiter = rt
        .spawn(a, Affinity::Core(0), async move {
            std::future::poll_fn(|cx| {
                if f2.load(Ordering::Acquire) {
                    return Poll::Ready(());
                }
                *s2.lock().unwrap() = Some(cx.waker().clone());
                Poll::Pending
            })
            .await
        })
        .unwrap();
    wait_for("the waker", || slot.lock().unwrap().is_some());
    flag.store(true, Ordering::Release);
    slot.lock().unwrap().take().unwrap().wake();
    assert_eq!(join(waiter), Ok(()));
}

/// Wakes made during a dispatch are queued before its charge: one to another activity's idle
/// task (its leaf becomes ready while the waker's is in service) and the waker's own (its leaf
/// stays backlogged). Each poll is still one dispatch, charged to its own task's activity.
#[test]
fn wakes_made_during_a_dispatch_reach_both_activities() {
    let (rt, a, b) = runtime(1, TaskConfig::default());
    let (tx, rx) = futures_channel::oneshot::channel::<u32>();
    let waiter = rt
        .spawn(b, Affinity::Core(0), async move { rx.await.unwrap() })
        .unwrap();
    wait_for("the waiter's first poll", || polls(&rt, b).0 == 1);
    const YIELDS: u64 = 10;
    let waker = rt
        .spawn(a, Affinity::Core(0), async move {
            // Wakes the waiter in /b and then itself, in the same poll.
            tx.send(7).unwrap();
            for _ in 0..YIELDS {
                task::yield_now().await;
            }
        })
        .unwrap();
    join(waker).unwrap();
    assert_eq!(join(waiter), Ok(7));
    wait_for("the ledger", || polls(&rt, a).0 == YIELDS + 1);
    assert_eq!(polls(&rt, a), (YIELDS + 1, YIELDS + 1));
    assert_eq!(polls(&rt, b), (2, 2));
}

/// Many wakes of a queued task queue it once.
#[test]
fn a_task_is_queued_once_however_often_it_is_woken() {
    let (rt, a, _) = runtime(1, TaskConfig::default());
    let h = rt
        .spawn(a, Affinity::Any, async {
            let mut first = true;
            std::future::poll_fn(|cx| {
                if first {
                    first = false;
                    for _ in 0..100 {
                        cx.waker().wake_by_ref();
                    }
                    return Poll::Pending;
                }
                Poll::Ready(())
            })
            .await
        })
        .unwrap();
    join(h).unwrap();
    wait_for("the ledger", || polls(&rt, a).0 >= 2);
    assert_eq!(polls(&rt, a).0, 2);
}

/// Abort drops a waiting task without polling it again; its handle says so.
#[test]
fn abort_drops_the_task() {
    let (rt, a, _) = runtime(1, TaskConfig::default());
    let dropped = Arc::new(AtomicBool::new(false));
    struct OnDrop(Arc<AtomicBool>);
    impl Drop for OnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }
    let guard = OnDrop(dropped.clone());
    let h = rt
        .spawn(a, Affinity::Any, async move {
            let _g = guard;
            std::future::pending::<()>().await
        })
        .unwrap();
    wait_for("the first poll", || polls(&rt, a).0 == 1);
    assert!(!h.is_finished());
    h.abort();
    assert_eq!(join(h), Err(JoinError::Aborted));
    assert!(dropped.load(Ordering::Acquire));
    // One more dispatch to drop it; the future was not polled again.
    wait_for("the ledger", || polls(&rt, a).0 == 2);
}

/// A task aborted from inside another task on the same core, and a finished task's output
/// survives a late abort.
#[test]
fn abort_from_a_task_and_after_completion() {
    let (rt, a, _) = runtime(1, TaskConfig::default());
    let h = rt
        .spawn(a, Affinity::Any, async {
            let sleeper = task::spawn(std::future::pending::<()>()).unwrap();
            task::yield_now().await;
            sleeper.abort();
            let r1 = sleeper.await;
            let done = task::spawn(async { 7 }).unwrap();
            task::yield_now().await;
            task::yield_now().await;
            done.abort();
            (r1, done.await)
        })
        .unwrap();
    assert_eq!(join(h), Ok((Err(JoinError::Aborted), Ok(7))));
}

/// A panicking task is contained: its handle says so, the ledger counts the panic, the worker
/// goes on.
#[test]
fn a_panicking_task_is_counted_and_the_worker_goes_on() {
    let (rt, a, _) = runtime(1, TaskConfig::default());
    let h = rt
        .spawn(a, Affinity::Any, async {
            task::yield_now().await;
            panic!("task panic (expected by the test)");
        })
        .unwrap();
    assert_eq!(join(h), Err(JoinError::Panicked));
    let stage = rt.task_stage().unwrap();
    wait_for("the ledger", || {
        rt.snapshot()
            .rows
            .iter()
            .any(|r| r.stage == stage && r.activity == a && r.panics == 1)
    });
    let h = rt.spawn(a, Affinity::Any, async { 1 }).unwrap();
    assert_eq!(join(h), Ok(1));
}

/// `!Send` futures run on the current core; `Send` ones go to the core asked for, and each
/// task stays on its core.
#[test]
fn cross_core_spawn_and_local_not_send_tasks() {
    let (rt, a, _) = runtime(2, TaskConfig::default());
    let h = rt
        .spawn_with(a, Affinity::Core(0), || async move {
            let here = task::core().unwrap();
            // Not Send: an Rc shared with a local child.
            let shared = Rc::new(Cell::new(0));
            let s2 = shared.clone();
            task::spawn(async move {
                s2.set(s2.get() + 1);
                task::core()
            })
            .unwrap()
            .await
            .unwrap();
            let there = task::spawn_on(1, async {
                let c1 = task::core();
                task::yield_now().await;
                (c1, task::core(), task::activity())
            })
            .unwrap()
            .await
            .unwrap();
            (here, shared.get(), there)
        })
        .unwrap();
    let (here, count, (c1, c2, act)) = join(h).unwrap();
    assert_eq!(here, 0);
    assert_eq!(count, 1);
    assert_eq!((c1, c2), (Some(1), Some(1)));
    assert_eq!(act, Some(a), "a cross-core child inherits the activity");
    let stage = rt.task_stage().unwrap();
    wait_for("the ledger", || {
        rt.snapshot()
            .rows
            .iter()
            .any(|r| r.stage == stage && r.core == 1 && r.dispatches == 2)
    });
    assert_eq!(
        rt.spawn(a, Affinity::Core(9), async {}).err(),
        Some(SpawnError::Send(SendError::NoSuchCore(9)))
    );
}

/// A message a stage answers through a `Reply`.
struct Double {
    n: u64,
    reply: Reply<u64>,
}

/// The bridge both ways: a task sends to a stage and awaits its reply (the stage runs in the
/// task's activity); a stage spawns a task, which reports back.
#[test]
fn the_bridge_between_tasks_and_stages() {
    let seen: Arc<std::sync::Mutex<Vec<(ActivityId, u64)>>> = Default::default();
    let spawned_ran = Arc::new(AtomicU64::new(0));
    let (mut b, a) = Runtime::builder()
        .workers(1)
        .tasks(TaskConfig::default())
        .unwrap()
        .activity("/a", ActivitySpec::weight(1))
        .unwrap();
    let seen2 = seen.clone();
    let doubler: StageRef<Double> = b
        .stage("double", StageConfig::default(), move |_| {
            let seen = seen2.clone();
            move |ctx: &mut Ctx<'_>, m: Double| {
                seen.lock().unwrap().push((ctx.activity(), m.n));
                let _ = m.reply.send(m.n * 2);
            }
        })
        .unwrap();
    let dropper: StageRef<Double> = b
        .stage("drop-reply", StageConfig::default(), |_| {
            |_: &mut Ctx<'_>, m: Double| drop(m)
        })
        .unwrap();
    let ran = spawned_ran.clone();
    let starter: StageRef<u64> = b
        .stage("starter", StageConfig::default(), move |_| {
            let ran = ran.clone();
            move |ctx: &mut Ctx<'_>, n: u64| {
                let ran = ran.clone();
                let act = ctx.activity();
                ctx.spawn(async move {
                    task::yield_now().await;
                    if task::activity() == Some(act) {
                        ran.fetch_add(n, Ordering::Relaxed);
                    }
                })
                .unwrap();
            }
        })
        .unwrap();
    let rt = b.start().unwrap();
    let h = rt
        .spawn(a, Affinity::Any, async move {
            let mut sum = 0;
            for n in 1..=3 {
                sum += task::call(&doubler, |reply| Double { n, reply })
                    .await
                    .unwrap();
            }
            // A stage that drops the reply: the caller is told.
            let none = task::call(&dropper, |reply| Double { n: 0, reply }).await;
            (sum, none)
        })
        .unwrap();
    let (sum, none) = join(h).unwrap();
    assert_eq!(sum, 12);
    assert_eq!(none, Err(task::CallError::NoReply));
    assert_eq!(seen.lock().unwrap().clone(), vec![(a, 1), (a, 2), (a, 3)]);
    rt.send(&starter, a, Affinity::Any, 5).unwrap();
    wait_for("the stage's task", || {
        spawned_ran.load(Ordering::Relaxed) == 5
    });
    // Off a task there is no Ctx to send with.
    assert!(block_on(task::call(&doubler, |reply| Double { n: 1, reply })).is_err());
}

/// Sleeps complete on the worker's timers; a timeout elapses or not.
#[test]
fn sleep_and_timeout_on_the_workers_timers() {
    let (rt, a, _) = runtime(1, TaskConfig::default());
    let h = rt
        .spawn(a, Affinity::Any, async {
            let t0 = task::now_ns().unwrap();
            task::sleep(Duration::from_millis(2)).await;
            let slept = task::now_ns().unwrap() - t0;
            let short = task::timeout(Duration::from_millis(1), std::future::pending::<()>()).await;
            let long = task::timeout(Duration::from_secs(60), async { 3 }).await;
            // A sleep dropped before it fires leaves no timer behind.
            drop(task::timeout(
                Duration::from_secs(60),
                std::future::pending::<()>(),
            ));
            (slept, short, long)
        })
        .unwrap();
    let (slept, short, long) = join(h).unwrap();
    // The runtime's own clock, not an assertion on the test's wall clock.
    assert!(slept >= 2_000_000, "woke after {slept} ns");
    assert_eq!(short, Err(task::Elapsed));
    assert_eq!(long, Ok(3));
}

/// A poll past the limit is counted in its activity; quick polls under a generous limit are
/// not.
#[test]
fn long_polls_are_counted_per_activity() {
    // A quick poll preempted past the limit counts as long: at 1 ms a stalled machine made
    // b's empty task one (two activities listed). 100 ms is a stall the test cannot be blamed
    // for, and the spin (twice the limit) costs 0.2 s.
    let limit_ns = 100_000_000;
    let (rt, a, b) = runtime(
        1,
        TaskConfig {
            poll_limit_ns: limit_ns,
            ..Default::default()
        },
    );
    let h = rt
        .spawn(a, Affinity::Any, async move {
            // Spins past the limit by construction (twice the limit on the OS's clock).
            let t = Instant::now();
            while t.elapsed() < Duration::from_nanos(2 * limit_ns) {
                std::hint::spin_loop();
            }
            task::yield_now().await;
        })
        .unwrap();
    join(h).unwrap();
    let h = rt.spawn(b, Affinity::Any, async {}).unwrap();
    join(h).unwrap();
    let lp = rt.long_polls();
    assert_eq!(lp.len(), 1, "{lp:?}");
    assert_eq!(lp[0].activity, a);
    assert!(lp[0].count >= 1);
    assert!(lp[0].worst_ns >= 2 * limit_ns);
}

/// Spawning asks the task stage's gate like a send.
#[test]
fn spawns_pass_the_gate() {
    let (rt, a, _) = runtime(
        1,
        TaskConfig {
            stage: StageConfig {
                batch_max: 1,
                queue_limit: 2,
                ..Default::default()
            },
            ..Default::default()
        },
    );
    let h = rt
        .spawn(a, Affinity::Any, async {
            // This task holds the core: the children stay queued until it yields.
            let mut results = Vec::new();
            let mut handles = Vec::new();
            for _ in 0..3 {
                match task::spawn(async {}) {
                    Ok(h) => handles.push(h),
                    Err(e) => results.push(e),
                }
            }
            for h in handles {
                h.await.unwrap();
            }
            results
        })
        .unwrap();
    // The running task left the queue; two more fit, the third is refused.
    assert_eq!(
        join(h).unwrap(),
        vec![SpawnError::Send(SendError::Rejected(
            RejectReason::QueueFull
        ))]
    );
}

/// Shares between tasks of weighted activities, judged by counts: every poll is charged the
/// same (a 50 ms minimum charge; each poll here takes microseconds), so the tree's SFQ gives
/// /a (weight 2) two polls for each of /b's (weight 1) while both are backlogged.
#[test]
fn weighted_activities_share_polls_by_weight() {
    let (b, a) = Runtime::builder()
        .workers(1)
        .min_cost_ns(50_000_000)
        .tasks(TaskConfig::default())
        .unwrap()
        .activity("/a", ActivitySpec::weight(2))
        .unwrap();
    let (b, bb) = b.activity("/b", ActivitySpec::weight(1)).unwrap();
    let rt = b.start().unwrap();
    const TOTAL: u64 = 3000;
    let total = Arc::new(AtomicU64::new(0));
    let counts = [Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0))];
    let go = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    for (i, act) in [a, bb].into_iter().enumerate() {
        for _ in 0..4 {
            let (total, count, go) = (total.clone(), counts[i].clone(), go.clone());
            handles.push(
                rt.spawn(act, Affinity::Core(0), async move {
                    // Everyone starts backlogged at once.
                    while !go.load(Ordering::Acquire) {
                        task::yield_now().await;
                    }
                    while total.fetch_add(1, Ordering::Relaxed) < TOTAL {
                        count.fetch_add(1, Ordering::Relaxed);
                        task::yield_now().await;
                    }
                })
                .unwrap(),
            );
        }
    }
    wait_for("all tasks queued", || rt.task_stats().spawned == 8);
    go.store(true, Ordering::Release);
    for h in handles {
        join(h).unwrap();
    }
    let (ca, cb) = (
        counts[0].load(Ordering::Relaxed),
        counts[1].load(Ordering::Relaxed),
    );
    assert_eq!(ca + cb, TOTAL);
    // 2:1 of 3000, up to a few polls for the start and the tasks' granularity.
    assert!(ca.abs_diff(2000) <= 16, "/a {ca} /b {cb}");
}

/// Task sockets on the worker's poller: an echo server task and a client task.
#[test]
fn tcp_echo_between_tasks() {
    let (rt, a, _) = runtime(1, TaskConfig::default());
    let h = rt
        .spawn_with(a, Affinity::Any, || async {
            let listener = task::TcpListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
            let addr = listener.local_addr().unwrap();
            let server = task::spawn(async move {
                let (s, _) = listener.accept().await.unwrap();
                let mut buf = [0u8; 64];
                loop {
                    let n = s.read(&mut buf).await.unwrap();
                    if n == 0 {
                        break;
                    }
                    s.write_all(&buf[..n]).await.unwrap();
                }
            })
            .unwrap();
            let c = task::TcpStream::connect(addr).await.unwrap();
            let mut got = Vec::new();
            for word in [&b"hello"[..], b" ", b"tasks"] {
                c.write_all(word).await.unwrap();
                let mut buf = [0u8; 64];
                let n = c.read(&mut buf).await.unwrap();
                got.extend_from_slice(&buf[..n]);
            }
            c.shutdown_write().unwrap();
            server.await.unwrap();
            got
        })
        .unwrap();
    assert_eq!(join(h).unwrap(), b"hello tasks");
}

/// Dropping the runtime drops its tasks; their handles say it stopped.
#[test]
fn shutdown_stops_waiting_tasks() {
    let (rt, a, _) = runtime(1, TaskConfig::default());
    let h = rt
        .spawn(a, Affinity::Any, std::future::pending::<()>())
        .unwrap();
    wait_for("the first poll", || polls(&rt, a).0 == 1);
    drop(rt);
    assert_eq!(join(h), Err(JoinError::Stopped));
}

/// A task socket's readiness: a read that fills its buffer leaves the socket ready (the rest is
/// read at once, with no event to come for it), a short read means the kernel had no more, so
/// the next read waits for the socket's next event without a syscall. Each exchange polls a
/// read once more before answering (the client sends nothing before the answer, so the
/// socket is surely empty): it is pending without asking the kernel. Over 50 exchanges only
/// the first accept and the first read (before any data) may find nothing.
#[test]
fn a_drained_socket_is_not_read_again_until_its_next_event() {
    const EXCHANGES: usize = 50;
    let (rt, a, _) = runtime(1, TaskConfig::default());
    let (tx, rx) = std::sync::mpsc::channel();
    let h = rt
        .spawn_with(a, Affinity::Any, move || async move {
            let listener = task::TcpListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            let (s, _) = listener.accept().await.unwrap();
            let mut reads = 0;
            for _ in 0..EXCHANGES {
                let mut got = Vec::new();
                while got.len() < 10 {
                    // Smaller than a message: 4 + 4 fill the buffer, 2 is short.
                    let mut buf = [0u8; 4];
                    let n = s.read(&mut buf).await.unwrap();
                    assert!(n > 0, "the client closed early");
                    got.extend_from_slice(&buf[..n]);
                    reads += 1;
                }
                assert_eq!(got, b"0123456789");
                let mut buf = [0u8; 4];
                let more = std::future::poll_fn(|cx| Poll::Ready(s.poll_read_some(cx, &mut buf)));
                assert!(more.await.is_pending(), "read more than the client sent");
                s.write_all(b"ok").await.unwrap();
            }
            reads
        })
        .unwrap();
    let addr = rx.recv_timeout(DEADLINE).unwrap();
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(DEADLINE)).unwrap();
    for _ in 0..EXCHANGES {
        use std::io::{Read, Write};
        c.write_all(b"0123456789").unwrap();
        let mut ok = [0u8; 2];
        c.read_exact(&mut ok).unwrap();
        assert_eq!(&ok, b"ok");
    }
    assert_eq!(join(h).unwrap(), 3 * EXCHANGES);
    let wasted = rt.task_stats().io_would_block;
    assert!(
        wasted <= 2,
        "{wasted} reads or accepts found nothing (at most the first accept and first read may)"
    );
}

/// A peer's close that came in the same readiness event as its last bytes: the short read of
/// those bytes must not leave the socket waiting for another event (an edge-triggered poller
/// reports the close once), so the next read returns 0. The task reads only after the loop
/// has collected every event of the exchange (it waits for the client's close, then polls
/// the kernel once more by sleeping).
#[test]
fn a_close_that_came_with_the_last_bytes_is_read_after_a_short_read() {
    let (rt, a, _) = runtime(1, TaskConfig::default());
    let (tx, rx) = std::sync::mpsc::channel();
    let closed = Arc::new(AtomicBool::new(false));
    let closed2 = closed.clone();
    let h = rt
        .spawn_with(a, Affinity::Any, move || async move {
            let listener = task::TcpListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            let (s, _) = listener.accept().await.unwrap();
            // Bounded: the test's deadline in 1 ms sleeps.
            for _ in 0..DEADLINE.as_millis() {
                if closed2.load(Ordering::Acquire) {
                    break;
                }
                task::sleep(Duration::from_millis(1)).await;
            }
            // One more round of the loop's poll: the close's event is collected before the
            // first read.
            task::sleep(Duration::from_millis(1)).await;
            let mut buf = [0u8; 64];
            let first = s.read(&mut buf).await.unwrap();
            let end = task::timeout(DEADLINE, s.read(&mut buf)).await;
            (first, end.map(|r| r.unwrap()))
        })
        .unwrap();
    let addr = rx.recv_timeout(DEADLINE).unwrap();
    {
        use std::io::Write;
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.write_all(b"bye").unwrap();
    }
    closed.store(true, Ordering::Release);
    let (first, end) = join(h).unwrap();
    assert_eq!(first, 3);
    assert_eq!(
        end.ok(),
        Some(0),
        "the close was not seen after the short read"
    );
}

/// A `timeout` (a `sleep`) made off a worker counts from when it was made: made on the main
/// thread once the runtime has run longer than it, it used to be over at once. Judged on the
/// runtime's clock, from the timeout's making to its end (a timer never fires early).
#[test]
fn a_timeout_made_off_a_worker_counts_from_when_it_was_made() {
    const LENGTH: Duration = Duration::from_millis(50);
    let (rt, a, _) = runtime(1, TaskConfig::default());
    // Bounded by the test's deadline on the runtime's own clock.
    while rt.now_ns() < 2 * LENGTH.as_nanos() as u64 {
        std::thread::yield_now();
        assert!(
            rt.now_ns() < DEADLINE.as_nanos() as u64,
            "the runtime clock stands"
        );
    }
    let made_ns = rt.now_ns();
    let t = task::timeout(LENGTH, std::future::pending::<()>());
    let h = rt
        .spawn(a, Affinity::Any, async move {
            let r = t.await;
            (r.is_err(), task::now_ns().unwrap())
        })
        .unwrap();
    let (elapsed, end_ns) = join(h).unwrap();
    assert!(elapsed);
    assert!(
        end_ns - made_ns >= LENGTH.as_nanos() as u64,
        "over {} ns after it was made, before its {LENGTH:?}",
        end_ns - made_ns
    );
}

fn batched(batch_max: u32) -> TaskConfig {
    TaskConfig {
        stage: StageConfig {
            batch_max,
            ..Default::default()
        },
        ..Default::default()
    }
}

/// Spins the calling thread for `ns` on the OS's clock (a poll that takes that long).
fn spin_ns(ns: u64) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_nanos(ns) {
        std::hint::spin_loop();
    }
}

/// With a task batch, one dispatch polls several queued tasks of one activity: children a
/// task spawns are queued together after its poll, and the next dispatch polls all of them
/// (exactly 2 dispatches, 5 polls). Long polls are still judged per poll, not per batch: four
/// polls of 0.1 of the limit in one dispatch count nothing, while one poll of twice the limit
/// beside a short one counts once.
#[test]
fn a_task_batch_polls_queued_tasks_together_and_times_each_poll() {
    // The polls spin on the OS's clock, so a preempted one lasts longer than it spun, and a
    // batch that runs past the limit is cut (more dispatches): the first batch (0.4 of the
    // limit) stays under it unless held off the CPU for 300 ms. (With a 20 ms limit a
    // preempted 6 ms poll once counted as long; with 0.8 of a 300 ms limit, a simulated
    // 250 ms stall cut the batch.)
    let limit_ns = 500_000_000;
    let (rt, a, b) = runtime(
        1,
        TaskConfig {
            poll_limit_ns: limit_ns,
            ..batched(8)
        },
    );
    let spawn_children = |act, spins: Vec<u64>| {
        rt.spawn(act, Affinity::Core(0), async move {
            for ns in spins {
                task::spawn(async move { spin_ns(ns) }).unwrap();
            }
        })
        .unwrap()
    };
    join(spawn_children(a, vec![limit_ns / 10; 4])).unwrap();
    wait_for("the children", || rt.task_stats().completed == 5);
    // A task completes inside its poll; the dispatch is charged after it returns.
    wait_for("the ledger", || polls(&rt, a).1 >= 5);
    assert_eq!(polls(&rt, a), (2, 5));
    assert_eq!(rt.long_polls(), vec![]);

    join(spawn_children(b, vec![2 * limit_ns, 0])).unwrap();
    wait_for("the children", || rt.task_stats().completed == 8);
    let lp = rt.long_polls();
    assert_eq!(lp.len(), 1, "{lp:?}");
    assert_eq!((lp[0].activity, lp[0].count), (b, 1));
    assert!(lp[0].worst_ns >= 2 * limit_ns);
}

/// A batch ends once it has run for the poll limit (a task quota): four queued polls of twice
/// the limit each take a dispatch of their own, the rest of each batch going back to the front
/// of the queue; without the bound they would have run as one dispatch of eight limits.
#[test]
fn a_task_batch_stops_at_the_poll_limit_and_the_rest_waits_its_turn() {
    // The parent's poll (it only spawns) must stay under the limit: at 5 ms a preempted one
    // counted as long (5 long polls, not 4). The four spins of twice the limit cost 0.8 s.
    let limit_ns = 100_000_000;
    let (rt, a, _) = runtime(
        1,
        TaskConfig {
            poll_limit_ns: limit_ns,
            ..batched(8)
        },
    );
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let o = order.clone();
    let parent = rt
        .spawn(a, Affinity::Core(0), async move {
            for i in 0..4 {
                let o = o.clone();
                task::spawn(async move {
                    spin_ns(2 * limit_ns);
                    o.lock().unwrap().push(i);
                })
                .unwrap();
            }
        })
        .unwrap();
    join(parent).unwrap();
    wait_for("the children", || rt.task_stats().completed == 5);
    // A task completes inside its poll; the dispatch is charged after it returns.
    wait_for("the ledger", || polls(&rt, a).1 >= 5);
    // The parent's poll, then one dispatch per child, in the order they were spawned.
    assert_eq!(polls(&rt, a), (5, 5));
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3]);
    assert_eq!(rt.long_polls()[0].count, 4);
}

/// Batched polls keep the shares: every dispatch is charged the same (a 50 ms minimum charge)
/// and takes 4 polls (8 tasks per activity, spawned together by one task so both queues are
/// deeper than the batch from the start), so /a (weight 2) still gets two polls for each of
/// /b's, 4 at a time.
#[test]
fn batched_polls_keep_the_shares_by_weight() {
    const BATCH: u64 = 4;
    let (b, a) = Runtime::builder()
        .workers(1)
        .min_cost_ns(50_000_000)
        .tasks(batched(BATCH as u32))
        .unwrap()
        .activity("/a", ActivitySpec::weight(2))
        .unwrap();
    let (b, bb) = b.activity("/b", ActivitySpec::weight(1)).unwrap();
    let rt = b.start().unwrap();
    const TOTAL: u64 = 3000;
    let total = Arc::new(AtomicU64::new(0));
    let counts = [Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0))];
    let parent = {
        let (total, counts) = (total.clone(), counts.clone());
        rt.spawn_with(a, Affinity::Core(0), move || async move {
            let mut handles = Vec::new();
            for (i, act) in [a, bb].into_iter().enumerate() {
                for _ in 0..2 * BATCH {
                    let (total, count) = (total.clone(), counts[i].clone());
                    handles.push(
                        task::spawn_in(act, async move {
                            while total.fetch_add(1, Ordering::Relaxed) < TOTAL {
                                count.fetch_add(1, Ordering::Relaxed);
                                task::yield_now().await;
                            }
                        })
                        .unwrap(),
                    );
                }
            }
            handles
        })
        .unwrap()
    };
    for h in join(parent).unwrap() {
        join(h).unwrap();
    }
    let (ca, cb) = (
        counts[0].load(Ordering::Relaxed),
        counts[1].load(Ordering::Relaxed),
    );
    assert_eq!(ca + cb, TOTAL);
    // 2:1 of 3000, up to a batch or two for the start and the end (here: 1,996).
    assert!(ca.abs_diff(2000) <= 2 * BATCH, "/a {ca} /b {cb}");
    // The polls went in batches: all took 4 but the parent's poll and the last two or so
    // dispatches of each queue, as its tasks end.
    for act in [a, bb] {
        let (dispatches, messages) = polls(&rt, act);
        assert!(
            messages >= BATCH * dispatches.saturating_sub(3),
            "{act:?}: {messages} polls in {dispatches} dispatches"
        );
    }
}

/// A remote spawn whose `make` panics ends its task: the handle finishes with `Panicked` and the
/// task counts as completed. Its future was never installed, so nothing else ever set its
/// state: the handle stayed running for ever (awaiting it gave `Stopped`) and `completed` never
/// counted it.
#[test]
fn a_remote_spawn_whose_make_panics_ends_its_handle() {
    let (rt, a, _) = runtime(1, TaskConfig::default());
    let h = rt
        .spawn_with(a, Affinity::Any, || -> std::future::Ready<()> {
            panic!("make panics (expected by the test)")
        })
        .unwrap();
    assert_eq!(join(h), Err(JoinError::Panicked));
    wait_for("completed to count it", || {
        let s = rt.task_stats();
        s.completed == s.spawned
    });
    assert_eq!(rt.task_stats().spawned, 1);
    // The worker goes on.
    let h = rt.spawn(a, Affinity::Any, async { 2 }).unwrap();
    assert_eq!(join(h), Ok(2));
}

/// A remote spawn admitted before its activity's removal still runs: here the activity is
/// removed while the spawn waits in the core's mailbox (the core is held by a task until
/// then). The spawn was admitted, so like any message queued for a removed activity it is
/// handled, and the activity is retired on the core afterwards. (Until the retirement of
/// removed activities, the queue for it could not be made on the core and the spawn was
/// dropped; that drop, which must end the handle with `Stopped`, is now reached only by a send
/// racing a removal on another core.)
#[test]
fn a_remote_spawn_admitted_before_its_activitys_removal_still_runs() {
    let (rt, a, _) = runtime(1, TaskConfig::default());
    let c = rt.create_activity("/c", ActivitySpec::weight(1)).unwrap();
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let holder = rt
        .spawn(a, Affinity::Core(0), async move {
            started_tx.send(()).unwrap();
            // Holds the only core until the test has sent and removed.
            go_rx.recv_timeout(DEADLINE).unwrap();
        })
        .unwrap();
    started_rx.recv_timeout(DEADLINE).unwrap();
    let h = rt.spawn(c, Affinity::Core(0), async { 3 }).unwrap();
    rt.remove_activity("/c").unwrap();
    go_tx.send(()).unwrap();
    assert_eq!(join(holder), Ok(()));
    assert_eq!(join(h), Ok(3));
    wait_for("completed to count it", || {
        let s = rt.task_stats();
        s.completed == s.spawned
    });
    assert_eq!(rt.task_stats().spawned, 2);
    wait_for("/c retired", || {
        rt.snapshot().rows.iter().all(|r| r.activity != c)
    });
}

/// A remote spawn refused at the gate started no task: it counts neither as spawned nor as
/// completed (its message, handed back, does not end a task).
#[test]
fn a_refused_remote_spawn_counts_neither_spawned_nor_completed() {
    let (rt, a, _) = runtime(
        1,
        TaskConfig {
            stage: StageConfig {
                queue_limit: 1,
                ..Default::default()
            },
            ..Default::default()
        },
    );
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let holder = rt
        .spawn(a, Affinity::Core(0), async move {
            started_tx.send(()).unwrap();
            go_rx.recv_timeout(DEADLINE).unwrap();
        })
        .unwrap();
    started_rx.recv_timeout(DEADLINE).unwrap();
    // The holder left the queue when it was dispatched: one place, then a refusal.
    let queued = rt.spawn(a, Affinity::Core(0), async { 4 }).unwrap();
    assert_eq!(
        rt.spawn(a, Affinity::Core(0), async { 5 }).err(),
        Some(SpawnError::Send(SendError::Rejected(
            RejectReason::QueueFull
        )))
    );
    go_tx.send(()).unwrap();
    assert_eq!(join(holder), Ok(()));
    assert_eq!(join(queued), Ok(4));
    wait_for("both to complete", || rt.task_stats().completed == 2);
    assert_eq!(rt.task_stats().spawned, 2);
    assert_eq!(rt.task_stats().completed, 2);
}

/// A local spawn in another activity (`spawn_in`) reserves its place at that activity's gate;
/// if the activity is removed before the task is first queued, the task goes on in /infra and
/// that place must be given back. Here the task stage has a shared limit of one message: the
/// place it kept counted in the stage's occupancy for good, and every later spawn, in any
/// activity, was refused (`QueueFull`) until restart.
#[test]
fn a_local_spawn_into_a_removed_activity_gives_its_place_back() {
    let (b, a) = Runtime::builder()
        .workers(1)
        .tasks(TaskConfig {
            stage: StageConfig {
                shared_limit: Some(SharedQueueLimit::new(1, 1).unwrap()),
                ..Default::default()
            },
            ..Default::default()
        })
        .unwrap()
        .activity("/a", ActivitySpec::weight(1))
        .unwrap();
    let (b, c) = b.activity("/c", ActivitySpec::weight(1)).unwrap();
    let rt = b.start().unwrap();
    let (spawned_tx, spawned_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let h = rt
        .spawn(a, Affinity::Any, async move {
            let child = task::spawn_in(c, async { task::activity() });
            spawned_tx.send(child.is_ok()).unwrap();
            // The child is queued once this poll returns: after /c is gone.
            go_rx.recv_timeout(DEADLINE).unwrap();
            child.unwrap().await
        })
        .unwrap();
    assert_eq!(spawned_rx.recv_timeout(DEADLINE), Ok(true));
    rt.remove_activity("/c").unwrap();
    go_tx.send(()).unwrap();
    assert_eq!(join(h), Ok(Ok(Some(INFRA))), "the child ran in /infra");
    wait_for("both to complete", || rt.task_stats().completed == 2);
    // The stage holds nothing now: a spawn gets the one place.
    let h = rt.spawn(a, Affinity::Any, async { 6 });
    assert_eq!(h.as_ref().err(), None);
    assert_eq!(join(h.unwrap()), Ok(6));
}
