//! The predicates and controllers under simulated time.

use super::batching::BATCH_BEST_WINDOWS;
use super::*;
use proptest::prelude::*;

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;

/// Relative comparison for rates computed by the same formula in a different order.
fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

// --- Threshold ---------------------------------------------------------------------------

#[test]
fn threshold_rejects_at_limit() {
    let t = Threshold { limit: 3 };
    assert_eq!(t.verdict(2), Verdict::Admit);
    assert_eq!(t.verdict(3), Verdict::Reject(RejectReason::QueueFull));
    assert_eq!(t.verdict(4), Verdict::Reject(RejectReason::QueueFull));
    assert_eq!(
        Threshold { limit: 0 }.verdict(0),
        Verdict::Reject(RejectReason::QueueFull)
    );
}

// --- GcraBucket --------------------------------------------------------------------------

#[test]
fn gcra_burst_then_one_per_interval() {
    let b = GcraBucket::new(1000.0, 10);
    assert_eq!(b.rate_per_s(), 1000.0);
    let admitted = (0..100).filter(|_| b.try_admit(0)).count();
    assert_eq!(admitted, 10);
    // Just before 1 ms: nothing; at 1 ms: exactly one.
    assert!(!b.try_admit(MS - 1));
    assert!(b.try_admit(MS));
    assert!(!b.try_admit(MS));
    for k in 2..50 {
        assert!(!b.try_admit(k * MS - 1), "k={k}");
        assert!(b.try_admit(k * MS), "k={k}");
        assert!(!b.try_admit(k * MS), "k={k}");
    }
}

#[test]
fn gcra_idle_refills_only_to_burst() {
    let b = GcraBucket::new(1000.0, 10);
    assert!(b.try_admit(0));
    // A long idle period banks at most `burst`.
    let t = 10 * S;
    assert_eq!((0..100).filter(|_| b.try_admit(t)).count(), 10);
}

#[test]
fn gcra_burst_one_is_a_leaky_bucket() {
    let b = GcraBucket::new(1000.0, 1);
    assert!(b.try_admit(0));
    assert!(!b.try_admit(0));
    assert!(!b.try_admit(MS - 1));
    assert!(b.try_admit(MS));
}

#[test]
fn gcra_rate_change_applies_and_debt_is_capped() {
    // Drain at a very low rate: TAT is 200 s ahead.
    let b = GcraBucket::new(0.05, 10);
    assert_eq!((0..20).filter(|_| b.try_admit(0)).count(), 10);
    // Raise to 1000/s: interval 1 ms, tau 9 ms; the debt is capped at 2 * 10 ms, so the
    // first admission comes tau + 2 ms = 11 ms later, not 200 s.
    b.set_rate(1000.0);
    assert_eq!(b.rate_per_s(), 1000.0);
    assert!(!b.try_admit(S));
    assert!(!b.try_admit(S + 11 * MS - 1));
    assert!(b.try_admit(S + 11 * MS));
    assert!(!b.try_admit(S + 11 * MS));
    assert!(b.try_admit(S + 12 * MS));
    // Lowering the rate slows admissions at once.
    b.set_rate(100.0);
    let t = 100 * S;
    assert_eq!((0..20).filter(|_| b.try_admit(t)).count(), 10);
    assert!(!b.try_admit(t + 10 * MS - 1));
    assert!(b.try_admit(t + 10 * MS));
}

#[test]
fn gcra_effective_rate_rounds_interval_up() {
    let b = GcraBucket::new(3.0, 1);
    // 10^9 / 3 = 333,333,333.3 ns, rounded up to ...334.
    assert!(b.rate_per_s() <= 3.0 && b.rate_per_s() > 3.0 - 1e-7);
    assert!(b.try_admit(0));
    assert!(!b.try_admit(333_333_333));
    assert!(b.try_admit(333_333_334));
}

#[test]
fn gcra_concurrent_senders_take_exactly_the_burst() {
    let b = std::sync::Arc::new(GcraBucket::new(1000.0, 100));
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let b = b.clone();
            std::thread::spawn(move || (0..1000).filter(|_| b.try_admit(5 * MS)).count())
        })
        .collect();
    let total: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    // Every CAS failure is another sender's admission, at most 100 of them, so nobody
    // runs out of retries: exactly the burst is admitted.
    assert_eq!(total, 100);
}

#[test]
fn gcra_limits_are_enforced() {
    assert!(GcraBucket::validate(0.0, 1).is_err());
    assert!(GcraBucket::validate(GCRA_RATE_MIN_PER_S / 2.0, 1).is_err());
    assert!(GcraBucket::validate(GCRA_RATE_MAX_PER_S * 2.0, 1).is_err());
    assert!(GcraBucket::validate(f64::NAN, 1).is_err());
    assert!(GcraBucket::validate(f64::INFINITY, 1).is_err());
    assert!(GcraBucket::validate(1.0, 0).is_err());
    assert!(GcraBucket::validate(1.0, GCRA_BURST_MAX + 1).is_err());
    assert!(GcraBucket::validate(GCRA_RATE_MIN_PER_S, GCRA_BURST_MAX).is_ok());
    assert!(GcraBucket::validate(GCRA_RATE_MAX_PER_S, 1).is_ok());
    // The extremes do not overflow.
    let slow = GcraBucket::new(GCRA_RATE_MIN_PER_S, GCRA_BURST_MAX);
    assert!(slow.try_admit(u64::MAX - 1));
    let fast = GcraBucket::new(GCRA_RATE_MAX_PER_S, 1);
    assert!(fast.try_admit(0));
    assert!(fast.try_admit(1));
    assert!(!fast.try_admit(1));
}

#[test]
#[should_panic(expected = "token bucket rate")]
fn gcra_new_refuses_zero_rate() {
    let _ = GcraBucket::new(0.0, 10);
}

#[test]
#[should_panic(expected = "burst")]
fn gcra_new_refuses_zero_burst() {
    let _ = GcraBucket::new(10.0, 0);
}

#[test]
#[should_panic(expected = "token bucket rate")]
fn gcra_set_rate_refuses_nan() {
    GcraBucket::new(10.0, 1).set_rate(f64::NAN);
}

/// Checks that over every window between two admissions, count <= rate * W + burst.
fn check_window_bound(admitted: &[u64], rate_per_s: f64, burst: u32) -> Result<(), String> {
    for i in 0..admitted.len() {
        for j in i..admitted.len() {
            let count = (j - i + 1) as f64;
            let w_s = (admitted[j] - admitted[i]) as f64 / 1e9;
            let bound = rate_per_s * w_s + f64::from(burst);
            if count > bound + 1e-9 {
                return Err(format!(
                    "{count} admissions in [{}, {}] > bound {bound}",
                    admitted[i], admitted[j]
                ));
            }
        }
    }
    Ok(())
}

proptest! {
    #[test]
    fn gcra_window_bound_1000_per_s_burst_10(
        mut arrivals in proptest::collection::vec(0u64..200 * MS, 1..600)
    ) {
        arrivals.sort_unstable();
        let b = GcraBucket::new(1000.0, 10);
        let admitted: Vec<u64> = arrivals.into_iter().filter(|&t| b.try_admit(t)).collect();
        prop_assert!(check_window_bound(&admitted, 1000.0, 10).is_ok(),
            "{:?}", check_window_bound(&admitted, 1000.0, 10));
    }

    #[test]
    fn gcra_window_bound_any_rate(
        rate in 1.0f64..100_000.0,
        burst in 1u32..50,
        mut arrivals in proptest::collection::vec(0u64..S, 1..600)
    ) {
        arrivals.sort_unstable();
        let b = GcraBucket::new(rate, burst);
        let admitted: Vec<u64> = arrivals.into_iter().filter(|&t| b.try_admit(t)).collect();
        let r = check_window_bound(&admitted, rate, burst);
        prop_assert!(r.is_ok(), "{:?}", r);
    }

    #[test]
    fn gcra_admits_whenever_a_token_is_due(gaps in proptest::collection::vec(0u64..3 * MS, 1..300)) {
        // With arrivals spaced at least one interval apart, every one is admitted.
        let b = GcraBucket::new(1000.0, 1);
        let mut t = 0;
        for g in gaps {
            prop_assert!(b.try_admit(t));
            t += MS + g;
        }
    }
}

// --- P90Params ---------------------------------------------------------------------------

#[test]
fn p90_defaults_are_sedas() {
    let p = P90Params::default();
    assert_eq!(p.nreq, 100);
    assert_eq!(p.timeout_ns, S);
    assert_eq!(p.alpha, 0.7);
    assert_eq!(p.err_i, -0.5);
    assert_eq!(p.err_d, 0.0);
    assert_eq!(p.adj_i, 2.0);
    assert_eq!(p.adj_d, 1.2);
    assert_eq!(p.c_i, -0.1);
    assert_eq!(p.rate_min_per_s, 0.05);
    assert_eq!(p.rate_max_per_s, 5000.0);
    assert!(p.validate().is_ok());
}

#[test]
fn p90_params_limits_are_enforced() {
    let d = P90Params::default();
    let bad = |p: P90Params, field: &str| {
        let e = p.validate().expect_err(field);
        assert!(e.contains(field), "{e:?} should name {field}");
    };
    bad(P90Params { target_ns: 0, ..d }, "target_ns");
    bad(
        P90Params {
            target_ns: P90_TIME_MAX_NS + 1,
            ..d
        },
        "target_ns",
    );
    bad(P90Params { nreq: 0, ..d }, "nreq");
    bad(
        P90Params {
            nreq: P90_NREQ_MAX + 1,
            ..d
        },
        "nreq",
    );
    bad(
        P90Params {
            timeout_ns: P90_TIMEOUT_MIN_NS - 1,
            ..d
        },
        "timeout_ns",
    );
    bad(
        P90Params {
            timeout_ns: P90_TIME_MAX_NS + 1,
            ..d
        },
        "timeout_ns",
    );
    bad(P90Params { alpha: 1.0, ..d }, "alpha");
    bad(P90Params { alpha: -0.1, ..d }, "alpha");
    bad(
        P90Params {
            alpha: f64::NAN,
            ..d
        },
        "alpha",
    );
    bad(P90Params { err_i: -1.0, ..d }, "err_i");
    bad(P90Params { err_d: -0.6, ..d }, "err_d");
    bad(
        P90Params {
            err_d: f64::INFINITY,
            ..d
        },
        "err_d",
    );
    bad(P90Params { c_i: -0.6, ..d }, "c_i");
    bad(P90Params { adj_i: 0.0, ..d }, "adj_i");
    bad(P90Params { adj_i: 6000.0, ..d }, "adj_i");
    bad(P90Params { adj_d: 1.0, ..d }, "adj_d");
    bad(
        P90Params {
            adj_d: P90_ADJ_D_MAX * 2.0,
            ..d
        },
        "adj_d",
    );
    bad(
        P90Params {
            rate_min_per_s: 0.0,
            ..d
        },
        "rate_min_per_s",
    );
    bad(
        P90Params {
            rate_max_per_s: 0.01,
            ..d
        },
        "rate_max_per_s",
    );
    bad(
        P90Params {
            rate_max_per_s: 2e9,
            ..d
        },
        "rate_max_per_s",
    );
    // The boundaries themselves are accepted.
    let edge = P90Params {
        target_ns: P90_TIME_MAX_NS,
        nreq: P90_NREQ_MAX,
        timeout_ns: P90_TIMEOUT_MIN_NS,
        alpha: 0.0,
        err_d: d.err_i,
        c_i: d.err_i,
        adj_d: P90_ADJ_D_MAX,
        rate_min_per_s: GCRA_RATE_MIN_PER_S,
        rate_max_per_s: GCRA_RATE_MAX_PER_S,
        ..d
    };
    assert!(edge.validate().is_ok(), "{:?}", edge.validate());
}

#[test]
fn p90_initial_rate_must_be_in_range() {
    let p = P90Params::default();
    assert!(P90Controller::try_new(p.clone(), 0.01).is_err());
    assert!(P90Controller::try_new(p.clone(), 5001.0).is_err());
    assert!(P90Controller::try_new(p.clone(), f64::NAN).is_err());
    assert!(P90Controller::try_new(P90Params { nreq: 0, ..p }, 1.0).is_err());
    assert!(P90Controller::try_new(p, 0.05).is_ok());
}

#[test]
#[should_panic(expected = "initial rate")]
fn p90_new_panics_on_bad_rate() {
    let _ = P90Controller::new(P90Params::default(), 0.0);
}

// --- P90Controller -----------------------------------------------------------------------

fn params_ms(target_ms: u64, nreq: u32) -> P90Params {
    P90Params {
        target_ns: target_ms * MS,
        nreq,
        ..P90Params::default()
    }
}

#[test]
fn p90_percentile_index_of_a_full_window() {
    let mut c = P90Controller::new(params_ms(1000, 100), 100.0);
    // 100 samples 100, 99, ..., 1 ns: sorted[90] = 91.
    for (i, r) in (1..=100u64).rev().enumerate() {
        let out = c.observe(r, i as u64);
        assert_eq!(out.is_some(), i == 99, "runs exactly on the 100th sample");
    }
    assert_eq!(c.p90_smoothed_ns(), Some(91.0));
    assert_eq!(c.pending_samples(), 0);
}

#[test]
fn p90_decrease_steps_by_hand() {
    // target 1 ms, nreq 10, alpha 0.7, start at 100/s.
    let mut c = P90Controller::new(params_ms(1, 10), 100.0);
    assert_eq!(c.p90_smoothed_ns(), None);
    // Window 1: 1..=10 ms; sorted[9] = 10 ms. cur = 10 ms (first run), err = 9 > 0.
    for k in 1..=9 {
        assert_eq!(c.observe(k * MS, 0), None);
    }
    let r1 = c.observe(10 * MS, 0).unwrap();
    assert_eq!(c.p90_smoothed_ns(), Some(10_000_000.0));
    assert_eq!(r1, 100.0 / 1.2);
    // Window 2: all 0.1 ms. cur = 0.7 * 10 ms + 0.3 * 0.1 ms = 7.03 ms, err = 6.03 > 0.
    let mut r2 = None;
    for _ in 0..10 {
        r2 = c.observe(100_000, 0);
    }
    assert!(close(c.p90_smoothed_ns().unwrap(), 7_030_000.0));
    assert_eq!(r2.unwrap(), 100.0 / 1.2 / 1.2);
    assert_eq!(c.rate_per_s(), r2.unwrap());
}

#[test]
fn p90_increase_and_deadband_by_hand() {
    // Window at 0.2 ms against 1 ms: err = -0.8 < -0.5, increase 2.0 * (0.8 - 0.1) = 1.4.
    let mut c = P90Controller::new(params_ms(1, 10), 100.0);
    let mut r = None;
    for _ in 0..10 {
        r = c.observe(200_000, 0);
    }
    assert!(close(r.unwrap(), 101.4), "{r:?}");
    // Next window at 0.9 ms: cur = 0.7 * 0.2 + 0.3 * 0.9 = 0.41 ms, err = -0.59:
    // increase 2.0 * (0.59 - 0.1) = 0.98.
    for _ in 0..10 {
        r = c.observe(900_000, 0);
    }
    assert!(close(c.p90_smoothed_ns().unwrap(), 410_000.0));
    assert!(close(r.unwrap(), 101.4 + 0.98), "{r:?}");
    // Next at 0.9 ms: cur = 0.7 * 0.41 + 0.3 * 0.9 = 0.557 ms, err = -0.443: deadband.
    let before = c.rate_per_s();
    for _ in 0..10 {
        r = c.observe(900_000, 0);
    }
    assert!(close(c.p90_smoothed_ns().unwrap(), 557_000.0));
    assert_eq!(r, Some(before));
}

#[test]
fn p90_rate_is_clamped() {
    let p = params_ms(1, 1);
    let mut c = P90Controller::new(p.clone(), 0.06);
    // One sample per run (nreq 1), far over target: 0.06 / 1.2 = 0.05, then stays at 0.05.
    assert!(close(c.observe(10 * MS, 0).unwrap(), 0.05));
    assert_eq!(c.observe(10 * MS, 0), Some(0.05));
    let mut c = P90Controller::new(p, 4999.0);
    // Far under target with alpha 0.7: cur = 0 -> err = -1, increase 1.8, clamped at 5000.
    assert_eq!(c.observe(0, 0), Some(5000.0));
    assert_eq!(c.observe(0, 0), Some(5000.0));
}

#[test]
fn p90_timeout_runs_a_partial_window() {
    let mut c = P90Controller::new(params_ms(1, 100), 100.0);
    assert_eq!(c.tick(5 * S), None, "no samples: nothing to run");
    // Window opens at the first sample (t = 1 s).
    assert_eq!(c.observe(3 * MS, S), None);
    assert_eq!(c.observe(2 * MS, S + 300 * MS), None);
    assert_eq!(c.observe(5 * MS, S + 600 * MS), None);
    assert_eq!(c.tick(2 * S - 1), None);
    // 3 samples: index min(27 / 10, 2) = 2, the max (5 ms). err = 4: decrease.
    assert_eq!(c.tick(2 * S), Some(100.0 / 1.2));
    assert_eq!(c.p90_smoothed_ns(), Some(5_000_000.0));
    // Next window measured from the run at 2 s; a sample arriving after the timeout runs
    // at once (it is the only sample of a window that lasted > timeout).
    assert_eq!(c.tick(3 * S), None);
    assert!(c.observe(5 * MS, 3 * S + 1).is_some());
    // Observe also triggers on timeout, not only tick.
    assert_eq!(c.observe(5 * MS, 3 * S + 2), None);
    assert!(c.observe(5 * MS, 4 * S + 1).is_some());
}

#[test]
fn p90_tolerates_time_going_backwards() {
    let mut c = P90Controller::new(params_ms(1, 100), 100.0);
    assert_eq!(c.observe(MS, 10 * S), None);
    assert_eq!(c.observe(MS, 5 * S), None);
    assert_eq!(c.tick(0), None);
}

// --- ClassedP90 --------------------------------------------------------------------------

fn classed_params() -> P90Params {
    // alpha 0 makes cur equal to each window's percentile, so each step is visible.
    P90Params {
        nreq: 10,
        alpha: 0.0,
        ..P90Params::default()
    }
}

/// Feeds one full window of `class` at `response_ns`; returns what the last observe said.
fn window(c: &mut ClassedP90, class: usize, response_ns: u64, now_ns: u64) -> bool {
    let mut changed = false;
    for _ in 0..10 {
        changed = c.observe(class, response_ns, now_ns);
    }
    changed
}

#[test]
fn classed_limits_are_enforced() {
    let p = classed_params();
    assert!(ClassedP90::new(&[], p.clone(), 100.0)
        .unwrap_err()
        .contains("classes"));
    assert!(ClassedP90::new(&[MS; CLASSES_MAX + 1], p.clone(), 100.0)
        .unwrap_err()
        .contains("classes"));
    assert_eq!(
        ClassedP90::new(&[MS; CLASSES_MAX], p.clone(), 100.0)
            .unwrap()
            .classes(),
        16
    );
    let e = ClassedP90::new(&[MS, 0], p.clone(), 100.0).unwrap_err();
    assert!(e.contains("class 1") && e.contains("target_ns"), "{e}");
    assert!(ClassedP90::new(&[MS], p, 0.0)
        .unwrap_err()
        .contains("initial rate"));
}

#[test]
#[should_panic(expected = "out of range")]
fn classed_class_out_of_range_panics() {
    let mut c = ClassedP90::new(&[MS, MS], classed_params(), 100.0).unwrap();
    c.observe(2, MS, 0);
}

#[test]
fn classed_high_over_target_cuts_lower_classes_by_ten() {
    let mut c = ClassedP90::new(&[MS, MS, MS], classed_params(), 100.0).unwrap();
    assert!(window(&mut c, 0, 5 * MS, 0));
    assert!(c.over_target(0));
    assert_eq!(c.rate_per_s(0), 100.0, "the high class keeps its rate");
    assert_eq!(c.rate_per_s(1), 10.0);
    assert_eq!(c.rate_per_s(2), 10.0);
    // The middle class over target cuts only the class below it.
    assert!(window(&mut c, 1, 5 * MS, 0));
    assert_eq!(c.rate_per_s(0), 100.0);
    assert_eq!(c.rate_per_s(1), 10.0);
    assert_eq!(c.rate_per_s(2), 1.0);
}

#[test]
fn classed_lowest_class_follows_single_class_rule() {
    let mut c = ClassedP90::new(&[MS, MS], classed_params(), 100.0).unwrap();
    assert!(window(&mut c, 1, 5 * MS, 0));
    assert_eq!(c.rate_per_s(1), 100.0 / 1.2);
    assert_eq!(c.rate_per_s(0), 100.0);
}

#[test]
fn classed_low_class_cannot_increase_while_high_class_is_over() {
    let mut c = ClassedP90::new(&[MS, MS], classed_params(), 100.0).unwrap();
    window(&mut c, 0, 5 * MS, 0);
    assert_eq!(c.rate_per_s(1), 10.0);
    // Class 1 far under target (err = -0.9) would increase, but class 0 is over.
    assert!(!window(&mut c, 1, 100_000, 100 * MS));
    assert_eq!(c.rate_per_s(1), 10.0);
    // Class 0 back at half its target: err = -0.5, not over (and no increase for it).
    assert!(!window(&mut c, 0, 500_000, 200 * MS));
    assert!(!c.over_target(0));
    // Now class 1 increases by 2.0 * (0.9 - 0.1) = 1.6.
    assert!(window(&mut c, 1, 100_000, 300 * MS));
    assert!(close(c.rate_per_s(1), 11.6));
}

#[test]
fn classed_over_flag_lapses_when_high_class_goes_quiet() {
    let mut c = ClassedP90::new(&[MS, MS], classed_params(), 100.0).unwrap();
    window(&mut c, 0, 5 * MS, 0);
    // Within two timeouts of class 0's last run: held.
    assert!(!window(&mut c, 1, 100_000, 2 * S));
    assert_eq!(c.rate_per_s(1), 10.0);
    // Class 0 has not run for more than two timeouts: its flag no longer holds class 1.
    assert!(window(&mut c, 1, 100_000, 2 * S + 1));
    assert!(close(c.rate_per_s(1), 11.6));
}

#[test]
fn classed_shed_high_class_counts_as_over_and_cuts_the_lower_class() {
    let mut c = ClassedP90::new(&[MS, MS], classed_params(), 100.0).unwrap();
    // Class 0 served its requests at a quarter of its target (err = -0.75) ...
    c.note_shed(0);
    // ... but its queue bound refused some: the lower class is cut, class 0 keeps its rate.
    assert!(window(&mut c, 0, 250_000, 0));
    assert!(c.over_target(0));
    assert_eq!(c.rate_per_s(0), 100.0);
    assert_eq!(c.rate_per_s(1), 10.0);
    // The flag is for one run only: the next clean run is under target and increases.
    assert!(window(&mut c, 0, 250_000, 0));
    assert!(!c.over_target(0));
    assert!(close(c.rate_per_s(0), 100.0 + 2.0 * 0.65));
    // The lowest class has nobody to cut: a shed alone does not count as over there.
    c.note_shed(1);
    assert!(window(&mut c, 1, 250_000, 10 * S));
    assert!(!c.over_target(1));
}

#[test]
#[should_panic(expected = "out of range")]
fn classed_note_shed_out_of_range_panics() {
    let mut c = ClassedP90::new(&[MS, MS], classed_params(), 100.0).unwrap();
    c.note_shed(2);
}

// --- LittleBound --------------------------------------------------------------------------

#[test]
fn little_bound_limits_are_enforced() {
    assert!(LittleBound::new(0, 0.5, 100)
        .unwrap_err()
        .contains("target_ns"));
    assert!(LittleBound::new(P90_TIME_MAX_NS + 1, 0.5, 100).is_err());
    assert!(LittleBound::new(MS, 0.0, 100)
        .unwrap_err()
        .contains("fraction"));
    assert!(LittleBound::new(MS, 1.5, 100)
        .unwrap_err()
        .contains("fraction"));
    assert!(LittleBound::new(MS, f64::NAN, 100).is_err());
    assert!(LittleBound::new(MS, 0.5, 0)
        .unwrap_err()
        .contains("limit_max"));
    let p = |f| P90Params {
        queue_bound_fraction: f,
        ..P90Params::default()
    };
    assert!(p(1.5)
        .validate()
        .unwrap_err()
        .contains("queue_bound_fraction"));
    assert!(p(0.5).validate().is_ok());
}

#[test]
fn little_bound_is_fraction_of_target_times_backlogged_departure_rate() {
    // Target 20 ms, half of it: at 2,000 departures/s the queue may hold 20.
    let mut b = LittleBound::new(20 * MS, 0.5, 10_000).unwrap();
    assert_eq!(b.bound(), 10_000, "no bound before the first window");
    assert_eq!(b.observe(0, 0, u64::MAX, 0), None);
    // 100 completions over 50 ms of backlog = 2,000/s.
    assert_eq!(b.observe(99, 49 * MS, u64::MAX, 0), None);
    assert_eq!(b.observe(1, 50 * MS, u64::MAX, 0), Some(20));
    assert_eq!(b.rate_per_s(), Some(2_000.0));
    // Next window at 4,000/s: smoothed to 3,000/s, bound 30.
    assert_eq!(b.observe(200, 100 * MS, u64::MAX, 0), Some(30));
    // Idle intervals do not count (the oldest message of the batch was queued after the
    // previous report): 40 completions in 20 ms of backlog, in a window whose first 30 ms
    // began with an empty queue, is 2,000/s (smoothed with 3,000: 2,500/s).
    assert_eq!(b.observe(5, 130 * MS, 0, 0), None);
    assert_eq!(b.observe(20, 140 * MS, 10 * MS, 0), None);
    assert_eq!(b.observe(20, 150 * MS, u64::MAX, 0), Some(25));
    // A window with under 5 ms of backlog keeps the bound.
    assert_eq!(b.observe(1, 300 * MS, 0, 0), None);
    assert_eq!(b.bound(), 25);
    // A slow backlogged window lowers it, down to the floor.
    assert_eq!(b.observe(1, 10 * S, u64::MAX, 0), Some(12));
    assert_eq!(b.observe(1, 20 * S, u64::MAX, 0), Some(6));
    assert_eq!(b.observe(1, 30 * S, u64::MAX, 0), Some(LITTLE_BOUND_MIN));
}

#[test]
fn little_bound_counts_throughput_when_it_refused() {
    // A queue kept at a bound no larger than a batch is emptied by every batch, so it
    // never looks backlogged; refusals show that demand exceeded it.
    let mut b = LittleBound::new(20 * MS, 0.5, 10_000).unwrap();
    b.observe(0, 0, 0, 0);
    // 100 completions in 50 ms, never backlogged, no refusal: nothing learnt.
    assert_eq!(b.observe(100, 50 * MS, 0, 0), None);
    // The same with refusals: 2,000/s, bound 20.
    assert_eq!(b.observe(100, 100 * MS, 0, 3), Some(20));
    // The larger of the two estimates wins: backlogged 4,000/s vs throughput 1,000/s.
    assert_eq!(b.observe(10, 140 * MS, 0, 1), None);
    assert_eq!(b.observe(40, 150 * MS, u64::MAX, 0), Some(30));
}

#[test]
fn little_bound_never_exceeds_the_queue_limit() {
    let mut b = LittleBound::new(S, 1.0, 50).unwrap();
    b.observe(0, 0, u64::MAX, 0);
    // 1e6/s × 1 s would be a million: capped at the queue's own limit.
    assert_eq!(b.observe(50_000, 50 * MS, u64::MAX, 0), Some(50));
    // A huge count saturates instead of overflowing.
    assert_eq!(b.observe(u64::MAX, 100 * MS, u64::MAX, 0), Some(50));
}

#[test]
fn classed_lc_thresh_cuts_the_high_class_itself() {
    let mut c = ClassedP90::new(&[MS, MS], classed_params(), 1.0).unwrap();
    // Run 1: class 1 from 1.0 to 0.1; run 2: to 0.05 (0.01 clamped at rate_min).
    assert!(window(&mut c, 0, 5 * MS, 0));
    assert!(close(c.rate_per_s(1), 0.1));
    assert!(window(&mut c, 0, 5 * MS, 0));
    assert_eq!(c.rate_per_s(1), 0.05);
    assert_eq!(c.low_count(0), 0);
    // Runs 3..=21: lower class at the floor, lc counts up to 19, class 0 untouched.
    for k in 1..LC_THRESH {
        assert!(!window(&mut c, 0, 5 * MS, 0));
        assert_eq!(c.low_count(0), k);
        assert_eq!(c.rate_per_s(0), 1.0);
    }
    // Run 22: lc reaches 20, class 0 divides its own rate by adj_d, lc resets.
    assert!(window(&mut c, 0, 5 * MS, 0));
    assert_eq!(c.rate_per_s(0), 1.0 / 1.2);
    assert_eq!(c.low_count(0), 0);
    // An under-target run also resets the count.
    assert!(!window(&mut c, 0, 5 * MS, 0));
    assert_eq!(c.low_count(0), 1);
    window(&mut c, 0, 800_000, 0);
    assert_eq!(c.low_count(0), 0);
}

#[test]
fn classed_tick_runs_on_timeout() {
    let mut c = ClassedP90::new(&[MS, MS], classed_params(), 100.0).unwrap();
    assert!(!c.observe(0, 5 * MS, 0));
    assert!(!c.tick(S - 1));
    assert!(c.tick(S));
    assert_eq!(c.rate_per_s(1), 10.0);
    assert_eq!(c.p90_smoothed_ns(0), Some(5_000_000.0));
    assert_eq!(c.p90_smoothed_ns(1), None);
}

// --- BatchingController ------------------------------------------------------------------

/// Throughput as a function of batch size with its optimum at 200, shaped like SEDA's
/// Fig. 32: below 200 an expensive per-batch operation is amortized over fewer events
/// (throughput roughly proportional to the batch), above 200 it falls off slowly.
fn fig32(batch: u32) -> f64 {
    let b = f64::from(batch);
    let peak = 100_000.0;
    if b <= 200.0 {
        peak * b * 10_200.0 / (200.0 * (10_000.0 + b))
    } else {
        peak * (200.0 / b).sqrt()
    }
}

#[test]
fn batching_settles_near_the_optimum() {
    let mut c = BatchingController::new(1000);
    assert_eq!(c.batch(), 1000);
    let mut b = c.batch();
    let mut trace = Vec::new();
    for _ in 0..300 {
        b = c.observe(fig32(b));
        trace.push(b);
    }
    let tail = &trace[50..];
    for &x in tail {
        assert!(
            (120..=280).contains(&x),
            "batch {x} strays from 200: {tail:?}"
        );
    }
    let mean = tail.iter().map(|&x| f64::from(x)).sum::<f64>() / tail.len() as f64;
    assert!((160.0..=240.0).contains(&mean), "mean {mean}");
}

#[test]
fn batching_shrink_then_grow_by_hand() {
    let mut c = BatchingController::new(1000);
    // Constant throughput: shrink ×0.8 each window.
    assert_eq!(c.observe(100.0), 800);
    assert_eq!(c.observe(100.0), 640);
    assert_eq!(c.phase(), BatchPhase::Shrink);
    // 89 < 0.9 * 100: grow ×1.2 (640 * 1.2 = 768).
    assert_eq!(c.observe(89.0), 768);
    assert_eq!(c.phase(), BatchPhase::Grow);
    // 92 < 0.95 * 100 and better than 89: keep growing.
    assert_eq!(c.observe(92.0), 922);
    // 96 >= 95: approached best, shrink again.
    assert_eq!(c.observe(96.0), 737);
    assert_eq!(c.phase(), BatchPhase::Shrink);
    // Idle window: nothing changes.
    assert_eq!(c.observe(0.0), 737);
    // Grow phase that gets worse turns back to shrinking.
    assert_eq!(c.observe(80.0), 885);
    assert_eq!(c.observe(70.0), 708);
    assert_eq!(c.phase(), BatchPhase::Shrink);
}

#[test]
fn batching_resets_on_sudden_drop() {
    let mut c = BatchingController::new(1000);
    for _ in 0..10 {
        c.observe(1000.0);
    }
    assert!(c.batch() < 200);
    assert_eq!(c.observe(499.0), 1000);
    assert_eq!(c.phase(), BatchPhase::Shrink);
    assert_eq!(
        c.best_per_s(),
        499.0,
        "history restarts from the new regime"
    );
    // The new regime is not a drop from itself: shrinking resumes.
    assert_eq!(c.observe(499.0), 800);
}

#[test]
fn batching_best_is_forgotten_after_the_window() {
    let mut c = BatchingController::new(1000);
    c.observe(1000.0);
    for _ in 0..BATCH_BEST_WINDOWS {
        c.observe(600.0);
    }
    assert_eq!(c.best_per_s(), 600.0);
}

#[test]
fn batching_climbs_from_one() {
    let mut c = BatchingController::new(1000);
    for _ in 0..40 {
        c.observe(100.0);
    }
    assert_eq!(c.batch(), 1, "bottoms out at 1");
    // Throughput falls below 90% of best: grow; the real-valued batch climbs past 1.
    let mut seen = vec![c.observe(85.0)];
    for t in [86.0, 87.0, 88.0, 89.0, 90.0, 91.0] {
        seen.push(c.observe(t));
    }
    assert!(seen.windows(2).all(|w| w[0] <= w[1]), "{seen:?}");
    assert!(*seen.last().unwrap() >= 3, "{seen:?}");
}

#[test]
#[should_panic(expected = "batch_max")]
fn batching_refuses_zero_max() {
    let _ = BatchingController::new(0);
}

#[test]
#[should_panic(expected = "batch_max")]
fn batching_refuses_huge_max() {
    let _ = BatchingController::new(BATCH_MAX + 1);
}

#[test]
#[should_panic(expected = "throughput")]
fn batching_refuses_nan_throughput() {
    BatchingController::new(10).observe(f64::NAN);
}

proptest! {
    #[test]
    fn batching_stays_in_range(
        max in 1u32..5000,
        tputs in proptest::collection::vec(0.0f64..1e6, 1..200)
    ) {
        let mut c = BatchingController::new(max);
        for t in tputs {
            let b = c.observe(t);
            prop_assert!((1..=max).contains(&b));
        }
    }
}

// --- Share-aware shedding ----------------------------------------------------------------

#[test]
fn over_share_ratio_examples() {
    // Half the usage with a quarter of the weight: twice its share.
    assert_eq!(over_share_ratio(50, 1, 100, 4), 2.0);
    assert_eq!(over_share_ratio(25, 1, 100, 4), 1.0);
    assert_eq!(over_share_ratio(0, 1, 100, 4), 0.0);
    assert_eq!(over_share_ratio(0, 3, 0, 4), 1.0);
}

#[test]
#[should_panic(expected = "weight must be >= 1")]
fn over_share_ratio_refuses_zero_weight() {
    over_share_ratio(1, 0, 1, 1);
}

#[test]
#[should_panic(expected = "below the activity's weight")]
fn over_share_ratio_refuses_total_below_weight() {
    over_share_ratio(1, 5, 1, 4);
}

#[test]
fn shared_queue_limits_are_enforced() {
    assert!(SharedQueueLimit::new(0, 0)
        .unwrap_err()
        .contains("capacity"));
    assert!(SharedQueueLimit::new(SHARED_QUEUE_CAPACITY_MAX + 1, 1)
        .unwrap_err()
        .contains("capacity"));
    assert!(SharedQueueLimit::new(10, 11)
        .unwrap_err()
        .contains("high_water"));
    let l = SharedQueueLimit::new(10, 10).unwrap();
    assert_eq!((l.capacity(), l.high_water()), (10, 10));
    // No shedding band: a plain bound.
    assert_eq!(l.verdict(9, 9, 1, 2), Verdict::Admit);
    assert_eq!(
        l.verdict(10, 0, 1, 2),
        Verdict::Reject(RejectReason::QueueFull)
    );
}

#[test]
fn shared_queue_sheds_over_share_first() {
    let l = SharedQueueLimit::new(100, 50).unwrap();
    // Below high water: everyone, even a hog.
    assert_eq!(l.verdict(49, 49, 1, 2), Verdict::Admit);
    // At 80 queued: tolerance = 2 - 30/50 = 1.4; fair portion of each of two equal
    // activities = 40, so the limit is 56.
    assert_eq!(l.verdict(80, 60, 1, 2), Verdict::Reject(RejectReason::Shed));
    assert_eq!(l.verdict(80, 56, 1, 2), Verdict::Admit);
    assert_eq!(l.verdict(80, 20, 1, 2), Verdict::Admit);
    // Weights count: with weights 1 and 3 (sum 4), at 80 the weight-3 activity's fair
    // portion is 60, limit 84: 70 queued still gets in; the weight-1 one's limit is 28.
    assert_eq!(l.verdict(80, 70, 3, 4), Verdict::Admit);
    assert_eq!(l.verdict(80, 29, 1, 4), Verdict::Reject(RejectReason::Shed));
    // Near capacity the under-share activity still gets in; at capacity nobody does.
    assert_eq!(l.verdict(99, 10, 1, 2), Verdict::Admit);
    for (q, w) in [(0, 1), (10, 1), (99, 3)] {
        assert_eq!(
            l.verdict(100, q, w, 4),
            Verdict::Reject(RejectReason::QueueFull)
        );
        assert_eq!(
            l.verdict(150, q, w, 4),
            Verdict::Reject(RejectReason::QueueFull)
        );
    }
}

#[test]
fn shared_queue_sheds_the_furthest_above_share_at_lowest_occupancy() {
    // Three equal activities holding 60%, 40% and 0% of the queue (ratios 1.8, 1.2, 0):
    // find the occupancy at which each is first shed.
    let l = SharedQueueLimit::new(1000, 500).unwrap();
    let first_shed = |fraction: f64| {
        (500..1000).find(|&total| {
            let q = (total as f64 * fraction) as usize;
            l.verdict(total, q, 1, 3) == Verdict::Reject(RejectReason::Shed)
        })
    };
    let hog = first_shed(0.6).unwrap();
    let over = first_shed(0.4).unwrap();
    assert!(hog < over, "hog shed at {hog}, lesser offender at {over}");
    assert_eq!(first_shed(0.0), None, "an idle activity is never shed");
}

#[test]
#[should_panic(expected = "activity weight")]
fn shared_queue_refuses_zero_weight() {
    SharedQueueLimit::new(10, 5).unwrap().verdict(6, 1, 0, 1);
}

#[test]
#[should_panic(expected = "active weight sum")]
fn shared_queue_refuses_sum_below_weight() {
    SharedQueueLimit::new(10, 5).unwrap().verdict(6, 1, 3, 2);
}
