//! A core's connection deadlines ([`Deadlines`]): every connection's header/idle deadline and
//! its proxied request's deadline, kept in one ordered set per core and served by a single
//! runtime timer (`Tick::Sweep`), the way nginx keeps its timers in one tree and deletes a
//! connection's on close.
//!
//! Before, each connection armed a runtime timer of its own that nothing cancelled: a
//! 10-second header timer at accept and a 30-second one per proxied request. At 20,000 short
//! connections a second a worker held some 800,000 stale timers (its `TIMERS_MAX` is 2^20),
//! each a boxed message counted against the timer stage's queue, and popping them was the
//! top user-space symbol in a profile of the proxy. Here a closed connection's entries leave
//! the set at once, so the set is bounded by the live connections (two entries each) and the
//! runtime holds one outstanding sweep, plus at most one stale sweep per arming that moved
//! the earliest deadline closer.

use std::collections::BTreeSet;

/// Due entries one sweep hands out before it yields (another sweep follows at once): a burst
/// of timeouts (10,000 idle connections reaching their deadline together) is spread over
/// dispatches instead of holding the worker in one.
pub(super) const SWEEP_ENTRIES_MAX: usize = 256;

/// Which of a connection's deadlines an entry is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Kind {
    /// Header timeout, keep-alive idleness, a client that stops reading (`Tick::Deadline`).
    Conn,
    /// A proxied request's connect or response deadline (`Tick::Proxy`).
    Proxy,
}

/// One core's pending deadlines, ordered by when they fall due.
#[derive(Default)]
pub(super) struct Deadlines {
    /// (due, connection key, kind). A connection holds at most one entry of each kind; its
    /// `Conn` says which (`deadline_ns`, `proxy_timer_ns`; 0 when none).
    set: BTreeSet<(u64, u64, Kind)>,
    /// Due time of the runtime timer that will sweep next; 0 when none is outstanding.
    armed_ns: u64,
}

impl Deadlines {
    /// Enters a connection's deadline of `kind` at `due_ns`, replacing its previous one
    /// (`previous_ns`, 0 if none). Returns the due time a sweep must be armed for, if the
    /// outstanding one (if any) comes later; the caller arms it and reports with [`Self::armed`].
    pub(super) fn insert(
        &mut self,
        key: u64,
        kind: Kind,
        previous_ns: u64,
        due_ns: u64,
    ) -> Option<u64> {
        debug_assert!(due_ns > 0, "0 means no deadline");
        if previous_ns != 0 {
            self.set.remove(&(previous_ns, key, kind));
        }
        self.set.insert((due_ns, key, kind));
        (self.armed_ns == 0 || due_ns < self.armed_ns).then_some(due_ns)
    }

    /// Removes a connection's deadline of `kind` (due at `due_ns`; nothing if 0).
    pub(super) fn remove(&mut self, key: u64, kind: Kind, due_ns: u64) {
        if due_ns != 0 {
            self.set.remove(&(due_ns, key, kind));
        }
    }

    /// A sweep for `due_ns` is armed with the runtime.
    pub(super) fn armed(&mut self, due_ns: u64) {
        self.armed_ns = due_ns;
    }

    /// A sweep armed for `due_ns` fired: whether it is the current one (a stale one, replaced
    /// by a sooner one, does nothing). The current one is now spent.
    pub(super) fn sweep_fired(&mut self, due_ns: u64) -> bool {
        if due_ns != self.armed_ns {
            return false;
        }
        self.armed_ns = 0;
        true
    }

    /// Takes out the next entry due by `now_ns`.
    pub(super) fn pop_due(&mut self, now_ns: u64) -> Option<(u64, Kind)> {
        let &(due, key, kind) = self.set.first()?;
        if due > now_ns {
            return None;
        }
        self.set.pop_first();
        Some((key, kind))
    }

    /// The earliest deadline, if no sweep is outstanding for it or before it: what the next
    /// sweep is armed for. (A sweep armed meanwhile for a later time, say by a deadline
    /// handled inside a sweep, does not hide entries due sooner: a sooner sweep replaces it.)
    pub(super) fn next_to_arm(&self) -> Option<u64> {
        let &(due, _, _) = self.set.first()?;
        (self.armed_ns == 0 || due < self.armed_ns).then_some(due)
    }

    /// Entries waiting (two at most per live connection).
    pub(super) fn len(&self) -> usize {
        self.set.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replacing_and_removing_leaves_one_entry_per_connection_and_kind() {
        let mut d = Deadlines::default();
        assert_eq!(d.insert(1, Kind::Conn, 0, 100), Some(100));
        d.armed(100);
        // Later: the armed sweep comes first and finds it.
        assert_eq!(d.insert(1, Kind::Conn, 100, 200), None);
        assert_eq!(d.insert(1, Kind::Proxy, 0, 300), None);
        assert_eq!(d.insert(2, Kind::Conn, 0, 150), None);
        assert_eq!(d.len(), 3);
        // Sooner than the armed sweep: a new one is needed.
        assert_eq!(d.insert(2, Kind::Conn, 150, 50), Some(50));
        d.armed(50);
        d.remove(1, Kind::Proxy, 300);
        d.remove(1, Kind::Proxy, 0);
        assert_eq!(d.len(), 2);
        assert!(!d.sweep_fired(100), "replaced by the sweep at 50");
        assert!(d.sweep_fired(50));
        assert_eq!(d.pop_due(60), Some((2, Kind::Conn)));
        assert_eq!(d.pop_due(60), None);
        assert_eq!(d.next_to_arm(), Some(200));
        d.armed(200);
        assert_eq!(d.next_to_arm(), None, "armed for the earliest already");
        assert!(d.sweep_fired(200));
        assert_eq!(d.pop_due(200), Some((1, Kind::Conn)));
        assert_eq!(d.len(), 0);
        assert_eq!(d.next_to_arm(), None);
    }

    /// A deadline entered during a sweep, later than entries still waiting (handled inline,
    /// it re-armed at `now + timeout`), arms a sweep for itself; the entries due sooner still
    /// get theirs.
    #[test]
    fn a_later_sweep_armed_during_a_sweep_does_not_hide_sooner_entries() {
        let mut d = Deadlines::default();
        for key in 0..3 {
            d.insert(key, Kind::Conn, 0, 10 + key);
        }
        assert_eq!(d.next_to_arm(), Some(10));
        d.armed(10);
        assert!(d.sweep_fired(10));
        assert_eq!(d.pop_due(10), Some((0, Kind::Conn)));
        // Handled inline: re-armed for much later, which arms a sweep there.
        assert_eq!(d.insert(0, Kind::Conn, 0, 1_000), Some(1_000));
        d.armed(1_000);
        // Keys 1 and 2 (due at 11 and 12) need a sweep before it.
        assert_eq!(d.next_to_arm(), Some(11));
        d.armed(11);
        assert!(!d.sweep_fired(1_000), "replaced by the sooner one");
        assert!(d.sweep_fired(11));
        assert_eq!(d.pop_due(12), Some((1, Kind::Conn)));
        assert_eq!(d.pop_due(12), Some((2, Kind::Conn)));
        assert_eq!(d.next_to_arm(), Some(1_000));
    }

    #[test]
    fn equal_due_times_come_out_in_key_order_and_all_of_them() {
        let mut d = Deadlines::default();
        for key in (0..10u64).rev() {
            d.insert(key, Kind::Conn, 0, 7);
            d.insert(key, Kind::Proxy, 0, 7);
        }
        let mut out = Vec::new();
        while let Some(e) = d.pop_due(7) {
            out.push(e);
        }
        assert_eq!(out.len(), 20);
        assert_eq!(out[0], (0, Kind::Conn));
        assert_eq!(out[1], (0, Kind::Proxy));
        assert_eq!(out[19], (9, Kind::Proxy));
    }
}
