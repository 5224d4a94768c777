//! `omnistage shape --admin URL --activity PATH` against a running `omnistage serve`: a shaped
//! copy's disk bytes show under the activity (tree, `/metrics`), `omnistage set` lifts the
//! group's disk rate while it runs (the copy, throttled to 1 kB/s, could not end otherwise),
//! a configured tenant's own activity is refused, and an unreachable admin API stops the
//! command before the program runs. Needs the preload library (skips without it, as
//! `shape_cli.rs` does).

mod common;

use common::{have_preload, run, serve, BIN};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn node(admin: &str, path: &str) -> serde_json::Value {
    let (code, out, err) = run(&["tree", "--json", "--admin", admin]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    fn find(n: &serde_json::Value, path: &str) -> Option<serde_json::Value> {
        if n["path"] == path {
            return Some(n.clone());
        }
        n["children"].as_array()?.iter().find_map(|c| find(c, path))
    }
    find(&v["root"], path).unwrap_or(serde_json::Value::Null)
}

/// Kills a process group when dropped (a failed assertion must not leave the throttled copy
/// running for weeks).
struct Group(u32);

impl Drop for Group {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.0)])
            .stderr(Stdio::null())
            .status();
    }
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(60);
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_shaped_copy_reports_to_a_running_server_and_set_changes_its_rate() {
    if !have_preload() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("omnistage-shape-admin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let s = serve(&dir);
    let admin = s.admin.clone();
    let src = dir.join("src.bin");
    let dst = dir.join("dst.bin");
    let size: u64 = 1 << 20;
    std::fs::write(&src, vec![7u8; size as usize]).unwrap();

    // A configured tenant's activity is the server's: refused before the program runs.
    let out = Command::new(BIN)
        .args([
            "shape",
            "--admin",
            &admin,
            "--activity",
            "/tenants/a",
            "--",
            "true",
        ])
        .env_remove("OMNISTAGE_ADMIN_TOKEN")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/tenants/a/shaped"), "{err}");
    // An admin API that is not there: the program does not run.
    let marker = dir.join("ran");
    let out = Command::new(BIN)
        .args([
            "shape",
            "--admin",
            "http://127.0.0.1:1",
            "--activity",
            "/x",
            "--",
            "touch",
        ])
        .arg(&marker)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(!marker.exists());

    // 1 kB/s for the copy's 2 MiB of disk reads and writes: weeks, unless the rate is lifted.
    let mut copy = Command::new(BIN)
        .args([
            "shape",
            "--disk-rate",
            "1kB/s",
            "--admin",
            &admin,
            "--activity",
            "/tenants/a/copy",
            "--",
            "sh",
            "-c",
            "cat \"$0\" > \"$1\"",
        ])
        .arg(&src)
        .arg(&dst)
        .env_remove("OMNISTAGE_ADMIN_TOKEN")
        .env("LC_ALL", "C")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let _group = Group(copy.id());
    wait_for("the group's first bytes at the server", || {
        let n = node(&admin, "/tenants/a/copy");
        n["total"]["disk_bytes"].as_u64().unwrap_or(0) > 0
    });
    let n = node(&admin, "/tenants/a/copy");
    assert_eq!(n["shaped"]["cap_disk"], 1000, "{n}");
    let (code, out, err) = run(&["top", "--once", "--admin", &admin]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("copy"),
        "omnistage top lists the group's activity:\n{out}"
    );
    assert!(n["shaped"]["cap_net"].is_null(), "{n}");
    assert!(copy.try_wait().unwrap().is_none(), "still throttled");

    let (code, out, err) = run(&["set", "/tenants/a/copy", "cap_disk=none", "--admin", &admin]);
    assert_eq!(code, 0, "{out}{err}");
    // Not a timing: at 1 kB/s the copy would take weeks.
    let end = Instant::now() + Duration::from_secs(60);
    let st = loop {
        if let Some(st) = copy.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > end {
            panic!("the copy did not speed up once its rate was lifted");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(copy.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(st.success(), "{err}");
    assert_eq!(std::fs::metadata(&dst).unwrap().len(), size);

    // The last report went out as the command ended: every byte is at the server.
    let n = node(&admin, "/tenants/a/copy");
    assert_eq!(n["total"]["disk_bytes"], size, "{n}");
    assert_eq!(n["total"]["disk_write_bytes"], size, "{n}");
    assert_eq!(n["total"]["cpu_ns"], 0, "{n}");
    assert!(n["shaped"]["cap_disk"].is_null(), "{n}");
    let a = node(&admin, "/tenants/a");
    assert!(
        a["total"]["disk_write_bytes"].as_u64().unwrap() >= size,
        "rolled up: {a}"
    );
    let metrics = omnistage_admin::client::Client::new(&admin, None)
        .unwrap()
        .request("GET", "/metrics", None)
        .unwrap();
    let line = format!(
        "omnistage_activity_disk_written_bytes_total{{activity=\"/tenants/a/copy\"}} {size}"
    );
    assert!(metrics.text().contains(&line), "{line} not in /metrics");
    drop(s);
    std::fs::remove_dir_all(&dir).ok();
}
