//! `http.boot`: a core's life cycle. `Start` takes this core's listening sockets, registers
//! them and builds the core's [`CoreServer`]; `Drain` stops accepting and closes the
//! connections idle between requests (`timer::start_drain`); `FlushLog` writes out the core's
//! access-log buffer for `Server::drain`. Runs in `/infra`.

use super::conn::READ_CHUNK_BYTES;
use super::core_server::{with_core, CoreServer, CORE, LOG_BUFFER_BYTES};
use super::send_sched::SendSched;
use super::shared::ServerShared;
use super::work::ServeScratch;
use super::Stages;
use crate::request::Limits;
use crate::response::DateCache;
use omnistage::exec::Ctx;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

pub(super) enum Boot {
    Start,
    /// Stop accepting.
    Drain,
    /// Write out this core's access-log buffer; counts itself done.
    FlushLog(Arc<AtomicUsize>),
}

pub(super) fn on_boot(
    ctx: &mut Ctx<'_>,
    m: Boot,
    shared: &Arc<ServerShared>,
    stages: &std::sync::OnceLock<Stages>,
) {
    let stages = *stages.get().expect("stages set before start");
    match m {
        Boot::Start => {
            // The version first: a reload in between is then picked up at the next refresh.
            let live_version = shared.live_version.load(Ordering::Acquire);
            let live = shared.live.read().expect("live lock").clone();
            let core = ctx.core();
            let taken = std::mem::take(&mut shared.listeners.lock().expect("listeners lock")[core]);
            let mut listeners = Vec::new();
            let configured: Vec<_> = live.config.server.listeners().collect();
            for (i, (l, (addr, tls))) in taken.into_iter().zip(configured).enumerate() {
                // Tenants are bound to listeners by the address as configured (port 0 too).
                let mut l = mio::net::TcpListener::from_std(l);
                match ctx.io_register(&mut l, mio::Interest::READABLE, &stages.accept, i as u64) {
                    Ok(h) => listeners.push((l, h, addr, tls)),
                    Err(e) => {
                        // Not `eprintln!`: it panics when stderr is gone.
                        use std::io::Write;
                        let _ = writeln!(
                            std::io::stderr(),
                            "omnistage: core {core}: cannot register listener {addr}: {e}"
                        );
                    }
                }
            }
            let proxy = super::upstream_pool::ProxyCore::new(&live.config, shared.workers);
            CORE.with(|c| {
                *c.borrow_mut() = Some(CoreServer {
                    shared: shared.clone(),
                    stages,
                    live,
                    live_version,
                    send_version: 0,
                    conns: Vec::new(),
                    free: Vec::new(),
                    generations: Vec::new(),
                    listeners,
                    date: DateCache::new(),
                    log: Vec::with_capacity(LOG_BUFFER_BYTES),
                    limits: Limits::default(),
                    files: HashMap::new(),
                    serve_scratch: ServeScratch::default(),
                    proxy,
                    send: SendSched::for_config(
                        &shared.live.read().expect("live lock"),
                        ctx.now_ns(),
                    ),
                    cache_used: 0,
                    cache_by_activity: HashMap::new(),
                    workers: shared.workers,
                    deadlines: Default::default(),
                    scratch: vec![0u8; READ_CHUNK_BYTES].into_boxed_slice(),
                    unclaimed: VecDeque::new(),
                    log_flush_armed: false,
                    draining_since_ns: 0,
                })
            });
            with_core(|cs| super::timer::arm_log_flush(ctx, cs));
        }
        Boot::Drain => {
            with_core(|cs| {
                for (mut l, h, _, _) in cs.listeners.drain(..) {
                    let _ = ctx.io_deregister(h, &mut l);
                }
                cs.flush_log();
                super::timer::start_drain(ctx, cs);
            });
        }
        Boot::FlushLog(done) => {
            with_core(|cs| cs.flush_log());
            done.fetch_add(1, Ordering::AcqRel);
        }
    }
}
