//! The per-core open-file cache (like nginx's `open_file_cache`): resolved, opened files with
//! their validators, and the bytes of small files, held within the server's `cache_bytes_max`
//! split between the cores and shared by the tenants by budget (their `cache_bytes`, else their
//! weight's part); the tenant furthest above its budget gives back first. The table of open
//! files is bounded too (the tenant with the most entries gives back its oldest) and swept
//! every second: entries nobody asked for in a minute, and deleted files, are closed.

use super::core_server::CoreServer;
use bytes::Bytes;
use omnistage::account::ActivityId;
use std::collections::HashMap;
use std::fs::File;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::SystemTime;

/// Files up to this size are kept in memory by the cache (larger ones are streamed).
pub(super) const CACHE_FILE_BYTES_MAX: u64 = 1 << 20;
/// Open files (with their validators) kept per core, like nginx's `open_file_cache`.
pub(super) const FILE_CACHE_ENTRIES_MAX: usize = 1024;
/// How long a cached file's metadata is trusted: a file changed on disk is seen at most this
/// late (its old bytes and validators may be served until then).
pub(super) const FILE_CACHE_TTL_NS: u64 = 1_000_000_000;
/// An entry not asked for (revalidated) for this long is dropped by the periodic sweep, its
/// descriptor closed (nginx's `open_file_cache inactive=60s`): open files are not kept for
/// names nobody asks for any more.
pub(super) const FILE_CACHE_IDLE_NS: u64 = 60_000_000_000;
/// Entries dropped at once when the table is full (from the tenant with the most entries,
/// oldest first): each full-table miss then costs one scan of the table per this many misses.
const FILE_CACHE_EVICT_BATCH: usize = 64;

/// A resolved, opened file with its response headers precomputed.
pub(super) struct CachedFile {
    pub(super) file: Arc<File>,
    pub(super) len: u64,
    pub(super) modified: SystemTime,
    /// Shared so a response can hold them while the core is borrowed (a count, not a copy).
    pub(super) etag: Arc<str>,
    pub(super) last_modified: Arc<str>,
    pub(super) content_type: &'static str,
    pub(super) expires_ns: u64,
    /// The file's bytes, when the cache holds them (sent as shared slices, without copying).
    pub(super) content: Option<Bytes>,
    /// The descriptor was opened with O_DIRECT (reads must be aligned).
    pub(super) direct: bool,
}

impl CoreServer {
    /// This core's part of the cache's byte limit.
    pub(super) fn cache_limit(&self) -> usize {
        (self.live.config.server.cache_bytes_max / self.workers.max(1) as u64) as usize
    }

    /// This core's part of an activity's cache budget: its `cache_bytes`, or else its
    /// weight's share of the limit.
    pub(super) fn cache_budget(&self, activity: ActivityId) -> usize {
        let cfg = &self.live.config;
        let wsum: u64 = cfg
            .tenants
            .iter()
            .map(|t| u64::from(t.weight))
            .sum::<u64>()
            .max(1);
        let workers = self.workers.max(1) as u64;
        for (t, tr) in cfg.tenants.iter().zip(&self.live.tenants) {
            if tr.activity == activity {
                return match t.cache_bytes {
                    Some(b) => (b / workers) as usize,
                    None => (self.cache_limit() as u64 * u64::from(t.weight) / wsum) as usize,
                };
            }
        }
        0
    }

    pub(super) fn cache_account(&mut self, activity: ActivityId, delta: isize) {
        let used = self.cache_by_activity.entry(activity).or_insert(0);
        *used = (*used as isize + delta).max(0) as usize;
        self.cache_used = (self.cache_used as isize + delta).max(0) as usize;
        if let Some(tr) = self.live.tenants.iter().find(|t| t.activity == activity) {
            if delta >= 0 {
                tr.cache_bytes.fetch_add(delta as u64, Ordering::Relaxed);
            } else {
                tr.cache_bytes
                    .fetch_sub(delta.unsigned_abs() as u64, Ordering::Relaxed);
            }
        }
    }

    /// Drops the cached content of one entry.
    pub(super) fn cache_drop(&mut self, k: &(ActivityId, String)) {
        let freed = self
            .files
            .get_mut(k)
            .and_then(|f| f.content.take())
            .map(|b| b.len());
        if let Some(n) = freed {
            self.cache_account(k.0, -(n as isize));
        }
    }

    /// Drops an entry (its cached bytes given back; its descriptor closed once no response
    /// still sends from it).
    fn cache_forget(&mut self, k: &(ActivityId, String)) {
        self.cache_drop(k);
        self.files.remove(k);
    }

    /// Makes room in the full entry table for a new entry: drops the oldest entries (by when
    /// they were last validated) of the tenant that holds the most, up to
    /// [`FILE_CACHE_EVICT_BATCH`]. So a tenant (or a client) asking for thousands of names
    /// recycles its own entries and leaves the others' (the table was cleared whole before:
    /// one tenant's walk over 1,024 names dropped every tenant's cached bytes).
    pub(super) fn cache_make_entry_room(&mut self) {
        if self.files.len() < FILE_CACHE_ENTRIES_MAX {
            return;
        }
        let mut held: HashMap<ActivityId, usize> = HashMap::new();
        for k in self.files.keys() {
            *held.entry(k.0).or_insert(0) += 1;
        }
        // Ties go to the larger id, so the choice does not depend on the map's order.
        let Some((victim, _)) = held.into_iter().max_by_key(|&(a, n)| (n, a)) else {
            return;
        };
        let mut oldest: Vec<(u64, (ActivityId, String))> = self
            .files
            .iter()
            .filter(|(k, _)| k.0 == victim)
            .map(|(k, f)| (f.expires_ns, k.clone()))
            .collect();
        oldest.sort_unstable();
        for (_, k) in oldest.iter().take(FILE_CACHE_EVICT_BATCH) {
            self.cache_forget(k);
        }
        debug_assert!(self.files.len() < FILE_CACHE_ENTRIES_MAX);
    }

    /// The periodic sweep (every log flush, once a second): drops the entries not asked for
    /// in [`FILE_CACHE_IDLE_NS`], and those past their TTL whose file is gone from the file
    /// system (unlinked or replaced: its link count is 0), so a deleted file's descriptor, and
    /// with it the disk space, is not held until someone asks for that name again. Costs one
    /// `fstat` per entry past its TTL (at most [`FILE_CACHE_ENTRIES_MAX`] a second).
    pub(super) fn cache_sweep(&mut self, now_ns: u64) {
        use std::os::unix::fs::MetadataExt;
        let gone: Vec<(ActivityId, String)> = self
            .files
            .iter()
            .filter(|(_, f)| {
                f.expires_ns.saturating_add(FILE_CACHE_IDLE_NS) <= now_ns
                    || (f.expires_ns <= now_ns
                        && f.file.metadata().map_or(true, |m| m.nlink() == 0))
            })
            .map(|(k, _)| k.clone())
            .collect();
        for k in &gone {
            self.cache_forget(k);
        }
    }

    /// Forgets every cached file (after a reload).
    pub(super) fn cache_clear(&mut self) {
        let keys: Vec<_> = self.files.keys().cloned().collect();
        for k in &keys {
            self.cache_drop(k);
        }
        self.files.clear();
    }

    /// Makes room for `need` more bytes of `for_activity` by reclaiming from the activity
    /// furthest above its budget (counting `need` as already `for_activity`'s, so a tenant
    /// that would go over its budget reclaims from itself); false if it cannot.
    pub(super) fn cache_make_room(&mut self, need: usize, for_activity: ActivityId) -> bool {
        let limit = self.cache_limit();
        if need > limit {
            return false;
        }
        // Each round drops one entry; there are at most FILE_CACHE_ENTRIES_MAX.
        for _ in 0..=FILE_CACHE_ENTRIES_MAX {
            if self.cache_used + need <= limit {
                return true;
            }
            let own = self
                .cache_by_activity
                .get(&for_activity)
                .copied()
                .unwrap_or(0);
            let victim = self
                .cache_by_activity
                .iter()
                .filter(|(&a, &u)| u > 0 && a != for_activity)
                .map(|(&a, &u)| (a, u))
                .chain(std::iter::once((for_activity, own + need)))
                .map(|(a, u)| (a, u as f64 / self.cache_budget(a).max(1) as f64))
                .max_by(|x, y| x.1.total_cmp(&y.1))
                .map(|(a, _)| a);
            let Some(victim) = victim else { return false };
            if victim == for_activity && own == 0 {
                // The requester alone would be furthest above its budget: do not cache.
                return false;
            }
            let entry = self
                .files
                .iter()
                .filter(|(k, f)| k.0 == victim && f.content.is_some())
                .max_by_key(|(_, f)| f.len)
                .map(|(k, _)| k.clone());
            match entry {
                Some(k) => self.cache_drop(&k),
                None => {
                    self.cache_by_activity.remove(&victim);
                }
            }
        }
        false
    }
}

/// A file opened to serve, with its length and modification time read from the open
/// descriptor: the path may name another file by then (an atomic deploy's rename), and the
/// entry must describe the bytes it will send.
pub(super) struct Opened {
    pub(super) file: File,
    pub(super) len: u64,
    pub(super) modified: SystemTime,
}

/// Opens `path` (canonical, inside the canonical docroot `root`, as `path::resolve` checked
/// it) to serve it; with `direct`, bypassing the page cache (O_DIRECT) where the file system
/// allows it.
///
/// The check and the open are apart in time, so the open itself must hold what the check
/// found: it resolves the path relative to `root` with `openat2(RESOLVE_BENEATH |
/// RESOLVE_NO_MAGICLINKS)`, so a directory or the file swapped for a symlink in between
/// cannot lead out of the docroot (to another tenant's files); it does not block
/// (O_NONBLOCK), so a FIFO swapped in cannot hold the worker, whose every tenant would wait;
/// and it refuses what is not a regular file. On a kernel without `openat2` (before 5.6), or
/// under a seccomp filter that refuses it, the last component is opened with O_NOFOLLOW (a
/// directory swapped higher up is then not caught).
pub(super) fn open_beneath(
    root: &std::path::Path,
    path: &std::path::Path,
    direct: bool,
) -> std::io::Result<Opened> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let not_found = || std::io::Error::from(std::io::ErrorKind::NotFound);
    let relative = path.strip_prefix(root).map_err(|_| not_found())?;
    let dir = rustix::fs::open(
        root,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let open = |flags: OFlags| match rustix::fs::openat2(
        &dir,
        relative,
        flags,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
    ) {
        // No openat2 in this kernel, or a seccomp filter that refuses it (container runtimes
        // older than it answer ENOSYS or EPERM).
        Err(rustix::io::Errno::NOSYS | rustix::io::Errno::PERM) => {
            rustix::fs::open(path, flags | OFlags::NOFOLLOW, Mode::empty())
        }
        other => other,
    };
    let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY;
    let fd = match direct {
        true => open(flags | OFlags::DIRECT).or_else(|_| open(flags))?,
        false => open(flags)?,
    };
    let file = File::from(fd);
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(not_found());
    }
    Ok(Opened {
        len: meta.len(),
        modified: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
        file,
    })
}

#[cfg(test)]
mod tests {
    use super::open_beneath;
    use std::path::Path;
    use std::time::Duration;

    /// `open_beneath` on its own thread: a FIFO opened without O_NONBLOCK would block it
    /// until a writer came, so a hang fails the test instead of holding it forever.
    fn open_within_5_s(root: &Path, path: &Path) -> std::io::Result<u64> {
        let (root, path) = (root.to_path_buf(), path.to_path_buf());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(open_beneath(&root, &path, false).map(|o| o.len));
        });
        rx.recv_timeout(Duration::from_secs(5))
            .expect("the open returned (a FIFO did not block it)")
    }

    #[test]
    fn opens_a_regular_file_inside_the_root_with_its_own_length() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        std::fs::create_dir(root.join("sub")).unwrap();
        std::fs::write(root.join("sub/f.txt"), b"12345").unwrap();
        assert_eq!(open_within_5_s(&root, &root.join("sub/f.txt")).unwrap(), 5);
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            root.join("p.bin"),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o644),
            0,
        )
        .unwrap();
        assert!(open_within_5_s(&root, &root.join("p.bin")).is_err());
    }

    #[test]
    fn symlinks_swapped_in_cannot_lead_out_of_the_root() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret.txt"), b"another tenant's").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        // What `resolve` checked were a directory and a file; both are symlinks out by the
        // time of the open.
        std::os::unix::fs::symlink(outside.path(), root.join("sub")).unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret.txt"), root.join("secret.txt"))
            .unwrap();
        for path in [root.join("sub/secret.txt"), root.join("secret.txt")] {
            assert!(
                std::fs::File::open(&path).is_ok(),
                "a plain open (the old code) follows {path:?} out"
            );
            assert!(
                open_within_5_s(&root, &path).is_err(),
                "{path:?} was opened outside the root"
            );
        }
    }

    #[test]
    fn a_path_outside_the_root_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        assert!(open_within_5_s(&root.join("sub"), &root).is_err());
    }
}
