//! Counts heap allocations (a counting global allocator, for this test binary only) while
//! tasks wake each other on one core: after warm-up, a same-core wake and the poll it leads to
//! must not allocate (the wake list's room is reserved at spawn; the task queue reuses its
//! grown capacity; the poll reuses the task's stored waker).
//!
//! The count covers every thread of the process, so the bound is an average well below one
//! allocation per wake rather than exactly zero: the worker's periodic counter flush may
//! allocate now and then, but an allocation on the wake path would show once per wake.
use omnistage::activity::ActivitySpec;
use omnistage::exec::{Affinity, Runtime};
use omnistage::task::{self, TaskConfig};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged; it only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Wakes measured after warm-up (each of the two kinds).
const WAKES_MEASURED: u64 = 20_000;
const WAKES_WARMUP: u64 = 1_000;

/// Two tasks ping-pong through wakers they hand each other (a same-core wake of another
/// task), and a third yields (a task waking itself); the allocations between the checkpoints
/// the tasks take themselves are counted.
#[test]
fn same_core_wakes_allocate_nothing() {
    let (b, a) = Runtime::builder()
        .workers(1)
        .tasks(TaskConfig::default())
        .unwrap()
        .activity("/a", ActivitySpec::weight(1))
        .unwrap();
    let rt = b.start().unwrap();
    let h = rt
        .spawn_with(a, Affinity::Core(0), || async {
            // Ping-pong: `turn` says whose turn it is; each side leaves its waker in `parked`
            // for the other.
            let turn = Rc::new(Cell::new(0u64));
            let parked: Rc<[Cell<Option<Waker>>; 2]> = Rc::new([Cell::new(None), Cell::new(None)]);
            let total = 2 * (WAKES_WARMUP + WAKES_MEASURED);
            let mut sides = Vec::new();
            for me in 0..2u64 {
                let (turn, parked) = (turn.clone(), parked.clone());
                sides.push(
                    task::spawn(async move {
                        let mut counted = (0, 0);
                        loop {
                            std::future::poll_fn(|cx| {
                                if turn.get() % 2 == me || turn.get() >= total {
                                    return Poll::Ready(());
                                }
                                parked[me as usize].set(Some(cx.waker().clone()));
                                Poll::Pending
                            })
                            .await;
                            let t = turn.get();
                            if t >= total {
                                break;
                            }
                            if t == 2 * WAKES_WARMUP {
                                counted.0 = ALLOCS.load(Ordering::Relaxed);
                            }
                            if t == total - 1 {
                                counted.1 = ALLOCS.load(Ordering::Relaxed);
                            }
                            turn.set(t + 1);
                            if let Some(w) = parked[1 - me as usize].take() {
                                w.wake();
                            }
                        }
                        if let Some(w) = parked[1 - me as usize].take() {
                            w.wake();
                        }
                        counted
                    })
                    .unwrap(),
                );
            }
            let yielder = task::spawn(async {
                let mut counted = (0, 0);
                for i in 0..WAKES_WARMUP + WAKES_MEASURED {
                    if i == WAKES_WARMUP {
                        counted.0 = ALLOCS.load(Ordering::Relaxed);
                    }
                    task::yield_now().await;
                }
                counted.1 = ALLOCS.load(Ordering::Relaxed);
                counted
            })
            .unwrap();
            let mut out = Vec::new();
            for s in sides {
                out.push(s.await.unwrap());
            }
            out.push(yielder.await.unwrap());
            out
        })
        .unwrap();
    let end = Instant::now() + Duration::from_secs(30);
    while !h.is_finished() {
        assert!(Instant::now() < end, "timed out");
        std::thread::sleep(Duration::from_millis(5));
    }
    let out = futures_executor::block_on(h).unwrap();
    // The side that counted its window (one of the two starts it, the other ends it: take the
    // widest window over both), and the yielder.
    let ping_start = out[..2]
        .iter()
        .map(|c| c.0)
        .filter(|&v| v > 0)
        .min()
        .unwrap();
    let ping_end = out[..2].iter().map(|c| c.1).max().unwrap();
    let ping = ping_end - ping_start;
    let yielded = out[2].1 - out[2].0;
    eprintln!(
        "allocations: {ping} over {} ping-pong wakes, {yielded} over {WAKES_MEASURED} self-wakes",
        2 * WAKES_MEASURED
    );
    assert!(ping < WAKES_MEASURED / 100, "{ping} allocations");
    assert!(yielded < WAKES_MEASURED / 100, "{yielded} allocations");
}
