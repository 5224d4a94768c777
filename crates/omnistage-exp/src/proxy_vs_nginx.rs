//! `proxy-vs-nginx`: omnistage's reverse proxy against nginx's, side by side in one run, in
//! front of the same backend. One proxy worker each, pinned to CPU 0 (omnistage's worker;
//! nginx's one worker through the project's launcher, its confinement read back after every
//! round); the backend ([`super::backend`]: one mio thread answering a fixed response) and the
//! load generator (`omnistage load`, closed loop) on CPU 1. Two modes: requests over keep-alive
//! client connections, and one request per client connection. Both proxies keep idle
//! keep-alive connections to the backend (omnistage `idle_connections_max`, nginx
//! `upstream { keepalive N; }` with `proxy_http_version 1.1` and an empty `Connection`).
//!
//! Two figures per round: requests/s as the clients count them, and the proxy's own CPU per
//! request by the OS's clock (utime + stime from /proc: nginx's worker process; omnistage's
//! worker threads, which run inside the experiment's process beside the load generator)
//! divided by the responses the backend wrote in the same interval. The second judges even
//! when the backend and the clients, sharing CPU 1, are the limit. Rounds alternate between the
//! servers (`--repeats`); medians are compared.

use super::backend::Backend;
use super::nginx::{self, Tuning};
use super::report::{self, Doc, Table};
use super::rounds::{self, Spread, Verdict};
use super::util::{self, machine};
use super::{cfgweb, harness, Common};
use clap::Args;
use serde::Serialize;
use std::path::Path;
use std::time::Duration;

/// Seconds of load before the measured window.
const WARMUP_S: f64 = 0.5;
/// Goal: requests/s at least this × nginx's (medians; judged by [`rounds::compare`], which
/// holds only for 1.0).
const GOAL_RATE: f64 = 1.0;
/// Goal: the proxy's CPU per request at most this × nginx's (medians; likewise 1.0).
const GOAL_CPU: f64 = 1.0;
/// The name prefix of omnistage's worker threads (`omnistage-w0`, and the disk pool's, idle here).
const OMNISTAGE_THREADS: &str = "omnistage-";

#[derive(Args, Clone)]
#[command(mut_arg("seconds", |a| a.default_value("4.0").help("Measured seconds of each round.")))]
pub struct ProxyVsNginxArgs {
    /// Client connections.
    #[arg(long, default_value_t = 64)]
    conns: usize,
    /// Response body size in bytes.
    #[arg(long, default_value_t = 1024)]
    body_bytes: usize,
    /// Idle keep-alive connections each proxy keeps to the backend.
    #[arg(long, default_value_t = 64)]
    upstream_idle: usize,
    #[command(flatten)]
    common: Common,
}

#[derive(Serialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
enum Mode {
    /// Requests over open client connections.
    KeepAlive,
    /// A new client connection per request (`--requests-per-conn 1`).
    PerConnection,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::KeepAlive => "keep-alive",
            Mode::PerConnection => "one request per connection",
        }
    }
}

#[derive(Serialize, Clone)]
struct Round {
    round: usize,
    mode: Mode,
    server: &'static str,
    /// Requests/s as the clients count them.
    req_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    errors: u64,
    /// The proxy's utime + stime per response the backend wrote, µs.
    proxy_cpu_us_per_request: Option<f64>,
    /// Responses the backend wrote in the measured interval.
    backend_responses: u64,
}

#[derive(Serialize)]
struct Compared {
    mode: Mode,
    omnistage_req_per_s: Spread,
    nginx_req_per_s: Option<Spread>,
    ratio: Option<f64>,
    /// Requests/s against nginx's run-to-run spread (`null` without nginx, or not judged).
    verdict: Option<Verdict>,
    omnistage_cpu_us: Option<f64>,
    nginx_cpu_us: Option<f64>,
    cpu_ratio: Option<f64>,
    /// CPU per request against nginx's run-to-run spread (lower is better).
    cpu_verdict: Option<Verdict>,
    /// Why the mode was not compared although nginx ran (a round that served nothing, or
    /// nginx's clients seeing errors).
    not_judged: Option<String>,
    goal_met: Option<bool>,
}

#[derive(Serialize)]
struct Report {
    experiment: &'static str,
    machine: String,
    seconds_per_round: f64,
    repeats: usize,
    conns: usize,
    body_bytes: usize,
    upstream_idle: usize,
    rounds: Vec<Round>,
    compared: Vec<Compared>,
    peer_cpus: Vec<String>,
    nginx_note: Option<String>,
    /// Both goals in both modes; none without nginx.
    goal_met: Option<bool>,
}

/// Runs the load for one round against `addr`, reading `cpu_ns()` and the backend's count at
/// the measured window's edges.
fn load(
    a: &ProxyVsNginxArgs,
    mode: Mode,
    addr: &str,
    backend: &Backend,
    mut cpu_ns: impl FnMut() -> Option<u64>,
) -> Result<Round, String> {
    let mut extra = vec![
        "--tenant".to_string(),
        format!("t:localhost:{}:path=/file.bin", a.conns),
    ];
    if mode == Mode::PerConnection {
        extra.extend(["--requests-per-conn".into(), "1".into()]);
    }
    let args = harness::load_args(addr, a.common.seconds, WARMUP_S, &extra)?;
    let h = harness::spawn_load(args);
    std::thread::sleep(Duration::from_secs_f64(WARMUP_S));
    let (c0, b0) = (cpu_ns(), backend.tally().responses);
    std::thread::sleep(Duration::from_secs_f64(a.common.seconds));
    let (c1, b1) = (cpu_ns(), backend.tally().responses);
    let r = harness::join_load(h)?;
    let t = &r.total;
    let n = b1.saturating_sub(b0);
    Ok(Round {
        round: 0,
        mode,
        server: "",
        req_per_s: t.req_per_s,
        p50_ms: t.p50_ms,
        p99_ms: t.p99_ms,
        errors: harness::errors(t),
        proxy_cpu_us_per_request: match (c0, c1) {
            (Some(c0), Some(c1)) if n > 0 => Some(c1.saturating_sub(c0) as f64 / 1e3 / n as f64),
            _ => None,
        },
        backend_responses: n,
    })
}

fn omnistage_round(a: &ProxyVsNginxArgs, mode: Mode, backend: &Backend) -> Result<Round, String> {
    let cfg = format!(
        "[[upstream]]\nname = \"be\"\nservers = [\"{}\"]\nidle_connections_max = {}\n\n\
         [[tenant]]\nname = \"t\"\nupstream = \"be\"\n",
        backend.addr(),
        a.upstream_idle
    );
    let (server, addr) = cfgweb::start("connections_max = 100000", &cfg)?;
    let r = load(a, mode, &addr, backend, || {
        Some(util::threads_cpu_ns(OMNISTAGE_THREADS))
    });
    server.drain(Duration::from_millis(200));
    r
}

/// nginx's `http { }` content for the proxy: the upstream with its keep-alive pool and the
/// server passing every request to it (`extra_server` goes into `server { }`).
pub fn nginx_proxy_block(
    port: u16,
    backend: std::net::SocketAddr,
    upstream_server_extra: &str,
    keepalive: usize,
) -> String {
    format!(
        "upstream be {{ server {backend}{upstream_server_extra}; keepalive {keepalive}; }}\n\
         server {{ listen 127.0.0.1:{port} backlog=4096; location / {{ proxy_pass http://be; \
         proxy_http_version 1.1; proxy_set_header Connection \"\"; }} }}\n"
    )
}

fn nginx_round(
    a: &ProxyVsNginxArgs,
    mode: Mode,
    dir: &Path,
    backend: &Backend,
) -> Result<(Round, String), String> {
    let port = nginx::free_port()?;
    let ng = nginx::start(
        &a.common.nginx,
        dir,
        port,
        a.conns,
        Tuning::default(),
        &nginx_proxy_block(port, backend.addr(), "", a.upstream_idle),
    )?;
    let pid = ng.pid();
    let r = load(a, mode, &format!("127.0.0.1:{port}"), backend, || {
        util::process_cpu_ns(pid)
    })?;
    let cpus = ng.serving_cpus()?;
    Ok((r, cpus))
}

pub fn run(a: ProxyVsNginxArgs) -> Result<(), String> {
    a.common.check(0.5)?;
    if !(1..=10_000).contains(&a.conns) || !(1..=10_000).contains(&a.upstream_idle) {
        return Err("--conns 1..=10000, --upstream-idle 1..=10000".into());
    }
    if a.body_bytes > 1 << 20 {
        return Err("--body-bytes at most 1 MiB".into());
    }
    let dir = std::env::temp_dir().join(format!("omnistage-proxy-vs-nginx-{}", std::process::id()));
    let result = measure(&a, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    let report = result?;
    page(&a, &report)
}

fn measure(a: &ProxyVsNginxArgs, dir: &Path) -> Result<Report, String> {
    let backend = Backend::start(a.body_bytes, Duration::ZERO, harness::LOAD_CPU)?;
    let nginx_ok = a.common.nginx.exists();
    let nginx_note = (!nginx_ok).then(|| {
        format!(
            "{} not found: nginx not installed; omnistage alone",
            a.common.nginx.display()
        )
    });
    let servers: &[&'static str] = if nginx_ok {
        &["omnistage", "nginx"]
    } else {
        &["omnistage"]
    };
    let mut rounds_out = Vec::new();
    let mut peer_cpus = Vec::new();
    for mode in [Mode::KeepAlive, Mode::PerConnection] {
        let runs = rounds::alternate(a.common.repeats, servers, |round, server| {
            let mut r = if server == "nginx" {
                let (r, cpus) = nginx_round(a, mode, dir, &backend)?;
                peer_cpus.push(cpus);
                r
            } else {
                omnistage_round(a, mode, &backend)?
            };
            r.round = round + 1;
            r.server = server;
            Ok(r)
        })?;
        rounds_out.extend(runs.into_iter().map(|(_, _, r)| r));
    }
    let compared: Vec<Compared> = [Mode::KeepAlive, Mode::PerConnection]
        .into_iter()
        .map(|mode| judge_mode(&rounds_out, mode))
        .collect();
    let goal_met = harness::combine_verdicts(compared.iter().map(|c| c.goal_met));
    Ok(Report {
        experiment: "proxy-vs-nginx",
        machine: machine(),
        seconds_per_round: a.common.seconds,
        repeats: a.common.repeats,
        conns: a.conns,
        body_bytes: a.body_bytes,
        upstream_idle: a.upstream_idle,
        rounds: rounds_out,
        compared,
        peer_cpus,
        nginx_note,
        goal_met,
    })
}

/// One mode's figures and goal from the rounds.
fn judge_mode(rounds_out: &[Round], mode: Mode) -> Compared {
    let of = |name: &str, f: fn(&Round) -> Option<f64>| -> Vec<f64> {
        rounds_out
            .iter()
            .filter(|r| r.server == name && r.mode == mode)
            .filter_map(f)
            .collect()
    };
    let rate = |r: &Round| Some(r.req_per_s);
    let cpu = |r: &Round| r.proxy_cpu_us_per_request;
    let (om, ng) = (of("omnistage", rate), of("nginx", rate));
    let (om_cpu, ng_cpu) = (of("omnistage", cpu), of("nginx", cpu));
    let nginx_errors: u64 = rounds_out
        .iter()
        .filter(|r| r.server == "nginx" && r.mode == mode)
        .map(|r| r.errors)
        .sum();
    let omnistage_req_per_s = Spread::of(&om);
    let nginx_req_per_s = (!ng.is_empty()).then(|| Spread::of(&ng));
    let not_judged =
        nginx_req_per_s.and_then(|_| rounds::not_judged(&om, &ng, nginx_errors, "nginx"));
    let judged = nginx_req_per_s.is_some() && not_judged.is_none();
    let ratio = nginx_req_per_s
        .filter(|n| n.median > 0.0)
        .map(|n| omnistage_req_per_s.median / n.median);
    let verdict = judged.then(|| rounds::compare(&om, &ng, true));
    // Lower is better; the CPU figures must be there (and not 0) on both sides.
    let cpu_verdict = (judged && rounds::not_judged(&om_cpu, &ng_cpu, 0, "nginx").is_none())
        .then(|| rounds::compare(&om_cpu, &ng_cpu, false));
    let med = |v: &[f64]| harness::median_of(v);
    let (oc, nc) = (med(&om_cpu), med(&ng_cpu));
    Compared {
        mode,
        omnistage_req_per_s,
        nginx_req_per_s,
        ratio,
        verdict,
        omnistage_cpu_us: oc,
        nginx_cpu_us: nc,
        cpu_ratio: oc.zip(nc).filter(|(_, n)| *n > 0.0).map(|(o, n)| o / n),
        cpu_verdict,
        not_judged,
        goal_met: mode_goal(verdict, cpu_verdict),
    }
}

/// One mode's goal from the two comparisons, each by the symmetric rule: requests/s at least
/// nginx's (`rate`, higher better) and CPU per request at most nginx's (`cpu`, lower better).
/// A comparison inside nginx's own run-to-run range is inconclusive whatever its sign (a rate
/// 0.1 % above nginx's median is no more a win than one 0.1 % below is a loss); either one
/// beyond it the wrong way is a miss; `None` without nginx's figures.
fn mode_goal(rate: Option<Verdict>, cpu: Option<Verdict>) -> Option<bool> {
    harness::combine_verdicts([
        rate.and_then(rounds::verdict_met),
        cpu.and_then(rounds::verdict_met),
    ])
}

fn page(a: &ProxyVsNginxArgs, report: &Report) -> Result<(), String> {
    let mut t = Table::new(&[
        "mode",
        "round",
        "server",
        "req/s",
        "p50 ms",
        "p99 ms",
        "errors",
        "proxy CPU µs/req",
        "backend responses",
    ]);
    for r in &report.rounds {
        t.row(vec![
            r.mode.name().into(),
            r.round.to_string(),
            r.server.into(),
            format!("{:.0}", r.req_per_s),
            format!("{:.3}", r.p50_ms),
            format!("{:.3}", r.p99_ms),
            r.errors.to_string(),
            r.proxy_cpu_us_per_request
                .map_or("-".into(), |c| format!("{c:.1}")),
            r.backend_responses.to_string(),
        ]);
    }
    let mut s = Table::new(&[
        "mode",
        "omnistage req/s",
        "nginx req/s",
        "ratio (goal ≥ 1.0)",
        "verdict",
        "CPU µs/req omnistage / nginx (goal ≤ 1.0×)",
        "CPU verdict",
        "met",
    ]);
    let opt = |v: Option<f64>, d: usize| v.map_or("-".into(), |v| format!("{v:.d$}"));
    for c in &report.compared {
        s.row(vec![
            c.mode.name().into(),
            c.omnistage_req_per_s.show(0),
            c.nginx_req_per_s.map_or("-".into(), |n| n.show(0)),
            opt(c.ratio, 2),
            c.verdict.map_or("-", |v| v.word()).into(),
            format!(
                "{} / {} ({})",
                opt(c.omnistage_cpu_us, 1),
                opt(c.nginx_cpu_us, 1),
                opt(c.cpu_ratio, 2)
            ),
            c.cpu_verdict.map_or("-", |v| v.word()).into(),
            match (c.goal_met, c.nginx_req_per_s, &c.not_judged) {
                (Some(m), ..) => if m { "yes" } else { "no" }.into(),
                (None, Some(_), Some(why)) => format!("not judged: {why}"),
                (None, Some(_), None) => "inconclusive".into(),
                (None, None, _) => "-".into(),
            },
        ]);
    }
    let mut notes = vec![format!(
        "Goals, in both modes: requests/s ≥ {GOAL_RATE:.1}× nginx's (clients' counts, medians) \
         and the proxy's own CPU per request ≤ {GOAL_CPU:.1}× nginx's (OS clocks, medians): {}. \
         The verdict columns say whether each difference is larger than nginx's own \
         run-to-run range of that figure: a difference inside it is inconclusive whatever its \
         sign, so a rate above nginx's or a CPU below it by less than that range meets nothing. \
         A round in which either proxy served nothing, or nginx's clients saw errors, leaves \
         the mode not judged.",
        match (report.goal_met, &report.nginx_note) {
            (Some(true), _) => "met",
            (Some(false), _) => "not met",
            (None, Some(_)) => "not judged (no nginx)",
            (None, None) =>
                "inconclusive (a difference inside nginx's own run-to-run range, \
                             or a mode not judged: see the summary)",
        }
    )];
    match &report.nginx_note {
        Some(n) => notes.push(n.clone()),
        None => notes.push(format!(
            "nginx's worker was confined to CPU {} as read from /proc/PID/status \
             (Cpus_allowed_list) after each of its {} rounds: {}.",
            nginx::SERVER_CPU,
            report.peer_cpus.len(),
            {
                let mut c = report.peer_cpus.clone();
                c.sort_unstable();
                c.dedup();
                c.join(", ")
            }
        )),
    }
    notes.push(
        "The backend is a small mio event loop inside the experiment (one thread pinned to CPU 1, \
         a fixed response, no file system), not `omnistage serve`: it is the same for both \
         proxies, costs little beside the load generator on CPU 1, and its thread is not one of \
         omnistage's, so the CPU read for omnistage is the proxy's alone. CPU per request is \
         utime + stime over the measured interval divided by the responses the backend wrote in \
         it (an instrument neither proxy controls)."
            .into(),
    );
    let doc = Doc {
        title: "proxy-vs-nginx: reverse proxy requests/s and CPU per request".into(),
        command: format!(
            "omnistage exp proxy-vs-nginx {} --conns {} --body-bytes {} --upstream-idle {}",
            a.common.words(),
            a.conns,
            a.body_bytes,
            a.upstream_idle
        ),
        machine: report.machine.clone(),
        intro: vec![format!(
            "The same backend behind omnistage (`[[upstream]]`, one worker pinned to CPU {cpu}, full \
             scheduling and accounting) and behind nginx (`proxy_pass` to an `upstream` with \
             `keepalive {idle}`, `proxy_http_version 1.1`, `proxy_set_header Connection \"\"`; one \
             worker pinned to CPU {cpu} through the project's launcher, no access log). Backend and \
             load generator (`omnistage load`, closed loop, {conns} connections) on CPU 1; {body} B \
             responses. Modes: requests over keep-alive client connections, and one request per \
             client connection. {rep} alternating rounds of {sec} s per mode after {WARMUP_S} s of \
             warm-up; medians compared.",
            cpu = nginx::SERVER_CPU,
            idle = a.upstream_idle,
            conns = a.conns,
            body = a.body_bytes,
            rep = a.common.repeats,
            sec = a.common.seconds,
        )],
        tables: vec![("Summary".into(), s), ("Rounds".into(), t)],
        notes,
    };
    report::emit(
        "proxy-vs-nginx",
        report,
        &doc,
        a.common.json,
        a.common.out(),
        |p| {
            let cats: Vec<String> = report
                .compared
                .iter()
                .map(|c| c.mode.name().into())
                .collect();
            let om = report
                .compared
                .iter()
                .map(|c| c.omnistage_req_per_s.median)
                .collect();
            let ng = report
                .compared
                .iter()
                .map(|c| c.nginx_req_per_s.map_or(0.0, |n| n.median))
                .collect();
            report::svg_bars(
                p,
                "proxied requests/s (medians)",
                "requests/s",
                &cats,
                &[("omnistage".into(), om), ("nginx".into(), ng)],
            )
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_difference_inside_nginx_range_is_inconclusive_either_way() {
        use Verdict::*;
        // Faster or slower, inside nginx's range, CPU below it: not judged either way.
        assert_eq!(mode_goal(Some(Inconclusive), Some(Better)), None);
        // Faster beyond the range, CPU below nginx's beyond its range: met.
        assert_eq!(mode_goal(Some(Better), Some(Better)), Some(true));
        // Slower beyond that range: missed.
        assert_eq!(mode_goal(Some(Worse), Some(Better)), Some(false));
        // More CPU per request than nginx beyond its range: missed even when faster.
        assert_eq!(mode_goal(Some(Better), Some(Worse)), Some(false));
        // A CPU difference inside nginx's range is no miss (it was, by the ratio alone).
        assert_eq!(mode_goal(Some(Better), Some(Inconclusive)), None);
        // No nginx: nothing to judge.
        assert_eq!(mode_goal(None, None), None);
    }

    fn round(server: &'static str, req_per_s: f64, cpu_us: f64) -> Round {
        Round {
            round: 1,
            mode: Mode::KeepAlive,
            server,
            req_per_s,
            p50_ms: 1.0,
            p99_ms: 2.0,
            errors: 0,
            proxy_cpu_us_per_request: Some(cpu_us),
            backend_responses: 1000,
        }
    }

    #[test]
    fn the_rounds_decide_by_nginx_range() {
        // 1.001× nginx's median, inside its range: no win (mode_goal(Some(1.001), Some(0.9),
        // Some(Inconclusive)) was Some(true)).
        let mut rs = vec![
            round("omnistage", 10_010.0, 9.0),
            round("omnistage", 10_010.0, 9.0),
            round("omnistage", 10_010.0, 9.0),
        ];
        rs.extend([
            round("nginx", 9_000.0, 10.0),
            round("nginx", 10_000.0, 10.0),
            round("nginx", 11_000.0, 10.0),
        ]);
        let c = judge_mode(&rs, Mode::KeepAlive);
        assert_eq!(c.ratio.map(|r| (r * 1000.0).round()), Some(1001.0));
        assert_eq!(c.goal_met, None);
        // nginx serving nothing is no baseline.
        let mut rs: Vec<Round> = (0..3).map(|_| round("omnistage", 100.0, 9.0)).collect();
        rs.extend((0..3).map(|_| round("nginx", 0.0, 10.0)));
        let c = judge_mode(&rs, Mode::KeepAlive);
        assert_ne!(c.goal_met, Some(true));
        assert!(c.not_judged.is_some() && c.ratio.is_none());
    }

    #[test]
    fn both_modes_decide_together() {
        let all = |v: &[Option<bool>]| harness::combine_verdicts(v.iter().copied());
        assert_eq!(all(&[Some(true), Some(true)]), Some(true));
        assert_eq!(all(&[Some(true), None]), None);
        assert_eq!(all(&[None, Some(false)]), Some(false));
        assert_eq!(all(&[]), None);
    }
}
