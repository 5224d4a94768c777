//! The JSON documents of the admin API, as Rust types: the server serializes them and the
//! command line (`omnistage top`, `tree`, `set`, `graph`) deserializes them.
//!
//! Units are in the field names: `_ns` nanoseconds, `_s` seconds, `bytes_*` bytes; rates are
//! per second over the sampler's last complete interval (`interval_s`, about one second) and
//! are `null` until two samples exist, and while the last one is stale ([`SamplerStatus`]).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Counters of the ledger (summed over stages and cores) plus the gates' rejections.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Counters {
    /// CPU time of dispatches, ns.
    pub cpu_ns: u64,
    /// Handler calls (one per batch).
    pub dispatches: u64,
    /// Messages handled.
    pub messages: u64,
    /// Sum of queue waits, ns.
    pub queue_wait_ns: u64,
    /// Handler panics contained.
    pub panics: u64,
    /// Bytes received (recorded by receive stages).
    pub bytes_in: u64,
    /// Bytes sent (recorded by send stages).
    pub bytes_out: u64,
    /// Bytes read from disk.
    pub disk_bytes: u64,
    /// Bytes written to disk (reported by shaped programs; the HTTP server writes none).
    #[serde(default)]
    pub disk_write_bytes: u64,
    /// Sends refused at the gates.
    pub rejected: u64,
}

/// The same counters as rates, per second.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Rates {
    pub cpu_ns: f64,
    pub dispatches: f64,
    pub messages: f64,
    pub queue_wait_ns: f64,
    pub panics: f64,
    pub bytes_in: f64,
    pub bytes_out: f64,
    pub disk_bytes: f64,
    #[serde(default)]
    pub disk_write_bytes: f64,
    pub rejected: f64,
}

/// Percentiles of a latency histogram (`null` when nothing was recorded).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    /// Messages recorded.
    pub count: u64,
    pub p50: Option<u64>,
    pub p90: Option<u64>,
    pub p99: Option<u64>,
}

/// Queue wait (enqueue to dispatch start) and response time (enqueue to dispatch end) per
/// message, ns.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    pub queue_ns: Percentiles,
    pub response_ns: Percentiles,
}

/// A CPU cap (a shaper on the activity's node, per core).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cap {
    /// `token` or `leaky`.
    pub kind: String,
    /// The cap in cores for the whole machine (CPU seconds per second), as a change gives it
    /// and as the config file's `cpu_cap` is: `rate_per_s` × workers / 1e9.
    pub cores: f64,
    /// CPU ns per second that each worker's tree allows (the cap split evenly between the
    /// workers: an activity served on fewer workers than all gets only their parts).
    pub rate_per_s: u64,
    /// Bucket depth, CPU ns.
    pub burst: u64,
}

/// One node of the activity tree.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Node {
    pub id: u32,
    pub path: String,
    pub name: String,
    pub weight: u32,
    /// Policy over its children.
    pub policy: String,
    pub priority: u8,
    pub cap: Option<Cap>,
    /// Messages waiting for a dispatch now, this node and its sub-tree.
    pub queued: u64,
    /// Messages waiting for their time on timers now (held against queue bounds too).
    pub delayed: u64,
    /// Its sub-tree's part of all charged CPU over the last interval.
    pub share: Option<f64>,
    /// What its weight entitles it to over the last interval: its parent's target split by
    /// weight among the siblings that used CPU, water-filled (a sibling using less than its
    /// portion keeps what it used and leaves the rest to the others).
    pub target_share: Option<f64>,
    /// CPU over the last interval, percent of one core (sub-tree).
    pub cpu_percent: Option<f64>,
    /// Since start, this node and its sub-tree.
    pub total: Counters,
    /// Since start, this node's own records.
    pub own: Counters,
    /// Over the last interval, sub-tree.
    pub rate: Option<Rates>,
    /// Since start, sub-tree.
    pub latency: Latency,
    /// Over the last interval, sub-tree.
    pub latency_1s: Option<Latency>,
    /// Bytes of its files in the HTTP server's cache (tenants of an HTTP server only).
    #[serde(default)]
    pub cache_bytes: Option<u64>,
    /// A shaped group attached here from outside (`omnistage shape --admin`): its rates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shaped: Option<Shaped>,
    pub children: Vec<Node>,
}

/// One worker's loop counters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Core {
    pub core: u32,
    pub elapsed_ns: u64,
    pub idle_ns: u64,
    pub infra_ns: u64,
    pub dispatch_ns: u64,
    pub os_cpu_ns: u64,
    /// OS busy time minus charged time (see `account::CoreRow::unattributed_ns`).
    pub unattributed_ns: i64,
}

/// `GET /api/v1/tree`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tree {
    /// Version of the activity table (bumped on every accepted change).
    pub version: u64,
    /// Seconds since the runtime started.
    pub uptime_s: f64,
    pub workers: usize,
    /// Length of the interval the rates cover, s.
    pub interval_s: Option<f64>,
    /// All charged CPU over the last interval, ns/s.
    pub cpu_ns_per_s: Option<f64>,
    pub root: Node,
    pub cores: Vec<Core>,
    /// The fleet this node belongs to (`[cluster]`), as its fleet thread last saw it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet: Option<Fleet>,
    #[serde(flatten)]
    pub sampler: SamplerStatus,
    #[serde(flatten, default)]
    pub truncation: Truncation,
}

/// Whether a listing was cut at the admin API's bound on entries (`LIST_ENTRIES_MAX`, 10,000:
/// tree nodes, `/stages`' per-activity rows, graph edges): `omitted` entries were left out
/// (a tree's in depth-first path order, its totals still counting them).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Truncation {
    #[serde(default)]
    pub truncated: bool,
    #[serde(default)]
    pub omitted: u64,
}

/// How current the rates are: the sampler's last sample and its failures. Rates (and
/// `interval_s`) are `null` while the last sample is stale: older than two intervals, and at
/// least a second.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplerStatus {
    /// Seconds since the sampler's last sample (`null` before the first).
    #[serde(default)]
    pub sample_age_s: Option<f64>,
    /// Samples that failed (a panic while sampling) since start; each is also counted in
    /// `/metrics` (`omnistage_admin_sampler_failures`).
    #[serde(default)]
    pub sampler_failures: u64,
}

/// A node of a fleet (crate `omnistage-fleet`): what it last computed, as the server keeps it.
pub use omnistage_http::server::{FleetStatus as Fleet, FleetTenantStatus as FleetTenant};

/// The admission predicate of a queue.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Admission {
    /// `threshold`, `token` or `p90`.
    pub predicate: String,
    /// The bucket's rate now (token, p90), admissions/s.
    pub rate_per_s: Option<f64>,
    pub burst: Option<u32>,
    /// The p90 response-time target, ms.
    pub target_ms: Option<f64>,
}

/// One (stage, activity) queue.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageActivity {
    /// The activity's path (a removed activity's rows are left out; its work stays in the
    /// stage's totals).
    pub activity: String,
    pub id: u32,
    pub queued: u64,
    pub delayed: u64,
    pub total: Counters,
    pub rate: Option<Rates>,
    pub latency: Latency,
    pub latency_1s: Option<Latency>,
    pub admission: Option<Admission>,
}

/// One stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stage {
    pub id: u32,
    pub name: String,
    /// Largest batch per dispatch (`null` for the loop's pseudo-stage).
    pub batch_max: Option<u32>,
    /// The batch each core takes now (moves for adaptive stages).
    pub batch_now: Vec<u32>,
    pub adaptive_batch: bool,
    pub queue_limit: Option<usize>,
    /// Weight of the stage's leaves beside an activity's other children.
    pub weight: Option<u32>,
    /// The stage's default predicate.
    pub admission: Option<Admission>,
    pub queued: u64,
    pub delayed: u64,
    pub total: Counters,
    pub rate: Option<Rates>,
    pub latency: Latency,
    pub latency_1s: Option<Latency>,
    pub activities: Vec<StageActivity>,
}

/// `GET /api/v1/stages`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stages {
    pub interval_s: Option<f64>,
    pub stages: Vec<Stage>,
    #[serde(flatten)]
    pub sampler: SamplerStatus,
    #[serde(flatten, default)]
    pub truncation: Truncation,
}

/// A node of the stage graph.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GraphNode {
    pub name: String,
    /// `stage`, `io` (readiness turned into messages) or `external` (sends from outside).
    pub kind: String,
    pub id: Option<u32>,
}

/// An edge of the stage graph: messages sent from one stage (or source) to another.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GraphEdge {
    pub from: String,
    pub to: String,
    /// Since start.
    pub messages: u64,
    /// Over the last interval.
    pub per_s: Option<f64>,
}

/// `GET /api/v1/graph`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Graph {
    pub interval_s: Option<f64>,
    pub nodes: Vec<GraphNode>,
    pub edges: Vec<GraphEdge>,
    #[serde(flatten, default)]
    pub truncation: Truncation,
}

/// One sample of the share history.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HistoryPoint {
    /// Seconds since the runtime started.
    pub t_s: f64,
    /// Share of charged CPU by activity path (sub-trees).
    pub shares: BTreeMap<String, f64>,
    pub targets: BTreeMap<String, f64>,
    /// p90 response time over the interval, ns, by activity path (sub-trees).
    pub p90_response_ns: BTreeMap<String, u64>,
}

/// `GET /api/v1/history`: the last minutes of shares, one point per sampler interval.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct History {
    pub interval_s: f64,
    pub points: Vec<HistoryPoint>,
    #[serde(flatten)]
    pub sampler: SamplerStatus,
}

/// A CPU cap as a change gives it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapChange {
    /// Cores (CPU seconds per second) for the whole machine, > 0: split evenly between the
    /// workers, each of whose trees holds its part (as the config file's `cpu_cap`).
    pub cores: f64,
    /// `token` (default) or `leaky`.
    #[serde(default)]
    pub kind: Option<String>,
    /// Bucket depth in ms of the rate (token only; default 10).
    #[serde(default)]
    pub burst_ms: Option<f64>,
}

/// An admission change for one (stage, this activity) queue.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdmissionChange {
    /// Stage name.
    pub stage: String,
    /// `threshold`, `token`, `p90`, or `inherit` (back to the stage's).
    pub predicate: String,
    #[serde(default)]
    pub rate_per_s: Option<f64>,
    #[serde(default)]
    pub burst: Option<u32>,
    /// p90 target, ms.
    #[serde(default)]
    pub target_ms: Option<f64>,
}

fn present<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

/// Body of `PUT /api/v1/activities/{path}`: fields left out keep their value (or take the
/// default when the activity is created).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActivityChange {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
    /// `fifo`, `rr`, `priority`, `wfq`, `sfq`, `drr`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u8>,
    /// A CPU cap; `null` removes it.
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    pub cap: Option<Option<CapChange>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<AdmissionChange>,
    /// Network send cap of an HTTP server's tenant: bytes/s as a number or a string with units
    /// ("10MB/s"), `null` removes it (501 without an HTTP server).
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    pub cap_net: Option<serde_json::Value>,
    /// Disk read cap of an HTTP server's tenant (as `cap_net`).
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    pub cap_disk: Option<serde_json::Value>,
    /// Cache budget of an HTTP server's tenant, bytes (as `cap_net`, without "/s").
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    pub budget: Option<serde_json::Value>,
    /// Send order of an HTTP server's tenant: `fair`, `fifo`, `shortest_first` or
    /// `longest_first` (501 without an HTTP server).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub send_order: Option<String>,
}

/// Body of `POST /api/v1/activities/{path}:attach`: a shaped group (`omnistage shape --admin
/// ADDR --activity PATH`) joins the activity tree with the rates it was started with. An
/// activity already attached keeps the rates it has (a change made with `omnistage set` wins).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShapedAttach {
    /// Network rate, bytes/s (a number or a string like "10MB/s"); `null` or absent: none.
    #[serde(default)]
    pub cap_net: serde_json::Value,
    /// Disk rate (as `cap_net`).
    #[serde(default)]
    pub cap_disk: serde_json::Value,
}

/// Body of `POST /api/v1/activities/{path}:report`: bytes a shaped group moved since its last
/// report (each at most [`SHAPED_REPORT_BYTES_MAX`]). The answer is the group's rates now.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShapedReport {
    #[serde(default)]
    pub bytes_in: u64,
    #[serde(default)]
    pub bytes_out: u64,
    #[serde(default)]
    pub disk_read_bytes: u64,
    #[serde(default)]
    pub disk_write_bytes: u64,
}

/// Most bytes of one kind in one report: a reporter sends every quarter of a second, and no
/// program moves a TiB in that; a larger figure is a bug or an attack on the counters.
pub const SHAPED_REPORT_BYTES_MAX: u64 = 1 << 40;

/// Most shaped groups attached at once: a bound on the table a client can grow. An entry goes
/// when its activity is removed.
pub const SHAPED_GROUPS_MAX: usize = 1024;

/// A shaped group attached to an activity: the answer to `:attach` and `:report`, and a
/// node's `shaped` in the tree.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Shaped {
    pub path: String,
    /// Network rate, bytes/s (`null`: none).
    pub cap_net: Option<u64>,
    /// Disk rate, bytes/s (`null`: none).
    pub cap_disk: Option<u64>,
    /// Reports received since it was attached.
    pub reports: u64,
    /// Seconds since the last report (or the attach).
    pub last_report_age_s: f64,
}

/// Body of `POST /api/v1/activities/{path}:move`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoveRequest {
    /// The new parent (moves the sub-tree).
    #[serde(default)]
    pub to: Option<String>,
    /// Moving connections is refused with 501: connections belong to the HTTP server.
    #[serde(default)]
    pub connections_to: Option<String>,
}

/// Reply to a change.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Changed {
    pub path: String,
    pub id: u32,
    /// `created`, `changed`, `moved` or `removed`.
    pub action: String,
    /// Version of the activity table after the change.
    pub version: u64,
}

/// Body of every 4xx/5xx answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub status: u16,
    pub error: String,
}
