//! `soak`: `omnistage serve` (a child process, its worker pinned to CPU 0) with three tenants
//! (weights 50/33/17) for `--minutes` under load and faults from this process (pinned to CPU 1).
//!
//! The run is a chain of 20 s cycles: a 12 s fault burst, then an 8 s quiet window.
//! - All along: per tenant 4 keep-alive connections of `/_burn?us=500` (the share load: every
//!   tenant backlogged), and a fresh client's `GET /` on a new connection every second.
//! - In a burst, besides: mixed load per tenant (keep-alive, one request per connection,
//!   pipelined, ranges, a 4 MiB file); faults (clients gone mid-response, resets with SO_LINGER 0,
//!   half-closed requests, the mutation fuzzer's requests, a slowloris crowd of `--slowloris`
//!   connections); SIGHUP every 3 s alternating a good and a bad config file; an admin change
//!   every second (weights, CPU caps, a p90 target, creating and removing activities).
//! - A quiet window starts by undoing the burst's changes (the good file and SIGHUP, the
//!   tenants' weights and caps put back through the API, the crowd closed); its last 6 s are
//!   judged: each tenant's share of the burn completions the clients counted, against its weight.
//!
//! Every answer to a correct request is checked byte for byte against the file it names (or the
//! burn endpoint's body); every answer's status is read, the fuzzer's too (a 500 is a finding).
//! Per interval: the server's RSS and open descriptors (from /proc), requests/s, errors,
//! 500s, wrong bytes, panics (the server's `/metrics` counter; its stderr at the end), and the
//! slowest fresh client. Goals: no panic, no 500, no wrong byte (correctness: the run fails
//! when one is broken); RSS and descriptors flat after warm-up, shares within 5 points of the
//! weights in every quiet window, a fresh client answered within 1 s (timing: reported).

use super::report::{self, Doc, Table};
use super::util::machine;
use clap::Args;
use omnistage_admin::client::Client;
use serde::Serialize;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod clients;

use clients::*;

const TENANTS: [(&str, u32); 3] = [("a", 50), ("b", 33), ("c", 17)];
const CYCLE_S: f64 = 20.0;
const BURST_S: f64 = 12.0;
/// Quiet seconds given to settle (the undo, the crowd's sockets closing) before judging.
const SETTLE_S: f64 = 2.0;
const SHARE_GOAL_PTS: f64 = 5.0;
const FRESH_GOAL_S: f64 = 1.0;
/// Flat: the last third's max ≤ the first post-warm-up third's max × FLAT_FACTOR + slack.
const FLAT_FACTOR: f64 = 1.1;
const RSS_SLACK_KIB: f64 = 8192.0;
const FD_SLACK: f64 = 64.0;

#[derive(Args, Clone)]
pub struct SoakArgs {
    /// Length of the run, minutes (fractions allowed).
    #[arg(long, default_value_t = 30.0)]
    minutes: f64,
    /// Length of the run in seconds instead (for CI); at least one cycle, 20 s.
    #[arg(long)]
    seconds: Option<f64>,
    /// Seconds per sample of the time series.
    #[arg(long, default_value_t = 5.0)]
    interval_s: f64,
    /// Connections of the slowloris crowd in each burst.
    #[arg(long, default_value_t = 2000)]
    slowloris: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Write soak.json, soak.md and soak.svg into this directory.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn config_text(port: u16, root: &Path, good: bool) -> String {
    let mut s = format!(
        "# exp soak\n[server]\nlisten = [\"127.0.0.1:{port}\"]\nworkers = 1\n\
         connections_max = 20000\nheader_timeout_ms = 4000\n"
    );
    for (name, weight) in TENANTS {
        // The bad file gives b a weight the server refuses: the reload is refused, the old
        // config keeps serving.
        let w = if !good && name == "b" { 0 } else { weight };
        s.push_str(&format!(
            "\n[[tenant]]\nname = \"{name}\"\nhosts = [\"{name}.test\"]\nweight = {w}\n\
             docroot = \"{}\"\nsynthetic = true\n",
            root.display()
        ));
    }
    s
}

/// The server's VmRSS (KiB) and open descriptors, from /proc.
fn proc_usage(pid: u32) -> (f64, f64) {
    let rss = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(f64::NAN);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count() as f64)
        .unwrap_or(f64::NAN);
    (rss, fds)
}

/// The sum of `omnistage_stage_panics_total` in the server's /metrics.
fn panics_metric(admin: &Client) -> Option<f64> {
    let r = admin.request("GET", "/metrics", None).ok()?;
    Some(
        r.text()
            .lines()
            .filter(|l| l.starts_with("omnistage_stage_panics_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum(),
    )
}

fn sighup(pid: u32) {
    // SAFETY: kill(2) with a pid of our own child and a signal number; no memory is shared.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGHUP);
    }
}

/// The admin change made at second `k` of a burst.
fn admin_change(admin: &Client, k: u64) -> Result<u16, String> {
    let (t, _) = TENANTS[(k % 3) as usize];
    let put = |p: &str, body: String| {
        admin
            .request(
                "PUT",
                &format!("/api/v1/activities{p}"),
                Some(body.as_bytes()),
            )
            .map(|r| r.status)
    };
    match k % 6 {
        0 => put(
            &format!("/tenants/{t}"),
            format!("{{\"weight\": {}}}", [20, 70, 45, 90][(k / 6 % 4) as usize]),
        ),
        1 => put(
            &format!("/tenants/{t}"),
            r#"{"cap": {"cores": 0.3}}"#.into(),
        ),
        2 => put(
            "/tenants/c",
            r#"{"admission": {"stage": "http.work", "predicate": "p90", "target_ms": 40}}"#.into(),
        ),
        3 => put(&format!("/soak-{k}"), r#"{"weight": 10}"#.into()),
        4 => admin
            .request(
                "DELETE",
                &format!("/api/v1/activities/soak-{}", k - 1),
                None,
            )
            .map(|r| r.status),
        _ => put(&format!("/tenants/{t}"), r#"{"cap": null}"#.into()),
    }
}

/// Undoes a burst: the good file and SIGHUP, weights and caps back, the p90 target off, the
/// activities it made removed.
fn undo(admin: &Client, cfg: &Path, good: &str, pid: u32, made_upto: u64) -> Result<(), String> {
    std::fs::write(cfg, good).map_err(|e| e.to_string())?;
    sighup(pid);
    for (t, w) in TENANTS {
        admin.request(
            "PUT",
            &format!("/api/v1/activities/tenants/{t}"),
            Some(format!("{{\"weight\": {w}, \"cap\": null}}").as_bytes()),
        )?;
    }
    admin.request(
        "PUT",
        "/api/v1/activities/tenants/c",
        Some(br#"{"admission": {"stage": "http.work", "predicate": "inherit"}}"#),
    )?;
    for k in made_upto.saturating_sub(12)..=made_upto {
        let _ = admin.request("DELETE", &format!("/api/v1/activities/soak-{k}"), None);
    }
    Ok(())
}

#[derive(Serialize, Clone, Default)]
struct Sample {
    t_s: f64,
    phase: &'static str,
    rss_kib: f64,
    fds: f64,
    req_per_s: f64,
    errors: u64,
    status_503: u64,
    status_500_total: u64,
    wrong_bytes_total: u64,
    panics_total: Option<f64>,
    fresh_max_ms: f64,
}

#[derive(Serialize, Clone)]
struct QuietWindow {
    t_s: f64,
    completions: [u64; 3],
    shares: [f64; 3],
    max_error_pts: f64,
}

#[derive(Serialize)]
struct Flat {
    first_third_max: f64,
    last_third_max: f64,
    bound: f64,
    flat: bool,
}

#[derive(Serialize)]
struct SoakResult {
    experiment: &'static str,
    machine: String,
    seconds: f64,
    interval_s: f64,
    warmup_s: f64,
    slowloris: usize,
    slowloris_nofile: Option<(u64, u64)>,
    samples: Vec<Sample>,
    quiet_windows: Vec<QuietWindow>,
    weights: [u32; 3],
    requests_ok: u64,
    errors: BTreeMap<String, u64>,
    status_503: u64,
    status_500: u64,
    wrong_bytes: u64,
    panics_metric: Option<f64>,
    panic_lines_stderr: usize,
    faults: u64,
    fuzz_requests: u64,
    admin_changes: u64,
    admin_refused: u64,
    sighups: u64,
    examples: Vec<String>,
    rss: Option<Flat>,
    fds: Option<Flat>,
    fresh_max_ms: f64,
    share_goal_pts: f64,
    correctness_met: bool,
    flat_met: bool,
    shares_met: bool,
    fresh_met: bool,
    goal_met: bool,
}

/// Whether `series` (post-warm-up values in time order) is flat: the last third's max ≤ the
/// first third's max × [`FLAT_FACTOR`] + `slack`. `None` with fewer than 3 values.
fn flat(series: &[f64], slack: f64) -> Option<Flat> {
    let n = series.len() / 3;
    if n == 0 {
        return None;
    }
    let max = |s: &[f64]| s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let first = max(&series[..n]);
    let last = max(&series[series.len() - n..]);
    let bound = first * FLAT_FACTOR + slack;
    Some(Flat {
        first_third_max: first,
        last_third_max: last,
        bound,
        flat: last <= bound,
    })
}

/// Each tenant's share of `done` and the largest distance from its weight, points.
fn shares(done: [u64; 3]) -> ([f64; 3], f64) {
    let total = done.iter().sum::<u64>().max(1) as f64;
    let wsum: u32 = TENANTS.iter().map(|t| t.1).sum();
    let mut s = [0.0; 3];
    let mut worst: f64 = 0.0;
    for i in 0..3 {
        s[i] = done[i] as f64 / total;
        worst = worst.max((s[i] - f64::from(TENANTS[i].1) / f64::from(wsum)).abs() * 100.0);
    }
    (s, worst)
}

/// Stops the server at the end (or on an error): SIGTERM, then SIGKILL after 10 s.
struct ServerProc(Child);
impl Drop for ServerProc {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.0.id() as libc::pid_t, libc::SIGTERM);
        }
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn run(a: SoakArgs) -> Result<(), String> {
    let seconds = a.seconds.unwrap_or(a.minutes * 60.0);
    if !(CYCLE_S..=24.0 * 3600.0).contains(&seconds) {
        return Err(format!("the soak runs {CYCLE_S} s..=24 h"));
    }
    if !(1.0..=60.0).contains(&a.interval_s) {
        return Err("--interval-s 1..=60".into());
    }
    if a.slowloris > 50_000 {
        return Err("--slowloris 0..=50000".into());
    }
    let nofile = super::connections::sys::raise_nofile();
    let dir = std::env::temp_dir().join(format!("omnistage-soak-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let result = soak(&a, seconds, &dir, nofile);
    let _ = std::fs::remove_dir_all(&dir);
    let r = result?;
    let doc = page(&r, &a);
    report::emit("soak", &r, &doc, a.json, a.out.as_deref(), |p| chart(p, &r))?;
    if !r.correctness_met {
        return Err(format!(
            "soak: correctness broken: {} panics (metrics) / {} panic lines, {} 500s, {} wrong bytes",
            r.panics_metric.unwrap_or(f64::NAN),
            r.panic_lines_stderr,
            r.status_500,
            r.wrong_bytes
        ));
    }
    Ok(())
}

fn soak(
    a: &SoakArgs,
    seconds: f64,
    dir: &Path,
    nofile: Option<(u64, u64)>,
) -> Result<SoakResult, String> {
    let root = dir.join("www");
    std::fs::create_dir_all(&root).map_err(|e| e.to_string())?;
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let small: Vec<u8> = (0..SMALL_BYTES).map(|i| b'a' + (i % 26) as u8).collect();
    let large: Vec<u8> = (0..LARGE_BYTES).map(|_| rng.next() as u8).collect();
    std::fs::write(root.join("index.html"), &small).map_err(|e| e.to_string())?;
    std::fs::write(root.join("large.bin"), &large).map_err(|e| e.to_string())?;
    let port = super::fleet::free_port()?;
    let admin_port = super::fleet::free_port()?;
    let cfg = dir.join("soak.toml");
    let good = config_text(port, &root, true);
    let bad = config_text(port, &root, false);
    std::fs::write(&cfg, &good).map_err(|e| e.to_string())?;
    let log_path = dir.join("server.log");
    let log = std::fs::File::create(&log_path).map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // The server's threads on CPU 0 (taskset when there is one; its worker pinned either way).
    let mut cmd = if Command::new("taskset").arg("-V").output().is_ok() {
        let mut c = Command::new("taskset");
        c.args(["-c", "0"]).arg(&exe);
        c
    } else {
        Command::new(&exe)
    };
    let child = cmd
        .arg("serve")
        .arg("--config")
        .arg(&cfg)
        .arg("--pin")
        .args(["--admin", &format!("127.0.0.1:{admin_port}")])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("cannot start the server: {e}"))?;
    let server = ServerProc(child);
    let pid = server.0.id();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    super::fleet::wait_connect(addr, "omnistage serve")?;
    super::fleet::wait_connect(
        SocketAddr::from(([127, 0, 0, 1], admin_port)),
        "omnistage admin",
    )?;
    let admin = Client::new(&format!("http://127.0.0.1:{admin_port}"), None)?;
    // Read before this thread pins itself: pinned, it would see one CPU.
    let machine = machine();
    pin_to_load_cpu();

    let sh = Arc::new(Shared {
        addr,
        stats: Stats::default(),
        phase: AtomicU8::new(BURST),
        stop: AtomicBool::new(false),
        small,
        large,
    });
    let mut threads = Vec::new();
    let mut spawn = |f: Box<dyn FnOnce() + Send>| threads.push(std::thread::spawn(f));
    for t in 0..3 {
        for _ in 0..SHARE_CONNS {
            let sh = sh.clone();
            spawn(Box::new(move || share_client(&sh, t)));
        }
        let sh2 = sh.clone();
        spawn(Box::new(move || mixed_client(&sh2, t)));
    }
    {
        let sh = sh.clone();
        spawn(Box::new(move || fault_client(&sh)));
    }
    {
        let sh = sh.clone();
        let n = a.slowloris;
        spawn(Box::new(move || slowloris(&sh, n)));
    }
    {
        let sh = sh.clone();
        spawn(Box::new(move || fresh_client(&sh)));
    }

    let start = Instant::now();
    let mut samples = Vec::new();
    let mut windows = Vec::new();
    let mut next_sample = a.interval_s;
    let mut last_ok = 0u64;
    let mut last_err = 0u64;
    let mut last_503 = 0u64;
    let mut last_tick = -1i64;
    let mut admin_refused = 0u64;
    let mut sighup_n = 0u64;
    let mut made_upto = 0u64;
    let mut phase = BURST;
    loop {
        let t = start.elapsed().as_secs_f64();
        if t >= seconds {
            break;
        }
        let in_cycle = t % CYCLE_S;
        let want = if in_cycle < BURST_S {
            BURST
        } else if in_cycle < BURST_S + SETTLE_S {
            SETTLE
        } else {
            JUDGED
        };
        if want != phase {
            match want {
                SETTLE => {
                    sh.phase.store(SETTLE, Ordering::Relaxed);
                    undo(&admin, &cfg, &good, pid, made_upto)?;
                }
                JUDGED => {
                    for c in &sh.stats.share_judged {
                        c.store(0, Ordering::Relaxed);
                    }
                    sh.phase.store(JUDGED, Ordering::Relaxed);
                }
                _ => {
                    // The quiet window ends: judge it.
                    sh.phase.store(BURST, Ordering::Relaxed);
                    let done: [u64; 3] =
                        std::array::from_fn(|i| sh.stats.share_judged[i].load(Ordering::Relaxed));
                    let (s, worst) = shares(done);
                    windows.push(QuietWindow {
                        t_s: t,
                        completions: done,
                        shares: s,
                        max_error_pts: worst,
                    });
                }
            }
            phase = want;
        }
        // Once a second in a burst: an admin change; every 3 s a SIGHUP, good and bad in turn.
        let tick = t as i64;
        if tick != last_tick && phase == BURST {
            last_tick = tick;
            let k = tick as u64;
            // Nothing to remove when the activity of the second before was not made (quiet).
            let change = if k % 6 == 4 && made_upto + 1 != k {
                Ok(200)
            } else {
                admin_change(&admin, k)
            };
            match change {
                Ok(s) if (200..300).contains(&s) => {}
                Ok(s) => {
                    admin_refused += 1;
                    sh.stats.example(format!("admin change {k} answered {s}"));
                }
                Err(e) => {
                    admin_refused += 1;
                    sh.stats.example(format!("admin change {k}: {e}"));
                }
            }
            if k % 6 == 3 {
                made_upto = k;
            }
            sh.stats.admin_changes.fetch_add(1, Ordering::Relaxed);
            if k.is_multiple_of(3) {
                sighup_n += 1;
                let text = if sighup_n.is_multiple_of(2) {
                    &bad
                } else {
                    &good
                };
                std::fs::write(&cfg, text).map_err(|e| e.to_string())?;
                sighup(pid);
                sh.stats.sighups.fetch_add(1, Ordering::Relaxed);
            }
        }
        if t >= next_sample {
            next_sample += a.interval_s;
            let (rss_kib, fds) = proc_usage(pid);
            let ok = sh.stats.ok.load(Ordering::Relaxed);
            let err = sh.stats.errors_total();
            let s503 = sh.stats.status_503.load(Ordering::Relaxed);
            samples.push(Sample {
                t_s: t,
                phase: ["burst", "settle", "judged"][usize::from(phase)],
                rss_kib,
                fds,
                req_per_s: (ok - last_ok) as f64 / a.interval_s,
                errors: err - last_err,
                status_503: s503 - last_503,
                status_500_total: sh.stats.status_500.load(Ordering::Relaxed),
                wrong_bytes_total: sh.stats.wrong_bytes.load(Ordering::Relaxed),
                panics_total: panics_metric(&admin),
                fresh_max_ms: sh.stats.fresh_max_us.swap(0, Ordering::Relaxed) as f64 / 1e3,
            });
            (last_ok, last_err, last_503) = (ok, err, s503);
            if !a.json {
                let s = samples.last().expect("pushed");
                eprintln!(
                    "soak {:>6.0} s {:>6}: RSS {:.1} MiB, {} fds, {:.0} req/s, {} errors, 500s {}, wrong {}, fresh max {:.1} ms",
                    s.t_s, s.phase, s.rss_kib / 1024.0, s.fds, s.req_per_s, s.errors,
                    s.status_500_total, s.wrong_bytes_total, s.fresh_max_ms
                );
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    sh.stop.store(true, Ordering::Relaxed);
    for th in threads {
        let _ = th.join();
    }
    let panics_metric = panics_metric(&admin);
    drop(server);
    let stderr = std::fs::read_to_string(&log_path).unwrap_or_default();
    let panic_lines_stderr = stderr
        .lines()
        .filter(|l| l.starts_with("omnistage: panic"))
        .count();

    // Warm-up: the first cycle (at least a fifth of the run); flatness over the samples after.
    let warmup_s = CYCLE_S.max(seconds / 5.0).min(seconds / 2.0);
    // Compared like with like: the samples taken in the judged part of the quiet windows (the
    // same load each time, the crowd closed), so a leak shows and a burst's crowd does not.
    let after: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.t_s > warmup_s && s.phase == "judged")
        .collect();
    let rss = flat(
        &after.iter().map(|s| s.rss_kib).collect::<Vec<_>>(),
        RSS_SLACK_KIB,
    );
    let fds = flat(&after.iter().map(|s| s.fds).collect::<Vec<_>>(), FD_SLACK);
    let st = &sh.stats;
    let status_500 = st.status_500.load(Ordering::Relaxed);
    let wrong_bytes = st.wrong_bytes.load(Ordering::Relaxed);
    let correctness_met = status_500 == 0
        && wrong_bytes == 0
        && panic_lines_stderr == 0
        && panics_metric == Some(0.0);
    let flat_met = rss.as_ref().is_some_and(|f| f.flat) && fds.as_ref().is_some_and(|f| f.flat);
    let shares_met =
        !windows.is_empty() && windows.iter().all(|w| w.max_error_pts <= SHARE_GOAL_PTS);
    let fresh_max_ms = samples.iter().map(|s| s.fresh_max_ms).fold(0.0, f64::max);
    let fresh_met = fresh_max_ms <= FRESH_GOAL_S * 1e3;
    let errors = st
        .errors
        .lock()
        .expect("stats")
        .iter()
        .map(|((kind, client, phase), v)| (format!("{kind} ({client} client, {phase})"), *v))
        .collect();
    let examples = st.examples.lock().expect("stats").clone();
    Ok(SoakResult {
        experiment: "soak",
        machine,
        seconds,
        interval_s: a.interval_s,
        warmup_s,
        slowloris: a.slowloris,
        slowloris_nofile: nofile,
        samples,
        quiet_windows: windows,
        weights: TENANTS.map(|t| t.1),
        requests_ok: st.ok.load(Ordering::Relaxed),
        errors,
        status_503: st.status_503.load(Ordering::Relaxed),
        status_500,
        wrong_bytes,
        panics_metric,
        panic_lines_stderr,
        faults: st.faults.load(Ordering::Relaxed),
        fuzz_requests: st.fuzz_sent.load(Ordering::Relaxed),
        admin_changes: st.admin_changes.load(Ordering::Relaxed),
        admin_refused,
        sighups: st.sighups.load(Ordering::Relaxed),
        examples,
        rss,
        fds,
        fresh_max_ms,
        share_goal_pts: SHARE_GOAL_PTS,
        correctness_met,
        flat_met,
        shares_met,
        fresh_met,
        goal_met: correctness_met && flat_met && shares_met && fresh_met,
    })
}

fn yes(b: bool) -> String {
    if b { "**yes**" } else { "**no**" }.into()
}

fn page(r: &SoakResult, a: &SoakArgs) -> Doc {
    let mut goals = Table::new(&["goal", "measured", "met"]);
    goals.row(vec![
        "no panic".into(),
        format!(
            "{} in /metrics, {} lines on stderr",
            r.panics_metric
                .map_or("unreadable".into(), |p| format!("{p:.0}")),
            r.panic_lines_stderr
        ),
        yes(r.panics_metric == Some(0.0) && r.panic_lines_stderr == 0),
    ]);
    goals.row(vec![
        "no 500".into(),
        format!("{}", r.status_500),
        yes(r.status_500 == 0),
    ]);
    goals.row(vec![
        "no wrong byte".into(),
        format!(
            "{} of {} correct answers checked",
            r.wrong_bytes, r.requests_ok
        ),
        yes(r.wrong_bytes == 0),
    ]);
    let fl = |f: &Option<Flat>, unit: &str, scale: f64| {
        f.as_ref().map_or("too few samples".into(), |f| {
            format!(
                "last third max {:.1} {unit} ≤ {:.1} (first third max {:.1} × {FLAT_FACTOR} + slack)",
                f.last_third_max / scale,
                f.bound / scale,
                f.first_third_max / scale
            )
        })
    };
    goals.row(vec![
        "RSS flat after warm-up".into(),
        fl(&r.rss, "MiB", 1024.0),
        yes(r.rss.as_ref().is_some_and(|f| f.flat)),
    ]);
    goals.row(vec![
        "descriptors flat after warm-up".into(),
        fl(&r.fds, "fds", 1.0),
        yes(r.fds.as_ref().is_some_and(|f| f.flat)),
    ]);
    let worst = r
        .quiet_windows
        .iter()
        .map(|w| w.max_error_pts)
        .fold(0.0, f64::max);
    goals.row(vec![
        format!("shares within {SHARE_GOAL_PTS} pts in the quiet windows (clients' counts)"),
        format!(
            "worst {worst:.2} pts over {} windows",
            r.quiet_windows.len()
        ),
        yes(r.shares_met),
    ]);
    goals.row(vec![
        format!("a fresh client answered within {FRESH_GOAL_S} s"),
        format!("slowest {:.1} ms", r.fresh_max_ms),
        yes(r.fresh_met),
    ]);
    let mut load = Table::new(&["what", "count"]);
    for (k, v) in [
        ("correct answers checked", r.requests_ok),
        ("503 (admission, counted apart)", r.status_503),
        ("faults injected", r.faults),
        ("fuzzer requests", r.fuzz_requests),
        ("admin changes", r.admin_changes),
        ("admin changes not 2xx", r.admin_refused),
        ("SIGHUPs (good and bad in turn)", r.sighups),
    ] {
        load.row(vec![k.into(), v.to_string()]);
    }
    for (k, v) in &r.errors {
        load.row(vec![format!("client errors: {k}"), v.to_string()]);
    }
    let mut windows = Table::new(&["t (s)", "a", "b", "c", "completions", "max error (pts)"]);
    for w in &r.quiet_windows {
        windows.row(vec![
            format!("{:.0}", w.t_s),
            format!("{:.3}", w.shares[0]),
            format!("{:.3}", w.shares[1]),
            format!("{:.3}", w.shares[2]),
            format!("{}", w.completions.iter().sum::<u64>()),
            format!("{:.2}", w.max_error_pts),
        ]);
    }
    let mut notes = vec![format!(
        "Goal met: {} (correctness {}, flat {}, shares {}, fresh client {}). The run fails \
         (exit status) only when a correctness goal is broken; the timing goals are reported.",
        yes(r.goal_met),
        yes(r.correctness_met),
        yes(r.flat_met),
        yes(r.shares_met),
        yes(r.fresh_met)
    )];
    if !r.examples.is_empty() {
        notes.push(format!("First findings: {}", r.examples.join("; ")));
    }
    notes.push(format!(
        "Warm-up: the first {:.0} s. Flat, over the samples taken in the judged part of the \
         quiet windows (the same load each time): the last third's max ≤ the first post-warm-up \
         third's max × {FLAT_FACTOR} + {:.0} MiB (RSS) or + {FD_SLACK:.0} descriptors. Open \
         descriptors of the client side: soft limit raised to {:?} (soft, hard).",
        r.warmup_s,
        RSS_SLACK_KIB / 1024.0,
        r.slowloris_nofile
    ));
    Doc {
        title: "Soak under faults".into(),
        command: match a.seconds {
            Some(s) => format!("omnistage exp soak --seconds {s}"),
            None => format!("omnistage exp soak --minutes {}", a.minutes),
        },
        machine: r.machine.clone(),
        intro: vec![format!(
            "`omnistage serve` (its worker pinned to CPU 0) with tenants a/b/c at weights \
             50/33/17 for {:.0} s, the clients on CPU 1, in {CYCLE_S:.0} s cycles: a \
             {BURST_S:.0} s burst of mixed load and faults (clients gone mid-response, \
             resets, half-closes, the mutation fuzzer, {} slowloris connections, SIGHUP every \
             3 s with a good and a bad file in turn, an admin change every second), then a \
             quiet window whose last {:.0} s judge each tenant's share of the burn requests \
             (`/_burn?us={BURN_US}`, {SHARE_CONNS} keep-alive connections per tenant all \
             along). Every correct request's answer is compared byte for byte with the file.",
            r.seconds,
            r.slowloris,
            CYCLE_S - BURST_S - SETTLE_S
        )],
        tables: vec![
            ("Goals".into(), goals),
            ("Load and faults".into(), load),
            (
                "Quiet windows: shares by the clients' counts".into(),
                windows,
            ),
        ],
        notes,
    }
}

fn chart(path: &Path, r: &SoakResult) -> Result<(), String> {
    let pts = |f: &dyn Fn(&Sample) -> f64| -> Vec<(f64, f64)> {
        r.samples.iter().map(|s| (s.t_s, f(s))).collect()
    };
    report::svg_lines(
        path,
        "Soak: the server's RSS, open descriptors and requests/s",
        "time (s)",
        "MiB / descriptors / requests/s ÷ 10",
        &[
            ("RSS (MiB)".into(), pts(&|s| s.rss_kib / 1024.0)),
            ("open descriptors".into(), pts(&|s| s.fds)),
            ("requests/s ÷ 10".into(), pts(&|s| s.req_per_s / 10.0)),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_compares_the_last_third_with_the_first() {
        let f = flat(&[10.0, 12.0, 11.0, 11.0, 12.0, 13.0], 0.5).unwrap();
        assert_eq!(f.first_third_max, 12.0);
        assert_eq!(f.last_third_max, 13.0);
        assert!(f.flat, "13 ≤ 12 × 1.1 + 0.5");
        let g = flat(&[10.0, 10.0, 10.0, 20.0, 30.0, 40.0], 1.0).unwrap();
        assert!(!g.flat, "a leak grows past the bound");
        assert!(flat(&[1.0, 2.0], 0.0).is_none());
    }

    #[test]
    fn shares_are_measured_against_the_weights() {
        let (s, worst) = shares([500, 330, 170]);
        assert!((s[0] - 0.5).abs() < 1e-9);
        assert!(worst < 1e-6);
        let (_, worst) = shares([600, 300, 100]);
        assert!((worst - 10.0).abs() < 1e-6);
    }
}
