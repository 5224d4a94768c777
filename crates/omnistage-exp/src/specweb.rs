//! `specweb` (SEDA Fig. 39, Haboob vs Apache and Flash): a SPECweb99-like static load at 64 to
//! 4096 closed-loop clients against omnistage and nginx: throughput, mean/p99/max response time,
//! Jain's fairness across clients and errors by kind, per level and server.
//!
//! Owns the SPECweb99-like file set (written into a scratch docroot: directories of 36 files,
//! four size classes of nine files) and its popularity law (written as a `weighted=FILE` list for
//! the load generator: class 35/50/14/1 %, Zipf within a class over SPECweb's rank order, Zipf
//! α = 1 over directories), the runs, and the page. The server runs in this process (one worker
//! pinned to CPU 0, one tenant, cache on); nginx (one worker on CPU 0, its configuration picked
//! by a pre-run) serves the same docroot; the load generator runs in this process pinned to
//! CPU 1. Both servers stay up for the whole experiment (caches warm); levels run in increasing
//! order, and within a level the servers alternate round by round (`--repeats`); every run has
//! its own warmup.

use super::connections::sys;
use super::harness;
use super::nginx::{self, TuningChoice};
use super::report::{self, Doc, Table};
use super::rounds::{self, Spread};
use super::util::machine;
use super::{cfgweb, Common};
use clap::Args;
use omnistage_load::report::Report as LoadReport;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

#[derive(Args, Clone)]
#[command(mut_arg("seconds", |a| a.default_value("5.0").help("Measured seconds of each run (one run per level and server).")))]
#[command(mut_arg("out", |a| a.help("Write specweb.json, .md and .svg (and specweb-latency.svg) here.")))]
pub struct SpecwebArgs {
    /// Warmup before each run's measured window, seconds (connections open, the cache fills).
    #[arg(long = "warmup-s", default_value_t = 2.0)]
    warmup_s: f64,
    /// Client counts, comma-separated.
    #[arg(long, default_value = "64,256,1024,4096", value_delimiter = ',')]
    levels: Vec<usize>,
    /// Directories of the file set (36 files, about 4.9 MiB each).
    #[arg(long, default_value_t = 25)]
    dirs: usize,
    /// Think time of each client after a response, ms.
    #[arg(long = "think-ms", default_value_t = 20.0)]
    think_ms: f64,
    /// Requests per keep-alive connection before the client reconnects.
    #[arg(long = "requests-per-conn", default_value_t = 5)]
    requests_per_conn: u64,
    #[command(flatten)]
    common: Common,
}

/// Most directories (about 4.9 GiB of files).
const DIRS_MAX: usize = 1000;
/// Most clients in one level.
const CLIENTS_MAX: usize = 16_384;
/// Most levels.
const LEVELS_MAX: usize = 10;
/// Seconds of each configuration's pre-run that picks nginx's configuration.
const PICK_SECONDS: f64 = 1.0;
/// File descriptors beyond two per client (one each in the server and the load generator, both
/// in this process): listeners, the docroot's open-file cache, stdio.
const FD_SLACK: u64 = 1200;
/// Per-request timeout of the load generator: a response slower than this is an error, not a
/// response time (it exceeds every run's length anyway).
const TIMEOUT_MS: u64 = 60_000;
/// The server's cache: every file of the default set fits (25 directories, 128 MB).
const CACHE_BYTES_MAX: u64 = 512 << 20;

/// Fraction of requests per class (SPECweb96/99).
const CLASS_FREQ: [f64; 4] = [0.35, 0.50, 0.14, 0.01];
/// Popularity rank (1 = most popular) of files 1..=9 within a class: SPECweb99's order 5, 4, 6,
/// 3, 7, 2, 8, 9, 1; a file's weight within its class is 1/rank (35.3 %, 17.7 %, 11.8 %, ...).
const FILE_RANK: [u32; 9] = [9, 6, 4, 2, 1, 3, 5, 7, 8];

/// Size of file `file` (1..=9) of class `class` (0..=3): file × 102.4 × 10^class bytes, rounded
/// down (102 B ... 921 B, 1 KiB ... 9 KiB, 10 KiB ... 90 KiB, 100 KiB ... 900 KiB).
fn file_bytes(class: u32, file: u32) -> usize {
    (u64::from(file) * 1024 * 10u64.pow(class) / 10) as usize
}

fn file_path(dir: usize, class: u32, file: u32) -> String {
    format!("/dir{dir:05}/class{class}_{file}")
}

/// The popularity of every file of `dirs` directories: `(weight, path)`, weights summing to 1.
fn popularity(dirs: usize) -> Vec<(f64, String)> {
    let dir_norm: f64 = (1..=dirs).map(|d| 1.0 / d as f64).sum();
    let file_norm: f64 = FILE_RANK.iter().map(|&r| 1.0 / f64::from(r)).sum();
    let mut out = Vec::with_capacity(dirs * 36);
    for d in 0..dirs {
        let p_dir = 1.0 / (d + 1) as f64 / dir_norm;
        for (class, &p_class) in (0u32..).zip(&CLASS_FREQ) {
            for (file, &rank) in (1u32..).zip(&FILE_RANK) {
                let p_file = 1.0 / f64::from(rank) / file_norm;
                out.push((p_dir * p_class * p_file, file_path(d, class, file)));
            }
        }
    }
    out
}

/// Mean response body of the mix, bytes.
fn mean_body_bytes() -> f64 {
    let file_norm: f64 = FILE_RANK.iter().map(|&r| 1.0 / f64::from(r)).sum();
    (0u32..)
        .zip(&CLASS_FREQ)
        .map(|(class, &pc)| {
            (1u32..)
                .zip(&FILE_RANK)
                .map(|(file, &rank)| {
                    pc * (1.0 / f64::from(rank) / file_norm) * file_bytes(class, file) as f64
                })
                .sum::<f64>()
        })
        .sum()
}

/// Writes the file set under `root` and the weighted list at `list`; returns the set's bytes.
fn write_file_set(root: &Path, list: &Path, dirs: usize) -> Result<u64, String> {
    let io = |p: &Path, e: std::io::Error| format!("{}: {e}", p.display());
    let largest = file_bytes(3, 9);
    let data: Vec<u8> = (0..largest).map(|i| b'a' + (i % 26) as u8).collect();
    let mut total = 0u64;
    for d in 0..dirs {
        let dir = root.join(format!("dir{d:05}"));
        std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
        for class in 0..4 {
            for file in 1..=9 {
                let n = file_bytes(class, file);
                let p = dir.join(format!("class{class}_{file}"));
                std::fs::write(&p, &data[..n]).map_err(|e| io(&p, e))?;
                total += n as u64;
            }
        }
    }
    let mut text = String::from("# weight path: SPECweb99-like popularity\n");
    for (w, p) in popularity(dirs) {
        let _ = writeln!(text, "{w:.12e} {p}");
    }
    std::fs::write(list, text).map_err(|e| io(list, e))?;
    Ok(total)
}

#[derive(Serialize, Clone)]
struct Level {
    server: &'static str,
    clients: usize,
    /// The round (1-based) of this run; in `levels`, the round of the run with the median req/s.
    round: usize,
    /// Over the rounds of this server and level (in `levels`; one value in `runs`).
    req_per_s_spread: Spread,
    req_per_s: f64,
    bytes_per_s: f64,
    mbit_per_s: f64,
    mean_ms: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    /// Jain's index across clients (connection slots) by completed requests.
    client_jain: Option<f64>,
    client_requests_min: u64,
    client_requests_median: u64,
    client_requests_max: u64,
    /// Clients that completed no request in the measured window.
    clients_starved: usize,
    /// Failed requests (every kind but `connect`).
    errors: u64,
    /// The load generator's errors by kind (connect counts failed attempts).
    errors_by_kind: omnistage_load::ErrorCounts,
    reconnects: u64,
    /// Successful responses in the measured window.
    requests: u64,
    /// Requests in flight, or due and not sent, at the end of the run: not in any latency.
    unfinished: u64,
    /// How long the oldest of them had waited by then, ms (`null`: none).
    unfinished_oldest_ms: Option<f64>,
    seconds: f64,
}

#[derive(Serialize)]
struct Goals {
    /// Clients at the top level (the largest both servers ran).
    clients: usize,
    /// omnistage req/s ≥ nginx's.
    throughput_at_least_nginx: Option<bool>,
    /// omnistage req/s / nginx's.
    throughput_ratio: Option<f64>,
    /// omnistage's client Jain index ≥ 0.98.
    client_jain_at_least_0_98: Option<bool>,
    /// omnistage's longest wait < nginx's: the slowest response, or the oldest request still
    /// unfinished at the end if it had waited longer (`null` without nginx, or when a side
    /// completed nothing).
    max_response_below_nginx: Option<bool>,
}

#[derive(Serialize)]
struct Report {
    experiment: &'static str,
    machine: String,
    seconds: f64,
    warmup_s: f64,
    think_ms: f64,
    requests_per_conn: u64,
    dirs: usize,
    files: usize,
    file_set_bytes: u64,
    mean_body_bytes: f64,
    cache_bytes_max: u64,
    fd_soft_limit: Option<u64>,
    local_ports: Option<u64>,
    skipped_levels: Vec<usize>,
    repeats: usize,
    /// Per server and level, the run with the median req/s (its spread over the rounds beside).
    levels: Vec<Level>,
    /// Every run, in the order run (servers alternate within each level, round by round).
    runs: Vec<Level>,
    /// The CPUs nginx's worker was allowed, read from /proc after each nginx run.
    peer_cpus: Vec<String>,
    nginx_tuning: Option<TuningChoice>,
    nginx_note: Option<String>,
    goals: Goals,
    goal_met: Option<bool>,
}

fn level_of(server: &'static str, clients: usize, r: &LoadReport) -> Level {
    let t = &r.total;
    let c = &r.client_requests;
    Level {
        server,
        clients,
        round: 0,
        req_per_s_spread: Spread::of(&[t.req_per_s]),
        req_per_s: t.req_per_s,
        bytes_per_s: t.bytes_per_s,
        mbit_per_s: t.bytes_per_s * 8.0 / 1e6,
        mean_ms: t.mean_ms,
        p50_ms: t.p50_ms,
        p99_ms: t.p99_ms,
        max_ms: t.max_ms,
        client_jain: r.client_jain,
        client_requests_min: c.requests_min,
        client_requests_median: c.requests_median,
        client_requests_max: c.requests_max,
        clients_starved: c.starved,
        errors: t.errors.failed_requests(),
        errors_by_kind: t.errors,
        reconnects: t.reconnects,
        requests: t.requests,
        unfinished: t.unfinished,
        unfinished_oldest_ms: t.unfinished_oldest_ms,
        seconds: r.seconds,
    }
}

/// What the runs gave: the file set's bytes, the median run per server and level, every run,
/// nginx's confinement and configuration, and why nginx was not measured (if not).
struct Measured {
    set_bytes: u64,
    levels: Vec<Level>,
    runs: Vec<Level>,
    peer_cpus: Vec<String>,
    tuning: Option<TuningChoice>,
    nginx_note: Option<String>,
}

/// Per server and level (in the order first run), the run with the median req/s, carrying the
/// spread of req/s over that server's rounds at that level.
fn median_levels(runs: &[Level]) -> Vec<Level> {
    rounds::median_runs(runs, |r| (r.server, r.clients), |r| r.req_per_s)
        .into_iter()
        .map(|(mut l, spread)| {
            l.req_per_s_spread = spread;
            l
        })
        .collect()
}

fn run_level(
    server: &'static str,
    addr: &str,
    clients: usize,
    list: &Path,
    a: &SpecwebArgs,
) -> Result<Level, String> {
    let extra: Vec<String> = [
        "--think-ms".to_string(),
        a.think_ms.to_string(),
        "--requests-per-conn".into(),
        a.requests_per_conn.to_string(),
        "--timeout-ms".into(),
        TIMEOUT_MS.to_string(),
        "--tenant".into(),
        format!("web:a.test:{clients}:weighted={}", list.display()),
    ]
    .into();
    let args = harness::load_args(addr, a.common.seconds, a.warmup_s, &extra)?;
    let r = harness::join_load(harness::spawn_load(args))?;
    // Let the last connections close before the next level opens its own.
    std::thread::sleep(Duration::from_millis(300));
    Ok(level_of(server, clients, &r))
}

/// Judges the goals at the largest level both servers ran.
fn judge(levels: &[Level]) -> Goals {
    let top = levels
        .iter()
        .filter(|l| l.server == "omnistage")
        .map(|l| l.clients)
        .filter(|&n| levels.iter().any(|l| l.server == "nginx" && l.clients == n))
        .max();
    let ours_top = levels
        .iter()
        .filter(|l| l.server == "omnistage")
        .max_by_key(|l| l.clients);
    let at = |s: &str, n: usize| levels.iter().find(|l| l.server == s && l.clients == n);
    let (ours, ng) = match top {
        Some(n) => (at("omnistage", n), at("nginx", n)),
        None => (ours_top, None),
    };
    let throughput_ratio = match (ours, ng) {
        (Some(o), Some(n)) if n.req_per_s > 0.0 => Some(o.req_per_s / n.req_per_s),
        _ => None,
    };
    // At least nginx's: worse only by more than nginx's own run-to-run range; a difference
    // inside it is inconclusive (`None`) unless ours is at least as high as nginx's best run.
    let throughput_at_least_nginx = match (ours, ng) {
        // A round in which either served nothing (a level too short to open its connections,
        // a server that failed) is no comparison: no verdict.
        (Some(o), Some(n)) if o.req_per_s_spread.min > 0.0 && n.req_per_s_spread.min > 0.0 => {
            let (os, ns) = (o.req_per_s_spread, n.req_per_s_spread);
            if os.median >= ns.max {
                Some(true)
            } else if ns.median - os.median > ns.max - ns.min {
                Some(false)
            } else {
                None
            }
        }
        _ => None,
    };
    Goals {
        clients: ours.map_or(0, |o| o.clients),
        throughput_at_least_nginx,
        throughput_ratio,
        client_jain_at_least_0_98: ours.map(|o| o.client_jain.is_some_and(|j| j >= 0.98)),
        max_response_below_nginx: match (
            ours.and_then(longest_wait_ms),
            ng.and_then(longest_wait_ms),
        ) {
            (Some(o), Some(n)) => Some(o < n),
            _ => None,
        },
    }
}

/// The longest any request of the run waited within it, ms: its slowest response, or the age
/// at the end of the oldest request still unfinished then (in flight, or due and not sent) if
/// that is longer. The load generator leaves unfinished requests out of every latency, so a
/// server that starves some connections at the end would otherwise look faster by its maximum.
/// `None` (no verdict) when nothing succeeded (a maximum of 0 is no latency), or when requests
/// were unfinished and their age is not known.
fn longest_wait_ms(l: &Level) -> Option<f64> {
    if l.requests == 0 || !l.max_ms.is_finite() {
        return None;
    }
    match (l.unfinished, l.unfinished_oldest_ms) {
        (0, _) => Some(l.max_ms),
        (_, Some(age)) if age.is_finite() => Some(l.max_ms.max(age)),
        _ => None,
    }
}

/// All three goals met: `Some(true)`; any missed: `Some(false)`; otherwise `None` (no nginx,
/// or a throughput inside nginx's own run-to-run range).
/// Without nginx at the top level nothing is judged, the Jain index (ours alone) included: the
/// goal is the comparison with nginx (the page says "not judged (no nginx)"); the index itself
/// is still reported in `goals`.
fn overall(g: &Goals) -> Option<bool> {
    // Set exactly when both servers ran the top level: no verdict otherwise.
    g.max_response_below_nginx?;
    super::harness::combine_verdicts([
        g.throughput_at_least_nginx,
        g.client_jain_at_least_0_98,
        g.max_response_below_nginx,
    ])
}

fn check_args(a: &SpecwebArgs) -> Result<(), String> {
    if !(a.common.seconds.is_finite() && (0.2..=600.0).contains(&a.common.seconds)) {
        return Err(format!(
            "--seconds must be in 0.2..=600, got {}",
            a.common.seconds
        ));
    }
    if !(a.warmup_s.is_finite() && (0.0..=60.0).contains(&a.warmup_s)) {
        return Err(format!("--warmup-s must be in 0..=60, got {}", a.warmup_s));
    }
    if a.levels.is_empty()
        || a.levels.len() > LEVELS_MAX
        || a.levels.iter().any(|&n| !(1..=CLIENTS_MAX).contains(&n))
    {
        return Err(format!(
            "--levels: 1 to {LEVELS_MAX} client counts, each in 1..={CLIENTS_MAX}"
        ));
    }
    if !(1..=DIRS_MAX).contains(&a.dirs) {
        return Err(format!("--dirs must be in 1..={DIRS_MAX}, got {}", a.dirs));
    }
    if !(a.think_ms.is_finite() && (0.0..=10_000.0).contains(&a.think_ms)) {
        return Err(format!(
            "--think-ms must be in 0..=10000, got {}",
            a.think_ms
        ));
    }
    if !(1..=1_000_000).contains(&a.requests_per_conn) {
        return Err(format!(
            "--requests-per-conn must be in 1..=1000000, got {}",
            a.requests_per_conn
        ));
    }
    Ok(())
}

fn local_ports() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let v: Vec<u64> = s
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    (v.len() == 2 && v[1] >= v[0]).then(|| v[1] - v[0] + 1)
}

pub fn run(a: SpecwebArgs) -> Result<(), String> {
    check_args(&a)?;
    let t_start = Instant::now();
    let limits = sys::raise_nofile();
    let soft = limits.map(|l| l.0);
    let ports = local_ports();
    let (mut run_levels, mut skipped) = (Vec::new(), Vec::new());
    let mut sorted = a.levels.clone();
    sorted.sort_unstable();
    sorted.dedup();
    for n in sorted {
        let fits_fd = soft.is_none_or(|s| 2 * n as u64 + FD_SLACK <= s);
        let fits_port = ports.is_none_or(|p| n as u64 <= p);
        if fits_fd && fits_port {
            run_levels.push(n);
        } else {
            skipped.push(n);
        }
    }
    if run_levels.is_empty() {
        return Err(format!(
            "no level fits: open-files soft limit {soft:?} (each client needs 2 fds here), local ports {ports:?}"
        ));
    }
    let max_n = *run_levels.last().expect("not empty");
    let scratch = std::env::temp_dir().join(format!("omnistage-specweb-{}", std::process::id()));
    let root = scratch.join("www");
    let list = scratch.join("popularity.txt");
    let result = (|| -> Result<Measured, String> {
        let set_bytes = write_file_set(&root, &list, a.dirs)?;
        let tenant = format!(
            "[[tenant]]\nname = \"web\"\nhosts = [\"a.test\"]\ndocroot = \"{}\"\n",
            root.display()
        );
        let (server, addr) = cfgweb::start(
            &format!(
                "connections_max = {}\nkeepalive_timeout_ms = 120000\ncache_bytes_max = {CACHE_BYTES_MAX}\n",
                max_n + 100
            ),
            &tenant,
        )?;
        // Both servers stay up for the whole run, each on CPU 0 (the idle one sleeps in
        // epoll), and the load alternates between them level by level, round by round.
        let nginx_dir = scratch.join("nginx");
        let start_nginx = |tuning: nginx::Tuning| -> Result<(nginx::Nginx, String), String> {
            let port = nginx::free_port()?;
            // worker_connections twice the largest level: with a reconnect every few requests
            // nginx holds closing connections beside the open ones, and with only `clients +
            // 100` slots it reset about 96 connections/s at 4096 clients (measured).
            let ng = nginx::start(
                &a.common.nginx,
                &nginx_dir,
                port,
                max_n,
                tuning,
                &nginx::server_block(port, &root, None, ""),
            )?;
            Ok((ng, format!("127.0.0.1:{port}")))
        };
        let mut nginx_note = None;
        let mut tuning = None;
        let mut ng = None;
        if !a.common.nginx.exists() {
            nginx_note = Some(format!("{} not installed", a.common.nginx.display()));
        } else {
            // The pre-run: each standard configuration at the smallest level, briefly.
            let pick_level = run_levels[0];
            let pick = nginx::best_tuning(PICK_SECONDS, |t| {
                let (ng, addr) = start_nginx(t)?;
                let pre = SpecwebArgs {
                    common: Common {
                        seconds: PICK_SECONDS,
                        ..a.common.clone()
                    },
                    warmup_s: a.warmup_s.min(1.0),
                    ..a.clone()
                };
                let l = run_level("nginx", &addr, pick_level, &list, &pre)?;
                ng.serving_cpus()?;
                Ok(l.req_per_s)
            });
            match pick.and_then(|c| {
                let started = start_nginx(c.picked)?;
                Ok((c, started))
            }) {
                Ok((c, started)) => {
                    tuning = Some(c);
                    ng = Some(started);
                }
                Err(e) => nginx_note = Some(e),
            }
        }
        let servers: &[&'static str] = if ng.is_some() {
            &["omnistage", "nginx"]
        } else {
            &["omnistage"]
        };
        let mut runs = Vec::new();
        let mut peer_cpus = Vec::new();
        let measured = run_levels.iter().try_for_each(|&n| {
            let r = rounds::alternate(a.common.repeats, servers, |round, s| {
                let mut l = match (s, &ng) {
                    ("nginx", Some((ng, naddr))) => {
                        let l = run_level("nginx", naddr, n, &list, &a)?;
                        peer_cpus.push(ng.serving_cpus()?);
                        l
                    }
                    _ => run_level("omnistage", &addr, n, &list, &a)?,
                };
                l.round = round + 1;
                Ok(l)
            })?;
            runs.extend(r.into_iter().map(|(_, _, l)| l));
            Ok::<(), String>(())
        });
        drop(ng);
        server.drain(Duration::from_millis(300));
        measured?;
        Ok(Measured {
            set_bytes,
            levels: median_levels(&runs),
            runs,
            peer_cpus,
            tuning,
            nginx_note,
        })
    })();
    let _ = std::fs::remove_dir_all(&scratch);
    let m = result?;
    let (file_set_bytes, levels, nginx_note) = (m.set_bytes, m.levels, m.nginx_note);
    let goals = judge(&levels);
    let goal_met = overall(&goals);
    let r = Report {
        experiment: "specweb",
        machine: machine(),
        seconds: a.common.seconds,
        warmup_s: a.warmup_s,
        think_ms: a.think_ms,
        requests_per_conn: a.requests_per_conn,
        dirs: a.dirs,
        files: a.dirs * 36,
        file_set_bytes,
        mean_body_bytes: mean_body_bytes(),
        cache_bytes_max: CACHE_BYTES_MAX,
        fd_soft_limit: soft,
        local_ports: ports,
        skipped_levels: skipped,
        repeats: a.common.repeats,
        levels,
        runs: m.runs,
        peer_cpus: m.peer_cpus,
        nginx_tuning: m.tuning,
        nginx_note,
        goals,
        goal_met,
    };
    emit(&r, &a, t_start.elapsed().as_secs_f64())
}

fn yes_no(v: Option<bool>) -> &'static str {
    match v {
        Some(true) => "met",
        Some(false) => "not met",
        None => "not judged",
    }
}

fn emit(r: &Report, a: &SpecwebArgs, elapsed_s: f64) -> Result<(), String> {
    let mut t = Table::new(&[
        "server",
        "clients",
        "req/s",
        "Mbit/s",
        "mean ms",
        "p99 ms",
        "max ms",
        "client Jain",
        "per client min/med/max",
        "starved",
        "errors",
        "connect fails",
        "unfinished (oldest ms)",
    ]);
    for l in &r.levels {
        let e = &l.errors_by_kind;
        let kinds: Vec<String> = [
            ("reset", e.reset),
            ("timeout", e.timeout),
            ("503", e.rejected_503),
            ("4xx", e.http_4xx),
            ("5xx", e.http_5xx),
            ("other", e.http_other),
            ("parse", e.parse),
        ]
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
        t.row(vec![
            l.server.into(),
            l.clients.to_string(),
            l.req_per_s_spread.show(0),
            format!("{:.1}", l.mbit_per_s),
            format!("{:.2}", l.mean_ms),
            format!("{:.2}", l.p99_ms),
            format!("{:.1}", l.max_ms),
            l.client_jain
                .map(|j| format!("{j:.3}"))
                .unwrap_or_else(|| "-".into()),
            format!(
                "{}/{}/{}",
                l.client_requests_min, l.client_requests_median, l.client_requests_max
            ),
            l.clients_starved.to_string(),
            if kinds.is_empty() {
                "0".into()
            } else {
                kinds.join(", ")
            },
            e.connect.to_string(),
            match l.unfinished_oldest_ms {
                Some(age) if l.unfinished > 0 => format!("{} ({age:.0})", l.unfinished),
                _ => l.unfinished.to_string(),
            },
        ]);
    }
    let g = &r.goals;
    let mut notes = vec![format!(
        "Goals at {} clients (the largest level both servers ran): throughput ≥ nginx's: {} (ratio {}); \
         client Jain ≥ 0.98: {}; max response time below nginx's: {}. Overall: {}.",
        g.clients,
        yes_no(g.throughput_at_least_nginx),
        g.throughput_ratio
            .map(|x| format!("{x:.3}"))
            .unwrap_or_else(|| "-".into()),
        yes_no(g.client_jain_at_least_0_98),
        yes_no(g.max_response_below_nginx),
        match (r.goal_met, g.max_response_below_nginx) {
            (Some(true), _) => "all three met",
            (Some(false), _) => "not met",
            _ if !r
                .levels
                .iter()
                .any(|l| l.server == "nginx" && l.clients == g.clients) =>
            {
                "not judged (no nginx)"
            }
            (None, None) => {
                "not judged (the longest waits could not be compared: a server completed \
                 nothing, or left requests unfinished without their age)"
            }
            // nginx ran, nothing missed, and the throughput was inside nginx's own range (or a
            // round served nothing).
            (None, Some(_)) => {
                "not judged (throughput inside nginx's run-to-run range, or a round in which a \
                 server served nothing)"
            }
        }
    )];
    if let Some(n) = &r.nginx_note {
        notes.push(format!("nginx not measured: {n}."));
    }
    notes.extend(nginx::page_notes(r.nginx_tuning.as_ref(), &r.peer_cpus));
    if !r.skipped_levels.is_empty() {
        notes.push(format!(
            "Skipped for lack of file descriptors or local ports: {:?} (open-files soft limit {:?}, {:?} local ports).",
            r.skipped_levels, r.fd_soft_limit, r.local_ports
        ));
    }
    notes.push(format!(
        "Caveats: each run measures {} s (SEDA ran 500 s), so a maximum response time here is the worst of a few \
         seconds and cannot exceed the run's length; a request still in flight at the end (or due and not sent) is counted as unfinished, \
         not as a response time, and the maximum judged is the longer of the slowest response and the \
         oldest unfinished request's wait by the end (the table's \"oldest ms\"), so a server that starves \
         some connections at the end is not the faster for it. Both servers answer from memory (the whole set fits in omnistage's cache and in the \
         page cache under nginx), unlike SEDA's 3.31 GB set on a 2 GB machine, so this is the CPU-bound case: one \
         server core against one load-generator core on a shared 2-vCPU VM. The load generator is itself one core, so \
         at the top levels it may be the limit for both servers alike; the comparison is between servers under the \
         same generator. Response time runs from when a request became due (think time over) to its last byte, \
         so it includes the new connection's handshake for every fifth request. This page took {elapsed_s:.0} s.",
        r.seconds
    ));
    if a.common.out.is_some() {
        notes.push(
            "![SPECweb99-like load: max and mean response time vs clients](specweb-latency.svg)"
                .to_string(),
        );
    }
    let doc = Doc {
        title: "specweb: SPECweb99-like static load, 64 to 4096 clients, omnistage vs nginx (SEDA Fig. 39)".into(),
        command: format!(
            "omnistage exp specweb --seconds {} --repeats {} --warmup-s {} --levels {} --dirs {}",
            a.common.seconds,
            a.common.repeats,
            a.warmup_s,
            a.levels
                .iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(","),
            a.dirs
        ),
        machine: r.machine.clone(),
        intro: vec![
            format!(
                "**File set** (SPECweb99's, fixed rather than scaled with clients): {} directories × 36 files = {} files, \
                 {:.1} MB. Each directory has four classes of nine files: class 0 102–921 B (steps of 102.4 B), class 1 \
                 1–9 KiB, class 2 10–90 KiB, class 3 100–900 KiB (921,600 B). SPECweb99 sizes its set by connections \
                 (25 + 0.66 × connections directories: SEDA's 3.31 GB is its 1000-connection size); we keep its base of 25 \
                 directories at every level so that the whole set fits in both servers' caches (omnistage cache_bytes_max \
                 {} MiB; nginx reads through the page cache) and the runs fit the time budget.",
                r.dirs,
                r.files,
                r.file_set_bytes as f64 / 1e6,
                r.cache_bytes_max >> 20
            ),
            format!(
                "**Popularity**: a request picks a class with SPECweb's frequencies 35 / 50 / 14 / 1 %, a file within the \
                 class by Zipf over SPECweb99's rank order (file 5 first, then 4, 6, 3, 7, 2, 8, 9, 1: 35.3 %, 17.7 %, \
                 11.8 %, …), and a directory by Zipf with α = 1, independently. The {} (weight, path) pairs are written to \
                 a list that the load generator draws from (`--tenant web:a.test:N:weighted=FILE`). Mean response body \
                 {:.0} B.",
                r.files,
                r.mean_body_bytes
            ),
            format!(
                "**Load**: N closed-loop clients (one connection slot each), {} ms think time after each response, {} \
                 requests per keep-alive connection and then a new connection (the last request asks to close), one \
                 load-generator thread pinned to CPU 1. Both servers run for the whole experiment: omnistage (this \
                 process, one worker pinned to CPU 0, one tenant, cache on) and nginx (master and one worker, the worker \
                 under worker_cpu_affinity on CPU 0, its configuration picked by a pre-run, backlog 4096, \
                 worker_connections twice the largest level), same docroot. Each level runs {} rounds; in each round \
                 both servers run {} s after {} s of warmup, the first server alternating from round to round; the \
                 table shows the run with the median req/s per server and level, req/s as median (min–max) over the rounds. Client Jain is Jain's index over the \
                 clients' completed requests (every client counted, including any that completed none), as in SEDA.",
                r.think_ms, r.requests_per_conn, r.repeats, r.seconds, r.warmup_s
            ),
            format!(
                "**Limits**: N clients need 2N file descriptors in this process (the server's end and the load                  generator's; the soft limit was raised to {}) and N local ports at a time ({} in                  net.ipv4.ip_local_port_range; with a reconnect every {} requests, ports left in TIME_WAIT are reused                  on loopback under tcp_tw_reuse). A level that does not fit is skipped and named below.",
                r.fd_soft_limit
                    .map(|n| n.to_string())
                    .unwrap_or_else(|| "?".into()),
                r.local_ports
                    .map(|n| n.to_string())
                    .unwrap_or_else(|| "?".into()),
                r.requests_per_conn
            ),
            "**Goal** (judged at the top level): throughput (req/s) ≥ nginx's (met when our median is at least \
             nginx's best round, missed when below nginx's median by more than nginx's own range, inconclusive in \
             between); client Jain ≥ 0.98; max response time \
             below nginx's. SEDA's Fig. 39: at 1024 clients Haboob 201 Mbit/s, mean 547 ms, max 3886 ms, fairness 0.98 \
             (Apache max 93.7 s, fairness 0.80; Flash max 37.4 s)."
                .to_string(),
        ],
        tables: vec![(String::new(), t)],
        notes,
    };
    let series = |f: fn(&Level) -> f64, suffix: &str| -> Vec<(String, Vec<(f64, f64)>)> {
        ["omnistage", "nginx"]
            .iter()
            .map(|&s| {
                (
                    format!("{s} {suffix}"),
                    r.levels
                        .iter()
                        .filter(|l| l.server == s)
                        .map(|l| ((l.clients as f64).log2(), f(l)))
                        .collect::<Vec<_>>(),
                )
            })
            .filter(|s| !s.1.is_empty())
            .collect()
    };
    let throughput = series(|l| l.req_per_s, "req/s");
    let mut latency = series(|l| l.max_ms, "max ms");
    latency.extend(series(|l| l.mean_ms, "mean ms"));
    report::emit("specweb", r, &doc, a.common.json, a.common.out(), |p| {
        report::svg_lines(
            p,
            "SPECweb99-like load: throughput vs clients",
            "log2(clients): 6 = 64, 12 = 4096",
            "req/s",
            &throughput,
        )?;
        report::svg_lines(
            &p.with_file_name("specweb-latency.svg"),
            "SPECweb99-like load: max and mean response time vs clients",
            "log2(clients): 6 = 64, 12 = 4096",
            "ms",
            &latency,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_specweb() {
        assert_eq!(file_bytes(0, 1), 102);
        assert_eq!(file_bytes(0, 9), 921);
        assert_eq!(file_bytes(1, 1), 1024);
        assert_eq!(file_bytes(2, 9), 92_160);
        assert_eq!(file_bytes(3, 9), 921_600);
        // One directory: about 4,608 B × (1 + 10 + 100 + 1000), class 0 rounded down.
        let dir: usize = (0..4)
            .flat_map(|c| (1..=9).map(move |f| file_bytes(c, f)))
            .sum();
        assert_eq!(dir, 5_119_484);
    }

    #[test]
    fn popularity_is_specweb_mix() {
        let p = popularity(25);
        assert_eq!(p.len(), 25 * 36);
        let total: f64 = p.iter().map(|x| x.0).sum();
        assert!((total - 1.0).abs() < 1e-9);
        let class = |c: u32| -> f64 {
            p.iter()
                .filter(|x| x.1.contains(&format!("/class{c}_")))
                .map(|x| x.0)
                .sum()
        };
        for (c, want) in CLASS_FREQ.iter().enumerate() {
            assert!((class(c as u32) - want).abs() < 1e-9);
        }
        // Within a class, file 5 is the most popular (35.3 %), file 1 the least (3.9 %).
        let f = |file: u32| -> f64 {
            p.iter()
                .filter(|x| x.1.ends_with(&format!("class1_{file}")))
                .map(|x| x.0)
                .sum::<f64>()
                / 0.50
        };
        assert!((f(5) - 0.353).abs() < 0.001, "{}", f(5));
        assert!((f(4) - 0.177).abs() < 0.001, "{}", f(4));
        assert!((f(1) - 0.039).abs() < 0.001, "{}", f(1));
        // Directories: Zipf with α = 1, so directory 0 gets twice directory 1's share.
        let d = |dir: usize| -> f64 {
            p.iter()
                .filter(|x| x.1.starts_with(&format!("/dir{dir:05}/")))
                .map(|x| x.0)
                .sum()
        };
        assert!((d(0) / d(1) - 2.0).abs() < 1e-9);
        // The mean body is SPECweb's "roughly 14 KB" or so.
        let m = mean_body_bytes();
        assert!((10_000.0..20_000.0).contains(&m), "{m}");
    }

    fn level(server: &'static str, clients: usize, rps: f64, max_ms: f64, jain: f64) -> Level {
        Level {
            server,
            clients,
            round: 1,
            req_per_s_spread: Spread::of(&[rps]),
            req_per_s: rps,
            bytes_per_s: 0.0,
            mbit_per_s: 0.0,
            mean_ms: 0.0,
            p50_ms: 0.0,
            p99_ms: 0.0,
            max_ms,
            client_jain: Some(jain),
            client_requests_min: 0,
            client_requests_median: 0,
            client_requests_max: 0,
            clients_starved: 0,
            errors: 0,
            errors_by_kind: Default::default(),
            reconnects: 0,
            requests: 1000,
            unfinished: 0,
            unfinished_oldest_ms: None,
            seconds: 1.0,
        }
    }

    #[test]
    fn a_side_with_requests_left_at_the_end_is_not_judged_by_its_completed_ones() {
        // Ours answered its slowest in 100 ms but left 500 requests unfinished, nginx's
        // slowest took 900 ms: the 500 may have waited longer than that.
        let mut ls = vec![
            level("omnistage", 4096, 110.0, 100.0, 0.99),
            level("nginx", 4096, 100.0, 900.0, 0.99),
        ];
        ls[0].unfinished = 500;
        assert_ne!(judge(&ls).max_response_below_nginx, Some(true));
        assert_eq!(
            judge(&ls).max_response_below_nginx,
            None,
            "no age: no verdict"
        );
        // Their age at the end is a lower bound of their latency: 2 s is longer than 900 ms.
        ls[0].unfinished_oldest_ms = Some(2000.0);
        assert_eq!(judge(&ls).max_response_below_nginx, Some(false));
        // Every one of them younger than our slowest response: the maximum stands.
        ls[0].unfinished_oldest_ms = Some(50.0);
        assert_eq!(judge(&ls).max_response_below_nginx, Some(true));
        // No successful response at all: its max of 0 is no latency.
        ls[0].requests = 0;
        assert_eq!(judge(&ls).max_response_below_nginx, None);
    }

    #[test]
    fn goals_are_judged_at_the_top_common_level() {
        let ls = vec![
            level("omnistage", 64, 100.0, 10.0, 0.99),
            level("omnistage", 4096, 110.0, 50.0, 0.985),
            level("nginx", 64, 120.0, 5.0, 0.99),
            level("nginx", 4096, 100.0, 80.0, 0.9),
        ];
        let g = judge(&ls);
        assert_eq!(g.clients, 4096);
        assert_eq!(g.throughput_at_least_nginx, Some(true));
        assert_eq!(g.client_jain_at_least_0_98, Some(true));
        assert_eq!(g.max_response_below_nginx, Some(true));
        assert_eq!(overall(&g), Some(true));
        let g = judge(&ls[..1]);
        assert_eq!(g.throughput_at_least_nginx, None);
        assert_eq!(overall(&g), None);
        // Without nginx an unfair run is reported but not judged either.
        let mut alone = ls[..2].to_vec();
        alone[1].client_jain = Some(0.5);
        let g = judge(&alone);
        assert_eq!(g.client_jain_at_least_0_98, Some(false));
        assert_eq!(overall(&g), None);
        let mut worse = ls.clone();
        worse[1].client_jain = Some(0.97);
        assert_eq!(overall(&judge(&worse)), Some(false));
        // Throughput inside nginx's own range: inconclusive, whichever side of its median.
        let mut close = ls.clone();
        close[3].req_per_s_spread = Spread::of(&[90.0, 100.0, 120.0]);
        close[1].req_per_s_spread = Spread::of(&[95.0]);
        assert_eq!(judge(&close).throughput_at_least_nginx, None);
        close[1].req_per_s_spread = Spread::of(&[105.0]);
        assert_eq!(judge(&close).throughput_at_least_nginx, None);
        close[1].req_per_s_spread = Spread::of(&[121.0]);
        assert_eq!(judge(&close).throughput_at_least_nginx, Some(true));
        close[1].req_per_s_spread = Spread::of(&[60.0]);
        assert_eq!(judge(&close).throughput_at_least_nginx, Some(false));
        // Neither served anything: not judged.
        close[1].req_per_s_spread = Spread::of(&[0.0]);
        close[3].req_per_s_spread = Spread::of(&[0.0, 0.0]);
        assert_eq!(judge(&close).throughput_at_least_nginx, None);
        // nginx served nothing (in every round, or in one): no baseline, not a win.
        close[1].req_per_s_spread = Spread::of(&[100.0]);
        assert_eq!(judge(&close).throughput_at_least_nginx, None);
        close[3].req_per_s_spread = Spread::of(&[0.0, 90.0, 95.0]);
        assert_eq!(judge(&close).throughput_at_least_nginx, None);
        // Nor ours in a round.
        close[1].req_per_s_spread = Spread::of(&[0.0, 200.0, 200.0]);
        close[3].req_per_s_spread = Spread::of(&[90.0, 95.0, 100.0]);
        assert_eq!(judge(&close).throughput_at_least_nginx, None);
    }

    #[test]
    fn bad_arguments_are_refused() {
        let base = SpecwebArgs {
            warmup_s: 0.5,
            levels: vec![64],
            dirs: 2,
            think_ms: 20.0,
            requests_per_conn: 5,
            common: Common::for_test(1.0),
        };
        assert!(check_args(&base).is_ok());
        for (f, needle) in [
            (
                (|a: &mut SpecwebArgs| a.levels = vec![0]) as fn(&mut SpecwebArgs),
                "--levels",
            ),
            (|a| a.levels = vec![CLIENTS_MAX + 1], "--levels"),
            (|a| a.levels = vec![1; LEVELS_MAX + 1], "--levels"),
            (|a| a.dirs = DIRS_MAX + 1, "--dirs"),
            (|a| a.dirs = 0, "--dirs"),
            (|a| a.common.seconds = f64::NAN, "--seconds"),
            (|a| a.warmup_s = 61.0, "--warmup-s"),
            (|a| a.think_ms = -1.0, "--think-ms"),
            (|a| a.requests_per_conn = 0, "--requests-per-conn"),
        ] {
            let mut x = base.clone();
            f(&mut x);
            let e = check_args(&x).unwrap_err();
            assert!(e.contains(needle), "{e}");
        }
    }
}
