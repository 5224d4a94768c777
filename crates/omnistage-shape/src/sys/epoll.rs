//! `epoll`: what `poll` does for a poll set, done for an epoll set. The kernel keeps an epoll
//! set's interest list, so the library keeps its own copy of the shaped part of it (from
//! `epoll_ctl`): while a registered descriptor may not be used yet, `epoll_wait` takes its
//! `EPOLLIN`/`EPOLLOUT` out of the kernel's set (`EPOLL_CTL_MOD`), waits on the epoll descriptor
//! with `ppoll` at ns precision until the buckets allow it (or the caller's deadline), and puts
//! the caller's interest back before it returns. Putting it back re-arms an edge-triggered
//! registration, so a program that got `EAGAIN` from the shaper and waits for the next edge gets
//! one when the tokens are there; a descriptor that got a shaper's `EAGAIN` and is no longer
//! throttled when the program next waits is re-armed the same way.
//!
//! `close` takes a descriptor's registrations (and a closed set's) out of the table. The table's
//! mutex is never waited for from inside a hook (a signal handler interrupting one): see
//! `table`.
//!
//! Limits: at most [`TRACKED_MAX`] registrations are tracked (beyond: waited on as asked, the
//! program may spin on them); `EPOLLEXCLUSIVE` registrations are never tracked (the kernel
//! refuses `EPOLL_CTL_MOD` on them); a thread changing a registration with `epoll_ctl` while
//! another is inside `epoll_wait` on the same set may see its change undone by the restore.

use super::wait::{ns_timespec, POLL_HELD_MAX};
use super::{context, errno, now_ns, real, set_errno};
use crate::hooks::{self, FdKind, PollAsk};
use libc::{c_int, epoll_event, sigset_t};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, Once, TryLockError};

/// Most registrations tracked per process.
pub const TRACKED_MAX: usize = 1024;
/// Most tracked registrations of one epoll set looked at per wait (as poll's held limit).
const PER_SET_MAX: usize = POLL_HELD_MAX;
/// Descriptors below this have a "starved" bit (the shaper failed a call with `EAGAIN`).
const STARVED_FDS: usize = 4096;

const READ_BITS: u32 = (libc::EPOLLIN | libc::EPOLLRDNORM) as u32;
const WRITE_BITS: u32 = (libc::EPOLLOUT | libc::EPOLLWRNORM) as u32;
const ONESHOT: u32 = libc::EPOLLONESHOT as u32;
const EDGE: u32 = libc::EPOLLET as u32;

#[derive(Clone, Copy)]
struct Reg {
    /// -1: a free slot.
    epfd: c_int,
    fd: c_int,
    /// The caller's events and data, as last given to `epoll_ctl`.
    events: u32,
    data: u64,
    /// The bits of `events` taken out of the kernel's set by a wait now.
    out: u32,
    /// An `EPOLLONESHOT` registration that fired and was not re-armed by the caller: the kernel
    /// has it disabled, and a `MOD` of ours would wrongly enable it.
    disarmed: bool,
}

const FREE: Reg = Reg {
    epfd: -1,
    fd: -1,
    events: 0,
    data: 0,
    out: 0,
    disarmed: false,
};

static TABLE: Mutex<[Reg; TRACKED_MAX]> = Mutex::new([FREE; TRACKED_MAX]);
/// Registrations in `TABLE`: 0 lets every wait go straight to the real call.
static TRACKED: AtomicUsize = AtomicUsize::new(0);
/// This process is the child of a `fork` made while the table was in use: another thread of the
/// parent may have held the table's lock at the fork, and that thread does not exist here, so
/// the lock is never waited for (a `close` in a child that closes every descriptor before
/// `exec` would otherwise hang). Set by the `pthread_atfork` child handler registered when the
/// first registration is tracked.
static FORKED_CHILD: AtomicBool = AtomicBool::new(false);
static FORK_HANDLER: Once = Once::new();

extern "C" fn after_fork_in_child() {
    // Async-signal-safe: one atomic store.
    FORKED_CHILD.store(true, Ordering::Relaxed);
}

/// Registers [`after_fork_in_child`] once, before the table's lock can be held across a fork.
fn register_fork_handler() {
    FORK_HANDLER.call_once(|| {
        // SAFETY: pthread_atfork stores the three function pointers (two null); the child
        // handler only stores an atomic. A failure (ENOMEM) leaves forks as they were before
        // this handler existed.
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    });
}
static STARVED: [AtomicU64; STARVED_FDS / 64] = [const { AtomicU64::new(0) }; STARVED_FDS / 64];
/// Descriptors below [`STARVED_FDS`] that may be in the table (as the registered descriptor or
/// as the set): set under the table's lock when a registration goes in, cleared when `close`
/// takes the descriptor's out. `close` of any other descriptor below it leaves the table
/// alone; above it, `close` looks whenever anything is tracked.
static LISTED: [AtomicU64; STARVED_FDS / 64] = [const { AtomicU64::new(0) }; STARVED_FDS / 64];

fn set_listed(fd: c_int, on: bool) {
    if (0..STARVED_FDS as c_int).contains(&fd) {
        let bit = 1u64 << (fd % 64);
        if on {
            LISTED[fd as usize / 64].fetch_or(bit, Ordering::Relaxed);
        } else {
            LISTED[fd as usize / 64].fetch_and(!bit, Ordering::Relaxed);
        }
    }
}

/// Whether `fd` may be in the table (see [`LISTED`]).
fn maybe_listed(fd: c_int) -> bool {
    !(0..STARVED_FDS as c_int).contains(&fd)
        || LISTED[fd as usize / 64].load(Ordering::Relaxed) & (1 << (fd % 64)) != 0
}

/// The table, locked, with this thread marked as inside a hook while it holds the lock: a
/// signal handler that interrupts it and calls `epoll_wait`, `epoll_ctl` or `close` goes
/// straight to the real call instead of waiting for a mutex its own thread holds.
struct Table {
    // Declared first, so dropped first: the lock goes before the re-entry mark.
    lock: MutexGuard<'static, [Reg; TRACKED_MAX]>,
    _guard: Option<hooks::Guard>,
}

impl std::ops::Deref for Table {
    type Target = [Reg; TRACKED_MAX];
    fn deref(&self) -> &Self::Target {
        &self.lock
    }
}

impl std::ops::DerefMut for Table {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.lock
    }
}

/// The locked table; `None` for a call made from inside a hook (a signal handler, the library's
/// own code) while the table is locked: this thread may be the one holding it, so it is never
/// waited for there (the call then leaves the table alone, unshaped). Outside a hook the lock is
/// waited for as usual.
fn table() -> Option<Table> {
    // Nothing in the table can be left half-written by a panic (plain copies).
    let guard = hooks::Guard::enter();
    // In a forked child the lock may be held by a thread that did not survive the fork: never
    // wait for it there (as inside a hook).
    let guard = if FORKED_CHILD.load(Ordering::Relaxed) {
        None
    } else {
        guard
    };
    match guard {
        Some(g) => Some(Table {
            lock: TABLE.lock().unwrap_or_else(|e| e.into_inner()),
            _guard: Some(g),
        }),
        None => match TABLE.try_lock() {
            Ok(lock) => Some(Table { lock, _guard: None }),
            Err(TryLockError::Poisoned(e)) => Some(Table {
                lock: e.into_inner(),
                _guard: None,
            }),
            Err(TryLockError::WouldBlock) => None,
        },
    }
}

/// Whether any registration is tracked (else every wait is the real call).
pub(super) fn tracks_any() -> bool {
    TRACKED.load(Ordering::Relaxed) > 0
}

/// Notes that the shaper failed a call on `fd` with `EAGAIN` (see the module's doc).
pub fn note_starved(fd: c_int) {
    if (0..STARVED_FDS as c_int).contains(&fd) {
        STARVED[fd as usize / 64].fetch_or(1 << (fd % 64), Ordering::Relaxed);
    }
}

/// Clears and returns `fd`'s starved bit.
fn take_starved(fd: c_int) -> bool {
    if !(0..STARVED_FDS as c_int).contains(&fd) {
        return false;
    }
    let bit = 1u64 << (fd % 64);
    STARVED[fd as usize / 64].fetch_and(!bit, Ordering::Relaxed) & bit != 0
}

/// Records a successful `epoll_ctl` of the caller's.
fn track(epfd: c_int, op: c_int, fd: c_int, ev: Option<(u32, u64)>) {
    let Some(mut t) = table() else {
        return;
    };
    let at = t.iter().position(|r| r.epfd == epfd && r.fd == fd);
    match (op, ev) {
        (libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD, Some((events, data))) => {
            let shaped = context().is_some_and(|c| !c.is_unlimited())
                && events & libc::EPOLLEXCLUSIVE as u32 == 0
                && super::classify(fd) != FdKind::Other;
            let slot = match (at, shaped) {
                (Some(i), true) => Some(i),
                (None, true) => t.iter().position(|r| r.epfd < 0),
                (Some(i), false) => {
                    t[i] = FREE;
                    TRACKED.fetch_sub(1, Ordering::Relaxed);
                    None
                }
                (None, false) => None,
            };
            if let Some(i) = slot {
                if t[i].epfd < 0 {
                    register_fork_handler();
                    TRACKED.fetch_add(1, Ordering::Relaxed);
                }
                set_listed(epfd, true);
                set_listed(fd, true);
                t[i] = Reg {
                    epfd,
                    fd,
                    events,
                    data,
                    out: 0,
                    disarmed: false,
                };
            }
        }
        _ => {
            if let Some(i) = at {
                t[i] = FREE;
                TRACKED.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// `close(fd)`: the registrations of `fd`, in any set, and those of the set `fd` if it is an
/// epoll descriptor, leave the table before the descriptor goes (after, its number could be
/// reused and registered by another thread, and that registration dropped). A registration
/// whose interest a wait holds back now gets it back first: if the descriptor was duplicated,
/// the kernel keeps the registration after this close and must not keep it reduced. Cost: with
/// nothing tracked, or `fd` not [`LISTED`], one or two atomic loads; else a look at the table
/// under its lock. A close from inside a hook (a signal handler; the library's own descriptors,
/// such as its segment's while it opens it) never waits for the table.
///
/// # Safety
/// close(2)'s contract.
pub unsafe fn hook_close(fd: c_int) -> c_int {
    if TRACKED.load(Ordering::Relaxed) > 0 && fd >= 0 && maybe_listed(fd) {
        let e = errno();
        forget(fd);
        set_errno(e);
    }
    // SAFETY: the caller's contract.
    unsafe { real::close(fd) }
}

fn forget(fd: c_int) {
    let mut restore = [(0 as c_int, 0 as c_int, 0u32, 0u64); 8];
    let mut nr = 0;
    {
        let Some(mut t) = table() else {
            return;
        };
        for r in t.iter_mut() {
            if r.epfd < 0 || (r.fd != fd && r.epfd != fd) {
                continue;
            }
            if r.fd == fd && r.out != 0 && !r.disarmed && nr < restore.len() {
                restore[nr] = (r.epfd, r.fd, r.events, r.data);
                nr += 1;
            }
            *r = FREE;
            TRACKED.fetch_sub(1, Ordering::Relaxed);
        }
        set_listed(fd, false);
    }
    for &(epfd, fd, events, data) in &restore[..nr] {
        let mut ev = epoll_event { events, u64: data };
        // SAFETY: `ev` is a valid epoll_event on our stack; a failure (the set is gone) is
        // nothing to undo.
        unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_MOD, fd, &mut ev) };
    }
}

/// # Safety
/// epoll_ctl(2)'s contract.
pub unsafe fn hook_epoll_ctl(epfd: c_int, op: c_int, fd: c_int, ev: *mut epoll_event) -> c_int {
    // SAFETY: the caller's contract.
    let r = unsafe { real::epoll_ctl(epfd, op, fd, ev) };
    if r != 0 {
        return r;
    }
    let e = errno();
    // SAFETY: for `ADD` and `MOD`, a non-null `ev` is the caller's valid epoll_event (read by
    // value: it is packed). `DEL` ignores `ev`, which may then be anything (the kernel has
    // not read it since 2.6.9), so it is not read.
    let given =
        (op != libc::EPOLL_CTL_DEL && !ev.is_null()).then(|| unsafe { ((*ev).events, (*ev).u64) });
    if TRACKED.load(Ordering::Relaxed) > 0 || op != libc::EPOLL_CTL_DEL {
        track(epfd, op, fd, given);
    }
    set_errno(e);
    r
}

/// Gives the kernel registration `i` of `epfd` the caller's events less `out` (when that
/// changes what the kernel has, or always with `force`: a re-arm); a failing `MOD` (the
/// descriptor was closed, so the kernel dropped it) frees the slot.
fn apply(epfd: c_int, changes: &[(usize, u32)], force: bool) {
    let mut ops = [(0 as c_int, 0u32, 0u64, 0usize); PER_SET_MAX];
    let mut n = 0;
    {
        let Some(mut t) = table() else {
            return;
        };
        for &(i, out) in changes {
            let r = &mut t[i];
            if r.epfd != epfd || r.disarmed || (!force && r.out == out & r.events) {
                continue;
            }
            r.out = out & r.events;
            ops[n] = (r.fd, r.events & !r.out, r.data, i);
            n += 1;
        }
    }
    for &(fd, events, data, i) in &ops[..n] {
        let mut ev = epoll_event { events, u64: data };
        // SAFETY: `ev` is a valid epoll_event on our stack.
        if unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_MOD, fd, &mut ev) } != 0 {
            let Some(mut t) = table() else {
                continue;
            };
            if t[i].epfd == epfd && t[i].fd == fd {
                t[i] = FREE;
                TRACKED.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// Marks the `EPOLLONESHOT` registrations among `got` as fired.
fn mark_fired(epfd: c_int, got: &[epoll_event]) {
    let Some(mut t) = table() else {
        return;
    };
    for ev in got {
        let data = ev.u64;
        for r in t.iter_mut() {
            if r.epfd == epfd && r.data == data && r.events & ONESHOT != 0 {
                r.disarmed = true;
            }
        }
    }
}

/// The caller's epoll_wait/epoll_pwait. `first()` makes the caller's own call unchanged (when
/// nothing is held); `deadline_ns` is the caller's timeout on our clock (`None`: forever).
///
/// # Safety
/// epoll_wait(2)'s contract: `events` points to `max` writable epoll_events; `sigmask` null or
/// a valid mask.
pub unsafe fn epoll_common(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
    deadline_ns: Option<u64>,
    sigmask: *const sigset_t,
    first: &dyn Fn() -> c_int,
) -> c_int {
    if TRACKED.load(Ordering::Relaxed) == 0 || events.is_null() || max <= 0 || hooks::in_hook() {
        // Nothing tracked, a call the kernel refuses, or a re-entry (a signal handler that
        // interrupted a hook of this thread, which may hold the table): the real call.
        return first();
    }
    let finish = |n: c_int| {
        if n > 0 {
            let e = errno();
            // SAFETY: the kernel wrote `n <= max` events at the caller's `events`.
            mark_fired(epfd, unsafe {
                std::slice::from_raw_parts(events, n as usize)
            });
            set_errno(e);
        }
        n
    };
    let mut idx = [0usize; PER_SET_MAX];
    let mut asks = [PollAsk {
        fd: -1,
        wants_read: false,
        wants_write: false,
    }; PER_SET_MAX];
    let mut rearm = [(0usize, 0u32); PER_SET_MAX];
    let (mut k, mut nr) = (0, 0);
    let Some(t) = table() else {
        return first();
    };
    for (i, r) in t.iter().enumerate() {
        if r.epfd != epfd || r.disarmed || k == PER_SET_MAX {
            continue;
        }
        idx[k] = i;
        asks[k] = PollAsk {
            fd: r.fd,
            wants_read: r.events & READ_BITS != 0,
            wants_write: r.events & WRITE_BITS != 0,
        };
        if r.events & EDGE != 0 && take_starved(r.fd) {
            rearm[nr] = (i, 0);
            nr += 1;
        }
        k += 1;
    }
    drop(t);
    if k == 0 {
        return first();
    }
    let mut held = [(false, false); PER_SET_MAX];
    let mut any_out = false;
    loop {
        let until = hooks::poll_plan(&asks[..k], &mut held[..k]);
        if until.is_none() && !any_out {
            // Nothing throttled: re-arm the edges the shaper swallowed, then wait as asked.
            apply(epfd, &rearm[..nr], true);
            return finish(first());
        }
        let mut changes = [(0usize, 0u32); PER_SET_MAX];
        for ((c, &i), h) in changes.iter_mut().zip(&idx[..k]).zip(&held[..k]) {
            *c = (
                i,
                if h.0 { READ_BITS } else { 0 } | if h.1 { WRITE_BITS } else { 0 },
            );
        }
        apply(epfd, &changes[..k], false);
        if nr > 0 {
            // The edges the shaper swallowed, on descriptors not held now, are re-armed here
            // (once): the non-forced `apply` above changes nothing for them, as nothing of
            // theirs was out. A held one is re-armed when its interest is given back.
            let mut free = 0;
            for j in 0..nr {
                let i = rearm[j].0;
                let pos = idx[..k].iter().position(|&x| x == i);
                if pos.is_some_and(|p| !held[p].0 && !held[p].1) {
                    rearm[free] = (i, 0);
                    free += 1;
                }
            }
            apply(epfd, &rearm[..free], true);
            nr = 0;
        }
        any_out = held[..k].iter().any(|h| h.0 || h.1);
        let Some(until) = until else {
            // Tokens are there now (the interest is back): wait as asked for what is left.
            let ms = deadline_ns.map_or(-1, |d| {
                d.saturating_sub(now_ns())
                    .div_ceil(1_000_000)
                    .min(i32::MAX as u64) as c_int
            });
            // SAFETY: the caller's contract.
            return finish(unsafe { real::epoll_pwait(epfd, events, max, ms, sigmask) });
        };
        let ts = ns_timespec(hooks::poll_timeout_ns(deadline_ns, until, now_ns()));
        let mut p = libc::pollfd {
            fd: epfd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd and a timespec on our stack, the caller's mask.
        let r = unsafe { real::ppoll(&mut p, 1, &ts, sigmask) };
        let n = if r > 0 {
            // SAFETY: the caller's contract; a zero timeout never blocks.
            unsafe { real::epoll_wait(epfd, events, max, 0) }
        } else {
            r
        };
        let timed_out = n == 0 && deadline_ns.is_some_and(|d| now_ns() >= d);
        if n != 0 || timed_out {
            // First the one-shot registrations that fired are marked, so that giving the
            // interest back skips them: the kernel has disabled them, and a `MOD` would enable
            // one that the program's thread is now handling (another thread could get it too).
            let n = finish(n);
            let e = errno();
            let mut restore = [(0usize, 0u32); PER_SET_MAX];
            for (r, &i) in restore.iter_mut().zip(&idx[..k]) {
                *r = (i, 0);
            }
            apply(epfd, &restore[..k], false);
            set_errno(e);
            return n;
        }
    }
}
