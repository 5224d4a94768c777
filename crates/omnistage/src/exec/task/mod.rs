//! `task`: async tasks as scheduled clients of a core's tree.
//!
//! A task is a future spawned in an activity on a core. It is a client of that activity's leaf
//! for the runtime's task stage (registered by [`Builder::tasks`]): a task that is woken is a
//! message queued in the (task stage, activity) queue of its core, and each poll is one
//! dispatch of that stage polls up to [`TASK_BATCH_DEFAULT`] of the activity's queued tasks
//! (`TaskConfig::stage`'s `batch_max`; the batch also ends once it has run for the poll limit),
//! picked through the tree and measured,
//! charged, gated, shaped and capped like any message. Tasks stay on their core
//! (thread-per-core): `!Send` futures are spawned on the current core; `Send` ones may be sent
//! to another ([`spawn_on`], [`Runtime::spawn`]).
//!
//! How a wake reaches the queue:
//!
//! ```text
//! waker.wake() on the task's own core ── scheduled flag (one atomic swap: queued at most once)
//!                                      └─ push (core, slot, generation) on this thread's wake
//!                                         list, whose capacity was reserved at spawn
//! waker.wake() on any other thread ──── the same flag, then a control message to the task's
//!                                       core (a lock and an allocation; cross-core only)
//! the worker loop, before each pick ─── moves the wake list into the task stage's queues
//! a dispatch of the task stage ──────── polls the task once, with the worker's `Ctx` at hand
//! ```
//!
//! So a same-core wake allocates nothing and takes no lock: a thread-local list (no lock, its
//! `RefCell` is only ever borrowed for the push) with room for every task of the core, and a
//! queue push that reuses the queue's grown capacity. `tests/task_alloc.rs` counts it.
//!
//! Spawning asks the (task stage, activity) gate like a send (a refused spawn returns
//! `Rejected`); a wake of an admitted task is never refused. A spawned task inherits the
//! spawner's activity; [`set_activity`] re-tags the running task explicitly. A poll that runs
//! longer than [`TaskConfig::poll_limit_ns`] is counted per activity ([`Runtime::long_polls`]):
//! cooperative code cannot be preempted, so it is at least seen (Seastar's task-quota
//! violations).
//!
//! Timers ([`sleep`], [`timeout`]) and sockets ([`TcpListener`], [`TcpStream`]) live on the
//! worker's own timers and poller; see `task_io.rs`.
//!
//! Layout: this file holds a task's state, its place on its core, the loop's side and the task
//! stage; `spawn.rs` spawning and join handles, `inside.rs` what a running task can ask,
//! `timers.rs` sleeps and timeouts.

use super::gate::Gate;
use super::worker::{Control, CoreState};
use super::{Affinity, Builder, Ctx, Runtime, RuntimeError, SendError, SendOpts, Shared};
use super::{StageConfig, StageRef};
use crate::account::{ActivityId, StageId};
use crate::activity::INFRA;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::future::Future;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

pub(super) use super::task_io::{io_event, io_live, IO_TOKEN_BASE};
pub use super::task_io::{Accept, TcpListener, TcpStream, TASK_SOCKETS_MAX};
#[cfg(feature = "hyper")]
pub use super::task_io::{TaskExecutor, TaskTimer};

/// Most live tasks per core.
pub const TASKS_PER_CORE_MAX: usize = 1 << 20;
/// Most pending task timers (sleeps) per core; a sleep past this completes at once and is
/// counted in [`TaskStats::timers_refused`].
pub const TASK_TIMERS_MAX: usize = 1 << 20;
/// Default task batch: polls of one activity's queued tasks per dispatch, as a stage's default
/// batch, and a batch also ends once it has run for the poll limit. With 1 (each poll its own
/// dispatch) a keep-alive /hello served 0.81× Tokio's requests; with 8, 0.97× with the shares
/// still within 0.4 points (`exp tasks`, quiet 2-vCPU machine, 2026-11-24).
pub const TASK_BATCH_DEFAULT: u32 = 8;
/// Default [`TaskConfig::poll_limit_ns`]: Seastar's default task quota.
pub const POLL_LIMIT_DEFAULT_NS: u64 = 500_000;

/// Settings of a runtime's tasks.
#[derive(Clone, Debug)]
pub struct TaskConfig {
    /// The task stage: its queue bound and predicate (applied to spawns), its weight beside an
    /// activity's other leaves, and its batch: how many queued tasks of one activity one
    /// dispatch polls ([`TASK_BATCH_DEFAULT`] by default; 1 makes each poll a dispatch, picked
    /// by the tree). A batch spares the pick and the charge for all but one poll (the /hello
    /// experiment's cost) at the price of a coarser grain of the shares: the tree charges the
    /// batch's time, so the shares of CPU still hold, over up to `batch_max` polls at a time,
    /// and a batch ends once it has run for `poll_limit_ns` (the rest waits its turn).
    pub stage: StageConfig,
    /// A poll longer than this is counted as a long poll of its activity.
    pub poll_limit_ns: u64,
}

impl Default for TaskConfig {
    fn default() -> Self {
        TaskConfig {
            stage: StageConfig {
                batch_max: TASK_BATCH_DEFAULT,
                ..Default::default()
            },
            poll_limit_ns: POLL_LIMIT_DEFAULT_NS,
        }
    }
}

/// Long polls of one activity (polls that ran past the configured limit).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LongPolls {
    pub activity: ActivityId,
    pub count: u64,
    /// The longest such poll, ns.
    pub worst_ns: u64,
}

/// Counters of a runtime's tasks over all cores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TaskStats {
    pub spawned: u64,
    pub completed: u64,
    /// Sleeps that found their core's timer table full and completed at once.
    pub timers_refused: u64,
    /// Task socket reads, writes and accepts that found nothing to do (`WouldBlock`): each
    /// is a syscall spent for no work. A socket's readiness spares most of them.
    pub io_would_block: u64,
}

/// What the runtime keeps about tasks (in `Shared`).
pub(crate) struct TaskShared {
    stage: StageId,
    poll_limit_ns: u64,
    /// Written only when a poll runs long, so a lock is fine.
    long_polls: Mutex<BTreeMap<ActivityId, LongPolls>>,
    spawned: AtomicU64,
    completed: AtomicU64,
    timers_refused: AtomicU64,
    pub(super) io_would_block: AtomicU64,
}

/// Why a spawn failed (nothing was started).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpawnError {
    /// Not on a worker thread of a runtime with tasks (use [`Runtime::spawn`] from outside).
    NotOnWorker,
    /// The runtime was built without [`Builder::tasks`].
    TasksDisabled,
    /// This core has [`TASKS_PER_CORE_MAX`] live tasks.
    TooManyTasks,
    /// The task stage's gate refused it, or the activity or core does not exist.
    Send(SendError),
}

impl std::fmt::Display for SpawnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}
impl std::error::Error for SpawnError {}

/// Why a [`JoinHandle`] has no output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JoinError {
    /// [`JoinHandle::abort`] dropped the task before it finished.
    Aborted,
    /// The task panicked (counted in the ledger as a panic of the task stage).
    Panicked,
    /// The runtime stopped before the task finished.
    Stopped,
}

impl std::fmt::Display for JoinError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}
impl std::error::Error for JoinError {}

/// Not inside a task on a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NotInTask;

impl std::fmt::Display for NotInTask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("not inside a task on a worker")
    }
}
impl std::error::Error for NotInTask {}

// ---------------------------------------------------------------------------------------------
// Where a task is: packed in one u64 so a waker reads it with one atomic load.

/// Not yet installed on its core (a cross-core spawn in flight).
const LOC_NONE: u64 = u64::MAX;
/// In a wake-list entry: the spawn already passed the gate (do not count it twice).
const LOC_ADMITTED: u64 = 1 << 55;
const SLOT_BITS: u32 = 23;

fn loc(core: usize, slot: u32, generation: u32) -> u64 {
    debug_assert!(core < 256 && (slot as usize) < TASKS_PER_CORE_MAX);
    (core as u64) << 56 | u64::from(slot) << 32 | u64::from(generation)
}
fn loc_core(l: u64) -> usize {
    (l >> 56) as usize
}
fn loc_slot(l: u64) -> u32 {
    ((l >> 32) as u32) & ((1 << SLOT_BITS) - 1)
}
fn loc_gen(l: u64) -> u32 {
    l as u32
}

const STATE_RUNNING: u8 = 0;
const STATE_ABORTED: u8 = 1;
const STATE_PANICKED: u8 = 2;
const STATE_DONE: u8 = 3;

/// The part of a task that wakers and join handles share (any thread).
struct Header {
    /// Which runtime (the address of its `Shared`): a wake on a worker of another runtime is
    /// remote even if the core number matches.
    runtime: usize,
    shared: Weak<Shared>,
    /// Packed (core, slot, generation), or `LOC_NONE` until installed.
    loc: AtomicU64,
    /// Queued (or about to be polled): further wakes do nothing.
    scheduled: AtomicBool,
    /// Asked to stop by `abort`.
    abort: AtomicBool,
    state: AtomicU8,
}

impl Wake for Header {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if self.scheduled.swap(true, Ordering::AcqRel) {
            return;
        }
        let l = self.loc.load(Ordering::Acquire);
        if l == LOC_NONE {
            // Its first poll comes with its install on the core.
            return;
        }
        // The same-core path: no allocation (capacity reserved at spawn), no lock.
        let local = WAKES
            .try_with(|w| match w.try_borrow_mut() {
                Ok(mut w) if w.runtime == self.runtime && w.core == loc_core(l) => {
                    w.list.push(l);
                    true
                }
                _ => false,
            })
            .unwrap_or(false);
        if !local {
            if let Some(shared) = self.shared.upgrade() {
                shared.control_to(loc_core(l), Control::WakeTask(l));
            }
        }
    }
}

/// The wake list of the current worker thread (empty identity off a worker).
struct Wakes {
    runtime: usize,
    core: usize,
    list: Vec<u64>,
}

type LocalFuture = Pin<Box<dyn Future<Output = ()>>>;

/// One task's place on its core.
struct Slot {
    generation: u32,
    activity: ActivityId,
    /// `None` while free, or while the task is being polled.
    future: Option<LocalFuture>,
    header: Option<Arc<Header>>,
    waker: Option<Waker>,
    /// The gate that admitted a local spawn ([`spawn_in`]), until the task's first queueing:
    /// its place goes with the task to the queue, or is given back if that queue cannot be had.
    spawn_gate: Option<Arc<Gate>>,
}

/// A pending sleep (see [`Sleep`]).
type TimerKey = (u64, u64);

/// A worker's tasks, timers and task sockets (thread-local: only its own thread touches it).
pub(super) struct CoreTasks {
    pub(super) shared: Arc<Shared>,
    pub(super) core: usize,
    stage: StageId,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// The other half of the wake list's double buffer (same capacity).
    spare: Vec<u64>,
    timers: BTreeMap<TimerKey, Waker>,
    timer_seq: u64,
    /// Wakers of due timers, reused.
    fired: Vec<Waker>,
    pub(super) io: super::task_io::IoTable,
}

thread_local! {
    static WAKES: RefCell<Wakes> = const {
        RefCell::new(Wakes { runtime: 0, core: 0, list: Vec::new() })
    };
    pub(super) static CORE: RefCell<Option<CoreTasks>> = const { RefCell::new(None) };
    /// The task being polled: its activity and location.
    static CURRENT: Cell<Option<(ActivityId, u64)>> = const { Cell::new(None) };
    /// The `Ctx` of the dispatch polling the current task (null outside a poll).
    static CTX: Cell<*mut ()> = const { Cell::new(std::ptr::null_mut()) };
}

/// Runs `f` on this worker's task state, if this thread is a worker of a runtime with tasks.
/// Never called while user code runs inside `f`.
pub(super) fn with_core<R>(f: impl FnOnce(&mut CoreTasks) -> R) -> Option<R> {
    CORE.try_with(|c| c.try_borrow_mut().ok()?.as_mut().map(f))
        .ok()
        .flatten()
}

// ---------------------------------------------------------------------------------------------
// Set-up.

impl Builder {
    /// Lets the runtime run async tasks: registers the task stage (named `task`).
    pub fn tasks(mut self, config: TaskConfig) -> Result<Self, RuntimeError> {
        if self.tasks.is_some() {
            return Err(RuntimeError::Config("tasks enabled twice".into()));
        }
        let stage: StageRef<TaskMsg> = self.stage("task", config.stage, |_core| run_message)?;
        self.tasks = Some(TaskShared {
            stage: stage.id(),
            poll_limit_ns: config.poll_limit_ns,
            long_polls: Mutex::new(BTreeMap::new()),
            spawned: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            timers_refused: AtomicU64::new(0),
            io_would_block: AtomicU64::new(0),
        });
        Ok(self)
    }
}

impl TaskShared {
    /// The task stage's id.
    pub(super) fn stage(&self) -> StageId {
        self.stage
    }

    pub(super) fn poll_limit_ns(&self) -> u64 {
        self.poll_limit_ns
    }
}

impl Shared {
    /// Sends one control message to one core (remote task wakes).
    pub(super) fn control_to(&self, core: usize, c: Control) {
        let Some(mb) = self.mailboxes.get(core) else {
            return;
        };
        mb.control.lock().expect("control lock").push(c);
        mb.control_pending.store(true, Ordering::Release);
        mb.wake();
    }

    fn runtime_id(&self) -> usize {
        self as *const Shared as usize
    }
}

/// Clears this thread's task state when the worker ends (its tasks are dropped here, on their
/// own thread, so `!Send` futures never leave it).
pub(super) struct WorkerTasks {
    active: bool,
}

impl Drop for WorkerTasks {
    fn drop(&mut self) {
        if !self.active {
            return;
        }
        let _ = WAKES.try_with(|w| {
            let mut w = w.borrow_mut();
            w.runtime = 0;
            w.list = Vec::new();
        });
        // Taken out first: the futures' own drops may call back into task functions.
        let core = CORE.try_with(|c| c.borrow_mut().take()).ok().flatten();
        if let Some(mut core) = core {
            for slot in &mut core.slots {
                if let Some(h) = &slot.header {
                    let _ = h.state.compare_exchange(
                        STATE_RUNNING,
                        STATE_DONE,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    );
                }
                drop(slot.future.take());
            }
            drop(core);
        }
    }
}

/// Sets this worker thread's task state up (nothing if the runtime has no tasks).
pub(super) fn enter_worker(
    core: usize,
    shared: &Arc<Shared>,
    registry: &mio::Registry,
) -> std::io::Result<WorkerTasks> {
    let Some(t) = &shared.tasks else {
        return Ok(WorkerTasks { active: false });
    };
    let registry = registry.try_clone()?;
    WAKES.with(|w| {
        let mut w = w.borrow_mut();
        w.runtime = shared.runtime_id();
        w.core = core;
    });
    CORE.with(|c| {
        *c.borrow_mut() = Some(CoreTasks {
            shared: shared.clone(),
            core,
            stage: t.stage,
            slots: Vec::new(),
            free: Vec::new(),
            spare: Vec::new(),
            timers: BTreeMap::new(),
            timer_seq: 0,
            fired: Vec::new(),
            io: super::task_io::IoTable::new(registry),
        })
    });
    Ok(WorkerTasks { active: true })
}

// ---------------------------------------------------------------------------------------------
// The loop's side.

/// A remote wake arrived in this core's control channel: put it on the wake list.
pub(super) fn wake_from_remote(l: u64) {
    let _ = WAKES.try_with(|w| w.borrow_mut().list.push(l));
}

/// Once per loop turn: wakes due timers, then queues every woken task in its activity's task
/// queue. Says whether it did anything.
pub(super) fn turn(st: &mut CoreState, shared: &Shared) -> bool {
    if shared.tasks.is_none() {
        return false;
    }
    let fired = fire_timers(st.now_ns());
    // Most turns find the list empty (a dispatch's own wakes were queued before its charge).
    fired | (wakes_pending() && queue_wakes(st, shared))
}

/// Whether this thread's wake list holds wakes (a cheap look before [`queue_wakes`]).
pub(super) fn wakes_pending() -> bool {
    WAKES
        .try_with(|w| w.try_borrow().is_ok_and(|w| !w.list.is_empty()))
        .unwrap_or(false)
}

/// Queues every woken task in its activity's task queue; says whether there were any.
pub(super) fn queue_wakes(st: &mut CoreState, shared: &Shared) -> bool {
    let Some((stage, mut list)) = with_core(|c| {
        let mut spare = std::mem::take(&mut c.spare);
        WAKES.with(|w| std::mem::swap(&mut w.borrow_mut().list, &mut spare));
        (c.stage, spare)
    }) else {
        return false;
    };
    let any = !list.is_empty();
    for &entry in &list {
        let admitted = entry & LOC_ADMITTED != 0;
        let l = entry & !LOC_ADMITTED;
        let Some((activity, spawn_gate)) = with_core(|c| {
            let s = c.slots.get_mut(loc_slot(l) as usize)?;
            (s.generation == loc_gen(l) && s.header.is_some())
                .then(|| (s.activity, s.spawn_gate.take().filter(|_| admitted)))
        })
        .flatten() else {
            continue;
        };
        if !st.push_forced(shared, stage, activity, TaskMsg::Run(l), admitted) {
            // Its activity is gone: the task goes on in /infra rather than hang. A new task's
            // place in its activity's gate (taken by `spawn_in`) is given back: the /infra
            // queue counts it anew. Kept, it held the gate's and the stage's counts up for
            // good (with a shared limit, until spawns were refused for everyone).
            if let Some(gate) = spawn_gate {
                gate.release(&shared.stages[stage as usize].load);
            }
            with_core(|c| c.slots[loc_slot(l) as usize].activity = INFRA);
            if !st.push_forced(shared, stage, INFRA, TaskMsg::Run(l), false) {
                eprintln!(
                    "omnistage: a woken task could not be queued on core {}",
                    st.core()
                );
            }
        }
    }
    list.clear();
    with_core(|c| c.spare = list);
    any
}

/// Counts a poll that ran past the limit (`took_ns`: its dispatch's length, measured by the
/// loop) as a long poll of `activity`.
pub(super) fn check_poll_length(shared: &Shared, activity: ActivityId, took_ns: u64) {
    let Some(tasks) = &shared.tasks else {
        return;
    };
    if took_ns <= tasks.poll_limit_ns {
        return;
    }
    let mut m = tasks.long_polls.lock().expect("long polls lock");
    let e = m.entry(activity).or_insert(LongPolls {
        activity,
        ..Default::default()
    });
    e.count += 1;
    e.worst_ns = e.worst_ns.max(took_ns);
}

impl TaskShared {
    /// Folds a removed activity's long polls into those of [`RETIRED`](crate::account::RETIRED)
    /// (counts added, the worst kept), so the map holds no entry per removed activity. Each
    /// core that retires the activity calls this; a long poll of its last queued task on
    /// another core comes after and is folded by that core.
    pub(crate) fn retire_long_polls(&self, activity: ActivityId) {
        let mut m = self.long_polls.lock().expect("long polls lock");
        if let Some(old) = m.remove(&activity) {
            let retired = crate::account::RETIRED;
            let e = m.entry(retired).or_insert(LongPolls {
                activity: retired,
                ..Default::default()
            });
            e.count += old.count;
            e.worst_ns = e.worst_ns.max(old.worst_ns);
        }
    }
}

/// Wakes the tasks whose sleeps are due; says whether any were.
fn fire_timers(now_ns: u64) -> bool {
    let Some(fired) = with_core(|c| {
        // The common turn: nothing due, one look at the first deadline.
        if !matches!(c.timers.first_key_value(), Some((k, _)) if k.0 <= now_ns) {
            return None;
        }
        let mut fired = std::mem::take(&mut c.fired);
        while let Some(entry) = c.timers.first_entry() {
            if entry.key().0 > now_ns {
                break;
            }
            fired.push(entry.remove());
        }
        Some(fired)
    })
    .flatten() else {
        return false;
    };
    let any = !fired.is_empty();
    let mut fired = fired;
    // Woken outside the borrow: a waker may be anyone's.
    for w in fired.drain(..) {
        w.wake();
    }
    with_core(|c| c.fired = fired);
    any
}

/// How long until this core's next task timer, if any.
pub(super) fn next_timer_ns(now_ns: u64) -> Option<u64> {
    with_core(|c| {
        c.timers
            .first_key_value()
            .map(|(k, _)| k.0.saturating_sub(now_ns))
    })
    .flatten()
}

// ---------------------------------------------------------------------------------------------
// The task stage.

/// A message of the task stage: poll a task of this core, or install one sent from elsewhere.
pub(crate) enum TaskMsg {
    Run(u64),
    Spawn(RemoteSpawn),
}

pub(crate) struct RemoteSpawn {
    /// Builds the future on its core (so it need not be `Send` itself); taken when it runs.
    make: Option<Box<dyn FnOnce() -> LocalFuture + Send>>,
    header: Arc<Header>,
    /// Dropped now, this spawn ends its task (and counts it completed): true from its send
    /// until its task is installed (from then on its polls say how it ended). False for a
    /// spawn whose send was refused: no task was started.
    ends_task: bool,
}

/// A spawn that ends before its task is installed ends its task too: its `make` panicked, its
/// core had no room, or the message was dropped on the way (the activity's queue could not be
/// made on the core because the activity was removed meanwhile, the core's timer table was
/// full, the runtime stopped with it still queued). Without this its join handle stayed
/// running for ever (`is_finished` false, awaiting it gave `Stopped` even for a panic) and
/// `completed` never counted it.
impl Drop for RemoteSpawn {
    fn drop(&mut self) {
        if !self.ends_task {
            return;
        }
        // A panic of `make` was marked by the wrapper `send_spawn` made (before the output's
        // sender was dropped); anything else stopped it, unless it was asked to abort.
        let end = if self.header.abort.load(Ordering::Acquire) {
            STATE_ABORTED
        } else {
            STATE_DONE
        };
        let _ = self.header.state.compare_exchange(
            STATE_RUNNING,
            end,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        if let Some(shared) = self.header.shared.upgrade() {
            if let Some(t) = &shared.tasks {
                t.completed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// The task stage's handler: one poll per message.
fn run_message(ctx: &mut Ctx<'_>, msg: TaskMsg) {
    let l = match msg {
        TaskMsg::Run(l) => l,
        TaskMsg::Spawn(mut r) => {
            let activity = ctx.activity();
            // A panic here is the task's (the dispatch counts it); `r` ends it as it unwinds.
            let future = (r.make.take().expect("a spawn is made once"))();
            match with_core(|c| c.install(r.header.clone(), future, activity)) {
                Some(Ok(l)) => {
                    r.ends_task = false;
                    l
                }
                // Full: `r` ends it (its join handle sees it stopped), then the future is
                // dropped (here, outside the core's borrow), which wakes a handle's awaiter.
                refused => {
                    drop(r);
                    drop(refused);
                    return;
                }
            }
        }
    };
    poll_task(ctx, l);
}

/// Polls the task at `l` once (the dispatch the loop measures and charges).
fn poll_task(ctx: &mut Ctx<'_>, l: u64) {
    let taken = with_core(|c| {
        let s = c.slots.get_mut(loc_slot(l) as usize)?;
        if s.generation != loc_gen(l) || s.future.is_none() {
            return None; // stale: the task ended after this wake was queued
        }
        Some((
            s.future.take().expect("checked"),
            s.waker.take().expect("live slot has a waker"),
            s.header.take().expect("live slot has a header"),
            s.activity,
        ))
    })
    .flatten();
    let Some((mut future, waker, header, activity)) = taken else {
        return;
    };
    // Wakes from here on queue it again. A swap, not a store: with a store, the poll's reads
    // of what a waker published could pass it (a store then a load, which x86 reorders), and a
    // waker on another thread could still see `true` and not queue it: a lost wake-up. As an
    // acquiring read-modify-write it either reads a waker's `true` (and with it what the
    // waker published before its swap) or comes first, and then the waker queues it.
    header.scheduled.swap(false, Ordering::AcqRel);
    if header.abort.load(Ordering::Acquire) {
        header.state.store(STATE_ABORTED, Ordering::Release);
        finish(l, future, ctx.shared);
        return;
    }
    let shared = ctx.shared;
    CURRENT.set(Some((activity, l)));
    CTX.set(ctx as *mut Ctx<'_> as *mut ());
    // The poll's length is checked by the loop from the dispatch's (`check_poll_length`).
    let polled = catch_unwind(AssertUnwindSafe(|| {
        future.as_mut().poll(&mut Context::from_waker(&waker))
    }));
    CTX.set(std::ptr::null_mut());
    let activity_now = CURRENT.take().map(|(a, _)| a).unwrap_or(activity);
    match polled {
        Ok(Poll::Pending) => {
            with_core(|c| {
                let s = &mut c.slots[loc_slot(l) as usize];
                s.future = Some(future);
                s.waker = Some(waker);
                s.header = Some(header);
                s.activity = activity_now;
            });
        }
        Ok(Poll::Ready(())) => {
            header.state.store(STATE_DONE, Ordering::Release);
            finish(l, future, shared);
        }
        Err(panic) => {
            header.state.store(STATE_PANICKED, Ordering::Release);
            finish(l, future, shared);
            // The dispatch counts it as the task stage's panic.
            resume_unwind(panic);
        }
    }
}

/// Frees a task's slot and drops its future (outside the borrow: drops run user code).
fn finish(l: u64, future: LocalFuture, shared: &Shared) {
    with_core(|c| {
        let slot = loc_slot(l);
        let s = &mut c.slots[slot as usize];
        s.generation = s.generation.wrapping_add(1);
        s.header = None;
        s.waker = None;
        c.free.push(slot);
    });
    if let Some(t) = &shared.tasks {
        t.completed.fetch_add(1, Ordering::Relaxed);
    }
    drop(future);
}

impl CoreTasks {
    /// Puts a task in a slot of this core; returns its location. Refused (the core is full),
    /// it hands the future back, to be dropped by the caller outside the core's borrow: a drop
    /// runs user code (a socket's deregistration, a sleep's cancel) that needs the core.
    fn install(
        &mut self,
        header: Arc<Header>,
        future: LocalFuture,
        activity: ActivityId,
    ) -> Result<u64, (SpawnError, LocalFuture)> {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                if self.slots.len() >= TASKS_PER_CORE_MAX {
                    return Err((SpawnError::TooManyTasks, future));
                }
                self.slots.push(Slot {
                    generation: 0,
                    activity,
                    future: None,
                    header: None,
                    waker: None,
                    spawn_gate: None,
                });
                // One wake-list entry per task fits without growing (both halves), so a wake
                // never allocates. A stale entry of a finished task can add one more now and
                // then; the slack covers it.
                let want = self.slots.len() + 64;
                WAKES.with(|w| {
                    let list = &mut w.borrow_mut().list;
                    list.reserve(want.saturating_sub(list.len()));
                });
                self.spare.reserve(want);
                (self.slots.len() - 1) as u32
            }
        };
        let s = &mut self.slots[slot as usize];
        let l = loc(self.core, slot, s.generation);
        header.loc.store(l, Ordering::Release);
        header.scheduled.store(true, Ordering::Release);
        s.activity = activity;
        s.spawn_gate = None;
        s.waker = Some(Waker::from(header.clone()));
        s.header = Some(header);
        s.future = Some(future);
        Ok(l)
    }
}

mod inside;
mod spawn;
mod timers;

pub use inside::*;
pub use spawn::*;
pub use timers::*;
