//! `omnistage-load`: the load generator behind `omnistage load`.
//!
//! Drives an HTTP/1.1 server with several tenants at once, each with its own `Host` header, number
//! of keep-alive connections and URL mix, and reports per-tenant throughput, latency quantiles,
//! errors by kind and Jain's fairness index across each tenant's connections, and across all
//! clients (connection slots) of the run.
//!
//! It is a benchmark tool, so the measurement comes first:
//!
//! - **Open loop** (`--rate`): each tenant's requests follow a fixed schedule, and latency is
//!   measured from each request's *intended* send time (coordinated-omission correction, as in
//!   wrk2): a request that waits for a busy connection carries that wait in its latency.
//! - **Closed loop** (default, `--think-ms`): one request outstanding per connection; latency runs
//!   from when the request became due.
//! - Only the window after `--warmup-s` is recorded; requests in flight (or due and unsent) at the
//!   deadline are reported as `unfinished`, not dropped silently, with how long the oldest of
//!   them had waited by then (`unfinished_oldest_ms`: a lower bound of a latency no quantile holds).
//! - Responses are framed properly (status line and headers by `httparse`; Content-Length,
//!   chunked and close-delimited bodies), and bodies are counted, never buffered.
//!
//! Everything is bounded: at most [`MAX_CONNECTIONS_TOTAL`] connections, 64 KiB response heads,
//! 1 GiB bodies, a deadline on every run, and targets limited to IP literals on loopback (names
//! are never resolved).
//!
//! Modules, bottom up:
//!
//! - [`parse`]: incremental response framing;
//! - [`mix`]: `--tenant` specs and the paths each tenant requests;
//! - [`stats`]: histograms, counters, Jain's index;
//! - [`args`]: command-line arguments and their validation;
//! - `engine`: the per-thread `mio` event loop;
//! - [`report`]: the [`Report`] and its table;
//! - `affinity`: `--cpu` pinning.

pub mod args;
pub mod mix;
pub mod parse;
pub mod report;
pub mod stats;

mod affinity;
mod engine;
mod segments;
mod stamps;

pub use args::LoadArgs;
pub use report::{format_table, print_table, Report, ServerSegments, TenantReport, WindowReport};
pub use stats::{client_counts, jain_index, ClientCounts, ErrorCounts};

use engine::{Budget, Run, ThreadResult};
use mix::Pacing;
use report::TenantMeta;
use stats::TenantStats;
use std::time::Instant;

/// Most connections in one run, over all tenants and threads.
pub const MAX_CONNECTIONS_TOTAL: usize = 100_000;

/// Runs the load described by `args` and returns what was measured. Arguments are checked before
/// any connection is opened; errors are messages for the user.
pub fn run(args: &LoadArgs) -> Result<Report, String> {
    let plan = args::plan(args)?;
    check_pinning(&plan.cpus)?;

    // Slots are dealt to threads in turn, so each thread gets a share of every tenant.
    let mut slots: Vec<Vec<(usize, usize)>> = vec![Vec::new(); plan.threads];
    let mut next = 0;
    for (tenant, t) in plan.tenants.iter().enumerate() {
        for slot in 0..t.connections {
            slots[next % plan.threads].push((tenant, slot));
            next += 1;
        }
    }

    let start = Instant::now();
    let measure_start = start + plan.warmup;
    let run = Run {
        plan: &plan,
        budgets: plan
            .tenants
            .iter()
            .map(|_| Budget::new(plan.requests))
            .collect(),
        start,
        measure_start,
        end: measure_start + plan.measure,
    };
    let results: Vec<Result<ThreadResult, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = slots
            .iter()
            .enumerate()
            .map(|(i, mine)| {
                let run = &run;
                std::thread::Builder::new()
                    .name(format!("load-{i}"))
                    .spawn_scoped(s, move || engine::run_thread(run, i, mine))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => h
                    .join()
                    .unwrap_or_else(|_| Err("a generator thread panicked".into())),
                Err(e) => Err(format!("cannot start a generator thread: {e}")),
            })
            .collect()
    });

    let mut per_tenant: Vec<TenantStats> = plan
        .tenants
        .iter()
        .map(|t| TenantStats::new(t.connections))
        .collect();
    let mut finished = measure_start;
    let mut segments = segments::SegmentTotals::default();
    for r in results {
        let r = r?;
        finished = finished.max(r.finished);
        segments.merge(&r.segments);
        for (acc, s) in per_tenant.iter_mut().zip(&r.stats) {
            if let Some(s) = s {
                acc.merge(s);
            }
        }
    }
    let seconds = finished
        .saturating_duration_since(measure_start)
        .as_secs_f64();

    let mut total = TenantStats::new(0);
    let mut tenants = Vec::with_capacity(plan.tenants.len());
    for (t, s) in plan.tenants.iter().zip(&per_tenant) {
        total.append(s);
        let (rate_per_s, think_ms) = match t.pacing {
            Pacing::Open { rate_per_s } => (Some(rate_per_s), None),
            Pacing::Closed { think_ms } => (None, Some(think_ms)),
        };
        tenants.push(report::tenant_report(
            TenantMeta {
                name: t.name.clone(),
                host: t.host.clone(),
                mix: t.mix_text.clone(),
                rate_per_s,
                think_ms,
            },
            s,
            seconds,
        ));
    }
    let total_rate: Option<f64> = tenants.iter().map(|t| t.rate_per_s).sum::<Option<f64>>();
    let client_requests = stats::client_counts(&total.ok_per_connection);
    let total = report::tenant_report(
        TenantMeta {
            name: "total".into(),
            host: String::new(),
            mix: String::new(),
            rate_per_s: total_rate,
            think_ms: None,
        },
        &total,
        seconds,
    );
    let server_segments = segments::read_anywhere().then(|| {
        let per_response =
            |x: u64| (total.responses > 0).then(|| x as f64 / total.responses as f64);
        ServerSegments {
            data: segments.data,
            without_data: segments.without_data,
            data_per_response: per_response(segments.data),
            without_data_per_response: per_response(segments.without_data),
            unread_sockets: segments.unread,
        }
    });
    Ok(Report {
        addr: plan.addr.to_string(),
        threads: plan.threads,
        seconds,
        warmup_s: plan.warmup.as_secs_f64(),
        window_s: plan.window.map(|w| w.as_secs_f64()),
        tenants,
        total,
        client_jain: client_requests.jain,
        client_requests,
        server_segments,
    })
}

/// Fails early, before any connection, if a `--cpu` cannot be used (a probe thread pins itself
/// to each CPU once).
fn check_pinning(cpus: &[usize]) -> Result<(), String> {
    for (i, &cpu) in cpus.iter().enumerate() {
        if cpus[..i].contains(&cpu) {
            continue;
        }
        std::thread::spawn(move || affinity::pin_current_thread(cpu))
            .join()
            .map_err(|_| "the CPU pinning probe panicked".to_string())??;
    }
    Ok(())
}
