//! lease: how many of a fleet cap's tokens a node asks Redis for, and what it spends when Redis
//! cannot be reached.
//!
//! A fleet cap (`fleet_rate_per_s` in requests, `fleet_net_cap` in bytes) is one token bucket in
//! Redis (`store.rs`'s Lua script, refilled at the cap, holding at most [`bucket_burst`]: two
//! sync intervals of the cap). Every sync a node renews its lease: it asks for what brings its
//! local pool up to [`lease_target`] (two intervals of its recent demand), or gives back what it
//! holds beyond twice that; it spends the pool locally, one token per request (bytes: the
//! bytes sent are debited after the fact, and a request is admitted while the pool is
//! positive), so no request waits for Redis.
//!
//! **Overshoot.** Tokens leave the bucket at most at the cap plus its burst, and a node spends
//! only tokens it was given (requests) or repays what it overspent from its next lease
//! (bytes). So in any window of `T` seconds the fleet serves at most
//! `cap × T + burst + held`, where `held` is what the nodes held when the window began, at
//! most the sum of their targets (each at most `burst`): the excess over a window is at most
//! `(1 + nodes) × 2 × sync_ms` of the cap, and it does not accumulate (a long run averages to
//! the cap). For bytes add one interval of each node's sending before its debit lands. When
//! Redis is unreachable (or a renewal fails) each node refills its pool locally at
//! `cap / nodes last seen` ([`fallback_rate`]) for the time since the pool was last refilled
//! or renewed, measured, up to two intervals of that rate; with the nodes' count stale (a node
//! died during the outage) the fleet may then run under the cap, or over it by the
//! dead-or-born nodes' parts.
//!
//! Pure: the caller passes rates and times.

/// Tokens the fleet bucket holds at most: two sync intervals of the cap, at least 1.
pub fn bucket_burst(cap_per_s: u64, sync_ms: u64) -> u64 {
    (cap_per_s.saturating_mul(2).saturating_mul(sync_ms) / 1000).max(1)
}

/// The tokens a node aims to hold after a renewal: two intervals of its recent demand
/// (`demand_per_s`, what arrived for the capped tenant here), at least 1 (so a first request
/// after a quiet spell is served), at most the bucket's burst.
pub fn lease_target(demand_per_s: f64, cap_per_s: u64, sync_ms: u64) -> u64 {
    let burst = bucket_burst(cap_per_s, sync_ms);
    if !demand_per_s.is_finite() || demand_per_s <= 0.0 {
        return 1;
    }
    let want = (demand_per_s * 2.0 * sync_ms as f64 / 1000.0).ceil();
    if want >= burst as f64 {
        burst
    } else {
        (want as u64).max(1)
    }
}

/// What a renewal asks for (positive) or gives back (negative) to go from `held` tokens to
/// `target`: it asks for the shortfall, and gives back only what is held beyond twice the
/// target (so a pool does not flap between asking and returning). A debt (`held < 0`, bytes
/// overspent) is asked for on top of the target, so it is repaid.
pub fn lease_delta(target: u64, held: i64) -> i64 {
    let target = target.min(i64::MAX as u64 / 4) as i64;
    // Saturating: `held` comes from a pool that Redis's grants fill (bounded by the asks, but
    // a debt can be deep), and an overflow here would ask for a wrapped amount.
    if held < target {
        target.saturating_sub(held)
    } else if held > 2 * target {
        (2 * target).saturating_sub(held)
    } else {
        0
    }
}

/// A grant as Redis replied it, held to what the renewal could get: between nothing and `ask`
/// (or, giving back, between `ask` and nothing). A reply outside that (a script replaced in
/// Redis, a corrupted key) would switch a cap off or starve a tenant; returns the clamped grant
/// and whether it had to be clamped (counted as garbage).
pub fn clamp_grant(ask: i64, granted: i64) -> (i64, bool) {
    let clamped = if ask >= 0 {
        granted.clamp(0, ask)
    } else {
        granted.clamp(ask, 0)
    };
    (clamped, clamped != granted)
}

/// The local rate of a fleet cap while Redis is unreachable: the cap split evenly over the
/// nodes last seen (this one included, so at least 1).
pub fn fallback_rate(cap_per_s: u64, nodes_last_seen: usize) -> f64 {
    cap_per_s as f64 / nodes_last_seen.max(1) as f64
}

/// Tokens to add to a pool of `held` while Redis is unreachable, after `elapsed_ns` at `rate`
/// per second, without going past `ceiling` (the local burst). Never negative.
pub fn fallback_refill(rate_per_s: f64, elapsed_ns: u64, held: i64, ceiling: u64) -> i64 {
    let ceiling = ceiling.min(i64::MAX as u64 / 4) as i64;
    if held >= ceiling || !rate_per_s.is_finite() || rate_per_s <= 0.0 {
        return 0;
    }
    let add = (rate_per_s * elapsed_ns as f64 / 1e9).floor();
    let room = (ceiling - held) as f64;
    add.min(room).max(0.0) as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_is_two_intervals_of_the_cap() {
        assert_eq!(bucket_burst(1000, 100), 200);
        assert_eq!(bucket_burst(50_000_000, 100), 10_000_000);
        assert_eq!(bucket_burst(1, 10), 1);
        assert_eq!(bucket_burst(u64::MAX, 100), u64::MAX / 1000);
    }

    #[test]
    fn target_is_two_intervals_of_demand_within_1_and_the_burst() {
        assert_eq!(lease_target(1800.0, 1000, 100), 200);
        assert_eq!(lease_target(900.0, 1000, 100), 180);
        assert_eq!(lease_target(300.0, 1000, 100), 60);
        assert_eq!(lease_target(0.4, 1000, 100), 1);
        assert_eq!(lease_target(0.0, 1000, 100), 1);
        assert_eq!(lease_target(f64::NAN, 1000, 100), 1);
        assert_eq!(lease_target(f64::INFINITY, 1000, 100), 1);
        assert_eq!(lease_target(1e300, 1000, 100), 200);
        assert_eq!(lease_target(1e300, 0, 100), 1);
    }

    #[test]
    fn delta_asks_for_the_shortfall_and_returns_only_past_twice_the_target() {
        assert_eq!(lease_delta(100, 0), 100);
        assert_eq!(lease_delta(100, 40), 60);
        assert_eq!(lease_delta(100, 100), 0);
        assert_eq!(lease_delta(100, 200), 0);
        assert_eq!(lease_delta(100, 250), -50);
        // A debt is repaid on top of the target.
        assert_eq!(lease_delta(100, -30), 130);
        assert_eq!(lease_delta(u64::MAX, 0), i64::MAX / 4);
        // A debt as deep as a pool can hold asks for the most there is, not a wrapped amount.
        assert_eq!(lease_delta(100, i64::MIN), i64::MAX);
        assert_eq!(lease_delta(0, i64::MAX), -i64::MAX);
    }

    #[test]
    fn fallback_splits_the_cap_over_the_nodes_last_seen() {
        assert_eq!(fallback_rate(900, 3), 300.0);
        assert_eq!(fallback_rate(900, 0), 900.0);
        assert_eq!(fallback_refill(300.0, 100_000_000, 0, 60), 30);
        assert_eq!(fallback_refill(300.0, 1_000_000_000, 0, 60), 60);
        assert_eq!(fallback_refill(300.0, 1_000_000_000, 50, 60), 10);
        assert_eq!(fallback_refill(300.0, 1_000_000_000, 70, 60), 0);
        assert_eq!(fallback_refill(300.0, 1_000_000_000, -100, 60), 160);
        assert_eq!(fallback_refill(f64::NAN, 1_000_000_000, 0, 60), 0);
        assert_eq!(fallback_refill(300.0, 1_000_000, 0, 60), 0);
    }

    #[test]
    fn a_grant_is_held_between_nothing_and_the_ask() {
        assert_eq!(clamp_grant(100, 60), (60, false));
        assert_eq!(clamp_grant(100, 100), (100, false));
        assert_eq!(clamp_grant(100, i64::MAX), (100, true));
        assert_eq!(clamp_grant(100, -5), (0, true));
        assert_eq!(clamp_grant(100, i64::MIN), (0, true));
        assert_eq!(clamp_grant(-50, -50), (-50, false));
        assert_eq!(clamp_grant(-50, -20), (-20, false));
        assert_eq!(clamp_grant(-50, -80), (-50, true));
        assert_eq!(clamp_grant(-50, 7), (0, true));
        assert_eq!(clamp_grant(0, 3), (0, true));
    }
}
