//! One worker: its tree, its typed queues, its timers and its I/O registrations (`CoreState`),
//! and the type-erased stages it dispatches. Its loop is in `run_loop`, the handler context
//! in `ctx`.

use super::gate::Gate;
use super::lost_time::LostTime;
use super::wake_queue::WakeQueue;
use super::{sys, Destination, HandlerFactory, SendError, SendOpts, Shared, StageRef, LOOP_STAGE};
use super::{DELAY_MAX_NS, MAILBOX_DRAIN_MAX};
use crate::account::{ActivityId, Cell, EdgeFrom, StageId, RETIRED};
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

mod activities;
mod ctx;
mod run_loop;

pub(crate) use activities::ActivityInfo;
use activities::{LocalActivity, QueueOps};

pub use ctx::{Ctx, DeferredResponse};
pub(crate) use run_loop::run;

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

/// Messages to a worker about the runtime itself.
#[derive(Clone, Debug)]
pub(crate) enum Control {
    Upsert(ActivityInfo),
    Remove(ActivityId),
    /// A task of this core was woken on another thread (its packed location; see `task`).
    WakeTask(u64),
    Stop,
}

// An `IoHandle` names its worker in 16 bits.
const _: () = assert!(super::WORKERS_MAX <= 1 << 16);

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
/// of a closed socket can never reach the socket that reused its slot, plus the worker, so a
/// handle used on another worker, whose own sources have the same indexes and generations,
/// is refused there instead of acting on that worker's unrelated source).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IoHandle {
    index: u32,
    generation: u32,
    core: u16,
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
    /// Taken from the mailbox: queued, or put on a timer if it was sent with a delay that has
    /// not passed.
    fn deliver(self: Box<Self>, st: &mut CoreState, shared: &Shared);
    /// Its time has come (a timer that fired): into its queue.
    fn deliver_due(self: Box<Self>, st: &mut CoreState, shared: &Shared);
    fn due_ns(&self) -> u64;
    /// For a sender whose push was refused, to take its message back.
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
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
            if self.due_ns > self.enq_ns {
                // Sent with a delay that has not passed by this loop's clock.
                st.add_timer(self, shared);
                return;
            }
            // Not delayed, but stamped after this loop last read its clock (the loop empties
            // its mailbox before reading it). It once went on a timer all the same: a heap
            // push and pop per message, its delivery put off to the next clock reading (up to
            // 32 dispatches in the bypass), and dropped after its sender was told Ok when the
            // timer table was full. Its time has come by the sender's clock, and so has that
            // of every timer due by its stamp: those go first, in the order they would have
            // fired in with it.
            st.fire_timers_until(shared, self.due_ns);
        }
        self.deliver_due(st, shared);
    }
    fn deliver_due(self: Box<Self>, st: &mut CoreState, shared: &Shared) {
        let Remote {
            stage,
            activity,
            enq_ns,
            due_ns,
            gate,
            msg,
        } = *self;
        let delayed = due_ns > enq_ns;
        if delayed {
            gate.delay_end();
            // Off the timer path: its place in this core's timers is free.
            shared.release_timer(st.core);
        }
        // A delayed message enters its queue now: its wait starts here, not at its send (the
        // delay it asked for is neither queue wait in the histograms nor response time for the
        // p90 controller). One sent without a delay keeps its send stamp: its time in the
        // mailbox is wait.
        let enq_ns = if delayed {
            due_ns.max(st.now_ns)
        } else {
            enq_ns
        };
        // Admitted before any removal of its activity: a removed activity still draining here
        // takes it.
        match st.queue_index_in::<M>(shared, stage, activity, Some(&gate)) {
            Ok(q) => {
                if delayed {
                    // Its queue place, taken now that it is due (not held over its delay):
                    // by the queue's gate, which gives it back at the dispatch.
                    let load = &shared.stages[stage as usize].load;
                    st.queues::<M>(stage).qs[q as usize].gate.force_admit(load);
                }
                st.push::<M>(stage, q, Envelope { msg, enq_ns })
            }
            // A delayed message held no queue place.
            Err(_) if delayed => st.drop_pending(shared),
            Err(_) => st.drop_admitted(shared, &gate, stage),
        }
    }
    fn due_ns(&self) -> u64 {
        self.due_ns
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
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
    /// Its activity was removed and still had messages here: the dispatch that leaves this
    /// queue empty checks whether the activity's queues on this core are all drained, and if
    /// so retires them (`CoreState::retire_if_drained`). Read with the leaf's stage and queue
    /// before the dispatch: the only cost to a live activity is a branch on it.
    retiring: bool,
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
    /// The typed operations a retirement needs on this stage's queues.
    fn queue_ops(&self) -> QueueOps;
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

    fn queue_ops(&self) -> QueueOps {
        QueueOps::of::<M>()
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
    /// Per stage: what retiring one of its queues needs (typed code behind a fn pointer).
    queue_ops: Vec<QueueOps>,
    /// (stage, activity) queues on this core.
    queue_count: usize,
    activities: IdMap<ActivityId, LocalActivity>,
    /// Activities removed since the mailbox was last emptied: once it has been, the messages
    /// sent to them before their removal are in their queues, and each is retired at once
    /// (nothing queued) or when its last queue here drains.
    retiring: Vec<ActivityId>,
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
        tree.set_wake_credit(shared.wake_credit_ns);
        let mut activities = IdMap::default();
        for a in table.iter() {
            activities.insert(
                a.id,
                LocalActivity::new(
                    ActivityInfo::of(&table, a.id),
                    (a.id == ROOT).then_some(tree.root()),
                ),
            );
        }
        drop(table);
        let st = CoreState {
            core,
            tree,
            bypass: shared.bypass,
            bypass_fifo: VecDeque::new(),
            leaves: Vec::new(),
            queues: handlers
                .iter()
                .map(|h| h.as_ref().expect("handler present at start").new_queues())
                .collect(),
            queue_ops: handlers
                .iter()
                .map(|h| h.as_ref().expect("handler present at start").queue_ops())
                .collect(),
            queue_count: 0,
            activities,
            retiring: Vec::new(),
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
        };
        st.publish_footprint(shared);
        st
    }

    /// The cell a handler's explicit record for `activity` goes to. A record for an activity
    /// that is gone (removed, and retired here or never seen here) goes to the retired
    /// aggregate of its stage, so it is neither lost nor the start of a cell that nothing
    /// would free.
    fn record_cell(&mut self, shared: &Shared, activity: ActivityId) -> Option<&Cell> {
        let mut key = (activity, self.current_stage);
        if !self.record_cells.contains_key(&key) {
            let known = self.activities.contains_key(&activity)
                || shared
                    .activities
                    .read()
                    .expect("activities lock")
                    .get(activity)
                    .is_some();
            let cell = if known {
                shared
                    .ledger
                    .cell(self.core, activity, self.current_stage)?
            } else {
                key = (RETIRED, self.current_stage);
                shared.ledger.retired_cell(self.core, self.current_stage)
            };
            self.record_cells.entry(key).or_insert(cell);
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
                    core: self.core as u16,
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
        if usize::from(h.core) != self.core {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "I/O handle of another worker",
            ));
        }
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

    /// Puts a delayed message on this core's timer heap. Its sender reserved its place
    /// ([`Shared::reserve_timer`]), so the heap never holds more than the runtime's bound.
    fn add_timer(&mut self, payload: Box<dyn Deliver>, shared: &Shared) {
        debug_assert!(
            self.timers.len() < shared.timers_max,
            "timer without a reservation"
        );
        self.timer_seq += 1;
        self.timers.push(Timer {
            due_ns: payload.due_ns(),
            seq: self.timer_seq,
            payload,
        });
    }

    /// Delivers the timers that are due; says whether any were.
    fn fire_timers(&mut self, shared: &Shared) -> bool {
        self.fire_timers_until(shared, self.now_ns)
    }

    /// Delivers the timers due by `until_ns` (a time that has come), in order; says whether
    /// any were.
    fn fire_timers_until(&mut self, shared: &Shared, until_ns: u64) -> bool {
        let mut fired = false;
        while let Some(t) = self.timers.peek() {
            if t.due_ns > until_ns {
                break;
            }
            let t = self.timers.pop().expect("peeked");
            t.payload.deliver_due(self, shared);
            fired = true;
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
