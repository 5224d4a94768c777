//! The run-queue wait a worker's wake-ups cost, settled once per counter flush (pure
//! arithmetic; the worker reads the clocks and passes them in).

/// Run-queue wait after wake-ups, found once per counter flush instead of around every sleep.
///
/// The thread's CPU clock is read on each side of every sleep (the CPU inside the blocking
/// poll), but its run-queue wait only at each flush (`/proc/thread-self/schedstat`, every
/// 10 ms): two `pread`s of procfs per sleep were about 0.7 µs, most of what a lightly loaded
/// worker paid to measure its sleeps. The wait the OS counted over a flush interval is split by
/// where it could fall: inside the loop's own segments (from a wake-up to the next sleep; there
/// the wait is wall time beyond the thread's CPU time, preemption, which the loop already
/// charged as wall time) or after a wake-up (the rest). The rest moves from idle to wake time,
/// never more than the interval's sleeps left idle (their window less their CPU).
pub(crate) struct WakeQueue {
    /// The thread's run-queue wait at the last flush, ns (schedstat).
    pub(crate) rq_flushed_ns: u64,
    /// Over the sleeps since the last flush: Σ (window − CPU inside it), ns.
    pub(crate) sleep_room_ns: u64,
    /// Over the loop's segments since the last flush: Σ (wall − CPU), ns.
    pub(crate) loop_wait_ns: u64,
    /// Where the open loop segment began: our clock (raw) and the thread's CPU clock (ns).
    pub(crate) mark_raw: u64,
    pub(crate) mark_cpu_ns: u64,
}

impl WakeQueue {
    /// At the worker's start: the thread's run-queue wait then, and the first loop segment's
    /// start by our clock (raw) and the thread's CPU clock (ns).
    pub(crate) fn new(rq_ns: u64, raw: u64, cpu_ns: u64) -> WakeQueue {
        WakeQueue {
            rq_flushed_ns: rq_ns,
            sleep_room_ns: 0,
            loop_wait_ns: 0,
            mark_raw: raw,
            mark_cpu_ns: cpu_ns,
        }
    }

    /// Ends the open loop segment at (`raw`, `cpu_ns`), which starts the next one.
    pub(crate) fn close_segment(&mut self, wall_ns: u64, raw: u64, cpu_ns: u64) {
        let cpu = cpu_ns.saturating_sub(self.mark_cpu_ns);
        self.loop_wait_ns += wall_ns.saturating_sub(cpu);
        self.mark_raw = raw;
        self.mark_cpu_ns = cpu_ns;
    }

    /// At a flush, with the thread's run-queue wait now: the wait that went to wake-ups since
    /// the last flush, ns, bounded by the sleeps' idle room. Starts the next interval.
    pub(crate) fn settle(&mut self, rq_now_ns: u64) -> u64 {
        let rq = rq_now_ns.saturating_sub(self.rq_flushed_ns);
        let to_wake = rq.saturating_sub(self.loop_wait_ns).min(self.sleep_room_ns);
        self.rq_flushed_ns = rq_now_ns;
        self.sleep_room_ns = 0;
        self.loop_wait_ns = 0;
        to_wake
    }
}

#[cfg(test)]
mod tests {
    use super::WakeQueue;

    fn fresh(rq_ns: u64) -> WakeQueue {
        WakeQueue::new(rq_ns, 0, 0)
    }

    #[test]
    fn a_wait_outside_the_loops_segments_goes_to_wake_ups() {
        let mut q = fresh(1_000);
        // A segment of 400 ns wall with 400 ns of CPU: never off its CPU.
        q.close_segment(400, 400, 400);
        q.sleep_room_ns += 10_000;
        assert_eq!(q.settle(1_300), 300);
        assert_eq!(
            (q.rq_flushed_ns, q.sleep_room_ns, q.loop_wait_ns),
            (1_300, 0, 0)
        );
    }

    #[test]
    fn a_wait_inside_a_segment_is_preemption_the_loop_already_charged() {
        let mut q = fresh(0);
        // 500 ns of wall with 200 ns of CPU: 300 ns off its CPU inside the loop.
        q.close_segment(500, 500, 200);
        assert_eq!(q.loop_wait_ns, 300);
        q.sleep_room_ns += 10_000;
        assert_eq!(q.settle(300), 0);
        // Next interval: the segment starts where the last one ended.
        q.close_segment(100, 600, 300);
        q.sleep_room_ns += 10_000;
        assert_eq!(q.settle(350), 50);
    }

    #[test]
    fn never_more_than_the_sleeps_left_idle() {
        let mut q = fresh(0);
        q.sleep_room_ns += 100;
        assert_eq!(q.settle(5_000), 100);
        // No sleep in the next interval: nothing moves, whatever the OS counted.
        assert_eq!(q.settle(9_000), 0);
    }

    #[test]
    fn cpu_beyond_the_wall_is_no_wait() {
        // The CPU readings sit just outside the wall stamps, so a segment can show a little
        // more CPU than wall time: no negative wait.
        let mut q = fresh(0);
        q.close_segment(100, 100, 130);
        assert_eq!(q.loop_wait_ns, 0);
    }
}
