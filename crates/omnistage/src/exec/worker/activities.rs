//! The per-core activity and queue bookkeeping of a worker: what it knows of each activity
//! ([`ActivityInfo`], [`LocalActivity`]), the activity's node in this core's tree (created on
//! first use with its ancestors), its (stage, activity) queues and their leaves, the gate
//! cache, and the changes the control messages bring (upsert, remove).

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
                    if let Some(p) = info.parent.and_then(|p| self.ensure_node(None, p, 0)) {
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
                self.activities.insert(
                    id,
                    LocalActivity {
                        info,
                        node: None,
                        removed: false,
                    },
                );
            }
        }
    }

    pub(super) fn remove_activity(&mut self, id: ActivityId) {
        self.gate_cache.retain(|(_, a), _| *a != id);
        if let Some(a) = self.activities.get_mut(&id) {
            a.removed = true;
            // Its node stays while it has queued work; its queues drain normally.
            if let Some(node) = a.node {
                if self.tree.remove(node).is_ok() {
                    a.node = None;
                }
            }
        }
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
    pub(super) fn ensure_node(
        &mut self,
        shared: Option<&Shared>,
        id: ActivityId,
        depth: usize,
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
        if a.removed {
            return None;
        }
        if let Some(n) = a.node {
            return Some(n);
        }
        let info = a.info.clone();
        let parent_node = match info.parent {
            None => self.tree.root(),
            Some(p) => self.ensure_node(shared, p, depth + 1)?,
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
        if let Some(&q) = self.queues::<M>(stage).by_activity.get(&activity) {
            return Ok(q);
        }
        if !self.activities.contains_key(&activity) && !self.learn(shared, activity) {
            return Err(SendError::NoSuchActivity(activity));
        }
        let node = self
            .ensure_node(Some(shared), activity, 0)
            .ok_or(SendError::NoSuchActivity(activity))?;
        let weight = shared.stages[stage as usize].config.weight;
        let cell = shared
            .ledger
            .cell(self.core, activity, stage)
            .ok_or(SendError::Rejected(crate::admit::RejectReason::QueueFull))?;
        let gate = self.cached_gate(shared, stage, activity)?;
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
        });
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

    /// Publishes this core's counts for [`Runtime::footprint`](crate::exec::Runtime::footprint).
    pub(super) fn publish_footprint(&self, shared: &Shared) {
        let f = &shared.footprints[self.core];
        f.activities.store(self.activities.len(), Ordering::Release);
        f.tree_nodes.store(self.tree.len(), Ordering::Release);
        f.queues.store(self.queue_count, Ordering::Release);
    }
}
