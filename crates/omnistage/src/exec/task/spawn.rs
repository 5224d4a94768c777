//! Spawning tasks (on this core, on another, in another activity) and their join handles.

use super::*;

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

pub(super) fn new_header(shared: &Arc<Shared>) -> Arc<Header> {
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
pub(super) fn with_output<F: Future + 'static>(
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
pub(super) fn send_spawn<F, M>(
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
    let dest = super::super::Destination {
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
