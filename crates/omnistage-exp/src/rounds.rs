//! Repeated runs and what they allow us to say: servers alternated round by round (so a slow
//! spell of the shared machine falls on both), each figure as a median with its min–max, and the
//! symmetric verdict: a difference inside the run-to-run spread of its baseline is
//! "inconclusive" whatever its sign.

use serde::Serialize;

/// A figure over repeats: median and range.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

impl Spread {
    /// The spread of `v` (all zero for none; NaNs are left out).
    pub fn of(v: &[f64]) -> Spread {
        let mut s: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
        if s.is_empty() {
            return Spread {
                median: 0.0,
                min: 0.0,
                max: 0.0,
                n: 0,
            };
        }
        s.sort_by(|a, b| a.total_cmp(b));
        let n = s.len();
        let median = if n % 2 == 1 {
            s[n / 2]
        } else {
            (s[n / 2 - 1] + s[n / 2]) / 2.0
        };
        Spread {
            median,
            min: s[0],
            max: s[n - 1],
            n,
        }
    }

    /// "52,100 (49,800–53,000)" with `decimals` decimals.
    pub fn show(&self, decimals: usize) -> String {
        if self.n <= 1 {
            return format!("{:.*}", decimals, self.median);
        }
        format!(
            "{:.*} ({:.*}–{:.*})",
            decimals, self.median, decimals, self.min, decimals, self.max
        )
    }
}

/// Runs `run(round, server)` for `repeats` rounds, each round every server in turn (the order
/// reversed every other round, so neither always goes first), and returns the results in run
/// order.
pub fn alternate<T>(
    repeats: usize,
    servers: &[&'static str],
    mut run: impl FnMut(usize, &'static str) -> Result<T, String>,
) -> Result<Vec<(usize, &'static str, T)>, String> {
    let mut out = Vec::with_capacity(repeats * servers.len());
    for round in 0..repeats {
        let mut order: Vec<&'static str> = servers.to_vec();
        if round % 2 == 1 {
            order.reverse();
        }
        for s in order {
            out.push((round, s, run(round, s)?));
        }
    }
    Ok(out)
}

/// Groups `runs` by `key` (groups in the order first seen) and returns, per group, the run
/// whose `value` is the median (the lower middle for an even count) with the spread of `value`
/// over the group.
pub fn median_runs<T: Clone, K: PartialEq>(
    runs: &[T],
    key: impl Fn(&T) -> K,
    value: impl Fn(&T) -> f64,
) -> Vec<(T, Spread)> {
    let mut keys: Vec<K> = Vec::new();
    for r in runs {
        let k = key(r);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    keys.into_iter()
        .map(|k| {
            let mut mine: Vec<&T> = runs.iter().filter(|r| key(r) == k).collect();
            mine.sort_by(|a, b| value(a).total_cmp(&value(b)));
            let spread = Spread::of(&mine.iter().map(|r| value(r)).collect::<Vec<_>>());
            (mine[(mine.len() - 1) / 2].clone(), spread)
        })
        .collect()
}

/// How a comparison of ours against a baseline came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Ours is better: the median of ours differs from the baseline's median, in the better
    /// direction, by more than the baseline's run-to-run spread (max − min). (Not a claim about
    /// every run: a single fast run of ours can be Better.)
    Better,
    /// Ours is worse, likewise in the worse direction.
    Worse,
    /// The difference of medians lies inside the baseline's run-to-run spread (whatever its
    /// sign), or there is no baseline spread to judge against (one run).
    Inconclusive,
}

impl Verdict {
    pub fn word(&self) -> &'static str {
        match self {
            Verdict::Better => "better",
            Verdict::Worse => "worse",
            Verdict::Inconclusive => "inconclusive",
        }
    }
}

/// Compares the median of `ours` with the median of `base`, where larger is better when
/// `higher_is_better`: the difference counts only when it is larger than the baseline's own
/// spread (max − min over its runs). One baseline run has no spread: inconclusive.
pub fn compare(ours: &[f64], base: &[f64], higher_is_better: bool) -> Verdict {
    let (o, b) = (Spread::of(ours), Spread::of(base));
    if o.n == 0 || b.n < 2 {
        return Verdict::Inconclusive;
    }
    let diff = o.median - b.median;
    if diff.abs() <= b.max - b.min {
        return Verdict::Inconclusive;
    }
    if (diff > 0.0) == higher_is_better {
        Verdict::Better
    } else {
        Verdict::Worse
    }
}

/// Why the runs of ours cannot be compared with a peer's at all, if they cannot: a side
/// without runs, a figure that is not a finite number, a run that served nothing (a rate of
/// 0 makes any ratio to it infinite, or zero, and reads as a result), or a peer whose clients
/// saw errors (a failing peer is no baseline). The sentence names the peer `peer`.
pub fn not_judged(ours: &[f64], base: &[f64], base_errors: u64, peer: &str) -> Option<String> {
    let runs = |v: &[f64]| if v.len() == 1 { "run" } else { "runs" };
    if ours.is_empty() || base.is_empty() {
        return Some(format!(
            "no runs of {}",
            if ours.is_empty() { "omnistage" } else { peer }
        ));
    }
    if ours.iter().chain(base).any(|x| !x.is_finite()) {
        return Some("a figure that is not a finite number".into());
    }
    for (who, v) in [(peer, base), ("omnistage", ours)] {
        let idle = v.iter().filter(|&&x| x <= 0.0).count();
        if idle > 0 {
            return Some(format!(
                "{who} served nothing in {idle} of its {} {}",
                v.len(),
                runs(v)
            ));
        }
    }
    if base_errors > 0 {
        return Some(format!(
            "{peer}'s clients saw {base_errors} errors (a failing peer is no baseline)"
        ));
    }
    None
}

/// Judges "ours at least `goal` × the baseline" (larger is better) by the symmetric rule: the
/// baseline's runs scaled by `goal` are the bar, met when the median of ours is above the bar's
/// median by more than the bar's run-to-run range, missed when below it by more, `None`
/// (inconclusive) inside it whatever the sign, with one baseline run (no range), or when
/// [`not_judged`] gives a reason.
pub fn at_least(ours: &[f64], base: &[f64], goal: f64) -> Option<bool> {
    if not_judged(ours, base, 0, "the peer").is_some() || !(goal.is_finite() && goal > 0.0) {
        return None;
    }
    let bar: Vec<f64> = base.iter().map(|b| b * goal).collect();
    verdict_met(compare(ours, &bar, true))
}

/// A comparison's verdict as a goal of "better": met, missed, or `None` when inconclusive.
pub fn verdict_met(v: Verdict) -> Option<bool> {
    match v {
        Verdict::Better => Some(true),
        Verdict::Worse => Some(false),
        Verdict::Inconclusive => None,
    }
}

/// Judges a measured relative cost `fraction` (e.g. +0.02 = 2 % more than the baseline) against
/// a goal of at most `goal`, given the baseline's own run-to-run spread relative to its median
/// (`spread`, e.g. 0.05): the cost is known only to lie in `fraction ± spread`, so the goal is
/// met when even `fraction + spread` is inside it, missed when even `fraction − spread` is
/// outside it, and `None` (inconclusive) when the interval holds the bound, whatever the sign
/// of `fraction` (design.md, "Symmetric verdicts"). An interval that holds 0 but lies wholly
/// under the bound (0.5 % ± 1.5 % against 3 %) meets it: the question is the bound, not
/// whether there is a difference.
pub fn within_goal(fraction: f64, spread: f64, goal: f64) -> Option<bool> {
    if !fraction.is_finite() || !spread.is_finite() || !goal.is_finite() {
        return None;
    }
    let spread = spread.abs();
    if fraction + spread <= goal {
        Some(true)
    } else if fraction - spread > goal {
        Some(false)
    } else {
        None
    }
}

/// (max − min) / median of `v`: a run-to-run spread relative to the median (infinite for one
/// run: one run says nothing about its own noise).
pub fn relative_spread(v: &[f64]) -> f64 {
    let s = Spread::of(v);
    if s.n < 2 || s.median == 0.0 {
        return f64::INFINITY;
    }
    (s.max - s.min) / s.median.abs()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_of_odd_even_empty() {
        let s = Spread::of(&[3.0, 1.0, 2.0]);
        assert_eq!((s.median, s.min, s.max, s.n), (2.0, 1.0, 3.0, 3));
        assert_eq!(Spread::of(&[4.0, 1.0, 2.0, 3.0]).median, 2.5);
        assert_eq!(Spread::of(&[]).n, 0);
        assert_eq!(Spread::of(&[f64::NAN, 1.0]).n, 1);
        assert_eq!(Spread::of(&[1.0, 3.0, 2.0]).show(1), "2.0 (1.0–3.0)");
        assert_eq!(Spread::of(&[1.0]).show(0), "1");
    }

    #[test]
    fn bounded_goals_are_judged_by_the_interval() {
        // 0.69 % with a 10 % spread: inconclusive (up to 10.69 %); −8.4 % with the same
        // spread is at most 1.6 %: met.
        assert_eq!(within_goal(0.0069, 0.10, 0.03), None);
        assert_eq!(within_goal(-0.084, 0.10, 0.03), Some(true));
        assert_eq!(within_goal(-0.084, 0.05, 0.03), Some(true));
        assert_eq!(within_goal(0.015, 0.01, 0.03), Some(true));
        assert_eq!(within_goal(0.025, 0.01, 0.03), None);
        assert_eq!(within_goal(0.10, 0.05, 0.03), Some(false));
        assert_eq!(within_goal(0.0, f64::INFINITY, 0.03), None);
        // A cost whose whole interval lies inside the bound meets it, even when the interval
        // holds 0 (0.5 % ± 1.5 % is at most 2 %), as −2 % ± 1.5 % does.
        assert_eq!(within_goal(0.005, 0.015, 0.03), Some(true));
        assert_eq!(within_goal(-0.02, 0.015, 0.03), Some(true));
        // An interval that holds the bound is inconclusive, whichever side the cost is on.
        assert_eq!(within_goal(0.02, 0.015, 0.03), None);
        assert_eq!(within_goal(0.04, 0.015, 0.03), None);
        assert_eq!(within_goal(0.05, 0.015, 0.03), Some(false));
        assert_eq!(relative_spread(&[9.0, 10.0, 11.0]), 0.2);
        assert!(relative_spread(&[1.0]).is_infinite());
    }

    #[test]
    fn the_median_run_of_each_group() {
        let runs = [("a", 3.0), ("b", 1.0), ("a", 1.0), ("a", 2.0), ("b", 5.0)];
        let m = median_runs(&runs, |r| r.0, |r| r.1);
        assert_eq!(m.len(), 2);
        assert_eq!((m[0].0, m[0].1.min, m[0].1.max), (("a", 2.0), 1.0, 3.0));
        assert_eq!(m[1].0, ("b", 1.0)); // lower middle of two
    }

    #[test]
    fn alternation_swaps_who_goes_first() {
        let r = alternate(3, &["a", "b"], |round, s| Ok(format!("{round}{s}"))).unwrap();
        let order: Vec<&str> = r.iter().map(|x| x.2.as_str()).collect();
        assert_eq!(order, ["0a", "0b", "1b", "1a", "2a", "2b"]);
        assert!(alternate(2, &["a"], |_, _| Err::<(), _>("no".into())).is_err());
    }

    #[test]
    fn a_peer_that_served_nothing_is_no_baseline() {
        let ours = [100.0, 100.0, 100.0];
        assert!(not_judged(&ours, &[0.0, 0.0, 0.0], 0, "nginx")
            .is_some_and(|r| r.contains("nginx served nothing in 3 of its 3 runs")));
        assert!(not_judged(&ours, &[90.0, 0.0, 95.0], 0, "nginx").is_some());
        assert!(
            not_judged(&[0.0, 100.0, 100.0], &[90.0, 91.0, 95.0], 0, "nginx")
                .is_some_and(|r| r.contains("omnistage served nothing"))
        );
        assert!(not_judged(&ours, &[90.0, f64::NAN, 95.0], 0, "nginx").is_some());
        assert!(not_judged(&ours, &[90.0, 91.0, 95.0], 3, "nginx")
            .is_some_and(|r| r.contains("3 errors")));
        assert!(not_judged(&ours, &[], 0, "nginx").is_some());
        assert_eq!(not_judged(&ours, &[90.0, 91.0, 95.0], 0, "nginx"), None);
        assert_eq!(at_least(&ours, &[0.0, 0.0, 0.0], 1.0), None);
    }

    #[test]
    fn at_least_a_multiple_is_judged_against_the_scaled_range() {
        // 0.8 × [90, 100, 110] = [72, 80, 88]: range 16 about 80.
        let base = [90.0, 100.0, 110.0];
        assert_eq!(at_least(&[97.0], &base, 0.8), Some(true));
        assert_eq!(at_least(&[95.0], &base, 0.8), None);
        assert_eq!(at_least(&[65.0], &base, 0.8), None);
        assert_eq!(at_least(&[63.0], &base, 0.8), Some(false));
        // Ours just above the bar, inside its range: not met (it was, by the ratio alone).
        assert_eq!(at_least(&[101.0, 101.0, 101.0], &base, 1.0), None);
        // One baseline run: no range to judge by.
        assert_eq!(at_least(&[1000.0], &[100.0], 1.0), None);
    }

    #[test]
    fn verdicts_are_symmetric_in_sign() {
        let base = [10.0, 12.0, 11.0]; // spread 2
                                       // +1.5 and -1.5: both inside the spread.
        assert_eq!(compare(&[12.5], &base, true), Verdict::Inconclusive);
        assert_eq!(compare(&[9.5], &base, true), Verdict::Inconclusive);
        assert_eq!(compare(&[13.5], &base, true), Verdict::Better);
        assert_eq!(compare(&[8.5], &base, true), Verdict::Worse);
        // Lower is better (time per request): the same difference, the other word.
        assert_eq!(compare(&[8.5], &base, false), Verdict::Better);
        // One baseline run: nothing to judge the difference against.
        assert_eq!(compare(&[100.0], &[1.0], true), Verdict::Inconclusive);
    }
}
