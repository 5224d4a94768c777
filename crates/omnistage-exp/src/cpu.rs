//! `cpu-share` and `cross-core`: CPU-bound activities that are always backlogged, each message
//! doing the same fixed work and re-sending itself in its own activity, on its own core.
//! Shares are measured two ways: charged CPU from the ledger, and messages completed.

use super::report::{self, Doc, Table};
use super::share::{self, ShareVerdict};
use super::util::{burn, burn_iters_per_us, machine, water_fill};
use super::Common;
use clap::Args;
use omnistage::activity::ActivitySpec;
use omnistage::exec::{Affinity, Runtime, StageConfig, StageRef};
use serde::Serialize;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
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
    /// Messages of equal fixed work completed, counted by the work itself (not the ledger).
    completed: u64,
    client_share: f64,
    client_error_pts: f64,
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
    #[serde(flatten)]
    verdict: ShareVerdict,
}

/// The goals: cpu-share within 1 point of the weights, cross-core within 3 points of the
/// water-filled shares.
const CPU_SHARE_GOAL_PTS: f64 = 1.0;
const CROSS_CORE_GOAL_PTS: f64 = 3.0;

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
    goal_pts: f64,
) -> Result<ShareReport, String> {
    if !(0.1..=3600.0).contains(&seconds) {
        return Err("--seconds must be in 0.1..=3600".into());
    }
    if !(0.1..=10_000.0).contains(&work_us) {
        return Err("--work-us must be in 0.1..=10000".into());
    }
    let iters = (burn_iters_per_us() * work_us).max(1.0) as u64;
    let mut b = Runtime::builder().workers(workers).pin(true);
    let me: Arc<OnceLock<StageRef<usize>>> = Arc::new(OnceLock::new());
    let me2 = me.clone();
    // Completed work items per activity, counted by the work itself: the instrument the
    // scheduler does not control (its ledger counts messages too, but that is its own figure).
    let done: Arc<Vec<AtomicU64>> = Arc::new(specs.iter().map(|_| AtomicU64::new(0)).collect());
    let done2 = done.clone();
    let stage = b
        .stage::<usize, _, _>(
            "burn",
            StageConfig {
                batch_max: 1,
                ..Default::default()
            },
            move |_core| {
                let me = me2.clone();
                let done = done2.clone();
                move |ctx, i: usize| {
                    burn(iters);
                    done[i].fetch_add(1, Ordering::Relaxed);
                    // Inherits the activity; stays on this core.
                    let _ = ctx.send(me.get().expect("set before start"), i);
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
    for (i, (s, &id)) in specs.iter().zip(&ids).enumerate() {
        for &c in &s.cores {
            for _ in 0..IN_FLIGHT_PER_CORE {
                rt.send(&stage, id, Affinity::Core(c as u16), i)
                    .map_err(|e| e.to_string())?;
            }
        }
    }
    std::thread::sleep(WARMUP);
    let count = || -> Vec<u64> { done.iter().map(|d| d.load(Ordering::Relaxed)).collect() };
    let (s0, c0) = (rt.snapshot(), count());
    std::thread::sleep(Duration::from_secs_f64(seconds));
    let (s1, c1) = (rt.snapshot(), count());
    rt.shutdown();
    let completed: Vec<u64> = c1.iter().zip(&c0).map(|(b, a)| b - a).collect();
    let client = share::shares(&completed.iter().map(|&c| c as f64).collect::<Vec<_>>());

    let row = |snap: &omnistage::account::Snapshot, id| {
        snap.by_activity()
            .into_iter()
            .find(|(a, _)| *a == id)
            .map(|(_, r)| r)
            .unwrap_or_default()
    };
    let deltas: Vec<u64> = ids
        .iter()
        .map(|&id| {
            let (a, b) = (row(&s0, id), row(&s1, id));
            b.cpu_ns - a.cpu_ns
        })
        .collect();
    let cpu_total: u64 = deltas.iter().sum();
    let masks: Vec<u64> = specs
        .iter()
        .map(|s| s.cores.iter().fold(0u64, |m, &c| m | 1 << c))
        .collect();
    let weights: Vec<f64> = specs.iter().map(|s| f64::from(s.weight)).collect();
    let targets = water_fill(&weights, &masks, workers);
    let activities: Vec<ActivityResult> = specs
        .iter()
        .zip(&deltas)
        .zip(&targets)
        .enumerate()
        .map(|(i, ((s, &cpu), &target))| {
            let share = cpu as f64 / cpu_total.max(1) as f64;
            ActivityResult {
                path: s.path.clone(),
                weight: s.weight,
                cores: s.cores.clone(),
                target_share: target,
                share,
                error_pts: (share - target) * 100.0,
                completed: completed[i],
                client_share: client[i],
                client_error_pts: (client[i] - target) * 100.0,
            }
        })
        .collect();
    let verdict = share::judge(
        &targets,
        &activities.iter().map(|a| a.share).collect::<Vec<_>>(),
        &client,
        &completed,
        goal_pts,
    );
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
        verdict,
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
        "completed (counted by the work)",
        "client share",
        "client error pts",
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
            format!("{:.4}", a.client_share),
            format!("{:+.2}", a.client_error_pts),
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
    let title = match report.experiment {
        "cross-core" => "cross-core: weights 1:1, A on core 0 only, B on every core",
        _ => "cpu-share: always-backlogged activities by weight",
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
             cores cannot take more than those cores). Two figures per activity: the share of CPU \
             charged by the ledger, and the client share: work items completed, each the same \
             fixed work, counted by the work itself outside the scheduler.",
            report.workers, report.seconds, report.work_us
        )],
        tables: vec![
            ("Shares per activity".into(), acts),
            ("Per core (unattributed = OS busy − charged; OS busy = thread CPU + run-queue wait + steal)".into(), cores),
        ],
        notes: vec![
            report.verdict.note("work items completed"),
            format!(
                "Unattributed fraction of elapsed core time: {:.4} %.",
                report.unattributed_fraction * 100.0
            ),
        ],
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
                    "work items completed".into(),
                    report.activities.iter().map(|a| a.client_share).collect(),
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
    let r = measure(
        "cpu-share",
        specs,
        workers,
        a.common.seconds,
        a.work_us,
        CPU_SHARE_GOAL_PTS,
    )?;
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
    let r = measure(
        "cross-core",
        specs,
        workers,
        a.common.seconds,
        a.work_us,
        CROSS_CORE_GOAL_PTS,
    )?;
    emit(&r, a.common.json, a.common.out())
}
