//! `omnistage serve --config FILE` resolves the file's relative paths against the file's
//! directory, whatever directory the server is started in (as the config's docs and
//! `examples/three-tenants.toml` say). It once resolved them against the working directory, so
//! the README's `serve --config examples/three-tenants.toml` answered 404 for every file.

mod common;

use common::serve_config;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

fn get(addr: &str, host: &str, path: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn a_relative_docroot_is_found_from_any_working_directory() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("conf")).unwrap();
    std::fs::create_dir_all(dir.path().join("www")).unwrap();
    std::fs::create_dir_all(dir.path().join("elsewhere/deeper")).unwrap();
    std::fs::write(
        dir.path().join("www/index.html"),
        "found by the file's directory\n",
    )
    .unwrap();
    let config = dir.path().join("conf/omnistage.toml");
    std::fs::write(
        &config,
        "[server]\nlisten = [\"127.0.0.1:0\"]\n\n[[tenant]]\nname = \"a\"\nhosts = [\"a.test\"]\ndocroot = \"../www\"\n",
    )
    .unwrap();
    // Started elsewhere, with the config named by a relative path from there (from where
    // `../www` would be `elsewhere/www`, which is not there).
    let s = serve_config(
        std::path::Path::new("../../conf/omnistage.toml"),
        &dir.path().join("elsewhere/deeper"),
    );
    let r = get(&s.http, "a.test", "/");
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(r.ends_with("found by the file's directory\n"), "{r}");
}

#[test]
fn an_admin_listener_that_would_be_refused_stops_serve_before_it_serves() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("omnistage.toml");
    std::fs::write(
        &config,
        "[server]\nlisten = [\"127.0.0.1:0\"]\n\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n",
    )
    .unwrap();
    let (code, _, err) = common::run(&[
        "serve",
        "--admin",
        "0.0.0.0:0",
        "--config",
        config.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("needs a bearer token"), "{err}");
    assert!(!err.contains("serving"), "{err}");
}
