//! Measurement: what each generator thread records per tenant, and how threads' records merge.
//!
//! Owns the latency histogram (HdrHistogram, microseconds, [`LATENCY_LOWEST_US`] to
//! [`LATENCY_HIGHEST_US`], longer than any run can measure, [`LATENCY_SIGNIFICANT_DIGITS`]
//! significant digits; each `--window-ms` window's with [`WINDOW_LATENCY_SIGNIFICANT_DIGITS`]),
//! the counters (responses, body bytes, errors by kind) and the
//! per-connection completion counts that Jain's fairness index is computed from. Only events in
//! the measurement window (after the warmup) are recorded.

use hdrhistogram::Histogram;
use serde::Serialize;

/// Lowest latency the histogram tells apart: 1 µs.
pub const LATENCY_LOWEST_US: u64 = 1;
/// Highest latency the histogram records: 10,000 s, above the longest latency a run can
/// measure (its warmup and its measured window, 3,600 s each at most, plus the 300 s longest
/// timeout), so no latency is clipped. (It was 60 s: an open-loop run falling behind for minutes
/// read 60 s at its p99 and max.)
pub const LATENCY_HIGHEST_US: u64 = 10_000_000_000;
/// Significant decimal digits kept by the histogram.
pub const LATENCY_SIGNIFICANT_DIGITS: u8 = 3;
/// Significant digits of each window's histogram (1 % resolution): a run may hold
/// [`crate::args::MAX_WINDOWS`] windows per tenant and thread, and three digits cost ~190 KiB
/// a window against ~27 KiB.
pub const WINDOW_LATENCY_SIGNIFICANT_DIGITS: u8 = 2;

/// Failed or unsuccessful exchanges, by kind. Each request that was sent ends as exactly one of:
/// a successful response (2xx or 304), or one of `reset`, `timeout`, `rejected_503`, `http_4xx`,
/// `http_5xx`, `http_other`, `parse`. `connect` counts failed connection attempts, which use up no
/// request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ErrorCounts {
    /// Connection attempts that failed (refused, unreachable, or not established within the
    /// timeout). The client retries with backoff.
    pub connect: u64,
    /// The connection was reset or closed by the server before the response was complete.
    pub reset: u64,
    /// No complete response within the timeout after the request was sent.
    pub timeout: u64,
    /// 503 responses (admission control said no).
    pub rejected_503: u64,
    /// Other 4xx responses.
    pub http_4xx: u64,
    /// 5xx responses other than 503.
    pub http_5xx: u64,
    /// Other unsuccessful statuses: 3xx other than 304, and anything outside 200..=599.
    pub http_other: u64,
    /// Malformed or over-limit responses.
    pub parse: u64,
    /// Bytes the server sent while no request was outstanding (a 408 before closing an idle
    /// connection, say): the connection is dropped and reopened, but no request failed, so
    /// this is not in [`ErrorCounts::failed_requests`].
    pub unsolicited: u64,
}

impl ErrorCounts {
    fn add(&mut self, o: &ErrorCounts) {
        self.connect += o.connect;
        self.reset += o.reset;
        self.timeout += o.timeout;
        self.rejected_503 += o.rejected_503;
        self.http_4xx += o.http_4xx;
        self.http_5xx += o.http_5xx;
        self.http_other += o.http_other;
        self.parse += o.parse;
        self.unsolicited += o.unsolicited;
    }

    /// Requests that ended without a successful response (everything but `connect`).
    pub fn failed_requests(&self) -> u64 {
        self.reset
            + self.timeout
            + self.rejected_503
            + self.http_4xx
            + self.http_5xx
            + self.http_other
            + self.parse
    }
}

/// Where a completed exchange falls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    Rejected503,
    Http4xx,
    Http5xx,
    HttpOther,
}

/// Classifies a final status code.
pub fn classify(status: u16) -> Outcome {
    match status {
        200..=299 | 304 => Outcome::Ok,
        503 => Outcome::Rejected503,
        400..=499 => Outcome::Http4xx,
        500..=599 => Outcome::Http5xx,
        _ => Outcome::HttpOther,
    }
}

/// A new latency histogram with the crate's bounds.
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(
        LATENCY_LOWEST_US,
        LATENCY_HIGHEST_US,
        LATENCY_SIGNIFICANT_DIGITS,
    )
    .expect("histogram bounds are valid constants")
}

/// An empty histogram of one window (coarser than [`new_histogram`], same bounds).
pub fn new_window_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(
        LATENCY_LOWEST_US,
        LATENCY_HIGHEST_US,
        WINDOW_LATENCY_SIGNIFICANT_DIGITS,
    )
    .expect("histogram bounds are valid constants")
}

/// Bytes one window's histogram holds (its counts).
pub fn window_histogram_bytes() -> u64 {
    (new_window_histogram().distinct_values() * std::mem::size_of::<u64>()) as u64
}

/// What one thread (or, merged, the whole run) recorded for one tenant.
#[derive(Debug, Clone)]
pub struct TenantStats {
    /// Latency of successful responses, µs from the intended send time.
    pub latency_us: Histogram<u64>,
    /// With `--kernel-stamps`: µs from each successful request's actual send to the kernel's
    /// receipt of its response (empty otherwise).
    pub kernel_latency_us: Histogram<u64>,
    /// Successful responses (2xx, 304).
    pub ok: u64,
    /// Complete responses of any status.
    pub responses: u64,
    /// Body bytes of successful responses (counted when a response completes).
    pub body_bytes: u64,
    /// Bytes read from the tenant's sockets during the measured window (heads and bodies of
    /// any status), counted as they arrive: unlike `body_bytes`, a response that spans the
    /// window's edges counts only its bytes inside it.
    pub received_bytes: u64,
    pub errors: ErrorCounts,
    /// Responses that carried `Retry-After`.
    pub retry_after: u64,
    /// New connections opened after the first one of each connection slot.
    pub reconnects: u64,
    /// Keep-alive connections that the server closed or reset while no request was outstanding.
    pub idle_closes: u64,
    /// Requests in flight, or due but not yet sent, when the run ended.
    pub unfinished: u64,
    /// How long the oldest of `unfinished` had waited at the deadline, µs from its intended
    /// send time (0 when none): a lower bound of a latency that `latency_us` does not hold.
    pub unfinished_oldest_us: u64,
    /// Successful responses per connection slot (index = slot within the tenant).
    pub ok_per_connection: Vec<u64>,
    /// Per window of `--window-ms` (index = window from the start of the measured window);
    /// empty without windows. Grows as windows are reached.
    pub windows: Vec<WindowStats>,
}

/// One window's figures for one tenant.
#[derive(Debug, Clone)]
pub struct WindowStats {
    /// Latency of successful responses that completed in the window, µs.
    pub latency_us: Histogram<u64>,
    pub ok: u64,
    pub rejected_503: u64,
    /// Bytes read in the window, counted as they arrive (see [`TenantStats::received_bytes`]).
    pub received_bytes: u64,
}

impl WindowStats {
    pub fn new() -> Self {
        WindowStats {
            latency_us: new_window_histogram(),
            ok: 0,
            received_bytes: 0,
            rejected_503: 0,
        }
    }
}

impl Default for WindowStats {
    fn default() -> Self {
        Self::new()
    }
}

impl TenantStats {
    /// Empty stats for a tenant with `connections` slots.
    pub fn new(connections: usize) -> Self {
        TenantStats {
            latency_us: new_histogram(),
            kernel_latency_us: new_histogram(),
            ok: 0,
            responses: 0,
            body_bytes: 0,
            received_bytes: 0,
            errors: ErrorCounts::default(),
            retry_after: 0,
            reconnects: 0,
            idle_closes: 0,
            unfinished: 0,
            unfinished_oldest_us: 0,
            ok_per_connection: vec![0; connections],
            windows: Vec::new(),
        }
    }

    /// Adds another thread's stats for the same tenant (same connection slots).
    pub fn merge(&mut self, o: &TenantStats) {
        self.add_counts(o);
        for (a, b) in self.ok_per_connection.iter_mut().zip(&o.ok_per_connection) {
            *a += b;
        }
    }

    /// Adds another tenant's stats, keeping its connections as further slots (for totals).
    pub fn append(&mut self, o: &TenantStats) {
        self.add_counts(o);
        self.ok_per_connection
            .extend_from_slice(&o.ok_per_connection);
    }

    fn add_counts(&mut self, o: &TenantStats) {
        self.latency_us
            .add(&o.latency_us)
            .expect("histograms share bounds");
        self.kernel_latency_us
            .add(&o.kernel_latency_us)
            .expect("histograms share bounds");
        self.ok += o.ok;
        self.responses += o.responses;
        self.body_bytes += o.body_bytes;
        self.received_bytes += o.received_bytes;
        self.errors.add(&o.errors);
        self.retry_after += o.retry_after;
        self.reconnects += o.reconnects;
        self.idle_closes += o.idle_closes;
        self.unfinished += o.unfinished;
        self.unfinished_oldest_us = self.unfinished_oldest_us.max(o.unfinished_oldest_us);
        if self.windows.len() < o.windows.len() {
            self.windows.resize_with(o.windows.len(), WindowStats::new);
        }
        for (a, b) in self.windows.iter_mut().zip(&o.windows) {
            a.latency_us
                .add(&b.latency_us)
                .expect("histograms share bounds");
            a.ok += b.ok;
            a.rejected_503 += b.rejected_503;
            a.received_bytes += b.received_bytes;
        }
    }

    /// The window of `index` (grown to it; the caller bounds `index` by the run's windows).
    pub fn window(&mut self, index: usize) -> &mut WindowStats {
        if self.windows.len() <= index {
            self.windows.resize_with(index + 1, WindowStats::new);
        }
        &mut self.windows[index]
    }
}

/// Jain's fairness index of `xs`: (Σx)² / (n·Σx²). 1.0 when all are equal, 1/n when one has
/// everything. `None` when there is nothing to judge (no values, or all zero).
pub fn jain_index(xs: &[u64]) -> Option<f64> {
    let n = xs.len() as f64;
    let sum: f64 = xs.iter().map(|&x| x as f64).sum();
    let sum_sq: f64 = xs.iter().map(|&x| (x as f64) * (x as f64)).sum();
    if xs.is_empty() || sum_sq == 0.0 {
        None
    } else {
        Some(sum * sum / (n * sum_sq))
    }
}

/// Successful responses per client (connection slot) over the whole run, summarised: what SEDA
/// calls fairness across clients (Jain's index over each client's completed requests, every
/// slot counted, including those that completed none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ClientCounts {
    /// Client slots (all tenants).
    pub clients: usize,
    /// Jain's index over the slots' successful responses; `None` when none succeeded.
    pub jain: Option<f64>,
    /// Fewest successful responses of a slot.
    pub requests_min: u64,
    /// Median successful responses of a slot (lower middle for an even count).
    pub requests_median: u64,
    /// Most successful responses of a slot.
    pub requests_max: u64,
    /// Slots with no successful response in the measured window.
    pub starved: usize,
}

/// Summarises per-slot successful responses (sorts a copy; called once per report).
pub fn client_counts(per_slot: &[u64]) -> ClientCounts {
    let mut sorted = per_slot.to_vec();
    sorted.sort_unstable();
    let n = sorted.len();
    ClientCounts {
        clients: n,
        jain: jain_index(per_slot),
        requests_min: sorted.first().copied().unwrap_or(0),
        requests_median: if n == 0 { 0 } else { sorted[(n - 1) / 2] },
        requests_max: sorted.last().copied().unwrap_or(0),
        starved: sorted.iter().take_while(|&&x| x == 0).count(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jain_equal_is_one() {
        assert_eq!(jain_index(&[5, 5, 5, 5]), Some(1.0));
        assert_eq!(jain_index(&[7]), Some(1.0));
    }

    #[test]
    fn jain_one_of_n() {
        for n in 1..=10usize {
            let mut xs = vec![0u64; n];
            xs[n - 1] = 42;
            let j = jain_index(&xs).unwrap();
            assert!((j - 1.0 / n as f64).abs() < 1e-12, "n={n}: {j}");
        }
    }

    #[test]
    fn jain_between_and_undefined() {
        let j = jain_index(&[1, 3]).unwrap();
        assert!((j - 16.0 / 20.0).abs() < 1e-12);
        assert_eq!(jain_index(&[]), None);
        assert_eq!(jain_index(&[0, 0]), None);
    }

    #[test]
    fn client_counts_summarise_every_slot() {
        let c = client_counts(&[4, 0, 2, 4, 0]);
        assert_eq!(c.clients, 5);
        assert_eq!(
            (c.requests_min, c.requests_median, c.requests_max, c.starved),
            (0, 2, 4, 2)
        );
        // (Σx)² / (n Σx²) = 100 / (5 · 36).
        assert!((c.jain.unwrap() - 100.0 / 180.0).abs() < 1e-12);
        let even = client_counts(&[1, 2, 3, 4]);
        assert_eq!(even.requests_median, 2);
        assert_eq!(client_counts(&[3, 3, 3]).jain, Some(1.0));
        let empty = client_counts(&[]);
        assert_eq!((empty.clients, empty.jain, empty.starved), (0, None, 0));
        assert_eq!(client_counts(&[0, 0]).jain, None);
    }

    #[test]
    fn classes() {
        assert_eq!(classify(200), Outcome::Ok);
        assert_eq!(classify(206), Outcome::Ok);
        assert_eq!(classify(304), Outcome::Ok);
        assert_eq!(classify(301), Outcome::HttpOther);
        assert_eq!(classify(503), Outcome::Rejected503);
        assert_eq!(classify(429), Outcome::Http4xx);
        assert_eq!(classify(500), Outcome::Http5xx);
        assert_eq!(classify(600), Outcome::HttpOther);
    }

    #[test]
    fn merge_adds() {
        let mut a = TenantStats::new(2);
        let mut b = TenantStats::new(2);
        a.ok = 1;
        a.ok_per_connection[0] = 1;
        a.latency_us.record(100).unwrap();
        b.ok = 2;
        b.ok_per_connection[1] = 2;
        b.errors.timeout = 3;
        b.latency_us.saturating_record(LATENCY_HIGHEST_US * 10);
        a.merge(&b);
        assert_eq!(a.ok, 3);
        assert_eq!(a.ok_per_connection, vec![1, 2]);
        assert_eq!(a.errors.timeout, 3);
        assert_eq!(a.latency_us.len(), 2);
        assert!(a.latency_us.max() >= LATENCY_HIGHEST_US);
    }
}
