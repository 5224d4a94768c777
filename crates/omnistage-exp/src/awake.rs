//! Keeping CPUs from halting while an experiment measures latency on a virtual machine.
//!
//! On a VM an idle vCPU halts, and the host resumes it only when it next schedules it: that
//! delay is counted as steal and lands on whatever woke the CPU (a request's arrival, a load
//! generator's timer). A phase whose CPUs are often idle (`exp adversary`'s victim alone, at a
//! third of the server's CPU) pays it; a phase whose CPUs are busy (under attack) does not, so
//! the delay flattered the attacked/alone ratio. Measured on the 2-vCPU VM with spinners
//! started by hand (`chrt --idle`; `--keep-awake true|false` now runs the same comparison), 4
//! alternating runs each of `exp adversary --victim-rate 13000 --repeats 1 --closed-loop
//! false`: the alone
//! phase's steal on the server's CPU was 30–700 ms of 3 s and its send→kernel p99 0.30–33 ms
//! with the CPUs free to halt; 0 ms and 0.19–0.33 ms with a spinner on each.
//!
//! [`KeepAwake`] runs a SCHED_IDLE thread spinning on each given CPU: it takes only time that
//! nothing else wants (SCHED_IDLE's weight is 3, against 15 for nice 19 and 1,024 for nice 0:
//! beside a busy nice-19 thread it still gets about a sixth), a waking normal thread preempts
//! it at once, and the CPU never halts. A spinner that cannot get SCHED_IDLE does not spin.
//! It must not run beside SCHED_IDLE work that it would share the CPU with (the adversary's
//! clients): `exp adversary` keeps the CPUs awake only in phases without an attack, whose CPUs
//! are otherwise often idle.

use super::harness;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Spinning SCHED_IDLE threads, one per CPU, until dropped.
pub struct KeepAwake {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl KeepAwake {
    /// Starts one spinner on each CPU in `cpus` (best effort: a thread that cannot be pinned or
    /// lowered still spins, and the experiment's page reads steal back from the OS).
    pub fn start(cpus: &[usize]) -> KeepAwake {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = cpus
            .iter()
            .filter_map(|&cpu| {
                let stop = stop.clone();
                std::thread::Builder::new()
                    .name(format!("keep-awake-{cpu}"))
                    .spawn(move || {
                        harness::pin_this_thread(cpu);
                        if !harness::sched_idle_this_thread() {
                            // At normal priority it would take half of a busy CPU: no spinner.
                            return;
                        }
                        // Bounded by the owner: it sets `stop` on drop and joins.
                        while !stop.load(Ordering::Relaxed) {
                            std::hint::spin_loop();
                        }
                    })
                    .ok()
            })
            .collect();
        KeepAwake { stop, threads }
    }
}

impl Drop for KeepAwake {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The spinners run under SCHED_IDLE on their CPU (read back from /proc) and stop when
    /// dropped.
    #[test]
    fn spinners_are_idle_class_and_stop_on_drop() {
        let k = KeepAwake::start(&[0]);
        assert_eq!(k.threads.len(), 1);
        let tid = {
            let mut found = None;
            for _ in 0..200 {
                found = std::fs::read_dir("/proc/self/task").unwrap().find_map(|e| {
                    let e = e.ok()?;
                    let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
                    (comm.trim() == "keep-awake-0").then(|| e.path())
                });
                if found.is_some() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            found.expect("the spinner thread")
        };
        // Field 41 of stat is the policy (SCHED_IDLE = 5); it is set just after the thread
        // starts, so wait for it (bounded).
        let policy = || {
            let stat = std::fs::read_to_string(tid.join("stat")).ok()?;
            let after = &stat[stat.rfind(')')? + 2..];
            after.split(' ').nth(38)?.parse::<u32>().ok()
        };
        let mut seen = None;
        for _ in 0..200 {
            seen = policy();
            if seen == Some(5) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(seen, Some(5), "SCHED_IDLE");
        drop(k);
        // Joined; the kernel may take a moment to remove its /proc entry (bounded wait).
        for _ in 0..200 {
            if !tid.exists() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!tid.exists(), "the spinner ended");
    }
}
