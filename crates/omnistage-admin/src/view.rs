//! Builds the API's documents (`model`) from what the runtime measured: aggregation of the
//! ledger's (activity, stage, core) rows, roll-up through the activity tree, rates over the
//! sampler's window, percentiles from the latency histograms, water-filled target shares,
//! and the stage graph (JSON and Graphviz dot).

use crate::model::{self, Admission, Counters, Latency, Percentiles, Rates};
use crate::sampler::{Sample, Window};
use omnistage::account::{ActivityId, EdgeFrom, HistSnapshot, StageId};
use omnistage::activity::{ActivitySpec, DEPTH_MAX, ROOT};
use omnistage::exec::{Predicate, Runtime};
use omnistage::sched::ShaperKind;
use std::collections::{BTreeMap, BTreeSet};

/// Activities kept per point of the share history (the largest shares).
pub(crate) const HISTORY_ACTIVITIES_MAX: usize = 32;

/// Counters, histograms and queue length of one activity, stage or (stage, activity).
#[derive(Clone, Debug, Default)]
pub(crate) struct Agg {
    pub(crate) c: Counters,
    pub(crate) wait: HistSnapshot,
    pub(crate) resp: HistSnapshot,
    pub(crate) queued: u64,
    pub(crate) delayed: u64,
}

impl Agg {
    /// Sums wrap, as the ledger's cells do (a counter fed by `:report` can reach 2^64), so no
    /// sum panics; an interval in which one wrapped reads as 0 ([`Agg::since`] saturates).
    pub(crate) fn add(&mut self, o: &Agg) {
        let (a, b) = (&mut self.c, &o.c);
        a.cpu_ns = a.cpu_ns.wrapping_add(b.cpu_ns);
        a.dispatches = a.dispatches.wrapping_add(b.dispatches);
        a.messages = a.messages.wrapping_add(b.messages);
        a.queue_wait_ns = a.queue_wait_ns.wrapping_add(b.queue_wait_ns);
        a.panics = a.panics.wrapping_add(b.panics);
        a.bytes_in = a.bytes_in.wrapping_add(b.bytes_in);
        a.bytes_out = a.bytes_out.wrapping_add(b.bytes_out);
        a.disk_bytes = a.disk_bytes.wrapping_add(b.disk_bytes);
        a.disk_write_bytes = a.disk_write_bytes.wrapping_add(b.disk_write_bytes);
        a.rejected = a.rejected.wrapping_add(b.rejected);
        self.wait.add(&o.wait);
        self.resp.add(&o.resp);
        self.queued = self.queued.wrapping_add(o.queued);
        self.delayed = self.delayed.wrapping_add(o.delayed);
    }

    /// What happened between `earlier` and `self` (queue lengths stay `self`'s: levels).
    fn since(&self, earlier: &Agg) -> Agg {
        let (a, b) = (&self.c, &earlier.c);
        Agg {
            c: Counters {
                cpu_ns: a.cpu_ns.saturating_sub(b.cpu_ns),
                dispatches: a.dispatches.saturating_sub(b.dispatches),
                messages: a.messages.saturating_sub(b.messages),
                queue_wait_ns: a.queue_wait_ns.saturating_sub(b.queue_wait_ns),
                panics: a.panics.saturating_sub(b.panics),
                bytes_in: a.bytes_in.saturating_sub(b.bytes_in),
                bytes_out: a.bytes_out.saturating_sub(b.bytes_out),
                disk_bytes: a.disk_bytes.saturating_sub(b.disk_bytes),
                disk_write_bytes: a.disk_write_bytes.saturating_sub(b.disk_write_bytes),
                rejected: a.rejected.saturating_sub(b.rejected),
            },
            wait: self.wait.since(&earlier.wait),
            resp: self.resp.since(&earlier.resp),
            queued: self.queued,
            delayed: self.delayed,
        }
    }

    fn rates(&self, dt_s: f64) -> Rates {
        let c = &self.c;
        let r = |v: u64| v as f64 / dt_s;
        Rates {
            cpu_ns: r(c.cpu_ns),
            dispatches: r(c.dispatches),
            messages: r(c.messages),
            queue_wait_ns: r(c.queue_wait_ns),
            panics: r(c.panics),
            bytes_in: r(c.bytes_in),
            bytes_out: r(c.bytes_out),
            disk_bytes: r(c.disk_bytes),
            disk_write_bytes: r(c.disk_write_bytes),
            rejected: r(c.rejected),
        }
    }

    fn latency(&self) -> Latency {
        Latency {
            queue_ns: percentiles(&self.wait),
            response_ns: percentiles(&self.resp),
        }
    }
}

pub(crate) fn percentiles(h: &HistSnapshot) -> Percentiles {
    Percentiles {
        count: h.count(),
        p50: h.percentile(0.5),
        p90: h.percentile(0.9),
        p99: h.percentile(0.99),
    }
}

/// Per (stage, activity): the ledger's rows summed over cores, the histograms, the gate's
/// queued count and rejections.
pub(crate) fn by_stage_activity(s: &Sample) -> BTreeMap<(StageId, ActivityId), Agg> {
    let mut m: BTreeMap<(StageId, ActivityId), Agg> = BTreeMap::new();
    for r in &s.snap.rows {
        let a = m.entry((r.stage, r.activity)).or_default();
        a.c.cpu_ns = a.c.cpu_ns.wrapping_add(r.cpu_ns);
        a.c.dispatches = a.c.dispatches.wrapping_add(r.dispatches);
        a.c.messages = a.c.messages.wrapping_add(r.messages);
        a.c.queue_wait_ns = a.c.queue_wait_ns.wrapping_add(r.queue_wait_ns);
        a.c.panics = a.c.panics.wrapping_add(r.panics);
        a.c.bytes_in = a.c.bytes_in.wrapping_add(r.bytes_in);
        a.c.bytes_out = a.c.bytes_out.wrapping_add(r.bytes_out);
        a.c.disk_bytes = a.c.disk_bytes.wrapping_add(r.disk_bytes);
        a.c.disk_write_bytes = a.c.disk_write_bytes.wrapping_add(r.disk_write_bytes);
    }
    for l in &s.lat {
        let a = m.entry((l.stage, l.activity)).or_default();
        a.wait.add(&l.wait);
        a.resp.add(&l.response);
    }
    for q in &s.queues {
        let a = m.entry((q.stage, q.activity)).or_default();
        a.queued = a.queued.wrapping_add(q.queued as u64);
        a.delayed = a.delayed.wrapping_add(q.delayed as u64);
        a.c.rejected = a.c.rejected.wrapping_add(q.rejected);
    }
    m
}

/// Per activity (its own records, all stages).
pub(crate) fn by_activity(s: &Sample) -> BTreeMap<ActivityId, Agg> {
    let mut m: BTreeMap<ActivityId, Agg> = BTreeMap::new();
    for ((_, a), agg) in by_stage_activity(s) {
        m.entry(a).or_default().add(&agg);
    }
    m
}

/// Per stage (all activities).
fn by_stage(m: &BTreeMap<(StageId, ActivityId), Agg>) -> BTreeMap<StageId, Agg> {
    let mut out: BTreeMap<StageId, Agg> = BTreeMap::new();
    for (&(s, _), agg) in m {
        out.entry(s).or_default().add(agg);
    }
    out
}

/// What the tree needs of one activity, copied out of the table's lock.
#[derive(Clone, Debug)]
pub(crate) struct ActInfo {
    pub(crate) id: ActivityId,
    pub(crate) path: String,
    pub(crate) spec: ActivitySpec,
    pub(crate) children: Vec<ActivityId>,
}

pub(crate) fn activities(rt: &Runtime) -> (u64, BTreeMap<ActivityId, ActInfo>) {
    rt.with_activities(|t| {
        let m = t
            .iter()
            .map(|a| {
                (
                    a.id,
                    ActInfo {
                        id: a.id,
                        path: a.path.clone(),
                        spec: a.spec.clone(),
                        children: a.children.clone(),
                    },
                )
            })
            .collect();
        (t.version(), m)
    })
}

/// The cap as the API gives it: machine-wide cores (each of `workers` trees holds an even part,
/// `rate_per_s`), as `cap_spec` takes them and as the config file's `cpu_cap` is.
fn cap_of(spec: &ActivitySpec, workers: usize) -> Option<model::Cap> {
    spec.cap.map(|c| model::Cap {
        kind: match c.kind {
            ShaperKind::Token => "token".into(),
            ShaperKind::Leaky => "leaky".into(),
        },
        cores: c.rate_per_s as f64 * workers as f64 / 1e9,
        rate_per_s: c.rate_per_s,
        burst: c.burst,
    })
}

fn name_of(path: &str) -> String {
    match path.rfind('/') {
        Some(i) if path != "/" => path[i + 1..].to_string(),
        _ => "/".to_string(),
    }
}

/// Node building state: fresh totals and, with a window, interval aggregates.
struct Build<'a> {
    acts: &'a BTreeMap<ActivityId, ActInfo>,
    workers: usize,
    now: BTreeMap<ActivityId, Agg>,
    interval: Option<(BTreeMap<ActivityId, Agg>, f64)>,
}

impl Build<'_> {
    /// The node of `id` with its sub-tree; returns it with its rolled-up totals and interval.
    fn node(&self, id: ActivityId, depth: usize) -> (model::Node, Agg, Option<Agg>) {
        assert!(
            depth <= DEPTH_MAX + 1,
            "activity tree deeper than the limit"
        );
        let info = &self.acts[&id];
        let own = self.now.get(&id).cloned().unwrap_or_default();
        let mut total = own.clone();
        let mut interval = self
            .interval
            .as_ref()
            .map(|(m, _)| m.get(&id).cloned().unwrap_or_default());
        let mut kids: Vec<&ActInfo> = info
            .children
            .iter()
            .filter_map(|c| self.acts.get(c))
            .collect();
        kids.sort_by(|a, b| a.path.cmp(&b.path));
        let mut children = Vec::with_capacity(kids.len());
        for k in kids {
            let (n, t, i) = self.node(k.id, depth + 1);
            total.add(&t);
            if let (Some(acc), Some(i)) = (interval.as_mut(), i.as_ref()) {
                acc.add(i);
            }
            children.push(n);
        }
        let dt = self.interval.as_ref().map(|(_, dt)| *dt);
        let node = model::Node {
            id,
            path: info.path.clone(),
            name: name_of(&info.path),
            weight: info.spec.weight,
            policy: info.spec.policy.name().into(),
            priority: info.spec.priority,
            cap: cap_of(&info.spec, self.workers),
            queued: total.queued,
            delayed: total.delayed,
            share: None,
            target_share: None,
            cpu_percent: interval
                .as_ref()
                .zip(dt)
                .map(|(i, dt)| i.c.cpu_ns as f64 / dt / 1e7),
            total: total.c.clone(),
            own: own.c.clone(),
            rate: interval.as_ref().zip(dt).map(|(i, dt)| i.rates(dt)),
            latency: total.latency(),
            latency_1s: interval.as_ref().map(|i| i.latency()),
            cache_bytes: None,
            shaped: None,
            children,
        };
        (node, total, interval)
    }
}

/// A sibling using less than this fraction of its portion, and refusing nothing, is taken as
/// wanting no more than it uses.
pub(crate) const SATED_FRACTION: f64 = 0.5;

/// What one sibling claims of its parent's target.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Claim {
    pub(crate) weight: u32,
    /// What it used over the interval (fraction of all charged CPU).
    pub(crate) usage: f64,
    /// It had messages waiting for a dispatch, or had sends refused.
    pub(crate) backlogged: bool,
    /// Most its cap allows (fraction of all charged CPU); infinite without a cap.
    pub(crate) ceiling: f64,
}

/// Splits `avail` among siblings by weight, water-filled: a sibling whose cap is below its
/// portion gets its cap; a sibling that is not backlogged and used less than
/// [`SATED_FRACTION`] of its portion keeps what it used; the rest is split again among the
/// others, until nobody is fixed in a round. Siblings that used nothing (and are not
/// backlogged) get 0.
///
/// Whether a sibling wants more than it gets cannot be measured from usage alone; the caller
/// marks it backlogged when it had messages waiting for a dispatch at the sample (timers not
/// counted) or had sends refused. A sibling with neither, between half and all of its
/// portion, is shown owed its whole portion: a possible false alarm in that band rather than
/// a hidden shortfall below it.
pub(crate) fn water_fill(avail: f64, items: &[Claim]) -> Vec<f64> {
    let mut target = vec![0.0; items.len()];
    let mut open: Vec<usize> = (0..items.len())
        .filter(|&i| items[i].usage > 0.0 || items[i].backlogged)
        .collect();
    let mut remaining = avail.max(0.0);
    // Each round fixes at least one sibling or ends: at most n rounds.
    for _ in 0..=items.len() {
        let wsum: f64 = open.iter().map(|&i| f64::from(items[i].weight)).sum();
        if open.is_empty() || wsum <= 0.0 {
            break;
        }
        let unit = remaining / wsum;
        let mut fixed = false;
        let mut hungry = Vec::with_capacity(open.len());
        for &i in &open {
            let c = &items[i];
            let portion = f64::from(c.weight) * unit;
            let keep = if c.ceiling < portion {
                Some(c.ceiling.min(remaining))
            } else if !c.backlogged && c.usage < SATED_FRACTION * portion {
                Some(c.usage.min(remaining))
            } else {
                None
            };
            match keep {
                Some(t) => {
                    target[i] = t;
                    fixed = true;
                }
                None => hungry.push(i),
            }
        }
        if !fixed {
            for &i in &hungry {
                target[i] = f64::from(items[i].weight) * unit;
            }
            break;
        }
        let kept: f64 = open
            .iter()
            .filter(|i| !hungry.contains(i))
            .map(|&i| target[i])
            .sum();
        remaining = (remaining - kept).max(0.0);
        open = hungry;
    }
    target
}

/// Sets `share` and `target_share` top-down (needs rates). `workers` turns a per-core cap
/// into a machine-wide ceiling.
fn shares(
    node: &mut model::Node,
    total_ns_per_s: f64,
    target: f64,
    workers: usize,
    backlogged: &dyn Fn(&model::Node) -> bool,
) {
    let usage = |n: &model::Node| {
        n.rate
            .as_ref()
            .map(|r| r.cpu_ns / total_ns_per_s)
            .unwrap_or(0.0)
    };
    node.share = Some(usage(node));
    node.target_share = Some(target);
    if node.children.is_empty() {
        return;
    }
    // The node's own work (its stage queues) competes with its children; it keeps what it
    // used and the children split the rest.
    let kids_usage: f64 = node.children.iter().map(usage).sum();
    let own_usage = (usage(node) - kids_usage).max(0.0);
    let items: Vec<Claim> = node
        .children
        .iter()
        .map(|c| Claim {
            weight: c.weight,
            usage: usage(c),
            backlogged: backlogged(c),
            ceiling: c
                .cap
                .as_ref()
                .map(|cap| cap.rate_per_s as f64 * workers as f64 / total_ns_per_s)
                .unwrap_or(f64::INFINITY),
        })
        .collect();
    let targets = water_fill((target - own_usage).max(0.0), &items);
    for (c, t) in node.children.iter_mut().zip(targets) {
        shares(c, total_ns_per_s, t, workers, backlogged);
    }
}

/// `GET /api/v1/tree`.
pub(crate) fn tree(rt: &Runtime, fresh: &Sample, win: Option<&Window>) -> model::Tree {
    let (version, acts) = activities(rt);
    let b = Build {
        acts: &acts,
        workers: rt.workers(),
        now: by_activity(fresh),
        interval: win.map(|w| {
            let last = by_activity(&w.last);
            let prev = by_activity(&w.prev);
            let d = last
                .iter()
                .map(|(a, agg)| {
                    (
                        *a,
                        match prev.get(a) {
                            Some(p) => agg.since(p),
                            None => agg.clone(),
                        },
                    )
                })
                .collect();
            (d, w.dt_s())
        }),
    };
    let (mut root, _, _) = b.node(ROOT, 0);
    let cpu_ns_per_s = root.rate.as_ref().map(|r| r.cpu_ns);
    if let Some(total) = cpu_ns_per_s {
        if total > 0.0 {
            let backlogged =
                |n: &model::Node| n.queued > 0 || n.rate.as_ref().is_some_and(|r| r.rejected > 0.0);
            shares(&mut root, total, 1.0, rt.workers(), &backlogged);
        }
    }
    model::Tree {
        truncation: Default::default(),
        fleet: None,
        sampler: Default::default(),
        version,
        uptime_s: rt.now_ns() as f64 / 1e9,
        workers: rt.workers(),
        interval_s: win.map(|w| w.dt_s()),
        cpu_ns_per_s,
        root,
        cores: fresh
            .snap
            .cores
            .iter()
            .map(|c| model::Core {
                core: c.core,
                elapsed_ns: c.elapsed_ns,
                idle_ns: c.idle_ns,
                infra_ns: c.infra_ns,
                dispatch_ns: c.dispatch_ns,
                os_cpu_ns: c.os_cpu_ns,
                unattributed_ns: c.unattributed_ns(),
            })
            .collect(),
    }
}

/// Finds the node of `path` in a tree.
pub(crate) fn find<'a>(n: &'a model::Node, path: &str) -> Option<&'a model::Node> {
    if n.path == path {
        return Some(n);
    }
    n.children.iter().find_map(|c| {
        let under = c.path == path || path.starts_with(&format!("{}/", c.path));
        if under {
            find(c, path)
        } else {
            None
        }
    })
}

pub(crate) fn admission_of(
    rt: &Runtime,
    stage: StageId,
    activity: Option<ActivityId>,
) -> Option<Admission> {
    let p = match activity {
        Some(a) => rt.admission(stage, a)?,
        None => rt.stage_config(stage)?.predicate.clone(),
    };
    let rate_now = activity.and_then(|a| rt.admission_rate(stage, a));
    Some(match p {
        Predicate::Threshold => Admission {
            predicate: "threshold".into(),
            rate_per_s: None,
            burst: None,
            target_ms: None,
        },
        Predicate::TokenBucket { rate_per_s, burst } => Admission {
            predicate: "token".into(),
            rate_per_s: Some(rate_now.unwrap_or(rate_per_s)),
            burst: Some(burst),
            target_ms: None,
        },
        Predicate::P90 {
            params,
            initial_rate_per_s,
            burst,
        } => Admission {
            predicate: "p90".into(),
            rate_per_s: Some(rate_now.unwrap_or(initial_rate_per_s)),
            burst: Some(burst),
            target_ms: Some(params.target_ns as f64 / 1e6),
        },
        Predicate::ClassedP90 {
            group,
            level,
            burst,
        } => Admission {
            predicate: format!("p90-class {level}"),
            rate_per_s: Some(rate_now.unwrap_or_else(|| group.rate_per_s(level))),
            burst: Some(burst),
            target_ms: Some(group.target_ns(level) as f64 / 1e6),
        },
    })
}

fn stage_label(rt: &Runtime, id: StageId) -> String {
    rt.stage_name(id)
        .map(str::to_string)
        .unwrap_or_else(|| format!("#{id}"))
}

/// `GET /api/v1/stages`.
pub(crate) fn stages(rt: &Runtime, fresh: &Sample, win: Option<&Window>) -> model::Stages {
    let (_, acts) = activities(rt);
    let now = by_stage_activity(fresh);
    let interval = win.map(|w| {
        let last = by_stage_activity(&w.last);
        let prev = by_stage_activity(&w.prev);
        let d: BTreeMap<(StageId, ActivityId), Agg> = last
            .iter()
            .map(|(k, agg)| {
                (
                    *k,
                    match prev.get(k) {
                        Some(p) => agg.since(p),
                        None => agg.clone(),
                    },
                )
            })
            .collect();
        (d, w.dt_s())
    });
    let now_by_stage = by_stage(&now);
    // A stage's interval figures are the difference of its totals, not the sum of its rows'
    // differences: a removed activity's rows are folded into the retired aggregate between two
    // samples (every total kept), which row by row would count its whole life as new work.
    let int_by_stage = win.map(|w| {
        let (last, prev) = (
            by_stage(&by_stage_activity(&w.last)),
            by_stage(&by_stage_activity(&w.prev)),
        );
        let d: BTreeMap<StageId, Agg> = last
            .iter()
            .map(|(s, agg)| {
                let i = match prev.get(s) {
                    Some(p) => agg.since(p),
                    None => agg.clone(),
                };
                (*s, i)
            })
            .collect();
        (d, w.dt_s())
    });
    let mut ids: BTreeSet<StageId> = (0..rt.stage_count() as StageId).collect();
    ids.extend(now.keys().map(|(s, _)| *s));
    let mut out = Vec::with_capacity(ids.len());
    for sid in ids {
        let cfg = rt.stage_config(sid);
        let total = now_by_stage.get(&sid).cloned().unwrap_or_default();
        let int = int_by_stage
            .as_ref()
            .map(|(m, dt)| (m.get(&sid).cloned().unwrap_or_default(), *dt));
        let mut rows = Vec::new();
        for (&(s, a), agg) in now.range((sid, 0)..=(sid, ActivityId::MAX)) {
            debug_assert_eq!(s, sid);
            // A removed activity's rows are left out (its work stays in the stage's totals):
            // with activities made and removed all day, they only grew the document.
            let Some(info) = acts.get(&a) else {
                continue;
            };
            let ia = interval
                .as_ref()
                .map(|(m, dt)| (m.get(&(s, a)).cloned().unwrap_or_default(), *dt));
            rows.push(model::StageActivity {
                activity: info.path.clone(),
                id: a,
                queued: agg.queued,
                delayed: agg.delayed,
                total: agg.c.clone(),
                rate: ia.as_ref().map(|(i, dt)| i.rates(*dt)),
                latency: agg.latency(),
                latency_1s: ia.as_ref().map(|(i, _)| i.latency()),
                admission: if cfg.is_some() {
                    admission_of(rt, s, Some(a))
                } else {
                    None
                },
            });
        }
        out.push(model::Stage {
            id: sid,
            name: stage_label(rt, sid),
            batch_max: cfg.map(|c| c.batch_max),
            batch_now: if cfg.is_some() {
                (0..rt.workers())
                    .filter_map(|c| rt.batch_size(sid, c))
                    .collect()
            } else {
                Vec::new()
            },
            adaptive_batch: cfg.is_some_and(|c| c.adaptive_batch),
            queue_limit: cfg.map(|c| c.queue_limit),
            weight: cfg.map(|c| c.weight),
            admission: cfg.and_then(|_| admission_of(rt, sid, None)),
            queued: total.queued,
            delayed: total.delayed,
            total: total.c.clone(),
            rate: int.as_ref().map(|(i, dt)| i.rates(*dt)),
            latency: total.latency(),
            latency_1s: int.as_ref().map(|(i, _)| i.latency()),
            activities: rows,
        });
    }
    model::Stages {
        truncation: Default::default(),
        sampler: Default::default(),
        interval_s: win.map(|w| w.dt_s()),
        stages: out,
    }
}

/// Keeps the first `max` nodes of the tree under `root` (the root first, then depth-first in
/// path order) and leaves the rest out; how many were left out. Totals, shares and targets
/// were computed on the whole tree, so the nodes kept say the same as without the bound.
pub(crate) fn bound_tree(root: &mut model::Node, max: usize) -> model::Truncation {
    fn count(n: &model::Node) -> u64 {
        1 + n.children.iter().map(count).sum::<u64>()
    }
    fn walk(n: &mut model::Node, left: &mut usize) -> u64 {
        let mut omitted = 0;
        let children = std::mem::take(&mut n.children);
        for mut c in children {
            if *left == 0 {
                omitted += count(&c);
                continue;
            }
            *left -= 1;
            omitted += walk(&mut c, left);
            n.children.push(c);
        }
        omitted
    }
    let mut left = max.saturating_sub(1);
    let omitted = walk(root, &mut left);
    model::Truncation {
        truncated: omitted > 0,
        omitted,
    }
}

/// Keeps the first `max` (stage, activity) rows of `/stages`, in stage order; the stages
/// themselves (and their totals) all stay.
pub(crate) fn bound_stages(st: &mut model::Stages, max: usize) {
    let mut left = max;
    let mut omitted = 0u64;
    for s in &mut st.stages {
        let keep = s.activities.len().min(left);
        omitted += (s.activities.len() - keep) as u64;
        s.activities.truncate(keep);
        left -= keep;
    }
    st.truncation = model::Truncation {
        truncated: omitted > 0,
        omitted,
    };
}

/// Keeps the first `max` edges of the graph (its nodes, one per stage and source, all stay).
pub(crate) fn bound_graph(g: &mut model::Graph, max: usize) {
    let omitted = g.edges.len().saturating_sub(max) as u64;
    g.edges.truncate(max);
    g.truncation = model::Truncation {
        truncated: omitted > 0,
        omitted,
    };
}

fn edge_source(rt: &Runtime, f: EdgeFrom) -> (String, &'static str, Option<u32>) {
    match f {
        EdgeFrom::Stage(s) => (stage_label(rt, s), "stage", Some(s)),
        EdgeFrom::Io => ("io".into(), "io", None),
        EdgeFrom::External => ("external".into(), "external", None),
    }
}

/// `GET /api/v1/graph`.
pub(crate) fn graph(rt: &Runtime, fresh: &Sample, win: Option<&Window>) -> model::Graph {
    let mut nodes: Vec<model::GraphNode> = (0..rt.stage_count() as StageId)
        .map(|s| model::GraphNode {
            name: stage_label(rt, s),
            kind: "stage".into(),
            id: Some(s),
        })
        .collect();
    let prev: BTreeMap<(EdgeFrom, StageId), u64> = win
        .map(|w| {
            w.prev
                .edges
                .iter()
                .map(|e| ((e.from, e.to), e.messages))
                .collect()
        })
        .unwrap_or_default();
    let last: BTreeMap<(EdgeFrom, StageId), u64> = win
        .map(|w| {
            w.last
                .edges
                .iter()
                .map(|e| ((e.from, e.to), e.messages))
                .collect()
        })
        .unwrap_or_default();
    let dt = win.map(|w| w.dt_s());
    let mut sources = BTreeSet::new();
    let mut edges = Vec::with_capacity(fresh.edges.len());
    for e in &fresh.edges {
        let (from, kind, _) = edge_source(rt, e.from);
        if kind != "stage" {
            sources.insert((kind, from.clone()));
        }
        let key = (e.from, e.to);
        edges.push(model::GraphEdge {
            from,
            to: stage_label(rt, e.to),
            messages: e.messages,
            per_s: dt.map(|dt| {
                last.get(&key)
                    .copied()
                    .unwrap_or(0)
                    .saturating_sub(prev.get(&key).copied().unwrap_or(0)) as f64
                    / dt
            }),
        });
    }
    for (kind, name) in sources {
        nodes.push(model::GraphNode {
            name,
            kind: kind.into(),
            id: None,
        });
    }
    model::Graph {
        interval_s: dt,
        nodes,
        edges,
        truncation: Default::default(),
    }
}

fn dot_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' | '\\' => {
                out.push('\\');
                out.push(ch);
            }
            '\n' | '\r' => out.push(' '),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The stage graph in Graphviz dot: stages as boxes, sources as ellipses, edges labelled with
/// messages since start (and per second over the last interval).
pub(crate) fn dot(g: &model::Graph) -> String {
    let mut s = String::from("digraph omnistage {\n  rankdir=LR;\n  node [shape=box, fontname=\"sans-serif\"];\n  edge [fontname=\"sans-serif\"];\n");
    for n in &g.nodes {
        let shape = if n.kind == "stage" { "box" } else { "ellipse" };
        s.push_str(&format!("  {} [shape={shape}];\n", dot_quote(&n.name)));
    }
    for e in &g.edges {
        let label = match e.per_s {
            Some(r) => format!("{} ({:.0}/s)", e.messages, r),
            None => e.messages.to_string(),
        };
        s.push_str(&format!(
            "  {} -> {} [label={}];\n",
            dot_quote(&e.from),
            dot_quote(&e.to),
            dot_quote(&label)
        ));
    }
    s.push_str("}\n");
    s
}

/// One point of the share history, from the sampler's window.
pub(crate) fn history_point(rt: &Runtime, w: &Window) -> model::HistoryPoint {
    let t = tree(rt, &w.last, Some(w));
    let mut all = Vec::new();
    fn walk(n: &model::Node, out: &mut Vec<(String, f64, f64, Option<u64>)>) {
        if n.path != "/" {
            out.push((
                n.path.clone(),
                n.share.unwrap_or(0.0),
                n.target_share.unwrap_or(0.0),
                n.latency_1s.as_ref().and_then(|l| l.response_ns.p90),
            ));
        }
        for c in &n.children {
            walk(c, out);
        }
    }
    walk(&t.root, &mut all);
    all.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    all.truncate(HISTORY_ACTIVITIES_MAX);
    let mut p = model::HistoryPoint {
        t_s: w.last.at_ns as f64 / 1e9,
        shares: BTreeMap::new(),
        targets: BTreeMap::new(),
        p90_response_ns: BTreeMap::new(),
    };
    for (path, share, target, p90) in all {
        p.shares.insert(path.clone(), share);
        p.targets.insert(path.clone(), target);
        if let Some(v) = p90 {
            p.p90_response_ns.insert(path, v);
        }
    }
    p
}

/// The stage id named `name`.
pub(crate) fn stage_by_name(rt: &Runtime, name: &str) -> Option<StageId> {
    (0..rt.stage_count() as StageId).find(|&s| rt.stage_name(s) == Some(name))
}

/// Sets the cache bytes of the nodes named in `by_path` (an HTTP server's tenants).
/// Puts each attached shaped group on its node.
pub(crate) fn fill_shaped(node: &mut model::Node, shaped: &[model::Shaped]) {
    if let Some(g) = shaped.iter().find(|g| g.path == node.path) {
        node.shaped = Some(g.clone());
    }
    for c in &mut node.children {
        fill_shaped(c, shaped);
    }
}

pub(crate) fn fill_cache_bytes(node: &mut model::Node, by_path: &[(String, u64)]) {
    if let Some((_, b)) = by_path.iter().find(|(p, _)| *p == node.path) {
        node.cache_bytes = Some(*b);
    }
    for c in &mut node.children {
        fill_cache_bytes(c, by_path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(weight: u32, usage: f64, backlogged: bool) -> Claim {
        Claim {
            weight,
            usage,
            backlogged,
            ceiling: f64::INFINITY,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn water_fill_splits_by_weight_among_the_hungry() {
        // Three backlogged siblings 50:33:17.
        let t = water_fill(1.0, &[c(50, 0.5, true), c(33, 0.3, true), c(17, 0.2, true)]);
        assert!(
            close(t[0], 0.5) && close(t[1], 0.33) && close(t[2], 0.17),
            "{t:?}"
        );
        // One idle sibling gets nothing; the others split everything.
        let t = water_fill(1.0, &[c(1, 0.0, false), c(1, 0.6, true), c(1, 0.4, true)]);
        assert_eq!(t[0], 0.0);
        assert!(close(t[1], 0.5) && close(t[2], 0.5));
        // A light sibling that is not backlogged keeps what it used; the rest is split.
        let t = water_fill(1.0, &[c(1, 0.1, false), c(1, 0.5, true), c(1, 0.4, true)]);
        assert!(close(t[0], 0.1) && close(t[1], 0.45) && close(t[2], 0.45));
        // Rounds: after the lightest is sated the portions grow, and more may be sated:
        // 0.2 is above half of 1/3 but below half of 0.99/2.
        let t = water_fill(
            1.0,
            &[c(1, 0.01, false), c(1, 0.2, false), c(1, 0.79, false)],
        );
        assert!(
            close(t[0], 0.01) && close(t[1], 0.2) && close(t[2], 0.79),
            "{t:?}"
        );
        // Between half and all of its portion a sibling is owed the whole portion.
        let t = water_fill(1.0, &[c(1, 0.4, false), c(1, 0.6, false)]);
        assert!(close(t[0], 0.5));
        // A backlogged sibling below its portion is not sated: it is owed its portion.
        let t = water_fill(1.0, &[c(1, 0.1, true), c(1, 0.9, true)]);
        assert!(close(t[0], 0.5));
        // A cap below the portion is the target; the rest goes to the others.
        let capped = Claim {
            ceiling: 0.2,
            ..c(1, 0.2, true)
        };
        let t = water_fill(1.0, &[capped, c(1, 0.5, true), c(2, 0.3, true)]);
        assert!(
            close(t[0], 0.2) && close(t[1], 0.8 / 3.0) && close(t[2], 1.6 / 3.0),
            "{t:?}"
        );
        // A cap above the portion changes nothing.
        let loose = Claim {
            ceiling: 0.9,
            ..c(1, 0.5, true)
        };
        let t = water_fill(1.0, &[loose, c(1, 0.5, true)]);
        assert!(close(t[0], 0.5) && close(t[1], 0.5));
        // Targets never exceed what is available.
        let t = water_fill(0.5, &[c(3, 0.2, false), c(1, 0.3, true)]);
        assert!(t.iter().sum::<f64>() <= 0.5 + 1e-9);
    }

    #[test]
    fn dot_quotes_names() {
        let g = model::Graph {
            truncation: Default::default(),
            interval_s: None,
            nodes: vec![model::GraphNode {
                name: "a\"b".into(),
                kind: "stage".into(),
                id: Some(0),
            }],
            edges: vec![model::GraphEdge {
                from: "io".into(),
                to: "a\"b".into(),
                messages: 3,
                per_s: Some(1.5),
            }],
        };
        let d = dot(&g);
        assert!(d.contains(r#""a\"b" [shape=box];"#), "{d}");
        assert!(d.contains(r#""io" -> "a\"b" [label="3 (2/s)"];"#), "{d}");
        assert!(d.starts_with("digraph omnistage {") && d.ends_with("}\n"));
    }

    /// A histogram's sum wraps by design (as the ledger's counters do): two cells near
    /// `u64::MAX` for one (stage, activity) on two cores add without a panic.
    #[test]
    fn histogram_sums_near_the_top_add_without_a_panic() {
        use omnistage::account::{LatencyRow, Snapshot};
        let mut h = HistSnapshot::default();
        h.counts[3] = 1;
        h.sum = u64::MAX - 1;
        let row = |core| LatencyRow {
            activity: 7,
            stage: 1,
            core,
            wait: h,
            response: h,
        };
        let s = Sample {
            at_ns: 0,
            snap: Snapshot::default(),
            lat: vec![row(0), row(1)],
            stretches: Vec::new(),
            queues: Vec::new(),
            edges: Vec::new(),
        };
        let m = by_activity(&s);
        let a = &m[&7];
        assert_eq!(a.resp.count(), 2);
        assert_eq!(a.resp.sum, (u64::MAX - 1).wrapping_add(u64::MAX - 1));
        assert_eq!(a.wait.sum, a.resp.sum);
    }

    #[test]
    fn names_of_paths() {
        assert_eq!(name_of("/"), "/");
        assert_eq!(name_of("/tenants/a"), "a");
    }
}
