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
    // The weight reached the running configuration, which the send scheduler takes its
    // tenants' link weights from (not only the CPU tree).
    let weight_of = |name: &str| {
        server
            .config()
            .tenants
            .iter()
            .find(|t| t.name == name)
            .map(|t| t.weight)
    };
    assert_eq!(weight_of("a"), Some(7));
    assert_eq!(weight_of("b"), Some(100));
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

fn served(
    toml: &str,
    dir: &std::path::Path,
    with_file: bool,
) -> (Arc<omnistage_admin::Served>, std::path::PathBuf) {
    let path = dir.join("omnistage.toml");
    std::fs::write(&path, toml).unwrap();
    let (config, file) = omnistage_http::persist::ConfigFile::load(&path).unwrap();
    let server = Server::start(
        config,
        ServerOptions {
            workers: Some(1),
            ..Default::default()
        },
    )
    .unwrap();
    let file = with_file.then_some(file);
    (Arc::new(omnistage_admin::Served::new(server, file)), path)
}

/// `?persist=true` writes the change into the file (comments kept), a reload of the file (what
/// SIGHUP does) keeps it; refused with nothing changed on the embedded default, when the file
/// changed on disk, and for what the file has no key for.
#[test]
fn persisted_changes_survive_a_reload_and_refusals_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "# kept by the operator\n[server]\nlisten = [\"127.0.0.1:0\"]\n\n\
         [[tenant]]\nname = \"a\"\nhosts = [\"a\"]\ndocroot = '{d}'\nweight = 50 # half\n\
         [[tenant.class]]\nname = \"gold\"\nheader = \"X-Class: gold\"\n\n\
         [[tenant]]\nname = \"b\"\ndocroot = '{d}'\n",
        d = dir.path().display()
    );
    let (s, path) = served(&toml, dir.path(), true);
    let cfg = AdminConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        threads: 1,
        ..Default::default()
    };
    let h = start_admin_with_tenants(s.clone(), omnistage_admin::Served::runtime, cfg).unwrap();
    let c = Client::new(&format!("http://{}", h.local_addr()), None).unwrap();
    let put = |p: &str, body: &str| {
        c.request(
            "PUT",
            &format!("/api/v1/activities{p}?persist=true"),
            Some(body.as_bytes()),
        )
        .unwrap()
    };
    let weight = |p: &str| {
        let rt = s.runtime();
        rt.with_activities(|t| t.lookup(p).map(|id| t.get(id).unwrap().spec.weight))
    };

    let r = put("/tenants/a", r#"{"weight": 70, "cap_net": "10MB/s"}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    let r = put("/tenants/a/gold", r#"{"weight": 30}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.starts_with("# kept by the operator\n"), "{text}");
    assert!(text.contains("weight = 70 # half"), "{text}");
    assert!(text.contains("net_cap = \"10000000B/s\""), "{text}");
    assert!(text.contains("weight = 30"), "{text}");
    // What SIGHUP does: the file's values win, and they are the persisted ones.
    s.reload_file().unwrap();
    assert_eq!(weight("/tenants/a"), Some(70));
    assert_eq!(weight("/tenants/a/gold"), Some(30));

    // Refusals: each leaves the file and the running weight as they were.
    let before = std::fs::read_to_string(&path).unwrap();
    for (p, body, needle) in [
        ("/tenants/a", r#"{"weight": 0}"#, "invalid"),
        (
            "/tenants/a",
            r#"{"policy": "drr"}"#,
            "no key in the config file",
        ),
        (
            "/tenants/a/gold",
            r#"{"cap_net": "1MB/s"}"#,
            "no key in the config file",
        ),
        (
            "/tenants/a/extra",
            r#"{"weight": 5}"#,
            "not in the config file",
        ),
    ] {
        let r = put(p, body);
        assert_eq!(r.status, 409, "{p} {body}: {}", r.text());
        assert!(
            r.error_message().contains(needle),
            "{p} {body}: {}",
            r.error_message()
        );
    }
    assert_eq!(std::fs::read_to_string(&path).unwrap(), before);
    assert_eq!(weight("/tenants/a"), Some(70));
    assert!(s.runtime().activity_id("/tenants/a/extra").is_none());

    // Edited by hand since it was loaded: refused, the hand edit stays, nothing changes.
    let by_hand = before.replace("weight = 70", "weight = 71");
    std::fs::write(&path, &by_hand).unwrap();
    let r = put("/tenants/a", r#"{"weight": 90}"#);
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(
        r.error_message().contains("changed on disk"),
        "{}",
        r.error_message()
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), by_hand);
    assert_eq!(weight("/tenants/a"), Some(70));
    // After a reload the hand edit runs and persisting works again.
    s.reload_file().unwrap();
    assert_eq!(weight("/tenants/a"), Some(71));
    assert_eq!(put("/tenants/a", r#"{"weight": 90}"#).status, 200);
    assert!(std::fs::read_to_string(&path)
        .unwrap()
        .contains("weight = 90 # half"));
}

#[test]
fn persist_is_refused_on_the_embedded_default() {
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\n[[tenant]]\nname = \"a\"\ndocroot = '{}'\n",
        dir.path().display()
    );
    let (s, _) = served(&toml, dir.path(), false);
    let cfg = AdminConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        threads: 1,
        ..Default::default()
    };
    let h = start_admin_with_tenants(s.clone(), omnistage_admin::Served::runtime, cfg).unwrap();
    let c = Client::new(&format!("http://{}", h.local_addr()), None).unwrap();
    let r = c
        .request(
            "PUT",
            "/api/v1/activities/tenants/a?persist=true",
            Some(br#"{"weight": 7}"#),
        )
        .unwrap();
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(
        r.error_message().contains("embedded default"),
        "{}",
        r.error_message()
    );
    let w = s
        .runtime()
        .with_activities(|t| t.get(t.lookup("/tenants/a").unwrap()).unwrap().spec.weight);
    assert_eq!(w, 100, "nothing changed");
}
