//! `http-vs-nginx`: requests/s of omnistage and nginx side by side in one run, one worker each,
//! the server pinned to one CPU and the load generator (`omnistage load`, closed loop) on the
//! other, a 1 KiB file over keep-alive connections. Rounds alternate between the two servers and
//! the medians are compared. nginx runs from Debian's package if it is installed; otherwise the
//! experiment says so and reports omnistage alone.

use super::nginx;
use super::report::{self, Doc, Table};
use super::util::machine;
use super::Common;
use clap::{Args, Parser};
use omnistage_http::config::parse_config;
use omnistage_http::server::{Server, ServerOptions};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args, Clone)]
pub struct PeerArgs {
    /// Seconds per round.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Rounds per server (alternating); medians are reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    #[arg(long, default_value_t = 64)]
    conns: usize,
    /// File size in bytes.
    #[arg(long, default_value_t = 1024)]
    file_bytes: usize,
    #[arg(long, default_value = nginx::DEFAULT_BIN)]
    nginx: PathBuf,
    /// Write http-vs-nginx.json, .md and .svg into this directory.
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    common: Common,
}

#[derive(Serialize, Clone)]
struct Round {
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
    rounds: Vec<Round>,
    omnistage_req_per_s: f64,
    nginx_req_per_s: Option<f64>,
    ratio: Option<f64>,
    nginx_note: Option<String>,
    conns: usize,
    file_bytes: usize,
}

#[derive(Parser)]
struct LoadCli {
    #[command(flatten)]
    args: omnistage_load::LoadArgs,
}

fn load(addr: &str, conns: usize, seconds: f64) -> Result<Round, String> {
    let argv = vec![
        "load".to_string(),
        "--addr".into(),
        addr.into(),
        "--seconds".into(),
        seconds.to_string(),
        "--warmup-s".into(),
        "0.5".into(),
        "--cpu".into(),
        "1".into(),
        "--tenant".into(),
        format!("t:localhost:{conns}:path=/file.bin"),
    ];
    let a = LoadCli::try_parse_from(&argv)
        .map_err(|e| e.to_string())?
        .args;
    let r = omnistage_load::run(&a)?;
    let t = &r.total;
    let e = &t.errors;
    Ok(Round {
        server: "",
        req_per_s: t.req_per_s,
        p50_ms: t.p50_ms,
        p99_ms: t.p99_ms,
        errors: e.connect
            + e.reset
            + e.timeout
            + e.rejected_503
            + e.http_4xx
            + e.http_5xx
            + e.parse,
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub fn run(a: PeerArgs) -> Result<(), String> {
    if !(0.5..=600.0).contains(&a.seconds)
        || !(1..=20).contains(&a.rounds)
        || !(1..=10_000).contains(&a.conns)
    {
        return Err("--seconds 0.5..=600, --rounds 1..=20, --conns 1..=10000".into());
    }
    if a.file_bytes > 1 << 30 {
        return Err("--file-bytes at most 1 GiB".into());
    }
    let dir = std::env::temp_dir().join(format!("omnistage-vs-nginx-{}", std::process::id()));
    let root = dir.join("www");
    std::fs::create_dir_all(&root).map_err(|e| e.to_string())?;
    std::fs::write(root.join("file.bin"), vec![b'x'; a.file_bytes]).map_err(|e| e.to_string())?;
    let toml = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\nworkers = 1\n\n[[tenant]]\nname = \"t\"\ndocroot = \"{}\"\n",
        root.display()
    );
    let config = parse_config(&toml).map_err(|e| e.to_string())?;
    let nginx_ok = a.nginx.exists();
    let nginx_note = (!nginx_ok).then(|| {
        format!(
            "{} not found: nginx not installed; omnistage alone",
            a.nginx.display()
        )
    });
    let mut rounds = Vec::new();
    for _ in 0..a.rounds {
        let server = Server::start(
            config.clone(),
            ServerOptions {
                pin: true,
                workers: Some(1),
                bypass: false,
            },
        )?;
        let addr = server.local_addrs()[0].to_string();
        let mut r = load(&addr, a.conns, a.seconds)?;
        server.drain(Duration::from_millis(200));
        r.server = "omnistage";
        rounds.push(r);
        if nginx_ok {
            let port = nginx::free_port()?;
            let ng = nginx::start(
                &a.nginx,
                &dir,
                port,
                4096,
                &nginx::server_block(port, &root, None, ""),
            )?;
            let mut r = load(&format!("127.0.0.1:{port}"), a.conns, a.seconds)?;
            drop(ng);
            r.server = "nginx";
            rounds.push(r);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let mut om: Vec<f64> = rounds
        .iter()
        .filter(|r| r.server == "omnistage")
        .map(|r| r.req_per_s)
        .collect();
    let mut ng: Vec<f64> = rounds
        .iter()
        .filter(|r| r.server == "nginx")
        .map(|r| r.req_per_s)
        .collect();
    let omnistage_req_per_s = median(&mut om);
    let nginx_req_per_s = (!ng.is_empty()).then(|| median(&mut ng));
    let report = Report {
        experiment: "http-vs-nginx",
        machine: machine(),
        seconds_per_round: a.seconds,
        ratio: nginx_req_per_s.map(|n| omnistage_req_per_s / n),
        rounds,
        omnistage_req_per_s,
        nginx_req_per_s,
        nginx_note,
        conns: a.conns,
        file_bytes: a.file_bytes,
    };
    let mut t = Table::new(&["round", "server", "req/s", "p50 ms", "p99 ms", "errors"]);
    for (i, r) in report.rounds.iter().enumerate() {
        t.row(vec![
            (i / 2 + 1).to_string(),
            r.server.to_string(),
            format!("{:.0}", r.req_per_s),
            format!("{:.3}", r.p50_ms),
            format!("{:.3}", r.p99_ms),
            r.errors.to_string(),
        ]);
    }
    let verdict = match (report.nginx_req_per_s, report.ratio) {
        (Some(n), Some(ratio)) => format!(
            "Median: omnistage {:.0} req/s, nginx {n:.0} req/s, ratio {ratio:.2} (≥ 1: at least as fast as nginx).",
            report.omnistage_req_per_s
        ),
        _ => format!(
            "Median: omnistage {:.0} req/s; nginx not run ({}).",
            report.omnistage_req_per_s,
            report.nginx_note.as_deref().unwrap_or("not installed")
        ),
    };
    let doc = Doc {
        title: "http-vs-nginx: requests/s side by side".into(),
        command: format!(
            "omnistage exp http-vs-nginx --rounds {} --seconds {} --conns {}",
            a.rounds, a.seconds, a.conns
        ),
        machine: report.machine.clone(),
        intro: vec![format!(
            "One worker each pinned to CPU 0 (omnistage with full scheduling and accounting; nginx \
             with sendfile and an open-file cache, no access log), the load generator on CPU 1, {} \
             keep-alive connections, a {} B file, {} alternating rounds of {} s; medians compared.",
            a.conns, a.file_bytes, a.rounds, a.seconds
        )],
        tables: vec![(String::new(), t)],
        notes: vec![verdict],
    };
    report::emit(
        "http-vs-nginx",
        &report,
        &doc,
        a.common.json,
        a.out.as_deref(),
        |p| {
            let cats: Vec<String> = (1..=a.rounds).map(|i| format!("round {i}")).collect();
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
