//! `overhead` (Omni-Kernel §V-G): the worker's CPU per request at equal throughput with full
//! scheduling and accounting vs the bypass (`ServerOptions { bypass: true }`: FIFO, no ledger,
//! no clock read per dispatch; see `BYPASS_STILL_DOES`), for a 1 KiB
//! and a 1 MiB file. The load generator's open loop offers the same rate to both modes; the
//! worker's CPU is the OS's count (`CoreRow.os_cpu_ns`, published in both modes), divided by
//! the requests the server answered in the window. Rounds alternate the modes; medians.

use super::harness;
use super::report::{self, Doc, Table};
use super::rounds;
use super::util::machine;
use super::Common;
use clap::Args;
use serde::Serialize;
use std::time::Duration;

#[derive(Args, Clone)]
#[command(mut_arg("seconds", |a| a.default_value("3.0").help("Seconds per round per mode per file.")))]
#[command(mut_arg("repeats", |a| a.default_value("3")))]
#[command(mut_arg("out", |a| a.help("Write overhead.json, .md and .svg here.")))]
#[command(mut_arg("nginx", |a| a.hide(true)))]
pub struct OverheadArgs {
    /// Offered requests/s for the 1 KiB file.
    #[arg(long, default_value_t = 5000.0)]
    rate_small: f64,
    /// Offered requests/s for the 1 MiB file.
    #[arg(long, default_value_t = 300.0)]
    rate_large: f64,
    /// The server's `wake_credit_us` in scheduled mode (default: the server's default).
    #[arg(long, default_value_t = omnistage_http::config::WAKE_CREDIT_US_DEFAULT)]
    wake_credit_us: u64,
    #[command(flatten)]
    common: Common,
}

#[derive(Serialize)]
struct Round {
    file_bytes: usize,
    bypass: bool,
    req_per_s: f64,
    cpu_ns_per_request: f64,
    errors: u64,
}

#[derive(Serialize)]
struct FileResult {
    file_bytes: usize,
    rate_per_s: f64,
    scheduled_ns_per_request: f64,
    bypass_ns_per_request: f64,
    scheduled_req_per_s: f64,
    bypass_req_per_s: f64,
    /// (scheduled − bypass) / bypass of each repeat's two adjacent rounds (one per mode),
    /// in repeat order: pairing takes out the host's slow drift, which moves both modes.
    paired_fractions: Vec<f64>,
    /// The median of `paired_fractions`: the figure judged.
    fraction: f64,
    /// Half the range (max − min) of `paired_fractions`: the noise the verdict allows for.
    paired_spread: f64,
    /// (scheduled − bypass) / bypass of the two modes' medians, for comparison.
    fraction_of_medians: f64,
    /// The bypass's own run-to-run spread, (max − min) / median of its rounds.
    bypass_spread: f64,
    /// Met when fraction + paired spread ≤ the goal, missed when fraction − paired spread >
    /// the goal, `None` (inconclusive) when fraction ± paired spread holds the goal.
    goal_met: Option<bool>,
}

#[derive(Serialize)]
struct Report {
    experiment: &'static str,
    machine: String,
    seconds_per_round: f64,
    /// The server's wake credit, µs.
    wake_credit_us: u64,
    rounds: Vec<Round>,
    files: Vec<FileResult>,
    goal_fraction: f64,
}

const WARMUP_S: f64 = 0.5;
/// What the baseline is: what it leaves out, and the little it still does.
pub const BYPASS_STILL_DOES: &str = "The bypass (`Builder::bypass`, `omnistage serve --bypass`) \
     runs its own copy of the worker loop, chosen once when the worker starts, so neither mode \
     tests the mode per dispatch: a FIFO of ready queues instead of the scheduler tree, no \
     ledger (no cells, no histograms, no per-core time split), no batch-size or admission \
     controller feedback, and no clock read per dispatch: it reads the clock once every 32 \
     dispatches (timers, the I/O poll, the 10 ms counter flush) and around sleeps, and never \
     reads the OS's clocks around a sleep. It still counts messages handled (one add per \
     dispatch), keeps each core's pending count, fills each message's enqueue-time field with \
     the last clock reading (a store), and publishes the worker thread's OS CPU clock every \
     10 ms, which is what this experiment divides. Counted by callgrind \
     (`cargo run --release -p omnistage --example dispatch_cost`, docs/design.md): the \
     scheduled loop and the bypass differ by the instructions per dispatch given there.";
const GOAL: f64 = 0.03;
const CONNS: usize = 16;

fn round(
    bytes: usize,
    rate: f64,
    bypass: bool,
    seconds: f64,
    wake_credit_us: u64,
) -> Result<Round, String> {
    let web = harness::start_with(
        "overhead",
        &[("a", 100)],
        &[("f.bin", bytes)],
        bypass,
        &format!("wake_credit_us = {wake_credit_us}"),
    )?;
    let extra = vec![
        "--rate".into(),
        rate.to_string(),
        "--tenant".into(),
        format!("a:a.test:{CONNS}:path=/f.bin"),
    ];
    let args = harness::load_args(&web.addr, seconds, WARMUP_S, &extra)?;
    let h = harness::spawn_load(args);
    std::thread::sleep(Duration::from_secs_f64(WARMUP_S));
    let (s0, q0) = (web.server.runtime().snapshot(), web.requests());
    std::thread::sleep(Duration::from_secs_f64(seconds));
    let (s1, q1) = (web.server.runtime().snapshot(), web.requests());
    let rep = harness::join_load(h)?;
    web.stop();
    let cpu: u64 = harness::core_deltas(&s0, &s1)
        .iter()
        .map(|d| d.os_cpu_ns)
        .sum();
    Ok(Round {
        file_bytes: bytes,
        bypass,
        req_per_s: (q1 - q0) as f64 / seconds,
        cpu_ns_per_request: cpu as f64 / (q1 - q0).max(1) as f64,
        errors: rep.tenants.iter().map(harness::errors).sum(),
    })
}

/// (scheduled − bypass) / bypass.
pub fn overhead_fraction(scheduled: f64, bypass: f64) -> f64 {
    (scheduled - bypass) / bypass.max(f64::MIN_POSITIVE)
}

pub fn run(a: OverheadArgs) -> Result<(), String> {
    if !(0.2..=3600.0).contains(&a.common.seconds)
        || !(1..=50).contains(&a.common.repeats)
        || a.wake_credit_us > omnistage_http::config::WAKE_CREDIT_US_MAX as u64
    {
        return Err("--seconds 0.2..=3600, --repeats 1..=50, --wake-credit-us 0..=1000000".into());
    }
    let files = [(1024usize, a.rate_small), (1 << 20, a.rate_large)];
    let mut rounds = Vec::new();
    for i in 0..a.common.repeats {
        for &(bytes, rate) in &files {
            // Alternate which mode goes first.
            for bypass in [i % 2 == 1, i % 2 == 0] {
                rounds.push(round(
                    bytes,
                    rate,
                    bypass,
                    a.common.seconds,
                    a.wake_credit_us,
                )?);
            }
        }
    }
    let med = |bytes: usize, bypass: bool, f: fn(&Round) -> f64| {
        harness::median(
            &rounds
                .iter()
                .filter(|r| r.file_bytes == bytes && r.bypass == bypass)
                .map(f)
                .collect::<Vec<_>>(),
        )
    };
    let results: Vec<FileResult> = files
        .iter()
        .map(|&(bytes, rate)| {
            let s = med(bytes, false, |r| r.cpu_ns_per_request);
            let b = med(bytes, true, |r| r.cpu_ns_per_request);
            let fraction_of_medians = overhead_fraction(s, b);
            let of_mode = |bypass: bool| -> Vec<f64> {
                rounds
                    .iter()
                    .filter(|r| r.file_bytes == bytes && r.bypass == bypass)
                    .map(|r| r.cpu_ns_per_request)
                    .collect()
            };
            // Repeat i ran one round of each mode back to back, so the i-th of each pair up.
            let paired_fractions: Vec<f64> = of_mode(false)
                .iter()
                .zip(of_mode(true))
                .map(|(&s, b)| overhead_fraction(s, b))
                .collect();
            let pairs = rounds::Spread::of(&paired_fractions);
            let fraction = pairs.median;
            // One pair says nothing about its own noise.
            let paired_spread = if pairs.n < 2 {
                f64::INFINITY
            } else {
                (pairs.max - pairs.min) / 2.0
            };
            let bypass_spread = rounds::relative_spread(
                &rounds
                    .iter()
                    .filter(|r| r.file_bytes == bytes && r.bypass)
                    .map(|r| r.cpu_ns_per_request)
                    .collect::<Vec<_>>(),
            );
            FileResult {
                file_bytes: bytes,
                rate_per_s: rate,
                scheduled_ns_per_request: s,
                bypass_ns_per_request: b,
                scheduled_req_per_s: med(bytes, false, |r| r.req_per_s),
                bypass_req_per_s: med(bytes, true, |r| r.req_per_s),
                paired_fractions,
                fraction,
                paired_spread,
                fraction_of_medians,
                bypass_spread,
                goal_met: rounds::within_goal(fraction, paired_spread, GOAL),
            }
        })
        .collect();
    let r = Report {
        experiment: "overhead",
        machine: machine(),
        seconds_per_round: a.common.seconds,
        wake_credit_us: a.wake_credit_us,
        rounds,
        files: results,
        goal_fraction: GOAL,
    };
    let mut t = Table::new(&[
        "file",
        "offered req/s",
        "scheduled req/s",
        "bypass req/s",
        "scheduled CPU µs/req",
        "bypass CPU µs/req",
        "overhead (median of pairs)",
        "pairs' half range",
        "overhead of medians",
        "bypass spread",
        "goal ≤ 3 %",
    ]);
    for f in &r.files {
        t.row(vec![
            format!("{} B", f.file_bytes),
            format!("{:.0}", f.rate_per_s),
            format!("{:.0}", f.scheduled_req_per_s),
            format!("{:.0}", f.bypass_req_per_s),
            format!("{:.2}", f.scheduled_ns_per_request / 1000.0),
            format!("{:.2}", f.bypass_ns_per_request / 1000.0),
            format!("{:+.2} %", f.fraction * 100.0),
            format!("{:.1} %", f.paired_spread * 100.0),
            format!("{:+.2} %", f.fraction_of_medians * 100.0),
            format!("{:.1} %", f.bypass_spread * 100.0),
            match f.goal_met {
                Some(true) => "met",
                Some(false) => "not met",
                None => "inconclusive (3 % inside overhead ± half-range)",
            }
            .into(),
        ]);
    }
    let mut rt = Table::new(&["file", "mode", "req/s", "CPU µs/req", "errors"]);
    for x in &r.rounds {
        rt.row(vec![
            format!("{} B", x.file_bytes),
            if x.bypass { "bypass" } else { "scheduled" }.into(),
            format!("{:.0}", x.req_per_s),
            format!("{:.2}", x.cpu_ns_per_request / 1000.0),
            x.errors.to_string(),
        ]);
    }
    let doc = Doc {
        title: "overhead: CPU per request, scheduled vs FIFO bypass (Omni-Kernel §V-G)".into(),
        command: format!(
            "omnistage exp overhead --seconds {} --repeats {} --rate-small {} --rate-large {}",
            a.common.seconds, a.common.repeats, a.rate_small, a.rate_large
        ),
        machine: r.machine.clone(),
        intro: vec![format!(
            "The HTTP server (1 worker on CPU 0, 1 tenant, `wake_credit_us = {}`) with full scheduling and accounting, and with the bypass \
             (FIFO, no scheduler tree, no ledger, no clock read per dispatch), each offered the same open-loop rate by the load generator on CPU 1 \
             ({CONNS} connections). CPU per request = the worker thread's CPU time as the OS counts it / requests answered, \
             {} repeats of {} s per mode and file, each repeat one round of each mode back to back (the order alternating). \
             The overhead judged is the median over repeats of each pair's (scheduled − bypass) / bypass: pairing takes out \
             the host's slow drift, which on a shared VM moves both modes by more than the overhead sought (the bypass's \
             own spread is shown beside it, and the overhead of the two modes' medians). Goal: overhead ≤ 3 %, judged against \
             half the pairs' range: met when overhead + half-range ≤ 3 %, missed when overhead − half-range > 3 %, \
             inconclusive when 3 % lies between the two, whatever the overhead's sign.",
            r.wake_credit_us, a.common.repeats, a.common.seconds
        ), BYPASS_STILL_DOES.into()],
        tables: vec![
            (String::new(), t),
            ("Rounds:".into(), rt),
        ],
        notes: vec![],
    };
    let cats: Vec<String> = r
        .files
        .iter()
        .map(|f| format!("{} B", f.file_bytes))
        .collect();
    let series = vec![
        (
            "scheduled".to_string(),
            r.files
                .iter()
                .map(|f| f.scheduled_ns_per_request / 1000.0)
                .collect(),
        ),
        (
            "bypass".to_string(),
            r.files
                .iter()
                .map(|f| f.bypass_ns_per_request / 1000.0)
                .collect(),
        ),
    ];
    report::emit("overhead", &r, &doc, a.common.json, a.common.out(), |p| {
        report::svg_bars(
            p,
            "Worker CPU per request at equal rate",
            "µs per request",
            &cats,
            &series,
        )
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn overhead_fraction_is_relative_to_bypass() {
        assert!((super::overhead_fraction(103.0, 100.0) - 0.03).abs() < 1e-12);
        assert!((super::overhead_fraction(95.0, 100.0) + 0.05).abs() < 1e-12);
    }
}
