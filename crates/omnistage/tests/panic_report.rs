//! The panic report seen from outside: a child process (this test binary, re-run with
//! `PANIC_REPORT_CHILD` set) panics in a stage's handler many times; the parent reads its stderr.
//! One line per panic in the documented form, the backtrace once for the location, and the
//! stage's counter in `panic_counts`.
use omnistage::activity::ActivitySpec;
use omnistage::exec::panic::panic_counts;
use omnistage::exec::{Affinity, Ctx, Runtime, StageConfig};
use std::process::Command;
use std::time::{Duration, Instant};

const PANICS: u64 = 20;
const CHILD: &str = "PANIC_REPORT_CHILD";

/// Runs only in the child: panics `PANICS` times in stage "fragile", prints the counts.
#[test]
fn child_panics_in_a_stage() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let (mut b, t) = Runtime::builder()
        .workers(1)
        .activity("/tenants/a", ActivitySpec::default())
        .unwrap();
    let stage = b
        .stage::<u64, _, _>("fragile", StageConfig::default(), |_| {
            |_ctx: &mut Ctx<'_>, v: u64| panic!("bad input\nnumber {v}")
        })
        .unwrap();
    let rt = b.start().unwrap();
    for v in 0..PANICS {
        rt.send(&stage, t, Affinity::Core(0), v).unwrap();
    }
    let end = Instant::now() + Duration::from_secs(10);
    while rt.pending() > 0 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(1));
    }
    let fragile = panic_counts()
        .into_iter()
        .find(|(s, _)| *s == "fragile")
        .map_or(0, |(_, n)| n);
    println!("COUNT fragile {fragile}");
}

#[test]
fn one_line_per_panic_and_one_backtrace() {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_panics_in_a_stage",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    let here = file!();
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("omnistage: panic in "))
        .collect();
    assert_eq!(lines.len() as u64, PANICS, "{stderr}");
    for (i, l) in lines.iter().enumerate() {
        let want_prefix = format!("omnistage: panic in fragile at {here}:");
        assert!(l.starts_with(&want_prefix), "{l}");
        assert!(
            l.ends_with(&format!(": bad input\\nnumber {i}")),
            "one line, escaped: {l}"
        );
    }
    let backtraces = stderr.matches("omnistage: backtrace").count();
    assert_eq!(backtraces, 1, "one backtrace for one location:\n{stderr}");
    assert!(
        stdout.contains(&format!("COUNT fragile {PANICS}")),
        "{stdout}"
    );
}
