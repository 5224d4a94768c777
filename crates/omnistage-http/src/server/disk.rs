//! The disk resource stage: a bounded pool of reader threads fed by a scheduler that is fair
//! by bytes between tenants.
//!
//! A chunk of a file body that the page cache already holds is copied by the worker that asks
//! for it, in the tenant's activity ([`read_cached`], `RWF_NOWAIT`); one that would wait for
//! the device (or any `disk_direct` read) is a job here. The jobs wait in
//! one FIFO per tenant; a scheduling tree (SFQ over tenant leaves, charged in bytes before the
//! read, each leaf optionally capped by the tenant's `disk_cap`, under a node capped by the
//! server's `disk_cap`) decides which tenant's read goes next; `disk_threads` threads do the
//! reads, which bounds the reads in flight. A finished read goes back to the core that owns the
//! connection as a message in the tenant's activity, carrying the bytes (no copy on the way).
//!
//! The pool's lock is taken once per read, by a worker submitting and by a reader picking; the
//! per-message path of the workers never takes it. io_uring per core would remove the threads
//! and the lock; this is the blocking-pool fallback the architecture allows.
//!
//! The readers are the server's threads: with pinned workers they stay on the workers' CPUs at
//! nice 19, below the workers ([`READER_NICE`]).
//!
//! The `http.disk` stage ([`on_disk`]) is the way back: it runs on the connection's core, in
//! the tenant's activity, queues the bytes read and writes on; [`submit_read`] is the way in.

use super::conn::{close, drive, flush, FLOW_CHUNK_BYTES};
use super::core_server::{with_core, CoreServer};
use super::tenants::{cap_kind, TenantRuntime};
use super::Stages;
use bytes::Bytes;
use omnistage::account::ActivityId;
use omnistage::exec::{Affinity, Ctx, Runtime, SendError, SendOpts};
use omnistage::sched::{ClientParams, NodeId, PolicyKind, ShaperKind, ShaperSpec, Tree};
use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// O_DIRECT needs buffers, offsets and lengths aligned to the device's block size; 4 KiB
/// covers the common ones.
pub(super) const DIRECT_ALIGN: u64 = 4096;
/// Most jobs waiting, over all tenants (each connection has at most one read in flight, so
/// this is reached only with more connections than this).
const JOBS_QUEUED_MAX: usize = 1 << 20;
/// How many times a reader retries handing a result to a full mailbox before giving up.
const DELIVER_RETRIES: usize = 1000;

/// One read.
pub(super) struct DiskJob {
    pub(super) core: u16,
    pub(super) key: u64,
    pub(super) activity: ActivityId,
    pub(super) weight: u32,
    pub(super) cap: Option<ShaperSpec>,
    pub(super) file: Arc<File>,
    pub(super) offset: u64,
    pub(super) len: usize,
    pub(super) direct: bool,
}

struct Sched {
    tree: Tree,
    disk: NodeId,
    leaves: HashMap<ActivityId, NodeId>,
    queues: HashMap<NodeId, VecDeque<DiskJob>>,
    queued: usize,
    stopping: bool,
}

/// The readers' nice value. A reader copies a file's chunk (from the page cache, mostly) for one
/// tenant while the workers serve every tenant by share; at equal priority the kernel split a
/// pinned worker's CPU evenly with the readers it shares it with, and a victim tenant's messages
/// waited behind an attacker's file reads (`exp adversary`: the worker waited 364 ms of a 3 s
/// attacked phase in its CPU's run queue, median of 4; 115 ms at nice 19, against 41 ms with
/// the readers under SCHED_IDLE, which cut the attacker's large-file rate from ~425 to ~150
/// MB/s: starving the disk stage whenever the workers are busy). At nice 19 a reader still
/// gets about 1.5 % of a busy worker's CPU, and all of an idle one's. Applied only when the
/// workers are pinned ([`Runtime::enter_helper_thread`]); an unpinned server's readers keep
/// the priority and CPUs they started with.
const READER_NICE: i32 = 19;

/// The pool.
pub(super) struct DiskPool {
    state: Arc<(Mutex<Sched>, Condvar)>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    epoch: Instant,
    /// Bytes read, all tenants.
    pub(super) bytes_read: AtomicU64,
}

fn ns_since(epoch: Instant) -> u64 {
    epoch.elapsed().as_nanos() as u64
}

impl DiskPool {
    /// Starts `threads` readers, which hand a finished read to its core. A reader that cannot
    /// be spawned is an error, and the readers started before it are stopped and joined.
    pub(super) fn start(
        threads: usize,
        disk_cap: Option<u64>,
        rt: Arc<Runtime>,
        stages: Stages,
    ) -> Result<Arc<DiskPool>, String> {
        let mut tree = Tree::new(PolicyKind::Sfq);
        tree.set_min_cost(1);
        let disk = tree
            .add_interior(tree.root(), ClientParams::default(), PolicyKind::Sfq)
            .expect("a new tree has room");
        if let Some(rate) = disk_cap {
            let spec = ShaperSpec {
                kind: ShaperKind::Token,
                rate_per_s: rate,
                burst: (rate / 100).max(FLOW_CHUNK_BYTES as u64),
                grain: 0,
            };
            tree.set_shaper(disk, Some(spec), 0)
                .expect("validated by the config");
        }
        let pool = Arc::new(DiskPool {
            state: Arc::new((
                Mutex::new(Sched {
                    tree,
                    disk,
                    leaves: HashMap::new(),
                    queues: HashMap::new(),
                    queued: 0,
                    stopping: false,
                }),
                Condvar::new(),
            )),
            threads: Mutex::new(Vec::new()),
            epoch: Instant::now(),
            bytes_read: AtomicU64::new(0),
        });
        for i in 0..threads {
            let pool2 = pool.clone();
            let rt = rt.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("omnistage-disk{i}"))
                .spawn(move || pool2.reader(&rt, stages));
            match spawned {
                Ok(h) => pool.threads.lock().expect("threads lock").push(h),
                Err(e) => {
                    pool.stop();
                    return Err(format!("cannot start disk reader {i}: {e}"));
                }
            }
        }
        Ok(pool)
    }

    /// Queues a read; false if the pool is full or stopping (the caller reads inline).
    pub(super) fn submit(&self, job: DiskJob) -> bool {
        let (lock, cv) = &*self.state;
        let mut s = lock.lock().expect("disk lock");
        if s.stopping || s.queued >= JOBS_QUEUED_MAX {
            return false;
        }
        let now = ns_since(self.epoch);
        let leaf = match s.leaves.get(&job.activity) {
            Some(&l) => l,
            None => {
                let disk = s.disk;
                let Ok(l) = s.tree.add_leaf(disk, ClientParams::weight(job.weight)) else {
                    return false;
                };
                s.leaves.insert(job.activity, l);
                l
            }
        };
        // Weight and cap follow the tenant's configuration at its latest read.
        let _ = s.tree.set_params(leaf, ClientParams::weight(job.weight));
        let _ = s.tree.set_shaper(leaf, job.cap, now);
        s.queues.entry(leaf).or_default().push_back(job);
        s.queued += 1;
        s.tree.leaf_ready(leaf, now);
        cv.notify_one();
        true
    }

    /// Stops the readers (jobs still queued are dropped) and waits for them.
    pub(super) fn stop(&self) {
        {
            let (lock, cv) = &*self.state;
            lock.lock().expect("disk lock").stopping = true;
            cv.notify_all();
        }
        for h in std::mem::take(&mut *self.threads.lock().expect("threads lock")) {
            let _ = h.join();
        }
    }

    fn next_job(&self) -> Option<DiskJob> {
        let (lock, cv) = &*self.state;
        let mut s = lock.lock().expect("disk lock");
        loop {
            if s.stopping {
                return None;
            }
            let now = ns_since(self.epoch);
            if let Some(leaf) = s.tree.pick(now) {
                let q = s.queues.get_mut(&leaf).expect("a ready leaf has a queue");
                let job = q.pop_front().expect("a ready leaf has a job");
                let more = !q.is_empty();
                // Charged before the read: its cost (bytes) is known.
                s.tree.charge(leaf, job.len as u64, more, now);
                s.queued -= 1;
                return Some(job);
            }
            s = match s.tree.next_decision_ns(now) {
                Some(d) => {
                    cv.wait_timeout(s, Duration::from_nanos(d.max(1)))
                        .expect("disk lock")
                        .0
                }
                None => cv.wait(s).expect("disk lock"),
            };
        }
    }

    fn reader(&self, rt: &Runtime, stages: Stages) {
        if let Err(e) = rt.enter_helper_thread(READER_NICE) {
            // Not `eprintln!`: it panics when stderr is gone.
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "omnistage: disk reader: {e}");
        }
        while let Some(job) = self.next_job() {
            let result = read(&job);
            if let Ok(b) = &result {
                self.bytes_read.fetch_add(b.len() as u64, Ordering::Relaxed);
            }
            let data = result.ok();
            let opts = SendOpts {
                activity: Some(job.activity),
                affinity: Affinity::Core(job.core),
                ..Default::default()
            };
            for _ in 0..DELIVER_RETRIES {
                // A refused send drops its message; the bytes are shared, so a retry is cheap.
                let done = DiskDone {
                    key: job.key,
                    offset: job.offset,
                    data: data.clone(),
                };
                match rt.send_with(&stages.disk, opts, done) {
                    Ok(()) => break,
                    Err(SendError::MailboxFull) | Err(SendError::Rejected(_)) => {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(SendError::Stopped) => return,
                    // Anything else concerns this result only (its activity was removed, say):
                    // drop it and go on serving the others.
                    Err(_) => break,
                }
            }
        }
    }
}

/// Reads `job.len` bytes at `job.offset` (fewer at the end of the file). With O_DIRECT the
/// aligned superset is read into an aligned part of the buffer, and the bytes asked for are
/// sliced out of it without a copy.
fn read(job: &DiskJob) -> Result<Bytes, std::io::Error> {
    if !job.direct {
        let mut v = vec![0; job.len];
        job.file.read_exact_at(&mut v, job.offset)?;
        return Ok(Bytes::from(v));
    }
    let start = job.offset / DIRECT_ALIGN * DIRECT_ALIGN;
    let end = (job.offset + job.len as u64).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
    let span = (end - start) as usize;
    let mut v = vec![0u8; span + DIRECT_ALIGN as usize];
    let skew = v.as_ptr().align_offset(DIRECT_ALIGN as usize);
    let buf = &mut v[skew..skew + span];
    let mut got = 0;
    // Bounded: each round reads at least one byte or ends.
    while got < span {
        let n = job.file.read_at(&mut buf[got..], start + got as u64)?;
        if n == 0 {
            break;
        }
        got += n;
    }
    let from = skew + (job.offset - start) as usize;
    let to = from + job.len;
    if to > skew + got {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "file shorter than the read",
        ));
    }
    Ok(Bytes::from(v).slice(from..to))
}

/// A finished disk read, on its way back to the connection's core.
pub(super) struct DiskDone {
    pub(super) key: u64,
    pub(super) offset: u64,
    /// `None`: the read failed.
    pub(super) data: Option<Bytes>,
}

/// One chunk to read.
pub(super) struct ChunkRead {
    pub(super) file: Arc<File>,
    pub(super) offset: u64,
    pub(super) len: usize,
    /// The descriptor was opened with O_DIRECT.
    pub(super) direct: bool,
}

/// Hands the read of a body chunk to the disk stage, in the tenant's name.
pub(super) fn submit_read(
    ctx: &mut Ctx<'_>,
    cs: &mut CoreServer,
    pool: &Arc<DiskPool>,
    key: u64,
    tenant: Option<Arc<TenantRuntime>>,
    read: ChunkRead,
) -> bool {
    let Some(tr) = tenant else { return false };
    if !read.direct {
        if let Some(data) = read_cached(&read) {
            // The page cache held it: the copy was made here, in the tenant's activity (the
            // dispatch that asked for it), and the bytes take the way back a reader's would,
            // as a message on this core, so the caller's control flow is the same either way.
            let opts = SendOpts {
                activity: Some(tr.activity),
                affinity: Affinity::Core(ctx.core() as u16),
                ..Default::default()
            };
            let done = DiskDone {
                key,
                offset: read.offset,
                data: Some(data),
            };
            if ctx.send_with(&cs.stages.disk, opts, done).is_ok() {
                if let Some(body) = cs.conn(key).and_then(|c| c.body.as_mut()) {
                    body.in_flight = true;
                }
                return true;
            }
            // Refused (the disk stage's queue is full): the pool reads it again below.
        }
    }
    let live = cs.live.clone();
    let Some(t) = live.config.tenants.iter().find(|t| t.name == tr.name) else {
        return false;
    };
    let job = DiskJob {
        core: ctx.core() as u16,
        key,
        activity: tr.activity,
        weight: t.weight,
        cap: t.disk_cap_bytes_per_s.map(|r| ShaperSpec {
            kind: cap_kind(t.cap_kind),
            rate_per_s: r,
            burst: (r / 100).max(FLOW_CHUNK_BYTES as u64),
            grain: 0,
        }),
        file: read.file,
        offset: read.offset,
        len: read.len,
        direct: read.direct,
    };
    if !pool.submit(job) {
        return false;
    }
    if let Some(body) = cs.conn(key).and_then(|c| c.body.as_mut()) {
        body.in_flight = true;
    }
    true
}

/// Reads a chunk only if the page cache holds it (`preadv2` with `RWF_NOWAIT`, which fails
/// with `EAGAIN` rather than wait for the device): the bytes it got from the start of the
/// chunk, or `None` when it got none (not cached, the end of the file, a file system without
/// `RWF_NOWAIT`, any error; the pool then reads the chunk, and reports what it must).
///
/// Why the worker copies cached chunks itself: a reader thread shares the worker's CPU
/// ([`READER_NICE`]) and the kernel, not the tenants' shares, decides when it runs. Each time
/// the kernel picks a reader it may run a whole slice (up to ~1.5 ms on 2 CPUs) while the
/// worker, runnable, waits with every other tenant's messages; in `exp adversary` the two
/// readers took ~2.5 % of the attacked worker's CPU that way (`perf sched`, 25 ms per second
/// in runs of up to 2.1 ms). Copied here, a chunk (at most [`FLOW_CHUNK_BYTES`], a few µs from
/// the page cache) is part of a dispatch the runtime schedules and charges to the tenant, as
/// cgroups charge a page-cache hit to the reader's CPU and not to the device: only reads that
/// would wait for the device go to the pool and its disk share.
fn read_cached(read: &ChunkRead) -> Option<Bytes> {
    let mut v = vec![0u8; read.len];
    let mut bufs = [std::io::IoSliceMut::new(&mut v)];
    match rustix::io::preadv2(
        &*read.file,
        &mut bufs,
        read.offset,
        rustix::io::ReadWriteFlags::NOWAIT,
    ) {
        Ok(n) if n > 0 => {
            v.truncate(n);
            Some(Bytes::from(v))
        }
        _ => None,
    }
}

/// A disk read came back: queue its bytes (no copy) and go on writing.
pub(super) fn on_disk(ctx: &mut Ctx<'_>, d: DiskDone) {
    with_core(|cs| {
        cs.refresh(ctx);
        let key = d.key;
        let Some(c) = cs.conn(key) else { return };
        let Some(body) = c.body.as_mut() else { return };
        if !body.in_flight || body.offset != d.offset {
            return;
        }
        body.in_flight = false;
        let Some(data) = d.data else {
            // A failed read: the length already promised cannot be honoured.
            close(ctx, cs, key);
            return;
        };
        let n = data.len() as u64;
        body.offset += n;
        body.remaining = body.remaining.saturating_sub(n);
        if body.remaining == 0 {
            c.body = None;
        }
        c.out.push_shared(data);
        if let Some(t) = &c.tenant {
            t.disk_bytes.fetch_add(n, Ordering::Relaxed);
        }
        if flush(ctx, cs, key) {
            drive(ctx, cs, key);
        }
    });
}
