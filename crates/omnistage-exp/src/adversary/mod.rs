//! `adversary` (QLinux LRP, TAP §1): a victim tenant sized by the server's CPU (the open-loop
//! rate at which it alone uses a third of the worker's CPU by the OS's clock), measured alone
//! and then while an adversary tenant on the same server attacks it with many keep-alive connections, large files, slow readers and slowloris, each switchable.
//! omnistage (two tenants, one worker pinned to CPU 0, in this process) and nginx (the same two
//! `server_name` virtual hosts, one worker on CPU 0) are measured the same way.
//!
//! Owns the attack clients that the load generator does not have: slow readers (a small
//! `SO_RCVBUF`, a few KiB read per tick) and slowloris (a request head one byte at a time),
//! each one thread over a fixed set of non-blocking sockets that stops by itself at a deadline.
//! Floods and large files are the load generator (`omnistage-load`, in process). Every client
//! runs on CPU 1; the adversary's threads run under SCHED_IDLE so that on the
//! shared load CPU they take what the victim's generator leaves rather than delaying its sends.

use super::awake;
use super::cfgweb;
use super::harness;
use super::nginx;
use super::report::{self, Doc, Table};
use super::rounds::{self, Spread};
use super::util::machine;
use super::windowing::{self, ClientWindow};
use super::Common;
use clap::Args;
use omnistage::account::{HistSnapshot, LatencyRow, StretchRow};
use omnistage::activity::INFRA;
use serde::Serialize;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The attack kinds, in the order they are run one by one.
const KINDS: [&str; 4] = ["many-conns", "large-files", "slow-readers", "slowloris"];
const SMALL: &str = "small.html";
const SMALL_BYTES: usize = 1024;
const LARGE: &str = "large.bin";
/// Victim connections (open loop, keep-alive).
const VICTIM_CONNS: usize = 128;
/// Name of the load generator's (first) thread.
const LOAD_THREAD: &str = "load-0";
/// Closed-loop connections fetching the large file.
const LARGE_CONNS: usize = 8;
/// Time the adversary gets to open its connections before the victim is measured.
const RAMP: Duration = Duration::from_millis(1500);
/// Victim warmup in each phase, seconds.
const WARMUP_S: f64 = 0.5;
/// Seconds of the victim's closed-loop capacity run on each server.
const CAPACITY_S: f64 = 2.0;
/// Measured seconds of each victim-sizing pre-run, and how many.
const SIZING_S: f64 = 1.0;
const SIZING_STEPS: usize = 3;
/// A step this far above the target still counts as on it (the OS's clock over one second).
const SIZING_SLACK: f64 = 0.02;
/// The sizing never offers more than this fraction of the closed-loop capacity.
const SIZING_CAP_FRACTION: f64 = 0.7;
/// Goal for the stretches in which omnistage's worker can pick nothing else (each dispatch,
/// each I/O round): p99 ≤ this, µs.
const STRETCH_P99_GOAL_US: f64 = 200.0;
/// The victim's clients count their latencies per window of this many ms too (a phase's p99
/// can hide a bad stretch; its worst window shows it).
const VICTIM_WINDOW_MS: u64 = 250;
/// Tick of the slow-reader and slowloris loops.
const SLOW_TICK: Duration = Duration::from_millis(100);
/// Receive buffer of a slow reader's socket, bytes.
const SLOW_RCVBUF_BYTES: usize = 4096;
/// Bytes a slow reader reads per tick.
const SLOW_READ_BYTES: usize = 4096;
/// A slowloris connection sends one byte this often.
const SLOWLORIS_BYTE_EVERY: Duration = Duration::from_secs(2);
/// Connect timeout of the attack threads' sockets.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// The same timeouts on both servers.
const HEADER_TIMEOUT_MS: u64 = 10_000;
const KEEPALIVE_TIMEOUT_MS: u64 = 5_000;
const SERVER_CONNECTIONS_MAX: usize = 10_000;
/// Open files kept free beyond two per connection (listeners, files, stdio).
const FD_SLACK: u64 = 200;
/// Per-tenant connection limit on omnistage (40 % of the server's).
const TENANT_CONNECTIONS_MAX: usize = 4_000;

#[derive(Args, Clone)]
#[command(mut_arg("seconds", |a| a.default_value("4.0").help("Measured seconds of the victim in each phase.")))]
#[command(mut_arg("out", |a| a.help("Write adversary.json, .md and .svg here.")))]
pub struct AdversaryArgs {
    /// Attack kinds, comma-separated: many-conns, large-files, slow-readers, slowloris.
    #[arg(
        long,
        default_value = "many-conns,large-files,slow-readers,slowloris",
        value_delimiter = ','
    )]
    attacks: Vec<String>,
    /// Also run each attack kind alone (after the combined attack).
    #[arg(long)]
    per_kind: bool,
    /// The victim's size: the open-loop rate at which the victim alone uses this fraction of
    /// the server worker's CPU by the OS's clock (found by a pre-run on each server; the lower
    /// rate of the two is used on both). Below the victim's share (half, at equal weights) so
    /// that the goal is reachable: a victim that asks for more than its share must queue.
    #[arg(long, default_value_t = 0.33)]
    victim_cpu: f64,
    /// The victim tenant's weight on omnistage (the adversary's is 100). With equal weights a
    /// victim at half the server's capacity asks for exactly its share, with no slack.
    #[arg(long, default_value_t = 100)]
    victim_weight: u32,
    /// The server's `wake_credit_us` (CPU µs a tenant that was idle may take ahead of the busy
    /// one; default: the server's default).
    #[arg(long, default_value_t = omnistage_http::config::WAKE_CREDIT_US_DEFAULT)]
    wake_credit_us: u64,
    /// Victim rate, requests/s (overrides --victim-cpu; no capacity or sizing run).
    #[arg(long)]
    victim_rate: Option<f64>,
    /// The victim generator's busy-poll window (omnistage load --spin-us).
    #[arg(long, default_value_t = 0)]
    victim_spin_us: u64,
    /// Seconds of each configuration's pre-run that picks nginx's configuration (the victim's
    /// closed-loop capacity alone, as http-vs-nginx picks by requests/s).
    #[arg(long, default_value_t = 1.0)]
    pick_seconds: f64,
    /// Keep-alive connections of the many-conns flood (closed loop, no think time).
    #[arg(long, default_value_t = 2000)]
    flood_conns: usize,
    /// Size of the large file, bytes.
    #[arg(long, default_value_t = 4 << 20)]
    large_bytes: usize,
    /// Slow-reader connections.
    #[arg(long, default_value_t = 50)]
    slow_readers: usize,
    /// Slowloris connections.
    #[arg(long, default_value_t = 300)]
    slowloris_conns: usize,
    /// Also run the victim in closed loop, alone and under the combined attack (phases
    /// `closed-alone` and `closed-all`): the same connections, each waiting `connections /
    /// rate` after every response, so that it offers the sized rate when answered at once.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    closed_loop: bool,
    /// Run the adversary's client threads under SCHED_IDLE on the load CPU, so that they take
    /// only the CPU the victim's generator leaves and never delay its wakeups (false: normal).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    adversary_idle: bool,
    /// In phases without an attack, keep the server's CPU and the clients' from halting (a
    /// SCHED_IDLE thread spins on each): on a VM a halted vCPU is resumed late, and only the
    /// phases whose CPUs go idle (the victim alone) paid that (false: let them halt).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    keep_awake: bool,
    /// Stamp the attack's responses in the kernel too (the load generator's `--kernel-stamps`
    /// for the adversary's clients), so the flood's latency is also given from each send to the
    /// kernel's receipt, without its SCHED_IDLE clients' own delays. Off by default: the stamps
    /// cost the attack's clients CPU, and the default attack is the one the goals are judged on.
    #[arg(long)]
    attack_kernel_stamps: bool,
    #[command(flatten)]
    common: Common,
}

mod attack;
mod model;
mod page;

use attack::*;
use model::*;
use page::emit;

fn victim_of(r: &omnistage_load::report::Report) -> Victim {
    let t = &r.total;
    Victim {
        req_per_s: t.req_per_s,
        p50_ms: t.p50_ms,
        p99_ms: t.p99_ms,
        max_ms: t.max_ms,
        kernel_p50_ms: t.kernel_p50_ms,
        kernel_p99_ms: t.kernel_p99_ms,
        errors: harness::errors(t),
        errors_by_kind: serde_json::to_value(t.errors).unwrap_or_default(),
        requests: t.requests,
        unfinished: t.unfinished,
        unfinished_oldest_ms: t.unfinished_oldest_ms,
    }
}

/// Closed-loop capacity of the victim alone over `seconds`, req/s.
fn capacity(addr: &str, seconds: f64) -> Result<f64, String> {
    let args = harness::load_args(
        addr,
        seconds,
        WARMUP_S,
        &[
            "--tenant".into(),
            format!("victim:victim.test:{VICTIM_CONNS}:path=/{SMALL}"),
        ],
    )?;
    Ok(omnistage_load::run(&args)?.total.req_per_s)
}

/// The victim's sizing on one server: the rates tried and the worker's CPU at each.
#[derive(Serialize, Clone)]
struct Sizing {
    server: String,
    /// (offered req/s, fraction of the worker's CPU by the OS's clock) per pre-run.
    tried: Vec<(f64, f64)>,
    /// The rate picked for the target.
    rate_per_s: f64,
    /// The fraction of the worker's CPU aimed at.
    target: f64,
}

impl Sizing {
    fn describe(&self) -> String {
        let tried: Vec<String> = self
            .tried
            .iter()
            .map(|(r, f)| format!("{r:.0} req/s → {:.0} %", f * 100.0))
            .collect();
        let reached = self
            .tried
            .iter()
            .any(|(_, f)| (f - self.target).abs() <= SIZING_SLACK);
        format!(
            "{}: {}, picked {:.0} req/s{}",
            self.server,
            tried.join(", "),
            self.rate_per_s,
            if reached {
                ""
            } else {
                " (target NOT reached within 70 % of the closed-loop capacity: the load \
                 generator, not the server, limited the rate)"
            }
        )
    }
}

/// Pre-runs of the victim alone, open loop, that find the rate at which the server's worker
/// spends `target` of its CPU on it (the OS's clock: the worker's schedstat). CPU per request
/// is near constant at these loads, so each step scales the rate by target / measured; three
/// steps, starting from `target` × the closed-loop capacity.
fn size_victim(tg: &Target<'_>, cap: f64, target: f64) -> Result<Sizing, String> {
    let Some(stat) = tg.schedstat.as_deref() else {
        return Err(format!(
            "{}: the worker's schedstat is not readable; give --victim-rate",
            tg.server
        ));
    };
    let mut rate = (cap * target.min(SIZING_CAP_FRACTION)).max(100.0);
    let mut tried = Vec::new();
    for _ in 0..SIZING_STEPS {
        let args = harness::load_args(
            tg.addr,
            SIZING_S,
            WARMUP_S,
            &[
                "--tenant".into(),
                format!("victim:victim.test:{VICTIM_CONNS}:path=/{SMALL},rate={rate:.0}"),
            ],
        )?;
        let h = harness::spawn_load(args);
        std::thread::sleep(Duration::from_secs_f64(WARMUP_S));
        let (c0, t0) = (cpu_ns(stat), Instant::now());
        std::thread::sleep(Duration::from_secs_f64(SIZING_S));
        let (c1, dt) = (cpu_ns(stat), t0.elapsed().as_secs_f64());
        harness::join_load(h)?;
        let f = match (c0, c1) {
            (Some(a), Some(b)) => b.saturating_sub(a) as f64 / 1e9 / dt,
            _ => return Err(format!("{}: schedstat unreadable", tg.server)),
        };
        tried.push((rate.round(), f));
        std::thread::sleep(Duration::from_millis(200));
        // Scale toward the target, never past SIZING_CAP_FRACTION of the capacity (beyond it
        // the victim's own generator, not the server, sets its latency); an idle reading keeps
        // the rate.
        if f > 0.0 {
            rate = (rate * target / f).clamp(100.0, (cap * SIZING_CAP_FRACTION).max(100.0));
        }
    }
    // The tried rate whose CPU came closest to the target from below (else the lowest).
    let rate_per_s = tried
        .iter()
        .filter(|(_, f)| *f <= target + SIZING_SLACK)
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .or_else(|| tried.iter().min_by(|a, b| a.1.total_cmp(&b.1)))
        .map(|(r, _)| *r)
        .expect("at least one step");
    Ok(Sizing {
        server: tg.server.into(),
        tried,
        rate_per_s,
        target,
    })
}

/// CPU time (ns) from a `schedstat` file (`cpu_ns runqueue_ns timeslices`).
fn cpu_ns(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path)
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// A server under test: its name, address, and (omnistage) a ledger reader with the victim's
/// and the adversary's activity ids.
struct Target<'a> {
    server: &'static str,
    addr: &'a str,
    ledger: Option<&'a dyn Fn() -> omnistage::account::Snapshot>,
    /// omnistage: the worker's stretch histograms (dispatches, I/O rounds).
    stretches: Option<&'a dyn Fn() -> Vec<StretchRow>>,
    /// omnistage: the runtime's queue-wait histograms per (activity, stage, core).
    latencies: Option<&'a dyn Fn() -> Vec<LatencyRow>>,
    ids: (u32, u32),
    /// The server's `schedstat` file (its one worker thread): where its run-queue wait is read.
    schedstat: Option<PathBuf>,
}

/// Run-queue wait (ns) from a `schedstat` file (`cpu_ns runqueue_ns timeslices`).
fn runqueue_ns(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path)
        .ok()?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Thread ids of this process whose name is `name`.
fn tids_named(name: &str) -> Vec<u64> {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    dir.flatten()
        .filter(|e| std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.trim() == name))
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

/// The `schedstat` of the thread named `name` that is not among `old` (waits up to 0.5 s for
/// it to appear).
fn new_thread_schedstat(name: &str, old: &[u64]) -> Option<PathBuf> {
    for _ in 0..50 {
        if let Some(t) = tids_named(name).into_iter().find(|t| !old.contains(t)) {
            return Some(PathBuf::from(format!("/proc/self/task/{t}/schedstat")));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

/// The victim's pacing at `rate`: open loop at that rate, or closed loop with each connection
/// waiting `connections / rate` after every response (the same rate when answered at once).
fn victim_pacing(rate: f64, closed: bool) -> String {
    if closed {
        format!("think-ms={:.3}", VICTIM_CONNS as f64 / rate * 1e3)
    } else {
        format!("rate={rate}")
    }
}

/// Runs the victim at `rate` for one phase, with `kinds` attacking (none: alone), in open or
/// closed loop.
fn phase(
    a: &AdversaryArgs,
    tg: &Target<'_>,
    rate: f64,
    name: &str,
    kinds: &[&str],
    closed: bool,
) -> Result<Phase, String> {
    // Until the phase ends: a phase without an attack would otherwise leave its CPUs idle
    // enough to halt (`awake.rs`).
    let _awake = (a.keep_awake && kinds.is_empty())
        .then(|| awake::KeepAwake::start(&[nginx::SERVER_CPU, harness::LOAD_CPU]));
    let attack = if kinds.is_empty() {
        None
    } else {
        let total = RAMP + Duration::from_secs_f64(WARMUP_S + a.common.seconds + 0.5);
        let at = start_attack(a, kinds, tg.addr, total)?;
        std::thread::sleep(RAMP);
        Some(at)
    };
    let args = harness::load_args(
        tg.addr,
        a.common.seconds,
        WARMUP_S,
        &[
            "--spin-us".into(),
            a.victim_spin_us.to_string(),
            "--window-ms".into(),
            VICTIM_WINDOW_MS.to_string(),
            "--kernel-stamps".into(),
            "--tenant".into(),
            format!(
                "victim:victim.test:{VICTIM_CONNS}:path=/{SMALL},{}",
                victim_pacing(rate, closed)
            ),
        ],
    )?;
    // The victim's generator thread is the one named like the load generator's that the
    // attack did not start: its run-queue wait says how much of the victim's latency was its
    // own CPU's doing, not the server's.
    let old = tids_named(LOAD_THREAD);
    let h = harness::spawn_load(args);
    let gen_stat = new_thread_schedstat(LOAD_THREAD, &old);
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(WARMUP_S).saturating_sub(t0.elapsed()));
    let before = tg.ledger.map(|f| f());
    let stretch0 = tg.stretches.map(|f| f());
    let lat0 = tg.latencies.map(|f| f());
    let gen0 = gen_stat.as_deref().and_then(runqueue_ns);
    let srv0 = tg.schedstat.as_deref().and_then(runqueue_ns);
    let steal = || {
        (
            omnistage::exec::cpu_steal_ns(nginx::SERVER_CPU),
            omnistage::exec::cpu_steal_ns(harness::LOAD_CPU),
        )
    };
    let steal0 = steal();
    let mut gen1 = gen0;
    let mut srv1 = srv0;
    let mut steal1 = steal0;
    let t_measure = Instant::now();
    while !h.is_finished() {
        // Read until the generator ends (its last reading is at most one tick old).
        if t_measure.elapsed().as_secs_f64() <= a.common.seconds {
            gen1 = gen_stat.as_deref().and_then(runqueue_ns).or(gen1);
            srv1 = tg.schedstat.as_deref().and_then(runqueue_ns).or(srv1);
            let now = steal();
            steal1 = (now.0.or(steal1.0), now.1.or(steal1.1));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = harness::join_load(h);
    let after = tg.ledger.map(|f| f());
    let stretches = match (stretch0, tg.stretches.map(|f| f())) {
        (Some(b), Some(e)) => Some(Stretches::between(&b, &e)),
        _ => None,
    };
    let victim_queue_wait = match (lat0, tg.latencies.map(|f| f())) {
        (Some(b), Some(e)) => Some(QueueWait::between(&b, &e, tg.ids.0)),
        _ => None,
    };
    let ms = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / 1e6),
        _ => None,
    };
    let adversary = match attack {
        Some(at) => Some(finish_attack(at)?),
        None => None,
    };
    let r = r?;
    let ledger = match (before, after) {
        (Some(b), Some(e)) => {
            let cpu = |id: u32| {
                (harness::activity_totals(&e, id, None).0 as f64
                    - harness::activity_totals(&b, id, None).0 as f64)
                    / 1e6
            };
            let cores = harness::core_deltas(&b, &e);
            Some(Ledger {
                infra_cpu_ms: cpu(INFRA),
                victim_cpu_ms: cpu(tg.ids.0),
                adversary_cpu_ms: cpu(tg.ids.1),
                idle_ms: cores.iter().map(|c| c.idle_ns as f64).sum::<f64>() / 1e6,
                elapsed_ms: cores.iter().map(|c| c.elapsed_ns as f64).sum::<f64>() / 1e6,
            })
        }
        _ => None,
    };
    let victim_windows = windowing::client_windows(&r, 0.0);
    // Let the server close what the attack left behind before the next phase.
    std::thread::sleep(Duration::from_millis(500));
    Ok(Phase {
        round: 0,
        server: tg.server,
        phase: name.into(),
        victim_rate_per_s: rate,
        victim: victim_of(&r),
        adversary,
        p99_ratio: None,
        kernel_p99_ratio: None,
        victim_window_p99_max_ms: windowing::p99_max_ms(&victim_windows),
        victim_windows,
        ledger,
        stretches,
        victim_queue_wait,
        victim_generator_runqueue_ms: ms(gen0, gen1),
        server_runqueue_ms: ms(srv0, srv1),
        server_cpu_steal_ms: ms(steal0.0, steal1.0),
        load_cpu_steal_ms: ms(steal0.1, steal1.1),
        disturbed: is_disturbed(
            ms(steal0.0, steal1.0),
            ms(steal0.1, steal1.1),
            a.common.seconds,
        ),
        ratio_disturbed: false,
    })
}

/// More of a window than this taken by the hypervisor from the server's or the clients' CPU
/// marks a phase disturbed. Why 1 %: the goal is on the p99, the slowest 1 % of the victim's
/// requests, and requests that arrive while a CPU is taken away wait for it; a steal of 1 % of
/// the window can be that whole tail by itself (one stall of 30 ms in a 3 s phase at 15,000
/// requests a second delays 450 of 45,000 requests).
const STEAL_DISTURBED_FRACTION: f64 = 0.01;

/// Whether steal of `server_ms` and `load_ms` in a window of `seconds` disturbs a phase.
fn is_disturbed(server_ms: Option<f64>, load_ms: Option<f64>, seconds: f64) -> bool {
    let limit_ms = STEAL_DISTURBED_FRACTION * seconds * 1e3;
    server_ms.into_iter().chain(load_ms).any(|ms| ms > limit_ms)
}

/// Every phase against one server: capacity (unless the rate is given), alone, all selected
/// attacks at once, then each kind alone if asked.
fn run_server(
    a: &AdversaryArgs,
    tg: &Target<'_>,
    kinds: &[&str],
    rate: f64,
) -> Result<Vec<Phase>, String> {
    let mut out = vec![phase(a, tg, rate, "alone", &[], false)?];
    out.push(phase(a, tg, rate, "all", kinds, false)?);
    if a.per_kind && kinds.len() > 1 {
        for k in kinds {
            out.push(phase(a, tg, rate, k, &[k], false)?);
        }
    }
    set_ratios(&mut out);
    if a.closed_loop {
        let mut closed = vec![phase(a, tg, rate, "closed-alone", &[], true)?];
        closed.push(phase(a, tg, rate, "closed-all", kinds, true)?);
        set_ratios(&mut closed);
        out.extend(closed);
    }
    Ok(out)
}

/// Each phase after the first (the victim alone) gets its p99 ratios to the first's.
fn set_ratios(out: &mut [Phase]) {
    let Some((alone, rest)) = out.split_first_mut() else {
        return;
    };
    let alone_answered = alone.victim.req_per_s > 0.0;
    for p in rest {
        p.ratio_disturbed = alone.disturbed || p.disturbed;
        p.p99_ratio = attacked_ratio(alone_answered, alone.victim.p99_ms, &p.victim);
        p.kernel_p99_ratio = alone
            .victim
            .kernel_p99_ms
            .zip(p.victim.kernel_p99_ms)
            .and_then(|(a, k)| p99_ratio(alone_answered, a, p.victim.req_per_s > 0.0, k));
    }
}

/// The victim's attacked/alone p99 ratio, or None when a phase's victim got no answers.
fn attacked_ratio(alone_answered: bool, alone_p99_ms: f64, attacked: &Victim) -> Option<f64> {
    p99_ratio(
        alone_answered,
        alone_p99_ms,
        attacked.req_per_s > 0.0,
        attacked.p99_ms,
    )
}

/// attacked / alone, when both phases' victims were answered (on any instrument).
fn p99_ratio(
    alone_answered: bool,
    alone_p99_ms: f64,
    attacked_answered: bool,
    attacked_p99_ms: f64,
) -> Option<f64> {
    (alone_answered && alone_p99_ms > 0.0 && attacked_answered)
        .then(|| attacked_p99_ms / alone_p99_ms)
}

/// The ratios of `server` that the verdicts read (the combined attack's) and left out as
/// disturbed, as "round (loop)", in order. A disturbed per-kind phase does not count: no
/// verdict reads it.
fn rounds_disturbed(phases: &[Phase], server: &str) -> Vec<String> {
    let mut rounds: Vec<(usize, &str)> = phases
        .iter()
        .filter(|p| p.server == server && p.ratio_disturbed)
        .filter_map(|p| match p.phase.as_str() {
            "all" => Some((p.round, "open")),
            "closed-all" => Some((p.round, "closed")),
            _ => None,
        })
        .collect();
    rounds.sort_unstable();
    rounds.dedup();
    rounds
        .into_iter()
        .map(|(round, lp)| format!("{round} ({lp})"))
        .collect()
}

/// Rounds in which `server`'s victim got no answer at all under the combined attack (either
/// loop; a round counts once).
fn unanswered_rounds(phases: &[Phase], server: &str) -> usize {
    let mut rounds: Vec<usize> = phases
        .iter()
        .filter(|p| {
            p.server == server && ATTACKED.contains(&p.phase.as_str()) && p.victim.req_per_s <= 0.0
        })
        .map(|p| p.round)
        .collect();
    // A round counts once, in whichever loop (or both) its victim got nothing.
    rounds.sort_unstable();
    rounds.dedup();
    rounds.len()
}

/// Whether a phase's p99 stands for what its victim sent ([`harness::p99_stands`]).
fn p99_settled(v: &Victim) -> bool {
    harness::p99_stands(v.requests, v.unfinished)
}

/// Rounds whose ratio a verdict of `server` reads (the combined attack's, in either loop, not
/// left out as disturbed) in which the victim's p99, alone or attacked, does not stand
/// ([`p99_settled`]); a round counts once.
fn unsettled_rounds(phases: &[Phase], server: &str) -> usize {
    let mut rounds: Vec<usize> = phases
        .iter()
        .filter(|p| {
            p.server == server && ATTACKED.contains(&p.phase.as_str()) && !p.ratio_disturbed
        })
        .filter(|p| {
            let alone = if p.phase == "all" {
                "alone"
            } else {
                "closed-alone"
            };
            let alone_settled = phases
                .iter()
                .filter(|q| q.server == server && q.round == p.round && q.phase == alone)
                .all(|q| p99_settled(&q.victim));
            !(alone_settled && p99_settled(&p.victim))
        })
        .map(|p| p.round)
        .collect();
    rounds.sort_unstable();
    rounds.dedup();
    rounds.len()
}

/// The phases under the combined attack that the goal is judged on (open and closed loop).
const ATTACKED: [&str; 2] = ["all", "closed-all"];

/// omnistage's goal from its phases and the median ratios of each loop (`closed` read only
/// when the closed loop ran). Met when every loop measured meets (a victim with no answer at
/// all in some round, or with errors under attack, is a miss, whatever the other rounds'
/// ratio); not judged when a loop has no ratio, or when a round read left too many of the
/// victim's requests unfinished for its p99 to stand ([`unsettled_rounds`]).
fn judge_goal(
    phases: &[Phase],
    closed_loop: bool,
    open: Option<f64>,
    closed: Option<f64>,
) -> Option<bool> {
    let attacked_errors: u64 = phases
        .iter()
        .filter(|p| p.server == "omnistage" && ATTACKED.contains(&p.phase.as_str()))
        .map(|p| p.victim.errors)
        .sum();
    if unanswered_rounds(phases, "omnistage") > 0 || attacked_errors > 0 {
        return Some(false);
    }
    if unsettled_rounds(phases, "omnistage") > 0 {
        return None;
    }
    let loops = if closed_loop {
        vec![open, closed]
    } else {
        vec![open]
    };
    let met: Option<Vec<bool>> = loops.into_iter().map(|r| r.map(|r| r <= 1.5)).collect();
    met.map(|m| m.iter().all(|&x| x))
}

fn omnistage_toml(root: &Path, victim_weight: u32, wake_credit_us: u64) -> (String, String) {
    let server = format!(
        "connections_max = {SERVER_CONNECTIONS_MAX}\nheader_timeout_ms = {HEADER_TIMEOUT_MS}\nkeepalive_timeout_ms = {KEEPALIVE_TIMEOUT_MS}\nwake_credit_us = {wake_credit_us}\n"
    );
    let tenants = [("victim", victim_weight), ("adversary", 100)]
        .iter()
        .map(|(n, w)| {
            format!(
                "[[tenant]]\nname = \"{n}\"\nhosts = [\"{n}.test\"]\nweight = {w}\nconnections_max = {TENANT_CONNECTIONS_MAX}\ndocroot = \"{}\"\n",
                root.display()
            )
        })
        .collect::<Vec<_>>()
        .join("\n");
    (server, tenants)
}

fn nginx_servers(port: u16, root: &Path) -> String {
    let extra = format!(
        "client_header_timeout {}s; keepalive_timeout {}s; send_timeout 10s;",
        HEADER_TIMEOUT_MS / 1000,
        KEEPALIVE_TIMEOUT_MS / 1000
    );
    // Listen options (the backlog) may be given once per address: the second block listens
    // plainly on the same address.
    format!(
        "{}server {{ listen 127.0.0.1:{port}; server_name adversary.test; root {}; {extra} }}\n",
        nginx::server_block(port, root, Some("victim.test"), &extra),
        root.display()
    )
}

pub fn run(a: AdversaryArgs) -> Result<(), String> {
    if !(0.3..=600.0).contains(&a.common.seconds)
        || !(0.05..=0.95).contains(&a.victim_cpu)
        || !(1..=10_000).contains(&a.victim_weight)
        || a.wake_credit_us > omnistage_http::config::WAKE_CREDIT_US_MAX as u64
        || a.victim_rate.is_some_and(|r| !(1.0..=1e6).contains(&r))
        || a.victim_spin_us > omnistage_load::args::MAX_SPIN_US
        || !(0.2..=60.0).contains(&a.pick_seconds)
        || !(1..=20_000).contains(&a.flood_conns)
        || !(1..=1000).contains(&a.slow_readers)
        || !(1..=5000).contains(&a.slowloris_conns)
        || !(1024..=(256 << 20)).contains(&a.large_bytes)
    {
        return Err("--seconds 0.3..=600, --victim-cpu 0.05..=0.95, --victim-weight 1..=10000, --victim-rate 1..=1e6, --victim-spin-us 0..=1000, --pick-seconds 0.2..=60, --flood-conns 1..=20000, --slow-readers 1..=1000, --slowloris-conns 1..=5000, --large-bytes 1024..=268435456".into());
    }
    let mut kinds: Vec<&str> = Vec::new();
    for k in &a.attacks {
        let Some(&known) = KINDS.iter().find(|&&x| x == k.trim()) else {
            return Err(format!(
                "--attacks: unknown kind {k:?}; choose from {}",
                KINDS.join(",")
            ));
        };
        if !kinds.contains(&known) {
            kinds.push(known);
        }
    }
    if kinds.is_empty() {
        return Err("--attacks: give at least one kind".into());
    }
    // Client and server sockets of every attack live in this process: the flood shrinks to
    // what the open-files limit leaves (said on the page), the rest must fit.
    let mut a = a;
    let others = VICTIM_CONNS + LARGE_CONNS + a.slow_readers + a.slowloris_conns;
    let mut fd_note = None;
    if let Some(soft) = raise_nofile() {
        let fit = (soft.saturating_sub(FD_SLACK) / 2) as usize;
        if others + 1 > fit {
            return Err(format!(
                "{} connections need {} open files in this process; the limit is {soft}",
                others + 1,
                2 * (others + 1) + FD_SLACK as usize
            ));
        }
        if others + a.flood_conns > fit {
            fd_note = Some(format!(
                "many-conns shrunk from {} to {} connections to fit the open-files limit {soft}",
                a.flood_conns,
                fit - others
            ));
            a.flood_conns = fit - others;
        }
    }
    let dir = std::env::temp_dir().join(format!("omnistage-adversary-{}", std::process::id()));
    let root = dir.join("www");
    std::fs::create_dir_all(&root).map_err(|e| e.to_string())?;
    let result = (|| -> Result<_, String> {
        std::fs::write(root.join(SMALL), vec![b'v'; SMALL_BYTES]).map_err(|e| e.to_string())?;
        let big: Vec<u8> = (0..a.large_bytes).map(|i| b'a' + (i % 26) as u8).collect();
        std::fs::write(root.join(LARGE), big).map_err(|e| e.to_string())?;
        let (server_toml, tenants_toml) = omnistage_toml(&root, a.victim_weight, a.wake_credit_us);
        let (server, addr) = cfgweb::start(&server_toml, &tenants_toml)?;
        let rt = server.runtime();
        let ids = (
            rt.activity_id("/tenants/victim").ok_or("victim activity")?,
            rt.activity_id("/tenants/adversary")
                .ok_or("adversary activity")?,
        );
        let snap = || server.runtime().snapshot();
        let stretches = || server.runtime().stretches();
        let latencies = || server.runtime().latencies();
        let ours = Target {
            server: "omnistage",
            addr: &addr,
            ledger: Some(&snap),
            stretches: Some(&stretches),
            latencies: Some(&latencies),
            ids,
            // The worker names itself when it starts running.
            schedstat: new_thread_schedstat("omnistage-w0", &[]),
        };
        // nginx runs beside (idle) so that both capacities are known before any phase.
        let port = nginx::free_port()?;
        let ng_addr = format!("127.0.0.1:{port}");
        let start_nginx = |t: nginx::Tuning| {
            nginx::start(
                &a.common.nginx,
                &dir.join("nginx"),
                port,
                SERVER_CONNECTIONS_MAX,
                t,
                &nginx_servers(port, &root),
            )
        };
        let (ng, nginx_note, nginx_tuning) = if !a.common.nginx.exists() {
            (
                None,
                Some(format!("{} not installed", a.common.nginx.display())),
                None,
            )
        } else {
            // nginx at its best for the victim's workload: a short pre-run of each of its
            // standard configurations (as http-vs-nginx does), the fastest kept.
            let pick = nginx::best_tuning(a.pick_seconds, |t| {
                let ng = start_nginx(t)?;
                let c = capacity(&ng_addr, a.pick_seconds);
                drop(ng);
                c
            });
            match pick.and_then(|p| start_nginx(p.picked).map(|ng| (ng, p))) {
                Ok((ng, p)) => (Some(ng), None, Some(p)),
                Err(e) => (None, Some(e), None),
            }
        };
        let theirs = Target {
            server: "nginx",
            addr: &ng_addr,
            ledger: None,
            stretches: None,
            latencies: None,
            ids: (0, 0),
            schedstat: ng
                .as_ref()
                .map(|n| PathBuf::from(format!("/proc/{}/schedstat", n.pid()))),
        };
        let targets: Vec<&Target<'_>> = if ng.is_some() {
            vec![&ours, &theirs]
        } else {
            vec![&ours]
        };
        let result = (|| -> Result<_, String> {
            let mut caps = Vec::new();
            let mut sizing = Vec::new();
            if a.victim_rate.is_none() {
                for tg in &targets {
                    let cap = capacity(tg.addr, CAPACITY_S)?;
                    caps.push((tg.server.to_string(), cap));
                    std::thread::sleep(Duration::from_millis(300));
                    sizing.push(size_victim(tg, cap, a.victim_cpu)?);
                }
            }
            // One rate for both servers, the lower of the two sizes, so the victim's generator
            // has the same work (and the same headroom on the shared load CPU) against each and
            // neither server's worker spends more than the target on it.
            let rate = a
                .victim_rate
                .unwrap_or_else(|| {
                    sizing
                        .iter()
                        .map(|s| s.rate_per_s)
                        .fold(f64::INFINITY, f64::min)
                })
                .max(1.0)
                .round();
            let servers: Vec<&'static str> = targets.iter().map(|t| t.server).collect();
            let mut peer_cpus = Vec::new();
            let runs = rounds::alternate(a.common.repeats, &servers, |round, s| {
                let tg = targets.iter().find(|t| t.server == s).expect("a target");
                let mut ps = run_server(&a, tg, &kinds, rate)?;
                for p in &mut ps {
                    p.round = round + 1;
                }
                if let (Some(ng), "nginx") = (&ng, s) {
                    peer_cpus.push(ng.serving_cpus()?);
                }
                Ok(ps)
            })?;
            let phases: Vec<Phase> = runs.into_iter().flat_map(|(_, _, ps)| ps).collect();
            Ok((caps, sizing, phases, peer_cpus))
        })();
        drop(ng);
        server.drain(Duration::from_millis(300));
        let (caps, sizing, phases, peer_cpus) = result?;
        Ok((
            caps,
            sizing,
            phases,
            peer_cpus,
            nginx_note,
            nginx_tuning,
            server_toml + &tenants_toml,
        ))
    })();
    let _ = std::fs::remove_dir_all(&dir);
    let (caps, sizing, phases, peer_cpus, nginx_note, nginx_tuning, omni_cfg) = result?;
    // The median over the rounds of the attacked/alone p99 ratio, in open loop (phase "all")
    // and in closed loop ("closed-all").
    // Rounds whose alone or attacked phase the hypervisor disturbed are left out; with every
    // round disturbed there is no ratio, and the goal is not judged.
    let ratio = |s: &str, phase: &str, of: fn(&Phase) -> Option<f64>| {
        let v: Vec<f64> = phases
            .iter()
            .filter(|p| p.server == s && p.phase == phase && !p.ratio_disturbed)
            .filter_map(of)
            .collect();
        (!v.is_empty()).then(|| Spread::of(&v).median)
    };
    let e2e = |p: &Phase| p.p99_ratio;
    let kernel = |p: &Phase| p.kernel_p99_ratio;
    let omnistage_p99_ratio = ratio("omnistage", "all", e2e);
    let nginx_p99_ratio = ratio("nginx", "all", e2e);
    let omnistage_kernel_p99_ratio = ratio("omnistage", "all", kernel);
    let nginx_kernel_p99_ratio = ratio("nginx", "all", kernel);
    let omnistage_closed_p99_ratio = ratio("omnistage", "closed-all", e2e);
    let nginx_closed_p99_ratio = ratio("nginx", "closed-all", e2e);
    let omnistage_closed_kernel_p99_ratio = ratio("omnistage", "closed-all", kernel);
    let nginx_closed_kernel_p99_ratio = ratio("nginx", "closed-all", kernel);
    let omnistage_victim_unanswered_rounds = unanswered_rounds(&phases, "omnistage");
    let nginx_victim_unanswered_rounds = unanswered_rounds(&phases, "nginx");
    let omnistage_victim_unsettled_rounds = unsettled_rounds(&phases, "omnistage");
    let goal_met = judge_goal(
        &phases,
        a.closed_loop,
        omnistage_p99_ratio,
        omnistage_closed_p99_ratio,
    );
    let kernel_goal_met = judge_goal(
        &phases,
        a.closed_loop,
        omnistage_kernel_p99_ratio,
        omnistage_closed_kernel_p99_ratio,
    );
    let stretch_p99_us = {
        let v: Vec<f64> = phases
            .iter()
            .filter(|p| p.server == "omnistage" && p.phase == "all" && !p.ratio_disturbed)
            .filter_map(|p| p.stretches.as_ref().map(Stretches::p99_us))
            .collect();
        (!v.is_empty()).then(|| Spread::of(&v).median)
    };
    let omnistage_rounds_disturbed = rounds_disturbed(&phases, "omnistage");
    let runqueue_fraction_max = phases
        .iter()
        .flat_map(|p| [p.victim_generator_runqueue_ms, p.server_runqueue_ms])
        .flatten()
        .map(|ms| ms / (a.common.seconds * 1e3))
        .reduce(f64::max);
    let r = Report {
        experiment: "adversary",
        machine: machine(),
        seconds: a.common.seconds,
        attacks: kinds.iter().map(|s| s.to_string()).collect(),
        victim_conns: VICTIM_CONNS,
        victim_cpu: a.victim_cpu,
        victim_weight: a.victim_weight,
        wake_credit_us: a.wake_credit_us,
        victim_spin_us: a.victim_spin_us,
        small_file_bytes: SMALL_BYTES,
        large_file_bytes: a.large_bytes,
        flood_conns: a.flood_conns,
        large_conns: LARGE_CONNS,
        slow_readers: a.slow_readers,
        slowloris_conns: a.slowloris_conns,
        adversary_idle: a.adversary_idle,
        attack_kernel_stamps: a.attack_kernel_stamps,
        omnistage_config: omni_cfg,
        nginx_config: nginx_servers(0, Path::new("ROOT")),
        capacity_req_per_s: caps,
        victim_sizing: sizing,
        phases,
        repeats: a.common.repeats,
        peer_cpus,
        nginx_note,
        nginx_tuning,
        fd_note,
        omnistage_p99_ratio,
        nginx_p99_ratio,
        omnistage_victim_unanswered_rounds,
        nginx_victim_unanswered_rounds,
        omnistage_victim_unsettled_rounds,
        omnistage_closed_p99_ratio,
        nginx_closed_p99_ratio,
        goal_met,
        omnistage_kernel_p99_ratio,
        nginx_kernel_p99_ratio,
        omnistage_closed_kernel_p99_ratio,
        nginx_closed_kernel_p99_ratio,
        kernel_goal_met,
        stretch_p99_us,
        stretch_goal_met: stretch_p99_us.map(|v| v <= STRETCH_P99_GOAL_US),
        runqueue_fraction_max,
        keep_awake: a.keep_awake,
        omnistage_rounds_disturbed,
    };
    emit(&a, &r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: AdversaryArgs,
    }

    fn args(extra: &[&str]) -> AdversaryArgs {
        Cli::try_parse_from(std::iter::once("adversary").chain(extra.iter().copied()))
            .expect("parses")
            .a
    }

    fn victim(req_per_s: f64, p99_ms: f64) -> Victim {
        Victim {
            req_per_s,
            p50_ms: p99_ms / 2.0,
            p99_ms,
            max_ms: p99_ms,
            kernel_p50_ms: None,
            kernel_p99_ms: None,
            errors: 0,
            errors_by_kind: serde_json::Value::Null,
            requests: (req_per_s * 3.0) as u64,
            unfinished: 0,
            unfinished_oldest_ms: None,
        }
    }

    fn phase_of(name: &str, p99_ms: f64, kernel_p99_ms: Option<f64>) -> Phase {
        Phase {
            server: "omnistage",
            round: 1,
            phase: name.into(),
            victim_rate_per_s: 100.0,
            victim: Victim {
                kernel_p99_ms,
                ..victim(100.0, p99_ms)
            },
            adversary: None,
            p99_ratio: None,
            kernel_p99_ratio: None,
            victim_windows: Vec::new(),
            victim_window_p99_max_ms: None,
            ledger: None,
            stretches: None,
            victim_queue_wait: None,
            victim_generator_runqueue_ms: None,
            server_runqueue_ms: None,
            server_cpu_steal_ms: None,
            load_cpu_steal_ms: None,
            disturbed: false,
            ratio_disturbed: false,
        }
    }

    /// Attacked phases are compared with the alone phase of their own loop, on each
    /// instrument; a phase without kernel stamps has no kernel ratio.
    #[test]
    fn ratios_pair_each_loop_with_its_own_alone_phase() {
        let mut open = vec![
            phase_of("alone", 2.0, Some(0.5)),
            phase_of("all", 3.0, Some(1.5)),
            phase_of("many-conns", 1.0, None),
        ];
        set_ratios(&mut open);
        assert_eq!(open[0].p99_ratio, None);
        assert_eq!(
            (open[1].p99_ratio, open[1].kernel_p99_ratio),
            (Some(1.5), Some(3.0))
        );
        assert_eq!(
            (open[2].p99_ratio, open[2].kernel_p99_ratio),
            (Some(0.5), None)
        );
        let mut closed = vec![
            phase_of("closed-alone", 4.0, Some(1.0)),
            phase_of("closed-all", 5.0, Some(1.0)),
        ];
        set_ratios(&mut closed);
        assert_eq!(
            (closed[1].p99_ratio, closed[1].kernel_p99_ratio),
            (Some(1.25), Some(1.0))
        );
    }

    /// The victim's queue waits are the growth of its own rows only (every stage and core),
    /// a row that appeared during the phase counting whole.
    #[test]
    fn queue_wait_is_the_victims_growth_over_the_phase() {
        use omnistage::account::Histogram;
        let row = |activity: u32, stage: u32, waits_ns: &[u64]| {
            let h = Histogram::default();
            for &w in waits_ns {
                h.record(w);
            }
            LatencyRow {
                activity,
                stage,
                core: 0,
                wait: h.snapshot(),
                response: h.snapshot(),
            }
        };
        let before = [row(3, 2, &[1_000; 10]), row(4, 2, &[1_000; 10])];
        let after = [
            // 10 old waits of 1 µs, 99 new of 1 µs and one of 1 ms.
            row(3, 2, &[&[1_000; 109][..], &[1_000_000]].concat()),
            // A stage the victim first used during the phase.
            row(3, 3, &[2_000; 100]),
            // The adversary's row is not the victim's.
            row(4, 2, &[5_000_000; 50]),
        ];
        let q = QueueWait::between(&before, &after, 3);
        assert_eq!(q.messages, 200);
        assert!(q.p50_us >= 1.0 && q.p50_us < 4.0, "{}", q.p50_us);
        assert!(q.max_us >= 900.0 && q.max_us < 1_300.0, "{}", q.max_us);
    }

    /// A phase is disturbed when steal on either CPU exceeds 1 % of its window; an attacked
    /// phase compared with a disturbed alone phase is left out too, and its round is named.
    #[test]
    fn steal_above_one_percent_disturbs_a_phase_and_its_round() {
        assert!(!is_disturbed(Some(30.0), Some(0.0), 3.0), "exactly 1 %");
        assert!(is_disturbed(Some(40.0), None, 3.0));
        assert!(is_disturbed(None, Some(40.0), 3.0));
        assert!(
            !is_disturbed(None, None, 3.0),
            "no reading, no verdict on it"
        );
        let mut round1 = vec![phase_of("alone", 2.0, None), phase_of("all", 2.0, None)];
        round1[0].disturbed = true;
        set_ratios(&mut round1);
        let mut round2 = vec![
            phase_of("alone", 2.0, None),
            phase_of("all", 2.0, None),
            phase_of("many-conns", 2.0, None),
        ];
        round2[2].disturbed = true;
        set_ratios(&mut round2);
        for p in &mut round2 {
            p.round = 2;
        }
        assert!(round1[1].ratio_disturbed && !round2[1].ratio_disturbed);
        assert!(round2[2].ratio_disturbed, "a per-kind phase is marked too");
        let all: Vec<Phase> = round1.into_iter().chain(round2).collect();
        assert_eq!(
            rounds_disturbed(&all, "omnistage"),
            vec!["1 (open)".to_string()],
            "only the verdicts' phases name a round, with its loop"
        );
    }

    /// A round whose victim got nothing in both loops counts once.
    #[test]
    fn an_unanswered_round_counts_once_across_loops() {
        let mut ps = vec![
            phase_of("all", 0.0, None),
            phase_of("closed-all", 0.0, None),
            phase_of("all", 1.0, None),
        ];
        for p in &mut ps[..2] {
            p.victim.req_per_s = 0.0;
        }
        ps[2].round = 2;
        assert_eq!(unanswered_rounds(&ps, "omnistage"), 1);
        assert_eq!(unanswered_rounds(&ps, "nginx"), 0);
    }

    /// The closed-loop victim offers the sized rate when answered at once: each of its
    /// connections waits connections / rate after every response.
    #[test]
    fn the_closed_loop_victim_waits_connections_over_rate() {
        assert_eq!(victim_pacing(1_000.0, false), "rate=1000");
        let think_ms = VICTIM_CONNS as f64 / 1_000.0 * 1e3;
        assert_eq!(
            victim_pacing(1_000.0, true),
            format!("think-ms={think_ms:.3}")
        );
    }

    /// A phase whose victim left more requests unfinished at the end than its p99 can hide
    /// (over 1/99 of what it completed) has no p99 of what was sent: the goal is not judged.
    #[test]
    fn a_victim_with_many_requests_unfinished_is_not_judged() {
        let mut ps = vec![phase_of("alone", 2.0, None), phase_of("all", 2.5, None)];
        set_ratios(&mut ps);
        assert_eq!(judge_goal(&ps, false, Some(1.25), None), Some(true));
        // The attack stalled the victim at the end: 300 requests due and unanswered beside
        // the 300 it completed, their latencies in no p99.
        ps[1].victim.unfinished = 300;
        ps[1].victim.unfinished_oldest_ms = Some(900.0);
        assert_ne!(judge_goal(&ps, false, Some(1.25), None), Some(true));
        assert_eq!(unsettled_rounds(&ps, "omnistage"), 1);
        // A few in flight, as any open loop leaves: judged.
        ps[1].victim.unfinished = 3;
        assert_eq!(judge_goal(&ps, false, Some(1.25), None), Some(true));
        // Alone too: the ratio's denominator is a p99 as well.
        ps[0].victim.unfinished = 100;
        assert_eq!(judge_goal(&ps, false, Some(1.25), None), None);
        // A miss stays a miss.
        ps[1].victim.errors = 1;
        assert_eq!(judge_goal(&ps, false, Some(1.25), None), Some(false));
    }

    #[test]
    fn a_victim_without_answers_has_no_ratio() {
        assert_eq!(attacked_ratio(true, 2.0, &victim(100.0, 3.0)), Some(1.5));
        // nginx's victim completed nothing under the combined attack: its p99 reads 0 ms,
        // which must not become a 0.00× "win".
        assert_eq!(attacked_ratio(true, 2.0, &victim(0.0, 0.0)), None);
        assert_eq!(attacked_ratio(false, 0.0, &victim(100.0, 3.0)), None);
    }

    #[test]
    fn bad_input_is_refused_before_anything_runs() {
        for bad in [
            &["--attacks", "many-conns,nope"][..],
            &["--seconds", "0"],
            &["--flood-conns", "0"],
            &["--flood-conns", "20001"],
            &["--slowloris-conns", "5001"],
            &["--slow-readers", "1001"],
            &["--victim-rate", "0"],
            &["--victim-cpu", "3"],
            &["--large-bytes", "10"],
        ] {
            let e = run(args(bad)).expect_err("refused");
            assert!(e.contains("--"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn slow_clients_keep_their_connection_count_and_stop_by_themselves() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let until = Instant::now() + Duration::from_millis(300);
        let loris = std::thread::spawn(move || slowloris(addr, 3, until, false));
        let slow = slow_readers(addr, 2, until, false);
        let loris = loris.join().unwrap();
        // Nothing is ever answered: the connections stay, none is re-opened beyond the count.
        assert!(loris.open_at_end <= 3);
        assert!(
            loris.bytes_sent >= 1,
            "the first connection sent its first byte"
        );
        assert_eq!(slow.bytes, 0);
        assert_eq!(slow.reconnects, 0);
        drop(l);
    }
}
