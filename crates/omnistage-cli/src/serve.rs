//! `omnistage serve`: runs the multi-tenant HTTP server until SIGTERM or SIGINT (graceful drain),
//! reloading its config on SIGHUP.

use clap::Args;
use omnistage_http::config::{default_config, load_config};
use omnistage_http::server::{Server, ServerOptions};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args)]
pub struct ServeArgs {
    /// Config file (TOML). Without one, an embedded default serves the current directory for
    /// one tenant on 127.0.0.1:8080.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Worker threads (overrides the config).
    #[arg(long)]
    workers: Option<usize>,
    /// Pin worker i to CPU i.
    #[arg(long)]
    pin: bool,
    /// Scheduling bypass (FIFO, no accounting): a baseline for measurements only.
    #[arg(long)]
    bypass: bool,
    /// Seconds open connections get to finish after SIGTERM.
    #[arg(long, default_value_t = 10)]
    drain_s: u64,
}

pub fn run(a: ServeArgs) -> Result<(), String> {
    let config = match &a.config {
        Some(p) => load_config(p).map_err(|e| e.to_string())?,
        None => {
            let cwd = std::env::current_dir().map_err(|e| format!("current directory: {e}"))?;
            default_config(&cwd)
        }
    };
    let tenants: Vec<String> = config.tenants.iter().map(|t| t.name.clone()).collect();
    let server = Server::start(
        config,
        ServerOptions {
            pin: a.pin,
            workers: a.workers,
            bypass: a.bypass,
        },
    )?;
    for addr in server.local_addrs() {
        eprintln!(
            "omnistage: serving {} tenant(s) [{}] on http://{addr}/ with {} worker(s)",
            tenants.len(),
            tenants.join(", "),
            server.runtime().workers()
        );
    }
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])
        .map_err(|e| format!("cannot install signal handlers: {e}"))?;
    for sig in signals.forever() {
        match sig {
            SIGHUP => match &a.config {
                None => eprintln!("omnistage: SIGHUP: no config file to reload (embedded default)"),
                Some(p) => match load_config(p) {
                    Err(e) => {
                        eprintln!("omnistage: reload refused, the old config keeps serving: {e}")
                    }
                    Ok(c) => match server.reload(c) {
                        Ok(()) => eprintln!("omnistage: reloaded {}", p.display()),
                        Err(e) => eprintln!("omnistage: reload: {e}"),
                    },
                },
            },
            _ => {
                eprintln!("omnistage: draining (up to {} s)", a.drain_s);
                server.drain(Duration::from_secs(a.drain_s));
                eprintln!("omnistage: stopped");
                return Ok(());
            }
        }
    }
    Ok(())
}
