//! One worker: its tree, its typed queues, its timers, its loop, and the handler context.

use super::gate::Gate;
use super::lost_time::LostTime;
use super::wake_queue::WakeQueue;
use super::{sys, Destination, HandlerFactory, SendError, SendOpts, Shared, StageRef, LOOP_STAGE};
use super::{MAILBOX_DRAIN_MAX, TIMERS_MAX};
use crate::account::{ActivityId, Cell, EdgeFrom, StageId};
use crate::activity::{ActivitySpec, ActivityTable, INFRA, ROOT};
use crate::admit::Verdict;
use crate::sched::{ClientParams, NodeId, SharedTag, Tree};
use std::any::Any;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

pub(crate) const WAKE_TOKEN: mio::Token = mio::Token(usize::MAX);
/// Token of the worker's precise (sub-millisecond) timer.
const TIMER_TOKEN: mio::Token = mio::Token(usize::MAX - 1);

/// An adaptive stage's batch is re-decided after this much of its own dispatch time on a core
/// (a SEDA controller window, in stage time so an idle stage keeps its setting).
const BATCH_WINDOW_NS: u64 = 10_000_000;

/// SEDA's batching controller for one stage on one core.
struct StageBatching {
    controller: crate::admit::BatchingController,
    window_messages: u64,
    window_ns: u64,
}

/// How often a worker publishes its loop counters and reads the OS clocks, ns.
const FLUSH_INTERVAL_NS: u64 = 10_000_000;

/// A hasher for small integer keys (ids): one multiply. Keys are ids we assign, not input an
/// attacker picks, so flooding is not a concern.
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u32(&mut self, v: u32) {
        self.0 = (self.0.rotate_left(32) ^ u64::from(v)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(32) ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

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

/// Messages to a worker about the runtime itself.
#[derive(Clone, Debug)]
pub(crate) enum Control {
    Upsert(ActivityInfo),
    Remove(ActivityId),
    /// A task of this core was woken on another thread (its packed location; see `task`).
    WakeTask(u64),
    Stop,
}

/// Most I/O registrations (sockets) per worker.
pub const IO_REGISTRATIONS_MAX: usize = 1 << 20;
/// While busy, a worker polls for I/O readiness after this many dispatches...
const IO_POLL_EVERY_DISPATCHES: u32 = 32;
/// ...or after this long, whichever comes first (bounds the latency a busy core adds to I/O).
const IO_POLL_INTERVAL_NS: u64 = 100_000;
/// Readiness events taken from the kernel per `epoll_wait`.
const IO_EVENTS_PER_POLL: usize = 256;
/// Most `epoll_wait` calls per I/O round: a round goes on while the kernel returns a full
/// batch, so up to this times [`IO_EVENTS_PER_POLL`] sources are classified into their
/// activities' queues at once. The kernel's ready list is FIFO and blind to activities; taking
/// only one batch per round left a tenant with thousands of busy sockets ahead of everyone
/// else's readiness there, out of the scheduler's reach (LRP: classify early, then schedule).
const IO_POLL_ROUNDS_MAX: usize = 32;

/// A registered I/O source on one worker (a `mio` token plus a generation, so a stale handle
/// of a closed socket can never reach the socket that reused its slot).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IoHandle {
    index: u32,
    generation: u32,
}

/// Readiness of a registered source, delivered as a message to the registering stage in the
/// source's activity (lazy receive: the bytes stay in the kernel until that activity's turn).
/// At most one `IoEvent` per source is queued at a time; readiness that arrives while one is
/// queued is merged into it. Sources are edge-triggered: a handler must read or write until
/// `WouldBlock` before it can expect another event.
#[derive(Clone, Copy, Debug)]
pub struct IoEvent {
    pub handle: IoHandle,
    /// The value given at registration (e.g. a connection slot).
    pub user: u64,
    pub readable: bool,
    pub writable: bool,
    /// Peer closed its side or the socket has an error.
    pub closed: bool,
}

struct IoRegistration {
    stage: StageId,
    activity: ActivityId,
    user: u64,
    generation: u32,
    live: bool,
    /// An `IoEvent` for this source is queued.
    pending: bool,
    readable: bool,
    writable: bool,
    closed: bool,
}

/// A message (or timer) that crossed from another thread; delivered into a local queue.
pub(crate) trait Deliver: Send {
    fn deliver(self: Box<Self>, st: &mut CoreState, shared: &Shared);
    fn due_ns(&self) -> u64;
    /// The message was admitted but will not be delivered: give its places back.
    fn drop_admitted(self: Box<Self>, st: &mut CoreState, shared: &Shared);
}

pub(crate) struct Remote<M> {
    pub(crate) stage: StageId,
    pub(crate) activity: ActivityId,
    pub(crate) enq_ns: u64,
    pub(crate) due_ns: u64,
    pub(crate) gate: Arc<Gate>,
    pub(crate) msg: M,
}

impl<M: Send + 'static> Deliver for Remote<M> {
    fn deliver(self: Box<Self>, st: &mut CoreState, shared: &Shared) {
        if self.due_ns > st.now_ns {
            st.add_timer(self, shared);
            return;
        }
        let Remote {
            stage,
            activity,
            enq_ns,
            due_ns,
            gate,
            msg,
        } = *self;
        if due_ns > enq_ns {
            gate.delay_end();
        }
        match st.queue_index::<M>(shared, stage, activity) {
            Ok(q) => st.push::<M>(stage, q, Envelope { msg, enq_ns }),
            Err(_) => st.drop_admitted(shared, &gate, stage),
        }
    }
    fn due_ns(&self) -> u64 {
        self.due_ns
    }
    fn drop_admitted(self: Box<Self>, st: &mut CoreState, shared: &Shared) {
        if self.due_ns > self.enq_ns {
            self.gate.delay_end();
        }
        st.drop_admitted(shared, &self.gate, self.stage);
    }
}

struct Timer {
    due_ns: u64,
    seq: u64,
    payload: Box<dyn Deliver>,
}
impl PartialEq for Timer {
    fn eq(&self, o: &Self) -> bool {
        (self.due_ns, self.seq) == (o.due_ns, o.seq)
    }
}
impl Eq for Timer {}
impl Ord for Timer {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (o.due_ns, o.seq).cmp(&(self.due_ns, self.seq))
    }
}
impl PartialOrd for Timer {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

pub(crate) struct Envelope<M> {
    msg: M,
    enq_ns: u64,
}

/// Messages' room a drained queue keeps; a queue that grew beyond four times it in a burst is
/// shrunk back to it when it empties ([`release_burst`]). Measured: 10,000 connections that
/// each sent one request at once left 0.27 KiB per idle connection behind in the server's
/// resident memory before this.
const QUEUE_CAPACITY_KEPT: usize = 256;

/// Gives back the room a burst left in an emptied queue (a `VecDeque` never shrinks by itself):
/// a queue that grew past four times [`QUEUE_CAPACITY_KEPT`] keeps that much when it drains. A
/// branch per dispatch; the shrink runs once per such burst, and the factor of four keeps a
/// queue whose bursts reach a few hundred messages from reallocating on every one of them.
#[inline(always)]
fn release_burst<T>(items: &mut VecDeque<T>) {
    if items.is_empty() && items.capacity() > 4 * QUEUE_CAPACITY_KEPT {
        items.shrink_to(QUEUE_CAPACITY_KEPT);
    }
}

struct LocalQueue<M> {
    items: VecDeque<Envelope<M>>,
    leaf: NodeId,
    activity: ActivityId,
    gate: Arc<Gate>,
}

/// The typed queues of one stage on one core: one per activity that sent to it here.
struct Queues<M> {
    qs: Vec<LocalQueue<M>>,
    by_activity: IdMap<ActivityId, u32>,
}

#[derive(Clone)]
struct LeafInfo {
    stage: StageId,
    q: u32,
    /// In the bypass FIFO (bypass mode only).
    in_bypass: bool,
    /// The queue's ledger cell (the same `Arc` the typed queue holds).
    cell: Arc<Cell>,
}

struct LocalActivity {
    info: ActivityInfo,
    node: Option<NodeId>,
    removed: bool,
}

/// What one dispatch did.
pub(crate) struct Batch {
    /// The activity the dispatch is charged to (its queue's).
    activity: ActivityId,
    messages: u32,
    wait_ns: u64,
    still_backlogged: bool,
    panics: u32,
    /// The longest message of a batch of more than one, ns, for the task stage (whose long
    /// polls are counted per poll); 0 otherwise (a batch of one is as long as its dispatch).
    longest_ns: u64,
}

/// A stage's handler with its message type erased.
pub(crate) trait ErasedStage {
    fn new_queues(&self) -> Box<dyn Any>;
    /// Handles up to `batch_max` messages of queue `q` with accounting: the messages' queue
    /// waits are summed and their enqueue times kept for the histograms and the gate's
    /// controller.
    fn run(&mut self, st: &mut CoreState, shared: &Shared, q: u32, batch_max: usize) -> Batch;
    /// The same without any accounting (the bypass): no waits, no enqueue times, no controller.
    fn run_bypass(
        &mut self,
        st: &mut CoreState,
        shared: &Shared,
        q: u32,
        batch_max: usize,
    ) -> Batch;
    /// Whether queue `q` of this stage holds messages.
    fn backlogged(&self, st: &mut CoreState, q: u32) -> bool;
}

struct Typed<M, H> {
    id: StageId,
    /// For the panic report (interned: no allocation per batch).
    name: &'static str,
    handler: H,
    /// Reused buffer of the batch being handled (no allocation per dispatch).
    buf: Vec<Envelope<M>>,
}

pub(crate) fn erase<M, H>(id: StageId, name: &'static str, handler: H) -> Box<dyn ErasedStage>
where
    M: Send + 'static,
    H: FnMut(&mut Ctx<'_>, M) + 'static,
{
    Box::new(Typed {
        id,
        name,
        handler,
        buf: Vec::new(),
    })
}

impl<M, H> ErasedStage for Typed<M, H>
where
    M: Send + 'static,
    H: FnMut(&mut Ctx<'_>, M) + 'static,
{
    fn new_queues(&self) -> Box<dyn Any> {
        Box::new(Queues::<M> {
            qs: Vec::new(),
            by_activity: IdMap::default(),
        })
    }

    fn backlogged(&self, st: &mut CoreState, q: u32) -> bool {
        !st.queues::<M>(self.id).qs[q as usize].items.is_empty()
    }

    fn run(&mut self, st: &mut CoreState, shared: &Shared, q: u32, batch_max: usize) -> Batch {
        self.run_mode::<true>(st, shared, q, batch_max)
    }

    fn run_bypass(
        &mut self,
        st: &mut CoreState,
        shared: &Shared,
        q: u32,
        batch_max: usize,
    ) -> Batch {
        self.run_mode::<false>(st, shared, q, batch_max)
    }
}

impl<M, H> Typed<M, H>
where
    M: Send + 'static,
    H: FnMut(&mut Ctx<'_>, M) + 'static,
{
    /// One dispatch; `ACCOUNTED` is constant per instance of this function, so the bypass's
    /// copy carries none of the accounting's code and no branch on the mode.
    #[inline(always)]
    fn run_mode<const ACCOUNTED: bool>(
        &mut self,
        st: &mut CoreState,
        shared: &Shared,
        q: u32,
        batch_max: usize,
    ) -> Batch {
        let now = st.now_ns;
        let load = &shared.stages[self.id as usize].load;
        // The gate is cloned only when its controller will be fed after the batch: the common
        // dispatch takes no reference count.
        let (activity, observe_gate) = {
            let lq = &mut st.queues::<M>(self.id).qs[q as usize];
            let n = batch_max.min(lq.items.len());
            self.buf.extend(lq.items.drain(..n));
            release_burst(&mut lq.items);
            // The messages leave the queue: their places are free for new sends.
            lq.gate.release_n(load, n);
            (
                lq.activity,
                (ACCOUNTED && lq.gate.has_controller()).then(|| lq.gate.clone()),
            )
        };
        let n = self.buf.len();
        debug_assert!(n > 0, "dispatched an empty queue");
        let mut wait_ns = 0;
        if ACCOUNTED {
            // Enqueue times feed the latency histograms and the gate's controller (a reused
            // buffer: no allocation once it has grown to the batch size).
            st.responses.clear();
            for e in &self.buf {
                wait_ns += now.saturating_sub(e.enq_ns);
                st.responses.push(e.enq_ns);
            }
        }
        st.current_activity = activity;
        st.current_stage = self.id;
        // Set before the handlers run: one of them may take its message's sample.
        st.observe_gate = observe_gate;
        st.deferred.clear();
        let _reported_as = super::panic::StageGuard::enter(self.name);
        let mut panics = 0;
        let handler = &mut self.handler;
        let is_io = std::any::TypeId::of::<M>() == std::any::TypeId::of::<IoEvent>();
        // A batch of task polls times each poll (one clock read per poll), so that a long poll
        // is judged alone and not by the batch's length; a batch of one is its dispatch.
        // A batch of polls also ends once it has run for the poll limit (Seastar's task quota):
        // a batch is a grain of the shares, and it must not turn a few slow polls into one
        // long dispatch. The polls not run go back to the front of their queue.
        let budget_ns = shared
            .tasks
            .as_ref()
            .filter(|t| n > 1 && t.stage() == self.id)
            .map(|t| t.poll_limit_ns());
        let timed = ACCOUNTED && budget_ns.is_some();
        let start = if timed { shared.clock.raw() } else { 0 };
        let mut mark = start;
        let mut longest_ns = 0;
        let mut handled = 0;
        let mut rest = self.buf.drain(..).enumerate();
        for (pos, mut env) in rest.by_ref() {
            st.batch_pos = pos;
            if is_io {
                // Constant per monomorphization: free for every other message type.
                if let Some(ev) = (&mut env.msg as &mut dyn Any).downcast_mut::<IoEvent>() {
                    st.io_take(ev);
                }
            }
            let mut ctx = Ctx { st, shared };
            // Contain a panicking handler: the message is lost and counted, the worker goes on.
            if catch_unwind(AssertUnwindSafe(|| handler(&mut ctx, env.msg))).is_err() {
                panics += 1;
            }
            // A handler may re-tag; the next message of the batch starts from its own activity.
            st.current_activity = activity;
            handled = pos + 1;
            if timed {
                let t = shared.clock.raw();
                longest_ns = longest_ns.max(shared.clock.delta_as_nanos(mark, t));
                mark = t;
                if handled < n
                    && shared.clock.delta_as_nanos(start, t) >= budget_ns.unwrap_or(u64::MAX)
                {
                    break;
                }
            }
        }
        if handled < n {
            // Out of time: the rest goes back, first in line, admitted again (its places were
            // given back when the batch left the queue); its waits and samples count when it runs.
            let lq = &mut st.queues::<M>(self.id).qs[q as usize];
            for (_, env) in rest.rev() {
                wait_ns -= now.saturating_sub(env.enq_ns).min(wait_ns);
                lq.gate.force_admit(load);
                lq.items.push_front(env);
            }
            st.responses.truncate(handled);
        } else {
            drop(rest);
        }
        debug_assert!(self.buf.is_empty());
        let still_backlogged = self.backlogged(st, q);
        Batch {
            activity,
            messages: handled as u32,
            wait_ns,
            still_backlogged,
            panics,
            longest_ns,
        }
    }
}

/// A worker's own state; handlers reach it through [`Ctx`].
pub(crate) struct CoreState {
    core: usize,
    tree: Tree,
    bypass: bool,
    bypass_fifo: VecDeque<NodeId>,
    leaves: Vec<Option<LeafInfo>>,
    queues: Vec<Box<dyn Any>>,
    activities: IdMap<ActivityId, LocalActivity>,
    gate_cache: IdMap<(StageId, ActivityId), Arc<Gate>>,
    timers: BinaryHeap<Timer>,
    timer_seq: u64,
    now_ns: u64,
    current_activity: ActivityId,
    current_stage: StageId,
    /// Enqueue times of the batch just handled, when its gate has a controller.
    responses: Vec<u64>,
    /// The batch's gate, while its handler runs and until its controller is fed.
    observe_gate: Option<Arc<Gate>>,
    /// Position in the batch of the message its handler is handling.
    batch_pos: usize,
    /// Positions (ascending) whose response sample the handler took ([`Ctx::defer_response`]):
    /// their controller sample comes later, not from this dispatch.
    deferred: Vec<usize>,
    dropped: u64,
    registry: mio::Registry,
    io: Vec<IoRegistration>,
    io_free: Vec<u32>,
    io_live: usize,
    /// Ledger cells for records a handler charges explicitly (bytes), by (activity, stage).
    record_cells: IdMap<(ActivityId, StageId), Arc<Cell>>,
}

impl CoreState {
    fn new(
        core: usize,
        shared: &Shared,
        handlers: &[Option<Box<dyn ErasedStage>>],
        registry: mio::Registry,
    ) -> Self {
        let table = shared.activities.read().expect("activities lock");
        let root_policy = table.get(ROOT).expect("root").spec.policy;
        let mut tree = Tree::new(root_policy);
        tree.set_min_cost(shared.min_cost_ns);
        let mut activities = IdMap::default();
        for a in table.iter() {
            activities.insert(
                a.id,
                LocalActivity {
                    info: ActivityInfo::of(&table, a.id),
                    node: (a.id == ROOT).then_some(tree.root()),
                    removed: false,
                },
            );
        }
        CoreState {
            core,
            tree,
            bypass: shared.bypass,
            bypass_fifo: VecDeque::new(),
            leaves: Vec::new(),
            queues: handlers
                .iter()
                .map(|h| h.as_ref().expect("handler present at start").new_queues())
                .collect(),
            activities,
            gate_cache: IdMap::default(),
            timers: BinaryHeap::new(),
            timer_seq: 0,
            now_ns: 0,
            current_activity: INFRA,
            current_stage: StageId::MAX,
            responses: Vec::new(),
            observe_gate: None,
            batch_pos: 0,
            deferred: Vec::new(),
            dropped: 0,
            registry,
            io: Vec::new(),
            io_free: Vec::new(),
            io_live: 0,
            record_cells: IdMap::default(),
        }
    }

    fn record_cell(&mut self, shared: &Shared, activity: ActivityId) -> Option<&Cell> {
        let key = (activity, self.current_stage);
        if !self.record_cells.contains_key(&key) {
            let cell = shared
                .ledger
                .cell(self.core, activity, self.current_stage)?;
            self.record_cells.insert(key, cell);
        }
        self.record_cells.get(&key).map(|c| &**c)
    }

    /// Turns readiness from `poll` into `IoEvent` messages (merged per source).
    fn io_ready(&mut self, shared: &Shared, events: &mio::Events) {
        for ev in events.iter() {
            let token = ev.token();
            if token == WAKE_TOKEN || token == TIMER_TOKEN {
                continue;
            }
            if token.0 >= super::task::IO_TOKEN_BASE {
                // A task's socket: readiness wakes the task, which is queued in its activity.
                super::task::io_event(ev);
                continue;
            }
            let Some(reg) = self.io.get_mut(token.0) else {
                continue;
            };
            if !reg.live {
                continue;
            }
            reg.readable |= ev.is_readable() || ev.is_read_closed();
            reg.writable |= ev.is_writable() || ev.is_write_closed();
            reg.closed |= ev.is_read_closed() || ev.is_error();
            if reg.pending {
                continue;
            }
            reg.pending = true;
            let (stage, activity) = (reg.stage, reg.activity);
            let event = IoEvent {
                handle: IoHandle {
                    index: token.0 as u32,
                    generation: reg.generation,
                },
                user: reg.user,
                readable: false,
                writable: false,
                closed: false,
            };
            // Readiness is never refused: it is bounded by one queued event per source, and
            // dropping it would lose an edge-triggered wakeup for good. If the activity is gone,
            // it is delivered in /infra so the owner can close the source.
            if !self.push_io_event(shared, stage, activity, event) {
                self.io[token.0].activity = INFRA;
                if !self.push_io_event(shared, stage, INFRA, event) {
                    self.io[token.0].pending = false;
                }
            }
        }
    }

    /// Queues a readiness event in `activity` without admission; false if no queue can be had.
    fn push_io_event(
        &mut self,
        shared: &Shared,
        stage: StageId,
        activity: ActivityId,
        event: IoEvent,
    ) -> bool {
        let pushed = self.push_forced(shared, stage, activity, event, false);
        if pushed {
            shared.edges.record(self.core, EdgeFrom::Io, stage);
        }
        pushed
    }

    /// Queues `msg` for (stage, activity) on this core without asking the gate (readiness and
    /// task wakes cannot be refused: losing one would strand its source or task). The gate
    /// still counts it, unless `admitted` says it already did. False if no queue can be had
    /// (the activity is gone). Allocates nothing once the queue has grown to its backlog.
    pub(super) fn push_forced<M: 'static>(
        &mut self,
        shared: &Shared,
        stage: StageId,
        activity: ActivityId,
        msg: M,
        admitted: bool,
    ) -> bool {
        // Every task wake and readiness event comes through here: the queue exists almost
        // always, so it is found and filled through one downcast of the stage's queues (the
        // general path took three and two lookups).
        let now_ns = self.now_ns;
        let qs = self.queues::<M>(stage);
        let (leaf, was_empty) = if let Some(&q) = qs.by_activity.get(&activity) {
            let lq = &mut qs.qs[q as usize];
            if !admitted {
                lq.gate.force_admit(&shared.stages[stage as usize].load);
            }
            let was_empty = lq.items.is_empty();
            lq.items.push_back(Envelope {
                msg,
                enq_ns: now_ns,
            });
            (lq.leaf, was_empty)
        } else {
            let Ok(q) = self.queue_index::<M>(shared, stage, activity) else {
                return false;
            };
            let lq = &mut self.queues::<M>(stage).qs[q as usize];
            if !admitted {
                lq.gate.force_admit(&shared.stages[stage as usize].load);
            }
            lq.items.push_back(Envelope {
                msg,
                enq_ns: now_ns,
            });
            (lq.leaf, true)
        };
        shared.core_pending[self.core]
            .0
            .fetch_add(1, Ordering::AcqRel);
        if was_empty {
            self.leaf_ready(leaf);
        }
        true
    }

    /// This worker's core index.
    pub(super) fn core(&self) -> usize {
        self.core
    }

    /// The loop's clock, ns since the runtime started (as of the last read).
    pub(super) fn now_ns(&self) -> u64 {
        self.now_ns
    }

    /// Fills a dequeued `IoEvent` with the readiness merged since it was queued.
    fn io_take(&mut self, ev: &mut IoEvent) {
        if let Some(reg) = self.io.get_mut(ev.handle.index as usize) {
            if reg.live && reg.generation == ev.handle.generation {
                reg.pending = false;
                ev.readable = std::mem::take(&mut reg.readable);
                ev.writable = std::mem::take(&mut reg.writable);
                ev.closed = std::mem::take(&mut reg.closed);
            }
        }
    }

    fn io_reg(&mut self, h: IoHandle) -> std::io::Result<&mut IoRegistration> {
        match self.io.get_mut(h.index as usize) {
            Some(r) if r.live && r.generation == h.generation => Ok(r),
            _ => Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "stale or unknown I/O handle",
            )),
        }
    }

    fn queues<M: 'static>(&mut self, stage: StageId) -> &mut Queues<M> {
        self.queues[stage as usize]
            .downcast_mut::<Queues<M>>()
            .expect("message type matches the stage's")
    }

    /// Applies an activity change to this core's tree.
    fn upsert(&mut self, info: ActivityInfo) {
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

    fn remove_activity(&mut self, id: ActivityId) {
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
    fn learn(&mut self, shared: &Shared, id: ActivityId) -> bool {
        let info = {
            let t = shared.activities.read().expect("activities lock");
            if t.get(id).is_none() {
                return false;
            }
            ActivityInfo::of(&t, id)
        };
        self.upsert(info);
        true
    }

    /// The tree node of an activity on this core, created (with its ancestors) on first use.
    /// With `shared`, an ancestor this core has not heard of yet is looked up in the shared
    /// table (a child can be sent to before the control message of its parent arrives).
    fn ensure_node(
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
    fn queue_index<M: 'static>(
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
        Ok(q)
    }

    fn cached_gate(
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
    fn push<M: 'static>(&mut self, stage: StageId, q: u32, env: Envelope<M>) {
        let lq = &mut self.queues::<M>(stage).qs[q as usize];
        let was_empty = lq.items.is_empty();
        lq.items.push_back(env);
        let leaf = lq.leaf;
        if was_empty {
            self.leaf_ready(leaf);
        }
    }

    fn leaf_ready(&mut self, leaf: NodeId) {
        // A branch per enqueue on a field constant for the runtime's life, paid alike in both
        // modes (the loop itself has one copy per mode; see `run`).
        if self.bypass {
            self.bypass_ready(leaf);
        } else {
            self.tree.leaf_ready(leaf, self.now_ns);
        }
    }

    /// A message was admitted but cannot be queued here after all: give its place back.
    fn drop_admitted(&mut self, shared: &Shared, gate: &Gate, stage: StageId) {
        gate.release_n(&shared.stages[stage as usize].load, 1);
        shared.core_pending[self.core]
            .0
            .fetch_sub(1, Ordering::AcqRel);
        self.dropped += 1;
    }

    fn add_timer(&mut self, payload: Box<dyn Deliver>, shared: &Shared) {
        if self.timers.len() >= TIMERS_MAX {
            // Checked by local senders; a remote one that raced past the check is dropped
            // here, giving back its gate place and pending count.
            payload.drop_admitted(self, shared);
            return;
        }
        self.timer_seq += 1;
        self.timers.push(Timer {
            due_ns: payload.due_ns(),
            seq: self.timer_seq,
            payload,
        });
        shared.core_timers[self.core]
            .0
            .store(self.timers.len(), Ordering::Relaxed);
    }

    /// Delivers the timers that are due; says whether any were.
    fn fire_timers(&mut self, shared: &Shared) -> bool {
        let mut fired = false;
        while let Some(t) = self.timers.peek() {
            if t.due_ns > self.now_ns {
                break;
            }
            let t = self.timers.pop().expect("peeked");
            t.payload.deliver(self, shared);
            fired = true;
        }
        if fired {
            shared.core_timers[self.core]
                .0
                .store(self.timers.len(), Ordering::Relaxed);
        }
        fired
    }

    fn next_timer_ns(&self) -> Option<u64> {
        self.timers
            .peek()
            .map(|t| t.due_ns.saturating_sub(self.now_ns))
    }

    /// The next leaf to dispatch: the tree's pick, or the bypass's FIFO (constant per copy of
    /// the loop, see [`run`]).
    #[inline(always)]
    fn pick<const ACCOUNTED: bool>(&mut self) -> Option<NodeId> {
        if ACCOUNTED {
            self.tree.pick(self.now_ns)
        } else {
            let leaf = self.bypass_fifo.pop_front()?;
            self.leaves[leaf as usize].as_mut().expect("leaf").in_bypass = false;
            Some(leaf)
        }
    }

    /// Puts a ready leaf at the back of the bypass's FIFO, unless it is there already (a
    /// handler may have sent to its own queue during the dispatch).
    #[inline(always)]
    fn bypass_ready(&mut self, leaf: NodeId) {
        let li = self.leaves[leaf as usize].as_mut().expect("leaf info");
        if !li.in_bypass {
            li.in_bypass = true;
            self.bypass_fifo.push_back(leaf);
        }
    }
}

/// What a handler can do while it runs.
/// A message's response sample taken out of its dispatch ([`Ctx::defer_response`]); given to
/// [`Ctx::complete_response`] when the response is done (dropped: the sample is lost).
#[derive(Debug)]
pub struct DeferredResponse {
    gate: Arc<Gate>,
    enq_ns: u64,
}

pub struct Ctx<'a> {
    pub(super) st: &'a mut CoreState,
    pub(super) shared: &'a Shared,
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
        {
            let gate = &st.queues::<M>(to.id).qs[q as usize].gate;
            if opts.delay_ns > 0 {
                // A timer is bounded by this core's timer table, not by the queue bound.
                gate.force_admit(load);
            } else if let Verdict::Reject(r) = gate.admit(load, now) {
                return Err(SendError::Rejected(r));
            }
        }
        shared.core_pending[st.core]
            .0
            .fetch_add(1, Ordering::AcqRel);
        if opts.delay_ns > 0 {
            if st.timers.len() >= TIMERS_MAX {
                let gate = st.queues::<M>(to.id).qs[q as usize].gate.clone();
                st.drop_admitted(shared, &gate, to.id);
                st.dropped -= 1;
                return Err(SendError::TooManyTimers);
            }
            let gate = st.queues::<M>(to.id).qs[q as usize].gate.clone();
            gate.delay_begin();
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
        st.push::<M>(to.id, q, Envelope { msg, enq_ns: now });
        Ok(())
    }
}

/// Loop-level time, accumulated locally and published every `FLUSH_INTERVAL_NS`.
#[derive(Default)]
struct LoopTime {
    idle_ns: u64,
    infra_ns: u64,
    dispatch_ns: u64,
    /// The part of `infra_ns` spent around sleeps by the OS's clocks (CPU in the blocking poll,
    /// run-queue wait after a wake-up).
    wake_ns: u64,
    /// Σ half the length of each OS CPU-clock read the loop stamped (see
    /// `CoreCounters::os_read_uncertainty_ns`).
    read_uncertainty_ns: u64,
}

/// The clock reading halfway between two readings (`a` first).
fn raw_midpoint(a: u64, b: u64) -> u64 {
    a.wrapping_add(b.wrapping_sub(a) / 2)
}

/// The thread's CPU clock (ns) and the instant it stands for: our clock at the midpoint of
/// the read, whose half length is added to `uncertainty_ns` (the OS samples somewhere inside
/// the system call).
fn stamped_cpu_read(clock: &quanta::Clock, uncertainty_ns: &mut u64) -> (u64, u64) {
    let pre = clock.raw();
    let cpu = sys::thread_cpu_ns();
    let post = clock.raw();
    *uncertainty_ns += clock.delta_as_nanos(pre, post) / 2;
    (raw_midpoint(pre, post), cpu)
}

/// The worker thread's body: one copy of the loop per mode, chosen once here, so the
/// scheduled loop carries no test of the mode per dispatch and the bypass carries none of the
/// accounting.
///
/// The bypass (`Builder::bypass`) is the baseline the overhead experiments compare against: a
/// FIFO of ready queues, no tree, no ledger cells or histograms, no batch-size or admission
/// controller feedback, and no clock read per dispatch. It reads the clock once every
/// [`IO_POLL_EVERY_DISPATCHES`] dispatches (for timers, the I/O poll and the 10 ms counter
/// flush, which still publishes the OS's CPU clock of the thread) and around sleeps; messages
/// keep their enqueue stamp field, filled with that last reading (a store, no clock read). It
/// still counts messages handled (`handled`, one add per dispatch) and the pending count each
/// core keeps for routing.
pub(crate) fn run(
    core: usize,
    pin: Option<usize>,
    shared: Arc<Shared>,
    factories: &[HandlerFactory],
    poll: mio::Poll,
) {
    if shared.bypass {
        run_loop::<false>(core, pin, shared, factories, poll)
    } else {
        run_loop::<true>(core, pin, shared, factories, poll)
    }
}

fn run_loop<const ACCOUNTED: bool>(
    core: usize,
    pin: Option<usize>,
    shared: Arc<Shared>,
    factories: &[HandlerFactory],
    mut poll: mio::Poll,
) {
    // Tasks on this core live in this thread's task state until the worker ends.
    let _tasks = match super::task::enter_worker(core, &shared, poll.registry()) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("omnistage: worker {core}: cannot set up tasks: {e}");
            return;
        }
    };
    if let Some(cpu) = pin {
        if let Err(e) = sys::pin_to(cpu) {
            eprintln!("omnistage: worker {core}: cannot pin to CPU {cpu}: {e}");
        }
    }
    let shared: &Shared = &shared;
    let mut handlers: Vec<Option<Box<dyn ErasedStage>>> =
        factories.iter().map(|f| Some(f(core))).collect();
    let registry = match poll.registry().try_clone() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("omnistage: worker {core}: cannot clone the poll registry: {e}");
            return;
        }
    };
    let mut st = CoreState::new(core, shared, &handlers, registry);
    let mut dispatches_since_poll = 0u32;
    let mut batching: Vec<Option<StageBatching>> = shared
        .stages
        .iter()
        .map(|s| {
            s.config.adaptive_batch.then(|| StageBatching {
                controller: crate::admit::BatchingController::new(s.config.batch_max),
                window_messages: 0,
                window_ns: 0,
            })
        })
        .collect();
    let mut last_poll_ns = 0u64;
    let mut events = mio::Events::with_capacity(IO_EVENTS_PER_POLL);
    // epoll's own timeout is in whole milliseconds; waits shorter than that go to a timerfd.
    let precise = sys::PreciseTimer::new().ok().and_then(|t| {
        poll.registry()
            .register(
                &mut mio::unix::SourceFd(&t.raw()),
                TIMER_TOKEN,
                mio::Interest::READABLE,
            )
            .ok()
            .map(|_| t)
    });
    let clock = &shared.clock;
    let mailbox = &shared.mailboxes[core];
    let counters = shared.ledger.core(core);
    let infra_cell = shared
        .ledger
        .cell(core, INFRA, LOOP_STAGE)
        .expect("first cell of the core fits");
    let mut schedstat = sys::SchedStat::open();
    // Steal is per CPU, so it can be charged to a worker only if the worker owns its CPU.
    let mut steal = pin.map(sys::CpuSteal::open);
    let steal_begin = steal.as_mut().and_then(|s| s.read()).unwrap_or(0);
    let mut flushes = 0u64;
    let cpu_begin = sys::thread_cpu_ns();
    let rq_begin = schedstat.read().map(|(_, w)| w).unwrap_or(0);
    let t_begin = clock.raw();
    let mut wq = WakeQueue::new(rq_begin, t_begin, cpu_begin);
    let mut lost = LostTime::new(shared.ns_of_raw(t_begin), cpu_begin);
    let mut seg_start = t_begin;
    let mut time = LoopTime::default();
    let mut next_flush_ns = 0u64;
    let mut stop = false;
    // The bypass's clock: dispatches since it was last read, and whether the loop found
    // nothing to do on a reading that may be stale (then it reads again before sleeping).
    let mut since_clock = 0u32;
    let mut stale_idle = false;
    let task_stage = shared.tasks.as_ref().map(|t| t.stage() as usize);

    let mut flush = |time: &mut LoopTime, seg_start: &mut u64, wq: &mut WakeQueue| {
        let t = clock.raw();
        if ACCOUNTED {
            time.infra_ns += clock.delta_as_nanos(*seg_start, t);
        }
        *seg_start = t;
        let cpu_now = sys::thread_cpu_ns();
        let t_after_cpu = if ACCOUNTED { clock.raw() } else { t };
        let rq_now = schedstat.read().map(|(_, w)| w);
        if ACCOUNTED {
            // The CPU clock's sample instant, for the segment's edge (as around sleeps).
            let t_cpu = raw_midpoint(t, t_after_cpu);
            time.read_uncertainty_ns += clock.delta_as_nanos(t, t_after_cpu) / 2;
            wq.close_segment(clock.delta_as_nanos(wq.mark_raw, t_cpu), t_cpu, cpu_now);
            if let Some(rq_now) = rq_now {
                let to_wake = wq.settle(rq_now);
                // Inside the room the sleeps left idle: idle_ns cannot go below zero.
                time.idle_ns -= to_wake;
                time.wake_ns += to_wake;
                time.infra_ns += to_wake;
            }
        }
        let cpu = cpu_now.saturating_sub(cpu_begin);
        let rq = rq_now.map(|w| w.saturating_sub(rq_begin)).unwrap_or(0);
        counters.elapsed_ns.set(clock.delta_as_nanos(t_begin, t));
        counters.idle_ns.set(time.idle_ns);
        counters.infra_ns.set(time.infra_ns);
        counters.wake_ns.set(time.wake_ns);
        counters
            .os_read_uncertainty_ns
            .set(time.read_uncertainty_ns);
        counters.dispatch_ns.set(time.dispatch_ns);
        counters.os_cpu_ns.set(cpu);
        counters.os_runqueue_ns.set(rq);
        // /proc/stat is larger than schedstat: read it every 10th flush (100 ms).
        flushes += 1;
        if flushes % 10 == 1 {
            if let Some(st) = steal.as_mut().and_then(|s| s.read()) {
                counters.os_steal_ns.set(st.saturating_sub(steal_begin));
            }
        }
        infra_cell.cpu_ns.set(time.infra_ns);
    };

    while !stop {
        // A plain load first: the locked swap only when there is something (most turns).
        if mailbox.control_pending.load(Ordering::Acquire)
            && mailbox.control_pending.swap(false, Ordering::AcqRel)
        {
            let controls = std::mem::take(&mut *mailbox.control.lock().expect("control lock"));
            for c in controls {
                match c {
                    Control::Upsert(info) => st.upsert(info),
                    Control::Remove(id) => st.remove_activity(id),
                    Control::WakeTask(loc) => super::task::wake_from_remote(loc),
                    Control::Stop => stop = true,
                }
            }
        }
        let mut drained = 0;
        while drained < MAILBOX_DRAIN_MAX {
            match mailbox.messages.pop() {
                Some(d) => d.deliver(&mut st, shared),
                None => break,
            }
            drained += 1;
        }
        let mut now_raw = seg_start;
        let fresh = ACCOUNTED || stale_idle || since_clock >= IO_POLL_EVERY_DISPATCHES;
        if fresh {
            now_raw = clock.raw();
            st.now_ns = shared.ns_of_raw(now_raw);
            since_clock = 0;
            stale_idle = false;
        }
        if (st.io_live > 0 || super::task::io_live())
            && (dispatches_since_poll >= IO_POLL_EVERY_DISPATCHES
                || st.now_ns.saturating_sub(last_poll_ns) >= IO_POLL_INTERVAL_NS)
        {
            dispatches_since_poll = 0;
            last_poll_ns = st.now_ns;
            for _ in 0..IO_POLL_ROUNDS_MAX {
                if let Err(e) = poll.poll(&mut events, Some(Duration::ZERO)) {
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        eprintln!("omnistage: worker {core}: poll failed: {e}");
                    }
                }
                st.io_ready(shared, &events);
                if events.iter().count() < IO_EVENTS_PER_POLL {
                    break;
                }
            }
            let round_start = now_raw;
            now_raw = clock.raw();
            st.now_ns = shared.ns_of_raw(now_raw);
            if ACCOUNTED {
                // Fresh at the top of the loop in this mode: the round is stamped for free.
                counters
                    .io_round_hist
                    .record(clock.delta_as_nanos(round_start, now_raw));
            }
        }
        if (st.fire_timers(shared) | super::task::turn(&mut st, shared)) && ACCOUNTED {
            // Delivering timers and queueing woken tasks is the loop's work (infra), not the
            // next dispatch's.
            now_raw = clock.raw();
            st.now_ns = shared.ns_of_raw(now_raw);
        }
        if let Some(leaf) = st.pick::<ACCOUNTED>() {
            dispatches_since_poll += 1;
            if !ACCOUNTED {
                since_clock += 1;
                let (stage, q) = {
                    let li = st.leaves[leaf as usize]
                        .as_ref()
                        .expect("picked leaf has info");
                    (li.stage as usize, li.q)
                };
                let batch_max =
                    shared.stages[stage].batch_now[core].load(Ordering::Relaxed) as usize;
                let mut h = handlers[stage].take().expect("handler not re-entered");
                let b = h.run_bypass(&mut st, shared, q, batch_max);
                handlers[stage] = Some(h);
                if b.still_backlogged {
                    st.bypass_ready(leaf);
                }
                if b.panics > 0 {
                    counters.panics.add(u64::from(b.panics));
                }
                counters.handled.add(u64::from(b.messages));
                shared.core_pending[core]
                    .0
                    .fetch_sub(b.messages as usize, Ordering::AcqRel);
                if st.now_ns >= next_flush_ns || stop {
                    flush(&mut time, &mut seg_start, &mut wq);
                    counters.dropped.set(st.dropped);
                    next_flush_ns = st.now_ns + FLUSH_INTERVAL_NS;
                }
                continue;
            }
            time.infra_ns += clock.delta_as_nanos(seg_start, now_raw);
            let (stage, q) = {
                let li = st.leaves[leaf as usize]
                    .as_ref()
                    .expect("picked leaf has info");
                (li.stage as usize, li.q)
            };
            let batch_max = shared.stages[stage].batch_now[core].load(Ordering::Relaxed) as usize;
            let mut h = handlers[stage].take().expect("handler not re-entered");
            let b = h.run(&mut st, shared, q, batch_max);
            let end_raw = clock.raw();
            let cost = clock.delta_as_nanos(now_raw, end_raw);
            let end_ns = st.now_ns + cost;
            counters.dispatch_hist.record(cost);
            // Tasks woken during the dispatch are queued now, before the charge (enqueued at
            // its end): a task that woke itself, or another of its activity, leaves its leaf
            // backlogged, and the tree keeps it in place instead of taking it out and putting
            // it back (one charge rather than idle + ready). Their queueing is the loop's time.
            let still_backlogged = if super::task::wakes_pending() {
                let start_ns = std::mem::replace(&mut st.now_ns, end_ns);
                super::task::queue_wakes(&mut st, shared);
                st.now_ns = start_ns;
                h.backlogged(&mut st, q)
            } else {
                b.still_backlogged
            };
            handlers[stage] = Some(h);
            if task_stage == Some(stage) {
                // One poll per dispatch: the dispatch's length bounds the poll's (within the
                // loop's own few hundred ns), so no clock is read inside the poll itself. A
                // batch of polls timed each (`Batch::longest_ns`).
                let poll_ns = if b.messages > 1 { b.longest_ns } else { cost };
                super::task::check_poll_length(shared, b.activity, poll_ns);
            }
            if let Some(bc) = &mut batching[stage] {
                bc.window_messages += u64::from(b.messages);
                bc.window_ns += cost;
                if bc.window_ns >= BATCH_WINDOW_NS {
                    let per_s = bc.window_messages as f64 * 1e9 / bc.window_ns as f64;
                    let next = bc.controller.observe(per_s);
                    shared.stages[stage].batch_now[core].store(next, Ordering::Relaxed);
                    bc.window_messages = 0;
                    bc.window_ns = 0;
                }
            }
            // The scheduler is charged what the dispatch ran, not the time the thread lost to
            // preemption in it (the ledger keeps the whole stretch, as the loop's time).
            let sched_cost = lost.run_part(end_ns, cost, sys::thread_cpu_ns);
            st.tree.charge(leaf, sched_cost, still_backlogged, end_ns);
            let cell = &st.leaves[leaf as usize].as_ref().expect("leaf info").cell;
            cell.cpu_ns.add(cost);
            cell.dispatches.add(1);
            cell.messages.add(u64::from(b.messages));
            cell.queue_wait_ns.add(b.wait_ns);
            for &enq in &st.responses {
                cell.wait_hist.record(st.now_ns.saturating_sub(enq));
                cell.response_hist.record(end_ns.saturating_sub(enq));
            }
            if b.panics > 0 {
                cell.panics.add(u64::from(b.panics));
                counters.panics.add(u64::from(b.panics));
            }
            time.dispatch_ns += cost;
            counters.handled.add(u64::from(b.messages));
            shared.core_pending[core]
                .0
                .fetch_sub(b.messages as usize, Ordering::AcqRel);
            if let Some(g) = st.observe_gate.take() {
                if !st.deferred.is_empty() {
                    // Their samples come when their responses are done.
                    let (mut pos, mut next) = (0, 0);
                    let deferred = &st.deferred;
                    st.responses.retain(|_| {
                        let taken = deferred.get(next) == Some(&pos);
                        next += usize::from(taken);
                        pos += 1;
                        !taken
                    });
                    st.deferred.clear();
                }
                for r in st.responses.iter_mut() {
                    *r = end_ns.saturating_sub(*r);
                }
                if !st.responses.is_empty() {
                    g.observe(&st.responses, end_ns);
                }
            }
            seg_start = end_raw;
        } else {
            if !fresh {
                // The bypass found nothing on a reading up to a round old: read the clock
                // before deciding how long to sleep (a timer may be due by now).
                stale_idle = true;
                continue;
            }
            if ACCOUNTED {
                time.infra_ns += clock.delta_as_nanos(seg_start, now_raw);
            }
            let wait_ns = [
                st.next_timer_ns(),
                st.tree.next_decision_ns(st.now_ns),
                super::task::next_timer_ns(st.now_ns),
            ]
            .into_iter()
            .flatten()
            .min();
            mailbox.sleeping.store(true, Ordering::SeqCst);
            if !mailbox.messages.is_empty() || mailbox.control_pending.load(Ordering::SeqCst) {
                mailbox.sleeping.store(false, Ordering::SeqCst);
                seg_start = now_raw;
                continue;
            }
            // Wake at least every flush interval so counters stay fresh while idle.
            let wait = wait_ns.unwrap_or(FLUSH_INTERVAL_NS).min(FLUSH_INTERVAL_NS);
            let precise_armed = match &precise {
                Some(t) if wait < 1_000_000 => {
                    t.arm(wait.max(1));
                    true
                }
                _ => false,
            };
            // The OS's CPU clock on each side of the sleep: the kernel's CPU inside the
            // blocking poll (entering it, the wake-up, leaving it) is the runtime's cost of
            // sleeping, not idle time; so is the run-queue wait between the wake-up and
            // running again, settled at the next flush (`WakeQueue`). Two syscalls per sleep:
            // only an idle worker pays them. Each window edge is stamped by our clock at the
            // midpoint of its OS read (a clock read on each side of it): the OS samples its
            // clock somewhere inside the system call, so an edge stamped outside the read
            // leaves part of the read's own CPU on neither side (counted idle: about 1 % of a
            // lightly loaded worker's busy time here, 0.5-1 µs per sleep), and one stamped
            // inside would count that part twice. The midpoint errs by the read's asymmetry.
            // The bypass takes none of these readings.
            let (window_start, cpu_before) = if ACCOUNTED {
                stamped_cpu_read(clock, &mut time.read_uncertainty_ns)
            } else {
                (now_raw, 0)
            };
            if ACCOUNTED {
                let wall = clock.delta_as_nanos(wq.mark_raw, window_start);
                wq.close_segment(wall, window_start, cpu_before);
            }
            if let Err(e) = poll.poll(&mut events, Some(Duration::from_nanos(wait))) {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    eprintln!("omnistage: worker {core}: poll failed: {e}");
                }
            }
            let (window_end, cpu_after) = if ACCOUNTED {
                stamped_cpu_read(clock, &mut time.read_uncertainty_ns)
            } else {
                (0, 0)
            };
            let after = clock.raw();
            let window_end = if ACCOUNTED { window_end } else { after };
            if precise_armed {
                if let Some(t) = &precise {
                    t.arm(0);
                    t.clear();
                }
            }
            mailbox.sleeping.store(false, Ordering::SeqCst);
            let window = clock.delta_as_nanos(window_start, window_end);
            if ACCOUNTED {
                // The OS's readings lie inside the window; never move more than its length.
                let wake = cpu_after.saturating_sub(cpu_before).min(window);
                time.wake_ns += wake;
                time.idle_ns += window - wake;
                wq.sleep_room_ns += window - wake;
                // The next loop segment starts at the wake-up.
                wq.mark_raw = window_end;
                wq.mark_cpu_ns = cpu_after;
                // A sleep is not lost time: the next dispatch's check starts at the wake-up.
                lost = LostTime::new(shared.ns_of_raw(window_end), cpu_after);
                // Arming the sleep is the loop's work; so is the wake. What follows the window
                // falls in the next segment, which starts at `window_end`.
                time.infra_ns += clock.delta_as_nanos(now_raw, window_start) + wake;
            }
            seg_start = window_end;
            st.now_ns = shared.ns_of_raw(after);
            last_poll_ns = st.now_ns;
            dispatches_since_poll = 0;
            st.io_ready(shared, &events);
            // A full batch: take the rest of the kernel's ready list too (see IO_POLL_ROUNDS_MAX).
            let mut rounds = 1;
            while rounds < IO_POLL_ROUNDS_MAX && events.iter().count() >= IO_EVENTS_PER_POLL {
                rounds += 1;
                if poll.poll(&mut events, Some(Duration::ZERO)).is_err() {
                    break;
                }
                st.io_ready(shared, &events);
            }
            if ACCOUNTED {
                // The round after a sleep: from the wake-up to the ready list classified (one
                // clock read per sleep, paid only by a worker that slept).
                let t = clock.raw();
                counters
                    .io_round_hist
                    .record(clock.delta_as_nanos(after, t));
            }
        }
        if st.now_ns >= next_flush_ns || stop {
            flush(&mut time, &mut seg_start, &mut wq);
            counters.dropped.set(st.dropped);
            next_flush_ns = st.now_ns + FLUSH_INTERVAL_NS;
        }
    }
}

#[cfg(test)]
mod queue_room {
    use super::*;

    #[test]
    fn a_drained_queue_gives_back_what_a_burst_grew() {
        let mut q: VecDeque<[u64; 8]> = VecDeque::new();
        q.extend(std::iter::repeat_n([0; 8], 10_000));
        assert!(q.capacity() >= 10_000);
        // Not while it holds messages.
        q.drain(..9_999);
        release_burst(&mut q);
        assert!(q.capacity() >= 10_000);
        q.pop_front();
        release_burst(&mut q);
        assert!(q.capacity() <= QUEUE_CAPACITY_KEPT, "{}", q.capacity());
        // A queue that never grew past four times the room keeps what it has.
        let mut small: VecDeque<u8> = VecDeque::with_capacity(3 * QUEUE_CAPACITY_KEPT);
        let before = small.capacity();
        assert!(before <= 4 * QUEUE_CAPACITY_KEPT);
        release_burst(&mut small);
        assert_eq!(small.capacity(), before);
    }
}
