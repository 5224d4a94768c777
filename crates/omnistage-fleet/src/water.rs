//! water: the fleet-wide water-fill of one resource (CPU or link bytes) over the nodes' published
//! demand, and the local weights that make one node follow it.
//!
//! The problem is the one the runtime solves across cores (docs/design.md, "Shares across
//! cores"), one level up: tenant `i` has weight `w_i` and can be served only on the nodes its
//! traffic reaches (placement); each node has a capacity. The fleet-wide allocation we want is
//! the weighted max-min fair one under placement: no tenant can get more without taking from a
//! tenant that has no more per unit of weight than it. A tenant present on few nodes gets its
//! fleet share there; one present everywhere yields where it can be served elsewhere.
//!
//! [`water_fill`] computes it the way the cores do, by progressive filling in small units: in
//! each round every node gives one unit (a thousandth of its capacity) to the tenant present
//! there whose fleet-wide allocation per unit of weight is lowest, as long as that tenant wants
//! more on that node. This is the runtime's shared-tag rule run to completion on published
//! numbers instead of live dispatches. Error: a tenant's allocation is within about one unit per
//! node of the exact max-min allocation (the order in which nodes give within a round), i.e.
//! 0.1 % of a node's capacity per node; the tests pin exact figures for small cases.
//!
//! [`local_weights`] turns one node's part of the fill into weights for its local scheduler:
//! proportional to what each tenant is given on this node, with a floor for a tenant that has
//! demand here but is given nothing (its requests still complete, slowly, and keep its demand
//! visible), and the configured share for tenants with no demand here (so one that arrives is
//! served at once, until the next sync recomputes).
//!
//! Pure: no clock, no I/O; all quantities are integers (units of the resource per second), so
//! tests give exact expectations.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Local weights of the tenants with demand on a node sum to about this.
pub const WEIGHT_SCALE: u32 = 10_000;
/// The weight of a tenant with demand on a node that the fill gives (almost) nothing there:
/// 1 % of [`WEIGHT_SCALE`].
pub const WEIGHT_FLOOR: u32 = WEIGHT_SCALE / 100;
/// Units a node's capacity is cut into for the progressive fill.
pub const STEPS_PER_NODE: u64 = 1000;
/// Scale of the normalized allocation (allocation × this / weight), as the runtime's shared tag.
const KEY_SCALE: u128 = 1024;

/// One tenant's demand for one resource on one node over the last interval, as published.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Demand {
    /// Had work waiting during the interval: it would use more if given more.
    pub backlogged: bool,
    /// What it would use here, units/s (for a backlogged tenant, any amount up to the node's
    /// capacity: the fill treats it as unbounded).
    pub want: u64,
    /// What it used here, units/s.
    pub used: u64,
}

impl Demand {
    /// The most the fill may give it on a node of `capacity`.
    fn ceiling(&self, capacity: u64) -> u64 {
        if self.backlogged {
            capacity
        } else {
            self.want.min(capacity)
        }
    }
}

/// One node's capacity for the resource and the demand of the tenants present there (tenant
/// indexes into the weights given to [`water_fill`]; each at most once).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeDemand {
    /// Units/s the node can give (CPU: ns/s of all its workers; link: its link cap).
    pub capacity: u64,
    pub tenants: Vec<(usize, Demand)>,
}

/// The fill: per node, what each tenant present there is given; per tenant, its fleet-wide
/// target and the use the nodes reported.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fill {
    /// Per node (in input order), `(tenant, units/s)` in the node's tenant order.
    pub alloc: Vec<Vec<(usize, u64)>>,
    /// Per tenant, the sum of its allocations (units/s).
    pub target: Vec<u64>,
    /// Per tenant, the sum of the use the nodes published (units/s).
    pub used: Vec<u64>,
}

impl Fill {
    /// Tenant `i`'s fleet-wide share target: its allocation over the fleet's capacity.
    pub fn share_target(&self, i: usize, capacity_total: u64) -> f64 {
        if capacity_total == 0 {
            return 0.0;
        }
        self.target.get(i).copied().unwrap_or(0) as f64 / capacity_total as f64
    }
}

fn key(total: u64, weight: u32) -> u128 {
    u128::from(total) * KEY_SCALE / u128::from(weight.max(1))
}

/// The weighted max-min fair allocation of every node's capacity to the tenants present there
/// (module doc). Entries naming a tenant index outside `weights` are ignored; a weight of 0
/// counts as 1. Deterministic: ties go to the lower tenant index, nodes give in input order.
pub fn water_fill(weights: &[u32], nodes: &[NodeDemand]) -> Fill {
    let tenants = weights.len();
    let mut total = vec![0u64; tenants];
    let mut used = vec![0u64; tenants];
    let mut alloc: Vec<Vec<(usize, u64)>> = Vec::with_capacity(nodes.len());
    // Per node, the ceiling of each of its slots (beside `alloc`'s), so a step reads it by slot.
    let mut ceilings: Vec<Vec<u64>> = Vec::with_capacity(nodes.len());
    // The last node (plus one) that named each tenant: a node's repeated entry is found in
    // O(1). (A scan of the node's slots per entry, and one per step to find the entry again,
    // were quadratic in a node's tenants: ~10^11 steps for the entries the parser allows,
    // enough to stall the fleet thread past its lease renewals.)
    let mut named_by = vec![0usize; tenants];
    let mut left: Vec<u64> = Vec::with_capacity(nodes.len());
    let mut unit: Vec<u64> = Vec::with_capacity(nodes.len());
    // Per node, its candidates keyed by normalized fleet-wide allocation: (key, tenant, slot).
    let mut heaps: Vec<BinaryHeap<Reverse<(u128, usize, usize)>>> = Vec::with_capacity(nodes.len());
    for (node, n) in nodes.iter().enumerate() {
        let mut a = Vec::with_capacity(n.tenants.len());
        let mut c = Vec::with_capacity(n.tenants.len());
        let mut h = BinaryHeap::with_capacity(n.tenants.len());
        for &(i, d) in &n.tenants {
            if i >= tenants || named_by[i] == node + 1 {
                continue;
            }
            named_by[i] = node + 1;
            used[i] = used[i].saturating_add(d.used);
            let ceiling = d.ceiling(n.capacity);
            if ceiling > 0 {
                h.push(Reverse((0, i, a.len())));
            }
            a.push((i, 0u64));
            c.push(ceiling);
        }
        alloc.push(a);
        ceilings.push(c);
        heaps.push(h);
        left.push(n.capacity);
        unit.push((n.capacity / STEPS_PER_NODE).max(1));
    }
    let mut active: Vec<usize> = (0..nodes.len()).filter(|&n| left[n] > 0).collect();
    while !active.is_empty() {
        active.retain(|&n| {
            let heap = &mut heaps[n];
            // Keys only grow (allocations only grow), so a popped entry whose key is stale is
            // put back with its current key; the true minimum is found when a popped key is
            // current.
            while let Some(Reverse((k, i, slot))) = heap.pop() {
                let now = key(total[i], weights[i]);
                if now > k {
                    heap.push(Reverse((now, i, slot)));
                    continue;
                }
                let ceiling = ceilings[n][slot];
                let a = &mut alloc[n][slot].1;
                let give = unit[n].min(left[n]).min(ceiling - *a);
                *a += give;
                total[i] += give;
                left[n] -= give;
                if *a < ceiling {
                    heap.push(Reverse((key(total[i], weights[i]), i, slot)));
                }
                return left[n] > 0 && !heap.is_empty();
            }
            false
        });
    }
    Fill {
        alloc,
        target: total,
        used,
    }
}

/// Whether a tenant counts as backlogged on a node's link over one sync interval: from the
/// send scheduler's picks of it in the interval (`picks`, of which `picks_waiting` left output
/// of it waiting), the majority; with no pick at all, whether output of it waits now
/// (`waiting_now`). A tenant held at [`WEIGHT_FLOOR`] on a slow link is picked less often than
/// once per interval (1 % of 10 MB/s in 16 KiB quanta: one pick per 160 ms); counting those
/// intervals as "no demand" left it out of the node's entry, so its weight jumped from the
/// floor to its configured share every other interval.
pub fn link_backlogged(picks: u64, picks_waiting: u64, waiting_now: bool) -> bool {
    if picks == 0 {
        waiting_now
    } else {
        2 * picks_waiting.min(picks) >= picks
    }
}

/// Weights for one node's local scheduler from its part of the fill (`alloc`, as in
/// [`Fill::alloc`] for this node): a tenant with demand here gets
/// `WEIGHT_SCALE × given / capacity`, at least [`WEIGHT_FLOOR`]; a tenant without demand here
/// its configured share of [`WEIGHT_SCALE`] (at least 1). With no capacity, every tenant gets
/// its configured share. One weight per entry of `weights`, each in `1..=WEIGHT_SCALE`.
///
/// `weights` are this node's tenants' only (the first entries of the fill's weights): the
/// configured shares are shares among the tenants this node schedules, and a tenant known only
/// from other nodes' entries would dilute them. Entries of `alloc` beyond `weights` are
/// ignored.
pub fn local_weights(weights: &[u32], capacity: u64, alloc: &[(usize, u64)]) -> Vec<u32> {
    let sum: u64 = weights
        .iter()
        .map(|&w| u64::from(w.max(1)))
        .sum::<u64>()
        .max(1);
    let mut out: Vec<u32> = weights
        .iter()
        .map(|&w| {
            ((u64::from(WEIGHT_SCALE) * u64::from(w.max(1)) + sum / 2) / sum)
                .clamp(1, u64::from(WEIGHT_SCALE)) as u32
        })
        .collect();
    if capacity == 0 {
        return out;
    }
    for &(i, given) in alloc {
        if let Some(w) = out.get_mut(i) {
            let scaled = (u128::from(WEIGHT_SCALE) * u128::from(given) + u128::from(capacity) / 2)
                / u128::from(capacity);
            *w = (scaled as u64).clamp(u64::from(WEIGHT_FLOOR), u64::from(WEIGHT_SCALE)) as u32;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_backlog_without_picks_is_whether_output_waits() {
        // No pick in the interval: output waiting (a tenant at the floor) is backlogged,
        // nothing waiting is not.
        assert!(link_backlogged(0, 0, true));
        assert!(!link_backlogged(0, 0, false));
        // With picks, the majority of them says, whatever waits at the sample.
        assert!(link_backlogged(4, 2, false));
        assert!(!link_backlogged(4, 1, true));
        assert!(link_backlogged(1, 1, false));
        // Counts from another core's race (more waiting picks than picks) are clamped.
        assert!(link_backlogged(1, 5, false));
        assert!(!link_backlogged(3, 0, true));
    }

    fn backlogged() -> Demand {
        Demand {
            backlogged: true,
            want: 0,
            used: 0,
        }
    }

    fn light(want: u64) -> Demand {
        Demand {
            backlogged: false,
            want,
            used: want,
        }
    }

    fn node(capacity: u64, tenants: &[(usize, Demand)]) -> NodeDemand {
        NodeDemand {
            capacity,
            tenants: tenants.to_vec(),
        }
    }

    #[test]
    fn one_node_splits_by_weight() {
        let f = water_fill(
            &[3, 1],
            &[node(1000, &[(0, backlogged()), (1, backlogged())])],
        );
        assert_eq!(f.alloc, vec![vec![(0, 750), (1, 250)]]);
        assert_eq!(f.target, vec![750, 250]);
    }

    #[test]
    fn the_issues_skewed_ingress_gives_a_node_1_and_b_the_others() {
        // a (weight 4) only on node 1, b (weight 1) on all three: a's whole demand is on node 1,
        // so it gets node 1; b gets nodes 2 and 3 (4:1 per node would give a 8 and b 22).
        let cap = 10_000_000;
        let nodes = [
            node(cap, &[(0, backlogged()), (1, backlogged())]),
            node(cap, &[(1, backlogged())]),
            node(cap, &[(1, backlogged())]),
        ];
        let f = water_fill(&[4, 1], &nodes);
        assert_eq!(f.alloc[0], vec![(0, cap), (1, 0)]);
        assert_eq!(f.alloc[1], vec![(1, cap)]);
        assert_eq!(f.target, vec![cap, 2 * cap]);
        assert_eq!(f.share_target(0, 3 * cap), 1.0 / 3.0);
        // Node 1 then runs a at the full scale and b at the floor (1 %): a's part of node 1 is
        // 10000 / 10100 = 0.990.
        assert_eq!(
            local_weights(&[4, 1], cap, &f.alloc[0]),
            vec![WEIGHT_SCALE, WEIGHT_FLOOR]
        );
        // Node 2: b everything, a (no demand there) its configured share 4/5.
        assert_eq!(local_weights(&[4, 1], cap, &f.alloc[1]), vec![8000, 10_000]);
    }

    #[test]
    fn a_tenant_everywhere_yields_where_the_other_is_confined() {
        // a on nodes 1 and 2, b only on node 1, equal weights: b gets node 1, a node 2 (max-min:
        // 1000 each); the order of giving within a round leaves a one unit ahead.
        let nodes = [
            node(1000, &[(0, backlogged()), (1, backlogged())]),
            node(1000, &[(0, backlogged())]),
        ];
        let f = water_fill(&[1, 1], &nodes);
        assert_eq!(f.alloc[0], vec![(0, 1), (1, 999)]);
        assert_eq!(f.alloc[1], vec![(0, 1000)]);
        assert_eq!(f.target, vec![1001, 999]);
    }

    #[test]
    fn three_tenants_on_two_nodes_meet_at_two_thirds() {
        // a on both, b on node 1, c on node 2: max-min gives each 2000/3 (a a third of each node).
        let nodes = [
            node(3000, &[(0, backlogged()), (1, backlogged())]),
            node(3000, &[(0, backlogged()), (2, backlogged())]),
        ];
        let f = water_fill(&[1, 1, 1], &nodes);
        for (i, &t) in f.target.iter().enumerate() {
            assert!((t as i64 - 2000).abs() <= 3, "tenant {i}: {t}");
        }
        assert_eq!(f.target.iter().sum::<u64>(), 6000);
    }

    #[test]
    fn a_light_tenant_keeps_what_it_wants_and_the_rest_goes_to_the_backlogged() {
        let nodes = [node(1000, &[(0, light(100)), (1, backlogged())])];
        let f = water_fill(&[1, 1], &nodes);
        assert_eq!(f.alloc[0], vec![(0, 100), (1, 900)]);
        // The light tenant's weight follows what it is given (1000), the other's 9000.
        assert_eq!(local_weights(&[1, 1], 1000, &f.alloc[0]), vec![1000, 9000]);
    }

    #[test]
    fn nobody_backlogged_leaves_capacity_unallocated() {
        let f = water_fill(&[1, 1], &[node(1000, &[(0, light(100)), (1, light(50))])]);
        assert_eq!(f.alloc[0], vec![(0, 100), (1, 50)]);
        assert_eq!(f.target, vec![100, 50]);
        assert_eq!(f.used, vec![100, 50]);
    }

    #[test]
    fn a_dead_node_frees_its_share_for_the_others() {
        // With node 3 gone, b is only on node 2 and a's and b's targets follow.
        let cap = 1000;
        let with = [
            node(cap, &[(0, backlogged()), (1, backlogged())]),
            node(cap, &[(1, backlogged())]),
            node(cap, &[(1, backlogged())]),
        ];
        let without = &with[..2];
        assert_eq!(water_fill(&[4, 1], &with).target, vec![cap, 2 * cap]);
        assert_eq!(water_fill(&[4, 1], without).target, vec![cap, cap]);
    }

    #[test]
    fn weights_decide_when_both_are_everywhere() {
        let nodes = [
            node(1000, &[(0, backlogged()), (1, backlogged())]),
            node(1000, &[(0, backlogged()), (1, backlogged())]),
        ];
        let f = water_fill(&[4, 1], &nodes);
        assert_eq!(f.target, vec![1600, 400]);
        assert_eq!(f.alloc[0], vec![(0, 800), (1, 200)]);
    }

    #[test]
    fn bad_indexes_duplicates_and_empty_inputs_are_harmless() {
        assert_eq!(water_fill(&[], &[]), Fill::default());
        let f = water_fill(
            &[1],
            &[node(
                100,
                &[(5, backlogged()), (0, light(10)), (0, backlogged())],
            )],
        );
        assert_eq!(f.alloc[0], vec![(0, 10)]);
        // A tenant repeated on one node and named again on the next: once on each.
        let f = water_fill(
            &[1],
            &[
                node(100, &[(0, light(10)), (0, backlogged())]),
                node(100, &[(0, light(20)), (0, backlogged())]),
            ],
        );
        assert_eq!(f.alloc, vec![vec![(0, 10)], vec![(0, 20)]]);
        let f = water_fill(&[0, 1], &[node(0, &[(0, backlogged())])]);
        assert_eq!(f.target, vec![0, 0]);
        // A weight of 0 counts as 1.
        let f = water_fill(
            &[0, 1],
            &[node(100, &[(0, backlogged()), (1, backlogged())])],
        );
        assert_eq!(f.target, vec![50, 50]);
    }

    #[test]
    fn a_node_smaller_than_its_steps_still_fills() {
        let f = water_fill(&[1, 1], &[node(7, &[(0, backlogged()), (1, backlogged())])]);
        assert_eq!(f.target, vec![4, 3]);
    }

    #[test]
    fn huge_capacities_do_not_overflow() {
        let cap = u64::MAX / 4;
        let f = water_fill(
            &[10_000, 1],
            &[node(cap, &[(0, backlogged()), (1, backlogged())])],
        );
        assert_eq!(f.target.iter().sum::<u64>(), cap);
        // b's first unit (a thousandth: the fill's granularity) is all it gets.
        assert_eq!(f.alloc[0][1].1, cap / STEPS_PER_NODE);
        let w = local_weights(&[1, 1], cap, &f.alloc[0]);
        assert_eq!(w, vec![9990, WEIGHT_FLOOR]);
    }

    #[test]
    fn local_weights_without_capacity_are_the_configured_shares() {
        assert_eq!(
            local_weights(&[50, 33, 17], 0, &[(0, 10)]),
            vec![5000, 3300, 1700]
        );
        // Rounded, never 0.
        assert_eq!(local_weights(&[1, 100_000], 0, &[]), vec![1, 10_000]);
    }

    #[test]
    fn local_weights_share_among_the_local_tenants_only() {
        // Tenants 0..3 are this node's (4 : 1 : 1), tenant 3 is known only from node 1, where
        // it is backlogged with the largest weight; nobody has demand here.
        let weights = [4, 1, 1, WEIGHT_SCALE];
        let fill = water_fill(
            &weights,
            &[node(1000, &[]), node(1000, &[(3, backlogged())])],
        );
        assert_eq!(fill.target, vec![0, 0, 0, 1000]);
        assert_eq!(
            local_weights(&weights[..3], 1000, &fill.alloc[0]),
            vec![6667, 1667, 1667]
        );
        // With demand here, the given tenants follow the fill; the others keep their share.
        let fill = water_fill(
            &weights,
            &[
                node(1000, &[(1, backlogged())]),
                node(1000, &[(3, backlogged())]),
            ],
        );
        assert_eq!(
            local_weights(&weights[..3], 1000, &fill.alloc[0]),
            vec![6667, WEIGHT_SCALE, 1667]
        );
    }

    #[test]
    fn fill_conserves_capacity_and_respects_ceilings() {
        // A small exhaustive sweep: every tenant set on three nodes, demands light or
        // backlogged; capacity is never exceeded, is used up whenever someone is backlogged on
        // a node, and no tenant is given more than it wants.
        let demands = [None, Some(light(0)), Some(light(300)), Some(backlogged())];
        let weights = [1, 2, 7];
        for code in 0..(demands.len().pow(6)) {
            let mut c = code;
            let mut nodes = Vec::new();
            for n in 0..2 {
                let mut ts = Vec::new();
                for t in 0..3 {
                    if let Some(d) = demands[c % demands.len()] {
                        ts.push((t, d));
                    }
                    c /= demands.len();
                }
                nodes.push(node(1000 + 500 * n as u64, &ts));
            }
            let f = water_fill(&weights, &nodes);
            for (n, a) in f.alloc.iter().enumerate() {
                let given: u64 = a.iter().map(|&(_, g)| g).sum();
                assert!(given <= nodes[n].capacity);
                let any_backlogged = nodes[n].tenants.iter().any(|(_, d)| d.backlogged);
                if any_backlogged {
                    assert_eq!(given, nodes[n].capacity, "code {code} node {n}");
                }
                for (&(i, g), &(j, d)) in a.iter().zip(&nodes[n].tenants) {
                    assert_eq!(i, j);
                    assert!(g <= d.ceiling(nodes[n].capacity));
                }
            }
        }
    }
}
