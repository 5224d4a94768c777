//! `http-vs-nginx`: requests/s of omnistage and nginx side by side in one run, one worker each,
//! the server pinned to CPU 0 and the load generator (`omnistage load`, closed loop) on CPU 1, a
//! 1 KiB file over keep-alive connections. nginx gets the fastest of its standard
//! configurations for this workload (a short pre-run of each, see [`nginx::best_tuning`]); then
//! rounds alternate between the two servers (`--repeats`) and the medians are compared, with
//! their min–max. The worker's confinement is read from the OS after every nginx round
//! (`peer_cpus`). nginx runs from Debian's package if it is installed; otherwise the experiment
//! says so and reports omnistage alone.

use super::nginx::{self, Tuning, TuningChoice};
use super::report::{self, Doc, Table};
use super::rounds::{self, Spread, Verdict};
use super::util::machine;
use super::Common;
use super::{cfgweb, harness};
use clap::Args;
use serde::Serialize;
use std::path::Path;
use std::time::Duration;

#[derive(Args, Clone)]
#[command(mut_arg("seconds", |a| a.default_value("5.0").help("Measured seconds of each round.")))]
pub struct HttpVsNginxArgs {
    #[arg(long, default_value_t = 64)]
    conns: usize,
    /// File size in bytes.
    #[arg(long, default_value_t = 1024)]
    file_bytes: usize,
    /// Seconds of each configuration's pre-run that picks nginx's configuration.
    #[arg(long, default_value_t = 1.0)]
    pick_seconds: f64,
    #[command(flatten)]
    common: Common,
}

#[derive(Serialize, Clone)]
struct Round {
    round: usize,
    server: &'static str,
    req_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    errors: u64,
}

#[derive(Serialize)]
struct Report {
    experiment: &'static str,
    machine: String,
    seconds_per_round: f64,
    repeats: usize,
    rounds: Vec<Round>,
    omnistage_req_per_s: Spread,
    nginx_req_per_s: Option<Spread>,
    ratio: Option<f64>,
    /// omnistage against nginx's run-to-run spread: better, worse or inconclusive (none
    /// without nginx, or when not judged).
    verdict: Option<Verdict>,
    /// Why the rounds were not compared although nginx ran (it served nothing in a round, or
    /// its clients saw errors).
    not_judged: Option<String>,
    /// The CPUs nginx's worker was allowed, read from /proc after each round.
    peer_cpus: Vec<String>,
    nginx_tuning: Option<TuningChoice>,
    nginx_note: Option<String>,
    conns: usize,
    file_bytes: usize,
    /// At least as fast as nginx (the comparison not inconclusive); none without nginx, or
    /// when not judged.
    goal_met: Option<bool>,
}

fn load(addr: &str, conns: usize, seconds: f64) -> Result<Round, String> {
    let args = harness::load_args(
        addr,
        seconds,
        0.5,
        &[
            "--tenant".into(),
            format!("t:localhost:{conns}:path=/file.bin"),
        ],
    )?;
    let r = omnistage_load::run(&args)?;
    let t = &r.total;
    Ok(Round {
        round: 0,
        server: "",
        req_per_s: t.req_per_s,
        p50_ms: t.p50_ms,
        p99_ms: t.p99_ms,
        errors: harness::errors(t),
    })
}

/// One nginx round: started with `tuning`, loaded, its confinement read back.
fn nginx_round(
    a: &HttpVsNginxArgs,
    dir: &Path,
    root: &Path,
    tuning: Tuning,
    seconds: f64,
) -> Result<(Round, String), String> {
    let port = nginx::free_port()?;
    let ng = nginx::start(
        &a.common.nginx,
        dir,
        port,
        a.conns,
        tuning,
        &nginx::server_block(port, root, None, ""),
    )?;
    let r = load(&format!("127.0.0.1:{port}"), a.conns, seconds)?;
    let cpus = ng.serving_cpus()?;
    Ok((r, cpus))
}

pub fn run(a: HttpVsNginxArgs) -> Result<(), String> {
    a.common.check(0.5)?;
    if !(1..=10_000).contains(&a.conns) || !(0.2..=60.0).contains(&a.pick_seconds) {
        return Err("--conns 1..=10000, --pick-seconds 0.2..=60".into());
    }
    if a.file_bytes > 1 << 30 {
        return Err("--file-bytes at most 1 GiB".into());
    }
    let dir = std::env::temp_dir().join(format!("omnistage-vs-nginx-{}", std::process::id()));
    let root = dir.join("www");
    std::fs::create_dir_all(&root).map_err(|e| e.to_string())?;
    let result = measure(&a, &dir, &root);
    let _ = std::fs::remove_dir_all(&dir);
    let report = result?;
    page(&a, &report)
}

fn measure(a: &HttpVsNginxArgs, dir: &Path, root: &Path) -> Result<Report, String> {
    std::fs::write(root.join("file.bin"), vec![b'x'; a.file_bytes]).map_err(|e| e.to_string())?;
    let tenant = format!(
        "[[tenant]]\nname = \"t\"\ndocroot = \"{}\"\n",
        root.display()
    );
    let nginx_ok = a.common.nginx.exists();
    let nginx_note = (!nginx_ok).then(|| {
        format!(
            "{} not found: nginx not installed; omnistage alone",
            a.common.nginx.display()
        )
    });
    let tuning = if nginx_ok {
        Some(nginx::best_tuning(a.pick_seconds, |t| {
            nginx_round(a, dir, root, t, a.pick_seconds).map(|(r, _)| r.req_per_s)
        })?)
    } else {
        None
    };
    let servers: &[&'static str] = if nginx_ok {
        &["omnistage", "nginx"]
    } else {
        &["omnistage"]
    };
    let mut peer_cpus = Vec::new();
    let runs = rounds::alternate(a.common.repeats, servers, |round, server| {
        let mut r = if server == "nginx" {
            let t = tuning.as_ref().map(|c| c.picked).unwrap_or_default();
            let (r, cpus) = nginx_round(a, dir, root, t, a.common.seconds)?;
            peer_cpus.push(cpus);
            r
        } else {
            let (server, addr) = cfgweb::start("", &tenant)?;
            let r = load(&addr, a.conns, a.common.seconds);
            server.drain(Duration::from_millis(200));
            r?
        };
        r.round = round + 1;
        r.server = server;
        Ok(r)
    })?;
    let rounds: Vec<Round> = runs.into_iter().map(|(_, _, r)| r).collect();
    let j = judge(&rounds);
    Ok(Report {
        experiment: "http-vs-nginx",
        machine: machine(),
        seconds_per_round: a.common.seconds,
        repeats: a.common.repeats,
        ratio: j.ratio,
        rounds,
        omnistage_req_per_s: j.omnistage_req_per_s,
        nginx_req_per_s: j.nginx_req_per_s,
        verdict: j.verdict,
        not_judged: j.not_judged,
        peer_cpus,
        nginx_tuning: tuning,
        nginx_note,
        conns: a.conns,
        file_bytes: a.file_bytes,
        goal_met: j.goal_met,
    })
}

/// What the rounds say: the spreads, the ratio of medians, the verdict and the goal.
struct Judged {
    omnistage_req_per_s: Spread,
    nginx_req_per_s: Option<Spread>,
    ratio: Option<f64>,
    verdict: Option<Verdict>,
    not_judged: Option<String>,
    goal_met: Option<bool>,
}

/// No verdict without nginx, or when [`rounds::not_judged`] says the rounds cannot be
/// compared (nginx served nothing in a round, or its clients saw errors).
fn judge(rounds: &[Round]) -> Judged {
    let of = |name: &str| -> Vec<f64> {
        rounds
            .iter()
            .filter(|r| r.server == name)
            .map(|r| r.req_per_s)
            .collect()
    };
    let (om, ng) = (of("omnistage"), of("nginx"));
    let nginx_errors: u64 = rounds
        .iter()
        .filter(|r| r.server == "nginx")
        .map(|r| r.errors)
        .sum();
    let omnistage_req_per_s = Spread::of(&om);
    let nginx_req_per_s = (!ng.is_empty()).then(|| Spread::of(&ng));
    let not_judged =
        nginx_req_per_s.and_then(|_| rounds::not_judged(&om, &ng, nginx_errors, "nginx"));
    let verdict = nginx_req_per_s
        .filter(|_| not_judged.is_none())
        .map(|_| rounds::compare(&om, &ng, true));
    Judged {
        ratio: nginx_req_per_s
            .filter(|n| n.median > 0.0)
            .map(|n| omnistage_req_per_s.median / n.median),
        omnistage_req_per_s,
        nginx_req_per_s,
        verdict,
        not_judged,
        goal_met: verdict.and_then(rounds::verdict_met),
    }
}

fn page(a: &HttpVsNginxArgs, report: &Report) -> Result<(), String> {
    let mut t = Table::new(&["round", "server", "req/s", "p50 ms", "p99 ms", "errors"]);
    for r in &report.rounds {
        t.row(vec![
            r.round.to_string(),
            r.server.to_string(),
            format!("{:.0}", r.req_per_s),
            format!("{:.3}", r.p50_ms),
            format!("{:.3}", r.p99_ms),
            r.errors.to_string(),
        ]);
    }
    let mut notes = Vec::new();
    match (&report.nginx_req_per_s, report.ratio, report.verdict) {
        (Some(n), _, _) if report.not_judged.is_some() => notes.push(format!(
            "Median (min–max) over {} rounds: omnistage {} req/s, nginx {} req/s: not judged, {}.",
            report.repeats,
            report.omnistage_req_per_s.show(0),
            n.show(0),
            report.not_judged.as_deref().unwrap_or("")
        )),
        (Some(n), Some(ratio), Some(v)) => notes.push(format!(
            "Median (min–max) over {} rounds: omnistage {} req/s, nginx {} req/s, ratio {ratio:.2}: {} \
             (a difference inside nginx's run-to-run range is inconclusive whatever its sign).",
            report.repeats,
            report.omnistage_req_per_s.show(0),
            n.show(0),
            v.word()
        )),
        _ => notes.push(format!(
            "Median (min–max): omnistage {} req/s; nginx not run ({}).",
            report.omnistage_req_per_s.show(0),
            report.nginx_note.as_deref().unwrap_or("not installed")
        )),
    }
    notes.extend(nginx::page_notes(
        report.nginx_tuning.as_ref(),
        &report.peer_cpus,
    ));
    let doc = Doc {
        title: "http-vs-nginx: requests/s side by side".into(),
        command: format!(
            "omnistage exp http-vs-nginx {} --conns {} --file-bytes {}",
            a.common.words(),
            a.conns,
            a.file_bytes
        ),
        machine: report.machine.clone(),
        intro: vec![format!(
            "One worker each pinned to CPU {} (omnistage with full scheduling and accounting; nginx \
             with its master process and one worker under worker_cpu_affinity, no access log), the \
             load generator on CPU 1, {} keep-alive connections, a {} B file, {} alternating rounds \
             of {} s (the first server of a round alternates); medians compared.",
            nginx::SERVER_CPU,
            a.conns,
            a.file_bytes,
            a.common.repeats,
            a.common.seconds
        )],
        tables: vec![(String::new(), t)],
        notes,
    };
    report::emit(
        "http-vs-nginx",
        report,
        &doc,
        a.common.json,
        a.common.out(),
        |p| {
            let cats: Vec<String> = (1..=a.common.repeats)
                .map(|i| format!("round {i}"))
                .collect();
            let per = |name: &str| -> Vec<f64> {
                report
                    .rounds
                    .iter()
                    .filter(|r| r.server == name)
                    .map(|r| r.req_per_s)
                    .collect()
            };
            report::svg_bars(
                p,
                "requests/s per round",
                "requests/s",
                &cats,
                &[
                    ("omnistage".into(), per("omnistage")),
                    ("nginx".into(), per("nginx")),
                ],
            )
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rounds_of(om: &[f64], ng: &[f64], ng_errors: u64) -> Vec<Round> {
        let round = |server: &'static str, req_per_s: f64, errors: u64| Round {
            round: 1,
            server,
            req_per_s,
            p50_ms: 1.0,
            p99_ms: 2.0,
            errors,
        };
        om.iter()
            .map(|&x| round("omnistage", x, 0))
            .chain(ng.iter().map(|&x| round("nginx", x, ng_errors)))
            .collect()
    }

    #[test]
    fn a_peer_that_served_nothing_is_not_beaten() {
        let j = judge(&rounds_of(&[100.0; 3], &[0.0; 3], 0));
        assert_ne!(j.goal_met, Some(true), "nginx served nothing");
        assert_eq!(j.verdict, None);
        let j = judge(&rounds_of(&[100.0; 3], &[50.0, 51.0, 52.0], 1));
        assert_ne!(j.goal_met, Some(true), "nginx's clients saw an error");
        // A sound peer: judged as before.
        let j = judge(&rounds_of(&[100.0; 3], &[50.0, 51.0, 52.0], 0));
        assert_eq!((j.verdict, j.goal_met), (Some(Verdict::Better), Some(true)));
    }
}
