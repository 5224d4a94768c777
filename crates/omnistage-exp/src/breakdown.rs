//! `breakdown` (Vortex Fig. 7): charged CPU per stage of the HTTP server, per request, for
//! HTTP/1.0-style load (one request per connection) through keep-alive connections that carry
//! 2, 5, 10, 20 and unlimited requests. From the ledger by stage (`Runtime::stage_name`; `loop`
//! is the worker's own work, charged to `/infra`). Cost per request = total charged CPU / requests
//! the server answered in the same window.

use super::harness;
use super::report::{self, Doc, Table};
use super::util::machine;
use super::Common;
use clap::Args;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

#[derive(Args, Clone)]
#[command(mut_arg("seconds", |a| a.default_value("12.0").help("Total measured seconds, split evenly over the six points.")))]
#[command(mut_arg("out", |a| a.help("Write breakdown.json, .md and .svg here.")))]
#[command(mut_arg("repeats", |a| a.default_value("1").hide(true)))]
#[command(mut_arg("nginx", |a| a.hide(true)))]
pub struct BreakdownArgs {
    /// Connections per tenant (2 tenants, closed loop).
    #[arg(long, default_value_t = 16)]
    conns: usize,
    #[command(flatten)]
    common: Common,
}

#[derive(Serialize)]
struct Point {
    /// Requests per connection; 0 = keep-alive without limit.
    requests_per_conn: u64,
    seconds: f64,
    requests: u64,
    req_per_s: f64,
    errors: u64,
    reconnects: u64,
    /// Charged CPU ns per request, all stages.
    ns_per_request: f64,
    /// Charged CPU ns per request by stage name.
    stages: BTreeMap<String, f64>,
    /// Share of charged CPU by stage name.
    stage_shares: BTreeMap<String, f64>,
}

#[derive(Serialize)]
struct Report {
    experiment: &'static str,
    machine: String,
    file_bytes: usize,
    conns_per_tenant: usize,
    points: Vec<Point>,
    /// ns per request with one request per connection over ns per request with keep-alive.
    http10_over_keepalive: f64,
}

const WARMUP_S: f64 = 0.5;
const RPC: [u64; 6] = [1, 2, 5, 10, 20, 0];
const FILE_BYTES: usize = 1024;

pub fn run(a: BreakdownArgs) -> Result<(), String> {
    if !(0.6..=3600.0).contains(&a.common.seconds) || !(1..=1000).contains(&a.conns) {
        return Err("--seconds 0.6..=3600, --conns 1..=1000".into());
    }
    let per = a.common.seconds / RPC.len() as f64;
    let web = harness::start(
        "breakdown",
        &[("a", 100), ("b", 100)],
        &[("index.html", FILE_BYTES)],
        false,
    )?;
    let mut points = Vec::new();
    for rpc in RPC {
        let extra = vec![
            "--requests-per-conn".into(),
            rpc.to_string(),
            "--tenant".into(),
            format!("a:a.test:{}:path=/index.html", a.conns),
            "--tenant".into(),
            format!("b:b.test:{}:path=/index.html", a.conns),
        ];
        let args = harness::load_args(&web.addr, per, WARMUP_S, &extra)?;
        let h = harness::spawn_load(args);
        std::thread::sleep(Duration::from_secs_f64(WARMUP_S));
        let (s0, q0) = (web.server.runtime().snapshot(), web.requests());
        std::thread::sleep(Duration::from_secs_f64(per));
        let (s1, q1) = (web.server.runtime().snapshot(), web.requests());
        let rep = harness::join_load(h)?;
        let n = (q1 - q0).max(1);
        let mut stages: BTreeMap<String, f64> = BTreeMap::new();
        let mut total = 0u64;
        for (id, (cpu, _)) in harness::by_stage(&s0, &s1) {
            let name = web
                .server
                .runtime()
                .stage_name(id)
                .unwrap_or("?")
                .to_string();
            *stages.entry(name).or_default() += cpu as f64;
            total += cpu;
        }
        let stage_shares = stages
            .iter()
            .map(|(k, v)| (k.clone(), v / total.max(1) as f64))
            .collect();
        for v in stages.values_mut() {
            *v /= n as f64;
        }
        points.push(Point {
            requests_per_conn: rpc,
            seconds: per,
            requests: q1 - q0,
            req_per_s: (q1 - q0) as f64 / per,
            errors: rep.tenants.iter().map(harness::errors).sum(),
            reconnects: rep.tenants.iter().map(|t| t.reconnects).sum(),
            ns_per_request: total as f64 / n as f64,
            stages,
            stage_shares,
        });
    }
    web.stop();
    let r = Report {
        experiment: "breakdown",
        machine: machine(),
        file_bytes: FILE_BYTES,
        conns_per_tenant: a.conns,
        http10_over_keepalive: points[0].ns_per_request
            / points
                .last()
                .map(|p| p.ns_per_request)
                .unwrap_or(1.0)
                .max(1.0),
        points,
    };
    let names: Vec<String> = {
        let mut v: Vec<(String, f64)> = r.points[0]
            .stages
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        for p in &r.points[1..] {
            for k in p.stages.keys() {
                if !v.iter().any(|x| &x.0 == k) {
                    v.push((k.clone(), 0.0));
                }
            }
        }
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v.into_iter().map(|x| x.0).collect()
    };
    let rpc_name = |r: u64| {
        if r == 0 {
            "keep-alive".to_string()
        } else {
            r.to_string()
        }
    };
    let mut header = vec!["requests/conn", "req/s", "errors", "ns/request"];
    let stage_cols: Vec<String> = names
        .iter()
        .map(|n| format!("{n} ns/req (share)"))
        .collect();
    header.extend(stage_cols.iter().map(|s| s.as_str()));
    let mut t = Table::new(&header);
    for p in &r.points {
        let mut row = vec![
            rpc_name(p.requests_per_conn),
            format!("{:.0}", p.req_per_s),
            p.errors.to_string(),
            format!("{:.0}", p.ns_per_request),
        ];
        for n in &names {
            row.push(format!(
                "{:.0} ({:.1} %)",
                p.stages.get(n).copied().unwrap_or(0.0),
                p.stage_shares.get(n).copied().unwrap_or(0.0) * 100.0
            ));
        }
        t.row(row);
    }
    let ka = r.points.last().expect("points");
    let doc = Doc {
        title: "breakdown: CPU per stage and cost per request vs requests per connection (Vortex Fig. 7)".into(),
        command: format!("omnistage exp breakdown --seconds {} --conns {}", a.common.seconds, a.conns),
        machine: r.machine.clone(),
        intro: vec![format!(
            "The HTTP server (1 worker on CPU 0, 2 tenants) serving a {FILE_BYTES} B file to the load generator on CPU 1, \
             {} closed-loop connections per tenant, each connection closed after N requests (N = 1 is HTTP/1.0's one request \
             per connection; keep-alive = no limit), {per:.1} s per point. CPU is the ledger's charged time by stage, divided \
             by the requests the server answered in the same window.",
            a.conns
        )],
        tables: vec![(String::new(), t)],
        notes: vec![format!(
            "One request per connection costs {:.0} ns of charged CPU per request, keep-alive {:.0} ns: {:.2}×. \
             The accept and connection set-up/tear-down work (http.accept, and the part of http.conn and loop that opens and \
             closes sockets) is what falls as more requests share a connection.",
            r.points[0].ns_per_request, ka.ns_per_request, r.http10_over_keepalive
        )],
    };
    let fin: Vec<&Point> = r
        .points
        .iter()
        .filter(|p| p.requests_per_conn > 0)
        .collect();
    let mut series = vec![(
        "total".to_string(),
        fin.iter()
            .map(|p| (p.requests_per_conn as f64, p.ns_per_request / 1000.0))
            .collect::<Vec<_>>(),
    )];
    series.push((
        "total, keep-alive (no limit)".to_string(),
        vec![
            (1.0, ka.ns_per_request / 1000.0),
            (20.0, ka.ns_per_request / 1000.0),
        ],
    ));
    for n in names.iter().take(5) {
        series.push((
            n.clone(),
            fin.iter()
                .map(|p| {
                    (
                        p.requests_per_conn as f64,
                        p.stages.get(n).copied().unwrap_or(0.0) / 1000.0,
                    )
                })
                .collect(),
        ));
    }
    report::emit("breakdown", &r, &doc, a.common.json, a.common.out(), |p| {
        report::svg_lines(
            p,
            "Charged CPU per request vs requests per connection",
            "requests per connection",
            "µs per request",
            &series,
        )
    })
}
