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

/// A fake Redis on a loopback port that answers every connection with the start of a reply
/// (`*1\r\n` and a bulk string's length) and then one byte of it every 20 ms: a server that
/// never finishes a reply but never lets a read time out either (each byte comes well within
/// any socket timeout). The bulk string is long enough (10^8 bytes) not to end in any test's
/// time. Stopped, with its threads, when dropped.
pub struct Trickle {
    pub port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    accept: Option<std::thread::JoinHandle<()>>,
}

impl Trickle {
    pub fn start() -> Trickle {
        use std::io::Write;
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("addr").port();
        let stop = Arc::new(AtomicBool::new(false));
        let stop_accept = stop.clone();
        let accept = std::thread::spawn(move || {
            let mut conns = Vec::new();
            while !stop_accept.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut s, _)) => {
                        let stop = stop_accept.clone();
                        conns.push(std::thread::spawn(move || {
                            let _ = s.set_nonblocking(false);
                            if s.write_all(b"*1\r\n$100000000\r\n").is_err() {
                                return;
                            }
                            while !stop.load(Ordering::Relaxed) {
                                std::thread::sleep(Duration::from_millis(20));
                                if s.write_all(b"x").is_err() {
                                    return;
                                }
                            }
                        }));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
            for c in conns {
                let _ = c.join();
            }
        });
        Trickle {
            port,
            stop,
            accept: Some(accept),
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for Trickle {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(a) = self.accept.take() {
            let _ = a.join();
        }
    }
}

/// Runs `f` on a thread of its own and returns its result, or `None` if it has not returned
/// within [`WAIT`] (the thread is then left behind: for a call that may hang for ever).
pub fn within_wait<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(WAIT).ok()
}

/// A Unix socket that listens with a backlog of 0 and never accepts, its one queued connection
/// already taken by the test: a blocking connect to it waits for ever (a Unix socket's connect
/// has no timeout). Removed when dropped (which also wakes such a connect with an error).
pub struct FullUnixSocket {
    pub path: std::path::PathBuf,
    _listener: std::os::unix::net::UnixListener,
    _queued: std::os::unix::net::UnixStream,
}

impl FullUnixSocket {
    pub fn bind(name: &str) -> FullUnixSocket {
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::io::FromRawFd;
        let path = std::env::temp_dir().join(format!("{name}-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        // SAFETY: plain socket calls on a descriptor this function creates and then hands to
        // a UnixListener, which owns (and closes) it; `addr` is a zeroed sockaddr_un whose
        // path is filled within its bounds.
        let listener = unsafe {
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0, "socket");
            let listener = std::os::unix::net::UnixListener::from_raw_fd(fd);
            let mut addr: libc::sockaddr_un = std::mem::zeroed();
            addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
            let bytes = path.as_os_str().as_bytes();
            assert!(bytes.len() < addr.sun_path.len(), "socket path too long");
            for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
                *d = *s as libc::c_char;
            }
            let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
            let r = libc::bind(fd, (&addr as *const libc::sockaddr_un).cast(), len);
            assert_eq!(r, 0, "bind");
            assert_eq!(libc::listen(fd, 0), 0, "listen");
            listener
        };
        let queued = std::os::unix::net::UnixStream::connect(&path).expect("the queued connect");
        FullUnixSocket {
            path,
            _listener: listener,
            _queued: queued,
        }
    }
}

impl Drop for FullUnixSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
