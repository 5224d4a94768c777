//! `overload-spike` (SEDA Fig. 55, Breakwater): one tenant on `/_burn?us=N`, offered open-loop
//! load that steps from 0.5× the server's measured capacity to 10× (for half the run, 10 s by
//! default) and back, with `p90_target_ms` (SEDA's p90 admission controller plus the
//! Little's-law queue bound on `http.work`; repeated, the median run reported) and once
//! without. The load generator runs three phases back to back (each its own run, so each phase
//! has its own end-to-end p90, 503 fraction and goodput); meanwhile the ledger is read every
//! 250 ms for the server-side p90 of admitted requests (response time at `http.work`, enqueue
//! to end of dispatch) and the gate's rejections, which give the time to get back under the
//! target and when rejections stop after the spike.
//!
//! Each of the server's windows also records what the machine took from the run in it (steal
//! over every CPU and the worker's and the load generator's run-queue wait, by the OS's
//! counters). A run that misses the goal only through windows so disturbed, or whose spike was
//! mostly disturbed, is not judged (`goal_met` null), never passed.

use super::cfgweb;
use super::harness;
use super::report::{self, Doc, Table};
use super::util::machine;
use super::windowing::{self, ClientWindow, Windowed};
use super::Common;
use clap::Args;
use omnistage::account::HistSnapshot;
use serde::Serialize;
use std::time::{Duration, Instant};

#[derive(Args, Clone)]
#[command(mut_arg("seconds", |a| a.default_value("20.0").help("Seconds of one run: 25 % low, 50 % spike, 25 % low again.")))]
#[command(mut_arg("repeats", |a| a.default_value("3").help("Runs with admission (the median by settle time is reported); one run without.")))]
#[command(mut_arg("out", |a| a.help("Write overload-spike.json, .md and .svg here.")))]
#[command(mut_arg("nginx", |a| a.hide(true)))]
pub struct SpikeArgs {
    /// CPU per request, µs.
    #[arg(long, default_value_t = 500)]
    burn_us: u64,
    /// The tenant's p90 target, ms.
    #[arg(long, default_value_t = 20)]
    target_ms: u64,
    /// Offered load during the spike, × the measured capacity.
    #[arg(long, default_value_t = 10.0)]
    spike: f64,
    /// Open-loop connection slots.
    #[arg(long, default_value_t = 256)]
    conns: usize,
    #[command(flatten)]
    common: Common,
}

#[derive(Serialize, Clone)]
struct Window {
    t_s: f64,
    /// Server-side p90 of admitted requests in this window, ms (`null`: none finished).
    p90_ms: Option<f64>,
    completed: u64,
    rejected: u64,
    reject_fraction: f64,
    /// The Little's-law bound of the tenant's queue at the end of the window (`null`: none).
    queue_bound: Option<usize>,
    /// Hypervisor steal over every CPU of the machine in the window, ms (/proc/stat, in 10 ms
    /// ticks; `null`: not readable).
    steal_ms: Option<f64>,
    /// Run-queue wait of the server's worker and the load generator's thread in the window, ms
    /// (their schedstat; `null`: not readable).
    runqueue_ms: Option<f64>,
    /// The machine took at least `DISTURBED_FRACTION_OF_TARGET` of the target away from the
    /// run in this window (steal + run-queue wait): a p90 over the target here may be the
    /// host's, not the server's.
    disturbed: bool,
}

#[derive(Serialize, Clone)]
struct PhaseLoad {
    name: &'static str,
    offered_per_s: f64,
    seconds: f64,
    ok_per_s: f64,
    /// End-to-end p90 of successful responses (from the intended send time), ms.
    p90_ms: f64,
    p99_ms: f64,
    rejected_503: u64,
    /// 503s / (successes + 503s).
    reject_fraction: f64,
    other_errors: u64,
    unfinished: u64,
}

#[derive(Serialize)]
struct Run {
    admission: bool,
    phases: Vec<PhaseLoad>,
    windows: Vec<Window>,
    /// Seconds from the step up to the start of the first window from which every later
    /// spike window completed requests with its server-side p90 under the target (`null`:
    /// never; a window that completed nothing is a stall, not under the target).
    settle_after_step_up_s: Option<f64>,
    /// The same after the step down, over the last phase.
    settle_after_step_down_s: Option<f64>,
    /// The clients' windows (the load generator's, `TICK` long, placed on the same time line):
    /// their p90 is end to end, from each request's intended send time.
    client_windows: Vec<ClientWindow>,
    /// `settle_after_step_up_s` by the clients' windows: the goal's figure.
    client_settle_after_step_up_s: Option<f64>,
    /// The same two settle times with the disturbed windows over the target set aside (a
    /// client window is disturbed when a server window overlapping it, within
    /// `CLIENT_WINDOW_SLACK_S`, is): only the reason a miss is not judged, never a pass.
    settle_after_step_up_undisturbed_s: Option<f64>,
    client_settle_after_step_up_undisturbed_s: Option<f64>,
    /// Spike windows that were disturbed (server's windows), and the clients' spike windows
    /// over the target that were.
    spike_windows_disturbed: usize,
    client_spike_windows_over_target: usize,
    client_spike_windows_over_target_disturbed: usize,
    client_rejects_stop_after_step_down_s: Option<f64>,
    /// Seconds from the step down until the gate stops rejecting (every later window with
    /// under 1 % rejected; `null`: never within the run).
    rejects_stop_after_step_down_s: Option<f64>,
    /// The first spike window with its server-side p90 under the target, from the step up
    /// (`null`: none).
    first_under_target_after_step_up_s: Option<f64>,
    /// The Little's-law fraction of the tenant's p90 predicate (`null`: none).
    queue_bound_fraction: Option<f64>,
    /// Spike windows (with completions) whose server-side p90 was over the target.
    spike_windows_over_target: usize,
    spike_windows: usize,
    /// Requests served per second during the spike (load generator), ÷ the measured capacity.
    spike_goodput_fraction: f64,
    /// During the spike: CPU the OS gave the worker thread ÷ wall time (below 1: the machine
    /// was busy with something else).
    spike_worker_os_cpu_fraction: Option<f64>,
    /// During the spike: charged CPU of the tenant's `http.work` ÷ all charged CPU.
    spike_work_cpu_fraction: Option<f64>,
    /// During the spike: charged CPU outside `http.work` (reading, parsing, answering 503s)
    /// per request refused, µs.
    spike_other_cpu_us_per_reject: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    experiment: &'static str,
    machine: String,
    burn_us: u64,
    target_ms: u64,
    capacity_per_s: f64,
    spike_factor: f64,
    conns: usize,
    /// `runs[0]`: the median of the runs with admission (by settle time after the step up);
    /// `runs[1]`: the run without.
    runs: Vec<Run>,
    /// Settle time after the step up of every run with admission, in run order (`null`: never).
    settle_after_step_up_s_repeats: Vec<Option<f64>>,
    /// Spike goodput fraction of every run with admission.
    spike_goodput_fraction_repeats: Vec<f64>,
    goal_settle_s: f64,
    /// Spike goodput that counts as "near capacity".
    goal_goodput_fraction: f64,
    /// Median settle time ≤ goal_settle_s (by the server's windows and the clients') and the
    /// median run's spike goodput ≥ goal_goodput_fraction. `null` (not judged): missed only
    /// through windows the machine disturbed, that is, met with those windows set aside.
    goal_met: Option<bool>,
}

const TICK: Duration = Duration::from_millis(250);
/// A window is disturbed when steal and run-queue wait in it reach this fraction of the
/// target: a stall that long can lift a p90 that sits at about half the target (the queue
/// bound keeps it there) over the target. Steal is read in 10 ms ticks, so any tick counts
/// at the default 20 ms target; sub-tick steal is not seen, which makes the rule strict.
const DISTURBED_FRACTION_OF_TARGET: f64 = 0.25;
/// How far a client window's edges may be from the server's time line: the three load runs
/// start one after the other, each after connecting its slots, so the clients' windows lag
/// the server's by a few milliseconds per phase.
const CLIENT_WINDOW_SLACK_S: f64 = 0.1;
const GOAL_SETTLE_S: f64 = 1.0;
/// Served during the spike at least this fraction of the capacity measured without overload:
/// "near capacity" (503s cost the worker a little CPU each, so 100 % is out of reach).
const GOAL_GOODPUT_FRACTION: f64 = 0.7;
/// Most runs with admission.
const REPEATS_MAX: usize = 9;

fn tenant_toml(target_ms: Option<u64>) -> String {
    let mut s = String::from(
        "[[tenant]]\nname = \"a\"\nhosts = [\"a.test\"]\ndocroot = \"/nonexistent-omnistage-docroot\"\nsynthetic = true\n",
    );
    if let Some(t) = target_ms {
        s.push_str(&format!("p90_target_ms = {t}\n"));
    }
    s
}

/// Requests/s of one worker on `/_burn?us=N` under closed-loop saturation.
fn capacity(a: &SpikeArgs, seconds: f64) -> Result<f64, String> {
    let (server, addr) = cfgweb::start("", &tenant_toml(None))?;
    let la = harness::load_args(
        &addr,
        seconds,
        0.3,
        &["--tenant".into(), format!("a:a.test:16:burn={}", a.burn_us)],
    )?;
    let r = omnistage_load::run(&la)?;
    server.drain(Duration::from_millis(300));
    Ok(r.total.req_per_s)
}

/// Run-queue wait so far of the server's worker and of the load generator's thread, by thread
/// id and ns (each `None` while that thread does not exist: the generator's thread is a new
/// one in each phase).
type RunqReading = [Option<(u64, u64)>; 2];

fn runqueue_reading() -> RunqReading {
    ["omnistage-w0", "load-0"]
        .map(|name| harness::thread_stat_with_tid(name).map(|(tid, s)| (tid, s.runqueue_ns)))
}

/// Run-queue wait between two readings, ns: a thread that is new since `before` counts from
/// its start (`None`: the worker could not be read at either end).
fn runqueue_delta_ns(now: &RunqReading, before: &RunqReading) -> Option<u64> {
    now[0]?;
    let mut sum = 0;
    for (n, b) in now.iter().zip(before) {
        sum += match (n, b) {
            (Some((tid, ns)), Some((tid_b, ns_b))) if tid == tid_b => ns.saturating_sub(*ns_b),
            (Some((_, ns)), _) => *ns,
            (None, _) => 0,
        };
    }
    Some(sum)
}

fn response_hist(rt: &omnistage::exec::Runtime, id: u32, stage: u32) -> HistSnapshot {
    let mut h = HistSnapshot::default();
    for l in rt.latencies() {
        if l.activity == id && l.stage == stage {
            h.add(&l.response);
        }
    }
    h
}

impl Windowed for Window {
    fn end_s(&self) -> f64 {
        self.t_s
    }
    fn p90_ms(&self) -> Option<f64> {
        self.p90_ms
    }
    fn reject_fraction(&self) -> f64 {
        self.reject_fraction
    }
}

fn one_run(a: &SpikeArgs, admission: bool, cap: f64) -> Result<Run, String> {
    let (server, addr) = cfgweb::start("", &tenant_toml(admission.then_some(a.target_ms)))?;
    let rt = server.runtime();
    let id = rt.activity_id("/tenants/a").ok_or("tenant activity")?;
    let work = server.work_stage();
    let rt_admission = rt.admission(work, id);
    let lens = [
        a.common.seconds * 0.25,
        a.common.seconds * 0.5,
        a.common.seconds * 0.25,
    ];
    let rates = [0.5 * cap, a.spike * cap, 0.5 * cap];
    let names = ["low", "spike", "low again"];
    let addr2 = addr.clone();
    let burn = a.burn_us;
    let conns = a.conns;
    // The three phases back to back on one thread (pinned to the load CPU by each run).
    let loader = std::thread::spawn(
        move || -> Result<(Vec<PhaseLoad>, Vec<ClientWindow>), String> {
            let mut out = Vec::new();
            let mut client = Vec::new();
            for i in 0..3 {
                let la = harness::load_args(
                    &addr2,
                    lens[i],
                    0.0,
                    &[
                        "--rate".into(),
                        format!("{:.1}", rates[i]),
                        "--timeout-ms".into(),
                        "30000".into(),
                        "--window-ms".into(),
                        TICK.as_millis().to_string(),
                        "--tenant".into(),
                        format!("a:a.test:{conns}:burn={burn}"),
                    ],
                )?;
                let r = omnistage_load::run(&la)?;
                client.extend(windowing::client_windows(&r, lens[..i].iter().sum()));
                let t = &r.total;
                let rej = t.errors.rejected_503;
                out.push(PhaseLoad {
                    name: names[i],
                    offered_per_s: rates[i],
                    seconds: r.seconds,
                    ok_per_s: t.req_per_s,
                    p90_ms: t.p90_ms,
                    p99_ms: t.p99_ms,
                    rejected_503: rej,
                    reject_fraction: rej as f64 / (t.requests + rej).max(1) as f64,
                    other_errors: harness::errors(t) - rej,
                    unfinished: t.unfinished,
                });
            }
            Ok((out, client))
        },
    );
    let start = Instant::now();
    let total = lens.iter().sum::<f64>();
    let mut prev_h = response_hist(rt, id, work);
    let mut prev_r = rt.rejected(work, id);
    let mut prev_steal = super::util::machine_steal_ns();
    let mut prev_runq = runqueue_reading();
    let disturb_ns = a.target_ms as f64 * 1e6 * DISTURBED_FRACTION_OF_TARGET;
    let mut windows = Vec::new();
    let mut k = 1u32;
    // (snapshot, worker thread stat, rejections, time) at the step up and at the step down.
    type Mark = (
        omnistage::account::Snapshot,
        Option<harness::ThreadStat>,
        u64,
        Instant,
    );
    let mark = || -> Mark {
        (
            rt.snapshot(),
            harness::thread_stat("omnistage-w0"),
            rt.rejected(work, id),
            Instant::now(),
        )
    };
    let (mut at_up, mut at_down): (Option<Mark>, Option<Mark>) = (None, None);
    while start.elapsed().as_secs_f64() < total + 0.5 && !loader.is_finished() {
        let due = start + TICK * k;
        if let Some(d) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(d);
        }
        k += 1;
        let el = start.elapsed().as_secs_f64();
        if at_up.is_none() && el >= lens[0] {
            at_up = Some(mark());
        }
        if at_down.is_none() && el >= lens[0] + lens[1] {
            at_down = Some(mark());
        }
        let h = response_hist(rt, id, work);
        let r = rt.rejected(work, id);
        let queue_bound = rt.queue_bound(work, id);
        let d = h.since(&prev_h);
        let rej = r - prev_r;
        let n = d.count();
        let (steal, runq) = (super::util::machine_steal_ns(), runqueue_reading());
        let steal_ns = steal.zip(prev_steal).map(|(s, p)| s.saturating_sub(p));
        let runq_ns = runqueue_delta_ns(&runq, &prev_runq);
        (prev_steal, prev_runq) = (steal, runq);
        let lost_ns = steal_ns.unwrap_or(0) + runq_ns.unwrap_or(0);
        windows.push(Window {
            steal_ms: steal_ns.map(|ns| ns as f64 / 1e6),
            runqueue_ms: runq_ns.map(|ns| ns as f64 / 1e6),
            disturbed: lost_ns as f64 >= disturb_ns,
            t_s: start.elapsed().as_secs_f64(),
            p90_ms: d.percentile(0.9).map(|ns| ns as f64 / 1e6),
            completed: n,
            rejected: rej,
            reject_fraction: rej as f64 / (n + rej).max(1) as f64,
            queue_bound,
        });
        prev_h = h;
        prev_r = r;
    }
    let (phases, client_windows) = loader
        .join()
        .map_err(|_| "load generator panicked".to_string())??;
    let (mut os_frac, mut work_frac, mut per_reject) = (None, None, None);
    if let (Some(u), Some(d)) = (&at_up, &at_down) {
        let wall_ns = d.3.duration_since(u.3).as_nanos() as f64;
        if let (Some(a), Some(b)) = (u.1, d.1) {
            os_frac = Some(b.since(&a).cpu_ns as f64 / wall_ns.max(1.0));
        }
        let total_cpu =
            |s: &omnistage::account::Snapshot| -> u64 { s.rows.iter().map(|r| r.cpu_ns).sum() };
        let all = total_cpu(&d.0).saturating_sub(total_cpu(&u.0)) as f64;
        let w = harness::activity_totals(&d.0, id, Some(work))
            .0
            .saturating_sub(harness::activity_totals(&u.0, id, Some(work)).0)
            as f64;
        if all > 0.0 {
            work_frac = Some(w / all);
        }
        let rejects = d.2.saturating_sub(u.2);
        if rejects > 0 {
            per_reject = Some((all - w) / 1e3 / rejects as f64);
        }
    }
    server.drain(Duration::from_millis(300));
    let tgt = a.target_ms as f64;
    let dt = TICK.as_secs_f64();
    let (up, down) = (lens[0], lens[0] + lens[1]);
    let spike_w: Vec<&Window> = windows
        .iter()
        .filter(|w| {
            let mid = w.t_s - TICK.as_secs_f64() / 2.0;
            mid > up && mid < down && w.completed > 0
        })
        .collect();
    let first_under = spike_w
        .iter()
        .find(|w| w.p90_ms.is_some_and(|p| p <= tgt))
        .map(|w| (w.t_s - TICK.as_secs_f64() - up).max(0.0));
    // A client window is disturbed when a server window overlapping it is (with slack for the
    // clients' time line lagging the server's).
    let client_disturbed = |c: &ClientWindow| {
        let (from, to) = (
            c.t_s - dt - CLIENT_WINDOW_SLACK_S,
            c.t_s + CLIENT_WINDOW_SLACK_S,
        );
        windows
            .iter()
            .any(|w| w.disturbed && w.t_s > from && w.t_s - dt < to)
    };
    let client_spike: Vec<&ClientWindow> = client_windows
        .iter()
        .filter(|c| {
            let mid = c.t_s - dt / 2.0;
            mid > up && mid < down
        })
        .collect();
    let client_over: Vec<&&ClientWindow> = client_spike
        .iter()
        .filter(|c| c.p90_ms.is_none_or(|p| p > tgt))
        .collect();
    let settle_after_step_up_undisturbed_s =
        windowing::settle_skipping(&windows, dt, up, down, tgt, |w| w.disturbed);
    let client_settle_after_step_up_undisturbed_s =
        windowing::settle_skipping(&client_windows, dt, up, down, tgt, client_disturbed);
    let spike_windows_disturbed = spike_w.iter().filter(|w| w.disturbed).count();
    let client_spike_windows_over_target = client_over.len();
    let client_spike_windows_over_target_disturbed =
        client_over.iter().filter(|c| client_disturbed(c)).count();
    let queue_bound_fraction = match rt_admission {
        Some(omnistage::exec::Predicate::P90 { params, .. }) => Some(params.queue_bound_fraction),
        _ => None,
    };
    Ok(Run {
        admission,
        first_under_target_after_step_up_s: first_under,
        queue_bound_fraction,
        settle_after_step_up_s: windowing::settle(&windows, dt, up, down, tgt),
        settle_after_step_down_s: windowing::settle(&windows, dt, down, total, tgt),
        rejects_stop_after_step_down_s: windowing::rejects_stop(&windows, dt, down, total),
        client_settle_after_step_up_s: windowing::settle(&client_windows, dt, up, down, tgt),
        settle_after_step_up_undisturbed_s,
        client_settle_after_step_up_undisturbed_s,
        spike_windows_disturbed,
        client_spike_windows_over_target,
        client_spike_windows_over_target_disturbed,

        client_rejects_stop_after_step_down_s: windowing::rejects_stop(
            &client_windows,
            dt,
            down,
            total,
        ),
        client_windows,
        spike_windows_over_target: spike_w
            .iter()
            .filter(|w| w.p90_ms.is_some_and(|p| p > tgt))
            .count(),
        spike_windows: spike_w.len(),
        spike_goodput_fraction: phases[1].ok_per_s / cap,
        spike_worker_os_cpu_fraction: os_frac,
        spike_work_cpu_fraction: work_frac,
        spike_other_cpu_us_per_reject: per_reject,
        phases,
        windows,
    })
}

/// The goal on one run: met, missed, or not judged when the run misses only through windows the
/// machine disturbed (met with them set aside; what is set aside is counted on the page) or
/// when most of its spike windows were disturbed.
fn verdict(r: &Run) -> Option<bool> {
    let within = |s: Option<f64>| s.is_some_and(|s| s <= GOAL_SETTLE_S);
    let goodput = r.spike_goodput_fraction >= GOAL_GOODPUT_FRACTION;
    if within(r.settle_after_step_up_s) && within(r.client_settle_after_step_up_s) && goodput {
        Some(true)
    } else if r.spike_windows_disturbed * 2 > r.spike_windows {
        // The machine took time from most of the spike: neither figure says what the server
        // does (goodput included).
        None
    } else if goodput
        && within(r.settle_after_step_up_undisturbed_s)
        && within(r.client_settle_after_step_up_undisturbed_s)
    {
        None
    } else {
        Some(false)
    }
}

pub fn run(a: SpikeArgs) -> Result<(), String> {
    if !(1.0..=3600.0).contains(&a.common.seconds)
        || !(10..=100_000).contains(&a.burn_us)
        || !(1..=60_000).contains(&a.target_ms)
        || !(1.0..=50.0).contains(&a.spike)
        || !(1..=10_000).contains(&a.conns)
        || !(1..=REPEATS_MAX).contains(&a.common.repeats)
    {
        return Err(format!("--seconds 1..=3600, --burn-us 10..=100000, --target-ms 1..=60000, --spike 1..=50, --conns 1..=10000, --repeats 1..={REPEATS_MAX}"));
    }
    let cap = capacity(&a, (a.common.seconds / 10.0).clamp(0.5, 2.0))?;
    if cap <= 0.0 {
        return Err("capacity measured as 0 req/s".into());
    }
    let mut with: Vec<Run> = Vec::with_capacity(a.common.repeats);
    for _ in 0..a.common.repeats {
        with.push(one_run(&a, true, cap)?);
    }
    let settle_repeats: Vec<Option<f64>> = with.iter().map(|r| r.settle_after_step_up_s).collect();
    let goodput_repeats: Vec<f64> = with.iter().map(|r| r.spike_goodput_fraction).collect();
    // Median by settle time, "never" counting as longest.
    let mut order: Vec<usize> = (0..with.len()).collect();
    order.sort_by(|&i, &j| {
        let key = |k: usize| with[k].settle_after_step_up_s.unwrap_or(f64::INFINITY);
        key(i).total_cmp(&key(j))
    });
    let median = order[order.len() / 2];
    let median_run = with.swap_remove(median);
    let runs = vec![median_run, one_run(&a, false, cap)?];
    // Judged by the clients' windows (end-to-end p90) and the server's alike.
    let goal_met = verdict(&runs[0]);
    let r = Report {
        experiment: "overload-spike",
        machine: machine(),
        burn_us: a.burn_us,
        target_ms: a.target_ms,
        capacity_per_s: cap,
        spike_factor: a.spike,
        conns: a.conns,
        runs,
        settle_after_step_up_s_repeats: settle_repeats,
        spike_goodput_fraction_repeats: goodput_repeats,
        goal_settle_s: GOAL_SETTLE_S,
        goal_goodput_fraction: GOAL_GOODPUT_FRACTION,
        goal_met,
    };
    let mut t = Table::new(&[
        "admission",
        "phase",
        "offered/s",
        "ok/s",
        "p90 ms (end to end)",
        "p99 ms",
        "503 fraction",
        "other errors",
        "unfinished",
    ]);
    for run in &r.runs {
        for p in &run.phases {
            t.row(vec![
                if run.admission {
                    format!("p90 {} ms", a.target_ms)
                } else {
                    "none".into()
                },
                p.name.into(),
                format!("{:.0}", p.offered_per_s),
                format!("{:.0}", p.ok_per_s),
                format!("{:.1}", p.p90_ms),
                format!("{:.1}", p.p99_ms),
                format!("{:.3}", p.reject_fraction),
                p.other_errors.to_string(),
                p.unfinished.to_string(),
            ]);
        }
    }
    let opt = |v: Option<f64>| {
        v.map(|v| format!("{v:.2} s"))
            .unwrap_or_else(|| "never".into())
    };
    let mut ts = Table::new(&[
        "admission",
        "under target after step up (server)",
        "under target after step up (clients)",
        "spike windows over target",
        "spike goodput (× capacity)",
        "spike: worker CPU from OS",
        "spike: CPU in http.work",
        "spike: other CPU per 503",
        "under target after step down",
        "rejections stop after step down (server)",
        "(clients)",
    ]);
    for run in &r.runs {
        ts.row(vec![
            if run.admission {
                "p90 controller".into()
            } else {
                "none".to_string()
            },
            opt(run.settle_after_step_up_s),
            opt(run.client_settle_after_step_up_s),
            format!("{} of {}", run.spike_windows_over_target, run.spike_windows),
            format!("{:.2}", run.spike_goodput_fraction),
            run.spike_worker_os_cpu_fraction
                .map(|v| format!("{:.0} %", v * 100.0))
                .unwrap_or_else(|| "-".into()),
            run.spike_work_cpu_fraction
                .map(|v| format!("{:.0} %", v * 100.0))
                .unwrap_or_else(|| "-".into()),
            run.spike_other_cpu_us_per_reject
                .map(|v| format!("{v:.1} µs"))
                .unwrap_or_else(|| "-".into()),
            opt(run.settle_after_step_down_s),
            opt(run.rejects_stop_after_step_down_s),
            opt(run.client_rejects_stop_after_step_down_s),
        ]);
    }
    let med_settle = format!(
        "{} by the server's windows and {} by the clients'",
        opt(r.runs[0].settle_after_step_up_s),
        opt(r.runs[0].client_settle_after_step_up_s)
    );
    let repeats = r
        .settle_after_step_up_s_repeats
        .iter()
        .map(|v| opt(*v))
        .collect::<Vec<_>>()
        .join(", ");
    let m = &r.runs[0];
    let word = match r.goal_met {
        Some(true) => "**Goal met**",
        Some(false) => "**Goal not met**",
        None => "**Not judged**",
    };
    let mut verdict = format!(
        "{word}: the median run is back under the target {med_settle} after the step (goal ≤ {GOAL_SETTLE_S} s) \
         and serves {:.2}× capacity during the spike (goal ≥ {GOAL_GOODPUT_FRACTION}).",
        m.spike_goodput_fraction
    );
    verdict.push_str(&format!(
        " Disturbed windows (the machine took ≥ {:.0} % of the target from the run in them: steal over every CPU \
         plus the worker's and the load generator's run-queue wait, by the OS's counters): {} of {} spike windows; \
         the clients' spike windows over the target: {}, of which disturbed {}. With the disturbed windows over the \
         target set aside, back under the target {} by the server's windows and {} by the clients'.",
        DISTURBED_FRACTION_OF_TARGET * 100.0,
        m.spike_windows_disturbed,
        m.spike_windows,
        m.client_spike_windows_over_target,
        m.client_spike_windows_over_target_disturbed,
        opt(m.settle_after_step_up_undisturbed_s),
        opt(m.client_settle_after_step_up_undisturbed_s),
    ));
    if r.goal_met.is_none() {
        verdict.push_str(
            " The run missed the goal only through disturbed windows, or most of its spike windows were \
             disturbed, so the goal is not judged on it (neither met nor missed); a quieter run is needed.",
        );
    }
    let doc = Doc {
        title: format!(
            "overload-spike: a {}× load spike with and without p90 admission (SEDA Fig. 55)",
            a.spike
        ),
        command: format!(
            "omnistage exp overload-spike --seconds {} --repeats {} --burn-us {} --target-ms {} --spike {} --conns {}",
            a.common.seconds, a.common.repeats, a.burn_us, a.target_ms, a.spike, a.conns
        ),
        machine: r.machine.clone(),
        intro: vec![
            format!(
                "The HTTP server (1 worker on CPU 0), one tenant serving /_burn?us={}. Its capacity was measured first with \
                 16 closed-loop connections: {cap:.0} req/s. The load generator (CPU 1, open loop over {} connection slots, \
                 latency from each request's intended send time) then offers 0.5× capacity for {:.1} s, {}× for {:.1} s and \
                 0.5× for {:.1} s, as three runs back to back; {} times with `p90_target_ms = {}` (the median run by settle \
                 time is shown; settle times of all runs: {repeats}) and once without. Phase rows are the load generator's; \
                 the settle times come from two instruments on the same 250 ms windows: the server's ledger (p90 of the \
                 response time at `http.work` of admitted requests — queueing inside the server) and the load generator's \
                 own windows (`--window-ms 250`: the clients' end-to-end p90 of the successes completed in each window).",
                a.burn_us,
                a.conns,
                a.common.seconds * 0.25,
                a.spike,
                a.common.seconds * 0.5,
                a.common.seconds * 0.25,
                a.common.repeats,
                a.target_ms
            ),
            format!("Admission is SEDA's p90 controller (a token bucket whose rate falls ×1/1.2 per run over the target and rises \
             additively well under it) plus a Little's-law bound on the tenant's work queue: at most {f} × target × the \
             measured completion rate may wait, so mean queueing stays near {f} × the target whatever the controller's \
             rate. How rejects are counted: every refusal happens at admission, before the request is queued, and is \
             answered at once with 503 + Retry-After; it counts in the 503 fraction and in the gate's rejections. No \
             request is dropped after it was queued, so every admitted request is served and counts in the p90. \
             The settle time is strict: from the first window after which *every* spike window is under the target \
             (a single late window over it, or one in which nothing completed, moves it to the end); the first window under the target came {first} after \
             the step in the median run.",
             f = r.runs[0].queue_bound_fraction.map(|f| f.to_string()).unwrap_or_else(|| "(none)".into()),
             first = opt(r.runs[0].first_under_target_after_step_up_s)),
            format!(
                "Goal: with admission, the p90 back under the target, by the server's windows and by the clients' alike, within {GOAL_SETTLE_S} s of the step \
                 (SEDA needed 1.58 s in Breakwater's test), while serving at least {GOAL_GOODPUT_FRACTION}× the capacity \
                 during the spike (shedding everything is not a win). {verdict}"
            ),
        ],
        tables: vec![
            ("Per phase (load generator)".into(), t),
            ("Time to get back under the target (250 ms windows, server and clients)".into(), ts),
        ],
        notes: vec![],
    };
    let series: Vec<(String, Vec<(f64, f64)>)> = r
        .runs
        .iter()
        .map(|run| {
            (
                if run.admission {
                    "p90 admission".to_string()
                } else {
                    "no admission".into()
                },
                run.windows
                    .iter()
                    .filter_map(|w| w.p90_ms.map(|p| (w.t_s, p.min(1000.0))))
                    .collect(),
            )
        })
        .chain(std::iter::once((
            format!("target {} ms", a.target_ms),
            vec![
                (0.0, a.target_ms as f64),
                (a.common.seconds, a.target_ms as f64),
            ],
        )))
        .collect();
    report::emit(
        "overload-spike",
        &r,
        &doc,
        a.common.json,
        a.common.out(),
        |p| {
            report::svg_lines(
                p,
                &format!(
                    "Server-side p90 per 250 ms through a {}x spike (clipped at 1 s)",
                    a.spike
                ),
                "time, s",
                "p90 at http.work, ms",
                &series,
            )
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_for_test(server: Option<f64>, clients: Option<f64>, goodput: f64) -> Run {
        Run {
            admission: true,
            phases: Vec::new(),
            windows: Vec::new(),
            settle_after_step_up_s: server,
            settle_after_step_down_s: Some(0.0),
            client_windows: Vec::new(),
            client_settle_after_step_up_s: clients,
            settle_after_step_up_undisturbed_s: server,
            client_settle_after_step_up_undisturbed_s: clients,
            spike_windows_disturbed: 0,
            client_spike_windows_over_target: 0,
            client_spike_windows_over_target_disturbed: 0,
            client_rejects_stop_after_step_down_s: Some(0.0),
            rejects_stop_after_step_down_s: Some(0.0),
            first_under_target_after_step_up_s: Some(0.0),
            queue_bound_fraction: Some(0.4),
            spike_windows_over_target: 0,
            spike_windows: 40,
            spike_goodput_fraction: goodput,
            spike_worker_os_cpu_fraction: None,
            spike_work_cpu_fraction: None,
            spike_other_cpu_us_per_reject: None,
        }
    }

    #[test]
    fn a_miss_through_disturbed_windows_only_is_not_judged_and_never_a_pass() {
        assert_eq!(
            verdict(&run_for_test(Some(0.0), Some(0.5), 0.8)),
            Some(true)
        );
        // The clients' late window was disturbed: met with it set aside, so not judged.
        let mut r = run_for_test(Some(0.0), Some(4.5), 0.8);
        r.client_settle_after_step_up_undisturbed_s = Some(0.0);
        assert_eq!(verdict(&r), None);
        // Missed with the disturbed windows set aside too: missed.
        r.client_settle_after_step_up_undisturbed_s = Some(2.0);
        assert_eq!(verdict(&r), Some(false));
        // Goodput short, few windows disturbed: missed, whatever the settle times.
        let mut r = run_for_test(Some(0.0), Some(0.0), 0.5);
        r.spike_windows_disturbed = 20;
        assert_eq!(verdict(&r), Some(false));
        // Most spike windows disturbed: not judged.
        r.spike_windows_disturbed = 21;
        assert_eq!(verdict(&r), None);
        // ...but a run that meets the goal strictly is met however disturbed.
        let mut r = run_for_test(Some(0.0), Some(0.0), 0.9);
        r.spike_windows_disturbed = 40;
        assert_eq!(verdict(&r), Some(true));
    }

    #[test]
    fn run_queue_wait_of_a_new_load_thread_counts_from_its_start() {
        let before: RunqReading = [Some((10, 1_000)), Some((20, 5_000))];
        // Same threads: the differences.
        let now: RunqReading = [Some((10, 1_500)), Some((20, 5_300))];
        assert_eq!(runqueue_delta_ns(&now, &before), Some(800));
        // The generator's thread of the next phase (a new id): its whole wait so far.
        let now: RunqReading = [Some((10, 1_500)), Some((21, 200))];
        assert_eq!(runqueue_delta_ns(&now, &before), Some(700));
        // Between phases, no generator thread: the worker's alone.
        let now: RunqReading = [Some((10, 1_500)), None];
        assert_eq!(runqueue_delta_ns(&now, &before), Some(500));
        // The worker unreadable: no figure.
        assert_eq!(runqueue_delta_ns(&[None, Some((20, 6_000))], &before), None);
    }
}
