//! `omnistage serve`: runs the multi-tenant HTTP server until SIGTERM or SIGINT (graceful drain),
//! reloading its config on SIGHUP, with the admin API and dashboard on a separate listener
//! (`--admin`, default 127.0.0.1:9090; `--admin off` disables it), and, with a `[cluster]`
//! section, as a node of a fleet (crate omnistage-fleet, docs/fleet.md).

use clap::Args;
use omnistage_admin::{start_admin_with_tenants, AdminConfig, Served, TOKEN_ENV};
use omnistage_fleet::{FleetNode, NodeConfig};
use omnistage_http::config::default_config;
use omnistage_http::persist::ConfigFile;
use omnistage_http::server::{Server, ServerOptions, DRAIN_GRACE_MAX};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Args)]
pub struct ServeArgs {
    /// Config file (TOML). Without one, an embedded default serves the current directory for
    /// one tenant on 127.0.0.1:8080.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Worker threads (overrides the config), 1..=256 (the runtime's limit).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new()
        .range(1..=omnistage::exec::WORKERS_MAX as u64))]
    workers: Option<usize>,
    /// Pin worker i to CPU i (the disk readers then stay on the workers' CPUs, at nice 19).
    #[arg(long)]
    pin: bool,
    /// Scheduling bypass (FIFO, no accounting, no clock read per dispatch): a baseline for
    /// measurements only.
    #[arg(long)]
    bypass: bool,
    /// Seconds open connections get to finish after SIGTERM (at most a day); a second SIGTERM
    /// or SIGINT stops at once.
    #[arg(long, default_value_t = 10,
        value_parser = clap::value_parser!(u64).range(0..=DRAIN_GRACE_MAX.as_secs()))]
    drain_s: u64,
    /// Admin API and dashboard listener (`ADDR:PORT`), or `off`.
    #[arg(long, default_value = omnistage_admin::DEFAULT_LISTEN)]
    admin: String,
    /// Bearer token the admin API requires (default: the OMNISTAGE_ADMIN_TOKEN environment
    /// variable); mandatory when `--admin` is not a loopback address.
    #[arg(long)]
    admin_token: Option<String>,
}

/// Writes one line to stderr, ignoring a failure: `eprintln!` panics when stderr is gone (a
/// closed pipe, a full disk), and here that was the thread that handles SIGHUP and SIGTERM,
/// so a reload or a drain killed the server instead.
fn warn(line: std::fmt::Arguments<'_>) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// The admin listener's settings from the command line, or `None` for `--admin off`.
fn admin_config(a: &ServeArgs) -> Result<Option<AdminConfig>, String> {
    if a.admin == "off" {
        return Ok(None);
    }
    let listen: SocketAddr = a
        .admin
        .parse()
        .map_err(|_| format!("--admin {:?}: want ADDR:PORT or off", a.admin))?;
    let token = a
        .admin_token
        .clone()
        .or_else(|| std::env::var(TOKEN_ENV).ok().filter(|t| !t.is_empty()));
    let cfg = AdminConfig {
        listen,
        token,
        ..Default::default()
    };
    // Refused before the server starts serving (it once printed where it served, then
    // refused to start the admin API and exited).
    cfg.validate()
        .map_err(|e| format!("{e} (use --admin ADDR:PORT, or --admin off)"))?;
    Ok(Some(cfg))
}

pub fn run(a: ServeArgs) -> Result<(), String> {
    // The file's bytes are kept: `?persist=true` writes changes back only to the file they
    // were loaded from (refused once it changed on disk).
    let (config, file) = match &a.config {
        Some(p) => {
            let (c, f) = ConfigFile::load(p).map_err(|e| e.to_string())?;
            (c, Some(f))
        }
        None => {
            let cwd = std::env::current_dir().map_err(|e| format!("current directory: {e}"))?;
            (default_config(&cwd), None)
        }
    };
    let admin_cfg = admin_config(&a)?;
    let cluster = config.cluster.clone();
    let node_cfg = cluster.as_ref().map(NodeConfig::from_cluster).transpose()?;
    let tenants: Vec<String> = config.tenants.iter().map(|t| t.name.clone()).collect();
    let schemes: Vec<&str> = config
        .server
        .listeners()
        .map(|(_, tls)| if tls { "https" } else { "http" })
        .collect();
    // The handlers first: a SIGTERM while the server starts waits for the loop below instead
    // of killing the process with the default action.
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])
        .map_err(|e| format!("cannot install signal handlers: {e}"))?;
    let server = Server::start(
        config,
        ServerOptions {
            pin: a.pin,
            workers: a.workers,
            bypass: a.bypass,
        },
    )?;
    for (addr, scheme) in server.local_addrs().iter().zip(schemes) {
        warn(format_args!(
            "omnistage: serving {} tenant(s) [{}] on {scheme}://{addr}/ with {} worker(s)",
            tenants.len(),
            tenants.join(", "),
            server.runtime().workers()
        ));
    }
    // The admin server and the fleet thread share the server (and through it the runtime)
    // until they are stopped.
    let server = Arc::new(Served::new(server, file));
    let mut fleet = match node_cfg {
        None => None,
        Some(cfg) => {
            warn(format_args!(
                "omnistage: node {} of the fleet at {}, syncing every {} ms",
                cfg.node,
                cfg.redis,
                cfg.sync.as_millis()
            ));
            Some(FleetNode::start(server.shared_server(), cfg)?)
        }
    };
    let mut admin = match admin_cfg {
        None => None,
        Some(cfg) => {
            let h = start_admin_with_tenants(server.clone(), Served::runtime, cfg)
                .map_err(|e| format!("{e} (use --admin ADDR:PORT, or --admin off)"))?;
            warn(format_args!(
                "omnistage: admin API and dashboard on http://{}/",
                h.local_addr()
            ));
            Some(h)
        }
    };
    for sig in signals.forever() {
        if sig != SIGHUP {
            break;
        }
        match server.reload_file() {
            Ok((p, c, reloaded)) => {
                warn(format_args!("omnistage: reloaded {p}"));
                for not_applied in &reloaded.not_applied {
                    warn(format_args!("omnistage: reload: {not_applied}"));
                }
                if c.cluster != cluster {
                    warn(format_args!(
                        "omnistage: reload: [cluster] changes only on restart"
                    ));
                }
                if let Some(f) = &fleet {
                    f.reload(&c);
                }
            }
            Err(e) => warn(format_args!("omnistage: reload: {e}")),
        }
    }
    warn(format_args!("omnistage: draining (up to {} s)", a.drain_s));
    // The server's drain first: its listeners close and its idle connections with them, so
    // clients go elsewhere while the admin API and the fleet thread stop (the admin API
    // finishes the requests it has, which may take seconds).
    server.server().stop_accepting();
    // A second SIGTERM or SIGINT during the drain stops at once (a SIGHUP now is ignored).
    std::thread::spawn(move || {
        if let Some(sig) = signals.forever().find(|&s| s != SIGHUP) {
            warn(format_args!(
                "omnistage: signal {sig} during the drain: stopping at once"
            ));
            std::process::exit(128 + sig);
        }
    });
    if let Some(h) = admin.as_mut() {
        h.stop();
    }
    if let Some(f) = fleet.as_mut() {
        f.stop();
    }
    let server = match Arc::try_unwrap(server).ok().and_then(Served::into_server) {
        Some(s) => s,
        None => return Err("the admin server or the fleet still holds the server".into()),
    };
    server.drain(Duration::from_secs(a.drain_s));
    warn(format_args!("omnistage: stopped"));
    Ok(())
}
