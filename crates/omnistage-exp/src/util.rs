//! Helpers shared by experiments: fixed CPU work, water-filling targets, machine description.

use std::hint::black_box;
use std::time::Instant;

/// Spins `iters` rounds of a xorshift: the same fixed work every time, independent of clocks.
#[inline(never)]
pub fn burn(iters: u64) -> u64 {
    let mut x = black_box(0x2545_F491_4F6C_DD1Du64);
    for _ in 0..iters {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    black_box(x)
}

/// Iterations of [`burn`] per microsecond on this machine (median of 5 short runs).
pub fn burn_iters_per_us() -> f64 {
    let mut v: Vec<f64> = (0..5)
        .map(|_| {
            let n = 2_000_000;
            let t = Instant::now();
            burn(n);
            n as f64 / t.elapsed().as_secs_f64() / 1e6
        })
        .collect();
    v.sort_by(|a, b| a.total_cmp(b));
    v[2]
}

/// Max-min weighted fair shares of `cores` identical CPUs among activities that may each run
/// only on some cores (`allowed[i]` a bit mask), all with unbounded demand: progressive filling,
/// where an activity is frozen when some set of cores S that holds all its allowed cores
/// is saturated by the activities confined to S. Returns fractions of the whole machine.
pub fn water_fill(weights: &[f64], allowed: &[u64], cores: usize) -> Vec<f64> {
    assert_eq!(weights.len(), allowed.len());
    assert!(cores <= 16, "subset enumeration is exponential in cores");
    let n = weights.len();
    let mut alloc = vec![0.0; n];
    let mut frozen = vec![false; n];
    let full: u64 = (1u64 << cores) - 1;
    // At most n rounds: each freezes at least one activity.
    for _ in 0..n {
        if frozen.iter().all(|&f| f) {
            break;
        }
        // Largest uniform raise t of (alloc_i = w_i * level) before some subset saturates.
        let mut best: Option<(f64, u64)> = None;
        for s in 1..=full {
            let inside: Vec<usize> = (0..n).filter(|&i| allowed[i] & !s == 0).collect();
            let w_free: f64 = inside
                .iter()
                .filter(|&&i| !frozen[i])
                .map(|&i| weights[i])
                .sum();
            if w_free == 0.0 {
                continue;
            }
            let used: f64 = inside
                .iter()
                .filter(|&&i| frozen[i])
                .map(|&i| alloc[i])
                .sum();
            let cap = s.count_ones() as f64 - used;
            let level = cap / w_free;
            if best.is_none_or(|(l, _)| level < l - 1e-12) {
                best = Some((level, s));
            }
        }
        let (level, s) = best.expect("some unfrozen activity");
        for i in 0..n {
            if !frozen[i] {
                alloc[i] = weights[i] * level;
            }
        }
        for i in 0..n {
            if !frozen[i] && allowed[i] & !s == 0 {
                frozen[i] = true;
            }
        }
    }
    alloc.iter().map(|a| a / cores as f64).collect()
}

/// CPU time (user + system) of a process, ns, from /proc/PID/stat.
pub fn process_cpu_ns(pid: u32) -> Option<u64> {
    process_cpu_ns_at(&format!("/proc/{pid}/stat"))
}

/// utime + stime of a `stat` file of /proc, ns.
fn process_cpu_ns_at(path: &str) -> Option<u64> {
    let s = std::fs::read_to_string(path).ok()?;
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf(3) reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Some(ticks * 1_000_000_000 / hz)
}

/// CPU time (user + system, from /proc/self/task/TID/stat) of this process's threads whose
/// name starts with `prefix`, ns: the same clock as [`process_cpu_ns`], for a server run inside
/// the experiment's process beside its load generator.
pub fn threads_cpu_ns(prefix: &str) -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("comm"))
                .is_ok_and(|c| c.trim().starts_with(prefix))
        })
        .filter_map(|e| {
            let tid: u32 = e.file_name().to_str()?.parse().ok()?;
            process_cpu_ns_at(&format!("/proc/self/task/{tid}/stat"))
        })
        .sum()
}

/// The length of one clock tick (`sysconf(_SC_CLK_TCK)`), in which /proc/stat counts steal.
pub fn steal_tick_ns() -> u64 {
    // SAFETY: sysconf reads a constant of the C library; no memory is passed.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    1_000_000_000 / u64::try_from(hz).ok().filter(|&h| h > 0).unwrap_or(100)
}

/// Hypervisor steal of every CPU together so far, ns: /proc/stat's first line, the kernel's own
/// sum over the CPUs (offline ones included), in clock ticks (`None`: not readable).
pub fn machine_steal_ns() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    steal_ticks_of_all(&text).map(|t| t.saturating_mul(steal_tick_ns()))
}

/// The steal field (the eighth number) of /proc/stat's all-CPU line.
fn steal_ticks_of_all(stat: &str) -> Option<u64> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    line.split_ascii_whitespace().nth(8)?.parse().ok()
}

/// One line naming the machine: CPU model, CPUs, memory, kernel.
pub fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "unknown CPU".into());
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|k| k.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0 / 1024.0)
        .unwrap_or(0.0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "{model}, {cpus} CPUs, {mem_gib:.0} GiB, Linux {}",
        kernel.trim()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steal_of_all_cpus_is_the_first_lines_eighth_number() {
        let stat = "cpu  10 0 5 100 0 0 0 9 0 0\ncpu0 5 0 2 50 0 0 0 3 0 0\n";
        assert_eq!(steal_ticks_of_all(stat), Some(9));
        assert_eq!(steal_ticks_of_all("cpu0 1 2 3 4 5 6 7 8\n"), None);
        assert_eq!(steal_ticks_of_all("cpu  1 2\n"), None);
    }

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-9)
    }

    #[test]
    fn water_fill_unconstrained_is_weight_proportional() {
        let s = water_fill(&[50.0, 33.0, 17.0], &[0b11, 0b11, 0b11], 2);
        assert!(close(&s, &[0.5, 0.33, 0.17]), "{s:?}");
    }

    #[test]
    fn water_fill_confined_activity_caps_at_its_cores() {
        // A on core 0 only, B on both, equal weights: each gets one core.
        let s = water_fill(&[1.0, 1.0], &[0b01, 0b11], 2);
        assert!(close(&s, &[0.5, 0.5]), "{s:?}");
        // A weighs 3: it still cannot have more than core 0; B gets core 1.
        let s = water_fill(&[3.0, 1.0], &[0b01, 0b11], 2);
        assert!(close(&s, &[0.5, 0.5]), "{s:?}");
        // Two activities confined to core 0 share it; C alone gets core 1.
        let s = water_fill(&[1.0, 1.0, 1.0], &[0b01, 0b01, 0b11], 2);
        assert!(close(&s, &[0.25, 0.25, 0.5]), "{s:?}");
    }
}
