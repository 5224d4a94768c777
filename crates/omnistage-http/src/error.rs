//! The error type shared by every module of this crate: what went wrong with a request,
//! which status answers it, and whether the connection may carry another request after it.
//!
//! Two families:
//!
//! - **framing errors** come from [`crate::request::parse`]: the byte stream itself is bad or too
//!   large, so the position of the next request is unknown. [`HttpError::closes_connection`] is
//!   true for them: answer, then close.
//! - **request errors** come from [`crate::path`], [`crate::synthetic`] and the like: the request
//!   was framed correctly, only its meaning is refused. The connection may be kept alive.

use std::fmt;

/// Why a request is refused, with the status that answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HttpError {
    /// 400, framing: the request line or a header is malformed (detail says which).
    BadRequest(&'static str),
    /// 400, framing: `Content-Length`/`Transfer-Encoding` are contradictory, duplicated or invalid.
    /// A request-smuggling attempt looks like this; the connection must close.
    BadFraming(&'static str),
    /// 400, framing: a GET or HEAD carries a body (`Content-Length` other than 0, or any
    /// `Transfer-Encoding`). We never read request bodies, so we cannot skip it; close.
    BodyNotAllowed,
    /// 431, framing: the header section is longer than `Limits::header_bytes_max`.
    HeaderTooLarge,
    /// 431, framing: more header fields than `Limits::headers_max`.
    TooManyHeaders,
    /// 414, framing: the request target is longer than `Limits::uri_bytes_max`.
    UriTooLong,
    /// 505, framing: an HTTP version other than 1.0 and 1.1.
    VersionNotSupported,
    /// 501, framing: a method other than GET/HEAD that carries a body, or a method token longer
    /// than `request::METHOD_BYTES_MAX`. (A body-less unknown method parses as `Method::Other`;
    /// the caller answers 501 itself and may keep the connection.)
    NotImplemented,
    /// 413, framing: a request body (on a proxied route) longer than `body_bytes_max`; its bytes
    /// are not read, so the connection closes.
    PayloadTooLarge,
    /// 400, request: the target cannot be decoded (bad percent escape, NUL, invalid UTF-8,
    /// a form other than origin-form or `http://` absolute-form).
    BadTarget(&'static str),
    /// 400, request: a query parameter of a synthetic endpoint is missing or out of range.
    BadParameter(&'static str),
    /// 404, request: nothing to serve here, including every traversal attempt.
    NotFound,
    /// 301, request: a directory was named without its trailing slash; `location` is the
    /// percent-encoded path with the slash added (send it as `Location`).
    MovedPermanently {
        /// The value of the `Location` header.
        location: String,
    },
}

impl HttpError {
    /// The status code that answers this error.
    pub fn status(&self) -> u16 {
        match self {
            HttpError::BadRequest(_)
            | HttpError::BadFraming(_)
            | HttpError::BodyNotAllowed
            | HttpError::BadTarget(_)
            | HttpError::BadParameter(_) => 400,
            HttpError::HeaderTooLarge | HttpError::TooManyHeaders => 431,
            HttpError::UriTooLong => 414,
            HttpError::VersionNotSupported => 505,
            HttpError::NotImplemented => 501,
            HttpError::PayloadTooLarge => 413,
            HttpError::NotFound => 404,
            HttpError::MovedPermanently { .. } => 301,
        }
    }

    /// The reason phrase for [`HttpError::status`].
    pub fn reason(&self) -> &'static str {
        crate::response::status_reason(self.status())
    }

    /// True when the connection must be closed after the error response: the request stream
    /// can no longer be trusted to be in step (every error of [`crate::request::parse`]).
    pub fn closes_connection(&self) -> bool {
        match self {
            HttpError::BadRequest(_)
            | HttpError::BadFraming(_)
            | HttpError::BodyNotAllowed
            | HttpError::HeaderTooLarge
            | HttpError::TooManyHeaders
            | HttpError::UriTooLong
            | HttpError::VersionNotSupported
            | HttpError::NotImplemented
            | HttpError::PayloadTooLarge => true,
            HttpError::BadTarget(_)
            | HttpError::BadParameter(_)
            | HttpError::NotFound
            | HttpError::MovedPermanently { .. } => false,
        }
    }

    /// The `Location` header value for a redirect, if this is one.
    pub fn location(&self) -> Option<&str> {
        match self {
            HttpError::MovedPermanently { location } => Some(location),
            _ => None,
        }
    }
}

impl fmt::Display for HttpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.status(), self.reason())?;
        match self {
            HttpError::BadRequest(d)
            | HttpError::BadFraming(d)
            | HttpError::BadTarget(d)
            | HttpError::BadParameter(d) => write!(f, ": {d}"),
            HttpError::MovedPermanently { location } => write!(f, ": {location}"),
            _ => Ok(()),
        }
    }
}

impl std::error::Error for HttpError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_reasons_and_closing() {
        let cases: [(HttpError, u16, bool); 13] = [
            (HttpError::PayloadTooLarge, 413, true),
            (HttpError::BadRequest("x"), 400, true),
            (HttpError::BadFraming("x"), 400, true),
            (HttpError::BodyNotAllowed, 400, true),
            (HttpError::HeaderTooLarge, 431, true),
            (HttpError::TooManyHeaders, 431, true),
            (HttpError::UriTooLong, 414, true),
            (HttpError::VersionNotSupported, 505, true),
            (HttpError::NotImplemented, 501, true),
            (HttpError::BadTarget("x"), 400, false),
            (HttpError::BadParameter("x"), 400, false),
            (HttpError::NotFound, 404, false),
            (
                HttpError::MovedPermanently {
                    location: "/d/".into(),
                },
                301,
                false,
            ),
        ];
        for (e, status, closes) in cases {
            assert_eq!(e.status(), status, "{e:?}");
            assert_eq!(e.closes_connection(), closes, "{e:?}");
            assert_ne!(e.reason(), "Unknown", "{e:?}");
        }
        assert_eq!(HttpError::NotFound.to_string(), "404 Not Found");
        assert_eq!(
            HttpError::BadTarget("NUL").to_string(),
            "400 Bad Request: NUL"
        );
        let redirect = HttpError::MovedPermanently {
            location: "/d/".into(),
        };
        assert_eq!(redirect.location(), Some("/d/"));
        assert_eq!(HttpError::NotFound.location(), None);
    }
}
