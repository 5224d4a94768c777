//! hyper's HTTP/1.1 server on omnistage tasks: three tenants by Host with weights 50/33/17.
//!
//! ```sh
//! cargo run --release -p omnistage --example hyper_tenants -- --workers 1 --pin
//! omnistage load --addr 127.0.0.1:8090 --seconds 10 --cpu 1 \
//!   --tenant a:a.test:16:burn=200 --tenant b:b.test:16:burn=200 --tenant c:c.test:16:burn=200
//! ```
//!
//! Endpoints: `/hello` (12 bytes) and `/burn?us=N` (also `/_burn?us=N`, the load generator's
//! spelling): N µs of calibrated CPU inside the async handler, with an `.await` before and
//! after. Each connection is a task; its first request re-tags it from `/infra` to its tenant
//! (`task::set_activity`), and the `.await` that follows puts it in the tenant's queue, so the
//! tenants' polls share the core by the tree's weights. Nothing here is Tokio: hyper runs on
//! the worker's own poller and timers through `omnistage::task`'s `hyper::rt` impls.
//!
//! Every 5 s it prints each tenant's requests and its share of the task stage's charged CPU
//! (the ledger's figure; the load generator's completed requests are the independent one).

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use omnistage::account::ActivityId;
use omnistage::activity::{ActivitySpec, INFRA};
use omnistage::exec::{Affinity, Runtime};
use omnistage::task::{self, TaskConfig, TaskTimer};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The tenants: Host, activity path, weight.
const TENANTS: [(&str, &str, u32); 3] = [
    ("a.test", "/a", 50),
    ("b.test", "/b", 33),
    ("c.test", "/c", 17),
];
/// Largest `/burn` a request may ask for, µs (a bound on what a client can make us spin).
const BURN_US_MAX: u64 = 1_000_000;
const HELLO: &[u8] = b"hello world\n";

struct Args {
    workers: usize,
    pin: bool,
    addr: SocketAddr,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        workers: 1,
        pin: false,
        addr: "127.0.0.1:8090".parse().expect("literal"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--workers" => {
                args.workers = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|&n| n >= 1)
                    .ok_or("--workers needs a count of at least 1")?;
            }
            "--pin" => args.pin = true,
            "--addr" => {
                args.addr = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or("--addr needs IP:PORT")?;
            }
            "-h" | "--help" => {
                return Err("usage: hyper_tenants [--workers N] [--pin] [--addr IP:PORT]".into())
            }
            other => return Err(format!("unknown argument {other:?} (try --help)")),
        }
    }
    Ok(args)
}

/// A CPU burn calibrated in loop iterations per µs (so a busy machine lengthens the burn
/// rather than shortening the work).
#[derive(Clone, Copy)]
struct Burner {
    iters_per_us: u64,
}

impl Burner {
    fn spin(iters: u64) -> u64 {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for i in 0..iters {
            x = std::hint::black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(i));
        }
        x
    }

    /// The fastest of a few timed runs (the least disturbed by other work).
    fn calibrate() -> Self {
        let iters = 2_000_000;
        let best = (0..5)
            .map(|_| {
                let t = Instant::now();
                Self::spin(iters);
                t.elapsed()
            })
            .min()
            .expect("five runs");
        Burner {
            iters_per_us: (iters as f64 / best.as_secs_f64() / 1e6).max(1.0) as u64,
        }
    }

    fn burn(&self, us: u64) {
        Self::spin(us * self.iters_per_us);
    }
}

struct App {
    tenants: Vec<(&'static str, ActivityId)>,
    requests: Vec<AtomicU64>,
    burner: Burner,
}

fn reply(status: StatusCode, body: Bytes) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body));
    *r.status_mut() = status;
    r
}

async fn handle(
    app: Arc<App>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let host = req
        .headers()
        .get(hyper::header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(|h| h.split(':').next().unwrap_or(h));
    let Some(i) = host.and_then(|h| app.tenants.iter().position(|(n, _)| *n == h)) else {
        return Ok(reply(
            StatusCode::NOT_FOUND,
            Bytes::from_static(b"unknown host\n"),
        ));
    };
    // From here the connection's task works for the tenant (re-tagging is explicit).
    let _ = task::set_activity(app.tenants[i].1);
    let resp = match req.uri().path() {
        "/hello" => {
            task::yield_now().await;
            reply(StatusCode::OK, Bytes::from_static(HELLO))
        }
        "/burn" | "/_burn" => {
            let us = req
                .uri()
                .query()
                .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("us=")))
                .and_then(|v| v.parse::<u64>().ok())
                .filter(|&us| us <= BURN_US_MAX);
            let Some(us) = us else {
                return Ok(reply(
                    StatusCode::BAD_REQUEST,
                    Bytes::from(format!("burn needs us=0..={BURN_US_MAX}\n")),
                ));
            };
            task::yield_now().await;
            app.burner.burn(us);
            task::yield_now().await;
            reply(StatusCode::OK, Bytes::from(format!("burned {us} us\n")))
        }
        _ => reply(StatusCode::NOT_FOUND, Bytes::from_static(b"not found\n")),
    };
    app.requests[i].fetch_add(1, Ordering::Relaxed);
    Ok(resp)
}

/// One core's accept loop: each connection becomes a task on this core, in `/infra` until
/// its first request names its tenant.
async fn accept_loop(listener: std::net::TcpListener, app: Arc<App>) {
    let listener = match task::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("hyper_tenants: cannot register the listener: {e}");
            return;
        }
    };
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors, say: wait a little instead of spinning.
                eprintln!("hyper_tenants: accept: {e}");
                task::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let spawned = task::spawn(async move {
            let service = service_fn(move |req| handle(app.clone(), req));
            // Errors are the clients' (resets, bad requests): hyper has answered what it could.
            let _ = http1::Builder::new()
                .timer(TaskTimer)
                .serve_connection(stream, service)
                .await;
        });
        if let Err(e) = spawned {
            eprintln!("hyper_tenants: connection refused by the task stage: {e}");
        }
    }
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let burner = Burner::calibrate();
    let mut b = Runtime::builder()
        .workers(args.workers)
        .pin(args.pin)
        .tasks(TaskConfig::default())
        .unwrap_or_else(|e| panic!("tasks: {e}"));
    let mut tenants = Vec::new();
    for (host, path, weight) in TENANTS {
        let (nb, id) = b
            .activity(path, ActivitySpec::weight(weight))
            .unwrap_or_else(|e| panic!("activity {path}: {e}"));
        b = nb;
        tenants.push((host, id));
    }
    let rt = match b.start() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("hyper_tenants: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    let listener = match std::net::TcpListener::bind(args.addr) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("hyper_tenants: cannot listen on {}: {e}", args.addr);
            std::process::exit(1);
        }
    };
    let app = Arc::new(App {
        tenants,
        requests: TENANTS.iter().map(|_| AtomicU64::new(0)).collect(),
        burner,
    });
    for core in 0..args.workers {
        // One descriptor of the listener per core, in each core's own poller.
        let l = listener.try_clone().expect("dup the listener");
        let app = app.clone();
        rt.spawn_with(INFRA, Affinity::Core(core as u16), move || {
            accept_loop(l, app)
        })
        .expect("spawn the accept loop");
    }
    println!(
        "hyper_tenants: http://{} on {} worker(s){}, burn calibrated at {} iterations/us",
        args.addr,
        args.workers,
        if args.pin { ", pinned" } else { "" },
        burner.iters_per_us
    );
    let stage = rt.task_stage().expect("tasks enabled");
    let mut last_req = vec![0u64; TENANTS.len()];
    let mut last_cpu = vec![0u64; TENANTS.len()];
    loop {
        std::thread::sleep(Duration::from_secs(5));
        let snap = rt.snapshot();
        let mut line = String::from("last 5 s:");
        let cpu: Vec<u64> = app
            .tenants
            .iter()
            .map(|(_, id)| {
                snap.rows
                    .iter()
                    .filter(|r| r.stage == stage && r.activity == *id)
                    .map(|r| r.cpu_ns)
                    .sum()
            })
            .collect();
        let d_cpu: Vec<u64> = cpu.iter().zip(&last_cpu).map(|(c, l)| c - l).collect();
        let cpu_total: u64 = d_cpu.iter().sum::<u64>().max(1);
        for (i, (host, _)) in app.tenants.iter().enumerate() {
            let n = app.requests[i].load(Ordering::Relaxed);
            line += &format!(
                "  {host} {} req ({:.1} % of task CPU)",
                n - last_req[i],
                100.0 * d_cpu[i] as f64 / cpu_total as f64
            );
            last_req[i] = n;
        }
        last_cpu = cpu;
        let lp = rt.long_polls();
        if !lp.is_empty() {
            line += &format!("  long polls: {lp:?}");
        }
        println!("{line}");
    }
}
