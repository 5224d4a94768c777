//! Task timers: [`sleep`], [`sleep_until_instant`] and [`timeout`] on the worker's own timers.

use super::*;

// ---------------------------------------------------------------------------------------------
// Timers.

/// Completes at a time on the worker's clock (a timer of the worker's loop). `Send` and `Sync`
/// (as hyper asks), but a sleep is registered with the core that polls it.
pub struct Sleep {
    deadline_ns: u64,
    /// A sleep made off a worker (no runtime clock to read there): when it ends on the OS's
    /// monotonic clock, turned into the runtime's at its first poll. (Counted from the
    /// runtime's 0 instead, a `timeout` made on the main thread for a task was over at once
    /// once the runtime had run longer than it.)
    until: Option<Instant>,
    /// (runtime, core, key) of the timer registered for this sleep.
    timer: Option<(usize, usize, TimerKey)>,
}

/// `now_ns` on the runtime's clock plus `d`, saturating.
pub(super) fn ns_after(now_ns: u64, d: Duration) -> u64 {
    now_ns.saturating_add(d.as_nanos().min(u128::from(u64::MAX)) as u64)
}

/// `until` on the runtime's clock, read when the runtime's clock says `now_ns`.
pub(super) fn ns_at(now_ns: u64, until: Instant) -> u64 {
    ns_after(now_ns, until.saturating_duration_since(Instant::now()))
}

/// Sleeps for `d` on the current worker's clock (made off a worker: from when it was made).
pub fn sleep(d: Duration) -> Sleep {
    match with_core(|c| c.shared.now_ns()) {
        Some(now) => sleep_until_ns(ns_after(now, d)),
        // A length past what an `Instant` holds never ends.
        None => Instant::now()
            .checked_add(d)
            .map_or_else(|| sleep_until_ns(u64::MAX), sleep_until_instant),
    }
}

/// Sleeps until `deadline_ns` on the runtime's clock (ns since it started; see
/// [`Runtime::now_ns`]).
pub fn sleep_until_ns(deadline_ns: u64) -> Sleep {
    Sleep {
        deadline_ns,
        until: None,
        timer: None,
    }
}

/// Sleeps until `deadline` on the OS's monotonic clock.
pub fn sleep_until_instant(deadline: Instant) -> Sleep {
    match with_core(|c| c.shared.now_ns()) {
        Some(now) => sleep_until_ns(ns_at(now, deadline)),
        None => Sleep {
            deadline_ns: u64::MAX,
            until: Some(deadline),
            timer: None,
        },
    }
}

/// The runtime's clock as seen from a worker, ns since it started (`None` off a worker).
pub fn now_ns() -> Option<u64> {
    with_core(|c| c.shared.now_ns())
}

impl Sleep {
    /// When it completes, ns on the runtime's clock (`u64::MAX` for a sleep made off a worker
    /// and not polled yet).
    pub fn deadline_ns(&self) -> u64 {
        self.deadline_ns
    }

    /// Moves the deadline (the timer is registered again at the next poll).
    pub fn reset(&mut self, deadline_ns: u64) {
        self.cancel();
        self.deadline_ns = deadline_ns;
        self.until = None;
    }

    fn cancel(&mut self) {
        if let Some((runtime, core, key)) = self.timer.take() {
            with_core(|c| {
                if c.shared.runtime_id() == runtime && c.core == core {
                    c.timers.remove(&key);
                }
            });
        }
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        self.cancel();
    }
}

impl Future for Sleep {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let (until, timer) = (self.until, self.timer);
        let mut deadline = self.deadline_ns;
        let r = with_core(|c| {
            let now = c.shared.now_ns();
            if let Some(until) = until {
                deadline = ns_at(now, until);
            }
            let id = c.shared.runtime_id();
            if now >= deadline {
                // Only a timer of this core's: a sleep moved from another core would remove
                // another sleep's timer that had the same key here (as `cancel` checks).
                if let Some((runtime, core, key)) = timer {
                    if runtime == id && core == c.core {
                        c.timers.remove(&key);
                    }
                }
                return (Poll::Ready(()), None);
            }
            if let Some((runtime, core, key)) = timer {
                if runtime == id && core == c.core {
                    if let Some(w) = c.timers.get_mut(&key) {
                        if !w.will_wake(cx.waker()) {
                            w.clone_from(cx.waker());
                        }
                        return (Poll::Pending, timer);
                    }
                }
            }
            if c.timers.len() >= TASK_TIMERS_MAX {
                if let Some(t) = &c.shared.tasks {
                    t.timers_refused.fetch_add(1, Ordering::Relaxed);
                }
                return (Poll::Ready(()), None);
            }
            c.timer_seq += 1;
            let key = (deadline, c.timer_seq);
            c.timers.insert(key, cx.waker().clone());
            (Poll::Pending, Some((id, c.core, key)))
        });
        match r {
            Some((p, t)) => {
                self.timer = t;
                self.deadline_ns = deadline;
                self.until = None;
                p
            }
            None => panic!("omnistage::task::Sleep polled off a worker thread with tasks"),
        }
    }
}

/// The deadline of a [`timeout`] passed first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Elapsed;

impl std::fmt::Display for Elapsed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("deadline elapsed")
    }
}
impl std::error::Error for Elapsed {}

/// Runs `future` until `d` passes on the worker's clock.
pub fn timeout<F: Future>(d: Duration, future: F) -> Timeout<F> {
    Timeout {
        future: Box::pin(future),
        sleep: sleep(d),
    }
}

/// The future of [`timeout`].
pub struct Timeout<F: Future> {
    future: Pin<Box<F>>,
    sleep: Sleep,
}

impl<F: Future> Future for Timeout<F> {
    type Output = Result<F::Output, Elapsed>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Poll::Ready(v) = self.future.as_mut().poll(cx) {
            return Poll::Ready(Ok(v));
        }
        match Pin::new(&mut self.sleep).poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(Elapsed)),
            Poll::Pending => Poll::Pending,
        }
    }
}
