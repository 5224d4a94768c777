//! What a dispatch ran, told apart from the time its thread lost while it ran.
//!
//! A dispatch's cost is the TSC time around it. When the OS preempts the worker in the middle
//! of a dispatch (another thread on its CPU, the hypervisor's steal), that time is in the cost
//! though the dispatch never ran in it. Charged to the scheduling tree, it puts the dispatch's
//! activity ahead by service it did not get, and at equal weights that activity then waits
//! for the others to catch up: under `exp adversary`'s attack, hundreds of the victim's 15 µs
//! dispatches per run measured 0.5–9 ms by the TSC.
//!
//! Reading the thread's CPU clock is a system call (~0.2–0.5 µs; the vDSO does not serve
//! thread clocks), too dear for every dispatch. So the clock is read only after a dispatch
//! long enough to have been preempted ([`DISPATCH_CHECKED_NS`]) and at least every
//! [`CPU_ANCHOR_NS`] (the anchor), and such a dispatch is charged its TSC time less the time
//! the thread lost since the anchor. Loss in the part of that window before the dispatch
//! began is taken off too, so a long dispatch can be under-charged by at most
//! [`CPU_ANCHOR_NS`]; that bound is what the anchor interval buys.
//!
//! Only the scheduler's charge changes: the ledger keeps every stretch of the loop (the
//! preempted time included), so attribution still adds up against the OS's clocks.
//!
//! Pure: the caller passes the loop's time (ns) and a function that reads the thread's CPU
//! clock, so the rule is tested with made-up readings.

/// A dispatch this long by the TSC (ns) has its thread CPU time checked: longer than any
/// dispatch the stages bound themselves to, and rare enough that one clock syscall each costs
/// nothing measurable.
pub(super) const DISPATCH_CHECKED_NS: u64 = 250_000;

/// The thread's CPU clock is also read at least this often (ns of loop time), so that at most
/// this much loss from before a long dispatch is taken off its charge.
pub(super) const CPU_ANCHOR_NS: u64 = 1_000_000;

/// The last reading of the thread's CPU clock and the loop time it was taken at.
#[derive(Clone, Copy, Debug)]
pub(super) struct LostTime {
    anchor_ns: u64,
    anchor_cpu_ns: u64,
}

impl LostTime {
    /// Anchored at a reading taken at loop time `now_ns` (a wake-up, the loop's start): time
    /// before it, a sleep included, is never counted as lost.
    pub(super) fn new(now_ns: u64, cpu_ns: u64) -> Self {
        LostTime {
            anchor_ns: now_ns,
            anchor_cpu_ns: cpu_ns,
        }
    }

    /// The part of a dispatch that ended at loop time `end_ns` and took `cost_ns` by the TSC
    /// that the thread ran: `cost_ns` unless the dispatch was long, then `cost_ns` less the
    /// time lost since the anchor, never below 1 ns. `read_cpu_ns` reads the thread's CPU
    /// clock; it is called only when the dispatch is long or the anchor is old.
    pub(super) fn run_part(
        &mut self,
        end_ns: u64,
        cost_ns: u64,
        read_cpu_ns: impl FnOnce() -> u64,
    ) -> u64 {
        let since_ns = end_ns.saturating_sub(self.anchor_ns);
        if cost_ns < DISPATCH_CHECKED_NS && since_ns < CPU_ANCHOR_NS {
            return cost_ns;
        }
        let cpu_ns = read_cpu_ns();
        let anchor_cpu_ns = std::mem::replace(&mut self.anchor_cpu_ns, cpu_ns);
        self.anchor_ns = end_ns;
        if cost_ns < DISPATCH_CHECKED_NS {
            return cost_ns;
        }
        // A clock that failed (reads 0) or went back says nothing about loss: charge it all.
        let Some(ran_ns) = cpu_ns.checked_sub(anchor_cpu_ns) else {
            return cost_ns;
        };
        let lost_ns = since_ns.saturating_sub(ran_ns);
        debug_assert!(lost_ns <= since_ns);
        cost_ns.saturating_sub(lost_ns).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn never() -> u64 {
        panic!("a short dispatch under a fresh anchor must not read the CPU clock")
    }

    #[test]
    fn a_short_dispatch_under_a_fresh_anchor_is_charged_whole_without_a_reading() {
        let mut lost = LostTime::new(1_000, 50);
        assert_eq!(lost.run_part(1_000 + 20_000, 15_000, never), 15_000);
        assert_eq!(lost.run_part(1_000 + 999_999, 249_999, never), 249_999);
    }

    #[test]
    fn a_preempted_dispatch_is_charged_what_it_ran() {
        // Anchored at the dispatch's start; 2 ms by the TSC, of which the thread ran 15 µs.
        let mut lost = LostTime::new(10_000, 7_000_000);
        assert_eq!(
            lost.run_part(10_000 + 2_000_000, 2_000_000, || 7_000_000 + 15_000),
            15_000
        );
        // The reading is the new anchor: a short dispatch right after reads nothing.
        assert_eq!(lost.run_part(2_010_000 + 30_000, 30_000, never), 30_000);
    }

    #[test]
    fn a_long_dispatch_that_ran_throughout_is_charged_whole() {
        let mut lost = LostTime::new(0, 0);
        assert_eq!(lost.run_part(900_000, 800_000, || 900_000), 800_000);
    }

    #[test]
    fn loss_before_the_dispatch_since_the_anchor_is_taken_off_within_the_anchor_interval() {
        // Anchor 0; the thread ran 800 of the 1,100 µs since then, the last 400 µs a dispatch
        // that ran throughout: the 300 µs lost before it are taken off its charge (the price
        // of not reading the clock at every dispatch), which the anchor interval bounds.
        let mut lost = LostTime::new(0, 0);
        let charged = lost.run_part(1_100_000, 400_000, || 800_000);
        assert_eq!(charged, 100_000);
        assert!(400_000 - charged <= CPU_ANCHOR_NS);
    }

    #[test]
    fn an_old_anchor_is_renewed_by_a_short_dispatch_which_is_charged_whole() {
        let mut lost = LostTime::new(0, 0);
        // 2 ms since the anchor, half of it lost: the short dispatch keeps its cost.
        assert_eq!(lost.run_part(2_000_000, 10_000, || 1_000_000), 10_000);
        // The loss before the renewal no longer counts against the next long dispatch.
        assert_eq!(
            lost.run_part(2_000_000 + 300_000, 300_000, || 1_300_000),
            300_000
        );
    }

    #[test]
    fn a_charge_never_falls_below_one_ns() {
        let mut lost = LostTime::new(0, 100);
        // Ran 100 ns of the 900 µs: everything but the ran part is loss, more than the cost.
        assert_eq!(lost.run_part(900_000, 300_000, || 200), 1);
    }

    #[test]
    fn a_failed_or_backward_clock_charges_the_whole_cost() {
        let mut lost = LostTime::new(0, 5_000_000);
        assert_eq!(lost.run_part(2_000_000, 1_500_000, || 0), 1_500_000);
        let mut lost = LostTime::new(0, 5_000_000);
        assert_eq!(lost.run_part(2_000_000, 1_500_000, || 4_000_000), 1_500_000);
    }
}
