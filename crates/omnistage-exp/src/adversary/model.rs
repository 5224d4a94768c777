//! What the adversary experiment records: per phase, the victim's and the adversary's
//! figures, the worker's stretches, ledger and queue waits; the report over all rounds.

use super::*;

/// What the victim saw in one phase.
#[derive(Serialize, Clone, Default)]
pub(super) struct Victim {
    pub(super) req_per_s: f64,
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
    pub(super) max_ms: f64,
    /// From each request's actual send to the kernel's receipt of its response (the load
    /// generator's `--kernel-stamps`), ms: the latency the server and the loopback caused,
    /// without the generator's own lateness in sending or in waking to read.
    pub(super) kernel_p50_ms: Option<f64>,
    pub(super) kernel_p99_ms: Option<f64>,
    pub(super) errors: u64,
    pub(super) errors_by_kind: serde_json::Value,
    /// Successful responses in the measured window.
    pub(super) requests: u64,
    /// Requests in flight, or due and not sent, at the end of the run: in no latency above.
    pub(super) unfinished: u64,
    /// How long the oldest of them had waited by then, ms (`null`: none).
    pub(super) unfinished_oldest_ms: Option<f64>,
}

/// What the adversary got in one phase.
#[derive(Serialize, Clone, Default)]
pub(super) struct Adversary {
    pub(super) flood_req_per_s: f64,
    pub(super) flood_errors: u64,
    /// The flood's latency quantiles, ms, by its own clients (closed loop, from each send; the
    /// clients' delays included: they run under SCHED_IDLE beside the victim's generator).
    /// With few flood connections the flood is a busy tenant: what a wake credit costs a
    /// tenant that never idles (`--wake-credit-us` A/B; `--attack-kernel-stamps` for the part
    /// the server and the loopback caused).
    pub(super) flood_p50_ms: f64,
    pub(super) flood_p99_ms: f64,
    /// The same from each send to the kernel's receipt of the response (`null` without
    /// `--attack-kernel-stamps`).
    pub(super) flood_kernel_p50_ms: Option<f64>,
    pub(super) flood_kernel_p99_ms: Option<f64>,
    pub(super) large_bytes_per_s: f64,
    pub(super) large_errors: u64,
    pub(super) slow_reader_bytes_per_s: f64,
    pub(super) slow_reader_responses_done: u64,
    pub(super) slow_reader_reconnects: u64,
    /// Slowloris connections open at the end of the phase.
    pub(super) slowloris_open_at_end: usize,
    /// Slowloris connections the server closed (timeouts, errors) during the phase.
    pub(super) slowloris_closed_by_server: u64,
    pub(super) slowloris_bytes_sent: u64,
}

/// The stretches of one phase, µs (quantiles within a bucket's width; see
/// `omnistage::account::Histogram`).
#[derive(Serialize, Clone, Default)]
pub(super) struct Stretches {
    pub(super) dispatches: u64,
    pub(super) dispatch_p99_us: f64,
    pub(super) dispatch_max_us: f64,
    pub(super) io_rounds: u64,
    pub(super) io_round_p99_us: f64,
    pub(super) io_round_max_us: f64,
}

impl Stretches {
    pub(super) fn between(before: &[StretchRow], after: &[StretchRow]) -> Stretches {
        let (mut d, mut io) = (HistSnapshot::default(), HistSnapshot::default());
        for (b, e) in before.iter().zip(after) {
            d.add(&e.dispatch.since(&b.dispatch));
            io.add(&e.io_round.since(&b.io_round));
        }
        let us = |h: &HistSnapshot, q: f64| h.percentile(q).map_or(0.0, |v| v as f64 / 1e3);
        Stretches {
            dispatches: d.count(),
            dispatch_p99_us: us(&d, 0.99),
            dispatch_max_us: us(&d, 1.0),
            io_rounds: io.count(),
            io_round_p99_us: us(&io, 0.99),
            io_round_max_us: us(&io, 1.0),
        }
    }

    /// The larger p99 of the two kinds: the figure the goal bounds.
    pub(super) fn p99_us(&self) -> f64 {
        self.dispatch_p99_us.max(self.io_round_p99_us)
    }
}

/// CPU the omnistage worker charged per activity during a phase, ms.
#[derive(Serialize, Clone, Default)]
pub(super) struct Ledger {
    pub(super) infra_cpu_ms: f64,
    pub(super) victim_cpu_ms: f64,
    pub(super) adversary_cpu_ms: f64,
    pub(super) idle_ms: f64,
    pub(super) elapsed_ms: f64,
}

/// How long the victim's messages waited in the omnistage worker's queues in one phase (every
/// stage, from enqueue to the start of their dispatch; the runtime's own histograms), µs.
#[derive(Serialize, Clone, Default)]
pub(super) struct QueueWait {
    pub(super) messages: u64,
    pub(super) p50_us: f64,
    pub(super) p99_us: f64,
    pub(super) max_us: f64,
}

impl QueueWait {
    /// `activity`'s queue waits between two readings of the runtime's latency rows.
    pub(super) fn between(before: &[LatencyRow], after: &[LatencyRow], activity: u32) -> QueueWait {
        let mut h = HistSnapshot::default();
        for e in after.iter().filter(|r| r.activity == activity) {
            let b = before
                .iter()
                .find(|b| (b.activity, b.stage, b.core) == (e.activity, e.stage, e.core));
            h.add(&b.map_or(e.wait, |b| e.wait.since(&b.wait)));
        }
        let us = |q: f64| h.percentile(q).map_or(0.0, |v| v as f64 / 1e3);
        QueueWait {
            messages: h.count(),
            p50_us: us(0.5),
            p99_us: us(0.99),
            max_us: us(1.0),
        }
    }
}

#[derive(Serialize, Clone)]
pub(super) struct Phase {
    pub(super) server: &'static str,
    /// The round (1-based): servers alternate round by round (`--repeats`).
    pub(super) round: usize,
    /// "alone", "all" (every selected attack at once) or one attack kind, with the victim in
    /// open loop; "closed-alone" and "closed-all" with the victim in closed loop.
    pub(super) phase: String,
    pub(super) victim_rate_per_s: f64,
    pub(super) victim: Victim,
    pub(super) adversary: Option<Adversary>,
    /// attacked p99 / alone p99 of the same server; None when either phase's victim got no
    /// answer at all (a p99 of nothing is not 0 ms, and the ratio would read as a win).
    pub(super) p99_ratio: Option<f64>,
    /// The same ratio of the kernel-stamped p99s (send → the kernel's receipt).
    pub(super) kernel_p99_ratio: Option<f64>,
    /// The victim's clients' own windows of the measured window ([`VICTIM_WINDOW_MS`] each,
    /// the load generator's `--window-ms`), and the largest p99 among them.
    pub(super) victim_windows: Vec<ClientWindow>,
    pub(super) victim_window_p99_max_ms: Option<f64>,
    pub(super) ledger: Option<Ledger>,
    /// omnistage: how long the worker's loop was held by each dispatch and each I/O round in
    /// the measured window (its own stamps), the stretches in which it could not pick the
    /// victim's work.
    pub(super) stretches: Option<Stretches>,
    /// omnistage: the victim's messages' waits in the worker's queues: the part of its latency
    /// that the worker's scheduling decided.
    pub(super) victim_queue_wait: Option<QueueWait>,
    /// Time the victim's generator thread waited for CPU 1 in the measured window (the OS's
    /// run queue), ms: latency the server did not cause.
    pub(super) victim_generator_runqueue_ms: Option<f64>,
    /// Time the server's worker waited for CPU 0 in the measured window, ms (other processes
    /// on the machine).
    pub(super) server_runqueue_ms: Option<f64>,
    /// Time the hypervisor took from the server's CPU and from the clients' CPU in the measured
    /// window (steal, by /proc/stat, in 10 ms ticks), ms: time neither the server nor its
    /// clients ran, and that no run-queue figure shows.
    pub(super) server_cpu_steal_ms: Option<f64>,
    pub(super) load_cpu_steal_ms: Option<f64>,
    /// The hypervisor took more than [`STEAL_DISTURBED_FRACTION`] of the window from either CPU.
    pub(super) disturbed: bool,
    /// This phase or the alone phase its ratios compare it with was disturbed: its round is
    /// left out of the verdict's medians.
    pub(super) ratio_disturbed: bool,
}

#[derive(Serialize)]
pub(super) struct Report {
    pub(super) experiment: &'static str,
    pub(super) machine: String,
    pub(super) seconds: f64,
    pub(super) attacks: Vec<String>,
    pub(super) victim_conns: usize,
    pub(super) victim_cpu: f64,
    pub(super) victim_weight: u32,
    pub(super) wake_credit_us: u64,
    pub(super) victim_spin_us: u64,
    pub(super) small_file_bytes: usize,
    pub(super) large_file_bytes: usize,
    pub(super) flood_conns: usize,
    pub(super) large_conns: usize,
    pub(super) slow_readers: usize,
    pub(super) slowloris_conns: usize,
    pub(super) adversary_idle: bool,
    /// The attack's clients stamped their responses in the kernel (`--attack-kernel-stamps`).
    pub(super) attack_kernel_stamps: bool,
    pub(super) omnistage_config: String,
    pub(super) nginx_config: String,
    /// Closed-loop capacity of the victim alone, req/s, per server.
    pub(super) capacity_req_per_s: Vec<(String, f64)>,
    /// The sizing pre-runs: per server, each open-loop rate tried and the fraction of the
    /// worker's CPU (OS clock, schedstat) the victim used at it.
    pub(super) victim_sizing: Vec<Sizing>,
    pub(super) phases: Vec<Phase>,
    pub(super) repeats: usize,
    /// The CPUs nginx's worker was allowed, read from /proc after each of its rounds.
    pub(super) peer_cpus: Vec<String>,
    pub(super) nginx_note: Option<String>,
    /// nginx's configuration, picked by a pre-run of each standard choice on the victim's
    /// workload alone (closed-loop capacity).
    pub(super) nginx_tuning: Option<nginx::TuningChoice>,
    /// Set when the flood was shrunk to fit the open-files limit.
    pub(super) fd_note: Option<String>,
    /// omnistage's victim p99 under the combined attack / alone.
    pub(super) omnistage_p99_ratio: Option<f64>,
    pub(super) nginx_p99_ratio: Option<f64>,
    /// Rounds in which each server's victim got no answer at all under the combined attack
    /// (no ratio then: it is a miss, not a 0×).
    pub(super) omnistage_victim_unanswered_rounds: usize,
    pub(super) nginx_victim_unanswered_rounds: usize,
    /// Rounds read by the verdict in which omnistage's victim, alone or attacked, left more
    /// requests unfinished at the end than 1/99 of those it completed: its p99 may then be an
    /// unfinished request's, which nobody measured, and the goal is not judged.
    pub(super) omnistage_victim_unsettled_rounds: usize,
    /// The same ratios with the victim in closed loop (`closed-all` over `closed-alone`).
    pub(super) omnistage_closed_p99_ratio: Option<f64>,
    pub(super) nginx_closed_p99_ratio: Option<f64>,
    /// omnistage_p99_ratio ≤ 1.5, and omnistage_closed_p99_ratio ≤ 1.5 when the closed loop
    /// ran, and the victim had no errors under attack; `null` as well when a round read left
    /// too many requests unfinished (`omnistage_victim_unsettled_rounds`).
    pub(super) goal_met: Option<bool>,
    /// The ratios of the kernel-stamped p99s (each request's send → the kernel's receipt of
    /// its response; medians over rounds), and the same goal judged on omnistage's: the
    /// server's and the loopback's part of the victim's latency, the generator's own delays
    /// (its run-queue wait among them) left out.
    pub(super) omnistage_kernel_p99_ratio: Option<f64>,
    pub(super) nginx_kernel_p99_ratio: Option<f64>,
    pub(super) omnistage_closed_kernel_p99_ratio: Option<f64>,
    pub(super) nginx_closed_kernel_p99_ratio: Option<f64>,
    pub(super) kernel_goal_met: Option<bool>,
    /// Under the combined attack (median over rounds), the larger of the worker's dispatch and
    /// I/O-round p99s, µs, and whether it is within [`STRETCH_P99_GOAL_US`].
    pub(super) stretch_p99_us: Option<f64>,
    pub(super) stretch_goal_met: Option<bool>,
    /// Largest run-queue wait of the server's worker or the victim's generator in any phase, as
    /// a fraction of the measured window: above 0.1 the machine was busy with other work and
    /// the latencies say more about it than about the servers.
    pub(super) runqueue_fraction_max: Option<f64>,
    /// Phases without an attack ran with both CPUs kept from halting ([`awake::KeepAwake`]).
    pub(super) keep_awake: bool,
    /// omnistage's rounds left out of the verdicts because the hypervisor disturbed their alone
    /// or attacked phase (in either loop).
    pub(super) omnistage_rounds_disturbed: Vec<String>,
}
