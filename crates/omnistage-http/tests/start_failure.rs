//! `Server::start` failing late: a step after the runtime's workers and the disk pool's readers
//! were started (here the TLS certificate, loaded with the tenants) refuses the configuration,
//! and every thread started on the way is stopped and joined before `start` returns.
//!
//! Its own test binary (its own process), so that no other test's server adds threads while
//! the process's threads (`/proc/self/task`) are counted.

use omnistage_http::config::parse_config;
use omnistage_http::server::{Server, ServerOptions};
use std::time::{Duration, Instant};

/// The names of this process's threads.
fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|e| {
            let path = e.ok()?.path().join("comm");
            // A thread may end between the listing and the read.
            Some(std::fs::read_to_string(path).ok()?.trim().to_string())
        })
        .collect()
}

/// The threads a server starts: the runtime's workers (`omnistage-w<core>`) and the disk
/// readers (`omnistage-disk<i>`).
fn server_threads(names: &[String]) -> Vec<&String> {
    names
        .iter()
        .filter(|n| n.starts_with("omnistage-"))
        .collect()
}

#[test]
fn a_start_refused_after_the_disk_pool_started_leaves_no_thread_running() {
    let dir = tempfile::tempdir().expect("tempdir");
    let www = dir.path().join("www");
    std::fs::create_dir_all(&www).unwrap();
    let missing = dir.path().join("missing.pem");
    // The certificate is read only when the tenants are applied: after the listeners, the
    // runtime and the disk pool.
    let toml = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\nlisten_tls = [\"127.0.0.2:0\"]\n\
         tls_cert = '{0}'\ntls_key = '{0}'\ndisk_threads = 3\n\
         [[tenant]]\nname = \"a\"\ndocroot = '{1}'\n",
        missing.display(),
        www.display(),
    );
    let config = parse_config(&toml).unwrap_or_else(|e| panic!("bad test config: {e}\n{toml}"));
    let before = thread_names();
    assert!(server_threads(&before).is_empty(), "{before:?}");
    let opts = ServerOptions {
        workers: Some(2),
        ..Default::default()
    };
    let e = Server::start(config, opts).err().expect("refused");
    assert!(e.contains("missing.pem"), "{e}");
    // `start` joined them, but a joined thread can linger in /proc for a moment: a bounded
    // wait, never a sleep taken as the proof.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = thread_names();
        if server_threads(&now).is_empty() && now.len() <= before.len() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "threads left running after a refused start: {:?} (before: {before:?})",
            now
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
