//! Share verdicts judged by an instrument the scheduler does not control. Every share
//! experiment has two figures per activity: the ledger's share (what the scheduler charged) and
//! the clients' share (completed requests of equal fixed work, bytes received, or work items
//! counted by the work itself). The goal is met only when both are inside it, and the clients'
//! figure is trusted only with at least [`COMPLETIONS_MIN`] completions per activity (fewer
//! and one completion more or less moves a share by more than 0.1 point).

use serde::Serialize;

/// Completions per activity below which the clients' share is too coarse to judge by.
pub const COMPLETIONS_MIN: u64 = 1000;

/// The verdict on one set of shares; flattened into an experiment's top-level JSON.
#[derive(Clone, Debug, Serialize)]
pub struct ShareVerdict {
    pub goal_pts: f64,
    /// Largest |share − target| by the ledger, points.
    pub ledger_max_error_pts: f64,
    /// Largest |client_share − target| by the clients, points.
    pub client_max_error_pts: f64,
    /// The fewest completions the clients counted for one activity.
    pub client_completions_min: u64,
    /// `client_completions_min` ≥ [`COMPLETIONS_MIN`].
    pub completions_enough: bool,
    /// Both figures inside the goal.
    pub goal_met: bool,
}

/// Each count's fraction of the total (all zero when the total is zero).
pub fn shares(counts: &[f64]) -> Vec<f64> {
    let total: f64 = counts.iter().sum();
    counts
        .iter()
        .map(|c| if total > 0.0 { c / total } else { 0.0 })
        .collect()
}

/// Judges `ledger` and `client` shares against `targets` with a goal of `goal_pts` points;
/// `completions` are the clients' completions per activity.
pub fn judge(
    targets: &[f64],
    ledger: &[f64],
    client: &[f64],
    completions: &[u64],
    goal_pts: f64,
) -> ShareVerdict {
    assert!(targets.len() == ledger.len() && targets.len() == client.len());
    // The largest error, NaN when a share or target is not a finite number (`f64::max` would
    // drop a NaN and read it as no error at all) or when there is nothing to judge.
    let max_err = |s: &[f64]| {
        s.iter()
            .zip(targets)
            .map(|(s, t)| ((s - t) * 100.0).abs())
            .map(|e| if e.is_finite() { e } else { f64::NAN })
            .reduce(|a, b| {
                if a.is_nan() || b.is_nan() {
                    f64::NAN
                } else {
                    a.max(b)
                }
            })
            .unwrap_or(f64::NAN)
    };
    let (l, c) = (max_err(ledger), max_err(client));
    let min = completions.iter().copied().min().unwrap_or(0);
    ShareVerdict {
        goal_pts,
        ledger_max_error_pts: l,
        client_max_error_pts: c,
        client_completions_min: min,
        completions_enough: min >= COMPLETIONS_MIN,
        // A NaN error compares false: not met.
        goal_met: l <= goal_pts && c <= goal_pts,
    }
}

impl ShareVerdict {
    /// The page's verdict paragraph: both figures, the goal, and the completions caveat.
    pub fn note(&self, client_what: &str) -> String {
        let mut s = format!(
            "Largest error by the clients ({client_what}) {:.2} points, by the ledger {:.2} points \
             (goal ≤ {} points for both): {}.",
            self.client_max_error_pts,
            self.ledger_max_error_pts,
            self.goal_pts,
            if self.goal_met { "met" } else { "NOT met" }
        );
        if !self.completions_enough {
            s.push_str(&format!(
                " The clients counted only {} completions for the smallest activity (fewer than \
                 {COMPLETIONS_MIN}): the run is too short for their share to be exact to 0.1 point; \
                 run longer.",
                self.client_completions_min
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_figures_must_be_inside_the_goal() {
        let t = [0.5, 0.5];
        let v = judge(&t, &[0.5, 0.5], &[0.53, 0.47], &[5000, 5000], 2.0);
        assert!(!v.goal_met, "the clients' 3 points miss a 2-point goal");
        assert!((v.client_max_error_pts - 3.0).abs() < 1e-9);
        let v = judge(&t, &[0.53, 0.47], &[0.5, 0.5], &[5000, 5000], 2.0);
        assert!(!v.goal_met, "the ledger's 3 points miss too");
        let v = judge(&t, &[0.51, 0.49], &[0.49, 0.51], &[999, 5000], 2.0);
        assert!(v.goal_met && !v.completions_enough);
        assert!(v.note("requests").contains("only 999"));
    }

    #[test]
    fn a_share_that_is_not_a_number_is_not_met() {
        let v = judge(
            &[0.5, 0.5],
            &[f64::NAN, f64::NAN],
            &[0.5, 0.5],
            &[5000, 5000],
            1.0,
        );
        assert!(!v.goal_met, "a NaN share is no error of 0");
        assert!(v.ledger_max_error_pts.is_nan());
        let v = judge(
            &[0.5, 0.5],
            &[0.5, 0.5],
            &[0.5, f64::INFINITY],
            &[5000, 5000],
            1.0,
        );
        assert!(!v.goal_met);
        // One NaN among finite errors is not hidden by them either.
        let v = judge(
            &[0.5, 0.5],
            &[0.5, f64::NAN],
            &[0.5, 0.5],
            &[5000, 5000],
            1.0,
        );
        assert!(!v.goal_met);
        // Nothing to judge is not met.
        assert!(!judge(&[], &[], &[], &[], 1.0).goal_met);
    }

    #[test]
    fn shares_of_counts() {
        assert_eq!(shares(&[1.0, 3.0]), vec![0.25, 0.75]);
        assert_eq!(shares(&[0.0, 0.0]), vec![0.0, 0.0]);
    }
}
