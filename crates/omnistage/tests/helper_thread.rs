//! `Runtime::enter_helper_thread`: a server's helper thread (a disk reader) stays on the CPUs
//! its pinned workers were given and runs at the nice value it asked for; with unpinned
//! workers it is left as it started. Read back from the OS (`/proc/thread-self`).

use omnistage::exec::Runtime;

/// The calling thread's allowed CPUs, as the kernel lists them (`0-1`, `0`).
fn cpus_allowed_list() -> String {
    let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim()
        .to_string()
}

/// The calling thread's nice value (field 19 of `stat`, after the parenthesised name).
fn nice() -> i32 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
    let after_name = &stat[stat.rfind(')').unwrap() + 2..];
    after_name.split(' ').nth(16).unwrap().parse().unwrap()
}

/// Runs `f` on a fresh thread (affinity and nice are per thread and inherited: the test's own
/// thread must keep its own).
fn on_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(f).join().unwrap()
}

/// Whether CPU 0 is one this process may use (a worker pinned "to CPU 0" needs it).
fn cpu0_allowed() -> bool {
    cpus_allowed_list()
        .split(',')
        .any(|r| r == "0" || r.starts_with("0-"))
}

#[test]
fn a_helper_of_pinned_workers_stays_on_their_cpus_at_its_nice() {
    if !cpu0_allowed() {
        return;
    }
    let rt = std::sync::Arc::new(Runtime::builder().workers(1).pin(true).start().unwrap());
    assert_eq!(rt.worker_cpus(), &[0]);
    let before = nice();
    let rt2 = rt.clone();
    let (cpus, helper_nice) = on_thread(move || {
        rt2.enter_helper_thread(19).unwrap();
        (cpus_allowed_list(), nice())
    });
    assert_eq!(cpus, "0");
    assert_eq!(helper_nice, 19);
    assert_eq!(
        nice(),
        before,
        "per thread: the test's own thread keeps its nice"
    );
    rt.shutdown();
}

/// An unpinned server's helper is left as it started: CPUs and nice alike.
#[test]
fn a_helper_of_unpinned_workers_is_left_as_it_is() {
    let rt = std::sync::Arc::new(Runtime::builder().workers(1).start().unwrap());
    assert!(rt.worker_cpus().is_empty());
    let rt2 = rt.clone();
    let (before, after) = on_thread(move || {
        let before = (cpus_allowed_list(), nice());
        rt2.enter_helper_thread(19).unwrap();
        (before, (cpus_allowed_list(), nice()))
    });
    assert_eq!(before, after);
    rt.shutdown();
}
