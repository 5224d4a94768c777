//! omnistage's experiments, behind `omnistage exp NAME` (the binary in `omnistage-cli` calls
//! [`run`]). Each prints a table by default, or one JSON object with `--json`, and with `--out DIR`
//! writes NAME.json, a page NAME.md and an SVG chart. They measure on real clocks and are
//! benchmarks, never tests. This crate owns the peers' launchers (nginx, started pinned), the
//! pages and charts (`report`), and `exp all`, which writes the index of results.

mod adversary;
mod all;
mod args;
mod attribution;
mod awake;
mod backend;
mod breakdown;
mod cfgweb;
mod classes;
mod connections;
mod cpu;
mod fleet;
mod harness;
mod http_vs_nginx;
mod isolation;
pub(crate) mod nginx;
mod overhead;
mod priority;
mod proxy_vs_nginx;
mod recheck;
pub(crate) mod report;
mod rounds;
mod sched_cost;
mod shape;
mod shaping;
mod share;
mod shared_backend;
mod soak;
mod specweb;
mod spike;
mod tasks;
mod tls;
pub(crate) mod util;
mod web;
mod windowing;

use clap::{Args, Subcommand};

#[derive(Args)]
pub struct ExpArgs {
    #[command(subcommand)]
    which: Which,
}

pub use args::Common;

#[derive(Subcommand)]
enum Which {
    /// One CPU-bound activity per weight, spread over the workers; measured shares vs targets.
    CpuShare(cpu::CpuShareArgs),
    /// Weights 1:1; activity A confined to worker 0, B spread over all: water-filled shares.
    CrossCore(cpu::CrossCoreArgs),
    /// Scheduler cost per event by policy and active leaves, and runtime overhead vs a bypass.
    SchedCost(sched_cost::SchedCostArgs),
    /// The HTTP server with tenants 50/33/17 offered more than their shares.
    WebShare(web::WebShareArgs),
    /// omnistage and nginx side by side: one worker each, 1 KiB file, 64 keep-alive conns.
    HttpVsNginx(http_vs_nginx::HttpVsNginxArgs),
    /// The same backend behind omnistage's proxy and nginx's: req/s and proxy CPU per request.
    ProxyVsNginx(proxy_vs_nginx::ProxyVsNginxArgs),
    /// A 16-slot upstream whose backend takes 20 ms: tenant a's p99 alone and while b floods; fair vs FIFO vs nginx max_conns.
    SharedBackend(shared_backend::SharedBackendArgs),
    /// Unattributed core time under web load, light and saturated (Omni-Kernel §IV).
    Attribution(attribution::AttributionArgs),
    /// Charged CPU per stage and per request vs requests per connection (Vortex Fig. 7).
    Breakdown(breakdown::BreakdownArgs),
    /// Worker CPU per request at equal rate, scheduled vs FIFO bypass (Omni-Kernel §V-G).
    Overhead(overhead::OverheadArgs),
    /// Two overloaded tenants at 2:1, 4:1 and strict priority: shares over time (Vortex Figs. 8-10).
    Isolation(isolation::IsolationArgs),
    /// A tenant's net_cap at several rates, token and leaky bucket: achieved vs cap (TAP Fig. 3).
    Shaping(shaping::ShapingArgs),
    /// Unmodified programs under `omnistage shape`: curl at 64 KiB/s..100 MiB/s, cat/dd overhead, groups (TAP Fig. 3, Table 2).
    Shape(shape::ShapeExpArgs),
    /// Open-loop load stepping 0.5x -> 10x -> 0.5x capacity, with and without a p90 target (SEDA Fig. 55).
    OverloadSpike(spike::SpikeArgs),
    /// Two classes of 128 clients, the high class joining mid-run, with and without class priorities (SEDA Figs. 58-59).
    Classes(classes::ClassesArgs),
    /// Requests/s and resident memory per connection at 100..10000 keep-alive connections (SEDA Fig. 7).
    Connections(connections::ConnectionsArgs),
    /// SPECweb99-like static load at 64..4096 clients, omnistage vs nginx (SEDA Fig. 39).
    Specweb(specweb::SpecwebArgs),
    /// One capped tenant, files 1 KiB..1 MiB: response time by size per send order (TAP Fig. 6).
    Priority(priority::PriorityArgs),
    /// A victim tenant at half load, alone and attacked by a co-hosted tenant; vs nginx (QLinux LRP, TAP §1).
    Adversary(adversary::AdversaryArgs),
    /// Three nodes and a Redis: fleet-wide shares under skewed ingress, a fleet cap, faults.
    Fleet(fleet::FleetArgs),
    /// hyper on omnistage's async tasks vs on Tokio's current-thread runtime: shares, req/s, ns per poll.
    Tasks(tasks::TasksArgs),
    /// TLS 1.3 new connections/s and keep-alive requests/s over TLS, omnistage vs nginx.
    Tls(tls::TlsArgs),
    /// `omnistage serve` for --minutes under mixed load and faults: no panic, 500 or wrong byte; RSS and descriptors flat; shares in the quiet windows.
    Soak(soak::SoakArgs),
    /// Recomputes each share experiment's verdict from the raw counts in its JSON (--dir).
    Recheck(recheck::RecheckArgs),
    /// Runs every experiment briefly, writing JSON, pages, charts and README.md into --out.
    All(all::AllArgs),
}

pub fn run(args: ExpArgs) -> Result<(), String> {
    match args.which {
        Which::CpuShare(a) => cpu::cpu_share(a),
        Which::CrossCore(a) => cpu::cross_core(a),
        Which::SchedCost(a) => sched_cost::run(a),
        Which::WebShare(a) => web::run(a),
        Which::HttpVsNginx(a) => http_vs_nginx::run(a),
        Which::ProxyVsNginx(a) => proxy_vs_nginx::run(a),
        Which::SharedBackend(a) => shared_backend::run(a),
        Which::Attribution(a) => attribution::run(a),
        Which::Breakdown(a) => breakdown::run(a),
        Which::Overhead(a) => overhead::run(a),
        Which::Isolation(a) => isolation::run(a),
        Which::Shaping(a) => shaping::run(a),
        Which::Shape(a) => shape::run(a),
        Which::OverloadSpike(a) => spike::run(a),
        Which::Classes(a) => classes::run(a),
        Which::Connections(a) => connections::run(a),
        Which::Specweb(a) => specweb::run(a),
        Which::Priority(a) => priority::run(a),
        Which::Adversary(a) => adversary::run(a),
        Which::Fleet(a) => fleet::run(a),
        Which::Tasks(a) => tasks::run(a),
        Which::Tls(a) => tls::run(a),
        Which::Soak(a) => soak::run(a),
        Which::Recheck(a) => recheck::run(a),
        Which::All(a) => all::run(a),
    }
}
