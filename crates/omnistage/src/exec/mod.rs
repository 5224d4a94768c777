//! `exec`: per-core workers — the only layer that owns threads and reads clocks.
//!
//! A [`Runtime`] runs one worker thread per core (count configurable, pinning optional). Each
//! worker owns one scheduling [`Tree`](crate::sched::Tree): a node per activity it has seen
//! (keyed machine-wide by the activity's shared tag) and, under each, a leaf per
//! (stage, activity) queue. The loop:
//!
//! ```text
//! loop:
//!   apply control messages (activity changes, stop); take messages other cores sent here
//!   fire due timers
//!   pick a leaf through the tree; take up to the stage's batch of messages
//!   set the current activity; read the clock; run the handler; read the clock
//!   charge the cost up the tree and into the ledger (activity, stage, core)
//!   nothing to do: block in epoll until a message, a timer or a shaper is due (idle time)
//! ```
//!
//! Every stretch of the loop between two clock reads is charged to something: a dispatch (its
//! activity), the loop's own work (`/infra`), or idle. The OS's count of the thread's CPU time
//! is recorded beside it so unattributed time is measured, not assumed.
//!
//! Sends: a message sent from a handler inherits the handler's activity; re-tagging is explicit
//! ([`Ctx::set_activity`]). A send to a queue on the same core goes straight into the typed
//! queue (no allocation, no lock); a send to another core allocates one box and goes through
//! that core's bounded lock-free mailbox. Every send passes the destination queue's gate first
//! and returns `Rejected` at once in the sender's context.
//!
//! Observation (what the admin API reads): every admitted send is counted on its (source
//! stage, destination stage) edge by the sending core ([`Runtime::edges`]); every message's
//! queue wait and response time go into its ledger cell's histograms
//! ([`Runtime::latencies`]); the gates give queue lengths and rejections per (stage, activity)
//! ([`Runtime::queues`]).

mod activities;
mod builder;
mod gate;
mod lost_time;
pub mod panic;
mod sys;
pub mod task;
mod task_io;
#[cfg(test)]
mod tests;
mod wake_queue;
mod worker;

pub use builder::{Builder, MIN_COST_NS_MAX, MIN_COST_NS_MIN, RESERVED_STAGE_NAMES};
pub use gate::{ClassGroup, Predicate, CLASS_GROUP_GATES_MAX};
pub use sys::{cpu_steal_ns, thread_cpu_ns};
pub use worker::{Ctx, DeferredResponse, IoEvent, IoHandle, IO_REGISTRATIONS_MAX};

use crate::account::{
    ActivityId, EdgeCounts, EdgeFrom, EdgeRow, LatencyRow, Ledger, Snapshot, StageId,
};
use crate::activity::{ActivityError, ActivitySpec, ActivityTable};
use crate::admit::{RejectReason, SharedQueueLimit, Verdict};
use crate::sched::PolicyKind;
use gate::{Gate, StageLoad};
use std::any::TypeId;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use worker::{Control, Deliver, Remote};

/// Most workers a runtime may have.
pub const WORKERS_MAX: usize = 256;
/// Most stages a runtime may have.
pub const STAGES_MAX: usize = 1024;
/// Capacity of each worker's cross-core mailbox (messages).
pub const MAILBOX_CAPACITY: usize = 1 << 16;
/// Most messages a worker takes from its mailbox per loop turn, so a flood from other cores
/// cannot keep it from dispatching.
pub const MAILBOX_DRAIN_MAX: usize = 4096;
/// Most pending timers per worker (memory: a boxed message and a heap entry each), and the
/// default of [`Builder::timers_max`].
pub const TIMERS_MAX: usize = 1 << 20;
/// Longest delay a send may ask for (`SendOpts::delay_ns`, `send_after`): one hour, the longest
/// timeout the HTTP server's configuration accepts. A timer holds a place in its core's timer
/// count for its whole delay, and `u64::MAX` (or `now + delay` saturating) meant never.
pub const DELAY_MAX_NS: u64 = 3_600_000_000_000;
/// Largest batch a stage may take per dispatch.
pub const BATCH_MAX: u32 = 1024;
/// Largest queue bound per (stage, activity).
pub const QUEUE_LIMIT_MAX: usize = 1 << 24;
/// Stage id reserved for the loop's own work in the ledger (charged to `/infra`).
pub const LOOP_STAGE: StageId = StageId::MAX - 1;
/// Stage id reserved in the ledger for bytes that moved outside the runtime and were reported
/// to it ([`Runtime::charge_external`]: a shaped program's I/O, `omnistage shape --admin`),
/// named `external`.
pub const EXTERNAL_STAGE: StageId = StageId::MAX - 2;
const _: () = assert!(STAGES_MAX < EXTERNAL_STAGE as usize);

/// Bytes that moved outside the runtime, charged with [`Runtime::charge_external`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExternalBytes {
    /// Received from the network.
    pub net_in: u64,
    /// Sent to the network.
    pub net_out: u64,
    /// Read from disk.
    pub disk_read: u64,
    /// Written to disk.
    pub disk_write: u64,
}

/// Settings of one stage.
#[derive(Clone, Debug)]
pub struct StageConfig {
    /// Most messages handed to one dispatch (SEDA's batching factor), 1..=BATCH_MAX.
    pub batch_max: u32,
    /// Bound on each (stage, activity) queue, summed over cores.
    pub queue_limit: usize,
    /// Admission predicate of each (stage, activity) queue.
    pub predicate: Predicate,
    /// Weight of this stage's leaf beside the other leaves and children of an activity.
    pub weight: u32,
    /// Optional stage-wide limit with share-aware shedding across activities.
    pub shared_limit: Option<SharedQueueLimit>,
    /// Let SEDA's batching controller tune the batch (per core, between 1 and `batch_max`)
    /// from the stage's measured throughput, instead of always taking `batch_max`.
    pub adaptive_batch: bool,
}

impl Default for StageConfig {
    fn default() -> Self {
        StageConfig {
            batch_max: 8,
            queue_limit: 65_536,
            predicate: Predicate::Threshold,
            weight: crate::sched::WEIGHT_DEFAULT,
            shared_limit: None,
            adaptive_batch: false,
        }
    }
}

impl StageConfig {
    fn validate(&self) -> Result<(), String> {
        if !(1..=BATCH_MAX).contains(&self.batch_max) {
            return Err(format!("batch_max must be in 1..={BATCH_MAX}"));
        }
        if !(1..=QUEUE_LIMIT_MAX).contains(&self.queue_limit) {
            return Err(format!("queue_limit must be in 1..={QUEUE_LIMIT_MAX}"));
        }
        if !(crate::sched::WEIGHT_MIN..=crate::sched::WEIGHT_MAX).contains(&self.weight) {
            return Err(format!("stage weight {} out of range", self.weight));
        }
        self.predicate.validate()?;
        Ok(())
    }
}

/// A typed handle to a registered stage.
pub struct StageRef<M> {
    id: StageId,
    _m: PhantomData<fn(M)>,
}

impl<M> Clone for StageRef<M> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<M> Copy for StageRef<M> {}

impl<M> StageRef<M> {
    pub fn id(&self) -> StageId {
        self.id
    }
}

/// Where a message should run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Affinity {
    /// The sender's core when sent from a handler; else the least loaded core.
    #[default]
    Any,
    /// Same key, same core while the mapping lives (TTL); new keys go to the least loaded core.
    Key(u64),
    /// This core.
    Core(u16),
}

/// Header fields a sender may set (the activity is inherited unless given).
#[derive(Clone, Copy, Debug, Default)]
pub struct SendOpts {
    pub activity: Option<ActivityId>,
    pub affinity: Affinity,
    /// Messages with the same (source stage, activity, order key) are handled in send order.
    pub order: Option<u64>,
    /// Deliver no earlier than this many ns from now (a timer), at most [`DELAY_MAX_NS`]. A
    /// delayed send passes its queue's gate when it is sent (predicate, shedding, the queue as
    /// it is then) and takes its queue place when it is due.
    pub delay_ns: u64,
}

/// One (stage, activity) queue as [`Runtime::queues`] reports it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QueueStat {
    pub stage: StageId,
    pub activity: ActivityId,
    /// Admitted and waiting for a dispatch, all cores (as [`Runtime::queued`]).
    pub queued: usize,
    /// Admitted with a delay and still waiting for their time (timers). Not held against the
    /// queue bound: each takes its place in `queued` when it is due.
    pub delayed: usize,
    /// Refused at the gate since it was created.
    pub rejected: u64,
    /// Token rate of its predicate's bucket, if it has one.
    pub rate_per_s: Option<f64>,
}

/// Why a send failed. The message is dropped; nothing else changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendError {
    /// The queue is full, its predicate said no, or its activity was shed.
    Rejected(RejectReason),
    NoSuchActivity(ActivityId),
    NoSuchCore(u16),
    /// The destination core's mailbox is full.
    MailboxFull,
    /// Too many timers pending on the destination core.
    TooManyTimers,
    /// The delay asked for is longer than [`DELAY_MAX_NS`].
    DelayTooLong,
    /// The runtime is stopping.
    Stopped,
    /// No stage of this id takes this message type here: the `StageRef` is another
    /// runtime's.
    NoSuchStage(StageId),
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}
impl std::error::Error for SendError {}

/// Errors from building or changing the runtime.
#[derive(Debug)]
pub enum RuntimeError {
    Config(String),
    Activity(ActivityError),
    Io(std::io::Error),
}

impl std::fmt::Display for RuntimeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RuntimeError::Config(s) => write!(f, "configuration: {s}"),
            RuntimeError::Activity(e) => write!(f, "{e}"),
            RuntimeError::Io(e) => write!(f, "{e}"),
        }
    }
}
impl std::error::Error for RuntimeError {}

impl From<ActivityError> for RuntimeError {
    fn from(e: ActivityError) -> Self {
        RuntimeError::Activity(e)
    }
}

pub(crate) type HandlerFactory = Box<dyn Fn(usize) -> Box<dyn worker::ErasedStage> + Send + Sync>;

pub(crate) struct StageMeta {
    pub(crate) name: String,
    pub(crate) config: StageConfig,
    pub(crate) load: StageLoad,
    pub(crate) type_id: TypeId,
    /// The batch each core uses now (`batch_max` unless the stage is adaptive).
    pub(crate) batch_now: Vec<std::sync::atomic::AtomicU32>,
}

/// Placement of affinity keys: key → (core, expiry). Striped so senders on different cores
/// rarely meet; only sends that carry an affinity key come here.
struct AffinityTable {
    shards: Vec<Mutex<AffinityShard>>,
    ttl_ns: u64,
}

struct AffinityShard {
    map: HashMap<u64, (u16, u64)>,
    /// A full shard sweeps out its expired mappings no earlier than this (once per TTL).
    next_sweep_ns: u64,
}

/// Shards of the affinity table (senders on different cores rarely share a lock).
const AFFINITY_SHARDS: usize = 16;
/// Most live affinity mappings per shard (memory: about 16 bytes each plus the map's room).
const AFFINITY_PER_SHARD_MAX: usize = 1 << 16;
/// Mappings a full shard looks at to make room for a new key when its sweep finds nothing
/// expired: the expired among them go, or else the one used longest ago. Bounded so that a
/// shard full of live keys costs each new key this many steps under its lock, not a pass over
/// the whole shard (which also left the key out, so that each of its messages was placed on
/// the least-loaded core again and its affinity was lost).
const AFFINITY_EVICT_SCAN: usize = 64;

impl AffinityTable {
    fn new(shards: usize, ttl_ns: u64) -> Self {
        AffinityTable {
            shards: (0..shards)
                .map(|_| {
                    Mutex::new(AffinityShard {
                        map: HashMap::new(),
                        next_sweep_ns: 0,
                    })
                })
                .collect(),
            ttl_ns,
        }
    }

    fn place(&self, key: u64, now_ns: u64, least_loaded: impl FnOnce() -> u16) -> u16 {
        let shard = &self.shards
            [(key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60) as usize % self.shards.len()];
        let mut sh = shard.lock().expect("affinity lock");
        let expiry = now_ns.saturating_add(self.ttl_ns);
        if let Some((core, exp)) = sh.map.get_mut(&key) {
            if *exp > now_ns {
                *exp = expiry;
                return *core;
            }
        }
        if sh.map.len() >= AFFINITY_PER_SHARD_MAX && !sh.map.contains_key(&key) {
            if now_ns >= sh.next_sweep_ns {
                sh.map.retain(|_, (_, exp)| *exp > now_ns);
                sh.next_sweep_ns = expiry;
            }
            if sh.map.len() >= AFFINITY_PER_SHARD_MAX {
                Self::evict_one(&mut sh.map, now_ns);
            }
        }
        let core = least_loaded();
        sh.map.insert(key, (core, expiry));
        core
    }

    /// Makes room in a full shard by a bounded look: the expired mappings among the first
    /// [`AFFINITY_EVICT_SCAN`] go, or if none is, the one of them used longest ago.
    fn evict_one(map: &mut HashMap<u64, (u16, u64)>, now_ns: u64) {
        let mut expired = [0u64; AFFINITY_EVICT_SCAN];
        let mut n = 0;
        let mut oldest: Option<(u64, u64)> = None;
        for (&k, &(_, exp)) in map.iter().take(AFFINITY_EVICT_SCAN) {
            if exp <= now_ns {
                expired[n] = k;
                n += 1;
            } else if oldest.is_none_or(|(e, _)| exp < e) {
                oldest = Some((exp, k));
            }
        }
        if n > 0 {
            for k in &expired[..n] {
                map.remove(k);
            }
        } else if let Some((_, k)) = oldest {
            map.remove(&k);
        }
    }
}

pub(crate) struct Mailbox {
    pub(crate) messages: crossbeam_queue::ArrayQueue<Box<dyn Deliver>>,
    pub(crate) control: Mutex<Vec<Control>>,
    pub(crate) control_pending: AtomicBool,
    pub(crate) sleeping: AtomicBool,
    pub(crate) waker: mio::Waker,
}

impl Mailbox {
    pub(crate) fn wake(&self) {
        if self.sleeping.swap(false, Ordering::SeqCst) {
            // A failed wake leaves the worker to its poll timeout; nothing is lost.
            let _ = self.waker.wake();
        }
    }
}

/// State every thread of a runtime shares.
pub(crate) struct Shared {
    pub(crate) workers: usize,
    pub(crate) clock: quanta::Clock,
    pub(crate) start_raw: u64,
    pub(crate) ledger: Ledger,
    /// Messages per (source, destination stage) edge.
    pub(crate) edges: EdgeCounts,
    pub(crate) activities: RwLock<ActivityTable>,
    pub(crate) stages: Vec<StageMeta>,
    gates: RwLock<HashMap<(StageId, ActivityId), Arc<Gate>>>,
    /// Predicates set for one (stage, activity), overriding the stage's.
    predicates: RwLock<HashMap<(StageId, ActivityId), Predicate>>,
    pub(crate) mailboxes: Vec<Mailbox>,
    /// Messages admitted for each core and not yet handled (queued, in a mailbox, on a timer,
    /// or in the handler now).
    pub(crate) core_pending: Vec<CachePadded>,
    /// Timers of each core: on its timer heap, or on their way to it (in a mailbox), each
    /// reserved by its sender before it is sent ([`Shared::reserve_timer`]) and given back
    /// when its message leaves the timer path. At most `timers_max` each.
    pub(crate) core_timers: Vec<CachePadded>,
    /// Most timers per core ([`Builder::timers_max`], at most [`TIMERS_MAX`]).
    pub(crate) timers_max: usize,
    /// What each worker holds per activity, as it last published it ([`Runtime::footprint`]).
    pub(crate) footprints: Vec<FootprintCounters>,
    affinity: AffinityTable,
    pub(crate) stopping: AtomicBool,
    pub(crate) bypass: bool,
    pub(crate) min_cost_ns: u64,
    /// Every fair-queue node's wake credit, ns ([`Builder::wake_credit_ns`]).
    pub(crate) wake_credit_ns: u64,
    /// The task stage and its settings, if the runtime runs tasks ([`Builder::tasks`]).
    pub(crate) tasks: Option<task::TaskShared>,
    /// The CPUs the workers are pinned to, in core order (empty when they are not pinned).
    worker_cpus: Vec<usize>,
}

/// What one worker holds for activities, as [`Runtime::footprint`] reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CoreFootprint {
    pub core: usize,
    /// Activities the worker keeps an entry for (live ones it has seen, and removed ones whose
    /// queues there are still draining).
    pub activities: usize,
    /// Nodes in its scheduling tree (root, activity nodes and (stage, activity) leaves).
    pub tree_nodes: usize,
    /// Its (stage, activity) queues.
    pub queues: usize,
    /// Its ledger cells.
    pub cells: usize,
}

/// A worker's counts behind [`CoreFootprint`], published by the worker whenever they change
/// (on activity changes and new queues, never per message).
#[derive(Default)]
pub(crate) struct FootprintCounters {
    pub(crate) activities: AtomicUsize,
    pub(crate) tree_nodes: AtomicUsize,
    pub(crate) queues: AtomicUsize,
}

/// An `AtomicUsize` on its own cache line, so cores do not share lines of each other's counts.
#[repr(align(128))]
#[derive(Default)]
pub(crate) struct CachePadded(pub(crate) AtomicUsize);

impl Shared {
    /// Nanoseconds since the runtime started, by the TSC clock.
    pub(crate) fn now_ns(&self) -> u64 {
        self.clock.delta_as_nanos(self.start_raw, self.clock.raw())
    }

    pub(crate) fn ns_of_raw(&self, raw: u64) -> u64 {
        self.clock.delta_as_nanos(self.start_raw, raw)
    }

    pub(crate) fn gate(
        &self,
        stage: StageId,
        activity: ActivityId,
    ) -> Result<Arc<Gate>, SendError> {
        if let Some(g) = self
            .gates
            .read()
            .expect("gates lock")
            .get(&(stage, activity))
        {
            return Ok(g.clone());
        }
        // Weight and predicate are read under the gates' write lock: a `set_activity` or
        // `set_admission` that changes them either lands before (and is read here) or walks the
        // gates after this one is in. Lock order everywhere: gates, then predicates.
        let mut gates = self.gates.write().expect("gates lock");
        if let Some(g) = gates.get(&(stage, activity)) {
            return Ok(g.clone());
        }
        #[cfg(test)]
        tests::gate_hook();
        // The activities' lock is taken inside the gates' lock here, so nothing may take the
        // gates' lock while holding the activities' (`Runtime::remove_activity` drops its
        // gates after the table change, outside it). A removed activity is out of the table
        // before its gates are dropped, so no gate for it is made here after that drop.
        let weight = {
            let t = self.activities.read().expect("activities lock");
            t.get(activity)
                .ok_or(SendError::NoSuchActivity(activity))?
                .spec
                .weight
        };
        let cfg = &self.stages[stage as usize].config;
        let predicate = self
            .predicates
            .read()
            .expect("predicates lock")
            .get(&(stage, activity))
            .cloned()
            .unwrap_or_else(|| cfg.predicate.clone());
        let g = Arc::new(Gate::new(cfg.queue_limit, weight, &predicate));
        g.attach(&predicate);
        gates.insert((stage, activity), g.clone());
        Ok(g)
    }

    /// Checks that `to` names a stage of this runtime that takes `M`: a `StageRef` of another
    /// runtime may name an id that is absent here or whose stage takes another type, and such
    /// a message reached the typed queues' downcast on the destination worker, outside any
    /// handler's `catch_unwind` (the worker thread died). A bounds check and a type-id compare
    /// on the stage's entry that the send reads anyway.
    #[inline]
    pub(crate) fn check_stage<M: 'static>(&self, to: &StageRef<M>) -> Result<(), SendError> {
        match self.stages.get(to.id as usize) {
            Some(s) if s.type_id == TypeId::of::<M>() => Ok(()),
            _ => Err(SendError::NoSuchStage(to.id)),
        }
    }

    /// Reserves a place in `core`'s timers for a delayed message about to be sent there, or
    /// says there is none. Every sender reserves, on any thread, so the bound holds for
    /// messages still in a mailbox too (a remote one was once checked by nobody, told `Ok`,
    /// and dropped by the destination when its table was full).
    pub(crate) fn reserve_timer(&self, core: usize) -> Result<(), SendError> {
        self.core_timers[core]
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.timers_max).then_some(n + 1)
            })
            .map(|_| ())
            .map_err(|_| SendError::TooManyTimers)
    }

    /// Gives back a place reserved with [`Shared::reserve_timer`].
    pub(crate) fn release_timer(&self, core: usize) {
        self.core_timers[core].0.fetch_sub(1, Ordering::AcqRel);
    }

    fn least_loaded(&self) -> u16 {
        let mut best = 0usize;
        let mut best_load = usize::MAX;
        for (i, c) in self.core_pending.iter().enumerate() {
            let l = c.0.load(Ordering::Relaxed);
            if l < best_load {
                best = i;
                best_load = l;
            }
        }
        best as u16
    }

    /// Chooses the destination core of a send.
    pub(crate) fn route(
        &self,
        from_core: Option<usize>,
        source_stage: StageId,
        activity: ActivityId,
        opts: &SendOpts,
        now_ns: u64,
    ) -> Result<usize, SendError> {
        let core = match opts.affinity {
            Affinity::Core(c) => {
                if c as usize >= self.workers {
                    return Err(SendError::NoSuchCore(c));
                }
                c as usize
            }
            Affinity::Key(k) => self.affinity.place(k, now_ns, || self.least_loaded()) as usize,
            Affinity::Any => match opts.order {
                // Order keys map to a core by hash alone (no TTL), so a stream of ordered
                // messages can never be split across cores by an expiring mapping.
                Some(o) => {
                    let h = (u64::from(source_stage) << 32 | u64::from(activity))
                        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                        ^ o.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
                    (h % self.workers as u64) as usize
                }
                None => match from_core {
                    Some(c) => c,
                    None => self.least_loaded() as usize,
                },
            },
        };
        Ok(core)
    }

    /// Sends from outside any worker, or to another core: gate, box, mailbox.
    pub(crate) fn send_remote<M: Send + 'static>(
        &self,
        core: usize,
        gate: &Arc<Gate>,
        to: Destination,
        msg: M,
    ) -> Result<(), SendError> {
        self.send_remote_or_back(core, gate, to, msg)
            .map_err(|(e, _)| e)
    }

    /// [`Shared::send_remote`], handing a refused message back (a spawn disarms what its drop
    /// would otherwise do: end a task that was never started).
    pub(crate) fn send_remote_or_back<M: Send + 'static>(
        &self,
        core: usize,
        gate: &Arc<Gate>,
        to: Destination,
        msg: M,
    ) -> Result<(), (SendError, M)> {
        let Destination {
            stage,
            activity,
            enq_ns,
            due_ns,
        } = to;
        if self.stopping.load(Ordering::Acquire) {
            // Its worker may have ended: the message would sit in a mailbox nobody drains.
            // (One racing with `shutdown` can still get in; shutdown drops what is queued.)
            return Err((SendError::Stopped, msg));
        }
        let load = &self.stages[stage as usize].load;
        let delayed = due_ns > enq_ns;
        if delayed {
            if let Err(e) = self.reserve_timer(core) {
                return Err((e, msg));
            }
            // Through the gate like any send, but it takes its queue place only when due: a
            // timer is bounded by its core's timer count, not by the queue bound (it would hold
            // a queue place for its whole delay). See `Gate::admit_delayed`.
            if let Verdict::Reject(r) = gate.admit_delayed(load, enq_ns) {
                self.release_timer(core);
                return Err((SendError::Rejected(r), msg));
            }
            gate.delay_begin();
        } else if let Verdict::Reject(r) = gate.admit(load, enq_ns) {
            return Err((SendError::Rejected(r), msg));
        }
        self.core_pending[core].0.fetch_add(1, Ordering::AcqRel);
        let boxed: Box<dyn Deliver> = Box::new(Remote {
            stage,
            activity,
            enq_ns,
            due_ns,
            gate: gate.clone(),
            msg,
        });
        let mb = &self.mailboxes[core];
        if let Err(boxed) = mb.messages.push(boxed) {
            if delayed {
                gate.delay_end();
                self.release_timer(core);
            } else {
                gate.release(load);
            }
            self.core_pending[core].0.fetch_sub(1, Ordering::AcqRel);
            let back = boxed
                .into_any()
                .downcast::<Remote<M>>()
                .expect("the box made just above");
            return Err((SendError::MailboxFull, back.msg));
        }
        mb.wake();
        Ok(())
    }

    fn broadcast(&self, c: impl Fn() -> Control) {
        for mb in &self.mailboxes {
            mb.control.lock().expect("control lock").push(c());
            mb.control_pending.store(true, Ordering::Release);
            mb.sleeping.store(true, Ordering::SeqCst);
            mb.wake();
        }
    }
}

/// Where and when a remote message goes.
pub(crate) struct Destination {
    pub(crate) stage: StageId,
    pub(crate) activity: ActivityId,
    pub(crate) enq_ns: u64,
    pub(crate) due_ns: u64,
}

/// A running runtime. Dropping it stops the workers (messages still queued are dropped).
pub struct Runtime {
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Runtime {
    pub fn builder() -> Builder {
        Builder::default()
    }

    pub fn workers(&self) -> usize {
        self.shared.workers
    }

    /// The CPUs the workers are pinned to, in core order; empty when they are not pinned.
    pub fn worker_cpus(&self) -> &[usize] {
        &self.shared.worker_cpus
    }

    /// Sets up the calling thread as one of the server's helper threads (a blocking disk
    /// reader, say). Only when the workers are pinned (a server given its CPUs): the thread is
    /// confined to the workers' CPUs, so the helpers never take a CPU the server was not given
    /// (a load generator's, a neighbour process's), and it gets nice value `nice` (0 leaves it
    /// as it is), so the kernel runs a worker ahead of it when both want the same CPU. With
    /// unpinned workers the thread is left as it is: it shares the machine with everything
    /// else, and a low priority there would rank it below every other process too. Both steps
    /// are tried; the first failure is returned for the caller to report (the thread still
    /// works where it is).
    pub fn enter_helper_thread(&self, nice: i32) -> std::io::Result<()> {
        if self.shared.worker_cpus.is_empty() {
            return Ok(());
        }
        let confined = sys::confine_to(&self.shared.worker_cpus);
        let niced = if nice != 0 {
            sys::set_thread_nice(nice)
        } else {
            Ok(())
        };
        confined.and(niced)
    }

    /// Nanoseconds since start by the runtime's clock.
    pub fn now_ns(&self) -> u64 {
        self.shared.now_ns()
    }

    /// Sends a message from outside the workers, to `activity`.
    pub fn send<M: Send + 'static>(
        &self,
        to: &StageRef<M>,
        activity: ActivityId,
        affinity: Affinity,
        msg: M,
    ) -> Result<(), SendError> {
        self.send_with(
            to,
            SendOpts {
                activity: Some(activity),
                affinity,
                ..Default::default()
            },
            msg,
        )
    }

    /// Sends with full options; `opts.activity` defaults to `/infra` outside a handler.
    pub fn send_with<M: Send + 'static>(
        &self,
        to: &StageRef<M>,
        opts: SendOpts,
        msg: M,
    ) -> Result<(), SendError> {
        let s = &self.shared;
        if s.stopping.load(Ordering::Acquire) {
            return Err(SendError::Stopped);
        }
        s.check_stage(to)?;
        if opts.delay_ns > DELAY_MAX_NS {
            return Err(SendError::DelayTooLong);
        }
        let activity = opts.activity.unwrap_or(crate::activity::INFRA);
        let now = s.now_ns();
        let core = s.route(None, StageId::MAX, activity, &opts, now)?;
        let gate = s.gate(to.id, activity)?;
        let dest = Destination {
            stage: to.id,
            activity,
            enq_ns: now,
            due_ns: now.saturating_add(opts.delay_ns),
        };
        s.send_remote(core, &gate, dest, msg)?;
        s.edges.record(core, EdgeFrom::External, to.id);
        Ok(())
    }

    /// Messages admitted and not yet handled, over all cores.
    pub fn pending(&self) -> usize {
        self.shared
            .core_pending
            .iter()
            .map(|c| c.0.load(Ordering::Acquire))
            .sum()
    }

    /// Messages handled so far, over all cores (counted in bypass mode too).
    pub fn handled(&self) -> u64 {
        (0..self.shared.workers)
            .map(|c| self.shared.ledger.core(c).handled.get())
            .sum()
    }

    /// A copy of the ledger.
    pub fn snapshot(&self) -> Snapshot {
        self.shared.ledger.snapshot()
    }

    /// What each worker holds for activities now: its activity entries, tree nodes,
    /// (stage, activity) queues and ledger cells. The worker counts are as it last published
    /// them (each worker does so whenever one changes, between dispatches), so they lag a
    /// control message or a first send by at most the worker's current dispatch.
    pub fn footprint(&self) -> Vec<CoreFootprint> {
        let s = &self.shared;
        s.footprints
            .iter()
            .enumerate()
            .map(|(core, f)| CoreFootprint {
                core,
                activities: f.activities.load(Ordering::Acquire),
                tree_nodes: f.tree_nodes.load(Ordering::Acquire),
                queues: f.queues.load(Ordering::Acquire),
                cells: s.ledger.cell_count(core),
            })
            .collect()
    }

    /// Runs `f` over the activity table (read-only).
    pub fn with_activities<R>(&self, f: impl FnOnce(&ActivityTable) -> R) -> R {
        f(&self.shared.activities.read().expect("activities lock"))
    }

    pub fn activity_id(&self, path: &str) -> Option<ActivityId> {
        self.with_activities(|t| t.lookup(path))
    }

    /// Name of a stage.
    pub fn stage_name(&self, id: StageId) -> Option<&str> {
        if id == LOOP_STAGE {
            return Some("loop");
        }
        if id == EXTERNAL_STAGE {
            return Some("external");
        }
        self.shared.stages.get(id as usize).map(|s| s.name.as_str())
    }

    /// The batch a stage takes per dispatch on `core` now (moves only for adaptive stages).
    pub fn batch_size(&self, stage: StageId, core: usize) -> Option<u32> {
        self.shared
            .stages
            .get(stage as usize)
            .and_then(|s| s.batch_now.get(core))
            .map(|b| b.load(Ordering::Relaxed))
    }

    /// Number of registered stages (ids `0..stage_count()`).
    pub fn stage_count(&self) -> usize {
        self.shared.stages.len()
    }

    /// The settings a stage was registered with.
    pub fn stage_config(&self, id: StageId) -> Option<&StageConfig> {
        self.shared.stages.get(id as usize).map(|s| &s.config)
    }

    /// Timers waiting to fire on every core (delayed sends: `send_after`, `SendOpts::delay_ns`),
    /// counting those still on their way to their core's timers. Each core holds at most
    /// [`Builder::timers_max`] ([`TIMERS_MAX`] unless set); a delayed send beyond that is
    /// refused with [`SendError::TooManyTimers`].
    pub fn timers_pending(&self) -> usize {
        self.shared
            .core_timers
            .iter()
            .map(|c| c.0.load(Ordering::Relaxed))
            .sum()
    }

    /// Messages admitted to the (stage, activity) queue and waiting for a dispatch (queued
    /// or in a mailbox on their way), summed over cores; delayed messages still waiting for
    /// their time are not counted (see [`QueueStat::delayed`]). 0 if nothing was ever sent
    /// there.
    pub fn queued(&self, stage: StageId, activity: ActivityId) -> usize {
        self.shared
            .gates
            .read()
            .expect("gates lock")
            .get(&(stage, activity))
            .map(|g| g.queued.load(Ordering::Acquire))
            .unwrap_or(0)
    }

    /// The Little's-law bound of the (stage, activity) queue when its p90 predicate sets one
    /// (`P90Params::queue_bound_fraction`), else `None`.
    pub fn queue_bound(&self, stage: StageId, activity: ActivityId) -> Option<usize> {
        self.shared
            .gates
            .read()
            .expect("gates lock")
            .get(&(stage, activity))
            .and_then(|g| g.queue_bound())
    }

    /// Every (stage, activity) queue that has been used: its queued count, rejections and
    /// admission rate, in (stage, activity) order.
    pub fn queues(&self) -> Vec<QueueStat> {
        let mut v: Vec<QueueStat> = self
            .shared
            .gates
            .read()
            .expect("gates lock")
            .iter()
            .map(|(&(stage, activity), g)| QueueStat {
                stage,
                activity,
                queued: g.queued.load(Ordering::Relaxed),
                delayed: g.delayed.load(Ordering::Relaxed),
                rejected: g.rejected.load(Ordering::Relaxed),
                rate_per_s: g.rate_per_s(),
            })
            .collect();
        v.sort_by_key(|q| (q.stage, q.activity));
        v
    }

    /// The admission predicate in force for (stage, activity): its own if one was set with
    /// [`Runtime::set_admission`], else the stage's.
    pub fn admission(&self, stage: StageId, activity: ActivityId) -> Option<Predicate> {
        let s = &self.shared;
        let meta = s.stages.get(stage as usize)?;
        Some(
            s.predicates
                .read()
                .expect("predicates lock")
                .get(&(stage, activity))
                .cloned()
                .unwrap_or_else(|| meta.config.predicate.clone()),
        )
    }

    /// The predicate set for (stage, activity) with [`Runtime::set_admission`], if any (`None`:
    /// the stage's own applies). What to put back to undo a change: [`Runtime::admission`]
    /// gives the predicate in force, which is the stage's when nothing was set.
    pub fn admission_override(&self, stage: StageId, activity: ActivityId) -> Option<Predicate> {
        self.shared
            .predicates
            .read()
            .expect("predicates lock")
            .get(&(stage, activity))
            .cloned()
    }

    /// Messages counted per edge of the stage graph since start (sends that were admitted,
    /// from handlers, from I/O readiness and from outside), summed over cores.
    pub fn edges(&self) -> Vec<EdgeRow> {
        self.shared.edges.edges()
    }

    /// Queue-wait and response-time histograms per (activity, stage, core) since start.
    pub fn latencies(&self) -> Vec<LatencyRow> {
        self.shared.ledger.latencies()
    }

    /// Per core since start: how long each dispatch and each I/O round held the worker's loop
    /// (scheduled mode; the bypass records none), the stretches in which it could pick nothing.
    pub fn stretches(&self) -> Vec<crate::account::StretchRow> {
        self.shared.ledger.stretches()
    }

    /// Rejections counted at the gate of (stage, activity).
    pub fn rejected(&self, stage: StageId, activity: ActivityId) -> u64 {
        self.shared
            .gates
            .read()
            .expect("gates lock")
            .get(&(stage, activity))
            .map(|g| g.rejected.load(Ordering::Relaxed))
            .unwrap_or(0)
    }

    /// Stops the workers and waits for them. Idempotent.
    pub fn shutdown(&self) {
        self.shared.stopping.store(true, Ordering::Release);
        self.shared.broadcast(|| Control::Stop);
        let threads = std::mem::take(&mut *self.threads.lock().expect("threads lock"));
        for t in threads {
            // A worker that panicked outside a handler has already been reported by the panic
            // hook; shutting down goes on for the others.
            let _ = t.join();
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.shutdown();
    }
}
