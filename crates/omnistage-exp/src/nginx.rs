//! nginx as a peer: writes a configuration into a scratch directory, starts nginx (Debian's
//! package) in the foreground with one worker pinned to CPU 0, waits until it listens, and kills
//! it on drop. Experiments give the `server { ... }` blocks; everything else is fixed here so all
//! peers run the same way: no access log, sendfile, an open-file cache (omnistage keeps open
//! files for 1 s too, so neither opens a file per request), long keep-alive.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where Debian's package installs nginx.
pub const DEFAULT_BIN: &str = "/usr/sbin/nginx";

/// How long nginx may take to start listening.
const START_TIMEOUT: Duration = Duration::from_secs(5);

/// A free loopback port (bound and released; the tiny race with other binders is accepted).
pub fn free_port() -> Result<u16, String> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

/// A running nginx; killed and reaped on drop.
pub struct Nginx {
    child: Child,
}

impl Nginx {
    /// The process id (for /proc readings such as resident memory).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A single `server` block listening on `127.0.0.1:port` with `root`, and `extra` directives
/// inside it (empty for none).
pub fn server_block(port: u16, root: &Path, server_name: Option<&str>, extra: &str) -> String {
    let name = server_name
        .map(|n| format!(" server_name {n};"))
        .unwrap_or_default();
    format!(
        "server {{ listen 127.0.0.1:{port} backlog=4096;{name} root {}; {extra} }}\n",
        root.display()
    )
}

/// Starts nginx with its files in `dir` (created if missing), up to `connections` client
/// connections, the `servers` blocks inside `http { }`, and waits until `port` accepts.
pub fn start(
    bin: &Path,
    dir: &Path,
    port: u16,
    connections: usize,
    servers: &str,
) -> Result<Nginx, String> {
    if !bin.exists() {
        return Err(format!("{} not installed", bin.display()));
    }
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let conf = dir.join("nginx.conf");
    let text = format!(
        "worker_processes 1;\nworker_cpu_affinity 01;\ndaemon off;\nmaster_process off;\npid {pid};\nerror_log {err};\n\
         worker_rlimit_nofile {fds};\nevents {{ worker_connections {wc}; }}\n\
         http {{ access_log off; sendfile on; tcp_nopush on; keepalive_requests 1000000; keepalive_timeout 120s;\n\
         open_file_cache max=1000 inactive=20s; open_file_cache_valid 1s;\n\
         client_body_temp_path {d}; proxy_temp_path {d}; fastcgi_temp_path {d}; uwsgi_temp_path {d}; scgi_temp_path {d};\n\
         {servers}}}\n",
        pid = dir.join("nginx.pid").display(),
        err = dir.join("error.log").display(),
        fds = connections + 200,
        wc = connections + 100,
        d = dir.display(),
    );
    std::fs::write(&conf, text).map_err(|e| e.to_string())?;
    let child = Command::new(bin)
        .arg("-c")
        .arg(&conf)
        .arg("-p")
        .arg(dir)
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start nginx: {e}"))?;
    let nginx = Nginx { child };
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if t0.elapsed() > START_TIMEOUT {
            return Err(format!(
                "nginx did not start listening within {} s",
                START_TIMEOUT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(nginx)
}
