//! Shared set-up of the shaping, overload-spike and connections experiments: the server from a
//! TOML fragment (tenants with caps or admission targets that [`super::harness::start`] does not
//! set), one pinned worker on CPU 0, synthetic endpoints on; and small helpers (ledger bytes of
//! one activity, resident memory of a process, a linear fit).

use omnistage::account::Snapshot;
use omnistage_http::config::parse_config;
use omnistage_http::server::{Server, ServerOptions};

/// Starts the server (one worker pinned to CPU 0, `127.0.0.1:0`) with `server_extra` lines in
/// `[server]` and `tenants` the `[[tenant]]` tables (each should set `synthetic = true` if it
/// needs `/_burn` or `/_bytes`). Returns the server and its address.
pub fn start(server_extra: &str, tenants: &str) -> Result<(Server, String), String> {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    if cpus < 2 {
        return Err("needs 2 CPUs: one for the server, one for the load".into());
    }
    let toml =
        format!("[server]\nlisten = [\"127.0.0.1:0\"]\nworkers = 1\n{server_extra}\n{tenants}");
    let config = parse_config(&toml).map_err(|e| e.to_string())?;
    let server = Server::start(
        config,
        ServerOptions {
            pin: true,
            workers: Some(1),
            bypass: false,
        },
    )?;
    let addr = server.local_addrs()[0].to_string();
    Ok((server, addr))
}

/// Bytes sent for one activity (own records, all stages and cores) in a snapshot.
pub fn bytes_out(s: &Snapshot, activity: u32) -> u64 {
    s.rows
        .iter()
        .filter(|r| r.activity == activity)
        .map(|r| r.bytes_out)
        .sum()
}

/// `VmRSS` of a process (`"self"` or a pid) in KiB, from `/proc/PID/status`.
pub fn rss_kib(pid: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Least-squares line `y = a + b x` over the points: `(a, b, r2)`. R² is 1 − SSres/SStot (0 when
/// the y values do not vary or there are fewer than two points).
pub fn linear_fit(pts: &[(f64, f64)]) -> (f64, f64, f64) {
    let n = pts.len() as f64;
    if pts.len() < 2 {
        return (0.0, 0.0, 0.0);
    }
    let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
    let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let syy: f64 = pts.iter().map(|p| (p.1 - my).powi(2)).sum();
    if sxx == 0.0 || syy == 0.0 {
        return (my, 0.0, 0.0);
    }
    let b = sxy / sxx;
    let a = my - b * mx;
    let ss_res: f64 = pts.iter().map(|p| (p.1 - a - b * p.0).powi(2)).sum();
    (a, b, 1.0 - ss_res / syy)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_of_a_line_is_exact() {
        let (a, b, r2) = linear_fit(&[(1.0, 3.0), (2.0, 5.0), (4.0, 9.0)]);
        assert!((a - 1.0).abs() < 1e-9 && (b - 2.0).abs() < 1e-9 && (r2 - 1.0).abs() < 1e-12);
        let (_, _, r2) = linear_fit(&[(1.0, 1.0), (2.0, 3.0), (3.0, 2.0)]);
        assert!(r2 < 0.5);
        assert_eq!(linear_fit(&[(1.0, 1.0)]).2, 0.0);
    }

    #[test]
    fn own_rss_is_read() {
        assert!(rss_kib("self").unwrap() > 0);
    }
}
