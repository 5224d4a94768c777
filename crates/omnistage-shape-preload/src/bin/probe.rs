//! Test helper for the preload library (run under it by `tests/semantics.rs`): makes one
//! scenario's calls on real descriptors and prints `label result errno` per call, plus the bytes
//! it got where that matters. Not part of the library; its `unsafe` is plain libc use.

use libc::{c_int, c_void};
use std::ffi::CString;

fn out(label: &str, r: isize) {
    let e = if r < 0 {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    } else {
        0
    };
    println!("{label} {r} {e}");
}

fn tcp_pair() -> (c_int, c_int) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    use std::os::fd::IntoRawFd;
    (c.into_raw_fd(), s.into_raw_fd())
}

/// Opens `path` for writing, created or emptied.
fn create(path: &str) -> c_int {
    let p = CString::new(path).unwrap();
    // SAFETY: a valid C string; the descriptor is the caller's.
    unsafe {
        libc::open(
            p.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC,
            0o600,
        )
    }
}

fn nonblock(fd: c_int) {
    // SAFETY: fcntl on our own descriptor.
    unsafe {
        libc::fcntl(
            fd,
            libc::F_SETFL,
            libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK,
        )
    };
}

/// Which epoll wait call [`wait`] makes.
#[derive(Clone, Copy, PartialEq)]
enum Wait {
    Plain,
    P,
    P2,
}

/// A wait on `ep` for up to `ms`: prints `label n` and `label-events E` (the first event's bits).
unsafe fn wait(label: &str, ep: c_int, ms: c_int, how: Wait) {
    let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 4];
    let n = match how {
        Wait::P => libc::epoll_pwait(ep, evs.as_mut_ptr(), 4, ms, std::ptr::null()),
        Wait::P2 => {
            let ts = libc::timespec {
                tv_sec: libc::time_t::from(ms / 1000),
                tv_nsec: i64::from(ms % 1000) * 1_000_000,
            };
            libc::epoll_pwait2(ep, evs.as_mut_ptr(), 4, &ts, std::ptr::null())
        }
        Wait::Plain => libc::epoll_wait(ep, evs.as_mut_ptr(), 4, ms),
    };
    out(label, n as isize);
    let first = evs[0].events;
    println!("{label}-events {}", if n > 0 { first } else { 0 });
}

/// Registers `fd` in `ep` for `events`, its data the descriptor.
unsafe fn add(ep: c_int, fd: c_int, events: c_int) {
    let mut ev = libc::epoll_event {
        events: events as u32,
        u64: fd as u64,
    };
    assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev), 0);
}

/// A set of `words` longs that ends where its mapping does (the next page is `PROT_NONE`), as a
/// set sized for its `nfds` may: reading or writing past it faults.
///
/// # Safety
/// `words * 8` is at most a page.
unsafe fn set_at_page_end(words: usize) -> *mut libc::fd_set {
    let page = libc::sysconf(libc::_SC_PAGESIZE) as usize;
    let m = libc::mmap(
        std::ptr::null_mut(),
        2 * page,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
        -1,
        0,
    );
    assert_ne!(m, libc::MAP_FAILED);
    assert_eq!(
        libc::mprotect(m.cast::<u8>().add(page).cast(), page, libc::PROT_NONE),
        0
    );
    m.cast::<u8>().add(page - words * 8).cast()
}

/// Whether bit `fd` is set in a set of longs (the caller's own layout, read within its words).
///
/// # Safety
/// `set` is valid for the long that holds bit `fd`.
unsafe fn bit(set: *const libc::fd_set, fd: c_int) -> bool {
    let w = set.cast::<u64>().add(fd as usize / 64).read_unaligned();
    w & (1 << (fd % 64)) != 0
}

/// Sets bit `fd` in a set of longs, touching only the word that holds it.
///
/// # Safety
/// `set` is valid for reads and writes of the long that holds bit `fd`.
unsafe fn set_bit(set: *mut libc::fd_set, fd: c_int) {
    let p = set.cast::<u64>().add(fd as usize / 64);
    p.write_unaligned(p.read_unaligned() | 1 << (fd % 64));
}

extern "C" {
    // glibc's fortified entry points, as a program built with `_FORTIFY_SOURCE` calls them.
    fn __read_chk(fd: c_int, buf: *mut c_void, n: usize, buflen: usize) -> isize;
    fn __pread_chk(fd: c_int, buf: *mut c_void, n: usize, off: i64, buflen: usize) -> isize;
    fn __pread64_chk(fd: c_int, buf: *mut c_void, n: usize, off: i64, buflen: usize) -> isize;
    fn __recv_chk(fd: c_int, buf: *mut c_void, n: usize, buflen: usize, flags: c_int) -> isize;
    fn __recvfrom_chk(
        fd: c_int,
        buf: *mut c_void,
        n: usize,
        buflen: usize,
        flags: c_int,
        addr: *mut libc::sockaddr,
        alen: *mut libc::socklen_t,
    ) -> isize;
    fn __poll_chk(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int, len: usize) -> c_int;
    fn __ppoll_chk(
        fds: *mut libc::pollfd,
        n: libc::nfds_t,
        ts: *const libc::timespec,
        mask: *const libc::sigset_t,
        len: usize,
    ) -> c_int;
}

/// A page that cannot be read or written: a pointer the kernel answers with EFAULT.
///
/// # Safety
/// Plain libc use.
unsafe fn bad_page() -> *mut c_void {
    let m = libc::mmap(
        std::ptr::null_mut(),
        4096,
        libc::PROT_NONE,
        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
        -1,
        0,
    );
    assert_ne!(m, libc::MAP_FAILED);
    m
}

/// Installs `handler` for `sig`, with `SA_RESTART` or without.
///
/// # Safety
/// `handler` is async-signal-safe.
unsafe fn on_signal(sig: c_int, handler: extern "C" fn(c_int), restart: bool) {
    let mut sa: libc::sigaction = std::mem::zeroed();
    sa.sa_sigaction = handler as usize;
    sa.sa_flags = if restart { libc::SA_RESTART } else { 0 };
    libc::sigemptyset(&mut sa.sa_mask);
    assert_eq!(libc::sigaction(sig, &sa, std::ptr::null_mut()), 0);
}

static SIGNALS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

extern "C" fn count_signal(_: c_int) {
    SIGNALS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
}

static HANDLER_EP: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);
static HANDLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A handler that waits on an epoll set (zero timeout), as an event loop's signal handler may.
extern "C" fn epoll_in_handler(_: c_int) {
    let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 4];
    // SAFETY: a valid array of 4 events; the set is the probe's.
    unsafe {
        libc::epoll_wait(
            HANDLER_EP.load(std::sync::atomic::Ordering::SeqCst),
            evs.as_mut_ptr(),
            4,
            0,
        )
    };
    HANDLED.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// The system call thread `tid` of this process is blocked in (`/proc/self/task/TID/syscall`).
/// Made with raw system calls: the caller holds the group's mutex, which a hooked `read`
/// would wait for.
fn blocked_in(tid: libc::pid_t) -> Option<i64> {
    let path = CString::new(format!("/proc/self/task/{tid}/syscall")).unwrap();
    let mut b = [0u8; 64];
    // SAFETY: a valid C string and a buffer of 64 bytes; the descriptor is closed here.
    let n = unsafe {
        let fd = libc::syscall(
            libc::SYS_openat,
            libc::AT_FDCWD,
            path.as_ptr(),
            libc::O_RDONLY,
        );
        if fd < 0 {
            return None;
        }
        let n = libc::syscall(libc::SYS_read, fd, b.as_mut_ptr(), b.len());
        libc::syscall(libc::SYS_close, fd);
        n
    };
    let s = std::str::from_utf8(&b[..n.max(0) as usize]).ok()?;
    s.split_whitespace().next()?.parse().ok()
}

/// A UDP pair, `a` connected to `b`.
fn udp_pair() -> (c_int, c_int) {
    use std::os::fd::IntoRawFd;
    let a = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let b = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    a.connect(b.local_addr().unwrap()).unwrap();
    (a.into_raw_fd(), b.into_raw_fd())
}

/// `vlen` mmsghdrs, message `i` one iovec over `bufs[i]`.
fn mmsgs(bufs: &mut [Vec<u8>], iovs: &mut Vec<libc::iovec>) -> Vec<libc::mmsghdr> {
    *iovs = bufs
        .iter_mut()
        .map(|b| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        })
        .collect();
    iovs.iter_mut()
        .map(|v| {
            // SAFETY: an all-zero mmsghdr is a valid empty header.
            let mut h: libc::mmsghdr = unsafe { std::mem::zeroed() };
            h.msg_hdr.msg_iov = v;
            h.msg_hdr.msg_iovlen = 1;
            h
        })
        .collect()
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 % 251) as u8).collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let scenario = args[1].as_str();
    let path = args.get(2).cloned().unwrap_or_default();
    // SAFETY (all below): libc calls on descriptors and buffers this function owns, with the
    // lengths of those buffers.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        match scenario {
            "file-read" => {
                let p = CString::new(path.clone()).unwrap();
                let fd = libc::open(p.as_ptr(), libc::O_RDONLY);
                let want = pattern(3000);
                let mut b = vec![0u8; 3000];
                out("read", libc::read(fd, b.as_mut_ptr().cast(), 3000));
                println!("read-ok {}", (b == want) as u8);
                out("read-eof", libc::read(fd, b.as_mut_ptr().cast(), 3000));
                let mut b = vec![0u8; 1500];
                out("pread", libc::pread(fd, b.as_mut_ptr().cast(), 1500, 1000));
                println!("pread-ok {}", (b[..] == want[1000..2500]) as u8);
                let mut parts = [vec![0u8; 1000], vec![0u8; 700], vec![0u8; 1300]];
                let iov: Vec<libc::iovec> = parts
                    .iter_mut()
                    .map(|p| libc::iovec {
                        iov_base: p.as_mut_ptr().cast(),
                        iov_len: p.len(),
                    })
                    .collect();
                out("preadv", libc::preadv(fd, iov.as_ptr(), 3, 0));
                println!("preadv-ok {}", (parts.concat() == want) as u8);
                libc::lseek(fd, 0, libc::SEEK_SET);
                for p in parts.iter_mut() {
                    p.fill(0);
                }
                out("readv", libc::readv(fd, iov.as_ptr(), 3));
                println!("readv-ok {}", (parts.concat() == want) as u8);
                libc::lseek(fd, 0, libc::SEEK_SET);
                out("read-efault", libc::read(fd, std::ptr::null_mut(), 10));
                out("read-ebadf", libc::read(-1, b.as_mut_ptr().cast(), 10));
                out(
                    "recv-enotsock",
                    libc::recv(fd, b.as_mut_ptr().cast(), 10, 0),
                );
            }
            "file-write" => {
                let fd = create(&path);
                let data = pattern(3000);
                out("write", libc::write(fd, data.as_ptr().cast(), 3000));
                out("pwrite", libc::pwrite(fd, data.as_ptr().cast(), 3000, 3000));
                let iov = [
                    libc::iovec {
                        iov_base: data.as_ptr() as *mut c_void,
                        iov_len: 1000,
                    },
                    libc::iovec {
                        iov_base: data[1000..].as_ptr() as *mut c_void,
                        iov_len: 2000,
                    },
                ];
                libc::lseek(fd, 6000, libc::SEEK_SET);
                out("writev", libc::writev(fd, iov.as_ptr(), 2));
                out("pwritev", libc::pwritev(fd, iov.as_ptr(), 2, 9000));
                // /dev/null and a pipe are never shaped.
                let n = CString::new("/dev/null").unwrap();
                let null = libc::open(n.as_ptr(), libc::O_WRONLY);
                let big = vec![0u8; 1 << 20];
                out("devnull", libc::write(null, big.as_ptr().cast(), big.len()));
                let mut pipe = [0; 2];
                libc::pipe(pipe.as_mut_ptr());
                out("pipe", libc::write(pipe[1], big.as_ptr().cast(), 4096));
                libc::close(fd);
            }
            "append" => {
                // 100 records of 2,000 bytes (1,999 times the letter given, then a newline),
                // one write each, appended to a file another process appends to as well.
                let p = CString::new(path.clone()).unwrap();
                let fd = libc::open(
                    p.as_ptr(),
                    libc::O_WRONLY | libc::O_APPEND | libc::O_CREAT,
                    0o600,
                );
                assert!(fd >= 0);
                let letter = args[3].as_bytes()[0];
                let mut line = vec![letter; 2000];
                line[1999] = b'\n';
                let mut written = 0;
                for _ in 0..100 {
                    let r = libc::write(fd, line.as_ptr().cast(), line.len());
                    if r < 0 {
                        out("append-write", r);
                        break;
                    }
                    written += r;
                }
                out("appended", written);
            }
            "file-writev-many" => {
                // 300 iovecs of 10 bytes: to a socket, the first 1,000-byte piece the bucket
                // allows (its burst, full at the start) spans 100 of them, more than one window
                // of the library's holds; to a file, the write is one call (all 300).
                let data = pattern(3000);
                let many: Vec<libc::iovec> = (0..300)
                    .map(|i| libc::iovec {
                        iov_base: data[i * 10..].as_ptr() as *mut c_void,
                        iov_len: 10,
                    })
                    .collect();
                let (c, s) = tcp_pair();
                // A short writev fails the test instead of hanging it.
                let tv = libc::timeval {
                    tv_sec: 2,
                    tv_usec: 0,
                };
                libc::setsockopt(
                    s,
                    libc::SOL_SOCKET,
                    libc::SO_RCVTIMEO,
                    (&tv as *const libc::timeval).cast(),
                    std::mem::size_of::<libc::timeval>() as libc::socklen_t,
                );
                out("writev-many-socket", libc::writev(c, many.as_ptr(), 300));
                let mut got = vec![0u8; 3000];
                out(
                    "peer-read",
                    libc::recv(s, got.as_mut_ptr().cast(), 3000, libc::MSG_WAITALL),
                );
                println!("peer-read-ok {}", (got == data) as u8);
                let fd = create(&path);
                out("writev-many", libc::writev(fd, many.as_ptr(), 300));
                libc::close(fd);
            }
            "tcp-nonblocking" => {
                let (c, s) = tcp_pair();
                let data = pattern(5000);
                out("peer-write", libc::write(s, data.as_ptr().cast(), 5000));
                std::thread::sleep(std::time::Duration::from_millis(50));
                nonblock(c);
                let mut b = vec![0u8; 4096];
                out(
                    "peek",
                    libc::recv(c, b.as_mut_ptr().cast(), 4096, libc::MSG_PEEK),
                );
                out("recv", libc::recv(c, b.as_mut_ptr().cast(), 4096, 0));
                println!("recv-ok {}", (b[..100] == data[..100]) as u8);
                out("recv-again", libc::recv(c, b.as_mut_ptr().cast(), 4096, 0));
                out("read-again", libc::read(c, b.as_mut_ptr().cast(), 4096));
                out(
                    "recvfrom-again",
                    libc::recvfrom(
                        c,
                        b.as_mut_ptr().cast(),
                        4096,
                        0,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                    ),
                );
                let mut iov = libc::iovec {
                    iov_base: b.as_mut_ptr().cast(),
                    iov_len: 4096,
                };
                let mut msg: libc::msghdr = std::mem::zeroed();
                msg.msg_iov = &mut iov;
                msg.msg_iovlen = 1;
                out("recvmsg-again", libc::recvmsg(c, &mut msg, 0));
                let mut p = libc::pollfd {
                    fd: c,
                    events: libc::POLLIN,
                    revents: 0,
                };
                out("poll-held", libc::poll(&mut p, 1, 30) as isize);
                println!("poll-events-restored {}", (p.events == libc::POLLIN) as u8);
                // select and pselect hold the throttled read back the same way (the socket
                // holds 4,900 unread bytes: unshaped, both would report it at once), clear the
                // caller's set on the timeout, and report what is not throttled (writing).
                let mut rs: libc::fd_set = std::mem::zeroed();
                libc::FD_SET(c, &mut rs);
                let mut tv = libc::timeval {
                    tv_sec: 0,
                    tv_usec: 30_000,
                };
                let none = std::ptr::null_mut();
                out(
                    "select-held",
                    libc::select(c + 1, &mut rs, none, none, &mut tv) as isize,
                );
                println!("select-set-cleared {}", (!libc::FD_ISSET(c, &rs)) as u8);
                println!(
                    "select-timeval-spent {}",
                    (tv.tv_sec == 0 && tv.tv_usec < 30_000) as u8
                );
                let mut ws: libc::fd_set = std::mem::zeroed();
                libc::FD_SET(c, &mut ws);
                let mut rs: libc::fd_set = std::mem::zeroed();
                libc::FD_SET(c, &mut rs);
                let mut tv = libc::timeval {
                    tv_sec: 0,
                    tv_usec: 30_000,
                };
                out(
                    "select-write",
                    libc::select(c + 1, &mut rs, &mut ws, none, &mut tv) as isize,
                );
                println!(
                    "select-write-only {}",
                    (libc::FD_ISSET(c, &ws) && !libc::FD_ISSET(c, &rs)) as u8
                );
                // Sets wider than an fd_set (nfds past FD_SETSIZE, as libevent allocates
                // them) go to the real call unshaped: it reports the unread bytes at once, and
                // nothing writes past a copy of one fd_set.
                let mut wide = [0u64; 2 * libc::FD_SETSIZE / 64];
                wide[c as usize / 64] |= 1 << (c as usize % 64);
                let mut tv = libc::timeval {
                    tv_sec: 0,
                    tv_usec: 30_000,
                };
                out(
                    "select-wide",
                    libc::select(
                        2 * libc::FD_SETSIZE as c_int,
                        wide.as_mut_ptr().cast(),
                        none,
                        none,
                        &mut tv,
                    ) as isize,
                );
                let mut rs: libc::fd_set = std::mem::zeroed();
                libc::FD_SET(c, &mut rs);
                let ts = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 30_000_000,
                };
                out(
                    "pselect-held",
                    libc::pselect(c + 1, &mut rs, none, none, &ts, std::ptr::null()) as isize,
                );
                // epoll, level-triggered: the throttled read is not reported (unshaped it
                // would be at once), writing is, and the set is given back as it was.
                let ep = libc::epoll_create1(0);
                add(ep, c, libc::EPOLLIN);
                wait("epoll-held", ep, 30, Wait::Plain);
                wait("epoll-pwait-held", ep, 30, Wait::P);
                wait("epoll-pwait2-held", ep, 30, Wait::P2);
                let ep2 = libc::epoll_create1(0);
                add(ep2, c, libc::EPOLLIN | libc::EPOLLOUT);
                wait("epoll-write", ep2, 30, Wait::Plain);
                // One-shot: the wait that reports the write (the read held) leaves the
                // registration disabled, as the kernel did; a second wait reports nothing.
                let ep3 = libc::epoll_create1(0);
                add(ep3, c, libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLONESHOT);
                wait("epoll-oneshot-first", ep3, 30, Wait::Plain);
                wait("epoll-oneshot-again", ep3, 0, Wait::Plain);
                // `EPOLL_CTL_DEL` ignores its event pointer: any value will do.
                out(
                    "epoll-del-any-event",
                    libc::epoll_ctl(ep3, libc::EPOLL_CTL_DEL, c, 8 as *mut libc::epoll_event)
                        as isize,
                );
                // After the waits the kernel's set holds the caller's interest again: a
                // non-throttled descriptor (a pipe) in the same set is reported as asked.
                let mut pipe = [0; 2];
                libc::pipe(pipe.as_mut_ptr());
                libc::write(pipe[1], b"x".as_ptr().cast(), 1);
                add(ep, pipe[0], libc::EPOLLIN);
                wait("epoll-pipe", ep, 30, Wait::Plain);
            }
            "select-page-end" => {
                // Sets sized for `nfds` (one long for descriptors below 64) at the end of a
                // mapping, on a throttled socket (the held path, copying the sets): nothing
                // past the long is read or written.
                let (c, s) = tcp_pair();
                assert!(c < 64);
                let data = pattern(5000);
                libc::write(s, data.as_ptr().cast(), 5000);
                std::thread::sleep(std::time::Duration::from_millis(50));
                nonblock(c);
                let mut b = vec![0u8; 4096];
                out("recv", libc::recv(c, b.as_mut_ptr().cast(), 4096, 0));
                let rs = set_at_page_end(1);
                let ws = set_at_page_end(1);
                let none = std::ptr::null_mut();
                set_bit(rs, c);
                let mut tv = libc::timeval {
                    tv_sec: 0,
                    tv_usec: 30_000,
                };
                out(
                    "select-held",
                    libc::select(c + 1, rs, none, none, &mut tv) as isize,
                );
                println!("select-held-cleared {}", (!bit(rs, c)) as u8);
                set_bit(rs, c);
                set_bit(ws, c);
                let mut tv = libc::timeval {
                    tv_sec: 0,
                    tv_usec: 30_000,
                };
                out(
                    "select-write",
                    libc::select(c + 1, rs, ws, none, &mut tv) as isize,
                );
                println!("select-write-only {}", (bit(ws, c) && !bit(rs, c)) as u8);
                set_bit(rs, c);
                let ts = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 30_000_000,
                };
                out(
                    "pselect-held",
                    libc::pselect(c + 1, rs, none, none, &ts, std::ptr::null()) as isize,
                );
            }
            "read-two-threads" => {
                // Thread A reads a socket whose peer sends a byte every 2 ms, thread B one whose
                // peer keeps it full, each with blocking recvs of 64 KiB, for 2 s: prints what
                // each got.
                use std::sync::atomic::{AtomicBool, Ordering};
                use std::sync::Arc;
                use std::time::{Duration, Instant};
                let (ca, sa) = tcp_pair();
                let (cb, sb) = tcp_pair();
                let stop = Arc::new(AtomicBool::new(false));
                let st = stop.clone();
                std::thread::spawn(move || {
                    while !st.load(Ordering::Relaxed) {
                        libc::send(sa, b"x".as_ptr().cast(), 1, 0);
                        std::thread::sleep(Duration::from_millis(2));
                    }
                });
                std::thread::spawn(move || {
                    let chunk = pattern(65536);
                    loop {
                        if libc::send(sb, chunk.as_ptr().cast(), chunk.len(), 0) < 0 {
                            break;
                        }
                    }
                });
                // Let the full one fill up.
                std::thread::sleep(Duration::from_millis(100));
                let start = Instant::now();
                let reader = |fd: c_int| {
                    move || {
                        let mut b = vec![0u8; 65536];
                        let mut got = 0isize;
                        while start.elapsed() < Duration::from_secs(2) {
                            let r = libc::recv(fd, b.as_mut_ptr().cast(), b.len(), 0);
                            if r <= 0 {
                                break;
                            }
                            got += r;
                        }
                        got
                    }
                };
                let a = std::thread::spawn(reader(ca));
                let b = std::thread::spawn(reader(cb));
                let (got_a, got_b) = (a.join().unwrap(), b.join().unwrap());
                stop.store(true, Ordering::Relaxed);
                out("a-got", got_a);
                out("b-got", got_b);
            }
            "tcp-epoll-edge" => {
                // Edge-triggered: the shaper's EAGAIN swallows the edge the data raised, and
                // the wait gives one back when the tokens are there.
                let (c, s) = tcp_pair();
                let data = pattern(5000);
                out("peer-write", libc::write(s, data.as_ptr().cast(), 5000));
                std::thread::sleep(std::time::Duration::from_millis(50));
                nonblock(c);
                let ep = libc::epoll_create1(0);
                add(ep, c, libc::EPOLLIN | libc::EPOLLET);
                wait("edge-first", ep, 0, Wait::Plain);
                let mut b = vec![0u8; 4096];
                let mut got = 0;
                let r = loop {
                    let r = libc::recv(c, b.as_mut_ptr().cast(), 4096, 0);
                    if r <= 0 {
                        break r;
                    }
                    got += r;
                };
                println!("edge-drained {}", (got > 0 && got < 5000) as u8);
                out("edge-again", r);
                // Unshaped, no new data means no new edge: this would time out with 0.
                wait("edge-rearmed", ep, 2_000, Wait::Plain);
                out("edge-more", libc::recv(c, b.as_mut_ptr().cast(), 4096, 0));
            }
            "tcp-blocking" => {
                let (c, s) = tcp_pair();
                let data = pattern(8192);
                out("peer-write", libc::write(s, data.as_ptr().cast(), 8192));
                let mut b = vec![0u8; 8192];
                out("recv", libc::recv(c, b.as_mut_ptr().cast(), 4096, 0));
                out(
                    "recv-waitall",
                    libc::recv(c, b[1000..].as_mut_ptr().cast(), 4096, libc::MSG_WAITALL),
                );
                println!("recv-ok {}", (b[..5096] == data[..5096]) as u8);
                // Blocking sends move everything.
                let big = pattern(6000);
                out("send", libc::send(c, big.as_ptr().cast(), 3000, 0));
                let iov = [libc::iovec {
                    iov_base: big[3000..].as_ptr() as *mut c_void,
                    iov_len: 3000,
                }];
                let mut msg: libc::msghdr = std::mem::zeroed();
                msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
                msg.msg_iovlen = 1;
                out("sendmsg", libc::sendmsg(c, &msg, 0));
                let mut got = vec![0u8; 6000];
                out(
                    "peer-read",
                    libc::recv(s, got.as_mut_ptr().cast(), 6000, libc::MSG_WAITALL),
                );
                println!("sent-ok {}", (got == big) as u8);
                libc::shutdown(s, libc::SHUT_RDWR);
                libc::close(s);
                std::thread::sleep(std::time::Duration::from_millis(50));
                let mut r = 0;
                for _ in 0..10 {
                    r = libc::send(c, big.as_ptr().cast(), 1000, 0);
                    if r < 0 {
                        break;
                    }
                }
                out("send-epipe", r);
            }
            "sendmsg-readonly" => {
                // sendmsg takes a `const` header: one in a read-only page, sent in pieces (the
                // bucket holds a third of it), must not be written to.
                let (c, s) = tcp_pair();
                let big = pattern(3000);
                let iov = [libc::iovec {
                    iov_base: big.as_ptr() as *mut c_void,
                    iov_len: 3000,
                }];
                let page = libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                assert_ne!(page, libc::MAP_FAILED);
                let msg = page.cast::<libc::msghdr>();
                std::ptr::write(msg, std::mem::zeroed());
                (*msg).msg_iov = iov.as_ptr() as *mut libc::iovec;
                (*msg).msg_iovlen = 1;
                libc::mprotect(page, 4096, libc::PROT_READ);
                out("sendmsg-readonly", libc::sendmsg(c, msg, 0));
                let mut got = vec![0u8; 3000];
                out(
                    "peer-read",
                    libc::recv(s, got.as_mut_ptr().cast(), 3000, libc::MSG_WAITALL),
                );
            }
            "tcp-send-nonblocking" => {
                let (c, _s) = tcp_pair();
                let data = pattern(1000);
                out(
                    "send",
                    libc::send(c, data.as_ptr().cast(), 1000, libc::MSG_DONTWAIT),
                );
                out(
                    "send-again",
                    libc::send(c, data.as_ptr().cast(), 1000, libc::MSG_DONTWAIT),
                );
                out(
                    "sendto-again",
                    libc::sendto(
                        c,
                        data.as_ptr().cast(),
                        1000,
                        libc::MSG_DONTWAIT,
                        std::ptr::null(),
                        0,
                    ),
                );
            }
            "udp" => {
                let a = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
                let b = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
                a.connect(b.local_addr().unwrap()).unwrap();
                use std::os::fd::AsRawFd;
                let data = pattern(1500);
                out(
                    "send-whole",
                    libc::send(a.as_raw_fd(), data.as_ptr().cast(), 1500, 0),
                );
                out(
                    "send-debt",
                    libc::send(
                        a.as_raw_fd(),
                        data.as_ptr().cast(),
                        1500,
                        libc::MSG_DONTWAIT,
                    ),
                );
                let mut got = vec![0u8; 2000];
                out(
                    "peer-recv",
                    libc::recv(b.as_raw_fd(), got.as_mut_ptr().cast(), 2000, 0),
                );
            }
            "transfers" => {
                // sendfile file -> socket, copy_file_range file -> file, splice file -> pipe.
                let p = CString::new(path.clone()).unwrap();
                let fd = libc::open(p.as_ptr(), libc::O_RDONLY);
                let (c, s) = tcp_pair();
                let mut off: libc::off64_t = 0;
                out("sendfile", libc::sendfile64(c, fd, &mut off, 3000));
                let mut got = vec![0u8; 3000];
                libc::recv(s, got.as_mut_ptr().cast(), 3000, libc::MSG_WAITALL);
                println!("sendfile-ok {}", (got == pattern(3000)) as u8);
                let q = CString::new(format!("{path}.copy")).unwrap();
                let dst = libc::open(
                    q.as_ptr(),
                    libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC,
                    0o600,
                );
                let mut o1: libc::off64_t = 0;
                out(
                    "copy_file_range",
                    libc::copy_file_range(fd, &mut o1, dst, std::ptr::null_mut(), 3000, 0),
                );
                let mut pipe = [0; 2];
                libc::pipe(pipe.as_mut_ptr());
                let mut o2: libc::off64_t = 0;
                out(
                    "splice",
                    libc::splice(fd, &mut o2, pipe[1], std::ptr::null_mut(), 3000, 0),
                );
            }
            "splice-pipe" => {
                // A blocking splice from a pipe holding 1,000 bytes (the bucket's burst) to a
                // socket: the real call moves what the pipe has and returns. More bytes come
                // 300 ms later; a shaped splice that went on for the rest would wait for them.
                let (c, _s) = tcp_pair();
                let mut pipe = [0; 2];
                libc::pipe(pipe.as_mut_ptr());
                let first = pattern(1000);
                libc::write(pipe[1], first.as_ptr().cast(), 1000);
                let w = pipe[1];
                let later = std::thread::spawn(move || {
                    std::thread::sleep(std::time::Duration::from_millis(300));
                    let more = pattern(500);
                    libc::write(w, more.as_ptr().cast(), 500);
                });
                out(
                    "splice-from-pipe",
                    libc::splice(
                        pipe[0],
                        std::ptr::null_mut(),
                        c,
                        std::ptr::null_mut(),
                        3000,
                        0,
                    ),
                );
                later.join().unwrap();
            }
            "fortified" => {
                // glibc's fortified reads, as a `_FORTIFY_SOURCE` build calls them.
                let p = CString::new(path.clone()).unwrap();
                let fd = libc::open(p.as_ptr(), libc::O_RDONLY);
                let want = pattern(3000);
                let mut b = vec![0u8; 3000];
                out(
                    "pread-chk",
                    __pread_chk(fd, b.as_mut_ptr().cast(), 1500, 1000, 3000),
                );
                println!("pread-chk-ok {}", (b[..1500] == want[1000..2500]) as u8);
                out(
                    "pread64-chk",
                    __pread64_chk(fd, b.as_mut_ptr().cast(), 1500, 0, 3000),
                );
                println!("pread64-chk-ok {}", (b[..1500] == want[..1500]) as u8);
                out(
                    "read-chk",
                    __read_chk(fd, b.as_mut_ptr().cast(), 3000, 3000),
                );
                println!("read-chk-ok {}", (b == want) as u8);
            }
            "fortified-poll" => {
                // A fortified ppoll on a socket the bucket holds back: held like ppoll's.
                let (c, s) = tcp_pair();
                let data = pattern(5000);
                out("peer-write", libc::write(s, data.as_ptr().cast(), 5000));
                std::thread::sleep(std::time::Duration::from_millis(50));
                nonblock(c);
                let mut b = vec![0u8; 4096];
                out("recv", __recv_chk(c, b.as_mut_ptr().cast(), 4096, 4096, 0));
                let mut p = libc::pollfd {
                    fd: c,
                    events: libc::POLLIN,
                    revents: 0,
                };
                let ts = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 30_000_000,
                };
                let len = std::mem::size_of::<libc::pollfd>();
                out(
                    "ppoll-chk-held",
                    __ppoll_chk(&mut p, 1, &ts, std::ptr::null(), len) as isize,
                );
                out("poll-chk-held", __poll_chk(&mut p, 1, 30, len) as isize);
            }
            "chk-fail" => {
                // A fortified call whose length is larger than the caller's buffer (as the
                // compiler knows it): glibc's own ends the process (SIGABRT); so must ours.
                // The real buffer is large enough: nothing is overrun either way.
                let (c, s) = tcp_pair();
                let data = pattern(100);
                libc::write(s, data.as_ptr().cast(), 100);
                let p = CString::new("/dev/zero").unwrap();
                let zero = libc::open(p.as_ptr(), libc::O_RDONLY);
                let mut b = vec![0u8; 4096];
                let bp = b.as_mut_ptr().cast();
                let mut pf = [libc::pollfd {
                    fd: c,
                    events: libc::POLLIN,
                    revents: 0,
                }; 2];
                let one = std::mem::size_of::<libc::pollfd>();
                let r = match args[3].as_str() {
                    "read" => __read_chk(zero, bp, 200, 100),
                    "pread" => __pread_chk(zero, bp, 200, 0, 100),
                    "pread64" => __pread64_chk(zero, bp, 200, 0, 100),
                    "recv" => __recv_chk(c, bp, 200, 100, 0),
                    "recvfrom" => __recvfrom_chk(
                        c,
                        bp,
                        200,
                        100,
                        0,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                    ),
                    "poll" => __poll_chk(pf.as_mut_ptr(), 2, 0, one) as isize,
                    "ppoll" => {
                        let ts = libc::timespec {
                            tv_sec: 0,
                            tv_nsec: 0,
                        };
                        __ppoll_chk(pf.as_mut_ptr(), 2, &ts, std::ptr::null(), one) as isize
                    }
                    other => panic!("unknown call {other}"),
                };
                out("returned", r);
            }
            "v2" => {
                // preadv2/pwritev2 on a file, at an offset and at the file position (-1).
                let fd = {
                    let p = CString::new(path.clone()).unwrap();
                    libc::open(
                        p.as_ptr(),
                        libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC,
                        0o600,
                    )
                };
                let data = pattern(3000);
                let iov = [
                    libc::iovec {
                        iov_base: data.as_ptr() as *mut c_void,
                        iov_len: 1000,
                    },
                    libc::iovec {
                        iov_base: data[1000..].as_ptr() as *mut c_void,
                        iov_len: 2000,
                    },
                ];
                out("pwritev2", libc::pwritev2(fd, iov.as_ptr(), 2, 0, 0));
                let mut got = vec![0u8; 3000];
                let riov = [libc::iovec {
                    iov_base: got.as_mut_ptr().cast(),
                    iov_len: 3000,
                }];
                out("preadv2", libc::preadv2(fd, riov.as_ptr(), 1, 0, 0));
                println!("preadv2-ok {}", (got == data) as u8);
                got.fill(0);
                libc::lseek(fd, 0, libc::SEEK_SET);
                out(
                    "preadv2-position",
                    libc::preadv2(fd, riov.as_ptr(), 1, -1, 0),
                );
                println!("preadv2-position-ok {}", (got == data) as u8);
                println!("position {}", libc::lseek(fd, 0, libc::SEEK_CUR));
            }
            "mmsg" => {
                // sendmmsg moves whole messages and leaves a debt, as sendmsg on UDP does;
                // recvmmsg likewise (a read bucket).
                let (a, b) = udp_pair();
                let mut bufs = vec![pattern(700), pattern(800)];
                let mut iovs = Vec::new();
                let mut v = mmsgs(&mut bufs, &mut iovs);
                let which = args[3].as_str();
                if which == "send" {
                    out("sendmmsg", libc::sendmmsg(a, v.as_mut_ptr(), 2, 0) as isize);
                    println!("sendmmsg-lens {}", v[0].msg_len + v[1].msg_len);
                    out(
                        "sendmmsg-debt",
                        libc::sendmmsg(a, v.as_mut_ptr(), 2, libc::MSG_DONTWAIT) as isize,
                    );
                } else {
                    for m in &bufs {
                        libc::send(a, m.as_ptr().cast(), m.len(), 0);
                    }
                    let mut rbufs = vec![vec![0u8; 2000], vec![0u8; 2000]];
                    let mut riovs = Vec::new();
                    let mut rv = mmsgs(&mut rbufs, &mut riovs);
                    out(
                        "recvmmsg",
                        libc::recvmmsg(b, rv.as_mut_ptr(), 2, 0, std::ptr::null_mut()) as isize,
                    );
                    println!("recvmmsg-lens {}", rv[0].msg_len + rv[1].msg_len);
                    libc::send(a, bufs[0].as_ptr().cast(), 700, 0);
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    out(
                        "recvmmsg-debt",
                        libc::recvmmsg(
                            b,
                            rv.as_mut_ptr(),
                            2,
                            libc::MSG_DONTWAIT,
                            std::ptr::null_mut(),
                        ) as isize,
                    );
                }
            }
            "epoll-closed" => {
                // 1,056 registrations of sockets closed without EPOLL_CTL_DEL (32 sockets in
                // 33 sets), then one of a throttled socket: it must still be held.
                let (c, s) = tcp_pair();
                let data = pattern(5000);
                out("peer-write", libc::write(s, data.as_ptr().cast(), 5000));
                std::thread::sleep(std::time::Duration::from_millis(50));
                nonblock(c);
                let mut b = vec![0u8; 4096];
                out("recv", libc::recv(c, b.as_mut_ptr().cast(), 4096, 0));
                let sets: Vec<c_int> = (0..33).map(|_| libc::epoll_create1(0)).collect();
                let socks: Vec<c_int> = (0..32)
                    .map(|_| libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0))
                    .collect();
                for &ep in &sets {
                    for &fd in &socks {
                        add(ep, fd, libc::EPOLLIN);
                    }
                }
                for &fd in &socks {
                    libc::close(fd);
                }
                let ep = libc::epoll_create1(0);
                add(ep, c, libc::EPOLLIN);
                wait("epoll-after-closes", ep, 30, Wait::Plain);
                // Closing the set itself lets its registrations go too.
                libc::close(ep);
                let ep2 = libc::epoll_create1(0);
                add(ep2, c, libc::EPOLLIN);
                wait("epoll-new-set", ep2, 30, Wait::Plain);
            }
            "signal-in-epoll" => {
                // A signal handler calls epoll_wait while its thread is inside epoll_ctl's
                // bookkeeping (held there: the group's mutex, which that bookkeeping takes after
                // a change of the group's rates, is held by a helper thread of ours).
                use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
                static LOCKED: AtomicBool = AtomicBool::new(false);
                let (c, s) = tcp_pair();
                let ep = libc::epoll_create1(0);
                add(ep, c, libc::EPOLLIN);
                HANDLER_EP.store(ep, SeqCst);
                on_signal(libc::SIGUSR1, epoll_in_handler, false);
                let group = std::env::var("OMNISTAGE_SHAPE_GROUP").unwrap();
                let (map, _) = omnistage_shape::sys::SegmentMap::open(&group, None).unwrap();
                let main_tid = libc::gettid();
                let main = libc::pthread_self() as usize;
                let helper = std::thread::spawn(move || {
                    // A change of the group's configuration, which the library's next look at
                    // its mask reads under the group's mutex.
                    map.with(|g| g.cfg_changed = 1);
                    map.with(|_| {
                        LOCKED.store(true, SeqCst);
                        let t0 = std::time::Instant::now();
                        while blocked_in(main_tid) != Some(libc::SYS_futex)
                            && t0.elapsed().as_secs() < 5
                        {
                            std::thread::sleep(std::time::Duration::from_millis(1));
                        }
                        libc::pthread_kill(main as libc::pthread_t, libc::SIGUSR1);
                        let t0 = std::time::Instant::now();
                        while !HANDLED.load(SeqCst) && t0.elapsed().as_secs() < 3 {
                            std::thread::sleep(std::time::Duration::from_millis(1));
                        }
                        if !HANDLED.load(SeqCst) {
                            // Deadlocked: the handler waits for a lock its own thread holds.
                            // (A raw write: a hooked one would wait for the mutex held here.)
                            let line = b"handler-returned 0\n";
                            libc::syscall(libc::SYS_write, 1, line.as_ptr(), line.len());
                            libc::_exit(0);
                        }
                    });
                });
                let t0 = std::time::Instant::now();
                while !LOCKED.load(SeqCst) && t0.elapsed().as_secs() < 5 {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                add(ep, s, libc::EPOLLIN);
                helper.join().unwrap();
                println!("handler-returned {}", HANDLED.load(SeqCst) as u8);
            }
            "fork-in-epoll" => {
                // A thread forks while another is inside epoll_ctl's bookkeeping, holding the
                // epoll table's lock (held there as in "signal-in-epoll": a helper thread holds
                // the group's mutex that the bookkeeping waits for). The child closes a
                // registered descriptor, as a child closing every descriptor before `exec` does:
                // the lock's holder does not exist in the child, so the close must not wait.
                use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
                static LOCKED: AtomicBool = AtomicBool::new(false);
                let (c, s) = tcp_pair();
                let ep = libc::epoll_create1(0);
                add(ep, c, libc::EPOLLIN);
                let group = std::env::var("OMNISTAGE_SHAPE_GROUP").unwrap();
                let (map, _) = omnistage_shape::sys::SegmentMap::open(&group, None).unwrap();
                let main_tid = libc::gettid();
                let helper = std::thread::spawn(move || {
                    map.with(|g| g.cfg_changed = 1);
                    map.with(|_| {
                        LOCKED.store(true, SeqCst);
                        let t0 = std::time::Instant::now();
                        while blocked_in(main_tid) != Some(libc::SYS_futex)
                            && t0.elapsed().as_secs() < 5
                        {
                            std::thread::sleep(std::time::Duration::from_millis(1));
                        }
                        let pid = libc::fork();
                        if pid == 0 {
                            // The child: only async-signal-safe calls.
                            libc::close(c);
                            libc::_exit(0);
                        }
                        let mut closed = 0;
                        let t0 = std::time::Instant::now();
                        while t0.elapsed().as_secs() < 3 {
                            let mut status = 0;
                            if libc::waitpid(pid, &mut status, libc::WNOHANG) == pid {
                                closed = 1;
                                break;
                            }
                            std::thread::sleep(std::time::Duration::from_millis(1));
                        }
                        if closed == 0 {
                            libc::kill(pid, libc::SIGKILL);
                            libc::waitpid(pid, std::ptr::null_mut(), 0);
                        }
                        closed
                    })
                });
                let t0 = std::time::Instant::now();
                while !LOCKED.load(SeqCst) && t0.elapsed().as_secs() < 5 {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                add(ep, s, libc::EPOLLIN);
                let closed = helper.join().unwrap();
                println!("child-closed {closed}");
            }
            "eintr" => {
                // Blocking calls waiting for tokens, with SIGUSR1 coming every 10 ms: a handler
                // without SA_RESTART ends them (the partial count, or EINTR); with it, a call
                // that moved nothing yet goes on waiting (and one that moved bytes returns
                // their count, as a TCP send does).
                use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
                static DONE: AtomicBool = AtomicBool::new(false);
                let (c, s) = tcp_pair();
                // The peer's bytes go around the library (a raw system call): they are not
                // the test's.
                let data = pattern(1000);
                libc::syscall(libc::SYS_write, s, data.as_ptr(), 1000);
                on_signal(libc::SIGUSR1, count_signal, false);
                let main = libc::pthread_self() as usize;
                let kicker = std::thread::spawn(move || {
                    let t0 = std::time::Instant::now();
                    while !DONE.load(SeqCst) && t0.elapsed().as_secs() < 20 {
                        libc::pthread_kill(main as libc::pthread_t, libc::SIGUSR1);
                        std::thread::sleep(std::time::Duration::from_millis(10));
                    }
                });
                let big = pattern(1000);
                out("send-partial", libc::send(c, big.as_ptr().cast(), 1000, 0));
                out("send-eintr", libc::send(c, big.as_ptr().cast(), 1000, 0));
                let mut b = vec![0u8; 1000];
                out("recv-first", libc::recv(c, b.as_mut_ptr().cast(), 1000, 0));
                out("recv-eintr", libc::recv(c, b.as_mut_ptr().cast(), 1000, 0));
                on_signal(libc::SIGUSR1, count_signal, true);
                out(
                    "recv-restarted",
                    libc::recv(c, b.as_mut_ptr().cast(), 1000, 0),
                );
                out("send-restarted", libc::send(c, big.as_ptr().cast(), 200, 0));
                DONE.store(true, SeqCst);
                kicker.join().unwrap();
                println!("signals {}", (SIGNALS.load(SeqCst) > 0) as u8);
            }
            "efault" => {
                // Bad pointers: the kernel answers EFAULT, and so must the shaped calls.
                let (c, _s) = tcp_pair();
                let bad = bad_page();
                out("poll", libc::poll(bad.cast(), 1, 0) as isize);
                // (A bad timeout to ppoll, select or pselect is not here: glibc copies it
                // before the system call, so the unshaped call faults too.)
                let ep = libc::epoll_create1(0);
                add(ep, c, libc::EPOLLIN);
                let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 4];
                out(
                    "epoll-pwait2-timeout",
                    libc::epoll_pwait2(ep, evs.as_mut_ptr(), 4, bad.cast(), std::ptr::null())
                        as isize,
                );
                out("readv", libc::readv(c, bad.cast(), 2));
                out("writev", libc::writev(c, bad.cast(), 2));
                out("sendmsg", libc::sendmsg(c, bad.cast(), 0));
                out("recvmsg", libc::recvmsg(c, bad.cast(), 0));
                let mut msg: libc::msghdr = std::mem::zeroed();
                msg.msg_iov = bad.cast();
                msg.msg_iovlen = 2;
                out("sendmsg-iov", libc::sendmsg(c, &msg, 0));
                out("sendmmsg", libc::sendmmsg(c, bad.cast(), 2, 0) as isize);
            }
            "fork-exec" => {
                // The child (fork) and a program it execs read the file under the same group.
                let p = CString::new(path.clone()).unwrap();
                let pid = libc::fork();
                if pid == 0 {
                    let fd = libc::open(p.as_ptr(), libc::O_RDONLY);
                    let mut b = vec![0u8; 3000];
                    let r = libc::read(fd, b.as_mut_ptr().cast(), 3000);
                    let cat = CString::new("/bin/cat").unwrap();
                    let argv = [cat.as_ptr(), p.as_ptr(), std::ptr::null()];
                    let dn = CString::new("/dev/null").unwrap();
                    let null = libc::open(dn.as_ptr(), libc::O_WRONLY);
                    libc::dup2(null, 1);
                    if r != 3000 {
                        libc::_exit(3);
                    }
                    libc::execv(cat.as_ptr(), argv.as_ptr());
                    libc::_exit(4);
                }
                let mut st = 0;
                libc::waitpid(pid, &mut st, 0);
                println!("child-exit {}", libc::WEXITSTATUS(st));
            }
            other => panic!("unknown scenario {other}"),
        }
    }
}
