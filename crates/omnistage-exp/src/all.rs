//! `all`: runs every experiment with short durations, each in its own process (`omnistage exp
//! NAME --json --out <out>`); each writes `<out>/NAME.json`, its page `NAME.md` and chart
//! `NAME.svg` (`writes_own`; otherwise the JSON on stdout is saved), and `<out>/README.md` with one row per experiment: the seed figure, the seed's
//! number, ours (read from the JSON), the peer's where relevant, and whether the goal is met.

mod catalog;

use super::util::machine;
use clap::Args;
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

#[derive(Args, Clone)]
pub struct AllArgs {
    #[arg(long, default_value = "docs/results")]
    out: PathBuf,
    /// Scale every experiment's duration by this factor.
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Run only these experiments (their `file` names, comma-separated, e.g.
    /// `--only soak,fleet`); every other row is rebuilt from the JSON an earlier run left in
    /// `--out`, and says so.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
}

/// What the README says of one run: ours, the peer's, whether the goal is met.
type Summary = (String, Option<String>, Option<bool>);

struct Exp {
    file: &'static str,
    args: Vec<String>,
    writes_own: bool,
    seed: &'static str,
    seed_number: &'static str,
    ours: fn(&Value) -> Summary,
}

/// Adds one experiment's row to the table and, when its goal is not met or has no verdict, to
/// the lists under it. `took` is the run's duration, or where the figures came from.
#[allow(clippy::too_many_arguments)]
fn push_row(
    rows: &mut String,
    short: &mut Vec<String>,
    unjudged: &mut Vec<String>,
    e: &Exp,
    cmdline: &str,
    took: &str,
    ours: &str,
    peer: Option<String>,
    met: Option<bool>,
) {
    let link = if e.writes_own {
        format!("[{0}]({0}.md)", e.file)
    } else {
        format!("[{0}]({0}.json)", e.file)
    };
    rows.push_str(&format!(
        "| {link} | `{cmdline}` ({took}) | {} | {} | {ours} | {} | {} |\n",
        e.seed,
        e.seed_number,
        peer.unwrap_or_else(|| "-".into()),
        match met {
            Some(true) => "yes",
            Some(false) => "no",
            None => "(no goal, or inconclusive: see its page)",
        }
    ));
    match met {
        Some(false) => short.push(format!("[{0}]({0}.md): {ours}", e.file)),
        None => unjudged.push(format!("[{0}]({0}.md)", e.file)),
        Some(true) => {}
    }
}

pub fn run(a: AllArgs) -> Result<(), String> {
    if !(0.05..=10.0).contains(&a.scale) {
        return Err("--scale 0.05..=10".into());
    }
    let exps = catalog::experiments(a.scale);
    if let Some(unknown) = a
        .only
        .iter()
        .find(|o| !exps.iter().any(|e| e.file == o.as_str()))
    {
        let names: Vec<_> = exps.iter().map(|e| e.file).collect();
        return Err(format!(
            "--only: no experiment {unknown:?} (names: {})",
            names.join(", ")
        ));
    }
    std::fs::create_dir_all(&a.out).map_err(|e| format!("{}: {e}", a.out.display()))?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut rows = String::new();
    // Rows whose goal was not met (or that failed), and rows without a verdict, for the
    // section under the table that says plainly where we fall short.
    let (mut short, mut unjudged) = (Vec::new(), Vec::new());
    let t_all = Instant::now();
    let mut earlier = Vec::new();
    for e in &exps {
        let cmdline = format!("omnistage exp {}", e.args.join(" "));
        if !a.only.is_empty() && !a.only.iter().any(|o| o == e.file) {
            // Not run this time: the row comes from the JSON an earlier run wrote.
            let p = a.out.join(format!("{}.json", e.file));
            let j: Option<Value> = std::fs::read(&p)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            let Some(j) = j else {
                rows.push_str(&format!(
                    "| {} | `{cmdline}` | {} | {} | not run (no earlier {}) | | no |\n",
                    e.file,
                    e.seed,
                    e.seed_number,
                    p.display()
                ));
                short.push(format!("`{}` (not run)", e.file));
                continue;
            };
            earlier.push(e.file);
            let (ours, peer, met) = (e.ours)(&j);
            push_row(
                &mut rows,
                &mut short,
                &mut unjudged,
                e,
                &cmdline,
                "earlier run",
                &ours,
                peer,
                met,
            );
            continue;
        }
        let mut cmd = Command::new(&exe);
        cmd.arg("exp").args(&e.args).arg("--json");
        if e.writes_own {
            cmd.arg("--out").arg(&a.out);
        }
        let t = Instant::now();
        eprintln!("== omnistage exp {}", e.args.join(" "));
        let out = cmd.output().map_err(|x| x.to_string())?;
        let secs = t.elapsed().as_secs_f64();
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
            eprintln!("   failed: {err}");
            rows.push_str(&format!(
                "| {} | `{cmdline}` | {} | {} | failed: {} | | no |\n",
                e.file,
                e.seed,
                e.seed_number,
                err.replace('|', "/")
            ));
            short.push(format!("`{}` (the run failed)", e.file));
            continue;
        }
        let j: Value =
            serde_json::from_slice(&out.stdout).map_err(|x| format!("{}: {x}", e.file))?;
        if !e.writes_own {
            let p = a.out.join(format!("{}.json", e.file));
            std::fs::write(
                &p,
                serde_json::to_string_pretty(&j).map_err(|x| x.to_string())? + "\n",
            )
            .map_err(|x| format!("{}: {x}", p.display()))?;
        }
        let (ours, peer, met) = (e.ours)(&j);
        let took = format!("{secs:.0} s");
        push_row(
            &mut rows,
            &mut short,
            &mut unjudged,
            e,
            &cmdline,
            &took,
            &ours,
            peer,
            met,
        );
        eprintln!("   {ours} ({secs:.0} s)");
    }
    let list = |v: &[String]| {
        if v.is_empty() {
            "none.".to_string()
        } else {
            v.iter().map(|x| format!("\n- {x}")).collect::<String>()
        }
    };
    let shortfalls = format!(
        "\n## Where we fall short\n\nGoals not met in this run: {}\n\nNo goal of their own, or \
         inconclusive on this machine (see each page): {}\n",
        list(&short),
        unjudged.join(", ")
    );
    let partial = if earlier.is_empty() {
        String::new()
    } else {
        format!(
            " This run was partial (`--only {}`): the rows marked \"earlier run\" ({}) are read from \
             the JSON an earlier run left here (their pages name the machine they ran on).",
            a.only.join(","),
            earlier.join(", ")
        )
    };
    // Each share verdict recomputed from the raw counts in the JSON just written; a
    // disagreement is listed in the index (and is a bug in the experiment that wrote it).
    let rechecked = match super::recheck::check_dir(&a.out) {
        Ok(rows) => super::recheck::markdown(&rows),
        Err(e) => format!("\n## Verdicts recomputed from the clients' numbers\n\nfailed: {e}\n"),
    };
    let md = format!(
        "# Results\n\nWritten by `omnistage exp all --out {}` in {:.0} s on **{}**.{partial} One row per experiment; numbers are read from each \
         experiment's JSON beside this file; each experiment's page (`.md`) has its tables and chart (`.svg`).\n\n\
         | experiment | command | seed figure | seed's number | ours | peer | goal met |\n|---|---|---|---|---|---|---|\n{rows}{shortfalls}{rechecked}",
        a.out.display(), t_all.elapsed().as_secs_f64(), machine()
    );
    let p = a.out.join("README.md");
    std::fs::write(&p, md).map_err(|x| format!("{}: {x}", p.display()))?;
    println!("wrote {}", p.display());
    Ok(())
}
