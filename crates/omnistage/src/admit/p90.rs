//! SEDA's 90th-percentile response-time controller ([`P90Params`], [`P90Controller`]) and its
//! per-class form ([`ClassedP90`]: lower classes are cut first).

use super::*;

// ---------------------------------------------------------------------------------------------
// 90th-percentile response-time controller
// ---------------------------------------------------------------------------------------------

/// Longest response-time target and controller timeout accepted: one hour. Anything longer is
/// a unit mistake (seconds written as ns the other way round), not a policy.
pub const P90_TIME_MAX_NS: u64 = 3_600 * 1_000_000_000;
/// Shortest controller timeout: 1 ms. The controller runs on a worker's dispatch loop; windows
/// shorter than that measure noise and spend the loop on sorting.
pub const P90_TIMEOUT_MIN_NS: u64 = 1_000_000;
/// Most samples per controller run. The buffer (8 bytes a sample) is allocated once per
/// controller and sorted on every run, so it must stay small: 10,000 is 80 KB and a sub-ms sort.
pub const P90_NREQ_MAX: u32 = 10_000;
/// Largest multiplicative decrease: dividing by more than 1000 in one step is a cliff, not a
/// controller.
pub const P90_ADJ_D_MAX: f64 = 1000.0;

/// Parameters of the 90th-percentile controller; names and defaults are SEDA's (Fig. 50,
/// seda.md 2.4). Rates are in admissions per second.
///
/// `target_ns` has no meaningful default in SEDA (the administrator sets it); the default here
/// is 1 s, the target of SEDA's Fig. 52 trace, and **should be set** for every stage.
// Not `Copy`: callers hold it in configuration enums and clone it explicitly.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct P90Params {
    /// Target for the smoothed 90th-percentile response time.
    pub target_ns: u64,
    /// Samples per controller run (and the size of the sample buffer).
    pub nreq: u32,
    /// Longest time between runs while samples are waiting.
    pub timeout_ns: u64,
    /// EWMA weight of the previous smoothed value.
    pub alpha: f64,
    /// The rate is increased only when the error is below this (−0.5: below half the target).
    pub err_i: f64,
    /// The rate is decreased whenever the error is above this (0: above the target).
    pub err_d: f64,
    /// Additive increase, in admissions/s per unit of error beyond `c_i`.
    pub adj_i: f64,
    /// Multiplicative decrease: the rate is divided by this.
    pub adj_d: f64,
    /// Error at which the additive increase would be zero.
    pub c_i: f64,
    /// Floor of the rate.
    pub rate_min_per_s: f64,
    /// Ceiling of the rate.
    pub rate_max_per_s: f64,
    /// Not SEDA's: when above 0, the queue is also bounded by Little's law to
    /// `queue_bound_fraction × target × measured completion rate` ([`LittleBound`]), so a
    /// backlog admitted before the controller reacts cannot hold the response time over the
    /// target. 0 (the default) leaves only SEDA's rate control.
    pub queue_bound_fraction: f64,
}

impl Default for P90Params {
    fn default() -> Self {
        P90Params {
            target_ns: 1_000_000_000,
            nreq: 100,
            timeout_ns: 1_000_000_000,
            alpha: 0.7,
            err_i: -0.5,
            err_d: 0.0,
            adj_i: 2.0,
            adj_d: 1.2,
            c_i: -0.1,
            rate_min_per_s: 0.05,
            rate_max_per_s: 5000.0,
            queue_bound_fraction: 0.0,
        }
    }
}

impl P90Params {
    /// Checks a controller's starting rate against these parameters' range (narrower than a
    /// token bucket's).
    pub fn validate_initial_rate(&self, initial_rate_per_s: f64) -> Result<(), String> {
        if !(self.rate_min_per_s..=self.rate_max_per_s).contains(&initial_rate_per_s) {
            return Err(format!(
                "p90: initial rate must be in {}..={} per s, got {initial_rate_per_s}",
                self.rate_min_per_s, self.rate_max_per_s
            ));
        }
        Ok(())
    }

    /// Checks every parameter against its limit; the message names the parameter.
    pub fn validate(&self) -> Result<(), String> {
        let p = self;
        if !(1..=P90_TIME_MAX_NS).contains(&p.target_ns) {
            return Err(format!(
                "p90: target_ns must be in 1..={P90_TIME_MAX_NS}, got {}",
                p.target_ns
            ));
        }
        if !(1..=P90_NREQ_MAX).contains(&p.nreq) {
            return Err(format!(
                "p90: nreq must be in 1..={P90_NREQ_MAX}, got {}",
                p.nreq
            ));
        }
        if !(P90_TIMEOUT_MIN_NS..=P90_TIME_MAX_NS).contains(&p.timeout_ns) {
            return Err(format!(
                "p90: timeout_ns must be in {P90_TIMEOUT_MIN_NS}..={P90_TIME_MAX_NS}, got {}",
                p.timeout_ns
            ));
        }
        // alpha = 1 would never move the smoothed value off its first sample.
        if !(0.0..1.0).contains(&p.alpha) {
            return Err(format!("p90: alpha must be in [0, 1), got {}", p.alpha));
        }
        // The error is (cur - target) / target >= -1, so err_i <= -1 would never increase.
        if !(p.err_i > -1.0 && p.err_i.is_finite()) {
            return Err(format!(
                "p90: err_i must be finite and > -1 (else the rate never increases), got {}",
                p.err_i
            ));
        }
        if !(p.err_d.is_finite() && p.err_d >= p.err_i) {
            return Err(format!(
                "p90: err_d must be finite and >= err_i ({}), got {}",
                p.err_i, p.err_d
            ));
        }
        // The increase adj_i * (c_i - err) for err < err_i is positive only if c_i >= err_i.
        if !(p.c_i.is_finite() && p.c_i >= p.err_i) {
            return Err(format!(
                "p90: c_i must be finite and >= err_i ({}) so increases are positive, got {}",
                p.err_i, p.c_i
            ));
        }
        if !(GCRA_RATE_MIN_PER_S..=GCRA_RATE_MAX_PER_S).contains(&p.rate_min_per_s) {
            return Err(format!(
                "p90: rate_min_per_s must be in {GCRA_RATE_MIN_PER_S}..={GCRA_RATE_MAX_PER_S} (the token bucket's range), got {}",
                p.rate_min_per_s
            ));
        }
        if !(p.rate_min_per_s..=GCRA_RATE_MAX_PER_S).contains(&p.rate_max_per_s) {
            return Err(format!(
                "p90: rate_max_per_s must be in rate_min_per_s ({})..={GCRA_RATE_MAX_PER_S}, got {}",
                p.rate_min_per_s, p.rate_max_per_s
            ));
        }
        if !(p.adj_i > 0.0 && p.adj_i <= p.rate_max_per_s) {
            return Err(format!(
                "p90: adj_i must be in (0, rate_max_per_s ({})], got {}",
                p.rate_max_per_s, p.adj_i
            ));
        }
        if !(0.0..=1.0).contains(&p.queue_bound_fraction) {
            return Err(format!(
                "p90: queue_bound_fraction must be in [0, 1] (0: no Little's-law bound), got {}",
                p.queue_bound_fraction
            ));
        }
        if !(p.adj_d > 1.0 && p.adj_d <= P90_ADJ_D_MAX) {
            return Err(format!(
                "p90: adj_d must be in (1, {P90_ADJ_D_MAX}] (the rate is divided by it), got {}",
                p.adj_d
            ));
        }
        Ok(())
    }
}

/// SEDA's 90th-percentile response-time controller (seda.md 2.4) for one queue. Single-threaded:
/// owned by the worker that measures response times; its output goes to a [`GcraBucket`].
///
/// A run happens when `nreq` samples have arrived, or when `timeout_ns` has passed since the last
/// run (since the first sample, before any run) and at least one sample is waiting:
///
/// ```text
/// samp = sorted(samples)[min(floor(0.9 * n), n - 1)]    n = samples in this window
/// cur  = alpha * cur + (1 - alpha) * samp                (cur = samp on the first run)
/// err  = (cur - target) / target
/// if err > err_d:      rate = rate / adj_d
/// elif err < err_i:    rate = rate + adj_i * -(err - c_i)
/// rate = clamp(rate, rate_min, rate_max)
/// ```
///
/// Two choices SEDA leaves open: the percentile index uses the number of samples actually in
/// the window (equal to SEDA's `0.9 * nreq` for a full window; a window cut short by the timeout
/// reports its own 90th percentile, and its maximum when it has 10 samples or fewer), and the
/// smoothed value starts at the first window's percentile rather than at 0 (which would hide
/// the first overload for several runs).
#[derive(Debug, Clone)]
pub struct P90Controller {
    params: P90Params,
    rate_per_s: f64,
    /// Smoothed 90th percentile; `None` until the first run.
    cur_ns: Option<f64>,
    /// Samples of the current window; never more than `nreq` (a run empties it).
    samples_ns: Vec<u64>,
    /// Time of the last run, or of the first sample before any run.
    window_start_ns: Option<u64>,
}

impl P90Controller {
    /// Panics with the message of [`P90Controller::try_new`] when the parameters or the initial
    /// rate are invalid.
    pub fn new(params: P90Params, initial_rate_per_s: f64) -> Self {
        match Self::try_new(params, initial_rate_per_s) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        }
    }

    /// A controller starting at `initial_rate_per_s`, which must lie in
    /// `rate_min_per_s..=rate_max_per_s`.
    pub fn try_new(params: P90Params, initial_rate_per_s: f64) -> Result<Self, String> {
        params.validate()?;
        params.validate_initial_rate(initial_rate_per_s)?;
        let nreq = params.nreq as usize;
        Ok(P90Controller {
            params,
            rate_per_s: initial_rate_per_s,
            cur_ns: None,
            samples_ns: Vec::with_capacity(nreq),
            window_start_ns: None,
        })
    }

    /// Records one response time measured at `now_ns`; returns the new rate when this sample
    /// completed a run (even if the rate did not change), else `None`.
    pub fn observe(&mut self, response_ns: u64, now_ns: u64) -> Option<f64> {
        self.record(response_ns, now_ns);
        self.tick(now_ns)
    }

    /// Runs the controller if a timeout has passed with samples waiting; returns the new rate
    /// when it ran.
    pub fn tick(&mut self, now_ns: u64) -> Option<f64> {
        if !self.due(now_ns) {
            return None;
        }
        let err = self.measure(now_ns);
        self.adjust(err, true);
        Some(self.rate_per_s)
    }

    pub fn rate_per_s(&self) -> f64 {
        self.rate_per_s
    }

    /// The smoothed 90th-percentile response time (`cur`), `None` before the first run.
    /// SEDA exposes this to applications for service degradation.
    pub fn p90_smoothed_ns(&self) -> Option<f64> {
        self.cur_ns
    }

    pub fn params(&self) -> &P90Params {
        &self.params
    }

    /// Samples waiting for the next run.
    pub fn pending_samples(&self) -> usize {
        self.samples_ns.len()
    }

    fn record(&mut self, response_ns: u64, now_ns: u64) {
        // A run empties the buffer as soon as it holds nreq samples, so this never grows it.
        assert!(
            self.samples_ns.len() < self.params.nreq as usize,
            "p90: sample buffer over nreq; the controller was not run when due"
        );
        self.window_start_ns.get_or_insert(now_ns);
        self.samples_ns.push(response_ns);
    }

    fn due(&self, now_ns: u64) -> bool {
        let Some(start) = self.window_start_ns else {
            return false;
        };
        !self.samples_ns.is_empty()
            && (self.samples_ns.len() >= self.params.nreq as usize
                || now_ns.saturating_sub(start) >= self.params.timeout_ns)
    }

    /// Closes the window: updates `cur` and returns the error against the target.
    fn measure(&mut self, now_ns: u64) -> f64 {
        let n = self.samples_ns.len();
        debug_assert!(n > 0, "p90: run without samples");
        self.samples_ns.sort_unstable();
        let samp = self.samples_ns[(n * 9 / 10).min(n - 1)] as f64;
        let a = self.params.alpha;
        let cur = match self.cur_ns {
            None => samp,
            Some(c) => a * c + (1.0 - a) * samp,
        };
        self.cur_ns = Some(cur);
        self.samples_ns.clear();
        self.window_start_ns = Some(now_ns);
        let target = self.params.target_ns as f64;
        (cur - target) / target
    }

    /// Applies SEDA's rule for `err`; `may_increase` is false while a higher class is over its
    /// target. Returns whether the rate changed.
    fn adjust(&mut self, err: f64, may_increase: bool) -> bool {
        let p = &self.params;
        let old = self.rate_per_s;
        let mut rate = old;
        if err > p.err_d {
            rate /= p.adj_d;
        } else if err < p.err_i && may_increase {
            rate += p.adj_i * -(err - p.c_i);
        }
        self.rate_per_s = rate.clamp(p.rate_min_per_s, p.rate_max_per_s);
        self.rate_per_s != old
    }

    /// Sets the rate from outside (class differentiation), clamped; returns whether it changed.
    fn set_rate_clamped(&mut self, rate_per_s: f64) -> bool {
        let old = self.rate_per_s;
        self.rate_per_s = rate_per_s.clamp(self.params.rate_min_per_s, self.params.rate_max_per_s);
        self.rate_per_s != old
    }

    /// Whether the last run found the response time over target (err > err_d) and that run is
    /// recent: within two timeouts, the longest a class with traffic can go without a run plus
    /// one timeout of slack. A class whose traffic stopped stops holding others back.
    fn over_target_recently(&self, over: bool, now_ns: u64) -> bool {
        over && self
            .window_start_ns
            .is_some_and(|t| now_ns.saturating_sub(t) <= 2 * self.params.timeout_ns)
    }
}

// ---------------------------------------------------------------------------------------------
// Class-based differentiation
// ---------------------------------------------------------------------------------------------

/// Most classes a [`ClassedP90`] holds. Each class run scans the classes below or above it, and
/// SEDA's examples use two; 16 priority levels is more than any configuration needs.
pub const CLASSES_MAX: usize = 16;
/// Lower classes are divided by this when a higher class is over its target (SEDA's adjlo_d).
pub const ADJLO_D: f64 = 10.0;
/// Over-target runs, with every lower class already at the floor, before a class cuts its own
/// rate (SEDA's lc_thresh).
pub const LC_THRESH: u32 = 20;

#[derive(Debug, Clone)]
struct ClassState {
    ctl: P90Controller,
    /// lc^c: over-target runs with every lower class at rate_min since the last own cut.
    lc: u32,
    /// Whether the last run was over target (err > err_d, or the class was shed).
    over: bool,
    /// The class's queue bound refused requests since its last run ([`ClassedP90::note_shed`]).
    shed: bool,
}

/// SEDA's class-based differentiation (seda.md 2.4): one response-time controller per class,
/// each with its own target; class 0 has the highest priority. Each class drives its own token
/// bucket (read [`ClassedP90::rate_per_s`] after a change).
///
/// When class `c` runs with `err > err_d`:
/// - if some lower class (`c+1..`) is above `rate_min`, every lower class is divided by
///   [`ADJLO_D`] (clamped at `rate_min`) and class `c` keeps its rate;
/// - otherwise `lc[c] += 1`, and when `lc[c] >= LC_THRESH` class `c` divides its own rate by
///   `adj_d` and `lc[c] = 0`;
/// - the lowest class has nobody to cut, so it follows the single-class rule (divide by
///   `adj_d` at once).
///
/// When class `c` runs with `err <= err_d`, `lc[c] = 0` (the count is of consecutive
/// over-target runs) and it may increase by the single-class rule, unless a higher class is
/// flagged over target. A flag lasts until that class's next run, and lapses if that run is
/// more than two timeouts old, so a class whose traffic stopped does not pin the others.
#[derive(Debug, Clone)]
pub struct ClassedP90 {
    classes: Vec<ClassState>,
}

impl ClassedP90 {
    /// One class per target (`targets_ns[0]` is class 0, the highest priority); every class
    /// shares `params` except the target, and starts at `initial_rate_per_s`.
    pub fn new(
        targets_ns: &[u64],
        params: P90Params,
        initial_rate_per_s: f64,
    ) -> Result<Self, String> {
        if !(1..=CLASSES_MAX).contains(&targets_ns.len()) {
            return Err(format!(
                "p90 classes: need 1..={CLASSES_MAX} classes, got {}",
                targets_ns.len()
            ));
        }
        let mut classes = Vec::with_capacity(targets_ns.len());
        for (c, &target_ns) in targets_ns.iter().enumerate() {
            let p = P90Params {
                target_ns,
                ..params
            };
            let ctl = P90Controller::try_new(p, initial_rate_per_s)
                .map_err(|e| format!("p90 class {c}: {e}"))?;
            classes.push(ClassState {
                ctl,
                lc: 0,
                over: false,
                shed: false,
            });
        }
        Ok(ClassedP90 { classes })
    }

    pub fn classes(&self) -> usize {
        self.classes.len()
    }

    /// Records a response time of class `class`; returns true when some class's rate changed.
    /// Panics if `class` is out of range.
    pub fn observe(&mut self, class: usize, response_ns: u64, now_ns: u64) -> bool {
        self.check(class);
        self.classes[class].ctl.record(response_ns, now_ns);
        if self.classes[class].ctl.due(now_ns) {
            self.run(class, now_ns)
        } else {
            false
        }
    }

    /// Records that `class`'s queue bound (Little's law, [`LittleBound`]) refused requests: its
    /// next run counts as over target even if the requests it did serve met the target (the
    /// bound is what kept them under it), so the lower classes are cut first. The lowest class
    /// has nobody to cut and ignores this. Panics if `class` is out of range.
    pub fn note_shed(&mut self, class: usize) {
        self.check(class);
        self.classes[class].shed = true;
    }

    /// Runs every class whose timeout has passed with samples waiting, highest first; returns
    /// true when some class's rate changed.
    pub fn tick(&mut self, now_ns: u64) -> bool {
        let mut changed = false;
        for c in 0..self.classes.len() {
            if self.classes[c].ctl.due(now_ns) {
                changed |= self.run(c, now_ns);
            }
        }
        changed
    }

    pub fn rate_per_s(&self, class: usize) -> f64 {
        self.check(class);
        self.classes[class].ctl.rate_per_s()
    }

    pub fn p90_smoothed_ns(&self, class: usize) -> Option<f64> {
        self.check(class);
        self.classes[class].ctl.p90_smoothed_ns()
    }

    /// The lc counter of `class`.
    pub fn low_count(&self, class: usize) -> u32 {
        self.check(class);
        self.classes[class].lc
    }

    /// Whether `class` was over its target at its last run.
    pub fn over_target(&self, class: usize) -> bool {
        self.check(class);
        self.classes[class].over
    }

    fn check(&self, class: usize) {
        assert!(
            class < self.classes.len(),
            "p90 class {class} out of range ({} classes)",
            self.classes.len()
        );
    }

    fn run(&mut self, c: usize, now_ns: u64) -> bool {
        let err = self.classes[c].ctl.measure(now_ns);
        let p = &self.classes[c].ctl.params;
        let (err_d, adj_d, rate_min_per_s) = (p.err_d, p.adj_d, p.rate_min_per_s);
        let lowest = c + 1 == self.classes.len();
        let over = err > err_d || (self.classes[c].shed && !lowest);
        self.classes[c].shed = false;
        self.classes[c].over = over;
        if !over {
            self.classes[c].lc = 0;
            let held = self.classes[..c]
                .iter()
                .any(|h| h.ctl.over_target_recently(h.over, now_ns));
            return self.classes[c].ctl.adjust(err, !held);
        }
        if lowest {
            return self.classes[c].ctl.adjust(err, true);
        }
        let lower = &mut self.classes[c + 1..];
        if lower.iter().all(|l| l.ctl.rate_per_s <= rate_min_per_s) {
            let me = &mut self.classes[c];
            me.lc += 1;
            if me.lc >= LC_THRESH {
                me.lc = 0;
                let r = me.ctl.rate_per_s / adj_d;
                return me.ctl.set_rate_clamped(r);
            }
            return false;
        }
        let mut changed = false;
        for l in lower {
            let r = l.ctl.rate_per_s / ADJLO_D;
            changed |= l.ctl.set_rate_clamped(r);
        }
        changed
    }
}
