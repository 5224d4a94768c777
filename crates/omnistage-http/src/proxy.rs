//! The reverse proxy's HTTP/1.1 intermediary rules (RFC 9110 §7.6, RFC 9112), as pure
//! functions: bytes in, result out; nothing here owns a socket or a clock.
//!
//! - [`parse_response_head`]: an upstream's response head → status, framing and persistence,
//!   or a refusal (the server answers 502 and closes that upstream connection). Refused:
//!   malformed heads, a head longer than the limit, versions other than HTTP/1.0 and 1.1,
//!   `Content-Length` with `Transfer-Encoding`, more than one `Content-Length` (even equal), an
//!   invalid `Content-Length`, a transfer coding other than exactly one `chunked`, `101`.
//! - [`ChunkedDecoder`]: walks a chunked body (sizes, data, CRLFs, trailers) and says where
//!   its data lies and where it ends; refuses malformed sizes, a missing CRLF after data, and
//!   size lines or trailers beyond their limits.
//! - [`write_upstream_head`]: the request as the backend sees it: hop-by-hop fields (and every
//!   field named in `Connection`) removed, `Expect` handled here, `X-Forwarded-For`,
//!   `-Proto`, `-Host` set, `Host` as the client sent it.
//! - [`write_client_head`]: the response as the client sees it: hop-by-hop fields removed and
//!   the framing and persistence of this hop written.

use crate::request::{BodyFraming, Request};
use std::io::Write as _;
use std::net::IpAddr;
use std::ops::Range;

/// Most header fields in an upstream response head.
pub const RESPONSE_HEADERS_MAX: usize = 128;
/// Longest chunk-size line (with extensions) accepted.
pub const CHUNK_LINE_BYTES_MAX: usize = 4096;
/// Most bytes of trailer fields accepted after the last chunk.
pub const TRAILER_BYTES_MAX: usize = 16 * 1024;

/// How a response body is framed on the upstream connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResponseFraming {
    /// No body: `HEAD`, 1xx, 204, 304.
    None,
    /// `Content-Length` bytes.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// Until the upstream closes the connection (no length given).
    UntilClose,
}

/// A parsed upstream response head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResponseHead {
    pub status: u16,
    pub framing: ResponseFraming,
    /// The upstream connection may carry another request after this response.
    pub keep_alive: bool,
    /// Bytes of the head (the body starts here).
    pub head_len: usize,
}

/// What [`parse_response_head`] made of the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadOutcome {
    /// Not complete, and nothing proves it bad yet.
    Partial,
    /// A whole head. A 1xx (other than 101) is interim: skip `head_len` bytes and parse again.
    Complete(ResponseHead),
    /// Refused: answer 502 and close the upstream connection.
    Invalid(&'static str),
}

/// Hop-by-hop fields (RFC 9110 §7.6.1), never forwarded.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "proxy-authenticate",
    "proxy-authorization",
];

fn eq(a: &[u8], b: &str) -> bool {
    a.eq_ignore_ascii_case(b.as_bytes())
}

/// Comma-separated tokens of a field value, trimmed, empty ones skipped.
fn tokens(v: &[u8]) -> impl Iterator<Item = &[u8]> {
    v.split(|&b| b == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
}

/// Whether the field `name` must not be forwarded, given the fields' `Connection` values.
///
/// A `Connection` option never removes `Content-Length`: the body is forwarded with the length
/// this hop parsed, so the next hop must see it too. (Honouring `Connection: content-length`
/// sent the body bare, and a body that is itself a request was read upstream as a second
/// request: smuggling, on a pooled connection answered to the next client.)
fn is_hop_by_hop<'a>(name: &[u8], connection: impl Iterator<Item = &'a [u8]>) -> bool {
    HOP_BY_HOP.iter().any(|h| eq(name, h))
        || (!eq(name, "content-length")
            && connection
                .flat_map(tokens)
                .any(|t| t.eq_ignore_ascii_case(name)))
}

/// Parses the response head at the start of `buf`. `head_bytes_max` bounds the head (a longer
/// one, complete or not, is refused); `request_is_head` says the request was `HEAD` (no body
/// follows whatever the head says).
pub fn parse_response_head(
    buf: &[u8],
    head_bytes_max: usize,
    request_is_head: bool,
) -> HeadOutcome {
    let mut slots = [httparse::EMPTY_HEADER; RESPONSE_HEADERS_MAX];
    let mut resp = httparse::Response::new(&mut slots);
    let head_len = match resp.parse(buf) {
        Ok(httparse::Status::Partial) => {
            if buf.len() > head_bytes_max {
                return HeadOutcome::Invalid("response head too large");
            }
            return HeadOutcome::Partial;
        }
        Ok(httparse::Status::Complete(n)) => n,
        Err(httparse::Error::TooManyHeaders) => return HeadOutcome::Invalid("too many fields"),
        Err(_) => return HeadOutcome::Invalid("malformed response head"),
    };
    if head_len > head_bytes_max {
        return HeadOutcome::Invalid("response head too large");
    }
    let version_minor = match resp.version {
        Some(v @ (0 | 1)) => v,
        _ => return HeadOutcome::Invalid("unsupported version"),
    };
    let status = resp.code.unwrap_or(0);
    if !(100..=999).contains(&status) {
        return HeadOutcome::Invalid("invalid status");
    }
    if status == 101 {
        return HeadOutcome::Invalid("protocol upgrade not supported");
    }
    let mut content_length: Option<u64> = None;
    let mut te_fields = 0usize;
    let mut te_chunked = false;
    let mut conn_close = false;
    let mut conn_keep_alive = false;
    for h in resp.headers.iter() {
        let name = h.name.as_bytes();
        let value = h.value.trim_ascii();
        if eq(name, "content-length") {
            if content_length.is_some() {
                return HeadOutcome::Invalid("more than one Content-Length");
            }
            match parse_length(value) {
                Some(n) => content_length = Some(n),
                None => return HeadOutcome::Invalid("invalid Content-Length"),
            }
        } else if eq(name, "transfer-encoding") {
            te_fields += 1;
            te_chunked = value.eq_ignore_ascii_case(b"chunked");
        } else if eq(name, "connection") {
            for t in tokens(value) {
                conn_close |= t.eq_ignore_ascii_case(b"close");
                conn_keep_alive |= t.eq_ignore_ascii_case(b"keep-alive");
            }
        }
    }
    if te_fields > 0 && content_length.is_some() {
        return HeadOutcome::Invalid("both Content-Length and Transfer-Encoding");
    }
    if te_fields > 1 || (te_fields == 1 && !te_chunked) {
        return HeadOutcome::Invalid("transfer coding other than chunked");
    }
    let framing = if request_is_head || status < 200 || status == 204 || status == 304 {
        ResponseFraming::None
    } else if te_chunked {
        ResponseFraming::Chunked
    } else {
        match content_length {
            Some(n) => ResponseFraming::Length(n),
            None => ResponseFraming::UntilClose,
        }
    };
    let persistent = if conn_close {
        false
    } else {
        version_minor == 1 || conn_keep_alive
    };
    HeadOutcome::Complete(ResponseHead {
        status,
        framing,
        keep_alive: persistent && framing != ResponseFraming::UntilClose,
        head_len,
    })
}

/// A `Content-Length` value: 1..=19 digits.
fn parse_length(v: &[u8]) -> Option<u64> {
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(v.iter().fold(0u64, |n, &d| n * 10 + u64::from(d - b'0')))
}

/// Where a [`ChunkedDecoder`] is in a chunked body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ChunkState {
    Size,
    Data,
    DataCrlf,
    Trailer,
    Done,
}

/// One step of a [`ChunkedDecoder`]: `consumed` bytes of the input are done with; `data` (a
/// range of the input) is body data among them; `done` once the last chunk and the trailers
/// are through. `consumed == 0` and not done: more bytes are needed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkStep {
    pub consumed: usize,
    pub data: Range<usize>,
    pub done: bool,
}

/// Walks a chunked body incrementally (RFC 9112 §7.1).
#[derive(Clone, Debug)]
pub struct ChunkedDecoder {
    state: ChunkState,
    remaining: u64,
    trailer_bytes: usize,
}

impl Default for ChunkedDecoder {
    fn default() -> Self {
        ChunkedDecoder {
            state: ChunkState::Size,
            remaining: 0,
            trailer_bytes: 0,
        }
    }
}

impl ChunkedDecoder {
    /// Whether the whole body has been walked.
    pub fn is_done(&self) -> bool {
        self.state == ChunkState::Done
    }

    /// Walks one element (a size line, data, a CRLF, a trailer line) at the start of `input`.
    pub fn step(&mut self, input: &[u8]) -> Result<ChunkStep, &'static str> {
        let none = |consumed| ChunkStep {
            consumed,
            data: 0..0,
            done: false,
        };
        match self.state {
            ChunkState::Done => Ok(ChunkStep {
                consumed: 0,
                data: 0..0,
                done: true,
            }),
            ChunkState::Size => match httparse::parse_chunk_size(input) {
                Ok(httparse::Status::Complete((n, size))) => {
                    if n > CHUNK_LINE_BYTES_MAX {
                        return Err("chunk size line too long");
                    }
                    // httparse takes any byte in an extension, a bare LF included, which a
                    // peer that ends lines at LF reads as the end of the line: the two would
                    // disagree on where the body ends (request smuggling). RFC 9112 allows no
                    // control characters there (the line ends with the CRLF httparse checked).
                    if input[..n - 2].iter().any(|&b| is_ctl(b)) {
                        return Err("control character in a chunk size line");
                    }
                    if size == 0 {
                        self.state = ChunkState::Trailer;
                    } else {
                        self.state = ChunkState::Data;
                        self.remaining = size;
                    }
                    Ok(none(n))
                }
                Ok(httparse::Status::Partial) if input.len() > CHUNK_LINE_BYTES_MAX => {
                    Err("chunk size line too long")
                }
                Ok(httparse::Status::Partial) => Ok(none(0)),
                Err(_) => Err("invalid chunk size"),
            },
            ChunkState::Data => {
                let n = (input.len() as u64).min(self.remaining) as usize;
                self.remaining -= n as u64;
                if self.remaining == 0 {
                    self.state = ChunkState::DataCrlf;
                }
                Ok(ChunkStep {
                    consumed: n,
                    data: 0..n,
                    done: false,
                })
            }
            ChunkState::DataCrlf => {
                if input.len() < 2 {
                    return Ok(none(0));
                }
                if &input[..2] != b"\r\n" {
                    return Err("chunk data not followed by CRLF");
                }
                self.state = ChunkState::Size;
                Ok(none(2))
            }
            ChunkState::Trailer => {
                let Some(end) = input.windows(2).position(|w| w == b"\r\n") else {
                    if self.trailer_bytes + input.len() > TRAILER_BYTES_MAX {
                        return Err("trailers too long");
                    }
                    return Ok(none(0));
                };
                self.trailer_bytes += end + 2;
                if self.trailer_bytes > TRAILER_BYTES_MAX {
                    return Err("trailers too long");
                }
                // A trailer is a field line: a bare LF in it would end it early for a peer
                // that ends lines at LF (the next bytes then read as a request or a response).
                let line = &input[..end];
                if end > 0 && (line.iter().any(|&b| is_ctl(b)) || !line.contains(&b':')) {
                    return Err("invalid trailer line");
                }
                if end == 0 {
                    self.state = ChunkState::Done;
                    return Ok(ChunkStep {
                        consumed: 2,
                        data: 0..0,
                        done: true,
                    });
                }
                Ok(none(end + 2))
            }
        }
    }
}

impl ChunkedDecoder {
    /// [`ChunkedDecoder::step`], appending to `out` the element in its plain form: the size in
    /// lowercase hex without extensions, the data, the CRLFs, the last chunk, and no trailers.
    /// What goes on is then what this decoder read, whatever a lenient reader downstream would
    /// make of the original bytes (nginx re-frames a chunked request body the same way). Never
    /// more bytes than `step` consumed (no leading zeros, extensions or trailers are added).
    pub fn step_plain(
        &mut self,
        input: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<ChunkStep, &'static str> {
        let before = self.state;
        let s = self.step(input)?;
        if s.consumed == 0 && !s.done {
            return Ok(s);
        }
        match before {
            ChunkState::Size if self.state == ChunkState::Data => {
                use std::io::Write as _;
                // Writing into a Vec cannot fail.
                let _ = write!(out, "{:x}\r\n", self.remaining);
            }
            ChunkState::Size => out.extend_from_slice(b"0\r\n"),
            ChunkState::Data => out.extend_from_slice(&input[s.data.clone()]),
            ChunkState::DataCrlf => out.extend_from_slice(b"\r\n"),
            ChunkState::Trailer if s.done => out.extend_from_slice(b"\r\n"),
            ChunkState::Trailer | ChunkState::Done => {}
        }
        Ok(s)
    }
}

/// A control character as RFC 9110 counts them, less HTAB (which field values may hold).
fn is_ctl(b: u8) -> bool {
    (b < 0x20 && b != b'\t') || b == 0x7f
}

/// The origin-form of a request target: an absolute-form `http://host/path?q` becomes
/// `/path?q` (and `http://host?q` becomes `/?q`: the slash is the first element).
fn origin_form(target: &str) -> (&'static str, &str) {
    let scheme = "http://";
    // Compared as bytes: the target may hold bytes above 0x7F (the parser accepts them), and
    // slicing the string at a byte that is not a character boundary would panic.
    if target
        .as_bytes()
        .get(..scheme.len())
        .is_some_and(|p| p.eq_ignore_ascii_case(scheme.as_bytes()))
    {
        let rest = &target[scheme.len()..];
        return match rest.find(['/', '?']) {
            Some(i) if rest.as_bytes()[i] == b'/' => ("", &rest[i..]),
            Some(i) => ("/", &rest[i..]),
            None => ("/", ""),
        };
    }
    ("", target)
}

/// Writes the request head the backend receives (HTTP/1.1): the client's method and target
/// (origin-form), its end-to-end fields, `Host` as the client sent it (or the absolute-form's
/// authority), `X-Forwarded-For` (the client's list plus `peer`), `X-Forwarded-Proto` =
/// `proto`, `X-Forwarded-Host` = the client's Host, and the body's framing.
pub fn write_upstream_head(out: &mut Vec<u8>, req: &Request, peer: IpAddr, proto: &str) {
    out.extend_from_slice(req.method_raw().as_bytes());
    out.push(b' ');
    let (slash, path) = origin_form(req.target());
    out.extend_from_slice(slash.as_bytes());
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    let connection = || {
        req.headers()
            .filter(|(n, _)| eq(n, "connection"))
            .map(|(_, v)| v)
    };
    let mut host_sent = false;
    let mut xff: Option<&[u8]> = None;
    let mut client_host: Option<&[u8]> = None;
    for (name, value) in req.headers() {
        if is_hop_by_hop(name, connection())
            || eq(name, "expect")
            || eq(name, "x-forwarded-proto")
            || eq(name, "x-forwarded-host")
        {
            continue;
        }
        if eq(name, "x-forwarded-for") {
            // Joined below with the peer; several fields keep the first (the parser accepted
            // the head, so values are bounded).
            xff.get_or_insert(value);
            continue;
        }
        if eq(name, "host") {
            host_sent = true;
            client_host = Some(value);
        }
        out.extend_from_slice(name);
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    if !host_sent {
        // HTTP/1.0 without Host, or absolute-form: the authority the client named, if any.
        out.extend_from_slice(b"Host: ");
        if let Some(h) = req.host() {
            out.extend_from_slice(h.as_bytes());
        }
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"X-Forwarded-For: ");
    if let Some(x) = xff.filter(|x| !x.is_empty()) {
        out.extend_from_slice(x);
        out.extend_from_slice(b", ");
    }
    // Straight into the head: no String per request.
    let _ = write!(out, "{peer}");
    out.extend_from_slice(b"\r\nX-Forwarded-Proto: ");
    out.extend_from_slice(proto.as_bytes());
    out.extend_from_slice(b"\r\n");
    if let Some(h) = client_host.or(req.host().map(str::as_bytes)) {
        out.extend_from_slice(b"X-Forwarded-Host: ");
        out.extend_from_slice(h);
        out.extend_from_slice(b"\r\n");
    }
    if req.body == BodyFraming::Chunked {
        out.extend_from_slice(b"Transfer-Encoding: chunked\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// Writes the response head the client receives: the upstream's status line (as HTTP/1.1)
/// and end-to-end fields (the head must have parsed with [`parse_response_head`]), then this
/// hop's framing (`Transfer-Encoding: chunked` when `chunked`) and persistence.
pub fn write_client_head(
    out: &mut Vec<u8>,
    upstream_head: &[u8],
    chunked: bool,
    keep_alive: bool,
    client_version_minor: u8,
) {
    let mut slots = [httparse::EMPTY_HEADER; RESPONSE_HEADERS_MAX];
    let mut resp = httparse::Response::new(&mut slots);
    // Parsed before; a failure here writes a bare status line rather than panic.
    let _ = resp.parse(upstream_head);
    let status = resp.code.unwrap_or(502);
    let _ = write!(out, "HTTP/1.1 {status} ");
    out.extend_from_slice(resp.reason.unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    let headers = &*resp.headers;
    let connection = || {
        headers
            .iter()
            .filter(|h| eq(h.name.as_bytes(), "connection"))
            .map(|h| h.value)
    };
    for h in headers {
        if is_hop_by_hop(h.name.as_bytes(), connection()) {
            continue;
        }
        out.extend_from_slice(h.name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(h.value);
        out.extend_from_slice(b"\r\n");
    }
    if chunked {
        out.extend_from_slice(b"Transfer-Encoding: chunked\r\n");
    }
    if !keep_alive {
        out.extend_from_slice(b"Connection: close\r\n");
    } else if client_version_minor == 0 {
        out.extend_from_slice(b"Connection: keep-alive\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{parse_with_body, Limits, ParseOutcome};

    fn head(b: &[u8]) -> HeadOutcome {
        parse_response_head(b, 1024, false)
    }

    fn complete(b: &[u8]) -> ResponseHead {
        match head(b) {
            HeadOutcome::Complete(h) => h,
            other => panic!("{other:?} for {:?}", String::from_utf8_lossy(b)),
        }
    }

    #[test]
    fn response_framing() {
        let h = complete(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello");
        assert_eq!(h.framing, ResponseFraming::Length(5));
        assert!(h.keep_alive);
        assert_eq!(h.head_len, 38);
        let h = complete(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert_eq!(h.framing, ResponseFraming::Chunked);
        let h = complete(b"HTTP/1.1 200 OK\r\n\r\n");
        assert_eq!(h.framing, ResponseFraming::UntilClose);
        assert!(!h.keep_alive, "a close-delimited body ends the connection");
        let h = complete(b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n");
        assert!(!h.keep_alive);
        let h = complete(b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\n");
        assert!(h.keep_alive);
        let h = complete(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\n");
        assert!(!h.keep_alive);
        for s in [204, 304, 100, 103] {
            let b = format!("HTTP/1.1 {s} X\r\nContent-Length: 9\r\n\r\n");
            assert_eq!(complete(b.as_bytes()).framing, ResponseFraming::None, "{s}");
        }
        match parse_response_head(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", 1024, true) {
            HeadOutcome::Complete(h) => assert_eq!(h.framing, ResponseFraming::None),
            o => panic!("{o:?}"),
        }
        assert_eq!(head(b"HTTP/1.1 200 OK\r\nContent-"), HeadOutcome::Partial);
    }

    #[test]
    fn ambiguous_or_invalid_responses_are_refused() {
        for b in [
            &b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"HTTP/2.0 200 OK\r\n\r\n",
            b"HTTP/1.1 2000 OK\r\n\r\n",
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n",
            b"garbage\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nBad Header\r\n\r\n",
        ] {
            assert!(
                matches!(head(b), HeadOutcome::Invalid(_)),
                "{:?}",
                String::from_utf8_lossy(b)
            );
        }
    }

    #[test]
    fn head_limit_is_crossed_partial_or_complete() {
        let mut b = b"HTTP/1.1 200 OK\r\nX: ".to_vec();
        b.resize(100, b'a');
        assert_eq!(parse_response_head(&b, 100, false), HeadOutcome::Partial);
        b.push(b'a');
        assert!(matches!(
            parse_response_head(&b, 100, false),
            HeadOutcome::Invalid(_)
        ));
        let ok = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n";
        assert!(matches!(
            parse_response_head(ok, ok.len(), false),
            HeadOutcome::Complete(_)
        ));
        assert!(matches!(
            parse_response_head(ok, ok.len() - 1, false),
            HeadOutcome::Invalid(_)
        ));
    }

    /// Feeds `body` to a decoder `split` bytes at a time; returns the data and whether it ended.
    fn dechunk(body: &[u8], split: usize) -> Result<(Vec<u8>, bool, usize), &'static str> {
        let mut d = ChunkedDecoder::default();
        let mut data = Vec::new();
        let mut pos = 0;
        let mut avail = split.min(body.len());
        loop {
            let s = d.step(&body[pos..avail])?;
            data.extend_from_slice(&body[pos..avail][s.data.clone()]);
            pos += s.consumed;
            if s.done {
                return Ok((data, true, pos));
            }
            if s.consumed == 0 {
                if avail == body.len() {
                    return Ok((data, false, pos));
                }
                avail = (avail + split).min(body.len());
            }
        }
    }

    #[test]
    fn chunked_bodies_decode_in_any_split() {
        let body = b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nTrailer: x\r\n\r\nNEXT";
        for split in [1, 2, 3, 7, 100] {
            let (data, done, used) = dechunk(body, split).unwrap();
            assert_eq!(data, b"hello world", "split {split}");
            assert!(done);
            assert_eq!(used, body.len() - 4, "the next message is not taken");
        }
        let (data, done, _) = dechunk(b"5\r\nhel", 2).unwrap();
        assert_eq!((data.as_slice(), done), (&b"hel"[..], false));
    }

    #[test]
    fn bad_chunked_bodies_are_refused() {
        assert!(dechunk(b"zz\r\nhello\r\n0\r\n\r\n", 100).is_err());
        assert!(dechunk(b"5\r\nhelloXX0\r\n\r\n", 100).is_err());
        let mut long = b"5;".to_vec();
        long.resize(CHUNK_LINE_BYTES_MAX + 10, b'a');
        assert!(dechunk(&long, 100_000).is_err());
        let mut trailers = b"0\r\n".to_vec();
        for _ in 0..2000 {
            trailers.extend_from_slice(b"X-Trailer: 123456\r\n");
        }
        assert!(dechunk(&trailers, 100_000).is_err());
    }

    /// Once: httparse takes any byte in a chunk extension, a bare LF included, and a trailer
    /// line was any bytes up to CRLF: a backend that ends lines at LF read the bytes after the
    /// LF as a second request the proxy never saw (CVE-2025-22871's proxy and Go pair).
    #[test]
    fn chunk_lines_a_lenient_reader_would_split_are_refused() {
        for body in [
            &b"4;\nGET /smuggled HTTP/1.1\r\nabcd\r\n0\r\n\r\n"[..],
            b"4;a=\x01\r\nabcd\r\n0\r\n\r\n",
            b"4\r\nabcd\r\n0\r\nX: 1\nGET /smuggled HTTP/1.1\r\n\r\n",
            b"4\r\nabcd\r\n0\r\nnot a field\r\n\r\n",
        ] {
            assert!(
                dechunk(body, 100).is_err(),
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
        // Tabs and spaces in extensions and trailers are fine.
        let ok = b"4 ;\tx=\"y\"\r\nabcd\r\n0\r\nX-T:\t1\r\n\r\n";
        assert_eq!(dechunk(ok, 100).unwrap().0, b"abcd");
    }

    /// `step_plain` writes what the decoder read in the plain form, in any split: sizes
    /// without leading zeros or extensions, no trailers, and never more than it consumed.
    #[test]
    fn step_plain_reframes_what_it_reads() {
        let body = b"005;ext=1\r\nhello\r\n6\r\n world\r\n0;last\r\nX-T: 1\r\n\r\nNEXT";
        for split in [1, 2, 3, 7, 100] {
            let mut d = ChunkedDecoder::default();
            let mut out = Vec::new();
            let (mut pos, mut avail) = (0, split.min(body.len()));
            loop {
                let before = out.len();
                let s = d.step_plain(&body[pos..avail], &mut out).unwrap();
                assert!(out.len() - before <= s.consumed.max(2), "split {split}");
                pos += s.consumed;
                if s.done {
                    break;
                }
                if s.consumed == 0 {
                    avail = (avail + split).min(body.len());
                }
            }
            assert_eq!(pos, body.len() - 4, "split {split}");
            assert_eq!(
                out, b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
                "split {split}"
            );
        }
    }

    fn request(b: &[u8]) -> Request {
        match parse_with_body(b, &Limits::default(), Vec::new) {
            ParseOutcome::Complete { request, .. } => request,
            o => panic!("{o:?}"),
        }
    }

    #[test]
    fn upstream_head_drops_hop_by_hop_and_sets_forwarding() {
        let req = request(
            b"POST /api/x?q=1 HTTP/1.1\r\nHost: A.test:8080\r\nConnection: keep-alive, X-Secret\r\n\
              X-Secret: s\r\nKeep-Alive: 5\r\nTE: trailers\r\nUpgrade: h2c\r\nProxy-Connection: x\r\n\
              Expect: 100-continue\r\nX-Forwarded-For: 10.0.0.1\r\nX-Forwarded-Proto: ftp\r\n\
              Transfer-Encoding: chunked\r\nAccept: */*\r\n\r\n",
        );
        let mut out = Vec::new();
        write_upstream_head(&mut out, &req, "127.0.0.9".parse().unwrap(), "http");
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text,
            "POST /api/x?q=1 HTTP/1.1\r\nHost: A.test:8080\r\nAccept: */*\r\n\
             X-Forwarded-For: 10.0.0.1, 127.0.0.9\r\nX-Forwarded-Proto: http\r\n\
             X-Forwarded-Host: A.test:8080\r\nTransfer-Encoding: chunked\r\n\r\n"
        );
        let req = request(b"GET http://b.test/p HTTP/1.0\r\n\r\n");
        let mut out = Vec::new();
        write_upstream_head(&mut out, &req, "::1".parse().unwrap(), "https");
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "GET /p HTTP/1.1\r\nHost: b.test\r\nX-Forwarded-For: ::1\r\n\
             X-Forwarded-Proto: https\r\nX-Forwarded-Host: b.test\r\n\r\n"
        );
    }

    /// `Connection: content-length` must not strip the length of a body that is forwarded
    /// (the body, itself a request, was read upstream as a second request), in either
    /// direction; and a target with bytes above 0x7F where the scheme would be is not sliced
    /// inside a character.
    #[test]
    fn a_connection_option_never_strips_the_length() {
        let smuggle = b"POST /x HTTP/1.1\r\nHost: a\r\nConnection: content-length\r\n\
                        Content-Length: 40\r\n\r\n";
        let req = request(smuggle);
        assert_eq!(req.body, BodyFraming::Length(40));
        let mut out = Vec::new();
        write_upstream_head(&mut out, &req, "127.0.0.9".parse().unwrap(), "http");
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("\r\nContent-Length: 40\r\n"), "{text}");
        let up = b"HTTP/1.1 200 OK\r\nConnection: Content-Length\r\nContent-Length: 3\r\n\r\n";
        let mut out = Vec::new();
        write_client_head(&mut out, up, false, true, 1);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n"
        );
        for target in [
            "/a\u{65e5}\u{672c}",
            "http:/\u{65e5}",
            "\u{65e5}\u{672c}\u{8a9e}xx",
        ] {
            assert_eq!(origin_form(target), ("", target));
        }
        assert_eq!(origin_form("HTTP://h/\u{65e5}"), ("", "/\u{65e5}"));
    }

    #[test]
    fn client_head_drops_hop_by_hop_and_sets_framing() {
        let up =
            b"HTTP/1.1 201 Created\r\nConnection: X-Hop, close\r\nX-Hop: 1\r\nKeep-Alive: 3\r\n\
                   Transfer-Encoding: chunked\r\nTrailer: X\r\nSet-Cookie: a=b\r\n\r\n";
        let mut out = Vec::new();
        write_client_head(&mut out, up, true, true, 1);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "HTTP/1.1 201 Created\r\nSet-Cookie: a=b\r\nTransfer-Encoding: chunked\r\n\r\n"
        );
        let up = b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\n";
        let mut out = Vec::new();
        write_client_head(&mut out, up, false, false, 0);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\n"
        );
    }
}
