//! The request head parser's tests: each rule of the module documentation, fed as bytes.

use super::host::absolute_form_authority;
use super::*;

fn lim() -> Limits {
    Limits::default()
}

fn complete(bytes: &[u8]) -> (Request, usize) {
    match parse(bytes, &lim()) {
        ParseOutcome::Complete { request, consumed } => (request, consumed),
        other => panic!(
            "expected Complete for {:?}, got {other:?}",
            String::from_utf8_lossy(bytes)
        ),
    }
}

fn error(bytes: &[u8]) -> HttpError {
    error_with(bytes, &lim())
}

fn error_with(bytes: &[u8], limits: &Limits) -> HttpError {
    match parse(bytes, limits) {
        ParseOutcome::Error(e) => e,
        other => panic!(
            "expected Error for {:?}, got {other:?}",
            String::from_utf8_lossy(bytes)
        ),
    }
}

/// The absolute-form check once sliced the target at byte 7 whatever it held: a target of
/// non-ASCII bytes must parse (origin-form is checked later, by `path`) or be refused.
#[test]
fn a_multibyte_char_across_the_scheme_is_no_panic() {
    for target in ["http:/\u{e9}x", "abcdef\u{e9}", "\u{1f600}\u{1f600}"] {
        let bytes = format!("GET {target} HTTP/1.1\r\nHost: a\r\n\r\n");
        match parse(bytes.as_bytes(), &lim()) {
            ParseOutcome::Complete { request, .. } => assert_eq!(request.host(), Some("a")),
            ParseOutcome::Error(_) => {}
            ParseOutcome::Partial => panic!("{target:?}: a whole head is not partial"),
        }
    }
    assert_eq!(absolute_form_authority("http:/\u{e9}x"), None);
}

#[test]
fn defaults() {
    let l = Limits::default();
    assert_eq!(l.header_bytes_max, 16384);
    assert_eq!(l.uri_bytes_max, 8192);
    assert_eq!(l.headers_max, 64);
}

#[test]
fn simple_get() {
    let bytes = b"GET /index.html?x=1 HTTP/1.1\r\nHost: A.Example:8080\r\nUser-Agent: t\r\n\r\n";
    let (r, n) = complete(bytes);
    assert_eq!(n, bytes.len());
    assert_eq!(r.method, Method::Get);
    assert_eq!(r.method_raw(), "GET");
    assert_eq!(r.target(), "/index.html?x=1");
    assert_eq!(r.version_minor, 1);
    assert_eq!(r.host(), Some("a.example"));
    assert!(r.keep_alive);
    assert_eq!(r.if_none_match(), None);
    assert_eq!(r.range(), None);
    assert_eq!(
        r.headers().collect::<Vec<_>>(),
        vec![
            (&b"Host"[..], &b"A.Example:8080"[..]),
            (&b"User-Agent"[..], &b"t"[..])
        ]
    );
    assert_eq!(r.header("user-agent"), Some("t"));
    assert_eq!(r.header("USER-AGENT"), Some("t"));
    assert_eq!(r.header("accept"), None);
    assert_eq!(r.head(), &bytes[..]);
}

#[test]
fn parse_with_reuses_the_buffer_it_is_given() {
    // A small head stays inside the request: no buffer taken.
    let small = b"GET /s HTTP/1.1\r\nHost: a\r\n\r\n";
    let never = || -> Vec<u8> { panic!("took a buffer") };
    let ParseOutcome::Complete { request, .. } = parse_with(small, &lim(), never) else {
        panic!("not complete");
    };
    assert!(request.is_inline());
    assert_eq!(request.head(), &small[..]);
    assert_eq!(request.into_buf().capacity(), 0);
    // A head one byte over the inline size goes into the given buffer, and so does one
    // whose derived values (here a lowercased host) do not fit beside it.
    let pad = |n: usize| format!("GET /a HTTP/1.1\r\nHost: a\r\nX: {}\r\n\r\n", "p".repeat(n));
    let base = pad(0).len();
    let at = pad(HEAD_INLINE_BYTES - base);
    assert!(complete(at.as_bytes()).0.is_inline());
    let over = pad(HEAD_INLINE_BYTES - base + 1);
    assert!(!complete(over.as_bytes()).0.is_inline());
    let upper = at.replace("Host: a", "Host: A");
    let (r, _) = complete(upper.as_bytes());
    assert!(!r.is_inline());
    assert_eq!(r.host(), Some("a"));
    assert_eq!(r.head(), upper.as_bytes());
    let big = format!("{over}GET /b");
    let bytes = big.as_bytes();
    let mut given = Vec::with_capacity(1024);
    given.extend_from_slice(b"stale bytes");
    let ptr = given.as_ptr();
    let ParseOutcome::Complete { request, consumed } = parse_with(bytes, &lim(), move || given)
    else {
        panic!("not complete");
    };
    assert_eq!(request.target(), "/a");
    assert_eq!(consumed, over.len());
    assert_eq!(request.head(), &bytes[..consumed]);
    let buf = request.into_buf();
    assert_eq!(buf.as_ptr(), ptr, "the same allocation");
    // Partial or refused heads never take a buffer.
    assert_eq!(
        parse_with(b"GET /a HTT", &lim(), never),
        ParseOutcome::Partial
    );
    assert!(matches!(
        parse_with(b"GET / HTTP/1.1\r\n\r\n", &lim(), never),
        ParseOutcome::Error(_)
    ));
}

#[test]
fn derived_values_live_in_the_request_buffer() {
    // Uppercase host: lowercased copy; absolute form: taken from the target.
    let (r, _) = complete(b"GET / HTTP/1.1\r\nHost: WWW.A.Test.:80\r\n\r\n");
    assert_eq!(r.host(), Some("www.a.test"));
    let (r, _) = complete(b"GET http://X.Test/p HTTP/1.1\r\nHost: a\r\n\r\n");
    assert_eq!(r.host(), Some("x.test"));
    assert_eq!(r.target(), "http://X.Test/p");
    // Invalid UTF-8 in a value: made lossy, as before (never a match for our validators).
    let (r, _) =
        complete(b"GET / HTTP/1.1\r\nHost: a\r\nIf-None-Match: \"\xff\"\r\nIf-Range: \xfe\r\n\r\n");
    assert_eq!(r.if_none_match(), Some("\"\u{fffd}\""));
    assert_eq!(r.if_range(), Some("\u{fffd}"));
    assert_eq!(r.header("if-none-match"), None);
    assert_eq!(r.header_bytes("if-none-match"), Some(&b"\"\xff\""[..]));
    // Values are trimmed; bare LF line endings and leading empty lines are read too.
    let (r, _) = complete(b"\r\n\nGET / HTTP/1.1\nHost: a\nRange:  bytes=0-1 \t\nX-A: 1\n\n");
    assert_eq!(r.range(), Some("bytes=0-1"));
    assert_eq!(
        r.headers().collect::<Vec<_>>(),
        vec![
            (&b"Host"[..], &b"a"[..]),
            (&b"Range"[..], &b"bytes=0-1"[..]),
            (&b"X-A"[..], &b"1"[..])
        ]
    );
}

#[test]
fn head_and_other_methods() {
    let (r, _) = complete(b"HEAD / HTTP/1.1\r\nHost: a\r\n\r\n");
    assert_eq!(r.method, Method::Head);
    let (r, _) = complete(b"DELETE /x HTTP/1.1\r\nHost: a\r\n\r\n");
    assert_eq!(r.method, Method::Other);
    assert_eq!(r.method_raw(), "DELETE");
    assert!(r.keep_alive);
    // Methods are case-sensitive.
    let (r, _) = complete(b"get / HTTP/1.1\r\nHost: a\r\n\r\n");
    assert_eq!(r.method, Method::Other);
    // A method with a body cannot be skipped: 501 and close.
    assert_eq!(
        error(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc"),
        HttpError::NotImplemented
    );
    assert_eq!(
        error(b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"),
        HttpError::NotImplemented
    );
    // Body-less POST is Other.
    let (r, _) = complete(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n");
    assert_eq!(r.method, Method::Other);
}

#[test]
fn overlong_method() {
    let long = "A".repeat(METHOD_BYTES_MAX + 1);
    let complete_req = format!("{long} / HTTP/1.1\r\nHost: a\r\n\r\n");
    assert_eq!(error(complete_req.as_bytes()), HttpError::NotImplemented);
    // Still partial, no space yet: refused early.
    assert_eq!(error(long.as_bytes()), HttpError::NotImplemented);
    // Exactly at the limit, partial: wait.
    let at = "A".repeat(METHOD_BYTES_MAX);
    assert_eq!(parse(at.as_bytes(), &lim()), ParseOutcome::Partial);
}

/// Once: a TLS ClientHello on the plaintext port was answered 501 when its random bytes
/// put a line feed before any space (the "line" read as an overlong method), and 400
/// otherwise: `tests/tls.rs` failed about once in 20 runs. Bytes that are no token are 400.
#[test]
fn binary_bytes_before_a_line_feed_are_a_bad_request_not_an_overlong_method() {
    let mut hello = vec![
        0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03,
    ];
    hello.extend((0..40u8).map(|i| 0x80 | i));
    hello.push(b'\n');
    hello.extend_from_slice(&[0x20, 0x13, 0x01]);
    assert!(matches!(error(&hello), HttpError::BadRequest(_)));
    // Partial, no line feed yet, longer than a method: also not a 501.
    assert!(!matches!(
        parse(&hello[..45], &lim()),
        ParseOutcome::Error(HttpError::NotImplemented)
    ));
}

#[test]
fn partial_heads() {
    let full = b"GET /a HTTP/1.1\r\nHost: a\r\nAccept: */*\r\n\r\n";
    for cut in 0..full.len() {
        assert_eq!(
            parse(&full[..cut], &lim()),
            ParseOutcome::Partial,
            "cut at {cut}"
        );
    }
    let (_, n) = complete(full);
    assert_eq!(n, full.len());
}

#[test]
fn pipelined_requests_consume_one_at_a_time() {
    let bytes = b"GET /1 HTTP/1.1\r\nHost: a\r\n\r\nGET /2 HTTP/1.1\r\nHost: a\r\n\r\nGET /3";
    let (r1, n1) = complete(bytes);
    assert_eq!(r1.target(), "/1");
    let (r2, n2) = complete(&bytes[n1..]);
    assert_eq!(r2.target(), "/2");
    assert_eq!(parse(&bytes[n1 + n2..], &lim()), ParseOutcome::Partial);
}

#[test]
fn leading_empty_lines_are_skipped() {
    let bytes = b"\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n";
    let (r, n) = complete(bytes);
    assert_eq!(r.target(), "/");
    assert_eq!(n, bytes.len());
}

#[test]
fn keep_alive_rules() {
    let cases: [(&[u8], bool); 8] = [
        (b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", true),
        (
            b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
            false,
        ),
        (
            b"GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade, Close\r\n\r\n",
            false,
        ),
        (
            b"GET / HTTP/1.1\r\nHost: a\r\nConnection: keep-alive\r\n\r\n",
            true,
        ),
        (b"GET / HTTP/1.0\r\n\r\n", false),
        (b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n", true),
        (
            b"GET / HTTP/1.0\r\nConnection: keep-alive, close\r\n\r\n",
            false,
        ),
        (
            b"GET / HTTP/1.0\r\nConnection: foo\r\nConnection: keep-alive\r\n\r\n",
            true,
        ),
    ];
    for (bytes, ka) in cases {
        let (r, _) = complete(bytes);
        assert_eq!(r.keep_alive, ka, "{:?}", String::from_utf8_lossy(bytes));
    }
}

#[test]
fn host_rules() {
    let host = |bytes: &[u8]| complete(bytes).0.host().map(str::to_string);
    assert_eq!(host(b"GET / HTTP/1.0\r\n\r\n"), None);
    assert_eq!(host(b"GET / HTTP/1.1\r\nHost: \r\n\r\n"), None);
    assert_eq!(
        host(b"GET / HTTP/1.1\r\nHost: EXAMPLE.com.\r\n\r\n").as_deref(),
        Some("example.com")
    );
    assert_eq!(
        host(b"GET / HTTP/1.1\r\nHost: [::1]:8080\r\n\r\n").as_deref(),
        Some("[::1]")
    );
    assert_eq!(
        host(b"GET / HTTP/1.1\r\nHost: 127.0.0.1:80\r\n\r\n").as_deref(),
        Some("127.0.0.1")
    );
    assert_eq!(
        host(b"GET / HTTP/1.1\r\nHost: a.test:\r\n\r\n").as_deref(),
        Some("a.test")
    );
    // Absolute-form overrides Host.
    assert_eq!(
        host(b"GET http://B.Test:81/x HTTP/1.1\r\nHost: a.test\r\n\r\n").as_deref(),
        Some("b.test")
    );
    let bad: [&[u8]; 8] = [
        b"GET / HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a/b\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a:b\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: [zz]\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: [::1\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: user@a\r\n\r\n",
        b"GET http:///x HTTP/1.1\r\nHost: a\r\n\r\n",
    ];
    for bytes in bad {
        let e = error(bytes);
        assert_eq!(e.status(), 400, "{:?}", String::from_utf8_lossy(bytes));
        assert!(e.closes_connection());
    }
    let long = format!(
        "GET / HTTP/1.1\r\nHost: {}\r\n\r\n",
        "a".repeat(HOST_BYTES_MAX + 1)
    );
    assert_eq!(error(long.as_bytes()).status(), 400);
}

#[test]
fn conditional_and_range_fields() {
    let (r, _) = complete(
        b"GET / HTTP/1.1\r\nHost: a\r\nIf-None-Match: \"x\"\r\nif-none-match: \"y\"\r\n\
          If-Modified-Since: Sun, 06 Nov 1994 08:49:37 GMT\r\nRange: bytes=0-1\r\nIf-Range: \"x\"\r\n\r\n",
    );
    assert_eq!(r.if_none_match(), Some("\"x\", \"y\""));
    assert_eq!(r.if_modified_since(), Some("Sun, 06 Nov 1994 08:49:37 GMT"));
    assert_eq!(r.range(), Some("bytes=0-1"));
    assert_eq!(r.if_range(), Some("\"x\""));
    let (r, _) = complete(
        b"GET / HTTP/1.1\r\nHost: a\r\nIf-Modified-Since: a\r\nIf-Modified-Since: b\r\n\
          Range: bytes=0-1\r\nRange: bytes=3-4\r\n\r\n",
    );
    assert_eq!(r.if_modified_since(), None);
    assert_eq!(r.range(), Some("bytes=0-1, bytes=3-4"));
}

#[test]
fn uri_too_long() {
    let limits = Limits {
        uri_bytes_max: 100,
        ..Limits::default()
    };
    let at = format!("GET /{} HTTP/1.1\r\nHost: a\r\n\r\n", "x".repeat(99));
    assert!(matches!(
        parse(at.as_bytes(), &limits),
        ParseOutcome::Complete { .. }
    ));
    let over = format!("GET /{} HTTP/1.1\r\nHost: a\r\n\r\n", "x".repeat(100));
    assert_eq!(error_with(over.as_bytes(), &limits), HttpError::UriTooLong);
    // Partial, no CRLF yet, target still arriving: refused once it is provably too long.
    let partial = format!("GET /{}", "x".repeat(100));
    assert_eq!(
        error_with(partial.as_bytes(), &limits),
        HttpError::UriTooLong
    );
    let partial_ok = format!("GET /{}", "x".repeat(99));
    assert_eq!(parse(partial_ok.as_bytes(), &limits), ParseOutcome::Partial);
    // The request line is done, headers still arriving.
    let partial_line = format!("GET /{} HTTP/1.1\r\nHost: a", "x".repeat(100));
    assert_eq!(
        error_with(partial_line.as_bytes(), &limits),
        HttpError::UriTooLong
    );
    // 414 wins over 431 when the target alone is the problem.
    let small = Limits {
        uri_bytes_max: 100,
        header_bytes_max: 64,
        headers_max: 8,
    };
    assert_eq!(
        error_with(partial.as_bytes(), &small),
        HttpError::UriTooLong
    );
    // Default limits with a huge target.
    let huge = format!("GET /{}", "x".repeat(URI_BYTES_MAX_DEFAULT + 1));
    assert_eq!(error(huge.as_bytes()), HttpError::UriTooLong);
}

#[test]
fn header_section_too_large() {
    let limits = Limits {
        header_bytes_max: 200,
        ..Limits::default()
    };
    // Partial and already over the limit.
    let partial = format!("GET / HTTP/1.1\r\nHost: a\r\nX-Big: {}", "v".repeat(200));
    assert_eq!(
        error_with(partial.as_bytes(), &limits),
        HttpError::HeaderTooLarge
    );
    // Complete in one read but over the limit.
    let whole = format!(
        "GET / HTTP/1.1\r\nHost: a\r\nX-Big: {}\r\n\r\n",
        "v".repeat(200)
    );
    assert_eq!(
        error_with(whole.as_bytes(), &limits),
        HttpError::HeaderTooLarge
    );
    // Under the limit, with a large pipelined tail after it: fine.
    let ok = format!("GET / HTTP/1.1\r\nHost: a\r\n\r\n{}", "G".repeat(500));
    assert!(matches!(
        parse(ok.as_bytes(), &limits),
        ParseOutcome::Complete { consumed: 27, .. }
    ));
    assert_eq!(HttpError::HeaderTooLarge.status(), 431);
    // Boundaries: a head of exactly the limit passes; one byte more does not, whether the
    // bytes are complete or still arriving.
    let exact = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n";
    let at = Limits {
        header_bytes_max: exact.len(),
        ..Limits::default()
    };
    assert!(matches!(parse(exact, &at), ParseOutcome::Complete { .. }));
    let below = Limits {
        header_bytes_max: exact.len() - 1,
        ..Limits::default()
    };
    assert_eq!(error_with(exact, &below), HttpError::HeaderTooLarge);
    let partial = &exact[..exact.len() - 1];
    let at_partial = Limits {
        header_bytes_max: partial.len(),
        ..Limits::default()
    };
    assert_eq!(parse(partial, &at_partial), ParseOutcome::Partial);
    let below_partial = Limits {
        header_bytes_max: partial.len() - 1,
        ..Limits::default()
    };
    assert_eq!(
        error_with(partial, &below_partial),
        HttpError::HeaderTooLarge
    );
}

#[test]
fn too_many_headers() {
    let limits = Limits {
        headers_max: 4,
        ..Limits::default()
    };
    let mut four = String::from("GET / HTTP/1.1\r\nHost: a\r\n");
    for i in 0..3 {
        four.push_str(&format!("X-{i}: v\r\n"));
    }
    let mut five = four.clone();
    four.push_str("\r\n");
    assert!(matches!(
        parse(four.as_bytes(), &limits),
        ParseOutcome::Complete { .. }
    ));
    five.push_str("X-4: v\r\n");
    // Detected before the blank line arrives.
    assert_eq!(
        error_with(five.as_bytes(), &limits),
        HttpError::TooManyHeaders
    );
    five.push_str("\r\n");
    let e = error_with(five.as_bytes(), &limits);
    assert_eq!(e, HttpError::TooManyHeaders);
    assert_eq!(e.status(), 431);
    // headers_max above the cap is clamped, not a panic.
    let huge = Limits {
        headers_max: usize::MAX,
        ..Limits::default()
    };
    assert!(matches!(
        parse(four.as_bytes(), &huge),
        ParseOutcome::Complete { .. }
    ));
}

#[test]
fn malformed_is_400() {
    let bad: [&[u8]; 9] = [
        b"GET  / HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost a\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost : a\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n",
        b"G(T / HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET / HTTX/1.1\r\nHost: a\r\n\r\n",
        b"GET / HTTP/1.1x\r\nHost: a\r\n\r\n",
        b"GET /\x01 HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET / HTTP/1.1\r\nX\x00: a\r\n\r\n",
    ];
    for bytes in bad {
        let e = error(bytes);
        assert_eq!(
            e.status(),
            400,
            "{:?} gave {e:?}",
            String::from_utf8_lossy(bytes)
        );
        assert!(e.closes_connection());
    }
}

#[test]
fn versions() {
    for bytes in [
        &b"GET / HTTP/2.0\r\nHost: a\r\n\r\n"[..],
        b"GET / HTTP/1.2\r\nHost: a\r\n\r\n",
        b"GET / HTTP/3.0\r\n",
        b"GET / HTTP/2",
        b"GET / HTTP/0.9\r\n\r\n",
    ] {
        assert_eq!(
            error(bytes),
            HttpError::VersionNotSupported,
            "{:?}",
            String::from_utf8_lossy(bytes)
        );
    }
    assert_eq!(HttpError::VersionNotSupported.status(), 505);
    let (r, _) = complete(b"GET / HTTP/1.0\r\n\r\n");
    assert_eq!(r.version_minor, 0);
}

#[test]
fn framing_conflicts() {
    let cases: [&[u8]; 7] = [
        b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nContent-Length: 0\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nContent-Length: 5\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 0, 0\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999\r\n\r\n",
    ];
    for bytes in cases {
        let e = error(bytes);
        assert!(
            matches!(e, HttpError::BadFraming(_)),
            "{:?} gave {e:?}",
            String::from_utf8_lossy(bytes)
        );
        assert_eq!(e.status(), 400);
        assert!(e.closes_connection());
    }
}

#[test]
fn bodies_on_get_and_head() {
    let (r, _) = complete(b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n");
    assert_eq!(r.method, Method::Get);
    for bytes in [
        &b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\n\r\nx"[..],
        b"HEAD / HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"GET / HTTP/1.0\r\nTransfer-Encoding: identity\r\n\r\n",
    ] {
        let e = error(bytes);
        assert_eq!(
            e,
            HttpError::BodyNotAllowed,
            "{:?}",
            String::from_utf8_lossy(bytes)
        );
        assert_eq!(e.status(), 400);
    }
}

#[test]
fn every_parse_error_closes() {
    // Fuzz-ish: every prefix and every single-byte corruption of a valid request either
    // parses, is partial, or errors with a closing error; never panics.
    let good = b"GET /a/b?c=d HTTP/1.1\r\nHost: a.test:80\r\nRange: bytes=0-1\r\nConnection: close\r\n\r\n";
    for i in 0..good.len() {
        for b in [0u8, b' ', b'\r', b'\n', b':', 0xff, b'/'] {
            let mut v = good.to_vec();
            v[i] = b;
            if let ParseOutcome::Error(e) = parse(&v, &lim()) {
                assert!(e.closes_connection());
            }
        }
    }
}
