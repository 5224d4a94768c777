//! The worker thread's loop: take mail, fire timers, poll I/O, pick a leaf through the tree,
//! dispatch it, charge what it cost (the tree, the ledger, the histograms), and sleep in
//! `epoll_wait` when nothing is ready. Every stretch between two clock reads is charged to a
//! dispatch, to the loop (`/infra`) or to idle; see the module docs of `exec`.

use super::*;

/// Loop-level time, accumulated locally and published every `FLUSH_INTERVAL_NS`.
#[derive(Default)]
struct LoopTime {
    idle_ns: u64,
    infra_ns: u64,
    dispatch_ns: u64,
    /// The part of `infra_ns` spent around sleeps by the OS's clocks (CPU in the blocking poll,
    /// run-queue wait after a wake-up).
    wake_ns: u64,
    /// Σ half the length of each OS CPU-clock read the loop stamped (see
    /// `CoreCounters::os_read_uncertainty_ns`).
    read_uncertainty_ns: u64,
}

/// The clock reading halfway between two readings (`a` first).
fn raw_midpoint(a: u64, b: u64) -> u64 {
    a.wrapping_add(b.wrapping_sub(a) / 2)
}

/// The thread's CPU clock (ns) and the instant it stands for: our clock at the midpoint of
/// the read, whose half length is added to `uncertainty_ns` (the OS samples somewhere inside
/// the system call).
fn stamped_cpu_read(clock: &quanta::Clock, uncertainty_ns: &mut u64) -> (u64, u64) {
    let pre = clock.raw();
    let cpu = sys::thread_cpu_ns();
    let post = clock.raw();
    *uncertainty_ns += clock.delta_as_nanos(pre, post) / 2;
    (raw_midpoint(pre, post), cpu)
}

/// The worker thread's body: one copy of the loop per mode, chosen once here, so the
/// scheduled loop carries no test of the mode per dispatch and the bypass carries none of the
/// accounting.
///
/// The bypass (`Builder::bypass`) is the baseline the overhead experiments compare against: a
/// FIFO of ready queues, no tree, no ledger cells or histograms, no batch-size or admission
/// controller feedback, and no clock read per dispatch. It reads the clock once every
/// [`IO_POLL_EVERY_DISPATCHES`] dispatches (for timers, the I/O poll and the 10 ms counter
/// flush, which still publishes the OS's CPU clock of the thread) and around sleeps; messages
/// keep their enqueue stamp field, filled with that last reading (a store, no clock read). It
/// still counts messages handled (`handled`, one add per dispatch) and the pending count each
/// core keeps for routing.
///
/// The worker reports through `started` once it is set up (its tasks, its handlers, its
/// state), or why it could not be: [`Builder::start`](super::super::Builder::start) waits for
/// every worker's report and fails if one did not start (a worker that ended early once left
/// `start` returning `Ok` and its core's mailbox taking messages nobody would handle).
pub(crate) fn run(
    core: usize,
    pin: Option<usize>,
    shared: Arc<Shared>,
    factories: &[HandlerFactory],
    poll: mio::Poll,
    started: Started,
) {
    if shared.bypass {
        run_loop::<false>(core, pin, shared, factories, poll, started)
    } else {
        run_loop::<true>(core, pin, shared, factories, poll, started)
    }
}

/// Where a worker reports its start-up: its core and whether it is running.
pub(crate) type Started = std::sync::mpsc::Sender<(usize, std::io::Result<()>)>;

fn run_loop<const ACCOUNTED: bool>(
    core: usize,
    pin: Option<usize>,
    shared: Arc<Shared>,
    factories: &[HandlerFactory],
    mut poll: mio::Poll,
    started: Started,
) {
    // Tasks on this core live in this thread's task state until the worker ends.
    let _tasks = match crate::exec::task::enter_worker(core, &shared, poll.registry()) {
        Ok(t) => t,
        Err(e) => {
            let e = std::io::Error::new(e.kind(), format!("cannot set up tasks: {e}"));
            let _ = started.send((core, Err(e)));
            return;
        }
    };
    if let Some(cpu) = pin {
        if let Err(e) = sys::pin_to(cpu) {
            eprintln!("omnistage: worker {core}: cannot pin to CPU {cpu}: {e}");
        }
    }
    let shared: &Shared = &shared;
    let mut handlers: Vec<Option<Box<dyn ErasedStage>>> =
        factories.iter().map(|f| Some(f(core))).collect();
    let registry = match poll.registry().try_clone() {
        Ok(r) => r,
        Err(e) => {
            let e = std::io::Error::new(e.kind(), format!("cannot clone the poll registry: {e}"));
            let _ = started.send((core, Err(e)));
            return;
        }
    };
    let mut st = CoreState::new(core, shared, &handlers, registry);
    // Running from here on (`start` no longer listens once every worker reported). A panic
    // before this (a stage's factory) drops the sender unsent, which `start` sees too.
    let _ = started.send((core, Ok(())));
    drop(started);
    let mut dispatches_since_poll = 0u32;
    let mut batching: Vec<Option<StageBatching>> = shared
        .stages
        .iter()
        .map(|s| {
            s.config.adaptive_batch.then(|| StageBatching {
                controller: crate::admit::BatchingController::new(s.config.batch_max),
                window_messages: 0,
                window_ns: 0,
            })
        })
        .collect();
    let mut last_poll_ns = 0u64;
    let mut events = mio::Events::with_capacity(IO_EVENTS_PER_POLL);
    // epoll's own timeout is in whole milliseconds; waits shorter than that go to a timerfd.
    let precise = sys::PreciseTimer::new().ok().and_then(|t| {
        poll.registry()
            .register(
                &mut mio::unix::SourceFd(&t.raw()),
                TIMER_TOKEN,
                mio::Interest::READABLE,
            )
            .ok()
            .map(|_| t)
    });
    let clock = &shared.clock;
    let mailbox = &shared.mailboxes[core];
    let counters = shared.ledger.core(core);
    let infra_cell = shared
        .ledger
        .cell(core, INFRA, LOOP_STAGE)
        .expect("first cell of the core fits");
    let mut schedstat = sys::SchedStat::open();
    // Steal is per CPU, so it can be charged to a worker only if the worker owns its CPU.
    let mut steal = pin.map(sys::CpuSteal::open);
    let steal_begin = steal.as_mut().and_then(|s| s.read()).unwrap_or(0);
    let mut flushes = 0u64;
    let cpu_begin = sys::thread_cpu_ns();
    let rq_begin = schedstat.read().map(|(_, w)| w).unwrap_or(0);
    let t_begin = clock.raw();
    let mut wq = WakeQueue::new(rq_begin, t_begin, cpu_begin);
    let mut lost = LostTime::new(shared.ns_of_raw(t_begin), cpu_begin);
    let mut seg_start = t_begin;
    let mut time = LoopTime::default();
    let mut next_flush_ns = 0u64;
    let mut stop = false;
    // The bypass's clock: dispatches since it was last read, and whether the loop found
    // nothing to do on a reading that may be stale (then it reads again before sleeping).
    let mut since_clock = 0u32;
    let mut stale_idle = false;
    let task_stage = shared.tasks.as_ref().map(|t| t.stage() as usize);

    let mut flush = |time: &mut LoopTime, seg_start: &mut u64, wq: &mut WakeQueue| {
        let t = clock.raw();
        if ACCOUNTED {
            time.infra_ns += clock.delta_as_nanos(*seg_start, t);
        }
        *seg_start = t;
        let cpu_now = sys::thread_cpu_ns();
        let t_after_cpu = if ACCOUNTED { clock.raw() } else { t };
        let rq_now = schedstat.read().map(|(_, w)| w);
        if ACCOUNTED {
            // The CPU clock's sample instant, for the segment's edge (as around sleeps).
            let t_cpu = raw_midpoint(t, t_after_cpu);
            time.read_uncertainty_ns += clock.delta_as_nanos(t, t_after_cpu) / 2;
            wq.close_segment(clock.delta_as_nanos(wq.mark_raw, t_cpu), t_cpu, cpu_now);
            if let Some(rq_now) = rq_now {
                let to_wake = wq.settle(rq_now);
                // Inside the room the sleeps left idle: idle_ns cannot go below zero.
                time.idle_ns -= to_wake;
                time.wake_ns += to_wake;
                time.infra_ns += to_wake;
            }
        }
        let cpu = cpu_now.saturating_sub(cpu_begin);
        let rq = rq_now.map(|w| w.saturating_sub(rq_begin)).unwrap_or(0);
        counters.elapsed_ns.set(clock.delta_as_nanos(t_begin, t));
        counters.idle_ns.set(time.idle_ns);
        counters.infra_ns.set(time.infra_ns);
        counters.wake_ns.set(time.wake_ns);
        counters
            .os_read_uncertainty_ns
            .set(time.read_uncertainty_ns);
        counters.dispatch_ns.set(time.dispatch_ns);
        counters.os_cpu_ns.set(cpu);
        counters.os_runqueue_ns.set(rq);
        // /proc/stat is larger than schedstat: read it every 10th flush (100 ms).
        flushes += 1;
        if flushes % 10 == 1 {
            if let Some(st) = steal.as_mut().and_then(|s| s.read()) {
                counters.os_steal_ns.set(st.saturating_sub(steal_begin));
            }
        }
        infra_cell.cpu_ns.set(time.infra_ns);
    };

    while !stop {
        // A plain load first: the locked swap only when there is something (most turns).
        if mailbox.control_pending.load(Ordering::Acquire)
            && mailbox.control_pending.swap(false, Ordering::AcqRel)
        {
            let controls = std::mem::take(&mut *mailbox.control.lock().expect("control lock"));
            for c in controls {
                match c {
                    Control::Upsert(info) => st.upsert(info),
                    Control::Remove(id) => st.remove_activity(id),
                    Control::WakeTask(loc) => crate::exec::task::wake_from_remote(loc),
                    Control::Stop => stop = true,
                }
            }
            st.publish_footprint(shared);
        }
        let mut drained = 0;
        while drained < MAILBOX_DRAIN_MAX {
            match mailbox.messages.pop() {
                Some(d) => d.deliver(&mut st, shared),
                None => break,
            }
            drained += 1;
        }
        if !st.retiring.is_empty() && drained < MAILBOX_DRAIN_MAX {
            // The mailbox is empty: what was sent to the removed activities before their
            // removal is in their queues now.
            st.retire_removed(shared);
        }
        let mut now_raw = seg_start;
        let fresh = ACCOUNTED || stale_idle || since_clock >= IO_POLL_EVERY_DISPATCHES;
        if fresh {
            now_raw = clock.raw();
            st.now_ns = shared.ns_of_raw(now_raw);
            since_clock = 0;
            stale_idle = false;
        }
        if (st.io_live > 0 || crate::exec::task::io_live())
            && (dispatches_since_poll >= IO_POLL_EVERY_DISPATCHES
                || st.now_ns.saturating_sub(last_poll_ns) >= IO_POLL_INTERVAL_NS)
        {
            dispatches_since_poll = 0;
            last_poll_ns = st.now_ns;
            for _ in 0..IO_POLL_ROUNDS_MAX {
                if let Err(e) = poll.poll(&mut events, Some(Duration::ZERO)) {
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        eprintln!("omnistage: worker {core}: poll failed: {e}");
                    }
                }
                st.io_ready(shared, &events);
                if events.iter().count() < IO_EVENTS_PER_POLL {
                    break;
                }
            }
            let round_start = now_raw;
            now_raw = clock.raw();
            st.now_ns = shared.ns_of_raw(now_raw);
            if ACCOUNTED {
                // Fresh at the top of the loop in this mode: the round is stamped for free.
                counters
                    .io_round_hist
                    .record(clock.delta_as_nanos(round_start, now_raw));
            }
        }
        if (st.fire_timers(shared) | crate::exec::task::turn(&mut st, shared)) && ACCOUNTED {
            // Delivering timers and queueing woken tasks is the loop's work (infra), not the
            // next dispatch's.
            now_raw = clock.raw();
            st.now_ns = shared.ns_of_raw(now_raw);
        }
        if let Some(leaf) = st.pick::<ACCOUNTED>() {
            dispatches_since_poll += 1;
            if !ACCOUNTED {
                since_clock += 1;
                let (stage, q, retiring) = {
                    let li = st.leaves[leaf as usize]
                        .as_ref()
                        .expect("picked leaf has info");
                    (li.stage as usize, li.q, li.retiring)
                };
                let batch_max =
                    shared.stages[stage].batch_now[core].load(Ordering::Relaxed) as usize;
                let mut h = handlers[stage].take().expect("handler not re-entered");
                let b = h.run_bypass(&mut st, shared, q, batch_max);
                handlers[stage] = Some(h);
                if b.still_backlogged {
                    st.bypass_ready(leaf);
                } else if retiring {
                    st.retire_if_drained(shared, b.activity);
                }
                if b.panics > 0 {
                    counters.panics.add(u64::from(b.panics));
                }
                counters.handled.add(u64::from(b.messages));
                shared.core_pending[core]
                    .0
                    .fetch_sub(b.messages as usize, Ordering::AcqRel);
                if st.now_ns >= next_flush_ns || stop {
                    flush(&mut time, &mut seg_start, &mut wq);
                    counters.dropped.set(st.dropped);
                    next_flush_ns = st.now_ns + FLUSH_INTERVAL_NS;
                }
                continue;
            }
            time.infra_ns += clock.delta_as_nanos(seg_start, now_raw);
            // `retiring`: its activity was removed; the dispatch that drains it may retire it.
            let (stage, q, retiring) = {
                let li = st.leaves[leaf as usize]
                    .as_ref()
                    .expect("picked leaf has info");
                (li.stage as usize, li.q, li.retiring)
            };
            let batch_max = shared.stages[stage].batch_now[core].load(Ordering::Relaxed) as usize;
            let mut h = handlers[stage].take().expect("handler not re-entered");
            let b = h.run(&mut st, shared, q, batch_max);
            let end_raw = clock.raw();
            let cost = clock.delta_as_nanos(now_raw, end_raw);
            let end_ns = st.now_ns + cost;
            counters.dispatch_hist.record(cost);
            // Tasks woken during the dispatch are queued now, before the charge (enqueued at
            // its end): a task that woke itself, or another of its activity, leaves its leaf
            // backlogged, and the tree keeps it in place instead of taking it out and putting
            // it back (one charge rather than idle + ready). Their queueing is the loop's time.
            let still_backlogged = if crate::exec::task::wakes_pending() {
                let start_ns = std::mem::replace(&mut st.now_ns, end_ns);
                crate::exec::task::queue_wakes(&mut st, shared);
                st.now_ns = start_ns;
                h.backlogged(&mut st, q)
            } else {
                b.still_backlogged
            };
            handlers[stage] = Some(h);
            if task_stage == Some(stage) {
                // One poll per dispatch: the dispatch's length bounds the poll's (within the
                // loop's own few hundred ns), so no clock is read inside the poll itself. A
                // batch of polls timed each (`Batch::longest_ns`).
                let poll_ns = if b.messages > 1 { b.longest_ns } else { cost };
                crate::exec::task::check_poll_length(shared, b.activity, poll_ns);
            }
            if let Some(bc) = &mut batching[stage] {
                bc.window_messages += u64::from(b.messages);
                bc.window_ns += cost;
                if bc.window_ns >= BATCH_WINDOW_NS {
                    let per_s = bc.window_messages as f64 * 1e9 / bc.window_ns as f64;
                    let next = bc.controller.observe(per_s);
                    shared.stages[stage].batch_now[core].store(next, Ordering::Relaxed);
                    bc.window_messages = 0;
                    bc.window_ns = 0;
                }
            }
            // The scheduler is charged what the dispatch ran, not the time the thread lost to
            // preemption in it (the ledger keeps the whole stretch, as the loop's time).
            let sched_cost = lost.run_part(end_ns, cost, sys::thread_cpu_ns);
            st.tree.charge(leaf, sched_cost, still_backlogged, end_ns);
            let cell = &st.leaves[leaf as usize].as_ref().expect("leaf info").cell;
            cell.cpu_ns.add(cost);
            cell.dispatches.add(1);
            cell.messages.add(u64::from(b.messages));
            cell.queue_wait_ns.add(b.wait_ns);
            for &enq in &st.responses {
                cell.wait_hist.record(st.now_ns.saturating_sub(enq));
                cell.response_hist.record(end_ns.saturating_sub(enq));
            }
            if b.panics > 0 {
                cell.panics.add(u64::from(b.panics));
                counters.panics.add(u64::from(b.panics));
            }
            time.dispatch_ns += cost;
            counters.handled.add(u64::from(b.messages));
            shared.core_pending[core]
                .0
                .fetch_sub(b.messages as usize, Ordering::AcqRel);
            if let Some(g) = st.observe_gate.take() {
                if !st.deferred.is_empty() {
                    // Their samples come when their responses are done.
                    let (mut pos, mut next) = (0, 0);
                    let deferred = &st.deferred;
                    st.responses.retain(|_| {
                        let taken = deferred.get(next) == Some(&pos);
                        next += usize::from(taken);
                        pos += 1;
                        !taken
                    });
                    st.deferred.clear();
                }
                for r in st.responses.iter_mut() {
                    *r = end_ns.saturating_sub(*r);
                }
                if !st.responses.is_empty() {
                    g.observe(&st.responses, end_ns);
                }
            }
            seg_start = end_raw;
            if retiring && !still_backlogged {
                // Its last queued message here was handled: free what the core holds for it
                // (the loop's time, in the next segment).
                st.retire_if_drained(shared, b.activity);
            }
        } else {
            if !fresh {
                // The bypass found nothing on a reading up to a round old: read the clock
                // before deciding how long to sleep (a timer may be due by now).
                stale_idle = true;
                continue;
            }
            if ACCOUNTED {
                time.infra_ns += clock.delta_as_nanos(seg_start, now_raw);
            }
            let wait_ns = [
                st.next_timer_ns(),
                st.tree.next_decision_ns(st.now_ns),
                crate::exec::task::next_timer_ns(st.now_ns),
            ]
            .into_iter()
            .flatten()
            .min();
            mailbox.sleeping.store(true, Ordering::SeqCst);
            if !mailbox.messages.is_empty() || mailbox.control_pending.load(Ordering::SeqCst) {
                mailbox.sleeping.store(false, Ordering::SeqCst);
                seg_start = now_raw;
                continue;
            }
            // Wake at least every flush interval so counters stay fresh while idle.
            let wait = wait_ns.unwrap_or(FLUSH_INTERVAL_NS).min(FLUSH_INTERVAL_NS);
            let precise_armed = match &precise {
                Some(t) if wait < 1_000_000 => {
                    t.arm(wait.max(1));
                    true
                }
                _ => false,
            };
            // The OS's CPU clock on each side of the sleep: the kernel's CPU inside the
            // blocking poll (entering it, the wake-up, leaving it) is the runtime's cost of
            // sleeping, not idle time; so is the run-queue wait between the wake-up and
            // running again, settled at the next flush (`WakeQueue`). Two syscalls per sleep:
            // only an idle worker pays them. Each window edge is stamped by our clock at the
            // midpoint of its OS read (a clock read on each side of it): the OS samples its
            // clock somewhere inside the system call, so an edge stamped outside the read
            // leaves part of the read's own CPU on neither side (counted idle: about 1 % of a
            // lightly loaded worker's busy time here, 0.5-1 µs per sleep), and one stamped
            // inside would count that part twice. The midpoint errs by the read's asymmetry.
            // The bypass takes none of these readings.
            let (window_start, cpu_before) = if ACCOUNTED {
                stamped_cpu_read(clock, &mut time.read_uncertainty_ns)
            } else {
                (now_raw, 0)
            };
            if ACCOUNTED {
                let wall = clock.delta_as_nanos(wq.mark_raw, window_start);
                wq.close_segment(wall, window_start, cpu_before);
            }
            if let Err(e) = poll.poll(&mut events, Some(Duration::from_nanos(wait))) {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    eprintln!("omnistage: worker {core}: poll failed: {e}");
                }
            }
            let (window_end, cpu_after) = if ACCOUNTED {
                stamped_cpu_read(clock, &mut time.read_uncertainty_ns)
            } else {
                (0, 0)
            };
            let after = clock.raw();
            let window_end = if ACCOUNTED { window_end } else { after };
            if precise_armed {
                if let Some(t) = &precise {
                    t.arm(0);
                    t.clear();
                }
            }
            mailbox.sleeping.store(false, Ordering::SeqCst);
            let window = clock.delta_as_nanos(window_start, window_end);
            if ACCOUNTED {
                // The OS's readings lie inside the window; never move more than its length.
                let wake = cpu_after.saturating_sub(cpu_before).min(window);
                time.wake_ns += wake;
                time.idle_ns += window - wake;
                wq.sleep_room_ns += window - wake;
                // The next loop segment starts at the wake-up.
                wq.mark_raw = window_end;
                wq.mark_cpu_ns = cpu_after;
                // A sleep is not lost time: the next dispatch's check starts at the wake-up.
                lost = LostTime::new(shared.ns_of_raw(window_end), cpu_after);
                // Arming the sleep is the loop's work; so is the wake. What follows the window
                // falls in the next segment, which starts at `window_end`.
                time.infra_ns += clock.delta_as_nanos(now_raw, window_start) + wake;
            }
            seg_start = window_end;
            st.now_ns = shared.ns_of_raw(after);
            last_poll_ns = st.now_ns;
            dispatches_since_poll = 0;
            st.io_ready(shared, &events);
            // A full batch: take the rest of the kernel's ready list too (see IO_POLL_ROUNDS_MAX).
            let mut rounds = 1;
            while rounds < IO_POLL_ROUNDS_MAX && events.iter().count() >= IO_EVENTS_PER_POLL {
                rounds += 1;
                if poll.poll(&mut events, Some(Duration::ZERO)).is_err() {
                    break;
                }
                st.io_ready(shared, &events);
            }
            if ACCOUNTED {
                // The round after a sleep: from the wake-up to the ready list classified (one
                // clock read per sleep, paid only by a worker that slept).
                let t = clock.raw();
                counters
                    .io_round_hist
                    .record(clock.delta_as_nanos(after, t));
            }
        }
        if st.now_ns >= next_flush_ns || stop {
            flush(&mut time, &mut seg_start, &mut wq);
            counters.dropped.set(st.dropped);
            next_flush_ns = st.now_ns + FLUSH_INTERVAL_NS;
        }
    }
}
