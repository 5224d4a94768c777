//! `classes` (SEDA Figs. 58–59): class-based admission. One tenant with a p90 target and two
//! request classes chosen by a header, `high` and `low`, each driven by 128 closed-loop
//! clients; the low class runs throughout and the high class joins a third of the way in. Run
//! twice: with class priorities (`priority = 0 / 1`: one class-based controller, SEDA's
//! ClassedP90, cuts the low class first) and without (each class its own p90 controller). The
//! ledger is read every 500 ms for each class's server-side p90 (response time at `http.work`),
//! completions and rejections.

use super::cfgweb;
use super::harness;
use super::report::{self, Doc, Table};
use super::util::machine;
use super::windowing;
use super::Common;
use clap::Args;
use omnistage::account::HistSnapshot;
use serde::Serialize;
use std::time::{Duration, Instant};

#[derive(Args, Clone)]
#[command(mut_arg("seconds", |a| a.default_value("30.0").help("Seconds of one run (the high class joins after a third of it).")))]
#[command(mut_arg("out", |a| a.help("Write classes.json, .md and .svg here.")))]
#[command(mut_arg("repeats", |a| a.default_value("1").hide(true)))]
#[command(mut_arg("nginx", |a| a.hide(true)))]
pub struct ClassesArgs {
    /// CPU per request, µs.
    #[arg(long, default_value_t = 1000)]
    burn_us: u64,
    /// The tenant's p90 target (both classes), ms.
    #[arg(long, default_value_t = 50)]
    target_ms: u64,
    /// Closed-loop clients per class.
    #[arg(long, default_value_t = 128)]
    clients: usize,
    /// Load of one class alone, × the measured capacity (sets the clients' think time).
    #[arg(long, default_value_t = 0.8)]
    class_load: f64,
    #[command(flatten)]
    common: Common,
}

const TICK: Duration = Duration::from_millis(500);
const CLASSES: [&str; 2] = ["high", "low"];

#[derive(Serialize, Clone)]
struct ClassWindow {
    /// Server-side p90 in this window, ms (`null`: nothing finished).
    p90_ms: Option<f64>,
    ok_per_s: f64,
    rejected_per_s: f64,
    /// Rejections / (completions + rejections).
    reject_fraction: f64,
    /// The class's admission rate (token bucket) at the end of the window.
    admission_rate_per_s: Option<f64>,
    /// The class's Little's-law queue bound at the end of the window (`null`: none).
    queue_bound: Option<usize>,
}

#[derive(Serialize, Clone)]
struct Window {
    t_s: f64,
    /// `high`, `low`.
    classes: Vec<ClassWindow>,
}

#[derive(Serialize, Clone)]
struct ClassPhase {
    class: &'static str,
    /// Server-side p90 over the phase, ms.
    p90_ms: Option<f64>,
    ok_per_s: f64,
    reject_fraction: f64,
    /// Windows of the phase (with completions) whose p90 was over the target.
    windows_over_target: usize,
    windows: usize,
}

/// The phase with both classes as the load generator saw it.
#[derive(Serialize)]
struct ClientPhase {
    /// The high class's end-to-end p90, ms (`null`: not run, or no request succeeded).
    high_p90_ms: Option<f64>,
    high_completed: u64,
    high_reject_fraction: f64,
    low_completed: u64,
    low_reject_fraction: f64,
}

#[derive(Serialize)]
struct Run {
    priorities: bool,
    windows: Vec<Window>,
    /// Low class alone (before the high class joins).
    alone: ClassPhase,
    /// Both classes, from one second after the join to the end.
    both: Vec<ClassPhase>,
    /// The clients' view of the phase with both classes (the goal is judged on it too).
    client_both: ClientPhase,
    /// Load generator: per class, 503s / (successes + 503s) over its whole run.
    load_reject_fraction: Vec<f64>,
    load_ok_per_s: Vec<f64>,
}

#[derive(Serialize)]
struct Report {
    experiment: &'static str,
    machine: String,
    burn_us: u64,
    target_ms: u64,
    clients_per_class: usize,
    think_ms: f64,
    capacity_per_s: f64,
    join_at_s: f64,
    runs: Vec<Run>,
    /// With priorities, while both run: high's p90 ≤ target, low's reject fraction above
    /// high's, and high's reject fraction no higher than without priorities (SEDA: the high
    /// class is refused slightly less than before, the low class more); by the server's
    /// windows and by the clients' alike.
    goal_met: bool,
}

fn tenant_toml(target_ms: u64, priorities: bool) -> String {
    let mut s = format!(
        "[[tenant]]\nname = \"a\"\nhosts = [\"a.test\"]\ndocroot = \"/nonexistent-omnistage-docroot\"\nsynthetic = true\np90_target_ms = {target_ms}\n"
    );
    for (i, c) in CLASSES.iter().enumerate() {
        s.push_str(&format!(
            "[[tenant.class]]\nname = \"{c}\"\nheader = \"x-class: {c}\"\n"
        ));
        if priorities {
            s.push_str(&format!("priority = {i}\n"));
        }
    }
    s
}

fn capacity(burn_us: u64) -> Result<f64, String> {
    let (server, addr) = cfgweb::start(
        "",
        "[[tenant]]\nname = \"a\"\nhosts = [\"a.test\"]\ndocroot = \"/nonexistent-omnistage-docroot\"\nsynthetic = true\n",
    )?;
    let la = harness::load_args(
        &addr,
        1.0,
        0.3,
        &["--tenant".into(), format!("a:a.test:16:burn={burn_us}")],
    )?;
    let r = omnistage_load::run(&la)?;
    server.drain(Duration::from_millis(300));
    Ok(r.total.req_per_s)
}

fn hist(rt: &omnistage::exec::Runtime, id: u32, stage: u32) -> HistSnapshot {
    let mut h = HistSnapshot::default();
    for l in rt.latencies() {
        if l.activity == id && l.stage == stage {
            h.add(&l.response);
        }
    }
    h
}

fn one_run(a: &ClassesArgs, think_ms: f64, priorities: bool) -> Result<Run, String> {
    let (server, addr) = cfgweb::start("", &tenant_toml(a.target_ms, priorities))?;
    let rt = server.runtime();
    let work = server.work_stage();
    let ids: Vec<u32> = CLASSES
        .iter()
        .map(|c| {
            rt.activity_id(&format!("/tenants/a/{c}"))
                .ok_or("class activity")
        })
        .collect::<Result<_, _>>()?;
    let join_at = a.common.seconds / 3.0;
    let spec = |c: &str| {
        vec![
            "--tenant".to_string(),
            format!(
                "{c}:a.test:{}:burn={},header=X-Class:{c},think-ms={think_ms:.1}",
                a.clients, a.burn_us
            ),
            "--timeout-ms".into(),
            "30000".into(),
        ]
    };
    // The low class's clients also report per window, so their view of the phase with both
    // classes can be cut out of their one run.
    let low = harness::spawn_load(harness::load_args(
        &addr,
        a.common.seconds,
        0.0,
        &[
            spec("low"),
            vec!["--window-ms".into(), TICK.as_millis().to_string()],
        ]
        .concat(),
    )?);
    // The high class's clients measure from the same moment as the server's phase with both.
    let high_warmup = ((a.common.seconds - join_at) / 2.0).min(1.0);
    let start = Instant::now();
    let mut high = None;
    let mut prev_h: Vec<HistSnapshot> = ids.iter().map(|&id| hist(rt, id, work)).collect();
    let mut prev_r: Vec<u64> = ids.iter().map(|&id| rt.rejected(work, id)).collect();
    let mut windows = Vec::new();
    // Per window and class, the histogram delta (for phase percentiles).
    let mut deltas: Vec<Vec<HistSnapshot>> = Vec::new();
    let mut k = 1u32;
    let join = start + Duration::from_secs_f64(join_at);
    let done = |h: &Option<harness::LoadHandle>| h.as_ref().is_some_and(|h| h.is_finished());
    while start.elapsed().as_secs_f64() < a.common.seconds + 1.0
        && !(low.is_finished() && done(&high))
    {
        let due = start + TICK * k;
        let wake = if high.is_none() { due.min(join) } else { due };
        if let Some(d) = wake.checked_duration_since(Instant::now()) {
            std::thread::sleep(d);
        }
        if high.is_none() && Instant::now() >= join {
            high = Some(harness::spawn_load(harness::load_args(
                &addr,
                (a.common.seconds - join_at - high_warmup).max(0.1),
                high_warmup,
                &spec("high"),
            )?));
        }
        if Instant::now() < due {
            continue;
        }
        k += 1;
        let dt = TICK.as_secs_f64();
        let mut cw = Vec::new();
        let mut dw = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let h = hist(rt, id, work);
            let r = rt.rejected(work, id);
            let d = h.since(&prev_h[i]);
            let rej = r - prev_r[i];
            let n = d.count();
            cw.push(ClassWindow {
                p90_ms: d.percentile(0.9).map(|ns| ns as f64 / 1e6),
                ok_per_s: n as f64 / dt,
                rejected_per_s: rej as f64 / dt,
                reject_fraction: rej as f64 / (n + rej).max(1) as f64,
                admission_rate_per_s: rt.admission_rate(work, id),
                queue_bound: rt.queue_bound(work, id),
            });
            dw.push(d);
            prev_h[i] = h;
            prev_r[i] = r;
        }
        windows.push(Window {
            t_s: start.elapsed().as_secs_f64(),
            classes: cw,
        });
        deltas.push(dw);
    }
    let low_r = harness::join_load(low)?;
    let high_r = match high {
        Some(h) => Some(harness::join_load(h)?),
        None => None,
    };
    server.drain(Duration::from_millis(300));
    let tgt = a.target_ms as f64;
    let phase = |ci: usize, from: f64, to: f64| -> ClassPhase {
        let dt = TICK.as_secs_f64();
        let mut h = HistSnapshot::default();
        let (mut ok, mut rej, mut secs) = (0.0, 0.0, 0.0);
        let (mut over, mut n) = (0, 0);
        for (w, d) in windows.iter().zip(&deltas) {
            let mid = w.t_s - dt / 2.0;
            if mid <= from || mid >= to {
                continue;
            }
            let c = &w.classes[ci];
            h.add(&d[ci]);
            ok += c.ok_per_s * dt;
            rej += c.rejected_per_s * dt;
            secs += dt;
            if let Some(p) = c.p90_ms {
                n += 1;
                if p > tgt {
                    over += 1;
                }
            }
        }
        ClassPhase {
            class: CLASSES[ci],
            p90_ms: h.percentile(0.9).map(|ns| ns as f64 / 1e6),
            ok_per_s: ok / secs.max(1e-9),
            reject_fraction: rej / (ok + rej).max(1.0),
            windows_over_target: over,
            windows: n,
        }
    };
    let frac = |r: &omnistage_load::report::Report| {
        let t = &r.total;
        t.errors.rejected_503 as f64 / (t.requests + t.errors.rejected_503).max(1) as f64
    };
    // The clients' view of the phase with both classes: the high class's whole measured run,
    // the low class's windows over the same span.
    let low_windows = windowing::client_windows(&low_r, 0.0);
    let (low_ok, low_rej) = windowing::totals(
        &low_windows,
        TICK.as_secs_f64(),
        join_at + high_warmup,
        a.common.seconds,
    );
    let client_both = ClientPhase {
        high_p90_ms: high_r.as_ref().and_then(answered_p90),
        high_completed: high_r.as_ref().map_or(0, |r| r.total.requests),
        high_reject_fraction: high_r.as_ref().map(frac).unwrap_or(0.0),
        low_completed: low_ok,
        low_reject_fraction: low_rej as f64 / (low_ok + low_rej).max(1) as f64,
    };
    Ok(Run {
        priorities,
        client_both,
        alone: phase(1, 0.0, join_at),
        both: (0..CLASSES.len())
            .map(|ci| phase(ci, join_at + 1.0, a.common.seconds))
            .collect(),
        load_reject_fraction: vec![high_r.as_ref().map(frac).unwrap_or(0.0), frac(&low_r)],
        load_ok_per_s: vec![
            high_r.as_ref().map(|r| r.total.req_per_s).unwrap_or(0.0),
            low_r.total.req_per_s,
        ],
        windows,
    })
}

/// The clients' p90 over the whole run; None when no request succeeded (the report's 0 is
/// not a latency, and would pass any target).
fn answered_p90(r: &omnistage_load::report::Report) -> Option<f64> {
    (r.total.requests > 0).then_some(r.total.p90_ms)
}

pub fn run(a: ClassesArgs) -> Result<(), String> {
    if !(1.5..=3600.0).contains(&a.common.seconds)
        || !(10..=100_000).contains(&a.burn_us)
        || !(1..=60_000).contains(&a.target_ms)
        || !(1..=1000).contains(&a.clients)
        || !(0.05..=10.0).contains(&a.class_load)
    {
        return Err("--seconds 1.5..=3600, --burn-us 10..=100000, --target-ms 1..=60000, --clients 1..=1000, --class-load 0.05..=10".into());
    }
    let cap = capacity(a.burn_us)?;
    if cap <= 0.0 {
        return Err("capacity measured as 0 req/s".into());
    }
    // Closed loop: clients / (think + response) ≈ class_load × capacity, with short responses.
    let think_ms = (a.clients as f64 / (a.class_load * cap) * 1000.0).clamp(0.0, 60_000.0);
    let runs = vec![one_run(&a, think_ms, true)?, one_run(&a, think_ms, false)?];
    let tgt = a.target_ms as f64;
    let (with, without) = (&runs[0], &runs[1]);
    // The server's figures and the clients' must both say so.
    let (cw, cwo) = (&with.client_both, &without.client_both);
    let goal_met = with.both[0].p90_ms.is_some_and(|p| p <= tgt)
        && with.both[1].reject_fraction > with.both[0].reject_fraction
        && with.both[0].reject_fraction <= without.both[0].reject_fraction
        && cw.high_p90_ms.is_some_and(|p| p <= tgt)
        && cw.low_reject_fraction > cw.high_reject_fraction
        && cw.high_reject_fraction <= cwo.high_reject_fraction;
    let r = Report {
        experiment: "classes",
        machine: machine(),
        burn_us: a.burn_us,
        target_ms: a.target_ms,
        clients_per_class: a.clients,
        think_ms,
        capacity_per_s: cap,
        join_at_s: a.common.seconds / 3.0,
        runs,
        goal_met,
    };
    let mut t = Table::new(&[
        "controller",
        "phase",
        "class",
        "p90 ms (server)",
        "windows over target",
        "ok/s",
        "reject fraction",
    ]);
    let opt_ms = |v: Option<f64>| v.map(|v| format!("{v:.1}")).unwrap_or_else(|| "-".into());
    for run in &r.runs {
        let name = if run.priorities {
            "class priorities"
        } else {
            "one per class"
        };
        let mut rows = vec![("low alone", &run.alone)];
        rows.extend(run.both.iter().map(|p| ("both", p)));
        for (ph, p) in rows {
            t.row(vec![
                name.into(),
                ph.into(),
                p.class.into(),
                opt_ms(p.p90_ms),
                format!("{} of {}", p.windows_over_target, p.windows),
                format!("{:.0}", p.ok_per_s),
                format!("{:.3}", p.reject_fraction),
            ]);
        }
    }
    let mut tl = Table::new(&[
        "controller",
        "class",
        "ok/s (whole run)",
        "503 fraction (whole run)",
    ]);
    for run in &r.runs {
        for (ci, c) in CLASSES.iter().enumerate() {
            tl.row(vec![
                if run.priorities {
                    "class priorities".into()
                } else {
                    "one per class".to_string()
                },
                (*c).into(),
                format!("{:.0}", run.load_ok_per_s[ci]),
                format!("{:.3}", run.load_reject_fraction[ci]),
            ]);
        }
    }
    let (hb, lb) = (&r.runs[0].both[0], &r.runs[0].both[1]);
    let verdict = format!(
        "**Goal {}**: with class priorities, while both classes run, the high class's server-side p90 is {} ms \
         (target {}) with reject fraction {:.3} ({:.3} without priorities), and the low class's reject fraction is \
         {:.3} ({:.3} without). By the clients (the load generator, end to end): high's p90 {} ms, reject fraction \
         {:.3} ({:.3} without) over {} completions; low's reject fraction {:.3} ({:.3} without) over {} completions. \
         Met means, by the server's figures and by the clients' alike: high's p90 within its target, low refused \
         more than high, and high refused no more than without priorities.",
        if r.goal_met { "met" } else { "not met" },
        opt_ms(hb.p90_ms),
        a.target_ms,
        hb.reject_fraction,
        r.runs[1].both[0].reject_fraction,
        lb.reject_fraction,
        r.runs[1].both[1].reject_fraction,
        opt_ms(r.runs[0].client_both.high_p90_ms),
        r.runs[0].client_both.high_reject_fraction,
        r.runs[1].client_both.high_reject_fraction,
        r.runs[0].client_both.high_completed,
        r.runs[0].client_both.low_reject_fraction,
        r.runs[1].client_both.low_reject_fraction,
        r.runs[0].client_both.low_completed
    );
    let doc = Doc {
        title: "classes: class-based admission, a high class joining mid-run (SEDA Figs. 58–59)".into(),
        command: format!(
            "omnistage exp classes --seconds {} --burn-us {} --target-ms {} --clients {} --class-load {}",
            a.common.seconds, a.burn_us, a.target_ms, a.clients, a.class_load
        ),
        machine: r.machine.clone(),
        intro: vec![
            format!(
                "The HTTP server (1 worker on CPU 0), one tenant serving /_burn?us={} with `p90_target_ms = {}` and two \
                 classes chosen by the `X-Class` header, `high` and `low` (equal weights). Capacity measured first: \
                 {cap:.0} req/s. The load generator (CPU 1) runs {} closed-loop clients per class with a think time of \
                 {think_ms:.0} ms (one class alone offers about {}× capacity); the low class runs for {} s, the high \
                 class joins at {:.1} s and runs to the end. Run twice: with `priority = 0` (high) and `priority = 1` \
                 (low), which puts both classes under one class-based controller (SEDA's: a higher class over its \
                 target, or refused by its queue bound, divides the lower classes' rates by 10 and holds them from \
                 increasing), and without priorities (each class its own p90 controller and queue bound).",
                a.burn_us, a.target_ms, a.clients, a.class_load, a.common.seconds, a.common.seconds / 3.0
            ),
            "Figures are the server's ledger, read every 500 ms: p90 of the response time at `http.work` of admitted \
             requests, completions, and rejections at the class's gate (token bucket or Little's-law queue bound; all \
             refusals happen before queueing and are answered with 503, so every admitted request is served). A \
             rejected client thinks and retries, like SEDA's clients."
                .into(),
            format!("Goal: the high class keeps its target; the low class absorbs the rejects. {verdict}"),
        ],
        tables: vec![
            ("Per phase and class (ledger)".into(), t),
            ("Per class, whole run (load generator)".into(), tl),
        ],
        notes: vec![
            "classes-rejects.svg charts each class's reject fraction per window.".into(),
        ],
    };
    let mut series = Vec::new();
    let mut rejects = Vec::new();
    for run in &r.runs {
        for (ci, c) in CLASSES.iter().enumerate() {
            let name = format!(
                "{c}, {}",
                if run.priorities {
                    "priorities"
                } else {
                    "no priorities"
                }
            );
            series.push((
                name.clone(),
                run.windows
                    .iter()
                    .filter_map(|w| w.classes[ci].p90_ms.map(|p| (w.t_s, p.min(10.0 * tgt))))
                    .collect::<Vec<_>>(),
            ));
            rejects.push((
                name,
                run.windows
                    .iter()
                    .map(|w| (w.t_s, w.classes[ci].reject_fraction))
                    .collect::<Vec<_>>(),
            ));
        }
    }
    series.push((
        format!("target {} ms", a.target_ms),
        vec![(0.0, tgt), (a.common.seconds, tgt)],
    ));
    report::emit("classes", &r, &doc, a.common.json, a.common.out(), |p| {
        report::svg_lines(
            p,
            "Server-side p90 per class per 500 ms (clipped at 10x target)",
            "time, s",
            "p90 at http.work, ms",
            &series,
        )?;
        report::svg_lines(
            &p.with_file_name("classes-rejects.svg"),
            "Reject fraction per class per 500 ms",
            "time, s",
            "rejected / (served + rejected)",
            &rejects,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_class_without_answers_has_no_p90() {
        // The high class got nothing: the report's p90 of 0 is no latency under the target.
        let t = harness::tenant_for_test("high");
        let r = harness::report_for_test(vec![t.clone()], t, 10.0);
        assert_eq!(answered_p90(&r), None);
        let mut t = harness::tenant_for_test("high");
        (t.requests, t.p90_ms) = (500, 12.0);
        let r = harness::report_for_test(vec![t.clone()], t, 10.0);
        assert_eq!(answered_p90(&r), Some(12.0));
    }
}
