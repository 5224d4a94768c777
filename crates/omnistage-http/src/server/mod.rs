//! `server`: the multi-tenant HTTP server as stages on the omnistage runtime.
//!
//! Stages (all per core; a connection lives on the core that accepted it):
//!
//! ```text
//! http.boot ──── takes this core's listening sockets and registers them       (/infra)
//! http.accept ── listener readiness: accept, register the connection          (/infra)
//! http.conn ──── connection readiness: read (lazily, in the connection's
//!                activity), parse, pick the tenant, queue the request,
//!                write what is pending                                         (tenant)
//! http.work ──── a request in its tenant's activity: files, synthetic
//!                endpoints, errors; its gate turns overload into 503           (tenant)
//! http.timer ─── header and keep-alive deadlines; access-log flushes           (any)
//! http.send ──── the network send resource stage, when a link or tenant net cap is
//!                configured: its own scheduler (SFQ by bytes under a link shaper,
//!                one node per tenant with its weight and cap, a leaf per
//!                connection, or one per tenant whose `send_order` heap picks
//!                the response) decides whose bytes go out next                 (/infra)
//! http.cont ──── a connection's continuation (more body, more pipelined
//!                requests) after it yielded; never refused                     (tenant)
//! http.disk ──── a disk read coming back from the disk stage (`disk.rs`)       (tenant)
//! ```
//!
//! Output is a queue of segments written with `writev`, and with `sendfile` for large file
//! bodies when the `sendfile` key is on (`output.rs`); the disk stage is a pool of reader
//! threads behind a byte-fair scheduler (`disk.rs`).
//!
//! Receive is lazy (QLinux's LRP): the first request of a connection is read and parsed in
//! `/infra` (nobody knows the tenant before the Host header); from then on the connection's
//! readiness is delivered in its tenant's activity, so a tenant over its share leaves its bytes
//! in the kernel and TCP flow control slows its clients, not the others.
//!
//! Per-core server state lives in a thread-local: each worker thread runs the handlers of its
//! own core only, and handlers never call each other (they send messages), so a `RefCell`
//! borrow is never held across another.

mod disk;
mod fleet;
mod output;
mod pool;

pub use fleet::{FleetHooks, FleetStatus, FleetTenantStatus, LeasePool};

use crate::cond::{self, RangeOutcome};
use crate::config::{AccessLog, CapKind, ClassSelector, Config, SendOrder};
use crate::path;
use crate::request::{self, Limits, Method, ParseOutcome, Request};
use crate::response::{self, DateCache};
use crate::synthetic::{self, Synthetic};
use crate::HttpError;
use bytes::Bytes;
use omnistage::account::ActivityId;
use omnistage::account::StageId;
use omnistage::activity::{ActivitySpec, INFRA};
use omnistage::admit::P90Params;
use omnistage::exec::{
    Affinity, Ctx, IoEvent, IoHandle, Runtime, SendError, SendOpts, StageConfig, StageRef,
};
use omnistage::exec::{ClassGroup, Predicate};
use omnistage::sched::{ClientParams, NodeId, PolicyKind, ShaperKind, ShaperSpec, Tree};
use output::Output;
use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

/// Bytes read from a socket per read call.
const READ_CHUNK_BYTES: usize = 16 * 1024;
/// Files up to this size are read whole into the response; larger ones are streamed.
const INLINE_FILE_BYTES_MAX: u64 = 256 * 1024;
/// Bytes of a streamed body read from the file per step: the flow's credit window, so a
/// connection never has more than this (plus one response head) in memory, whatever the file.
const FLOW_CHUNK_BYTES: usize = 64 * 1024;
/// Most flow chunks sent per dispatch before yielding to the scheduler (fairness between
/// tenants streaming large files).
const FLOW_CHUNKS_PER_DISPATCH: usize = 4;
/// Most bytes of file segments (`sendfile`) one unscheduled flush writes before it yields to
/// the scheduler: a cached body of up to `CACHE_FILE_BYTES_MAX` goes out in one `writev`, so
/// a sendfile'd one may go out in one dispatch too; larger files yield between such steps.
const SENDFILE_BYTES_PER_DISPATCH_MAX: usize = CACHE_FILE_BYTES_MAX as usize;
/// Most connections accepted per listener event before yielding.
const ACCEPTS_PER_EVENT_MAX: usize = 128;
/// Pending output above which a connection stops parsing pipelined requests (backpressure).
const OUT_PENDING_BYTES_MAX: usize = 1 << 20;
/// Access log bytes buffered per core before a write.
const LOG_BUFFER_BYTES: usize = 32 * 1024;
/// How often each core flushes its access log buffer.
const LOG_FLUSH_INTERVAL_NS: u64 = 1_000_000_000;
/// `Retry-After` seconds sent with 503.
const RETRY_AFTER_S: &str = "1";
/// Files up to this size are kept in memory by the cache (larger ones are streamed).
const CACHE_FILE_BYTES_MAX: u64 = 1 << 20;
/// Open files (with their validators) kept per core, like nginx's `open_file_cache`.
const FILE_CACHE_ENTRIES_MAX: usize = 1024;
/// How long a cached file's metadata is trusted: a file changed on disk is seen at most this
/// late (its old bytes and validators may be served until then).
const FILE_CACHE_TTL_NS: u64 = 1_000_000_000;
/// Bytes one pick of the send scheduler may write before it decides again: the quantum of
/// byte-fairness between connections.
const SEND_QUANTUM_BYTES: usize = 16 * 1024;
/// Most picks per dispatch of the send stage before it yields to the CPU scheduler.
const SEND_PICKS_PER_DISPATCH: usize = 64;
/// Aging of `shortest_first` and `longest_first`: a response's rank improves by one byte for
/// every this many bytes its tenant sent after it arrived, so no response waits behind
/// newcomers for more than this many times its own size (or, longest first, the largest
/// newcomer's) of its tenant's traffic.
const SEND_ORDER_AGING_FACTOR: u64 = 16;
/// Stale entries an ordered send queue may hold beyond twice its live ones before it is
/// compacted.
const SEND_QUEUE_SLACK: usize = 64;
/// Highest admission rate of a tenant with a p90 target, requests/s (all cores).
const P90_RATE_MAX_PER_S: f64 = 100_000.0;
/// Little's-law queue bound of a p90-controlled tenant, as a fraction of its target: the queue
/// holds at most this × target × its measured completion rate, so the mean queueing delay is
/// about 0.4 × target; the margin is for the 90th percentile, which sits above the mean (on a
/// busy machine we measured p90 of 15–20 ms at 0.5 × a 20 ms target).
const P90_QUEUE_BOUND_FRACTION: f64 = 0.4;
/// Requests a p90-controlled tenant may send back to back.
const P90_BURST: u32 = 256;
/// How long `drain` waits for the cores to write out their access-log buffers.
const LOG_FLUSH_WAIT: Duration = Duration::from_secs(1);
/// Body of a `/_burn` answer.
const BURN_BODY: &[u8] = b"burned\n";
/// Generated body bytes for `/_bytes`.
const PATTERN: &[u8; 64] = b"omnistage-omnistage-omnistage-omnistage-omnistage-omnistage-omn\n";

/// What the operator may set beyond the config file.
#[derive(Clone, Debug, Default)]
pub struct ServerOptions {
    /// Pin workers to CPUs.
    pub pin: bool,
    /// Override the worker count of the config.
    pub workers: Option<usize>,
    /// Scheduling bypass (FIFO, no accounting): the baseline for overhead experiments.
    pub bypass: bool,
}

/// Counters of the whole server (all cores).
#[derive(Debug, Default)]
pub struct ServerStats {
    pub accepted: AtomicU64,
    pub refused_connections: AtomicU64,
    pub open_connections: AtomicUsize,
    pub requests: AtomicU64,
    pub rejected_503: AtomicU64,
    pub errors_4xx: AtomicU64,
    pub errors_5xx: AtomicU64,
    pub timeouts: AtomicU64,
    /// Requests whose handler panicked (answered 500).
    pub panics: AtomicU64,
}

/// One tenant as the running server knows it. The same `Arc` lives across reloads for as long
/// as the tenant keeps its name, so connection counts stay with the tenant.
struct TenantRuntime {
    name: String,
    activity: ActivityId,
    path: String,
    open: AtomicUsize,
    /// Bytes of this tenant's files in the cache, over all cores.
    cache_bytes: AtomicU64,
    /// Bytes the disk stage read for this tenant.
    disk_bytes: AtomicU64,
    /// The fleet layer's hooks (lease pools, link backlog, link weight).
    fleet: Arc<FleetHooks>,
}

/// A tenant as the fleet layer sees it ([`Server::fleet_tenants`]).
#[derive(Clone, Debug)]
pub struct FleetTenant {
    pub name: String,
    /// `/tenants/<name>`.
    pub path: String,
    pub activity: ActivityId,
    /// The weight in the running configuration.
    pub weight: u32,
    /// Its fleet caps.
    pub caps: crate::config::TenantFleet,
    pub hooks: Arc<FleetHooks>,
}

/// The configuration and its tenants, swapped as one by a reload (so an index into one always
/// means the same tenant in the other).
struct Live {
    config: Config,
    tenants: Vec<Arc<TenantRuntime>>,
    /// Per tenant, the activity of each of its classes in config order
    /// (`/tenants/<tenant>/<class>`).
    classes: Vec<Vec<ActivityId>>,
}

/// State shared by every core of one server.
struct ServerShared {
    workers: usize,
    /// The disk stage, when `disk_threads` > 0 (set once the runtime runs).
    disk: std::sync::OnceLock<Arc<disk::DiskPool>>,
    live: RwLock<Arc<Live>>,
    live_version: AtomicU64,
    /// Bumped when a tenant's send weight override changes (the send schedulers re-weight
    /// their tenant nodes, nothing else).
    send_version: AtomicU64,
    /// What the fleet layer last computed, for the admin API.
    fleet_status: RwLock<Option<Arc<FleetStatus>>>,
    stats: ServerStats,
    /// Listening sockets, per core, taken by that core's boot message.
    listeners: Mutex<Vec<Vec<TcpListener>>>,
    burn_iters_per_us: f64,
    draining: AtomicBool,
    log: Option<Mutex<Box<dyn Write + Send>>>,
}

/// The stages of one server, handed to handlers.
#[derive(Clone, Copy)]
struct Stages {
    accept: StageRef<IoEvent>,
    conn: StageRef<IoEvent>,
    work: StageRef<Work>,
    timer: StageRef<Tick>,
    send: StageRef<Pump>,
    disk: StageRef<DiskDone>,
    /// Continuations of a connection (more body, more pipelined requests): a stage whose
    /// queues hold one per connection and never refuse, unlike `work`'s admission gates.
    cont: StageRef<Work>,
}

/// A finished disk read, on its way back to the connection's core.
struct DiskDone {
    key: u64,
    offset: u64,
    /// `None`: the read failed.
    data: Option<Bytes>,
}

/// Wakes the send stage of this core: now, or when a shaper allows (`timer`).
struct Pump {
    timer: bool,
}

/// The network send resource stage of one core: a scheduling tree charged in bytes.
struct SendSched {
    tree: Tree,
    link: NodeId,
    tenants: HashMap<ActivityId, NodeId>,
    leaves: HashMap<u64, NodeId>,
    conn_of: HashMap<NodeId, u64>,
    /// An immediate `Pump` is queued.
    pump_queued: bool,
    /// A `Pump` waits on a timer for a shaper (it does not stand for the immediate one: a
    /// tenant that is not throttled must not wait for one that is).
    pump_timer: bool,
    /// Per tenant with a `send_order` other than `fair`: the one leaf that stands for all its
    /// connections (created on its first send; at most one per tenant).
    queue_leaf: HashMap<ActivityId, NodeId>,
    /// The ordered queue behind each such leaf.
    queues: HashMap<NodeId, OrderedQueue>,
    /// Connection → (queue leaf, entry id) of its one live entry in an ordered queue.
    queued: HashMap<u64, (NodeId, u64)>,
    /// Connection → when its pending output arrived in its ordered queue (kept while it waits
    /// for the socket or the disk; forgotten when the output is done).
    arrivals: HashMap<u64, Arrival>,
    /// Each configured tenant's `send_order`, by activity (refreshed by `configure`).
    order_of: HashMap<ActivityId, SendOrder>,
}

/// When a response arrived in an ordered queue.
#[derive(Clone, Copy)]
struct Arrival {
    /// The queue's bytes sent by then (the clock of aging).
    sent_bytes: u64,
    /// Arrival number in the queue (the FIFO order, and the tie-break of the others).
    seq: u64,
    /// Bytes the connection had to send when it arrived.
    bytes: u64,
}

/// A tenant's pending responses in its `send_order`: a binary heap of
/// `(rank, arrival seq, entry id, connection)`, smallest first, with lazy deletion (an entry is
/// live while `SendSched::queued` names it). A decision is O(log n); entries are reused, and
/// stale ones are compacted away once they outnumber the live ones (plus a slack), so the
/// heap stays within twice the tenant's connections on this core.
struct OrderedQueue {
    order: SendOrder,
    heap: BinaryHeap<Reverse<(u64, u64, u64, u64)>>,
    live: usize,
    next_entry: u64,
    next_arrival: u64,
    sent_bytes: u64,
}

/// The heap rank of a response (smaller goes first). Shortest first ranks by the bytes left
/// (SRPT); longest first by the bytes the response had when it arrived (ranking it by the
/// bytes left would be LRPT, which evens out the large responses until every one, small ones
/// too, finishes together at the end).
fn send_rank(order: SendOrder, remaining_bytes: u64, arrival: Arrival) -> u64 {
    let age = arrival.sent_bytes / SEND_ORDER_AGING_FACTOR;
    // Byte counts are far below 2^62 (a body is bounded by a file size).
    const TOP: u64 = 1 << 62;
    match order {
        SendOrder::Fair | SendOrder::Fifo => 0,
        SendOrder::ShortestFirst => remaining_bytes.min(TOP).saturating_add(age),
        SendOrder::LongestFirst => (TOP - arrival.bytes.min(TOP)).saturating_add(age),
    }
}

fn bucket(kind: ShaperKind, rate_per_s: u64) -> ShaperSpec {
    ShaperSpec {
        kind,
        rate_per_s,
        // 10 ms of the rate, at least one quantum (a smaller bucket could never admit a write).
        burst: (rate_per_s / 100).max(SEND_QUANTUM_BYTES as u64),
    }
}

/// A tenant's weight in the send scheduler: the fleet layer's, else the configured one.
fn send_weight(t: &crate::config::TenantConfig, tr: &TenantRuntime) -> u32 {
    tr.fleet.send_weight().unwrap_or(t.weight)
}

fn cap_kind(k: CapKind) -> ShaperKind {
    match k {
        CapKind::Token => ShaperKind::Token,
        CapKind::Leaky => ShaperKind::Leaky,
    }
}

impl SendSched {
    /// A scheduler with only the link node (bytes as costs) and no tenants yet.
    fn empty() -> SendSched {
        let mut tree = Tree::new(PolicyKind::Sfq);
        // Costs are bytes: no minimum beyond one byte.
        tree.set_min_cost(1);
        let link = tree
            .add_interior(tree.root(), ClientParams::default(), PolicyKind::Sfq)
            .expect("a new tree has room");
        SendSched {
            tree,
            link,
            tenants: HashMap::new(),
            leaves: HashMap::new(),
            conn_of: HashMap::new(),
            pump_queued: false,
            pump_timer: false,
            queue_leaf: HashMap::new(),
            queues: HashMap::new(),
            queued: HashMap::new(),
            arrivals: HashMap::new(),
            order_of: HashMap::new(),
        }
    }

    /// A send scheduler if the configuration caps the link or any tenant's network rate.
    fn for_config(live: &Live) -> Option<SendSched> {
        let config = &live.config;
        let any_cap = config.server.net_link_cap_bytes_per_s.is_some()
            || config
                .tenants
                .iter()
                .any(|t| t.net_cap_bytes_per_s.is_some());
        if !any_cap {
            return None;
        }
        let mut s = SendSched::empty();
        s.configure(live, 0);
        Some(s)
    }

    /// Applies the link cap and the weight and cap of every tenant that has a node (after a
    /// reload, too).
    fn configure(&mut self, live: &Live, now_ns: u64) {
        let link_cap = live
            .config
            .server
            .net_link_cap_bytes_per_s
            .map(|r| bucket(ShaperKind::Token, r));
        let _ = self.tree.set_shaper(self.link, link_cap, now_ns);
        self.order_of.clear();
        for (t, tr) in live.config.tenants.iter().zip(&live.tenants) {
            self.order_of.insert(tr.activity, t.send_order);
            if let Some(&n) = self.tenants.get(&tr.activity) {
                let cap = t
                    .net_cap_bytes_per_s
                    .map(|r| bucket(cap_kind(t.cap_kind), r));
                let _ = self
                    .tree
                    .set_params(n, ClientParams::weight(send_weight(t, tr)));
                let _ = self.tree.set_shaper(n, cap, now_ns);
            }
            // A changed order ranks the entries pushed from now on; a tenant that went back to
            // `fair` keeps its queue until it drains (its connections move to their own leaves
            // as they next get output).
            if t.send_order != SendOrder::Fair {
                if let Some(q) = self
                    .queue_leaf
                    .get(&tr.activity)
                    .and_then(|l| self.queues.get_mut(l))
                {
                    q.order = t.send_order;
                }
            }
        }
    }

    /// Re-weights the tenants' nodes after a change of the fleet layer's send weights (caps,
    /// orders and the link's bucket are left as they are).
    fn reweight(&mut self, live: &Live) {
        for (t, tr) in live.config.tenants.iter().zip(&live.tenants) {
            if let Some(&n) = self.tenants.get(&tr.activity) {
                let _ = self
                    .tree
                    .set_params(n, ClientParams::weight(send_weight(t, tr)));
            }
        }
    }

    /// The ordered queue's leaf of a tenant, created under its node on first use.
    fn queue_leaf(
        &mut self,
        activity: ActivityId,
        node: NodeId,
        order: SendOrder,
    ) -> Option<NodeId> {
        if let Some(&l) = self.queue_leaf.get(&activity) {
            return Some(l);
        }
        let l = self.tree.add_leaf(node, ClientParams::default()).ok()?;
        self.queue_leaf.insert(activity, l);
        self.queues.insert(
            l,
            OrderedQueue {
                order,
                heap: BinaryHeap::new(),
                live: 0,
                next_entry: 0,
                next_arrival: 0,
                sent_bytes: 0,
            },
        );
        Some(l)
    }

    /// Puts a connection's pending output in an ordered queue (a no-op if it is there).
    /// Returns whether it was pushed.
    fn enqueue(&mut self, leaf: NodeId, key: u64, remaining_bytes: u64) -> bool {
        match self.queued.get(&key) {
            Some(&(l, _)) if l == leaf => return false,
            Some(_) => self.dequeue(key),
            None => {}
        }
        let Some(q) = self.queues.get_mut(&leaf) else {
            return false;
        };
        let arrival = *self.arrivals.entry(key).or_insert_with(|| {
            q.next_arrival += 1;
            Arrival {
                sent_bytes: q.sent_bytes,
                seq: q.next_arrival,
                bytes: remaining_bytes,
            }
        });
        q.next_entry += 1;
        let entry = q.next_entry;
        let rank = send_rank(q.order, remaining_bytes, arrival);
        q.heap.push(Reverse((rank, arrival.seq, entry, key)));
        q.live += 1;
        self.queued.insert(key, (leaf, entry));
        true
    }

    /// Takes the first live connection out of an ordered queue.
    fn pop_queued(&mut self, leaf: NodeId) -> Option<u64> {
        let q = self.queues.get_mut(&leaf)?;
        while let Some(Reverse((_, _, entry, key))) = q.heap.pop() {
            if self.queued.get(&key) == Some(&(leaf, entry)) {
                self.queued.remove(&key);
                q.live -= 1;
                return Some(key);
            }
        }
        None
    }

    /// Withdraws a connection from its ordered queue, if it is in one (the queue's leaf goes
    /// idle when nothing live is left). Not for a leaf in service.
    fn dequeue(&mut self, key: u64) {
        let Some((leaf, _)) = self.queued.remove(&key) else {
            return;
        };
        let queued = &self.queued;
        if let Some(q) = self.queues.get_mut(&leaf) {
            q.live -= 1;
            if q.live == 0 {
                q.heap.clear();
                self.tree.leaf_idle(leaf);
            } else if q.heap.len() > 2 * q.live + SEND_QUEUE_SLACK {
                q.heap
                    .retain(|Reverse((_, _, e, k))| queued.get(k) == Some(&(leaf, *e)));
            }
        }
    }

    /// Live connections in an ordered queue (0 for a leaf that is not one).
    fn queue_live(&self, leaf: NodeId) -> usize {
        self.queues.get(&leaf).map_or(0, |q| q.live)
    }

    /// The tenant's node, created with its weight and cap on its first send.
    fn tenant_node(
        &mut self,
        tr: &TenantRuntime,
        t: &crate::config::TenantConfig,
        now_ns: u64,
    ) -> Option<NodeId> {
        let activity = tr.activity;
        let params = ClientParams::weight(send_weight(t, tr));
        let cap = t
            .net_cap_bytes_per_s
            .map(|r| bucket(cap_kind(t.cap_kind), r));
        match self.tenants.get(&activity) {
            Some(&n) => Some(n),
            None => {
                let n = self
                    .tree
                    .add_interior(self.link, params, PolicyKind::Sfq)
                    .ok()?;
                let _ = self.tree.set_shaper(n, cap, now_ns);
                self.tenants.insert(activity, n);
                Some(n)
            }
        }
    }

    fn forget(&mut self, key: u64) {
        self.dequeue(key);
        self.arrivals.remove(&key);
        self.forget_leaf(key);
    }

    /// Removes a connection's own leaf (`fair`), if it has one.
    fn forget_leaf(&mut self, key: u64) {
        if let Some(leaf) = self.leaves.remove(&key) {
            self.conn_of.remove(&leaf);
            self.tree.leaf_idle(leaf);
            // Refused only for a leaf in service, which `close` never meets: the pump charges
            // before it closes.
            let _ = self.tree.remove(leaf);
        }
    }
}

enum Boot {
    Start,
    /// Stop accepting.
    Drain,
    /// Write out this core's access-log buffer; counts itself done.
    FlushLog(Arc<AtomicUsize>),
}

/// A request handed to the work stage in its tenant's activity.
// The request rides in the message by value (its head inline, or a pooled buffer): no `Box`.
#[allow(clippy::large_enum_variant)]
enum Work {
    /// The request travels by value; its head buffer comes from, and goes back to, the
    /// worker's pool (no allocation per request).
    Request { key: u64, request: Request },
    /// Continue a connection: stream more of a body, or answer more pipelined requests (after
    /// yielding to the scheduler).
    Continue { key: u64 },
}

enum Tick {
    Deadline { key: u64 },
    LogFlush,
}

/// The buffers a request is served with, kept by the core and reused (no allocation per
/// request): the file-cache key (tenant activity, decoded path) and the percent-decoded bytes.
#[derive(Default)]
struct ServeScratch {
    key: (ActivityId, String),
    decoded: Vec<u8>,
}

/// Longest `Date` value kept by [`DateText`] (an IMF-fixdate is 29 bytes).
const DATE_TEXT_BYTES_MAX: usize = 32;

/// A copy of the current `Date` value on the stack, so that a response can be written while
/// the core is borrowed (no `String` per response).
#[derive(Clone, Copy)]
struct DateText {
    bytes: [u8; DATE_TEXT_BYTES_MAX],
    len: usize,
}

impl DateText {
    /// Copies `s`, cut at [`DATE_TEXT_BYTES_MAX`] bytes (on a char boundary).
    fn new(s: &str) -> Self {
        let mut len = s.len().min(DATE_TEXT_BYTES_MAX);
        while !s.is_char_boundary(len) {
            len -= 1;
        }
        let mut bytes = [0u8; DATE_TEXT_BYTES_MAX];
        bytes[..len].copy_from_slice(&s.as_bytes()[..len]);
        DateText { bytes, len }
    }
}

impl std::ops::Deref for DateText {
    type Target = str;

    fn deref(&self) -> &str {
        // A prefix of a `str` cut on a char boundary.
        std::str::from_utf8(&self.bytes[..self.len]).unwrap_or_default()
    }
}

/// A resolved, opened file with its response headers precomputed.
struct CachedFile {
    file: Arc<File>,
    len: u64,
    modified: SystemTime,
    /// Shared so a response can hold them while the core is borrowed (a count, not a copy).
    etag: Arc<str>,
    last_modified: Arc<str>,
    content_type: &'static str,
    expires_ns: u64,
    /// The file's bytes, when the cache holds them (sent as shared slices, without copying).
    content: Option<Bytes>,
    /// The descriptor was opened with O_DIRECT (reads must be aligned).
    direct: bool,
}

/// Where a streamed body comes from.
enum Source {
    File(Arc<File>),
    /// `/_bytes`: the repeating pattern.
    Pattern,
}

struct Body {
    source: Source,
    /// The file was opened with O_DIRECT.
    direct: bool,
    offset: u64,
    remaining: u64,
    /// A read of the next chunk is with the disk stage.
    in_flight: bool,
}

struct Conn {
    stream: mio::net::TcpStream,
    handle: IoHandle,
    peer: SocketAddr,
    /// The listen address as configured (tenants are bound to those).
    local: SocketAddr,
    generation: u32,
    tenant: Option<Arc<TenantRuntime>>,
    activity: ActivityId,
    /// Bytes received and not yet parsed; taken from the thread's pool when bytes arrive and
    /// given back when it empties, so an idle connection holds none (`pool.rs`).
    inbuf: Vec<u8>,
    /// Reading stopped with the input buffer full: read again once a request is taken out
    /// (the socket will not signal again for bytes it already holds).
    read_stalled: bool,
    out: Output,
    /// A body being streamed (boxed: most connections have none, and the slot stays small).
    body: Option<Box<Body>>,
    /// The send scheduler met `WouldBlock`: wait for the socket to be writable.
    send_blocked: bool,
    /// A request is with the work stage; parse no further until it answers.
    busy: bool,
    /// Close once the output is flushed.
    closing: bool,
    /// When the request being received started (its first byte, or the accept).
    request_start_ns: u64,
    /// When a write last made progress: a client that stops reading is closed after
    /// `keepalive_timeout` without progress.
    last_progress_ns: u64,
    last_active_ns: u64,
    requests: u64,
}

struct CoreServer {
    shared: Arc<ServerShared>,
    stages: Stages,
    live: Arc<Live>,
    live_version: u64,
    /// The `ServerShared::send_version` the send scheduler's weights follow.
    send_version: u64,
    conns: Vec<Option<Conn>>,
    free: Vec<u32>,
    generations: Vec<u32>,
    listeners: Vec<(mio::net::TcpListener, IoHandle, SocketAddr)>,
    date: DateCache,
    log: Vec<u8>,
    limits: Limits,
    /// (tenant activity, decoded path) → open file; bounded by `FILE_CACHE_ENTRIES_MAX`,
    /// emptied when the configuration changes (a docroot may have moved).
    files: HashMap<(ActivityId, String), CachedFile>,
    /// Reused by every request served here: its file-cache key and decoding buffer.
    serve_scratch: ServeScratch,
    /// The send scheduler, when caps are configured; otherwise connections write directly.
    send: Option<SendSched>,
    /// Bytes of file content cached on this core, and per activity.
    cache_used: usize,
    cache_by_activity: HashMap<ActivityId, usize>,
    workers: usize,
    /// Reused read buffer: sockets are read here and only the bytes received are appended to
    /// the connection's buffer (no zeroing of a fresh buffer per read).
    scratch: Box<[u8]>,
}

thread_local! {
    static CORE: RefCell<Option<CoreServer>> = const { RefCell::new(None) };
}

fn with_core<R>(f: impl FnOnce(&mut CoreServer) -> R) -> Option<R> {
    CORE.with(|c| c.borrow_mut().as_mut().map(f))
}

fn key_of(slot: u32, generation: u32) -> u64 {
    u64::from(generation) << 32 | u64::from(slot)
}

/// Why [`Server::update_tenant`] refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpdateError {
    NoTenant(String),
    Refused(String),
}

/// A running server.
pub struct Server {
    rt: Arc<Runtime>,
    reloading: Mutex<()>,
    shared: Arc<ServerShared>,
    boot: StageRef<Boot>,
    work: StageId,
    local_addrs: Vec<SocketAddr>,
}

/// Spins the CPU for about `iters` rounds (fixed work for `/_burn`).
#[inline(never)]
pub fn burn(iters: u64) -> u64 {
    let mut x = std::hint::black_box(0x2545_F491_4F6C_DD1Du64);
    for _ in 0..iters {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    std::hint::black_box(x)
}

fn calibrate_burn() -> f64 {
    let mut v: Vec<f64> = (0..5)
        .map(|_| {
            let n = 1_000_000;
            let t = std::time::Instant::now();
            burn(n);
            n as f64 / t.elapsed().as_secs_f64().max(1e-9) / 1e6
        })
        .collect();
    v.sort_by(|a, b| a.total_cmp(b));
    v[2]
}

fn bind_reuseport(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let domain = socket2::Domain::for_address(addr);
    let s = socket2::Socket::new(domain, socket2::Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    s.set_reuse_port(true)?;
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    s.listen(1024)?;
    Ok(s.into())
}

fn shaper_of(rate_per_s: Option<f64>, kind: ShaperKind) -> Option<ShaperSpec> {
    rate_per_s.map(|r| ShaperSpec {
        kind,
        rate_per_s: r.max(1.0) as u64,
        // A token bucket may burst 10 ms of its rate.
        burst: (r / 100.0).max(1.0) as u64,
    })
}

/// SEDA's p90 controller parameters for a target, scaled for a server that answers up to
/// ~100,000 requests/s: SEDA's rate range (0.05–5,000/s) and additive step (2/s) suit tens of
/// requests per second and would cap a fast tenant or leave it cut for minutes, so the ceiling
/// is 100,000/s, the step 100/s and the floor 10/s (a cut class still sends the controller a
/// sample every 100 ms, so it can recover); the other parameters are SEDA's defaults. The
/// queue is also bounded by Little's law to [`P90_QUEUE_BOUND_FRACTION`] × target × the
/// measured completion rate, so a backlog admitted before the controller reacts cannot hold
/// the response time over the target (docs/design.md, "Overload").
fn p90_params(target: Duration) -> P90Params {
    P90Params {
        target_ns: (target.as_nanos() as u64).max(1),
        rate_max_per_s: P90_RATE_MAX_PER_S,
        rate_min_per_s: P90_RATE_MAX_PER_S / 10_000.0,
        adj_i: P90_RATE_MAX_PER_S / 1000.0,
        queue_bound_fraction: P90_QUEUE_BOUND_FRACTION,
        ..P90Params::default()
    }
}

fn p90_predicate(target: Duration) -> Predicate {
    Predicate::P90 {
        params: p90_params(target),
        initial_rate_per_s: P90_RATE_MAX_PER_S,
        burst: P90_BURST,
    }
}

/// The admission predicate of each of a tenant's activities on the work stage: the tenant's
/// own (requests in no class) first, then one per class in config order. With no class
/// priority, each gets its own p90 controller (the class's target, else the tenant's, else
/// none). When some class has a `priority`, they share one class-based controller
/// ([`ClassGroup`]): one level per distinct priority (0 first), and a bottom level for classes
/// without one and requests in no class (when the tenant has a target).
fn tenant_predicates(t: &crate::config::TenantConfig) -> Result<Vec<Option<Predicate>>, String> {
    let own = t.p90_target;
    if t.classes.iter().all(|c| c.priority.is_none()) {
        return Ok(std::iter::once(own.map(p90_predicate))
            .chain(
                t.classes
                    .iter()
                    .map(|c| c.p90_target.or(own).map(p90_predicate)),
            )
            .collect());
    }
    let mut priorities: Vec<u32> = t.classes.iter().filter_map(|c| c.priority).collect();
    priorities.sort_unstable();
    priorities.dedup();
    let bottom = priorities.len();
    let level_of = |c: &crate::config::ClassConfig| {
        c.priority
            .map(|p| priorities.iter().position(|&x| x == p).expect("listed"))
    };
    let mut targets: Vec<Option<Duration>> = vec![None; bottom + 1];
    for c in &t.classes {
        let (l, target) = match level_of(c) {
            Some(l) => (l, c.p90_target.or(own)),
            None => (bottom, own),
        };
        if let Some(x) = target {
            targets[l] = Some(targets[l].map_or(x, |y| y.min(x)));
        }
    }
    if own.is_some() {
        targets[bottom] = own;
    }
    let levels = if targets[bottom].is_some() {
        bottom + 1
    } else {
        bottom
    };
    let targets_ns: Vec<u64> = targets[..levels]
        .iter()
        .map(|x| {
            (x.expect("config checks every prioritized class has a target")
                .as_nanos() as u64)
                .max(1)
        })
        .collect();
    let params = p90_params(Duration::from_nanos(targets_ns[0]));
    let group = ClassGroup::new(&targets_ns, params, P90_RATE_MAX_PER_S)?;
    let pred = |level: usize| {
        (level < levels).then(|| Predicate::ClassedP90 {
            group: group.clone(),
            level,
            burst: P90_BURST,
        })
    };
    Ok(std::iter::once(pred(bottom))
        .chain(
            t.classes
                .iter()
                .map(|c| pred(level_of(c).unwrap_or(bottom))),
        )
        .collect())
}

/// Creates or updates the activities of `config`'s tenants (and their classes), and their
/// admission targets on the work stage; returns the live state, reusing the runtime record of
/// every tenant that keeps its name.
fn apply_tenants(
    rt: &Runtime,
    config: Config,
    old: Option<&Live>,
    work: StageId,
) -> Result<Live, String> {
    if rt.activity_id("/tenants").is_none() {
        rt.create_activity("/tenants", ActivitySpec::default())
            .map_err(|e| e.to_string())?;
    }
    let upsert = |path: &str, spec: ActivitySpec| -> Result<ActivityId, String> {
        match rt.activity_id(path) {
            Some(id) => {
                rt.set_activity(path, spec).map_err(|e| e.to_string())?;
                Ok(id)
            }
            None => rt.create_activity(path, spec).map_err(|e| e.to_string()),
        }
    };
    let mut out = Vec::with_capacity(config.tenants.len());
    let mut all_classes = Vec::with_capacity(config.tenants.len());
    for t in &config.tenants {
        let path = format!("/tenants/{}", t.name);
        let spec = ActivitySpec {
            weight: t.weight,
            // A shaper sits in each worker's tree, so the machine-wide cap is split evenly
            // between the workers (an activity confined to one worker then gets only its part:
            // a machine-wide bucket shared by the workers is future work).
            cap: shaper_of(
                t.cpu_cap.map(|f| f * 1e9 / rt.workers() as f64),
                cap_kind(t.cap_kind),
            ),
            ..Default::default()
        };
        let activity = upsert(&path, spec)?;
        let mut classes = Vec::with_capacity(t.classes.len());
        for c in &t.classes {
            classes.push(upsert(
                &format!("{path}/{}", c.name),
                ActivitySpec::weight(c.weight),
            )?);
        }
        // Classes a reload dropped: removed if nothing is queued for them (else they drain and
        // stay, unused).
        let prev = old.and_then(|o| {
            let i = o.tenants.iter().position(|x| x.name == t.name)?;
            Some((o.tenants[i].clone(), o.classes[i].clone()))
        });
        if let Some((_, prev_classes)) = &prev {
            for &id in prev_classes {
                if !classes.contains(&id) {
                    if let Some(p) = rt.with_activities(|tab| tab.get(id).map(|a| a.path.clone())) {
                        let _ = rt.remove_activity(&p);
                    }
                }
            }
        }
        let predicates = tenant_predicates(t)?;
        for (&id, predicate) in std::iter::once(&activity).chain(&classes).zip(predicates) {
            rt.set_admission(work, id, predicate)
                .map_err(|e| e.to_string())?;
        }
        match prev {
            Some((o, _)) => out.push(o),
            None => out.push(Arc::new(TenantRuntime {
                name: t.name.clone(),
                activity,
                path,
                open: AtomicUsize::new(0),
                cache_bytes: AtomicU64::new(0),
                disk_bytes: AtomicU64::new(0),
                fleet: Arc::new(FleetHooks::default()),
            })),
        }
        all_classes.push(classes);
    }
    Ok(Live {
        config,
        tenants: out,
        classes: all_classes,
    })
}

impl Server {
    /// Binds the listeners and starts the workers.
    pub fn start(config: Config, opts: ServerOptions) -> Result<Server, String> {
        let workers = opts.workers.or(config.server.workers).unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        });
        // One listening socket per (address, worker) with SO_REUSEPORT, so the kernel spreads
        // connections over the cores; a port 0 is resolved by the first bind.
        let mut per_core: Vec<Vec<TcpListener>> = (0..workers).map(|_| Vec::new()).collect();
        let mut local_addrs = Vec::new();
        for &addr in &config.server.listen {
            let first =
                bind_reuseport(addr).map_err(|e| format!("cannot listen on {addr}: {e}"))?;
            let actual = first.local_addr().map_err(|e| e.to_string())?;
            local_addrs.push(actual);
            per_core[0].push(first);
            for listeners in per_core.iter_mut().skip(1) {
                listeners.push(
                    bind_reuseport(actual)
                        .map_err(|e| format!("cannot listen on {actual}: {e}"))?,
                );
            }
        }
        let log: Option<Mutex<Box<dyn Write + Send>>> = match &config.server.access_log {
            AccessLog::Off => None,
            AccessLog::Stdout => Some(Mutex::new(Box::new(std::io::stdout()))),
            AccessLog::File(p) => Some(Mutex::new(Box::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .map_err(|e| format!("cannot open access log {}: {e}", p.display()))?,
            ))),
        };
        let shared = Arc::new(ServerShared {
            workers,
            disk: std::sync::OnceLock::new(),
            live: RwLock::new(Arc::new(Live {
                config: config.clone(),
                tenants: Vec::new(),
                classes: Vec::new(),
            })),
            live_version: AtomicU64::new(0),
            send_version: AtomicU64::new(0),
            fleet_status: RwLock::new(None),
            stats: ServerStats::default(),
            listeners: Mutex::new(per_core),
            burn_iters_per_us: calibrate_burn(),
            draining: AtomicBool::new(false),
            log,
        });
        let mut b = Runtime::builder()
            .workers(workers)
            .pin(opts.pin)
            .bypass(opts.bypass);
        let stages_cell: Arc<std::sync::OnceLock<Stages>> = Arc::new(std::sync::OnceLock::new());
        let boot = {
            let shared = shared.clone();
            let cell = stages_cell.clone();
            b.stage::<Boot, _, _>("http.boot", StageConfig::default(), move |_core| {
                let shared = shared.clone();
                let cell = cell.clone();
                move |ctx: &mut Ctx<'_>, m: Boot| on_boot(ctx, m, &shared, &cell)
            })
            .map_err(|e| e.to_string())?
        };
        let accept = b
            .stage::<IoEvent, _, _>("http.accept", StageConfig::default(), |_| on_accept)
            .map_err(|e| e.to_string())?;
        let conn = b
            .stage::<IoEvent, _, _>(
                "http.conn",
                StageConfig {
                    batch_max: 4,
                    ..Default::default()
                },
                |_| on_conn,
            )
            .map_err(|e| e.to_string())?;
        let work_cfg = StageConfig {
            batch_max: 4,
            // A connection has at most one request with the work stage at a time, so a
            // tenant's queue never holds more than the server's connections: bounding it lower
            // would turn many well-behaved connections into 503s. Overload control is the
            // tenant's p90 target, not this bound.
            queue_limit: config
                .server
                .connections_max
                .clamp(1, omnistage::exec::QUEUE_LIMIT_MAX),
            ..Default::default()
        };
        let work = b
            .stage::<Work, _, _>("http.work", work_cfg, |_| on_work)
            .map_err(|e| e.to_string())?;
        let timer = b
            .stage::<Tick, _, _>("http.timer", StageConfig::default(), |_| on_tick)
            .map_err(|e| e.to_string())?;
        let send = b
            .stage::<Pump, _, _>("http.send", StageConfig::default(), |_| on_send)
            .map_err(|e| e.to_string())?;
        let disk_stage = b
            .stage::<DiskDone, _, _>("http.disk", StageConfig::default(), |_| on_disk)
            .map_err(|e| e.to_string())?;
        let cont_cfg = StageConfig {
            batch_max: 4,
            // At most one continuation per connection is queued, and connections are bounded
            // far below this: the gate never refuses.
            queue_limit: omnistage::exec::QUEUE_LIMIT_MAX,
            ..Default::default()
        };
        let cont = b
            .stage::<Work, _, _>("http.cont", cont_cfg, |_| on_work)
            .map_err(|e| e.to_string())?;
        let stages = Stages {
            accept,
            conn,
            work,
            timer,
            send,
            disk: disk_stage,
            cont,
        };
        stages_cell.set(stages).map_err(|_| "stages set twice")?;
        let rt = Arc::new(b.start().map_err(|e| e.to_string())?);
        let server_cfg = shared.live.read().expect("live lock").config.server.clone();
        if server_cfg.disk_threads > 0 {
            let pool = disk::DiskPool::start(
                server_cfg.disk_threads,
                server_cfg.disk_cap_bytes_per_s,
                rt.clone(),
                stages,
            );
            let _ = shared.disk.set(pool);
        }
        let live = apply_tenants(&rt, config, None, work.id())?;
        *shared.live.write().expect("live lock") = Arc::new(live);
        for core in 0..workers {
            rt.send(&boot, INFRA, Affinity::Core(core as u16), Boot::Start)
                .map_err(|e| format!("cannot start core {core}: {e}"))?;
        }
        Ok(Server {
            rt,
            reloading: Mutex::new(()),
            shared,
            boot,
            work: work.id(),
            local_addrs,
        })
    }

    /// The addresses actually listened on (port 0 resolved).
    pub fn local_addrs(&self) -> &[SocketAddr] {
        &self.local_addrs
    }

    pub fn runtime(&self) -> &Runtime {
        &self.rt
    }

    pub fn stats(&self) -> &ServerStats {
        &self.shared.stats
    }

    /// Bytes the disk stage read for each tenant, in config order.
    pub fn disk_bytes(&self) -> Vec<(String, u64)> {
        let live = self.shared.live.read().expect("live lock").clone();
        live.tenants
            .iter()
            .map(|t| (t.name.clone(), t.disk_bytes.load(Ordering::Relaxed)))
            .collect()
    }

    /// Bytes of each tenant's files in the cache (all cores), in config order.
    pub fn cache_bytes(&self) -> Vec<(String, u64)> {
        let live = self.shared.live.read().expect("live lock").clone();
        live.tenants
            .iter()
            .map(|t| (t.name.clone(), t.cache_bytes.load(Ordering::Relaxed)))
            .collect()
    }

    /// The running configuration (as last loaded or changed through [`Server::update_tenant`]).
    pub fn config(&self) -> Config {
        self.shared.live.read().expect("live lock").config.clone()
    }

    /// Every tenant of the running configuration with its fleet hooks, in config order.
    pub fn fleet_tenants(&self) -> Vec<FleetTenant> {
        let live = self.shared.live.read().expect("live lock").clone();
        live.config
            .tenants
            .iter()
            .zip(&live.tenants)
            .map(|(t, tr)| FleetTenant {
                name: tr.name.clone(),
                path: tr.path.clone(),
                activity: tr.activity,
                weight: t.weight,
                caps: t.fleet,
                hooks: tr.fleet.clone(),
            })
            .collect()
    }

    /// Sets the weights of tenants' nodes in the send scheduler (`None`: back to the
    /// configured weight), by tenant name; unknown names are skipped. The cores re-weight at
    /// their next dispatch; nothing else changes (no reload, the cache stays).
    pub fn set_send_weights(&self, weights: &[(&str, Option<u32>)]) {
        let live = self.shared.live.read().expect("live lock").clone();
        let mut changed = false;
        for &(name, w) in weights {
            if let Some(tr) = live.tenants.iter().find(|t| t.name == name) {
                changed |= tr.fleet.set_send_weight(w.map(|w| w.clamp(1, 10_000)));
            }
        }
        if changed {
            self.shared.send_version.fetch_add(1, Ordering::Release);
        }
    }

    /// Records what the fleet layer computed (`None`: not in a fleet).
    pub fn set_fleet_status(&self, status: Option<Arc<FleetStatus>>) {
        *self.shared.fleet_status.write().expect("fleet status lock") = status;
    }

    /// What the fleet layer last computed, if this server is a node of a fleet.
    pub fn fleet_status(&self) -> Option<Arc<FleetStatus>> {
        self.shared
            .fleet_status
            .read()
            .expect("fleet status lock")
            .clone()
    }

    /// The stage that answers requests (its gates hold the tenants' admission control).
    pub fn work_stage(&self) -> StageId {
        self.work
    }

    /// Applies a new configuration: tenants' weights and caps, docroots, limits. Listeners are
    /// not changed by a reload (a restart is needed for that); the reply says so if they differ.
    pub fn reload(&self, config: Config) -> Result<(), String> {
        // One reload at a time: each builds on the state the previous one left.
        let _one = self.reloading.lock().expect("reload lock");
        let old = self.shared.live.read().expect("live lock").clone();
        let same_listen = old.config.server.listen == config.server.listen;
        let live = apply_tenants(&self.rt, config, Some(&old), self.work)?;
        *self.shared.live.write().expect("live lock") = Arc::new(live);
        self.shared.live_version.fetch_add(1, Ordering::Release);
        if same_listen {
            Ok(())
        } else {
            Err("reloaded, but listen addresses change only on restart".into())
        }
    }

    /// Changes one tenant's settings in the running configuration (a reload with that change).
    pub fn update_tenant(
        &self,
        name: &str,
        f: impl FnOnce(&mut crate::config::TenantConfig),
    ) -> Result<(), UpdateError> {
        let mut config = self.shared.live.read().expect("live lock").config.clone();
        // What runs may differ from the file: weights and CPU caps changed through the runtime
        // (the admin API) are kept, not reset by this reload.
        let workers = self.rt.workers() as f64;
        for t in &mut config.tenants {
            let path = format!("/tenants/{}", t.name);
            let spec = self.rt.with_activities(|tab| {
                tab.lookup(&path)
                    .and_then(|id| tab.get(id))
                    .map(|a| a.spec.clone())
            });
            if let Some(spec) = spec {
                t.weight = spec.weight;
                t.cpu_cap = spec.cap.map(|c| c.rate_per_s as f64 * workers / 1e9);
                if let Some(c) = spec.cap {
                    t.cap_kind = match c.kind {
                        ShaperKind::Token => CapKind::Token,
                        ShaperKind::Leaky => CapKind::Leaky,
                    };
                }
            }
        }
        let t = config
            .tenants
            .iter_mut()
            .find(|t| t.name == name)
            .ok_or_else(|| UpdateError::NoTenant(format!("no tenant {name}")))?;
        f(t);
        if t.net_cap_bytes_per_s == Some(0) || t.disk_cap_bytes_per_s == Some(0) {
            return Err(UpdateError::Refused(
                "a cap of 0 bytes/s would stop the tenant; remove the cap instead".into(),
            ));
        }
        if t.cache_bytes
            .is_some_and(|b| b > config.server.cache_bytes_max)
        {
            return Err(UpdateError::Refused(format!(
                "cache budget above the server's cache_bytes_max ({})",
                config.server.cache_bytes_max
            )));
        }
        self.reload(config).map_err(UpdateError::Refused)
    }

    /// Stops accepting, lets open connections finish for up to `grace`, writes out the access
    /// log, then stops.
    pub fn drain(self, grace: Duration) {
        self.shared.draining.store(true, Ordering::Release);
        let workers = self.rt.workers();
        for core in 0..workers {
            let _ = self
                .rt
                .send(&self.boot, INFRA, Affinity::Core(core as u16), Boot::Drain);
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline
            && self.shared.stats.open_connections.load(Ordering::Acquire) > 0
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let done = Arc::new(AtomicUsize::new(0));
        let mut asked = 0;
        for core in 0..workers {
            let flush = Boot::FlushLog(done.clone());
            if self
                .rt
                .send(&self.boot, INFRA, Affinity::Core(core as u16), flush)
                .is_ok()
            {
                asked += 1;
            }
        }
        // Bounded wait: a core stuck in a long handler must not hold shutdown forever.
        let deadline = Instant::now() + LOG_FLUSH_WAIT;
        while done.load(Ordering::Acquire) < asked && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        if let Some(pool) = self.shared.disk.get() {
            pool.stop();
        }
        self.rt.shutdown();
        if let Some(log) = &self.shared.log {
            if let Ok(mut w) = log.lock() {
                let _ = w.flush();
            }
        }
    }
}

impl Drop for Server {
    /// A server dropped without `drain` still stops its disk readers and workers.
    fn drop(&mut self) {
        if let Some(pool) = self.shared.disk.get() {
            pool.stop();
        }
        self.rt.shutdown();
    }
}

impl CoreServer {
    /// Picks up a reload: the new config and tenants, and an empty file cache (a docroot may
    /// have changed).
    fn refresh(&mut self) {
        let v = self.shared.live_version.load(Ordering::Acquire);
        if v != self.live_version {
            // Clear under the old tenants, so each one's count goes back down.
            self.cache_clear();
            self.live = self.shared.live.read().expect("live lock").clone();
            self.live_version = v;
            match &mut self.send {
                Some(ss) => ss.configure(&self.live, 0),
                None => self.send = SendSched::for_config(&self.live),
            }
        }
        let sv = self.shared.send_version.load(Ordering::Acquire);
        if sv != self.send_version {
            self.send_version = sv;
            if let Some(ss) = &mut self.send {
                ss.reweight(&self.live);
            }
        }
    }

    /// This core's part of the cache's byte limit.
    fn cache_limit(&self) -> usize {
        (self.live.config.server.cache_bytes_max / self.workers.max(1) as u64) as usize
    }

    /// This core's part of an activity's cache budget: its `cache_bytes`, or else its
    /// weight's share of the limit.
    fn cache_budget(&self, activity: ActivityId) -> usize {
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

    fn cache_account(&mut self, activity: ActivityId, delta: isize) {
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
    fn cache_drop(&mut self, k: &(ActivityId, String)) {
        let freed = self
            .files
            .get_mut(k)
            .and_then(|f| f.content.take())
            .map(|b| b.len());
        if let Some(n) = freed {
            self.cache_account(k.0, -(n as isize));
        }
    }

    /// Forgets every cached file (after a reload, or when the entry table is full).
    fn cache_clear(&mut self) {
        let keys: Vec<_> = self.files.keys().cloned().collect();
        for k in &keys {
            self.cache_drop(k);
        }
        self.files.clear();
    }

    /// Makes room for `need` more bytes of `for_activity` by reclaiming from the activity
    /// furthest above its budget (counting `need` as already `for_activity`'s, so a tenant
    /// that would go over its budget reclaims from itself); false if it cannot.
    fn cache_make_room(&mut self, need: usize, for_activity: ActivityId) -> bool {
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

    fn conn(&mut self, key: u64) -> Option<&mut Conn> {
        let slot = (key & 0xFFFF_FFFF) as usize;
        let generation = (key >> 32) as u32;
        match self.conns.get_mut(slot) {
            Some(Some(c)) if c.generation == generation => Some(c),
            _ => None,
        }
    }

    /// Reserves a connection slot; returns (slot, generation). Fill it or `release` it.
    fn reserve(&mut self) -> (u32, u32) {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                self.conns.push(None);
                self.generations.push(0);
                (self.conns.len() - 1) as u32
            }
        };
        let generation = self.generations[slot as usize].wrapping_add(1);
        self.generations[slot as usize] = generation;
        (slot, generation)
    }

    fn release(&mut self, slot: u32) {
        self.conns[slot as usize] = None;
        self.free.push(slot);
    }

    fn date(&mut self) -> DateText {
        DateText::new(self.date.get(SystemTime::now()))
    }

    fn flush_log(&mut self) {
        if self.log.is_empty() {
            return;
        }
        if let Some(log) = &self.shared.log {
            if let Ok(mut w) = log.lock() {
                let _ = w.write_all(&self.log);
            }
        }
        self.log.clear();
    }
}

fn on_boot(
    ctx: &mut Ctx<'_>,
    m: Boot,
    shared: &Arc<ServerShared>,
    stages: &std::sync::OnceLock<Stages>,
) {
    let stages = *stages.get().expect("stages set before start");
    match m {
        Boot::Start => {
            // The version first: a reload in between is then picked up at the next refresh.
            let live_version = shared.live_version.load(Ordering::Acquire);
            let live = shared.live.read().expect("live lock").clone();
            let core = ctx.core();
            let taken = std::mem::take(&mut shared.listeners.lock().expect("listeners lock")[core]);
            let mut listeners = Vec::new();
            for (i, l) in taken.into_iter().enumerate() {
                // Tenants are bound to listeners by the address as configured (port 0 too).
                let addr = live.config.server.listen[i];
                let mut l = mio::net::TcpListener::from_std(l);
                match ctx.io_register(&mut l, mio::Interest::READABLE, &stages.accept, i as u64) {
                    Ok(h) => listeners.push((l, h, addr)),
                    Err(e) => {
                        eprintln!("omnistage: core {core}: cannot register listener {addr}: {e}")
                    }
                }
            }
            CORE.with(|c| {
                *c.borrow_mut() = Some(CoreServer {
                    shared: shared.clone(),
                    stages,
                    live,
                    live_version,
                    send_version: 0,
                    conns: Vec::new(),
                    free: Vec::new(),
                    generations: Vec::new(),
                    listeners,
                    date: DateCache::new(),
                    log: Vec::with_capacity(LOG_BUFFER_BYTES),
                    limits: Limits::default(),
                    files: HashMap::new(),
                    serve_scratch: ServeScratch::default(),
                    send: SendSched::for_config(&shared.live.read().expect("live lock")),
                    cache_used: 0,
                    cache_by_activity: HashMap::new(),
                    workers: shared.workers,
                    scratch: vec![0u8; READ_CHUNK_BYTES].into_boxed_slice(),
                })
            });
            let _ = ctx.send_after(&stages.timer, LOG_FLUSH_INTERVAL_NS, Tick::LogFlush);
        }
        Boot::Drain => {
            with_core(|cs| {
                for (mut l, h, _) in cs.listeners.drain(..) {
                    let _ = ctx.io_deregister(h, &mut l);
                }
                cs.flush_log();
            });
        }
        Boot::FlushLog(done) => {
            with_core(|cs| cs.flush_log());
            done.fetch_add(1, Ordering::AcqRel);
        }
    }
}

fn on_accept(ctx: &mut Ctx<'_>, ev: IoEvent) {
    with_core(|cs| {
        cs.refresh();
        let idx = ev.user as usize;
        let now = ctx.now_ns();
        for n in 0..=ACCEPTS_PER_EVENT_MAX {
            if n == ACCEPTS_PER_EVENT_MAX {
                // More may be waiting: come back after others had their turn.
                let _ = ctx.send(&cs.stages.accept, ev);
                break;
            }
            let Some((listener, _, local)) = cs.listeners.get(idx) else {
                return;
            };
            let local = *local;
            let (mut stream, peer) = match listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                // WouldBlock: drained. Other errors (EMFILE, ECONNABORTED): try again on the
                // next readiness rather than spin.
                Err(_) => break,
            };
            let shared = cs.shared.clone();
            let stats = &shared.stats;
            // Take a place first, then check, so cores accepting at once cannot overshoot.
            if stats.open_connections.fetch_add(1, Ordering::AcqRel)
                >= cs.live.config.server.connections_max
            {
                // Over the server's limit: refuse at once rather than let it wait unserved.
                stats.open_connections.fetch_sub(1, Ordering::AcqRel);
                stats.refused_connections.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let _ = stream.set_nodelay(true);
            let (slot, generation) = cs.reserve();
            let key = key_of(slot, generation);
            let interest = mio::Interest::READABLE | mio::Interest::WRITABLE;
            let handle = match ctx.io_register(&mut stream, interest, &cs.stages.conn, key) {
                Ok(h) => h,
                Err(_) => {
                    cs.release(slot);
                    stats.open_connections.fetch_sub(1, Ordering::AcqRel);
                    continue;
                }
            };
            stats.accepted.fetch_add(1, Ordering::Relaxed);
            cs.conns[slot as usize] = Some(Conn {
                stream,
                handle,
                peer,
                local,
                generation,
                tenant: None,
                activity: INFRA,
                inbuf: Vec::new(),
                read_stalled: false,
                out: Output::default(),
                body: None,
                send_blocked: false,
                busy: false,
                closing: false,
                request_start_ns: now,
                last_progress_ns: now,
                last_active_ns: now,
                requests: 0,
            });
            let timeout_ns = cs.live.config.server.header_timeout.as_nanos() as u64;
            let _ = ctx.send_after(&cs.stages.timer, timeout_ns, Tick::Deadline { key });
        }
    });
}

/// Closes a connection and forgets it.
fn close(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64) {
    let slot = (key & 0xFFFF_FFFF) as u32;
    if cs.conn(key).is_none() {
        return;
    }
    let Some(mut c) = cs.conns[slot as usize].take() else {
        return;
    };
    let _ = ctx.io_deregister(c.handle, &mut c.stream);
    if let Some(ss) = &mut cs.send {
        ss.forget(key);
    }
    cs.free.push(slot);
    pool::give_buf(std::mem::take(&mut c.inbuf));
    cs.shared
        .stats
        .open_connections
        .fetch_sub(1, Ordering::AcqRel);
    if let Some(t) = c.tenant {
        t.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Reads what the socket holds, up to the input limit. Returns false if the connection closed.
fn read_more(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64) -> bool {
    let limit = cs.limits.header_bytes_max + READ_CHUNK_BYTES;
    let now = ctx.now_ns();
    let CoreServer { conns, scratch, .. } = &mut *cs;
    let Some(c) = conns[(key & 0xFFFF_FFFF) as usize].as_mut() else {
        return false;
    };
    c.read_stalled = false;
    // Bounded: each round either fills the buffer toward `limit`, or ends.
    loop {
        if c.inbuf.len() >= limit {
            // TCP flow control holds the client until a request is taken out.
            c.read_stalled = true;
            return true;
        }
        match c.stream.read(scratch) {
            Ok(0) => {
                close(ctx, cs, key);
                return false;
            }
            Ok(n) => {
                if c.inbuf.is_empty() {
                    c.request_start_ns = now;
                }
                if c.inbuf.capacity() == 0 {
                    c.inbuf = pool::take_buf();
                }
                c.inbuf.extend_from_slice(&scratch[..n]);
                c.last_active_ns = now;
                // A short read means the kernel's queue is empty; new data makes a new edge.
                if n < scratch.len() {
                    return true;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => {
                close(ctx, cs, key);
                return false;
            }
        }
    }
}

/// Asks the work stage to continue this connection later, in its activity.
fn yield_conn(ctx: &mut Ctx<'_>, cs: &CoreServer, key: u64, activity: ActivityId) {
    let opts = SendOpts {
        activity: Some(activity),
        ..Default::default()
    };
    // Refused only past 2^24 queued continuations (far above any connection limit); then the
    // connection's no-progress deadline closes it rather than leaving it stalled.
    let _ = ctx.send_with(&cs.stages.cont, opts, Work::Continue { key });
}

/// Writes what is pending; streams the next chunks of a body under the credit window.
/// Returns false when the connection was closed.
fn flush(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64) -> bool {
    let scheduled = cs.send.is_some();
    let pool = cs.shared.disk.get().cloned();
    let Some(c) = cs.conn(key) else { return false };
    let pending = !c.out.is_empty() || c.body.is_some();
    if scheduled && pending {
        if let Some(tr) = c.tenant.clone() {
            // A tenant's bytes go out when the send scheduler says so (unless it cannot take
            // them: then they are written directly below).
            if c.send_blocked || schedule_send(ctx, cs, key, &tr) {
                return true;
            }
        }
    }
    let Some(c) = cs.conn(key) else { return false };
    let mut chunks = 0;
    let mut file_bytes_left = SENDFILE_BYTES_PER_DISPATCH_MAX;
    loop {
        while !c.out.is_empty() {
            let max = if c.out.front_is_file() {
                if file_bytes_left == 0 {
                    // Yield: the rest of the file goes out in a later dispatch.
                    let activity = c.activity;
                    yield_conn(ctx, cs, key, activity);
                    return true;
                }
                file_bytes_left
            } else {
                usize::MAX
            };
            let front_is_file = max != usize::MAX;
            match c.out.write_to(&mut c.stream, max) {
                Ok(0) => {
                    close(ctx, cs, key);
                    return false;
                }
                Ok(n) => {
                    c.last_progress_ns = ctx.now_ns();
                    if front_is_file {
                        file_bytes_left -= n;
                    }
                    if let Some(t) = &c.tenant {
                        let a = t.activity;
                        ctx.record_bytes_out(a, n as u64);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => {
                    close(ctx, cs, key);
                    return false;
                }
            }
        }
        let Some(body) = &mut c.body else { break };
        if body.remaining == 0 {
            c.body = None;
            break;
        }
        if chunks == FLOW_CHUNKS_PER_DISPATCH {
            // Yield: the rest goes out in a later dispatch of the same activity.
            let activity = c.activity;
            yield_conn(ctx, cs, key, activity);
            return true;
        }
        let n = (body.remaining as usize).min(FLOW_CHUNK_BYTES);
        match &body.source {
            Source::File(file) => {
                if let Some(pool) = &pool {
                    // The disk stage reads it; the bytes come back as a message.
                    if !body.in_flight {
                        let file = file.clone();
                        let (offset, tenant) = (body.offset, c.tenant.clone());
                        let read = ChunkRead {
                            file,
                            offset,
                            len: n,
                            direct: body.direct,
                        };
                        if !submit_read(ctx, cs, pool, key, tenant, read) {
                            close(ctx, cs, key);
                            return false;
                        }
                    }
                    return true;
                }
                let mut chunk = vec![0; n];
                if file.read_exact_at(&mut chunk, body.offset).is_err() {
                    // The file shrank under us: the length already sent cannot be honoured.
                    close(ctx, cs, key);
                    return false;
                }
                c.out.push_owned(chunk);
            }
            Source::Pattern => {
                let mut chunk = Vec::with_capacity(n);
                fill_pattern(&mut chunk, body.offset, n);
                c.out.push_owned(chunk);
            }
        }
        body.offset += n as u64;
        body.remaining -= n as u64;
        chunks += 1;
    }
    if c.closing {
        close(ctx, cs, key);
        return false;
    }
    true
}

/// Appends `n` bytes of the `/_bytes` pattern starting at body offset `offset`.
fn fill_pattern(out: &mut Vec<u8>, offset: u64, n: usize) {
    let mut at = (offset % PATTERN.len() as u64) as usize;
    let mut left = n;
    while left > 0 {
        let k = left.min(PATTERN.len() - at);
        out.extend_from_slice(&PATTERN[at..at + k]);
        left -= k;
        at = 0;
    }
}

/// What `step` did with the connection's input.
enum Step {
    /// Nothing more to do now (waiting for bytes, for the work stage, or for the socket).
    Idle,
    /// Answered a request inline; there may be more.
    Answered,
    /// The connection is gone.
    Closed,
}

/// Parses and dispatches (or answers inline) the pipelined requests the connection holds, at
/// most `pipeline_depth_max` per call; if more remain, continues in a later dispatch of the
/// connection's activity. A loop, not recursion: a flood of pipelined requests costs no stack.
fn drive(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64) {
    let depth_max = cs.live.config.server.pipeline_depth_max.max(1);
    for _ in 0..depth_max {
        match step(ctx, cs, key) {
            Step::Idle | Step::Closed => return,
            Step::Answered => {}
        }
    }
    if let Some(c) = cs.conn(key) {
        if !c.inbuf.is_empty() {
            let activity = c.activity;
            yield_conn(ctx, cs, key, activity);
        }
    }
}

fn step(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64) -> Step {
    let limits = cs.limits;
    let Some(c) = cs.conn(key) else {
        return Step::Closed;
    };
    if c.busy
        || c.closing
        || c.body.is_some()
        || c.out.pending() > OUT_PENDING_BYTES_MAX
        || c.inbuf.is_empty()
    {
        return Step::Idle;
    }
    let (request, consumed) = match request::parse_with(&c.inbuf, &limits, pool::take_buf) {
        ParseOutcome::Partial => return Step::Idle,
        ParseOutcome::Error(e) => {
            pool::give_buf(std::mem::take(&mut c.inbuf));
            c.closing = true;
            let date = cs.date();
            let c = cs.conn(key).expect("live");
            c.out
                .with_head(|b| response::error_response(b, e.status(), false, &date, &[]));
            count_status(&cs.shared.stats, e.status());
            flush(ctx, cs, key);
            return Step::Closed;
        }
        ParseOutcome::Complete { request, consumed } => (request, consumed),
    };
    c.inbuf.drain(..consumed);
    if c.inbuf.is_empty() {
        // Idle until the next request: the buffer goes back to the pool.
        pool::give_buf(std::mem::take(&mut c.inbuf));
    }
    c.requests += 1;
    c.last_active_ns = ctx.now_ns();
    c.last_progress_ns = ctx.now_ns();
    c.request_start_ns = ctx.now_ns();
    let stalled = c.read_stalled;
    let local = c.local;
    if stalled && !read_more(ctx, cs, key) {
        return Step::Closed;
    }
    let keep = request.keep_alive && !cs.shared.draining.load(Ordering::Relaxed);
    let live = cs.live.clone();
    let Some(t) = live.config.tenant_for(request.host(), local) else {
        // No tenant serves this Host here.
        let step = answer_status(ctx, cs, key, &request, 421, keep);
        recycle(request);
        return step;
    };
    let tr = live.tenants[t].clone();
    let limit = live.config.tenants[t].connections_max;
    let c = cs.conn(key).expect("live");
    if !c.tenant.as_ref().is_some_and(|x| Arc::ptr_eq(x, &tr)) {
        if let Some(prev) = c.tenant.take() {
            prev.open.fetch_sub(1, Ordering::AcqRel);
            // Its send leaf hangs under the old tenant's node: start afresh.
            if let Some(ss) = &mut cs.send {
                ss.forget(key);
            }
        }
        let open = tr.open.fetch_add(1, Ordering::AcqRel);
        let c = cs.conn(key).expect("live");
        c.tenant = Some(tr.clone());
        if limit.is_some_and(|l| open >= l) {
            let step = answer_status(ctx, cs, key, &request, 503, false);
            recycle(request);
            return step;
        }
        c.activity = tr.activity;
        // From now on this connection's readiness is the tenant's work.
        let _ = ctx.io_set_activity(c.handle, tr.activity);
    }
    // A class of the tenant, if the request matches one (first match in config order);
    // a prefix is matched against the target as sent.
    let class = live.config.tenants[t]
        .classes
        .iter()
        .position(|c| match &c.selector {
            ClassSelector::Header { name, value } => {
                request.header_bytes(name) == Some(value.as_bytes())
            }
            ClassSelector::Prefix(p) => request.target().starts_with(p.as_str()),
        });
    let activity = class
        .and_then(|i| live.classes[t].get(i).copied())
        .unwrap_or(tr.activity);
    // The tenant's fleet caps: a local lease pool, never a round trip to Redis.
    if !tr.fleet.admit() {
        recycle(request);
        return answer_overload(ctx, cs, key, keep);
    }
    let opts = SendOpts {
        activity: Some(activity),
        ..Default::default()
    };
    match ctx.send_with(&cs.stages.work, opts, Work::Request { key, request }) {
        Ok(()) => {
            cs.conn(key).expect("live").busy = true;
            Step::Idle
        }
        Err(SendError::Rejected(_)) | Err(SendError::MailboxFull) => {
            answer_overload(ctx, cs, key, keep)
        }
        Err(_) => {
            let date = cs.date();
            let c = cs.conn(key).expect("live");
            c.out
                .with_head(|b| response::error_response(b, 500, false, &date, &[]));
            c.closing = true;
            count_status(&cs.shared.stats, 500);
            flush(ctx, cs, key);
            Step::Closed
        }
    }
}

/// Overload (an admission gate or a fleet cap said no): 503 + Retry-After at once, cheaply,
/// in the sender's context.
fn answer_overload(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64, keep: bool) -> Step {
    let date = cs.date();
    let c = cs.conn(key).expect("live");
    c.out.with_head(|b| {
        response::error_response(b, 503, keep, &date, &[("Retry-After", RETRY_AFTER_S)])
    });
    c.closing |= !keep;
    cs.shared.stats.rejected_503.fetch_add(1, Ordering::Relaxed);
    count_status(&cs.shared.stats, 503);
    if flush(ctx, cs, key) {
        Step::Answered
    } else {
        Step::Closed
    }
}

/// Gives a served request's head buffer back to the worker's pool.
fn recycle(request: Request) {
    pool::give_buf(request.into_buf());
}

fn count_status(stats: &ServerStats, status: u16) {
    stats.requests.fetch_add(1, Ordering::Relaxed);
    match status {
        400..=499 => stats.errors_4xx.fetch_add(1, Ordering::Relaxed),
        500..=599 => stats.errors_5xx.fetch_add(1, Ordering::Relaxed),
        _ => 0,
    };
}

fn answer_error(
    ctx: &mut Ctx<'_>,
    cs: &mut CoreServer,
    key: u64,
    req: &Request,
    e: &HttpError,
    keep: bool,
) -> Step {
    let keep = keep && !e.closes_connection();
    let date = cs.date();
    let Some(c) = cs.conn(key) else {
        return Step::Closed;
    };
    let mut extra: Vec<(&str, &str)> = Vec::new();
    if let Some(l) = e.location() {
        extra.push(("Location", l));
    }
    let head_only = req.method == Method::Head;
    c.out.with_head(|b| {
        let body_start = response::error_response(b, e.status(), keep, &date, &extra);
        if head_only {
            b.truncate(body_start);
        }
    });
    c.closing |= !keep;
    finish(ctx, cs, key, req, e.status(), 0)
}

fn answer_status(
    ctx: &mut Ctx<'_>,
    cs: &mut CoreServer,
    key: u64,
    req: &Request,
    status: u16,
    keep: bool,
) -> Step {
    let date = cs.date();
    let Some(c) = cs.conn(key) else {
        return Step::Closed;
    };
    let extra: &[(&str, &str)] = if status == 503 {
        &[("Retry-After", RETRY_AFTER_S)]
    } else {
        &[]
    };
    let head_only = req.method == Method::Head;
    c.out.with_head(|b| {
        let body_start = response::error_response(b, status, keep, &date, extra);
        if head_only {
            b.truncate(body_start);
        }
    });
    c.closing |= !keep;
    if status == 503 {
        cs.shared.stats.rejected_503.fetch_add(1, Ordering::Relaxed);
    }
    finish(ctx, cs, key, req, status, 0)
}

/// Logs the answer, marks the connection free for its next request, and writes.
fn finish(
    ctx: &mut Ctx<'_>,
    cs: &mut CoreServer,
    key: u64,
    req: &Request,
    status: u16,
    bytes: u64,
) -> Step {
    count_status(&cs.shared.stats, status);
    if cs.shared.log.is_some() {
        if let Some(c) = cs.conn(key) {
            let peer = c.peer.ip();
            let tenant = c.tenant.clone();
            let path = tenant.as_ref().map_or("/infra", |t| t.path.as_str());
            crate::log::clf_line(
                &mut cs.log,
                peer,
                SystemTime::now(),
                req.method_raw(),
                req.target(),
                req.version_minor,
                status,
                bytes,
                path,
            );
            if cs.log.len() >= LOG_BUFFER_BYTES {
                cs.flush_log();
            }
        }
    }
    if let Some(c) = cs.conn(key) {
        c.busy = false;
        c.last_active_ns = ctx.now_ns();
    }
    if flush(ctx, cs, key) {
        Step::Answered
    } else {
        Step::Closed
    }
}

fn on_conn(ctx: &mut Ctx<'_>, ev: IoEvent) {
    with_core(|cs| {
        cs.refresh();
        let key = ev.user;
        if cs.conn(key).is_none() {
            return;
        }
        if (ev.readable || ev.closed) && !read_more(ctx, cs, key) {
            return;
        }
        if ev.writable {
            if let Some(c) = cs.conn(key) {
                c.send_blocked = false;
            }
        }
        if flush(ctx, cs, key) {
            drive(ctx, cs, key);
        }
    });
}

fn on_work(ctx: &mut Ctx<'_>, w: Work) {
    with_core(|cs| {
        cs.refresh();
        match w {
            Work::Continue { key } => {
                if flush(ctx, cs, key) {
                    drive(ctx, cs, key);
                }
            }
            Work::Request { key, request } => {
                let Some(c) = cs.conn(key) else { return };
                // Where this response starts: a panic unwinds to here and only this
                // response's bytes are taken back.
                let mark = c.out.mark();
                let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    serve(ctx, cs, key, &request)
                }));
                let step = match served {
                    Ok(step) => step,
                    Err(_) => {
                        cs.shared.stats.panics.fetch_add(1, Ordering::Relaxed);
                        let date = cs.date();
                        match cs.conn(key) {
                            Some(c) => {
                                c.out.rollback(mark);
                                c.body = None;
                                c.closing = true;
                                c.out.with_head(|b| {
                                    response::error_response(b, 500, false, &date, &[])
                                });
                                finish(ctx, cs, key, &request, 500, 0)
                            }
                            None => Step::Closed,
                        }
                    }
                };
                recycle(request);
                if let Step::Answered = step {
                    drive(ctx, cs, key);
                }
            }
        }
    });
}

/// Answers one request in its tenant's activity, with the core's reused buffers.
fn serve(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64, req: &Request) -> Step {
    let mut scratch = std::mem::take(&mut cs.serve_scratch);
    let step = serve_with(ctx, cs, key, req, &mut scratch);
    cs.serve_scratch = scratch;
    step
}

fn serve_with(
    ctx: &mut Ctx<'_>,
    cs: &mut CoreServer,
    key: u64,
    req: &Request,
    scratch: &mut ServeScratch,
) -> Step {
    let keep = req.keep_alive && !cs.shared.draining.load(Ordering::Relaxed);
    if req.method == Method::Other {
        // A body-less unknown method: the stream is still in step, so the connection may stay.
        return answer_status(ctx, cs, key, req, 501, keep);
    }
    let ServeScratch {
        key: cache_key,
        decoded,
    } = scratch;
    let query = match path::decode_target_into(req.target(), &mut cache_key.1, decoded) {
        Ok(q) => q,
        Err(e) => return answer_error(ctx, cs, key, req, &e, keep),
    };
    let Some(tr) = cs.conn(key).and_then(|c| c.tenant.clone()) else {
        return Step::Closed;
    };
    let live = cs.live.clone();
    let Some(tenant) = live.config.tenants.iter().find(|t| t.name == tr.name) else {
        // The tenant was removed by a reload while this request waited.
        return answer_status(ctx, cs, key, req, 421, false);
    };
    if tenant.synthetic {
        if cache_key.1 == "/_panic" {
            // A synthetic fault, to exercise (and test) the panic-to-500 path.
            panic!("synthetic panic requested by /_panic");
        }
        if let Some(s) = synthetic::parse_synthetic(&cache_key.1, query) {
            let date = cs.date();
            let (body_len, source) = match s {
                Err(e) => return answer_error(ctx, cs, key, req, &e, keep),
                Ok(Synthetic::Burn { us }) => {
                    burn((cs.shared.burn_iters_per_us * us as f64) as u64);
                    (BURN_BODY.len() as u64, None)
                }
                Ok(Synthetic::Bytes { n }) => (n, Some(Source::Pattern)),
            };
            let c = cs.conn(key).expect("live");
            let ctype = if source.is_some() {
                "application/octet-stream"
            } else {
                "text/plain; charset=utf-8"
            };
            c.out.with_head(|b| {
                response::write_head(
                    b,
                    200,
                    "OK",
                    &[("Content-Type", ctype)],
                    Some(body_len),
                    keep,
                    &date,
                )
            });
            if req.method != Method::Head {
                match source {
                    None => c.out.with_head(|b| b.extend_from_slice(BURN_BODY)),
                    Some(source) => {
                        // Generated bytes go out through the same credit window as files.
                        c.body = Some(Box::new(Body {
                            source,
                            direct: false,
                            offset: 0,
                            remaining: body_len,
                            in_flight: false,
                        }));
                    }
                }
            }
            c.closing |= !keep;
            return finish(ctx, cs, key, req, 200, body_len);
        }
    }
    let now_ns = ctx.now_ns();
    cache_key.0 = tr.activity;
    let fresh = cs
        .files
        .get(cache_key)
        .is_some_and(|f| f.expires_ns > now_ns);
    if !fresh {
        let resolved = match path::resolve(&tenant.docroot, &cache_key.1, &tenant.index) {
            Ok(r) => r,
            Err(e) => {
                cs.cache_drop(cache_key);
                cs.files.remove(cache_key);
                return answer_error(ctx, cs, key, req, &e, keep);
            }
        };
        let direct = cs.live.config.server.disk_direct && cs.shared.disk.get().is_some();
        let file = match open_file(&resolved.path, direct) {
            Ok(f) => f,
            Err(_) => return answer_error(ctx, cs, key, req, &HttpError::NotFound, keep),
        };
        if cs.files.len() >= FILE_CACHE_ENTRIES_MAX {
            let stale: Vec<_> = cs
                .files
                .iter()
                .filter(|(_, f)| f.expires_ns <= now_ns)
                .map(|(k, _)| k.clone())
                .collect();
            for k in &stale {
                cs.cache_drop(k);
                cs.files.remove(k);
            }
            if cs.files.len() >= FILE_CACHE_ENTRIES_MAX {
                cs.cache_clear();
            }
        }
        // The cached bytes stay valid while the file's length and mtime do.
        let content = match cs.files.get(cache_key) {
            Some(old) if old.len == resolved.len && old.modified == resolved.modified => {
                old.content.clone()
            }
            _ => {
                cs.cache_drop(cache_key);
                None
            }
        };
        let entry = CachedFile {
            file: Arc::new(file),
            len: resolved.len,
            modified: resolved.modified,
            etag: cond::etag(resolved.len, resolved.modified).into(),
            last_modified: cond::last_modified(resolved.modified).into(),
            content_type: crate::mime::content_type(&resolved.path),
            expires_ns: now_ns + FILE_CACHE_TTL_NS,
            content,
            direct,
        };
        cs.files.insert(cache_key.clone(), entry);
    }
    let f = &cs.files[cache_key];
    let (file, flen, modified, direct) = (f.file.clone(), f.len, f.modified, f.direct);
    let mut content = f.content.clone();
    let (etag, last_modified, ctype) = (f.etag.clone(), f.last_modified.clone(), f.content_type);
    let date = cs.date();
    if cond::not_modified(req, &etag, modified) {
        let c = cs.conn(key).expect("live");
        let headers = [("ETag", &*etag), ("Last-Modified", &*last_modified)];
        c.out.with_head(|b| {
            response::write_head(b, 304, "Not Modified", &headers, None, keep, &date)
        });
        c.closing |= !keep;
        return finish(ctx, cs, key, req, 304, 0);
    }
    let range = cond::range_for(req, &etag, modified, flen);
    let (status, start, len) = match range {
        RangeOutcome::Full => (200, 0, flen),
        RangeOutcome::Partial {
            start,
            end_inclusive,
        } => (206, start, end_inclusive - start + 1),
        RangeOutcome::Unsatisfiable => {
            let cr = cond::content_range(&range, flen).unwrap_or_default();
            let c = cs.conn(key).expect("live");
            let head_only = req.method == Method::Head;
            c.out.with_head(|b| {
                let body_start =
                    response::error_response(b, 416, keep, &date, &[("Content-Range", &cr)]);
                if head_only {
                    b.truncate(body_start);
                }
            });
            c.closing |= !keep;
            return finish(ctx, cs, key, req, 416, 0);
        }
    };
    let content_range = cond::content_range(&range, flen);
    let mut headers: [(&str, &str); 5] = [
        ("Content-Type", ctype),
        ("ETag", &etag),
        ("Last-Modified", &last_modified),
        ("Accept-Ranges", "bytes"),
        ("", ""),
    ];
    let mut headers_len = 4;
    if let Some(cr) = &content_range {
        headers[4] = ("Content-Range", cr);
        headers_len = 5;
    }
    let headers = &headers[..headers_len];
    let c = cs.conn(key).expect("live");
    c.out.with_head(|b| {
        response::write_head(
            b,
            status,
            response::status_reason(status),
            headers,
            Some(len),
            keep,
            &date,
        )
    });
    c.closing |= !keep;
    let disk_stage = cs.shared.disk.get().is_some();
    let server = &cs.live.config.server;
    // Large files go from the page cache to the socket with sendfile, and are not kept in
    // memory: the files the worker would read itself (no disk stage, or a file the cache
    // would take). The disk stage keeps the ones it schedules (larger than the cache takes,
    // cache off, or O_DIRECT): their reads are charged to their tenant's disk share there.
    let by_sendfile = server.sendfile
        && !direct
        && flen >= server.sendfile_min_bytes
        && (!disk_stage || (server.cache_bytes_max > 0 && flen <= CACHE_FILE_BYTES_MAX));
    if req.method != Method::Head && len > 0 {
        let cacheable = content.is_none()
            && !by_sendfile
            && server.cache_bytes_max > 0
            && !server.disk_direct
            && flen <= CACHE_FILE_BYTES_MAX;
        if cacheable {
            // A miss: read the whole file once, keep it if the cache makes room.
            let mut all = vec![0; flen as usize];
            if file.read_exact_at(&mut all, 0).is_err() {
                close(ctx, cs, key);
                return Step::Closed;
            }
            let bytes = Bytes::from(all);
            if cs.cache_make_room(bytes.len(), cache_key.0) {
                if let Some(f) = cs.files.get_mut(cache_key) {
                    f.content = Some(bytes.clone());
                    cs.cache_account(cache_key.0, bytes.len() as isize);
                }
            }
            content = Some(bytes);
        }
    }
    let c = cs.conn(key).expect("live");
    if req.method != Method::Head && len > 0 {
        if let Some(content) = content {
            // A hit: the body is a slice of the cached bytes, queued without a copy.
            c.out
                .push_shared(content.slice(start as usize..(start + len) as usize));
        } else if by_sendfile {
            // The open file goes with the segment (an `Arc`), so the descriptor outlives any
            // change to the file cache; a file that shrank closes the connection when sent.
            c.out.push_file(file, start, len as usize);
        } else if len <= INLINE_FILE_BYTES_MAX && !disk_stage {
            let mut body = vec![0; len as usize];
            if file.read_exact_at(&mut body, start).is_err() {
                close(ctx, cs, key);
                return Step::Closed;
            }
            c.out.push_owned(body);
        } else {
            c.body = Some(Box::new(Body {
                source: Source::File(file),
                direct,
                offset: start,
                remaining: len,
                in_flight: false,
            }));
        }
    }
    finish(ctx, cs, key, req, status, len)
}

fn on_tick(ctx: &mut Ctx<'_>, t: Tick) {
    with_core(|cs| {
        cs.refresh();
        match t {
            Tick::LogFlush => {
                cs.flush_log();
                let _ = ctx.send_after(&cs.stages.timer, LOG_FLUSH_INTERVAL_NS, Tick::LogFlush);
            }
            Tick::Deadline { key } => {
                let now = ctx.now_ns();
                let header_ns = cs.live.config.server.header_timeout.as_nanos() as u64;
                let idle_ns = cs.live.config.server.keepalive_timeout.as_nanos() as u64;
                let timer = cs.stages.timer;
                let shared = cs.shared.clone();
                let Some(c) = cs.conn(key) else { return };
                let sending = !c.out.is_empty() || c.body.as_ref().is_some_and(|b| !b.in_flight);
                let deadline = if sending {
                    // Bytes wait for the client: it must keep reading.
                    c.last_progress_ns + idle_ns
                } else if c.busy || c.body.is_some() {
                    // The server is working on it (a queued request, a disk read): look again.
                    now + idle_ns
                } else if !c.inbuf.is_empty() || c.requests == 0 {
                    // Receiving a request head: bounded from its first byte (slowloris).
                    c.request_start_ns + header_ns
                } else {
                    c.last_active_ns + idle_ns
                };
                if now < deadline {
                    let _ = ctx.send_after(&timer, deadline - now, Tick::Deadline { key });
                    return;
                }
                shared.stats.timeouts.fetch_add(1, Ordering::Relaxed);
                if !c.inbuf.is_empty() && !sending {
                    let date = cs.date();
                    let c = cs.conn(key).expect("live");
                    pool::give_buf(std::mem::take(&mut c.inbuf));
                    c.out
                        .with_head(|b| response::error_response(b, 408, false, &date, &[]));
                    c.closing = true;
                    c.last_progress_ns = now;
                    if flush(ctx, cs, key) {
                        // Not all of it went out: if the client never reads, the no-progress
                        // deadline closes the connection.
                        let _ = ctx.send_after(&timer, idle_ns, Tick::Deadline { key });
                    }
                } else {
                    close(ctx, cs, key);
                }
            }
        }
    });
}

/// Makes a connection's pending output a client of the send scheduler, and wakes the pump.
/// False if the scheduler cannot take it (its tenant is gone from the config and it has no
/// leaf yet, or the tree is full): the caller writes directly.
fn schedule_send(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64, tr: &TenantRuntime) -> bool {
    let now = ctx.now_ns();
    let live = cs.live.clone();
    let send_stage = cs.stages.send;
    let remaining = cs.conn(key).map_or(0, remaining_bytes);
    let Some(ss) = cs.send.as_mut() else {
        return false;
    };
    // The order is cached per activity by `configure` (no scan of the tenants per send).
    let order = ss.order_of.get(&tr.activity).copied();
    let leaf = match (order, ss.leaves.get(&key)) {
        // In a tenant with a send order: the tenant's queue leaf, the queue ranks it.
        (Some(order), _) if order != SendOrder::Fair => {
            let l = match ss.queue_leaf.get(&tr.activity) {
                Some(&l) => l,
                None => {
                    let Some(tenant) = live.config.tenants.iter().find(|t| t.name == tr.name)
                    else {
                        return false;
                    };
                    let Some(node) = ss.tenant_node(tr, tenant, now) else {
                        return false;
                    };
                    let Some(l) = ss.queue_leaf(tr.activity, node, order) else {
                        return false;
                    };
                    l
                }
            };
            // After a change of order, its own leaf (not in service here) goes.
            ss.forget_leaf(key);
            ss.enqueue(l, key, remaining);
            l
        }
        // Its tenant left the configuration while it waited in the tenant's queue: it stays.
        (None, None) if ss.queued.contains_key(&key) => return true,
        (_, Some(&l)) => l,
        (_, None) => {
            let Some(tenant) = live.config.tenants.iter().find(|t| t.name == tr.name) else {
                return false;
            };
            let Some(node) = ss.tenant_node(tr, tenant, now) else {
                return false;
            };
            let Ok(l) = ss.tree.add_leaf(node, ClientParams::default()) else {
                return false;
            };
            // After a change of order, it leaves the tenant's queue.
            ss.dequeue(key);
            ss.leaves.insert(key, l);
            ss.conn_of.insert(l, key);
            l
        }
    };
    ss.tree.leaf_ready(leaf, now);
    if !ss.pump_queued {
        let opts = SendOpts {
            activity: Some(INFRA),
            ..Default::default()
        };
        ss.pump_queued = ctx
            .send_with(&send_stage, opts, Pump { timer: false })
            .is_ok();
    }
    true
}

/// Bytes of a connection's output still to send: what is queued plus the rest of its body.
fn remaining_bytes(c: &mut Conn) -> u64 {
    c.out.pending() as u64 + c.body.as_ref().map_or(0, |b| b.remaining)
}

/// What one pick of the send scheduler did with a connection.
struct Sent {
    bytes: usize,
    /// Output still pending.
    more: bool,
    /// The socket said `WouldBlock`.
    blocked: bool,
    /// The connection failed and must be closed.
    failed: bool,
    /// Waiting for the disk stage to bring the next chunk.
    waiting: bool,
}

/// Writes up to one quantum of a connection's pending output (response heads, then body
/// chunks under the credit window).
fn send_some(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64) -> Sent {
    let pool = cs.shared.disk.get().cloned();
    let mut sent = Sent {
        bytes: 0,
        more: false,
        blocked: false,
        failed: false,
        waiting: false,
    };
    let Some(c) = cs.conn(key) else {
        sent.failed = true;
        return sent;
    };
    while sent.bytes < SEND_QUANTUM_BYTES {
        if !c.out.is_empty() {
            match c
                .out
                .write_to(&mut c.stream, SEND_QUANTUM_BYTES - sent.bytes)
            {
                Ok(0) => {
                    sent.failed = true;
                    break;
                }
                Ok(n) => {
                    sent.bytes += n;
                    c.last_progress_ns = ctx.now_ns();
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    sent.blocked = true;
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => {
                    sent.failed = true;
                    break;
                }
            }
            continue;
        }
        let Some(body) = &mut c.body else { break };
        if body.remaining == 0 {
            c.body = None;
            break;
        }
        let n = (body.remaining as usize).min(FLOW_CHUNK_BYTES);
        let mut chunk = Vec::new();
        match &body.source {
            Source::File(file) => {
                if let Some(pool) = &pool {
                    if !body.in_flight {
                        let file = file.clone();
                        let (offset, tenant) = (body.offset, c.tenant.clone());
                        let activity = tenant.as_ref().map(|t| t.activity);
                        let read = ChunkRead {
                            file,
                            offset,
                            len: n,
                            direct: body.direct,
                        };
                        if !submit_read(ctx, cs, pool, key, tenant, read) {
                            sent.failed = true;
                        }
                        if let Some(a) = activity {
                            ctx.record_bytes_out(a, sent.bytes as u64);
                        }
                        sent.waiting = !sent.failed;
                        return sent;
                    }
                    sent.waiting = true;
                    if let Some(a) = c.tenant.as_ref().map(|t| t.activity) {
                        ctx.record_bytes_out(a, sent.bytes as u64);
                    }
                    return sent;
                }
                chunk.resize(n, 0);
                if file.read_exact_at(&mut chunk, body.offset).is_err() {
                    sent.failed = true;
                    break;
                }
            }
            Source::Pattern => fill_pattern(&mut chunk, body.offset, n),
        }
        c.out.push_owned(chunk);
        body.offset += n as u64;
        body.remaining -= n as u64;
    }
    sent.more = !c.out.is_empty() || c.body.is_some();
    if let Some(t) = &c.tenant {
        let a = t.activity;
        ctx.record_bytes_out(a, sent.bytes as u64);
    }
    sent
}

fn on_send(ctx: &mut Ctx<'_>, pump: Pump) {
    with_core(|cs| {
        cs.refresh();
        let now = ctx.now_ns();
        let send_stage = cs.stages.send;
        match cs.send.as_mut() {
            Some(ss) => {
                if pump.timer {
                    ss.pump_timer = false;
                } else {
                    ss.pump_queued = false;
                }
            }
            None => return,
        }
        for _ in 0..SEND_PICKS_PER_DISPATCH {
            let ss = cs.send.as_mut().expect("checked");
            let Some(leaf) = ss.tree.pick(now) else { break };
            // A connection's own leaf (`fair`), or its tenant's ordered queue.
            let (key, ordered) = match ss.conn_of.get(&leaf) {
                Some(&key) => (key, false),
                None => match ss.pop_queued(leaf) {
                    Some(key) => (key, true),
                    None => {
                        ss.tree.charge(leaf, 1, false, now);
                        continue;
                    }
                },
            };
            let sent = send_some(ctx, cs, key);
            let still = sent.more && !sent.blocked && !sent.failed && !sent.waiting;
            let remaining = match cs.conn(key) {
                Some(c) if ordered && still => remaining_bytes(c),
                _ => 0,
            };
            let ss = cs.send.as_mut().expect("checked");
            if ordered {
                if still {
                    ss.enqueue(leaf, key, remaining);
                }
                if let Some(q) = ss.queues.get_mut(&leaf) {
                    q.sent_bytes += sent.bytes as u64;
                }
                let backlogged = ss.queue_live(leaf) > 0;
                ss.tree
                    .charge(leaf, sent.bytes.max(1) as u64, backlogged, now);
            } else {
                ss.tree.charge(leaf, sent.bytes.max(1) as u64, still, now);
            }
            if !sent.more {
                // The response is done: the next one arrives afresh.
                ss.arrivals.remove(&key);
            }
            // The tenant's backlog on the link, for the fleet layer: whether its node (the
            // leaf's parent) still has output waiting on this core after the pick.
            let tenant_waits = ss.tree.parent(leaf).is_some_and(|n| ss.tree.has_work(n));
            if let Some(t) = cs.conn(key).and_then(|c| c.tenant.as_ref()) {
                t.fleet.note_pick(tenant_waits);
            }
            if sent.failed {
                close(ctx, cs, key);
                continue;
            }
            if sent.blocked {
                if let Some(c) = cs.conn(key) {
                    c.send_blocked = true;
                }
                continue;
            }
            if sent.waiting {
                // The disk stage's answer makes the connection ready again.
                continue;
            }
            if !sent.more {
                let Some(c) = cs.conn(key) else { continue };
                if c.closing {
                    close(ctx, cs, key);
                } else {
                    // Output done: its next pipelined request, in its own activity.
                    let activity = c.activity;
                    yield_conn(ctx, cs, key, activity);
                }
            }
        }
        let ss = cs.send.as_mut().expect("checked");
        let opts = SendOpts {
            activity: Some(INFRA),
            ..Default::default()
        };
        match ss.tree.next_decision_ns(now) {
            Some(0) if !ss.pump_queued => {
                ss.pump_queued = ctx
                    .send_with(&send_stage, opts, Pump { timer: false })
                    .is_ok();
            }
            // Shaped: come back when a bucket allows the next write.
            Some(d) if d > 0 && !ss.pump_timer => {
                let opts = SendOpts {
                    delay_ns: d,
                    ..opts
                };
                ss.pump_timer = ctx
                    .send_with(&send_stage, opts, Pump { timer: true })
                    .is_ok();
            }
            _ => {}
        }
    });
}

/// Opens a file to serve; with `direct`, bypassing the page cache (O_DIRECT), falling back to
/// a normal open where the file system refuses it.
fn open_file(path: &std::path::Path, direct: bool) -> std::io::Result<File> {
    if direct {
        use std::os::unix::fs::OpenOptionsExt;
        if let Ok(f) = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            return Ok(f);
        }
    }
    File::open(path)
}

/// One chunk to read.
struct ChunkRead {
    file: Arc<File>,
    offset: u64,
    len: usize,
    /// The descriptor was opened with O_DIRECT.
    direct: bool,
}

/// Hands the read of a body chunk to the disk stage, in the tenant's name.
fn submit_read(
    ctx: &mut Ctx<'_>,
    cs: &mut CoreServer,
    pool: &Arc<disk::DiskPool>,
    key: u64,
    tenant: Option<Arc<TenantRuntime>>,
    read: ChunkRead,
) -> bool {
    let Some(tr) = tenant else { return false };
    let live = cs.live.clone();
    let Some(t) = live.config.tenants.iter().find(|t| t.name == tr.name) else {
        return false;
    };
    let job = disk::DiskJob {
        core: ctx.core() as u16,
        key,
        activity: tr.activity,
        weight: t.weight,
        cap: t.disk_cap_bytes_per_s.map(|r| ShaperSpec {
            kind: cap_kind(t.cap_kind),
            rate_per_s: r,
            burst: (r / 100).max(FLOW_CHUNK_BYTES as u64),
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

/// A disk read came back: queue its bytes (no copy) and go on writing.
fn on_disk(ctx: &mut Ctx<'_>, d: DiskDone) {
    with_core(|cs| {
        cs.refresh();
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A send scheduler with one tenant (activity 7) and its ordered queue's leaf.
    fn sched(order: SendOrder) -> (SendSched, NodeId) {
        let mut ss = SendSched::empty();
        let node = ss
            .tree
            .add_interior(ss.link, ClientParams::default(), PolicyKind::Sfq)
            .unwrap();
        let leaf = ss.queue_leaf(7, node, order).unwrap();
        (ss, leaf)
    }

    /// Pops every live connection, in queue order.
    fn drain(ss: &mut SendSched, leaf: NodeId) -> Vec<u64> {
        std::iter::from_fn(|| ss.pop_queued(leaf)).collect()
    }

    #[test]
    fn ordered_queue_serves_by_order() {
        // Connections 1, 2, 3 arrive in that order with 500, 5, 50 bytes to send.
        let sizes = [(1, 500), (2, 5), (3, 50)];
        for (order, want) in [
            (SendOrder::Fifo, vec![1, 2, 3]),
            (SendOrder::ShortestFirst, vec![2, 3, 1]),
            (SendOrder::LongestFirst, vec![1, 3, 2]),
        ] {
            let (mut ss, leaf) = sched(order);
            for (key, bytes) in sizes {
                assert!(ss.enqueue(leaf, key, bytes));
                assert!(!ss.enqueue(leaf, key, bytes), "queued twice");
            }
            assert_eq!(ss.queue_live(leaf), 3);
            assert_eq!(drain(&mut ss, leaf), want, "{order:?}");
            assert_eq!(ss.queue_live(leaf), 0);
        }
    }

    #[test]
    fn fifo_keeps_a_response_at_the_head_across_quanta() {
        let (mut ss, leaf) = sched(SendOrder::Fifo);
        ss.enqueue(leaf, 1, 100);
        ss.enqueue(leaf, 2, 10);
        // Served one quantum, still pending: it keeps its arrival.
        assert_eq!(ss.pop_queued(leaf), Some(1));
        ss.enqueue(leaf, 1, 90);
        assert_eq!(ss.pop_queued(leaf), Some(1));
        // Blocked on its socket, then back: still first.
        ss.enqueue(leaf, 1, 80);
        assert_eq!(drain(&mut ss, leaf), vec![1, 2]);
    }

    /// Queues one response of `waiting_bytes`, then newcomers of `newcomer_bytes` one at a time,
    /// each served whole, until the waiting one is picked; returns how many overtook it.
    fn overtaken_before_aged(order: SendOrder, waiting_bytes: u64, newcomer_bytes: u64) -> u64 {
        let (mut ss, leaf) = sched(order);
        ss.enqueue(leaf, 1, waiting_bytes);
        let bound =
            SEND_ORDER_AGING_FACTOR * waiting_bytes.abs_diff(newcomer_bytes) / newcomer_bytes + 1;
        let mut key = 2;
        let mut overtaken = 0;
        loop {
            ss.enqueue(leaf, key, newcomer_bytes);
            let next = ss.pop_queued(leaf).unwrap();
            ss.queues.get_mut(&leaf).unwrap().sent_bytes += newcomer_bytes;
            if next == 1 {
                return overtaken;
            }
            ss.arrivals.remove(&next);
            overtaken += 1;
            key += 1;
            assert!(overtaken <= bound, "starved: {overtaken} > {bound}");
        }
    }

    #[test]
    fn shortest_first_ages_a_large_response() {
        // Newcomers of 10 bytes overtake a 1000-byte response until the tenant has sent the
        // aging factor times the size difference after it arrived (the bound is asserted inside).
        let overtaken = overtaken_before_aged(SendOrder::ShortestFirst, 1000, 10);
        assert!(overtaken > 10, "aging too fast: {overtaken}");
    }

    #[test]
    fn longest_first_ages_a_small_response() {
        let overtaken = overtaken_before_aged(SendOrder::LongestFirst, 10, 1000);
        assert!(overtaken > 1, "aging too fast: {overtaken}");
    }

    #[test]
    fn withdrawn_entries_are_compacted() {
        let (mut ss, leaf) = sched(SendOrder::ShortestFirst);
        let n = 1000u64;
        for key in 0..n {
            ss.enqueue(leaf, key, 1 + key);
        }
        // Connections close while queued (all but the 10 largest).
        for key in 0..n - 10 {
            ss.forget(key);
        }
        let q = &ss.queues[&leaf];
        assert_eq!(q.live, 10);
        assert!(
            q.heap.len() <= 2 * q.live + SEND_QUEUE_SLACK + 1,
            "{} entries for {} live",
            q.heap.len(),
            q.live
        );
        assert_eq!(drain(&mut ss, leaf), (n - 10..n).collect::<Vec<_>>());
        // Withdrawing the last one empties the heap.
        ss.enqueue(leaf, 5, 1);
        ss.forget(5);
        assert!(ss.queues[&leaf].heap.is_empty());
        assert!(!ss.arrivals.contains_key(&5));
    }
}
