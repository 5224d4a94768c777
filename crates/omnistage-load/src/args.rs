//! Command-line arguments ([`LoadArgs`]) and their validation into a plan of the run.
//!
//! Owns every limit on what a run may ask for: the target must be an `IP:port` literal on the
//! loopback range (never a name, never resolved; other addresses only with
//! `--allow-non-loopback`), durations, rates, counts, connections and threads are range-checked,
//! and the file-descriptor and ephemeral-port budgets of the machine are checked before any socket
//! is opened. Validation does no network I/O.

use crate::mix::{self, Mix, Pacing, MAX_TENANTS};
use crate::MAX_CONNECTIONS_TOTAL;
use clap::Args;
use std::net::SocketAddr;
use std::time::Duration;

/// Shortest measured window.
pub const MIN_SECONDS: f64 = 0.1;
/// Longest measured window (and longest warmup).
pub const MAX_SECONDS: f64 = 3600.0;
/// Most generator threads.
pub const MAX_THREADS: usize = 32;
/// Shortest per-request timeout.
pub const MIN_TIMEOUT_MS: u64 = 1;
/// Longest per-request timeout.
pub const MAX_TIMEOUT_MS: u64 = 300_000;
/// Largest `--requests` and `--requests-per-conn`.
pub const MAX_REQUESTS: u64 = 1_000_000_000_000;
/// Longest busy-poll before a due timer (`--spin-us`).
pub const MAX_SPIN_US: u64 = 1000;
/// File descriptors kept free beyond one per connection (poll, stdio, files).
pub const FD_SLACK: u64 = 64;

/// `omnistage load`: drive an HTTP/1.1 server with several tenants at once.
///
/// Each `--tenant` is NAME:HOST:CONNS:MIX[,OPTION...]. MIX is one of `path=/x`,
/// `zipf=N:ALPHA:/prefix` (requests /prefix/K.bin, K in 0..N, Zipf with exponent ALPHA),
/// `zipf=FILE:ALPHA` (Zipf over the paths listed in FILE, one per line, most popular first),
/// `weighted=FILE` (the paths of FILE's `WEIGHT PATH` lines, each with probability WEIGHT/sum),
/// `burn=US` (/_burn?us=US), `bytes=N` (/_bytes?n=N). OPTION is `rate=R` (open loop for this
/// tenant) or `think-ms=MS` (closed loop for this tenant).
#[derive(Args, Debug, Clone)]
pub struct LoadArgs {
    /// Target server as IP:port (a literal address; names are never resolved).
    #[arg(long, default_value = "127.0.0.1:8080", value_name = "IP:PORT")]
    pub addr: String,

    /// A tenant: NAME:HOST:CONNS:MIX[,rate=R|,think-ms=MS][,header=NAME:VALUE]; repeat for
    /// several tenants.
    #[arg(long = "tenant", value_name = "NAME:HOST:CONNS:MIX", required = true)]
    pub tenants: Vec<String>,

    /// Length of the measured window, seconds (0.1..=3600).
    #[arg(long, default_value_t = 10.0, value_name = "S")]
    pub seconds: f64,

    /// Warmup before the measured window, seconds (0..=3600); nothing in it is counted.
    #[arg(long = "warmup-s", default_value_t = 0.0, value_name = "S")]
    pub warmup_s: f64,

    /// Stop each tenant after it has sent this many requests (0 = no limit; warmup ones count).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub requests: u64,

    /// Requests per keep-alive connection before closing and reconnecting (0 = unlimited).
    #[arg(long = "requests-per-conn", default_value_t = 0, value_name = "N")]
    pub requests_per_conn: u64,

    /// Closed loop: pause after each response before the next request, ms (default 0).
    #[arg(long = "think-ms", value_name = "MS", conflicts_with = "rate_per_s")]
    pub think_ms: Option<f64>,

    /// Open loop: requests/s per tenant, spread over its connections; latency is measured from
    /// each request's scheduled time (coordinated-omission corrected).
    #[arg(long = "rate", value_name = "R")]
    pub rate_per_s: Option<f64>,

    /// A request with no complete response this long after it was sent is a timeout; also the
    /// connect timeout.
    #[arg(long = "timeout-ms", default_value_t = 10_000, value_name = "MS")]
    pub timeout_ms: u64,

    /// Generator threads, each running its own event loop over a share of the connections.
    #[arg(long, default_value_t = 1, value_name = "T")]
    pub threads: usize,

    /// Pin generator threads to these CPUs (N, or a list N,M,...: thread i gets entry i mod len).
    #[arg(long, value_name = "N[,N...]")]
    pub cpu: Option<String>,

    /// Seed for the Zipf path choices: each connection slot draws from its own generator seeded
    /// from this, its tenant and its number, so the paths each slot requests repeat exactly.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,

    /// Busy-poll instead of sleeping when the next scheduled send is this close (0..=1000 µs).
    /// The poll sleeps in whole milliseconds, so with 0 a send may leave up to 1 ms late, and in
    /// open loop that lateness counts as latency; 1000 (the default) keeps sends on time at the
    /// cost of CPU.
    #[arg(long = "spin-us", default_value_t = MAX_SPIN_US, value_name = "US")]
    pub spin_us: u64,

    /// Allow a target outside 127.0.0.0/8 and ::1 (still an IP literal, never a name).
    #[arg(long = "allow-non-loopback")]
    pub allow_non_loopback: bool,

    /// Also report each tenant's successes, 503s and latency quantiles per window of this many
    /// ms of the measured window (0 = no windows; 10..=60000, at most 10,000 windows).
    #[arg(long = "window-ms", default_value_t = 0, value_name = "MS")]
    pub window_ms: u64,

    /// Also measure each response from its request's actual send to the kernel's receipt of
    /// the response (SO_TIMESTAMPNS; Linux): the latency the server and the network caused,
    /// without the generator's own lateness in sending or in waking to read. Reported as
    /// `kernel_p50_ms`/`kernel_p99_ms` beside the usual figures.
    #[arg(long = "kernel-stamps")]
    pub kernel_stamps: bool,

    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One tenant, validated.
#[derive(Debug, Clone)]
pub(crate) struct TenantPlan {
    pub name: String,
    pub host: String,
    pub connections: usize,
    pub mix: Mix,
    pub mix_text: String,
    pub pacing: Pacing,
    /// One extra request header (`header=` option).
    pub header: Option<(String, String)>,
}

/// A validated run.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub addr: SocketAddr,
    pub tenants: Vec<TenantPlan>,
    pub measure: Duration,
    pub warmup: Duration,
    /// Per-tenant request budget.
    pub requests: Option<u64>,
    pub requests_per_conn: Option<u64>,
    pub timeout: Duration,
    pub threads: usize,
    pub cpus: Vec<usize>,
    pub seed: u64,
    /// Busy-poll when the next timer is this close.
    pub spin: Duration,
    /// Per-window figures (`--window-ms`), if asked for.
    pub window: Option<Duration>,
    /// Kernel receive stamps (`--kernel-stamps`).
    pub kernel_stamps: bool,
}

/// Parses and checks a target address: an IP literal with a port, loopback unless allowed.
pub fn parse_addr(addr: &str, allow_non_loopback: bool) -> Result<SocketAddr, String> {
    let sa: SocketAddr = addr.parse().map_err(|_| {
        format!("--addr {addr:?}: expected IP:PORT, e.g. 127.0.0.1:8080 or [::1]:8080 (names are not resolved)")
    })?;
    if sa.port() == 0 {
        return Err(format!("--addr {addr:?}: port 0 is not a target"));
    }
    let ip = sa.ip();
    if ip.is_unspecified() || ip.is_multicast() {
        return Err(format!("--addr {addr:?}: not a unicast address"));
    }
    if !ip.is_loopback() && !allow_non_loopback {
        return Err(format!(
            "--addr {addr:?}: only loopback targets (127.0.0.0/8, ::1) unless --allow-non-loopback"
        ));
    }
    Ok(sa)
}

fn check_seconds(flag: &str, v: f64, min: f64) -> Result<Duration, String> {
    if v.is_finite() && (min..=MAX_SECONDS).contains(&v) {
        Ok(Duration::from_secs_f64(v))
    } else {
        Err(format!("{flag} must be in {min}..={MAX_SECONDS}, got {v}"))
    }
}

fn parse_cpus(list: &str) -> Result<Vec<usize>, String> {
    let cpus: Vec<usize> = list
        .split(',')
        .map(|s| {
            s.trim()
                .parse::<usize>()
                .map_err(|_| format!("--cpu {list:?}: {s:?} is not a CPU index"))
        })
        .collect::<Result<_, _>>()?;
    if cpus.len() > MAX_THREADS {
        return Err(format!("--cpu: at most {MAX_THREADS} CPUs"));
    }
    if let Some(&c) = cpus
        .iter()
        .find(|&&c| c >= crate::affinity::MAX_CPU_INDEX_EXCLUSIVE)
    {
        return Err(format!(
            "--cpu {c}: CPU index must be below {}",
            crate::affinity::MAX_CPU_INDEX_EXCLUSIVE
        ));
    }
    Ok(cpus)
}

/// Validates arguments into a plan. Reads Zipf list files and the process's limits; opens no
/// socket.
pub(crate) fn plan(a: &LoadArgs) -> Result<Plan, String> {
    let addr = parse_addr(&a.addr, a.allow_non_loopback)?;
    let measure = check_seconds("--seconds", a.seconds, MIN_SECONDS)?;
    let warmup = check_seconds("--warmup-s", a.warmup_s, 0.0)?;
    if a.tenants.is_empty() {
        return Err("give at least one --tenant NAME:HOST:CONNS:MIX".into());
    }
    if a.tenants.len() > MAX_TENANTS {
        return Err(format!("at most {MAX_TENANTS} tenants"));
    }
    if a.requests > MAX_REQUESTS {
        return Err(format!("--requests must be at most {MAX_REQUESTS}"));
    }
    if a.requests_per_conn > MAX_REQUESTS {
        return Err(format!(
            "--requests-per-conn must be at most {MAX_REQUESTS}"
        ));
    }
    if !(MIN_TIMEOUT_MS..=MAX_TIMEOUT_MS).contains(&a.timeout_ms) {
        return Err(format!(
            "--timeout-ms must be in {MIN_TIMEOUT_MS}..={MAX_TIMEOUT_MS}, got {}",
            a.timeout_ms
        ));
    }
    if a.think_ms.is_some() && a.rate_per_s.is_some() {
        return Err("give --think-ms (closed loop) or --rate (open loop), not both".into());
    }
    let global = match (a.rate_per_s, a.think_ms) {
        (Some(rate), _) => Pacing::Open {
            rate_per_s: mix::check_rate(rate).map_err(|e| format!("--rate: {e}"))?,
        },
        (None, think) => Pacing::Closed {
            think_ms: mix::check_think(think.unwrap_or(0.0))
                .map_err(|e| format!("--think-ms: {e}"))?,
        },
    };
    let mut tenants: Vec<TenantPlan> = Vec::with_capacity(a.tenants.len());
    for spec in &a.tenants {
        let t = mix::parse_tenant(spec)?;
        if tenants.iter().any(|o| o.name == t.name) {
            return Err(format!(
                "--tenant {spec:?}: name {:?} is used twice",
                t.name
            ));
        }
        tenants.push(TenantPlan {
            name: t.name,
            host: t.host,
            connections: t.connections,
            mix: t.mix,
            mix_text: t.mix_text,
            pacing: t.pacing.unwrap_or(global),
            header: t.header,
        });
    }
    let total: usize = tenants.iter().map(|t| t.connections).sum();
    if total > MAX_CONNECTIONS_TOTAL {
        return Err(format!(
            "{total} connections in all; at most {MAX_CONNECTIONS_TOTAL}"
        ));
    }
    if a.threads == 0 || a.threads > MAX_THREADS {
        return Err(format!(
            "--threads must be in 1..={MAX_THREADS}, got {}",
            a.threads
        ));
    }
    if a.threads > total {
        return Err(format!(
            "--threads {} is more than the {total} connections to share among them",
            a.threads
        ));
    }
    if a.spin_us > MAX_SPIN_US {
        return Err(format!(
            "--spin-us must be in 0..={MAX_SPIN_US}, got {}",
            a.spin_us
        ));
    }
    let cpus = match &a.cpu {
        Some(list) => parse_cpus(list)?,
        None => Vec::new(),
    };
    check_machine_limits(total as u64)?;
    let window = check_window(a.window_ms, measure)?;
    check_window_memory(window, measure, tenants.len(), a.threads)?;
    Ok(Plan {
        addr,
        tenants,
        measure,
        warmup,
        requests: (a.requests > 0).then_some(a.requests),
        requests_per_conn: (a.requests_per_conn > 0).then_some(a.requests_per_conn),
        timeout: Duration::from_millis(a.timeout_ms),
        threads: a.threads,
        cpus,
        seed: a.seed,
        spin: Duration::from_micros(a.spin_us),
        window,
        kernel_stamps: a.kernel_stamps,
    })
}

/// Most windows in one run (each holds a latency histogram per tenant and thread).
pub const MAX_WINDOWS: u64 = 10_000;

/// `--window-ms`: 0 for none, else 10..=60000 ms and at most [`MAX_WINDOWS`] in the run.
fn check_window(window_ms: u64, measure: Duration) -> Result<Option<Duration>, String> {
    if window_ms == 0 {
        return Ok(None);
    }
    if !(10..=60_000).contains(&window_ms) {
        return Err(format!(
            "--window-ms must be 0 or in 10..=60000, got {window_ms}"
        ));
    }
    let n = measure.as_millis() as u64 / window_ms + 1;
    if n > MAX_WINDOWS {
        return Err(format!(
            "--window-ms {window_ms} cuts the run into {n} windows; at most {MAX_WINDOWS}"
        ));
    }
    Ok(Some(Duration::from_millis(window_ms)))
}

/// Most memory the windows' histograms may take (one per window, tenant and thread, and the
/// merged ones per tenant and for the total).
pub const WINDOW_MEMORY_MAX_BYTES: u64 = 1 << 30;

/// Refuses a run whose windows' histograms would take more than [`WINDOW_MEMORY_MAX_BYTES`].
fn check_window_memory(
    window: Option<Duration>,
    measure: Duration,
    tenants: usize,
    threads: usize,
) -> Result<(), String> {
    let Some(w) = window else { return Ok(()) };
    let windows = (measure.as_millis() / w.as_millis().max(1)) as u64 + 1;
    let histograms = windows * (tenants as u64 * (threads as u64 + 1) + 1);
    let bytes = histograms.saturating_mul(crate::stats::window_histogram_bytes());
    if bytes > WINDOW_MEMORY_MAX_BYTES {
        return Err(format!(
            "--window-ms {} over {:.0} s with {tenants} tenant(s) and {threads} thread(s) would hold {histograms} window \
             histograms, {} MiB; at most {} MiB: use longer windows, fewer tenants or threads",
            w.as_millis(),
            measure.as_secs_f64(),
            bytes >> 20,
            WINDOW_MEMORY_MAX_BYTES >> 20
        ));
    }
    Ok(())
}

/// Checks that the process may open `connections` sockets (soft `RLIMIT_NOFILE`) and that one
/// destination has enough ephemeral ports. Reads `/proc`; skips a check it cannot read.
fn check_machine_limits(connections: u64) -> Result<(), String> {
    if let Some(soft) = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|s| open_files_soft_limit(&s))
    {
        if connections + FD_SLACK > soft {
            return Err(format!(
                "{connections} connections need about {} file descriptors, but the limit is {soft}: raise it (ulimit -n) or use fewer connections",
                connections + FD_SLACK
            ));
        }
    }
    if let Some(ports) = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| port_range_size(&s))
    {
        if connections > ports {
            return Err(format!(
                "{connections} connections to one address need more than the {ports} local ports of net.ipv4.ip_local_port_range"
            ));
        }
    }
    Ok(())
}

/// The soft "Max open files" limit from `/proc/self/limits` text; `None` if unlimited or absent.
fn open_files_soft_limit(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Size of the ephemeral port range from `ip_local_port_range` text ("32768\t60999").
fn port_range_size(text: &str) -> Option<u64> {
    let mut it = text.split_whitespace().map(|s| s.parse::<u64>().ok());
    let (lo, hi) = (it.next()??, it.next()??);
    (hi >= lo).then(|| hi - lo + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert!(parse_addr("127.0.0.1:8080", false).is_ok());
        assert!(parse_addr("127.3.2.1:80", false).is_ok());
        assert!(parse_addr("[::1]:8080", false).is_ok());
        for (a, needle) in [
            ("localhost:8080", "names are not resolved"),
            ("example.com:80", "names are not resolved"),
            ("127.0.0.1", "expected IP:PORT"),
            ("127.0.0.1:0", "port 0"),
            ("0.0.0.0:80", "unicast"),
            ("10.0.0.1:80", "only loopback"),
            ("8.8.8.8:53", "only loopback"),
        ] {
            let e = parse_addr(a, false).unwrap_err();
            assert!(e.contains(needle), "{a}: {e}");
        }
        assert!(parse_addr("10.0.0.1:80", true).is_ok());
    }

    #[test]
    fn window_histograms_past_their_memory_bound_are_refused() {
        let hour = Duration::from_secs(3600);
        let w = Some(Duration::from_millis(500));
        // One tenant, one thread, 7,201 windows: ~0.4 GiB of histograms, allowed.
        assert!(check_window_memory(w, hour, 1, 1).is_ok());
        // Four tenants on two threads: 7,201 × 13 histograms, past 1 GiB.
        let e = check_window_memory(w, hour, 4, 2).unwrap_err();
        assert!(e.contains("at most 1024 MiB"), "{e}");
        assert!(check_window_memory(None, hour, 64, 32).is_ok());
    }

    #[test]
    fn a_latency_longer_than_a_minute_is_not_clipped() {
        let mut h = crate::stats::new_histogram();
        h.record(3_000_000_000).unwrap(); // 50 minutes, µs
        assert!(h.max() >= 2_990_000_000, "{}", h.max());
        let mut w = crate::stats::new_window_histogram();
        w.record(3_000_000_000).unwrap();
        assert!(w.max() >= 2_950_000_000, "{}", w.max());
    }

    #[test]
    fn proc_parsing() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1024                 524288               files\n";
        assert_eq!(open_files_soft_limit(limits), Some(1024));
        assert_eq!(
            open_files_soft_limit("Max open files  unlimited unlimited files\n"),
            None
        );
        assert_eq!(port_range_size("32768\t60999\n"), Some(28232));
        assert_eq!(port_range_size("garbage"), None);
    }
}
