//! The adversary experiment's page: its tables, verdicts and notes from a [`Report`].

use super::*;

pub(super) fn emit(a: &AdversaryArgs, r: &Report) -> Result<(), String> {
    let mut t = Table::new(&[
        "server",
        "phase",
        "victim req/s",
        "p50 ms",
        "p99 ms",
        "max ms",
        "worst 250 ms p99 ms",
        "p99 / alone",
        "send→kernel p99 ms",
        "send→kernel p99 / alone",
        "victim queue wait p99 µs",
        "victim errors",
        "victim unfinished (oldest ms)",
        "victim gen. run-queue ms",
        "server run-queue ms",
        "steal ms (server / clients' CPU)",
        "flood req/s",
        "flood p50 / p99 ms",
        "large MB/s",
        "slow-read KB/s",
        "slowloris open / closed by server",
    ]);
    for p in &r.phases {
        let adv = p.adversary.clone().unwrap_or_default();
        let has = |k: &str| {
            ATTACKED.contains(&p.phase.as_str()) && r.attacks.iter().any(|x| x == k) || p.phase == k
        };
        t.row(vec![
            p.server.into(),
            p.phase.clone(),
            format!("{:.0}", p.victim.req_per_s),
            format!("{:.2}", p.victim.p50_ms),
            format!("{:.2}", p.victim.p99_ms),
            format!("{:.1}", p.victim.max_ms),
            p.victim_window_p99_max_ms
                .map_or("—".into(), |x| format!("{x:.2}")),
            p.p99_ratio.map_or("—".into(), |x| format!("{x:.2}")),
            p.victim
                .kernel_p99_ms
                .map_or("—".into(), |x| format!("{x:.2}")),
            p.kernel_p99_ratio.map_or("—".into(), |x| format!("{x:.2}")),
            p.victim_queue_wait
                .as_ref()
                .map_or("—".into(), |q| format!("{:.0}", q.p99_us)),
            p.victim.errors.to_string(),
            match p.victim.unfinished_oldest_ms {
                Some(age) if p.victim.unfinished > 0 => {
                    format!("{} ({age:.0})", p.victim.unfinished)
                }
                _ => p.victim.unfinished.to_string(),
            },
            p.victim_generator_runqueue_ms
                .map_or("—".into(), |x| format!("{x:.0}")),
            p.server_runqueue_ms
                .map_or("—".into(), |x| format!("{x:.0}")),
            format!(
                "{} / {}{}",
                p.server_cpu_steal_ms
                    .map_or("—".into(), |x| format!("{x:.0}")),
                p.load_cpu_steal_ms
                    .map_or("—".into(), |x| format!("{x:.0}")),
                if p.disturbed { " (disturbed)" } else { "" }
            ),
            if has("many-conns") {
                format!("{:.0}", adv.flood_req_per_s)
            } else {
                "—".into()
            },
            if has("many-conns") {
                format!(
                    "{:.2} / {:.2}{}",
                    adv.flood_p50_ms,
                    adv.flood_p99_ms,
                    adv.flood_kernel_p99_ms
                        .map_or(String::new(), |k| format!(" (send→kernel p99 {k:.2})"))
                )
            } else {
                "—".into()
            },
            if has("large-files") {
                format!("{:.1}", adv.large_bytes_per_s / 1e6)
            } else {
                "—".into()
            },
            if has("slow-readers") {
                format!("{:.0}", adv.slow_reader_bytes_per_s / 1e3)
            } else {
                "—".into()
            },
            if has("slowloris") {
                format!(
                    "{} / {}",
                    adv.slowloris_open_at_end, adv.slowloris_closed_by_server
                )
            } else {
                "—".into()
            },
        ]);
    }
    let mut st = Table::new(&[
        "round",
        "phase",
        "dispatches",
        "dispatch p99 µs",
        "dispatch max µs",
        "I/O rounds",
        "I/O round p99 µs",
        "I/O round max µs",
    ]);
    for p in r.phases.iter().filter(|p| p.server == "omnistage") {
        if let Some(x) = &p.stretches {
            st.row(vec![
                p.round.to_string(),
                p.phase.clone(),
                x.dispatches.to_string(),
                format!("{:.0}", x.dispatch_p99_us),
                format!("{:.0}", x.dispatch_max_us),
                x.io_rounds.to_string(),
                format!("{:.0}", x.io_round_p99_us),
                format!("{:.0}", x.io_round_max_us),
            ]);
        }
    }
    // "1.23× (nginx 4.56×)", or "—" when there is no ratio.
    let pair = |ours: Option<f64>, peer: Option<f64>| match ours {
        Some(x) => format!(
            "{x:.2}×{}",
            peer.map_or(String::new(), |n| format!(" (nginx {n:.2}×)"))
        ),
        None => "—".into(),
    };
    let closed_part = |ours: Option<f64>, peer: Option<f64>| {
        if r.omnistage_closed_p99_ratio.is_some() || r.omnistage_closed_kernel_p99_ratio.is_some() {
            format!(", in closed loop {}", pair(ours, peer))
        } else {
            String::new()
        }
    };
    let kernel_verdict = match r.kernel_goal_met {
        Some(met) => format!(
            "From each request's send to the kernel's receipt of its response (the `send→kernel` columns: the \
             load generator's `--kernel-stamps`, SO_TIMESTAMPNS, so the generator's own lateness in sending and in \
             waking to read is left out), omnistage's victim p99 under the combined attack over its p99 alone: \
             in open loop {}{}: {} on that instrument.",
            pair(r.omnistage_kernel_p99_ratio, r.nginx_kernel_p99_ratio),
            closed_part(r.omnistage_closed_kernel_p99_ratio, r.nginx_closed_kernel_p99_ratio),
            if met { "the goal is met" } else { "the goal is **not met**" },
        ),
        None => String::new(),
    };
    let stretch_verdict = match (r.stretch_p99_us, r.stretch_goal_met) {
        (Some(v), Some(met)) => format!(
            "Stretches under the combined attack (median over rounds of the larger p99): {v:.0} µs: {} \
             (goal ≤ {STRETCH_P99_GOAL_US:.0} µs).",
            if met { "met" } else { "**not met**" }
        ),
        _ => String::new(),
    };
    let mut lt = Table::new(&[
        "phase",
        "infra CPU ms",
        "victim CPU ms",
        "adversary CPU ms",
        "idle ms",
        "elapsed ms",
    ]);
    for p in r.phases.iter().filter(|p| p.server == "omnistage") {
        if let Some(l) = &p.ledger {
            lt.row(vec![
                p.phase.clone(),
                format!("{:.0}", l.infra_cpu_ms),
                format!("{:.0}", l.victim_cpu_ms),
                format!("{:.0}", l.adversary_cpu_ms),
                format!("{:.0}", l.idle_ms),
                format!("{:.0}", l.elapsed_ms),
            ]);
        }
    }
    let verdict = match (r.omnistage_p99_ratio, r.goal_met) {
        (Some(x), met) => format!(
            "**Goal {}**: omnistage's victim p99 under the combined attack over its p99 alone, by its clients: in open \
             loop {x:.2}×{} (goal ≤ 1.5× in each loop, and no victim errors{}).",
            match met {
                Some(true) => "met",
                Some(false) => "not met",
                None => "not judged",
            },
            closed_part(r.omnistage_closed_p99_ratio, None),
            match (met, r.omnistage_victim_unsettled_rounds) {
                (Some(_), _) => String::new(),
                (None, 0) => "; a loop without a ratio".into(),
                (None, n) => format!(
                    "; in {n} of {} rounds the victim, alone or attacked, left more requests \
                     unfinished at the end than 1/99 of those it completed (the `victim \
                     unfinished` column), so its p99 may be one of theirs, which nobody measured",
                    r.repeats
                ),
            }
        ),
        (_, Some(false)) => format!(
            "**Goal not met**: omnistage's victim got no answer at all under the combined attack in {} of {} rounds.",
            r.omnistage_victim_unanswered_rounds, r.repeats
        ),
        _ if r
            .phases
            .iter()
            .filter(|p| p.server == "omnistage" && p.phase == "all")
            .all(|p| p.ratio_disturbed) =>
        {
            format!(
                "**Goal not judged**: the hypervisor disturbed every round's open loop (below){}.",
                r.omnistage_closed_p99_ratio
                    .map_or(String::new(), |c| format!(
                        "; in closed loop the victim's p99 under attack was {c:.2}× alone"
                    ))
            )
        }
        _ => "Goal not judged: no p99 alone to compare with.".into(),
    };
    let unanswered = |n: usize| {
        if n > 0 {
            format!(
                " In {n} of {} rounds its victim got no answer at all under the attack (a miss, not a ratio).",
                r.repeats
            )
        } else {
            String::new()
        }
    };
    let peer = match (r.nginx_p99_ratio, &r.nginx_note) {
        (Some(x), _) => format!(
            "nginx under the same attack: {x:.2}× its p99 alone{}.{}",
            r.nginx_closed_p99_ratio
                .map_or(String::new(), |c| format!(" ({c:.2}× in closed loop)")),
            unanswered(r.nginx_victim_unanswered_rounds)
        ),
        (None, Some(n)) => format!("nginx not measured: {n}."),
        (None, None) if r.nginx_victim_unanswered_rounds > 0 => format!(
            "nginx under the same attack: no ratio.{}",
            unanswered(r.nginx_victim_unanswered_rounds)
        ),
        _ => String::new(),
    };
    let steal_note = format!(
        "A phase in which the hypervisor took more than {:.0} % of the measured window from the server's CPU or the \
         clients' (steal, by /proc/stat, in 10 ms ticks) is marked disturbed: the p99 is the slowest 1 % of the \
         victim's requests, and that much stolen time can be the whole tail by itself. A round whose alone or attacked \
         phase was disturbed is left out of the ratios' medians and the verdicts{}. Victim errors and rounds \
         without any answer count in every round, disturbed or not: stolen time delays answers, it does not \
         lose them.",
        STEAL_DISTURBED_FRACTION * 100.0,
        if r.omnistage_rounds_disturbed.is_empty() {
            " (none was in this run)".to_string()
        } else {
            format!(
                "; omnistage's ratios left out in this run, by round and loop: {}",
                r.omnistage_rounds_disturbed.join(", ")
            )
        }
    );
    let noise = match r.runqueue_fraction_max {
        Some(f) if f > 0.1 => format!(
            "**The machine was busy**: in some phase the server's worker or the victim's generator waited {:.0} % of \
             the measured window in the OS's run queue (other processes on its CPU; see the run-queue columns). Those \
             waits are latency neither server caused; read the figures of such phases as noise, and the goal as unjudged \
             until a run on a quiet machine.",
            f * 100.0
        ),
        Some(f) => format!(
            "The server's worker and the victim's generator waited at most {:.1} % of a window in the OS's run queue.",
            f * 100.0
        ),
        None => String::new(),
    };
    let caps = r
        .capacity_req_per_s
        .iter()
        .map(|(s, c)| format!("{s} {c:.0} req/s"))
        .collect::<Vec<_>>()
        .join(", ");
    // Where nginx's worker ran, as the OS reported it after each round, and the configuration
    // its pre-run picked.
    let confinement = if r.peer_cpus.is_empty() {
        String::new()
    } else {
        let mut cpus = r.peer_cpus.clone();
        cpus.sort_unstable();
        cpus.dedup();
        format!(
            "Rounds: {} per server, alternating; ratios are medians over the rounds. {} (The pre-run measures the \
             victim's workload alone, the 1 KiB file; the attack's large files are not in it.) nginx's worker was \
             confined to CPU {} as read from /proc/PID/status (Cpus_allowed_list) after each of its {} rounds: {}.",
            r.repeats,
            r.nginx_tuning
                .as_ref()
                .map(|c| c.describe())
                .unwrap_or_default(),
            nginx::SERVER_CPU,
            r.peer_cpus.len(),
            cpus.join(", ")
        )
    };
    let doc = Doc {
        title: "adversary: a victim tenant alone and under attack by a co-hosted tenant (QLinux LRP, TAP §1)".into(),
        command: format!(
            "omnistage exp adversary --seconds {} --attacks {}{}",
            a.common.seconds,
            r.attacks.join(","),
            if a.per_kind { " --per-kind" } else { "" }
        ),
        machine: r.machine.clone(),
        intro: vec![
            format!(
                "Two virtual hosts on one server, victim.test and adversary.test. omnistage: one worker pinned to CPU 0, \
                 tenants of weight {} (victim) and 100 (adversary), each with `connections_max = {TENANT_CONNECTIONS_MAX}`, the server's \
                 `connections_max = {SERVER_CONNECTIONS_MAX}`, `header_timeout_ms = {HEADER_TIMEOUT_MS}`, \
                 `keepalive_timeout_ms = {KEEPALIVE_TIMEOUT_MS}` (the defaults), `wake_credit_us = {}`. nginx: one worker on CPU 0, two \
                 `server_name` blocks with `client_header_timeout 10s; keepalive_timeout 5s; send_timeout 10s;`, \
                 sendfile and open_file_cache as its pre-run picked (below), no access log, {SERVER_CONNECTIONS_MAX} worker connections.",
                r.victim_weight, r.wake_credit_us
            ),
            format!(
                "Victim: {VICTIM_CONNS} keep-alive connections, open loop (latency from each request's scheduled \
                 time), a {SMALL_BYTES}-byte file, {}; {} s measured after {WARMUP_S} s warmup per phase. Adversary (all on CPU 1 with the \
                 victim's generator,{}): many-conns = \
                 {} keep-alive connections closed loop on a {SMALL_BYTES}-byte file; large-files = {LARGE_CONNS} \
                 closed-loop connections on a {:.1} MB file; slow-readers = {} connections with SO_RCVBUF {SLOW_RCVBUF_BYTES} \
                 reading {SLOW_READ_BYTES} B per {} ms; slowloris = {} connections sending a never-ending request head \
                 one byte per {} s. The attack starts {} s before the victim's phase.",
                match a.victim_rate {
                    Some(rate) => format!("at a given {rate} req/s"),
                    None => format!(
                        "sized by the server's CPU: the open-loop rate at which the victim alone uses {:.0} % of the \
                         worker's CPU by the OS's clock (its thread's schedstat), found by a pre-run on each server \
                         ({}), the lower of the two used on both (closed-loop capacities alone: {caps}). A victim \
                         that asks for less than its share (half, at equal weights) need not queue behind the \
                         attacker; one that asks for more must",
                        r.victim_cpu * 100.0,
                        r.victim_sizing
                            .iter()
                            .map(|s| s.describe())
                            .collect::<Vec<_>>()
                            .join("; ")
                    ),
                },
                r.seconds,
                if r.adversary_idle {
                    " under SCHED_IDLE, so they take only the CPU the victim's generator leaves and never delay its wakeups"
                } else {
                    ", normal priority"
                },
                r.flood_conns,
                r.large_file_bytes as f64 / 1e6,
                r.slow_readers,
                SLOW_TICK.as_millis(),
                r.slowloris_conns,
                SLOWLORIS_BYTE_EVERY.as_secs(),
                RAMP.as_secs_f64()
            ),
            format!(
                "Goal (issues 5 and 14): the victim's p99 under the combined attack ≤ 1.5× its p99 alone, on omnistage, in \
                 open loop and (phases `closed-alone`, `closed-all`) in closed loop: the same connections, each waiting \
                 connections / rate after every response. {}",
                if r.keep_awake {
                    "In the phases without an attack a SCHED_IDLE thread spins on CPU 0 and on CPU 1 so that neither \
                     halts: on a virtual machine a halted vCPU is resumed late (counted as steal), which only the \
                     phases whose CPUs go idle paid and which made the victim's p99 alone noisy (the attacked \
                     phases keep both CPUs busy themselves; a spinner beside the SCHED_IDLE attackers would share \
                     their CPU)."
                } else {
                    "The CPUs may halt when idle (`--keep-awake false`)."
                }
            ),
        ],
        tables: vec![
            (String::new(), t),
            ("CPU the omnistage worker charged per activity in each phase (ledger, victim's measured window):".into(), lt),
            (format!("Stretches in which the omnistage worker could pick nothing else, by its loop's own stamps \
                      (each dispatch; each I/O round = epoll_wait calls + classifying the ready lists), victim's \
                      measured window; quantiles within a bucket (a quarter octave). Goal: p99 ≤ {STRETCH_P99_GOAL_US:.0} µs \
                      for both:"), st),
        ],
        notes: [verdict, kernel_verdict, stretch_verdict, peer, noise, steal_note, r.fd_note.clone().unwrap_or_default(), confinement]
            .into_iter()
            .filter(|n| !n.is_empty())
            .collect(),
    };
    let cats: Vec<String> = ["omnistage", "nginx"]
        .iter()
        .filter(|s| r.phases.iter().any(|p| p.server == **s))
        .map(|s| s.to_string())
        .collect();
    let get = |s: &str, ph: &str| {
        r.phases
            .iter()
            .find(|p| p.server == s && p.phase == ph)
            .map_or(0.0, |p| p.victim.p99_ms)
    };
    let series = vec![
        (
            "alone".to_string(),
            cats.iter().map(|c| get(c, "alone")).collect(),
        ),
        (
            "attacked (all)".to_string(),
            cats.iter().map(|c| get(c, "all")).collect(),
        ),
    ];
    report::emit("adversary", r, &doc, a.common.json, a.common.out(), |p| {
        report::svg_bars(p, "Victim p99 alone vs attacked", "p99 ms", &cats, &series)
    })
}
