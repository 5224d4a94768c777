//! Operator mistakes against a running HTTP server: the admin API refuses to remove or move an
//! activity the running configuration owns (a tenant's or a class's), with 409 and a reason that
//! says how to do it instead (edit the config file and reload); other activities can still be
//! made and removed, and the tenants go on serving through it all.

use omnistage_admin::client::Client;
use omnistage_admin::{start_admin_with_tenants, AdminConfig};
use omnistage_http::config::parse_config;
use omnistage_http::server::{Server, ServerOptions};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

fn get_status(addr: std::net::SocketAddr, host: &str) -> u16 {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /index.html HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let text = String::from_utf8_lossy(&out);
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

#[test]
fn configured_activities_cannot_be_removed_or_moved() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("index.html"), "hi\n").unwrap();
    let toml = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\n\n\
         [[tenant]]\nname = \"a\"\nhosts = [\"a\"]\ndocroot = '{d}'\n\
         [[tenant.class]]\nname = \"gold\"\nheader = \"X-Class: gold\"\n\n\
         [[tenant]]\nname = \"b\"\ndocroot = '{d}'\n",
        d = dir.path().display()
    );
    let server = Arc::new(
        Server::start(
            parse_config(&toml).unwrap(),
            ServerOptions {
                workers: Some(1),
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let addr = server.local_addrs()[0];
    let cfg = AdminConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        threads: 1,
        ..Default::default()
    };
    let h = start_admin_with_tenants(server.clone(), Server::runtime, cfg).unwrap();
    let c = Client::new(&format!("http://{}", h.local_addr()), None).unwrap();
    let req =
        |m: &str, p: &str, body: Option<&str>| c.request(m, p, body.map(str::as_bytes)).unwrap();
    assert_eq!(get_status(addr, "a"), 200);

    for (method, path, body) in [
        ("DELETE", "/api/v1/activities/tenants/a", None),
        ("DELETE", "/api/v1/activities/tenants/a/gold", None),
        ("DELETE", "/api/v1/activities/tenants/b", None),
        // Holds configured tenants (the tree would refuse it too, for its children).
        ("DELETE", "/api/v1/activities/tenants", None),
        (
            "POST",
            "/api/v1/activities/tenants/a:move",
            Some(r#"{"to": "/"}"#),
        ),
        (
            "POST",
            "/api/v1/activities/tenants/a/gold:move",
            Some(r#"{"to": "/tenants/b"}"#),
        ),
        (
            "POST",
            "/api/v1/activities/tenants:move",
            Some(r#"{"to": "/infra"}"#),
        ),
    ] {
        let r = req(method, path, body);
        assert_eq!(r.status, 409, "{method} {path}: {}", r.text());
        let why = r.error_message();
        assert!(
            why.contains("edit the config file") && why.contains("reload"),
            "{method} {path}: the reason says how: {why}"
        );
    }
    assert!(req("DELETE", "/api/v1/activities/tenants/a", None)
        .error_message()
        .contains("tenant \"a\""));
    // Nothing changed: the tenants and the class are where they were, and serve.
    let rt = server.runtime();
    for p in ["/tenants/a", "/tenants/a/gold", "/tenants/b"] {
        assert!(rt.activity_id(p).is_some(), "{p} is still there");
    }
    assert_eq!(get_status(addr, "a"), 200);
    assert_eq!(get_status(addr, "other"), 200);

    // Changing a configured tenant is fine, and so is an activity the config does not own.
    let r = req(
        "PUT",
        "/api/v1/activities/tenants/a",
        Some(r#"{"weight": 7}"#),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let r = req(
        "PUT",
        "/api/v1/activities/tenants/a/extra",
        Some(r#"{"weight": 3}"#),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let r = req("DELETE", "/api/v1/activities/tenants/a/extra", None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(get_status(addr, "a"), 200);
}
