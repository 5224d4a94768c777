//! `cpu-share` and `cross-core`: CPU-bound activities that are always backlogged, each message
//! doing the same fixed work and re-sending itself in its own activity, on its own core.
//! Shares are measured two ways: charged CPU from the ledger, and messages completed.

use super::report::{self, Doc, Table};
use super::util::{burn, burn_iters_per_us, machine, water_fill};
use super::Common;
use clap::Args;
use omnistage::activity::ActivitySpec;
use omnistage::exec::{Affinity, Runtime, StageConfig, StageRef};
use serde::Serialize;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

#[derive(Args, Clone)]
#[command(mut_arg("seconds", |a| a.default_value("10.0")))]
#[command(mut_arg("out", |a| a.help("Write the JSON, a page (.md) and a chart (.svg) into this directory.")))]
#[command(mut_arg("repeats", |a| a.default_value("1").hide(true)))]
#[command(mut_arg("nginx", |a| a.hide(true)))]
pub struct CpuShareArgs {
    /// Comma-separated weights, one activity each.
    #[arg(long, default_value = "50,33,17", value_delimiter = ',')]
    weights: Vec<u32>,
    /// Worker threads (default: number of CPUs).
    #[arg(long)]
    workers: Option<usize>,
    /// Fixed work per message, in microseconds (calibrated once at start).
    #[arg(long, default_value_t = 20.0)]
    work_us: f64,
    #[command(flatten)]
    common: Common,
}

#[derive(Args, Clone)]
#[command(mut_arg("seconds", |a| a.default_value("10.0")))]
#[command(mut_arg("out", |a| a.help("Write the JSON, a page (.md) and a chart (.svg) into this directory.")))]
#[command(mut_arg("repeats", |a| a.default_value("1").hide(true)))]
#[command(mut_arg("nginx", |a| a.hide(true)))]
pub struct CrossCoreArgs {
    #[arg(long)]
    workers: Option<usize>,
    #[arg(long, default_value_t = 20.0)]
    work_us: f64,
    #[command(flatten)]
    common: Common,
}

#[derive(Serialize)]
struct ActivityResult {
    path: String,
    weight: u32,
    cores: Vec<usize>,
    target_share: f64,
    share: f64,
    error_pts: f64,
    completed: u64,
    completed_share: f64,
}

#[derive(Serialize)]
struct CoreResult {
    core: u32,
    elapsed_ns: u64,
    idle_ns: u64,
    charged_ns: u64,
    os_cpu_ns: u64,
    os_runqueue_ns: u64,
    os_steal_ns: u64,
    unattributed_ns: i64,
}

#[derive(Serialize)]
struct ShareReport {
    experiment: &'static str,
    machine: String,
    workers: usize,
    seconds: f64,
    work_us: f64,
    activities: Vec<ActivityResult>,
    unattributed_fraction: f64,
    cores: Vec<CoreResult>,
}

/// Messages kept in flight per (activity, core): enough that a queue never runs dry.
const IN_FLIGHT_PER_CORE: usize = 4;
/// Time before the measurement window, so queues and tags settle.
const WARMUP: Duration = Duration::from_millis(500);

struct Spec {
    path: String,
    weight: u32,
    cores: Vec<usize>,
}

fn measure(
    name: &'static str,
    specs: Vec<Spec>,
    workers: usize,
    seconds: f64,
    work_us: f64,
) -> Result<ShareReport, String> {
    if !(0.1..=3600.0).contains(&seconds) {
        return Err("--seconds must be in 0.1..=3600".into());
    }
    if !(0.1..=10_000.0).contains(&work_us) {
        return Err("--work-us must be in 0.1..=10000".into());
    }
    let iters = (burn_iters_per_us() * work_us).max(1.0) as u64;
    let mut b = Runtime::builder().workers(workers).pin(true);
    let me: Arc<OnceLock<StageRef<()>>> = Arc::new(OnceLock::new());
    let me2 = me.clone();
    let stage = b
        .stage::<(), _, _>(
            "burn",
            StageConfig {
                batch_max: 1,
                ..Default::default()
            },
            move |_core| {
                let me = me2.clone();
                move |ctx, ()| {
                    burn(iters);
                    // Inherits the activity; stays on this core.
                    let _ = ctx.send(me.get().expect("set before start"), ());
                }
            },
        )
        .map_err(|e| e.to_string())?;
    me.set(stage).map_err(|_| "stage set twice")?;
    let rt = b.start().map_err(|e| e.to_string())?;
    let mut ids = Vec::new();
    for s in &specs {
        let id = rt
            .with_activities(|t| t.lookup(&s.path))
            .map(Ok)
            .unwrap_or_else(|| {
                // Parents first (`/tenants`), then the activity.
                let parent = &s.path[..s.path.rfind('/').unwrap_or(0)];
                if !parent.is_empty() && rt.activity_id(parent).is_none() {
                    rt.create_activity(parent, ActivitySpec::default())?;
                }
                rt.create_activity(&s.path, ActivitySpec::weight(s.weight))
            })
            .map_err(|e| e.to_string())?;
        ids.push(id);
    }
    for (s, &id) in specs.iter().zip(&ids) {
        for &c in &s.cores {
            for _ in 0..IN_FLIGHT_PER_CORE {
                rt.send(&stage, id, Affinity::Core(c as u16), ())
                    .map_err(|e| e.to_string())?;
            }
        }
    }
    std::thread::sleep(WARMUP);
    let s0 = rt.snapshot();
    std::thread::sleep(Duration::from_secs_f64(seconds));
    let s1 = rt.snapshot();
    rt.shutdown();

    let row = |snap: &omnistage::account::Snapshot, id| {
        snap.by_activity()
            .into_iter()
            .find(|(a, _)| *a == id)
            .map(|(_, r)| r)
            .unwrap_or_default()
    };
    let deltas: Vec<(u64, u64)> = ids
        .iter()
        .map(|&id| {
            let (a, b) = (row(&s0, id), row(&s1, id));
            (b.cpu_ns - a.cpu_ns, b.messages - a.messages)
        })
        .collect();
    let cpu_total: u64 = deltas.iter().map(|d| d.0).sum();
    let done_total: u64 = deltas.iter().map(|d| d.1).sum();
    let masks: Vec<u64> = specs
        .iter()
        .map(|s| s.cores.iter().fold(0u64, |m, &c| m | 1 << c))
        .collect();
    let weights: Vec<f64> = specs.iter().map(|s| f64::from(s.weight)).collect();
    let targets = water_fill(&weights, &masks, workers);
    let activities = specs
        .iter()
        .zip(&deltas)
        .zip(&targets)
        .map(|((s, &(cpu, done)), &target)| {
            let share = cpu as f64 / cpu_total.max(1) as f64;
            ActivityResult {
                path: s.path.clone(),
                weight: s.weight,
                cores: s.cores.clone(),
                target_share: target,
                share,
                error_pts: (share - target) * 100.0,
                completed: done,
                completed_share: done as f64 / done_total.max(1) as f64,
            }
        })
        .collect();
    let mut cores = Vec::new();
    let (mut unattributed_abs, mut elapsed) = (0u64, 0u64);
    for (a, b) in s0.cores.iter().zip(&s1.cores) {
        let d = b.since(a);
        unattributed_abs += d.unattributed_ns().unsigned_abs();
        elapsed += d.elapsed_ns;
        cores.push(CoreResult {
            core: d.core,
            elapsed_ns: d.elapsed_ns,
            idle_ns: d.idle_ns,
            charged_ns: d.charged_ns(),
            os_cpu_ns: d.os_cpu_ns,
            os_runqueue_ns: d.os_runqueue_ns,
            os_steal_ns: d.os_steal_ns,
            unattributed_ns: d.unattributed_ns(),
        });
    }
    Ok(ShareReport {
        experiment: name,
        machine: machine(),
        workers,
        seconds,
        work_us,
        activities,
        unattributed_fraction: unattributed_abs as f64 / elapsed.max(1) as f64,
        cores,
    })
}

/// The page: one row per activity, one per core, and a bar chart of target vs measured share.
fn emit(report: &ShareReport, json: bool, out: Option<&Path>) -> Result<(), String> {
    let mut acts = Table::new(&[
        "activity",
        "weight",
        "cores",
        "target",
        "share (charged CPU)",
        "error pts",
        "completed",
        "share (completed)",
    ]);
    for a in &report.activities {
        let cores: Vec<String> = a.cores.iter().map(|c| c.to_string()).collect();
        acts.row(vec![
            a.path.clone(),
            a.weight.to_string(),
            cores.join(","),
            format!("{:.4}", a.target_share),
            format!("{:.4}", a.share),
            format!("{:+.2}", a.error_pts),
            a.completed.to_string(),
            format!("{:.4}", a.completed_share),
        ]);
    }
    let mut cores = Table::new(&[
        "core",
        "elapsed s",
        "idle s",
        "charged s",
        "OS cpu s",
        "run-queue s",
        "steal s",
        "unattributed ms",
    ]);
    for c in &report.cores {
        cores.row(vec![
            c.core.to_string(),
            format!("{:.3}", c.elapsed_ns as f64 / 1e9),
            format!("{:.3}", c.idle_ns as f64 / 1e9),
            format!("{:.3}", c.charged_ns as f64 / 1e9),
            format!("{:.3}", c.os_cpu_ns as f64 / 1e9),
            format!("{:.3}", c.os_runqueue_ns as f64 / 1e9),
            format!("{:.3}", c.os_steal_ns as f64 / 1e9),
            format!("{:+.3}", c.unattributed_ns as f64 / 1e6),
        ]);
    }
    let max_err = report
        .activities
        .iter()
        .map(|a| a.error_pts.abs())
        .fold(0.0, f64::max);
    let (title, goal_pts) = match report.experiment {
        "cross-core" => (
            "cross-core: weights 1:1, A on core 0 only, B on every core",
            3.0,
        ),
        _ => ("cpu-share: always-backlogged activities by weight", 1.0),
    };
    let doc = Doc {
        title: title.into(),
        command: format!(
            "omnistage exp {} --seconds {}",
            report.experiment, report.seconds
        ),
        machine: report.machine.clone(),
        intro: vec![format!(
            "{} workers, {:.1} s, {:.1} µs of fixed work per message; every activity keeps \
             messages queued on each of its cores, so each is always backlogged. The target share is \
             the water-filled share of the machine's CPU by weight (an activity confined to fewer \
             cores cannot take more than those cores); the share is CPU charged by the ledger.",
            report.workers, report.seconds, report.work_us
        )],
        tables: vec![
            ("Shares per activity".into(), acts),
            ("Per core (unattributed = OS busy − charged; OS busy = thread CPU + run-queue wait + steal)".into(), cores),
        ],
        notes: vec![format!(
            "Largest error {max_err:.2} points (goal ≤ {goal_pts} point{}): {}. Unattributed \
             fraction of elapsed core time: {:.4} %.",
            if goal_pts > 1.0 { "s" } else { "" },
            if max_err <= goal_pts { "met" } else { "NOT met" },
            report.unattributed_fraction * 100.0
        )],
    };
    report::emit(report.experiment, report, &doc, json, out, |p| {
        let cats: Vec<String> = report.activities.iter().map(|a| a.path.clone()).collect();
        report::svg_bars(
            p,
            &format!("{}: target vs measured CPU share", report.experiment),
            "share of the machine's CPU",
            &cats,
            &[
                (
                    "target".into(),
                    report.activities.iter().map(|a| a.target_share).collect(),
                ),
                (
                    "charged CPU".into(),
                    report.activities.iter().map(|a| a.share).collect(),
                ),
                (
                    "completed".into(),
                    report
                        .activities
                        .iter()
                        .map(|a| a.completed_share)
                        .collect(),
                ),
            ],
        )
    })
}

fn default_workers() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

pub fn cpu_share(a: CpuShareArgs) -> Result<(), String> {
    let workers = a.workers.unwrap_or_else(default_workers);
    if a.weights.is_empty() || a.weights.len() > 64 {
        return Err("--weights needs 1..=64 weights".into());
    }
    let specs = a
        .weights
        .iter()
        .enumerate()
        .map(|(i, &w)| Spec {
            path: format!("/tenants/t{i}"),
            weight: w,
            cores: (0..workers).collect(),
        })
        .collect();
    let r = measure("cpu-share", specs, workers, a.common.seconds, a.work_us)?;
    emit(&r, a.common.json, a.common.out())
}

pub fn cross_core(a: CrossCoreArgs) -> Result<(), String> {
    let workers = a.workers.unwrap_or_else(default_workers);
    if workers < 2 {
        return Err("cross-core needs at least 2 workers".into());
    }
    let specs = vec![
        Spec {
            path: "/tenants/a".into(),
            weight: 100,
            cores: vec![0],
        },
        Spec {
            path: "/tenants/b".into(),
            weight: 100,
            cores: (0..workers).collect(),
        },
    ];
    let r = measure("cross-core", specs, workers, a.common.seconds, a.work_us)?;
    emit(&r, a.common.json, a.common.out())
}
