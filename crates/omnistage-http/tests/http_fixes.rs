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

/// Finding 1. Once: a reload applied the tenants one after the other (each one's activities,
/// the classes it dropped removed at once, its admission) and swapped the live state at the
/// end, so an error half-way (here the runtime's 65,536 activities running out) left the
/// tenants before it applied: tenant `a`'s class `gold` was gone while the old config, which
/// still had it, kept serving. Now the room is checked before anything changes, and dropped
/// classes are removed only once the new config is live.
#[test]
fn a_reload_refused_half_way_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let docroot = www(dir.path(), "a", "gold\n");
    let toml = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\n\n[[tenant]]\nname = \"a\"\ndocroot = '{}'\n\n[[tenant.class]]\nname = \"gold\"\nheader = \"x-class: gold\"\n",
        docroot.display()
    );
    let server = start(&toml, 1);
    let addr = server.local_addrs()[0];
    let rt = server.runtime();
    let gold = rt.activity_id("/tenants/a/gold").expect("class made");
    // `a` without its class first, then more tenants and classes than the runtime can hold
    // (built by hand: the config check would refuse such a file).
    let mut big = config(&toml);
    let a = big.tenants[0].clone();
    big.tenants[0].classes.clear();
    for i in 0..1_030 {
        let mut t = a.clone();
        t.name = format!("t{i}");
        t.hosts = vec![format!("t{i}.test")];
        t.classes = (0..63)
            .map(|j| {
                let mut c = a.classes[0].clone();
                c.name = format!("c{j}");
                c
            })
            .collect();
        big.tenants.push(t);
    }
    let e = server
        .reload(big)
        .expect_err("more activities than the runtime holds");
    assert!(e.contains("65536"), "{e}");
    assert_eq!(
        rt.activity_id("/tenants/a/gold"),
        Some(gold),
        "the class is still there"
    );
    assert_eq!(
        rt.activity_id("/tenants/t0"),
        None,
        "no tenant of the refused config"
    );
    let served = rt.with_activities(|t| t.len());
    assert!(
        served < 16,
        "{served} activities: the refused config made some"
    );
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    write!(
        s,
        "GET / HTTP/1.1\r\nHost: a\r\nx-class: gold\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut r = String::new();
    let _ = s.read_to_string(&mut r);
    assert_eq!(status_and_body(&r), (200, "gold\n".to_string()));
}

/// Finding 1, the config's side: tenants and classes together are bounded (half the runtime's
/// activities, so a reload replacing every class still fits while the old ones are live).
#[test]
fn a_config_with_too_many_activities_is_refused() {
    let tenant = |i: usize, classes: usize| {
        let mut t =
            format!("[[tenant]]\nname = \"t{i}\"\nhosts = [\"t{i}.test\"]\ndocroot = \".\"\n");
        for j in 0..classes {
            t.push_str(&format!(
                "[[tenant.class]]\nname = \"c{j}\"\nprefix = \"/c{j}/\"\n"
            ));
        }
        t
    };
    // 512 tenants of 63 classes: 32,768 activities, over 32,752; 511 of them fit.
    let text = |n: usize| -> String { (0..n).map(|i| tenant(i, 63)).collect() };
    assert!(parse_config(&text(511)).is_ok());
    let e = parse_config(&text(512)).unwrap_err();
    assert!(e.message.contains("32752"), "{e}");
}

/// Finding 2. Once: a reload put the file's `listen` and its tenants' listener bindings into
/// the live config although listeners change only on restart, so tenant `b`, moved in the file
/// from running listener B to C (not running), was no longer served on B (421 there) and not
/// on C either. Now such a reload is refused and `b` is still served on B.
#[test]
fn a_reload_binding_a_tenant_to_a_listener_not_running_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a = www(dir.path(), "a", "a\n");
    let b = www(dir.path(), "b", "b\n");
    let toml = |listen: &str, b_listen: &str| {
        format!(
            "[server]\nlisten = [\"127.0.0.1:0\", {listen}]\n\n[[tenant]]\nname = \"a\"\nhosts = [\"a.test\"]\ndocroot = '{}'\n\n[[tenant]]\nname = \"b\"\nlisten = [{b_listen}]\ndocroot = '{}'\n",
            a.display(),
            b.display()
        )
    };
    let server = start(&toml("\"127.0.0.2:0\"", "\"127.0.0.2:0\""), 1);
    let on_b = server.local_addrs()[1];
    assert_eq!(get(on_b, "whatever", "/"), (200, "b\n".to_string()));
    let moved = config(&toml("\"127.0.0.3:0\"", "\"127.0.0.3:0\""));
    let e = server
        .reload(moved)
        .expect_err("b bound to a listener that does not run");
    assert!(
        e.contains("127.0.0.3:0") && e.contains("not running"),
        "{e}"
    );
    assert_eq!(get(on_b, "whatever", "/"), (200, "b\n".to_string()));
    // A reload that changes `listen` alone is applied, with the listeners as they run.
    let reloaded = server
        .reload(config(&toml(
            "\"127.0.0.2:0\", \"127.0.0.3:0\"",
            "\"127.0.0.2:0\"",
        )))
        .unwrap();
    assert!(
        reloaded.not_applied.iter().any(|n| n.contains("listen")),
        "{reloaded:?}"
    );
    assert_eq!(
        server.config().server.listen.len(),
        2,
        "the live config names the listeners that run"
    );
    assert_eq!(get(on_b, "whatever", "/"), (200, "b\n".to_string()));
}

/// Writes a self-signed certificate and key for `sans` as `<name>-cert.pem` and
/// `<name>-key.pem`; returns their paths.
fn make_cert(dir: &Path, name: &str, sans: &[&str]) -> (std::path::PathBuf, std::path::PathBuf) {
    let ck =
        rcgen::generate_simple_self_signed(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .expect("rcgen");
    let cert = dir.join(format!("{name}-cert.pem"));
    let key = dir.join(format!("{name}-key.pem"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.key_pair.serialize_pem()).unwrap();
    (cert, key)
}

/// Finding 3. Once: an admin change of one tenant (`Server::update_tenant`, as the admin API's
/// `PUT /tenants/a` with `cap_net` does) went through the whole reload and read every
/// certificate from disk again: with a tenant's key file gone since the start (a renewal in
/// progress, say), changing any tenant's net cap failed. Now the certificates are kept when
/// no path to them changed; a reload of the file still reads them.
#[test]
fn an_admin_change_does_not_read_the_certificates_again() {
    let dir = tempfile::tempdir().unwrap();
    let docroot = www(dir.path(), "a", "a\n");
    let (cert, key) = make_cert(dir.path(), "default", &["default.test"]);
    let (a_cert, a_key) = make_cert(dir.path(), "a", &["a.test"]);
    let toml = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\nlisten_tls = [\"127.0.0.2:0\"]\ntls_cert = '{}'\ntls_key = '{}'\n\n[[tenant]]\nname = \"a\"\nhosts = [\"a.test\"]\ndocroot = '{}'\ntls_cert = '{}'\ntls_key = '{}'\n",
        cert.display(),
        key.display(),
        docroot.display(),
        a_cert.display(),
        a_key.display()
    );
    let server = start(&toml, 1);
    std::fs::remove_file(&a_key).unwrap();
    server
        .update_tenant("a", |t| t.net_cap_bytes_per_s = Some(1_000_000))
        .expect("an admin change of the net cap");
    assert_eq!(
        server.config().tenants[0].net_cap_bytes_per_s,
        Some(1_000_000)
    );
    // A reload of the file reads them (and is refused without the key).
    let e = server.reload(config(&toml)).unwrap_err();
    assert!(e.contains("a-key.pem"), "{e}");
}

/// Finding 7. Once: every reload of the file set every tenant's admission predicates again,
/// which replaced each p90 controller by a fresh one at its initial rate: a SIGHUP undid what
/// the controller had learnt under overload. Now a tenant's admission is set again only when
/// its admission settings changed.
#[test]
fn a_reload_keeps_the_admission_state_of_a_tenant_whose_targets_did_not_change() {
    let dir = tempfile::tempdir().unwrap();
    let docroot = www(dir.path(), "a", "a\n");
    let toml = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\n\n[[tenant]]\nname = \"a\"\ndocroot = '{}'\nsynthetic = true\np90_target_ms = 1\n",
        docroot.display()
    );
    let server = start(&toml, 1);
    let addr = server.local_addrs()[0];
    let (work, a) = (
        server.work_stage(),
        server.runtime().activity_id("/tenants/a").unwrap(),
    );
    let initial = server.runtime().admission_rate(work, a).unwrap();
    // Requests of 5 ms against a 1 ms target: the controller cuts the rate.
    let cut = wait_until(|| {
        let _ = get(addr, "a", "/_burn?us=5000");
        server.runtime().admission_rate(work, a).unwrap() < initial
    });
    let learnt = server.runtime().admission_rate(work, a).unwrap();
    assert!(
        cut,
        "the controller never cut the rate ({learnt} of {initial})"
    );
    server.reload(config(&toml)).unwrap();
    assert_eq!(server.runtime().admission_rate(work, a), Some(learnt));
    // A changed target does set it again.
    server
        .reload(config(
            &toml.replace("p90_target_ms = 1", "p90_target_ms = 2"),
        ))
        .unwrap();
    assert_eq!(server.runtime().admission_rate(work, a), Some(initial));
}

/// Finding 8. Once: the access log was opened at start only: a reload naming another file
/// kept writing to the first, and a log rotated by renaming (logrotate) was written to under
/// its old name for ever. Settings a reload does not apply (`disk_threads`, the server's
/// `disk_cap`) were applied in silence. Now a reload opens the log again, and says what it
/// left.
#[test]
fn a_reload_opens_the_access_log_again_and_names_what_it_leaves() {
    let dir = tempfile::tempdir().unwrap();
    let docroot = www(dir.path(), "a", "a\n");
    let (log_a, log_b) = (dir.path().join("a.log"), dir.path().join("b.log"));
    let toml = |log: &Path, extra: &str| {
        format!(
            "[server]\nlisten = [\"127.0.0.1:0\"]\naccess_log = '{}'\n{extra}\n[[tenant]]\nname = \"a\"\ndocroot = '{}'\n",
            log.display(),
            docroot.display()
        )
    };
    let server = start(&toml(&log_a, ""), 1);
    let addr = server.local_addrs()[0];
    let logged = |log: &Path, what: &str| {
        wait_until(|| std::fs::read_to_string(log).is_ok_and(|t| t.contains(what)))
    };
    assert_eq!(get(addr, "a", "/first").0, 404);
    assert!(logged(&log_a, "GET /first"), "the first log has its line");
    // Another file.
    let reloaded = server
        .reload(config(&toml(
            &log_b,
            "disk_threads = 1\ndisk_cap = \"1MB/s\"\n",
        )))
        .unwrap();
    assert_eq!(get(addr, "a", "/second").0, 404);
    assert!(logged(&log_b, "GET /second"), "the new log has its line");
    for key in ["disk_threads", "disk_cap"] {
        assert!(
            reloaded.not_applied.iter().any(|n| n.contains(key)),
            "{key} not named: {reloaded:?}"
        );
    }
    // Rotated by renaming: the same path is opened again.
    std::fs::rename(&log_b, dir.path().join("b.log.1")).unwrap();
    server.reload(config(&toml(&log_b, ""))).unwrap();
    assert_eq!(get(addr, "a", "/third").0, 404);
    assert!(logged(&log_b, "GET /third"), "the rotated log has its line");
}

/// A keep-alive backend on loopback that answers every GET `200 ok` and keeps its connections
/// open; returns its address and the count of connections it accepted.
fn keep_alive_backend() -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            count.fetch_add(1, Ordering::SeqCst);
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        buf.drain(..end + 4);
                        if s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
                            .is_err()
                        {
                            return;
                        }
                    }
                    match s.read(&mut chunk) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
            });
        }
    });
    (addr, accepted)
}

/// Finding 9. Once: after a reload replaced an upstream's servers, the idle keep-alive
/// connections to the old ones stayed in the pool (never reused, the old server keeping them
/// open) and filled `idle_connections_max`: every request to the new server then opened a
/// connection of its own. Now a reload closes idle connections to servers no longer listed.
#[test]
fn a_reload_closes_idle_connections_to_servers_no_longer_listed() {
    let dir = tempfile::tempdir().unwrap();
    let (a, _) = keep_alive_backend();
    let (b, b_accepted) = keep_alive_backend();
    let toml = |server: SocketAddr| {
        format!(
            "[server]\nlisten = [\"127.0.0.1:0\"]\n\n[[upstream]]\nname = \"app\"\nservers = [\"{server}\"]\nidle_connections_max = 1\n\n[[tenant]]\nname = \"a\"\ndocroot = '{}'\nupstream = \"app\"\n",
            dir.path().display()
        )
    };
    let server = start(&toml(a), 1);
    let addr = server.local_addrs()[0];
    assert_eq!(get(addr, "a", "/"), (200, "ok\n".to_string()));
    server.reload(config(&toml(b))).unwrap();
    for _ in 0..10 {
        assert_eq!(get(addr, "a", "/"), (200, "ok\n".to_string()));
    }
    assert_eq!(
        b_accepted.load(Ordering::SeqCst),
        1,
        "one connection to B, reused"
    );
}

/// Finding 8, `workers`. Once: a reload compared the file's `workers` with the file's value at
/// start, so a server that `--workers 1` started while its file said 2 reported nothing, as if
/// it ran 2. Now the file is compared with the count running.
#[test]
fn a_reload_compares_workers_with_the_count_running() {
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\nworkers = 2\n\n[[tenant]]\nname = \"a\"\ndocroot = '{}'\n",
        dir.path().display()
    );
    // `start` overrides the file's 2 with 1, as `serve --workers 1` does.
    let server = start(&toml, 1);
    let reloaded = server.reload(config(&toml)).unwrap();
    assert!(
        reloaded
            .not_applied
            .iter()
            .any(|n| n.contains("workers") && n.contains("still 1")),
        "{reloaded:?}"
    );
}
