//! `web-share`: the server with three tenants (weights 50/33/17) on one pinned worker, and the
//! load generator on the other core offering each tenant more than its share. The share is
//! measured on the bound resource from the server's ledger; the load generator's view
//! (requests/s, latency) is reported beside it.

use super::report::{self, Doc, Table};
use super::share::{self, ShareVerdict};
use super::util::machine;
use super::Common;
use clap::{Args, Parser, ValueEnum};
use omnistage_http::config::parse_config;
use omnistage_http::server::{Server, ServerOptions};
use serde::Serialize;
use std::time::Duration;

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum Bound {
    Cpu,
    Net,
    Disk,
}

#[derive(Args, Clone)]
#[command(mut_arg("seconds", |a| a.default_value("20.0")))]
#[command(mut_arg("out", |a| a.help("Write web-share-BOUND.json, .md and .svg into this directory.")))]
#[command(mut_arg("repeats", |a| a.default_value("1").hide(true)))]
#[command(mut_arg("nginx", |a| a.hide(true)))]
pub struct WebShareArgs {
    #[arg(long, value_enum, default_value = "cpu")]
    bound: Bound,
    /// Keep-alive connections per tenant (each keeps one request outstanding).
    #[arg(long, default_value_t = 16)]
    conns: usize,
    /// CPU per request for `--bound cpu`, µs.
    #[arg(long, default_value_t = 200)]
    burn_us: u64,
    /// For `--bound net`: the link cap all tenants share, bytes/s.
    #[arg(long, default_value_t = 40_000_000)]
    link_bytes_per_s: u64,
    /// For `--bound net`: body size of each response (`/_bytes?n=N`). Large enough that the
    /// link, not the worker's CPU, is the bound; the smallest tenant completes 1,000 requests
    /// in about 10 s at the default link cap.
    #[arg(long, default_value_t = 65_536)]
    body_bytes: u64,
    /// For `--bound disk`: the size of the file each request reads whole. Large enough that the
    /// disk cap, not the worker's CPU, is the bound (64 KiB files made a busy machine's run
    /// CPU-bound); the smallest tenant completes 1,000 requests in about 16 s at the default cap.
    #[arg(long, default_value_t = 262_144)]
    disk_file_bytes: usize,
    /// For `--bound disk`: the disk read rate all tenants share, bytes/s.
    #[arg(long, default_value_t = 100_000_000)]
    disk_bytes_per_s: u64,
    /// CPU the server's worker is pinned to; the load generator takes the other.
    #[arg(long, default_value_t = 0)]
    server_cpu: usize,
    #[command(flatten)]
    common: Common,
}

#[derive(Serialize)]
struct TenantResult {
    name: String,
    weight: u32,
    target_share: f64,
    share: f64,
    error_pts: f64,
    /// The clients' share: requests completed (CPU: each the same fixed work) or body bytes
    /// received (network, disk), from the load generator.
    client_share: f64,
    client_error_pts: f64,
    /// Requests the clients completed in the measured window.
    requests: u64,
    req_per_s: f64,
    bytes_per_s: f64,
    p50_ms: f64,
    p90_ms: f64,
    p99_ms: f64,
    errors: u64,
}

#[derive(Serialize)]
struct Report {
    experiment: &'static str,
    bound: &'static str,
    machine: String,
    seconds: f64,
    conns_per_tenant: usize,
    burn_us: u64,
    tenants: Vec<TenantResult>,
    #[serde(flatten)]
    verdict: ShareVerdict,
}

#[derive(Parser)]
struct LoadCli {
    #[command(flatten)]
    args: omnistage_load::LoadArgs,
}

const TENANTS: [(&str, u32); 3] = [("a", 50), ("b", 33), ("c", 17)];
const WARMUP_S: f64 = 1.0;

pub fn run(a: WebShareArgs) -> Result<(), String> {
    if !(1_000_000..=1_000_000_000).contains(&a.link_bytes_per_s)
        || !(1..=1 << 24).contains(&a.body_bytes)
        || !(1..=1 << 26).contains(&a.disk_file_bytes)
    {
        return Err(
            "--link-bytes-per-s 1e6..=1e9, --body-bytes 1..=16 MiB, --disk-file-bytes 1..=64 MiB"
                .into(),
        );
    }
    if !(1_000_000..=10_000_000_000).contains(&a.disk_bytes_per_s) {
        return Err("--disk-bytes-per-s 1e6..=1e10".into());
    }
    if !(1.0..=3600.0).contains(&a.common.seconds)
        || !(1..=1000).contains(&a.conns)
        || a.burn_us > 100_000
    {
        return Err("--seconds 1..=3600, --conns 1..=1000, --burn-us 0..=100000".into());
    }
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    if cpus < 2 || a.server_cpu >= cpus {
        return Err("web-share needs 2 CPUs: one for the server, one for the load".into());
    }
    let load_cpu = (a.server_cpu + 1) % cpus;
    let root = std::env::temp_dir().join(format!("omnistage-web-share-{}", std::process::id()));
    std::fs::create_dir_all(&root).map_err(|e| e.to_string())?;
    std::fs::write(root.join("index.html"), b"web-share\n").map_err(|e| e.to_string())?;
    let mut toml = String::from(
        "[server]\nlisten = [\"127.0.0.1:0\"]\nworkers = 1\nconnections_max = 10000\n",
    );
    if a.bound == Bound::Net {
        toml.push_str(&format!("net_link_cap = \"{}B/s\"\n", a.link_bytes_per_s));
    }
    if a.bound == Bound::Disk {
        // Cache off, page cache bypassed: every body byte is a read by the disk stage, whose
        // rate cap makes the disk the bottleneck.
        toml.push_str(&format!(
            "cache_bytes_max = 0\ndisk_direct = true\ndisk_threads = 2\ndisk_cap = \"{}B/s\"\n",
            a.disk_bytes_per_s
        ));
        let data = (0..a.disk_file_bytes)
            .map(|i| (i % 251) as u8)
            .collect::<Vec<u8>>();
        std::fs::write(root.join("data.bin"), data).map_err(|e| e.to_string())?;
    }
    for (name, weight) in TENANTS {
        toml.push_str(&format!(
            "\n[[tenant]]\nname = \"{name}\"\nhosts = [\"{name}.test\"]\nweight = {weight}\ndocroot = \"{}\"\nsynthetic = true\n",
            root.display()
        ));
    }
    let config = parse_config(&toml).map_err(|e| e.to_string())?;
    // The server pins its one worker to CPU 0; `server_cpu` other than 0 is not supported by
    // the server's pinning (worker i goes to CPU i), so say so instead of measuring wrongly.
    if a.server_cpu != 0 {
        return Err("--server-cpu other than 0 is not supported yet".into());
    }
    let server = Server::start(
        config,
        ServerOptions {
            pin: true,
            workers: Some(1),
            bypass: false,
        },
    )?;
    let addr = server.local_addrs()[0];
    let mut argv: Vec<String> = vec![
        "load".into(),
        "--addr".into(),
        addr.to_string(),
        "--seconds".into(),
        a.common.seconds.to_string(),
        "--warmup-s".into(),
        WARMUP_S.to_string(),
        "--cpu".into(),
        load_cpu.to_string(),
    ];
    for (name, _) in TENANTS {
        argv.push("--tenant".into());
        let mix = match a.bound {
            Bound::Net => format!("bytes={}", a.body_bytes),
            Bound::Disk => "path=/data.bin".to_string(),
            _ => format!("burn={}", a.burn_us),
        };
        argv.push(format!("{name}:{name}.test:{}:{mix}", a.conns));
    }
    let load = LoadCli::try_parse_from(&argv)
        .map_err(|e| e.to_string())?
        .args;
    let ids: Vec<_> = TENANTS
        .iter()
        .map(|(n, _)| {
            server
                .runtime()
                .activity_id(&format!("/tenants/{n}"))
                .expect("tenant activity")
        })
        .collect();
    let handle = std::thread::spawn(move || omnistage_load::run(&load));
    std::thread::sleep(Duration::from_secs_f64(WARMUP_S));
    let s0 = server.runtime().snapshot();
    let d0 = server.disk_bytes();
    std::thread::sleep(Duration::from_secs_f64(a.common.seconds));
    let s1 = server.runtime().snapshot();
    let d1 = server.disk_bytes();
    let report = handle.join().map_err(|_| "load generator panicked")??;
    server.drain(Duration::from_millis(500));
    let _ = std::fs::remove_dir_all(&root);

    // The bound resource: charged CPU, or bytes the server sent.
    let bound = a.bound;
    let cpu = |s: &omnistage::account::Snapshot, id| {
        s.by_activity()
            .into_iter()
            .find(|(x, _)| *x == id)
            .map(|(_, r)| {
                if bound == Bound::Net {
                    r.bytes_out
                } else {
                    r.cpu_ns
                }
            })
            .unwrap_or(0)
    };
    let used: Vec<u64> = if bound == Bound::Disk {
        d1.iter().zip(&d0).map(|(b, a)| b.1 - a.1).collect()
    } else {
        ids.iter().map(|&id| cpu(&s1, id) - cpu(&s0, id)).collect()
    };
    let total: u64 = used.iter().sum();
    let wsum: u32 = TENANTS.iter().map(|t| t.1).sum();
    let clients: Vec<Option<&omnistage_load::report::TenantReport>> = TENANTS
        .iter()
        .map(|(name, _)| report.tenants.iter().find(|t| t.name == *name))
        .collect();
    // The clients' instrument: completed requests of equal work for CPU, body bytes received
    // for network and disk.
    let client = share::shares(
        &clients
            .iter()
            .map(|t| {
                t.map(|t| match bound {
                    Bound::Cpu => t.requests as f64,
                    _ => t.bytes as f64,
                })
                .unwrap_or(0.0)
            })
            .collect::<Vec<_>>(),
    );
    let tenants: Vec<TenantResult> = TENANTS
        .iter()
        .zip(&used)
        .enumerate()
        .map(|(i, (&(name, weight), &u))| {
            let tr = clients[i];
            let target = f64::from(weight) / f64::from(wsum);
            let share = u as f64 / total.max(1) as f64;
            let e = tr.map(|t| &t.errors);
            TenantResult {
                name: name.into(),
                weight,
                target_share: target,
                share,
                error_pts: (share - target) * 100.0,
                client_share: client[i],
                client_error_pts: (client[i] - target) * 100.0,
                requests: tr.map(|t| t.requests).unwrap_or(0),
                req_per_s: tr.map(|t| t.req_per_s).unwrap_or(0.0),
                bytes_per_s: tr.map(|t| t.bytes_per_s).unwrap_or(0.0),
                p50_ms: tr.map(|t| t.p50_ms).unwrap_or(0.0),
                p90_ms: tr.map(|t| t.p90_ms).unwrap_or(0.0),
                p99_ms: tr.map(|t| t.p99_ms).unwrap_or(0.0),
                errors: e
                    .map(|e| {
                        e.connect
                            + e.reset
                            + e.timeout
                            + e.rejected_503
                            + e.http_4xx
                            + e.http_5xx
                            + e.parse
                    })
                    .unwrap_or(0),
            }
        })
        .collect();
    // The goals: 2 points for CPU and network, 5 for disk.
    let goal_pts = if a.bound == Bound::Disk { 5.0 } else { 2.0 };
    let verdict = share::judge(
        &tenants.iter().map(|t| t.target_share).collect::<Vec<_>>(),
        &tenants.iter().map(|t| t.share).collect::<Vec<_>>(),
        &client,
        &tenants.iter().map(|t| t.requests).collect::<Vec<_>>(),
        goal_pts,
    );
    let r = Report {
        experiment: "web-share",
        bound: match a.bound {
            Bound::Cpu => "cpu",
            Bound::Net => "net",
            Bound::Disk => "disk",
        },
        machine: machine(),
        seconds: a.common.seconds,
        conns_per_tenant: a.conns,
        burn_us: a.burn_us,
        tenants,
        verdict,
    };
    let what = match a.bound {
        Bound::Net => format!(
            "/_bytes?n={} under a {} B/s link cap, share of bytes sent",
            a.body_bytes, a.link_bytes_per_s
        ),
        Bound::Disk => format!(
            "a {} B file, cache off, O_DIRECT, {} B/s disk cap, share of bytes read",
            a.disk_file_bytes, a.disk_bytes_per_s
        ),
        _ => format!("/_burn?us={}, share of charged CPU", r.burn_us),
    };
    let mut t = Table::new(&[
        "tenant",
        "weight",
        "target",
        "share (ledger)",
        "error pts",
        "client share",
        "client error pts",
        "requests",
        "req/s",
        "MB/s",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "errors",
    ]);
    for x in &r.tenants {
        t.row(vec![
            x.name.clone(),
            x.weight.to_string(),
            format!("{:.4}", x.target_share),
            format!("{:.4}", x.share),
            format!("{:+.2}", x.error_pts),
            format!("{:.4}", x.client_share),
            format!("{:+.2}", x.client_error_pts),
            x.requests.to_string(),
            format!("{:.0}", x.req_per_s),
            format!("{:.2}", x.bytes_per_s / 1e6),
            format!("{:.2}", x.p50_ms),
            format!("{:.2}", x.p90_ms),
            format!("{:.2}", x.p99_ms),
            x.errors.to_string(),
        ]);
    }
    let name = format!("web-share-{}", r.bound);
    let doc = Doc {
        title: format!("web-share --bound {}: three tenants 50/33/17 on one worker", r.bound),
        command: format!(
            "omnistage exp web-share --bound {} --seconds {} --conns {}",
            r.bound, r.seconds, r.conns_per_tenant
        ),
        machine: r.machine.clone(),
        intro: vec![format!(
            "One server worker pinned to CPU {}, the load generator on CPU {load_cpu}, {} keep-alive \
             connections per tenant each keeping a request outstanding (every tenant offers more \
             than its share); {what}; {:.0} s after {WARMUP_S} s of warm-up.",
            a.server_cpu, r.conns_per_tenant, r.seconds
        )],
        tables: vec![(String::new(), t)],
        notes: vec![r.verdict.note(if a.bound == Bound::Cpu {
            "requests completed, each the same fixed work"
        } else {
            "body bytes received"
        })],
    };
    report::emit(&name, &r, &doc, a.common.json, a.common.out(), |p| {
        let cats: Vec<String> = r.tenants.iter().map(|x| x.name.clone()).collect();
        report::svg_bars(
            p,
            &format!("web-share --bound {}: target vs measured share", r.bound),
            "share",
            &cats,
            &[
                (
                    "target".into(),
                    r.tenants.iter().map(|x| x.target_share).collect(),
                ),
                ("ledger".into(), r.tenants.iter().map(|x| x.share).collect()),
                (
                    "clients".into(),
                    r.tenants.iter().map(|x| x.client_share).collect(),
                ),
            ],
        )
    })
}
