//! HTTP/1.x request heads: turning the bytes received on a connection into a [`Request`], or
//! saying that more bytes are needed, or refusing them with an [`HttpError`].
//!
//! [`parse`] is pure and never blocks; call it again with the whole buffered prefix each time
//! more bytes arrive. A [`Request`] is one buffer holding the raw head (plus the few values that
//! must be derived: the lowercased host, lists joined from several fields) and offsets into it,
//! so [`parse_with`], given a recycled buffer, parses without allocating. On `Complete`, `consumed`
//! bytes belong to this request (the head; GET and HEAD have no body here) and the rest of the
//! buffer is the next pipelined request.
//!
//! Rules, each tested by feeding bytes:
//!
//! - The target longer than `uri_bytes_max` → 414, detected as soon as the bytes seen prove it,
//!   even while the request is still partial.
//! - The head (request line and header fields up to the blank line) longer than
//!   `header_bytes_max` → 431, also on a partial buffer; more than `headers_max` fields → 431.
//! - A version other than HTTP/1.0 or HTTP/1.1 (`HTTP/2.0`, `HTTP/1.2`) → 505; anything else
//!   malformed → 400.
//! - `Content-Length` together with `Transfer-Encoding`, more than one `Content-Length` field
//!   (even with equal values), a list value or a non-numeric value → 400 (`BadFraming`).
//! - GET and HEAD may carry no body: only `Content-Length: 0` is accepted; any other length and
//!   any `Transfer-Encoding` → 400 (`BodyNotAllowed`). We never read bodies, so we cannot step
//!   over one.
//! - Methods are case-sensitive: only `GET` and `HEAD` are served. Another method **without a
//!   body** parses to [`Method::Other`] and the caller answers 501 (with `Allow: GET, HEAD`) and
//!   may keep the connection. Another method **with a body**, or a method token longer than
//!   [`METHOD_BYTES_MAX`], is `HttpError::NotImplemented` (501, close).
//! - HTTP/1.1 requires exactly one `Host`; HTTP/1.0 allows none; two `Host` fields → 400.
//!   `host` is lowercased, its port and one trailing dot stripped. For an absolute-form target
//!   (`GET http://a.example/x`), the target's authority replaces the `Host` field (RFC 9112 §3.2.2).
//! - `keep_alive`: HTTP/1.1 defaults to true unless a `Connection` field lists `close`;
//!   HTTP/1.0 defaults to false unless it lists `keep-alive` (and not `close`).
//!
//! Every error returned by [`parse`] is a framing error: answer it and close the connection
//! ([`HttpError::closes_connection`] is true for all of them).
//!
//! This file owns the public surface: the limits, [`Method`], [`BodyFraming`], [`ParseOutcome`]
//! and the entry points. The parser itself is in `parser.rs`, the parsed [`Request`] and its
//! buffer in `parsed.rs`, the `Host` checks in `host.rs`, the tests in `tests.rs`.

mod host;
mod parsed;
mod parser;
#[cfg(test)]
mod tests;

pub use crate::error::HttpError;
pub use parsed::{HeaderFields, Request, HEAD_INLINE_BYTES};
use parser::parse_inner;

/// Longest method token accepted; a longer one is answered 501 without waiting for the rest.
pub const METHOD_BYTES_MAX: usize = 32;
/// Longest host name (without port) accepted in `Host` or an absolute-form target.
pub const HOST_BYTES_MAX: usize = 255;
/// Upper bound on `Limits::headers_max`: the header slots live on the stack.
pub const HEADERS_CAP: usize = 256;

/// Default for [`Limits::header_bytes_max`]: 16 KiB.
pub const HEADER_BYTES_MAX_DEFAULT: usize = 16 * 1024;
/// Default for [`Limits::uri_bytes_max`]: 8 KiB.
pub const URI_BYTES_MAX_DEFAULT: usize = 8 * 1024;
/// Default for [`Limits::headers_max`].
pub const HEADERS_MAX_DEFAULT: usize = 64;

/// Size limits applied while parsing a request head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest head (request line, header fields and the blank line), in bytes → 431.
    pub header_bytes_max: usize,
    /// Longest request target, in bytes → 414.
    pub uri_bytes_max: usize,
    /// Most header fields → 431. Values above [`HEADERS_CAP`] are treated as [`HEADERS_CAP`].
    pub headers_max: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_bytes_max: HEADER_BYTES_MAX_DEFAULT,
            uri_bytes_max: URI_BYTES_MAX_DEFAULT,
            headers_max: HEADERS_MAX_DEFAULT,
        }
    }
}

/// The request method, as far as this server cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// `GET`
    Get,
    /// `HEAD`
    Head,
    /// Anything else (the raw token is in `Request::method_raw`); answer 501.
    Other,
}

/// How a request's body is framed (RFC 9112 §6). [`parse_with`] refuses every body; only
/// [`parse_with_body`] (for the proxy) returns requests with one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFraming {
    /// No body (no `Content-Length`, or `Content-Length: 0`, and no `Transfer-Encoding`).
    None,
    /// `Content-Length` bytes follow the head.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// A `Transfer-Encoding` other than exactly one `chunked`: a body nobody here can frame
    /// (the proxy answers 501 and closes).
    UnknownCoding,
}

/// Longest head accepted whatever `Limits::header_bytes_max` says (spans are 32-bit, and the
/// derived values may add up to about four times the head).
pub const HEAD_BYTES_CAP: usize = 64 * 1024 * 1024;

/// What [`parse`] made of the buffered bytes.
// The request is returned by value (no `Box` per request).
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseOutcome {
    /// A whole head; `consumed` bytes of the buffer belong to it.
    Complete {
        /// The request.
        request: Request,
        /// Bytes of the buffer taken by this request.
        consumed: usize,
    },
    /// The head is not complete yet and nothing proves it bad: read more.
    Partial,
    /// The bytes are refused; answer `status()` and close.
    Error(HttpError),
}

/// Parses the request head at the start of `buf` (the request gets a new buffer).
pub fn parse(buf: &[u8], limits: &Limits) -> ParseOutcome {
    parse_with(buf, limits, Vec::new)
}

/// Parses the request head at the start of `buf`. A complete request's bytes are copied into
/// the request itself when they fit in [`HEAD_INLINE_BYTES`], else into the buffer `take_buf`
/// gives (called only then, for a complete, valid head; cleared first), so a caller that
/// recycles buffers parses without allocating.
pub fn parse_with(buf: &[u8], limits: &Limits, take_buf: impl FnOnce() -> Vec<u8>) -> ParseOutcome {
    match parse_inner(buf, limits, take_buf, false) {
        Ok(Some((request, consumed))) => ParseOutcome::Complete { request, consumed },
        Ok(None) => ParseOutcome::Partial,
        Err(e) => ParseOutcome::Error(e),
    }
}

/// As [`parse_with`], but a request may carry a body (any method): its framing is in
/// [`Request::body`] and its bytes follow `consumed`. The framing rules stay: CL with TE, two
/// CLs, an invalid CL → 400. The caller refuses a body where it serves none
/// ([`Request::body_refusal`]) and a coding it cannot frame ([`BodyFraming::UnknownCoding`]).
pub fn parse_with_body(
    buf: &[u8],
    limits: &Limits,
    take_buf: impl FnOnce() -> Vec<u8>,
) -> ParseOutcome {
    match parse_inner(buf, limits, take_buf, true) {
        Ok(Some((request, consumed))) => ParseOutcome::Complete { request, consumed },
        Ok(None) => ParseOutcome::Partial,
        Err(e) => ParseOutcome::Error(e),
    }
}
