//! A `redis-server` of the test's own on a free loopback port (skipped with a message when
//! Debian's `redis-server` is not installed), and a bounded wait for a condition.

#![allow(dead_code)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long any awaited condition may take before the test fails.
pub const WAIT: Duration = Duration::from_secs(15);

/// Whether `redis-server` can be run here; prints why a test skips otherwise.
pub fn redis_installed(test: &str) -> bool {
    let ok = Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("{test}: skipped: redis-server is not installed (apt-get install redis-server)");
    }
    ok
}

/// A free loopback port (bound and released; another process could take it in between, which
/// would fail the start below loudly, not silently).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// A redis-server this test started; killed (by its own PID) when dropped.
pub struct Redis {
    pub port: u16,
    child: Option<Child>,
}

impl Redis {
    pub fn start() -> Redis {
        Self::start_on(free_port())
    }

    pub fn start_on(port: u16) -> Redis {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        let r = Redis {
            port,
            child: Some(child),
        };
        wait_for("redis-server answers PING", || {
            r.client()
                .get_connection_with_timeout(Duration::from_millis(200))
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
                .is_ok()
        });
        r
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).expect("client")
    }

    pub fn con(&self) -> redis::Connection {
        self.client()
            .get_connection_with_timeout(Duration::from_secs(2))
            .expect("connect")
    }

    /// Kills the server (SIGKILL, as a crash) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `f` every 10 ms until it holds; panics after [`WAIT`] naming `what`.
pub fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}
