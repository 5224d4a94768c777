//! The result of a run: [`Report`] (serialised as JSON by the CLI's `--json`) and its text table.
//!
//! Owns the conversion from merged [`TenantStats`] to per-tenant figures (rates over the measured
//! window, latency quantiles in milliseconds, Jain's index over connections) and the totals row.

use crate::stats::{jain_index, ClientCounts, ErrorCounts, TenantStats};
use serde::Serialize;

/// A whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Target `IP:port`.
    pub addr: String,
    /// Generator threads.
    pub threads: usize,
    /// Length of the measured window in seconds (shorter than `--seconds` when every tenant
    /// finished its `--requests` early).
    pub seconds: f64,
    /// Warmup before the measured window, seconds.
    pub warmup_s: f64,
    /// The length of each tenant's `windows`, seconds (`null` without `--window-ms`).
    pub window_s: Option<f64>,
    /// One entry per `--tenant`, in the order given.
    pub tenants: Vec<TenantReport>,
    /// All tenants together (`name` "total"; Jain's index over all connections).
    pub total: TenantReport,
    /// Jain's index across clients: every connection slot of every tenant, by its successful
    /// responses in the measured window (SEDA's fairness metric; the same number as
    /// `total.jain_fairness`, named for what it judges). `null` when nothing succeeded.
    pub client_jain: Option<f64>,
    /// Successful responses per client slot: fewest, median, most, and slots with none.
    pub client_requests: ClientCounts,
    /// TCP segments the server sent to the generator's sockets in the measured window, read
    /// from the sockets' `TCP_INFO` (`null` where the kernel does not give them).
    pub server_segments: Option<ServerSegments>,
}

/// The server's TCP segments as this generator's sockets received them in the measured
/// window (see the `segments` module: on loopback each costs the server system time).
#[derive(Debug, Clone, Serialize)]
pub struct ServerSegments {
    /// Segments carrying data.
    pub data: u64,
    /// Segments without data: pure ACKs (a request the server answered later than the
    /// kernel's delayed-ACK timeout gets one), and the SYN-ACKs and FINs of connections.
    pub without_data: u64,
    /// Per complete response (any status) in the window; `null` when there was none.
    pub data_per_response: Option<f64>,
    pub without_data_per_response: Option<f64>,
    /// Sockets whose counters could not be read (not in the sums).
    pub unread_sockets: u64,
}

/// One window's figures for one tenant (`--window-ms`): what completed in it.
#[derive(Debug, Clone, Serialize)]
pub struct WindowReport {
    /// Window number from the start of the measured window (it starts at index × window).
    pub index: usize,
    /// Successful responses that completed in the window.
    pub requests: u64,
    pub rejected_503: u64,
    /// Bytes read from the tenant's sockets in the window, counted as they arrive.
    pub received_bytes: u64,
    /// Latency quantiles of those responses, ms (`null`: none completed).
    pub p50_ms: Option<f64>,
    pub p90_ms: Option<f64>,
    pub p99_ms: Option<f64>,
}

/// One tenant's figures over the measured window.
#[derive(Debug, Clone, Serialize)]
pub struct TenantReport {
    pub name: String,
    /// The Host header sent.
    pub host: String,
    /// Keep-alive connection slots.
    pub connections: usize,
    /// The URL mix as given.
    pub mix: String,
    /// `"closed"` or `"open"`.
    pub pacing: String,
    /// Open-loop target rate (requests/s); `null` for closed loop.
    pub rate_per_s: Option<f64>,
    /// Closed-loop think time; `null` for open loop.
    pub think_ms: Option<f64>,
    /// Successful responses (2xx and 304).
    pub requests: u64,
    /// Complete responses of any status.
    pub responses: u64,
    /// Successful responses per second.
    pub req_per_s: f64,
    /// Body bytes of successful responses.
    pub bytes: u64,
    /// Body bytes of successful responses per second.
    pub bytes_per_s: f64,
    /// Bytes read from the tenant's sockets in the measured window, counted as they arrive
    /// (heads included, any status): the rate to compare with a byte rate the server enforces,
    /// since `bytes` counts a response only when it completes (a slow response's bytes from
    /// before the window, or none at all if it ends after it).
    pub received_bytes: u64,
    pub received_bytes_per_s: f64,
    /// Latency quantiles of successful responses, ms, measured from the intended send time.
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
    /// With `--kernel-stamps`: quantiles of the time from each successful request's actual
    /// send to the kernel's receipt of its response, ms (`null` otherwise): the server's and
    /// the network's part of the latency, without the generator's own delays.
    pub kernel_p50_ms: Option<f64>,
    pub kernel_p99_ms: Option<f64>,
    pub errors: ErrorCounts,
    /// Responses that carried a `Retry-After` header (counted only; never waited for).
    pub retry_after: u64,
    /// Connections opened after each slot's first (after `--requests-per-conn`, `Connection:
    /// close`, errors).
    pub reconnects: u64,
    /// Keep-alive connections the server closed while idle.
    pub idle_closes: u64,
    /// Requests in flight, or due and not yet sent, when the run ended (not in any other count).
    pub unfinished: u64,
    /// How long the oldest of them had waited by the end of the run, ms from its intended send
    /// time (`null` when none): a lower bound of its latency, which the latency figures above
    /// leave out. A server that starves a connection at the end shows it here, not in `max_ms`.
    pub unfinished_oldest_ms: Option<f64>,
    /// Per window of `--window-ms` from the start of the measured window (empty without).
    pub windows: Vec<WindowReport>,
    /// Jain's fairness index over this tenant's connections, by successful responses per
    /// connection; `null` when there were none.
    pub jain_fairness: Option<f64>,
}

/// What the report needs to know about a tenant besides its stats.
pub(crate) struct TenantMeta {
    pub name: String,
    pub host: String,
    pub mix: String,
    pub rate_per_s: Option<f64>,
    pub think_ms: Option<f64>,
}

fn us_to_ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

fn kernel_quantile(s: &TenantStats, q: f64) -> Option<f64> {
    let h = &s.kernel_latency_us;
    (!h.is_empty()).then(|| us_to_ms(h.value_at_quantile(q)))
}

/// Figures for one tenant (or the total) over `seconds` of measurement.
pub(crate) fn tenant_report(meta: TenantMeta, s: &TenantStats, seconds: f64) -> TenantReport {
    let per_s = |x: u64| {
        if seconds > 0.0 {
            x as f64 / seconds
        } else {
            0.0
        }
    };
    let h = &s.latency_us;
    let q = |q: f64| {
        if h.is_empty() {
            0.0
        } else {
            us_to_ms(h.value_at_quantile(q))
        }
    };
    TenantReport {
        name: meta.name,
        host: meta.host,
        connections: s.ok_per_connection.len(),
        mix: meta.mix,
        pacing: if meta.rate_per_s.is_some() {
            "open"
        } else {
            "closed"
        }
        .to_string(),
        rate_per_s: meta.rate_per_s,
        think_ms: meta.think_ms,
        requests: s.ok,
        responses: s.responses,
        req_per_s: per_s(s.ok),
        bytes: s.body_bytes,
        bytes_per_s: per_s(s.body_bytes),
        received_bytes: s.received_bytes,
        received_bytes_per_s: per_s(s.received_bytes),
        p50_ms: q(0.5),
        p90_ms: q(0.9),
        p99_ms: q(0.99),
        p999_ms: q(0.999),
        max_ms: if h.is_empty() { 0.0 } else { us_to_ms(h.max()) },
        mean_ms: if h.is_empty() { 0.0 } else { h.mean() / 1000.0 },
        kernel_p50_ms: kernel_quantile(s, 0.5),
        kernel_p99_ms: kernel_quantile(s, 0.99),
        errors: s.errors,
        retry_after: s.retry_after,
        reconnects: s.reconnects,
        idle_closes: s.idle_closes,
        unfinished: s.unfinished,
        unfinished_oldest_ms: (s.unfinished > 0).then(|| us_to_ms(s.unfinished_oldest_us)),
        windows: s
            .windows
            .iter()
            .enumerate()
            .map(|(index, w)| {
                let h = &w.latency_us;
                let q = |q: f64| (!h.is_empty()).then(|| us_to_ms(h.value_at_quantile(q)));
                WindowReport {
                    index,
                    requests: w.ok,
                    rejected_503: w.rejected_503,
                    received_bytes: w.received_bytes,
                    p50_ms: q(0.5),
                    p90_ms: q(0.9),
                    p99_ms: q(0.99),
                }
            })
            .collect(),
        jain_fairness: jain_index(&s.ok_per_connection),
    }
}

/// Prints the report as a table on standard output.
pub fn print_table(r: &Report) {
    print!("{}", format_table(r));
}

/// The report as a table (what [`print_table`] prints).
pub fn format_table(r: &Report) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "omnistage load: {} | {:.2} s measured after {:.2} s warmup | {} thread{}",
        r.addr,
        r.seconds,
        r.warmup_s,
        r.threads,
        if r.threads == 1 { "" } else { "s" }
    );
    let _ = writeln!(
        out,
        "{:<12} {:>6} {:>10} {:>11} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>6} {:>7} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6}",
        "tenant", "conns", "pacing", "req/s", "MB/s", "p50 ms", "p90 ms", "p99 ms", "max ms",
        "ok", "jain", "503", "4xx", "5xx", "conn", "reset", "tmout", "parse", "unfin"
    );
    for t in r.tenants.iter().chain(std::iter::once(&r.total)) {
        let pacing = match (t.rate_per_s, t.think_ms) {
            (Some(rate), _) => format!("{rate}/s"),
            (None, Some(think)) if think > 0.0 => format!("think {think}"),
            (None, _) => "closed".to_string(),
        };
        let pacing = if t.name == "total" && r.tenants.len() > 1 {
            String::new()
        } else {
            pacing
        };
        let jain = t
            .jain_fairness
            .map(|j| format!("{j:.3}"))
            .unwrap_or_else(|| "-".to_string());
        let e = &t.errors;
        let _ = writeln!(
            out,
            "{:<12} {:>6} {:>10} {:>11.1} {:>9.2} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8} {:>6} {:>7} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6}",
            truncate(&t.name, 12),
            t.connections,
            truncate(&pacing, 10),
            t.req_per_s,
            t.bytes_per_s / 1e6,
            t.p50_ms,
            t.p90_ms,
            t.p99_ms,
            t.max_ms,
            compact(t.requests),
            jain,
            compact(e.rejected_503),
            compact(e.http_4xx),
            compact(e.http_5xx),
            compact(e.connect),
            compact(e.reset),
            compact(e.timeout),
            compact(e.parse),
            compact(t.unfinished),
        );
    }
    // Bytes the server sent with no request outstanding (no request failed; the connection
    // was reopened): a line of their own, only when there were any.
    let unsolicited: Vec<String> = r
        .tenants
        .iter()
        .filter(|t| t.errors.unsolicited > 0)
        .map(|t| format!("{} {}", truncate(&t.name, 12), t.errors.unsolicited))
        .collect();
    if !unsolicited.is_empty() {
        let _ = writeln!(
            out,
            "connections closed after the server sent bytes with no request outstanding: {}",
            unsolicited.join(", ")
        );
    }
    // `--kernel-stamps`: the server's and the network's part of each tenant's latency, on a
    // line of its own so the table keeps its width without them.
    let stamped: Vec<String> = r
        .tenants
        .iter()
        .filter_map(|t| {
            let (p50, p99) = (t.kernel_p50_ms?, t.kernel_p99_ms?);
            Some(format!(
                "{} p50 {p50:.3} ms p99 {p99:.3} ms",
                truncate(&t.name, 12)
            ))
        })
        .collect();
    if !stamped.is_empty() {
        let _ = writeln!(
            out,
            "send→kernel (SO_TIMESTAMPNS: each request's send to the kernel's receipt of its response): {}",
            stamped.join("; ")
        );
    }
    let c = &r.client_requests;
    let _ = writeln!(
        out,
        "clients: {} | jain {} | successful responses per client: min {} median {} max {} | none: {}",
        c.clients,
        r.client_jain
            .map(|j| format!("{j:.3}"))
            .unwrap_or_else(|| "-".to_string()),
        c.requests_min,
        c.requests_median,
        c.requests_max,
        c.starved
    );
    if let Some(g) = &r.server_segments {
        let per = |x: Option<f64>| x.map_or_else(|| "-".to_string(), |v| format!("{v:.2}"));
        let _ = writeln!(
            out,
            "server's TCP segments (TCP_INFO of these sockets): per response {} with data, {} without (pure ACKs, SYN-ACKs, FINs){}",
            per(g.data_per_response),
            per(g.without_data_per_response),
            if g.unread_sockets > 0 {
                format!(" | {} sockets unread", g.unread_sockets)
            } else {
                String::new()
            }
        );
    }
    out
}

fn truncate(s: &str, max: usize) -> String {
    s.chars().take(max).collect()
}

/// A count in at most 6 characters (k/M/G suffixes past that).
fn compact(n: u64) -> String {
    match n {
        0..=999_999 => n.to_string(),
        1_000_000..=999_999_999 => format!("{:.1}M", n as f64 / 1e6),
        _ => format!("{:.1}G", n as f64 / 1e9),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(kernel: Option<(f64, f64)>) -> Report {
        let meta = |name: &str| TenantMeta {
            name: name.into(),
            host: "a.test".into(),
            mix: "path=/".into(),
            rate_per_s: Some(100.0),
            think_ms: None,
        };
        let stats = TenantStats::new(2);
        let mut a = tenant_report(meta("a"), &stats, 1.0);
        if let Some((p50, p99)) = kernel {
            a.kernel_p50_ms = Some(p50);
            a.kernel_p99_ms = Some(p99);
        }
        Report {
            addr: "127.0.0.1:1".into(),
            threads: 1,
            seconds: 1.0,
            warmup_s: 0.0,
            window_s: None,
            tenants: vec![a],
            total: tenant_report(meta("total"), &stats, 1.0),
            client_jain: None,
            client_requests: ClientCounts::default(),
            server_segments: None,
        }
    }

    #[test]
    fn the_table_shows_the_kernel_stamped_figures_when_there_are_any() {
        let t = format_table(&report(Some((0.25, 1.5))));
        assert!(
            t.contains("send→kernel") && t.contains("a p50 0.250 ms p99 1.500 ms"),
            "{t}"
        );
        let t = format_table(&report(None));
        assert!(!t.contains("send→kernel"), "{t}");
    }

    #[test]
    fn the_table_shows_the_servers_segments_when_counted() {
        let mut r = report(None);
        assert!(!format_table(&r).contains("TCP segments"));
        r.server_segments = Some(ServerSegments {
            data: 10,
            without_data: 5,
            data_per_response: Some(1.0),
            without_data_per_response: Some(0.5),
            unread_sockets: 0,
        });
        let t = format_table(&r);
        assert!(
            t.contains("per response 1.00 with data, 0.50 without"),
            "{t}"
        );
    }
}
