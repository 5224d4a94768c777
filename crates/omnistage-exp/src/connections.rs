//! `connections` (SEDA Fig. 7 / C10k): requests/s and resident memory of the server at 100, 1000,
//! 5000 and 10000 keep-alive connections. The server runs as its own process (`omnistage serve`,
//! one worker, the process confined to CPU 0, a fresh process per run, as nginx is); the load
//! generator runs as a child process (`omnistage load`, pinned to CPU 1).
//! Per level: an idle run (each connection sends one request and then thinks for 60 s) gives the
//! resident memory per idle connection, `VmRSS` once all connections are open (the run is
//! stopped then; if some never open within the limit, what was open counts) minus `VmRSS`
//! before, over the connections the server held; an active run (a small
//! think time) gives requests/s and the server's CPU time per request (user + system time of
//! its worker thread, or of nginx's single process, from `/proc`: a figure that stays
//! comparable when the machine is shared and throughput is not). nginx (`/usr/sbin/nginx`, one
//! worker pinned to CPU 0, if installed) is measured the same way from `/proc/PID/status`; it
//! allocates its connection table for `worker_connections` at start, which is in its "before"
//! reading (the page reports it per connection slot).

use super::cfgweb;
use super::harness::median_of;
use super::nginx::{self, TuningChoice};
use super::report::{self, Doc, Table};
use super::rounds::{self, Spread};
use super::util::machine;
use super::Common;
use clap::Args;
use serde::Serialize;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Args, Clone)]
#[command(mut_arg("seconds", |a| a.default_value("3.0").help("Measured seconds of each active run.")))]
#[command(mut_arg("out", |a| a.help("Write connections.json, .md and .svg here.")))]
pub struct ConnectionsArgs {
    /// Connection counts, comma-separated.
    #[arg(long, default_value = "100,1000,5000,10000", value_delimiter = ',')]
    levels: Vec<usize>,
    /// Think time of the active runs, ms.
    #[arg(long, default_value_t = 1.0)]
    think_ms: f64,
    #[command(flatten)]
    common: Common,
}

#[derive(Serialize, Clone, Default)]
struct Level {
    server: &'static str,
    connections: usize,
    /// The round (1-based) of this run; in `levels`, the round of the median run.
    round: usize,
    /// req/s over the rounds of this server and level (in `levels`).
    req_per_s_spread: Option<Spread>,
    /// Connections the server held open when the idle memory was read.
    open_at_reading: usize,
    rss_before_kib: u64,
    rss_idle_kib: u64,
    /// (rss_idle − rss_before) / open_at_reading (the connections the server held), with
    /// rss_idle read once all were open and their first requests answered.
    kib_per_idle_connection: f64,
    /// The same with the most VmRSS seen while they were opening.
    kib_per_idle_connection_peak: f64,
    req_per_s: f64,
    p99_ms: f64,
    errors: u64,
    /// The load generator's errors by kind (active run).
    errors_by_kind: serde_json::Value,
    /// Largest VmRSS seen during the active run.
    rss_active_max_kib: u64,
    /// Seconds the idle run took until the server held every connection, and the active
    /// run's warmup derived from it ([`active_warmup_s`]).
    open_all_s: f64,
    warmup_s: f64,
    /// The server's CPU time (user + system) during the active run's measured window over
    /// its requests, µs; `None` when /proc cannot say.
    server_cpu_us_per_req: Option<f64>,
    /// Its user and system parts (the system part includes the network's softirq work the
    /// kernel did in the thread's time: on loopback, the receipt of what it sent).
    server_user_us_per_req: Option<f64>,
    server_system_us_per_req: Option<f64>,
    /// TCP segments without data (pure ACKs, SYN-ACKs, FINs) the server sent per response in
    /// the active run's measured window, as the load generator's sockets received them
    /// (`TCP_INFO`); `None` where the kernel does not give them.
    server_segments_without_data_per_response: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    experiment: &'static str,
    machine: String,
    seconds: f64,
    think_ms: f64,
    file_bytes: usize,
    fd_soft_limit: Option<u64>,
    fd_note: Option<String>,
    skipped_levels: Vec<usize>,
    repeats: usize,
    /// Per server and level, the run with the median req/s.
    levels: Vec<Level>,
    /// Every run, by level and then round (within a round, in the order run).
    runs: Vec<Level>,
    /// The CPUs nginx's worker was allowed, read from /proc after each nginx run.
    peer_cpus: Vec<String>,
    nginx_tuning: Option<TuningChoice>,
    nginx_note: Option<String>,
    /// req/s at the largest level run / req/s at the smallest: the median over rounds of each
    /// round's ratio (`throughput_ratios`, in round order; the two levels of a round are
    /// measured within a minute of each other).
    throughput_ratio: Option<f64>,
    throughput_ratios: Vec<f64>,
    /// omnistage's KiB per idle connection at the largest level / nginx's.
    memory_ratio_vs_nginx: Option<f64>,
    /// omnistage's server CPU µs per request at the largest level / at the smallest: how much
    /// more each request costs with many connections (1.0: nothing). Median over rounds of
    /// each round's ratio (`cpu_per_req_ratios`), as `throughput_ratio`.
    cpu_per_req_ratio: Option<f64>,
    cpu_per_req_ratios: Vec<f64>,
    /// The same ratio for nginx, measured beside it.
    nginx_cpu_per_req_ratio: Option<f64>,
    nginx_cpu_per_req_ratios: Vec<f64>,
    /// Where a rise is: the same ratio of the user time alone (the server's own code) and of
    /// the system time alone (the kernel's work in its thread, the network's included), per
    /// server, medians over rounds.
    user_per_req_ratio: Option<f64>,
    system_per_req_ratio: Option<f64>,
    nginx_user_per_req_ratio: Option<f64>,
    nginx_system_per_req_ratio: Option<f64>,
    /// nginx's resident memory at start per connection of `worker_connections`, KiB (the
    /// slope of its "before" readings over the levels): memory it holds for every connection
    /// slot, used or not, that its per-idle-connection figure does not include.
    nginx_kib_per_slot_at_start: Option<f64>,
    goal_met: Option<bool>,
}

const FILE: &str = "one.bin";
/// Seconds of each configuration's pre-run that picks nginx's configuration.
const PICK_SECONDS: f64 = 1.0;
const FILE_BYTES: usize = 128;
/// Goal: the server's CPU per request at the largest level at most this times that at the
/// smallest (issue 14: judged on the OS's CPU clock, as the one-core load generator bounds
/// the throughput ratio).
const CPU_PER_REQ_RATIO_MAX: f64 = 1.1;
const FD_SLACK: u64 = 200;

/// Per round (in round order), `server`'s `value` at the `largest` level over that at the
/// `smallest`, for the rounds that measured both (and a positive smallest).
fn paired_ratios(
    runs: &[Level],
    server: &str,
    smallest: usize,
    largest: usize,
    value: fn(&Level) -> Option<f64>,
) -> Vec<f64> {
    if smallest >= largest {
        return Vec::new();
    }
    let at = |round: usize, n: usize| {
        runs.iter()
            .find(|l| l.server == server && l.round == round && l.connections == n)
            .and_then(value)
    };
    let mut rounds: Vec<usize> = runs
        .iter()
        .filter(|l| l.server == server)
        .map(|l| l.round)
        .collect();
    rounds.sort_unstable();
    rounds.dedup();
    rounds
        .into_iter()
        .filter_map(|r| match (at(r, smallest), at(r, largest)) {
            (Some(f), Some(l)) if f > 0.0 => Some(l / f),
            _ => None,
        })
        .collect()
}

/// Per-round ratios for a page: "1.02, 0.97, 1.10".
fn show_ratios(v: &[f64]) -> String {
    v.iter()
        .map(|x| format!("{x:.2}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Name of the server's one worker thread (set by the runtime).
const WORKER_THREAD: &str = "omnistage-w0";

#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(crate) mod sys {
    #[repr(C)]
    struct RLimit {
        cur: u64,
        max: u64,
    }
    const RLIMIT_NOFILE: i32 = 7;
    extern "C" {
        fn getrlimit(resource: i32, rlim: *mut RLimit) -> i32;
        fn setrlimit(resource: i32, rlim: *const RLimit) -> i32;
    }

    /// Raises the soft open-files limit to the hard one; returns (soft, hard) after.
    pub fn raise_nofile() -> Option<(u64, u64)> {
        let mut r = RLimit { cur: 0, max: 0 };
        // SAFETY: getrlimit/setrlimit read or write only the struct passed, which has the
        // layout of `struct rlimit` on 64-bit Linux (two rlim_t = u64).
        unsafe {
            if getrlimit(RLIMIT_NOFILE, &mut r) != 0 {
                return None;
            }
            if r.cur < r.max {
                let want = RLimit {
                    cur: r.max,
                    max: r.max,
                };
                if setrlimit(RLIMIT_NOFILE, &want) == 0 {
                    r.cur = r.max;
                }
            }
        }
        Some((r.cur, r.max))
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub(crate) mod sys {
    pub fn raise_nofile() -> Option<(u64, u64)> {
        None
    }
}

/// Starts `omnistage load --json` as a child process.
fn spawn_load(
    addr: &str,
    conns: usize,
    seconds: f64,
    warmup: f64,
    think_ms: f64,
) -> Result<Child, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    Command::new(exe)
        .args([
            "load",
            "--addr",
            addr,
            "--seconds",
            &seconds.to_string(),
            "--warmup-s",
            &warmup.to_string(),
            "--think-ms",
            &think_ms.to_string(),
            "--timeout-ms",
            "120000",
            "--cpu",
            "1",
            "--json",
            "--tenant",
            &format!("t:a.test:{conns}:path=/{FILE}"),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the load generator: {e}"))
}

fn finish_load(child: Child) -> Result<serde_json::Value, String> {
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "load generator: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("load generator JSON: {e}"))
}

fn err_sum(t: &serde_json::Value) -> u64 {
    t["errors"]
        .as_object()
        .map(|o| o.values().filter_map(|v| v.as_u64()).sum())
        .unwrap_or(0)
}

/// How to read one server: `rss` its VmRSS (KiB), `open` its open connections, `cpu_ticks`
/// the CPU time (user + system, clock ticks) of the thread or process that serves.
struct Probe<'a> {
    rss: &'a dyn Fn() -> u64,
    open: &'a dyn Fn() -> usize,
    cpu_ticks: &'a dyn Fn() -> Option<(u64, u64)>,
}

/// Longest wait for the server to close the idle run's connections.
const CLOSE_WAIT: Duration = Duration::from_secs(10);

/// Longest wait for all connections of the idle run to be open, s: 2 s plus 1 s per 1,000
/// connections (a connect that met a full accept queue retries after 1 s, 3 s, ...).
fn idle_wait_s(n: usize) -> f64 {
    2.0 + n as f64 / 1000.0
}

/// The active run's warmup: 0.5 s plus twice the time the idle run took until the server held
/// every connection, at most [`WARMUP_MAX_S`]. Its connections open and send their first
/// requests in a burst like the idle run's, and the steady state the window measures (req/s,
/// CPU per request, p99) begins after it. (The second-long p99 once seen at 10,000 connections
/// was the load generator's, timing a late connection's first request from the run's start;
/// see `omnistage_load`'s `due_when_connected`.)
fn active_warmup_s(open_all_s: f64) -> f64 {
    (0.5 + 2.0 * open_all_s).min(WARMUP_MAX_S)
}
const WARMUP_MAX_S: f64 = 10.0;

/// Clock ticks per second of /proc's CPU times (`CLK_TCK`, 100 on Linux).
const CLK_TCK: f64 = 100.0;

/// Measures one level against a server.
fn measure(
    server: &'static str,
    addr: &str,
    n: usize,
    a: &ConnectionsArgs,
    p: &Probe<'_>,
) -> Result<Level, String> {
    std::thread::sleep(Duration::from_millis(200));
    let before = (p.rss)();
    // Idle: one request per connection, then a 60 s think; read memory once all are open,
    // then stop the generator (its run is longer than the wait, so it never ends by itself
    // before the reading).
    let wait_s = idle_wait_s(n);
    let mut child = spawn_load(addr, n, wait_s + 5.0, 0.0, 60_000.0)?;
    let t0 = Instant::now();
    let mut open_n = 0;
    let mut idle_rss = 0;
    while t0.elapsed().as_secs_f64() < wait_s {
        open_n = (p.open)();
        idle_rss = idle_rss.max((p.rss)());
        if open_n >= n || child.try_wait().map_err(|e| e.to_string())?.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let open_all_s = t0.elapsed().as_secs_f64();
    // Let the last requests be answered and their buffers settle, then read: what the server
    // holds for its idle connections, including what its allocator kept from the burst of
    // first requests (neither server is asked to give that back). `idle_peak` is the most seen.
    std::thread::sleep(Duration::from_millis(300));
    open_n = open_n.max((p.open)());
    let idle_peak = idle_rss.max((p.rss)());
    let idle_rss = (p.rss)();
    if child.try_wait().map_err(|e| e.to_string())?.is_some() {
        let _ = finish_load(child)?;
    } else {
        // Our own child, by its handle.
        let _ = child.kill();
        let _ = child.wait();
    }
    // Its connections close now: wait until the server has closed them (bounded), so the
    // active run's connections do not meet a connection limit still held by these.
    let t_close = Instant::now();
    while (p.open)() > 0 && t_close.elapsed() < CLOSE_WAIT {
        std::thread::sleep(Duration::from_millis(50));
    }
    // Active: small think time, throughput from the load generator; the server's CPU time
    // over the measured window (it starts after the warmup).
    let warmup_s = active_warmup_s(open_all_s);
    let mut child = spawn_load(addr, n, a.common.seconds, warmup_s, a.think_ms)?;
    let t_active = Instant::now();
    let mut act_max = 0;
    let mut cpu_from: Option<(Instant, (u64, u64))> = None;
    let mut cpu_to: Option<(Instant, (u64, u64))> = None;
    while child.try_wait().map_err(|e| e.to_string())?.is_none() {
        act_max = act_max.max((p.rss)());
        let el = t_active.elapsed().as_secs_f64();
        // The generator's clock starts a little after ours (process start, connects):
        // sample inside its measured window, keeping clear of both edges.
        if cpu_from.is_none() && el >= warmup_s + 0.3 {
            cpu_from = (p.cpu_ticks)().map(|c| (Instant::now(), c));
        } else if el <= warmup_s + a.common.seconds - 0.1 {
            if let Some(c) = (p.cpu_ticks)() {
                if cpu_from.is_some() {
                    cpu_to = Some((Instant::now(), c));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let j = finish_load(child)?;
    let t = &j["total"];
    let req_per_s = t["req_per_s"].as_f64().unwrap_or(0.0);
    let per_conn = |rss: u64| rss.saturating_sub(before) as f64 / open_n.max(1) as f64;
    // µs per request of each: user, system.
    let per_req = match (cpu_from, cpu_to) {
        (Some((t0, (u0, s0))), Some((t1, (u1, s1)))) if t1 > t0 && req_per_s > 0.0 => {
            let reqs = req_per_s * (t1 - t0).as_secs_f64();
            let us = |from: u64, to: u64| to.saturating_sub(from) as f64 / CLK_TCK / reqs * 1e6;
            Some((us(u0, u1), us(s0, s1)))
        }
        _ => None,
    };
    let server_cpu_us_per_req = per_req.map(|(u, s)| u + s);
    Ok(Level {
        server,
        connections: n,
        round: 0,
        req_per_s_spread: None,
        open_at_reading: open_n,
        rss_before_kib: before,
        rss_idle_kib: idle_rss,
        kib_per_idle_connection: per_conn(idle_rss),
        kib_per_idle_connection_peak: per_conn(idle_peak),
        req_per_s,
        p99_ms: t["p99_ms"].as_f64().unwrap_or(0.0),
        errors: err_sum(t),
        errors_by_kind: t["errors"].clone(),
        rss_active_max_kib: act_max,
        open_all_s,
        warmup_s,
        server_cpu_us_per_req,
        server_user_us_per_req: per_req.map(|(u, _)| u),
        server_system_us_per_req: per_req.map(|(_, s)| s),
        server_segments_without_data_per_response: j["server_segments"]
            ["without_data_per_response"]
            .as_f64(),
    })
}

/// User and system CPU ticks from a `/proc/.../stat` file (fields 14 and 15).
fn stat_ticks(path: &str) -> Option<(u64, u64)> {
    let s = std::fs::read_to_string(path).ok()?;
    // The command name (field 2) may hold spaces; the fields after its ')' are fixed.
    let rest = &s[s.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some((f.get(11)?.parse().ok()?, f.get(12)?.parse().ok()?))
}

/// A child server process, killed and reaped when dropped (also on an early return).
struct Served(Child);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The `TASK_DIR/TID/stat` (`/proc/PID/task`) of the thread named `name`.
fn thread_stat_path(task_dir: &str, name: &str) -> Option<String> {
    std::fs::read_dir(task_dir).ok()?.flatten().find_map(|e| {
        let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
        (comm.trim() == name).then(|| format!("{}/stat", e.path().display()))
    })
}

/// TCP sockets a process holds (entries of /proc/PID/fd that are sockets), minus one listener.
fn sockets_of(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    std::fs::read_link(e.path())
                        .map(|l| l.to_string_lossy().starts_with("socket:"))
                        .unwrap_or(false)
                })
                .count()
                .saturating_sub(1)
        })
        .unwrap_or(0)
}

pub fn run(a: ConnectionsArgs) -> Result<(), String> {
    if !(0.3..=600.0).contains(&a.common.seconds)
        || a.levels.is_empty()
        || a.levels.len() > 10
        || a.levels.iter().any(|&n| !(1..=100_000).contains(&n))
        || !(0.0..=10_000.0).contains(&a.think_ms)
    {
        return Err(
            "--seconds 0.3..=600, --levels 1 to 10 counts in 1..=100000, --think-ms 0..=10000"
                .into(),
        );
    }
    let limits = sys::raise_nofile();
    let soft = limits.map(|l| l.0);
    let ports = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            let v: Vec<u64> = s
                .split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect();
            (v.len() == 2).then(|| v[1].saturating_sub(v[0]) + 1)
        });
    let mut run_levels = Vec::new();
    let mut skipped = Vec::new();
    for &n in &a.levels {
        let fits_fd = soft.is_none_or(|s| n as u64 + FD_SLACK <= s);
        let fits_port = ports.is_none_or(|p| n as u64 <= p);
        if fits_fd && fits_port {
            run_levels.push(n);
        } else {
            skipped.push(n);
        }
    }
    let fd_note = limits.map(|(s, h)| {
        format!("open files: soft limit raised to {s} (hard {h}); the server and the load generator are separate processes, each needing one fd per connection plus slack")
    });
    let root = std::env::temp_dir().join(format!("omnistage-connections-{}", std::process::id()));
    std::fs::create_dir_all(&root).map_err(|e| e.to_string())?;
    std::fs::write(root.join(FILE), vec![b'x'; FILE_BYTES]).map_err(|e| e.to_string())?;
    let max_n = run_levels.iter().copied().max().unwrap_or(100);
    let tenant = format!(
        "[[tenant]]\nname = \"a\"\nhosts = [\"a.test\"]\ndocroot = \"{}\"\n",
        root.display()
    );
    // One omnistage run at `n` connections: a fresh `omnistage serve` process each run, confined
    // to the server's CPU like nginx (memory is read from a process that served nothing else:
    // run in this process, a server's idle figure depended on what the servers before it had
    // left in the allocator, 0.00 to 0.58 KiB per connection).
    let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    let ours = |n: usize, a: &ConnectionsArgs| -> Result<Level, String> {
        let port = nginx::free_port()?;
        let config = root.join("omnistage.toml");
        std::fs::write(
            &config,
            format!(
                "[server]\nlisten = [\"127.0.0.1:{port}\"]\nworkers = 1\nconnections_max = {}\n\
                 keepalive_timeout_ms = 120000\n\n{tenant}",
                max_n + 100
            ),
        )
        .map_err(|e| e.to_string())?;
        let mut cmd = Command::new(&exe);
        cmd.arg("serve")
            .arg("--config")
            .arg(&config)
            .args(["--admin", "off", "--pin"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        nginx::confine_to_server_cpu(&mut cmd);
        let mut server = Served(
            cmd.spawn()
                .map_err(|e| format!("cannot start omnistage serve: {e}"))?,
        );
        let pid = server.0.id();
        let t0 = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = server.0.try_wait() {
                return Err(format!("omnistage serve exited at start ({status})"));
            }
            if t0.elapsed() > Duration::from_secs(10) {
                return Err(format!(
                    "omnistage serve did not listen on {port} within 10 s"
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Sockets it holds besides its clients' (its listener is already left out): counted
        // once the probe connection above is closed.
        std::thread::sleep(Duration::from_millis(200));
        let own_sockets = sockets_of(pid);
        let task_dir = format!("/proc/{pid}/task");
        let lv = measure(
            "omnistage",
            &format!("127.0.0.1:{port}"),
            n,
            a,
            &Probe {
                rss: &|| cfgweb::rss_kib(&pid.to_string()).unwrap_or(0),
                open: &|| sockets_of(pid).saturating_sub(own_sockets),
                // Looked up when read: the worker may not be named yet at start.
                cpu_ticks: &|| {
                    thread_stat_path(&task_dir, WORKER_THREAD).and_then(|p| stat_ticks(&p))
                },
            },
        );
        let cpus = nginx::cpus_allowed(pid)?;
        drop(server);
        let lv = lv?;
        if cpus != nginx::SERVER_CPU.to_string() {
            return Err(format!(
                "omnistage serve ran on CPUs {cpus}, not {}",
                nginx::SERVER_CPU
            ));
        }
        Ok(lv)
    };
    // One nginx run at `n` connections (a fresh nginx each run, `worker_connections` twice
    // `n`), and where its worker was allowed to run, read after the run.
    let theirs =
        |n: usize, a: &ConnectionsArgs, tuning: nginx::Tuning| -> Result<(Level, String), String> {
            let dir = root.join(format!("nginx-{n}"));
            std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
            let port = nginx::free_port()?;
            let ng = nginx::start(
                &a.common.nginx,
                &dir,
                port,
                n,
                tuning,
                &nginx::server_block(port, &root, None, ""),
            )?;
            let pid = ng.pid();
            let stat = format!("/proc/{pid}/stat");
            let lv = measure(
                "nginx",
                &format!("127.0.0.1:{port}"),
                n,
                a,
                &Probe {
                    rss: &|| cfgweb::rss_kib(&pid.to_string()).unwrap_or(0),
                    open: &|| sockets_of(pid),
                    cpu_ticks: &|| stat_ticks(&stat),
                },
            )?;
            let cpus = ng.serving_cpus()?;
            Ok((lv, cpus))
        };
    let mut runs = Vec::new();
    let mut peer_cpus = Vec::new();
    let mut tuning = None;
    let result = (|| -> Result<Option<String>, String> {
        let mut nginx_note = None;
        if !a.common.nginx.exists() {
            nginx_note = Some(format!("{} not installed", a.common.nginx.display()));
        } else {
            // The pre-run: each standard configuration at the smallest level, briefly.
            let pre = ConnectionsArgs {
                common: Common {
                    seconds: PICK_SECONDS,
                    ..a.common.clone()
                },
                ..a.clone()
            };
            match nginx::best_tuning(PICK_SECONDS, |t| {
                theirs(run_levels[0], &pre, t).map(|(l, _)| l.req_per_s)
            }) {
                Ok(c) => tuning = Some(c),
                Err(e) => nginx_note = Some(e),
            }
        }
        let servers: &[&'static str] = if tuning.is_some() {
            &["omnistage", "nginx"]
        } else {
            &["omnistage"]
        };
        // Round by round, each server runs every level in turn (the servers' order and the
        // levels' order reversed every other round), so that the ratios the goals judge
        // compare a server's smallest and largest levels measured within a minute of each
        // other. Run level by level, they were minutes apart, and this shared host's load
        // moves over minutes: the same build's CPU ratio read 0.87× and 1.39× in two runs.
        let r = rounds::alternate(a.common.repeats, servers, |round, s| {
            let mut order = run_levels.clone();
            if round % 2 == 1 {
                order.reverse();
            }
            let mut out = Vec::with_capacity(order.len());
            for n in order {
                let mut l = match (s, &tuning) {
                    ("nginx", Some(t)) => {
                        let (l, cpus) = theirs(n, &a, t.picked)?;
                        peer_cpus.push(cpus);
                        l
                    }
                    _ => ours(n, &a)?,
                };
                l.round = round + 1;
                out.push(l);
            }
            Ok(out)
        })?;
        runs.extend(r.into_iter().flat_map(|(_, _, ls)| ls));
        // The tables read per server and level in the levels' order.
        runs.sort_by_key(|l| (l.connections, l.round));
        Ok(nginx_note)
    })();
    let _ = std::fs::remove_dir_all(&root);
    let nginx_note = result?;
    // Per server and level, the run with the median req/s (its spread over the rounds beside).
    let levels: Vec<Level> =
        rounds::median_runs(&runs, |l| (l.server, l.connections), |l| l.req_per_s)
            .into_iter()
            .map(|(mut l, spread)| {
                l.req_per_s_spread = Some(spread);
                l
            })
            .collect();
    let ours: Vec<&Level> = levels.iter().filter(|l| l.server == "omnistage").collect();
    let (smallest, largest) = (
        run_levels.iter().copied().min().unwrap_or(0),
        run_levels.iter().copied().max().unwrap_or(0),
    );
    let paired = |server: &str, value: fn(&Level) -> Option<f64>| {
        paired_ratios(&runs, server, smallest, largest, value)
    };
    let throughput_ratios = paired("omnistage", |l| Some(l.req_per_s));
    let throughput_ratio = median_of(&throughput_ratios);
    let nginx_last = levels.iter().rfind(|l| l.server == "nginx");
    let memory_ratio_vs_nginx = match (ours.last(), nginx_last) {
        (Some(o), Some(n)) if n.kib_per_idle_connection > 0.0 => {
            Some(o.kib_per_idle_connection / n.kib_per_idle_connection)
        }
        _ => None,
    };
    let cpu_per_req_ratios = paired("omnistage", |l| l.server_cpu_us_per_req);
    let cpu_per_req_ratio = median_of(&cpu_per_req_ratios);
    let ng: Vec<&Level> = levels.iter().filter(|l| l.server == "nginx").collect();
    let nginx_cpu_per_req_ratios = paired("nginx", |l| l.server_cpu_us_per_req);
    let nginx_cpu_per_req_ratio = median_of(&nginx_cpu_per_req_ratios);
    let user_per_req_ratio = median_of(&paired("omnistage", |l| l.server_user_us_per_req));
    let system_per_req_ratio = median_of(&paired("omnistage", |l| l.server_system_us_per_req));
    let nginx_user_per_req_ratio = median_of(&paired("nginx", |l| l.server_user_us_per_req));
    let nginx_system_per_req_ratio = median_of(&paired("nginx", |l| l.server_system_us_per_req));
    let nginx_kib_per_slot_at_start = match (ng.first(), ng.last()) {
        (Some(f), Some(l)) if l.connections > f.connections => Some(
            (l.rss_before_kib as f64 - f.rss_before_kib as f64)
                / (nginx::SLOTS_PER_CONNECTION * (l.connections - f.connections)) as f64,
        ),
        _ => None,
    };
    let cpu_met = cpu_per_req_ratio.map(|c| c <= CPU_PER_REQ_RATIO_MAX);
    let goal_met = match (throughput_ratio, memory_ratio_vs_nginx, cpu_met) {
        (Some(t), Some(m), Some(c)) => Some(t >= 0.9 && m <= 1.0 && c),
        (Some(t), _, c) if t < 0.9 || c == Some(false) => Some(false),
        _ => None,
    };
    let r = Report {
        experiment: "connections",
        machine: machine(),
        seconds: a.common.seconds,
        think_ms: a.think_ms,
        file_bytes: FILE_BYTES,
        fd_soft_limit: soft,
        fd_note,
        skipped_levels: skipped,
        repeats: a.common.repeats,
        levels,
        runs,
        peer_cpus,
        nginx_tuning: tuning,
        nginx_note,
        throughput_ratio,
        throughput_ratios,
        memory_ratio_vs_nginx,
        cpu_per_req_ratio,
        cpu_per_req_ratios,
        nginx_cpu_per_req_ratio,
        nginx_cpu_per_req_ratios,
        user_per_req_ratio,
        system_per_req_ratio,
        nginx_user_per_req_ratio,
        nginx_system_per_req_ratio,
        nginx_kib_per_slot_at_start,
        goal_met,
    };
    let mut t = Table::new(&[
        "server",
        "connections",
        "open at reading",
        "req/s",
        "p99 ms",
        "all open s / warmup s",
        "errors",
        "server CPU µs / req",
        "(user + sys)",
        "server's segments without data / response",
        "RSS before MiB",
        "RSS idle MiB",
        "KiB / idle conn",
        "(peak)",
        "RSS max active MiB",
    ]);
    for l in &r.levels {
        t.row(vec![
            l.server.into(),
            l.connections.to_string(),
            l.open_at_reading.to_string(),
            l.req_per_s_spread
                .map(|s| s.show(0))
                .unwrap_or_else(|| format!("{:.0}", l.req_per_s)),
            format!("{:.2}", l.p99_ms),
            format!("{:.2} / {:.2}", l.open_all_s, l.warmup_s),
            l.errors.to_string(),
            l.server_cpu_us_per_req
                .map(|c| format!("{c:.1}"))
                .unwrap_or_else(|| "–".into()),
            match (l.server_user_us_per_req, l.server_system_us_per_req) {
                (Some(u), Some(s)) => format!("{u:.1} + {s:.1}"),
                _ => "–".into(),
            },
            l.server_segments_without_data_per_response
                .map_or_else(|| "–".into(), |g| format!("{g:.2}")),
            format!("{:.1}", l.rss_before_kib as f64 / 1024.0),
            format!("{:.1}", l.rss_idle_kib as f64 / 1024.0),
            format!("{:.2}", l.kib_per_idle_connection),
            format!("{:.2}", l.kib_per_idle_connection_peak),
            format!("{:.1}", l.rss_active_max_kib as f64 / 1024.0),
        ]);
    }
    let mut notes = Vec::new();
    if !r.skipped_levels.is_empty() {
        notes.push(format!(
            "Skipped for lack of file descriptors or local ports: {:?} (soft open-files limit {:?}).",
            r.skipped_levels, r.fd_soft_limit
        ));
    }
    if let Some(n) = &r.nginx_note {
        notes.push(format!("nginx not measured: {n}."));
    }
    notes.extend(nginx::page_notes(r.nginx_tuning.as_ref(), &r.peer_cpus));
    for l in &r.levels {
        if l.open_at_reading < l.connections {
            notes.push(format!(
                "{} at {}: only {} connections were open when the idle memory was read (within {:.0} s); the per-connection figure is over those.",
                l.server, l.connections, l.open_at_reading, idle_wait_s(l.connections)
            ));
        }
    }
    notes.push(match (r.throughput_ratio, r.cpu_per_req_ratio) {
        (Some(t), Some(c)) => format!(
            "Throughput: req/s at the largest level is {t:.2}× that at the smallest (median of the rounds' ratios {}; goal ≥ 0.90: {}); \
             the server's CPU time per request is {c:.2}× ({}; goal ≤ {CPU_PER_REQ_RATIO_MAX:.2}: {}; nginx {}; a figure the machine's other load disturbs less; at the \
             smallest level the think time alone bounds req/s to {:.0}, as each connection waits {} ms between requests).",
            show_ratios(&r.throughput_ratios),
            if t >= 0.9 { "met" } else { "not met" },
            show_ratios(&r.cpu_per_req_ratios),
            if c <= CPU_PER_REQ_RATIO_MAX { "met" } else { "not met" },
            r.nginx_cpu_per_req_ratio
                .map_or("not measured".to_string(), |n| format!(
                    "{n:.2}× ({})",
                    show_ratios(&r.nginx_cpu_per_req_ratios)
                )),
            r.levels
                .iter()
                .find(|l| l.server == "omnistage")
                .map_or(0.0, |l| l.connections as f64 * 1000.0 / r.think_ms.max(1e-3)),
            r.think_ms
        ),
        (Some(t), None) => format!(
            "Throughput: req/s at the largest level is {t:.2}× that at the smallest (goal ≥ 0.90: {}).",
            if t >= 0.9 { "met" } else { "not met" }
        ),
        _ => "Throughput ratio: needs two levels.".into(),
    });
    if let (Some(u), Some(s)) = (r.user_per_req_ratio, r.system_per_req_ratio) {
        let segments = |server: &str| {
            let at = |pick: fn(&[&Level]) -> Option<f64>| {
                let of: Vec<&Level> = r.levels.iter().filter(|l| l.server == server).collect();
                pick(&of).map_or("–".to_string(), |g| format!("{g:.2}"))
            };
            format!(
                "{} at the smallest level, {} at the largest",
                at(|v| v.first()?.server_segments_without_data_per_response),
                at(|v| v.last()?.server_segments_without_data_per_response)
            )
        };
        let ratio = |x: Option<f64>| x.map_or("–".to_string(), |v| format!("{v:.2}×"));
        notes.push(format!(
            "Where the CPU per request goes from the smallest level to the largest: omnistage's user time (its own code) {u:.2}×, its system time (the kernel's work in its thread, the network's included) {s:.2}×; nginx's {} and {}. Segments without data the server sent per response, read from the load generator's sockets (TCP_INFO): omnistage {}; nginx {}. On loopback each segment a server sends is received in the server's own time, and a request answered later than the kernel's delayed-ACK timeout (40 ms at least) gets a pure ACK before its response.",
            ratio(r.nginx_user_per_req_ratio),
            ratio(r.nginx_system_per_req_ratio),
            segments("omnistage"),
            segments("nginx"),
        ));
    }
    if let Some(m) = r.memory_ratio_vs_nginx {
        notes.push(format!(
            "Memory: omnistage holds {m:.2}× nginx's resident memory per idle connection at the largest level (goal ≤ 1.00: {}).",
            if m <= 1.0 { "met" } else { "not met" }
        ));
    }
    if let Some(k) = r.nginx_kib_per_slot_at_start {
        notes.push(format!(
            "nginx allocates its connection table for worker_connections (set to twice the level, at least 1,024) at start: \
             its RSS before grows by {k:.2} KiB per connection slot over the levels. That memory is in its \
             \"before\" reading, so it is not in its KiB per idle connection; omnistage allocates a connection's \
             slot when it accepts, so its figure includes it."
        ));
    }
    let doc = Doc {
        title: "connections: requests/s and memory per connection, 100 to 10,000 keep-alive connections (SEDA Fig. 7)".into(),
        command: format!(
            "omnistage exp connections --seconds {} --repeats {} --levels {} --think-ms {}",
            a.common.seconds,
            a.common.repeats,
            a.levels.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(","),
            a.think_ms
        ),
        machine: r.machine.clone(),
        intro: vec![format!(
            "The HTTP server as its own process (`omnistage serve`, 1 worker, the process confined to CPU 0 and read back \
             from /proc after each run, a fresh process per run) and, where installed, nginx \
             (master and one worker, the worker under worker_cpu_affinity on CPU 0, a fresh nginx per run with \
             worker_connections twice the level, its configuration picked by a pre-run). {} rounds: in each, each server \
             runs every level in turn (the servers' order and the levels' order reversed every other round), so that a \
             server's smallest and largest levels are measured within a minute of each other; the goals' ratios are \
             the medians over rounds of each round's ratio. The table shows per server and level the run with \
             the median req/s, req/s as median (min–max). The load generator runs as a child process on CPU 1 so its memory is not counted. \
             Per level: an idle run opens every connection, sends one request on each and then thinks for 60 s; the \
             server's VmRSS once all connections are open and their first requests answered, minus its VmRSS before \
             over the connections it held, is the memory per idle connection (the goal's figure; neither server gives \
             its allocator's free pages back before that reading). Also shown: the peak while the connections opened. An active run then sends a {FILE_BYTES}-byte file with {} ms think \
             time for {} s, after a warmup of 0.5 s plus twice the time the idle run took until the server held every \
             connection (at most {WARMUP_MAX_S} s: the active run opens its connections in the same burst, and the window \
             measures the steady state after it); the server's CPU time (its worker thread, or nginx's one process, \
             from /proc) over the requests in that window is its CPU per request. Goal: req/s at the largest level ≥ 90 % of that at the smallest, the \
             server's CPU per request there ≤ {CPU_PER_REQ_RATIO_MAX:.2}× that at the smallest, and KiB per idle \
             connection ≤ nginx's.",
            a.common.repeats, a.think_ms, a.common.seconds
        )],
        tables: vec![(String::new(), t)],
        notes,
    };
    let series: Vec<(String, Vec<(f64, f64)>)> = ["omnistage", "nginx"]
        .iter()
        .map(|&s| {
            (
                format!("{s} req/s"),
                r.levels
                    .iter()
                    .filter(|l| l.server == s)
                    .map(|l| (l.connections as f64, l.req_per_s))
                    .collect::<Vec<_>>(),
            )
        })
        .filter(|s| !s.1.is_empty())
        .collect();
    report::emit(
        "connections",
        &r,
        &doc,
        a.common.json,
        a.common.out(),
        |p| {
            report::svg_lines(
                p,
                "Requests/s vs keep-alive connections",
                "connections",
                "req/s",
                &series,
            )
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(server: &'static str, round: usize, connections: usize, cpu: Option<f64>) -> Level {
        Level {
            server,
            round,
            connections,
            req_per_s: 1000.0,
            server_cpu_us_per_req: cpu,
            ..Default::default()
        }
    }

    /// Each round's largest level is divided by the same round's smallest, never another
    /// round's; rounds missing a reading, and other servers' runs, are left out.
    #[test]
    fn ratios_pair_the_levels_of_one_round() {
        let runs = vec![
            run("omnistage", 1, 100, Some(10.0)),
            run("nginx", 1, 100, Some(1.0)),
            run("omnistage", 2, 100, Some(20.0)),
            run("omnistage", 3, 100, None),
            run("omnistage", 1, 1000, Some(99.0)),
            run("omnistage", 1, 10000, Some(11.0)),
            run("omnistage", 2, 10000, Some(30.0)),
            run("omnistage", 3, 10000, Some(5.0)),
            run("nginx", 1, 10000, Some(3.0)),
        ];
        let cpu = |l: &Level| l.server_cpu_us_per_req;
        let ours = paired_ratios(&runs, "omnistage", 100, 10000, cpu);
        assert_eq!(ours, vec![1.1, 1.5]);
        assert!((median_of(&ours).unwrap() - 1.3).abs() < 1e-12);
        assert_eq!(paired_ratios(&runs, "nginx", 100, 10000, cpu), vec![3.0]);
        // One level: no ratio.
        assert!(paired_ratios(&runs, "omnistage", 100, 100, cpu).is_empty());
        assert_eq!(median_of(&[]), None);
    }
}
