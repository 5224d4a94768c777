//! The scheduling tree (Vortex's event scheduling tree, QLinux's H-SFQ hierarchy).
//!
//! Interior nodes run a policy over their children; leaves stand for queues that the caller
//! owns (the tree only knows whether a leaf has work). The caller says when a leaf gets work
//! ([`Tree::leaf_ready`]), asks for the next leaf ([`Tree::pick`]), runs it, and charges what
//! it cost ([`Tree::charge`]); the charge goes to every node on the path, and readiness is
//! propagated up and down so that an interior node is ready in its parent exactly when it has
//! a ready child and is not held back by its shaper.
//!
//! The tree changes while work flows: nodes are added, re-weighted, re-policied, shaped,
//! moved and removed between decisions (QLinux's hsfq_mknod, hsfq_admin, hsfq_move).

use super::fq::FqClient;
use super::interior::Interior;
use super::policy::{AnyPolicy, ClientId, ClientParams, PolicyKind, Scheduler};
use super::shaper::{Shaper, ShaperLost, ShaperSpec};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Index of a node in a [`Tree`].
pub type NodeId = u32;

/// Default minimum charge per dispatch, in cost units (ns for CPU): a dispatch that did
/// nothing still advances its tags, so a yield loop cannot hold a node's attention.
pub const MIN_COST_DEFAULT: u64 = 200;

/// Largest number of nodes in one tree (a limit on memory and on ids).
pub const NODES_MAX: usize = 1 << 22;

/// Largest wake credit, cost units (1 s of CPU in ns): the credit is a burst allowance, and a
/// larger one would let a waking client hold a node for longer than any latency goal; the
/// bound also keeps `credit * VT_SCALE` far from overflow.
pub const WAKE_CREDIT_MAX: u64 = 1_000_000_000;

/// Trees with at least this many nodes warm the next pick's path after each charge
/// ([`Tree::warm_next_pick`]) and hint a parent's next child when one is made ready
/// ([`hint_next_child`]). Smaller trees stay in the caches, where that work is only cost
/// (measured: 5–8 ns more per event at 10 to 3,000 leaves, about 12 ns less at 10,000).
const WARM_NODES_MIN: usize = 4096;

/// Levels [`Tree::warm_next_pick`] follows (deeper trees are warmed down to this level).
const DEPTH_WARM_MAX: usize = 8;

/// Errors from tree changes. A refused change leaves the tree as it was.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TreeError {
    NoSuchNode(NodeId),
    NotInterior(NodeId),
    NotEmpty(NodeId),
    IsRoot,
    Cycle,
    InvalidWeight(u32),
    InvalidShaper(String),
    TooManyNodes,
}

impl std::fmt::Display for TreeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TreeError::NoSuchNode(n) => write!(f, "no node {n}"),
            TreeError::NotInterior(n) => write!(f, "node {n} is a leaf, not an interior node"),
            TreeError::NotEmpty(n) => write!(f, "node {n} has children or queued work"),
            TreeError::IsRoot => write!(f, "the root cannot be removed, moved or shaped"),
            TreeError::Cycle => write!(f, "the move would make a node its own ancestor"),
            TreeError::InvalidWeight(w) => write!(
                f,
                "weight {w} is outside {}..={}",
                super::WEIGHT_MIN,
                super::WEIGHT_MAX
            ),
            TreeError::InvalidShaper(s) => write!(f, "{s}"),
            TreeError::TooManyNodes => write!(f, "the tree is full ({NODES_MAX} nodes)"),
        }
    }
}

impl std::error::Error for TreeError {}

/// Cumulative statistics of one node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeStats {
    /// Cost charged to this node (after the minimum-cost rule), all dispatches under it.
    pub charged: u64,
    /// Dispatches under this node.
    pub dispatches: u64,
    /// Times its shaper held it back.
    pub throttles: u64,
}

/// Interior state is boxed so that leaves (most nodes) stay small: a node is ~80 bytes
/// instead of ~270, which keeps 10,000 leaves in far fewer cache lines.
#[derive(Debug)]
enum Kind {
    Interior(Box<Interior>),
    Leaf {
        backlogged: bool,
    },
    /// A removed node's place, on the free list. (Not an `Option<Node>`: the walks match on
    /// the kind anyway, and that one check then also says the node is live, where the
    /// option's cost a second compare and branch at every level: measured, 1,078 → 1,063
    /// instructions per event at 10,000 leaves.)
    Free,
}

/// One cache line per node: at 10,000 leaves a decision's cost is its cache misses.
#[derive(Debug)]
#[repr(align(64))]
struct Node {
    parent: Option<NodeId>,
    slot: ClientId,
    kind: Kind,
    shaper: Option<Box<Shaper>>,
    /// The parent's policy holds this node as ready (queued or in service).
    ready_in_parent: bool,
    /// Held back by its shaper; in the tree's throttled heap.
    throttled: bool,
    /// An interior node none of whose children is interior: the look-ahead stops at its next
    /// child without reading that child's node ([`Tree::warm_next_pick`]), which would be a
    /// demand miss where a prefetch is enough. Kept here, not only in [`Interior`], because
    /// the walk has this line already (the count's line in the boxed state was a miss: 0.55
    /// L1 misses per event at 10,000 leaves in callgrind's cache simulation).
    leaves_only: bool,
    stats: NodeStats,
}

impl Node {
    /// A free place in the node vector.
    fn free() -> Node {
        Node {
            parent: None,
            slot: 0,
            kind: Kind::Free,
            shaper: None,
            ready_in_parent: false,
            throttled: false,
            leaves_only: true,
            stats: NodeStats::default(),
        }
    }
    fn is_live(&self) -> bool {
        !matches!(self.kind, Kind::Free)
    }
    fn has_work(&self) -> bool {
        match &self.kind {
            Kind::Interior(i) => i.policy.ready_count() > 0,
            Kind::Leaf { backlogged } => *backlogged,
            Kind::Free => false,
        }
    }
}

/// A scheduling tree. See the module docs.
#[derive(Debug)]
pub struct Tree {
    /// Every node by id; removed ones are [`Kind::Free`] until reused.
    nodes: Vec<Node>,
    /// Each node's parameters (weight, priority, shared tag), kept apart from the nodes: they
    /// are read on changes, never per decision, and the hot node stays within a cache line.
    params: Vec<ClientParams>,
    /// Each node's state as a client of its parent's fair queue (unused under the other
    /// policies), by node id: a line of its own beside the node's, both found from the
    /// parent's heap entry at once (see [`Interior`]'s calls).
    fq: Vec<FqClient>,
    free: Vec<NodeId>,
    root: NodeId,
    /// Shaped nodes waiting for their bucket: (eligible time, node).
    throttled: BinaryHeap<Reverse<(u64, NodeId)>>,
    min_cost: u64,
    /// Every fair-queue node's wake credit, cost units ([`Tree::set_wake_credit`]).
    wake_credit: u64,
    /// The leaf taken by `pick` and not yet charged.
    in_service: Option<NodeId>,
}

impl Tree {
    /// A tree whose root runs `root_policy`.
    pub fn new(root_policy: PolicyKind) -> Self {
        let root = Node {
            parent: None,
            slot: 0,
            kind: Kind::Interior(Box::new(Interior {
                policy: {
                    let mut policy = AnyPolicy::new(root_policy);
                    policy.forget_client_stats();
                    policy
                },
                children: Vec::new(),
                free_slots: Vec::new(),
                child_count: 0,
                interior_children: 0,
            })),
            shaper: None,
            ready_in_parent: false,
            throttled: false,
            leaves_only: true,
            stats: NodeStats::default(),
        };
        Tree {
            nodes: vec![root],
            params: vec![ClientParams::default()],
            fq: vec![FqClient::default()],
            free: Vec::new(),
            root: 0,
            throttled: BinaryHeap::new(),
            min_cost: MIN_COST_DEFAULT,
            wake_credit: 0,
            in_service: None,
        }
    }

    pub fn root(&self) -> NodeId {
        self.root
    }

    /// Sets the minimum charge per dispatch (cost units).
    pub fn set_min_cost(&mut self, min_cost: u64) {
        self.min_cost = min_cost;
    }

    pub fn min_cost(&self) -> u64 {
        self.min_cost
    }

    /// Sets the wake credit of every fair-queue node, now and later (cost units): a client
    /// that wakes may take that much service ahead of the clients that stayed busy
    /// ([`super::FairQueue::set_wake_credit`]). 0, the default, banks nothing. Bounded by
    /// [`WAKE_CREDIT_MAX`] (a larger value is clamped).
    pub fn set_wake_credit(&mut self, credit: u64) {
        let credit = credit.min(WAKE_CREDIT_MAX);
        self.wake_credit = credit;
        for n in self.nodes.iter_mut() {
            if let Kind::Interior(i) = &mut n.kind {
                i.policy.set_wake_credit(credit);
            }
        }
        // The fair queues' client lines are the tree's.
        for c in self.fq.iter_mut().filter(|c| c.is_registered()) {
            c.set_wake_credit(credit);
        }
    }

    pub fn wake_credit(&self) -> u64 {
        self.wake_credit
    }

    /// A new policy for node `id`, with the tree's wake credit.
    fn new_policy(&self, kind: PolicyKind, id: NodeId) -> AnyPolicy {
        let mut policy = AnyPolicy::new(kind);
        policy.set_wake_credit(self.wake_credit);
        // The nodes keep the statistics ([`NodeStats`]).
        policy.forget_client_stats();
        if let AnyPolicy::Fq(f) = &mut policy {
            f.core().set_owner(id);
        }
        policy
    }

    fn node(&self, id: NodeId) -> Result<&Node, TreeError> {
        self.nodes
            .get(id as usize)
            .filter(|n| n.is_live())
            .ok_or(TreeError::NoSuchNode(id))
    }

    fn n(&mut self, id: NodeId) -> &mut Node {
        let n = &mut self.nodes[id as usize];
        assert!(n.is_live(), "node {id} is not live");
        n
    }

    /// An interior node's state, and the client lines its fair queue (if any) works on.
    fn interior(&mut self, id: NodeId) -> (&mut Interior, &mut [FqClient]) {
        let n = &mut self.nodes[id as usize];
        match &mut n.kind {
            Kind::Interior(i) => (i, &mut self.fq),
            Kind::Leaf { .. } | Kind::Free => unreachable!("node {id} is not interior"),
        }
    }

    /// Live nodes (the root included): what the tree holds now, not its high-water mark.
    pub fn len(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    /// Never: the root is always there.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether `id` names a live node.
    pub fn contains(&self, id: NodeId) -> bool {
        self.node(id).is_ok()
    }

    pub fn parent(&self, id: NodeId) -> Option<NodeId> {
        self.node(id).ok().and_then(|n| n.parent)
    }

    pub fn stats(&self, id: NodeId) -> Result<NodeStats, TreeError> {
        Ok(self.node(id)?.stats)
    }

    /// What a node's shaper has discarded of its rate's earnings (zero without a shaper; kept
    /// in the shaper, not in [`NodeStats`], so a node stays within one cache line).
    pub fn shaper_lost(&self, id: NodeId) -> Result<ShaperLost, TreeError> {
        Ok(self
            .node(id)?
            .shaper
            .as_ref()
            .map(|s| s.lost())
            .unwrap_or_default())
    }

    /// The least any shaper on the path from `leaf` to the root holds at `now_ns`, in whole
    /// units (None when no node on the path is shaped): what a caller that knows its cost in
    /// advance may spend on the leaf just picked without putting a bucket into debt.
    pub fn shaped_room(&mut self, leaf: NodeId, now_ns: u64) -> Option<u64> {
        let mut room: Option<u64> = None;
        let mut id = Some(leaf);
        // Bounded by the tree's depth: each step goes to a parent.
        while let Some(n) = id.and_then(|i| self.nodes.get_mut(i as usize)) {
            if let Some(shaper) = &mut n.shaper {
                let a = shaper.available(now_ns);
                room = Some(room.map_or(a, |r| r.min(a)));
            }
            id = n.parent;
        }
        room
    }

    pub fn params(&self, id: NodeId) -> Result<&ClientParams, TreeError> {
        self.node(id)?;
        Ok(&self.params[id as usize])
    }

    pub fn policy_kind(&self, id: NodeId) -> Result<PolicyKind, TreeError> {
        match &self.node(id)?.kind {
            Kind::Interior(i) => Ok(i.policy.kind()),
            Kind::Leaf { .. } | Kind::Free => Err(TreeError::NotInterior(id)),
        }
    }

    /// Whether the node has work in it (a backlogged leaf, or a ready child).
    pub fn has_work(&self, id: NodeId) -> bool {
        self.node(id).map(|n| n.has_work()).unwrap_or(false)
    }

    /// Whether any leaf can be picked now (not counting shaped nodes that are waiting).
    pub fn is_ready(&self) -> bool {
        self.nodes[self.root as usize].has_work()
    }

    fn validate_params(params: &ClientParams) -> Result<(), TreeError> {
        if !(super::WEIGHT_MIN..=super::WEIGHT_MAX).contains(&params.weight) {
            return Err(TreeError::InvalidWeight(params.weight));
        }
        Ok(())
    }

    fn insert(
        &mut self,
        parent: NodeId,
        params: ClientParams,
        kind: Kind,
    ) -> Result<NodeId, TreeError> {
        Self::validate_params(&params)?;
        match &self.node(parent)?.kind {
            Kind::Interior(_) => {}
            Kind::Leaf { .. } | Kind::Free => return Err(TreeError::NotInterior(parent)),
        }
        if self.free.is_empty() && self.nodes.len() >= NODES_MAX {
            return Err(TreeError::TooManyNodes);
        }
        let node = Node {
            parent: Some(parent),
            slot: 0,
            kind,
            shaper: None,
            ready_in_parent: false,
            throttled: false,
            leaves_only: true,
            stats: NodeStats::default(),
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                self.params[id as usize] = params;
                // Its client line is not registered: reset when it was detached from a fair
                // queue (keeping what tells its old heap entries stale), or never registered.
                debug_assert!(!self.fq[id as usize].is_registered());
                id
            }
            None => {
                self.nodes.push(node);
                self.params.push(params);
                self.fq.push(FqClient::default());
                (self.nodes.len() - 1) as NodeId
            }
        };
        if let Kind::Interior(i) = &mut self.nodes[id as usize].kind {
            if let AnyPolicy::Fq(f) = &mut i.policy {
                f.core().set_owner(id);
            }
        }
        self.attach(id, parent);
        Ok(id)
    }

    /// Registers `id` as a client of `parent` (not ready yet).
    fn attach(&mut self, id: NodeId, parent: NodeId) {
        let params = self.params[id as usize].clone();
        let is_interior = matches!(self.nodes[id as usize].kind, Kind::Interior(_));
        let (i, fq) = self.interior(parent);
        let slot = i.add_child(fq, id, is_interior, &params);
        let leaves_only = i.interior_children == 0;
        self.nodes[parent as usize].leaves_only = leaves_only;
        let n = self.n(id);
        n.parent = Some(parent);
        n.slot = slot;
        n.ready_in_parent = false;
    }

    /// Unregisters `id` from its parent; propagates the parent's loss of work upward.
    fn detach(&mut self, id: NodeId) {
        let (parent, slot, was_ready) = {
            let n = self.n(id);
            let r = (n.parent.expect("not root"), n.slot, n.ready_in_parent);
            n.ready_in_parent = false;
            r
        };
        let is_interior = matches!(self.nodes[id as usize].kind, Kind::Interior(_));
        let (i, fq) = self.interior(parent);
        i.remove_child(fq, id, is_interior, slot);
        let leaves_only = i.interior_children == 0;
        self.nodes[parent as usize].leaves_only = leaves_only;
        if was_ready {
            self.propagate_idle(parent);
        }
    }

    /// `id` may have lost its last ready child: withdraw it from its ancestors as needed.
    fn propagate_idle(&mut self, mut id: NodeId) {
        loop {
            let n = self.n(id);
            if n.has_work() || !n.ready_in_parent {
                return;
            }
            n.ready_in_parent = false;
            if let Some(shaper) = &mut n.shaper {
                shaper.idle();
            }
            let (parent, slot) = (n.parent.expect("ready_in_parent implies parent"), n.slot);
            let (i, fq) = self.interior(parent);
            i.child_suspended(fq, id, slot);
            id = parent;
        }
    }

    /// `id` has work: make it ready in its ancestors, unless a shaper holds it back.
    #[inline(always)]
    fn propagate_ready(&mut self, mut id: NodeId, now_ns: u64) {
        let hint = self.nodes.len() >= WARM_NODES_MIN;
        let Tree {
            nodes,
            fq,
            throttled,
            ..
        } = self;
        // Only addresses for cache hints, never dereferenced (the vectors do not change
        // size in this loop, and a stale hint would be harmless anyway).
        let base = (nodes.as_ptr(), fq.as_ptr());
        // One lookup per level: the parent looked up to make the child ready is the next
        // level's node.
        let mut n = &mut nodes[id as usize];
        loop {
            let Some(parent) = n.parent else { return };
            if n.ready_in_parent || n.throttled || !n.has_work() {
                return;
            }
            if let Some(shaper) = &mut n.shaper {
                let at = shaper.eligible_at(now_ns);
                if at > now_ns {
                    n.throttled = true;
                    n.stats.throttles += 1;
                    throttled.push(Reverse((at, id)));
                    return;
                }
            }
            n.ready_in_parent = true;
            let slot = n.slot;
            let p = &mut nodes[parent as usize];
            match &mut p.kind {
                Kind::Interior(i) => {
                    i.child_ready(fq, id, slot);
                    if hint {
                        hint_next_child(i, base);
                    }
                }
                Kind::Leaf { .. } | Kind::Free => unreachable!("a parent is an interior node"),
            }
            id = parent;
            n = p;
        }
    }

    /// Adds an interior node under `parent`, running `policy` over its own children.
    pub fn add_interior(
        &mut self,
        parent: NodeId,
        params: ClientParams,
        policy: PolicyKind,
    ) -> Result<NodeId, TreeError> {
        self.insert(
            parent,
            params,
            Kind::Interior(Box::new(Interior {
                // `insert` makes the node the owner of its fair queue, once it has an id.
                policy: self.new_policy(policy, 0),
                children: Vec::new(),
                free_slots: Vec::new(),
                child_count: 0,
                interior_children: 0,
            })),
        )
    }

    /// Adds a leaf (a queue the caller owns) under `parent`.
    pub fn add_leaf(&mut self, parent: NodeId, params: ClientParams) -> Result<NodeId, TreeError> {
        self.insert(parent, params, Kind::Leaf { backlogged: false })
    }

    /// Removes a node that has no children and no queued work.
    pub fn remove(&mut self, id: NodeId) -> Result<(), TreeError> {
        let n = self.node(id)?;
        if n.parent.is_none() {
            return Err(TreeError::IsRoot);
        }
        let empty = match &n.kind {
            Kind::Interior(i) => i.child_count == 0,
            Kind::Leaf { backlogged } => !backlogged,
            Kind::Free => unreachable!("node() returns live nodes"),
        };
        if !empty || self.in_service == Some(id) {
            return Err(TreeError::NotEmpty(id));
        }
        self.detach(id);
        if self.n(id).throttled {
            // Its heap entry is skipped when it comes due (the node is gone or reused: the
            // release checks `throttled`, which a new node starts false).
            self.n(id).throttled = false;
        }
        self.nodes[id as usize] = Node::free();
        self.free.push(id);
        Ok(())
    }

    /// Changes weight or priority (and the shared tag) of a node; takes effect at the next
    /// decision of its parent.
    pub fn set_params(&mut self, id: NodeId, params: ClientParams) -> Result<(), TreeError> {
        Self::validate_params(&params)?;
        let n = self.node(id)?;
        let Some(parent) = n.parent else {
            return Err(TreeError::IsRoot);
        };
        let slot = n.slot;
        self.params[id as usize] = params.clone();
        let (i, fq) = self.interior(parent);
        i.update_child(fq, id, slot, &params);
        Ok(())
    }

    /// Replaces the policy of an interior node, keeping its children and their readiness.
    pub fn set_policy(&mut self, id: NodeId, kind: PolicyKind) -> Result<(), TreeError> {
        if self.in_service.is_some() {
            // The new policy would not know the client in service; change between decisions.
            return Err(TreeError::NotEmpty(id));
        }
        let children: Vec<(ClientId, NodeId)> = match &self.node(id)?.kind {
            Kind::Interior(i) => i
                .children
                .iter()
                .enumerate()
                .filter_map(|(s, c)| c.map(|c| (s as ClientId, c)))
                .collect(),
            Kind::Leaf { .. } | Kind::Free => return Err(TreeError::NotInterior(id)),
        };
        let ready: Vec<bool> = children
            .iter()
            .map(|&(_, child)| self.nodes[child as usize].ready_in_parent)
            .collect();
        let policy = self.new_policy(kind, id);
        let Tree {
            nodes, params, fq, ..
        } = self;
        let Kind::Interior(i) = &mut nodes[id as usize].kind else {
            unreachable!("checked above")
        };
        // Out of the old policy (a fair queue's client lines are the tree's, and would
        // otherwise stay registered with it), into the new one in the same slots.
        for &(slot, child) in &children {
            i.unregister(fq, child, slot);
        }
        i.policy = policy;
        for (&(slot, child), &ready) in children.iter().zip(&ready) {
            i.register(fq, child, slot, &params[child as usize]);
            if ready {
                i.child_ready(fq, child, slot);
            }
        }
        Ok(())
    }

    /// Puts a shaper on a node (or takes it off with `None`).
    pub fn set_shaper(
        &mut self,
        id: NodeId,
        spec: Option<ShaperSpec>,
        now_ns: u64,
    ) -> Result<(), TreeError> {
        if let Some(spec) = &spec {
            spec.validate().map_err(TreeError::InvalidShaper)?;
        }
        if self.node(id)?.parent.is_none() {
            return Err(TreeError::IsRoot);
        }
        let n = self.n(id);
        match (spec, &mut n.shaper) {
            (Some(spec), Some(s)) => {
                s.set_spec(spec, now_ns);
                if n.throttled {
                    // The release time was computed at the old rate: recompute it now.
                    let at = s.eligible_at(now_ns);
                    if at <= now_ns {
                        n.throttled = false;
                        self.propagate_ready(id, now_ns);
                    } else {
                        self.throttled.push(Reverse((at, id)));
                    }
                }
            }
            (Some(spec), None) => n.shaper = Some(Box::new(Shaper::new(spec, now_ns))),
            (None, _) => {
                n.shaper = None;
                if n.throttled {
                    n.throttled = false;
                    self.propagate_ready(id, now_ns);
                }
            }
        }
        Ok(())
    }

    /// Moves a node (and its sub-tree) under another interior node. Its queued work moves
    /// with it; what it was charged stays in the old ancestors' statistics.
    pub fn move_node(
        &mut self,
        id: NodeId,
        new_parent: NodeId,
        now_ns: u64,
    ) -> Result<(), TreeError> {
        if self.node(id)?.parent.is_none() {
            return Err(TreeError::IsRoot);
        }
        match &self.node(new_parent)?.kind {
            Kind::Interior(_) => {}
            Kind::Leaf { .. } | Kind::Free => return Err(TreeError::NotInterior(new_parent)),
        }
        let mut a = Some(new_parent);
        while let Some(x) = a {
            if x == id {
                return Err(TreeError::Cycle);
            }
            a = self.node(x)?.parent;
        }
        if self.in_service.is_some() {
            // Moves happen between decisions; a pick must be charged first.
            return Err(TreeError::NotEmpty(id));
        }
        self.detach(id);
        self.attach(id, new_parent);
        if !self.n(id).throttled {
            self.propagate_ready(id, now_ns);
        }
        Ok(())
    }

    /// A leaf's queue went from empty to non-empty.
    pub fn leaf_ready(&mut self, leaf: NodeId, now_ns: u64) {
        // The match below also says the node is live.
        let n = &mut self.nodes[leaf as usize];
        match &mut n.kind {
            Kind::Leaf { backlogged } => {
                if *backlogged {
                    return;
                }
                *backlogged = true;
            }
            Kind::Interior(_) => panic!("leaf_ready on interior node {leaf}"),
            Kind::Free => panic!("leaf_ready on removed node {leaf}"),
        }
        if self.in_service == Some(leaf) {
            // Its readiness is settled by the charge that ends its service.
            return;
        }
        self.propagate_ready(leaf, now_ns);
    }

    /// A leaf's queue was emptied other than by a dispatch (messages withdrawn or moved).
    pub fn leaf_idle(&mut self, leaf: NodeId) {
        let in_service = self.in_service == Some(leaf);
        // The match below also says the node is live.
        let n = &mut self.nodes[leaf as usize];
        match &mut n.kind {
            Kind::Leaf { backlogged } => *backlogged = false,
            Kind::Interior(_) => panic!("leaf_idle on interior node {leaf}"),
            Kind::Free => panic!("leaf_idle on removed node {leaf}"),
        }
        if in_service {
            return;
        }
        if let Some(shaper) = &mut n.shaper {
            shaper.idle();
        }
        if n.ready_in_parent {
            n.ready_in_parent = false;
            let (parent, slot) = (n.parent.expect("leaf has parent"), n.slot);
            let (i, fq) = self.interior(parent);
            i.child_suspended(fq, leaf, slot);
            self.propagate_idle(parent);
        }
    }

    /// Releases shaped nodes whose buckets have refilled by `now_ns`.
    fn release_throttled(&mut self, now_ns: u64) {
        while let Some(&Reverse((at, id))) = self.throttled.peek() {
            if at > now_ns {
                return;
            }
            self.throttled.pop();
            let Some(n) = self.nodes.get_mut(id as usize) else {
                continue;
            };
            if !n.throttled {
                continue;
            }
            n.throttled = false;
            self.propagate_ready(id, now_ns);
        }
    }

    /// Takes the next leaf into service (Table III `schedule`, applied down the tree).
    /// Exactly one [`Tree::charge`] must follow before the next `pick`.
    pub fn pick(&mut self, now_ns: u64) -> Option<NodeId> {
        assert!(
            self.in_service.is_none(),
            "pick before the last pick was charged"
        );
        self.release_throttled(now_ns);
        let Tree { nodes, fq, .. } = self;
        let mut id = self.root;
        // Depth is bounded by the node count; each step goes one level down.
        loop {
            // One lookup of the node per level: its policy names the next node.
            match &mut nodes[id as usize].kind {
                Kind::Interior(i) => {
                    let child = i.schedule(fq)?;
                    debug_assert_eq!(
                        nodes[child as usize].parent,
                        Some(id),
                        "node {id}'s policy named another's child"
                    );
                    id = child;
                }
                Kind::Leaf { .. } => {
                    self.in_service = Some(id);
                    return Some(id);
                }
                Kind::Free => unreachable!("removed node {id} on the path of a pick"),
            }
        }
    }

    /// Charges the leaf taken by the last `pick`: `cost` units, and whether its queue still has
    /// work. Every node on the path is charged `max(cost, min_cost)`.
    pub fn charge(&mut self, leaf: NodeId, cost: u64, still_backlogged: bool, now_ns: u64) {
        assert_eq!(
            self.in_service,
            Some(leaf),
            "charge for a leaf that was not picked"
        );
        self.in_service = None;
        let cost = cost.max(self.min_cost);
        let Tree {
            nodes,
            fq,
            throttled,
            ..
        } = self;
        // One lookup per level: the parent looked up to record the charge is the next
        // level's node.
        let mut id = leaf;
        let mut n = &mut nodes[id as usize];
        match &mut n.kind {
            Kind::Leaf { backlogged } => *backlogged = still_backlogged,
            Kind::Interior(_) | Kind::Free => unreachable!("the leaf in service is a live leaf"),
        }
        // Whether `n` has work: the leaf's caller says; an interior node's policy, read right
        // after its child's record below (where its kind is already matched).
        let mut has_work = still_backlogged;
        loop {
            n.stats.charged += cost;
            n.stats.dispatches += 1;
            let Some(parent) = n.parent else { break };
            debug_assert_eq!(has_work, n.has_work());
            let mut still = has_work;
            if let Some(shaper) = &mut n.shaper {
                shaper.charge(cost, now_ns);
                if !still {
                    shaper.idle();
                } else {
                    let at = shaper.eligible_at(now_ns);
                    if at > now_ns {
                        still = false;
                        n.throttled = true;
                        n.stats.throttles += 1;
                        throttled.push(Reverse((at, id)));
                    }
                }
            }
            n.ready_in_parent = still;
            let slot = n.slot;
            let p = &mut nodes[parent as usize];
            match &mut p.kind {
                Kind::Interior(i) => {
                    i.record(fq, id, slot, cost, still);
                    has_work = i.ready_count() > 0;
                }
                Kind::Leaf { .. } | Kind::Free => unreachable!("a parent is an interior node"),
            }
            id = parent;
            n = p;
        }
        if self.nodes.len() >= WARM_NODES_MIN {
            self.warm_next_pick();
        }
    }

    /// Walks the path the next `pick` will take if nothing changes before it, loading each
    /// interior node on it and hinting the cache with the chosen child's node and client
    /// line, the first levels of each non-root node's heap, and the leaf.
    ///
    /// Why: at 10,000 leaves a decision is a chain of dependent loads (root's heap → group
    /// node → its policy → its heap's top → the leaf), each a miss, and nothing can overlap
    /// them inside `pick`. Walked here, at the end of a charge, the loads overlap with what the
    /// caller does before its next `pick` (in `exp sched-cost`, the leaf's refill and its
    /// sift). Only a hint: a tree that changes in between still picks correctly, from a
    /// colder cache. Bounded by `DEPTH_WARM_MAX` levels.
    fn warm_next_pick(&self) {
        let mut id = self.root;
        for _ in 0..DEPTH_WARM_MAX {
            let Some(n) = self.nodes.get(id as usize) else {
                return;
            };
            let Kind::Interior(i) = &n.kind else { return };
            if id != self.root {
                // The next event serves this node's top, and its refill or its next charge
                // sifts this heap from the top: start loading its first two levels (the
                // root's heap, touched every event, stays in the cache anyway).
                i.policy.hint_heap();
            }
            let Some(child) = i.next_child_hint() else {
                return;
            };
            id = child;
            // The heap entry names the child: its node and its client line load together.
            super::prefetch(self.nodes.as_ptr().wrapping_add(id as usize));
            super::prefetch(self.fq.as_ptr().wrapping_add(id as usize));
            if n.leaves_only {
                // A leaf: nothing below it to warm.
                return;
            }
        }
    }

    /// Nanoseconds until a decision is possible (Table III `poll_ready`): `Some(0)` if a leaf
    /// can be picked now, `Some(d)` if a shaped node becomes eligible in `d`, `None` if idle.
    pub fn next_decision_ns(&self, now_ns: u64) -> Option<u64> {
        if self.is_ready() {
            return Some(0);
        }
        // A stale entry (node since released or removed) only makes the caller look early.
        self.throttled
            .peek()
            .map(|Reverse((at, _))| at.saturating_sub(now_ns))
    }

    /// Children of an interior node.
    pub fn children(&self, id: NodeId) -> Result<Vec<NodeId>, TreeError> {
        match &self.node(id)?.kind {
            Kind::Interior(i) => Ok(i.children.iter().flatten().copied().collect()),
            Kind::Leaf { .. } | Kind::Free => Err(TreeError::NotInterior(id)),
        }
    }
}

/// Hints the cache with the child that `i`'s policy will take next (its node and its client
/// line, in the vectors at `base`), long before that decision: in trees of thousands of
/// leaves a group is served again only after its siblings, and its next leaf's lines are
/// otherwise cold by then.
#[inline]
fn hint_next_child(i: &Interior, base: (*const Node, *const FqClient)) {
    if let Some(child) = i.next_child_hint() {
        super::prefetch(base.0.wrapping_add(child as usize));
        super::prefetch(base.1.wrapping_add(child as usize));
    }
}

#[cfg(test)]
#[path = "tree_tests.rs"]
mod tests;
