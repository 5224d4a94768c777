//! A group's shared-memory segment: `shm_open`, `mmap`, a process-shared robust mutex around
//! the group's state, and the epoch the hooks watch for live changes.

use super::*;

const MAGIC: u64 = 0x6f6d_6e69_7368_6170; // "omnishap"
/// 3: `Member::released_ns`.
const VERSION: u64 = 3;

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
                None => {
                    let _ = sleep_until(now_ns() + 2_000_000);
                }
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
            let _ = sleep_until(now_ns() + 1_000_000);
        }
        let map = Self::map(fd)?;
        // SAFETY: the mapping is SEGMENT_BYTES long; `magic` is an atomic read by all.
        let seg = unsafe { &*map.seg };
        while seg.magic.load(Ordering::Acquire) != MAGIC {
            if now_ns() > deadline {
                return Err(format!("{} was never initialised", name.to_string_lossy()));
            }
            let _ = sleep_until(now_ns() + 1_000_000);
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
