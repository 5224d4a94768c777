//! [`Builder`]: a runtime's workers, stages, tasks and policies, set before it starts.

use super::*;

/// Names a stage may not have: the pseudo-stages the ledger and the metrics name on their own
/// (the loop's time, bytes charged from outside, readiness as an edge's source). A stage of
/// one of these names, or of a name starting with `#` (how an unnamed id is shown), would
/// make a second series of the same labels in `/metrics`.
pub const RESERVED_STAGE_NAMES: [&str; 3] = ["loop", "external", "io"];

/// Smallest minimum charge per dispatch ([`Builder::min_cost_ns`]), ns: 0 would turn off the
/// rule that a dispatch that did nothing still advances its tags (so a yield loop cannot hold
/// a node's attention).
pub const MIN_COST_NS_MIN: u64 = 1;
/// Largest minimum charge per dispatch, ns (1 s, longer than any dispatch should run): WFQ
/// multiplies a client's cost estimate by its virtual-time scale, and a huge minimum charge
/// overflowed that product.
pub const MIN_COST_NS_MAX: u64 = 1_000_000_000;

/// Builds a [`Runtime`].
pub struct Builder {
    workers: usize,
    pin: bool,
    bypass: bool,
    min_cost_ns: u64,
    wake_credit_ns: u64,
    affinity_ttl_ns: u64,
    timers_max: usize,
    stages: Vec<StageMeta>,
    factories: Vec<HandlerFactory>,
    activities: ActivityTable,
    pub(super) tasks: Option<task::TaskShared>,
}

impl Default for Builder {
    fn default() -> Self {
        Builder {
            workers: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            pin: false,
            bypass: false,
            min_cost_ns: crate::sched::MIN_COST_DEFAULT,
            wake_credit_ns: 0,
            affinity_ttl_ns: 10_000_000_000,
            timers_max: TIMERS_MAX,
            stages: Vec::new(),
            factories: Vec::new(),
            activities: ActivityTable::new(),
            tasks: None,
        }
    }
}

impl Builder {
    /// Number of worker threads (1..=WORKERS_MAX). Default: the number of CPUs.
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n;
        self
    }
    /// Pin worker `i` to CPU `i % ncpu`.
    pub fn pin(mut self, pin: bool) -> Self {
        self.pin = pin;
        self
    }
    /// Scheduling bypass: a FIFO of ready queues, no accounting and no clock read per dispatch
    /// (its own copy of the worker loop; see `worker::run`), the baseline that the overhead
    /// experiments compare against. Shares and caps do not hold in this mode, gates'
    /// controllers get no feedback, and timers may fire up to 32 dispatches late.
    pub fn bypass(mut self, bypass: bool) -> Self {
        self.bypass = bypass;
        self
    }
    /// Minimum charge per dispatch, ns, in [`MIN_COST_NS_MIN`]..=[`MIN_COST_NS_MAX`]
    /// (checked by [`Builder::start`]).
    pub fn min_cost_ns(mut self, ns: u64) -> Self {
        self.min_cost_ns = ns;
        self
    }
    /// CPU time an activity that wakes may take ahead of the activities that stayed busy, ns
    /// (every fair-queue node of every core's tree; [`crate::sched::Tree::set_wake_credit`]):
    /// a light activity's burst is then served at once rather than at its share, while no
    /// activity gets more than its share over time. 0 (the default) banks nothing; each tree
    /// clamps it to [`crate::sched::WAKE_CREDIT_MAX`].
    pub fn wake_credit_ns(mut self, ns: u64) -> Self {
        self.wake_credit_ns = ns;
        self
    }
    /// Most timers (delayed sends waiting for their time) per worker, 1..=[`TIMERS_MAX`] (the
    /// default; checked by [`Builder::start`]). A delayed send to a core that holds this many
    /// is refused with [`SendError::TooManyTimers`].
    pub fn timers_max(mut self, n: usize) -> Self {
        self.timers_max = n;
        self
    }
    /// How long an affinity mapping lives after its last use.
    pub fn affinity_ttl_ns(mut self, ns: u64) -> Self {
        self.affinity_ttl_ns = ns;
        self
    }
    /// Creates an activity before start (parents must exist).
    pub fn activity(
        mut self,
        path: &str,
        spec: ActivitySpec,
    ) -> Result<(Self, ActivityId), RuntimeError> {
        let id = self.activities.ensure(path, spec)?;
        Ok((self, id))
    }

    /// Registers a stage. `factory(core)` runs on each worker thread to make that core's
    /// handler (per-core state lives in the closure it returns).
    pub fn stage<M, H, F>(
        &mut self,
        name: &str,
        config: StageConfig,
        factory: F,
    ) -> Result<StageRef<M>, RuntimeError>
    where
        M: Send + 'static,
        H: FnMut(&mut Ctx<'_>, M) + 'static,
        F: Fn(usize) -> H + Send + Sync + 'static,
    {
        config.validate().map_err(RuntimeError::Config)?;
        if self.stages.len() >= STAGES_MAX {
            return Err(RuntimeError::Config(format!(
                "more than {STAGES_MAX} stages"
            )));
        }
        if RESERVED_STAGE_NAMES.contains(&name) || name.starts_with('#') {
            return Err(RuntimeError::Config(format!(
                "stage name {name:?} is reserved (the ledger's and the metrics' pseudo-stages \
                 {RESERVED_STAGE_NAMES:?} and names starting with '#')"
            )));
        }
        if self.stages.iter().any(|s| s.name == name) {
            return Err(RuntimeError::Config(format!(
                "stage {name:?} registered twice"
            )));
        }
        let id = self.stages.len() as StageId;
        let stage_name = panic::intern(name);
        self.stages.push(StageMeta {
            name: name.to_string(),
            load: StageLoad::new(config.shared_limit.clone()),
            batch_now: Vec::new(),
            config,
            type_id: TypeId::of::<M>(),
        });
        self.factories.push(Box::new(move |core| {
            worker::erase::<M, H>(id, stage_name, factory(core))
        }));
        Ok(StageRef {
            id,
            _m: PhantomData,
        })
    }

    /// Starts the workers.
    pub fn start(self) -> Result<Runtime, RuntimeError> {
        panic::install();
        if !(1..=WORKERS_MAX).contains(&self.workers) {
            return Err(RuntimeError::Config(format!(
                "workers must be in 1..={WORKERS_MAX}, got {}",
                self.workers
            )));
        }
        if !(1..=TIMERS_MAX).contains(&self.timers_max) {
            return Err(RuntimeError::Config(format!(
                "timers_max must be in 1..={TIMERS_MAX}, got {}",
                self.timers_max
            )));
        }
        if !(MIN_COST_NS_MIN..=MIN_COST_NS_MAX).contains(&self.min_cost_ns) {
            return Err(RuntimeError::Config(format!(
                "min_cost_ns must be in {MIN_COST_NS_MIN}..={MIN_COST_NS_MAX}, got {}",
                self.min_cost_ns
            )));
        }
        let mut polls = Vec::with_capacity(self.workers);
        let mut mailboxes = Vec::with_capacity(self.workers);
        for _ in 0..self.workers {
            let poll = mio::Poll::new().map_err(RuntimeError::Io)?;
            let waker =
                mio::Waker::new(poll.registry(), worker::WAKE_TOKEN).map_err(RuntimeError::Io)?;
            polls.push(poll);
            mailboxes.push(Mailbox {
                messages: crossbeam_queue::ArrayQueue::new(MAILBOX_CAPACITY),
                control: Mutex::new(Vec::new()),
                control_pending: AtomicBool::new(false),
                sleeping: AtomicBool::new(false),
                waker,
            });
        }
        let mut stages = self.stages;
        for s in &mut stages {
            s.batch_now = (0..self.workers)
                .map(|_| std::sync::atomic::AtomicU32::new(s.config.batch_max))
                .collect();
        }
        let ncpu = sys::cpu_count();
        let worker_cpus: Vec<usize> = if self.pin {
            (0..self.workers).map(|core| core % ncpu).collect()
        } else {
            Vec::new()
        };
        let clock = quanta::Clock::new();
        let start_raw = clock.raw();
        let shared = Arc::new(Shared {
            workers: self.workers,
            clock,
            start_raw,
            ledger: Ledger::new(self.workers),
            edges: EdgeCounts::new(self.workers, stages.len()),
            activities: RwLock::new(self.activities),
            stages,
            gates: RwLock::new(HashMap::new()),
            predicates: RwLock::new(HashMap::new()),
            mailboxes,
            core_pending: (0..self.workers).map(|_| CachePadded::default()).collect(),
            core_timers: (0..self.workers).map(|_| CachePadded::default()).collect(),
            footprints: (0..self.workers)
                .map(|_| FootprintCounters::default())
                .collect(),
            timers_max: self.timers_max,
            affinity: AffinityTable::new(AFFINITY_SHARDS, self.affinity_ttl_ns),
            stopping: AtomicBool::new(false),
            bypass: self.bypass,
            min_cost_ns: self.min_cost_ns,
            wake_credit_ns: self.wake_credit_ns,
            tasks: self.tasks,
            worker_cpus,
        });
        let factories = Arc::new(self.factories);
        let rt = Runtime {
            shared: shared.clone(),
            threads: Mutex::new(Vec::with_capacity(self.workers)),
        };
        let (started, reports) = std::sync::mpsc::channel();
        for (core, poll) in polls.into_iter().enumerate() {
            let shared = shared.clone();
            let factories = factories.clone();
            let started = started.clone();
            let pin = shared.worker_cpus.get(core).copied();
            let t = std::thread::Builder::new()
                .name(format!("omnistage-w{core}"))
                .spawn(move || worker::run(core, pin, shared, &factories, poll, started))
                // Dropping `rt` stops and joins the workers started so far.
                .map_err(RuntimeError::Io)?;
            rt.threads.lock().expect("threads lock").push(t);
        }
        drop(started);
        // Every worker says it runs, or why not; one that ends before saying (a stage's
        // factory panicked) drops its sender, and once all have, `recv` fails.
        let mut failure = None;
        for _ in 0..self.workers {
            match reports.recv() {
                Ok((_, Ok(()))) => {}
                Ok((core, Err(e))) => {
                    let e = std::io::Error::new(e.kind(), format!("worker {core}: {e}"));
                    failure.get_or_insert(e);
                }
                Err(_) => {
                    failure.get_or_insert(std::io::Error::other(
                        "a worker ended while starting (a stage's factory panicked?)",
                    ));
                    break;
                }
            }
        }
        match failure {
            // Dropping `rt` stops and joins the workers that did start.
            Some(e) => Err(RuntimeError::Io(e)),
            None => Ok(rt),
        }
    }
}
