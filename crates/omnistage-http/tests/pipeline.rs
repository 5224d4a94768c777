//! End to end through the pure pieces, the way the server glue uses them: bytes → request →
//! tenant → decoded path → file → validators → response head → access log line, using the
//! example configuration at the repository root.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

use omnistage_http::cond::{self, RangeOutcome};
use omnistage_http::config::{load_config, Config};
use omnistage_http::request::{self, Limits, Method, ParseOutcome};
use omnistage_http::response::{self, DateCache};
use omnistage_http::synthetic::{parse_synthetic, Synthetic};
use omnistage_http::{log, mime, path, HttpError};

fn example_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/three-tenants.toml")
}

fn example() -> Config {
    load_config(&example_path()).unwrap_or_else(|e| panic!("{e}"))
}

fn listener() -> SocketAddr {
    "127.0.0.1:8080".parse().unwrap()
}

#[test]
fn example_config_loads() {
    let cfg = example();
    let names: Vec<&str> = cfg.tenants.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a", "b", "c"]);
    let weights: Vec<u32> = cfg.tenants.iter().map(|t| t.weight).collect();
    assert_eq!(weights, [50, 33, 17]);
    let examples = example_path().parent().unwrap().canonicalize().unwrap();
    for (t, name) in cfg.tenants.iter().zip(["a", "b", "c"]) {
        assert_eq!(t.hosts, [format!("{name}.test")]);
        assert!(t.synthetic);
        assert_eq!(t.docroot, examples.join("www").join(name));
        let index = path::resolve(&t.docroot, "/", &t.index).unwrap();
        assert_eq!(index.path, t.docroot.join("index.html"));
    }
    assert_eq!(cfg.server.listen, [listener()]);
    // No catch-all: an unknown Host gets no tenant (the glue answers 421).
    assert_eq!(cfg.tenant_for(Some("d.test"), listener()), None);
}

#[test]
fn get_index_then_conditional_then_range() {
    let cfg = example();
    let mut dates = DateCache::new();
    let now = UNIX_EPOCH + Duration::from_secs(1_795_302_000);
    let bytes = b"GET / HTTP/1.1\r\nHost: B.test:8080\r\n\r\n";
    let ParseOutcome::Complete { request, consumed } = request::parse(bytes, &Limits::default())
    else {
        panic!("expected a complete request");
    };
    assert_eq!(consumed, bytes.len());
    assert_eq!(request.method, Method::Get);
    let tenant = cfg.tenant_for(request.host(), listener()).unwrap();
    assert_eq!(cfg.tenants[tenant].name, "b");
    let t = &cfg.tenants[tenant];
    let (decoded, query) = path::decode_target(request.target()).unwrap();
    assert_eq!(query, None);
    assert_eq!(parse_synthetic(&decoded, query.as_deref()), None);
    let file = path::resolve(&t.docroot, &decoded, &t.index).unwrap();
    let tag = cond::etag(file.len, file.modified);
    assert!(!cond::not_modified(&request, &tag, file.modified));
    let lm = cond::last_modified(file.modified);
    let mut head = Vec::new();
    response::write_head(
        &mut head,
        200,
        response::status_reason(200),
        &[
            ("Content-Type", mime::content_type(&file.path)),
            ("ETag", &tag),
            ("Last-Modified", &lm),
            ("Accept-Ranges", "bytes"),
        ],
        Some(file.len),
        request.keep_alive,
        dates.get(now),
    );
    let head = String::from_utf8(head).unwrap();
    assert!(head.starts_with("HTTP/1.1 200 OK\r\nDate: Sat, 21 Nov 2026 23:00:00 GMT\r\n"));
    assert!(head.contains("Content-Type: text/html; charset=utf-8\r\n"));
    assert!(head.contains(&format!("Content-Length: {}\r\n", file.len)));
    assert!(head.ends_with("Connection: keep-alive\r\n\r\n"));

    // The same request revalidated: 304.
    let again = format!("GET / HTTP/1.1\r\nHost: b.test\r\nIf-None-Match: {tag}\r\n\r\n");
    let ParseOutcome::Complete { request, .. } =
        request::parse(again.as_bytes(), &Limits::default())
    else {
        panic!("expected a complete request");
    };
    assert!(cond::not_modified(&request, &tag, file.modified));

    // A range of it, guarded by If-Range.
    let ranged = format!(
        "GET /index.html HTTP/1.1\r\nHost: b.test\r\nRange: bytes=-5\r\nIf-Range: {tag}\r\n\r\n"
    );
    let ParseOutcome::Complete { request, .. } =
        request::parse(ranged.as_bytes(), &Limits::default())
    else {
        panic!("expected a complete request");
    };
    let outcome = cond::range_for(&request, &tag, file.modified, file.len);
    assert_eq!(
        outcome,
        RangeOutcome::Partial {
            start: file.len - 5,
            end_inclusive: file.len - 1
        }
    );
    assert_eq!(
        cond::content_range(&outcome, file.len),
        Some(format!(
            "bytes {}-{}/{}",
            file.len - 5,
            file.len - 1,
            file.len
        ))
    );

    let mut line = Vec::new();
    log::clf_line(
        &mut line,
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        now,
        request.method_raw(),
        request.target(),
        request.version_minor,
        206,
        5,
        &cfg.tenants[tenant].activity(),
    );
    assert_eq!(
        String::from_utf8(line).unwrap(),
        "127.0.0.1 - - [21/Nov/2026:23:00:00 +0000] \"GET /index.html HTTP/1.1\" 206 5 /tenants/b\n"
    );
}

#[test]
fn synthetic_and_errors() {
    let cfg = example();
    let bytes = b"GET /_bytes?n=65536 HTTP/1.1\r\nHost: c.test\r\n\r\nGET /../x HTTP/1.1\r\nHost: c.test\r\n\r\n";
    let ParseOutcome::Complete { request, consumed } = request::parse(bytes, &Limits::default())
    else {
        panic!("expected a complete request");
    };
    let t = &cfg.tenants[cfg.tenant_for(request.host(), listener()).unwrap()];
    assert!(t.synthetic);
    let (decoded, query) = path::decode_target(request.target()).unwrap();
    assert_eq!(
        parse_synthetic(&decoded, query.as_deref()),
        Some(Ok(Synthetic::Bytes { n: 65536 }))
    );

    // The pipelined second request is a traversal: 404, connection kept.
    let ParseOutcome::Complete { request, .. } =
        request::parse(&bytes[consumed..], &Limits::default())
    else {
        panic!("expected a complete request");
    };
    let e = path::decode_target(request.target()).unwrap_err();
    assert_eq!(e, HttpError::NotFound);
    assert!(!e.closes_connection());
    let mut out = Vec::new();
    let body_start = response::error_response(&mut out, e.status(), request.keep_alive, "d", &[]);
    assert_eq!(&out[body_start..], b"404 Not Found\n");

    // A smuggling attempt: 400 and close.
    let smuggle = b"GET / HTTP/1.1\r\nHost: c.test\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n";
    let ParseOutcome::Error(e) = request::parse(smuggle, &Limits::default()) else {
        panic!("expected an error");
    };
    assert_eq!(e.status(), 400);
    assert!(e.closes_connection());
}
