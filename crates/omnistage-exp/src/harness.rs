//! Shared set-up of the web experiments: the server with some tenants on one worker pinned to
//! CPU 0, the in-process load generator pinned to CPU 1, ledger deltas, the OS's view of the
//! worker thread, and thread placement (pinning, SCHED_IDLE).

use clap::Parser;
use omnistage::account::{CoreRow, Snapshot};
use omnistage_http::config::parse_config;
use omnistage_http::server::{Server, ServerOptions};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;

/// A running server and its temporary docroot (removed on drop of [`Web::stop`]).
pub struct Web {
    pub server: Server,
    pub root: PathBuf,
    pub addr: String,
}

/// The CPU the load generator is pinned to (the server's worker is on CPU 0).
pub const LOAD_CPU: usize = 1;

/// Pins the calling thread to `cpu` (best effort: an experiment still runs unpinned, and its
/// page reads the placement back where it matters).
pub fn pin_this_thread(cpu: usize) {
    #[cfg(target_os = "linux")]
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes within it, and
    // sched_setaffinity(2) only reads it, for the calling thread (pid 0).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// Puts the calling thread (and the threads it creates after) under SCHED_IDLE: it runs only
/// when nothing else on its CPU wants to, and a waking normal thread preempts it at once.
/// Returns whether the kernel took it.
pub fn sched_idle_this_thread() -> bool {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: sched_setscheduler with pid 0 changes only the calling thread's policy on
        // Linux; it reads the local `param` and writes no memory of ours.
        unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    false
}

/// Pins the calling thread to [`LOAD_CPU`] (best effort).
pub fn pin_to_load_cpu() {
    pin_this_thread(LOAD_CPU);
}

/// Starts the server: one pinned worker, tenants `(name, weight)` with hosts `NAME.test`,
/// synthetic endpoints on, and `files` `(name, bytes)` in the shared docroot.
pub fn start(
    tag: &str,
    tenants: &[(&str, u32)],
    files: &[(&str, usize)],
    bypass: bool,
) -> Result<Web, String> {
    start_with(tag, tenants, files, bypass, "")
}

/// [`start`], with `server_extra` (TOML lines) added to the `[server]` table.
pub fn start_with(
    tag: &str,
    tenants: &[(&str, u32)],
    files: &[(&str, usize)],
    bypass: bool,
    server_extra: &str,
) -> Result<Web, String> {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    if cpus < 2 {
        return Err(format!(
            "{tag} needs 2 CPUs: one for the server, one for the load"
        ));
    }
    let root = std::env::temp_dir().join(format!("omnistage-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&root).map_err(|e| e.to_string())?;
    for &(name, bytes) in files {
        let data: Vec<u8> = (0..bytes).map(|i| b'a' + (i % 26) as u8).collect();
        std::fs::write(root.join(name), data).map_err(|e| e.to_string())?;
    }
    let mut toml = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\nworkers = 1\nconnections_max = 10000\n{server_extra}\n",
    );
    for (name, weight) in tenants {
        toml.push_str(&format!(
            "\n[[tenant]]\nname = \"{name}\"\nhosts = [\"{name}.test\"]\nweight = {weight}\ndocroot = \"{}\"\nsynthetic = true\n",
            root.display()
        ));
    }
    let config = parse_config(&toml).map_err(|e| e.to_string())?;
    let server = Server::start(
        config,
        ServerOptions {
            pin: true,
            workers: Some(1),
            bypass,
        },
    )?;
    let addr = server.local_addrs()[0].to_string();
    Ok(Web { server, root, addr })
}

impl Web {
    pub fn stop(self) {
        self.server.drain(std::time::Duration::from_millis(500));
        let _ = std::fs::remove_dir_all(&self.root);
    }

    /// Requests the server has answered so far (all tenants).
    pub fn requests(&self) -> u64 {
        self.server.stats().requests.load(Ordering::Relaxed)
    }
}

#[derive(Parser)]
struct LoadCli {
    #[command(flatten)]
    args: omnistage_load::LoadArgs,
}

/// Parses load-generator arguments (as `omnistage load` takes them) for `addr`, pinned to
/// [`LOAD_CPU`].
pub fn load_args(
    addr: &str,
    seconds: f64,
    warmup_s: f64,
    extra: &[String],
) -> Result<omnistage_load::LoadArgs, String> {
    let mut argv: Vec<String> = vec![
        "load".into(),
        "--addr".into(),
        addr.into(),
        "--seconds".into(),
        seconds.to_string(),
        "--warmup-s".into(),
        warmup_s.to_string(),
        "--cpu".into(),
        LOAD_CPU.to_string(),
    ];
    argv.extend(extra.iter().cloned());
    Ok(LoadCli::try_parse_from(&argv)
        .map_err(|e| e.to_string())?
        .args)
}

pub type LoadHandle = JoinHandle<Result<omnistage_load::report::Report, String>>;

pub fn spawn_load(args: omnistage_load::LoadArgs) -> LoadHandle {
    std::thread::spawn(move || omnistage_load::run(&args))
}

pub fn join_load(h: LoadHandle) -> Result<omnistage_load::report::Report, String> {
    h.join()
        .map_err(|_| "load generator panicked".to_string())?
}

/// Core rows of `b` minus `a`, core by core.
pub fn core_deltas(a: &Snapshot, b: &Snapshot) -> Vec<CoreRow> {
    a.cores
        .iter()
        .zip(&b.cores)
        .map(|(a, b)| b.since(a))
        .collect()
}

/// Charged CPU (ns) and messages per stage id in `b` minus `a`, all activities and cores.
pub fn by_stage(a: &Snapshot, b: &Snapshot) -> BTreeMap<u32, (u64, u64)> {
    let mut m: BTreeMap<u32, (i128, i128)> = BTreeMap::new();
    for (s, sign) in [(b, 1i128), (a, -1i128)] {
        for r in &s.rows {
            let e = m.entry(r.stage).or_default();
            e.0 += sign * r.cpu_ns as i128;
            e.1 += sign * r.messages as i128;
        }
    }
    m.into_iter()
        .map(|(k, (c, n))| (k, (c.max(0) as u64, n.max(0) as u64)))
        .collect()
}

/// Charged CPU (ns) and messages of one activity (own records, all stages), optionally one
/// stage only.
pub fn activity_totals(s: &Snapshot, activity: u32, stage: Option<u32>) -> (u64, u64) {
    s.rows
        .iter()
        .filter(|r| r.activity == activity && stage.is_none_or(|st| r.stage == st))
        .fold((0, 0), |acc, r| (acc.0 + r.cpu_ns, acc.1 + r.messages))
}

/// The OS's counters of one thread of this process, found by name: CPU time (ns), run-queue
/// wait (ns), and times it was put on a CPU (`/proc/self/task/TID/schedstat`), plus voluntary
/// and involuntary context switches (`status`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ThreadStat {
    pub cpu_ns: u64,
    pub runqueue_ns: u64,
    pub timeslices: u64,
    pub voluntary_switches: u64,
    pub involuntary_switches: u64,
}

pub fn thread_stat(name: &str) -> Option<ThreadStat> {
    thread_stat_with_tid(name).map(|(_, s)| s)
}

/// [`thread_stat`] with the thread's id, so that a caller comparing two readings can tell a
/// new thread of the same name (whose counters start again from zero) from the old one.
pub fn thread_stat_with_tid(name: &str) -> Option<(u64, ThreadStat)> {
    for e in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let p = e.path();
        let Some(tid) = e.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
        if comm.trim() != name {
            continue;
        }
        let sched = std::fs::read_to_string(p.join("schedstat")).ok()?;
        let f: Vec<u64> = sched
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        let status = std::fs::read_to_string(p.join("status")).ok()?;
        let field = |k: &str| {
            status
                .lines()
                .find(|l| l.starts_with(k))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        return Some((
            tid,
            ThreadStat {
                cpu_ns: *f.first()?,
                runqueue_ns: *f.get(1)?,
                timeslices: *f.get(2)?,
                voluntary_switches: field("voluntary_ctxt_switches:"),
                involuntary_switches: field("nonvoluntary_ctxt_switches:"),
            },
        ));
    }
    None
}

impl ThreadStat {
    pub fn since(&self, a: &ThreadStat) -> ThreadStat {
        ThreadStat {
            cpu_ns: self.cpu_ns.saturating_sub(a.cpu_ns),
            runqueue_ns: self.runqueue_ns.saturating_sub(a.runqueue_ns),
            timeslices: self.timeslices.saturating_sub(a.timeslices),
            voluntary_switches: self.voluntary_switches.saturating_sub(a.voluntary_switches),
            involuntary_switches: self
                .involuntary_switches
                .saturating_sub(a.involuntary_switches),
        }
    }
}

/// Median of a list (mean of the middle two for an even count); 0 for none.
pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// [`median`], or `None` for an empty list (a figure nothing measured, not a zero).
pub fn median_of(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| median(v))
}

/// Verdicts of several parts combined: missed if any part missed, met if there are parts and
/// all were met, otherwise (a part inconclusive or not judged) `None`.
pub fn combine_verdicts(parts: impl IntoIterator<Item = Option<bool>>) -> Option<bool> {
    let v: Vec<Option<bool>> = parts.into_iter().collect();
    if v.contains(&Some(false)) {
        Some(false)
    } else if !v.is_empty() && v.iter().all(|m| *m == Some(true)) {
        Some(true)
    } else {
        None
    }
}

/// Whether a p99 of `requests` completed latencies stands for every request sent, given
/// `unfinished` requests the load generator left out of it (in flight, or due and not sent, at
/// the end of the run): at most 1/99 of the completed. Up to that many, the slowest 1 % of all
/// the requests still holds a completed one, so the p99 of all is a measured latency; past it,
/// the slowest 1 % may be unfinished requests alone, whose latency nobody measured (an
/// open-loop client stalled at the end piles them up at its rate, while one answered normally
/// leaves about rate × latency in flight, far below 1/99 of a run of seconds).
pub fn p99_stands(requests: u64, unfinished: u64) -> bool {
    unfinished.saturating_mul(99) <= requests
}

/// Sum of a load report's errors of every kind (failed connection attempts included).
pub fn errors(t: &omnistage_load::report::TenantReport) -> u64 {
    t.errors.connect + t.errors.failed_requests()
}

/// A load report's tenant with nothing measured (every count 0, no latency), for tests to fill.
#[cfg(test)]
pub fn tenant_for_test(name: &str) -> omnistage_load::report::TenantReport {
    omnistage_load::report::TenantReport {
        name: name.into(),
        host: format!("{name}.test"),
        connections: 1,
        mix: "path=/".into(),
        pacing: "closed".into(),
        rate_per_s: None,
        think_ms: None,
        requests: 0,
        responses: 0,
        req_per_s: 0.0,
        bytes: 0,
        bytes_per_s: 0.0,
        received_bytes: 0,
        received_bytes_per_s: 0.0,
        p50_ms: 0.0,
        p90_ms: 0.0,
        p99_ms: 0.0,
        p999_ms: 0.0,
        max_ms: 0.0,
        mean_ms: 0.0,
        kernel_p50_ms: None,
        kernel_p99_ms: None,
        errors: omnistage_load::ErrorCounts::default(),
        retry_after: 0,
        reconnects: 0,
        idle_closes: 0,
        unfinished: 0,
        unfinished_oldest_ms: None,
        windows: Vec::new(),
        jain_fairness: None,
    }
}

/// A load report of `tenants` (their `total` as given), over `seconds`, for tests.
#[cfg(test)]
pub fn report_for_test(
    tenants: Vec<omnistage_load::report::TenantReport>,
    total: omnistage_load::report::TenantReport,
    seconds: f64,
) -> omnistage_load::report::Report {
    omnistage_load::report::Report {
        addr: "127.0.0.1:1".into(),
        threads: 1,
        seconds,
        warmup_s: 0.0,
        window_s: None,
        tenants,
        total,
        client_jain: None,
        client_requests: omnistage_load::ClientCounts::default(),
        server_segments: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_of_every_kind_are_counted() {
        let mut t = tenant_for_test("a");
        t.errors.http_other = 5;
        assert_eq!(errors(&t), 5, "a 3xx other than 304 is an error too");
        t.errors = omnistage_load::ErrorCounts {
            connect: 1,
            reset: 2,
            timeout: 3,
            rejected_503: 4,
            http_4xx: 5,
            http_5xx: 6,
            http_other: 7,
            parse: 8,
            unsolicited: 9,
        };
        assert_eq!(
            errors(&t),
            36,
            "bytes with no request outstanding fail no request"
        );
    }

    #[test]
    fn a_p99_stands_while_the_unfinished_are_at_most_one_in_99() {
        assert!(p99_stands(9_900, 100));
        assert!(!p99_stands(9_900, 101));
        assert!(p99_stands(0, 0));
        assert!(!p99_stands(0, 1));
    }

    #[test]
    fn median_odd_even_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median_of(&[]), None);
        assert_eq!(median_of(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
    }

    #[test]
    fn this_thread_is_found_by_name() {
        let h = std::thread::Builder::new()
            .name("omni-ts-test".into())
            .spawn(|| {
                let t = thread_stat("omni-ts-test").expect("found");
                assert!(t.timeslices >= 1);
            })
            .unwrap();
        h.join().unwrap();
        assert!(thread_stat("no-such-thread-x").is_none());
    }
}
