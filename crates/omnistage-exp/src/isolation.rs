//! `isolation` (Vortex Figs. 8–10): two tenants overloading the server with `/_burn` requests,
//! with weights 2:1, then 4:1, then strict priority (A first). The ledger is sampled every
//! 250 ms: each tenant's share of charged CPU and its requests/s (messages of `http.work`) over
//! time. Under strict priority B's load runs throughout and A's only in the middle third: B
//! should starve exactly while A is backlogged. Every phase is also judged on the clients'
//! completed requests (each the same fixed work): over the whole phase for the weights, in the
//! load generator's own 250 ms windows for priority.

use super::harness;
use super::report::{self, Doc, Table};
use super::share;
use super::util::machine;
use super::windowing;
use super::Common;
use clap::Args;
use omnistage::activity::ActivitySpec;
use omnistage::sched::PolicyKind;
use serde::Serialize;
use std::time::{Duration, Instant};

#[derive(Args, Clone)]
#[command(mut_arg("seconds", |a| a.default_value("18.0").help("Total measured seconds, split evenly over the three phases.")))]
#[command(mut_arg("out", |a| a.help("Write isolation.json, .md and .svg here.")))]
#[command(mut_arg("repeats", |a| a.default_value("1").hide(true)))]
#[command(mut_arg("nginx", |a| a.hide(true)))]
pub struct IsolationArgs {
    /// Connections per tenant (closed loop).
    #[arg(long, default_value_t = 16)]
    conns: usize,
    /// CPU per request, µs.
    #[arg(long, default_value_t = 200)]
    burn_us: u64,
    #[command(flatten)]
    common: Common,
}

#[derive(Serialize, Clone)]
struct Sample {
    t_s: f64,
    share_a: f64,
    share_b: f64,
    req_per_s_a: f64,
    req_per_s_b: f64,
}

#[derive(Serialize)]
struct Phase {
    name: String,
    weights: Option<(u32, u32)>,
    seconds: f64,
    samples: Vec<Sample>,
    share_a: f64,
    share_b: f64,
    /// CPU of A / CPU of B over the phase (weighted phases).
    share_ratio: Option<f64>,
    /// share_ratio / weight ratio − 1.
    ratio_error: Option<f64>,
    /// The clients' figures (weighted phases): A's completed requests / B's (each the same
    /// fixed work), its error against the weight ratio, and the fewer of the two counts.
    client_share_ratio: Option<f64>,
    client_ratio_error: Option<f64>,
    client_completions_min: Option<u64>,
    /// The clients' completions (A, B) over the phase (weighted phases), for `exp recheck`.
    client_completions: Option<(u64, u64)>,
    /// Strict priority: B's share while A was backlogged, and while it was not (the ledger's
    /// charged CPU in its 250 ms windows).
    b_share_while_a_loaded: Option<f64>,
    b_share_while_a_idle: Option<f64>,
    /// The same shares by the clients: B's completed requests / A's and B's together, in the
    /// load generator's own 250 ms windows over the same spans (each request the same work).
    client_b_share_while_a_loaded: Option<f64>,
    client_b_share_while_a_idle: Option<f64>,
    /// The clients' completions (A and B together) in those spans: (loaded, idle).
    client_completions_priority: Option<(u64, u64)>,
    /// The same per tenant: ((A, B) while A was loaded, (A, B) while it was idle).
    client_completions_by_tenant: Option<((u64, u64), (u64, u64))>,
    goal_met: bool,
}

#[derive(Serialize)]
struct Report {
    experiment: &'static str,
    machine: String,
    conns_per_tenant: usize,
    burn_us: u64,
    phases: Vec<Phase>,
    goal_ratio_error: f64,
}

const TICK: Duration = Duration::from_millis(250);
const WARMUP_S: f64 = 1.0;
const GOAL: f64 = 0.05;
/// Strict priority: B's share at most this while A is backlogged...
const PRIORITY_LOADED_MAX: f64 = 0.05;
/// ...and at least this while A is idle.
const PRIORITY_IDLE_MIN: f64 = 0.95;

/// |measured / target − 1|, the goal's measure.
pub fn ratio_error(measured: f64, target: f64) -> f64 {
    measured / target - 1.0
}

fn phase(
    name: &str,
    weights: Option<(u32, u32)>,
    seconds: f64,
    a: &IsolationArgs,
) -> Result<Phase, String> {
    let (wa, wb) = weights.unwrap_or((100, 100));
    let web = harness::start("isolation", &[("a", wa), ("b", wb)], &[], false)?;
    let rt = web.server.runtime();
    if weights.is_none() {
        rt.set_activity(
            "/tenants",
            ActivitySpec {
                policy: PolicyKind::Priority,
                ..Default::default()
            },
        )
        .map_err(|e| e.to_string())?;
        for (p, prio) in [("/tenants/a", 0), ("/tenants/b", 1)] {
            rt.set_activity(
                p,
                ActivitySpec {
                    priority: prio,
                    ..Default::default()
                },
            )
            .map_err(|e| e.to_string())?;
        }
    }
    let ids: Vec<u32> = ["/tenants/a", "/tenants/b"]
        .iter()
        .map(|p| rt.activity_id(p).ok_or("tenant activity"))
        .collect::<Result<_, _>>()?;
    let work = web.server.work_stage();
    let tenant = |n: &str| format!("{n}:{n}.test:{}:burn={}", a.conns, a.burn_us);
    // Under priority the clients count their completions per 250 ms window too, so B's
    // share while A is loaded comes from the clients as well as from the ledger.
    let priority = weights.is_none();
    let window_ms = TICK.as_millis().to_string();
    let load_extra = |n: &str| {
        let mut v = vec!["--tenant".to_string(), tenant(n)];
        if priority {
            v.extend(["--window-ms".to_string(), window_ms.clone()]);
        }
        v
    };
    let lb = harness::load_args(&web.addr, seconds, WARMUP_S, &load_extra("b"))?;
    // Under priority A's load runs only in the middle third; otherwise throughout.
    let (a_from, a_len) = if weights.is_none() {
        (seconds / 3.0, seconds / 3.0)
    } else {
        (0.0, seconds)
    };
    let la = harness::load_args(
        &web.addr,
        a_len,
        if weights.is_none() { 0.0 } else { WARMUP_S },
        &load_extra("a"),
    )?;
    let hb = harness::spawn_load(lb);
    let mut ha = if weights.is_some() {
        Some(harness::spawn_load(la.clone()))
    } else {
        None
    };
    std::thread::sleep(Duration::from_secs_f64(WARMUP_S));
    let start = Instant::now();
    let mut prev = rt.snapshot();
    let mut samples = Vec::new();
    let (mut tot_a, mut tot_b) = (0u64, 0u64);
    let (mut in_a, mut in_b, mut out_a, mut out_b) = (0u64, 0u64, 0u64, 0u64);
    let mut k = 1u32;
    // When A's load actually started (its clients' windows count from there).
    let mut a_started_s = 0.0;
    while start.elapsed().as_secs_f64() < seconds - 1e-3 {
        if ha.is_none() && start.elapsed().as_secs_f64() >= a_from {
            a_started_s = start.elapsed().as_secs_f64();
            ha = Some(harness::spawn_load(la.clone()));
        }
        let due = start + TICK * k;
        if let Some(d) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(d);
        }
        k += 1;
        let now = rt.snapshot();
        let t = start.elapsed().as_secs_f64();
        let d = |id: u32, st: Option<u32>| {
            let (c1, m1) = harness::activity_totals(&now, id, st);
            let (c0, m0) = harness::activity_totals(&prev, id, st);
            (c1 - c0, m1 - m0)
        };
        let (ca, _) = d(ids[0], None);
        let (cb, _) = d(ids[1], None);
        let (_, ma) = d(ids[0], Some(work));
        let (_, mb) = d(ids[1], Some(work));
        let sum = (ca + cb).max(1) as f64;
        let dt = TICK.as_secs_f64();
        samples.push(Sample {
            t_s: t,
            share_a: ca as f64 / sum,
            share_b: cb as f64 / sum,
            req_per_s_a: ma as f64 / dt,
            req_per_s_b: mb as f64 / dt,
        });
        tot_a += ca;
        tot_b += cb;
        // Priority windows, leaving out one tick at each edge of A's load.
        let mid = t - dt / 2.0;
        if mid > a_from + dt && mid < a_from + a_len - dt {
            in_a += ca;
            in_b += cb;
        } else if mid < a_from - dt / 2.0 || mid > a_from + a_len + dt {
            out_a += ca;
            out_b += cb;
        }
        prev = now;
    }
    let rb = harness::join_load(hb)?;
    let ra = match ha {
        Some(h) => Some(harness::join_load(h)?),
        None => None,
    };
    // The clients' count of completed requests, A and B, over the same measured window
    // (weighted phases only: under priority A's load covers only the middle third).
    let client = match (weights, &ra) {
        (Some(_), Some(ra)) => Some((ra.total.requests, rb.total.requests)),
        _ => None,
    };
    web.stop();
    // Priority by the clients: each tenant's completions in the same spans as the ledger's
    // windows (one window left out at each edge of A's load).
    let dt = TICK.as_secs_f64();
    let client_priority = match (priority, &ra) {
        (true, Some(ra)) => {
            let wb = windowing::client_windows(&rb, 0.0);
            let wa = windowing::client_windows(ra, a_started_s);
            let span = |w: &[windowing::ClientWindow], from: f64, to: f64| {
                windowing::totals(w, dt, from, to).0
            };
            let (lo, hi) = (a_from + dt, a_from + a_len - dt);
            let loaded = (span(&wa, lo, hi), span(&wb, lo, hi));
            let (before, after) = (a_from - dt / 2.0, a_from + a_len + dt);
            let idle = (
                span(&wa, f64::MIN, before) + span(&wa, after, f64::MAX),
                span(&wb, f64::MIN, before) + span(&wb, after, f64::MAX),
            );
            Some((loaded, idle))
        }
        _ => None,
    };
    // No completions in a span: no figure (and no verdict), not a share of zero.
    let b_of = |(ca, cb): (u64, u64)| (ca + cb > 0).then(|| cb as f64 / (ca + cb) as f64);
    let sum = (tot_a + tot_b).max(1) as f64;
    let share_ratio = weights.map(|_| tot_a as f64 / tot_b.max(1) as f64);
    let ratio_err =
        weights.map(|(x, y)| ratio_error(tot_a as f64 / tot_b.max(1) as f64, x as f64 / y as f64));
    let b_in = weights
        .is_none()
        .then(|| in_b as f64 / (in_a + in_b).max(1) as f64);
    let b_out = weights
        .is_none()
        .then(|| out_b as f64 / (out_a + out_b).max(1) as f64);
    let client_ratio = client.map(|(ca, cb)| ca as f64 / cb.max(1) as f64);
    let client_ratio_err = weights
        .zip(client_ratio)
        .map(|((x, y), r)| ratio_error(r, x as f64 / y as f64));
    let client_b_in = client_priority.and_then(|(l, _)| b_of(l));
    let client_b_out = client_priority.and_then(|(_, i)| b_of(i));
    let goal_met = match (ratio_err, b_in, b_out, client_b_in, client_b_out) {
        (Some(e), ..) => e.abs() <= GOAL && client_ratio_err.is_some_and(|c| c.abs() <= GOAL),
        (None, Some(i), Some(o), Some(ci), Some(co)) => {
            i <= PRIORITY_LOADED_MAX
                && o >= PRIORITY_IDLE_MIN
                && ci <= PRIORITY_LOADED_MAX
                && co >= PRIORITY_IDLE_MIN
        }
        _ => false,
    };
    Ok(Phase {
        name: name.into(),
        weights,
        seconds,
        samples,
        share_a: tot_a as f64 / sum,
        share_b: tot_b as f64 / sum,
        share_ratio,
        ratio_error: ratio_err,
        client_share_ratio: client_ratio,
        client_ratio_error: client_ratio_err,
        client_completions_min: client.map(|(a, b)| a.min(b)),
        client_completions: client,
        b_share_while_a_loaded: b_in,
        b_share_while_a_idle: b_out,
        client_b_share_while_a_loaded: client_b_in,
        client_b_share_while_a_idle: client_b_out,
        client_completions_priority: client_priority.map(|(l, i)| (l.0 + l.1, i.0 + i.1)),
        client_completions_by_tenant: client_priority,
        goal_met,
    })
}

pub fn run(a: IsolationArgs) -> Result<(), String> {
    if !(1.5..=3600.0).contains(&a.common.seconds)
        || !(1..=1000).contains(&a.conns)
        || a.burn_us > 100_000
    {
        return Err("--seconds 1.5..=3600, --conns 1..=1000, --burn-us 0..=100000".into());
    }
    let per = a.common.seconds / 3.0;
    let phases = vec![
        phase("2:1", Some((200, 100)), per, &a)?,
        phase("4:1", Some((400, 100)), per, &a)?,
        phase("priority", None, per, &a)?,
    ];
    let r = Report {
        experiment: "isolation",
        machine: machine(),
        conns_per_tenant: a.conns,
        burn_us: a.burn_us,
        phases,
        goal_ratio_error: GOAL,
    };
    let pct = |v: Option<f64>| {
        v.map(|v| format!("{:.1} %", v * 100.0))
            .unwrap_or_else(|| "-".into())
    };
    let both = |l: Option<f64>, c: Option<f64>| match (l, c) {
        (None, None) => "-".to_string(),
        _ => format!("{} / {}", pct(l), pct(c)),
    };
    let mut t = Table::new(&[
        "phase",
        "share A",
        "share B",
        "A/B ratio",
        "ratio error",
        "client A/B ratio",
        "client ratio error",
        "client completions (fewer)",
        "B share while A loaded (ledger / clients)",
        "B share while A idle (ledger / clients)",
        "goal",
    ]);
    for p in &r.phases {
        t.row(vec![
            p.name.clone(),
            format!("{:.3}", p.share_a),
            format!("{:.3}", p.share_b),
            p.share_ratio
                .map(|v| format!("{v:.3}"))
                .unwrap_or_else(|| "-".into()),
            p.ratio_error
                .map(|v| format!("{:+.1} %", v * 100.0))
                .unwrap_or_else(|| "-".into()),
            p.client_share_ratio
                .map(|v| format!("{v:.3}"))
                .unwrap_or_else(|| "-".into()),
            p.client_ratio_error
                .map(|v| format!("{:+.1} %", v * 100.0))
                .unwrap_or_else(|| "-".into()),
            p.client_completions_min
                .map(|v| v.to_string())
                .unwrap_or_else(|| "-".into()),
            both(p.b_share_while_a_loaded, p.client_b_share_while_a_loaded),
            both(p.b_share_while_a_idle, p.client_b_share_while_a_idle),
            if p.goal_met { "met" } else { "not met" }.into(),
        ]);
    }
    let doc = Doc {
        title: "isolation: CPU shares of two overloaded tenants over time (Vortex Figs. 8–10)".into(),
        command: format!(
            "omnistage exp isolation --seconds {} --conns {} --burn-us {}",
            a.common.seconds, a.conns, a.burn_us
        ),
        machine: r.machine.clone(),
        intro: vec![format!(
            "The HTTP server (1 worker on CPU 0) with tenants A and B, each offered {} closed-loop connections of \
             /_burn?us={} by the load generator on CPU 1 (far more than one core). Three phases of {per:.1} s: weights \
             2:1, weights 4:1, and strict priority (`/tenants` policy `priority`, A level 0, B level 1) with B's load \
             throughout and A's only from {:.1} s to {:.1} s. Shares are of charged CPU, sampled every 250 ms. Goal: the \
             A/B CPU ratio within 5 % of the weight ratio, both by the ledger's charged CPU and by the \
             clients' completed requests (each the same fixed work, counted by the load generator); under priority, B's share \
             ≤ 5 % while A is loaded and ≥ 95 % otherwise, both by the ledger's 250 ms windows and by the clients' own 250 ms \
             windows (`omnistage load --window-ms 250`; B's completions over A's and B's, one window left out at each edge \
             of A's load).",
            a.conns,
            a.burn_us,
            per / 3.0,
            2.0 * per / 3.0
        )],
        tables: vec![(String::new(), t)],
        notes: isolation_notes(&r),
    };
    let mut series = Vec::new();
    let mut off = 0.0;
    for p in &r.phases {
        series.push((
            format!("A share ({})", p.name),
            p.samples
                .iter()
                .map(|s| (off + s.t_s, s.share_a))
                .collect::<Vec<_>>(),
        ));
        off += p.seconds;
    }
    report::emit("isolation", &r, &doc, a.common.json, a.common.out(), |p| {
        report::svg_lines(
            p,
            "Tenant A's share of charged CPU (2:1, then 4:1, then priority)",
            "time, s",
            "share of CPU",
            &series,
        )
    })
}

/// The caveats the run's own figures call for: too few completions for the clients' figures.
fn isolation_notes(r: &Report) -> Vec<String> {
    let mut notes = Vec::new();
    for p in &r.phases {
        if let Some(n) = p
            .client_completions_min
            .filter(|&n| n < share::COMPLETIONS_MIN)
        {
            notes.push(format!(
                "Phase {}: the clients counted only {n} completions for one tenant (fewer than {}): \
                 too few for a ratio exact to 5 %; run longer.",
                p.name,
                share::COMPLETIONS_MIN
            ));
        }
    }
    for p in &r.phases {
        if let Some((loaded, idle)) = p.client_completions_priority {
            if loaded.min(idle) < share::COMPLETIONS_MIN {
                notes.push(format!(
                    "Phase {}: the clients completed {loaded} requests while A was loaded and {idle} \
                     while it was idle (fewer than {} in one span): too few for a share exact to \
                     5 %; run longer.",
                    p.name,
                    share::COMPLETIONS_MIN
                ));
            }
        }
    }
    notes
}

#[cfg(test)]
mod tests {
    #[test]
    fn ratio_error_is_relative() {
        assert!((super::ratio_error(2.1, 2.0) - 0.05).abs() < 1e-12);
    }
}
