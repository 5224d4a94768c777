//! Inputs that once crashed a target, each run through its target again. A new finding of the
//! fuzzers goes here (and into `corpus/TARGET/`) with the date and what it broke.

/// Found by a plain mutation fuzzer before this crate existed: a `Range` with a multi-byte
/// character where the unit ends sliced a `str` inside it (cond.rs:146), panicking the worker.
#[test]
fn range_with_a_multibyte_char_at_the_unit() {
    let mut input = 1001u64.to_le_bytes().to_vec();
    input.extend_from_slice("bytes\u{ff}0-2".as_bytes());
    omnistage_fuzz::range(&input);
    omnistage_fuzz::request(b"\0GET / HTTP/1.1\r\nHost: a\r\nRange: bytes\xc3\xbf0-2\r\n\r\n");
    omnistage_fuzz::conditional(b"\0\0\0bytes\xc3\xbf0-2");
}

/// Same class, found in the sweep after it: an absolute-form check sliced the target at byte 7.
#[test]
fn target_with_a_multibyte_char_across_the_scheme() {
    omnistage_fuzz::path("http:/\u{e9}x".as_bytes());
    omnistage_fuzz::request("\0GET http:/\u{e9}x HTTP/1.1\r\nHost: a\r\n\r\n".as_bytes());
}

/// Found by AFL++ (target `chunked`, 2026-11-23, within 15 s): the load generator's response
/// reader took `HTTP/1.1 000 OK` as a response with status 0.
#[test]
fn response_status_below_100_is_refused() {
    omnistage_fuzz::chunked(b"\xffHTTP/1.1 000 OK\r\nContent-Length: 0\r\n\r\n");
    omnistage_fuzz::chunked(b"\xffHTTP/1.1 053 Service Unavailable\r\nContent-Length: 2\r\n\r\nno");
}

/// Found by the `admin` target's first seeds (2026-11-23): a PUT whose network cap was valid but
/// whose weight was refused (409) had already applied the network cap: a refused request
/// changed the running config.
#[test]
fn admin_put_refused_after_a_valid_server_setting_changes_nothing() {
    omnistage_fuzz::admin(
        b"\x01/api/v1/activities/tenants/b\n{\"cap_net\": \"5MB/s\", \"weight\": 0}",
    );
    omnistage_fuzz::admin(
        b"\x01/api/v1/activities/tenants/b\n{\"budget\": 1000, \"policy\": \"x\"}",
    );
}

/// Found by review (2026-11-27), now held by the `request` target's upstream-head check: the
/// proxy's request head dropped `Content-Length` when `Connection` named it, so a body that is
/// itself a request reached the backend as a second request (smuggling); and the proxy's own
/// absolute-form check sliced a non-ASCII target at byte 7.
#[test]
fn proxied_head_keeps_the_body_framing_and_slices_no_character() {
    omnistage_fuzz::request(
        b"\0POST /x HTTP/1.1\r\nHost: a\r\nConnection: content-length\r\nContent-Length: 40\r\n\r\n",
    );
    omnistage_fuzz::request("\0GET /a\u{65e5}\u{672c} HTTP/1.1\r\nHost: a\r\n\r\n".as_bytes());
}
