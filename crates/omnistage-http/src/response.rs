//! Response heads: the status line and the header fields every response carries (`Date`,
//! `Server`, `Content-Length`, `Connection`), small error responses with a text body, reason
//! phrases, and a [`DateCache`] that formats the `Date` value at most once per second.
//!
//! Writers append to a caller-owned `Vec<u8>` so a connection can reuse one buffer. Nothing here
//! reads a clock: the time comes in as an argument.
//!
//! Header values are written as given, except that control characters (CR, LF, NUL, …; tab is
//! kept) become spaces and header names keep only token characters, so no argument can split a
//! response. `write_head` writes `Date`, `Server`, `Content-Length` and `Connection` itself and
//! drops fields of those names from `headers`, so framing is stated exactly once.

use std::time::{SystemTime, UNIX_EPOCH};

/// The `Server` header value.
pub const SERVER_NAME: &str = "omnistage";

/// Longest reason phrase written; a longer one is cut.
pub const REASON_BYTES_MAX: usize = 64;

/// The reason phrase for a status code (`"Unknown"` for codes not listed).
pub fn status_reason(code: u16) -> &'static str {
    match code {
        100 => "Continue",
        101 => "Switching Protocols",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        206 => "Partial Content",
        301 => "Moved Permanently",
        302 => "Found",
        303 => "See Other",
        304 => "Not Modified",
        307 => "Temporary Redirect",
        308 => "Permanent Redirect",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        406 => "Not Acceptable",
        408 => "Request Timeout",
        409 => "Conflict",
        410 => "Gone",
        411 => "Length Required",
        412 => "Precondition Failed",
        413 => "Content Too Large",
        414 => "URI Too Long",
        415 => "Unsupported Media Type",
        416 => "Range Not Satisfiable",
        417 => "Expectation Failed",
        421 => "Misdirected Request",
        422 => "Unprocessable Content",
        426 => "Upgrade Required",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        _ => "Unknown",
    }
}

/// Fields that `write_head` always writes itself (lowercase).
const OWN_FIELDS: [&str; 4] = ["date", "server", "content-length", "connection"];

/// Writes an HTTP/1.1 response head: status line, `Date`, `Server: omnistage`, `headers` in
/// order, `Content-Length` (when `Some`), `Connection: keep-alive` or `close`, and the blank line.
///
/// Pass `content_length: None` only for responses that have no body by definition (304, 204,
/// 1xx) or when the connection closes after the body; a HEAD response passes the length the GET
/// would have had. `status` outside 100..=999 is written as 500.
pub fn write_head(
    buf: &mut Vec<u8>,
    status: u16,
    reason: &str,
    headers: &[(&str, &str)],
    content_length: Option<u64>,
    keep_alive: bool,
    date: &str,
) {
    let status = if (100..=999).contains(&status) {
        status
    } else {
        500
    };
    buf.extend_from_slice(b"HTTP/1.1 ");
    push_u64(buf, u64::from(status));
    buf.push(b' ');
    let reason = &reason.as_bytes()[..reason.len().min(REASON_BYTES_MAX)];
    push_value(buf, reason);
    buf.extend_from_slice(b"\r\nDate: ");
    push_value(buf, date.as_bytes());
    buf.extend_from_slice(b"\r\nServer: ");
    buf.extend_from_slice(SERVER_NAME.as_bytes());
    buf.extend_from_slice(b"\r\n");
    for (name, value) in headers {
        if OWN_FIELDS.iter().any(|own| own.eq_ignore_ascii_case(name)) || name.is_empty() {
            continue;
        }
        push_name(buf, name.as_bytes());
        buf.extend_from_slice(b": ");
        push_value(buf, value.as_bytes());
        buf.extend_from_slice(b"\r\n");
    }
    if let Some(len) = content_length {
        buf.extend_from_slice(b"Content-Length: ");
        push_u64(buf, len);
        buf.extend_from_slice(b"\r\n");
    }
    buf.extend_from_slice(if keep_alive {
        b"Connection: keep-alive\r\n\r\n".as_slice()
    } else {
        b"Connection: close\r\n\r\n".as_slice()
    });
}

/// Writes a whole error response: the head (with `Content-Type: text/plain; charset=utf-8`,
/// `extra_headers`, and `Allow: GET, HEAD` for 405 and 501) and the body `"<code> <reason>\n"`.
///
/// Returns the offset in `buf` where the body starts: a HEAD request truncates `buf` to it.
/// For 304 and 1xx/204 no body is written (and no `Content-Length`).
pub fn error_response(
    buf: &mut Vec<u8>,
    status: u16,
    keep_alive: bool,
    date: &str,
    extra_headers: &[(&str, &str)],
) -> usize {
    let reason = status_reason(status);
    let bodyless = status == 304 || status == 204 || (100..200).contains(&status);
    let mut headers: Vec<(&str, &str)> = Vec::with_capacity(extra_headers.len() + 2);
    if !bodyless {
        headers.push(("Content-Type", "text/plain; charset=utf-8"));
    }
    if status == 405 || status == 501 {
        headers.push(("Allow", "GET, HEAD"));
    }
    headers.extend_from_slice(extra_headers);
    // "<code> <reason>\n": three digits, a space, the reason and a newline.
    let body_len = if bodyless {
        None
    } else {
        Some(3 + 1 + reason.len() as u64 + 1)
    };
    write_head(buf, status, reason, &headers, body_len, keep_alive, date);
    let body_start = buf.len();
    if !bodyless {
        push_u64(buf, u64::from(status));
        buf.push(b' ');
        buf.extend_from_slice(reason.as_bytes());
        buf.push(b'\n');
        debug_assert_eq!(Some((buf.len() - body_start) as u64), body_len);
    }
    body_start
}

/// Formats the `Date` header value (IMF-fixdate) at most once per second of `now`.
#[derive(Debug, Clone, Default)]
pub struct DateCache {
    secs: Option<u64>,
    value: String,
    formats: u64,
}

impl DateCache {
    /// An empty cache; the first [`DateCache::get`] formats.
    pub fn new() -> Self {
        Self::default()
    }

    /// The `Date` value for `now`, reformatted only when the whole second differs from the
    /// last call's (in either direction, so a clock stepped back is followed).
    pub fn get(&mut self, now: SystemTime) -> &str {
        let secs = now
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        if self.secs != Some(secs) {
            self.value = httpdate::fmt_http_date(UNIX_EPOCH + std::time::Duration::from_secs(secs));
            self.secs = Some(secs);
            self.formats += 1;
        }
        &self.value
    }

    /// How many times the value was formatted (for tests and statistics).
    pub fn formats(&self) -> u64 {
        self.formats
    }
}

/// Appends the decimal digits of `n` without going through `fmt`.
pub(crate) fn push_u64(buf: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    buf.extend_from_slice(&digits[i..]);
}

fn push_value(buf: &mut Vec<u8>, value: &[u8]) {
    buf.extend(value.iter().map(|&b| {
        if (b < 0x20 && b != b'\t') || b == 0x7f {
            b' '
        } else {
            b
        }
    }));
}

fn push_name(buf: &mut Vec<u8>, name: &[u8]) {
    buf.extend(name.iter().map(|&b| if is_tchar(b) { b } else { b'_' }));
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const DATE: &str = "Sun, 06 Nov 1994 08:49:37 GMT";

    fn text(buf: &[u8]) -> &str {
        std::str::from_utf8(buf).unwrap()
    }

    #[test]
    fn head_layout() {
        let mut buf = Vec::new();
        write_head(
            &mut buf,
            200,
            "OK",
            &[
                ("Content-Type", "text/html; charset=utf-8"),
                ("ETag", "\"1-2\""),
            ],
            Some(1234),
            true,
            DATE,
        );
        assert_eq!(
            text(&buf),
            "HTTP/1.1 200 OK\r\nDate: Sun, 06 Nov 1994 08:49:37 GMT\r\nServer: omnistage\r\n\
             Content-Type: text/html; charset=utf-8\r\nETag: \"1-2\"\r\nContent-Length: 1234\r\n\
             Connection: keep-alive\r\n\r\n"
        );
        buf.clear();
        write_head(&mut buf, 304, "Not Modified", &[], None, false, DATE);
        assert_eq!(
            text(&buf),
            "HTTP/1.1 304 Not Modified\r\nDate: Sun, 06 Nov 1994 08:49:37 GMT\r\nServer: omnistage\r\n\
             Connection: close\r\n\r\n"
        );
    }

    #[test]
    fn head_cannot_be_split_or_reframed() {
        let mut buf = Vec::new();
        write_head(
            &mut buf,
            200,
            "OK\r\nX: y",
            &[
                ("Location", "/a\r\nSet-Cookie: x=1"),
                ("Bad Name:", "v"),
                ("content-length", "999"),
                ("Connection", "upgrade"),
                ("", "empty name"),
            ],
            Some(0),
            true,
            DATE,
        );
        let s = text(&buf);
        assert!(s.starts_with("HTTP/1.1 200 OK  X: y\r\n"));
        assert!(s.contains("Location: /a  Set-Cookie: x=1\r\n"));
        assert!(s.contains("Bad_Name_: v\r\n"));
        assert!(!s.contains("999"));
        assert!(!s.contains("upgrade"));
        assert!(!s.contains("empty name"));
        assert_eq!(s.matches("\r\n\r\n").count(), 1);
        assert_eq!(s.matches("Content-Length").count(), 1);
        buf.clear();
        write_head(&mut buf, 42, "x", &[], None, true, DATE);
        assert!(text(&buf).starts_with("HTTP/1.1 500 x\r\n"));
        buf.clear();
        write_head(&mut buf, 200, &"r".repeat(100), &[], None, true, DATE);
        assert!(text(&buf).starts_with(&format!(
            "HTTP/1.1 200 {}\r\n",
            "r".repeat(REASON_BYTES_MAX)
        )));
    }

    #[test]
    fn error_bodies() {
        let mut buf = b"previous".to_vec();
        let body_start = error_response(&mut buf, 404, true, DATE, &[]);
        let s = text(&buf[8..]);
        assert!(s.starts_with("HTTP/1.1 404 Not Found\r\n"));
        assert!(s.contains("Content-Type: text/plain; charset=utf-8\r\n"));
        assert!(s.contains("Content-Length: 14\r\n"));
        assert!(s.contains("Connection: keep-alive\r\n"));
        assert_eq!(text(&buf[body_start..]), "404 Not Found\n");

        buf.clear();
        let body_start = error_response(&mut buf, 501, false, DATE, &[("Retry-After", "1")]);
        let s = text(&buf);
        assert!(s.contains("Allow: GET, HEAD\r\nRetry-After: 1\r\n"));
        assert!(s.contains("Connection: close\r\n"));
        assert_eq!(text(&buf[body_start..]), "501 Not Implemented\n");
        // HEAD: truncate to the body start.
        buf.truncate(body_start);
        assert!(text(&buf).ends_with("\r\n\r\n"));

        buf.clear();
        let body_start = error_response(&mut buf, 301, true, DATE, &[("Location", "/d/")]);
        assert!(text(&buf).contains("Location: /d/\r\n"));
        assert_eq!(text(&buf[body_start..]), "301 Moved Permanently\n");

        buf.clear();
        let body_start = error_response(&mut buf, 304, true, DATE, &[]);
        assert_eq!(body_start, buf.len());
        assert!(!text(&buf).contains("Content-Length"));
        assert!(!text(&buf).contains("Content-Type"));

        for code in [400u16, 414, 416, 421, 431, 500, 503, 505] {
            buf.clear();
            let start = error_response(&mut buf, code, true, DATE, &[]);
            let body = text(&buf[start..]);
            assert!(text(&buf).contains(&format!("Content-Length: {}\r\n", body.len())));
            assert_eq!(body, format!("{code} {}\n", status_reason(code)));
        }
    }

    #[test]
    fn reasons() {
        assert_eq!(status_reason(200), "OK");
        assert_eq!(status_reason(206), "Partial Content");
        assert_eq!(status_reason(304), "Not Modified");
        assert_eq!(status_reason(416), "Range Not Satisfiable");
        assert_eq!(status_reason(431), "Request Header Fields Too Large");
        assert_eq!(status_reason(505), "HTTP Version Not Supported");
        assert_eq!(status_reason(299), "Unknown");
    }

    #[test]
    fn date_cache_formats_once_per_second() {
        let mut cache = DateCache::new();
        let t = UNIX_EPOCH + Duration::from_secs(784_111_777);
        assert_eq!(cache.get(t), DATE);
        assert_eq!(cache.get(t + Duration::from_millis(999)), DATE);
        assert_eq!(cache.formats(), 1);
        assert_eq!(
            cache.get(t + Duration::from_secs(1)),
            "Sun, 06 Nov 1994 08:49:38 GMT"
        );
        assert_eq!(cache.formats(), 2);
        // A clock stepped back is followed.
        assert_eq!(cache.get(t), DATE);
        assert_eq!(cache.formats(), 3);
        // Before the epoch: formatted as the epoch, no panic.
        assert_eq!(
            cache.get(UNIX_EPOCH - Duration::from_secs(5)),
            "Thu, 01 Jan 1970 00:00:00 GMT"
        );
    }

    #[test]
    fn digits() {
        for n in [0u64, 7, 10, 1234, u64::MAX] {
            let mut b = Vec::new();
            push_u64(&mut b, n);
            assert_eq!(text(&b), n.to_string());
        }
    }
}
