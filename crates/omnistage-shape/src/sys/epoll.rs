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
//! Limits: at most [`TRACKED_MAX`] registrations are tracked (beyond: waited on as asked, the
//! program may spin on them); `EPOLLEXCLUSIVE` registrations are never tracked (the kernel
//! refuses `EPOLL_CTL_MOD` on them); a thread changing a registration with `epoll_ctl` while
//! another is inside `epoll_wait` on the same set may see its change undone by the restore.

use super::wait::{ns_timespec, POLL_HELD_MAX};
use super::{context, errno, now_ns, real, set_errno};
use crate::hooks::{self, FdKind, PollAsk};
use libc::{c_int, epoll_event, sigset_t};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

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
static STARVED: [AtomicU64; STARVED_FDS / 64] = [const { AtomicU64::new(0) }; STARVED_FDS / 64];

fn table() -> MutexGuard<'static, [Reg; TRACKED_MAX]> {
    // Nothing in the table can be left half-written by a panic (plain copies).
    TABLE.lock().unwrap_or_else(|e| e.into_inner())
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
    let mut t = table();
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
                    TRACKED.fetch_add(1, Ordering::Relaxed);
                }
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
        let mut t = table();
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
            let mut t = table();
            if t[i].epfd == epfd && t[i].fd == fd {
                t[i] = FREE;
                TRACKED.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// Marks the `EPOLLONESHOT` registrations among `got` as fired.
fn mark_fired(epfd: c_int, got: &[epoll_event]) {
    let mut t = table();
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
    if TRACKED.load(Ordering::Relaxed) == 0 || events.is_null() || max <= 0 {
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
    for (i, r) in table().iter().enumerate() {
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
