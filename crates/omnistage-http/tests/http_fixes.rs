//! Regressions of a review of the server's reload, drain and config loading: each test failed
//! against the code it describes in its comment (checked by applying the test alone to that
//! code), and guards the fix. Waits are bounded waits for an event, never a sleep taken as the
//! assertion; everything listens on loopback.

use omnistage_http::config::{parse_config, Config};
use omnistage_http::persist::ConfigFile;
use omnistage_http::server::{Server, ServerOptions};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Longest any bounded wait of these tests lasts before it fails the test.
const WAIT: Duration = Duration::from_secs(10);

fn start(toml: &str, workers: usize) -> Server {
    let config = parse_config(toml).unwrap_or_else(|e| panic!("bad config: {e}\n{toml}"));
    Server::start(
        config,
        ServerOptions {
            workers: Some(workers),
            ..Default::default()
        },
    )
    .unwrap()
}

fn config(toml: &str) -> Config {
    parse_config(toml).unwrap_or_else(|e| panic!("bad config: {e}\n{toml}"))
}

/// One request on a new connection (`Connection: close`): the status and the body.
fn get(addr: SocketAddr, host: &str, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    status_and_body(&out)
}

fn status_and_body(r: &str) -> (u16, String) {
    let status = r
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {r:?}"));
    let body = r.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_string();
    (status, body)
}

/// Polls `cond` every few milliseconds until it holds or [`WAIT`] passes.
fn wait_until(mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + WAIT;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn www(dir: &Path, name: &str, body: &str) -> std::path::PathBuf {
    let d = dir.join(name);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("index.html"), body).unwrap();
    d
}

/// Finding 12. Once: `ConfigFile::load` (at start and on every SIGHUP) read whatever the path
/// named, unbounded: a FIFO blocked the signal thread until someone wrote to it (for ever, and
/// SIGTERM with it), `/dev/zero` was read until memory ran out. Now it must be a regular file.
#[test]
fn a_config_that_is_a_fifo_or_a_device_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("omnistage.toml");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo");
    assert!(made.success());
    for path in [fifo.clone(), "/dev/zero".into()] {
        let (tx, rx) = mpsc::channel();
        let p = path.clone();
        std::thread::spawn(move || {
            let _ = tx.send(ConfigFile::load(&p).map(|_| ()).map_err(|e| e.to_string()));
        });
        let got = rx.recv_timeout(WAIT);
        if got.is_err() && path == fifo {
            // Unblock the reader (a writer that opens and closes the FIFO), then fail.
            let _ = std::fs::OpenOptions::new().write(true).open(&fifo);
        }
        let e = got
            .unwrap_or_else(|_| panic!("loading {} still blocks after {WAIT:?}", path.display()))
            .expect_err("not a config file");
        assert!(e.contains("not a regular file"), "{e}");
    }
}

/// Finding 4. Once: `workers = 0` from the command line (`ServerOptions::workers`) made
/// `Server::start` index an empty list of listeners (a panic); the config accepted up to 1024
/// workers where the runtime takes 256.
#[test]
fn a_worker_count_outside_the_runtimes_range_is_refused_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\n\n[[tenant]]\nname = \"a\"\ndocroot = '{}'\n",
        dir.path().display()
    );
    let started = std::panic::catch_unwind(|| {
        Server::start(
            config(&toml),
            ServerOptions {
                workers: Some(0),
                ..Default::default()
            },
        )
        .map(|_| ())
    });
    let e = started
        .expect("workers 0 must not panic")
        .expect_err("workers 0 refused");
    assert!(e.contains("outside 1..=256"), "{e}");
    // The config's bound is the runtime's: 256 is accepted, 257 refused with its line.
    let with =
        |n: u32| parse_config(&toml.replace("[server]\n", &format!("[server]\nworkers = {n}\n")));
    assert_eq!(with(256).unwrap().server.workers, Some(256));
    let e = with(257).unwrap_err();
    assert!(e.message.contains("outside 1..=256"), "{e}");
}

/// Finding 11. Once: `drain` computed `Instant::now() + grace` unchecked, so a grace near
/// `u64::MAX` seconds (`serve --drain-s 18446744073709551615`) panicked at SIGTERM.
#[test]
fn a_drain_with_an_enormous_grace_is_bounded_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(
        &format!(
            "[server]\nlisten = [\"127.0.0.1:0\"]\n\n[[tenant]]\nname = \"a\"\ndocroot = '{}'\n",
            dir.path().display()
        ),
        1,
    );
    // No connection is open: the drain returns at once whatever its grace.
    let drained = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        server.drain(Duration::from_secs(u64::MAX))
    }));
    assert!(drained.is_ok(), "drain panicked");
}

/// Finding 6. Once: the drain closed the listeners and waited for every connection to end, and
/// a keep-alive client idle after its answer was closed only by `keepalive_timeout` (here a
/// minute): one such client held every drain to its whole grace. Now the drain closes
/// connections idle between requests at once.
#[test]
fn a_drain_closes_an_idle_keep_alive_connection_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let docroot = www(dir.path(), "a", "hello\n");
    let server = start(
        &format!(
            "[server]\nlisten = [\"127.0.0.1:0\"]\nkeepalive_timeout_ms = 60000\n\n[[tenant]]\nname = \"a\"\ndocroot = '{}'\n",
            docroot.display()
        ),
        2,
    );
    let mut s = TcpStream::connect(server.local_addrs()[0]).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    write!(s, "GET / HTTP/1.1\r\nHost: a\r\n\r\n").unwrap();
    let mut buf = [0u8; 4096];
    let mut got = Vec::new();
    while !got.ends_with(b"hello\n") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "closed before the answer");
        got.extend_from_slice(&buf[..n]);
    }
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    // Answered and kept alive; now idle.
    let began = Instant::now();
    server.drain(Duration::from_secs(10));
    let took = began.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "the drain waited {took:?} for an idle keep-alive connection"
    );
    // The client sees the close (not a reset, not an answer).
    assert_eq!(s.read(&mut buf).unwrap(), 0);
}
