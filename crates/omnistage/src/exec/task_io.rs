//! `task_io`: tasks' sockets on the worker's own poller, and the standard async I/O traits.
//!
//! A task's socket is registered with its worker's `epoll` (no second reactor) under a token
//! above [`IO_TOKEN_BASE`], so the loop tells it from a stage's source. Sources are
//! edge-triggered; a read or write is always tried first, and only a `WouldBlock` leaves the
//! task's waker with the socket. Readiness then wakes the task, which is queued in its
//! activity like any wake: the bytes stay in the kernel until that activity's turn (lazy
//! receive), as for stages' sources. The poller is driven by the loop on this same thread, so
//! no readiness can slip in between the `WouldBlock` and the waker being stored.
//!
//! Sockets are `!Send`: they belong to the core whose poller they are registered with.
//! `TcpStream` implements `futures_io::{AsyncRead, AsyncWrite}` and, with the `hyper` feature,
//! `hyper::rt::{Read, Write}`; [`TaskExecutor`] and [`TaskTimer`] are hyper's `Executor` and
//! `Timer` on tasks.

use super::task::with_core;
use std::cell::Cell;
use std::future::Future;
use std::io::{self, Read, Write};
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

/// Tokens from here up belong to tasks' sockets (stages' sources sit below
/// `IO_REGISTRATIONS_MAX`).
pub(crate) const IO_TOKEN_BASE: usize = 1 << 32;
/// Most task sockets per core.
pub const TASK_SOCKETS_MAX: usize = 1 << 20;

const _: () = assert!(
    usize::BITS == 64,
    "task sockets' tokens need a 64-bit usize"
);

thread_local! {
    /// Live task sockets of this thread's core (the loop polls for I/O while any are).
    static LIVE: Cell<usize> = const { Cell::new(0) };
}

/// Whether this core has task sockets (the loop then polls the kernel while busy too).
pub(crate) fn io_live() -> bool {
    LIVE.get() > 0
}

struct IoSlot {
    generation: u32,
    live: bool,
    /// Worth trying a read (a write): set by readiness events, cleared by `WouldBlock` or a
    /// short transfer. A hint that errs only towards trying.
    readable: bool,
    writable: bool,
    /// The peer closed its side (or the socket failed): reported once by the edge-triggered
    /// poller, so from then on that direction stays worth trying (the read that returns 0,
    /// or the error, is still to come after a short transfer). As Tokio keeps its closed bits
    /// when it clears readiness.
    read_closed: bool,
    write_closed: bool,
    read: Option<Waker>,
    write: Option<Waker>,
}

/// The task sockets of one core.
pub(crate) struct IoTable {
    registry: mio::Registry,
    slots: Vec<IoSlot>,
    free: Vec<u32>,
}

impl IoTable {
    pub(crate) fn new(registry: mio::Registry) -> Self {
        IoTable {
            registry,
            slots: Vec::new(),
            free: Vec::new(),
        }
    }
}

/// Readiness of a task socket: wakes the tasks waiting on it.
pub(crate) fn io_event(ev: &mio::event::Event) {
    let index = ev.token().0 - IO_TOKEN_BASE;
    let read = ev.is_readable() || ev.is_read_closed() || ev.is_error();
    let write = ev.is_writable() || ev.is_write_closed() || ev.is_error();
    let wakers = with_core(|c| {
        let s = c.io.slots.get_mut(index)?;
        if !s.live {
            return None;
        }
        s.readable |= read;
        s.writable |= write;
        s.read_closed |= ev.is_read_closed() || ev.is_error();
        s.write_closed |= ev.is_write_closed() || ev.is_error();
        Some((
            if read { s.read.take() } else { None },
            if write { s.write.take() } else { None },
        ))
    })
    .flatten();
    // Woken outside the borrow: a waker may be anyone's.
    if let Some((r, w)) = wakers {
        if let Some(r) = r {
            r.wake();
        }
        if let Some(w) = w {
            w.wake();
        }
    }
}

/// A task socket's registration on its core.
#[derive(Clone, Copy, Debug)]
struct IoKey {
    runtime: usize,
    core: usize,
    index: u32,
    generation: u32,
}

#[derive(Clone, Copy)]
enum Dir {
    Read,
    Write,
}

fn not_on_worker() -> io::Error {
    io::Error::other("task sockets need a worker thread of a runtime with tasks")
}

fn register<S: mio::event::Source>(source: &mut S) -> io::Result<IoKey> {
    with_core(|c| {
        let index = match c.io.free.pop() {
            Some(i) => i,
            None => {
                if c.io.slots.len() >= TASK_SOCKETS_MAX {
                    return Err(io::Error::new(
                        io::ErrorKind::OutOfMemory,
                        "too many task sockets on this core",
                    ));
                }
                c.io.slots.push(IoSlot {
                    generation: 0,
                    live: false,
                    readable: false,
                    writable: false,
                    read_closed: false,
                    write_closed: false,
                    read: None,
                    write: None,
                });
                (c.io.slots.len() - 1) as u32
            }
        };
        if let Err(e) = c.io.registry.register(
            source,
            mio::Token(IO_TOKEN_BASE + index as usize),
            mio::Interest::READABLE | mio::Interest::WRITABLE,
        ) {
            c.io.free.push(index);
            return Err(e);
        }
        let s = &mut c.io.slots[index as usize];
        s.live = true;
        // Unknown until tried: the first read or write goes to the kernel.
        s.readable = true;
        s.writable = true;
        (s.read_closed, s.write_closed) = (false, false);
        LIVE.set(LIVE.get() + 1);
        Ok(IoKey {
            runtime: std::sync::Arc::as_ptr(&c.shared) as usize,
            core: c.core,
            index,
            generation: s.generation,
        })
    })
    .unwrap_or_else(|| Err(not_on_worker()))
}

fn deregister<S: mio::event::Source>(key: IoKey, source: &mut S) {
    // Off its core (or after its worker ended) there is nothing to do: closing the socket
    // takes it out of the poller.
    with_core(|c| {
        if std::sync::Arc::as_ptr(&c.shared) as usize != key.runtime || c.core != key.core {
            return None;
        }
        let s = c.io.slots.get_mut(key.index as usize)?;
        if !s.live || s.generation != key.generation {
            return None;
        }
        let _ = c.io.registry.deregister(source);
        s.live = false;
        s.generation = s.generation.wrapping_add(1);
        let (r, w) = (s.read.take(), s.write.take());
        c.io.free.push(key.index);
        LIVE.set(LIVE.get() - 1);
        Some((r, w))
    });
}

/// The live slot of `key` on this thread's core.
fn slot_of(c: &mut super::task::CoreTasks, key: IoKey) -> io::Result<&mut IoSlot> {
    if std::sync::Arc::as_ptr(&c.shared) as usize != key.runtime || c.core != key.core {
        return Err(io::Error::other("task socket polled off its core"));
    }
    c.io.slots
        .get_mut(key.index as usize)
        .filter(|s| s.live && s.generation == key.generation)
        .ok_or_else(|| io::Error::other("task socket is no longer registered"))
}

/// Leaves `waker` to be woken by the next readiness of `dir`.
fn park_in(s: &mut IoSlot, dir: Dir, waker: &Waker) {
    let slot = match dir {
        Dir::Read => &mut s.read,
        Dir::Write => &mut s.write,
    };
    match slot {
        Some(w) if w.will_wake(waker) => {}
        _ => *slot = Some(waker.clone()),
    }
}

fn ready_mut(s: &mut IoSlot, dir: Dir) -> &mut bool {
    match dir {
        Dir::Read => &mut s.readable,
        Dir::Write => &mut s.writable,
    }
}

/// Leaves `waker` to be woken by the next readiness of `dir` (whatever the readiness now).
fn park(key: IoKey, dir: Dir, waker: &Waker) -> io::Result<()> {
    with_core(|c| {
        park_in(slot_of(c, key)?, dir, waker);
        Ok(())
    })
    .unwrap_or_else(|| Err(not_on_worker()))
}

/// Whether `dir` is worth a syscall; if not, parks `waker` for its next readiness.
fn ready_or_park(key: IoKey, dir: Dir, waker: &Waker) -> io::Result<bool> {
    with_core(|c| {
        let s = slot_of(c, key)?;
        if *ready_mut(s, dir) {
            return Ok(true);
        }
        park_in(s, dir, waker);
        Ok(false)
    })
    .unwrap_or_else(|| Err(not_on_worker()))
}

/// `dir` has nothing more for now (a `WouldBlock` or a short transfer); with `waker`, also
/// parks it. A socket that is gone is left to the next call to report.
fn not_ready(key: IoKey, dir: Dir, waker: Option<&Waker>) {
    with_core(|c| {
        if waker.is_some() {
            // A syscall that found nothing (the slow path already): counted.
            if let Some(t) = &c.shared.tasks {
                t.io_would_block
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
        if let Ok(s) = slot_of(c, key) {
            let closed = match dir {
                Dir::Read => s.read_closed,
                Dir::Write => s.write_closed,
            };
            // After the close's one event, only the call that reports it (0, or the error)
            // can tell the task: the socket stays worth trying.
            if !closed {
                *ready_mut(s, dir) = false;
            }
            if let Some(w) = waker {
                park_in(s, dir, w);
            }
        }
    });
}

/// Runs `op` while `dir` is ready and until it does not block; on `WouldBlock` (or when
/// `dir` is known not ready) parks the waker for `dir`. `want` is the bytes asked for: a
/// transfer of fewer (but not none) means the kernel had no more, so `dir` is not ready until
/// its next event (`transferred` says how many bytes a result moved; `None` for accepts).
fn poll_io<T>(
    key: IoKey,
    dir: Dir,
    cx: &mut Context<'_>,
    want: usize,
    transferred: impl Fn(&T) -> Option<usize>,
    mut op: impl FnMut() -> io::Result<T>,
) -> Poll<io::Result<T>> {
    match ready_or_park(key, dir, cx.waker()) {
        Ok(true) => {}
        Ok(false) => return Poll::Pending,
        Err(e) => return Poll::Ready(Err(e)),
    }
    loop {
        match op() {
            Ok(v) => {
                if transferred(&v).is_some_and(|n| n > 0 && n < want) {
                    not_ready(key, dir, None);
                }
                return Poll::Ready(Ok(v));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                not_ready(key, dir, Some(cx.waker()));
                return Poll::Pending;
            }
            Err(e) => return Poll::Ready(Err(e)),
        }
    }
}

/// [`poll_io`] for a read or write of `want` bytes.
fn poll_bytes(
    key: IoKey,
    dir: Dir,
    cx: &mut Context<'_>,
    want: usize,
    op: impl FnMut() -> io::Result<usize>,
) -> Poll<io::Result<usize>> {
    poll_io(key, dir, cx, want, |&n| Some(n), op)
}

fn io_len(bufs: &[io::IoSlice<'_>]) -> usize {
    bufs.iter().map(|b| b.len()).sum()
}

/// A TCP connection of a task, on its core's poller.
pub struct TcpStream {
    io: mio::net::TcpStream,
    key: IoKey,
    /// Registered with this core's poller: it stays here.
    _core_bound: PhantomData<*const ()>,
}

impl TcpStream {
    /// Registers a connected (or connecting) std stream with this core's poller.
    pub fn from_std(stream: std::net::TcpStream) -> io::Result<Self> {
        stream.set_nonblocking(true)?;
        Self::from_mio(mio::net::TcpStream::from_std(stream))
    }

    fn from_mio(mut io: mio::net::TcpStream) -> io::Result<Self> {
        let key = register(&mut io)?;
        Ok(TcpStream {
            io,
            key,
            _core_bound: PhantomData,
        })
    }

    /// Connects to `addr` (the connect completes on the poller).
    pub async fn connect(addr: SocketAddr) -> io::Result<TcpStream> {
        let s = Self::from_mio(mio::net::TcpStream::connect(addr)?)?;
        std::future::poll_fn(|cx| {
            if let Some(e) = s.io.take_error()? {
                return Poll::Ready(Err(e));
            }
            match s.io.peer_addr() {
                Ok(_) => Poll::Ready(Ok(())),
                Err(e)
                    if e.kind() == io::ErrorKind::NotConnected
                        || e.raw_os_error() == Some(libc::EINPROGRESS) =>
                {
                    park(s.key, Dir::Write, cx.waker())?;
                    Poll::Pending
                }
                Err(e) => Poll::Ready(Err(e)),
            }
        })
        .await?;
        Ok(s)
    }

    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.io.peer_addr()
    }
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.io.local_addr()
    }
    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        self.io.set_nodelay(on)
    }

    /// Reads what is there into `buf` (0: the peer closed), or waits for readiness.
    pub fn poll_read_some(&self, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<io::Result<usize>> {
        let want = buf.len();
        poll_bytes(self.key, Dir::Read, cx, want, || (&self.io).read(buf))
    }

    /// Writes what fits of `buf`, or waits for room.
    pub fn poll_write_some(&self, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let want = buf.len();
        poll_bytes(self.key, Dir::Write, cx, want, || (&self.io).write(buf))
    }

    fn poll_write_vectored_some(
        &self,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let want = io_len(bufs);
        poll_bytes(self.key, Dir::Write, cx, want, || {
            (&self.io).write_vectored(bufs)
        })
    }

    /// Reads into `buf` once data is there.
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        std::future::poll_fn(|cx| self.poll_read_some(cx, buf)).await
    }

    /// Writes all of `buf`.
    pub async fn write_all(&self, mut buf: &[u8]) -> io::Result<()> {
        while !buf.is_empty() {
            let n = std::future::poll_fn(|cx| self.poll_write_some(cx, buf)).await?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            buf = &buf[n..];
        }
        Ok(())
    }

    /// Closes the write side (the peer reads end of stream).
    pub fn shutdown_write(&self) -> io::Result<()> {
        match self.io.shutdown(std::net::Shutdown::Write) {
            Err(e) if e.kind() == io::ErrorKind::NotConnected => Ok(()),
            r => r,
        }
    }
}

impl Drop for TcpStream {
    fn drop(&mut self) {
        deregister(self.key, &mut self.io);
    }
}

impl futures_io::AsyncRead for TcpStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_read_some(cx, buf)
    }
}

impl futures_io::AsyncWrite for TcpStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_some(cx, buf)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored_some(cx, bufs)
    }
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Nothing is buffered here: writes go straight to the kernel.
        Poll::Ready(Ok(()))
    }
    fn poll_close(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.shutdown_write())
    }
}

/// A TCP listener of a task, on its core's poller.
pub struct TcpListener {
    io: mio::net::TcpListener,
    key: IoKey,
    _core_bound: PhantomData<*const ()>,
}

impl TcpListener {
    /// Binds on this core (call from a task or a stage handler on a worker).
    pub fn bind(addr: SocketAddr) -> io::Result<Self> {
        Self::from_mio(mio::net::TcpListener::bind(addr)?)
    }

    /// Registers a bound std listener with this core's poller (a listener shared by several
    /// cores is one `try_clone` per core; each core's accepts race, the losers see
    /// `WouldBlock`).
    pub fn from_std(listener: std::net::TcpListener) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        Self::from_mio(mio::net::TcpListener::from_std(listener))
    }

    fn from_mio(mut io: mio::net::TcpListener) -> io::Result<Self> {
        let key = register(&mut io)?;
        Ok(TcpListener {
            io,
            key,
            _core_bound: PhantomData,
        })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.io.local_addr()
    }

    /// Accepts a connection (registered with this core), or waits for one.
    pub fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<(TcpStream, SocketAddr)>> {
        match poll_io(self.key, Dir::Read, cx, 0, |_| None, || self.io.accept()) {
            Poll::Ready(Ok((s, addr))) => Poll::Ready(TcpStream::from_mio(s).map(|s| (s, addr))),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }

    /// The next connection.
    pub fn accept(&self) -> Accept<'_> {
        Accept { listener: self }
    }
}

impl Drop for TcpListener {
    fn drop(&mut self) {
        deregister(self.key, &mut self.io);
    }
}

/// The future of [`TcpListener::accept`].
pub struct Accept<'a> {
    listener: &'a TcpListener,
}

impl Future for Accept<'_> {
    type Output = io::Result<(TcpStream, SocketAddr)>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.listener.poll_accept(cx)
    }
}

#[cfg(feature = "hyper")]
mod hyper_rt {
    //! hyper 1.x's runtime traits on tasks (the `hyper` feature).
    use super::*;
    use std::time::{Duration, Instant};

    impl hyper::rt::Read for TcpStream {
        fn poll_read(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            mut buf: hyper::rt::ReadBufCursor<'_>,
        ) -> Poll<io::Result<()>> {
            use std::os::fd::AsRawFd;
            let fd = self.io.as_raw_fd();
            // SAFETY: the slice is only written by the kernel below (never read, never
            // uninitialized); reading into it directly spares zeroing hyper's whole read
            // buffer on every read (8 KiB and more).
            let dst = unsafe { buf.as_mut() };
            let (ptr, len) = (dst.as_mut_ptr(), dst.len());
            let r = poll_bytes(self.key, Dir::Read, cx, len, || {
                // SAFETY: `ptr` and `len` describe the unfilled part of hyper's buffer,
                // valid for writes for this call.
                let n = unsafe { libc::recv(fd, ptr.cast(), len, 0) };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match r {
                Poll::Ready(Ok(n)) => {
                    // SAFETY: the kernel initialized exactly `n` bytes of the unfilled part.
                    unsafe { buf.advance(n) };
                    Poll::Ready(Ok(()))
                }
                Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                Poll::Pending => Poll::Pending,
            }
        }
    }

    impl hyper::rt::Write for TcpStream {
        fn poll_write(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.poll_write_some(cx, buf)
        }
        fn poll_write_vectored(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            bufs: &[io::IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            self.poll_write_vectored_some(cx, bufs)
        }
        fn is_write_vectored(&self) -> bool {
            true
        }
        fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(self.shutdown_write())
        }
    }

    /// hyper's `Executor` on tasks: a future hyper hands over runs as a task on this core, in
    /// the current activity.
    #[derive(Clone, Copy, Debug, Default)]
    pub struct TaskExecutor;

    impl<F> hyper::rt::Executor<F> for TaskExecutor
    where
        F: Future + 'static,
    {
        fn execute(&self, future: F) {
            if let Err(e) = crate::task::spawn(future) {
                // Refusals come in floods under overload (one per connection or stream a
                // peer opens), and this line is written on the worker's thread: the 1st,
                // 2nd, 4th, 8th... only.
                static REFUSED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let n = REFUSED.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                if n.is_power_of_two() {
                    eprintln!(
                        "omnistage: hyper's executor could not spawn a task: {e} ({n} refused \
                         so far; further ones logged at each power of two)"
                    );
                }
            }
        }
    }

    /// hyper's `Timer` on the worker's timers.
    #[derive(Clone, Copy, Debug, Default)]
    pub struct TaskTimer;

    impl hyper::rt::Sleep for crate::task::Sleep {}

    impl hyper::rt::Timer for TaskTimer {
        fn sleep(&self, d: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
            Box::pin(crate::task::sleep(d))
        }
        fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
            Box::pin(crate::task::sleep_until_instant(deadline))
        }
    }
}

#[cfg(feature = "hyper")]
pub use hyper_rt::{TaskExecutor, TaskTimer};
