//! nginx as a peer: the one launcher every experiment with a peer uses. It writes a
//! configuration into a scratch directory, starts nginx (Debian's package) in the foreground with
//! its master process on and one worker, confines both to the server's CPU (the master under
//! `sched_setaffinity` before exec, the worker also with `worker_cpu_affinity`), waits until it
//! listens, and reads the confinement back from the OS (`Cpus_allowed_list` of the worker in
//! /proc): [`Nginx::serving_cpus`] fails loudly when the process that serves requests may run
//! anywhere else. It stops nginx on drop (SIGTERM to the master, which stops its worker; SIGKILL
//! to both after a grace period).
//!
//! Experiments give the `server { ... }` blocks and a [`Tuning`]: nginx's standard choices that
//! change its speed for a workload (sendfile on/off, the open-file cache on/off), picked by a
//! short pre-run with [`best_tuning`]. Everything else is fixed here so all peers run the same
//! way: no access log, long keep-alive, `worker_connections` twice the experiment's largest
//! connection level (fewer makes nginx reset connections near the limit).
//!
//! With `master_process off` nginx runs its single-process cycle, which never applies
//! `worker_cpu_affinity` or `worker_rlimit_nofile`: so the master stays on.

use serde::Serialize;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where Debian's package installs nginx.
pub const DEFAULT_BIN: &str = "/usr/sbin/nginx";

/// The CPU the peer (like omnistage's worker) runs on; the load generator runs on CPU 1.
pub const SERVER_CPU: usize = 0;

/// How long nginx may take to start listening (its worker included).
const START_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the master may take to stop its worker after SIGTERM before both are killed.
const STOP_GRACE: Duration = Duration::from_secs(3);
/// `worker_connections` per client connection of the largest level.
pub const SLOTS_PER_CONNECTION: usize = 2;
/// Most `worker_connections` (nginx keeps an array of this many connection slots).
const SLOTS_MAX: usize = 1 << 20;

/// A free loopback port (bound and released; the tiny race with other binders is accepted).
pub fn free_port() -> Result<u16, String> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

/// nginx's standard switches that change its speed on a static workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Tuning {
    /// `sendfile on` (the kernel copies file to socket) or off (read + writev).
    pub sendfile: bool,
    /// `open_file_cache max=1000 inactive=20s; open_file_cache_valid 1s` (omnistage keeps open
    /// files for 1 s too) or no cache (open and close per request).
    pub open_file_cache: bool,
}

impl Tuning {
    /// All four combinations, in the order [`best_tuning`] tries them.
    pub const ALL: [Tuning; 4] = [
        Tuning {
            sendfile: false,
            open_file_cache: true,
        },
        Tuning {
            sendfile: true,
            open_file_cache: true,
        },
        Tuning {
            sendfile: false,
            open_file_cache: false,
        },
        Tuning {
            sendfile: true,
            open_file_cache: false,
        },
    ];

    /// The directives inside `http { }`.
    fn directives(&self) -> String {
        let mut s = format!(
            "sendfile {}; tcp_nopush on;",
            if self.sendfile { "on" } else { "off" }
        );
        if self.open_file_cache {
            s.push_str(" open_file_cache max=1000 inactive=20s; open_file_cache_valid 1s;");
        }
        s
    }

    /// How a page names it: "sendfile off, open_file_cache on".
    pub fn describe(&self) -> String {
        let on = |b: bool| if b { "on" } else { "off" };
        format!(
            "sendfile {}, open_file_cache {}",
            on(self.sendfile),
            on(self.open_file_cache)
        )
    }
}

impl Default for Tuning {
    /// Until a pre-run picks: sendfile off (measured no faster than writev over loopback for
    /// small files here), the open-file cache on.
    fn default() -> Self {
        Tuning::ALL[0]
    }
}

/// The pre-run's result: each tuning's requests/s and the one picked (the fastest).
#[derive(Clone, Debug, Serialize)]
pub struct TuningChoice {
    pub picked: Tuning,
    pub tried: Vec<(Tuning, f64)>,
    pub seconds_each: f64,
}

impl TuningChoice {
    /// One sentence for a page.
    pub fn describe(&self) -> String {
        let tried: Vec<String> = self
            .tried
            .iter()
            .map(|(t, r)| format!("{} {r:.0} req/s", t.describe()))
            .collect();
        format!(
            "nginx's configuration was picked by a {} s pre-run of each of its standard choices ({}): {}.",
            self.seconds_each,
            tried.join("; "),
            self.picked.describe()
        )
    }
}

/// What a page says of the peer: the configuration the pre-run picked and where the worker was
/// allowed to run, as read after each of its runs (nothing when nginx did not run).
pub fn page_notes(tuning: Option<&TuningChoice>, peer_cpus: &[String]) -> Vec<String> {
    let Some(c) = tuning else {
        return Vec::new();
    };
    let mut cpus = peer_cpus.to_vec();
    cpus.sort_unstable();
    cpus.dedup();
    vec![
        c.describe(),
        format!(
            "nginx's worker was confined to CPU {SERVER_CPU} as read from /proc/PID/status \
             (Cpus_allowed_list) after each of its {} runs: {}.",
            peer_cpus.len(),
            cpus.join(", ")
        ),
    ]
}

/// Runs `measure` (requests/s of nginx started with that tuning, over `seconds_each`) for every
/// tuning and picks the fastest.
pub fn best_tuning(
    seconds_each: f64,
    mut measure: impl FnMut(Tuning) -> Result<f64, String>,
) -> Result<TuningChoice, String> {
    let mut tried = Vec::with_capacity(Tuning::ALL.len());
    for t in Tuning::ALL {
        tried.push((t, measure(t)?));
    }
    let picked = tried
        .iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(t, _)| *t)
        .expect("four tunings tried");
    Ok(TuningChoice {
        picked,
        tried,
        seconds_each,
    })
}

/// A running nginx (master and one worker); stopped and reaped on drop.
pub struct Nginx {
    master: Child,
    worker: u32,
}

impl Nginx {
    /// The process that serves requests (the worker), for /proc readings such as resident
    /// memory, CPU time and sockets.
    pub fn pid(&self) -> u32 {
        self.worker
    }

    /// The CPUs the worker may run on, read from the OS (`Cpus_allowed_list` in
    /// /proc/PID/status); an error, saying what was found, unless it is exactly
    /// [`SERVER_CPU`] and the worker is still the one that started (a restarted worker would
    /// have served part of the run unobserved).
    pub fn serving_cpus(&self) -> Result<String, String> {
        let workers = children(self.master.id());
        if workers != [self.worker] {
            return Err(format!(
                "nginx's workers changed during the run: started {}, now {workers:?}",
                self.worker
            ));
        }
        let cpus = cpus_allowed(self.worker)?;
        if cpus != SERVER_CPU.to_string() {
            return Err(format!(
                "nginx's worker (pid {}) may run on CPUs {cpus}, not only CPU {SERVER_CPU} as the experiment states",
                self.worker
            ));
        }
        Ok(cpus)
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let master = self.master.id() as libc::pid_t;
        // SAFETY: kill(2) on our own child's pid; no memory is shared.
        unsafe { libc::kill(master, libc::SIGTERM) };
        let t0 = Instant::now();
        while t0.elapsed() < STOP_GRACE {
            if let Ok(Some(_)) = self.master.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // A worker left behind (the master killed before it could stop it) would keep the port.
        if Path::new(&format!("/proc/{}", self.worker)).exists()
            && ppid(self.worker) == Some(self.master.id())
        {
            // SAFETY: kill(2) on the worker of our child, checked to be its child just above.
            unsafe { libc::kill(self.worker as libc::pid_t, libc::SIGKILL) };
        }
        let _ = self.master.kill();
        let _ = self.master.wait();
    }
}

/// A `server` block listening on `127.0.0.1:port` with `root`, and `extra` directives inside it
/// (empty for none).
pub fn server_block(port: u16, root: &Path, server_name: Option<&str>, extra: &str) -> String {
    let name = server_name
        .map(|n| format!(" server_name {n};"))
        .unwrap_or_default();
    format!(
        "server {{ listen 127.0.0.1:{port} backlog=4096;{name} root {}; {extra} }}\n",
        root.display()
    )
}

/// Starts nginx with its files in `dir` (created if missing), room for `connections` client
/// connections at once (the experiment's largest level), the `servers` blocks inside
/// `http { }`, and waits until `port` accepts. The worker's confinement is checked before it
/// returns.
pub fn start(
    bin: &Path,
    dir: &Path,
    port: u16,
    connections: usize,
    tuning: Tuning,
    servers: &str,
) -> Result<Nginx, String> {
    if !bin.exists() {
        return Err(format!("{} not installed", bin.display()));
    }
    let slots = (connections * SLOTS_PER_CONNECTION).clamp(1024, SLOTS_MAX);
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let conf = dir.join("nginx.conf");
    let cpu_mask = format!("{:b}", 1u64 << SERVER_CPU);
    let text = format!(
        "worker_processes 1;\nworker_cpu_affinity {cpu_mask};\ndaemon off;\nmaster_process on;\npid {pid};\nerror_log {err};\n\
         worker_rlimit_nofile {fds};\nevents {{ worker_connections {slots}; }}\n\
         http {{ access_log off; {tuning} keepalive_requests 1000000; keepalive_timeout 120s;\n\
         client_body_temp_path {d}; proxy_temp_path {d}; fastcgi_temp_path {d}; uwsgi_temp_path {d}; scgi_temp_path {d};\n\
         {servers}}}\n",
        pid = dir.join("nginx.pid").display(),
        err = dir.join("error.log").display(),
        // A client connection may hold a socket and an open file.
        fds = 2 * slots + 200,
        tuning = tuning.directives(),
        d = dir.display(),
    );
    std::fs::write(&conf, text).map_err(|e| e.to_string())?;
    let mut cmd = Command::new(bin);
    cmd.arg("-c")
        .arg(&conf)
        .arg("-p")
        .arg(dir)
        .stderr(Stdio::null());
    confine_to_server_cpu(&mut cmd);
    let master = cmd
        .spawn()
        .map_err(|e| format!("cannot start nginx: {e}"))?;
    let mut nginx = Nginx { master, worker: 0 };
    let t0 = Instant::now();
    loop {
        if let Ok(Some(status)) = nginx.master.try_wait() {
            let log = std::fs::read_to_string(dir.join("error.log")).unwrap_or_default();
            return Err(format!(
                "nginx exited at start ({status}): {}",
                log.lines().last().unwrap_or("")
            ));
        }
        let workers = children(nginx.master.id());
        if workers.len() == 1 && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            nginx.worker = workers[0];
            break;
        }
        if t0.elapsed() > START_TIMEOUT {
            return Err(format!(
                "nginx did not start one worker listening on {port} within {} s (workers {workers:?})",
                START_TIMEOUT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    nginx.serving_cpus()?;
    Ok(nginx)
}

/// Makes the process `cmd` starts, and every thread it makes, run on the server's CPU only
/// (`sched_setaffinity` before exec; read back from /proc by [`cpus_allowed`]).
pub fn confine_to_server_cpu(cmd: &mut Command) {
    // SAFETY: between fork and exec the closure only calls sched_setaffinity(2) on a cpu_set_t
    // on its own stack (async-signal-safe; no allocation, no locks).
    unsafe {
        cmd.pre_exec(|| {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(SERVER_CPU, &mut set);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// `Cpus_allowed_list` of a process, from /proc/PID/status.
pub fn cpus_allowed(pid: u32) -> Result<String, String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("/proc/{pid}/status: {e}"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|v| v.trim().to_string())
        .ok_or_else(|| format!("/proc/{pid}/status has no Cpus_allowed_list"))
}

/// The parent pid of a process (`PPid` in /proc/PID/status).
fn ppid(pid: u32) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// The pids whose parent is `parent`, found by scanning /proc (works without
/// CONFIG_PROC_CHILDREN), in increasing order.
fn children(parent: u32) -> Vec<u32> {
    let mut v: Vec<u32> = std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter(|&pid| ppid(pid) == Some(parent))
                .collect()
        })
        .unwrap_or_default();
    v.sort_unstable();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_an_allowed_cpu_list() {
        let cpus = cpus_allowed(std::process::id()).unwrap();
        assert!(!cpus.is_empty());
        assert!(cpus_allowed(u32::MAX).is_err());
    }

    #[test]
    fn a_child_is_found_under_its_parent() {
        let mut c = Command::new("sleep").arg("5").spawn().unwrap();
        assert!(children(std::process::id()).contains(&c.id()));
        assert_eq!(ppid(c.id()), Some(std::process::id()));
        c.kill().unwrap();
        c.wait().unwrap();
    }

    #[test]
    fn tunings_are_distinct_and_the_fastest_is_picked() {
        let mut seen = Tuning::ALL.to_vec();
        seen.dedup();
        assert_eq!(seen.len(), 4);
        let c = best_tuning(0.1, |t| {
            Ok(if t.sendfile && !t.open_file_cache {
                9.0
            } else {
                1.0
            })
        })
        .unwrap();
        assert!(c.picked.sendfile && !c.picked.open_file_cache);
        assert!(c.describe().contains("sendfile on, open_file_cache off"));
        assert!(best_tuning(0.1, |_| Err("x".into())).is_err());
    }

    /// Against the real nginx when it is installed: the worker is confined to the server's CPU
    /// as the OS reports it, and stops with the launcher.
    #[test]
    fn real_nginx_worker_is_pinned() {
        let bin = Path::new(DEFAULT_BIN);
        if !bin.exists() {
            eprintln!("{DEFAULT_BIN} not installed: skipped");
            return;
        }
        let dir = std::env::temp_dir().join(format!("omnistage-nginx-test-{}", std::process::id()));
        let root = dir.join("www");
        std::fs::create_dir_all(&root).unwrap();
        let port = free_port().unwrap();
        let ng = start(
            bin,
            &dir,
            port,
            64,
            Tuning::default(),
            &server_block(port, &root, None, ""),
        )
        .unwrap();
        let worker = ng.pid();
        assert_eq!(ng.serving_cpus().unwrap(), SERVER_CPU.to_string());
        assert_eq!(
            cpus_allowed(ng.master.id()).unwrap(),
            SERVER_CPU.to_string()
        );
        let conf = std::fs::read_to_string(dir.join("nginx.conf")).unwrap();
        assert!(conf.contains("worker_connections 1024;"), "{conf}");
        drop(ng);
        // The master reaps its worker before it exits, and the launcher waits for the master.
        assert!(
            !Path::new(&format!("/proc/{worker}")).exists(),
            "worker {worker} left behind"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
