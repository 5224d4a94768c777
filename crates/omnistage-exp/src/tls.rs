//! `tls`: omnistage's TLS against nginx's, one worker each pinned to CPU 0, the clients on
//! CPU 1: TLS 1.3 new connections per second (each a full handshake, no resumption, and one
//! request with `Connection: close`) and keep-alive requests per second over TLS (a 1 KiB file).
//! Both servers get the same certificate (ECDSA P-256, made here with rcgen) and, because the
//! client offers nothing else, the same cipher suite (TLS_AES_128_GCM_SHA256) and key exchange
//! (X25519).
//!
//! The load generator `omnistage load` has no TLS, so the clients are here: blocking rustls
//! clients (ring), one thread per connection, all pinned to CPU 1, counting completed
//! exchanges over the measured window. A client's handshake costs about as much CPU as the
//! server's, so the clients on one CPU can be the limit; the server's own CPU per exchange, by
//! the OS's clock (the worker thread's schedstat, nginx's worker's /proc stat), is reported
//! beside the rates so the comparison holds even then. Rounds alternate between the servers
//! (`--repeats`) and medians are compared. nginx runs from Debian's package if installed;
//! otherwise omnistage is reported alone.

use super::nginx::{self, Tuning};
use super::report::{self, Doc, Table};
use super::rounds::{self, Spread};
use super::util::{self, machine};
use super::{harness, Common};
use clap::Args;
use omnistage_http::config::parse_config;
use omnistage_http::server::{Server, ServerOptions};
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};
use serde::Serialize;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The CPU the clients run on.
const CLIENT_CPU: usize = 1;
/// Seconds of load before the measured window.
const WARMUP_S: f64 = 0.5;
/// Goal: keep-alive requests/s at least this × nginx's.
const GOAL_KEEPALIVE: f64 = 1.0;
/// Goal: new connections (handshakes)/s at least this × nginx's.
const GOAL_HANDSHAKES: f64 = 0.8;
/// Client read timeout: a server that stops answering ends the round with an error.
const IO_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Args, Clone)]
#[command(mut_arg("seconds", |a| a.default_value("3.0").help("Measured seconds of each round.")))]
pub struct TlsArgs {
    /// Client connections (one thread each).
    #[arg(long, default_value_t = 16)]
    conns: usize,
    /// File size in bytes.
    #[arg(long, default_value_t = 1024)]
    file_bytes: usize,
    #[command(flatten)]
    common: Common,
}

#[derive(Serialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
enum Mode {
    /// A new connection per exchange: full TLS 1.3 handshake, one request.
    Handshake,
    /// Requests on open TLS connections.
    KeepAlive,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Handshake => "handshakes",
            Mode::KeepAlive => "keep-alive",
        }
    }
}

#[derive(Serialize, Clone)]
struct Round {
    round: usize,
    mode: Mode,
    server: &'static str,
    per_s: f64,
    /// The server's CPU per exchange by the OS's clock, µs.
    server_cpu_us: Option<f64>,
    errors: u64,
}

#[derive(Serialize)]
struct Compared {
    mode: Mode,
    omnistage_per_s: Spread,
    nginx_per_s: Option<Spread>,
    ratio: Option<f64>,
    goal: f64,
    omnistage_cpu_us: Option<f64>,
    nginx_cpu_us: Option<f64>,
    /// At least `goal` × nginx's median by more than `goal` × nginx's run-to-run range (below
    /// by more: missed; inside it: `null`, inconclusive).
    goal_met: Option<bool>,
    /// Why the mode was not compared, if it was not.
    not_judged: Option<String>,
}

#[derive(Serialize)]
struct Report {
    experiment: &'static str,
    machine: String,
    seconds_per_round: f64,
    repeats: usize,
    conns: usize,
    file_bytes: usize,
    cipher_suite: &'static str,
    rounds: Vec<Round>,
    compared: Vec<Compared>,
    peer_cpus: Vec<String>,
    nginx_note: Option<String>,
    /// Both goals met, either missed, or `null` (a mode inconclusive or not judged).
    goal_met: Option<bool>,
}

fn pin_to(cpu: usize) {
    // SAFETY: sched_setaffinity(2) on this thread with a cpu_set_t on our stack.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn client_config(cert: &CertificateDer<'static>) -> Result<Arc<ClientConfig>, String> {
    let mut roots = RootCertStore::empty();
    roots.add(cert.clone()).map_err(|e| e.to_string())?;
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites = vec![rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256];
    provider.kx_groups = vec![rustls::crypto::ring::kx_group::X25519];
    let mut cfg = ClientConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    // Every new connection is a full handshake.
    cfg.resumption = rustls::client::Resumption::disabled();
    Ok(Arc::new(cfg))
}

type Tls = StreamOwned<ClientConnection, TcpStream>;

fn connect(addr: SocketAddr, cfg: &Arc<ClientConfig>) -> std::io::Result<Tls> {
    let sock = TcpStream::connect(addr)?;
    sock.set_nodelay(true)?;
    sock.set_read_timeout(Some(IO_TIMEOUT))?;
    let name = ServerName::try_from("localhost").expect("a valid name");
    let conn = ClientConnection::new(cfg.clone(), name).map_err(std::io::Error::other)?;
    let mut s = StreamOwned::new(conn, sock);
    while s.conn.is_handshaking() {
        s.conn.complete_io(&mut s.sock)?;
    }
    Ok(s)
}

/// Sends one GET and reads its response (a `Content-Length` body) into `buf`.
fn exchange(s: &mut Tls, close: bool, buf: &mut Vec<u8>) -> std::io::Result<()> {
    let req: &[u8] = if close {
        b"GET /file.bin HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    } else {
        b"GET /file.bin HTTP/1.1\r\nHost: localhost\r\n\r\n"
    };
    s.write_all(req)?;
    buf.clear();
    let mut chunk = [0u8; 4096];
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    loop {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(bad("closed before the response ended"));
        }
        buf.extend_from_slice(&chunk[..n]);
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        if !buf.starts_with(b"HTTP/1.1 200") {
            return Err(bad("not a 200"));
        }
        let head = std::str::from_utf8(&buf[..end]).map_err(|_| bad("head not UTF-8"))?;
        let len: usize = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse().ok())?
            })
            .ok_or_else(|| bad("no Content-Length"))?;
        if buf.len() >= end + 4 + len {
            return Ok(());
        }
    }
}

/// Runs `conns` client threads on CPU 1 against `addr` for the warm-up and `seconds`; returns
/// (exchanges per second in the measured window, errors, exchanges in the window).
fn load(
    addr: SocketAddr,
    cfg: &Arc<ClientConfig>,
    mode: Mode,
    conns: usize,
    seconds: f64,
    mut at_window: impl FnMut(bool),
) -> (f64, u64, u64) {
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..conns)
        .map(|_| {
            let (done, errors, stop, cfg) =
                (done.clone(), errors.clone(), stop.clone(), cfg.clone());
            std::thread::spawn(move || {
                pin_to(CLIENT_CPU);
                let mut buf = Vec::with_capacity(8192);
                let mut open: Option<Tls> = None;
                while !stop.load(Ordering::Relaxed) {
                    let s = match open.take() {
                        Some(s) => Ok(s),
                        None => connect(addr, &cfg),
                    };
                    let mut s = match s {
                        Ok(s) => s,
                        Err(_) => {
                            errors.fetch_add(1, Ordering::Relaxed);
                            std::thread::sleep(Duration::from_millis(10));
                            continue;
                        }
                    };
                    let close = mode == Mode::Handshake;
                    match exchange(&mut s, close, &mut buf) {
                        Ok(()) => {
                            done.fetch_add(1, Ordering::Relaxed);
                            if !close {
                                open = Some(s);
                            }
                        }
                        Err(_) => {
                            errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs_f64(WARMUP_S));
    at_window(true);
    let (d0, e0, t0) = (
        done.load(Ordering::Relaxed),
        errors.load(Ordering::Relaxed),
        Instant::now(),
    );
    std::thread::sleep(Duration::from_secs_f64(seconds));
    let (d1, e1, t1) = (
        done.load(Ordering::Relaxed),
        errors.load(Ordering::Relaxed),
        Instant::now(),
    );
    at_window(false);
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    let n = d1 - d0;
    (n as f64 / (t1 - t0).as_secs_f64(), e1 - e0, n)
}

fn omnistage_round(
    a: &TlsArgs,
    mode: Mode,
    dir: &Path,
    cfg: &Arc<ClientConfig>,
) -> Result<Round, String> {
    let toml = format!(
        "[server]\nlisten = []\nlisten_tls = [\"127.0.0.1:0\"]\nworkers = 1\n\
         tls_cert = '{}'\ntls_key = '{}'\nconnections_max = 100000\n\
         [[tenant]]\nname = \"t\"\ndocroot = '{}'\n",
        dir.join("cert.pem").display(),
        dir.join("key.pem").display(),
        dir.join("www").display()
    );
    let config = parse_config(&toml).map_err(|e| e.to_string())?;
    let server = Server::start(
        config,
        ServerOptions {
            pin: true,
            workers: Some(1),
            bypass: false,
        },
    )?;
    let addr = server.local_addrs()[0];
    let mut cpu = (None, None);
    let (per_s, errors, n) = load(addr, cfg, mode, a.conns, a.common.seconds, |start| {
        let v = harness::thread_stat("omnistage-w0").map(|t| t.cpu_ns);
        if start {
            cpu.0 = v;
        } else {
            cpu.1 = v;
        }
    });
    server.drain(Duration::from_millis(200));
    Ok(Round {
        round: 0,
        mode,
        server: "omnistage",
        per_s,
        server_cpu_us: per_exchange(cpu, n),
        errors,
    })
}

fn per_exchange(cpu: (Option<u64>, Option<u64>), n: u64) -> Option<f64> {
    match cpu {
        (Some(a), Some(b)) if n > 0 => Some(b.saturating_sub(a) as f64 / 1e3 / n as f64),
        _ => None,
    }
}

fn nginx_round(
    a: &TlsArgs,
    mode: Mode,
    dir: &Path,
    cfg: &Arc<ClientConfig>,
) -> Result<(Round, String), String> {
    let port = nginx::free_port()?;
    let extra = format!(
        "ssl_certificate {}; ssl_certificate_key {}; ssl_protocols TLSv1.2 TLSv1.3;",
        dir.join("cert.pem").display(),
        dir.join("key.pem").display()
    );
    let block = nginx::server_block(port, &dir.join("www"), None, &extra).replace(
        &format!("listen 127.0.0.1:{port} "),
        &format!("listen 127.0.0.1:{port} ssl "),
    );
    // omnistage keeps open files in its cache: nginx keeps them open too.
    let tuning = Tuning {
        sendfile: false,
        open_file_cache: true,
    };
    let ng = nginx::start(
        &a.common.nginx,
        &dir.join("nginx"),
        port,
        a.conns,
        tuning,
        &block,
    )?;
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let pid = ng.pid();
    let mut cpu = (None, None);
    let (per_s, errors, n) = load(addr, cfg, mode, a.conns, a.common.seconds, |start| {
        let v = util::process_cpu_ns(pid);
        if start {
            cpu.0 = v;
        } else {
            cpu.1 = v;
        }
    });
    let cpus = ng.serving_cpus()?;
    Ok((
        Round {
            round: 0,
            mode,
            server: "nginx",
            per_s,
            server_cpu_us: per_exchange(cpu, n),
            errors,
        },
        cpus,
    ))
}

pub fn run(a: TlsArgs) -> Result<(), String> {
    a.common.check(0.5)?;
    if !(1..=256).contains(&a.conns) || a.file_bytes > 1 << 20 {
        return Err("--conns 1..=256, --file-bytes at most 1 MiB".into());
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus < 2 {
        return Err("needs 2 CPUs: one for the server, one for the clients".into());
    }
    let dir = std::env::temp_dir().join(format!("omnistage-exp-tls-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("www")).map_err(|e| e.to_string())?;
    let result = measure(&a, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    let report = result?;
    page(&a, &report)
}

fn measure(a: &TlsArgs, dir: &Path) -> Result<Report, String> {
    std::fs::write(dir.join("www").join("file.bin"), vec![b'x'; a.file_bytes])
        .map_err(|e| e.to_string())?;
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])
        .map_err(|e| e.to_string())?;
    std::fs::write(dir.join("cert.pem"), ck.cert.pem()).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("key.pem"), ck.key_pair.serialize_pem()).map_err(|e| e.to_string())?;
    let cfg = client_config(ck.cert.der())?;
    let nginx_ok = a.common.nginx.exists();
    let nginx_note = (!nginx_ok).then(|| {
        format!(
            "{} not found: nginx not installed; omnistage alone",
            a.common.nginx.display()
        )
    });
    let servers: &[&'static str] = if nginx_ok {
        &["omnistage", "nginx"]
    } else {
        &["omnistage"]
    };
    let mut rounds_out = Vec::new();
    let mut peer_cpus = Vec::new();
    for mode in [Mode::Handshake, Mode::KeepAlive] {
        let runs = rounds::alternate(a.common.repeats, servers, |round, server| {
            let mut r = if server == "nginx" {
                let (r, cpus) = nginx_round(a, mode, dir, &cfg)?;
                peer_cpus.push(cpus);
                r
            } else {
                omnistage_round(a, mode, dir, &cfg)?
            };
            r.round = round + 1;
            Ok(r)
        })?;
        rounds_out.extend(runs.into_iter().map(|(_, _, r)| r));
    }
    let mut compared = Vec::new();
    for (mode, goal) in [
        (Mode::Handshake, GOAL_HANDSHAKES),
        (Mode::KeepAlive, GOAL_KEEPALIVE),
    ] {
        let of = |name: &str, f: fn(&Round) -> Option<f64>| -> Vec<f64> {
            rounds_out
                .iter()
                .filter(|r| r.server == name && r.mode == mode)
                .filter_map(f)
                .collect()
        };
        let rate = |r: &Round| Some(r.per_s);
        let cpu = |r: &Round| r.server_cpu_us;
        let (om, ng) = (of("omnistage", rate), of("nginx", rate));
        let ng_errors: u64 = rounds_out
            .iter()
            .filter(|r| r.server == "nginx" && r.mode == mode)
            .map(|r| r.errors)
            .sum();
        let j = judge_mode(&om, &ng, ng_errors, goal);
        let med = |v: Vec<f64>| harness::median_of(&v);
        compared.push(Compared {
            mode,
            omnistage_per_s: Spread::of(&om),
            nginx_per_s: (!ng.is_empty()).then(|| Spread::of(&ng)),
            ratio: j.ratio,
            goal,
            omnistage_cpu_us: med(of("omnistage", cpu)),
            nginx_cpu_us: med(of("nginx", cpu)),
            goal_met: j.goal_met,
            not_judged: j.not_judged,
        });
    }
    let goal_met = harness::combine_verdicts(compared.iter().map(|c| c.goal_met));
    Ok(Report {
        experiment: "tls",
        machine: machine(),
        seconds_per_round: a.common.seconds,
        repeats: a.common.repeats,
        conns: a.conns,
        file_bytes: a.file_bytes,
        cipher_suite: "TLS_AES_128_GCM_SHA256, X25519, ECDSA P-256",
        rounds: rounds_out,
        compared,
        peer_cpus,
        nginx_note,
        goal_met,
    })
}

/// One mode's comparison: the ratio of medians, the goal, and why it was not judged.
struct Judged {
    ratio: Option<f64>,
    goal_met: Option<bool>,
    not_judged: Option<String>,
}

/// Judges one mode: omnistage's rates `om` against nginx's `ng` (its clients saw `ng_errors`)
/// for a goal of at least `goal` × nginx's, by the symmetric rule ([`rounds::at_least`]: a
/// difference from `goal` × nginx inside `goal` × nginx's range is inconclusive). Not judged
/// without nginx, when a round served nothing or nginx's clients saw errors, or with one nginx
/// round (no range to judge against).
fn judge_mode(om: &[f64], ng: &[f64], ng_errors: u64, goal: f64) -> Judged {
    if ng.is_empty() {
        return Judged {
            ratio: None,
            goal_met: None,
            not_judged: Some("no nginx".into()),
        };
    }
    let (o, n) = (Spread::of(om), Spread::of(ng));
    let ratio = (n.median > 0.0).then(|| o.median / n.median);
    let not_judged = rounds::not_judged(om, ng, ng_errors, "nginx").or_else(|| {
        (ng.len() < 2).then(|| "one nginx round: no run-to-run range to judge against".into())
    });
    Judged {
        ratio,
        goal_met: not_judged
            .is_none()
            .then(|| rounds::at_least(om, ng, goal))
            .flatten(),
        not_judged,
    }
}

fn page(a: &TlsArgs, report: &Report) -> Result<(), String> {
    let mut t = Table::new(&[
        "mode",
        "round",
        "server",
        "per s",
        "server CPU µs each",
        "errors",
    ]);
    for r in &report.rounds {
        t.row(vec![
            r.mode.name().into(),
            r.round.to_string(),
            r.server.into(),
            format!("{:.0}", r.per_s),
            r.server_cpu_us.map_or("-".into(), |c| format!("{c:.1}")),
            r.errors.to_string(),
        ]);
    }
    let mut s = Table::new(&[
        "mode",
        "omnistage per s",
        "nginx per s",
        "ratio",
        "goal",
        "met",
        "CPU µs omnistage / nginx",
    ]);
    for c in &report.compared {
        s.row(vec![
            c.mode.name().into(),
            c.omnistage_per_s.show(0),
            c.nginx_per_s.map_or("-".into(), |n| n.show(0)),
            c.ratio.map_or("-".into(), |r| format!("{r:.2}")),
            format!("≥ {:.1}×", c.goal),
            match (c.goal_met, &c.not_judged) {
                (Some(true), _) => "yes".into(),
                (Some(false), _) => "no".into(),
                (None, Some(why)) => format!("not judged: {why}"),
                (None, None) => "inconclusive (inside nginx's range)".into(),
            },
            format!(
                "{} / {}",
                c.omnistage_cpu_us.map_or("-".into(), |v| format!("{v:.1}")),
                c.nginx_cpu_us.map_or("-".into(), |v| format!("{v:.1}"))
            ),
        ]);
    }
    let mut notes = vec![format!(
        "Goals: keep-alive requests/s ≥ {GOAL_KEEPALIVE:.1}× nginx's and new connections/s ≥ \
         {GOAL_HANDSHAKES:.1}× nginx's (medians; a difference from the goal × nginx's median \
         inside the goal × nginx's run-to-run range is inconclusive whatever its sign, and a \
         round in which either server served nothing, or nginx's clients saw errors, leaves \
         the mode not judged): {}.",
        match report.goal_met {
            Some(true) => "met",
            Some(false) => "not met",
            None if report.nginx_note.is_some() => "not judged (no nginx)",
            None => "not judged (a mode inconclusive or not judged: see the summary)",
        }
    )];
    if let Some(n) = &report.nginx_note {
        notes.push(n.clone());
    } else {
        notes.push(format!(
            "nginx's worker was confined to CPU {} as read from /proc/PID/status after each round: {}.",
            nginx::SERVER_CPU,
            report.peer_cpus.join(", ")
        ));
    }
    notes.push(
        "The clients (rustls, one blocking thread per connection on CPU 1) do about as much \
         crypto per handshake as the server, so they may be the limit of the handshake rate: \
         then the rates tie and the server CPU per exchange (OS clocks) is the fairer comparison."
            .into(),
    );
    let doc = Doc {
        title: "tls: TLS handshakes and keep-alive requests, omnistage vs nginx".into(),
        command: format!(
            "omnistage exp tls {} --conns {} --file-bytes {}",
            a.common.words(),
            a.conns,
            a.file_bytes
        ),
        machine: report.machine.clone(),
        intro: vec![format!(
            "One worker each pinned to CPU {} (omnistage with full scheduling and accounting; \
             nginx with one worker, no access log, open-file cache), {} client connections on \
             CPU {CLIENT_CPU}, the same ECDSA P-256 certificate, TLS 1.3 with \
             TLS_AES_128_GCM_SHA256 and X25519 (the only ones the client offers), a {} B file. \
             Handshakes: each exchange is a new connection with a full handshake (no \
             resumption) and one request with Connection: close. Keep-alive: requests on open \
             connections. {} alternating rounds of {} s per mode; medians compared.",
            nginx::SERVER_CPU,
            a.conns,
            a.file_bytes,
            a.common.repeats,
            a.common.seconds
        )],
        tables: vec![("Summary".into(), s), ("Rounds".into(), t)],
        notes,
    };
    report::emit("tls", report, &doc, a.common.json, a.common.out(), |p| {
        let cats: Vec<String> = report
            .compared
            .iter()
            .map(|c| c.mode.name().into())
            .collect();
        let om: Vec<f64> = report
            .compared
            .iter()
            .map(|c| c.omnistage_per_s.median)
            .collect();
        let ng: Vec<f64> = report
            .compared
            .iter()
            .map(|c| c.nginx_per_s.map_or(0.0, |n| n.median))
            .collect();
        report::svg_bars(
            p,
            "TLS: new connections/s and keep-alive requests/s (medians)",
            "per second",
            &cats,
            &[("omnistage".into(), om), ("nginx".into(), ng)],
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_that_served_nothing_is_not_beaten() {
        let j = judge_mode(&[100.0; 3], &[0.0; 3], 0, GOAL_HANDSHAKES);
        assert_ne!(j.goal_met, Some(true), "nginx served nothing");
        assert_eq!(j.ratio, None, "a ratio to nothing");
        let j = judge_mode(&[100.0; 3], &[50.0, 51.0, 52.0], 4, GOAL_KEEPALIVE);
        assert_ne!(j.goal_met, Some(true), "nginx's clients saw errors");
    }

    #[test]
    fn a_ratio_inside_nginx_range_is_inconclusive() {
        // 1.05× nginx's median, nginx's rounds 90–110: inside its range.
        let j = judge_mode(
            &[105.0, 106.0, 104.0],
            &[100.0, 90.0, 110.0],
            0,
            GOAL_KEEPALIVE,
        );
        assert_eq!(j.goal_met, None);
        // Beyond it: met; below 0.8× by more than 0.8 × its range: missed.
        let j = judge_mode(&[125.0; 3], &[100.0, 90.0, 110.0], 0, GOAL_KEEPALIVE);
        assert_eq!(j.goal_met, Some(true));
        let j = judge_mode(&[60.0; 3], &[100.0, 90.0, 110.0], 0, GOAL_HANDSHAKES);
        assert_eq!(j.goal_met, Some(false));
        // One nginx round: no range to judge against.
        let j = judge_mode(&[200.0], &[100.0], 0, GOAL_KEEPALIVE);
        assert_eq!(j.goal_met, None);
    }
}
