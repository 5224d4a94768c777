//! The request head parser: bytes → [`Request`] (via httparse), partial, or an [`HttpError`]:
//! the size limits (also on partial heads), the version, the body framing (`Content-Length`,
//! `Transfer-Encoding`), `Host` and `Connection`, then the copy into the request's buffer.

use super::host::{absolute_form_authority, normalize_host};
use super::parsed::{HeadWriter, Request, Span};
use super::{
    BodyFraming, HttpError, Limits, Method, HEADERS_CAP, HEAD_BYTES_CAP, METHOD_BYTES_MAX,
};

/// Where `part` (a slice of `buf`) starts in `buf`.
fn offset_in(buf: &[u8], part: &[u8]) -> usize {
    part.as_ptr() as usize - buf.as_ptr() as usize
}

/// A header field that may appear several times: the first one's index and how many.
#[derive(Clone, Copy, Default)]
struct Seen {
    first: usize,
    count: usize,
}

impl Seen {
    fn see(&mut self, i: usize) {
        if self.count == 0 {
            self.first = i;
        }
        self.count += 1;
    }
}
pub(super) fn parse_inner(
    buf: &[u8],
    limits: &Limits,
    take_buf: impl FnOnce() -> Vec<u8>,
    allow_body: bool,
) -> Result<Option<(Request, usize)>, HttpError> {
    let headers_max = limits.headers_max.min(HEADERS_CAP);
    let mut slots = [httparse::EMPTY_HEADER; HEADERS_CAP];
    let mut req = httparse::Request::new(&mut slots[..headers_max]);
    let status = match req.parse(buf) {
        Ok(s) => s,
        Err(httparse::Error::TooManyHeaders) => return Err(HttpError::TooManyHeaders),
        Err(httparse::Error::Version) => return Err(version_error(buf)),
        Err(_) => {
            // A malformed line may also be an overlong one still arriving; prefer the size
            // errors when the bytes already prove them.
            check_partial_sizes(buf, limits)?;
            return Err(HttpError::BadRequest("malformed request head"));
        }
    };
    let consumed = match status {
        httparse::Status::Partial => {
            check_partial_sizes(buf, limits)?;
            return Ok(None);
        }
        httparse::Status::Complete(n) => n,
    };

    let method_raw = req.method.unwrap_or_default();
    let target = req.path.unwrap_or_default();
    if method_raw.len() > METHOD_BYTES_MAX {
        return Err(HttpError::NotImplemented);
    }
    if target.len() > limits.uri_bytes_max {
        return Err(HttpError::UriTooLong);
    }
    if consumed > limits.header_bytes_max || consumed > HEAD_BYTES_CAP {
        return Err(HttpError::HeaderTooLarge);
    }
    let version_minor = match req.version {
        Some(0) => 0,
        Some(1) => 1,
        _ => return Err(HttpError::VersionNotSupported),
    };
    let method = match method_raw {
        "GET" => Method::Get,
        "HEAD" => Method::Head,
        _ => Method::Other,
    };

    let mut host_field: Option<&[u8]> = None;
    let mut host_count = 0usize;
    let mut content_length: Option<u64> = None;
    let mut transfer_encoding = false;
    let mut te_chunked_only = true;
    let mut conn_close = false;
    let mut conn_keep_alive = false;
    let mut if_none_match = Seen::default();
    let mut if_modified_since = Seen::default();
    let mut if_range = Seen::default();
    let mut range = Seen::default();

    for (i, h) in req.headers.iter().enumerate() {
        let name = h.name.as_bytes();
        let value = h.value.trim_ascii();
        let is = |n: &str| name.eq_ignore_ascii_case(n.as_bytes());
        if is("host") {
            host_count += 1;
            host_field = Some(value);
        } else if is("content-length") {
            if content_length.is_some() {
                return Err(HttpError::BadFraming("more than one Content-Length"));
            }
            content_length = Some(parse_content_length(value)?);
        } else if is("transfer-encoding") {
            // Only one field, whose value is exactly `chunked`, is a body we can frame.
            te_chunked_only &= !transfer_encoding && value.eq_ignore_ascii_case(b"chunked");
            transfer_encoding = true;
        } else if is("connection") {
            for token in value.split(|&b| b == b',').map(<[u8]>::trim_ascii) {
                if token.eq_ignore_ascii_case(b"close") {
                    conn_close = true;
                } else if token.eq_ignore_ascii_case(b"keep-alive") {
                    conn_keep_alive = true;
                }
            }
        } else if is("if-none-match") {
            if_none_match.see(i);
        } else if is("if-modified-since") {
            if_modified_since.see(i);
        } else if is("if-range") {
            if_range.see(i);
        } else if is("range") {
            range.see(i);
        }
    }

    if transfer_encoding && content_length.is_some() {
        return Err(HttpError::BadFraming(
            "both Content-Length and Transfer-Encoding",
        ));
    }
    let has_body = transfer_encoding || content_length.is_some_and(|n| n > 0);
    let body = if transfer_encoding && te_chunked_only {
        BodyFraming::Chunked
    } else if transfer_encoding {
        BodyFraming::UnknownCoding
    } else {
        match content_length {
            Some(n) if n > 0 => BodyFraming::Length(n),
            _ => BodyFraming::None,
        }
    };
    if has_body && !allow_body {
        return Err(match method {
            Method::Get | Method::Head => HttpError::BodyNotAllowed,
            Method::Other => HttpError::NotImplemented,
        });
    }

    if host_count > 1 {
        return Err(HttpError::BadRequest("more than one Host"));
    }
    if version_minor == 1 && host_count == 0 {
        return Err(HttpError::BadRequest("HTTP/1.1 request without Host"));
    }
    let mut host = match host_field {
        Some(v) => {
            let v = std::str::from_utf8(v)
                .map_err(|_| HttpError::BadRequest("invalid character in host"))?;
            normalize_host(v)?
        }
        None => None,
    };
    if let Some(authority) = absolute_form_authority(target) {
        host = normalize_host(authority)?;
        if host.is_none() {
            return Err(HttpError::BadRequest("absolute-form target without host"));
        }
    }

    let keep_alive = if conn_close {
        false
    } else {
        version_minor == 1 || conn_keep_alive
    };

    // Valid: copy the head into the request's buffer, then append the derived values.
    let mut out = HeadWriter::new(take_buf);
    out.extend(&buf[..consumed]);
    let raw = |part: &[u8]| Span {
        start: offset_in(buf, part) as u32,
        len: part.len() as u32,
    };
    let host = host.map(|h| {
        if h.bytes().any(|b| b.is_ascii_uppercase()) {
            let start = out.len();
            for chunk in h.as_bytes().chunks(32) {
                let mut lower = [0u8; 32];
                for (l, b) in lower.iter_mut().zip(chunk) {
                    *l = b.to_ascii_lowercase();
                }
                out.extend(&lower[..chunk.len()]);
            }
            Span {
                start: start as u32,
                len: h.len() as u32,
            }
        } else {
            raw(h.as_bytes())
        }
    });
    let fields = &*req.headers;
    let list = |seen: Seen, single: bool, out: &mut HeadWriter<_>| -> Option<Span> {
        if seen.count == 0 || (single && seen.count > 1) {
            return None;
        }
        let first = fields[seen.first].value.trim_ascii();
        if seen.count == 1 && std::str::from_utf8(first).is_ok() {
            return Some(raw(first));
        }
        // Several fields, or invalid UTF-8: the value is made after the raw head.
        let start = out.len();
        let names = fields[seen.first].name;
        for (n, h) in fields[seen.first..]
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case(names))
            .enumerate()
        {
            if n > 0 {
                out.extend(b", ");
            }
            out.extend(String::from_utf8_lossy(h.value.trim_ascii()).as_bytes());
        }
        Some(Span {
            start: start as u32,
            len: (out.len() - start) as u32,
        })
    };
    let if_none_match = list(if_none_match, false, &mut out);
    let if_modified_since = list(if_modified_since, true, &mut out);
    let if_range = list(if_range, true, &mut out);
    let range = list(range, false, &mut out);

    let request = Request {
        method,
        version_minor,
        keep_alive,
        body,
        head_len: consumed as u32,
        method_raw: raw(method_raw.as_bytes()),
        target: raw(target.as_bytes()),
        host,
        if_none_match,
        if_modified_since,
        if_range,
        range,
        buf: out.finish(),
    };
    Ok(Some((request, consumed)))
}

/// Longest `Content-Length` value accepted, in digits (u64 holds 19 full digits).
const CONTENT_LENGTH_DIGITS_MAX: usize = 19;

fn parse_content_length(value: &[u8]) -> Result<u64, HttpError> {
    if value.is_empty()
        || value.len() > CONTENT_LENGTH_DIGITS_MAX
        || !value.iter().all(|b| b.is_ascii_digit())
    {
        return Err(HttpError::BadFraming("invalid Content-Length"));
    }
    // At most 19 digits: always fits in a u64.
    Ok(value
        .iter()
        .fold(0u64, |n, &d| n * 10 + u64::from(d - b'0')))
}
/// httparse refuses any version but 1.0 and 1.1 with `Error::Version`. A well-formed
/// `HTTP/<digit>.<digit>` (or `HTTP/<digit>`) is a version we do not support → 505;
/// anything else in that place is malformed → 400.
fn version_error(buf: &[u8]) -> HttpError {
    let line = skip_leading_newlines(buf);
    let line = match line.iter().position(|&b| b == b'\r' || b == b'\n') {
        Some(i) => &line[..i],
        None => line,
    };
    let version = match line.iter().rposition(|&b| b == b' ') {
        Some(i) => &line[i + 1..],
        None => line,
    };
    let Some(rest) = version.strip_prefix(b"HTTP/") else {
        return HttpError::BadRequest("malformed HTTP version");
    };
    let plausible = match rest {
        [] => true, // still arriving
        [major] => major.is_ascii_digit(),
        [major, b'.'] => major.is_ascii_digit(),
        [major, b'.', minor] => major.is_ascii_digit() && minor.is_ascii_digit(),
        _ => false,
    };
    if plausible {
        HttpError::VersionNotSupported
    } else {
        HttpError::BadRequest("malformed HTTP version")
    }
}

/// A `tchar` of RFC 9110 §5.6.2: what a method token is made of.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

pub(super) fn skip_leading_newlines(buf: &[u8]) -> &[u8] {
    let start = buf
        .iter()
        .position(|&b| b != b'\r' && b != b'\n')
        .unwrap_or(buf.len());
    &buf[start..]
}

/// On a partial (or malformed) head, refuse it already when the bytes seen prove a limit broken.
fn check_partial_sizes(buf: &[u8], limits: &Limits) -> Result<(), HttpError> {
    let line = skip_leading_newlines(buf);
    let line = match line.iter().position(|&b| b == b'\n') {
        Some(i) => &line[..i],
        None => line,
    };
    match line.iter().position(|&b| b == b' ') {
        Some(sp) => {
            let after = &line[sp + 1..];
            let target_len = after
                .iter()
                .position(|&b| b == b' ' || b == b'\r')
                .unwrap_or(after.len());
            if target_len > limits.uri_bytes_max {
                return Err(HttpError::UriTooLong);
            }
        }
        None => {
            // A long token with no space yet is a method we will not implement; bytes that
            // cannot be a method (TLS on the plaintext port, binary garbage) are a bad request,
            // answered below or when the head fails to parse.
            let token = line.strip_suffix(b"\r").unwrap_or(line);
            if token.len() > METHOD_BYTES_MAX && token.iter().all(|&b| is_tchar(b)) {
                return Err(HttpError::NotImplemented);
            }
        }
    }
    if buf.len() > limits.header_bytes_max {
        return Err(HttpError::HeaderTooLarge);
    }
    Ok(())
}
