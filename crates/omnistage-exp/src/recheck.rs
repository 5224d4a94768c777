//! `omnistage exp recheck`: recomputes each share experiment's verdict from the raw counts its
//! JSON holds (the clients' completed requests or received bytes, the ledger's shares, the
//! targets) and says whether it agrees with the `goal_met` the experiment wrote. It reads only
//! the JSON files, never the code that judged them, so a verdict written from the wrong figure,
//! or a client share computed from the wrong counts, shows up as a disagreement. `exp all` runs
//! it over its output directory and lists the result in the index.

use clap::Args;
use serde_json::Value;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct RecheckArgs {
    /// Directory holding the experiments' JSON (as `exp all --out` writes it).
    #[arg(long, default_value = "docs/results")]
    pub dir: PathBuf,
}

/// One experiment's verdict, as written and as recomputed.
#[derive(Debug, PartialEq)]
pub struct Recheck {
    pub file: String,
    pub recorded: bool,
    /// None when the JSON lacks what the recomputation needs (an older experiment's file).
    pub recomputed: Option<bool>,
    /// What was recomputed from what, or why it could not be, for the table.
    pub detail: String,
}

impl Recheck {
    pub fn agrees(&self) -> bool {
        self.recomputed == Some(self.recorded)
    }
}

/// Tolerance for a stored share or ratio to equal its recomputation (serde's f64 round trip is
/// exact; this only absorbs summation order).
const SAME: f64 = 1e-9;

fn num(v: &Value, k: &str) -> Result<f64, String> {
    v.get(k)
        .and_then(Value::as_f64)
        .ok_or_else(|| format!("no number `{k}`"))
}

fn shares(counts: &[f64]) -> Vec<f64> {
    let total: f64 = counts.iter().sum();
    counts
        .iter()
        .map(|c| if total > 0.0 { c / total } else { 0.0 })
        .collect()
}

/// cpu-share, cross-core and web-share: rows of (target, ledger share, client count); the
/// verdict is both largest errors within `goal_pts`, and each stored `client_share` must be
/// the recomputed one.
fn recheck_rows(j: &Value, rows_key: &str, count_key: &str) -> Result<(bool, String), String> {
    let rows = j
        .get(rows_key)
        .and_then(Value::as_array)
        .filter(|r| !r.is_empty())
        .ok_or_else(|| format!("no rows `{rows_key}`"))?;
    let goal_pts = num(j, "goal_pts")?;
    let counts: Vec<f64> = rows
        .iter()
        .map(|r| num(r, count_key))
        .collect::<Result<_, _>>()?;
    let client = shares(&counts);
    let (mut ledger_max, mut client_max, mut target_sum) = (0f64, 0f64, 0f64);
    for (r, c) in rows.iter().zip(&client) {
        let target = num(r, "target_share")?;
        target_sum += target;
        ledger_max = ledger_max.max(((num(r, "share")? - target) * 100.0).abs());
        client_max = client_max.max(((c - target) * 100.0).abs());
        let stored = num(r, "client_share")?;
        if (stored - c).abs() > SAME {
            return Err(format!(
                "stored client_share {stored} but the counts give {c}"
            ));
        }
    }
    if (target_sum - 1.0).abs() > 1e-6 {
        return Err(format!("targets sum to {target_sum}, not 1"));
    }
    let met = ledger_max <= goal_pts && client_max <= goal_pts;
    // The fewest completions (requests or work items), whatever the share was counted in.
    let min = rows
        .iter()
        .filter_map(|r| r.get("completed").or(r.get("requests"))?.as_f64())
        .fold(f64::INFINITY, f64::min);
    Ok((
        met,
        format!(
            "clients' `{count_key}` → worst {client_max:.2} pts, ledger {ledger_max:.2} pts \
             (goal {goal_pts}); fewest completions {min:.0}"
        ),
    ))
}

/// isolation: each weighted phase's ratio from the clients' completions (A, B) and the ledger's
/// ratio, both within `goal_ratio_error` of the weight ratio; the priority phase from the
/// clients' completions in the loaded and idle spans and the ledger's shares.
fn recheck_isolation(j: &Value) -> Result<(bool, String), String> {
    let goal = num(j, "goal_ratio_error")?;
    let phases = j
        .get("phases")
        .and_then(Value::as_array)
        .ok_or("no phases")?;
    let mut all_met = true;
    let mut detail = Vec::new();
    let pair = |v: Option<&Value>| -> Option<(f64, f64)> {
        let a = v?.as_array()?;
        Some((a.first()?.as_f64()?, a.get(1)?.as_f64()?))
    };
    for p in phases {
        let name = p.get("name").and_then(Value::as_str).unwrap_or("?");
        let met = if let Some((x, y)) = pair(p.get("weights")) {
            let (ca, cb) =
                pair(p.get("client_completions")).ok_or("no client_completions (A, B)")?;
            let target = x / y;
            let client_err = (ca / cb.max(1.0)) / target - 1.0;
            let ledger_err = num(p, "share_ratio")? / target - 1.0;
            detail.push(format!(
                "{name}: clients {:+.2} %, ledger {:+.2} %",
                client_err * 100.0,
                ledger_err * 100.0
            ));
            client_err.abs() <= goal && ledger_err.abs() <= goal
        } else {
            let counts = p
                .get("client_completions_by_tenant")
                .and_then(Value::as_array)
                .ok_or("no client_completions_by_tenant")?;
            let (la, lb) = pair(counts.first()).ok_or("no loaded counts")?;
            let (ia, ib) = pair(counts.get(1)).ok_or("no idle counts")?;
            let b_loaded = lb / (la + lb).max(1.0);
            let b_idle = ib / (ia + ib).max(1.0);
            let ledger_loaded = num(p, "b_share_while_a_loaded")?;
            let ledger_idle = num(p, "b_share_while_a_idle")?;
            detail.push(format!(
                "{name}: B while A loaded {:.1} % (ledger {:.1} %), idle {:.1} % (ledger {:.1} %)",
                b_loaded * 100.0,
                ledger_loaded * 100.0,
                b_idle * 100.0,
                ledger_idle * 100.0
            ));
            la + lb > 0.0
                && ia + ib > 0.0
                && b_loaded <= 0.05
                && b_idle >= 0.95
                && ledger_loaded <= 0.05
                && ledger_idle >= 0.95
        };
        let stored = p.get("goal_met").and_then(Value::as_bool);
        if stored != Some(met) {
            return Err(format!(
                "phase {name}: recorded {stored:?}, recomputed {met}"
            ));
        }
        all_met &= met;
    }
    Ok((all_met, detail.join("; ")))
}

/// Recomputes one experiment's verdict from its JSON: (met, what it was computed from).
type RecheckFn = fn(&Value) -> Result<(bool, String), String>;

/// The share experiments `exp all` writes, with how each is rechecked.
fn rechecks() -> [(&'static str, RecheckFn); 6] {
    [
        ("cpu-share", |j| recheck_rows(j, "activities", "completed")),
        ("cross-core", |j| recheck_rows(j, "activities", "completed")),
        ("web-share-cpu", |j| recheck_rows(j, "tenants", "requests")),
        ("web-share-net", |j| {
            recheck_rows(j, "tenants", "bytes_per_s")
        }),
        ("web-share-disk", |j| {
            recheck_rows(j, "tenants", "bytes_per_s")
        }),
        ("isolation", recheck_isolation),
    ]
}

/// Rechecks every share experiment whose JSON is in `dir`; a missing file is skipped, one that
/// is not JSON or has no verdict is an error, one that lacks a count is a row that cannot agree.
pub fn check_dir(dir: &Path) -> Result<Vec<Recheck>, String> {
    let mut out = Vec::new();
    for (file, f) in rechecks() {
        let p = dir.join(format!("{file}.json"));
        let Ok(text) = std::fs::read_to_string(&p) else {
            continue;
        };
        let j: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", p.display()))?;
        let recorded = j
            .get("goal_met")
            .and_then(Value::as_bool)
            .or_else(|| {
                // isolation keeps a verdict per phase: the experiment's is all of them.
                j.get("phases")?
                    .as_array()?
                    .iter()
                    .map(|p| p.get("goal_met")?.as_bool())
                    .collect::<Option<Vec<bool>>>()
                    .map(|v| v.iter().all(|&m| m))
            })
            .ok_or_else(|| format!("{}: no goal_met", p.display()))?;
        let (recomputed, detail) = match f(&j) {
            Ok((met, detail)) => (Some(met), detail),
            Err(e) => (None, format!("cannot recompute: {e}")),
        };
        out.push(Recheck {
            file: file.into(),
            recorded,
            recomputed,
            detail,
        });
    }
    Ok(out)
}

/// The index's section: one line per rechecked experiment.
pub fn markdown(rows: &[Recheck]) -> String {
    let mut s = String::from(
        "\n## Verdicts recomputed from the clients' numbers\n\n`omnistage exp recheck` read each \
         share experiment's JSON and recomputed its verdict from the raw counts (clients' \
         completions or bytes, the ledger's shares, the targets), without the code that \
         judged it.\n\n| experiment | recorded | recomputed | agrees | from |\n|---|---|---|---|---|\n",
    );
    let yn = |b: bool| if b { "met" } else { "not met" };
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} |\n",
            r.file,
            yn(r.recorded),
            r.recomputed.map_or("—", yn),
            if r.agrees() { "yes" } else { "**NO**" },
            r.detail
        ));
    }
    s
}

pub fn run(a: RecheckArgs) -> Result<(), String> {
    let rows = check_dir(&a.dir)?;
    if rows.is_empty() {
        return Err(format!(
            "{}: no share experiment's JSON here (cpu-share, cross-core, web-share-*, isolation)",
            a.dir.display()
        ));
    }
    print!("{}", markdown(&rows));
    let bad: Vec<&str> = rows
        .iter()
        .filter(|r| !r.agrees())
        .map(|r| r.file.as_str())
        .collect();
    if bad.is_empty() {
        Ok(())
    } else {
        Err(format!("verdicts that disagree: {}", bad.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn row(target: f64, share: f64, completed: f64) -> Value {
        json!({"target_share": target, "share": share, "completed": completed,
               "client_share": 0.0})
    }

    fn with_client_shares(mut j: Value) -> Value {
        let counts: Vec<f64> = j["activities"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["completed"].as_f64().unwrap())
            .collect();
        for (r, s) in j["activities"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .zip(shares(&counts))
        {
            r["client_share"] = json!(s);
        }
        j
    }

    #[test]
    fn rows_judged_on_both_figures() {
        // Clients 3,000 : 2,000 against 0.5/0.5 is 10 points off: not met however good the
        // ledger is.
        let j = with_client_shares(json!({"goal_pts": 1.0, "goal_met": true, "activities": [
            row(0.5, 0.5, 3000.0), row(0.5, 0.5, 2000.0)]}));
        let (met, detail) = recheck_rows(&j, "activities", "completed").unwrap();
        assert!(!met, "{detail}");
        let j = with_client_shares(json!({"goal_pts": 1.0, "activities": [
            row(0.5, 0.504, 5010.0), row(0.5, 0.496, 4990.0)]}));
        assert!(recheck_rows(&j, "activities", "completed").unwrap().0);
        // The ledger 2 points off fails a 1-point goal even with perfect clients.
        let j = with_client_shares(json!({"goal_pts": 1.0, "activities": [
            row(0.5, 0.52, 5000.0), row(0.5, 0.48, 5000.0)]}));
        assert!(!recheck_rows(&j, "activities", "completed").unwrap().0);
    }

    #[test]
    fn a_client_share_not_from_the_counts_is_an_error() {
        let mut j = with_client_shares(json!({"goal_pts": 1.0, "activities": [
            row(0.5, 0.5, 5000.0), row(0.5, 0.5, 5000.0)]}));
        j["activities"][0]["client_share"] = json!(0.51);
        let e = recheck_rows(&j, "activities", "completed").unwrap_err();
        assert!(e.contains("stored client_share"), "{e}");
    }

    #[test]
    fn isolation_phases() {
        let j = json!({"goal_ratio_error": 0.05, "phases": [
            {"name": "2:1", "weights": [200, 100], "client_completions": [6000, 3000],
             "share_ratio": 2.02, "goal_met": true},
            {"name": "priority", "weights": null,
             "client_completions_by_tenant": [[5000, 100], [0, 4000]],
             "b_share_while_a_loaded": 0.01, "b_share_while_a_idle": 0.99, "goal_met": true}]});
        let (met, _) = recheck_isolation(&j).unwrap();
        assert!(met);
        // A recorded verdict the counts do not support is reported.
        let j = json!({"goal_ratio_error": 0.05, "phases": [
            {"name": "2:1", "weights": [200, 100], "client_completions": [6600, 3000],
             "share_ratio": 2.0, "goal_met": true}]});
        assert!(recheck_isolation(&j)
            .unwrap_err()
            .contains("recomputed false"));
    }

    #[test]
    fn check_dir_compares_with_the_recorded_verdict() {
        let dir = std::env::temp_dir().join(format!("omnistage-recheck-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let j = with_client_shares(json!({"goal_pts": 1.0, "goal_met": true, "activities": [
            row(0.5, 0.5, 3000.0), row(0.5, 0.5, 2000.0)]}));
        std::fs::write(dir.join("cpu-share.json"), j.to_string()).unwrap();
        // An isolation file without the clients' counts cannot be rechecked: a row, not agreeing.
        let iso = json!({"goal_ratio_error": 0.05, "phases": [
            {"name": "2:1", "weights": [200, 100], "share_ratio": 2.0, "goal_met": true}]});
        std::fs::write(dir.join("isolation.json"), iso.to_string()).unwrap();
        let rows = check_dir(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(rows.len(), 2);
        assert!(
            rows[1].recomputed.is_none() && !rows[1].agrees(),
            "{:?}",
            rows[1]
        );
        assert!(rows[0].recorded && rows[0].recomputed == Some(false) && !rows[0].agrees());
        assert!(markdown(&rows).contains("**NO**"));
    }
}
