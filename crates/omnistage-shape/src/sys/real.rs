//! The real libc functions, found past this library with `dlsym(RTLD_NEXT)` once each.

use super::*;

/// Looks `name` up past this library (`dlsym(RTLD_NEXT)`), once.
fn lookup(cache: &AtomicUsize, name: &CStr) -> usize {
    let p = cache.load(Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    // SAFETY: `name` is NUL-terminated; RTLD_NEXT finds the next definition (libc's).
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
    cache.store(p, Ordering::Relaxed);
    p
}

macro_rules! real_fn {
    ($rust:ident, $sym:literal, fn($($a:ident : $t:ty),* $(,)?) -> $r:ty) => {
        /// The real libc function (ENOSYS if this libc lacks it).
        ///
        /// # Safety
        /// The libc function's contract.
        pub unsafe fn $rust($($a: $t),*) -> $r {
            static CACHE: AtomicUsize = AtomicUsize::new(0);
            let p = lookup(&CACHE, $sym);
            if p == 0 {
                set_errno(libc::ENOSYS);
                return -1 as $r;
            }
            // SAFETY: `p` is the address dlsym gave for this symbol, whose C signature is the
            // one spelled here (from the libc crate's declarations).
            let f: unsafe extern "C" fn($($t),*) -> $r = unsafe { std::mem::transmute(p) };
            // SAFETY: the caller keeps the function's contract.
            unsafe { f($($a),*) }
        }
    };
}

real_fn!(
    read,
    c"read",
    fn(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t
);
real_fn!(
    write,
    c"write",
    fn(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t
);
real_fn!(
    readv,
    c"readv",
    fn(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t
);
real_fn!(
    writev,
    c"writev",
    fn(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t
);
real_fn!(
    pread,
    c"pread64",
    fn(fd: c_int, buf: *mut c_void, n: size_t, off: libc::off64_t) -> ssize_t
);
real_fn!(
    pwrite,
    c"pwrite64",
    fn(fd: c_int, buf: *const c_void, n: size_t, off: libc::off64_t) -> ssize_t
);
real_fn!(
    preadv,
    c"preadv64",
    fn(fd: c_int, iov: *const iovec, cnt: c_int, off: libc::off64_t) -> ssize_t
);
real_fn!(
    pwritev,
    c"pwritev64",
    fn(fd: c_int, iov: *const iovec, cnt: c_int, off: libc::off64_t) -> ssize_t
);
real_fn!(
    send,
    c"send",
    fn(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t
);
real_fn!(
    recv,
    c"recv",
    fn(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t
);
real_fn!(
    sendto,
    c"sendto",
    fn(
        fd: c_int,
        buf: *const c_void,
        n: size_t,
        flags: c_int,
        addr: *const libc::sockaddr,
        len: libc::socklen_t,
    ) -> ssize_t
);
real_fn!(
    recvfrom,
    c"recvfrom",
    fn(
        fd: c_int,
        buf: *mut c_void,
        n: size_t,
        flags: c_int,
        addr: *mut libc::sockaddr,
        len: *mut libc::socklen_t,
    ) -> ssize_t
);
real_fn!(
    sendmsg,
    c"sendmsg",
    fn(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t
);
real_fn!(
    recvmsg,
    c"recvmsg",
    fn(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t
);
real_fn!(
    sendfile,
    c"sendfile64",
    fn(out: c_int, inp: c_int, off: *mut libc::off64_t, n: size_t) -> ssize_t
);
real_fn!(
    copy_file_range,
    c"copy_file_range",
    fn(
        fd_in: c_int,
        off_in: *mut libc::off64_t,
        fd_out: c_int,
        off_out: *mut libc::off64_t,
        n: size_t,
        flags: libc::c_uint,
    ) -> ssize_t
);
real_fn!(
    splice,
    c"splice",
    fn(
        fd_in: c_int,
        off_in: *mut libc::off64_t,
        fd_out: c_int,
        off_out: *mut libc::off64_t,
        n: size_t,
        flags: libc::c_uint,
    ) -> ssize_t
);
real_fn!(
    poll,
    c"poll",
    fn(fds: *mut pollfd, n: libc::nfds_t, timeout: c_int) -> c_int
);
real_fn!(
    ppoll,
    c"ppoll",
    fn(
        fds: *mut pollfd,
        n: libc::nfds_t,
        ts: *const libc::timespec,
        mask: *const libc::sigset_t,
    ) -> c_int
);
real_fn!(
    epoll_ctl,
    c"epoll_ctl",
    fn(epfd: c_int, op: c_int, fd: c_int, ev: *mut libc::epoll_event) -> c_int
);
real_fn!(
    epoll_wait,
    c"epoll_wait",
    fn(epfd: c_int, ev: *mut libc::epoll_event, max: c_int, timeout: c_int) -> c_int
);
real_fn!(
    epoll_pwait,
    c"epoll_pwait",
    fn(
        epfd: c_int,
        ev: *mut libc::epoll_event,
        max: c_int,
        timeout: c_int,
        mask: *const libc::sigset_t,
    ) -> c_int
);
real_fn!(
    epoll_pwait2,
    c"epoll_pwait2",
    fn(
        epfd: c_int,
        ev: *mut libc::epoll_event,
        max: c_int,
        timeout: *const libc::timespec,
        mask: *const libc::sigset_t,
    ) -> c_int
);
real_fn!(
    select,
    c"select",
    fn(
        nfds: c_int,
        r: *mut libc::fd_set,
        w: *mut libc::fd_set,
        e: *mut libc::fd_set,
        tv: *mut libc::timeval,
    ) -> c_int
);
real_fn!(
    pselect,
    c"pselect",
    fn(
        nfds: c_int,
        r: *mut libc::fd_set,
        w: *mut libc::fd_set,
        e: *mut libc::fd_set,
        ts: *const libc::timespec,
        mask: *const libc::sigset_t,
    ) -> c_int
);
real_fn!(
    preadv2,
    c"preadv64v2",
    fn(fd: c_int, iov: *const iovec, cnt: c_int, off: libc::off64_t, flags: c_int) -> ssize_t
);
real_fn!(
    pwritev2,
    c"pwritev64v2",
    fn(fd: c_int, iov: *const iovec, cnt: c_int, off: libc::off64_t, flags: c_int) -> ssize_t
);
real_fn!(
    sendmmsg,
    c"sendmmsg",
    fn(fd: c_int, vec: *mut libc::mmsghdr, vlen: libc::c_uint, flags: c_int) -> c_int
);
real_fn!(
    recvmmsg,
    c"recvmmsg",
    fn(
        fd: c_int,
        vec: *mut libc::mmsghdr,
        vlen: libc::c_uint,
        flags: c_int,
        timeout: *mut libc::timespec,
    ) -> c_int
);
real_fn!(close, c"close", fn(fd: c_int) -> c_int);

/// glibc's `__chk_fail`: reports "buffer overflow detected" and aborts, as a fortified entry
/// point of glibc's own does when the caller's buffer is shorter than the length it gave.
pub fn chk_fail() -> ! {
    static CACHE: AtomicUsize = AtomicUsize::new(0);
    let p = lookup(&CACHE, c"__chk_fail");
    if p != 0 {
        // SAFETY: `p` is glibc's `void __chk_fail(void)`, which takes nothing and never
        // returns.
        let f: unsafe extern "C" fn() -> ! = unsafe { std::mem::transmute(p) };
        // SAFETY: no preconditions.
        unsafe { f() }
    }
    // SAFETY: abort has no preconditions.
    unsafe { libc::abort() }
}
