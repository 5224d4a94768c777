//! A reference kernel for `omnistage exp sched-cost`: the least work one event of a two-level
//! H-SFQ (root → groups → leaves, every leaf always backlogged) needs over this crate's heap,
//! with none of the tree around it.
//!
//! Why it exists: the runtime's goal is SFQ at ≤ 100 ns per event at 10,000 leaves, and what
//! the tree costs above that has been cut over several sessions without meeting it. This
//! kernel splits the figure in two, measured in the same run: its own cost is what the
//! algorithm costs on the machine (two heap tops read, two tags charged with a division each,
//! two sifts, the leaf's state touched), and the tree's cost above it is the price of the
//! tree's generality (any policy at any node, readiness kept and propagated, per-node
//! statistics, shapers, lazy deletion, the look-ahead).
//!
//! It makes exactly the tree's decisions for that workload (a unit test runs both side by
//! side), so the comparison is of the same schedule. It is not a scheduler: it has no
//! readiness, no changes, no statistics, and it serves its leaves forever.

use super::heap::{Entry, TagHeap};
use super::VT_SCALE;

/// A client's start tag with its weight and the remainder carried between charges: the same
/// arithmetic as a fair-queue client's (`FairQueue::resource_record`). 16 bytes.
#[derive(Clone, Copy, Debug)]
struct Weighted {
    tag: u64,
    weight: u32,
    remainder: u32,
}

impl Weighted {
    fn new(weight: u32) -> Self {
        assert!((super::WEIGHT_MIN..=super::WEIGHT_MAX).contains(&weight));
        Weighted {
            tag: 0,
            weight,
            remainder: 0,
        }
    }

    /// Adds `cost * VT_SCALE / weight` to the tag, carrying the remainder (exact, as the
    /// fair queue's tags are).
    #[inline(always)]
    fn charge(&mut self, cost: u64) {
        let scaled = cost
            .saturating_mul(VT_SCALE)
            .saturating_add(u64::from(self.remainder));
        let weight = u64::from(self.weight);
        self.tag = self.tag.saturating_add(scaled / weight);
        self.remainder = (scaled % weight) as u32;
    }
}

#[derive(Debug)]
struct Group {
    /// Its leaves, keyed by start tag; an entry's id is the leaf's index in `SfqFloor::leaves`.
    heap: TagHeap,
    seq: u32,
    /// Start tag of the leaf last taken into service (the group's virtual time).
    vtime: u64,
    state: Weighted,
}

/// See the module docs.
#[derive(Debug)]
pub struct SfqFloor {
    /// The groups that have leaves, keyed by start tag; an entry's id is the group's index.
    root: TagHeap,
    seq: u32,
    /// Start tag of the group last taken into service.
    vtime: u64,
    groups: Vec<Group>,
    leaves: Vec<Weighted>,
    /// The tree's minimum charge ([`super::MIN_COST_DEFAULT`] unless set).
    min_cost: u64,
}

impl Default for SfqFloor {
    fn default() -> Self {
        SfqFloor {
            root: TagHeap::default(),
            seq: 0,
            vtime: 0,
            groups: Vec::new(),
            leaves: Vec::new(),
            min_cost: super::MIN_COST_DEFAULT,
        }
    }
}

impl SfqFloor {
    /// Adds a group of `weight` under the root; returns its index.
    pub fn add_group(&mut self, weight: u32) -> usize {
        let mut state = Weighted::new(weight);
        state.tag = self.vtime;
        self.groups.push(Group {
            heap: TagHeap::default(),
            seq: 0,
            vtime: 0,
            state,
        });
        self.groups.len() - 1
    }

    /// Adds a leaf of `weight` under `group`, backlogged from now on; returns its index.
    pub fn add_leaf(&mut self, group: usize, weight: u32) -> usize {
        let leaf = self.leaves.len();
        let g = &mut self.groups[group];
        let mut state = Weighted::new(weight);
        state.tag = g.vtime;
        self.leaves.push(state);
        g.seq = g.seq.wrapping_add(1);
        g.heap.push(Entry::new(state.tag, g.seq, index_u32(leaf)));
        if g.heap.len() == 1 {
            // The group's first leaf makes it ready in the root, at the root's virtual time
            // at the earliest (no banking), as the tree's readiness propagation does.
            g.state.tag = g.state.tag.max(self.vtime);
            self.seq = self.seq.wrapping_add(1);
            self.root
                .push(Entry::new(g.state.tag, self.seq, index_u32(group)));
        }
        leaf
    }

    /// One event: serves the leaf with the smallest start tag in the group with the smallest
    /// start tag, charges both `cost` (at least the minimum charge), and queues both again by
    /// their new tags. Returns the leaf served (`None` without leaves).
    #[inline(never)]
    pub fn event(&mut self, cost: u64) -> Option<usize> {
        let cost = cost.max(self.min_cost);
        let top = *self.root.peek()?;
        let group = &mut self.groups[top.id() as usize];
        let leaf_entry = *group.heap.peek().expect("a queued group has leaves");
        let leaf_index = leaf_entry.id() as usize;
        let leaf = &mut self.leaves[leaf_index];
        self.vtime = self.vtime.max(top.key());
        group.vtime = group.vtime.max(leaf_entry.key());
        // The leaf: charged, and queued again no earlier than the group's virtual time (what
        // a leaf that empties and refills gets in the tree; a no-op when it stays busy).
        leaf.charge(cost);
        leaf.tag = leaf.tag.max(group.vtime);
        group.seq = group.seq.wrapping_add(1);
        group
            .heap
            .replace_top(Entry::new(leaf.tag, group.seq, leaf_entry.id()));
        // The group: charged, and still ready (its leaves are always backlogged).
        group.state.charge(cost);
        self.seq = self.seq.wrapping_add(1);
        self.root
            .replace_top(Entry::new(group.state.tag, self.seq, top.id()));
        Some(leaf_index)
    }
}

/// A leaf or group index as a heap entry's id (bounded by the tree's node limit).
fn index_u32(i: usize) -> u32 {
    assert!(
        i < super::tree::NODES_MAX,
        "the floor has room for the tree's node limit"
    );
    i as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::{ClientParams, NodeId, PolicyKind, Tree};

    /// `exp sched-cost`'s tree (root → `ceil(sqrt(leaves))` groups → leaves, SFQ everywhere,
    /// the same weights) and the floor built alike; the leaves' node ids in the tree.
    fn both(leaves: usize) -> (Tree, SfqFloor, Vec<NodeId>) {
        let groups = (leaves as f64).sqrt().ceil() as usize;
        let mut tree = Tree::new(PolicyKind::Sfq);
        let mut floor = SfqFloor::default();
        let root = tree.root();
        let gs: Vec<_> = (0..groups)
            .map(|g| {
                let w = 1 + (g as u32 * 37) % 100;
                assert_eq!(floor.add_group(w), g);
                tree.add_interior(root, ClientParams::weight(w), PolicyKind::Sfq)
                    .unwrap()
            })
            .collect();
        let mut ids = Vec::new();
        for l in 0..leaves {
            let w = 1 + (l as u32 * 13) % 100;
            let leaf = tree
                .add_leaf(gs[l % groups], ClientParams::weight(w))
                .unwrap();
            tree.leaf_ready(leaf, 0);
            assert_eq!(floor.add_leaf(l % groups, w), l);
            ids.push(leaf);
        }
        (tree, floor, ids)
    }

    /// The floor serves exactly the leaves the tree serves, event by event, while leaves
    /// empty and refill at once (the benchmark's loop) under varied costs, some below the
    /// minimum charge: the two figures of `exp sched-cost` are of the same schedule.
    #[test]
    fn the_floor_makes_the_trees_decisions() {
        for leaves in [1, 2, 10, 100, 1_000] {
            let (mut tree, mut floor, ids) = both(leaves);
            let mut now = 0;
            for i in 0..20_000u64 {
                let leaf = tree.pick(now).expect("all leaves are backlogged");
                let cost = 50 + (i * 7_919) % 1_300;
                now += 1_000;
                tree.charge(leaf, cost, false, now);
                tree.leaf_ready(leaf, now);
                let served = floor.event(cost).expect("the floor has leaves");
                assert_eq!(ids[served], leaf, "{leaves} leaves, event {i}");
            }
        }
    }

    #[test]
    fn an_empty_floor_serves_nothing() {
        assert_eq!(SfqFloor::default().event(100), None);
        let mut f = SfqFloor::default();
        f.add_group(1);
        assert_eq!(f.event(100), None, "a group without leaves is not queued");
    }
}
