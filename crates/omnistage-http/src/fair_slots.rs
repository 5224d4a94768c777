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
//! With `fair`, slots are also kept for tenants that were recently active and are below their
//! share: a tenant at or above its weighted share of the slots does not get a slot that would
//! leave fewer free than the others' reserve, each one's recent peak demand (in flight plus
//! waiting, over the last one or two [`WINDOW_NS`]) up to its share, minus what it holds; the
//! reserve is at most 1/[`RESERVE_DIV`] of the slots (none below that many slots). Without it, a
//! flooding tenant holds every slot and a light tenant waits for the next release, which with
//! a backend of steady service time comes in bursts (the flood's requests start and end
//! together): up to one whole service time. With it, the light tenant's requests find a free
//! slot; the cost is at most the reserve's slots of the flood's concurrency while others are
//! active, and nothing once they have been idle for two windows (work-conserving then).
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

/// The window over which a tenant's peak demand and activity are remembered, ns: its reserve
/// lasts one to two windows after its last request.
pub const WINDOW_NS: u64 = 1_000_000_000;
/// The reserve kept for others is at most `slots_max / RESERVE_DIV` slots: 1 of 16 costs a
/// flood at most 6 % of the backend's concurrency while a light tenant is active (measured with
/// `exp shared-backend`: 1 of 16 kept the light tenant's p99 at its p99 alone and the backend
/// 14.8 of 16 busy; 2 and 4 of 16 cost 14.1–14.5 busy for no better p99).
pub const RESERVE_DIV: usize = 16;

/// Above this many tenants on one upstream (per worker) no reserve is kept: deciding it walks
/// every tenant for every waiting one, which must stay cheap on the grant path.
pub const RESERVE_TENANTS_MAX: usize = 64;

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
    /// Largest demand (in flight + waiting) in the current window and in the one before.
    peak_now: usize,
    peak_before: usize,
    /// Asked for a slot in the current window / in the one before.
    active_now: bool,
    active_before: bool,
}

impl<W> TenantQueue<W> {
    fn demand(&self) -> usize {
        self.stats.in_flight + self.queue.len()
    }

    fn active(&self) -> bool {
        self.active_now || self.active_before
    }

    /// Notes the current demand in the window's peak.
    fn note_demand(&mut self) {
        self.peak_now = self.peak_now.max(self.demand());
    }
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
    /// When the current activity window started, ns.
    window_start_ns: u64,
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
            window_start_ns: 0,
        }
    }

    /// Starts a new activity window when the current one is over (two when two are).
    fn roll(&mut self, now_ns: u64) {
        let elapsed = now_ns.saturating_sub(self.window_start_ns);
        if elapsed < WINDOW_NS {
            return;
        }
        let skipped = elapsed >= 2 * WINDOW_NS;
        for t in self.tenants.values_mut() {
            (t.peak_before, t.active_before) = if skipped {
                (0, false)
            } else {
                (t.peak_now, t.active_now)
            };
            t.peak_now = t.demand();
            t.active_now = false;
        }
        self.window_start_ns = now_ns;
    }

    /// Whether `tenant` holds fewer slots than its weighted share among the active tenants.
    fn below_share(&self, tenant: u32) -> bool {
        let Some(t) = self.tenants.get(&tenant) else {
            return true;
        };
        let weights: u64 = self
            .tenants
            .iter()
            .filter(|(&id, o)| id == tenant || o.active())
            .map(|(_, o)| u64::from(o.weight.max(1)))
            .sum();
        (t.stats.in_flight as u64) * weights < (self.slots_max as u64) * u64::from(t.weight.max(1))
    }

    /// Slots kept for the active tenants other than `tenant` that are below their share: each
    /// one's recent peak demand, up to its share, minus what it holds; at most
    /// `slots_max / RESERVE_DIV` in all.
    fn reserve_for_others(&self, tenant: u32) -> usize {
        let cap = self.slots_max / RESERVE_DIV;
        if cap == 0 {
            return 0;
        }
        let active = |o: &TenantQueue<W>| o.active();
        let weights: u64 = self
            .tenants
            .iter()
            .filter(|(&id, o)| id == tenant || active(o))
            .map(|(_, o)| u64::from(o.weight.max(1)))
            .sum();
        let mut reserve = 0usize;
        for (&id, o) in &self.tenants {
            if id == tenant || !active(o) {
                continue;
            }
            let share =
                (self.slots_max as u64 * u64::from(o.weight.max(1)) / weights.max(1)) as usize;
            let peak = o.peak_now.max(o.peak_before);
            reserve += peak.min(share).saturating_sub(o.stats.in_flight);
        }
        reserve.min(cap)
    }

    /// Whether slots are kept for light tenants at all (see [`RESERVE_DIV`],
    /// [`RESERVE_TENANTS_MAX`]).
    fn reserve_on(&self) -> bool {
        self.fair && self.slots_max / RESERVE_DIV > 0 && self.tenants.len() <= RESERVE_TENANTS_MAX
    }

    /// Whether a free slot may go to `tenant` now: always when it is below its share, else
    /// only if the others' reserve stays free (see the module docs). FIFO: always.
    fn may_take(&self, tenant: u32) -> bool {
        if !self.reserve_on() || self.below_share(tenant) {
            return true;
        }
        let free = self.slots_max.saturating_sub(self.in_flight);
        free > self.reserve_for_others(tenant)
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
                peak_now: 0,
                peak_before: 0,
                active_now: false,
                active_before: false,
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
        self.roll(now_ns);
        let waiting = self.queued();
        let fair = self.fair;
        let free = self.in_flight < self.slots_max;
        let in_fifo = self.fifo.iter().filter(|w| w.0 == tenant).count();
        let oldest_fifo = self.fifo.iter().find(|w| w.0 == tenant).map(|w| w.2);
        self.tenant(tenant, weight).active_now = true;
        // A free slot while others wait means their tenants are held to the reserve: a tenant
        // below its share takes it; others queue behind those waiters.
        let grant =
            free && self.may_take(tenant) && (waiting == 0 || (fair && self.below_share(tenant)));
        let t = self.tenant(tenant, weight);
        if grant {
            t.stats.in_flight += 1;
            t.stats.granted += 1;
            t.note_demand();
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
            t.note_demand();
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

    /// A slot granted to a waiter whose request had gone (its client left) comes back unused:
    /// like [`FairSlots::release`], but no sample of the tenant's slot-time (a 0 ns sample would
    /// pull its estimate toward nothing and win it grants it does not need).
    pub fn give_back_unused(&mut self, tenant: u32, now_ns: u64) -> Option<(u32, W)> {
        self.in_flight = self.in_flight.saturating_sub(1);
        if let Some(t) = self.tenants.get_mut(&tenant) {
            t.stats.in_flight = t.stats.in_flight.saturating_sub(1);
        }
        self.grant_next(now_ns)
    }

    /// Grants a free slot to the next waiter, if a slot is free and someone waits.
    pub fn grant_next(&mut self, now_ns: u64) -> Option<(u32, W)> {
        if self.in_flight >= self.slots_max {
            return None;
        }
        self.roll(now_ns);
        // Which waiting tenants may take the slot: if some may not (held to the reserve), the
        // slot goes to the one that may with the fewest slots for its weight, outside SFQ's
        // order (it is below its share), or stays free for a reserved tenant's next request.
        let (mut blocked, mut best) = (false, None::<(u64, u32)>);
        // No reserve: every waiting tenant may take the slot and SFQ picks (no scan).
        let tenants = if self.reserve_on() {
            Some(&self.tenants)
        } else {
            None
        };
        for (&id, t) in tenants.into_iter().flatten() {
            if t.queue.is_empty() {
                continue;
            }
            if self.may_take(id) {
                let load = (t.stats.in_flight as u64) * 1_000_000 / u64::from(t.weight.max(1));
                if best.is_none_or(|(l, _)| load < l) {
                    best = Some((load, id));
                }
            } else {
                blocked = true;
            }
        }
        // Waiters queued before a switch of discipline go first in the FIFO.
        let (tenant, waiter) = if let Some((tenant, w, _)) = self.fifo.pop_front() {
            (tenant, w)
        } else if blocked {
            let (_, id) = best?;
            let t = self.tenants.get_mut(&id).expect("found above");
            let (w, _) = t.queue.pop_front().expect("a waiting tenant");
            if t.queue.is_empty() {
                self.tree.leaf_idle(t.leaf);
            }
            (id, w)
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
        t.note_demand();
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
    fn a_light_tenant_finds_its_reserve_free() {
        const MS: u64 = 1_000_000;
        // 32 slots: at most 32 / RESERVE_DIV = 2 kept for others.
        let mut s = FairSlots::new(32, true);
        // B alone takes every slot (work-conserving) and queues ten more (ids 32..42).
        for i in 0..32 {
            assert_eq!(s.acquire(B, 100, i, 100, None, 0), Acquire::Granted);
        }
        for i in 32..42 {
            assert_eq!(s.acquire(B, 100, i, 100, None, 0), Acquire::Queued);
        }
        // A asks twice with every slot held: it waits, and the next two releases are its.
        assert_eq!(s.acquire(A, 100, 100, 100, None, MS), Acquire::Queued);
        assert_eq!(s.acquire(A, 100, 101, 100, None, MS), Acquire::Queued);
        assert_eq!(s.release(B, 20 * MS, 2 * MS), Some((A, 100)));
        assert_eq!(s.release(B, 20 * MS, 3 * MS), Some((A, 101)));
        // A's two requests end: B (above its share of 16) does not get those slots, which stay
        // free for A's recent peak of 2.
        assert_eq!(s.release(A, 21 * MS, 22 * MS), None);
        assert_eq!(s.release(A, 21 * MS, 23 * MS), None);
        assert_eq!(s.in_flight(), 30);
        // So A's next request is served at once though B has waiters; B's new one queues.
        assert_eq!(s.acquire(A, 100, 102, 100, None, 30 * MS), Acquire::Granted);
        assert_eq!(s.acquire(B, 100, 42, 100, None, 30 * MS), Acquire::Queued);
        // A slot B releases goes back to B, but not the one kept for A's second request.
        assert_eq!(s.release(B, 20 * MS, 31 * MS), Some((B, 32)));
        assert_eq!(s.release(B, 20 * MS, 32 * MS), Some((B, 33)));
        assert_eq!(s.in_flight(), 31);
        // A goes quiet. Two windows later its reserve is gone: B's releases refill every slot.
        assert_eq!(s.release(A, 21 * MS, 51 * MS), None);
        assert_eq!(s.in_flight(), 30);
        let later = 51 * MS + 2 * WINDOW_NS;
        assert_eq!(s.release(B, 20 * MS, later), Some((B, 34)));
        assert_eq!(s.grant_next(later), Some((B, 35)));
        assert_eq!(s.grant_next(later), Some((B, 36)));
        assert_eq!(s.in_flight(), 32);
        assert_eq!(s.grant_next(later), None);
    }

    #[test]
    fn the_reserve_is_bounded() {
        // 32 slots: at most two are kept for others, however many A asked for.
        let mut s = FairSlots::new(32, true);
        for i in 0..32 {
            assert_eq!(s.acquire(B, 100, i, 100, None, 0), Acquire::Granted);
        }
        assert_eq!(s.acquire(B, 100, 32, 100, None, 0), Acquire::Queued);
        for i in 0..4 {
            assert_eq!(s.acquire(A, 100, 100 + i, 100, None, 1), Acquire::Queued);
        }
        for i in 0..4 {
            assert_eq!(s.release(B, 10, 2 + i), Some((A, 100 + i)));
        }
        // A (peak 4) releases its four: the first two slots are kept for it; keeping a third
        // would pass the bound, so B's waiter gets it.
        assert_eq!(s.release(A, 10, 10), None);
        assert_eq!(s.release(A, 10, 11), None);
        assert_eq!(s.release(A, 10, 12), Some((B, 32)));
        assert_eq!(s.release(A, 10, 13), None);
        assert_eq!(s.in_flight(), 29);
    }

    #[test]
    fn no_reserve_on_a_small_upstream() {
        // Fewer than RESERVE_DIV slots: work-conserving as before, B may take every slot.
        let mut s = FairSlots::new(RESERVE_DIV - 1, true);
        assert_eq!(s.acquire(A, 100, 100, 100, None, 0), Acquire::Granted);
        assert_eq!(s.release(A, 10, 1), None);
        for i in 0..RESERVE_DIV as u64 - 1 {
            assert_eq!(s.acquire(B, 100, i, 100, None, 2), Acquire::Granted);
        }
    }

    #[test]
    fn an_unused_slot_is_no_sample() {
        let mut s = FairSlots::new(1, true);
        assert_eq!(s.acquire(A, 100, 0, 9, None, 0), Acquire::Granted);
        assert_eq!(s.acquire(B, 100, 1, 9, None, 0), Acquire::Queued);
        assert_eq!(s.acquire(B, 100, 2, 9, None, 0), Acquire::Queued);
        assert_eq!(s.release(A, 5_000_000, 5), Some((B, 1)));
        let before = s.tenants[&B].cost_ns;
        // B's waiter 1 had gone: its slot comes back unused and goes to waiter 2.
        assert_eq!(s.give_back_unused(B, 6), Some((B, 2)));
        assert_eq!(s.tenants[&B].cost_ns, before, "no 0 ns sample");
        assert_eq!(s.stats(B).in_flight, 1);
        assert_eq!(s.in_flight(), 1);
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
