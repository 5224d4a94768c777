//! Every `unsafe` of the shaping library, in one place: the real libc functions found with
//! `dlsym(RTLD_NEXT)`, the interposed entry points (expanded into the preload crate by
//! [`export_interposers!`]), raw pointers (buffers, iovecs, message headers, pollfds), the
//! shared-memory segment of a group (`shm_open`, `mmap`, a process-shared robust mutex), the
//! clock, and the descriptor checks (`fstat`, `getsockopt`, `fcntl`). Everything else is safe
//! code in `hooks` and `meter`.

mod epoll;

pub use epoll::{epoll_common, hook_epoll_ctl, note_starved, TRACKED_MAX as EPOLL_TRACKED_MAX};

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

/// Sleeps until `until_ns` on CLOCK_MONOTONIC, or until a signal (the caller asks again).
pub fn sleep_until(until_ns: u64) {
    let ts = libc::timespec {
        tv_sec: (until_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (until_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: `ts` is a valid timespec and the remaining-time pointer may be null with
    // TIMER_ABSTIME.
    unsafe {
        libc::clock_nanosleep(
            libc::CLOCK_MONOTONIC,
            libc::TIMER_ABSTIME,
            &ts,
            std::ptr::null_mut(),
        )
    };
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

// ---------------------------------------------------------------------------------------------
// The group's shared-memory segment.

const MAGIC: u64 = 0x6f6d_6e69_7368_6170; // "omnishap"
const VERSION: u64 = 2;

#[repr(C)]
struct Segment {
    magic: AtomicU64,
    version: u64,
    size: u64,
    /// Bumped (under the mutex) whenever the group's buckets or counting change, so the hooks
    /// see a live change with one atomic load per call instead of taking the mutex.
    cfg_epoch: AtomicU64,
    mutex: libc::pthread_mutex_t,
    state: GroupState,
}

const SEGMENT_BYTES: usize = std::mem::size_of::<Segment>();

/// A mapped group segment. Dropping it unmaps it (the name stays until [`unlink`]).
pub struct SegmentMap {
    seg: *mut Segment,
}

// SAFETY: the mapping is shared memory guarded by the process-shared mutex: every access to
// `state` goes through `with`, which holds the mutex; the header is written once before `magic`
// is published and only read afterwards.
unsafe impl Send for SegmentMap {}
// SAFETY: as above.
unsafe impl Sync for SegmentMap {}

impl Drop for SegmentMap {
    fn drop(&mut self) {
        // SAFETY: `seg` is a mapping of SEGMENT_BYTES made by `map` and not used after this.
        unsafe { libc::munmap(self.seg.cast(), SEGMENT_BYTES) };
    }
}

/// The shm name of a group: `/omnistage-shape.NAME`.
pub fn shm_name(group: &str) -> Result<CString, String> {
    CString::new(format!("/omnistage-shape.{group}"))
        .map_err(|_| "group name has a NUL".to_string())
}

/// Removes a segment's name (members that have it mapped keep it).
pub fn unlink(group: &str) {
    if let Ok(n) = shm_name(group) {
        // SAFETY: `n` is a NUL-terminated name.
        unsafe { libc::shm_unlink(n.as_ptr()) };
    }
}

impl SegmentMap {
    /// Opens the group's segment, creating it with `cfg` when it does not exist (and `cfg` is
    /// given). Returns the mapping and whether this call created it.
    pub fn open(group: &str, cfg: Option<GroupCfg>) -> Result<(SegmentMap, bool), String> {
        let name = shm_name(group)?;
        for _ in 0..50 {
            match Self::try_open(&name, cfg)? {
                Some(r) => return Ok(r),
                // The segment was being removed by its last member: try again.
                None => sleep_until(now_ns() + 2_000_000),
            }
        }
        Err(format!("group {group}: its segment keeps closing under us"))
    }

    fn try_open(name: &CStr, cfg: Option<GroupCfg>) -> Result<Option<(SegmentMap, bool)>, String> {
        let err = |what: &str| {
            format!(
                "{what} {}: {}",
                name.to_string_lossy(),
                std::io::Error::last_os_error()
            )
        };
        if let Some(cfg) = cfg {
            let state = GroupState::new(cfg, now_ns())?;
            // SAFETY: `name` is NUL-terminated; O_EXCL makes exactly one creator.
            let fd = unsafe {
                libc::shm_open(
                    name.as_ptr(),
                    libc::O_RDWR | libc::O_CREAT | libc::O_EXCL,
                    0o600,
                )
            };
            if fd >= 0 {
                // SAFETY: `fd` is our new shm object.
                if unsafe { libc::ftruncate(fd, SEGMENT_BYTES as libc::off_t) } != 0 {
                    let e = err("ftruncate");
                    // SAFETY: as above; the half-made name is removed.
                    unsafe {
                        libc::close(fd);
                        libc::shm_unlink(name.as_ptr());
                    }
                    return Err(e);
                }
                let map = Self::map(fd).inspect_err(|_| {
                    // SAFETY: as above.
                    unsafe { libc::shm_unlink(name.as_ptr()) };
                })?;
                // SAFETY: we created the segment and nobody else touches it before `magic` is
                // published; the mutex attributes are initialised before use and destroyed after.
                unsafe {
                    let seg = &mut *map.seg;
                    let mut attr: libc::pthread_mutexattr_t = std::mem::zeroed();
                    libc::pthread_mutexattr_init(&mut attr);
                    libc::pthread_mutexattr_setpshared(&mut attr, libc::PTHREAD_PROCESS_SHARED);
                    libc::pthread_mutexattr_setrobust(&mut attr, libc::PTHREAD_MUTEX_ROBUST);
                    libc::pthread_mutex_init(&mut seg.mutex, &attr);
                    libc::pthread_mutexattr_destroy(&mut attr);
                    std::ptr::write(&mut seg.state, state);
                    seg.version = VERSION;
                    seg.size = SEGMENT_BYTES as u64;
                    seg.magic.store(MAGIC, Ordering::Release);
                }
                return Ok(Some((map, true)));
            }
            if errno() != libc::EEXIST {
                return Err(err("shm_open"));
            }
        }
        // SAFETY: `name` is NUL-terminated.
        let fd = unsafe { libc::shm_open(name.as_ptr(), libc::O_RDWR, 0) };
        if fd < 0 {
            if errno() == libc::ENOENT && cfg.is_some() {
                return Ok(None); // removed between our two opens
            }
            return Err(err("shm_open"));
        }
        // The creator may not have sized it yet: wait up to a second.
        let deadline = now_ns() + 1_000_000_000;
        loop {
            // SAFETY: an all-zero stat is valid; `fd` is open.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: `st` is writable.
            unsafe { libc::fstat(fd, &mut st) };
            if st.st_size as usize == SEGMENT_BYTES {
                break;
            }
            if st.st_size != 0 || now_ns() > deadline {
                // SAFETY: `fd` is ours.
                unsafe { libc::close(fd) };
                return Err(format!(
                    "{} is not an omnistage shaping segment of this version (size {})",
                    name.to_string_lossy(),
                    st.st_size
                ));
            }
            sleep_until(now_ns() + 1_000_000);
        }
        let map = Self::map(fd)?;
        // SAFETY: the mapping is SEGMENT_BYTES long; `magic` is an atomic read by all.
        let seg = unsafe { &*map.seg };
        while seg.magic.load(Ordering::Acquire) != MAGIC {
            if now_ns() > deadline {
                return Err(format!("{} was never initialised", name.to_string_lossy()));
            }
            sleep_until(now_ns() + 1_000_000);
        }
        if seg.version != VERSION || seg.size != SEGMENT_BYTES as u64 {
            return Err(format!(
                "{} belongs to another version of omnistage",
                name.to_string_lossy()
            ));
        }
        if map.with(|g| g.closed != 0) {
            return Ok(None);
        }
        Ok(Some((map, false)))
    }

    fn map(fd: c_int) -> Result<SegmentMap, String> {
        // SAFETY: `fd` is an shm object at least SEGMENT_BYTES long; the fd is closed after
        // mapping (the mapping keeps the object).
        let p = unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                SEGMENT_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            libc::close(fd);
            p
        };
        if p == libc::MAP_FAILED {
            return Err(format!("mmap: {}", std::io::Error::last_os_error()));
        }
        Ok(SegmentMap { seg: p.cast() })
    }

    /// Runs `f` on the group's state under the segment's mutex. A member that died holding the
    /// mutex leaves it to the next locker (robust mutex), with the state as it was left: every
    /// field is checked on use, so a half-done update costs a little accuracy, never safety.
    pub fn with<R>(&self, f: impl FnOnce(&mut GroupState) -> R) -> R {
        let e = errno();
        // SAFETY: the mutex was initialised as process-shared and robust before `magic` was
        // published; holding it gives this thread exclusive access to `state` until unlock.
        let r = unsafe {
            let seg = &mut *self.seg;
            let rc = libc::pthread_mutex_lock(&mut seg.mutex);
            if rc == libc::EOWNERDEAD {
                libc::pthread_mutex_consistent(&mut seg.mutex);
            }
            let r = f(&mut seg.state);
            if seg.state.cfg_changed != 0 {
                seg.state.cfg_changed = 0;
                seg.cfg_epoch.fetch_add(1, Ordering::Release);
            }
            libc::pthread_mutex_unlock(&mut seg.mutex);
            r
        };
        set_errno(e);
        r
    }

    /// How many times the group's buckets or counting changed (see `Segment::cfg_epoch`).
    pub fn cfg_epoch(&self) -> u64 {
        // SAFETY: the mapping is SEGMENT_BYTES long and stays mapped while `self` lives;
        // `cfg_epoch` is an atomic, read without the mutex by design.
        unsafe { (*self.seg).cfg_epoch.load(Ordering::Acquire) }
    }
}

impl crate::link::Group for SegmentMap {
    fn with<R>(&self, f: impl FnOnce(&mut GroupState) -> R) -> R {
        SegmentMap::with(self, f)
    }
}

// ---------------------------------------------------------------------------------------------
// The process's shaping context (built lazily from the environment on the first hooked call).

/// Environment variables the command passes to the program.
pub const ENV_GROUP: &str = "OMNISTAGE_SHAPE_GROUP";
pub const ENV_MEMBER: &str = "OMNISTAGE_SHAPE_MEMBER";
pub const ENV_WEIGHT: &str = "OMNISTAGE_SHAPE_WEIGHT";

pub struct Context {
    map: SegmentMap,
    /// Bit `b` set: bucket `b` is configured; [`COUNTED_BIT`]: the group counts its bytes (a
    /// reporter claimed it). Read again from the segment when its epoch moves.
    mask: AtomicU32,
    /// The segment's `cfg_epoch` that `mask` was read at.
    epoch: AtomicU64,
    weight: u32,
    /// `index << 32 | generation` of this process's member slot.
    slot: AtomicU64,
}

/// In [`Context`]'s mask: every transfer goes through the group to be counted.
const COUNTED_BIT: u32 = 1 << 31;

fn mask_of(cfg: &GroupCfg, counted: u32) -> u32 {
    let mut m = 0;
    for (b, c) in cfg.buckets.iter().enumerate() {
        if c.present != 0 {
            m |= 1 << b;
        }
    }
    if counted != 0 {
        m |= COUNTED_BIT;
    }
    m
}

impl Context {
    /// The group's mask now: one atomic load, and the mutex only after a change.
    fn mask(&self) -> u32 {
        let e = self.map.cfg_epoch();
        if e != self.epoch.load(Ordering::Relaxed) {
            let m = self.map.with(|g| mask_of(&g.cfg, g.counted));
            self.mask.store(m, Ordering::Relaxed);
            self.epoch.store(e, Ordering::Relaxed);
            return m;
        }
        self.mask.load(Ordering::Relaxed)
    }

    /// Whether a call may go straight through without the hook's guard: the cached mask says
    /// neither limited nor counted and the segment's epoch has not moved since it was read. No
    /// lock is taken (a signal handler's call while this thread holds the segment's mutex must
    /// not wait for it), so a moved epoch sends the call the slow way, which reads it again.
    #[inline]
    pub fn passes_through_now(&self) -> bool {
        self.mask.load(Ordering::Relaxed) == 0
            && self.map.cfg_epoch() == self.epoch.load(Ordering::Relaxed)
    }

    /// Neither limited nor counted: the hooks pass calls through untouched.
    pub fn is_unlimited(&self) -> bool {
        self.mask() == 0
    }

    /// Whether `need` must go through the group: a configured bucket covers it, or the group
    /// counts its bytes.
    pub fn limits(&self, need: &Need) -> bool {
        let m = self.mask();
        let covered = need
            .mult
            .iter()
            .enumerate()
            .any(|(b, &k)| k != 0 && m & (1 << b) != 0);
        covered || (m & COUNTED_BIT != 0 && need.mult.iter().any(|&k| k != 0))
    }

    fn with<R>(&self, f: impl FnOnce(&mut GroupState, Slot, u64) -> R) -> R {
        self.map.with(|g| {
            let now = now_ns();
            g.reap(now, alive);
            let packed = self.slot.load(Ordering::Relaxed);
            let mut slot = Slot {
                index: (packed >> 32) as u32,
                generation: packed as u32,
            };
            if !g.holds(slot) {
                // Our slot was freed (the command that started us is gone): join as ourselves.
                if let Ok(s) = g.join(getpid(), self.weight, now) {
                    slot = s;
                    self.slot.store(
                        u64::from(s.index) << 32 | u64::from(s.generation),
                        Ordering::Relaxed,
                    );
                }
            }
            f(g, slot, now)
        })
    }

    pub fn request(&self, need: &Need, want: u64, mode: Mode) -> Verdict {
        self.with(|g, s, now| g.request(s, need, want, mode, now))
    }

    pub fn settle(&self, need: &Need, mode: Mode, granted: u64, moved: u64) {
        self.with(|g, s, now| g.settle(s, need, mode, granted, moved, now))
    }

    pub fn ready_at(&self, need: &Need) -> Option<u64> {
        self.with(|g, s, now| g.ready_at(s, need, now))
    }
}

static CONTEXT: OnceLock<Option<Context>> = OnceLock::new();

/// Whether a hooked call may go straight to libc before any of the hook's own work (its
/// thread-local guard costs a `__tls_get_addr` call in a preloaded library, about a third of
/// the pass-through cost): the process is not shaped, or its group neither limits nor counts
/// and nothing changed. `false` before the context is built (the slow path builds it under
/// the guard).
#[inline]
pub fn passes_through() -> bool {
    match CONTEXT.get() {
        Some(None) => true,
        Some(Some(c)) => c.passes_through_now(),
        None => false,
    }
}

/// The process's context, or `None` when it is not being shaped (no or bad environment).
pub fn context() -> Option<&'static Context> {
    CONTEXT
        .get_or_init(|| {
            let e = errno();
            let c = init_context();
            set_errno(e);
            c
        })
        .as_ref()
}

fn init_context() -> Option<Context> {
    let group = std::env::var(ENV_GROUP).ok()?;
    let member = std::env::var(ENV_MEMBER).ok().unwrap_or_default();
    let weight: u32 = std::env::var(ENV_WEIGHT)
        .ok()
        .and_then(|w| w.parse().ok())
        .unwrap_or(1);
    let (map, _) = SegmentMap::open(&group, None).ok()?;
    let epoch = map.cfg_epoch();
    let mask = map.with(|g| mask_of(&g.cfg, g.counted));
    let (index, generation) = member.split_once(':').unwrap_or(("0", "0"));
    let slot = u64::from(index.parse::<u32>().unwrap_or(0)) << 32
        | u64::from(generation.parse::<u32>().unwrap_or(0));
    Some(Context {
        map,
        mask: AtomicU32::new(mask),
        epoch: AtomicU64::new(epoch),
        weight,
        slot: AtomicU64::new(slot),
    })
}

// ---------------------------------------------------------------------------------------------
// The real functions.

/// Looks `name` up past this library (`dlsym(RTLD_NEXT)`), once.
fn real(cache: &AtomicUsize, name: &CStr) -> usize {
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
            let p = real(&CACHE, $sym);
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

pub mod real {
    use super::*;
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
}

// ---------------------------------------------------------------------------------------------
// Hooks: the interposed functions' bodies. Each takes the libc function's arguments unchanged and
// has its contract (the caller's pointers are valid for the lengths it gives).

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
    call: impl Fn(*const iovec, c_int, usize) -> ssize_t,
) -> ssize_t {
    // SAFETY: the caller's contract.
    let Some(total) = (unsafe { iov_total(iov, cnt) }) else {
        return call(iov, cnt, 0);
    };
    hooks::transfer(&leg(fd, dir), total, Flags::default(), |done, len| {
        if done == 0 && len == total {
            return call(iov, cnt, 0);
        }
        let mut w = [iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; 64];
        // SAFETY: the caller's contract.
        let k = unsafe { iov_window(iov, cnt, done, len, &mut w) };
        call(w.as_ptr(), k, done)
    })
}

/// # Safety
/// readv(2)'s contract.
pub unsafe fn hook_readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    // SAFETY: the caller's contract; `vectored` passes valid windows of `iov`.
    unsafe { vectored(fd, iov, cnt, Dir::Read, |v, k, _| real::readv(fd, v, k)) }
}

/// # Safety
/// writev(2)'s contract.
pub unsafe fn hook_writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    // SAFETY: as in `hook_readv`.
    unsafe { vectored(fd, iov, cnt, Dir::Write, |v, k, _| real::writev(fd, v, k)) }
}

/// # Safety
/// preadv(2)'s contract.
pub unsafe fn hook_preadv(fd: c_int, iov: *const iovec, cnt: c_int, off: libc::off64_t) -> ssize_t {
    // SAFETY: as in `hook_readv`.
    unsafe {
        vectored(fd, iov, cnt, Dir::Read, |v, k, d| {
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
        vectored(fd, iov, cnt, Dir::Write, |v, k, d| {
            real::pwritev(fd, v, k, off + d as libc::off64_t)
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
    if msg.is_null() || flags & libc::MSG_PEEK != 0 {
        return call(msg);
    }
    // SAFETY: the caller's contract: `msg` is a valid msghdr.
    let (iov, cnt) = unsafe { ((*msg).msg_iov, (*msg).msg_iovlen as c_int) };
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
        // for the call and the fields the kernel writes back (name length, control length,
        // flags) are copied back to the caller's header.
        unsafe {
            let k = iov_window(iov, cnt, done, len, &mut w);
            let mut m = std::ptr::read(msg);
            m.msg_iov = w.as_mut_ptr();
            m.msg_iovlen = k as _;
            let r = call(&mut m);
            (*msg).msg_namelen = m.msg_namelen;
            (*msg).msg_controllen = m.msg_controllen;
            (*msg).msg_flags = m.msg_flags;
            r
        }
    })
}

/// # Safety
/// sendmsg(2)'s contract.
pub unsafe fn hook_sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    // SAFETY: the caller's contract; sendmsg does not write through `msg` and neither does the
    // window (the write-back fields are unchanged by sendmsg).
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
        waitall: false,
    };
    // SAFETY: the caller's contract; the kernel advances the offsets between pieces.
    hooks::transfer(&legs, n.min(MAX_IO), f, |_, len| unsafe {
        real::splice(fd_in, off_in, fd_out, off_out, len, flags)
    })
}

/// Most pollfds whose interest a `poll` may hold back; beyond these, descriptors are polled as
/// asked (a program polling thousands of shaped sockets can spin on the rest).
const POLL_HELD_MAX: usize = 256;

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
    if fds.is_null() || n == 0 {
        return call(user_timeout());
    }
    let k = (n as usize).min(POLL_HELD_MAX);
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
    // SAFETY: a non-null `ts` is the caller's valid timespec.
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
/// # Safety
/// select(2)'s contract: each non-null set is a valid `fd_set` of the caller's, `nfds` at most
/// `FD_SETSIZE`; `sigmask` null or a valid mask.
unsafe fn select_common(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    deadline_ns: Option<u64>,
    sigmask: *const libc::sigset_t,
    first: &dyn Fn() -> c_int,
) -> (c_int, bool) {
    if nfds <= 0 || (r.is_null() && w.is_null()) {
        return (first(), false);
    }
    let n = (nfds as usize).min(libc::FD_SETSIZE);
    let mut asks = [PollAsk {
        fd: -1,
        wants_read: false,
        wants_write: false,
    }; POLL_HELD_MAX];
    let mut held = [(false, false); POLL_HELD_MAX];
    let mut k = 0;
    for fd in 0..n as c_int {
        // SAFETY: non-null sets are the caller's valid fd_sets; `fd < FD_SETSIZE`.
        let (rd, wr) = unsafe {
            (
                !r.is_null() && libc::FD_ISSET(fd, r),
                !w.is_null() && libc::FD_ISSET(fd, w),
            )
        };
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
        // SAFETY: non-null sets are the caller's valid fd_sets (copied, not changed here).
        let copy = |set: *mut libc::fd_set| (!set.is_null()).then(|| unsafe { *set });
        let (mut rc, mut wc, mut ec) = (copy(r), copy(w), copy(e));
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
            // The result (or, timed out, the emptied sets) goes to the caller.
            for (user, ours) in [(r, rc), (w, wc), (e, ec)] {
                if let (false, Some(set)) = (user.is_null(), ours) {
                    // SAFETY: the caller's valid fd_set.
                    unsafe { *user = set };
                }
            }
            return (res, true);
        }
        if res < 0 {
            return (res, true);
        }
    }
}

/// Now plus a caller's timeout (negative parts count as 0), on our clock.
fn deadline_in(sec: libc::time_t, ns: i64) -> u64 {
    now_ns()
        .saturating_add((sec.max(0) as u64).saturating_mul(1_000_000_000))
        .saturating_add(ns.max(0) as u64)
}

fn ns_timespec(ns: u64) -> libc::timespec {
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
    // SAFETY: a non-null `tv` is the caller's valid timeval.
    let deadline =
        (!tv.is_null()).then(|| unsafe { deadline_in((*tv).tv_sec, (*tv).tv_usec * 1_000) });
    // SAFETY: the caller's contract, passed on unchanged to the real call.
    let first = || unsafe { real::select(nfds, r, w, e, tv) };
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
    // SAFETY: a non-null `ts` is the caller's valid timespec.
    let deadline = (!ts.is_null()).then(|| unsafe { deadline_in((*ts).tv_sec, (*ts).tv_nsec) });
    // SAFETY: the caller's contract, passed on unchanged to the real call.
    let first = || unsafe { real::pselect(nfds, r, w, e, ts, mask) };
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
    // SAFETY: a non-null `timeout` is the caller's valid timespec.
    let deadline =
        (!timeout.is_null()).then(|| unsafe { deadline_in((*timeout).tv_sec, (*timeout).tv_nsec) });
    // SAFETY: the caller's contract.
    unsafe { epoll_common(epfd, ev, max, deadline, mask, &first) }
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
            _buflen: size_t,
        ) -> ssize_t {
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
            _buflen: size_t,
            f: c_int,
        ) -> ssize_t {
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
            _buflen: size_t,
            f: c_int,
            a: *mut sockaddr,
            l: *mut socklen_t,
        ) -> ssize_t {
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
            _len: size_t,
        ) -> c_int {
            s::hook_poll(p, n, t)
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
