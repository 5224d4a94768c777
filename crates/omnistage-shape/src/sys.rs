//! Every `unsafe` of the shaping library, in one place: the real libc functions found with
//! `dlsym(RTLD_NEXT)`, the interposed entry points (expanded into the preload crate by
//! [`export_interposers!`]), raw pointers (buffers, iovecs, message headers, pollfds), the
//! shared-memory segment of a group (`shm_open`, `mmap`, a process-shared robust mutex), the
//! clock, and the descriptor checks (`fstat`, `getsockopt`, `fcntl`). Everything else is safe
//! code in `hooks`, `meter` and `link`.
//!
//! This file holds the clock, errno, processes, the descriptor checks and the interposer macro;
//! its parts, one file each: `segment` (the group's shared memory), `context` (this process's
//! view of its group), `real` (libc's own functions), `transfer` (the hooks of calls that move
//! bytes), `wait` (poll and select), `epoll` (epoll's registrations and waits).

mod context;
mod epoll;
pub mod real;
mod segment;
mod transfer;
mod wait;

pub use context::*;
pub use epoll::{
    epoll_common, hook_close, hook_epoll_ctl, note_starved, TRACKED_MAX as EPOLL_TRACKED_MAX,
};
pub use segment::*;
pub use transfer::*;
pub use wait::*;

use crate::hooks::{self, FdKind, Flags, Leg, PollAsk};
use crate::meter::{Dir, GroupCfg, GroupState, Mode, Need, Slot, Verdict};
pub use libc;
use libc::{c_int, c_void, iovec, msghdr, pollfd, size_t, ssize_t};
use std::ffi::{CStr, CString};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

// ---------------------------------------------------------------------------------------------
// Clock, errno, processes.

/// CLOCK_MONOTONIC in ns: one clock for every process of a group.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).saturating_mul(1_000_000_000) + ts.tv_nsec as u64
}

/// Sleeps until `until_ns` on CLOCK_MONOTONIC, or until a signal handler runs (whatever its
/// `SA_RESTART`: `clock_nanosleep` is never restarted); `false` then, and the caller decides
/// whether to ask again. Stop and ignored signals do not end it. Never changes errno.
pub fn sleep_until(until_ns: u64) -> bool {
    let ts = libc::timespec {
        tv_sec: (until_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (until_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: `ts` is a valid timespec and the remaining-time pointer may be null with
    // TIMER_ABSTIME.
    let r = unsafe {
        libc::clock_nanosleep(
            libc::CLOCK_MONOTONIC,
            libc::TIMER_ABSTIME,
            &ts,
            std::ptr::null_mut(),
        )
    };
    // clock_nanosleep returns its error (EINTR) instead of setting errno.
    r != libc::EINTR
}

/// Sleeps until `until_ns` on CLOCK_MONOTONIC the way a blocking socket call waits: a signal
/// whose handler has `SA_RESTART` (or no handler) does not end the wait; a handler without it
/// does, and then this returns `false`. The sleep is a blocking `read` of a timerfd armed for
/// `until_ns`, which the kernel restarts, or fails with `EINTR`, by the same rule as a socket's
/// `recv` or `send` (`clock_nanosleep` always fails with `EINTR`, whatever the handler's
/// flags). The timerfd is made for this wait and closed after it: one kept across waits could
/// be closed behind our back by the program (`close_range`) and its number given to another
/// file. Without a timerfd, falls back to [`sleep_until`]. Never changes errno.
pub fn sleep_until_interruptible(until_ns: u64) -> bool {
    let e = errno();
    // SAFETY: timerfd_create has no memory effects; the descriptor is ours until closed below.
    let fd = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_CLOEXEC) };
    if fd < 0 {
        let _ = sleep_until(until_ns);
        set_errno(e);
        return true;
    }
    let spec = libc::itimerspec {
        it_interval: libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        },
        it_value: libc::timespec {
            tv_sec: (until_ns / 1_000_000_000) as libc::time_t,
            // At least 1 ns: an all-zero it_value would disarm the timer instead.
            tv_nsec: (until_ns % 1_000_000_000).max(u64::from(until_ns < 1_000_000_000))
                as libc::c_long,
        },
    };
    // SAFETY: `fd` is our timerfd, `spec` a valid itimerspec, the old value may be null.
    let armed =
        unsafe { libc::timerfd_settime(fd, libc::TFD_TIMER_ABSTIME, &spec, std::ptr::null_mut()) }
            == 0;
    let mut interrupted = false;
    if armed {
        let mut ticks = 0u64;
        // SAFETY: `ticks` is 8 writable bytes, what a timerfd read needs; `fd` is ours.
        let r = unsafe { real::read(fd, (&mut ticks as *mut u64).cast(), 8) };
        interrupted = r < 0 && errno() == libc::EINTR;
    } else {
        let _ = sleep_until(until_ns);
    }
    // SAFETY: `fd` is ours and closed once; the real close (not the hook: it is no
    // registration of the program's).
    unsafe { real::close(fd) };
    set_errno(e);
    !interrupted
}

/// Whether `len` bytes at `p` can be read now, tested by the kernel (`process_vm_readv` on this
/// process into a scratch buffer: a bad address fails with `EFAULT` instead of faulting).
/// Lets a hook hand a bad pointer to the real call, which answers `EFAULT` as it would have
/// unshaped, instead of dereferencing it. `true` where the kernel refuses the check (no
/// `process_vm_readv`, a seccomp filter): the hook then goes on as before. Never changes errno.
pub fn readable(p: *const u8, len: usize) -> bool {
    if len == 0 {
        return true;
    }
    if p.is_null() {
        return false;
    }
    const SCRATCH: usize = 1024;
    const PIECES: usize = 32;
    let mut scratch = [0u8; SCRATCH];
    // Up to PIECES KiB per check, each local piece the same scratch buffer; the caller's
    // structures (at most 1,024 iovecs or mmsghdrs, 256 pollfds, a timespec) fit in two checks.
    let mut at = 0usize;
    let e = errno();
    let mut ok = true;
    while at < len {
        let n = (len - at).min(SCRATCH * PIECES);
        let local = [libc::iovec {
            iov_base: scratch.as_mut_ptr().cast(),
            iov_len: SCRATCH,
        }; PIECES];
        let remote = libc::iovec {
            // Only read by the kernel (through `process_vm_readv`), never by us.
            iov_base: p.wrapping_add(at).cast_mut().cast(),
            iov_len: n,
        };
        // SAFETY: the local iovecs all point at our scratch buffer, valid for SCRATCH bytes
        // each; the remote range is read by the kernel, which checks it.
        let r = unsafe {
            libc::process_vm_readv(
                getpid(),
                local.as_ptr(),
                n.div_ceil(SCRATCH) as libc::c_ulong,
                &remote,
                1,
                0,
            )
        };
        if r < 0 {
            // EFAULT says the range is bad; anything else (ENOSYS, EPERM from a filter) says
            // nothing: trust the caller as before.
            ok = errno() != libc::EFAULT;
            break;
        }
        if (r as usize) < n {
            ok = false;
            break;
        }
        at += n;
    }
    set_errno(e);
    ok
}

/// Of a fortified entry point (`__read_chk`, …): the caller's buffer holds what it gave as the
/// length, or the process ends as glibc's own would end it (`__chk_fail`: "buffer overflow
/// detected", SIGABRT).
#[inline]
pub fn fortify_check(fits: bool) {
    if !fits {
        real::chk_fail();
    }
}

pub fn errno() -> c_int {
    // SAFETY: __errno_location returns this thread's errno, valid for the thread's life.
    unsafe { *libc::__errno_location() }
}

pub fn set_errno(e: c_int) {
    // SAFETY: as in `errno`.
    unsafe { *libc::__errno_location() = e };
}

/// Whether process `pid` exists (`kill(pid, 0)` fails with ESRCH only when it does not).
pub fn alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    let e = errno();
    // SAFETY: signal 0 only checks the pid; nothing is delivered.
    let r = unsafe { libc::kill(pid, 0) };
    let gone = r != 0 && errno() == libc::ESRCH;
    set_errno(e);
    !gone
}

/// Sends signal `sig` to `pid` (the command passing SIGTERM/SIGHUP on to its program).
pub fn signal(pid: i32, sig: c_int) {
    if pid > 0 {
        // SAFETY: kill has no memory effects; a gone pid fails with ESRCH.
        unsafe { libc::kill(pid, sig) };
    }
}

pub fn getpid() -> i32 {
    // SAFETY: getpid has no preconditions.
    unsafe { libc::getpid() }
}

/// What `fd` is for shaping (see [`FdKind`]). Never changes errno.
pub fn classify(fd: c_int) -> FdKind {
    if fd < 0 {
        return FdKind::Other;
    }
    let e = errno();
    let kind = classify_inner(fd);
    set_errno(e);
    kind
}

fn classify_inner(fd: c_int) -> FdKind {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is writable; fstat on a bad fd fails with EBADF and writes nothing.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return FdKind::Other;
    }
    match st.st_mode & libc::S_IFMT {
        libc::S_IFREG | libc::S_IFBLK => FdKind::File,
        libc::S_IFSOCK => {
            let domain = sockopt(fd, libc::SO_DOMAIN);
            if domain != Some(libc::AF_INET) && domain != Some(libc::AF_INET6) {
                return FdKind::Other;
            }
            let message = sockopt(fd, libc::SO_TYPE) != Some(libc::SOCK_STREAM);
            // SAFETY: F_GETFL takes no argument and only reads the descriptor's flags.
            let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
            FdKind::Socket {
                message,
                nonblocking: fl >= 0 && fl & libc::O_NONBLOCK != 0,
            }
        }
        _ => FdKind::Other,
    }
}

fn sockopt(fd: c_int, opt: c_int) -> Option<c_int> {
    let mut v: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as libc::socklen_t;
    // SAFETY: `v` and `len` are valid for writes and `len` says the size of `v`.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            opt,
            (&mut v as *mut c_int).cast(),
            &mut len,
        )
    };
    (r == 0).then_some(v)
}

/// Defines the interposed libc symbols. Expanded once, in the preload crate (`cdylib`): the
/// symbols must not exist in any other binary, such as the `omnistage` command, which links
/// this crate as a library.
#[macro_export]
macro_rules! export_interposers {
    () => {
        use $crate::sys as s;
        use $crate::sys::libc::{
            c_int, c_uint, c_void, iovec, msghdr, nfds_t, off64_t, pollfd, sigset_t, size_t,
            sockaddr, socklen_t, ssize_t, timespec,
        };
        // SAFETY (all below): each function has the libc function's signature and contract and
        // hands its arguments unchanged to the hook, which keeps that contract.
        #[no_mangle]
        pub unsafe extern "C" fn read(fd: c_int, b: *mut c_void, n: size_t) -> ssize_t {
            s::hook_read(fd, b, n)
        }
        #[no_mangle]
        pub unsafe extern "C" fn __read_chk(
            fd: c_int,
            b: *mut c_void,
            n: size_t,
            buflen: size_t,
        ) -> ssize_t {
            s::fortify_check(n <= buflen);
            s::hook_read(fd, b, n)
        }
        #[no_mangle]
        pub unsafe extern "C" fn write(fd: c_int, b: *const c_void, n: size_t) -> ssize_t {
            s::hook_write(fd, b, n)
        }
        #[no_mangle]
        pub unsafe extern "C" fn readv(fd: c_int, v: *const iovec, c: c_int) -> ssize_t {
            s::hook_readv(fd, v, c)
        }
        #[no_mangle]
        pub unsafe extern "C" fn writev(fd: c_int, v: *const iovec, c: c_int) -> ssize_t {
            s::hook_writev(fd, v, c)
        }
        #[no_mangle]
        pub unsafe extern "C" fn pread(
            fd: c_int,
            b: *mut c_void,
            n: size_t,
            o: off64_t,
        ) -> ssize_t {
            s::hook_pread(fd, b, n, o)
        }
        #[no_mangle]
        pub unsafe extern "C" fn pread64(
            fd: c_int,
            b: *mut c_void,
            n: size_t,
            o: off64_t,
        ) -> ssize_t {
            s::hook_pread(fd, b, n, o)
        }
        #[no_mangle]
        pub unsafe extern "C" fn __pread_chk(
            fd: c_int,
            b: *mut c_void,
            n: size_t,
            o: off64_t,
            buflen: size_t,
        ) -> ssize_t {
            s::fortify_check(n <= buflen);
            s::hook_pread(fd, b, n, o)
        }
        #[no_mangle]
        pub unsafe extern "C" fn __pread64_chk(
            fd: c_int,
            b: *mut c_void,
            n: size_t,
            o: off64_t,
            buflen: size_t,
        ) -> ssize_t {
            s::fortify_check(n <= buflen);
            s::hook_pread(fd, b, n, o)
        }
        #[no_mangle]
        pub unsafe extern "C" fn pwrite(
            fd: c_int,
            b: *const c_void,
            n: size_t,
            o: off64_t,
        ) -> ssize_t {
            s::hook_pwrite(fd, b, n, o)
        }
        #[no_mangle]
        pub unsafe extern "C" fn pwrite64(
            fd: c_int,
            b: *const c_void,
            n: size_t,
            o: off64_t,
        ) -> ssize_t {
            s::hook_pwrite(fd, b, n, o)
        }
        #[no_mangle]
        pub unsafe extern "C" fn preadv(
            fd: c_int,
            v: *const iovec,
            c: c_int,
            o: off64_t,
        ) -> ssize_t {
            s::hook_preadv(fd, v, c, o)
        }
        #[no_mangle]
        pub unsafe extern "C" fn preadv64(
            fd: c_int,
            v: *const iovec,
            c: c_int,
            o: off64_t,
        ) -> ssize_t {
            s::hook_preadv(fd, v, c, o)
        }
        #[no_mangle]
        pub unsafe extern "C" fn pwritev(
            fd: c_int,
            v: *const iovec,
            c: c_int,
            o: off64_t,
        ) -> ssize_t {
            s::hook_pwritev(fd, v, c, o)
        }
        #[no_mangle]
        pub unsafe extern "C" fn pwritev64(
            fd: c_int,
            v: *const iovec,
            c: c_int,
            o: off64_t,
        ) -> ssize_t {
            s::hook_pwritev(fd, v, c, o)
        }
        #[no_mangle]
        pub unsafe extern "C" fn preadv2(
            fd: c_int,
            v: *const iovec,
            c: c_int,
            o: off64_t,
            f: c_int,
        ) -> ssize_t {
            s::hook_preadv2(fd, v, c, o, f)
        }
        #[no_mangle]
        pub unsafe extern "C" fn preadv64v2(
            fd: c_int,
            v: *const iovec,
            c: c_int,
            o: off64_t,
            f: c_int,
        ) -> ssize_t {
            s::hook_preadv2(fd, v, c, o, f)
        }
        #[no_mangle]
        pub unsafe extern "C" fn pwritev2(
            fd: c_int,
            v: *const iovec,
            c: c_int,
            o: off64_t,
            f: c_int,
        ) -> ssize_t {
            s::hook_pwritev2(fd, v, c, o, f)
        }
        #[no_mangle]
        pub unsafe extern "C" fn pwritev64v2(
            fd: c_int,
            v: *const iovec,
            c: c_int,
            o: off64_t,
            f: c_int,
        ) -> ssize_t {
            s::hook_pwritev2(fd, v, c, o, f)
        }
        #[no_mangle]
        pub unsafe extern "C" fn send(fd: c_int, b: *const c_void, n: size_t, f: c_int) -> ssize_t {
            s::hook_send(fd, b, n, f)
        }
        #[no_mangle]
        pub unsafe extern "C" fn recv(fd: c_int, b: *mut c_void, n: size_t, f: c_int) -> ssize_t {
            s::hook_recv(fd, b, n, f)
        }
        #[no_mangle]
        pub unsafe extern "C" fn __recv_chk(
            fd: c_int,
            b: *mut c_void,
            n: size_t,
            buflen: size_t,
            f: c_int,
        ) -> ssize_t {
            s::fortify_check(n <= buflen);
            s::hook_recv(fd, b, n, f)
        }
        #[no_mangle]
        pub unsafe extern "C" fn sendto(
            fd: c_int,
            b: *const c_void,
            n: size_t,
            f: c_int,
            a: *const sockaddr,
            l: socklen_t,
        ) -> ssize_t {
            s::hook_sendto(fd, b, n, f, a, l)
        }
        #[no_mangle]
        pub unsafe extern "C" fn recvfrom(
            fd: c_int,
            b: *mut c_void,
            n: size_t,
            f: c_int,
            a: *mut sockaddr,
            l: *mut socklen_t,
        ) -> ssize_t {
            s::hook_recvfrom(fd, b, n, f, a, l)
        }
        #[no_mangle]
        pub unsafe extern "C" fn __recvfrom_chk(
            fd: c_int,
            b: *mut c_void,
            n: size_t,
            buflen: size_t,
            f: c_int,
            a: *mut sockaddr,
            l: *mut socklen_t,
        ) -> ssize_t {
            s::fortify_check(n <= buflen);
            s::hook_recvfrom(fd, b, n, f, a, l)
        }
        #[no_mangle]
        pub unsafe extern "C" fn sendmsg(fd: c_int, m: *const msghdr, f: c_int) -> ssize_t {
            s::hook_sendmsg(fd, m, f)
        }
        #[no_mangle]
        pub unsafe extern "C" fn recvmsg(fd: c_int, m: *mut msghdr, f: c_int) -> ssize_t {
            s::hook_recvmsg(fd, m, f)
        }
        #[no_mangle]
        pub unsafe extern "C" fn sendmmsg(
            fd: c_int,
            v: *mut $crate::sys::libc::mmsghdr,
            n: c_uint,
            f: c_int,
        ) -> c_int {
            s::hook_sendmmsg(fd, v, n, f)
        }
        #[no_mangle]
        pub unsafe extern "C" fn recvmmsg(
            fd: c_int,
            v: *mut $crate::sys::libc::mmsghdr,
            n: c_uint,
            f: c_int,
            t: *mut timespec,
        ) -> c_int {
            s::hook_recvmmsg(fd, v, n, f, t)
        }
        #[no_mangle]
        pub unsafe extern "C" fn close(fd: c_int) -> c_int {
            s::hook_close(fd)
        }
        #[no_mangle]
        pub unsafe extern "C" fn sendfile(
            o: c_int,
            i: c_int,
            off: *mut off64_t,
            n: size_t,
        ) -> ssize_t {
            s::hook_sendfile(o, i, off, n)
        }
        #[no_mangle]
        pub unsafe extern "C" fn sendfile64(
            o: c_int,
            i: c_int,
            off: *mut off64_t,
            n: size_t,
        ) -> ssize_t {
            s::hook_sendfile(o, i, off, n)
        }
        #[no_mangle]
        pub unsafe extern "C" fn copy_file_range(
            i: c_int,
            oi: *mut off64_t,
            o: c_int,
            oo: *mut off64_t,
            n: size_t,
            f: c_uint,
        ) -> ssize_t {
            s::hook_copy_file_range(i, oi, o, oo, n, f)
        }
        #[no_mangle]
        pub unsafe extern "C" fn splice(
            i: c_int,
            oi: *mut off64_t,
            o: c_int,
            oo: *mut off64_t,
            n: size_t,
            f: c_uint,
        ) -> ssize_t {
            s::hook_splice(i, oi, o, oo, n, f)
        }
        #[no_mangle]
        pub unsafe extern "C" fn poll(p: *mut pollfd, n: nfds_t, t: c_int) -> c_int {
            s::hook_poll(p, n, t)
        }
        #[no_mangle]
        pub unsafe extern "C" fn __poll_chk(
            p: *mut pollfd,
            n: nfds_t,
            t: c_int,
            len: size_t,
        ) -> c_int {
            s::fortify_check(len / ::std::mem::size_of::<pollfd>() >= n as usize);
            s::hook_poll(p, n, t)
        }
        #[no_mangle]
        pub unsafe extern "C" fn __ppoll_chk(
            p: *mut pollfd,
            n: nfds_t,
            t: *const timespec,
            m: *const sigset_t,
            len: size_t,
        ) -> c_int {
            s::fortify_check(len / ::std::mem::size_of::<pollfd>() >= n as usize);
            s::hook_ppoll(p, n, t, m)
        }
        #[no_mangle]
        pub unsafe extern "C" fn ppoll(
            p: *mut pollfd,
            n: nfds_t,
            t: *const timespec,
            m: *const sigset_t,
        ) -> c_int {
            s::hook_ppoll(p, n, t, m)
        }
        #[no_mangle]
        pub unsafe extern "C" fn epoll_ctl(
            epfd: c_int,
            op: c_int,
            fd: c_int,
            ev: *mut $crate::sys::libc::epoll_event,
        ) -> c_int {
            s::hook_epoll_ctl(epfd, op, fd, ev)
        }
        #[no_mangle]
        pub unsafe extern "C" fn epoll_wait(
            epfd: c_int,
            ev: *mut $crate::sys::libc::epoll_event,
            max: c_int,
            t: c_int,
        ) -> c_int {
            s::hook_epoll_wait(epfd, ev, max, t)
        }
        #[no_mangle]
        pub unsafe extern "C" fn epoll_pwait(
            epfd: c_int,
            ev: *mut $crate::sys::libc::epoll_event,
            max: c_int,
            t: c_int,
            m: *const sigset_t,
        ) -> c_int {
            s::hook_epoll_pwait(epfd, ev, max, t, m)
        }
        #[no_mangle]
        pub unsafe extern "C" fn epoll_pwait2(
            epfd: c_int,
            ev: *mut $crate::sys::libc::epoll_event,
            max: c_int,
            t: *const timespec,
            m: *const sigset_t,
        ) -> c_int {
            s::hook_epoll_pwait2(epfd, ev, max, t, m)
        }
        #[no_mangle]
        pub unsafe extern "C" fn select(
            n: c_int,
            r: *mut $crate::sys::libc::fd_set,
            w: *mut $crate::sys::libc::fd_set,
            e: *mut $crate::sys::libc::fd_set,
            t: *mut $crate::sys::libc::timeval,
        ) -> c_int {
            s::hook_select(n, r, w, e, t)
        }
        #[no_mangle]
        pub unsafe extern "C" fn pselect(
            n: c_int,
            r: *mut $crate::sys::libc::fd_set,
            w: *mut $crate::sys::libc::fd_set,
            e: *mut $crate::sys::libc::fd_set,
            t: *const timespec,
            m: *const sigset_t,
        ) -> c_int {
            s::hook_pselect(n, r, w, e, t, m)
        }
    };
}
