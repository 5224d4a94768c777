//! Runs cut into windows: the server's own windows (sampled from the ledger every tick) and the
//! clients' (the load generator's `--window-ms`), and the questions the experiments ask of
//! them: when did every later window get under the target (settle), when did rejections stop.
//! Shared by overload-spike, classes, isolation and adversary so that every experiment cuts time, and
//! reads a window's edges, the same way: a window is named by its end, `end_s` seconds from the
//! start of the run, and covers `[end_s − dt, end_s)`.

use omnistage_load::report::Report as LoadReport;
use serde::Serialize;

/// What the questions below need of a window.
pub trait Windowed {
    /// Seconds from the start of the run to the end of the window.
    fn end_s(&self) -> f64;
    /// The window's p90 response time, ms (`None`: nothing completed).
    fn p90_ms(&self) -> Option<f64>;
    /// 503s / (completions + 503s) in the window.
    fn reject_fraction(&self) -> f64;
}

/// One window as the clients saw it (one tenant or class of the load generator).
#[derive(Serialize, Clone, Debug)]
pub struct ClientWindow {
    pub t_s: f64,
    /// The clients' p90 of the successes that completed in the window, ms.
    pub p90_ms: Option<f64>,
    /// The same successes' p99, ms.
    pub p99_ms: Option<f64>,
    pub completed: u64,
    pub rejected: u64,
    pub reject_fraction: f64,
}

impl Windowed for ClientWindow {
    fn end_s(&self) -> f64 {
        self.t_s
    }
    fn p90_ms(&self) -> Option<f64> {
        self.p90_ms
    }
    fn reject_fraction(&self) -> f64 {
        self.reject_fraction
    }
}

/// The clients' windows of every tenant of `r` together (a load run made with `--window-ms`),
/// placed `offset_s` after the start of the experiment's run (where the load's measured
/// window began). The p90 of several tenants together is not kept per window, so with more
/// than one tenant the largest tenant p90 stands for the window (an upper bound).
///
/// Every whole window of the measured window is here: the generator keeps a window only once
/// something arrives in it, so windows at the end in which nothing arrived (a stall) are
/// absent from its report; they come back as windows that completed nothing.
pub fn client_windows(r: &LoadReport, offset_s: f64) -> Vec<ClientWindow> {
    let Some(dt) = r.window_s.filter(|dt| *dt > 0.0) else {
        return Vec::new();
    };
    let whole = if r.seconds.is_finite() && r.seconds > 0.0 {
        (r.seconds / dt + 1e-9).floor() as usize
    } else {
        0
    };
    let kept = r.tenants.iter().map(|t| t.windows.len()).max().unwrap_or(0);
    // Whole windows only: a window the run's end cut short (`--seconds` not a multiple of the
    // window) holds a shorter stretch and would read as a whole one.
    let n = if whole > 0 { whole } else { kept };
    (0..n)
        .map(|i| {
            let ws: Vec<_> = r.tenants.iter().filter_map(|t| t.windows.get(i)).collect();
            let completed: u64 = ws.iter().map(|w| w.requests).sum();
            let rejected: u64 = ws.iter().map(|w| w.rejected_503).sum();
            ClientWindow {
                t_s: offset_s + (i as f64 + 1.0) * dt,
                p90_ms: ws.iter().filter_map(|w| w.p90_ms).reduce(f64::max),
                p99_ms: ws.iter().filter_map(|w| w.p99_ms).reduce(f64::max),
                completed,
                rejected,
                reject_fraction: rejected as f64 / (completed + rejected).max(1) as f64,
            }
        })
        .collect()
}

/// The windows whose middle lies in `(from, to)`.
fn inside<W: Windowed>(windows: &[W], dt: f64, from: f64, to: f64) -> impl Iterator<Item = &W> {
    windows.iter().filter(move |w| {
        let mid = w.end_s() - dt / 2.0;
        mid > from && mid < to
    })
}

/// Seconds after `from` until the start of the first window in `(from, to)` from which every
/// later window completed something with p90 ≤ `target_ms` (`None`: the last one is over, or
/// completed nothing). A window in which nothing completed is a stall, not a window under the
/// target: its p90 is not 0.
pub fn settle<W: Windowed>(
    windows: &[W],
    dt: f64,
    from: f64,
    to: f64,
    target_ms: f64,
) -> Option<f64> {
    let in_range: Vec<&W> = inside(windows, dt, from, to).collect();
    let mut settle_at = None;
    for w in in_range.iter().rev() {
        match w.p90_ms() {
            Some(p) if p <= target_ms => settle_at = Some(w.end_s() - dt),
            _ => break,
        }
    }
    settle_at.map(|t| (t - from).max(0.0))
}

/// [`settle`] with the windows that `disturbed` names left out when they are over the target
/// (or completed nothing): what the run shows once the stretches the machine took away from it
/// are set aside. Not a verdict on its own: a caller reports it beside the strict figure, as the
/// reason a miss was not judged, never as a pass. A disturbed window under the target still
/// counts as under it.
pub fn settle_skipping<W: Windowed>(
    windows: &[W],
    dt: f64,
    from: f64,
    to: f64,
    target_ms: f64,
    disturbed: impl Fn(&W) -> bool,
) -> Option<f64> {
    let in_range: Vec<&W> = inside(windows, dt, from, to).collect();
    let mut settle_at = None;
    for w in in_range.iter().rev() {
        match w.p90_ms() {
            Some(p) if p <= target_ms => settle_at = Some(w.end_s() - dt),
            _ if disturbed(w) => {}
            _ => break,
        }
    }
    settle_at.map(|t| (t - from).max(0.0))
}

/// Seconds after `from` until the start of the first window in `(from, to)` from which every
/// later window rejects under 1 %.
pub fn rejects_stop<W: Windowed>(windows: &[W], dt: f64, from: f64, to: f64) -> Option<f64> {
    let in_range: Vec<&W> = inside(windows, dt, from, to).collect();
    let mut at = None;
    for w in in_range.iter().rev() {
        if w.reject_fraction() > 0.01 {
            break;
        }
        at = Some((w.end_s() - dt - from).max(0.0));
    }
    at
}

/// The largest p99 of any window with completions (`None`: none had any).
pub fn p99_max_ms(windows: &[ClientWindow]) -> Option<f64> {
    windows.iter().filter_map(|w| w.p99_ms).reduce(f64::max)
}

/// Completions and rejections of the windows in `(from, to)`: (completed, rejected).
pub fn totals(windows: &[ClientWindow], dt: f64, from: f64, to: f64) -> (u64, u64) {
    inside(windows, dt, from, to).fold((0, 0), |a, w| (a.0 + w.completed, a.1 + w.rejected))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(t_s: f64, p90: Option<f64>, rej: f64) -> ClientWindow {
        ClientWindow {
            t_s,
            p90_ms: p90,
            p99_ms: p90.map(|p| 2.0 * p),
            completed: 10,
            rejected: (rej * 10.0) as u64,
            reject_fraction: rej,
        }
    }

    #[test]
    fn settle_is_the_start_of_the_last_run_under_target() {
        let ws = vec![
            w(1.0, Some(5.0), 0.0),
            w(2.0, Some(50.0), 0.5),
            w(3.0, Some(5.0), 0.2),
            w(4.0, None, 0.0),
            w(5.0, Some(9.0), 0.0),
        ];
        // From 0: window 4 completed nothing (a stall, not a window under the target), so
        // settling starts with window 5 (at 4 s).
        assert_eq!(settle(&ws, 1.0, 0.0, 10.0, 10.0), Some(4.0));
        // Up to window 3: window 2 is over 10 ms, so settling starts with window 3 (at 2 s).
        assert_eq!(settle(&ws, 1.0, 0.0, 3.0, 10.0), Some(2.0));
        // A last window over the target: never settled.
        assert_eq!(settle(&ws, 1.0, 0.0, 10.0, 8.0), None);
        // Rejections stop from window 4 (starting at 3 s).
        assert_eq!(rejects_stop(&ws, 1.0, 0.0, 10.0), Some(3.0));
        assert_eq!(totals(&ws, 1.0, 1.0, 3.0), (20, 7));
        assert_eq!(p99_max_ms(&ws), Some(100.0));
        assert_eq!(p99_max_ms(&ws[3..4]), None);
    }

    #[test]
    fn settling_skips_only_disturbed_windows_over_the_target() {
        let ws = vec![
            w(1.0, Some(5.0), 0.0),
            w(2.0, Some(50.0), 0.0),
            w(3.0, Some(5.0), 0.0),
            w(4.0, Some(30.0), 0.0),
            w(5.0, Some(5.0), 0.0),
        ];
        // Strictly, window 4 is over 10 ms: settled from window 5 (at 4 s).
        assert_eq!(settle(&ws, 1.0, 0.0, 10.0, 10.0), Some(4.0));
        // Window 4 disturbed: settled from window 3 (at 2 s); window 2, over and undisturbed,
        // still stops the walk.
        let at4 = |x: &ClientWindow| (x.t_s - 4.0).abs() < 1e-9;
        assert_eq!(settle_skipping(&ws, 1.0, 0.0, 10.0, 10.0, at4), Some(2.0));
        // Nothing disturbed: the strict figure.
        assert_eq!(
            settle_skipping(&ws, 1.0, 0.0, 10.0, 10.0, |_| false),
            Some(4.0)
        );
        // A disturbed window at the end over the target, after one under it: settled from the
        // window under it; every window disturbed and over: never.
        let last = |x: &ClientWindow| (x.t_s - 5.0).abs() < 1e-9;
        assert_eq!(settle_skipping(&ws, 1.0, 0.0, 10.0, 4.0, last), None);
        assert_eq!(
            settle_skipping(&ws[..2], 1.0, 0.0, 10.0, 1.0, |_| true),
            None
        );
    }

    #[test]
    fn a_stall_at_the_end_is_not_settled() {
        let ws = vec![
            w(1.0, Some(5.0), 0.0),
            w(2.0, Some(50.0), 0.0),
            w(3.0, None, 0.0),
        ];
        assert_eq!(settle(&ws, 1.0, 0.0, 3.0, 10.0), None);
    }

    /// Three windows of 10 successes each, p90 5 ms.
    fn three_windows() -> Vec<omnistage_load::WindowReport> {
        (0..3)
            .map(|index| omnistage_load::WindowReport {
                index,
                requests: 10,
                rejected_503: 0,
                received_bytes: 100,
                p50_ms: Some(1.0),
                p90_ms: Some(5.0),
                p99_ms: Some(9.0),
            })
            .collect()
    }

    #[test]
    fn the_clients_windows_run_to_the_end_of_the_measured_window() {
        // The generator keeps no window in which nothing arrived at all: the last two of five
        // (a stall) are absent from its report, and come back here as empty windows.
        let mut t = crate::harness::tenant_for_test("a");
        t.windows = three_windows();
        let mut r = crate::harness::report_for_test(vec![t.clone()], t, 5.0);
        r.window_s = Some(1.0);
        let ws = client_windows(&r, 10.0);
        assert_eq!(ws.len(), 5);
        assert_eq!(ws[4].t_s, 15.0);
        assert_eq!((ws[4].completed, ws[4].p90_ms), (0, None));
        // So the stall is not read as settled.
        assert_eq!(settle(&ws, 1.0, 10.0, 15.0, 10.0), None);
        assert_eq!(settle(&ws, 1.0, 10.0, 13.0, 10.0), Some(0.0));
    }

    #[test]
    fn a_window_the_end_of_the_run_cut_short_is_left_out() {
        // 2.5 s in 1 s windows: the generator kept a third window of 0.5 s.
        let mut t = crate::harness::tenant_for_test("a");
        t.windows = three_windows();
        let mut r = crate::harness::report_for_test(vec![t.clone()], t, 2.5);
        r.window_s = Some(1.0);
        let ws = client_windows(&r, 0.0);
        assert_eq!(ws.len(), 2);
        assert_eq!(ws[1].t_s, 2.0);
    }
}
