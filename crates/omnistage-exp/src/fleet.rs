//! `fleet`: three omnistage nodes (separate `omnistage serve` processes, one worker each, every
//! one with `net_link_cap = "10MB/s"` so the bound resource is the nodes' links, not this
//! machine's cores) and a `redis-server` of their own on free loopback ports.
//!
//! - **shares**: tenant a (weight 4) reaches only node 1, tenant b (weight 1) all three; both
//!   closed-loop and backlogged on `/_bytes`. With `[cluster]` the water-fill gives a node 1 and
//!   b nodes 2 and 3 (b keeps a 1 % floor on node 1); without it node 1 splits 4:1. Measured by
//!   the clients: a's share of node 1's bytes and each tenant's fleet-wide bytes. Goal: a ≥ 0.97
//!   of node 1 and fleet shares within 3 points of the water-fill.
//! - **cap**: tenant c capped at `fleet_rate_per_s = 1000`, offered 3,000 requests/s open loop
//!   split 60/30/10 over the nodes. Goal: the clients' fleet total within ±5 % of the cap.
//! - **faults**: the shares load; Redis killed for 5 s and started again on its port, then node
//!   3 killed. A thread reads nodes 1 and 2's `/metrics` every 20 ms. Goals: no client errors on
//!   nodes 1 and 2 other than 503s, fallback within one interval, resync within 3 intervals,
//!   node 3's share reclaimed within 3 intervals (times to what the scrapes saw, so ± 20 ms).

use super::harness;
use super::report::{self, Doc, Table};
use super::util::machine;
use super::Common;
use clap::Args;
use omnistage_fleet::water::{self, Demand, NodeDemand};
use serde::Serialize;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Args, Clone)]
#[command(mut_arg("seconds", |a| a.default_value("8").help("Measured seconds per phase.")))]
#[command(mut_arg("out", |a| a.help("Write fleet.json, .md and .svg here.")))]
#[command(mut_arg("repeats", |a| a.default_value("1").hide(true)))]
#[command(mut_arg("nginx", |a| a.hide(true)))]
pub struct FleetArgs {
    /// The redis-server binary (Debian's `redis-server`).
    #[arg(long, default_value = "redis-server")]
    redis: PathBuf,
    /// The nodes' `sync_ms`.
    #[arg(long, default_value_t = 100)]
    sync_ms: u64,
    /// Phases to run, comma-separated (shares, cap, faults).
    #[arg(long, default_value = "shares,cap,faults", value_delimiter = ',')]
    phases: Vec<String>,
    #[command(flatten)]
    common: Common,
}

const NODES: usize = 3;
const LINK_BYTES_PER_S: u64 = 10_000_000;
const WEIGHT_A: u32 = 4;
const WEIGHT_B: u32 = 1;
const CAP_PER_S: u64 = 1000;
const OFFERED_PER_S: [f64; NODES] = [1800.0, 900.0, 300.0];
const BODY_BYTES: u64 = 65_536;
/// Seconds of load before the measured window (the fill converges in a few intervals).
const WARMUP_S: f64 = 2.0;
/// How long a node or Redis may take to start.
const START_WAIT: Duration = Duration::from_secs(15);

/// A process this experiment started; killed (by its own PID) when dropped.
struct Proc(Option<Child>);

impl Proc {
    fn kill(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

pub(crate) fn free_port() -> Result<u16, String> {
    Ok(TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port: {e}"))?
        .port())
}

pub(crate) fn wait_connect(addr: SocketAddr, what: &str) -> Result<(), String> {
    let deadline = Instant::now() + START_WAIT;
    while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        if Instant::now() > deadline {
            return Err(format!("{what} did not start on {addr}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn start_redis(bin: &Path, port: u16) -> Result<Proc, String> {
    let child = Command::new(bin)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
    let p = Proc(Some(child));
    wait_connect(SocketAddr::from(([127, 0, 0, 1], port)), "redis-server")?;
    Ok(p)
}

struct Node {
    proc: Proc,
    addr: SocketAddr,
    admin: SocketAddr,
}

fn node_config(dir: &Path, i: usize, port: u16, redis: Option<(u16, u64)>) -> String {
    let cluster = match redis {
        Some((rp, sync_ms)) => format!(
            "[cluster]\nredis = \"redis://127.0.0.1:{rp}\"\nnode = \"n{}\"\nsync_ms = {sync_ms}\n\n",
            i + 1
        ),
        None => String::new(),
    };
    let cap = if redis.is_some() {
        format!("fleet_rate_per_s = {CAP_PER_S}\n")
    } else {
        String::new()
    };
    format!(
        "[server]\nlisten = [\"127.0.0.1:{port}\"]\nworkers = 1\nnet_link_cap = \"10MB/s\"\n\n{cluster}\
         [[tenant]]\nname = \"a\"\nhosts = [\"a.test\"]\ndocroot = \"{d}\"\nsynthetic = true\nweight = {WEIGHT_A}\n\n\
         [[tenant]]\nname = \"b\"\nhosts = [\"b.test\"]\ndocroot = \"{d}\"\nsynthetic = true\nweight = {WEIGHT_B}\n\n\
         [[tenant]]\nname = \"c\"\nhosts = [\"c.test\"]\ndocroot = \"{d}\"\nsynthetic = true\nweight = 1\n{cap}",
        d = dir.display()
    )
}

/// Starts the three nodes (with `[cluster]` when `redis` is given).
fn start_nodes(dir: &Path, redis: Option<(u16, u64)>) -> Result<Vec<Node>, String> {
    let exe = std::env::current_exe().map_err(|e| format!("own binary: {e}"))?;
    let mut nodes = Vec::new();
    for i in 0..NODES {
        let port = free_port()?;
        let admin_port = free_port()?;
        let cfg = dir.join(format!("n{}.toml", i + 1));
        std::fs::write(&cfg, node_config(dir, i, port, redis)).map_err(|e| e.to_string())?;
        let log = std::fs::File::create(dir.join(format!("n{}.log", i + 1)))
            .map_err(|e| e.to_string())?;
        let child = Command::new(&exe)
            .arg("serve")
            .arg("--config")
            .arg(&cfg)
            .args(["--admin", &format!("127.0.0.1:{admin_port}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot start node {}: {e}", i + 1))?;
        let n = Node {
            proc: Proc(Some(child)),
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            admin: SocketAddr::from(([127, 0, 0, 1], admin_port)),
        };
        wait_connect(n.addr, "omnistage node")?;
        wait_connect(n.admin, "omnistage admin")?;
        nodes.push(n);
    }
    Ok(nodes)
}

/// The skewed ingress: a (16 connections, so that its output never runs dry between a
/// response and the next request) on node 1 only, b (8) on every node.
fn shares_load(i: usize) -> Vec<String> {
    let b = format!("b:b.test:8:bytes={BODY_BYTES}");
    let a = format!("a:a.test:16:bytes={BODY_BYTES}");
    let mut v = vec!["--spin-us".into(), "0".into()];
    for t in if i == 0 { vec![a, b] } else { vec![b] } {
        v.push("--tenant".into());
        v.push(t);
    }
    v
}

fn run_loads(
    nodes: &[Node],
    seconds: f64,
    load: impl Fn(usize) -> Vec<String>,
) -> Result<Vec<harness::LoadHandle>, String> {
    nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            Ok(harness::spawn_load(harness::load_args(
                &n.addr.to_string(),
                seconds,
                WARMUP_S,
                &load(i),
            )?))
        })
        .collect()
}

#[derive(Serialize, Clone, Default)]
struct SharesRun {
    cluster: bool,
    /// Bytes/s the clients read in their window (counted as they arrived), per node: (a, b).
    per_node_bytes_per_s: Vec<(f64, f64)>,
    a_share_of_node1: f64,
    /// The same share by node 1's ledger (`omnistage_activity_sent_bytes`, scraped when the
    /// clients' window starts and ends), beside the clients' figure; null if a scrape failed.
    ledger_a_share_of_node1: Option<f64>,
    a_fleet_share: f64,
    b_fleet_share: f64,
    fleet_bytes_per_s: f64,
    errors: u64,
    /// Fallback episodes the nodes counted during the run (a sync that missed its deadline on a
    /// busy machine is one): null without `[cluster]`.
    fallback_episodes: Option<f64>,
}

fn shares_run(dir: &Path, redis: Option<(u16, u64)>, seconds: f64) -> Result<SharesRun, String> {
    let nodes = start_nodes(dir, redis)?;
    let loads = run_loads(&nodes, seconds, shares_load)?;
    // Node 1's ledger over (about) the clients' measured window.
    std::thread::sleep(Duration::from_secs_f64(WARMUP_S));
    let before = ledger_sent(nodes[0].admin);
    std::thread::sleep(Duration::from_secs_f64(seconds));
    let after = ledger_sent(nodes[0].admin);
    let ledger_a_share_of_node1 = before.zip(after).map(|((a0, b0), (a1, b1))| {
        let (a, b) = (a1 - a0, b1 - b0);
        a / (a + b).max(1.0)
    });
    let mut per = Vec::new();
    let mut errors = 0;
    for h in loads {
        let r = harness::join_load(h)?;
        let bytes = |name: &str| {
            r.tenants
                .iter()
                .find(|t| t.name == name)
                .map_or(0.0, |t| t.received_bytes_per_s)
        };
        errors += r.tenants.iter().map(harness::errors).sum::<u64>();
        per.push((bytes("a"), bytes("b")));
    }
    let fallback_episodes = redis.and_then(|_| {
        nodes
            .iter()
            .map(|n| {
                scrape_values(n.admin, &["omnistage_fleet_fallback_episodes_total{"]).map(|v| v[0])
            })
            .sum::<Option<f64>>()
    });
    drop(nodes);
    let a: f64 = per.iter().map(|x| x.0).sum();
    let b: f64 = per.iter().map(|x| x.1).sum();
    Ok(SharesRun {
        cluster: redis.is_some(),
        a_share_of_node1: per[0].0 / (per[0].0 + per[0].1).max(1.0),
        ledger_a_share_of_node1,
        a_fleet_share: a / (a + b).max(1.0),
        b_fleet_share: b / (a + b).max(1.0),
        fleet_bytes_per_s: a + b,
        per_node_bytes_per_s: per,
        errors,
        fallback_episodes,
    })
}

/// The fleet shares the water-fill gives this placement (a on node 1, b everywhere, both
/// backlogged, equal links).
fn expected_shares() -> (f64, f64) {
    let backlogged = Demand {
        backlogged: true,
        want: LINK_BYTES_PER_S,
        used: 0,
    };
    let nodes: Vec<NodeDemand> = (0..NODES)
        .map(|i| NodeDemand {
            capacity: LINK_BYTES_PER_S,
            tenants: if i == 0 {
                vec![(0, backlogged), (1, backlogged)]
            } else {
                vec![(1, backlogged)]
            },
        })
        .collect();
    let f = water::water_fill(&[WEIGHT_A, WEIGHT_B], &nodes);
    let total = LINK_BYTES_PER_S * NODES as u64;
    (f.share_target(0, total), f.share_target(1, total))
}

#[derive(Serialize, Clone, Default)]
struct CapRun {
    cap_per_s: u64,
    offered_per_s: Vec<f64>,
    /// Served requests/s per node as the clients counted them.
    served_per_s: Vec<f64>,
    refused_503_per_s: f64,
    fleet_served_per_s: f64,
    error_fraction: f64,
    other_errors: u64,
    goal_met: bool,
}

fn cap_run(dir: &Path, redis: (u16, u64), seconds: f64) -> Result<CapRun, String> {
    let nodes = start_nodes(dir, Some(redis))?;
    let loads = run_loads(&nodes, seconds, |i| {
        vec![
            "--spin-us".into(),
            "0".into(),
            "--tenant".into(),
            format!(
                "c:c.test:{}:bytes=100,rate={}",
                8 * (3 - i),
                OFFERED_PER_S[i]
            ),
        ]
    })?;
    let mut served = Vec::new();
    let mut refused = 0.0;
    let mut other = 0;
    for h in loads {
        let r = harness::join_load(h)?;
        let t = &r.tenants[0];
        served.push(t.requests as f64 / r.seconds);
        refused += t.errors.rejected_503 as f64 / r.seconds;
        other += harness::errors(t) - t.errors.rejected_503;
    }
    drop(nodes);
    let total: f64 = served.iter().sum();
    let error_fraction = total / CAP_PER_S as f64 - 1.0;
    Ok(CapRun {
        cap_per_s: CAP_PER_S,
        offered_per_s: OFFERED_PER_S.to_vec(),
        served_per_s: served,
        refused_503_per_s: refused,
        fleet_served_per_s: total,
        error_fraction,
        other_errors: other,
        goal_met: error_fraction.abs() <= 0.05,
    })
}

/// One scrape of a node's fleet figures: (connected, nodes seen), or `None` if unreachable.
fn scrape(admin: SocketAddr) -> Option<(bool, f64)> {
    let v = scrape_values(
        admin,
        &["omnistage_fleet_connected{", "omnistage_fleet_nodes_seen{"],
    )?;
    Some((v[0] > 0.5, v[1]))
}

/// The bytes a node's ledger counts as sent for tenants a and b.
fn ledger_sent(admin: SocketAddr) -> Option<(f64, f64)> {
    let v = scrape_values(
        admin,
        &[
            "omnistage_activity_sent_bytes_total{activity=\"/tenants/a\"}",
            "omnistage_activity_sent_bytes_total{activity=\"/tenants/b\"}",
        ],
    )?;
    Some((v[0], v[1]))
}

/// The values of the first series of each named metric in a node's `/metrics`.
fn scrape_values(admin: SocketAddr, names: &[&str]) -> Option<Vec<f64>> {
    let mut s = TcpStream::connect_timeout(&admin, Duration::from_millis(200)).ok()?;
    s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    names
        .iter()
        .map(|name| {
            body.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse::<f64>().ok())
        })
        .collect()
}

#[derive(Serialize, Clone, Default)]
struct FaultsRun {
    sync_ms: u64,
    redis_down_s: f64,
    /// Redis killed → nodes 1 and 2 both report fallback (s; null: never seen).
    fallback_s: Option<f64>,
    /// Redis started again → both report connected (s).
    resync_s: Option<f64>,
    /// Node 3 killed → both see 2 nodes (s).
    reclaim_s: Option<f64>,
    /// Client errors on nodes 1 and 2 other than 503.
    errors_nodes_1_2: u64,
    /// Those errors by node, tenant and kind (e.g. "node 1 b timeout").
    errors_by_kind: std::collections::BTreeMap<String, u64>,
    /// Nodes 1 and 2's own count of connections closed by a deadline (`omnistage_http_timeouts`)
    /// at the end: a client error of kind "reset" beside a timeout here was the server's
    /// choice (null: the scrape failed).
    node_timeouts: [Option<f64>; 2],
    goal_met: bool,
}

fn faults_run(
    dir: &Path,
    redis_bin: &Path,
    redis_port: u16,
    sync_ms: u64,
    mut redis: Proc,
) -> Result<FaultsRun, String> {
    const DOWN_AT_S: f64 = 3.0;
    const DOWN_S: f64 = 5.0;
    const NODE3_KILL_AT_S: f64 = 11.0;
    const TOTAL_S: f64 = 14.0;
    let mut nodes = start_nodes(dir, Some((redis_port, sync_ms)))?;
    let admins = [nodes[0].admin, nodes[1].admin];
    let loads = run_loads(&nodes, TOTAL_S, shares_load)?;
    // The measured window starts after the warmup.
    let t0 = Instant::now() + Duration::from_secs_f64(WARMUP_S);
    while Instant::now() < t0 {
        std::thread::sleep(Duration::from_millis(10));
    }
    let at = |s: f64| t0 + Duration::from_secs_f64(s);
    let mut samples: Vec<(f64, bool, f64)> = Vec::new();
    let mut step = 0;
    let mut redis_again = None;
    while Instant::now() < at(TOTAL_S - 0.5) {
        let now = Instant::now();
        if step == 0 && now >= at(DOWN_AT_S) {
            redis.kill();
            step = 1;
        } else if step == 1 && now >= at(DOWN_AT_S + DOWN_S) {
            redis_again = Some(start_redis(redis_bin, redis_port)?);
            step = 2;
        } else if step == 2 && now >= at(NODE3_KILL_AT_S) {
            nodes[2].proc.kill();
            step = 3;
        }
        let t = now.duration_since(t0).as_secs_f64();
        let s: Vec<Option<(bool, f64)>> = admins.iter().map(|&a| scrape(a)).collect();
        if let [Some((c1, n1)), Some((c2, n2))] = s[..] {
            samples.push((t, c1 && c2, n1.max(n2)));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut errors = 0;
    let mut kinds = std::collections::BTreeMap::<String, u64>::new();
    for (i, h) in loads.into_iter().enumerate() {
        let r = harness::join_load(h)?;
        if i < 2 {
            for t in &r.tenants {
                errors += harness::errors(t) - t.errors.rejected_503;
                let e = &t.errors;
                for (k, n) in [
                    ("connect", e.connect),
                    ("reset", e.reset),
                    ("timeout", e.timeout),
                    ("4xx", e.http_4xx),
                    ("5xx", e.http_5xx),
                    ("parse", e.parse),
                ] {
                    if n > 0 {
                        *kinds
                            .entry(format!("node {} {} {k}", i + 1, t.name))
                            .or_default() += n;
                    }
                }
            }
        }
    }
    let node_timeouts =
        admins.map(|a| scrape_values(a, &["omnistage_http_timeouts"]).map(|v| v[0]));
    drop(nodes);
    drop(redis_again);
    let first = |from: f64, pred: &dyn Fn(&(f64, bool, f64)) -> bool| {
        samples
            .iter()
            .find(|x| x.0 >= from && pred(x))
            .map(|x| x.0 - from)
    };
    // Fallback: either node reports it (the first scrape where not both are connected).
    let fallback_s = first(DOWN_AT_S, &|x| !x.1);
    let resync_s = first(DOWN_AT_S + DOWN_S, &|x| x.1);
    let reclaim_s = first(NODE3_KILL_AT_S, &|x| x.1 && x.2 <= 2.0);
    let interval = sync_ms as f64 / 1000.0;
    let within = |x: Option<f64>, n: f64| x.is_some_and(|x| x <= n * interval);
    Ok(FaultsRun {
        sync_ms,
        redis_down_s: DOWN_S,
        goal_met: errors == 0
            && within(fallback_s, 1.0)
            && within(resync_s, 3.0)
            && within(reclaim_s, 3.0),
        fallback_s,
        resync_s,
        reclaim_s,
        errors_nodes_1_2: errors,
        errors_by_kind: kinds,
        node_timeouts,
    })
}

#[derive(Serialize, Default)]
struct Out {
    experiment: &'static str,
    machine: String,
    command: String,
    sync_ms: u64,
    link_bytes_per_s: u64,
    expected_a_fleet_share: f64,
    expected_b_fleet_share: f64,
    with_cluster: Option<SharesRun>,
    without_cluster: Option<SharesRun>,
    shares_goal_met: Option<bool>,
    cap: Option<CapRun>,
    faults: Option<FaultsRun>,
    goal_met: Option<bool>,
}

pub fn run(a: FleetArgs) -> Result<(), String> {
    a.common.check(1.0)?;
    if !(10..=60_000).contains(&a.sync_ms) {
        return Err("--sync-ms 10..=60000".into());
    }
    for p in &a.phases {
        if !["shares", "cap", "faults"].contains(&p.as_str()) {
            return Err(format!("--phases: unknown phase {p:?}"));
        }
    }
    let has = |p: &str| a.phases.iter().any(|x| x == p);
    let dir = std::env::temp_dir().join(format!("omnistage-exp-fleet-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let port = free_port()?;
    let redis = start_redis(&a.redis, port)?;
    let (ea, eb) = expected_shares();
    let mut out = Out {
        experiment: "fleet",
        machine: machine(),
        command: format!(
            "omnistage exp fleet --sync-ms {} --phases {} {}",
            a.sync_ms,
            a.phases.join(","),
            a.common.words()
        ),
        sync_ms: a.sync_ms,
        link_bytes_per_s: LINK_BYTES_PER_S,
        expected_a_fleet_share: ea,
        expected_b_fleet_share: eb,
        ..Default::default()
    };
    let cluster = Some((port, a.sync_ms));
    if has("shares") {
        let with = shares_run(&dir, cluster, a.common.seconds)?;
        let without = shares_run(&dir, None, a.common.seconds)?;
        out.shares_goal_met = Some(
            with.errors == 0
                && with.a_share_of_node1 >= 0.97
                && (with.a_fleet_share - ea).abs() <= 0.03
                && (with.b_fleet_share - eb).abs() <= 0.03,
        );
        out.with_cluster = Some(with);
        out.without_cluster = Some(without);
    }
    if has("cap") {
        out.cap = Some(cap_run(&dir, (port, a.sync_ms), a.common.seconds)?);
    }
    if has("faults") {
        out.faults = Some(faults_run(&dir, &a.redis, port, a.sync_ms, redis)?);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let verdicts = [
        out.shares_goal_met,
        out.cap.as_ref().map(|c| c.goal_met),
        out.faults.as_ref().map(|f| f.goal_met),
    ];
    out.goal_met = verdicts.iter().flatten().copied().reduce(|x, y| x && y);
    let doc = page(&out);
    report::emit("fleet", &out, &doc, a.common.json, a.common.out(), |p| {
        chart(p, &out)
    })
}

fn pct(x: f64) -> String {
    format!("{:.1} %", x * 100.0)
}

fn opt_s(x: Option<f64>) -> String {
    x.map_or_else(|| "never seen".into(), |x| format!("{:.3} s", x))
}

fn page(o: &Out) -> Doc {
    let mut tables = Vec::new();
    if let (Some(w), Some(wo)) = (&o.with_cluster, &o.without_cluster) {
        let mut t = Table::new(&[
            "run",
            "a of node 1",
            "(ledger)",
            "a fleet",
            "b fleet",
            "fleet MB/s",
            "node 1 a/b MB/s",
            "node 2 b",
            "node 3 b",
            "errors",
            "fallbacks",
        ]);
        for r in [w, wo] {
            let n = &r.per_node_bytes_per_s;
            t.row(vec![
                if r.cluster {
                    "with [cluster]"
                } else {
                    "without"
                }
                .into(),
                format!("{:.3}", r.a_share_of_node1),
                r.ledger_a_share_of_node1
                    .map_or_else(|| "–".into(), |x| format!("{x:.3}")),
                pct(r.a_fleet_share),
                pct(r.b_fleet_share),
                format!("{:.2}", r.fleet_bytes_per_s / 1e6),
                format!("{:.2} / {:.2}", n[0].0 / 1e6, n[0].1 / 1e6),
                format!("{:.2}", n[1].1 / 1e6),
                format!("{:.2}", n[2].1 / 1e6),
                r.errors.to_string(),
                r.fallback_episodes
                    .map_or_else(|| "–".into(), |x| format!("{x:.0}")),
            ]);
        }
        t.row(vec![
            "water-fill".into(),
            "≥ 0.97 (goal)".into(),
            String::new(),
            pct(o.expected_a_fleet_share),
            pct(o.expected_b_fleet_share),
            format!("{:.0}", 3.0 * LINK_BYTES_PER_S as f64 / 1e6),
            String::new(),
            String::new(),
            String::new(),
            String::new(),
            String::new(),
        ]);
        tables.push((
            "Skewed ingress: a only on node 1, b on all three".to_string(),
            t,
        ));
    }
    if let Some(c) = &o.cap {
        let mut t = Table::new(&["node", "offered req/s", "served req/s"]);
        for (i, (off, s)) in c.offered_per_s.iter().zip(&c.served_per_s).enumerate() {
            t.row(vec![
                format!("{}", i + 1),
                format!("{off:.0}"),
                format!("{s:.1}"),
            ]);
        }
        t.row(vec![
            "fleet".into(),
            format!("{:.0}", c.offered_per_s.iter().sum::<f64>()),
            format!(
                "{:.1} ({:+.2} % of the cap {}; 503/s {:.0}; other errors {})",
                c.fleet_served_per_s,
                c.error_fraction * 100.0,
                c.cap_per_s,
                c.refused_503_per_s,
                c.other_errors
            ),
        ]);
        tables.push((
            "Fleet cap: c at 1,000 req/s, offered 3,000 split 60/30/10".to_string(),
            t,
        ));
    }
    if let Some(f) = &o.faults {
        let mut t = Table::new(&["event", "measured", "goal"]);
        let iv = f.sync_ms as f64 / 1000.0;
        t.row(vec![
            "Redis killed → fallback".into(),
            opt_s(f.fallback_s),
            format!("≤ {iv:.3} s"),
        ]);
        t.row(vec![
            format!("Redis back after {:.0} s → resync", f.redis_down_s),
            opt_s(f.resync_s),
            format!("≤ {:.3} s", 3.0 * iv),
        ]);
        t.row(vec![
            "node 3 killed → reclaimed".into(),
            opt_s(f.reclaim_s),
            format!("≤ {:.3} s", 3.0 * iv),
        ]);
        let kinds: Vec<String> = f
            .errors_by_kind
            .iter()
            .map(|(k, n)| format!("{k}: {n}"))
            .collect();
        t.row(vec![
            "client errors on nodes 1, 2 (not 503)".into(),
            if kinds.is_empty() {
                f.errors_nodes_1_2.to_string()
            } else {
                format!("{} ({})", f.errors_nodes_1_2, kinds.join(", "))
            },
            "0".into(),
        ]);
        let timeouts = f
            .node_timeouts
            .map(|x| x.map_or("?".to_string(), |v| format!("{v:.0}")));
        t.row(vec![
            "connections the nodes closed by a deadline (node 1, node 2)".into(),
            format!("{}, {}", timeouts[0], timeouts[1]),
            "—".into(),
        ]);
        tables.push((
            "Faults (times from the event to what the nodes' /metrics showed; scrapes every 20 ms)"
                .to_string(),
            t,
        ));
    }
    let verdict = match o.goal_met {
        Some(true) => "Goal met.",
        Some(false) => "Goal **not** met.",
        None => "No verdict (no phase ran).",
    };
    Doc {
        title: "Fleet: shares and caps across three nodes through Redis".into(),
        command: o.command.clone(),
        machine: o.machine.clone(),
        intro: vec![
            format!(
                "Three `omnistage serve` processes (one worker each, `net_link_cap = \"10MB/s\"`) and a \
                 `redis-server` of their own on loopback; `sync_ms = {}`. Tenant a (weight {WEIGHT_A}) reaches only \
                 node 1, b (weight {WEIGHT_B}) all three, closed loop on `/_bytes?n={BODY_BYTES}` (a 16 connections, \
                 b 8 per node); figures are the bytes the clients read in their measured window, counted as they arrive (b's responses on node 1 take seconds each at its 1 % floor, so counting whole responses as they complete credited their earlier bytes to the window), with node 1's ledger beside them. All processes share this machine's cores, so the run \
                 is as noisy as the machine is busy.",
                o.sync_ms
            ),
            format!(
                "{verdict} Goals: a ≥ 0.97 of node 1 and fleet shares within 3 points of the water-fill; the \
                 capped tenant's fleet total within ±5 % of the cap; no client errors but 503s on the surviving \
                 nodes, fallback within one interval, resync and reclaim within three."
            ),
        ],
        tables,
        notes: vec![
            "Without `[cluster]` each node splits its link 4:1 between the tenants it sees, so a gets 0.8 of \
             node 1 and b the rest of the fleet; with it a gets node 1 (b keeps its 1 % floor there) and b \
             nodes 2 and 3 (docs/fleet.md)."
                .into(),
        ],
    }
}

fn chart(path: &Path, o: &Out) -> Result<(), String> {
    let (Some(w), Some(wo)) = (&o.with_cluster, &o.without_cluster) else {
        return report::svg_bars(path, "fleet (no shares phase)", "", &[], &[]);
    };
    report::svg_bars(
        path,
        "Fleet-wide shares of link bytes, skewed ingress",
        "share",
        &["a of node 1".into(), "a fleet".into(), "b fleet".into()],
        &[
            (
                "without [cluster]".into(),
                vec![wo.a_share_of_node1, wo.a_fleet_share, wo.b_fleet_share],
            ),
            (
                "with [cluster]".into(),
                vec![w.a_share_of_node1, w.a_fleet_share, w.b_fleet_share],
            ),
            (
                "water-fill".into(),
                vec![1.0, o.expected_a_fleet_share, o.expected_b_fleet_share],
            ),
        ],
    )
}
