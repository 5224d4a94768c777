//! Thin wrappers over the OS calls the workers and their helper threads need: CPU pinning and
//! confinement, a thread's nice value, and the OS's own clocks of a thread (CPU time, run-queue
//! wait, its CPU's steal), which the ledger uses as an independent check.

use std::fs::File;
use std::os::unix::fs::FileExt;

/// CPUs this process may run on.
pub(crate) fn cpu_count() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Pins the calling thread to `cpu`. Failure (a restricted cpuset) is reported, not fatal.
pub(crate) fn pin_to(cpu: usize) -> std::io::Result<()> {
    confine_to(&[cpu])
}

/// Confines the calling thread to the CPUs in `cpus` (at least one).
pub(crate) fn confine_to(cpus: &[usize]) -> std::io::Result<()> {
    if cpus.is_empty() || cpus.iter().any(|&c| c >= libc::CPU_SETSIZE as usize) {
        return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: `cpu_set_t` is a plain bit array for which all-zero is valid; CPU_SET writes
    // within it for cpu < CPU_SETSIZE (checked above), and sched_setaffinity reads exactly
    // `size_of::<cpu_set_t>()` bytes from the pointer we pass.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &cpu in cpus {
            libc::CPU_SET(cpu, &mut set);
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Sets the calling thread's nice value (Linux keeps one per thread).
pub(crate) fn set_thread_nice(nice: i32) -> std::io::Result<()> {
    // SAFETY: gettid(2) takes nothing and cannot fail; setpriority(2) only reads its
    // integer arguments. On Linux PRIO_PROCESS with a thread id sets that thread alone.
    let rc = unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// CPU time of the calling thread as the OS counts it (CLOCK_THREAD_CPUTIME_ID), ns. On a
/// paravirtualised guest this excludes steal (time the hypervisor ran something else).
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant the kernel knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The calling thread's `/proc/thread-self/schedstat`, kept open and re-read in place.
pub(crate) struct SchedStat {
    file: Option<File>,
    buf: [u8; 128],
}

impl SchedStat {
    pub(crate) fn open() -> Self {
        SchedStat {
            file: File::open("/proc/thread-self/schedstat").ok(),
            buf: [0; 128],
        }
    }

    /// (ns on a CPU, ns runnable and waiting for a CPU), or `None` where unavailable.
    pub(crate) fn read(&mut self) -> Option<(u64, u64)> {
        let f = self.file.as_ref()?;
        let n = f.read_at(&mut self.buf, 0).ok()?;
        let s = std::str::from_utf8(&self.buf[..n]).ok()?;
        let mut it = s.split_ascii_whitespace();
        let run = it.next()?.parse().ok()?;
        let wait = it.next()?.parse().ok()?;
        Some((run, wait))
    }
}

/// The steal field (clock ticks) of `cpuN` in /proc/stat's text.
fn steal_ticks_of(stat: &str, cpu: usize) -> Option<u64> {
    let label = format!("cpu{cpu} ");
    let line = stat.lines().find(|l| l.starts_with(&label))?;
    // cpuN user nice system idle iowait irq softirq steal ...
    line.split_ascii_whitespace().nth(8)?.parse().ok()
}

/// Hypervisor steal time of `cpu` so far, ns (one read of /proc/stat; `None` where the kernel
/// does not say): for a caller outside the workers, such as an experiment judging whether the
/// hypervisor disturbed a measurement.
pub fn cpu_steal_ns(cpu: usize) -> Option<u64> {
    CpuSteal::open(cpu).read()
}

/// Hypervisor steal time of one CPU from `/proc/stat`: time the CPU was taken away from this
/// machine. A worker pinned to that CPU sees it as wall time that neither its CPU clock nor its
/// run-queue wait contains. Resolution: one clock tick (usually 10 ms).
pub(crate) struct CpuSteal {
    file: Option<File>,
    cpu: usize,
    ns_per_tick: u64,
    buf: Vec<u8>,
}

impl CpuSteal {
    pub(crate) fn open(cpu: usize) -> Self {
        // SAFETY: sysconf only reads a configuration value.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        CpuSteal {
            file: File::open("/proc/stat").ok(),
            cpu,
            ns_per_tick: if ticks > 0 {
                1_000_000_000 / ticks as u64
            } else {
                0
            },
            buf: vec![0; 16 * 1024],
        }
    }

    /// Steal time of the CPU so far, ns; `None` where unavailable.
    pub(crate) fn read(&mut self) -> Option<u64> {
        let f = self.file.as_ref()?;
        let n = f.read_at(&mut self.buf, 0).ok()?;
        let text = std::str::from_utf8(&self.buf[..n]).ok()?;
        steal_ticks_of(text, self.cpu).map(|ticks| ticks * self.ns_per_tick)
    }
}

/// A timer with nanosecond resolution that wakes `epoll` (whose own timeout rounds up to whole
/// milliseconds): a shaper spacing sends 0.3 ms apart would otherwise wait 1 ms each time.
pub(crate) struct PreciseTimer {
    fd: std::os::fd::OwnedFd,
}

impl PreciseTimer {
    pub(crate) fn new() -> std::io::Result<Self> {
        // SAFETY: timerfd_create takes two integer flags and returns a new descriptor or -1.
        let fd = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by timerfd_create and is owned by nobody else.
        let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        Ok(PreciseTimer { fd })
    }

    pub(crate) fn raw(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.fd)
    }

    /// Fires once, `ns` from now (0 disarms).
    pub(crate) fn arm(&self, ns: u64) {
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: (ns / 1_000_000_000) as libc::time_t,
                tv_nsec: (ns % 1_000_000_000) as libc::c_long,
            },
        };
        // SAFETY: `spec` is a valid itimerspec; the old-value pointer may be null.
        unsafe {
            libc::timerfd_settime(self.raw(), 0, &spec, std::ptr::null_mut());
        }
    }

    /// Consumes an expiry (so the descriptor stops being readable).
    pub(crate) fn clear(&self) {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into `buf`; a non-blocking timerfd with no expiry
        // returns EAGAIN, which is fine to ignore.
        unsafe {
            libc::read(self.raw(), buf.as_mut_ptr().cast(), buf.len());
        }
    }
}

#[cfg(test)]
mod steal_tests {
    use super::steal_ticks_of;

    #[test]
    fn steal_is_the_eighth_field_of_its_cpu() {
        let stat =
            "cpu  10 0 5 100 0 0 0 9 0 0\ncpu0 5 0 2 50 0 0 0 3 0 0\ncpu1 5 0 3 50 0 0 0 6 0 0\n";
        assert_eq!(steal_ticks_of(stat, 0), Some(3));
        assert_eq!(steal_ticks_of(stat, 1), Some(6));
        assert_eq!(steal_ticks_of(stat, 2), None);
        assert_eq!(steal_ticks_of("cpu0 1 2\n", 0), None, "a short line");
    }
}
