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

// ---------------------------------------------------------------------------------------------
// Spawning.

/// A handle to a task's output. Awaiting it gives the output or why there is none; dropping it
/// detaches the task (it runs on).
pub struct JoinHandle<T> {
    rx: futures_channel::oneshot::Receiver<T>,
    header: Arc<Header>,
}

impl<T> JoinHandle<T> {
    /// Asks the task to stop: it is dropped at its next turn (without being polled again).
    /// A task that already finished keeps its output.
    pub fn abort(&self) {
        self.header.abort.store(true, Ordering::Release);
        self.header.wake_by_ref();
    }

    /// The task has ended (finished, aborted, panicked, or dropped at shutdown).
    pub fn is_finished(&self) -> bool {
        self.header.state.load(Ordering::Acquire) != STATE_RUNNING
    }
}

impl<T> Future for JoinHandle<T> {
    type Output = Result<T, JoinError>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match Pin::new(&mut self.rx).poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(v)) => Poll::Ready(Ok(v)),
            Poll::Ready(Err(_)) => {
                Poll::Ready(Err(match self.header.state.load(Ordering::Acquire) {
                    STATE_ABORTED => JoinError::Aborted,
                    STATE_PANICKED => JoinError::Panicked,
                    _ => JoinError::Stopped,
                }))
            }
        }
    }
}

fn new_header(shared: &Arc<Shared>) -> Arc<Header> {
    Arc::new(Header {
        runtime: shared.runtime_id(),
        shared: Arc::downgrade(shared),
        loc: AtomicU64::new(LOC_NONE),
        scheduled: AtomicBool::new(true),
        abort: AtomicBool::new(false),
        state: AtomicU8::new(STATE_RUNNING),
    })
}

/// Wraps a future so its output goes to a join handle.
fn with_output<F: Future + 'static>(
    future: F,
) -> (
    impl Future<Output = ()>,
    futures_channel::oneshot::Receiver<F::Output>,
) {
    let (tx, rx) = futures_channel::oneshot::channel();
    (
        async move {
            let out = future.await;
            // The handle may be gone (detached): the output is dropped.
            let _ = tx.send(out);
        },
        rx,
    )
}

/// Spawns `future` on this core in the current activity (the running task's, or `/infra` off
/// a task). Must be called on a worker thread; `!Send` futures are fine.
pub fn spawn<F>(future: F) -> Result<JoinHandle<F::Output>, SpawnError>
where
    F: Future + 'static,
{
    spawn_in(activity().unwrap_or(INFRA), future)
}

/// Spawns `future` on this core in `activity` (an explicit re-tag).
pub fn spawn_in<F>(activity: ActivityId, future: F) -> Result<JoinHandle<F::Output>, SpawnError>
where
    F: Future + 'static,
{
    let shared = with_core(|c| c.shared.clone()).ok_or(SpawnError::NotOnWorker)?;
    let tasks = shared.tasks.as_ref().ok_or(SpawnError::TasksDisabled)?;
    if shared.stopping.load(Ordering::Acquire) {
        return Err(SpawnError::Send(SendError::Stopped));
    }
    // A spawn is new work: the gate may refuse it like a send.
    let gate = shared
        .gate(tasks.stage, activity)
        .map_err(SpawnError::Send)?;
    let load = &shared.stages[tasks.stage as usize].load;
    if let crate::admit::Verdict::Reject(r) = gate.admit(load, shared.now_ns()) {
        return Err(SpawnError::Send(SendError::Rejected(r)));
    }
    let header = new_header(&shared);
    let (wrapped, rx) = with_output(future);
    let mut gate = Some(gate);
    let installed = with_core(|c| {
        let l = c.install(header.clone(), Box::pin(wrapped), activity)?;
        // The place goes with the task's first wake (`queue_wakes`).
        c.slots[loc_slot(l) as usize].spawn_gate = gate.take();
        Ok(l)
    })
    .expect("checked above");
    match installed {
        Ok(l) => {
            WAKES.with(|w| w.borrow_mut().list.push(l | LOC_ADMITTED));
            tasks.spawned.fetch_add(1, Ordering::Relaxed);
            Ok(JoinHandle { rx, header })
        }
        Err((e, future)) => {
            // Dropped outside the core's borrow (see `install`).
            drop(future);
            if let Some(gate) = gate {
                gate.release(load);
            }
            Err(e)
        }
    }
}

/// Spawns a `Send` future on `core` (this core or another) in the current activity.
pub fn spawn_on<F>(core: u16, future: F) -> Result<JoinHandle<F::Output>, SpawnError>
where
    F: Future + Send + 'static,
    F::Output: Send,
{
    let here = with_core(|c| c.core).ok_or(SpawnError::NotOnWorker)?;
    if usize::from(core) == here {
        return spawn(future);
    }
    let activity = activity().unwrap_or(INFRA);
    let shared = with_core(|c| c.shared.clone()).ok_or(SpawnError::NotOnWorker)?;
    send_spawn(&shared, activity, Affinity::Core(core), move || future)
}

/// Sends a spawn through the task stage's gate and the destination core's mailbox; `make`
/// builds the future there.
fn send_spawn<F, M>(
    shared: &Arc<Shared>,
    activity: ActivityId,
    affinity: Affinity,
    make: M,
) -> Result<JoinHandle<F::Output>, SpawnError>
where
    M: FnOnce() -> F + Send + 'static,
    F: Future + 'static,
    F::Output: Send,
{
    let tasks = shared.tasks.as_ref().ok_or(SpawnError::TasksDisabled)?;
    if shared.stopping.load(Ordering::Acquire) {
        return Err(SpawnError::Send(SendError::Stopped));
    }
    let header = new_header(shared);
    let (tx, rx) = futures_channel::oneshot::channel();
    let marks = header.clone();
    let make: Box<dyn FnOnce() -> LocalFuture + Send> = Box::new(move || {
        // A panicking `make` is the task's panic: marked before the output's sender is dropped,
        // so a handle woken by that drop already reads it.
        let future = match catch_unwind(AssertUnwindSafe(make)) {
            Ok(f) => f,
            Err(panic) => {
                let _ = marks.state.compare_exchange(
                    STATE_RUNNING,
                    STATE_PANICKED,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
                drop(tx);
                resume_unwind(panic);
            }
        };
        drop(marks);
        Box::pin(async move {
            // The handle may be gone (detached): the output is dropped.
            let _ = tx.send(future.await);
        })
    });
    let opts = SendOpts {
        activity: Some(activity),
        affinity,
        ..Default::default()
    };
    let now = shared.now_ns();
    let core = shared
        .route(None, StageId::MAX, activity, &opts, now)
        .map_err(SpawnError::Send)?;
    let gate = shared
        .gate(tasks.stage, activity)
        .map_err(SpawnError::Send)?;
    let dest = super::Destination {
        stage: tasks.stage,
        activity,
        enq_ns: now,
        due_ns: now,
    };
    let msg = TaskMsg::Spawn(RemoteSpawn {
        make: Some(make),
        header: header.clone(),
        ends_task: true,
    });
    if let Err((e, msg)) = shared.send_remote_or_back(core, &gate, dest, msg) {
        if let TaskMsg::Spawn(mut r) = msg {
            // Refused: no task was started, so there is none to end or count.
            r.ends_task = false;
        }
        return Err(SpawnError::Send(e));
    }
    tasks.spawned.fetch_add(1, Ordering::Relaxed);
    Ok(JoinHandle { rx, header })
}

impl Runtime {
    /// Spawns a `Send` future from outside the workers, in `activity`, on the core `affinity`
    /// names (`Any`: the least loaded).
    pub fn spawn<F>(
        &self,
        activity: ActivityId,
        affinity: Affinity,
        future: F,
    ) -> Result<JoinHandle<F::Output>, SpawnError>
    where
        F: Future + Send + 'static,
        F::Output: Send,
    {
        send_spawn(&self.shared, activity, affinity, move || future)
    }

    /// Spawns a future that need not be `Send`: `make` is sent to the chosen core and builds
    /// it there (thread-per-core: the future never leaves that core).
    pub fn spawn_with<F, M>(
        &self,
        activity: ActivityId,
        affinity: Affinity,
        make: M,
    ) -> Result<JoinHandle<F::Output>, SpawnError>
    where
        M: FnOnce() -> F + Send + 'static,
        F: Future + 'static,
        F::Output: Send,
    {
        send_spawn(&self.shared, activity, affinity, make)
    }

    /// Long polls per activity since start (polls past [`TaskConfig::poll_limit_ns`]).
    pub fn long_polls(&self) -> Vec<LongPolls> {
        self.shared
            .tasks
            .as_ref()
            .map(|t| {
                t.long_polls
                    .lock()
                    .expect("long polls lock")
                    .values()
                    .copied()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Task counters over all cores (zero without tasks).
    pub fn task_stats(&self) -> TaskStats {
        self.shared
            .tasks
            .as_ref()
            .map(|t| TaskStats {
                spawned: t.spawned.load(Ordering::Relaxed),
                completed: t.completed.load(Ordering::Relaxed),
                timers_refused: t.timers_refused.load(Ordering::Relaxed),
                io_would_block: t.io_would_block.load(Ordering::Relaxed),
            })
            .unwrap_or_default()
    }

    /// The task stage's id, if the runtime has tasks (its rows in the ledger are the polls).
    pub fn task_stage(&self) -> Option<StageId> {
        self.shared.tasks.as_ref().map(|t| t.stage)
    }
}

impl Ctx<'_> {
    /// Spawns a task on this core in the current activity (a stage starting async work).
    pub fn spawn<F>(&mut self, future: F) -> Result<JoinHandle<F::Output>, SpawnError>
    where
        F: Future + 'static,
    {
        spawn_in(self.activity(), future)
    }
}

// ---------------------------------------------------------------------------------------------
// Inside a task.

/// The activity of the running task (`None` outside a task's poll).
pub fn activity() -> Option<ActivityId> {
    CURRENT.get().map(|(a, _)| a)
}

/// The core this thread works for (`None` off a worker with tasks).
pub fn core() -> Option<usize> {
    with_core(|c| c.core)
}

/// Re-tags the running task: its later polls are charged to `activity`, and tasks it spawns
/// inherit it. The current poll stays charged to the activity it started in; `.await` a
/// [`yield_now`] to move to the new activity's queue at once.
pub fn set_activity(activity: ActivityId) -> Result<(), NotInTask> {
    let (_, l) = CURRENT.get().ok_or(NotInTask)?;
    CURRENT.set(Some((activity, l)));
    Ok(())
}

/// Runs `f` with the `Ctx` of the dispatch that polls the running task: sends to stages,
/// records bytes, registers I/O, all in the task's activity.
pub fn with_ctx<R>(f: impl FnOnce(&mut Ctx<'_>) -> R) -> Result<R, NotInTask> {
    // Taken out while in use, so a nested call finds none and cannot alias it.
    let p = CTX.replace(std::ptr::null_mut());
    if p.is_null() {
        return Err(NotInTask);
    }
    struct Restore(*mut ());
    impl Drop for Restore {
        fn drop(&mut self) {
            CTX.set(self.0);
        }
    }
    let _restore = Restore(p);
    // SAFETY: `p` was made by `poll_task` from the `&mut Ctx` of the dispatch that is polling
    // the running task, and it is cleared before `poll_task` uses that `Ctx` again or
    // returns, so it points to a live `Ctx` here. `poll_task` does not touch the `Ctx` while
    // the task is polled, and the pointer is taken out of the cell for the duration of `f`,
    // so this is the only `&mut` to it.
    let ctx = unsafe { &mut *(p as *mut Ctx<'_>) };
    // The task's activity, which `set_activity` may have changed, is what it sends in.
    if let Some(a) = activity() {
        ctx.set_activity(a);
    }
    Ok(f(ctx))
}

/// A reply slot that travels in a message to a stage ([`call`]).
pub struct Reply<T>(futures_channel::oneshot::Sender<T>);

impl<T> Reply<T> {
    /// Answers; gives the value back if the caller is gone.
    pub fn send(self, value: T) -> Result<(), T> {
        self.0.send(value)
    }
}

/// Why a [`call`] got no reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallError {
    NotInTask,
    /// The message was refused (the stage's gate, a full mailbox, ...).
    Send(SendError),
    /// The stage dropped the reply without answering.
    NoReply,
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}
impl std::error::Error for CallError {}

/// Sends a message to a stage in the task's activity and awaits its reply: the task side of
/// the bridge between tasks and stages. `make` builds the message around the reply slot.
pub async fn call<M, R>(to: &StageRef<M>, make: impl FnOnce(Reply<R>) -> M) -> Result<R, CallError>
where
    M: Send + 'static,
{
    let (tx, rx) = futures_channel::oneshot::channel();
    let msg = make(Reply(tx));
    with_ctx(|ctx| ctx.send(to, msg))
        .map_err(|_| CallError::NotInTask)?
        .map_err(CallError::Send)?;
    rx.await.map_err(|_| CallError::NoReply)
}

/// Gives the core back once: the task is queued behind the others of its activity (and its
/// activity behind the others by the tree).
pub fn yield_now() -> YieldNow {
    YieldNow { yielded: false }
}

/// The future of [`yield_now`].
pub struct YieldNow {
    yielded: bool,
}

impl Future for YieldNow {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.yielded {
            return Poll::Ready(());
        }
        self.yielded = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

// ---------------------------------------------------------------------------------------------
// Timers.

/// Completes at a time on the worker's clock (a timer of the worker's loop). `Send` and `Sync`
/// (as hyper asks), but a sleep is registered with the core that polls it.
pub struct Sleep {
    deadline_ns: u64,
    /// A sleep made off a worker (no runtime clock to read there): when it ends on the OS's
    /// monotonic clock, turned into the runtime's at its first poll. (Counted from the
    /// runtime's 0 instead, a `timeout` made on the main thread for a task was over at once
    /// once the runtime had run longer than it.)
    until: Option<Instant>,
    /// (runtime, core, key) of the timer registered for this sleep.
    timer: Option<(usize, usize, TimerKey)>,
}

/// `now_ns` on the runtime's clock plus `d`, saturating.
fn ns_after(now_ns: u64, d: Duration) -> u64 {
    now_ns.saturating_add(d.as_nanos().min(u128::from(u64::MAX)) as u64)
}

/// `until` on the runtime's clock, read when the runtime's clock says `now_ns`.
fn ns_at(now_ns: u64, until: Instant) -> u64 {
    ns_after(now_ns, until.saturating_duration_since(Instant::now()))
}

/// Sleeps for `d` on the current worker's clock (made off a worker: from when it was made).
pub fn sleep(d: Duration) -> Sleep {
    match with_core(|c| c.shared.now_ns()) {
        Some(now) => sleep_until_ns(ns_after(now, d)),
        // A length past what an `Instant` holds never ends.
        None => Instant::now()
            .checked_add(d)
            .map_or_else(|| sleep_until_ns(u64::MAX), sleep_until_instant),
    }
}

/// Sleeps until `deadline_ns` on the runtime's clock (ns since it started; see
/// [`Runtime::now_ns`]).
pub fn sleep_until_ns(deadline_ns: u64) -> Sleep {
    Sleep {
        deadline_ns,
        until: None,
        timer: None,
    }
}

/// Sleeps until `deadline` on the OS's monotonic clock.
pub fn sleep_until_instant(deadline: Instant) -> Sleep {
    match with_core(|c| c.shared.now_ns()) {
        Some(now) => sleep_until_ns(ns_at(now, deadline)),
        None => Sleep {
            deadline_ns: u64::MAX,
            until: Some(deadline),
            timer: None,
        },
    }
}

/// The runtime's clock as seen from a worker, ns since it started (`None` off a worker).
pub fn now_ns() -> Option<u64> {
    with_core(|c| c.shared.now_ns())
}

impl Sleep {
    /// When it completes, ns on the runtime's clock (`u64::MAX` for a sleep made off a worker
    /// and not polled yet).
    pub fn deadline_ns(&self) -> u64 {
        self.deadline_ns
    }

    /// Moves the deadline (the timer is registered again at the next poll).
    pub fn reset(&mut self, deadline_ns: u64) {
        self.cancel();
        self.deadline_ns = deadline_ns;
        self.until = None;
    }

    fn cancel(&mut self) {
        if let Some((runtime, core, key)) = self.timer.take() {
            with_core(|c| {
                if c.shared.runtime_id() == runtime && c.core == core {
                    c.timers.remove(&key);
                }
            });
        }
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        self.cancel();
    }
}

impl Future for Sleep {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let (until, timer) = (self.until, self.timer);
        let mut deadline = self.deadline_ns;
        let r = with_core(|c| {
            let now = c.shared.now_ns();
            if let Some(until) = until {
                deadline = ns_at(now, until);
            }
            let id = c.shared.runtime_id();
            if now >= deadline {
                // Only a timer of this core's: a sleep moved from another core would remove
                // another sleep's timer that had the same key here (as `cancel` checks).
                if let Some((runtime, core, key)) = timer {
                    if runtime == id && core == c.core {
                        c.timers.remove(&key);
                    }
                }
                return (Poll::Ready(()), None);
            }
            if let Some((runtime, core, key)) = timer {
                if runtime == id && core == c.core {
                    if let Some(w) = c.timers.get_mut(&key) {
                        if !w.will_wake(cx.waker()) {
                            w.clone_from(cx.waker());
                        }
                        return (Poll::Pending, timer);
                    }
                }
            }
            if c.timers.len() >= TASK_TIMERS_MAX {
                if let Some(t) = &c.shared.tasks {
                    t.timers_refused.fetch_add(1, Ordering::Relaxed);
                }
                return (Poll::Ready(()), None);
            }
            c.timer_seq += 1;
            let key = (deadline, c.timer_seq);
            c.timers.insert(key, cx.waker().clone());
            (Poll::Pending, Some((id, c.core, key)))
        });
        match r {
            Some((p, t)) => {
                self.timer = t;
                self.deadline_ns = deadline;
                self.until = None;
                p
            }
            None => panic!("omnistage::task::Sleep polled off a worker thread with tasks"),
        }
    }
}

/// The deadline of a [`timeout`] passed first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Elapsed;

impl std::fmt::Display for Elapsed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("deadline elapsed")
    }
}
impl std::error::Error for Elapsed {}

/// Runs `future` until `d` passes on the worker's clock.
pub fn timeout<F: Future>(d: Duration, future: F) -> Timeout<F> {
    Timeout {
        future: Box::pin(future),
        sleep: sleep(d),
    }
}

/// The future of [`timeout`].
pub struct Timeout<F: Future> {
    future: Pin<Box<F>>,
    sleep: Sleep,
}

impl<F: Future> Future for Timeout<F> {
    type Output = Result<F::Output, Elapsed>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Poll::Ready(v) = self.future.as_mut().poll(cx) {
            return Poll::Ready(Ok(v));
        }
        match Pin::new(&mut self.sleep).poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(Elapsed)),
            Poll::Pending => Poll::Pending,
        }
    }
}
