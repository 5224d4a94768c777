//! The per-core activity and queue bookkeeping of a worker: what it knows of each activity
//! ([`ActivityInfo`], [`LocalActivity`]), the activity's node in this core's tree (created on
//! first use with its ancestors), its (stage, activity) queues and their leaves, the gate
//! cache, and the changes the control messages bring (upsert, remove).
//!
//! A removed activity is retired here once its queued work has drained: its leaves and
//! queues, its node (once no child's node is left under it), its entry, its explicit-record
//! cells and its ledger cells (folded into the core's retired aggregate, see
//! `Ledger::retire`) all go. Messages sent to it before its removal are still handled:
//! retirement waits for the first loop turn that empties the mailbox after the removal, and
//! then for its last queued message here. What reaches it later (a timer that comes due, a
//! message from a core that had not yet heard of the removal) finds no queue and is dropped
//! and counted, as a send to an unknown activity is.

use super::*;

/// What a worker knows of one activity.
#[derive(Clone, Debug)]
pub(crate) struct ActivityInfo {
    pub(crate) id: ActivityId,
    pub(crate) parent: Option<ActivityId>,
    pub(crate) spec: ActivitySpec,
    pub(crate) tag: Arc<SharedTag>,
}

impl ActivityInfo {
    pub(crate) fn of(t: &ActivityTable, id: ActivityId) -> Self {
        let a = t.get(id).expect("activity just changed");
        ActivityInfo {
            id,
            parent: a.parent,
            spec: a.spec.clone(),
            tag: a.tag.clone(),
        }
    }
}

/// What this core keeps of one activity.
pub(super) struct LocalActivity {
    pub(super) info: ActivityInfo,
    pub(super) node: Option<NodeId>,
    pub(super) removed: bool,
    /// (stage, leaf) of each queue this activity has on this core.
    queues: Vec<(StageId, NodeId)>,
    /// Removed, its queues retired, its node waiting for the nodes of its children (removed
    /// too, and still draining) to go.
    drained: bool,
}

impl LocalActivity {
    pub(super) fn new(info: ActivityInfo, node: Option<NodeId>) -> Self {
        LocalActivity {
            info,
            node,
            removed: false,
            queues: Vec::new(),
            drained: false,
        }
    }
}

/// A retired queue: its leaf, and the leaf of the queue that took its index (the stage's
/// queues are kept dense by moving the last one into the hole).
pub(super) struct RetiredQueue {
    leaf: NodeId,
    moved: Option<(NodeId, u32)>,
}

/// Typed operations on one stage's queues, behind fn pointers so the per-core bookkeeping
/// reaches them without the stage's handler.
#[derive(Clone, Copy)]
pub(crate) struct QueueOps {
    /// Takes out the queue of an activity (which must be empty).
    retire: fn(&mut dyn Any, ActivityId) -> Option<RetiredQueue>,
    /// Messages in the queue of an activity (0 if it has none).
    len: fn(&dyn Any, ActivityId) -> usize,
}

impl QueueOps {
    pub(super) fn of<M: 'static>() -> Self {
        QueueOps {
            retire: retire_queue::<M>,
            len: queue_len::<M>,
        }
    }
}

fn retire_queue<M: 'static>(qs: &mut dyn Any, activity: ActivityId) -> Option<RetiredQueue> {
    let qs = qs
        .downcast_mut::<Queues<M>>()
        .expect("message type matches the stage's");
    let q = qs.by_activity.remove(&activity)?;
    let lq = qs.qs.swap_remove(q as usize);
    assert!(
        lq.items.is_empty(),
        "retired the queue of activity {activity} with {} messages in it",
        lq.items.len()
    );
    let moved = qs.qs.get(q as usize).map(|m| {
        qs.by_activity.insert(m.activity, q);
        (m.leaf, q)
    });
    Some(RetiredQueue {
        leaf: lq.leaf,
        moved,
    })
}

fn queue_len<M: 'static>(qs: &dyn Any, activity: ActivityId) -> usize {
    let qs = qs
        .downcast_ref::<Queues<M>>()
        .expect("message type matches the stage's");
    qs.by_activity
        .get(&activity)
        .map_or(0, |&q| qs.qs[q as usize].items.len())
}

impl CoreState {
    /// Applies an activity change to this core's tree.
    pub(super) fn upsert(&mut self, info: ActivityInfo) {
        let id = info.id;
        let node = self.activities.get(&id).and_then(|a| a.node);
        if let Some(node) = node {
            let old = self.activities[&id].info.clone();
            let params = ClientParams {
                weight: info.spec.weight,
                priority: info.spec.priority,
                shared: Some(info.tag.clone()),
            };
            if id == ROOT {
                let _ = self.tree.set_policy(node, info.spec.policy);
            } else {
                if old.parent != info.parent {
                    if let Some(p) = info
                        .parent
                        .and_then(|p| self.ensure_node(None, p, 0, false))
                    {
                        // Refused only if a pick is in service, which cannot be the case
                        // between dispatches.
                        let _ = self.tree.move_node(node, p, self.now_ns);
                    }
                }
                let _ = self.tree.set_params(node, params);
                if old.spec.policy != info.spec.policy {
                    let _ = self.tree.set_policy(node, info.spec.policy);
                }
                if old.spec.cap != info.spec.cap {
                    let _ = self.tree.set_shaper(node, info.spec.cap, self.now_ns);
                }
            }
        }
        match self.activities.get_mut(&id) {
            Some(a) => a.info = info,
            None => {
                self.activities.insert(id, LocalActivity::new(info, None));
            }
        }
    }

    /// An activity was removed: it takes nothing new here (its gates go from the cache; a
    /// send finds it removed), and it is retired once the mailbox has been emptied
    /// ([`CoreState::retire_removed`]).
    pub(super) fn remove_activity(&mut self, id: ActivityId) {
        self.gate_cache.retain(|(_, a), _| *a != id);
        if let Some(a) = self.activities.get_mut(&id) {
            a.removed = true;
        }
        self.retiring.push(id);
    }

    /// Called after a loop turn emptied the mailbox: every activity removed before it is
    /// retired now if nothing of it is queued here, else its leaves are marked so that the
    /// dispatch that drains its last queue retires it.
    pub(super) fn retire_removed(&mut self, shared: &Shared) {
        let ids = std::mem::take(&mut self.retiring);
        for &id in &ids {
            if !self.retire_if_drained(shared, id) {
                for &(_, leaf) in &self.activities[&id].queues {
                    self.leaves[leaf as usize]
                        .as_mut()
                        .expect("a queue's leaf has info")
                        .retiring = true;
                }
            }
        }
        // The list's room is kept (no allocation for the next removal).
        self.retiring = ids;
        self.retiring.clear();
    }

    /// Retires a removed activity on this core if none of its queues here holds a message;
    /// says whether it did.
    pub(super) fn retire_if_drained(&mut self, shared: &Shared, id: ActivityId) -> bool {
        if let Some(a) = self.activities.get(&id) {
            debug_assert!(a.removed, "retiring live activity {id}");
            let queued = a.queues.iter().any(|&(stage, _)| {
                (self.queue_ops[stage as usize].len)(&*self.queues[stage as usize], id) > 0
            });
            if queued {
                return false;
            }
        }
        self.retire(shared, id);
        true
    }

    /// Frees what this core holds for removed activity `id`, whose queues here are empty: its
    /// queues with their leaves and leaf infos, then its node, entry and cells (or, while the
    /// nodes of removed children still hang under its node, marks it drained; the last child
    /// to go retires it).
    fn retire(&mut self, shared: &Shared, id: ActivityId) {
        let queues = match self.activities.get_mut(&id) {
            Some(a) => std::mem::take(&mut a.queues),
            None => Vec::new(),
        };
        for (stage, leaf) in queues {
            let r = (self.queue_ops[stage as usize].retire)(&mut *self.queues[stage as usize], id)
                .expect("a listed queue exists");
            debug_assert_eq!(r.leaf, leaf);
            if let Some((moved_leaf, q)) = r.moved {
                self.leaves[moved_leaf as usize]
                    .as_mut()
                    .expect("a queue's leaf has info")
                    .q = q;
            }
            let li = self.leaves[r.leaf as usize]
                .take()
                .expect("a queue's leaf has info");
            assert!(!li.in_bypass, "retired a leaf waiting in the bypass FIFO");
            drop(li);
            self.tree
                .remove(r.leaf)
                .expect("a drained leaf leaves the tree");
            self.queue_count -= 1;
        }
        self.finish_retire(shared, id);
    }

    /// The last step of a retirement: the node (if no child's node is under it), the entry,
    /// the explicit-record cells and the ledger cells; then the parent, if it was waiting
    /// for this node.
    fn finish_retire(&mut self, shared: &Shared, id: ActivityId) {
        let mut parent = None;
        if let Some(a) = self.activities.get_mut(&id) {
            if let Some(node) = a.node {
                if self.tree.remove(node).is_err() {
                    // The nodes of removed children still drain under it.
                    a.drained = true;
                    self.publish_footprint(shared);
                    return;
                }
            }
            parent = a.info.parent;
            self.activities.remove(&id);
        }
        self.record_cells.retain(|&(a, _), _| a != id);
        shared.ledger.retire(self.core, id);
        if let Some(tasks) = &shared.tasks {
            tasks.retire_long_polls(id);
        }
        self.publish_footprint(shared);
        if let Some(p) = parent {
            if self.activities.get(&p).is_some_and(|pa| pa.drained) {
                self.finish_retire(shared, p);
            }
        }
    }

    /// Publishes this core's counts for [`Runtime::footprint`](crate::exec::Runtime::footprint).
    pub(super) fn publish_footprint(&self, shared: &Shared) {
        let f = &shared.footprints[self.core];
        f.activities.store(self.activities.len(), Ordering::Release);
        f.tree_nodes.store(self.tree.len(), Ordering::Release);
        f.queues.store(self.queue_count, Ordering::Release);
    }

    /// Looks an activity up in the shared table when this core has not heard of it yet
    /// (its creation and a message for it can race).
    pub(super) fn learn(&mut self, shared: &Shared, id: ActivityId) -> bool {
        let info = {
            let t = shared.activities.read().expect("activities lock");
            if t.get(id).is_none() {
                return false;
            }
            ActivityInfo::of(&t, id)
        };
        self.upsert(info);
        self.publish_footprint(shared);
        true
    }

    /// The tree node of an activity on this core, created (with its ancestors) on first use.
    /// With `shared`, an ancestor this core has not heard of yet is looked up in the shared
    /// table (a child can be sent to before the control message of its parent arrives).
    ///
    /// A removed activity gets no new node (nor does anything under it) unless `admitted`: a
    /// message its gate admitted before the removal, on its way here until now, still takes
    /// a queue while the activity is draining (not yet retired) on this core.
    pub(super) fn ensure_node(
        &mut self,
        shared: Option<&Shared>,
        id: ActivityId,
        depth: usize,
        admitted: bool,
    ) -> Option<NodeId> {
        assert!(
            depth <= crate::activity::DEPTH_MAX + 1,
            "activity chain too deep"
        );
        if !self.activities.contains_key(&id) {
            if let Some(shared) = shared {
                self.learn(shared, id);
            }
        }
        let a = self.activities.get(&id)?;
        if a.removed && !admitted {
            return None;
        }
        if let Some(n) = a.node {
            return Some(n);
        }
        let info = a.info.clone();
        let parent_node = match info.parent {
            None => self.tree.root(),
            Some(p) => self.ensure_node(shared, p, depth + 1, admitted)?,
        };
        let params = ClientParams {
            weight: info.spec.weight,
            priority: info.spec.priority,
            shared: Some(info.tag.clone()),
        };
        let node = self
            .tree
            .add_interior(parent_node, params, info.spec.policy)
            .ok()?;
        if info.spec.cap.is_some() {
            let _ = self.tree.set_shaper(node, info.spec.cap, self.now_ns);
        }
        self.activities.get_mut(&id).expect("present").node = Some(node);
        Some(node)
    }

    /// Index of the (stage, activity) queue on this core, created on first use.
    pub(super) fn queue_index<M: 'static>(
        &mut self,
        shared: &Shared,
        stage: StageId,
        activity: ActivityId,
    ) -> Result<u32, SendError> {
        self.queue_index_in::<M>(shared, stage, activity, None)
    }

    /// [`CoreState::queue_index`] for a message `admitted` by this gate (one from the mailbox
    /// or a timer), maybe before its activity's removal: a removed activity not yet retired
    /// here still takes it (see [`CoreState::ensure_node`]), in a queue under that gate (the
    /// removal took the activity's gates out of the shared map).
    pub(super) fn queue_index_in<M: 'static>(
        &mut self,
        shared: &Shared,
        stage: StageId,
        activity: ActivityId,
        admitted: Option<&Arc<Gate>>,
    ) -> Result<u32, SendError> {
        if let Some(&q) = self.queues::<M>(stage).by_activity.get(&activity) {
            return Ok(q);
        }
        if !self.activities.contains_key(&activity) && !self.learn(shared, activity) {
            return Err(SendError::NoSuchActivity(activity));
        }
        let node = self
            .ensure_node(Some(shared), activity, 0, admitted.is_some())
            .ok_or(SendError::NoSuchActivity(activity))?;
        let weight = shared.stages[stage as usize].config.weight;
        let cell = shared
            .ledger
            .cell(self.core, activity, stage)
            .ok_or(SendError::Rejected(crate::admit::RejectReason::QueueFull))?;
        let gate = match admitted {
            Some(g) => g.clone(),
            None => self.cached_gate(shared, stage, activity)?,
        };
        let leaf = self
            .tree
            .add_leaf(node, ClientParams::weight(weight))
            .map_err(|_| SendError::Rejected(crate::admit::RejectReason::QueueFull))?;
        let qs = self.queues::<M>(stage);
        let q = qs.qs.len() as u32;
        qs.qs.push(LocalQueue {
            items: VecDeque::new(),
            leaf,
            activity,
            gate,
        });
        qs.by_activity.insert(activity, q);
        let li = leaf as usize;
        if self.leaves.len() <= li {
            self.leaves.resize(li + 1, None);
        }
        self.leaves[li] = Some(LeafInfo {
            stage,
            q,
            in_bypass: false,
            cell,
            retiring: false,
        });
        let a = self.activities.get_mut(&activity).expect("ensured above");
        a.queues.push((stage, leaf));
        a.drained = false;
        if a.removed && !self.retiring.contains(&activity) {
            // Taken by a removed activity after its leaves were marked: marked too, so the
            // dispatch that drains it retires the activity.
            self.leaves[li].as_mut().expect("set above").retiring = true;
        }
        self.queue_count += 1;
        self.publish_footprint(shared);
        Ok(q)
    }

    pub(super) fn cached_gate(
        &mut self,
        shared: &Shared,
        stage: StageId,
        activity: ActivityId,
    ) -> Result<Arc<Gate>, SendError> {
        if let Some(g) = self.gate_cache.get(&(stage, activity)) {
            return Ok(g.clone());
        }
        let g = shared.gate(stage, activity)?;
        self.gate_cache.insert((stage, activity), g.clone());
        Ok(g)
    }

    /// Appends to a local queue (its gate already admitted the message).
    pub(super) fn push<M: 'static>(&mut self, stage: StageId, q: u32, env: Envelope<M>) {
        let lq = &mut self.queues::<M>(stage).qs[q as usize];
        let was_empty = lq.items.is_empty();
        lq.items.push_back(env);
        let leaf = lq.leaf;
        if was_empty {
            self.leaf_ready(leaf);
        }
    }

    pub(super) fn leaf_ready(&mut self, leaf: NodeId) {
        // A branch per enqueue on a field constant for the runtime's life, paid alike in both
        // modes (the loop itself has one copy per mode; see `run`).
        if self.bypass {
            self.bypass_ready(leaf);
        } else {
            self.tree.leaf_ready(leaf, self.now_ns);
        }
    }

    /// A message was admitted but cannot be queued here after all: give its place back.
    pub(super) fn drop_admitted(&mut self, shared: &Shared, gate: &Gate, stage: StageId) {
        gate.release_n(&shared.stages[stage as usize].load, 1);
        self.drop_pending(shared);
    }

    /// A message admitted for this core that holds no queue place (a delayed one) cannot be
    /// queued after all: it is no longer pending here.
    pub(super) fn drop_pending(&mut self, shared: &Shared) {
        shared.core_pending[self.core]
            .0
            .fetch_sub(1, Ordering::AcqRel);
        self.dropped += 1;
    }
}
