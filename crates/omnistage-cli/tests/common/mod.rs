//! Shared pieces of the command's end-to-end tests: `omnistage serve` with its admin listener
//! on a free port, and running the command.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_omnistage");

pub struct Serve {
    pub child: Child,
    pub admin: String,
    /// The first plain-HTTP listener, `IP:PORT`.
    pub http: String,
    pub lines: std::sync::mpsc::Receiver<String>,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn serve(dir: &std::path::Path) -> Serve {
    let config = dir.join("omnistage.toml");
    std::fs::write(dir.join("index.html"), "hello\n").unwrap();
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = [\"127.0.0.1:0\"]\n\n[[tenant]]\nname = \"a\"\ndocroot = \"{}\"\nweight = 50\n",
            dir.display()
        ),
    )
    .unwrap();
    serve_config(&config, dir)
}

/// `omnistage serve --config CONFIG` started in the working directory `cwd`.
pub fn serve_config(config: &std::path::Path, cwd: &std::path::Path) -> Serve {
    let mut child = Command::new(BIN)
        .args([
            "serve",
            "--workers",
            "1",
            "--admin",
            "127.0.0.1:0",
            "--config",
        ])
        .arg(config)
        .current_dir(cwd)
        .env_remove("OMNISTAGE_ADMIN_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let end = Instant::now() + Duration::from_secs(20);
    let mut http = None;
    let admin = loop {
        let left = end.saturating_duration_since(Instant::now());
        let line = rx
            .recv_timeout(left)
            .expect("serve prints where the admin API is");
        // "omnistage: serving 1 tenant(s) [a] on http://127.0.0.1:PORT/ with 1 worker(s)"
        if let Some(rest) = line.strip_prefix("omnistage: serving ") {
            if let Some((_, url)) = rest.split_once(" on http://") {
                http = http.or(url.split('/').next().map(str::to_string));
            }
        }
        if let Some(rest) = line.strip_prefix("omnistage: admin API and dashboard on ") {
            break rest.trim_end_matches('/').to_string();
        }
    };
    Serve {
        child,
        admin,
        http: http.expect("serve prints where it serves before the admin API"),
        lines: rx,
    }
}

pub fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN)
        .args(args)
        .env_remove("OMNISTAGE_ADMIN_TOKEN")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Whether the preload library is built where `omnistage shape` looks for it (next to the
/// binary, or in `deps/` where `cargo test` builds it); says why a test skips when it is not.
pub fn have_preload() -> bool {
    let dir = std::path::PathBuf::from(BIN)
        .parent()
        .unwrap()
        .to_path_buf();
    let found = [
        dir.join("libomnistage_shape_preload.so"),
        dir.join("deps").join("libomnistage_shape_preload.so"),
    ]
    .iter()
    .any(|p| p.is_file());
    if !found {
        eprintln!(
            "skipped: the preload library is not built (cargo build -p omnistage-shape-preload)"
        );
    }
    found
}
