//! The handler's context ([`Ctx`]): what a handler can do while it runs (send, reply later,
//! set timers, register I/O, change its activity), on the worker's state it borrows.

use super::*;

/// A message's response sample taken out of its dispatch ([`Ctx::defer_response`]); given to
/// [`Ctx::complete_response`] when the response is done (dropped: the sample is lost).
#[derive(Debug)]
pub struct DeferredResponse {
    gate: Arc<Gate>,
    enq_ns: u64,
}

/// What a handler can do while it runs.
pub struct Ctx<'a> {
    pub(in crate::exec) st: &'a mut CoreState,
    pub(in crate::exec) shared: &'a Shared,
}

impl Ctx<'_> {
    /// The worker (core index) running this handler.
    pub fn core(&self) -> usize {
        self.st.core
    }
    /// The activity that the current message belongs to (or was re-tagged to).
    pub fn activity(&self) -> ActivityId {
        self.st.current_activity
    }
    /// The stage being run.
    pub fn stage(&self) -> StageId {
        self.st.current_stage
    }
    /// Time the current dispatch started, ns since the runtime started.
    pub fn now_ns(&self) -> u64 {
        self.st.now_ns
    }
    /// Re-tags: messages sent from here on in this handler call belong to `activity`
    /// (demultiplexing, infra → tenant). The current dispatch stays charged to the activity
    /// of the message being handled.
    pub fn set_activity(&mut self, activity: ActivityId) {
        self.st.current_activity = activity;
    }
    /// Records bytes sent on behalf of `activity` by the current stage (Omni-Kernel's
    /// `resource_record` for the network): they appear in the ledger under
    /// (activity, this stage, this core). A stage that sends for several activities (a send
    /// scheduler) names each.
    pub fn record_bytes_out(&mut self, activity: ActivityId, bytes: u64) {
        if let Some(c) = self.st.record_cell(self.shared, activity) {
            c.bytes_out.add(bytes);
        }
    }

    /// Takes the response-time sample of the message being handled out of its dispatch: its
    /// response is not done when the handler returns (a proxied request waits for its
    /// backend), so its stage's admission controller (a p90 target) is fed when it is, through
    /// [`Ctx::complete_response`]. `None` when nothing samples this message (its gate has no
    /// controller, the scheduling bypass, or no stage message is being handled).
    pub fn defer_response(&mut self) -> Option<DeferredResponse> {
        let st = &mut *self.st;
        let gate = st.observe_gate.as_ref()?;
        let enq_ns = *st.responses.get(st.batch_pos)?;
        // Once per message, however many times its handler asks.
        if st.deferred.last() != Some(&st.batch_pos) {
            debug_assert!(st.deferred.last().is_none_or(|&p| p < st.batch_pos));
            st.deferred.push(st.batch_pos);
        }
        Some(DeferredResponse {
            gate: gate.clone(),
            enq_ns,
        })
    }

    /// Feeds a deferred response's time (from its message's enqueue until now) to its stage's
    /// admission controller, and counts it as completed.
    pub fn complete_response(&mut self, d: DeferredResponse) {
        let now = self.st.now_ns;
        d.gate.observe(&[now.saturating_sub(d.enq_ns)], now);
    }

    /// Records bytes received on behalf of `activity` by the current stage.
    pub fn record_bytes_in(&mut self, activity: ActivityId, bytes: u64) {
        if let Some(c) = self.st.record_cell(self.shared, activity) {
            c.bytes_in.add(bytes);
        }
    }

    /// Registers an I/O source with this worker: its readiness becomes `IoEvent` messages to
    /// `to`, in the current activity, carrying `user`.
    pub fn io_register<S: mio::event::Source + ?Sized>(
        &mut self,
        source: &mut S,
        interest: mio::Interest,
        to: &StageRef<IoEvent>,
        user: u64,
    ) -> std::io::Result<IoHandle> {
        let st = &mut *self.st;
        let index = match st.io_free.pop() {
            Some(i) => i,
            None => {
                if st.io.len() >= IO_REGISTRATIONS_MAX {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::OutOfMemory,
                        "too many I/O registrations on this worker",
                    ));
                }
                st.io.push(IoRegistration {
                    stage: 0,
                    activity: INFRA,
                    user: 0,
                    generation: 0,
                    live: false,
                    pending: false,
                    readable: false,
                    writable: false,
                    closed: false,
                });
                (st.io.len() - 1) as u32
            }
        };
        if let Err(e) = st
            .registry
            .register(source, mio::Token(index as usize), interest)
        {
            st.io_free.push(index);
            return Err(e);
        }
        let reg = &mut st.io[index as usize];
        reg.generation = reg.generation.wrapping_add(1);
        *reg = IoRegistration {
            stage: to.id,
            activity: st.current_activity,
            user,
            generation: reg.generation,
            live: true,
            pending: false,
            readable: false,
            writable: false,
            closed: false,
        };
        st.io_live += 1;
        Ok(IoHandle {
            index,
            generation: reg.generation,
            core: st.core as u16,
        })
    }

    /// Changes the interest of a registered source.
    pub fn io_reregister<S: mio::event::Source + ?Sized>(
        &mut self,
        handle: IoHandle,
        source: &mut S,
        interest: mio::Interest,
    ) -> std::io::Result<()> {
        self.st.io_reg(handle)?;
        self.st
            .registry
            .reregister(source, mio::Token(handle.index as usize), interest)
    }

    /// Future readiness of this source is delivered (and its handling charged) in `activity`
    /// (demultiplexing: a connection moves from `/infra` to its tenant).
    pub fn io_set_activity(
        &mut self,
        handle: IoHandle,
        activity: ActivityId,
    ) -> std::io::Result<()> {
        self.st.io_reg(handle)?.activity = activity;
        Ok(())
    }

    /// Deregisters a source; its handle becomes stale (a queued event for it is still
    /// delivered, with no readiness bits set).
    pub fn io_deregister<S: mio::event::Source + ?Sized>(
        &mut self,
        handle: IoHandle,
        source: &mut S,
    ) -> std::io::Result<()> {
        self.st.io_reg(handle)?;
        let r = self.st.registry.deregister(source);
        self.io_release(handle);
        r
    }

    /// Closes `source` (drops it) and frees its handle without `EPOLL_CTL_DEL`: closing the
    /// last descriptor of an open file description takes it out of every epoll set (epoll(7)),
    /// so closing a connection costs one system call instead of two. Only for a source no
    /// other descriptor refers to (not dup'd, not inherited by a child: the sockets a server
    /// accepts or connects, with CLOEXEC); otherwise [`Ctx::io_deregister`] first.
    pub fn io_close<S: mio::event::Source>(
        &mut self,
        handle: IoHandle,
        source: S,
    ) -> std::io::Result<()> {
        self.st.io_reg(handle)?;
        drop(source);
        self.io_release(handle);
        Ok(())
    }

    /// Marks a registered handle free; its generation moves on, so a queued event for it is
    /// delivered with no readiness bits set.
    fn io_release(&mut self, handle: IoHandle) {
        let reg = &mut self.st.io[handle.index as usize];
        reg.live = false;
        reg.pending = false;
        reg.generation = reg.generation.wrapping_add(1);
        self.st.io_free.push(handle.index);
        self.st.io_live -= 1;
    }

    /// Sends in the current activity, on this core unless the stage is elsewhere by key.
    pub fn send<M: Send + 'static>(&mut self, to: &StageRef<M>, msg: M) -> Result<(), SendError> {
        self.send_with(to, SendOpts::default(), msg)
    }
    /// Sends, dropping the message silently if it is refused (for messages whose loss is
    /// harmless); says whether it was accepted.
    pub fn send_lossy<M: Send + 'static>(&mut self, to: &StageRef<M>, msg: M) -> bool {
        self.send(to, msg).is_ok()
    }
    /// Sends `msg` to be delivered `delay_ns` from now.
    pub fn send_after<M: Send + 'static>(
        &mut self,
        to: &StageRef<M>,
        delay_ns: u64,
        msg: M,
    ) -> Result<(), SendError> {
        self.send_with(
            to,
            SendOpts {
                delay_ns,
                ..Default::default()
            },
            msg,
        )
    }
    /// Sends with header fields set explicitly.
    pub fn send_with<M: Send + 'static>(
        &mut self,
        to: &StageRef<M>,
        opts: SendOpts,
        msg: M,
    ) -> Result<(), SendError> {
        self.send_routed(to, opts, msg)?;
        // The stage graph as measured: one single-writer counter per (source, destination).
        self.shared
            .edges
            .record(self.st.core, EdgeFrom::Stage(self.st.current_stage), to.id);
        Ok(())
    }

    fn send_routed<M: Send + 'static>(
        &mut self,
        to: &StageRef<M>,
        opts: SendOpts,
        msg: M,
    ) -> Result<(), SendError> {
        let (st, shared) = (&mut *self.st, self.shared);
        shared.check_stage(to)?;
        if opts.delay_ns > DELAY_MAX_NS {
            return Err(SendError::DelayTooLong);
        }
        let activity = opts.activity.unwrap_or(st.current_activity);
        let now = st.now_ns;
        let core = shared.route(Some(st.core), st.current_stage, activity, &opts, now)?;
        if core != st.core {
            let gate = st.cached_gate(shared, to.id, activity)?;
            let dest = Destination {
                stage: to.id,
                activity,
                enq_ns: now,
                due_ns: now.saturating_add(opts.delay_ns),
            };
            return shared.send_remote(core, &gate, dest, msg);
        }
        if st.activities.get(&activity).is_some_and(|a| a.removed) {
            // Its queue here may still drain, but it takes nothing new.
            return Err(SendError::NoSuchActivity(activity));
        }
        let q = st.queue_index::<M>(shared, to.id, activity)?;
        let load = &shared.stages[to.id as usize].load;
        if opts.delay_ns > 0 {
            // Through the gate like any send (its predicate, the stage's shedding, the queue
            // as it is now), but it takes its queue place only when due: a timer is bounded by
            // this core's timer count, not by the queue bound (see `Gate::admit_delayed`).
            let gate = st.queues::<M>(to.id).qs[q as usize].gate.clone();
            shared.reserve_timer(st.core)?;
            if let Verdict::Reject(r) = gate.admit_delayed(load, now) {
                shared.release_timer(st.core);
                return Err(SendError::Rejected(r));
            }
            gate.delay_begin();
            shared.core_pending[st.core]
                .0
                .fetch_add(1, Ordering::AcqRel);
            st.add_timer(
                Box::new(Remote {
                    stage: to.id,
                    activity,
                    enq_ns: now,
                    due_ns: now.saturating_add(opts.delay_ns),
                    gate,
                    msg,
                }),
                shared,
            );
            return Ok(());
        }
        if let Verdict::Reject(r) = st.queues::<M>(to.id).qs[q as usize].gate.admit(load, now) {
            return Err(SendError::Rejected(r));
        }
        shared.core_pending[st.core]
            .0
            .fetch_add(1, Ordering::AcqRel);
        st.push::<M>(to.id, q, Envelope { msg, enq_ns: now });
        Ok(())
    }
}
