//! The hooks of the calls that move bytes (read, write, their vectored, positioned, socket and
//! file-to-file forms): each takes the libc function's arguments unchanged and has its
//! contract (the caller's pointers are valid for the lengths it gives).

use super::*;

/// Largest transfer a hook hands on in one real call (what a read may return anyway).
const MAX_IO: usize = 0x7fff_f000;

/// Copies the part `[skip, skip + len)` of an iovec array into `out`; returns the entries used.
///
/// # Safety
/// `iov` must point to `cnt` valid iovecs (when `cnt > 0`).
unsafe fn iov_window(
    iov: *const iovec,
    cnt: c_int,
    skip: usize,
    len: usize,
    out: &mut [iovec; 64],
) -> c_int {
    if iov.is_null() || cnt <= 0 {
        return 0;
    }
    // SAFETY: the caller's contract: `cnt` iovecs at `iov`.
    let src = unsafe { std::slice::from_raw_parts(iov, cnt as usize) };
    let (mut skip, mut left, mut n) = (skip, len, 0usize);
    for v in src {
        if left == 0 || n == out.len() {
            break;
        }
        if skip >= v.iov_len {
            skip -= v.iov_len;
            continue;
        }
        let take = (v.iov_len - skip).min(left);
        // SAFETY: `skip < iov_len`, so the pointer stays inside the caller's buffer.
        out[n] = iovec {
            iov_base: unsafe { v.iov_base.cast::<u8>().add(skip) }.cast(),
            iov_len: take,
        };
        skip = 0;
        left -= take;
        n += 1;
    }
    n as c_int
}

/// Whether an iovec array of `cnt` entries (a count the kernel takes) can be read; a bad count
/// is left to the real call.
fn iovecs_readable(iov: *const iovec, cnt: c_int) -> bool {
    !(1..=libc::UIO_MAXIOV).contains(&cnt)
        || readable(iov.cast(), cnt as usize * std::mem::size_of::<iovec>())
}

/// Total bytes of an iovec array (saturating), or `None` for a bad count (left to the kernel).
///
/// # Safety
/// `iov` must point to `cnt` valid iovecs.
unsafe fn iov_total(iov: *const iovec, cnt: c_int) -> Option<usize> {
    if iov.is_null() || !(1..=libc::UIO_MAXIOV).contains(&cnt) {
        return None;
    }
    // SAFETY: the caller's contract.
    let src = unsafe { std::slice::from_raw_parts(iov, cnt as usize) };
    Some(
        src.iter()
            .fold(0usize, |a, v| a.saturating_add(v.iov_len))
            .min(MAX_IO),
    )
}

fn flags_of(flags: c_int) -> Flags {
    Flags {
        dontwait: flags & libc::MSG_DONTWAIT != 0,
        waitall: flags & libc::MSG_WAITALL != 0,
        whole: false,
    }
}

/// The legs of a transfer from `fd_in` to `fd_out` (sendfile, copy_file_range, splice).
fn in_out(fd_in: c_int, fd_out: c_int) -> [Leg; 2] {
    [
        Leg {
            fd: fd_in,
            dir: Dir::Read,
        },
        Leg {
            fd: fd_out,
            dir: Dir::Write,
        },
    ]
}

fn leg(fd: c_int, dir: Dir) -> [Leg; 1] {
    [Leg { fd, dir }]
}

/// # Safety
/// read(2)'s contract.
pub unsafe fn hook_read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    hooks::transfer(
        &leg(fd, Dir::Read),
        n.min(MAX_IO),
        Flags::default(),
        |done, len| {
            // SAFETY: `done + len <= n`: inside the caller's buffer.
            unsafe { real::read(fd, buf.cast::<u8>().add(done).cast(), len) }
        },
    )
}

/// # Safety
/// write(2)'s contract.
pub unsafe fn hook_write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    hooks::transfer(
        &leg(fd, Dir::Write),
        n.min(MAX_IO),
        Flags::default(),
        |done, len| {
            // SAFETY: `done + len <= n`.
            unsafe { real::write(fd, buf.cast::<u8>().add(done).cast(), len) }
        },
    )
}

/// # Safety
/// pread(2)'s contract.
pub unsafe fn hook_pread(fd: c_int, buf: *mut c_void, n: size_t, off: libc::off64_t) -> ssize_t {
    hooks::transfer(
        &leg(fd, Dir::Read),
        n.min(MAX_IO),
        Flags::default(),
        |done, len| {
            // SAFETY: `done + len <= n`.
            unsafe {
                real::pread(
                    fd,
                    buf.cast::<u8>().add(done).cast(),
                    len,
                    off + done as libc::off64_t,
                )
            }
        },
    )
}

/// # Safety
/// pwrite(2)'s contract.
pub unsafe fn hook_pwrite(fd: c_int, buf: *const c_void, n: size_t, off: libc::off64_t) -> ssize_t {
    hooks::transfer(
        &leg(fd, Dir::Write),
        n.min(MAX_IO),
        Flags::default(),
        |done, len| {
            // SAFETY: `done + len <= n`.
            unsafe {
                real::pwrite(
                    fd,
                    buf.cast::<u8>().add(done).cast(),
                    len,
                    off + done as libc::off64_t,
                )
            }
        },
    )
}

/// # Safety
/// readv/writev/preadv/pwritev's contract; `call(iov, cnt, done)` makes the real call.
unsafe fn vectored(
    fd: c_int,
    iov: *const iovec,
    cnt: c_int,
    dir: Dir,
    flags: Flags,
    call: impl Fn(*const iovec, c_int, usize) -> ssize_t,
) -> ssize_t {
    if passes_through() || !iovecs_readable(iov, cnt) {
        // Not shaped, or an iovec array the kernel would refuse with EFAULT: the real call
        // sees it first.
        return call(iov, cnt, 0);
    }
    // SAFETY: the caller's contract (and the array was readable just now).
    let Some(total) = (unsafe { iov_total(iov, cnt) }) else {
        return call(iov, cnt, 0);
    };
    hooks::transfer(&leg(fd, dir), total, flags, |done, len| {
        if done == 0 && len == total {
            return call(iov, cnt, 0);
        }
        let mut w = [iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; 64];
        // A piece may span more iovecs than a window holds: a write goes on window by window
        // until the piece is moved, as the real call would have moved it (a blocking write
        // returns short only on an error). A read takes one window: a second read could block
        // for bytes the real call would not have waited for, and a short read is allowed.
        // Bounded: each round moves at least one byte or returns.
        let mut moved = 0usize;
        loop {
            // SAFETY: the caller's contract.
            let k = unsafe { iov_window(iov, cnt, done + moved, len - moved, &mut w) };
            let window: usize = w[..k as usize].iter().map(|v| v.iov_len).sum();
            let r = call(w.as_ptr(), k, done + moved);
            if r < 0 {
                return if moved > 0 { moved as ssize_t } else { r };
            }
            moved += r as usize;
            if dir == Dir::Read || r == 0 || (r as usize) < window || moved >= len {
                return moved as ssize_t;
            }
        }
    })
}

/// # Safety
/// readv(2)'s contract.
pub unsafe fn hook_readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    // SAFETY: the caller's contract; `vectored` passes valid windows of `iov`.
    unsafe {
        vectored(fd, iov, cnt, Dir::Read, Flags::default(), |v, k, _| {
            real::readv(fd, v, k)
        })
    }
}

/// # Safety
/// writev(2)'s contract.
pub unsafe fn hook_writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    // SAFETY: as in `hook_readv`.
    unsafe {
        vectored(fd, iov, cnt, Dir::Write, Flags::default(), |v, k, _| {
            real::writev(fd, v, k)
        })
    }
}

/// # Safety
/// preadv(2)'s contract.
pub unsafe fn hook_preadv(fd: c_int, iov: *const iovec, cnt: c_int, off: libc::off64_t) -> ssize_t {
    // SAFETY: as in `hook_readv`.
    unsafe {
        vectored(fd, iov, cnt, Dir::Read, Flags::default(), |v, k, d| {
            real::preadv(fd, v, k, off + d as libc::off64_t)
        })
    }
}

/// # Safety
/// pwritev(2)'s contract.
pub unsafe fn hook_pwritev(
    fd: c_int,
    iov: *const iovec,
    cnt: c_int,
    off: libc::off64_t,
) -> ssize_t {
    // SAFETY: as in `hook_readv`.
    unsafe {
        vectored(fd, iov, cnt, Dir::Write, Flags::default(), |v, k, d| {
            real::pwritev(fd, v, k, off + d as libc::off64_t)
        })
    }
}

/// preadv2/pwritev2's offset for the part `done` bytes in: -1 (the file position, which the
/// kernel advances) stays -1.
fn offset_at(off: libc::off64_t, done: usize) -> libc::off64_t {
    if off == -1 {
        -1
    } else {
        off + done as libc::off64_t
    }
}

fn rwf_flags(flags: c_int) -> Flags {
    Flags {
        dontwait: flags & libc::RWF_NOWAIT != 0,
        ..Flags::default()
    }
}

/// # Safety
/// preadv2(2)'s contract.
pub unsafe fn hook_preadv2(
    fd: c_int,
    iov: *const iovec,
    cnt: c_int,
    off: libc::off64_t,
    flags: c_int,
) -> ssize_t {
    // SAFETY: as in `hook_readv`.
    unsafe {
        vectored(fd, iov, cnt, Dir::Read, rwf_flags(flags), |v, k, d| {
            real::preadv2(fd, v, k, offset_at(off, d), flags)
        })
    }
}

/// # Safety
/// pwritev2(2)'s contract.
pub unsafe fn hook_pwritev2(
    fd: c_int,
    iov: *const iovec,
    cnt: c_int,
    off: libc::off64_t,
    flags: c_int,
) -> ssize_t {
    // SAFETY: as in `hook_readv`.
    unsafe {
        vectored(fd, iov, cnt, Dir::Write, rwf_flags(flags), |v, k, d| {
            real::pwritev2(fd, v, k, offset_at(off, d), flags)
        })
    }
}

/// sendmmsg/recvmmsg: whole messages, as a datagram socket's `sendmsg`/`recvmsg` moves them,
/// whatever the socket ([`Flags::whole`]): the call waits until the buckets are out of debt, is
/// one real call, and is charged the bytes of the messages it moved (their `msg_len`). A bad
/// array, or more messages than the kernel takes, goes to the real call unshaped.
///
/// # Safety
/// sendmmsg/recvmmsg's contract: `vec` points to `vlen` valid mmsghdrs; `call()` makes the real
/// call on them.
unsafe fn messages(
    fd: c_int,
    vec: *mut libc::mmsghdr,
    vlen: libc::c_uint,
    flags: c_int,
    dir: Dir,
    call: impl Fn() -> c_int,
) -> c_int {
    let n = (vlen as usize).min(libc::UIO_MAXIOV as usize);
    if vec.is_null()
        || n == 0
        || flags & libc::MSG_PEEK != 0
        || passes_through()
        || !readable(vec.cast(), n * std::mem::size_of::<libc::mmsghdr>())
    {
        return call();
    }
    // SAFETY: the caller's contract (the array was readable just now): `n <= vlen` headers.
    let hdrs = unsafe { std::slice::from_raw_parts(vec, n) };
    let mut total = 0usize;
    for h in hdrs {
        let (iov, cnt) = (h.msg_hdr.msg_iov, h.msg_hdr.msg_iovlen as c_int);
        if cnt == 0 {
            continue;
        }
        if !iovecs_readable(iov, cnt) {
            return call();
        }
        // SAFETY: the header's iovecs, readable just now.
        match unsafe { iov_total(iov, cnt) } {
            Some(t) => total = total.saturating_add(t).min(MAX_IO),
            None => return call(),
        }
    }
    let count = std::cell::Cell::new(0 as c_int);
    let f = Flags {
        whole: true,
        ..flags_of(flags)
    };
    let r = hooks::transfer(&leg(fd, dir), total, f, |_, _| {
        let r = call();
        if r < 0 {
            return r as ssize_t;
        }
        count.set(r);
        // SAFETY: the kernel wrote `msg_len` of the first `r <= n` headers.
        let moved = unsafe { std::slice::from_raw_parts(vec, r as usize) }
            .iter()
            .fold(0usize, |a, h| a.saturating_add(h.msg_len as usize));
        moved as ssize_t
    });
    if r < 0 {
        -1
    } else {
        count.get()
    }
}

/// # Safety
/// sendmmsg(2)'s contract.
pub unsafe fn hook_sendmmsg(
    fd: c_int,
    vec: *mut libc::mmsghdr,
    vlen: libc::c_uint,
    flags: c_int,
) -> c_int {
    // SAFETY: the caller's contract, passed on unchanged.
    unsafe {
        messages(fd, vec, vlen, flags, Dir::Write, || {
            real::sendmmsg(fd, vec, vlen, flags)
        })
    }
}

/// # Safety
/// recvmmsg(2)'s contract.
pub unsafe fn hook_recvmmsg(
    fd: c_int,
    vec: *mut libc::mmsghdr,
    vlen: libc::c_uint,
    flags: c_int,
    timeout: *mut libc::timespec,
) -> c_int {
    // SAFETY: the caller's contract, passed on unchanged.
    unsafe {
        messages(fd, vec, vlen, flags, Dir::Read, || {
            real::recvmmsg(fd, vec, vlen, flags, timeout)
        })
    }
}

/// # Safety
/// send(2)'s contract.
pub unsafe fn hook_send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    hooks::transfer(
        &leg(fd, Dir::Write),
        n.min(MAX_IO),
        flags_of(flags),
        |done, len| {
            // SAFETY: `done + len <= n`.
            unsafe { real::send(fd, buf.cast::<u8>().add(done).cast(), len, flags) }
        },
    )
}

/// # Safety
/// recv(2)'s contract.
pub unsafe fn hook_recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    if flags & libc::MSG_PEEK != 0 {
        // A peek moves nothing.
        // SAFETY: the caller's contract.
        return unsafe { real::recv(fd, buf, n, flags) };
    }
    hooks::transfer(
        &leg(fd, Dir::Read),
        n.min(MAX_IO),
        flags_of(flags),
        |done, len| {
            // SAFETY: `done + len <= n`.
            unsafe { real::recv(fd, buf.cast::<u8>().add(done).cast(), len, flags) }
        },
    )
}

/// # Safety
/// sendto(2)'s contract.
pub unsafe fn hook_sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const libc::sockaddr,
    alen: libc::socklen_t,
) -> ssize_t {
    hooks::transfer(
        &leg(fd, Dir::Write),
        n.min(MAX_IO),
        flags_of(flags),
        |done, len| {
            // SAFETY: `done + len <= n`; the address is the caller's.
            unsafe {
                real::sendto(
                    fd,
                    buf.cast::<u8>().add(done).cast(),
                    len,
                    flags,
                    addr,
                    alen,
                )
            }
        },
    )
}

/// # Safety
/// recvfrom(2)'s contract.
pub unsafe fn hook_recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut libc::sockaddr,
    alen: *mut libc::socklen_t,
) -> ssize_t {
    if flags & libc::MSG_PEEK != 0 {
        // SAFETY: the caller's contract.
        return unsafe { real::recvfrom(fd, buf, n, flags, addr, alen) };
    }
    hooks::transfer(
        &leg(fd, Dir::Read),
        n.min(MAX_IO),
        flags_of(flags),
        |done, len| {
            // SAFETY: `done + len <= n`; the address buffer is the caller's.
            unsafe {
                real::recvfrom(
                    fd,
                    buf.cast::<u8>().add(done).cast(),
                    len,
                    flags,
                    addr,
                    alen,
                )
            }
        },
    )
}

/// # Safety
/// sendmsg/recvmsg's contract; `call(msg)` makes the real call with a header whose iovecs may be
/// a window of the caller's.
unsafe fn message(
    fd: c_int,
    msg: *mut msghdr,
    flags: c_int,
    dir: Dir,
    call: impl Fn(*mut msghdr) -> ssize_t,
) -> ssize_t {
    if msg.is_null()
        || flags & libc::MSG_PEEK != 0
        || passes_through()
        || !readable(msg.cast(), std::mem::size_of::<msghdr>())
    {
        // Not shaped, a peek, or a header the kernel would refuse with EFAULT.
        return call(msg);
    }
    // SAFETY: the caller's contract: `msg` is a valid msghdr (readable just now).
    let (iov, cnt) = unsafe { ((*msg).msg_iov, (*msg).msg_iovlen as c_int) };
    if !iovecs_readable(iov, cnt) {
        return call(msg);
    }
    // SAFETY: the header's iovecs are valid.
    let Some(total) = (unsafe { iov_total(iov, cnt) }) else {
        return call(msg);
    };
    hooks::transfer(&leg(fd, dir), total, flags_of(flags), |done, len| {
        if done == 0 && len == total {
            return call(msg);
        }
        let mut w = [iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; 64];
        // SAFETY: the header's iovecs are valid; the copy of the header points at our window
        // for the call. For a receive, the fields the kernel writes back (name length,
        // control length, flags) are copied back to the caller's header; a send's header is
        // the caller's `const` one (it may be shared between threads, or read-only), never
        // written.
        unsafe {
            let k = iov_window(iov, cnt, done, len, &mut w);
            let mut m = std::ptr::read(msg);
            m.msg_iov = w.as_mut_ptr();
            m.msg_iovlen = k as _;
            let r = call(&mut m);
            if dir == Dir::Read {
                (*msg).msg_namelen = m.msg_namelen;
                (*msg).msg_controllen = m.msg_controllen;
                (*msg).msg_flags = m.msg_flags;
            }
            r
        }
    })
}

/// # Safety
/// sendmsg(2)'s contract.
pub unsafe fn hook_sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    // SAFETY: the caller's contract; sendmsg does not write through `msg` and neither does the
    // window (it writes back only for a receive).
    unsafe {
        message(fd, msg.cast_mut(), flags, Dir::Write, |m| {
            real::sendmsg(fd, m, flags)
        })
    }
}

/// # Safety
/// recvmsg(2)'s contract.
pub unsafe fn hook_recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    // SAFETY: the caller's contract.
    unsafe { message(fd, msg, flags, Dir::Read, |m| real::recvmsg(fd, m, flags)) }
}

/// # Safety
/// sendfile(2)'s contract.
pub unsafe fn hook_sendfile(out: c_int, inp: c_int, off: *mut libc::off64_t, n: size_t) -> ssize_t {
    let legs = in_out(inp, out);
    // The kernel advances the offset (or the file position) itself between pieces.
    // SAFETY: the caller's contract.
    hooks::transfer(&legs, n.min(MAX_IO), Flags::default(), |_, len| unsafe {
        real::sendfile(out, inp, off, len)
    })
}

/// # Safety
/// copy_file_range(2)'s contract.
pub unsafe fn hook_copy_file_range(
    fd_in: c_int,
    off_in: *mut libc::off64_t,
    fd_out: c_int,
    off_out: *mut libc::off64_t,
    n: size_t,
    flags: libc::c_uint,
) -> ssize_t {
    let legs = in_out(fd_in, fd_out);
    // SAFETY: the caller's contract; the kernel advances the offsets between pieces.
    hooks::transfer(&legs, n.min(MAX_IO), Flags::default(), |_, len| unsafe {
        real::copy_file_range(fd_in, off_in, fd_out, off_out, len, flags)
    })
}

/// # Safety
/// splice(2)'s contract.
pub unsafe fn hook_splice(
    fd_in: c_int,
    off_in: *mut libc::off64_t,
    fd_out: c_int,
    off_out: *mut libc::off64_t,
    n: size_t,
    flags: libc::c_uint,
) -> ssize_t {
    let legs = in_out(fd_in, fd_out);
    let f = Flags {
        dontwait: flags & libc::SPLICE_F_NONBLOCK != 0,
        ..Flags::default()
    };
    // SAFETY: the caller's contract; the kernel advances the offsets between pieces.
    hooks::transfer(&legs, n.min(MAX_IO), f, |_, len| unsafe {
        real::splice(fd_in, off_in, fd_out, off_out, len, flags)
    })
}
