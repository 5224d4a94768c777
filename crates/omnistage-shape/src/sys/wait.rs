//! The hooks of the calls that wait for readiness (poll, ppoll, select, pselect, epoll_wait,
//! epoll_pwait, epoll_pwait2): a descriptor the buckets hold back is taken out of the wait,
//! and the wait is cut to when they let it through.

use super::*;

/// Most pollfds whose interest a `poll` may hold back; beyond these, descriptors are polled as
/// asked (a program polling thousands of shaped sockets can spin on the rest).
pub(super) const POLL_HELD_MAX: usize = 256;

/// # Safety
/// poll(2)'s contract (`fds` points to `n` pollfds); `call(timeout_ns)` makes the real call with
/// `sigmask` (`None`: no timeout), at ns precision so that a program waking for tokens wakes when
/// they are there (a millisecond late each time would cost a leaky bucket a tenth of its rate).
unsafe fn poll_common(
    fds: *mut pollfd,
    n: libc::nfds_t,
    deadline_ns: Option<u64>,
    sigmask: *const libc::sigset_t,
) -> c_int {
    let call = |timeout_ns: Option<u64>| {
        let ts = timeout_ns.map(ns_timespec);
        let tp = ts
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: the caller's pollfds and mask; `ts` lives across the call.
        unsafe { real::ppoll(fds, n, tp, sigmask) }
    };
    let user_timeout = || deadline_ns.map(|d| d.saturating_sub(now_ns()));
    let k = (n as usize).min(POLL_HELD_MAX);
    if fds.is_null()
        || n == 0
        || passes_through()
        || !readable(fds.cast(), k * std::mem::size_of::<pollfd>())
    {
        // Nothing to hold, not shaped, or pollfds the kernel would refuse with EFAULT.
        return call(user_timeout());
    }
    // SAFETY: the caller's contract: `n >= k` pollfds at `fds`, ours to change during the call.
    let pfds = unsafe { std::slice::from_raw_parts_mut(fds, k) };
    let mut asks = [PollAsk {
        fd: -1,
        wants_read: false,
        wants_write: false,
    }; POLL_HELD_MAX];
    let mut held = [(false, false); POLL_HELD_MAX];
    loop {
        for (a, p) in asks.iter_mut().zip(pfds.iter()) {
            *a = PollAsk {
                fd: p.fd,
                wants_read: p.events & (libc::POLLIN | libc::POLLRDNORM) != 0,
                wants_write: p.events & (libc::POLLOUT | libc::POLLWRNORM) != 0,
            };
        }
        let Some(until) = hooks::poll_plan(&asks[..k], &mut held[..k]) else {
            return call(user_timeout());
        };
        let mut saved = [0i16; POLL_HELD_MAX];
        for ((p, h), s) in pfds.iter_mut().zip(&held).zip(saved.iter_mut()) {
            *s = p.events;
            if h.0 {
                p.events &= !(libc::POLLIN | libc::POLLRDNORM);
            }
            if h.1 {
                p.events &= !(libc::POLLOUT | libc::POLLWRNORM);
            }
        }
        let r = call(Some(hooks::poll_timeout_ns(deadline_ns, until, now_ns())));
        let e = errno();
        for (p, s) in pfds.iter_mut().zip(&saved) {
            p.events = *s;
        }
        set_errno(e);
        if r != 0 || deadline_ns.is_some_and(|d| now_ns() >= d) {
            return r;
        }
    }
}

/// # Safety
/// poll(2)'s contract.
pub unsafe fn hook_poll(fds: *mut pollfd, n: libc::nfds_t, timeout: c_int) -> c_int {
    let deadline = (timeout >= 0).then(|| now_ns() + timeout as u64 * 1_000_000);
    // SAFETY: the caller's contract.
    unsafe { poll_common(fds, n, deadline, std::ptr::null()) }
}

/// # Safety
/// ppoll(2)'s contract.
pub unsafe fn hook_ppoll(
    fds: *mut pollfd,
    n: libc::nfds_t,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: a non-null `ts` is the caller's valid timespec (glibc's own ppoll reads it
    // before the system call: a bad one faults unshaped too).
    let deadline = (!ts.is_null()).then(|| unsafe { deadline_in((*ts).tv_sec, (*ts).tv_nsec) });
    // SAFETY: the caller's contract.
    unsafe { poll_common(fds, n, deadline, mask) }
}

/// `select`/`pselect` as `poll` does it: a throttled descriptor's read or write bit is taken out
/// of a copy of the caller's sets and the wait cut to when the buckets allow it (through
/// `pselect`, at ns precision), looping until something is ready, the caller's deadline passes
/// or an error; the caller's sets get the result. Nothing held (no rate, or no shaped
/// descriptor throttled): `first` makes the caller's own call unchanged. Returns the result and
/// whether the held path ran (then `select`'s timeval is the caller's to update).
///
/// A caller's `nfds` above `FD_SETSIZE` (sets it allocated larger than an `fd_set`, as
/// libevent's select backend does) is passed through unshaped: the held path waits on copies
/// of one `fd_set` each, and the kernel would read and write `nfds` bits of them.
///
/// Of a caller's set, only the `long`s that cover `nfds` descriptors are read and written
/// ([`set_words`]): a set may be sized for its `nfds` (`howmany(maxfd + 1, NFDBITS)` words, as
/// libevent's select backend and older OpenSSH allocate them) and end where the mapping ends,
/// and the bytes past it are not the caller's to give back.
///
/// # Safety
/// select(2)'s contract: each non-null set is valid for `nfds` bits, in whole `long`s (what the
/// kernel reads and writes); `sigmask` null or a valid mask.
unsafe fn select_common(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    deadline_ns: Option<u64>,
    sigmask: *const libc::sigset_t,
    first: &dyn Fn() -> c_int,
) -> (c_int, bool) {
    if nfds <= 0 || nfds as usize > libc::FD_SETSIZE || (r.is_null() && w.is_null()) {
        return (first(), false);
    }
    let n = nfds as usize;
    let words = set_words(n);
    // The caller's sets as they are at the call (the kernel, too, reads them once), each in a
    // whole `fd_set` of ours.
    // SAFETY: non-null sets are valid for `nfds` bits in whole longs: `words` longs.
    let (r0, w0, e0) = unsafe { (load_set(r, words), load_set(w, words), load_set(e, words)) };
    let isset = |set: &Option<libc::fd_set>, fd: c_int| match set {
        // SAFETY: our own whole fd_set; `fd < nfds <= FD_SETSIZE`.
        Some(s) => unsafe { libc::FD_ISSET(fd, s) },
        None => false,
    };
    let mut asks = [PollAsk {
        fd: -1,
        wants_read: false,
        wants_write: false,
    }; POLL_HELD_MAX];
    let mut held = [(false, false); POLL_HELD_MAX];
    let mut k = 0;
    for fd in 0..n as c_int {
        let (rd, wr) = (isset(&r0, fd), isset(&w0, fd));
        if !(rd || wr) {
            continue;
        }
        if k == POLL_HELD_MAX {
            // As for poll: beyond these, descriptors are waited on as asked.
            break;
        }
        asks[k] = PollAsk {
            fd,
            wants_read: rd,
            wants_write: wr,
        };
        k += 1;
    }
    let mut held_path = false;
    loop {
        let Some(until) = hooks::poll_plan(&asks[..k], &mut held[..k]) else {
            if !held_path {
                return (first(), false);
            }
            // Tokens are there now: wait as asked for what is left of the caller's time.
            let left = deadline_ns.map(|d| ns_timespec(d.saturating_sub(now_ns())));
            let tp = left
                .as_ref()
                .map_or(std::ptr::null(), |t| t as *const libc::timespec);
            // SAFETY: the caller's sets and mask; `left` lives across the call.
            return (unsafe { real::pselect(nfds, r, w, e, tp, sigmask) }, true);
        };
        held_path = true;
        let (mut rc, mut wc, mut ec) = (r0, w0, e0);
        for (a, h) in asks[..k].iter().zip(&held[..k]) {
            // SAFETY: our own copies; `a.fd < FD_SETSIZE`.
            unsafe {
                if let (true, Some(set)) = (h.0, rc.as_mut()) {
                    libc::FD_CLR(a.fd, set);
                }
                if let (true, Some(set)) = (h.1, wc.as_mut()) {
                    libc::FD_CLR(a.fd, set);
                }
            }
        }
        let ts = ns_timespec(hooks::poll_timeout_ns(deadline_ns, until, now_ns()));
        let ptr = |set: &mut Option<libc::fd_set>| {
            set.as_mut()
                .map_or(std::ptr::null_mut(), |s| s as *mut libc::fd_set)
        };
        // SAFETY: our copies of the caller's sets, the caller's mask, `ts` on our stack.
        let res =
            unsafe { real::pselect(nfds, ptr(&mut rc), ptr(&mut wc), ptr(&mut ec), &ts, sigmask) };
        let timed_out = res == 0 && deadline_ns.is_some_and(|d| now_ns() >= d);
        if res > 0 || timed_out {
            // The result (or, timed out, the emptied sets) goes to the caller: the longs that
            // cover `nfds`, as the kernel writes them.
            for (user, ours) in [(r, rc), (w, wc), (e, ec)] {
                if let Some(set) = ours {
                    // SAFETY: `ours` is Some only for a non-null caller's set, valid for
                    // `words` longs.
                    unsafe { store_set(user, &set, words) };
                }
            }
            return (res, true);
        }
        if res < 0 {
            return (res, true);
        }
    }
}

/// How many `long`s of a set cover `nfds` descriptors: what the kernel reads and writes of each
/// set (`FDS_BYTES`), and all a caller must provide (glibc's `fd_mask` is a `long` too).
fn set_words(nfds: usize) -> usize {
    nfds.div_ceil(libc::c_ulong::BITS as usize)
}

/// A whole `fd_set` holding the first `words` longs of the caller's `set`, the rest cleared;
/// `None` for a null set.
///
/// # Safety
/// A non-null `set` is valid for reads of `words` longs (at any alignment);
/// `words <= set_words(FD_SETSIZE)`.
unsafe fn load_set(set: *const libc::fd_set, words: usize) -> Option<libc::fd_set> {
    if set.is_null() {
        return None;
    }
    // SAFETY: an all-zero fd_set is the empty set (what FD_ZERO makes).
    let mut ours: libc::fd_set = unsafe { std::mem::zeroed() };
    // SAFETY: the caller's set is valid for `words` longs; ours is a whole fd_set, at least
    // that long; bytes are copied, so neither needs any alignment; they do not overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(
            set.cast::<u8>(),
            (&mut ours as *mut libc::fd_set).cast::<u8>(),
            words * std::mem::size_of::<libc::c_ulong>(),
        )
    };
    Some(ours)
}

/// Writes the first `words` longs of `ours` to the caller's `set`, and nothing past them.
///
/// # Safety
/// `set` is valid for writes of `words` longs (at any alignment);
/// `words <= set_words(FD_SETSIZE)`.
unsafe fn store_set(set: *mut libc::fd_set, ours: &libc::fd_set, words: usize) {
    // SAFETY: the caller's set is valid for `words` longs; ours is a whole fd_set, at least
    // that long; bytes are copied; they do not overlap (ours is on our stack).
    unsafe {
        std::ptr::copy_nonoverlapping(
            (ours as *const libc::fd_set).cast::<u8>(),
            set.cast::<u8>(),
            words * std::mem::size_of::<libc::c_ulong>(),
        )
    };
}

/// Whether a caller's timeout (null: none) can be read.
fn timeout_readable(t: *const libc::timespec) -> bool {
    t.is_null() || readable(t.cast(), std::mem::size_of::<libc::timespec>())
}

/// Now plus a caller's timeout (negative parts count as 0), on our clock.
pub(super) fn deadline_in(sec: libc::time_t, ns: i64) -> u64 {
    now_ns()
        .saturating_add((sec.max(0) as u64).saturating_mul(1_000_000_000))
        .saturating_add(ns.max(0) as u64)
}

pub(super) fn ns_timespec(ns: u64) -> libc::timespec {
    libc::timespec {
        tv_sec: (ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (ns % 1_000_000_000) as libc::c_long,
    }
}

/// # Safety
/// select(2)'s contract.
pub unsafe fn hook_select(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    tv: *mut libc::timeval,
) -> c_int {
    // SAFETY: the caller's contract, passed on unchanged to the real call.
    let first = || unsafe { real::select(nfds, r, w, e, tv) };
    // SAFETY: a non-null `tv` is the caller's valid timeval (glibc's own select reads it
    // before the system call: a bad one faults unshaped too).
    let deadline =
        (!tv.is_null()).then(|| unsafe { deadline_in((*tv).tv_sec, (*tv).tv_usec * 1_000) });
    // SAFETY: the caller's contract.
    let (res, held) = unsafe { select_common(nfds, r, w, e, deadline, std::ptr::null(), &first) };
    if let (true, Some(d)) = (held, deadline) {
        // Linux's select leaves the time not slept in the caller's timeval; so do we.
        let left = d.saturating_sub(now_ns());
        // SAFETY: `deadline` is Some only for a non-null `tv`.
        unsafe {
            (*tv).tv_sec = (left / 1_000_000_000) as libc::time_t;
            (*tv).tv_usec = ((left % 1_000_000_000) / 1_000) as libc::suseconds_t;
        }
    }
    res
}

/// # Safety
/// pselect(2)'s contract.
pub unsafe fn hook_pselect(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: the caller's contract, passed on unchanged to the real call.
    let first = || unsafe { real::pselect(nfds, r, w, e, ts, mask) };
    // SAFETY: a non-null `ts` is the caller's valid timespec (glibc's own pselect reads it
    // before the system call: a bad one faults unshaped too).
    let deadline = (!ts.is_null()).then(|| unsafe { deadline_in((*ts).tv_sec, (*ts).tv_nsec) });
    // SAFETY: the caller's contract.
    unsafe { select_common(nfds, r, w, e, deadline, mask, &first).0 }
}

/// The caller's millisecond timeout as a deadline on our clock (negative: none).
fn deadline_ms(timeout: c_int) -> Option<u64> {
    (timeout >= 0).then(|| now_ns() + timeout as u64 * 1_000_000)
}

/// # Safety
/// epoll_wait(2)'s contract.
pub unsafe fn hook_epoll_wait(
    epfd: c_int,
    ev: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    // SAFETY: the caller's contract, passed on unchanged to the real call.
    let first = || unsafe { real::epoll_wait(epfd, ev, max, timeout) };
    // SAFETY: the caller's contract.
    unsafe {
        epoll_common(
            epfd,
            ev,
            max,
            deadline_ms(timeout),
            std::ptr::null(),
            &first,
        )
    }
}

/// # Safety
/// epoll_pwait(2)'s contract.
pub unsafe fn hook_epoll_pwait(
    epfd: c_int,
    ev: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: the caller's contract, passed on unchanged to the real call.
    let first = || unsafe { real::epoll_pwait(epfd, ev, max, timeout, mask) };
    // SAFETY: the caller's contract.
    unsafe { epoll_common(epfd, ev, max, deadline_ms(timeout), mask, &first) }
}

/// # Safety
/// epoll_pwait2(2)'s contract (a null `timeout` waits forever). Where libc lacks it, the real
/// call fails with ENOSYS, as the caller's would.
pub unsafe fn hook_epoll_pwait2(
    epfd: c_int,
    ev: *mut libc::epoll_event,
    max: c_int,
    timeout: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: the caller's contract, passed on unchanged to the real call.
    let first = || unsafe { real::epoll_pwait2(epfd, ev, max, timeout, mask) };
    if !super::epoll::tracks_any() || !timeout_readable(timeout) {
        // Nothing tracked (`epoll_common` would make the real call), or a timeout the kernel
        // would refuse with EFAULT (glibc's epoll_pwait2 hands it on unread).
        return first();
    }
    // SAFETY: a non-null `timeout` is the caller's timespec, readable just now.
    let deadline =
        (!timeout.is_null()).then(|| unsafe { deadline_in((*timeout).tv_sec, (*timeout).tv_nsec) });
    // SAFETY: the caller's contract.
    unsafe { epoll_common(epfd, ev, max, deadline, mask, &first) }
}
