//! The tree's unit tests (kept apart from `tree.rs` so that file holds the tree itself).

mod layout {
    #[test]
    fn a_node_fits_a_cache_line() {
        assert!(std::mem::size_of::<super::super::Node>() <= 64);
    }
}

mod removed {
    use super::super::*;

    /// A removed node's place answers as no node to every call that names it, until a new
    /// node takes it; its old parent no longer lists it, and the new node starts clean.
    #[test]
    fn a_removed_node_is_gone_until_its_place_is_reused() {
        let mut t = Tree::new(PolicyKind::Sfq);
        let root = t.root();
        let group = t
            .add_interior(root, ClientParams::default(), PolicyKind::Sfq)
            .unwrap();
        let leaf = t.add_leaf(group, ClientParams::default()).unwrap();
        t.leaf_ready(leaf, 0);
        assert_eq!(t.pick(0), Some(leaf));
        t.charge(leaf, 1_000, false, 1);
        t.remove(leaf).unwrap();
        assert!(!t.contains(leaf));
        assert!(!t.has_work(leaf));
        assert_eq!(t.parent(leaf), None);
        assert_eq!(t.stats(leaf), Err(TreeError::NoSuchNode(leaf)));
        assert_eq!(t.remove(leaf), Err(TreeError::NoSuchNode(leaf)));
        assert_eq!(
            t.set_params(leaf, ClientParams::default()),
            Err(TreeError::NoSuchNode(leaf))
        );
        assert_eq!(
            t.add_leaf(leaf, ClientParams::default()),
            Err(TreeError::NoSuchNode(leaf))
        );
        assert_eq!(t.children(group), Ok(vec![]));
        assert!(!t.is_ready());
        assert_eq!(t.pick(2), None);
        let again = t.add_leaf(group, ClientParams::default()).unwrap();
        assert_eq!(again, leaf, "the free place is reused");
        assert_eq!(t.stats(again), Ok(NodeStats::default()));
        t.leaf_ready(again, 3);
        assert_eq!(t.pick(3), Some(again));
    }

    /// A fair queue's client lines are the tree's, one per node, so a node that moves leaves
    /// its old entry behind in the old group's heap with a sequence number the new group may
    /// give it too (each queue counts its own). Here it does: X's stale entry in A has
    /// sequence 1, the first B gives out. A must still skip it (the line names B as its
    /// owner) and serve Z; served as A's child, X would be charged to B, which is not
    /// serving it.
    #[test]
    fn a_moved_nodes_old_entry_is_stale_even_when_its_sequence_matches() {
        let mut t = Tree::new(PolicyKind::Sfq);
        let root = t.root();
        let a = t
            .add_interior(root, ClientParams::default(), PolicyKind::Sfq)
            .unwrap();
        let b = t
            .add_interior(root, ClientParams::default(), PolicyKind::Sfq)
            .unwrap();
        let x = t.add_leaf(a, ClientParams::default()).unwrap();
        let z = t.add_leaf(a, ClientParams::default()).unwrap();
        t.leaf_ready(x, 0);
        t.leaf_ready(z, 0);
        t.move_node(x, b, 0).unwrap();
        let mut served = Vec::new();
        for now in 1..=6 {
            let leaf = t.pick(now).expect("both groups have work");
            served.push(leaf);
            t.charge(leaf, 1_000, true, now);
        }
        // Equal weights alternate the groups: A's only child is Z, B's is X.
        assert_eq!(served.iter().filter(|&&l| l == z).count(), 3, "{served:?}");
        assert_eq!(served.iter().filter(|&&l| l == x).count(), 3, "{served:?}");
        assert_eq!(t.stats(a).unwrap().dispatches, 3);
        assert_eq!(t.stats(b).unwrap().dispatches, 3);
    }

    #[test]
    #[should_panic(expected = "leaf_ready on removed node")]
    fn readying_a_removed_leaf_is_a_bug() {
        let mut t = Tree::new(PolicyKind::Sfq);
        let root = t.root();
        let leaf = t.add_leaf(root, ClientParams::default()).unwrap();
        t.remove(leaf).unwrap();
        t.leaf_ready(leaf, 0);
    }
}

mod warm {
    use super::super::*;

    /// Root SFQ over 30 groups (SFQ, WFQ and FIFO) of 100 leaves of varied weights, and
    /// optionally one more SFQ group of `idle` leaves that never get work, added last so every
    /// other node keeps its id.
    fn build(idle: usize) -> (Tree, Vec<NodeId>) {
        let mut t = Tree::new(PolicyKind::Sfq);
        let root = t.root();
        let mut leaves = Vec::new();
        for g in 0..30u32 {
            let policy = [PolicyKind::Sfq, PolicyKind::Wfq, PolicyKind::Fifo][g as usize % 3];
            let group = t
                .add_interior(root, ClientParams::weight(1 + g * 7 % 50), policy)
                .unwrap();
            for l in 0..100u32 {
                let leaf = t
                    .add_leaf(group, ClientParams::weight(1 + l * 13 % 100))
                    .unwrap();
                t.leaf_ready(leaf, 0);
                leaves.push(leaf);
            }
        }
        if idle > 0 {
            let group = t
                .add_interior(root, ClientParams::default(), PolicyKind::Sfq)
                .unwrap();
            for _ in 0..idle {
                t.add_leaf(group, ClientParams::default()).unwrap();
            }
        }
        (t, leaves)
    }

    /// One step of both trees: the next xorshift value in `x`, the same pick from both
    /// (asserted), `now` advanced and the same charge. Returns the leaf served and whether it
    /// is still backlogged.
    fn serve_both(
        small: &mut Tree,
        big: &mut Tree,
        x: &mut u64,
        now: &mut u64,
        step: u64,
    ) -> (NodeId, bool) {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        let (a, b) = (small.pick(*now), big.pick(*now));
        assert_eq!(a, b, "step {step}");
        let leaf = a.expect("some leaf is always backlogged");
        *now += 1_000;
        let still = !x.is_multiple_of(4);
        small.charge(leaf, 200 + *x % 900, still, *now);
        big.charge(leaf, 200 + *x % 900, still, *now);
        (leaf, still)
    }

    /// The look-ahead only reads (it takes `&self`) and only hints the cache: a tree big
    /// enough to warm its next pick picks exactly what the same tree below the threshold
    /// picks, while leaves empty, refill and are charged varied costs.
    #[test]
    fn warming_changes_no_decision() {
        let (mut small, leaves) = build(0);
        let (mut big, _) = build(2_000);
        assert!(small.nodes.len() < WARM_NODES_MIN && big.nodes.len() >= WARM_NODES_MIN);
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut now = 0;
        for step in 0..30_000u64 {
            let (leaf, still) = serve_both(&mut small, &mut big, &mut x, &mut now, step);
            if !still && !x.is_multiple_of(3) {
                // Refill now, or refill another leaf that had emptied.
                let other = leaves[(x >> 8) as usize % leaves.len()];
                for t in [&mut small, &mut big] {
                    t.leaf_ready(leaf, now);
                    t.leaf_ready(other, now);
                }
            }
        }
    }

    /// The same while the tree changes under the look-ahead: leaves moved between groups,
    /// groups re-policied, idle leaves removed and their places reused. A fair queue's heap
    /// names child nodes, whose client lines the tree keeps, and every one of those changes
    /// must leave them registered with the right queue: in a debug build `pick` checks that
    /// the child a policy names is its own (`Node::parent`).
    #[test]
    fn warming_changes_no_decision_while_the_tree_changes() {
        let (mut small, mut leaves) = build(0);
        let (mut big, _) = build(2_000);
        let groups: Vec<NodeId> = small.children(small.root()).unwrap();
        let policies = [PolicyKind::Sfq, PolicyKind::Wfq, PolicyKind::Fifo];
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut now = 0;
        let (mut moved, mut repolicied, mut replaced) = (0, 0, 0);
        for step in 0..30_000u64 {
            let (leaf, still) = serve_both(&mut small, &mut big, &mut x, &mut now, step);
            let pick_of = |y: u64, v: &[NodeId]| v[(y >> 11) as usize % v.len()];
            // Bits apart from the ones `still` reads, so every change meets every case.
            match (x >> 33) % 16 {
                0 => {
                    let (l, g) = (pick_of(x, &leaves), pick_of(x >> 7, &groups));
                    for t in [&mut small, &mut big] {
                        t.move_node(l, g, now).unwrap();
                    }
                    moved += 1;
                }
                1 => {
                    let g = pick_of(x, &groups);
                    let p = policies[(x >> 20) as usize % 3];
                    for t in [&mut small, &mut big] {
                        t.set_policy(g, p).unwrap();
                    }
                    repolicied += 1;
                }
                2 if !still => {
                    // The leaf just emptied: remove it and put a new one in its place.
                    let g = small.parent(leaf).unwrap();
                    let w = ClientParams::weight(1 + (x >> 30) as u32 % 100);
                    let (s_new, b_new) = {
                        small.remove(leaf).unwrap();
                        big.remove(leaf).unwrap();
                        (
                            small.add_leaf(g, w.clone()).unwrap(),
                            big.add_leaf(g, w).unwrap(),
                        )
                    };
                    assert_eq!(s_new, b_new, "both trees reuse the same place");
                    small.leaf_ready(s_new, now);
                    big.leaf_ready(b_new, now);
                    let at = leaves.iter().position(|&l| l == leaf).unwrap();
                    leaves[at] = s_new;
                    replaced += 1;
                }
                _ if !still && !x.is_multiple_of(3) => {
                    let other = pick_of(x, &leaves);
                    for t in [&mut small, &mut big] {
                        t.leaf_ready(leaf, now);
                        t.leaf_ready(other, now);
                    }
                }
                _ => {}
            }
        }
        assert!(
            moved > 100 && repolicied > 100 && replaced > 100,
            "moved {moved}, re-policied {repolicied}, replaced {replaced}"
        );
    }
}

mod shaped_room {
    use super::super::*;
    use crate::sched::ClientParams;

    #[test]
    fn the_least_room_on_the_path() {
        let mut t = Tree::new(PolicyKind::Sfq);
        t.set_min_cost(1);
        let root = t.root();
        let link = t
            .add_interior(root, ClientParams::default(), PolicyKind::Sfq)
            .unwrap();
        let tenant = t
            .add_interior(link, ClientParams::default(), PolicyKind::Sfq)
            .unwrap();
        let leaf = t.add_leaf(tenant, ClientParams::default()).unwrap();
        assert_eq!(t.shaped_room(leaf, 0), None, "nothing shaped");
        // Link: a token bucket of 10,000 units; tenant: a leaky bucket of 1,000,000 units/s in
        // grains of 100 (within the 5,000 it may bank while backlogged).
        t.set_shaper(link, Some(ShaperSpec::token(1_000_000, 10_000)), 0)
            .unwrap();
        t.set_shaper(
            tenant,
            Some(ShaperSpec::leaky(1_000_000).with_grain(100)),
            0,
        )
        .unwrap();
        t.leaf_ready(leaf, 0);
        assert_eq!(
            t.pick(0),
            None,
            "the leaky bucket waits for its first grain"
        );
        let at = 100_000; // 100 units at 1,000,000/s
        assert_eq!(t.pick(at), Some(leaf));
        assert_eq!(
            t.shaped_room(leaf, at),
            Some(100),
            "the tenant's grain, not the link's 10,000"
        );
        t.charge(leaf, 100, true, at);
        assert_eq!(t.shaped_room(leaf, at), Some(0));
    }
}
