//! `GET /metrics`: the ledger, the gates, the latency histograms, the stage graph and the
//! workers' loop counters in the OpenMetrics text format (which Prometheus scrapes), encoded
//! by `prometheus-client` from one fresh sample per scrape.
//!
//! Names follow Prometheus conventions (base units, `_total` on counters, `_seconds`,
//! `_bytes`): `omnistage_activity_cpu_seconds_total{activity="/tenants/a"}` and so on.
//! Per-activity counters are each activity's own records (sum a sub-tree with PromQL, e.g.
//! `sum(rate(omnistage_activity_cpu_seconds_total{activity=~"/tenants/a(/.*)?"}[1m]))`).
//! Latency histograms are per (stage, activity) with octave buckets from 128 ns to 137 s.
//! A scrape costs one snapshot (a lock per core, held while its cells are copied) and the
//! encoding; nothing on the workers' path.

use crate::model::Fleet;
use crate::sampler::Sample;
use crate::view::{self, Agg};
use omnistage::account::{HistSnapshot, Histogram, HIST_BUCKETS, RETIRED};
use omnistage::exec::Runtime;
use omnistage_http::server::UpstreamTenantStats;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

/// Content type of the answer.
pub(crate) const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Smallest and largest finite bucket bounds of the exported histograms, as powers of two ns.
const LE_FIRST_EXP: u32 = 7;
const LE_LAST_EXP: u32 = 37;

#[derive(Debug)]
enum Value {
    Counter(f64),
    CounterInt(u64),
    Gauge(f64),
    Histogram {
        sum: f64,
        count: u64,
        buckets: Vec<(f64, u64)>,
    },
}

type Labels = Vec<(&'static str, String)>;

#[derive(Debug)]
struct Family {
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    series: Vec<(Labels, Value)>,
}

#[derive(Debug, Default)]
struct Scrape {
    families: Vec<Family>,
}

impl Scrape {
    fn family(&mut self, name: &'static str, help: &'static str, kind: MetricType) -> &mut Family {
        self.families.push(Family {
            name,
            help,
            kind,
            series: Vec::new(),
        });
        self.families.last_mut().expect("just pushed")
    }
}

impl Collector for Scrape {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for f in &self.families {
            if f.series.is_empty() {
                continue;
            }
            let mut me = encoder.encode_descriptor(f.name, f.help, None, f.kind)?;
            if let [(labels, v)] = &f.series[..] {
                if labels.is_empty() {
                    // A lone series without labels is written `name value`, not
                    // `name{} value`.
                    encode_value(me, v)?;
                    continue;
                }
            }
            for (labels, v) in &f.series {
                encode_value(me.encode_family(labels)?, v)?;
            }
        }
        Ok(())
    }
}

fn encode_value(
    mut fe: prometheus_client::encoding::MetricEncoder<'_>,
    v: &Value,
) -> Result<(), std::fmt::Error> {
    match v {
        Value::Counter(x) => ConstCounter::new(*x).encode(fe),
        Value::CounterInt(x) => ConstCounter::new(*x).encode(fe),
        Value::Gauge(x) => ConstGauge::new(*x).encode(fe),
        Value::Histogram {
            sum,
            count,
            buckets,
        } => fe.encode_histogram::<NoLabelSet>(*sum, *count, buckets, None),
    }
}

/// A histogram in octave buckets (non-cumulative counts per upper bound, seconds; the
/// encoder accumulates them).
fn octaves(h: &HistSnapshot) -> Value {
    let mut buckets: Vec<(f64, u64)> = (LE_FIRST_EXP..=LE_LAST_EXP)
        .map(|e| ((1u64 << e) as f64 / 1e9, 0))
        .collect();
    let mut inf = 0;
    for (i, &c) in h.counts.iter().enumerate().take(HIST_BUCKETS) {
        if c == 0 {
            continue;
        }
        let (_, hi) = Histogram::bounds(i);
        if hi == u64::MAX {
            inf += c;
            continue;
        }
        // The octave whose bound is the first power of two >= hi.
        let e = (64 - (hi - 1).leading_zeros()).max(LE_FIRST_EXP);
        buckets[(e - LE_FIRST_EXP) as usize].1 += c;
    }
    buckets.push((f64::INFINITY, inf));
    Value::Histogram {
        sum: h.sum as f64 / 1e9,
        count: h.count(),
        buckets,
    }
}

fn secs(ns: u64) -> Value {
    Value::Counter(ns as f64 / 1e9)
}

/// The `activity` label of the ledger's aggregate of removed activities
/// ([`RETIRED`](omnistage::account::RETIRED)); never a path (paths start with `/`).
pub(crate) const RETIRED_LABEL: &str = "(retired)";

/// One counter of the HTTP server itself (not of the ledger): name, help, value.
pub(crate) type ServerCounter = (&'static str, &'static str, u64);

/// Sums the aggregates that share a key (the rows of removed activities under `(retired)`),
/// keeping the keys in the order they first appear.
fn merge_by_label<'a, K: std::hash::Hash + Eq + Clone>(
    rows: impl Iterator<Item = (K, &'a Agg)>,
) -> Vec<(K, Agg)> {
    let mut at: std::collections::HashMap<K, usize> = std::collections::HashMap::new();
    let mut out: Vec<(K, Agg)> = Vec::new();
    for (k, agg) in rows {
        match at.get(&k) {
            Some(&i) => out[i].1.add(agg),
            None => {
                at.insert(k.clone(), out.len());
                out.push((k, agg.clone()));
            }
        }
    }
    out
}

/// Encodes one fresh sample of `rt`, the server's upstreams and own counters (`upstreams` and
/// `server` are empty for a bare runtime), and, for a node of a fleet, what its fleet thread
/// last computed.
pub(crate) fn render(
    rt: &Runtime,
    s: &Sample,
    upstreams: &[UpstreamTenantStats],
    server: &[ServerCounter],
    fleet: Option<&Fleet>,
) -> String {
    let (_, acts) = view::activities(rt);
    // What removed activities were charged is kept by the ledger under `RETIRED` (their cells
    // are folded there once they drain): it shows as the activity `(retired)`, and so do the
    // rows of an activity removed but not yet drained, so the sum of a counter over activities
    // never drops. An activity's series ends when it is removed and its counts move into
    // `(retired)` at that scrape: `sum(rate(...))` over activities shows that move once as a
    // rise of `(retired)`'s rate; `rate(sum(...))` does not.
    let path = |a: u32| {
        if a == RETIRED {
            return Some(RETIRED_LABEL.to_string());
        }
        acts.get(&a).map(|i| i.path.clone())
    };
    let label = |a: u32| path(a).unwrap_or_else(|| RETIRED_LABEL.to_string());
    let mut sc = Scrape::default();
    let per_act = view::by_activity(s);
    let alive: Vec<(String, Agg)> = merge_by_label(per_act.iter().map(|(a, agg)| (label(*a), agg)));
    type Pick = fn(&Agg) -> Value;
    let activity_families: [(&'static str, &'static str, MetricType, Pick); 11] = [
        (
            "omnistage_activity_cpu_seconds",
            "CPU time of dispatches charged to the activity (its own records).",
            MetricType::Counter,
            |a| secs(a.c.cpu_ns),
        ),
        (
            "omnistage_activity_dispatches",
            "Handler calls (batches) charged to the activity.",
            MetricType::Counter,
            |a| Value::CounterInt(a.c.dispatches),
        ),
        (
            "omnistage_activity_messages",
            "Messages handled for the activity.",
            MetricType::Counter,
            |a| Value::CounterInt(a.c.messages),
        ),
        (
            "omnistage_activity_queue_wait_seconds",
            "Sum of the queue waits of the activity's messages.",
            MetricType::Counter,
            |a| secs(a.c.queue_wait_ns),
        ),
        (
            "omnistage_activity_panics",
            "Handler panics contained while handling the activity's messages.",
            MetricType::Counter,
            |a| Value::CounterInt(a.c.panics),
        ),
        (
            "omnistage_activity_received_bytes",
            "Bytes received for the activity.",
            MetricType::Counter,
            |a| Value::CounterInt(a.c.bytes_in),
        ),
        (
            "omnistage_activity_sent_bytes",
            "Bytes sent for the activity.",
            MetricType::Counter,
            |a| Value::CounterInt(a.c.bytes_out),
        ),
        (
            "omnistage_activity_disk_read_bytes",
            "Bytes read from disk for the activity.",
            MetricType::Counter,
            |a| Value::CounterInt(a.c.disk_bytes),
        ),
        (
            "omnistage_activity_disk_written_bytes",
            "Bytes written to disk for the activity (reported by shaped programs).",
            MetricType::Counter,
            |a| Value::CounterInt(a.c.disk_write_bytes),
        ),
        (
            "omnistage_activity_rejected_messages",
            "Sends refused at the activity's queues' gates.",
            MetricType::Counter,
            |a| Value::CounterInt(a.c.rejected),
        ),
        (
            "omnistage_activity_queued_messages",
            "Messages of the activity waiting for a dispatch now.",
            MetricType::Gauge,
            |a| Value::Gauge(a.queued as f64),
        ),
    ];
    for (name, help, kind, pick) in &activity_families {
        let f = sc.family(name, help, *kind);
        for (p, agg) in &alive {
            f.series.push((vec![("activity", p.clone())], pick(agg)));
        }
    }
    {
        let f = sc.family(
            "omnistage_activity_weight",
            "The activity's weight among its siblings.",
            MetricType::Gauge,
        );
        for a in acts.values() {
            f.series.push((
                vec![("activity", a.path.clone())],
                Value::Gauge(f64::from(a.spec.weight)),
            ));
        }
    }

    let per_sa = view::by_stage_activity(s);
    let stage_name = |id: u32| {
        rt.stage_name(id)
            .map(str::to_string)
            .unwrap_or_else(|| format!("#{id}"))
    };
    // Rows of activities removed but not yet drained go with the stage's `(retired)` row.
    let per_sa_merged: Vec<((u32, String), Agg)> =
        merge_by_label(per_sa.iter().map(|(&(st, a), agg)| ((st, label(a)), agg)));
    let sa: Vec<(Labels, &Agg)> = per_sa_merged
        .iter()
        .map(|((st, l), agg)| {
            (
                vec![("stage", stage_name(*st)), ("activity", l.clone())],
                agg,
            )
        })
        .collect();
    let stage_families: [(&'static str, &'static str, MetricType, Pick); 6] = [
        (
            "omnistage_stage_cpu_seconds",
            "CPU time of the stage's dispatches for the activity.",
            MetricType::Counter,
            |a| secs(a.c.cpu_ns),
        ),
        (
            "omnistage_stage_messages",
            "Messages the stage handled for the activity.",
            MetricType::Counter,
            |a| Value::CounterInt(a.c.messages),
        ),
        (
            "omnistage_stage_queued_messages",
            "Messages in the (stage, activity) queue now.",
            MetricType::Gauge,
            |a| Value::Gauge(a.queued as f64),
        ),
        (
            "omnistage_stage_delayed_messages",
            "Messages for the (stage, activity) queue waiting on timers now.",
            MetricType::Gauge,
            |a| Value::Gauge(a.delayed as f64),
        ),
        (
            "omnistage_stage_rejected_messages",
            "Sends refused at the (stage, activity) gate.",
            MetricType::Counter,
            |a| Value::CounterInt(a.c.rejected),
        ),
        (
            "omnistage_stage_queue_wait_seconds",
            "Queue wait per message.",
            MetricType::Histogram,
            |a| octaves(&a.wait),
        ),
    ];
    for (name, help, kind, pick) in &stage_families {
        let f = sc.family(name, help, *kind);
        for (labels, agg) in &sa {
            if matches!(kind, MetricType::Histogram) && agg.wait.count() == 0 {
                continue;
            }
            f.series.push((labels.clone(), pick(agg)));
        }
    }
    {
        let f = sc.family(
            "omnistage_stage_response_seconds",
            "Response time per message: enqueue to the end of its dispatch.",
            MetricType::Histogram,
        );
        for (labels, agg) in &sa {
            if agg.resp.count() > 0 {
                f.series.push((labels.clone(), octaves(&agg.resp)));
            }
        }
    }
    {
        let f = sc.family(
            "omnistage_stage_admission_rate",
            "Admissions per second the (stage, activity) gate's token bucket allows now.",
            MetricType::Gauge,
        );
        for q in &s.queues {
            if let (Some(r), Some(p)) = (q.rate_per_s, path(q.activity)) {
                f.series.push((
                    vec![("stage", stage_name(q.stage)), ("activity", p)],
                    Value::Gauge(r),
                ));
            }
        }
    }
    {
        let f = sc.family(
            "omnistage_stage_batch_size",
            "Messages the stage takes per dispatch on the core now.",
            MetricType::Gauge,
        );
        for st in 0..rt.stage_count() as u32 {
            for core in 0..rt.workers() {
                if let Some(b) = rt.batch_size(st, core) {
                    f.series.push((
                        vec![("stage", stage_name(st)), ("core", core.to_string())],
                        Value::Gauge(f64::from(b)),
                    ));
                }
            }
        }
    }
    {
        let f = sc.family(
            "omnistage_edge_messages",
            "Messages sent along an edge of the stage graph (from a stage, io or external).",
            MetricType::Counter,
        );
        for e in &s.edges {
            let from = match e.from {
                omnistage::account::EdgeFrom::Stage(x) => stage_name(x),
                omnistage::account::EdgeFrom::Io => "io".into(),
                omnistage::account::EdgeFrom::External => "external".into(),
            };
            f.series.push((
                vec![("from", from), ("to", stage_name(e.to))],
                Value::CounterInt(e.messages),
            ));
        }
    }
    {
        let f = sc.family(
            "omnistage_stage_panics",
            "Panics reported by the process's panic hook, by the stage (or named thread, e.g. admin) that panicked; each was contained and answered.",
            MetricType::Counter,
        );
        let counts = omnistage::exec::panic::panic_counts();
        // Every stage of this runtime, zero or not, then any other thread that panicked.
        let mut shown = Vec::new();
        for st in 0..rt.stage_count() as u32 {
            let name = stage_name(st);
            let n = counts.iter().find(|(s, _)| *s == name).map_or(0, |c| c.1);
            f.series
                .push((vec![("stage", name.clone())], Value::CounterInt(n)));
            shown.push(name);
        }
        for (name, n) in counts {
            if n > 0 && !shown.iter().any(|s| s == name) {
                f.series
                    .push((vec![("stage", name.to_string())], Value::CounterInt(n)));
            }
        }
    }
    type CorePick = fn(&omnistage::account::CoreRow) -> Value;
    let core_families: [(&'static str, &'static str, CorePick); 6] = [
        (
            "omnistage_worker_idle_seconds",
            "Time the worker was blocked waiting for work.",
            |c| secs(c.idle_ns),
        ),
        (
            "omnistage_worker_infra_seconds",
            "The loop's own work (mailboxes, timers, decisions), charged to /infra.",
            |c| secs(c.infra_ns),
        ),
        (
            "omnistage_worker_wake_seconds",
            "Part of infra: the kernel's work around sleeps (CPU in the wait, run-queue wait after waking), by the OS's clocks.",
            |c| secs(c.wake_ns),
        ),
        (
            "omnistage_worker_dispatch_seconds",
            "Time in dispatches (charged to activities).",
            |c| secs(c.dispatch_ns),
        ),
        (
            "omnistage_worker_os_cpu_seconds",
            "The worker thread's CPU time as the OS counts it.",
            |c| secs(c.os_cpu_ns),
        ),
        (
            "omnistage_worker_unattributed_seconds",
            "OS busy time minus charged time (negative: charged time the OS did not see).",
            |c| Value::Gauge(c.unattributed_ns() as f64 / 1e9),
        ),
    ];
    for (name, help, pick) in &core_families {
        let kind = if name.ends_with("unattributed_seconds") {
            MetricType::Gauge
        } else {
            MetricType::Counter
        };
        let f = sc.family(name, help, kind);
        for c in &s.snap.cores {
            f.series.push((vec![("core", c.core.to_string())], pick(c)));
        }
    }
    // The stretches in which a worker's loop could pick no other queue (issue 14's figure:
    // the victim's tail is bounded below by the longest of them).
    for (name, help, pick) in [
        (
            // Not `omnistage_worker_dispatch_seconds`: that is the counter of all dispatch time
            // above, and a name may be declared once.
            "omnistage_worker_dispatch_stretch_seconds",
            "How long each dispatch held the worker's loop.",
            (|r: &omnistage::account::StretchRow| r.dispatch) as fn(&_) -> HistSnapshot,
        ),
        (
            "omnistage_worker_io_round_seconds",
            "How long each I/O round (epoll_wait calls and classifying their ready lists) held the worker's loop.",
            |r: &omnistage::account::StretchRow| r.io_round,
        ),
    ] {
        let f = sc.family(name, help, MetricType::Histogram);
        for r in &s.stretches {
            f.series
                .push((vec![("core", r.core.to_string())], octaves(&pick(r))));
        }
    }
    type UpPick = fn(&UpstreamTenantStats) -> Value;
    let upstream_families: [(&'static str, &'static str, MetricType, UpPick); 9] = [
        (
            "omnistage_upstream_in_flight",
            "Proxied requests of the tenant holding one of the upstream's slots now.",
            MetricType::Gauge,
            |u| Value::Gauge(u.in_flight as f64),
        ),
        (
            "omnistage_upstream_queued",
            "Proxied requests of the tenant waiting for one of the upstream's slots now.",
            MetricType::Gauge,
            |u| Value::Gauge(u.queued as f64),
        ),
        (
            "omnistage_upstream_refused",
            "Proxied requests of the tenant refused (503) for a full or too slow queue.",
            MetricType::Counter,
            |u| Value::CounterInt(u.refused),
        ),
        (
            "omnistage_upstream_requests",
            "Proxied requests of the tenant that got a slot.",
            MetricType::Counter,
            |u| Value::CounterInt(u.requests),
        ),
        (
            "omnistage_upstream_slot_seconds",
            "Time the tenant's requests held the upstream's slots.",
            MetricType::Counter,
            |u| secs(u.slot_ns),
        ),
        (
            "omnistage_upstream_sent_bytes",
            "Bytes sent to the upstream's servers for the tenant.",
            MetricType::Counter,
            |u| Value::CounterInt(u.bytes_to_backend),
        ),
        (
            "omnistage_upstream_received_bytes",
            "Bytes received from the upstream's servers for the tenant.",
            MetricType::Counter,
            |u| Value::CounterInt(u.bytes_from_backend),
        ),
        (
            "omnistage_upstream_bad_gateway",
            "Proxied requests answered 502 (unreachable, invalid response).",
            MetricType::Counter,
            |u| Value::CounterInt(u.errors_502),
        ),
        (
            "omnistage_upstream_gateway_timeout",
            "Proxied requests answered 504 (no response head in time).",
            MetricType::Counter,
            |u| Value::CounterInt(u.errors_504),
        ),
    ];
    for (name, help, kind, pick) in &upstream_families {
        let f = sc.family(name, help, *kind);
        for u in upstreams {
            let labels = vec![
                ("upstream", u.upstream.clone()),
                ("activity", format!("/tenants/{}", u.tenant)),
            ];
            f.series.push((labels, pick(u)));
        }
    }
    for &(name, help, v) in server {
        sc.family(name, help, MetricType::Counter)
            .series
            .push((Vec::new(), Value::CounterInt(v)));
    }
    if let Some(fl) = fleet {
        fleet_families(&mut sc, fl);
    }
    let mut registry = Registry::default();
    registry.register_collector(Box::new(sc));
    let mut out = String::with_capacity(64 * 1024);
    prometheus_client::encoding::text::encode(&mut out, &registry)
        .expect("writing to a String cannot fail");
    out
}

/// A fleet node's figures (docs/fleet.md has the federation queries over them).
fn fleet_families(sc: &mut Scrape, fl: &Fleet) {
    let node = || vec![("node", fl.node.clone())];
    let one: [(&'static str, &'static str, MetricType, Value); 6] = [
        (
            "omnistage_fleet_connected",
            "1 when the node's last sync reached Redis, 0 in a fallback episode.",
            MetricType::Gauge,
            Value::Gauge(if fl.connected { 1.0 } else { 0.0 }),
        ),
        (
            "omnistage_fleet_fallback_episodes",
            "Episodes of Redis being unreachable (local weights and cap / nodes meanwhile).",
            MetricType::Counter,
            Value::CounterInt(fl.episodes),
        ),
        (
            "omnistage_fleet_garbage_entries",
            "Bad entries, lines and keys read from Redis, ignored.",
            MetricType::Counter,
            Value::CounterInt(fl.garbage),
        ),
        (
            "omnistage_fleet_syncs",
            "Syncs with Redis that succeeded.",
            MetricType::Counter,
            Value::CounterInt(fl.syncs),
        ),
        (
            "omnistage_fleet_restarts",
            "Panics of the fleet thread caught and recovered from (configured weights back).",
            MetricType::Counter,
            Value::CounterInt(fl.restarts),
        ),
        (
            "omnistage_fleet_nodes_seen",
            "Nodes whose entries the last good sync read (this one included).",
            MetricType::Gauge,
            Value::Gauge(fl.nodes_seen as f64),
        ),
    ];
    for (name, help, kind, v) in one {
        sc.family(name, help, kind).series.push((node(), v));
    }
    type Pick = fn(&crate::model::FleetTenant) -> f64;
    let per: [(&'static str, &'static str, &'static str, Pick); 8] = [
        (
            "omnistage_fleet_share_target",
            "The tenant's fleet-wide share target this node computed (0..=1).",
            "cpu",
            |t| t.cpu_share_target,
        ),
        ("omnistage_fleet_share_target", "", "link", |t| {
            t.link_share_target
        }),
        (
            "omnistage_fleet_used_per_second",
            "Fleet-wide use the nodes reported: CPU seconds/s, link bytes/s.",
            "cpu",
            |t| t.cpu_fleet_used_ns_per_s as f64 / 1e9,
        ),
        ("omnistage_fleet_used_per_second", "", "link", |t| {
            t.link_fleet_used_bytes_per_s as f64
        }),
        (
            "omnistage_fleet_local_weight",
            "The local weight this node set from the fleet's water-fill.",
            "cpu",
            |t| f64::from(t.cpu_weight),
        ),
        ("omnistage_fleet_local_weight", "", "link", |t| {
            f64::from(t.link_weight)
        }),
        (
            "omnistage_fleet_lease_tokens",
            "Tokens of the tenant's fleet caps this node holds (negative: a debt).",
            "requests",
            |t| t.lease_requests as f64,
        ),
        ("omnistage_fleet_lease_tokens", "", "bytes", |t| {
            t.lease_bytes as f64
        }),
    ];
    for (name, help, res, pick) in per {
        // Two resources share a family: the first row of each name opens it.
        if !help.is_empty() {
            sc.family(name, help, MetricType::Gauge);
        }
        let f = sc.families.last_mut().expect("opened");
        let label = if name == "omnistage_fleet_lease_tokens" {
            "cap"
        } else {
            "resource"
        };
        for t in &fl.tenants {
            f.series.push((
                vec![
                    ("node", fl.node.clone()),
                    ("activity", format!("/tenants/{}", t.name)),
                    (label, res.to_string()),
                ],
                Value::Gauge(pick(t)),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_under_one_label_are_summed_once_in_first_seen_order() {
        let agg = |messages: u64| {
            let mut a = Agg::default();
            a.c.messages = messages;
            a
        };
        let rows = [
            ("/a".to_string(), agg(1)),
            (RETIRED_LABEL.to_string(), agg(10)),
            ("/b".to_string(), agg(2)),
            (RETIRED_LABEL.to_string(), agg(20)),
        ];
        let merged = merge_by_label(rows.iter().map(|(l, a)| (l.clone(), a)));
        let got: Vec<(&str, u64)> = merged
            .iter()
            .map(|(l, a)| (l.as_str(), a.c.messages))
            .collect();
        assert_eq!(got, [("/a", 1), (RETIRED_LABEL, 30), ("/b", 2)]);
    }

    #[test]
    fn octave_buckets_keep_every_count() {
        let h = Histogram::default();
        for v in [0u64, 100, 128, 129, 1_000_000, 1 << 40] {
            h.record(v);
        }
        let Value::Histogram { count, buckets, .. } = octaves(&h.snapshot()) else {
            panic!("a histogram")
        };
        assert_eq!(count, 6);
        assert_eq!(buckets.iter().map(|b| b.1).sum::<u64>(), 6);
        // 0 and 100 are below 128 ns; 128 and 129 share the bucket [128, 192), counted
        // under le = 256 ns (a value exactly on a power of two lands one octave up).
        assert_eq!(buckets[0], (128e-9, 2));
        assert_eq!(buckets[1], (256e-9, 2));
        assert_eq!(buckets.last().unwrap(), &(f64::INFINITY, 1));
        // Bounds strictly increase.
        assert!(buckets.windows(2).all(|w| w[0].0 < w[1].0));
    }

    #[test]
    fn a_fleet_node_exports_its_figures_per_tenant() {
        let fl = Fleet {
            node: "n1".into(),
            connected: false,
            episodes: 2,
            garbage: 3,
            syncs: 40,
            restarts: 1,
            nodes_seen: 3,
            tenants: vec![crate::model::FleetTenant {
                name: "a".into(),
                cpu_share_target: 0.25,
                link_share_target: 0.5,
                cpu_fleet_used_ns_per_s: 1_500_000_000,
                link_fleet_used_bytes_per_s: 9_000_000,
                cpu_weight: 10_000,
                link_weight: 100,
                lease_requests: 7,
                lease_bytes: -20,
            }],
        };
        let mut sc = Scrape::default();
        fleet_families(&mut sc, &fl);
        let mut registry = Registry::default();
        registry.register_collector(Box::new(sc));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        for line in [
            "omnistage_fleet_connected{node=\"n1\"} 0",
            "omnistage_fleet_fallback_episodes_total{node=\"n1\"} 2",
            "omnistage_fleet_garbage_entries_total{node=\"n1\"} 3",
            "omnistage_fleet_nodes_seen{node=\"n1\"} 3",
            "omnistage_fleet_restarts_total{node=\"n1\"} 1",
            "omnistage_fleet_share_target{node=\"n1\",activity=\"/tenants/a\",resource=\"cpu\"} 0.25",
            "omnistage_fleet_share_target{node=\"n1\",activity=\"/tenants/a\",resource=\"link\"} 0.5",
            "omnistage_fleet_used_per_second{node=\"n1\",activity=\"/tenants/a\",resource=\"cpu\"} 1.5",
            "omnistage_fleet_local_weight{node=\"n1\",activity=\"/tenants/a\",resource=\"link\"} 100",
            "omnistage_fleet_lease_tokens{node=\"n1\",activity=\"/tenants/a\",cap=\"bytes\"} -20",
        ] {
            assert!(out.contains(line), "{line} not in\n{out}");
        }
        // Each family is declared once.
        assert_eq!(
            out.matches("# TYPE omnistage_fleet_share_target ").count(),
            1
        );
    }
}
