//! An upstream's concurrency slots shared by tenants (pure: no clock, no I/O; times are
//! arguments).
//!
//! At most `slots_max` requests hold a slot at once. Beyond that, requests wait: with `fair`,
//! in one queue per tenant, and a freed slot goes to the tenant the project's SFQ (`sched`)
//! picks, by weight; a grant is charged the tenant's estimated slot-time (an average of the
//! times its slots were held), so a slot is shared like a byte of link: a tenant whose requests
//! hold slots ten times longer gets a tenth of the grants at equal weight. Without `fair`, one
//! FIFO queue for everyone (the baseline nginx-like behaviour, minus the refusals).
//!
//! A tenant's queue is bounded (`queue_max`), and with a wait bound (the tenant's p90 target)
//! a request is refused while the tenant's oldest waiter has waited longer than that: queueing
//! it would only add a response that misses the target. Refusals are counted per tenant.

use omnistage::sched::{ClientParams, NodeId, PolicyKind, Tree};
use std::collections::{HashMap, VecDeque};

/// Estimated slot-time of a tenant before any of its slots was released, ns.
pub const COST_INITIAL_NS: u64 = 1_000_000;
/// The estimate moves by 1/this of the difference per release (an EWMA).
pub const COST_EWMA_DIV: u64 = 8;

/// What [`FairSlots::acquire`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acquire {
    /// The request holds a slot now.
    Granted,
    /// The request waits; [`FairSlots::release`] or [`FairSlots::grant_next`] grants it later.
    Queued,
    /// The tenant's queue is full or too slow: answer 503.
    Refused,
}

/// Counters of one tenant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TenantSlotStats {
    pub in_flight: usize,
    pub queued: usize,
    pub granted: u64,
    pub refused: u64,
    /// Slot-time released, ns.
    pub slot_ns: u64,
}

struct TenantQueue<W> {
    leaf: NodeId,
    weight: u32,
    /// Waiters and when each arrived.
    queue: VecDeque<(W, u64)>,
    cost_ns: u64,
    stats: TenantSlotStats,
}

/// See the module docs. `W` identifies a waiter (a connection key).
pub struct FairSlots<W> {
    slots_max: usize,
    in_flight: usize,
    fair: bool,
    tree: Tree,
    tenants: HashMap<u32, TenantQueue<W>>,
    /// `fair = false`: every waiter in arrival order, with its tenant.
    fifo: VecDeque<(u32, W, u64)>,
}

impl<W: PartialEq> FairSlots<W> {
    pub fn new(slots_max: usize, fair: bool) -> Self {
        let mut tree = Tree::new(PolicyKind::Sfq);
        tree.set_min_cost(1);
        FairSlots {
            slots_max: slots_max.max(1),
            in_flight: 0,
            fair,
            tree,
            tenants: HashMap::new(),
            fifo: VecDeque::new(),
        }
    }

    /// Changes the limit and the discipline (a reload). Waiters stay queued where they are;
    /// a switch of discipline applies to requests queued from now on.
    pub fn configure(&mut self, slots_max: usize, fair: bool) {
        self.slots_max = slots_max.max(1);
        self.fair = fair;
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    pub fn slots_max(&self) -> usize {
        self.slots_max
    }

    /// Waiters of every tenant.
    pub fn queued(&self) -> usize {
        self.fifo.len() + self.tenants.values().map(|t| t.queue.len()).sum::<usize>()
    }

    /// The counters of a tenant (zero for one never seen).
    pub fn stats(&self, tenant: u32) -> TenantSlotStats {
        self.tenants
            .get(&tenant)
            .map_or_else(Default::default, |t| {
                let mut s = t.stats;
                s.queued = t.queue.len() + self.fifo.iter().filter(|w| w.0 == tenant).count();
                s
            })
    }

    /// Tenants seen, in no particular order.
    pub fn tenants(&self) -> impl Iterator<Item = u32> + '_ {
        self.tenants.keys().copied()
    }

    fn tenant(&mut self, tenant: u32, weight: u32) -> &mut TenantQueue<W> {
        let tree = &mut self.tree;
        let t = self.tenants.entry(tenant).or_insert_with(|| {
            let root = tree.root();
            let leaf = tree
                .add_leaf(root, ClientParams::weight(weight.max(1)))
                .expect("a tree holds far more leaves than tenants");
            TenantQueue {
                leaf,
                weight,
                queue: VecDeque::new(),
                cost_ns: COST_INITIAL_NS,
                stats: TenantSlotStats::default(),
            }
        });
        if t.weight != weight {
            t.weight = weight;
            let _ = tree.set_params(t.leaf, ClientParams::weight(weight.max(1)));
        }
        t
    }

    /// A request of `tenant` (with its `weight`) asks for a slot at `now_ns`. It waits if none
    /// is free (or others wait already), unless its tenant has `queue_max` waiting, or its
    /// oldest waiter has waited more than `wait_max_ns`.
    pub fn acquire(
        &mut self,
        tenant: u32,
        weight: u32,
        waiter: W,
        queue_max: usize,
        wait_max_ns: Option<u64>,
        now_ns: u64,
    ) -> Acquire {
        let waiting = self.queued();
        let fair = self.fair;
        let free = self.in_flight < self.slots_max;
        let in_fifo = self.fifo.iter().filter(|w| w.0 == tenant).count();
        let oldest_fifo = self.fifo.iter().find(|w| w.0 == tenant).map(|w| w.2);
        let t = self.tenant(tenant, weight);
        if free && waiting == 0 {
            t.stats.in_flight += 1;
            t.stats.granted += 1;
            self.in_flight += 1;
            return Acquire::Granted;
        }
        let queued = t.queue.len() + in_fifo;
        let oldest = t.queue.front().map(|w| w.1).or(oldest_fifo);
        let too_slow = match (wait_max_ns, oldest) {
            (Some(max), Some(at)) => now_ns.saturating_sub(at) > max,
            _ => false,
        };
        if queued >= queue_max || too_slow {
            t.stats.refused += 1;
            return Acquire::Refused;
        }
        if fair {
            let was_empty = t.queue.is_empty();
            t.queue.push_back((waiter, now_ns));
            let leaf = t.leaf;
            if was_empty {
                self.tree.leaf_ready(leaf, now_ns);
            }
        } else {
            self.fifo.push_back((tenant, waiter, now_ns));
        }
        // Slots free while others wait (a reload raised the limit): the caller's `grant_next`
        // hands them out.
        Acquire::Queued
    }

    /// A request of `tenant` gives its slot back after holding it `held_ns`. Returns the next
    /// waiter granted a slot, if any (call [`FairSlots::grant_next`] for more after a reload
    /// raised the limit).
    pub fn release(&mut self, tenant: u32, held_ns: u64, now_ns: u64) -> Option<(u32, W)> {
        self.in_flight = self.in_flight.saturating_sub(1);
        if let Some(t) = self.tenants.get_mut(&tenant) {
            t.stats.in_flight = t.stats.in_flight.saturating_sub(1);
            t.stats.slot_ns += held_ns;
            // EWMA in integers: moves 1/8 of the way to the new sample.
            let c = t.cost_ns as i128;
            t.cost_ns = (c + (held_ns as i128 - c) / COST_EWMA_DIV as i128).max(1) as u64;
        }
        self.grant_next(now_ns)
    }

    /// Grants a free slot to the next waiter, if a slot is free and someone waits.
    pub fn grant_next(&mut self, now_ns: u64) -> Option<(u32, W)> {
        if self.in_flight >= self.slots_max {
            return None;
        }
        // Waiters queued before a switch of discipline go first in the FIFO.
        let (tenant, waiter) = if let Some((tenant, w, _)) = self.fifo.pop_front() {
            (tenant, w)
        } else {
            let leaf = self.tree.pick(now_ns)?;
            let Some((&tenant, t)) = self.tenants.iter_mut().find(|(_, t)| t.leaf == leaf) else {
                // A leaf of no tenant cannot be: charge it idle and give up this round.
                self.tree.charge(leaf, 1, false, now_ns);
                return None;
            };
            let Some((w, _)) = t.queue.pop_front() else {
                self.tree.charge(leaf, 1, false, now_ns);
                return None;
            };
            let still = !t.queue.is_empty();
            self.tree.charge(leaf, t.cost_ns, still, now_ns);
            (tenant, w)
        };
        let t = self
            .tenants
            .get_mut(&tenant)
            .expect("a waiter's tenant is known");
        t.stats.in_flight += 1;
        t.stats.granted += 1;
        self.in_flight += 1;
        Some((tenant, waiter))
    }

    /// Takes a waiter out of its queue (its client went away or timed out); false if it was not
    /// waiting.
    pub fn withdraw(&mut self, tenant: u32, waiter: &W) -> bool {
        if let Some(i) = self
            .fifo
            .iter()
            .position(|w| w.0 == tenant && &w.1 == waiter)
        {
            self.fifo.remove(i);
            return true;
        }
        let Some(t) = self.tenants.get_mut(&tenant) else {
            return false;
        };
        let Some(i) = t.queue.iter().position(|w| &w.0 == waiter) else {
            return false;
        };
        t.queue.remove(i);
        if t.queue.is_empty() {
            self.tree.leaf_idle(t.leaf);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: u32 = 1;
    const B: u32 = 2;

    /// With one slot held by A: releases it `n` times, each grant held `held(tenant)` ns;
    /// returns the tenants granted, in order.
    fn run(s: &mut FairSlots<u64>, n: usize, held: impl Fn(u32) -> u64) -> Vec<u32> {
        let mut out = Vec::new();
        let mut now = 0;
        let mut holder = A;
        for _ in 0..n {
            now += held(holder);
            match s.release(holder, held(holder), now) {
                Some((t, _)) => {
                    out.push(t);
                    holder = t;
                }
                None => break,
            }
        }
        out
    }

    /// A limit of one slot, held by a request of A, with `queued` waiters of each of A
    /// and B behind it.
    fn busy(fair: bool, wa: u32, wb: u32, queued: u64) -> FairSlots<u64> {
        let mut s = FairSlots::new(1, fair);
        assert_eq!(s.acquire(A, wa, 0, 1000, None, 0), Acquire::Granted);
        for i in 0..queued {
            assert_eq!(s.acquire(B, wb, 100 + i, 1000, None, 0), Acquire::Queued);
        }
        for i in 0..queued {
            assert_eq!(s.acquire(A, wa, 200 + i, 1000, None, 0), Acquire::Queued);
        }
        s
    }

    fn count(v: &[u32], t: u32) -> usize {
        v.iter().filter(|&&x| x == t).count()
    }

    #[test]
    fn grants_while_free_then_queues() {
        let mut s = FairSlots::new(2, true);
        assert_eq!(s.acquire(A, 100, 1, 10, None, 0), Acquire::Granted);
        assert_eq!(s.acquire(B, 100, 2, 10, None, 0), Acquire::Granted);
        assert_eq!(s.acquire(A, 100, 3, 10, None, 0), Acquire::Queued);
        assert_eq!(s.in_flight(), 2);
        assert_eq!(s.queued(), 1);
        assert_eq!(s.release(B, 5, 5), Some((A, 3)));
        assert_eq!(s.stats(A).in_flight, 2);
        assert_eq!(s.stats(B).slot_ns, 5);
        assert_eq!(s.release(A, 5, 5), None);
        assert_eq!(s.in_flight(), 1);
    }

    #[test]
    fn equal_weights_alternate_though_b_queued_first() {
        // B queued 10 before A queued its 10: SFQ still alternates.
        let mut s = busy(true, 100, 100, 10);
        let order = run(&mut s, 20, |_| COST_INITIAL_NS);
        assert_eq!(order.len(), 20);
        assert_eq!(count(&order[..10], A), 5, "{order:?}");
        assert_eq!(count(&order[..10], B), 5, "{order:?}");
        for w in order[..18].windows(2) {
            assert_ne!(w[0], w[1], "alternates: {order:?}");
        }
    }

    #[test]
    fn fifo_serves_in_arrival_order() {
        let mut s = busy(false, 100, 100, 10);
        let order = run(&mut s, 20, |_| 1000);
        assert_eq!(order, [vec![B; 10], vec![A; 10]].concat());
    }

    #[test]
    fn weights_share_the_grants() {
        // A weighs 3× B: of the first 20 grants with both backlogged, 15 are A's.
        let mut s = busy(true, 300, 100, 40);
        let order = run(&mut s, 20, |_| COST_INITIAL_NS);
        assert_eq!(count(&order, A), 15, "{order:?}");
        assert_eq!(count(&order, B), 5, "{order:?}");
    }

    #[test]
    fn slow_tenant_gets_fewer_grants_by_slot_time() {
        // B's requests hold a slot 10× longer: once its estimate has learned that, A gets
        // about ten grants per one of B's.
        let mut s = busy(true, 100, 100, 200);
        let order = run(&mut s, 200, |t| if t == B { 10_000_000 } else { 1_000_000 });
        let tail = &order[100..];
        let (a, b) = (count(tail, A), count(tail, B));
        assert!(
            (8..=11).contains(&(a / b.max(1))),
            "A {a}, B {b}: {order:?}"
        );
        // Once learned, slot-time is close to even: within 25%.
        let (sa, sb) = (a as u64, b as u64 * 10);
        assert!(sa * 4 >= sb * 3 && sb * 4 >= sa * 3, "A {sa} ms, B {sb} ms");
    }

    #[test]
    fn queue_bound_and_wait_bound_refuse() {
        let mut s = FairSlots::new(1, true);
        assert_eq!(s.acquire(A, 100, 0, 2, None, 0), Acquire::Granted);
        assert_eq!(s.acquire(B, 100, 1, 2, None, 0), Acquire::Queued);
        assert_eq!(s.acquire(B, 100, 2, 2, None, 0), Acquire::Queued);
        assert_eq!(s.acquire(B, 100, 3, 2, None, 0), Acquire::Refused);
        assert_eq!(s.stats(B).refused, 1);
        assert_eq!(s.stats(B).queued, 2);
        // A's own queue is not B's: A may still queue.
        assert_eq!(s.acquire(A, 100, 4, 2, Some(50), 10), Acquire::Queued);
        // A's oldest waiter has waited 50 ns: still within the bound; at 61 it is not.
        assert_eq!(s.acquire(A, 100, 5, 5, Some(50), 60), Acquire::Queued);
        assert_eq!(s.acquire(A, 100, 6, 5, Some(50), 61), Acquire::Refused);
        // A FIFO queue bounds per tenant too.
        let mut f = FairSlots::new(1, false);
        assert_eq!(f.acquire(A, 100, 0, 1, None, 0), Acquire::Granted);
        assert_eq!(f.acquire(B, 100, 1, 1, None, 0), Acquire::Queued);
        assert_eq!(f.acquire(B, 100, 2, 1, None, 0), Acquire::Refused);
        assert_eq!(f.acquire(A, 100, 3, 1, None, 0), Acquire::Queued);
    }

    #[test]
    fn withdrawn_waiters_are_never_granted() {
        let mut s = FairSlots::new(1, true);
        assert_eq!(s.acquire(A, 100, 0, 9, None, 0), Acquire::Granted);
        assert_eq!(s.acquire(B, 100, 1, 9, None, 0), Acquire::Queued);
        assert_eq!(s.acquire(B, 100, 2, 9, None, 0), Acquire::Queued);
        assert!(s.withdraw(B, &1));
        assert!(!s.withdraw(B, &1));
        assert_eq!(s.release(A, 1, 1), Some((B, 2)));
        assert!(s.withdraw(B, &2) || s.stats(B).in_flight == 1);
        assert_eq!(s.release(B, 1, 2), None);
        assert_eq!(s.in_flight(), 0);
        let mut f = FairSlots::new(1, false);
        assert_eq!(f.acquire(A, 100, 0, 9, None, 0), Acquire::Granted);
        assert_eq!(f.acquire(B, 100, 1, 9, None, 0), Acquire::Queued);
        assert!(f.withdraw(B, &1));
        assert_eq!(f.release(A, 1, 1), None);
    }

    #[test]
    fn raised_limit_grants_waiters() {
        let mut s = FairSlots::new(1, true);
        assert_eq!(s.acquire(A, 100, 0, 9, None, 0), Acquire::Granted);
        assert_eq!(s.acquire(B, 100, 1, 9, None, 0), Acquire::Queued);
        assert_eq!(s.acquire(B, 100, 2, 9, None, 0), Acquire::Queued);
        s.configure(3, true);
        assert_eq!(s.grant_next(1), Some((B, 1)));
        assert_eq!(s.grant_next(1), Some((B, 2)));
        assert_eq!(s.grant_next(1), None);
        assert_eq!(s.in_flight(), 3);
    }
}
