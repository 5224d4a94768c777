//! `priority` (TAP Fig. 6; Crovella, Frangioso and Harchol-Balter's shortest-connection-first):
//! one tenant under a bandwidth cap (`net_cap`) serving a file-size mix from 1 KiB to 1 MiB to
//! closed-loop clients that keep a queue at the cap, once per `send_order` (fair, fifo,
//! shortest_first, longest_first; a fresh server each). Per file size: mean and p90 response
//! time at the client; overall mean; throughput from the server's ledger. Goal: shortest first
//! cuts the small files' mean response time below FIFO's, longest first raises it above, and
//! every order keeps the tenant at its cap.

use super::cfgweb;
use super::harness;
use super::report::{self, Doc, Table};
use super::util::machine;
use super::Common;
use clap::Args;
use omnistage_http::config::SendOrder;
use plotters::prelude::*;
use serde::Serialize;
use std::path::Path;
use std::time::{Duration, Instant};

#[derive(Args, Clone)]
#[command(mut_arg("seconds", |a| a.default_value("12.0").help("Measured seconds per order.")))]
#[command(mut_arg("out", |a| a.help("Write priority.json, .md and .svg here.")))]
#[command(mut_arg("repeats", |a| a.default_value("1").hide(true)))]
#[command(mut_arg("nginx", |a| a.hide(true)))]
pub struct PriorityArgs {
    /// The tenant's net_cap, MB/s (decimal).
    #[arg(long, default_value_t = 32.0)]
    cap_mb: f64,
    /// Closed-loop think time of every client, ms.
    #[arg(long, default_value_t = 50.0)]
    think_ms: f64,
    /// Send orders to run, comma-separated (fair, fifo, shortest_first, longest_first).
    #[arg(
        long,
        default_value = "fair,fifo,shortest_first,longest_first",
        value_delimiter = ','
    )]
    orders: Vec<String>,
    #[command(flatten)]
    common: Common,
}

/// The file set: (name, bytes, closed-loop clients). More clients for the small files, so
/// most requests are small and most bytes are large, as on the web.
const FILES: [(&str, usize, usize); 6] = [
    ("1k.bin", 1 << 10, 16),
    ("4k.bin", 4 << 10, 8),
    ("16k.bin", 16 << 10, 8),
    ("64k.bin", 64 << 10, 4),
    ("256k.bin", 256 << 10, 4),
    ("1m.bin", 1 << 20, 4),
];
/// Files up to this size are the "small files" of the goal.
const SMALL_BYTES_MAX: usize = 16 << 10;
/// Achieved bytes/s at least this fraction of the cap counts as "at the cap".
const AT_CAP_FRACTION: f64 = 0.9;

#[derive(Serialize, Clone)]
struct Bucket {
    file_bytes: usize,
    clients: usize,
    /// Successful responses in the measured window.
    requests: u64,
    mean_ms: f64,
    p90_ms: f64,
    max_ms: f64,
    errors: u64,
}

#[derive(Serialize, Clone)]
struct Run {
    order: &'static str,
    /// Ledger `bytes_out` of the tenant over the measured window, per second.
    achieved_bytes_per_s: f64,
    achieved_over_cap: f64,
    /// Body bytes the clients received per second.
    load_bytes_per_s: f64,
    requests: u64,
    errors: u64,
    /// Mean response time over every successful response.
    overall_mean_ms: f64,
    /// Mean response time of the files up to `small_bytes_max`.
    small_mean_ms: f64,
    /// Mean response time of the largest file.
    large_mean_ms: f64,
    buckets: Vec<Bucket>,
}

#[derive(Serialize)]
struct Report {
    experiment: &'static str,
    machine: String,
    seconds_per_order: f64,
    warmup_s: f64,
    cap_bytes_per_s: f64,
    think_ms: f64,
    small_bytes_max: usize,
    runs: Vec<Run>,
    /// Shortest first's small-file mean below FIFO's.
    shortest_first_cuts_small: Option<bool>,
    /// Longest first's small-file mean above FIFO's.
    longest_first_raises_small: Option<bool>,
    /// Every order at ≥ `AT_CAP_FRACTION` of the cap.
    all_at_cap: bool,
    goal_met: Option<bool>,
    peer: &'static str,
}

/// Weighted mean of `(mean, count)` pairs (NaN with no counts).
fn weighted_mean(xs: impl Iterator<Item = (f64, u64)>) -> f64 {
    let (mut sum, mut n) = (0.0, 0u64);
    for (m, c) in xs.filter(|x| x.1 > 0) {
        sum += m * c as f64;
        n += c;
    }
    if n == 0 {
        f64::NAN
    } else {
        sum / n as f64
    }
}

fn run_order(
    order: SendOrder,
    a: &PriorityArgs,
    root: &Path,
    warmup_s: f64,
) -> Result<Run, String> {
    let cap = a.cap_mb * 1e6;
    let tenant = format!(
        "[[tenant]]\nname = \"a\"\nhosts = [\"a.test\"]\ndocroot = '{}'\nnet_cap = \"{}B/s\"\nsend_order = \"{}\"\n",
        root.display(),
        cap.round() as u64,
        order.name()
    );
    let (server, addr) = cfgweb::start("", &tenant)?;
    let rt = server.runtime();
    let id = rt.activity_id("/tenants/a").ok_or("tenant activity")?;
    let mut extra = Vec::new();
    for (name, _, clients) in FILES {
        extra.push("--tenant".to_string());
        extra.push(format!(
            "f{name}:a.test:{clients}:path=/{name},think-ms={}",
            a.think_ms
        ));
    }
    let la = harness::load_args(&addr, a.common.seconds, warmup_s, &extra)?;
    let h = harness::spawn_load(la);
    std::thread::sleep(Duration::from_secs_f64(warmup_s));
    let start = Instant::now();
    let first = cfgweb::bytes_out(&rt.snapshot(), id);
    std::thread::sleep(Duration::from_secs_f64(a.common.seconds));
    let last = cfgweb::bytes_out(&rt.snapshot(), id);
    let elapsed = start.elapsed().as_secs_f64().max(1e-9);
    let r = harness::join_load(h)?;
    server.drain(Duration::from_millis(300));
    let buckets: Vec<Bucket> = FILES
        .iter()
        .zip(&r.tenants)
        .map(|(&(_, bytes, clients), t)| Bucket {
            file_bytes: bytes,
            clients,
            requests: t.requests,
            mean_ms: t.mean_ms,
            p90_ms: t.p90_ms,
            max_ms: t.max_ms,
            errors: harness::errors(t),
        })
        .collect();
    let achieved = (last - first) as f64 / elapsed;
    Ok(Run {
        order: order.name(),
        achieved_bytes_per_s: achieved,
        achieved_over_cap: achieved / cap,
        load_bytes_per_s: r.total.bytes_per_s,
        requests: r.total.requests,
        errors: harness::errors(&r.total),
        overall_mean_ms: weighted_mean(buckets.iter().map(|b| (b.mean_ms, b.requests))),
        small_mean_ms: weighted_mean(
            buckets
                .iter()
                .filter(|b| b.file_bytes <= SMALL_BYTES_MAX)
                .map(|b| (b.mean_ms, b.requests)),
        ),
        large_mean_ms: buckets.last().map_or(f64::NAN, |b| b.mean_ms),
        buckets,
    })
}

pub fn run(a: PriorityArgs) -> Result<(), String> {
    if !(0.3..=600.0).contains(&a.common.seconds)
        || !(1.0..=1000.0).contains(&a.cap_mb)
        || !(0.0..=10_000.0).contains(&a.think_ms)
    {
        return Err("--seconds 0.3..=600, --cap-mb 1..=1000, --think-ms 0..=10000".into());
    }
    let mut orders = Vec::new();
    for o in &a.orders {
        let o = SendOrder::parse(o.trim()).map_err(|e| format!("--orders: {e}"))?;
        if orders.contains(&o) {
            return Err(format!("--orders: {} twice", o.name()));
        }
        orders.push(o);
    }
    if orders.is_empty() {
        return Err("--orders: give at least one".into());
    }
    let warmup_s = (a.common.seconds * 0.1).clamp(0.2, 1.0);
    let root = std::env::temp_dir().join(format!("omnistage-priority-{}", std::process::id()));
    std::fs::create_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()))?;
    for (name, bytes, _) in FILES {
        let data: Vec<u8> = (0..bytes).map(|i| b'a' + (i % 26) as u8).collect();
        std::fs::write(root.join(name), data).map_err(|e| format!("{name}: {e}"))?;
    }
    let mut runs = Vec::new();
    for &o in &orders {
        match run_order(o, &a, &root, warmup_s) {
            Ok(r) => runs.push(r),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&root);
                return Err(e);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&root);
    let rep = judge(runs, &a, warmup_s);
    let doc = page(&rep, &a);
    report::emit("priority", &rep, &doc, a.common.json, a.common.out(), |p| {
        chart(p, &rep)
    })
}

/// The goal from the runs (one per order).
fn judge(runs: Vec<Run>, a: &PriorityArgs, warmup_s: f64) -> Report {
    let small = |name: &str| {
        runs.iter()
            .find(|r| r.order == name)
            .map(|r| r.small_mean_ms)
    };
    let (fifo, sf, lf) = (
        small("fifo"),
        small("shortest_first"),
        small("longest_first"),
    );
    // A mean of nothing (an order without small-file responses, NaN) is no figure: not
    // judged, rather than a comparison that is false.
    let both =
        |a: Option<f64>, b: Option<f64>| a.zip(b).filter(|(a, b)| a.is_finite() && b.is_finite());
    let shortest_first_cuts_small = both(fifo, sf).map(|(f, s)| s < f);
    let longest_first_raises_small = both(fifo, lf).map(|(f, l)| l > f);
    let all_at_cap = runs.iter().all(|r| r.achieved_over_cap >= AT_CAP_FRACTION);
    let goal_met = shortest_first_cuts_small
        .zip(longest_first_raises_small)
        .map(|(s, l)| s && l && all_at_cap);
    Report {
        experiment: "priority",
        machine: machine(),
        seconds_per_order: a.common.seconds,
        warmup_s,
        cap_bytes_per_s: a.cap_mb * 1e6,
        think_ms: a.think_ms,
        small_bytes_max: SMALL_BYTES_MAX,
        runs,
        shortest_first_cuts_small,
        longest_first_raises_small,
        all_at_cap,
        goal_met,
        peer: "none: nginx has no per-server bandwidth cap or size-based send order to compare",
    }
}

fn kib(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

fn ms(x: f64) -> String {
    if !x.is_finite() {
        "-".into()
    } else if x < 10.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.0}")
    }
}

fn page(r: &Report, a: &PriorityArgs) -> Doc {
    let mut t = Table::new(&[
        "order",
        "file",
        "clients",
        "responses",
        "mean ms",
        "p90 ms",
        "max ms",
        "errors",
    ]);
    for run in &r.runs {
        for b in &run.buckets {
            t.row(vec![
                run.order.into(),
                kib(b.file_bytes),
                b.clients.to_string(),
                b.requests.to_string(),
                ms(b.mean_ms),
                ms(b.p90_ms),
                ms(b.max_ms),
                b.errors.to_string(),
            ]);
        }
    }
    let mut s = Table::new(&[
        "order",
        "small files (≤ 16 KiB) mean ms",
        "1 MiB mean ms",
        "overall mean ms",
        "achieved MB/s (ledger)",
        "achieved / cap",
        "responses",
        "errors",
    ]);
    for run in &r.runs {
        s.row(vec![
            run.order.into(),
            ms(run.small_mean_ms),
            ms(run.large_mean_ms),
            ms(run.overall_mean_ms),
            format!("{:.2}", run.achieved_bytes_per_s / 1e6),
            format!("{:.3}", run.achieved_over_cap),
            run.requests.to_string(),
            run.errors.to_string(),
        ]);
    }
    let yes_no = |x: Option<bool>| match x {
        Some(true) => "yes",
        Some(false) => "no",
        None => "not run",
    };
    let verdict = match r.goal_met {
        Some(true) => "**Goal met.**",
        Some(false) => "**Goal not met.**",
        None => {
            "**Goal not judged** (fifo, shortest_first and longest_first must all run, and each \
             complete small files)."
        }
    };
    // The experiment runs each order once: say so rather than invent a spread.
    let verdict = format!(
        "{verdict} The comparisons rest on one run per order (this experiment has no repeats): \
         there is no run-to-run range to judge a difference against, so the means are compared \
         as measured, and a close call would need repeated runs to be told from noise."
    );
    let files = FILES
        .iter()
        .map(|&(_, b, c)| format!("{} × {c}", kib(b)))
        .collect::<Vec<_>>()
        .join(", ");
    Doc {
        title: "priority: response time by file size under a bandwidth cap, per send order (TAP Fig. 6)".into(),
        command: format!(
            "omnistage exp priority --seconds {} --cap-mb {} --think-ms {} --orders {}",
            a.common.seconds,
            a.cap_mb,
            a.think_ms,
            r.runs.iter().map(|x| x.order).collect::<Vec<_>>().join(",")
        ),
        machine: r.machine.clone(),
        intro: vec![
            format!(
                "The HTTP server (1 worker on CPU 0) with one tenant capped at `net_cap` = {} MB/s (token bucket), \
                 once per `send_order`, a fresh server each. The load generator on CPU 1 runs closed-loop clients \
                 (think time {} ms) per file, file size × clients: {files} — most requests are small, most bytes \
                 large, and the clients offer far more than the cap, so a queue of responses waits at the cap. \
                 Files are cached in memory after the warmup ({:.1} s), so the cap, not the disk or the CPU, binds. \
                 Response time is measured at the client, request sent to last byte received, over {} s per order.",
                a.cap_mb, a.think_ms, r.warmup_s, a.common.seconds
            ),
            "Orders: `fair` (the server's default: byte round robin between the tenant's connections, \
             16 KiB quanta, like processor sharing), `fifo` (the response that became pending first goes out until done), \
             `shortest_first` (fewest bytes left first: SRPT, Crovella's shortest-connection-first), \
             `longest_first` (largest response first). Both size orders age: a response gains one byte of rank \
             per 16 bytes its tenant sends after it arrived, so none waits forever."
                .into(),
            format!(
                "Goal (TAP, Crovella): shortest first cuts the small files' (≤ 16 KiB) mean response time below FIFO's \
                 ({}), longest first raises it above FIFO's ({}), and the tenant stays at its cap in every order \
                 (≥ {AT_CAP_FRACTION} of it: {}). {verdict}",
                yes_no(r.shortest_first_cuts_small),
                yes_no(r.longest_first_raises_small),
                if r.all_at_cap { "yes" } else { "no" },
            ),
        ],
        tables: vec![
            ("Summary".into(), s),
            ("Per file size".into(), t),
        ],
        notes: notes(r),
    }
}

/// What this run shows beside the goal, read from its figures.
fn notes(r: &Report) -> Vec<String> {
    let run = |o: &str| r.runs.iter().find(|x| x.order == o);
    let mut n = Vec::new();
    if let Some(lf) = run("longest_first") {
        n.push(format!(
            "Longest first: the 1 MiB file's mean is {} ms and the small files' {} ms. TAP reports that \
             longest-connection-first balanced the times across sizes; here {}.",
            ms(lf.large_mean_ms),
            ms(lf.small_mean_ms),
            if lf.large_mean_ms < lf.small_mean_ms {
                "it is the mirror of shortest first instead: the large responses go first and the small \
                 ones wait, up to the aging bound (16 × the size difference of the tenant's traffic)"
            } else {
                "the small files are not faster than the large one either"
            }
        ));
    }
    if let (Some(fair), Some(sf)) = (run("fair"), run("shortest_first")) {
        let (a, b) = (fair.small_mean_ms, sf.small_mean_ms);
        let verdict = if (a - b).abs() <= 0.25 * a.min(b) {
            "within 25 % of each other: byte round robin in 16 KiB quanta already lets a small \
             response out within about one round of the tenant's busy connections"
        } else if b < a {
            "shortest first is clearly lower"
        } else {
            "fair is clearly lower"
        };
        n.push(format!(
            "Fair (byte round robin) against shortest first: small files {} vs {} ms ({verdict}); \
             1 MiB {} vs {} ms; overall {} vs {} ms.",
            ms(a),
            ms(b),
            ms(fair.large_mean_ms),
            ms(sf.large_mean_ms),
            ms(fair.overall_mean_ms),
            ms(sf.overall_mean_ms),
        ));
    }
    n.push(format!(
        "Peer: {}. TAP measured the time on the server (accept to close) at 2000 connections/s; \
         we measure at the client over keep-alive connections, so times include the client's own delays.",
        r.peer
    ));
    n
}

/// Mean response time by file size, one line per order, log-log.
fn chart(path: &Path, r: &Report) -> Result<(), String> {
    let e = |e: &dyn std::fmt::Display| format!("chart {}: {e}", path.display());
    let pts = |run: &Run| -> Vec<(f64, f64)> {
        run.buckets
            .iter()
            .filter(|b| b.mean_ms.is_finite() && b.mean_ms > 0.0)
            .map(|b| (b.file_bytes as f64 / 1024.0, b.mean_ms))
            .collect()
    };
    let all: Vec<f64> = r
        .runs
        .iter()
        .flat_map(|x| pts(x).into_iter().map(|p| p.1))
        .collect();
    let y_lo = all.iter().copied().fold(f64::INFINITY, f64::min);
    let y_hi = all.iter().copied().fold(0.0, f64::max);
    let (y_lo, y_hi) = if y_lo.is_finite() && y_hi > 0.0 {
        (y_lo / 1.5, y_hi * 1.5)
    } else {
        (0.01, 1.0)
    };
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let mut c = ChartBuilder::on(&root)
        .caption(
            "Mean response time by file size, per send order",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d((0.7f64..1500.0).log_scale(), (y_lo..y_hi).log_scale())
        .map_err(|x| e(&x))?;
    c.configure_mesh()
        .x_desc("file size, KiB (log)")
        .y_desc("mean response time, ms (log)")
        .draw()
        .map_err(|x| e(&x))?;
    const COLORS: [RGBColor; 4] = [
        RGBColor(127, 127, 127),
        RGBColor(31, 119, 180),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
    ];
    for (i, run) in r.runs.iter().enumerate() {
        let col = COLORS[i % COLORS.len()];
        let p = pts(run);
        c.draw_series(LineSeries::new(p.clone(), col.stroke_width(2)))
            .map_err(|x| e(&x))?
            .label(run.order)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], col.stroke_width(2)));
        c.draw_series(p.into_iter().map(|q| Circle::new(q, 3, col.filled())))
            .map_err(|x| e(&x))?;
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weighted_mean_weights_by_count_and_skips_empty() {
        let m = weighted_mean([(1.0, 3), (5.0, 1), (f64::NAN, 0)].into_iter());
        assert!((m - 2.0).abs() < 1e-12);
        assert!(weighted_mean(std::iter::empty()).is_nan());
    }

    fn run_of(order: &'static str, small_mean_ms: f64) -> Run {
        Run {
            order,
            achieved_bytes_per_s: 32e6,
            achieved_over_cap: 1.0,
            load_bytes_per_s: 32e6,
            requests: 1000,
            errors: 0,
            overall_mean_ms: small_mean_ms,
            small_mean_ms,
            large_mean_ms: 100.0,
            buckets: Vec::new(),
        }
    }

    #[test]
    fn the_verdict_says_it_rests_on_one_run() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            a: PriorityArgs,
        }
        let a = <Cli as clap::Parser>::parse_from(["priority"]).a;
        let runs = vec![
            run_of("fifo", 128.0),
            run_of("shortest_first", 2.6),
            run_of("longest_first", 593.7),
        ];
        let r = judge(runs, &a, 1.0);
        assert_eq!(r.goal_met, Some(true));
        let intro = page(&r, &a).intro.join(" ");
        assert!(intro.contains("one run per order"), "{intro}");
        // An order without small-file responses (mean NaN) is not judged, not a miss.
        let r = judge(
            vec![
                run_of("fifo", f64::NAN),
                run_of("shortest_first", 2.6),
                run_of("longest_first", 593.7),
            ],
            &a,
            1.0,
        );
        assert_eq!(r.goal_met, None);
    }
}
