//! The parsed request: [`Request`], one buffer holding the raw head and the derived values
//! (kept inline when small, see [`HEAD_INLINE_BYTES`]) with the spans of the pieces in it, the
//! writer that fills that buffer, and [`HeaderFields`], the iterator over its header fields.

use super::parser::skip_leading_newlines;
use super::{BodyFraming, HttpError, Method};

/// Where a piece of a [`Request`] lies in its head buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Span {
    pub(super) start: u32,
    pub(super) len: u32,
}

/// A parsed request head: the head's bytes in one buffer, and where the pieces the server needs
/// lie in it. No piece is a separate allocation: values that must be derived (the lowercased
/// host, a list joined from several fields, a value with invalid UTF-8 made lossy) are appended
/// after the raw head in the same buffer. The buffer can be handed back for reuse with
/// [`Request::into_buf`] and supplied again to [`parse_with`](super::parse_with).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The method, classified.
    pub method: Method,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub version_minor: u8,
    /// Whether the connection may carry another request after this one.
    pub keep_alive: bool,
    /// The body's framing (always `None` from [`parse_with`](super::parse_with)).
    pub body: BodyFraming,
    /// The raw head (`head_len` bytes), then the derived values.
    pub(super) buf: HeadBuf,
    pub(super) head_len: u32,
    pub(super) method_raw: Span,
    pub(super) target: Span,
    pub(super) host: Option<Span>,
    pub(super) if_none_match: Option<Span>,
    pub(super) if_modified_since: Option<Span>,
    pub(super) if_range: Option<Span>,
    pub(super) range: Option<Span>,
}

impl Request {
    fn text(&self, s: Span) -> &str {
        let bytes = &self.buf.bytes()[s.start as usize..(s.start + s.len) as usize];
        // Every span is checked (or made) UTF-8 when the request is built.
        std::str::from_utf8(bytes).unwrap_or_default()
    }

    fn opt(&self, s: Option<Span>) -> Option<&str> {
        s.map(|s| self.text(s))
    }

    /// The method token as received.
    pub fn method_raw(&self) -> &str {
        self.text(self.method_raw)
    }

    /// The request target as received (not decoded; see [`crate::path::decode_target`]).
    pub fn target(&self) -> &str {
        self.text(self.target)
    }

    /// The host, lowercased, port and trailing dot stripped; `None` if absent or empty.
    pub fn host(&self) -> Option<&str> {
        self.opt(self.host)
    }

    /// `If-None-Match`, several fields joined with `", "`.
    pub fn if_none_match(&self) -> Option<&str> {
        self.opt(self.if_none_match)
    }

    /// `If-Modified-Since`; `None` when absent or sent more than once.
    pub fn if_modified_since(&self) -> Option<&str> {
        self.opt(self.if_modified_since)
    }

    /// `If-Range`; `None` when absent or sent more than once.
    pub fn if_range(&self) -> Option<&str> {
        self.opt(self.if_range)
    }

    /// `Range`, several fields joined with `", "` (which makes it a multi-range, ignored).
    pub fn range(&self) -> Option<&str> {
        self.opt(self.range)
    }

    /// The raw head as received (request line, header fields, blank line).
    pub fn head(&self) -> &[u8] {
        &self.buf.bytes()[..self.head_len as usize]
    }

    /// Every header field in order: `(name as received, value trimmed of whitespace)`.
    pub fn headers(&self) -> HeaderFields<'_> {
        let head = skip_leading_newlines(self.head());
        // Past the request line; the parser has proved the head well-formed.
        let rest = match head.iter().position(|&b| b == b'\n') {
            Some(i) => &head[i + 1..],
            None => &[],
        };
        HeaderFields { rest }
    }

    /// The value of the first header field named `name` (any case), if it is valid UTF-8.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.header_bytes(name)
            .and_then(|v| std::str::from_utf8(v).ok())
    }

    /// The value of the first header field named `name` (any case), as bytes.
    pub fn header_bytes(&self, name: &str) -> Option<&[u8]> {
        self.headers()
            .find(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v)
    }

    /// Gives back the request's buffer (to be supplied to [`parse_with`](super::parse_with)
    /// again); a head kept inline has none, and gives an empty `Vec` (which holds no allocation).
    pub fn into_buf(self) -> Vec<u8> {
        match self.buf {
            HeadBuf::Inline { .. } => Vec::new(),
            HeadBuf::Heap(v) => v,
        }
    }

    /// The error [`parse_with`](super::parse_with) gives this request for its body, if it has
    /// one: for a route that serves no bodies.
    pub fn body_refusal(&self) -> Option<HttpError> {
        match (self.body, self.method) {
            (BodyFraming::None, _) => None,
            (_, Method::Get | Method::Head) => Some(HttpError::BodyNotAllowed),
            (_, Method::Other) => Some(HttpError::NotImplemented),
        }
    }

    /// Whether the head is kept inside the request (see [`HEAD_INLINE_BYTES`]).
    pub fn is_inline(&self) -> bool {
        matches!(self.buf, HeadBuf::Inline { .. })
    }
}

/// A head (with its derived values) of at most this many bytes is kept inside the [`Request`]
/// itself: the request then travels through the stages' queues by value, in one piece, and
/// holds no buffer while it waits (typical client and load-generator heads are 60-200 bytes).
/// A larger one goes into a buffer from the caller (see [`parse_with`](super::parse_with)).
pub const HEAD_INLINE_BYTES: usize = 256;

/// Where a request's bytes live.
// Inline on purpose: a small head travels in one piece, without a heap allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum HeadBuf {
    Inline {
        bytes: [u8; HEAD_INLINE_BYTES],
        len: u16,
    },
    Heap(Vec<u8>),
}

impl HeadBuf {
    fn bytes(&self) -> &[u8] {
        match self {
            HeadBuf::Inline { bytes, len } => &bytes[..*len as usize],
            HeadBuf::Heap(v) => v,
        }
    }
}

/// Writes a request's bytes inline until they no longer fit, then into the caller's buffer.
pub(super) struct HeadWriter<F: FnOnce() -> Vec<u8>> {
    inline: [u8; HEAD_INLINE_BYTES],
    len: usize,
    heap: Option<Vec<u8>>,
    take_buf: Option<F>,
}

impl<F: FnOnce() -> Vec<u8>> HeadWriter<F> {
    pub(super) fn new(take_buf: F) -> Self {
        HeadWriter {
            inline: [0; HEAD_INLINE_BYTES],
            len: 0,
            heap: None,
            take_buf: Some(take_buf),
        }
    }

    pub(super) fn len(&self) -> usize {
        match &self.heap {
            Some(v) => v.len(),
            None => self.len,
        }
    }

    pub(super) fn extend(&mut self, part: &[u8]) {
        if self.heap.is_none() {
            if self.len + part.len() <= HEAD_INLINE_BYTES {
                self.inline[self.len..self.len + part.len()].copy_from_slice(part);
                self.len += part.len();
                return;
            }
            let mut v = self.take_buf.take().map(|f| f()).unwrap_or_default();
            v.clear();
            v.extend_from_slice(&self.inline[..self.len]);
            self.heap = Some(v);
        }
        if let Some(v) = &mut self.heap {
            v.extend_from_slice(part);
        }
    }

    pub(super) fn finish(self) -> HeadBuf {
        match self.heap {
            Some(v) => HeadBuf::Heap(v),
            None => HeadBuf::Inline {
                bytes: self.inline,
                len: self.len as u16,
            },
        }
    }
}

/// The header fields of a [`Request`], in order, read from its raw head (see
/// [`Request::headers`]); at most as many as the parser accepted.
#[derive(Debug, Clone)]
pub struct HeaderFields<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for HeaderFields<'a> {
    type Item = (&'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        let end = self.rest.iter().position(|&b| b == b'\n')?;
        let line = &self.rest[..end];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        self.rest = &self.rest[end + 1..];
        if line.is_empty() {
            self.rest = &[];
            return None;
        }
        let colon = line.iter().position(|&b| b == b':')?;
        Some((&line[..colon], line[colon + 1..].trim_ascii()))
    }
}
