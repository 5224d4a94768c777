//! What a running task can ask of its runtime: its activity and core, re-tagging itself, the
//! worker's `Ctx` (calls into stages, with a [`Reply`]), yielding.

use super::*;

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
