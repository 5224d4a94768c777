//! Incremental HTTP/1.1 response reader.
//!
//! Owns the framing of responses on one connection: it takes bytes as they arrive, in pieces of
//! any size (a response may be split across many reads, several responses may arrive in one), and
//! reports each complete response with its status, body length and whether the server will close
//! the connection. The status line and headers are parsed with `httparse` once the end of the head
//! is seen; bodies are *counted, never buffered*: Content-Length bodies, `Transfer-Encoding:
//! chunked` bodies (with trailers) and close-delimited bodies are all skipped over as they arrive.
//!
//! Bounded: a head may be at most [`MAX_HEAD_BYTES`] with at most [`MAX_HEADERS`] headers, a body
//! at most [`MAX_BODY_BYTES`], a chunk-size line at most [`MAX_CHUNK_LINE_BYTES`]. Anything past a
//! limit, or malformed, is a [`ParseError`] and the connection must be dropped.

use std::fmt;

/// Largest response head (status line plus headers plus the blank line) accepted.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most headers accepted in one response head.
pub const MAX_HEADERS: usize = 128;
/// Largest body accepted for one response; the body is discarded, so this bounds time, not memory.
pub const MAX_BODY_BYTES: u64 = 1 << 30;
/// Longest chunk-size line (size, extensions, CRLF) accepted in a chunked body.
pub const MAX_CHUNK_LINE_BYTES: usize = 1024;

/// One complete response, as the load generator needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// Status code (never 1xx: informational responses are skipped).
    pub status: u16,
    /// Body bytes received (after removing chunked framing).
    pub body_bytes: u64,
    /// The server will close the connection after this response (`Connection: close`, HTTP/1.0
    /// without keep-alive, or a close-delimited body).
    pub close: bool,
    /// The response carried a `Retry-After` header.
    pub retry_after: bool,
}

/// Why a byte stream is not a valid response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseError {
    /// The head grew past [`MAX_HEAD_BYTES`].
    HeadTooLarge,
    /// `httparse` rejected the head (bad status line, bad header, too many headers).
    BadHead(String),
    /// Content-Length was missing a number, repeated with different values, or combined with
    /// chunked encoding.
    BadContentLength,
    /// A Transfer-Encoding other than `chunked` (alone or last).
    UnsupportedTransferEncoding,
    /// A malformed chunk-size line, or a missing CRLF after chunk data.
    BadChunk,
    /// The body is longer than [`MAX_BODY_BYTES`].
    BodyTooLarge,
    /// `101 Switching Protocols`: this client never asks for an upgrade.
    UnexpectedUpgrade,
    /// The connection ended in the middle of a response.
    UnexpectedEof,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParseError::HeadTooLarge => write!(f, "response head over {MAX_HEAD_BYTES} bytes"),
            ParseError::BadHead(e) => write!(f, "bad response head: {e}"),
            ParseError::BadContentLength => write!(f, "bad Content-Length"),
            ParseError::UnsupportedTransferEncoding => write!(f, "unsupported Transfer-Encoding"),
            ParseError::BadChunk => write!(f, "bad chunked framing"),
            ParseError::BodyTooLarge => write!(f, "body over {MAX_BODY_BYTES} bytes"),
            ParseError::UnexpectedUpgrade => write!(f, "unexpected 101 Switching Protocols"),
            ParseError::UnexpectedEof => write!(f, "connection closed mid-response"),
        }
    }
}

/// Result of feeding bytes to a [`ResponseReader`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Feed {
    /// All bytes were consumed and the response is not complete yet.
    NeedMore,
    /// A response completed after consuming `consumed` bytes of the input; the rest of the input
    /// (if any) belongs to the next response.
    Done { response: Response, consumed: usize },
}

/// Where the reader is within the current response.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Collecting the head; `scan` tracks the bytes that may end it.
    Head { scan: HeadScan },
    /// Content-Length body with this many bytes left.
    Fixed { remaining: u64 },
    /// Chunked body: reading a chunk-size line (its bytes so far are in `line`).
    ChunkSize,
    /// Chunked body: this many data bytes left in the current chunk.
    ChunkData { remaining: u64 },
    /// Chunked body: expecting the CRLF after chunk data (`seen_cr` once the CR arrived).
    ChunkDataEnd { seen_cr: bool },
    /// Chunked body: trailer section after the last chunk; `scan` finds the blank line, `seen`
    /// counts its bytes (trailers are skipped, only their size is bounded).
    Trailers { scan: HeadScan, seen: usize },
    /// Body delimited by the end of the connection.
    UntilClose,
}

/// A tiny state machine that finds the blank line ending a head: `\n\r\n` or `\n\n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeadScan {
    /// Inside a line.
    InLine,
    /// Just after a `\n` (at the start of a line).
    LineStart,
    /// At the start of a line, after a `\r`.
    LineStartCr,
}

impl HeadScan {
    /// Advances over one byte; true when that byte ends the head.
    fn step(&mut self, b: u8) -> bool {
        *self = match (*self, b) {
            (HeadScan::LineStart | HeadScan::LineStartCr, b'\n') => return true,
            (HeadScan::LineStart, b'\r') => HeadScan::LineStartCr,
            (_, b'\n') => HeadScan::LineStart,
            _ => HeadScan::InLine,
        };
        false
    }
}

/// Frames the responses on one connection. Reuse it across responses; call [`reset`] when the
/// connection is replaced.
///
/// [`reset`]: ResponseReader::reset
#[derive(Debug)]
pub struct ResponseReader {
    state: State,
    /// Head bytes (in the head state), chunk-size line bytes (chunk-size state), trailer bytes.
    buf: Vec<u8>,
    /// The response whose body is being read.
    current: Response,
}

impl Default for ResponseReader {
    fn default() -> Self {
        Self::new()
    }
}

impl ResponseReader {
    /// A reader waiting for the head of the first response.
    pub fn new() -> Self {
        ResponseReader {
            state: State::Head {
                scan: HeadScan::InLine,
            },
            buf: Vec::new(),
            current: empty_response(),
        }
    }

    /// Forgets any partial response (for a new connection). Keeps the buffer's allocation unless
    /// it grew large.
    pub fn reset(&mut self) {
        self.state = State::Head {
            scan: HeadScan::InLine,
        };
        self.buf.clear();
        if self.buf.capacity() > 4096 {
            self.buf = Vec::new();
        }
        self.current = empty_response();
    }

    /// True when no byte of a response has been seen since the last complete one.
    pub fn is_idle(&self) -> bool {
        matches!(self.state, State::Head { .. }) && self.buf.is_empty()
    }

    /// Consumes bytes up to the end of the current response (or all of them).
    pub fn feed(&mut self, data: &[u8]) -> Result<Feed, ParseError> {
        let mut pos = 0;
        loop {
            match &mut self.state {
                State::Head { scan } => {
                    let mut end = None;
                    for (i, &b) in data[pos..].iter().enumerate() {
                        if scan.step(b) {
                            end = Some(pos + i + 1);
                            break;
                        }
                    }
                    let take = end.unwrap_or(data.len());
                    if self.buf.len() + (take - pos) > MAX_HEAD_BYTES {
                        return Err(ParseError::HeadTooLarge);
                    }
                    self.buf.extend_from_slice(&data[pos..take]);
                    pos = take;
                    if end.is_none() {
                        return Ok(Feed::NeedMore);
                    }
                    self.parse_head()?;
                }
                State::Fixed { remaining } => {
                    let n = (*remaining).min((data.len() - pos) as u64);
                    *remaining -= n;
                    self.current.body_bytes += n;
                    pos += n as usize;
                    if *remaining > 0 {
                        return Ok(Feed::NeedMore);
                    }
                    return Ok(self.finish(pos));
                }
                State::ChunkSize => {
                    let Some(i) = data[pos..].iter().position(|&b| b == b'\n') else {
                        if self.buf.len() + (data.len() - pos) > MAX_CHUNK_LINE_BYTES {
                            return Err(ParseError::BadChunk);
                        }
                        self.buf.extend_from_slice(&data[pos..]);
                        return Ok(Feed::NeedMore);
                    };
                    if self.buf.len() + i + 1 > MAX_CHUNK_LINE_BYTES {
                        return Err(ParseError::BadChunk);
                    }
                    self.buf.extend_from_slice(&data[pos..pos + i + 1]);
                    pos += i + 1;
                    let size = parse_chunk_size(&self.buf)?;
                    self.buf.clear();
                    if self.current.body_bytes + size > MAX_BODY_BYTES {
                        return Err(ParseError::BodyTooLarge);
                    }
                    self.state = if size == 0 {
                        State::Trailers {
                            scan: HeadScan::LineStart,
                            seen: 0,
                        }
                    } else {
                        State::ChunkData { remaining: size }
                    };
                }
                State::ChunkData { remaining } => {
                    let n = (*remaining).min((data.len() - pos) as u64);
                    *remaining -= n;
                    self.current.body_bytes += n;
                    pos += n as usize;
                    if *remaining > 0 {
                        return Ok(Feed::NeedMore);
                    }
                    self.state = State::ChunkDataEnd { seen_cr: false };
                }
                State::ChunkDataEnd { seen_cr } => {
                    let Some(&b) = data.get(pos) else {
                        return Ok(Feed::NeedMore);
                    };
                    pos += 1;
                    match (b, *seen_cr) {
                        (b'\r', false) => *seen_cr = true,
                        (b'\n', _) => self.state = State::ChunkSize,
                        _ => return Err(ParseError::BadChunk),
                    }
                }
                State::Trailers { scan, seen } => {
                    let mut end = None;
                    for (i, &b) in data[pos..].iter().enumerate() {
                        if scan.step(b) {
                            end = Some(pos + i + 1);
                            break;
                        }
                    }
                    let take = end.unwrap_or(data.len());
                    *seen += take - pos;
                    if *seen > MAX_HEAD_BYTES {
                        return Err(ParseError::HeadTooLarge);
                    }
                    pos = take;
                    if end.is_none() {
                        return Ok(Feed::NeedMore);
                    }
                    return Ok(self.finish(pos));
                }
                State::UntilClose => {
                    let n = (data.len() - pos) as u64;
                    self.current.body_bytes += n;
                    if self.current.body_bytes > MAX_BODY_BYTES {
                        return Err(ParseError::BodyTooLarge);
                    }
                    return Ok(Feed::NeedMore);
                }
            }
        }
    }

    /// The connection reached end of stream. Completes a close-delimited body; `Ok(None)` when no
    /// response was in progress; an error when a response was cut short.
    pub fn eof(&mut self) -> Result<Option<Response>, ParseError> {
        match self.state {
            State::UntilClose => match self.finish(0) {
                Feed::Done { response, .. } => Ok(Some(response)),
                Feed::NeedMore => unreachable!("finish always completes"),
            },
            State::Head { .. } if self.buf.is_empty() => Ok(None),
            _ => Err(ParseError::UnexpectedEof),
        }
    }

    /// Parses the complete head in `buf` and picks the body framing.
    fn parse_head(&mut self) -> Result<(), ParseError> {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut parsed = httparse::Response::new(&mut headers);
        match parsed.parse(&self.buf) {
            Ok(httparse::Status::Complete(_)) => {}
            Ok(httparse::Status::Partial) => {
                return Err(ParseError::BadHead("incomplete head".into()));
            }
            Err(e) => return Err(ParseError::BadHead(e.to_string())),
        }
        let status = parsed.code.unwrap_or(0);
        // httparse takes any three digits; a status below 100 is not HTTP (RFC 9110 §15).
        if status < 100 {
            return Err(ParseError::BadHead(format!(
                "status {status:03} is not 100..=999"
            )));
        }
        let http10 = parsed.version == Some(0);
        let mut content_length: Option<u64> = None;
        let mut chunked = false;
        let mut conn_close = false;
        let mut conn_keep_alive = false;
        let mut retry_after = false;
        for h in parsed.headers.iter() {
            let name = h.name;
            if name.eq_ignore_ascii_case("content-length") {
                let v = std::str::from_utf8(h.value)
                    .ok()
                    .map(str::trim)
                    .and_then(|s| {
                        if s.bytes().all(|b| b.is_ascii_digit()) {
                            s.parse::<u64>().ok()
                        } else {
                            None
                        }
                    })
                    .ok_or(ParseError::BadContentLength)?;
                if content_length.is_some_and(|c| c != v) {
                    return Err(ParseError::BadContentLength);
                }
                content_length = Some(v);
            } else if name.eq_ignore_ascii_case("transfer-encoding") {
                // Only `chunked` as the final coding is understood (the codings before it would
                // need decoding, which this client does not do).
                let mut codings = h
                    .value
                    .split(|&b| b == b',')
                    .map(|c| c.trim_ascii())
                    .filter(|c| !c.is_empty());
                let last = codings.next_back();
                if codings.next().is_some()
                    || !last.is_some_and(|c| c.eq_ignore_ascii_case(b"chunked"))
                {
                    return Err(ParseError::UnsupportedTransferEncoding);
                }
                chunked = true;
            } else if name.eq_ignore_ascii_case("connection") {
                for token in h.value.split(|&b| b == b',').map(|c| c.trim_ascii()) {
                    if token.eq_ignore_ascii_case(b"close") {
                        conn_close = true;
                    } else if token.eq_ignore_ascii_case(b"keep-alive") {
                        conn_keep_alive = true;
                    }
                }
            } else if name.eq_ignore_ascii_case("retry-after") {
                retry_after = true;
            }
        }
        self.buf.clear();
        match status {
            101 => return Err(ParseError::UnexpectedUpgrade),
            100..=199 => {
                // Informational: the final response follows.
                self.state = State::Head {
                    scan: HeadScan::InLine,
                };
                return Ok(());
            }
            _ => {}
        }
        if chunked && content_length.is_some() {
            return Err(ParseError::BadContentLength);
        }
        self.current = Response {
            status,
            body_bytes: 0,
            close: conn_close || (http10 && !conn_keep_alive),
            retry_after,
        };
        let no_body = status == 204 || status == 304;
        self.state = if no_body {
            State::Fixed { remaining: 0 }
        } else if chunked {
            State::ChunkSize
        } else if let Some(len) = content_length {
            if len > MAX_BODY_BYTES {
                return Err(ParseError::BodyTooLarge);
            }
            State::Fixed { remaining: len }
        } else {
            self.current.close = true;
            State::UntilClose
        };
        Ok(())
    }

    /// Completes the current response and gets ready for the next head.
    fn finish(&mut self, consumed: usize) -> Feed {
        self.state = State::Head {
            scan: HeadScan::InLine,
        };
        let response = std::mem::replace(&mut self.current, empty_response());
        Feed::Done { response, consumed }
    }
}

fn empty_response() -> Response {
    Response {
        status: 0,
        body_bytes: 0,
        close: false,
        retry_after: false,
    }
}

/// Parses `1a;ext=1\r\n` into 26. At most 15 hex digits (so the size fits well within u64).
fn parse_chunk_size(line: &[u8]) -> Result<u64, ParseError> {
    let line = line.strip_suffix(b"\n").ok_or(ParseError::BadChunk)?;
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let digits_end = line
        .iter()
        .position(|b| !b.is_ascii_hexdigit())
        .unwrap_or(line.len());
    if digits_end == 0 || digits_end > 15 {
        return Err(ParseError::BadChunk);
    }
    let rest = &line[digits_end..];
    if !(rest.is_empty() || rest.trim_ascii_start().starts_with(b";")) {
        return Err(ParseError::BadChunk);
    }
    let digits = std::str::from_utf8(&line[..digits_end]).map_err(|_| ParseError::BadChunk)?;
    u64::from_str_radix(digits, 16).map_err(|_| ParseError::BadChunk)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `input` in pieces of `piece` bytes and collects every response.
    fn feed_in_pieces(input: &[u8], piece: usize) -> Result<Vec<Response>, ParseError> {
        let mut r = ResponseReader::new();
        let mut out = Vec::new();
        for chunk in input.chunks(piece) {
            let mut data = chunk;
            while !data.is_empty() {
                match r.feed(data)? {
                    Feed::NeedMore => break,
                    Feed::Done { response, consumed } => {
                        out.push(response);
                        data = &data[consumed..];
                    }
                }
            }
        }
        if let Some(resp) = r.eof()? {
            out.push(resp);
        }
        Ok(out)
    }

    fn ok(status: u16, body: u64) -> Response {
        Response {
            status,
            body_bytes: body,
            close: false,
            retry_after: false,
        }
    }

    const PIPELINED: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello\
HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n\r\n\
HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n10\r\n0123456789abcdef\r\n0\r\nX-T: 1\r\n\r\n\
HTTP/1.1 304 Not Modified\r\nContent-Length: 99\r\n\r\n\
HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 404 Not Found\r\nContent-Length: 2\r\nConnection: keep-alive, Close\r\n\r\nno";

    fn pipelined_expected() -> Vec<Response> {
        vec![
            ok(200, 5),
            Response {
                retry_after: true,
                ..ok(503, 0)
            },
            ok(200, 19),
            ok(304, 0),
            Response {
                close: true,
                ..ok(404, 2)
            },
        ]
    }

    /// Found by AFL++ (omnistage-fuzz, target `chunked`): httparse takes any three digits.
    #[test]
    fn a_status_below_100_is_a_bad_head() {
        for head in ["HTTP/1.1 000 OK", "HTTP/1.1 053 Service Unavailable"] {
            let bytes = format!("{head}\r\nContent-Length: 0\r\n\r\n");
            assert!(
                matches!(
                    feed_in_pieces(bytes.as_bytes(), 64),
                    Err(ParseError::BadHead(_))
                ),
                "{head}"
            );
        }
    }

    #[test]
    fn pipelined_responses_in_one_read() {
        assert_eq!(
            feed_in_pieces(PIPELINED, PIPELINED.len()).unwrap(),
            pipelined_expected()
        );
    }

    #[test]
    fn responses_split_at_every_size() {
        for piece in 1..=PIPELINED.len() {
            assert_eq!(
                feed_in_pieces(PIPELINED, piece).unwrap(),
                pipelined_expected(),
                "piece size {piece}"
            );
        }
    }

    #[test]
    fn close_delimited_and_http10() {
        let r = feed_in_pieces(b"HTTP/1.0 200 OK\r\n\r\nsome body", 4).unwrap();
        assert_eq!(
            r,
            vec![Response {
                close: true,
                ..ok(200, 9)
            }]
        );
        let r = feed_in_pieces(
            b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\nx",
            3,
        )
        .unwrap();
        assert_eq!(r, vec![ok(200, 1)]);
    }

    #[test]
    fn bare_lf_heads_are_accepted() {
        let r = feed_in_pieces(b"HTTP/1.1 200 OK\nContent-Length: 2\n\nhi", 1).unwrap();
        assert_eq!(r, vec![ok(200, 2)]);
    }

    #[test]
    fn errors() {
        let big = format!(
            "HTTP/1.1 200 OK\r\nX: {}\r\n\r\n",
            "a".repeat(MAX_HEAD_BYTES)
        );
        assert_eq!(
            feed_in_pieces(big.as_bytes(), 1000),
            Err(ParseError::HeadTooLarge)
        );
        assert!(matches!(
            feed_in_pieces(b"garbage\r\n\r\n", 100),
            Err(ParseError::BadHead(_))
        ));
        assert_eq!(
            feed_in_pieces(
                b"HTTP/1.1 200 OK\r\nContent-Length: 1073741825\r\n\r\n",
                100
            ),
            Err(ParseError::BodyTooLarge)
        );
        assert_eq!(
            feed_in_pieces(b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", 100),
            Err(ParseError::BadContentLength)
        );
        assert_eq!(
            feed_in_pieces(
                b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
                100
            ),
            Err(ParseError::BadContentLength)
        );
        assert_eq!(
            feed_in_pieces(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", 100),
            Err(ParseError::UnsupportedTransferEncoding)
        );
        assert_eq!(
            feed_in_pieces(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                100
            ),
            Err(ParseError::BadChunk)
        );
        assert_eq!(
            feed_in_pieces(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nabc",
                100
            ),
            Err(ParseError::BadChunk)
        );
        assert_eq!(
            feed_in_pieces(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", 100),
            Err(ParseError::UnexpectedEof)
        );
        assert_eq!(
            feed_in_pieces(b"HTTP/1.1 101 Switching Protocols\r\n\r\n", 100),
            Err(ParseError::UnexpectedUpgrade)
        );
    }

    #[test]
    fn idle_tracking() {
        let mut r = ResponseReader::new();
        assert!(r.is_idle());
        assert_eq!(r.feed(b"HTTP/1.1 2").unwrap(), Feed::NeedMore);
        assert!(!r.is_idle());
        r.reset();
        assert!(r.is_idle());
        assert_eq!(r.eof().unwrap(), None);
    }
}
