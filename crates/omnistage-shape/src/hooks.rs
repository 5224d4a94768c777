//! What an interposed call does, in safe code: classify its descriptors, ask the group's buckets,
//! wait or fail with `EAGAIN`, make the real call (a closure built by `sys` around the libc
//! function) on as many bytes as were granted, and settle. `sys` owns every raw pointer; this
//! module sees lengths, descriptors and results.
//!
//! Semantics kept:
//! - A blocking call waits for tokens (sleeping on the monotonic clock, never spinning); on a
//!   socket or a pipe, a signal handler ends that wait as it would end the kernel's wait in the
//!   real call (`EINTR` unless `SA_RESTART` with nothing moved, the partial count with bytes
//!   moved; `sys::sleep_until_interruptible`); on a file it does not. A
//!   blocking transfer on a file, or any blocking write or send, moves all its bytes in granted
//!   pieces and returns short only when the real call does (end of file, a full disk, an error
//!   after some bytes). A blocking read from a stream socket returns after one real call, as
//!   `recv` does (unless `MSG_WAITALL`); it reserves no tokens while it waits for its peer, and
//!   is charged for what it moved when it returns ([`Mode::Deferred`]).
//! - A write to a file (`write`, `writev`, `pwrite`, `pwritev`) is one real call, as unshaped:
//!   the kernel makes it atomic (with `O_APPEND`, or on a description shared across `fork`,
//!   no other writer's bytes land inside it), and pieces with the group's lock released between
//!   them would interleave the records of writers sharing a log. It waits until a piece could
//!   start and is charged all its bytes, the buckets going into debt ([`Mode::Atomic`]).
//! - A non-blocking call (`O_NONBLOCK` or `MSG_DONTWAIT`) moves what the buckets allow now, or
//!   fails with `EAGAIN` when they allow nothing.
//! - Message sockets (UDP, SEQPACKET) move whole messages: the call waits until the buckets are
//!   out of debt and is charged afterwards.
//! - `poll`/`ppoll`: a descriptor the program may not use yet has its `POLLIN`/`POLLOUT` taken out
//!   of the request and the wait is cut to when the buckets allow it, so a program that polls a
//!   throttled socket sleeps instead of spinning on `EAGAIN`.
//!   `select`/`pselect` do the same on copies of the sets, `epoll_wait`/`epoll_pwait` on the
//!   kernel's set (`sys::epoll`).
//! - errno is what the real call set; our own bookkeeping never changes it.
//! - Re-entry (a signal handler writing while this thread is inside a hook, or our own code
//!   calling an interposed function) goes straight to the real call.

use crate::meter::{Class, Dir, Mode, Need, Verdict};
use crate::sys;
use std::cell::Cell;

thread_local! {
    static IN_HOOK: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as inside a hook; `None` if it already is.
pub(crate) struct Guard;

/// Whether this thread is inside a hook now (a call made now is a re-entry: from a signal
/// handler that interrupted a hook, or from the library's own code).
pub(crate) fn in_hook() -> bool {
    IN_HOOK.try_with(|f| f.get()).unwrap_or(true)
}

impl Guard {
    pub(crate) fn enter() -> Option<Guard> {
        IN_HOOK
            .try_with(|f| {
                if f.get() {
                    None
                } else {
                    f.set(true);
                    Some(Guard)
                }
            })
            .ok()
            .flatten()
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = IN_HOOK.try_with(|f| f.set(false));
    }
}

/// What a descriptor is, as far as shaping goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FdKind {
    /// Not shaped: pipes, terminals, character devices, Unix and netlink sockets, bad fds.
    Other,
    /// A regular file or a block device.
    File,
    /// An IPv4/IPv6 socket; `message` for datagram and sequenced-packet sockets.
    Socket { message: bool, nonblocking: bool },
}

/// One descriptor of a transfer and the direction its bytes go.
#[derive(Clone, Copy, Debug)]
pub struct Leg {
    pub fd: i32,
    pub dir: Dir,
}

/// Flags of the socket calls that change how a transfer is shaped.
#[derive(Clone, Copy, Debug, Default)]
pub struct Flags {
    /// `MSG_DONTWAIT`.
    pub dontwait: bool,
    /// `MSG_WAITALL`.
    pub waitall: bool,
    /// The call moves whole messages whatever its socket (`sendmmsg`/`recvmmsg`): one real
    /// call, [`Mode::Whole`].
    pub whole: bool,
}

/// Runs one transfer of at most `want` bytes. `op(done, len)` makes the real call for `len`
/// bytes starting `done` bytes in and returns its result (errno set by the call).
pub fn transfer(
    legs: &[Leg],
    want: usize,
    flags: Flags,
    mut op: impl FnMut(usize, usize) -> isize,
) -> isize {
    if sys::passes_through() {
        return op(0, want);
    }
    let Some(_guard) = Guard::enter() else {
        return op(0, want);
    };
    let Some(ctx) = sys::context() else {
        return op(0, want);
    };
    if ctx.is_unlimited() {
        return op(0, want);
    }
    let mut need = Need::default();
    let mut nonblocking = flags.dontwait;
    let mut message = false;
    let mut stream_socket_read = false;
    let mut file_write = false;
    // A leg on a pipe (or another descriptor that is neither a file nor a shaped socket), as
    // `splice` has: the real call moves what the pipe holds or has room for and returns, and
    // a second one would block for bytes or room the caller did not wait for.
    let mut pipe_leg = false;
    let mut socket_leg = false;
    for leg in legs {
        match sys::classify(leg.fd) {
            FdKind::Other => pipe_leg = true,
            FdKind::File => {
                need.add(Class::Disk, leg.dir);
                file_write |= leg.dir == Dir::Write;
            }
            FdKind::Socket {
                message: m,
                nonblocking: nb,
            } => {
                need.add(Class::Net, leg.dir);
                socket_leg = true;
                nonblocking |= nb;
                message |= m;
                stream_socket_read |= !m && leg.dir == Dir::Read;
            }
        }
    }
    if need == Need::default() || want == 0 || !ctx.limits(&need) {
        return op(0, want);
    }
    // A write to a file, and nothing else (a `copy_file_range` or `sendfile` to a file is not
    // atomic in the kernel either), goes whole (see the module's doc).
    let atomic = file_write && legs.len() == 1;
    let mode = if message || flags.whole {
        Mode::Whole
    } else if atomic {
        Mode::Atomic
    } else if stream_socket_read && !nonblocking {
        // It may wait in the kernel for its peer: it must not hold tokens meanwhile.
        Mode::Deferred
    } else {
        Mode::Stream
    };
    // One real call, or as many as it takes to move everything (see the module's doc).
    let once = nonblocking
        || message
        || flags.whole
        || atomic
        || pipe_leg
        || (stream_socket_read && !flags.waitall);
    // Waiting for a socket or a pipe is interruptible in the kernel (a handler without
    // `SA_RESTART` ends the call with its partial count or `EINTR`); on a regular file it is
    // not, and neither is the wait for its tokens.
    let interruptible = pipe_leg || socket_leg;
    let mut done = 0usize;
    loop {
        let remaining = (want - done) as u64;
        let granted = match ctx.request(&need, remaining, mode) {
            Verdict::Go(n) => n.min(remaining) as usize,
            Verdict::Wait(until) => {
                if nonblocking {
                    if done > 0 {
                        return done as isize;
                    }
                    for leg in legs {
                        // An edge-triggered epoll registration owes this descriptor an edge.
                        sys::note_starved(leg.fd);
                    }
                    sys::set_errno(libc::EAGAIN);
                    return -1;
                }
                if !interruptible {
                    let _ = sys::sleep_until(until);
                    continue;
                }
                // With bytes moved, the real call returns their count for any handler that
                // ran (as a stream socket's send or MSG_WAITALL recv does, with SA_RESTART or
                // not); with none, it fails with EINTR unless the handler has SA_RESTART.
                let slept = if done > 0 {
                    sys::sleep_until(until)
                } else {
                    sys::sleep_until_interruptible(until)
                };
                if !slept {
                    if done > 0 {
                        return done as isize;
                    }
                    sys::set_errno(libc::EINTR);
                    return -1;
                }
                continue;
            }
        };
        let r = op(done, granted);
        let errno = sys::errno();
        ctx.settle(&need, mode, granted as u64, r.max(0) as u64);
        sys::set_errno(errno);
        if r < 0 {
            // Bytes already moved are reported; the error shows on the next call, as the
            // kernel does for a write that fails part way.
            return if done > 0 { done as isize } else { r };
        }
        done += r as usize;
        if once || (r as usize) < granted || done >= want {
            return done as isize;
        }
    }
}

/// A descriptor's readiness asked by `poll`: the events are `POLLIN`/`POLLOUT` style bits.
#[derive(Clone, Copy, Debug)]
pub struct PollAsk {
    pub fd: i32,
    pub wants_read: bool,
    pub wants_write: bool,
}

/// For `poll`: which of `asks` may not be used yet, and until when. Returns, per entry, whether
/// to take out its read and its write interest, and the earliest time one of them frees up.
/// `None` when nothing is held back (the caller polls as asked).
pub fn poll_plan(asks: &[PollAsk], held: &mut [(bool, bool)]) -> Option<u64> {
    if sys::passes_through() {
        return None;
    }
    let _guard = Guard::enter()?;
    let ctx = sys::context()?;
    if ctx.is_unlimited() {
        return None;
    }
    let mut earliest: Option<u64> = None;
    for (ask, h) in asks.iter().zip(held.iter_mut()) {
        *h = (false, false);
        if ask.fd < 0 || !(ask.wants_read || ask.wants_write) {
            continue;
        }
        let class = match sys::classify(ask.fd) {
            FdKind::Other => continue,
            FdKind::File => Class::Disk,
            FdKind::Socket { .. } => Class::Net,
        };
        for (wants, dir) in [(ask.wants_read, Dir::Read), (ask.wants_write, Dir::Write)] {
            if !wants {
                continue;
            }
            let need = Need::of(class, dir);
            if !ctx.limits(&need) {
                continue;
            }
            if let Some(at) = ctx.ready_at(&need) {
                if dir == Dir::Read {
                    h.0 = true;
                } else {
                    h.1 = true;
                }
                earliest = Some(earliest.map_or(at, |e: u64| e.min(at)));
            }
        }
    }
    earliest
}

/// The timeout to give the real poll, in ns: the caller's deadline (`None` = forever) cut to
/// `until_ns`, when the buckets allow a held descriptor again.
pub fn poll_timeout_ns(deadline_ns: Option<u64>, until_ns: u64, now_ns: u64) -> u64 {
    let end = deadline_ns.map_or(until_ns, |d| d.min(until_ns));
    end.saturating_sub(now_ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_timeout_is_cut_to_the_earlier() {
        assert_eq!(poll_timeout_ns(None, 5_500_000, 0), 5_500_000);
        assert_eq!(poll_timeout_ns(Some(2_000_000), 5_500_000, 0), 2_000_000);
        assert_eq!(poll_timeout_ns(Some(2_000_000), 5_500_000, 3_000_000), 0);
    }

    #[test]
    fn without_a_context_transfers_pass_through_unchanged() {
        // No OMNISTAGE_SHAPE_SEGMENT in a test process: the op gets the whole request once.
        let mut calls = Vec::new();
        let r = transfer(
            &[Leg {
                fd: 0,
                dir: Dir::Read,
            }],
            4096,
            Flags::default(),
            |done, len| {
                calls.push((done, len));
                17
            },
        );
        assert_eq!(r, 17);
        assert_eq!(calls, vec![(0, 4096)]);
    }

    #[test]
    fn re_entry_passes_through() {
        let g = Guard::enter().expect("first entry");
        assert!(Guard::enter().is_none());
        drop(g);
        assert!(Guard::enter().is_some());
    }
}
