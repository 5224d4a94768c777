//! The runtime's activity and admission control: creating, changing, moving and removing
//! activities while work flows (each change is validated by the table, then broadcast to every
//! worker), the admission predicate of each (stage, activity) queue, and bytes charged to an
//! activity from outside the runtime.

use super::*;

impl Runtime {
    /// Sets the admission predicate of one (stage, activity) queue, overriding the stage's
    /// (a tenant's own p90 target, say); `None` goes back to the stage's. Takes effect for the
    /// next send.
    pub fn set_admission(
        &self,
        stage: StageId,
        activity: ActivityId,
        predicate: Option<Predicate>,
    ) -> Result<(), RuntimeError> {
        let s = &self.shared;
        let meta = s
            .stages
            .get(stage as usize)
            .ok_or_else(|| RuntimeError::Config(format!("no stage {stage}")))?;
        if let Some(p) = &predicate {
            StageConfig {
                predicate: p.clone(),
                ..meta.config.clone()
            }
            .validate()
            .map_err(RuntimeError::Config)?;
        }
        if self.activity_id_exists(activity).is_none() {
            return Err(RuntimeError::Activity(ActivityError::NotFound(format!(
                "#{activity}"
            ))));
        }
        let effective = predicate
            .clone()
            .unwrap_or_else(|| meta.config.predicate.clone());
        // Gates, then predicates (the order `Shared::gate` takes them).
        let gates = s.gates.read().expect("gates lock");
        {
            let mut p = s.predicates.write().expect("predicates lock");
            match predicate {
                Some(pred) => p.insert((stage, activity), pred),
                None => p.remove(&(stage, activity)),
            };
        }
        if let Some(g) = gates.get(&(stage, activity)) {
            g.set_predicate(&effective);
            g.attach(&effective);
        }
        Ok(())
    }

    fn activity_id_exists(&self, activity: ActivityId) -> Option<()> {
        self.with_activities(|t| t.get(activity).map(|_| ()))
    }

    /// Current token rate of the gate of (stage, activity), if its predicate has a bucket
    /// (before the gate's first use: the rate it will start with).
    pub fn admission_rate(&self, stage: StageId, activity: ActivityId) -> Option<f64> {
        let s = &self.shared;
        if let Some(g) = s.gates.read().expect("gates lock").get(&(stage, activity)) {
            return g.rate_per_s();
        }
        let predicate = s
            .predicates
            .read()
            .expect("predicates lock")
            .get(&(stage, activity))
            .cloned()
            .or_else(|| {
                s.stages
                    .get(stage as usize)
                    .map(|m| m.config.predicate.clone())
            })?;
        match predicate {
            Predicate::Threshold => None,
            Predicate::TokenBucket { rate_per_s, .. } => Some(rate_per_s),
            Predicate::P90 {
                initial_rate_per_s, ..
            } => Some(initial_rate_per_s),
            Predicate::ClassedP90 { group, level, .. } => Some(group.rate_per_s(level)),
        }
    }

    pub(super) fn change(
        &self,
        f: impl FnOnce(&mut ActivityTable) -> Result<Control, ActivityError>,
    ) -> Result<(), RuntimeError> {
        let mut t = self.shared.activities.write().expect("activities lock");
        let control = f(&mut t)?;
        // Every worker applies the change before its next scheduling decision. Sent while the
        // table is still locked, so every worker gets the changes in the order the table made
        // them (sent after, a change to an activity could reach a worker after its removal
        // and bring it back there). Lock order: activities, then a mailbox's control lock
        // (which a worker holds only to take its queue).
        self.shared.broadcast(|| control.clone());
        drop(t);
        Ok(())
    }

    /// Charges bytes that moved outside the runtime to `activity`: a shaped program's network
    /// and disk I/O, reported over the admin API. They go to the `external` pseudo-stage's cell
    /// on core 0 ([`EXTERNAL_STAGE`]), so they show in the activity's totals and rates, in
    /// `/metrics` and in `omnistage top` beside the runtime's own bytes. No CPU, dispatch or
    /// message is charged. Any thread may call this (the cell's counters are added
    /// atomically; workers never write that cell).
    pub fn charge_external(
        &self,
        activity: ActivityId,
        bytes: ExternalBytes,
    ) -> Result<(), RuntimeError> {
        // The table stays read-locked until the bytes are in: a removal waits for this, so
        // the cell (and these bytes) are there when core 0 retires the activity, and no cell
        // is made for it after that. Declared first, dropped last (after `cell`).
        let table = self.shared.activities.read().expect("activities lock");
        if table.get(activity).is_none() {
            return Err(ActivityError::NotFound(format!("#{activity}")).into());
        }
        let cell = self
            .shared
            .ledger
            .cell(0, activity, EXTERNAL_STAGE)
            .ok_or(ActivityError::TooMany)?;
        cell.bytes_in.add_shared(bytes.net_in);
        cell.bytes_out.add_shared(bytes.net_out);
        cell.disk_bytes.add_shared(bytes.disk_read);
        cell.disk_write_bytes.add_shared(bytes.disk_write);
        Ok(())
    }

    /// Creates an activity (its parent must exist) while work flows.
    pub fn create_activity(
        &self,
        path: &str,
        spec: ActivitySpec,
    ) -> Result<ActivityId, RuntimeError> {
        let mut id = 0;
        self.change(|t| {
            id = t.create(path, spec)?;
            Ok(Control::Upsert(worker::ActivityInfo::of(t, id)))
        })?;
        Ok(id)
    }

    /// Changes an activity's weight, cap or policy; takes effect at each worker's next decision.
    pub fn set_activity(&self, path: &str, spec: ActivitySpec) -> Result<(), RuntimeError> {
        let weight = spec.weight;
        let mut changed = 0;
        self.change(|t| {
            let id = t
                .lookup(path)
                .ok_or_else(|| ActivityError::NotFound(path.into()))?;
            t.set(id, spec)?;
            changed = id;
            Ok(Control::Upsert(worker::ActivityInfo::of(t, id)))
        })?;
        // Gates weigh activities for share-aware shedding.
        for ((_, a), g) in self.shared.gates.read().expect("gates lock").iter() {
            if *a == changed {
                g.set_weight(weight);
            }
        }
        Ok(())
    }

    /// Moves an activity and its sub-tree under another.
    pub fn move_activity(&self, path: &str, new_parent: &str) -> Result<(), RuntimeError> {
        self.change(|t| {
            let id = t
                .lookup(path)
                .ok_or_else(|| ActivityError::NotFound(path.into()))?;
            let p = t
                .lookup(new_parent)
                .ok_or_else(|| ActivityError::NotFound(new_parent.into()))?;
            t.move_to(id, p)?;
            Ok(Control::Upsert(worker::ActivityInfo::of(t, id)))
        })
    }

    /// Removes an activity without children. Messages already queued for it are still handled;
    /// each worker then frees what it held for the activity (queues, tree node, ledger cells,
    /// folded into the `RETIRED` aggregate). A message that reaches a worker after that (a
    /// delayed send coming due later, a send from a core that had not yet heard of the removal)
    /// is dropped and counted in the worker's `dropped`, though its send said `Ok`.
    pub fn remove_activity(&self, path: &str) -> Result<(), RuntimeError> {
        let mut removed = None;
        self.change(|t| {
            let id = t
                .lookup(path)
                .ok_or_else(|| ActivityError::NotFound(path.into()))?;
            t.remove(id)?;
            removed = Some(id);
            Ok(Control::Remove(id))
        })?;
        // Its gates go too, so a later send to the id is refused instead of half-accepted.
        // After the table change and outside the activities' lock: `Shared::gate` takes that
        // lock inside the gates' one, and taking them here in the other order deadlocked with
        // the first send to a (stage, activity). Once the id is out of the table no new gate
        // is made for it, so none survives this sweep.
        if let Some(id) = removed {
            let s = &self.shared;
            s.gates
                .write()
                .expect("gates lock")
                .retain(|(_, a), _| *a != id);
            s.predicates
                .write()
                .expect("predicates lock")
                .retain(|(_, a), _| *a != id);
        }
        Ok(())
    }

    /// Policy names accepted by activities.
    pub fn policies() -> &'static [PolicyKind] {
        &PolicyKind::ALL
    }
}
