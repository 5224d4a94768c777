//! The dashboard in a real browser: headless Chromium loads the page with
//! `?set=/t/a&weight=70`, which makes the page fill its form and submit it once the tree has
//! loaded; the test then checks the DOM Chromium dumps (the form reported success and the
//! tree shows the new weight) and the API (the runtime has the new weight).
//!
//! Skipped, with a message, when no Chromium is installed (`.ci/run` installs Debian's
//! `chromium`). `CHROMIUM=/path/to/binary` picks another one.

mod common;

use common::{admin, rig};
use omnistage_admin::model::Tree;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Longest a Chromium run may take before the test fails.
const BROWSER_DEADLINE: Duration = Duration::from_secs(90);

fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    for dir in std::env::split_paths(&path) {
        for name in [
            "chromium",
            "chromium-browser",
            "google-chrome",
            "google-chrome-stable",
        ] {
            let p = dir.join(name);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

/// Runs Chromium headless on `url` with `extra` flags; returns its stdout.
fn run_chromium(bin: &PathBuf, url: &str, extra: &[&str]) -> String {
    let profile = std::env::temp_dir().join(format!(
        "omnistage-chromium-{}-{}",
        std::process::id(),
        extra.len()
    ));
    let _ = std::fs::remove_dir_all(&profile);
    std::fs::create_dir_all(&profile).unwrap();
    let mut cmd = Command::new(bin);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--no-first-run",
        "--no-default-browser-check",
        "--mute-audio",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .args(extra)
    .arg(url)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("chromium starts");
    // Read stdout on a thread so a full pipe cannot stall the browser.
    let mut out = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut out, &mut s);
        s
    });
    let mut err = child.stderr.take().unwrap();
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut err, &mut s);
        s
    });
    let end = Instant::now() + BROWSER_DEADLINE;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "chromium did not finish within {BROWSER_DEADLINE:?}: {}",
                err_reader.join().unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = reader.join().unwrap();
    let stderr = err_reader.join().unwrap_or_default();
    let _ = std::fs::remove_dir_all(&profile);
    assert!(status.success(), "chromium failed ({status}): {stderr}");
    stdout
}

#[test]
fn the_dashboard_form_changes_a_weight() {
    let Some(bin) = chromium() else {
        println!("SKIP the_dashboard_form_changes_a_weight: no chromium on PATH (.ci/run installs it; or set CHROMIUM)");
        return;
    };
    let r = rig(1);
    r.pipeline(r.a, 20);
    let (h, c) = admin(&r.rt, None);
    let url = format!("http://{}/?set=/t/a&weight=70", h.local_addr());
    // Virtual time runs the page's timers fast; it pauses while fetches are in flight.
    let dom = run_chromium(&bin, &url, &["--virtual-time-budget=5000", "--dump-dom"]);
    assert!(
        dom.contains("data-form-result=\"ok\""),
        "the form did not report success; DOM:\n{dom}"
    );
    assert!(
        dom.contains("data-weight-of=\"/t/a\">70<"),
        "the tree does not show the new weight; DOM:\n{dom}"
    );
    // The runtime has it, and the API says so.
    assert_eq!(
        r.rt.with_activities(|t| t.get(r.a).unwrap().spec.weight),
        70
    );
    let t: Tree = c.get_json("/api/v1/tree").unwrap();
    let w = t
        .root
        .children
        .iter()
        .flat_map(|n| n.children.iter())
        .find(|n| n.path == "/t/a")
        .map(|n| n.weight);
    assert_eq!(w, Some(70));
}
