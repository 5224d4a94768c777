//! The proxy's per-upstream, per-tenant counters through the admin API: `/api/v1/upstreams`
//! and the `omnistage_upstream_*` families of `/metrics`, against a real HTTP server proxying
//! to a backend made of a std `TcpListener` thread.

use omnistage_admin::client::Client;
use omnistage_admin::{start_admin_with_tenants, AdminConfig};
use omnistage_http::config::parse_config;
use omnistage_http::server::{Server, ServerOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

/// A keep-alive backend answering every request `200 ok`.
fn backend() -> std::net::SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(s) = s else { return };
            std::thread::spawn(move || {
                let mut r = BufReader::new(s.try_clone().unwrap());
                let mut w = s;
                loop {
                    let mut line = String::new();
                    match r.read_line(&mut line) {
                        Ok(0) | Err(_) => return,
                        Ok(_) if line == "\r\n" => {
                            if w.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                                .is_err()
                            {
                                return;
                            }
                        }
                        Ok(_) => {}
                    }
                }
            });
        }
    });
    addr
}

#[test]
fn upstream_counters_per_tenant_in_the_api_and_metrics() {
    let up = backend();
    let text = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\nworkers = 1\n\
         [[upstream]]\nname = \"app\"\nservers = [\"{up}\"]\nconcurrency_max = 4\n\
         [[tenant]]\nname = \"a\"\nhosts = [\"a.test\"]\nupstream = \"app\"\n"
    );
    let server =
        Arc::new(Server::start(parse_config(&text).unwrap(), ServerOptions::default()).unwrap());
    let addr = server.local_addrs()[0];
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    for _ in 0..3 {
        (&s).write_all(b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n")
            .unwrap();
        let mut got = Vec::new();
        // Head and the 2-byte body.
        let mut buf = [0u8; 256];
        while !got.ends_with(b"ok") {
            let n = (&s).read(&mut buf).unwrap();
            assert!(n > 0, "closed");
            got.extend_from_slice(&buf[..n]);
        }
        assert!(got.starts_with(b"HTTP/1.1 200 OK\r\n"));
    }
    let cfg = AdminConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        token: None,
        sample_interval: Duration::from_millis(50),
        threads: 1,
    };
    let h = start_admin_with_tenants(server.clone(), Server::runtime, cfg).unwrap();
    let c = Client::new(&format!("http://{}", h.local_addr()), None).unwrap();
    let r = c.request("GET", "/api/v1/upstreams", None).unwrap();
    assert_eq!(r.status, 200);
    let rows: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["upstream"], "app");
    assert_eq!(rows[0]["tenant"], "a");
    assert_eq!(rows[0]["requests"], 3);
    assert_eq!(rows[0]["in_flight"], 0);
    assert_eq!(rows[0]["queued"], 0);
    assert_eq!(rows[0]["refused"], 0);
    let m = c.request("GET", "/metrics", None).unwrap().text();
    let line = "omnistage_upstream_requests_total{upstream=\"app\",activity=\"/tenants/a\"} 3";
    assert!(m.lines().any(|l| l == line), "{m}");
    assert!(
        m.lines().any(|l| l.starts_with(
            "omnistage_upstream_in_flight{upstream=\"app\",activity=\"/tenants/a\"} 0"
        )),
        "{m}"
    );
}
