//! Shapers: token and leaky buckets that cap a node's rate (TAP's process shaping).
//!
//! Costs are charged after the work is done, so a bucket may go into debt by one dispatch:
//! the node is eligible while its balance is positive and is held back until the debt is repaid.
//! Over any window of length `T` the cost charged to a shaped node is therefore at most
//! `rate * T + burst + c_max`, where `c_max` is the largest single charge; when the caller
//! knows the cost in advance (bytes to send) and keeps chunks small, `c_max` is that chunk size.
//! A leaky bucket is the same meter with no burst (a GCRA with zero tolerance): its output is
//! spaced at the rate and banks nothing while its node is idle.
//!
//! Late wake-ups: a leaky bucket that banks nothing at all loses whatever a late wake-up costs
//! (a node eligible at `t` but dispatched at `t + L` loses `rate * L`; with sub-millisecond
//! spacing on a busy machine that was a third of the rate). So while its node stays backlogged
//! a leaky bucket keeps what it earned, up to [`LEAKY_CATCH_UP_NS`] worth of its rate, and
//! drops it back to nothing when the node goes idle ([`Shaper::idle`]). Bounds: from the start
//! of a backlog the node receives at most `rate * elapsed + c_max` (it never runs ahead of the
//! rate: it only catches up time it was held back), and in any window `T` at most
//! `rate * (T + LEAKY_CATCH_UP_NS) + c_max`. A caller that never reports idleness gets the
//! same window bound.

/// Kind of shaper.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShaperKind {
    /// Allows bursts up to `burst` units above the rate.
    Token,
    /// Smooth output at the rate; `burst` is ignored (zero).
    Leaky,
}

/// Configuration of a shaper.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShaperSpec {
    pub kind: ShaperKind,
    /// Cost units per second (ns of CPU per second, or bytes per second). Must be > 0.
    pub rate_per_s: u64,
    /// Bucket depth in cost units (token bucket only).
    pub burst: u64,
    /// The bucket admits work once it holds this many units (0: any positive balance), at most
    /// what it may bank (a token bucket's burst; a leaky bucket's catch-up allowance while
    /// backlogged). A caller that knows its cost in advance and takes no more than
    /// [`Shaper::available`] then never goes into debt and sends in grains of at least this
    /// size. A leaky bucket then gets over any window `T` at most `rate * T + grain` (plus the
    /// catch-up allowance after a late wake-up), instead of `rate * T + c_max` with a debt of
    /// one whole chunk; a token bucket keeps its bound (`rate * T + burst`: the grain only
    /// delays admission, and a bucket at least a grain deep loses nothing waiting for one).
    /// Either way the grain bounds how often the node is woken once drained: about
    /// `rate / grain` times a second. Without one, a drained bucket's caller that takes the
    /// whole units available leaves a fraction of a unit behind, which is eligible, so its next
    /// pick finds no whole unit to take.
    #[serde(default)]
    pub grain: u64,
}

/// Largest rate accepted: 2^40 units/s (about 1 TB/s or 1,100 cores of CPU-ns/s).
pub const RATE_MAX_PER_S: u64 = 1 << 40;
/// Largest burst accepted: 2^40 units.
pub const BURST_MAX: u64 = 1 << 40;

impl ShaperSpec {
    pub fn token(rate_per_s: u64, burst: u64) -> Self {
        ShaperSpec {
            kind: ShaperKind::Token,
            rate_per_s,
            burst,
            grain: 0,
        }
    }
    pub fn leaky(rate_per_s: u64) -> Self {
        ShaperSpec {
            kind: ShaperKind::Leaky,
            rate_per_s,
            burst: 0,
            grain: 0,
        }
    }
    /// The same bucket admitting work in grains of `grain` units (see [`ShaperSpec::grain`]).
    pub fn with_grain(self, grain: u64) -> Self {
        ShaperSpec { grain, ..self }
    }
    pub fn validate(&self) -> Result<(), String> {
        if self.rate_per_s == 0 || self.rate_per_s > RATE_MAX_PER_S {
            return Err(format!(
                "shaper rate must be in 1..={RATE_MAX_PER_S} units/s, got {}",
                self.rate_per_s
            ));
        }
        if self.grain > BURST_MAX {
            return Err(format!(
                "shaper grain must be at most {BURST_MAX} units, got {}",
                self.grain
            ));
        }
        if self.burst > BURST_MAX {
            return Err(format!(
                "shaper burst must be at most {BURST_MAX} units, got {}",
                self.burst
            ));
        }
        Ok(())
    }
}

const NS_PER_S: i128 = 1_000_000_000;

/// How much a backlogged leaky bucket may bank to catch up late wake-ups, in ns of its rate.
///
/// Why 2 ms: the allowance is also the most a catch-up can put above the rate into one window,
/// so it is what "no burst above the rate" costs in throughput. With the send stage's grain of
/// 1 ms of the rate, any 100 ms window then carries at most 3 % more than the rate (the
/// shaping goal's tolerance), and a wake-up up to 2 ms late costs nothing. It was 5 ms, and
/// `exp shaping` found a 100 ms window at 1.034× the rate after a late wake-up in a run the
/// hypervisor had taken 20 ms from.
pub const LEAKY_CATCH_UP_NS: u64 = 2_000_000;

/// A running bucket. The balance is kept in unit-nanoseconds (units * 1e9) so refills at any
/// rate are exact integers.
#[derive(Clone, Debug)]
pub struct Shaper {
    spec: ShaperSpec,
    /// Balance in units * 1e9; positive means eligible.
    balance: i128,
    last_ns: u64,
    /// The node went idle (leaky bucket: earn no more than one unit-ns until it has work).
    idle: bool,
    /// Earnings the bucket discarded, in unit-ns: while its node was backlogged (beyond the
    /// burst, or a leaky bucket's catch-up allowance: what wake-ups later than that cost it),
    /// and while idle or on going idle (a leaky bucket banks nothing then, by design).
    lost_backlogged: u128,
    lost_idle: u128,
}

/// What a bucket discarded of what its rate earned, in whole units (see [`Shaper::lost`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShaperLost {
    /// While its node was backlogged: earnings beyond the bucket's depth (a token bucket's
    /// burst; a leaky bucket's catch-up allowance, i.e. the part of a wake-up later than
    /// [`LEAKY_CATCH_UP_NS`] that could not be caught up).
    pub backlogged: u64,
    /// While its node was idle, or banked when it went idle (a leaky bucket keeps nothing).
    pub idle: u64,
}

impl Shaper {
    /// A new bucket, full at `now_ns`.
    pub fn new(spec: ShaperSpec, now_ns: u64) -> Self {
        spec.validate().expect("invalid shaper spec");
        let mut s = Shaper {
            spec,
            balance: 0,
            last_ns: now_ns,
            idle: true,
            lost_backlogged: 0,
            lost_idle: 0,
        };
        s.balance = s.depth();
        s
    }

    pub fn spec(&self) -> ShaperSpec {
        self.spec
    }

    /// Changes rate or burst, keeping the current balance (clamped to the new depth).
    pub fn set_spec(&mut self, spec: ShaperSpec, now_ns: u64) {
        spec.validate().expect("invalid shaper spec");
        self.refill(now_ns);
        self.spec = spec;
        self.balance = self.balance.min(self.depth());
    }

    fn depth(&self) -> i128 {
        match self.spec.kind {
            ShaperKind::Token => i128::from(self.spec.burst) * NS_PER_S,
            // An idle leaky bucket holds only the fraction of a unit; eligibility needs > 0.
            ShaperKind::Leaky if self.idle => 1,
            // A backlogged one keeps what late wake-ups cost it, up to the catch-up allowance.
            ShaperKind::Leaky => i128::from(self.spec.rate_per_s) * i128::from(LEAKY_CATCH_UP_NS),
        }
    }

    fn refill(&mut self, now_ns: u64) {
        if now_ns > self.last_ns {
            let earned = i128::from(now_ns - self.last_ns) * i128::from(self.spec.rate_per_s);
            let full = self.balance + earned;
            self.balance = full.min(self.depth().max(self.balance));
            self.note_lost(full - self.balance);
            self.last_ns = now_ns;
        }
    }

    /// The shaped node has no more work: a leaky bucket forgets what it banked for catching
    /// up (an idle node must come back with no burst), including what it earned since its
    /// last charge. A token bucket keeps its tokens.
    pub fn idle(&mut self) {
        self.idle = true;
        let kept = self.balance.min(self.depth());
        self.lost_idle += (self.balance - kept).unsigned_abs();
        self.balance = kept;
    }

    /// Counts `lost` unit-ns (≥ 0) as discarded in the node's present state.
    fn note_lost(&mut self, lost: i128) {
        let lost = lost.unsigned_abs();
        if self.idle {
            self.lost_idle += lost;
        } else {
            self.lost_backlogged += lost;
        }
    }

    /// What the bucket has discarded of its earnings since it was made, in whole units.
    pub fn lost(&self) -> ShaperLost {
        let units = |x: u128| u64::try_from(x / NS_PER_S as u128).unwrap_or(u64::MAX);
        ShaperLost {
            backlogged: units(self.lost_backlogged),
            idle: units(self.lost_idle),
        }
    }

    /// Earliest time at which the node may be dispatched; `<= now_ns` means now.
    /// Called when the node has work: it counts as backlogged from `now_ns`.
    pub fn eligible_at(&mut self, now_ns: u64) -> u64 {
        self.refill(now_ns);
        self.idle = false;
        // What the bucket must hold to admit work: one unit-ns, or its grain (never more than
        // it may bank, or it would never admit anything; never less than one unit-ns, the
        // positive balance of a bucket without a grain).
        let need = match self.spec.grain {
            0 => 1,
            grain => (i128::from(grain) * NS_PER_S).min(self.depth()).max(1),
        };
        if self.balance >= need {
            return now_ns;
        }
        let short = need - self.balance;
        let rate = i128::from(self.spec.rate_per_s);
        let wait = (short + rate - 1) / rate;
        now_ns.saturating_add(wait.min(i128::from(u64::MAX)) as u64)
    }

    /// Charges `cost` units spent at (or ending at) `now_ns`.
    pub fn charge(&mut self, cost: u64, now_ns: u64) {
        self.refill(now_ns);
        self.idle = false;
        self.balance -= i128::from(cost) * NS_PER_S;
    }

    /// Whole units in the bucket at `now_ns` (0 while in debt): what a caller that knows its cost
    /// in advance may take without going into debt.
    pub fn available(&mut self, now_ns: u64) -> u64 {
        self.refill(now_ns);
        u64::try_from(self.balance.max(0) / NS_PER_S).unwrap_or(u64::MAX)
    }

    /// Gives back `units` charged in advance but not spent (a transfer that moved fewer bytes than
    /// it reserved). The balance never rises above the bucket's depth.
    pub fn refund(&mut self, units: u64, now_ns: u64) {
        self.refill(now_ns);
        self.balance = (self.balance + i128::from(units) * NS_PER_S).min(self.depth());
    }

    /// The running state `(balance in unit-ns, time of the last refill)`, for a caller that keeps
    /// the bucket outside this struct (in memory shared between processes) and rebuilds it with
    /// [`Shaper::from_state`].
    pub fn state(&self) -> (i128, u64) {
        (self.balance, self.last_ns)
    }

    /// A bucket rebuilt from [`Shaper::state`]. The spec is validated; the balance is clamped to
    /// the bucket's depth (state from another process is not trusted to be in range).
    pub fn from_state(spec: ShaperSpec, balance: i128, last_ns: u64) -> Result<Self, String> {
        spec.validate()?;
        let mut s = Shaper {
            spec,
            balance: 0,
            last_ns,
            // The state kept outside holds no idleness: a rebuilt leaky bucket counts as
            // backlogged (its catch-up allowance applies; `idle()` drops it).
            idle: false,
            lost_backlogged: 0,
            lost_idle: 0,
        };
        // A debt deeper than an hour at the rate is not a state any caller produces.
        let floor = -i128::from(spec.rate_per_s) * 3600 * NS_PER_S;
        s.balance = balance.clamp(floor, s.depth());
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_bucket_allows_burst_then_paces() {
        // 1000 units/s, burst 100: ten 10-unit charges at t=0, then eligible again after 10 ms.
        let mut s = Shaper::new(ShaperSpec::token(1000, 100), 0);
        for _ in 0..10 {
            assert_eq!(s.eligible_at(0), 0);
            s.charge(10, 0);
        }
        assert_eq!(s.eligible_at(0), 1);
        s.charge(10, 0);
        // balance is -10 units: 10 ms to repay, plus the one unit-ns needed to be positive.
        assert_eq!(s.eligible_at(0), 10_000_001);
    }

    #[test]
    fn leaky_bucket_has_no_burst() {
        let mut s = Shaper::new(ShaperSpec::leaky(1000), 0);
        assert_eq!(s.eligible_at(0), 0);
        s.charge(1, 0);
        assert_eq!(s.eligible_at(0), 1_000_000);
        // A long idle period does not bank more than one unit-ns.
        s.idle();
        assert_eq!(s.eligible_at(10_000_000_000), 10_000_000_000);
        s.charge(1, 10_000_000_000);
        assert!(s.eligible_at(10_000_000_000) > 10_000_000_000);
    }

    /// 1,000,000 units/s (1 unit per µs), 100-unit sends: due every 100 µs. A wake-up 60 µs
    /// late is caught up at the next decision, and a worker that always wakes 37 µs late still
    /// sends on the 100 µs grid: late wake-ups cost nothing, and no send is possible early.
    #[test]
    fn leaky_bucket_catches_up_a_late_wake_up_exactly() {
        let mut s = Shaper::new(ShaperSpec::leaky(1_000_000), 0);
        assert_eq!(s.eligible_at(0), 0);
        s.charge(100, 0);
        assert_eq!(s.eligible_at(0), 100_000);
        // The worker wakes 60 µs late: the 60 units it waited too long are banked, not lost.
        assert_eq!(s.eligible_at(160_000), 160_000);
        s.charge(100, 160_000);
        // Due 40 µs later, at 200 µs, where an on-time worker would have sent too.
        let mut due = s.eligible_at(160_000);
        for k in 2..=20u64 {
            assert_eq!(due, k * 100_000, "send {k}");
            let now = due + 37_000;
            assert_eq!(s.eligible_at(now), now);
            s.charge(100, now);
            due = s.eligible_at(now);
            assert!(
                due > now,
                "a second send at {now} would run ahead of the rate"
            );
        }
    }

    /// The bucket counts what it discards, by state: a leaky bucket woken 60 µs late loses
    /// nothing, one woken 2 ms + 300 µs late loses exactly the 300 µs beyond the allowance, and
    /// what it earns while idle (and what it had banked when it went idle) counts as idle.
    #[test]
    fn leaky_bucket_counts_what_it_discards() {
        let rate = 1_000_000u64; // 1 unit per µs
        let mut s = Shaper::new(ShaperSpec::leaky(rate), 0);
        assert_eq!(s.eligible_at(0), 0);
        s.charge(100, 0);
        assert_eq!(s.eligible_at(160_000), 160_000);
        assert_eq!(
            s.lost(),
            ShaperLost::default(),
            "a late wake-up within the allowance"
        );
        s.charge(100, 160_000);
        // Due at 200 µs; woken at 200 µs + 2 ms + 300 µs: 300 units beyond the allowance.
        let late = 200_000 + LEAKY_CATCH_UP_NS + 300_000;
        assert_eq!(s.eligible_at(late), late);
        assert_eq!(
            s.lost(),
            ShaperLost {
                backlogged: 300,
                idle: 0
            }
        );
        // It sends the 2,000 units it kept, no more.
        let mut sent = 0;
        while s.eligible_at(late) <= late {
            s.charge(1, late);
            sent += 1;
        }
        assert_eq!(sent, 2_000);
        // Idle with nothing banked (nothing to drop), for 1 ms: of the 1,000 units earned it
        // keeps one unit-ns, so 999 whole units count as lost while idle.
        s.idle();
        assert_eq!(
            s.lost(),
            ShaperLost {
                backlogged: 300,
                idle: 0
            }
        );
        assert_eq!(s.eligible_at(late + 1_000_000), late + 1_000_000);
        assert_eq!(
            s.lost(),
            ShaperLost {
                backlogged: 300,
                idle: 999
            }
        );
        // Banked 50 units while backlogged, then idle: those 50 are dropped as idle.
        s.charge(1, late + 1_000_000);
        assert_eq!(s.eligible_at(late + 1_051_000), late + 1_051_000);
        s.idle();
        assert_eq!(
            s.lost(),
            ShaperLost {
                backlogged: 300,
                idle: 1_049
            }
        );
    }

    /// The catch-up allowance is bounded: a node held back far longer than the allowance gets
    /// at most `LEAKY_CATCH_UP_NS` worth of its rate at once, and an idle node gets nothing.
    #[test]
    fn leaky_catch_up_is_bounded_and_lost_on_idle() {
        let rate = 1_000_000u64;
        let mut s = Shaper::new(ShaperSpec::leaky(rate), 0);
        s.charge(1, 0);
        assert!(s.eligible_at(0) > 0);
        // Backlogged but not served for a second: it may send the allowance (2,000 units),
        // then waits.
        let t = 1_000_000_000;
        let mut burst = 0;
        while s.eligible_at(t) <= t {
            s.charge(1, t);
            burst += 1;
        }
        assert_eq!(burst, rate * LEAKY_CATCH_UP_NS / 1_000_000_000);
        // Idle for a second: one unit-ns banked, so one unit goes, then it waits a unit's time.
        s.idle();
        let t2 = 2_000_000_000;
        assert_eq!(s.eligible_at(t2), t2);
        s.charge(1, t2);
        assert_eq!(s.eligible_at(t2), t2 + 1_000);
    }

    #[test]
    fn leaky_grain_admits_whole_grains_and_never_goes_into_debt() {
        // 1,000,000 units/s (1 per µs), grain 1,000 units (1 ms of the rate).
        const MS: u64 = 1_000_000;
        let mut s = Shaper::new(ShaperSpec::leaky(1_000_000).with_grain(1000), 0);
        // Idle, it holds nothing: the first grain is admitted after 1 ms.
        assert_eq!(s.eligible_at(0), MS);
        // A caller taking exactly what is available, each time the bucket admits it, for 100 ms
        // of backlog woken on time: 100 grains, never a debt, never more than the rate.
        let (mut now, mut sent) = (0u64, 0u64);
        while now < 100 * MS {
            now = s.eligible_at(now);
            let take = s.available(now);
            assert!(take >= 1000, "a whole grain at {now}: {take}");
            s.charge(take, now);
            sent += take;
            assert!(s.state().0 >= 0, "never in debt");
            assert!(sent <= now / 1000 + 1000, "sent {sent} by {now} ns");
        }
        assert_eq!(sent, 100_000);
        // A grain larger than what the bucket may bank is cut to it (it would never admit).
        let mut big = Shaper::new(ShaperSpec::leaky(1000).with_grain(1 << 30), 0);
        assert!(big.eligible_at(0) <= LEAKY_CATCH_UP_NS + 1);
        assert!(ShaperSpec::leaky(1)
            .with_grain(BURST_MAX + 1)
            .validate()
            .is_err());
    }

    /// A token bucket with a grain, drained by a caller that takes exactly the whole units
    /// available: it admits its node again only once it holds a grain (without one, the
    /// fraction of a unit left behind by a whole-unit charge made it eligible with nothing to
    /// take). The rate is unchanged: the burst, then the rate, never in debt.
    #[test]
    fn token_grain_admits_whole_grains_at_the_rate() {
        const MS: u64 = 1_000_000;
        // 1,000,000 units/s (1 per µs), burst 10,000, grain 1,000.
        let mut s = Shaper::new(ShaperSpec::token(1_000_000, 10_000).with_grain(1000), 0);
        let (mut now, mut sent, mut takes) = (0u64, 0u64, 0u64);
        while now < 100 * MS {
            let at = s.eligible_at(now);
            // Woken 1.5 µs after the bucket allows (a fraction of a unit beyond the grain).
            now = if at > now { at + 1_500 } else { now };
            let take = s.available(now).min(4096);
            assert!(take >= 1000, "a whole grain at {now}: {take}");
            s.charge(take, now);
            sent += take;
            takes += 1;
            assert!(s.state().0 >= 0, "never in debt");
            assert!(sent <= 10_000 + now / 1000, "sent {sent} by {now} ns");
        }
        assert!(
            sent + 1000 >= 10_000 + now / 1000,
            "sent {sent} by {now} ns"
        );
        assert!(takes <= 100 + 3, "{takes} takes in 100 ms");
    }

    #[test]
    fn available_refund_and_state_round_trip() {
        let mut s = Shaper::new(ShaperSpec::token(1000, 100), 0);
        assert_eq!(s.available(0), 100);
        s.charge(60, 0);
        assert_eq!(s.available(0), 40);
        // 5 ms at 1000/s earns 5 units.
        assert_eq!(s.available(5_000_000), 45);
        s.refund(30, 5_000_000);
        assert_eq!(s.available(5_000_000), 75);
        // A refund never fills beyond the depth.
        s.refund(1000, 5_000_000);
        assert_eq!(s.available(5_000_000), 100);
        s.charge(150, 5_000_000);
        assert_eq!(s.available(5_000_000), 0);
        let (balance, last) = s.state();
        let mut t = Shaper::from_state(s.spec(), balance, last).unwrap();
        assert_eq!(t.eligible_at(5_000_000), s.eligible_at(5_000_000));
        // Out-of-range state is clamped, an invalid spec refused.
        let mut u = Shaper::from_state(s.spec(), i128::MAX, 0).unwrap();
        assert_eq!(u.available(0), 100);
        assert!(Shaper::from_state(ShaperSpec::token(0, 1), 0, 0).is_err());
    }

    #[test]
    fn invalid_specs_are_refused() {
        assert!(ShaperSpec::token(0, 10).validate().is_err());
        assert!(ShaperSpec::token(RATE_MAX_PER_S + 1, 10)
            .validate()
            .is_err());
        assert!(ShaperSpec::token(10, BURST_MAX + 1).validate().is_err());
        assert!(ShaperSpec::leaky(10).validate().is_ok());
    }
}
