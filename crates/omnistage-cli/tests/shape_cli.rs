//! `omnistage shape` as a user runs it: bytes through a shaped `cat`, the program's exit code, a
//! group refusing a member with other rates and removing its segment with its last member, clear
//! errors for bad options, the warning for a static program. Needs the preload library next to
//! the binary (`cargo test --workspace` or `cargo build -p omnistage-shape-preload` builds it);
//! without it the tests say so and skip.

mod common;

use common::have_preload;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn omnistage() -> Command {
    Command::new(env!("CARGO_BIN_EXE_omnistage"))
}

#[test]
fn a_shaped_cat_copies_every_byte_and_the_exit_code_comes_back() {
    if !have_preload() {
        return;
    }
    let f = std::env::temp_dir().join(format!("omnistage-shape-cli-{}", std::process::id()));
    let data: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
    std::fs::write(&f, &data).unwrap();
    let out = omnistage()
        .args(["shape", "--disk-rate", "20MB/s", "--", "cat"])
        .arg(&f)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.stdout == data,
        "cat's output differs ({} bytes)",
        out.stdout.len()
    );
    std::fs::remove_file(&f).ok();
    let st = omnistage()
        .args(["shape", "--rate", "1MB/s", "--", "sh", "-c", "exit 7"])
        .status()
        .unwrap();
    assert_eq!(st.code(), Some(7));
}

#[test]
fn a_group_refuses_other_rates_and_goes_away_with_its_last_member() {
    if !have_preload() {
        return;
    }
    let name = format!("cli-test-{}", std::process::id());
    let seg = PathBuf::from(format!("/dev/shm/omnistage-shape.g.{name}"));
    let mut first = omnistage()
        .args([
            "shape", "--group", &name, "--rate", "1MB/s", "--", "sleep", "30",
        ])
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !seg.exists() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(seg.exists(), "the group's segment appears");
    let out = omnistage()
        .args(["shape", "--group", &name, "--rate", "2MB/s", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("runs at all=") && err.contains("asked for all="),
        "{err}"
    );
    // Without rates, or with the same, a member joins.
    let st = omnistage()
        .args(["shape", "--group", &name, "--", "true"])
        .status()
        .unwrap();
    assert!(st.success());
    // SIGTERM reaches the program through the command, which leaves the group and removes it.
    // SAFETY: kill on the pid of our own child.
    unsafe { libc_kill(first.id() as i32, 15) };
    let st = first.wait().unwrap();
    assert_eq!(st.code(), Some(128 + 15));
    assert!(!seg.exists(), "the last member removed the segment");
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

#[test]
fn bad_options_get_clear_errors() {
    for (args, want) in [
        (&["--rate", "fast", "--", "true"][..], "--rate:"),
        (
            &["--weight", "3", "--", "true"][..],
            "--weight needs --group",
        ),
        (&["--group", "a/b", "--", "true"][..], "group name"),
        (
            &[
                "--rate", "1MB/s", "--bucket", "leaky", "--burst", "4KiB", "--", "true",
            ][..],
            "--burst is for token buckets",
        ),
    ] {
        let out = omnistage()
            .arg("shape")
            .args(args)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn a_static_program_gets_a_warning() {
    if !have_preload() {
        return;
    }
    let ldconfig = ["/sbin/ldconfig", "/usr/sbin/ldconfig"]
        .into_iter()
        .find(|p| std::path::Path::new(p).is_file());
    let Some(ldconfig) = ldconfig else {
        eprintln!("skipped: no ldconfig (a static program) here");
        return;
    };
    let out = omnistage()
        .args(["shape", "--rate", "1MB/s", "--", ldconfig, "--version"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("statically linked"), "{err}");
}
