//! `shared-backend`: what fair slots buy when tenants share a slow backend. One upstream with
//! `concurrency_max = 16` in front of a backend ([`super::backend`]) that holds every request
//! 20 ms and limits nothing itself; it counts the requests it holds, so whether it stays busy
//! is measured by the backend, not by the proxy. Tenant a sends a modest open-loop rate (far
//! below its half of the backend); tenant b floods (hundreds of closed-loop connections). Two
//! phases: a alone, then a while b floods. Side by side in the same run: omnistage with
//! `fair = true` (per-tenant queues, SFQ over the slots), omnistage with `fair = false` (one
//! FIFO queue), and nginx with `max_conns` on the upstream server (what open-source nginx can
//! do: it answers 502 when the slots are taken, counted here).
//!
//! Goals (judged for `fair = true`; the others are the baselines): a's p99 with b flooding at
//! most 1.5× its p99 alone (the clients' clock, open loop, measured from each request's
//! scheduled time), no errors for a, and the backend's mean requests in flight during the flood
//! at least 90 % of the 16 slots (b takes what a leaves).

use super::backend::{Backend, Tally};
use super::nginx::{self, Tuning};
use super::report::{self, Doc, Table};
use super::util::machine;
use super::{cfgweb, harness, proxy_vs_nginx, Common};
use clap::Args;
use omnistage_load::TenantReport;
use serde::Serialize;
use std::path::Path;
use std::time::{Duration, Instant};

/// The upstream's slots.
const SLOTS: usize = 16;
/// Goal: a's p99 with b flooding at most this × alone.
const GOAL_P99_RATIO: f64 = 1.5;
/// Goal: the backend's mean in flight during the flood at least this fraction of the slots.
const GOAL_BUSY_FRACTION: f64 = 0.9;
/// Warm-up before each measured window (b's connections all open and queued by then).
const WARMUP_S: f64 = 1.0;
/// Connections of tenant a (open loop: enough that a late response never holds back a send).
const A_CONNS: usize = 64;

#[derive(Args, Clone)]
#[command(mut_arg("seconds", |a| a.default_value("10.0").help("Measured seconds of each phase.")))]
#[command(mut_arg("repeats", |a| a.default_value("1")))]
pub struct SharedBackendArgs {
    /// Tenant a's open-loop rate, requests/s (the backend's capacity is 16 / 20 ms = 800/s).
    #[arg(long, default_value_t = 100.0)]
    a_rate: f64,
    /// Tenant b's closed-loop connections.
    #[arg(long, default_value_t = 256)]
    b_conns: usize,
    /// How long the backend holds each request, ms.
    #[arg(long, default_value_t = 20)]
    backend_ms: u64,
    #[command(flatten)]
    common: Common,
}

#[derive(Serialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
enum Phase {
    Alone,
    Flood,
}

#[derive(Serialize, Clone)]
struct Row {
    repeat: usize,
    server: &'static str,
    phase: Phase,
    a_req_per_s: f64,
    a_p50_ms: f64,
    a_p99_ms: f64,
    /// a's successful responses in the measured window.
    a_requests: u64,
    /// a's requests in flight, or due and not sent, at the end: in no latency above.
    a_unfinished: u64,
    /// How long the oldest of them had waited by then, ms (`null`: none).
    a_unfinished_oldest_ms: Option<f64>,
    a_errors: u64,
    /// a's 502s (nginx refusing at `max_conns`) and 503s (omnistage's queue bounds).
    a_502_503: u64,
    b_req_per_s: f64,
    b_errors: u64,
    /// Mean requests the backend held over the measured window, by its own count.
    backend_in_flight_mean: f64,
    /// Most it held at once in the window (a proxy that stops waiting for a response the
    /// backend still works on frees its slot early: then this exceeds the slots).
    backend_in_flight_max: u64,
}

#[derive(Serialize)]
struct Verdict {
    server: &'static str,
    /// Median over the repeats in which a got answers alone; None when it got none in any.
    a_p99_alone_ms: Option<f64>,
    /// Median over the repeats in which a got answers while b flooded; None when it got none
    /// in any (every request refused or failed).
    a_p99_flood_ms: Option<f64>,
    /// None then too: a p99 of nothing is not 0 ms, and the ratio would read as a win.
    p99_ratio: Option<f64>,
    /// Repeats (either phase) in which a got no answer at all: each is a miss.
    a_unanswered_repeats: usize,
    /// Repeats (either phase) in which a left more requests unfinished at the end than 1/99 of
    /// those it completed ([`harness::p99_stands`]): their p99 may be an unfinished request's,
    /// which nobody measured, so the ratio is not judged.
    a_unsettled_repeats: usize,
    a_errors: u64,
    backend_in_flight_mean: f64,
    /// All three goals met; missed when one is (a repeat without answers included); `null`
    /// when nothing was missed but a repeat's p99 does not stand (`a_unsettled_repeats`).
    goal_met: Option<bool>,
}

#[derive(Serialize)]
struct Report {
    experiment: &'static str,
    machine: String,
    seconds_per_phase: f64,
    repeats: usize,
    slots: usize,
    backend_ms: u64,
    a_rate_per_s: f64,
    b_conns: usize,
    rows: Vec<Row>,
    /// Per server, the median repeat's figures.
    verdicts: Vec<Verdict>,
    peer_cpus: Vec<String>,
    nginx_note: Option<String>,
    /// The goals met by omnistage with `fair = true` (`null`: not judged).
    goal_met: Option<bool>,
}

fn errors_5xx(t: &TenantReport) -> u64 {
    t.errors.http_5xx + t.errors.rejected_503
}

/// One phase against `addr`: the load, with the backend's tally read at the window's edges.
fn phase(
    a: &SharedBackendArgs,
    addr: &str,
    backend: &Backend,
    phase: Phase,
) -> Result<(TenantReport, Option<TenantReport>, f64, u64), String> {
    let mut extra = vec![
        "--tenant".to_string(),
        format!("a:a.test:{A_CONNS}:path=/x,rate={}", a.a_rate),
    ];
    if phase == Phase::Flood {
        extra.extend(["--tenant".into(), format!("b:b.test:{}:path=/x", a.b_conns)]);
    }
    let args = harness::load_args(addr, a.common.seconds, WARMUP_S, &extra)?;
    let h = harness::spawn_load(args);
    std::thread::sleep(Duration::from_secs_f64(WARMUP_S));
    let (t0, at0) = (backend.tally_window(), Instant::now());
    std::thread::sleep(Duration::from_secs_f64(a.common.seconds));
    let (t1, at1): (Tally, Instant) = (backend.tally_window(), Instant::now());
    let r = harness::join_load(h)?;
    let mean = t1.mean_in_flight_since(&t0, (at1 - at0).as_secs_f64());
    let find = |n: &str| r.tenants.iter().find(|t| t.name == n).cloned();
    let ta = find("a").ok_or("no report for tenant a")?;
    Ok((ta, find("b"), mean, t1.in_flight_max))
}

const SERVERS: [&str; 3] = ["omnistage fair", "omnistage fifo", "nginx max_conns"];

fn omnistage_config(backend: &Backend, fair: bool) -> String {
    format!(
        "[[upstream]]\nname = \"be\"\nservers = [\"{}\"]\nconcurrency_max = {SLOTS}\nfair = {fair}\n\n\
         [[tenant]]\nname = \"a\"\nhosts = [\"a.test\"]\nweight = 1\nupstream = \"be\"\n\n\
         [[tenant]]\nname = \"b\"\nhosts = [\"b.test\"]\nweight = 1\nupstream = \"be\"\n",
        backend.addr()
    )
}

pub fn run(a: SharedBackendArgs) -> Result<(), String> {
    a.common.check(1.0)?;
    if !(1.0..=10_000.0).contains(&a.a_rate)
        || !(1..=10_000).contains(&a.b_conns)
        || !(1..=10_000).contains(&a.backend_ms)
    {
        return Err("--a-rate 1..=10000, --b-conns 1..=10000, --backend-ms 1..=10000".into());
    }
    let dir = std::env::temp_dir().join(format!("omnistage-shared-backend-{}", std::process::id()));
    let result = measure(&a, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    let report = result?;
    page(&a, &report)
}

fn measure(a: &SharedBackendArgs, dir: &Path) -> Result<Report, String> {
    let backend = Backend::start(64, Duration::from_millis(a.backend_ms), harness::LOAD_CPU)?;
    let nginx_ok = a.common.nginx.exists();
    let nginx_note = (!nginx_ok).then(|| {
        format!(
            "{} not found: nginx not installed; omnistage alone",
            a.common.nginx.display()
        )
    });
    let mut rows = Vec::new();
    let mut peer_cpus = Vec::new();
    for repeat in 0..a.common.repeats {
        let mut order: Vec<&'static str> = SERVERS.to_vec();
        if !nginx_ok {
            order.pop();
        }
        if repeat % 2 == 1 {
            order.reverse();
        }
        for server in order {
            for ph in [Phase::Alone, Phase::Flood] {
                let (ra, rb, mean, max) = if server == "nginx max_conns" {
                    let port = nginx::free_port()?;
                    let block = proxy_vs_nginx::nginx_proxy_block(
                        port,
                        backend.addr(),
                        &format!(" max_conns={SLOTS}"),
                        SLOTS,
                    );
                    let ng = nginx::start(
                        &a.common.nginx,
                        dir,
                        port,
                        a.b_conns + A_CONNS,
                        Tuning::default(),
                        &block,
                    )?;
                    let r = phase(a, &format!("127.0.0.1:{port}"), &backend, ph)?;
                    peer_cpus.push(ng.serving_cpus()?);
                    r
                } else {
                    let (srv, addr) = cfgweb::start(
                        "connections_max = 100000",
                        &omnistage_config(&backend, server == "omnistage fair"),
                    )?;
                    let r = phase(a, &addr, &backend, ph);
                    srv.drain(Duration::from_millis(200));
                    r?
                };
                rows.push(Row {
                    repeat: repeat + 1,
                    server,
                    phase: ph,
                    a_req_per_s: ra.req_per_s,
                    a_p50_ms: ra.p50_ms,
                    a_p99_ms: ra.p99_ms,
                    a_requests: ra.requests,
                    a_unfinished: ra.unfinished,
                    a_unfinished_oldest_ms: ra.unfinished_oldest_ms,
                    a_errors: harness::errors(&ra),
                    a_502_503: errors_5xx(&ra),
                    b_req_per_s: rb.as_ref().map_or(0.0, |b| b.req_per_s),
                    b_errors: rb.as_ref().map_or(0, harness::errors),
                    backend_in_flight_mean: mean,
                    backend_in_flight_max: max,
                });
            }
        }
    }
    let verdicts: Vec<Verdict> = SERVERS
        .iter()
        .filter_map(|&server| judge(server, &rows))
        .collect();
    let goal_met = verdicts
        .iter()
        .find(|v| v.server == "omnistage fair")
        .and_then(|v| v.goal_met);
    Ok(Report {
        experiment: "shared-backend",
        machine: machine(),
        seconds_per_phase: a.common.seconds,
        repeats: a.common.repeats,
        slots: SLOTS,
        backend_ms: a.backend_ms,
        a_rate_per_s: a.a_rate,
        b_conns: a.b_conns,
        rows,
        verdicts,
        peer_cpus,
        nginx_note,
        goal_met,
    })
}

/// The verdict on `server` from its rows (None when it did not run). A repeat in which a got
/// no answer has no p99 (its report's 0 would read as the fastest repeat): the medians are
/// over the answered repeats only, and such a repeat is a miss of its own, as adversary's
/// unanswered rounds are.
fn judge(server: &'static str, rows: &[Row]) -> Option<Verdict> {
    let of = |ph: Phase| -> Vec<&Row> {
        rows.iter()
            .filter(|r| r.server == server && r.phase == ph)
            .collect()
    };
    let (alone, flood) = (of(Phase::Alone), of(Phase::Flood));
    if alone.is_empty() {
        return None;
    }
    let answered = |r: &Row| r.a_req_per_s > 0.0;
    let p99 = |v: &[&Row]| {
        harness::median_of(
            &v.iter()
                .filter(|r| answered(r))
                .map(|r| r.a_p99_ms)
                .collect::<Vec<f64>>(),
        )
    };
    let (p_alone, p_flood) = (p99(&alone), p99(&flood));
    let busy = harness::median(
        &flood
            .iter()
            .map(|r| r.backend_in_flight_mean)
            .collect::<Vec<f64>>(),
    );
    let a_errors: u64 = alone.iter().chain(&flood).map(|r| r.a_errors).sum();
    let a_unanswered_repeats = alone.iter().chain(&flood).filter(|r| !answered(r)).count();
    // Repeats answered whose p99 leaves out too many unfinished requests to stand.
    let a_unsettled_repeats = alone
        .iter()
        .chain(&flood)
        .filter(|r| answered(r) && !harness::p99_stands(r.a_requests, r.a_unfinished))
        .count();
    let ratio = flood_ratio(p_alone, p_flood);
    let missed = a_unanswered_repeats > 0
        || a_errors > 0
        || busy < GOAL_BUSY_FRACTION * SLOTS as f64
        || ratio.is_none();
    let goal_met = if missed {
        Some(false)
    } else if a_unsettled_repeats > 0 {
        None
    } else {
        ratio.map(|r| r <= GOAL_P99_RATIO)
    };
    Some(Verdict {
        server,
        a_p99_alone_ms: p_alone,
        a_p99_flood_ms: p_flood,
        p99_ratio: ratio,
        a_unanswered_repeats,
        a_unsettled_repeats,
        a_errors,
        backend_in_flight_mean: busy,
        goal_met,
    })
}

/// a's p99 while b floods over its p99 alone; None when a got no answer in either phase.
fn flood_ratio(p99_alone_ms: Option<f64>, p99_flood_ms: Option<f64>) -> Option<f64> {
    match (p99_alone_ms, p99_flood_ms) {
        (Some(alone), Some(flood)) if alone > 0.0 => Some(flood / alone),
        _ => None,
    }
}

fn page(a: &SharedBackendArgs, report: &Report) -> Result<(), String> {
    let mut t = Table::new(&[
        "repeat",
        "server",
        "phase",
        "a req/s",
        "a p50 ms",
        "a p99 ms",
        "a unfinished (oldest ms)",
        "a errors (502/503)",
        "b req/s",
        "b errors",
        "backend in flight mean / max",
    ]);
    for r in &report.rows {
        t.row(vec![
            r.repeat.to_string(),
            r.server.into(),
            match r.phase {
                Phase::Alone => "a alone",
                Phase::Flood => "b floods",
            }
            .into(),
            format!("{:.0}", r.a_req_per_s),
            format!("{:.1}", r.a_p50_ms),
            format!("{:.1}", r.a_p99_ms),
            match r.a_unfinished_oldest_ms {
                Some(age) if r.a_unfinished > 0 => format!("{} ({age:.0})", r.a_unfinished),
                _ => r.a_unfinished.to_string(),
            },
            format!("{} ({})", r.a_errors, r.a_502_503),
            format!("{:.0}", r.b_req_per_s),
            r.b_errors.to_string(),
            format!(
                "{:.1} / {}",
                r.backend_in_flight_mean, r.backend_in_flight_max
            ),
        ]);
    }
    let mut s = Table::new(&[
        "server",
        "a p99 alone ms",
        "a p99 b flooding ms",
        "ratio (goal ≤ 1.5)",
        "repeats a got no answer (goal 0)",
        "a errors (goal 0)",
        "backend in flight (goal ≥ 14.4)",
        "all",
    ]);
    let ms = |x: Option<f64>| x.map_or("no answers".into(), |x| format!("{x:.1}"));
    for v in &report.verdicts {
        s.row(vec![
            v.server.into(),
            ms(v.a_p99_alone_ms),
            ms(v.a_p99_flood_ms),
            v.p99_ratio.map_or(
                format!("— (a got no answers: {} errors)", v.a_errors),
                |x| format!("{x:.2}"),
            ),
            v.a_unanswered_repeats.to_string(),
            v.a_errors.to_string(),
            format!("{:.1}", v.backend_in_flight_mean),
            match v.goal_met {
                Some(true) => "yes".into(),
                Some(false) => "no".into(),
                None => format!(
                    "not judged: {} repeat(s) left over 1/99 of a's requests unfinished",
                    v.a_unsettled_repeats
                ),
            },
        ]);
    }
    let mut notes = vec![format!(
        "Goals for omnistage with fair = true: a's p99 while b floods ≤ {GOAL_P99_RATIO}× alone, \
         no errors for a, the backend's mean in flight during the flood ≥ {:.0} % of the {SLOTS} \
         slots (its own count): {}. The other two rows are the baselines the page compares with. \
         The p99s are medians over the repeats in which a got answers (a repeat without any has \
         no p99, not one of 0 ms), and a repeat in which a got no answer at all is a miss. A \
         repeat in which a left more requests unfinished at the end (in flight, or due and not \
         sent: in no latency) than 1/99 of those it completed leaves the ratio not judged: its \
         slowest 1 % may be those requests alone, whose latency nobody measured.",
        GOAL_BUSY_FRACTION * 100.0,
        match report.goal_met {
            Some(true) => "met",
            Some(false) => "not met",
            None => "not judged",
        }
    )];
    match &report.nginx_note {
        Some(n) => notes.push(n.clone()),
        None => {
            let mut c = report.peer_cpus.clone();
            c.sort_unstable();
            c.dedup();
            notes.push(format!(
                "nginx's worker was confined to CPU {} as read from /proc/PID/status after each \
                 of its {} runs: {}. nginx's `max_conns={SLOTS}` refuses with 502 when the slots \
                 are taken (no queue in open-source nginx); those 502s are a's and b's errors.",
                nginx::SERVER_CPU,
                report.peer_cpus.len(),
                c.join(", ")
            ));
        }
    }
    let doc = Doc {
        title: "shared-backend: a tenant's latency while another floods a shared backend".into(),
        command: format!(
            "omnistage exp shared-backend {} --a-rate {} --b-conns {} --backend-ms {}",
            a.common.words(),
            a.a_rate,
            a.b_conns,
            a.backend_ms
        ),
        machine: report.machine.clone(),
        intro: vec![format!(
            "One upstream with concurrency_max = {SLOTS}; its backend (inside the experiment, one \
             mio thread on CPU 1) holds every request {} ms and limits nothing itself, so it can \
             serve {:.0} requests/s through the {SLOTS} slots. Tenant a sends {} requests/s open \
             loop ({A_CONNS} connections, latency from each request's scheduled time); tenant b \
             floods with {} closed-loop connections; equal weights. Phases of {} s after {WARMUP_S} \
             s of warm-up: a alone, then a while b floods. The proxy runs one worker on CPU {} \
             (omnistage: one process, the fair and FIFO disciplines in turn; nginx: \
             `server ... max_conns={SLOTS}` with keepalive {SLOTS}); the load generator on CPU 1.",
            a.backend_ms,
            SLOTS as f64 * 1000.0 / a.backend_ms as f64,
            a.a_rate,
            a.b_conns,
            a.common.seconds,
            nginx::SERVER_CPU,
        )],
        tables: vec![("Verdicts".into(), s), ("Runs".into(), t)],
        notes,
    };
    report::emit(
        "shared-backend",
        report,
        &doc,
        a.common.json,
        a.common.out(),
        |p| {
            let cats: Vec<String> = report.verdicts.iter().map(|v| v.server.into()).collect();
            report::svg_bars(
                p,
                "tenant a's p99 (ms), alone and while b floods",
                "ms",
                &cats,
                &[
                    (
                        "a alone".into(),
                        report
                            .verdicts
                            .iter()
                            .map(|v| v.a_p99_alone_ms.unwrap_or(0.0))
                            .collect(),
                    ),
                    (
                        "b floods".into(),
                        report
                            .verdicts
                            .iter()
                            .map(|v| v.a_p99_flood_ms.unwrap_or(0.0))
                            .collect(),
                    ),
                ],
            )
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(phase: Phase, a_req_per_s: f64, a_p99_ms: f64) -> Row {
        Row {
            repeat: 1,
            server: "omnistage fair",
            phase,
            a_req_per_s,
            a_p50_ms: a_p99_ms / 2.0,
            a_p99_ms,
            a_requests: (a_req_per_s * 10.0) as u64,
            a_unfinished: 0,
            a_unfinished_oldest_ms: None,
            a_errors: 0,
            a_502_503: 0,
            b_req_per_s: 700.0,
            b_errors: 0,
            backend_in_flight_mean: 16.0,
            backend_in_flight_max: 16,
        }
    }

    #[test]
    fn a_repeat_without_answers_is_no_latency() {
        // a got nothing in the first flood repeat: its 0 ms p99 is not the fastest repeat.
        let mut rows = vec![row(Phase::Alone, 100.0, 2.0); 3];
        rows.extend([
            row(Phase::Flood, 0.0, 0.0),
            row(Phase::Flood, 100.0, 2.0),
            row(Phase::Flood, 100.0, 40.0),
        ]);
        let v = judge("omnistage fair", &rows).expect("ran");
        assert_ne!(
            v.p99_ratio,
            Some(1.0),
            "the median of [0, 2, 40] read 0 as a latency"
        );
        assert_eq!(
            v.goal_met,
            Some(false),
            "a repeat in which a got no answer is a miss"
        );
        // Every repeat answered: judged on the medians as before.
        let mut rows = vec![row(Phase::Alone, 100.0, 2.0); 3];
        rows.extend([
            row(Phase::Flood, 100.0, 2.0),
            row(Phase::Flood, 100.0, 2.5),
            row(Phase::Flood, 100.0, 40.0),
        ]);
        let v = judge("omnistage fair", &rows).expect("ran");
        assert_eq!(v.p99_ratio, Some(1.25));
        assert_eq!(v.goal_met, Some(true));
    }

    #[test]
    fn a_repeat_with_many_requests_unfinished_has_no_p99() {
        // While b flooded, a's last second went unanswered: 100 requests due beside the 1,000
        // it completed. Its p99 leaves them out.
        let mut rows = vec![row(Phase::Alone, 100.0, 2.0); 3];
        rows.extend(vec![row(Phase::Flood, 100.0, 2.5); 3]);
        rows[4].a_unfinished = 100;
        rows[4].a_unfinished_oldest_ms = Some(1000.0);
        let v = judge("omnistage fair", &rows).expect("ran");
        assert_eq!((v.goal_met, v.a_unsettled_repeats), (None, 1));
        // A few in flight, as any open loop leaves: judged.
        rows[4].a_unfinished = 3;
        assert_eq!(
            judge("omnistage fair", &rows).expect("ran").goal_met,
            Some(true)
        );
        // A miss stays a miss.
        rows[4].a_unfinished = 100;
        rows[0].a_errors = 1;
        assert_eq!(
            judge("omnistage fair", &rows).expect("ran").goal_met,
            Some(false)
        );
    }

    #[test]
    fn no_answers_is_no_ratio() {
        assert_eq!(flood_ratio(Some(20.0), Some(30.0)), Some(1.5));
        // nginx max_conns answering every one of a's requests 502: no p99, no ratio (it read
        // 0.00× before, as if a had been served instantly).
        assert_eq!(flood_ratio(Some(20.0), None), None);
        assert_eq!(flood_ratio(None, Some(30.0)), None);
        assert_eq!(flood_ratio(Some(0.0), Some(30.0)), None);
    }
}
