//! The fuzz targets of omnistage's parsers: one checking function per parser that takes any bytes,
//! feeds them to the parser and asserts what must hold whatever the bytes are (no panic, and a
//! refused input gets a defined answer). The same functions run in two harnesses:
//!
//! - proptest, in the ordinary `cargo test` (`tests/properties.rs`): random and mutated-seed
//!   inputs, a few hundred per target, every run;
//! - AFL++ through afl.rs on stable Rust (`src/bin/fuzz_*.rs`, built with
//!   `cargo afl build --features afl`): coverage-guided, as long as one lets it run.
//!   `crates/omnistage-fuzz/run` drives it (short runs in CI, long runs by hand).
//!
//! A crash either harness finds becomes a regression test (`tests/regressions.rs`) and its input
//! a member of the target's seed corpus (`corpus/TARGET/`).
//!
//! | target      | parser                                                             |
//! |-------------|--------------------------------------------------------------------|
//! | `request`   | request line and headers ([`omnistage_http::request::parse`])        |
//! | `range`     | `Range` ([`omnistage_http::cond::range`])                            |
//! | `cond`      | `If-None-Match`, `If-Modified-Since`, `If-Range` ([`omnistage_http::cond`]) |
//! | `path`      | request-target decoding and resolving ([`omnistage_http::path`])     |
//! | `chunked`   | response framing with chunked bodies ([`omnistage_load::parse::ResponseReader`]) |
//! | `config`    | the TOML config file ([`omnistage_http::config::parse_config`])      |
//! | `upstream`  | the proxy's upstream response heads and chunked bodies ([`omnistage_http::proxy`]) |
//! | `admin`     | admin API requests: heads, JSON bodies, every route's checks ([`admin`]) |

mod admin;

pub use admin::admin;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, UNIX_EPOCH};

use omnistage_http::cond::{self, RangeOutcome};
use omnistage_http::config::parse_config;
use omnistage_http::path::{decode_target, resolve};
use omnistage_http::proxy::{parse_response_head, ChunkedDecoder, HeadOutcome, ResponseFraming};
use omnistage_http::request::{parse, Limits, ParseOutcome, Request};
use omnistage_http::synthetic::parse_synthetic;
use omnistage_load::parse::{Feed, ResponseReader};

/// A fuzz target: takes any bytes, panics only on a bug.
pub type Target = fn(&[u8]);

/// The targets by name (each `src/bin/fuzz_NAME.rs` runs one), for the proptest harness.
pub const TARGETS: &[(&str, Target)] = &[
    ("request", request),
    ("range", range),
    ("cond", conditional),
    ("path", path),
    ("chunked", chunked),
    ("config", config),
    ("upstream", upstream),
    ("admin", admin),
];

/// Reads a little-endian u64 from the front of `data` (zero-padded), and the rest.
fn take_u64(data: &[u8]) -> (u64, &[u8]) {
    let n = data.len().min(8);
    let mut b = [0u8; 8];
    b[..n].copy_from_slice(&data[..n]);
    (u64::from_le_bytes(b), &data[n..])
}

/// Request heads: a complete head consumed exactly (and its fields usable by every later
/// stage), or partial only while no limit is proven broken, or refused with a status that
/// closes the connection (the server answers it and closes: a defined state).
pub fn request(data: &[u8]) {
    // Small limits from the first byte too, so the fuzzer crosses them cheaply.
    let limits = match data.first() {
        Some(&b) if b & 1 == 1 => Limits {
            header_bytes_max: 64 + usize::from(b) * 4,
            uri_bytes_max: 8 + usize::from(b),
            headers_max: usize::from(b % 8),
        },
        _ => Limits::default(),
    };
    let bytes = data.get(1..).unwrap_or_default();
    match parse(bytes, &limits) {
        ParseOutcome::Complete { request, consumed } => {
            assert!(
                consumed > 0 && consumed <= bytes.len(),
                "consumed {consumed}"
            );
            assert!(consumed <= limits.header_bytes_max, "head over its limit");
            assert_eq!(request.head(), &bytes[..consumed]);
            assert!(request.target().len() <= limits.uri_bytes_max);
            use_request(&request);
        }
        ParseOutcome::Partial => {
            assert!(
                bytes.len() <= limits.header_bytes_max + 2,
                "partial at {} bytes, over the {}-byte head limit",
                bytes.len(),
                limits.header_bytes_max
            );
        }
        ParseOutcome::Error(e) => {
            assert!(e.closes_connection(), "{e}: a parse error must close");
            assert!((400..=505).contains(&e.status()), "{e}");
        }
    }
}

/// Everything the server does with a parsed request's fields, short of the disk.
fn use_request(request: &Request) {
    let _ = request.host();
    for (name, _value) in request.headers() {
        assert!(!name.is_empty(), "an accepted field has a name");
    }
    if let Ok((path, query)) = decode_target(request.target()) {
        let _ = parse_synthetic(&path, query.as_deref());
    }
    let modified = UNIX_EPOCH + Duration::from_secs(784_111_777);
    let etag = cond::etag(1000, modified);
    let _ = cond::not_modified(request, &etag, modified);
    check_range(cond::range_for(request, &etag, modified, 1000), 1000);
    check_upstream_head(request);
}

/// The head a proxied request goes to its backend with is one request head that frames its
/// body as this server framed it: otherwise the body's bytes would be read upstream as
/// something else (request smuggling: a `Connection: content-length` once stripped the length).
fn check_upstream_head(request: &Request) {
    use omnistage_http::request::BodyFraming;
    if request.body == BodyFraming::UnknownCoding {
        // Refused with 501 before it could be proxied.
        return;
    }
    if request.headers().count() + 4 > omnistage_http::request::HEADERS_CAP {
        // The forwarding fields would take it past what the parser below reads.
        return;
    }
    let mut out = Vec::new();
    omnistage_http::proxy::write_upstream_head(
        &mut out,
        request,
        std::net::IpAddr::from([192, 0, 2, 1]),
        "http",
    );
    let limits = Limits {
        header_bytes_max: out.len() + 1,
        uri_bytes_max: out.len(),
        headers_max: usize::MAX,
    };
    match parse(&out, &limits) {
        ParseOutcome::Complete {
            request: up,
            consumed,
        } => {
            assert_eq!(
                consumed,
                out.len(),
                "one head: {:?}",
                String::from_utf8_lossy(&out)
            );
            assert_eq!(up.body, request.body, "{:?}", String::from_utf8_lossy(&out));
        }
        other => panic!(
            "the upstream head does not parse: {other:?}\n{}",
            String::from_utf8_lossy(&out)
        ),
    }
}

/// A range outcome stays inside a body of `len` bytes and has a `Content-Range` to match.
fn check_range(outcome: RangeOutcome, len: u64) {
    match outcome {
        RangeOutcome::Full => assert_eq!(cond::content_range(&outcome, len), None),
        RangeOutcome::Partial {
            start,
            end_inclusive,
        } => {
            assert!(
                start <= end_inclusive && end_inclusive < len,
                "{outcome:?} of {len}"
            );
            assert!(cond::content_range(&outcome, len).is_some());
        }
        RangeOutcome::Unsatisfiable => {
            assert_eq!(
                cond::content_range(&outcome, len),
                Some(format!("bytes */{len}"))
            );
        }
    }
}

/// `Range` values: 8 bytes of body length, then the header value.
pub fn range(data: &[u8]) {
    let (len, rest) = take_u64(data);
    // Lengths near zero and near u64::MAX both matter; keep both reachable.
    let len = if len & 1 == 0 { len >> 48 } else { len };
    let header = String::from_utf8_lossy(rest);
    check_range(cond::range(Some(&header), len), len);
    if let Ok(s) = std::str::from_utf8(rest) {
        check_range(cond::range(Some(s), len), len);
    }
}

/// Replaces the bytes that would end a header line, so the value stays one field.
fn one_line(v: &[u8]) -> Vec<u8> {
    v.iter()
        .map(|&b| if b == b'\r' || b == b'\n' { b' ' } else { b })
        .collect()
}

/// Conditional headers: the input is split at `0x00` into If-None-Match, If-Modified-Since,
/// If-Range and Range values (missing ones are absent); the request built from them must parse
/// and its preconditions be decided without panic, consistently with the validators.
pub fn conditional(data: &[u8]) {
    let mut parts = data.split(|&b| b == 0);
    let names = ["If-None-Match", "If-Modified-Since", "If-Range", "Range"];
    let mut head = b"GET /f HTTP/1.1\r\nHost: a\r\n".to_vec();
    for name in names {
        if let Some(v) = parts.next() {
            head.extend_from_slice(name.as_bytes());
            head.extend_from_slice(b": ");
            head.extend_from_slice(&one_line(v));
            head.extend_from_slice(b"\r\n");
        }
    }
    head.extend_from_slice(b"\r\n");
    let ParseOutcome::Complete { request, .. } = parse(&head, &Limits::default()) else {
        return; // e.g. a value with bytes httparse refuses: request() covers that case
    };
    let modified = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let etag = cond::etag(42, modified);
    let not_modified = cond::not_modified(&request, &etag, modified);
    // Our own validator always matches itself.
    if request.if_none_match().map(str::trim) == Some(etag.as_str()) {
        assert!(not_modified, "If-None-Match of our own ETag must be 304");
    }
    let later = modified + Duration::from_secs(86_400);
    let _ = cond::not_modified(&request, &cond::etag(43, later), later);
    check_range(cond::range_for(&request, &etag, modified, 42), 42);
}

/// The docroot used by [`path`]: a few files, made once per process.
fn docroot() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        let base = std::env::temp_dir().join(format!("omnistage-fuzz-{}", std::process::id()));
        let www = base.join("www");
        std::fs::create_dir_all(www.join("sub")).expect("make the fuzz docroot");
        std::fs::write(base.join("secret.txt"), "secret").expect("write");
        std::fs::write(www.join("index.html"), "index").expect("write");
        std::fs::write(www.join("sub/a.txt"), "a").expect("write");
        let _ = std::os::unix::fs::symlink("../secret.txt", www.join("out.txt"));
        www.canonicalize().expect("canonical docroot")
    })
}

/// Path decoding and resolving: a decoded path is absolute and normalized (no `.`/`..`
/// segments, no NUL or backslash), and a resolved file lies inside the docroot.
pub fn path(data: &[u8]) {
    let target = String::from_utf8_lossy(data);
    let Ok((decoded, _query)) = decode_target(&target) else {
        return;
    };
    assert!(decoded.starts_with('/'), "{decoded:?}");
    assert!(
        !decoded
            .split('/')
            .any(|s| s == "." || s == ".." || s.contains(['\0', '\\'])),
        "{decoded:?} is not normalized"
    );
    let root = docroot();
    if let Ok(found) = resolve(root, &decoded, &["index.html".to_string()]) {
        assert!(found.path.starts_with(root), "{:?} escapes", found.path);
    }
}

/// Response framing (chunked bodies, Content-Length, close-delimited): the first byte sets
/// the size of the pieces the rest is fed in, as reads would cut it; every `Done` consumes
/// at most the bytes given, and a reader that refused the stream is reset and reusable.
pub fn chunked(data: &[u8]) {
    let (piece, rest) = match data.split_first() {
        Some((&b, rest)) => (usize::from(b).max(1), rest),
        None => return,
    };
    let mut reader = ResponseReader::new();
    for mut part in rest.chunks(piece) {
        loop {
            match reader.feed(part) {
                Ok(Feed::NeedMore) => break,
                Ok(Feed::Done { response, consumed }) => {
                    assert!(
                        consumed <= part.len(),
                        "consumed {consumed} of {}",
                        part.len()
                    );
                    assert!((100..=999).contains(&response.status));
                    part = &part[consumed..];
                    if response.close || part.is_empty() {
                        break;
                    }
                }
                Err(_) => {
                    reader.reset();
                    assert!(reader.is_idle());
                    break;
                }
            }
        }
    }
    let _ = reader.eof();
}

/// The config file: parsed or refused with a message (never a panic); a parsed config maps
/// any Host to a tenant index inside its tenant list.
pub fn config(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    match parse_config(&text) {
        Ok(config) => {
            let listener: SocketAddr = ([127, 0, 0, 1], 8080).into();
            for host in [None, Some("a"), Some("localhost"), Some("")] {
                if let Some(i) = config.tenant_for(host, listener) {
                    assert!(i < config.tenants.len());
                }
            }
            for &addr in &config.server.listen {
                let _ = config.tenant_for(Some("x"), addr);
            }
        }
        Err(e) => assert!(!e.message.is_empty(), "an error says what is wrong"),
    }
}

/// The proxy's upstream responses: a head is partial, complete within the bounds it was given
/// (its length inside the bytes and the head limit, a status of three digits, no body for a
/// HEAD request), or refused (502 and the upstream connection closed: a defined state); a
/// chunked body is then walked in pieces of any size, each step consuming only bytes it was
/// given, its data inside them, until done, refused, or out of bytes; once done, its plain form
/// (what the proxy sends a request body on as) is no longer and decodes to the same data.
pub fn upstream(data: &[u8]) {
    let (control, rest) = match data.split_first() {
        Some((&b, rest)) => (b, rest),
        None => return,
    };
    // Small head limits and pieces from the control byte, so limits are crossed cheaply.
    let head_bytes_max = 16 + usize::from(control & 0x3F) * 64;
    let request_is_head = control & 0x40 != 0;
    let piece = usize::from(control >> 4).max(1);
    let head = match parse_response_head(rest, head_bytes_max, request_is_head) {
        HeadOutcome::Partial | HeadOutcome::Invalid(_) => return,
        HeadOutcome::Complete(head) => head,
    };
    assert!(head.head_len <= rest.len() && head.head_len <= head_bytes_max);
    assert!((100..=999).contains(&head.status), "status {}", head.status);
    if request_is_head {
        assert_eq!(head.framing, ResponseFraming::None);
    }
    if head.framing != ResponseFraming::Chunked {
        return;
    }
    let mut decoder = ChunkedDecoder::default();
    let mut body = &rest[head.head_len..];
    let mut window = piece.min(body.len());
    // The body re-framed as the proxy sends a request body on (`step_plain`), the data it
    // carries, and the bytes consumed: once done, the plain form is no longer than what was
    // consumed and decodes, in one piece, to the same data.
    let (mut plain, mut data, mut consumed) = (Vec::new(), Vec::new(), 0);
    // Every step either consumes a byte, grows the window or ends: bounded by twice the bytes.
    for _ in 0..=2 * body.len() + 2 {
        let step = match decoder.step_plain(&body[..window], &mut plain) {
            Ok(step) => step,
            Err(_) => return,
        };
        assert!(
            step.consumed <= window,
            "consumed {} of {window}",
            step.consumed
        );
        assert!(step.data.end <= step.consumed, "data {:?}", step.data);
        data.extend_from_slice(&body[step.data.clone()]);
        consumed += step.consumed;
        if step.done {
            assert!(decoder.is_done());
            assert!(
                plain.len() <= consumed,
                "{} plain of {consumed}",
                plain.len()
            );
            let mut again = ChunkedDecoder::default();
            let (mut at, mut redecoded) = (0, Vec::new());
            for _ in 0..=2 * plain.len() + 2 {
                let s = again.step(&plain[at..]).expect("the plain form decodes");
                redecoded.extend_from_slice(&plain[at..][s.data.clone()]);
                at += s.consumed;
                if s.done {
                    assert_eq!(at, plain.len(), "the plain form ends where it is done");
                    assert_eq!(redecoded, data, "the plain form carries the same data");
                    return;
                }
                assert!(s.consumed > 0, "the plain form is whole");
            }
            panic!("the plain form did not end");
        }
        body = &body[step.consumed..];
        if step.consumed == 0 {
            if window == body.len() {
                return;
            }
            window = (window + piece).min(body.len());
        } else {
            window = window.min(body.len());
        }
    }
    panic!("the chunked decoder made no progress");
}
