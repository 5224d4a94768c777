//! An interior node of the scheduling tree: its policy, its children by slot, and the calls
//! through which the tree drives the policy. A fair queue's clients are the child nodes
//! themselves (their client lines are the tree's, one per node, passed in to every call);
//! the other policies' clients are the children's slots. Kept apart from `tree.rs` so that
//! file holds the walks and the changes.

use super::fq::FqClient;
use super::policy::{AnyPolicy, ClientId, ClientParams, Scheduler};
use super::tree::NodeId;

/// An interior node's state (boxed in its node: see `tree.rs`).
#[derive(Debug)]
pub(super) struct Interior {
    pub(super) policy: AnyPolicy,
    /// Child node per client slot; `None` for a free slot.
    pub(super) children: Vec<Option<NodeId>>,
    pub(super) free_slots: Vec<ClientId>,
    pub(super) child_count: usize,
    /// How many of the children are interior nodes (mirrored in the node's `leaves_only`).
    pub(super) interior_children: usize,
}

/// The tree's calls into a node's policy. A fair queue's clients are the child nodes
/// themselves: its calls take the child's node id and the tree's client lines
/// (the tree's `fq`, by node id), so that a decision reaches the child's node and its client
/// line from the heap entry at once. The other policies' clients are the children's slots.
impl Interior {
    /// Registers `child` (not ready) in a free slot; returns the slot.
    pub(super) fn add_child(
        &mut self,
        fq: &mut [FqClient],
        child: NodeId,
        child_is_interior: bool,
        params: &ClientParams,
    ) -> ClientId {
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.children[s as usize] = Some(child);
                s
            }
            None => {
                self.children.push(Some(child));
                (self.children.len() - 1) as ClientId
            }
        };
        self.child_count += 1;
        self.interior_children += usize::from(child_is_interior);
        self.register(fq, child, slot, params);
        slot
    }

    /// Registers `child` with the policy in `slot` (which the children map already gives it).
    pub(super) fn register(
        &mut self,
        fq: &mut [FqClient],
        child: NodeId,
        slot: ClientId,
        params: &ClientParams,
    ) {
        match &mut self.policy {
            AnyPolicy::Fq(f) => f.core().add_client(fq, child, params),
            p => p.add_client(slot, params),
        }
    }

    /// Unregisters `child` from the policy (the children map still gives it `slot`).
    pub(super) fn unregister(&mut self, fq: &mut [FqClient], child: NodeId, slot: ClientId) {
        match &mut self.policy {
            AnyPolicy::Fq(f) => f.core().remove_client(fq, child),
            p => p.remove_client(slot),
        }
    }

    pub(super) fn remove_child(
        &mut self,
        fq: &mut [FqClient],
        child: NodeId,
        child_is_interior: bool,
        slot: ClientId,
    ) {
        self.unregister(fq, child, slot);
        debug_assert_eq!(self.children[slot as usize], Some(child));
        self.children[slot as usize] = None;
        self.free_slots.push(slot);
        self.child_count -= 1;
        self.interior_children -= usize::from(child_is_interior);
    }

    pub(super) fn update_child(
        &mut self,
        fq: &mut [FqClient],
        child: NodeId,
        slot: ClientId,
        params: &ClientParams,
    ) {
        match &mut self.policy {
            AnyPolicy::Fq(f) => f.core().update_client(fq, child, params),
            p => p.update_client(slot, params),
        }
    }

    #[inline(always)]
    pub(super) fn child_ready(&mut self, fq: &mut [FqClient], child: NodeId, slot: ClientId) {
        match &mut self.policy {
            AnyPolicy::Fq(f) => f.core().client_ready(fq, child),
            p => p.client_ready_cold(slot),
        }
    }

    pub(super) fn child_suspended(&mut self, fq: &mut [FqClient], child: NodeId, slot: ClientId) {
        match &mut self.policy {
            AnyPolicy::Fq(f) => f.core().client_suspended(fq, child),
            p => p.client_suspended(slot),
        }
    }

    /// The child the policy takes into service.
    #[inline(always)]
    pub(super) fn schedule(&mut self, fq: &mut [FqClient]) -> Option<NodeId> {
        match &mut self.policy {
            AnyPolicy::Fq(f) => f.core().schedule(fq),
            p => {
                let slot = p.schedule_cold()?;
                Some(self.children[slot as usize].expect("policy scheduled a free slot"))
            }
        }
    }

    #[inline(always)]
    pub(super) fn record(
        &mut self,
        fq: &mut [FqClient],
        child: NodeId,
        slot: ClientId,
        cost: u64,
        still_ready: bool,
    ) {
        match &mut self.policy {
            AnyPolicy::Fq(f) => f.core().resource_record(fq, child, cost, still_ready),
            p => p.resource_record_cold(slot, cost, still_ready),
        }
    }

    #[inline(always)]
    pub(super) fn ready_count(&self) -> usize {
        self.policy.ready_count()
    }

    /// The child a fair queue will probably take next (the top of its heap, which may be
    /// stale): a cache hint, read without touching any client line. `None` for the other
    /// policies.
    #[inline]
    pub(super) fn next_child_hint(&self) -> Option<NodeId> {
        match &self.policy {
            AnyPolicy::Fq(f) => f.core_ref().next_hint(),
            _ => None,
        }
    }
}
