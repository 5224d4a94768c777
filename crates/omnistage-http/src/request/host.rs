//! The host a request names: checking a `Host` value (or an absolute-form target's authority)
//! and stripping its port and trailing dot.

use super::{HttpError, HOST_BYTES_MAX};
use crate::ascii::strip_prefix_ignore_ascii_case;

/// The authority of an `http://` absolute-form target, if the target has that form.
pub(super) fn absolute_form_authority(target: &str) -> Option<&str> {
    let rest = strip_prefix_ignore_ascii_case(target, "http://")?;
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    Some(&rest[..end])
}

/// Checks a `Host` value and strips its port and one trailing dot (the caller lowercases it).
/// Empty → `None`.
pub(super) fn normalize_host(raw: &str) -> Result<Option<&str>, HttpError> {
    let raw = raw.trim();
    if raw.is_empty() {
        return Ok(None);
    }
    let (name, port) = if raw.starts_with('[') {
        let close = raw
            .find(']')
            .ok_or(HttpError::BadRequest("unterminated IPv6 literal in host"))?;
        let inner = &raw[1..close];
        if inner.is_empty()
            || !inner
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
        {
            return Err(HttpError::BadRequest("invalid IPv6 literal in host"));
        }
        (&raw[..=close], &raw[close + 1..])
    } else {
        match raw.find(':') {
            Some(i) => (&raw[..i], &raw[i..]),
            None => (raw, ""),
        }
    };
    if !port.is_empty() {
        let digits = port
            .strip_prefix(':')
            .ok_or(HttpError::BadRequest("invalid host"))?;
        if digits.len() > 5 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(HttpError::BadRequest("invalid port in host"));
        }
    }
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.is_empty() || name.len() > HOST_BYTES_MAX {
        return Err(HttpError::BadRequest("invalid host"));
    }
    if !name.starts_with('[') && !name.bytes().all(is_reg_name_byte) {
        return Err(HttpError::BadRequest("invalid character in host"));
    }
    Ok(Some(name))
}

/// RFC 3986 reg-name: unreserved, pct-encoded and sub-delims.
fn is_reg_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric()
        || matches!(
            b,
            b'-' | b'.'
                | b'_'
                | b'~'
                | b'%'
                | b'!'
                | b'$'
                | b'&'
                | b'\''
                | b'('
                | b')'
                | b'*'
                | b'+'
                | b','
                | b';'
                | b'='
        )
}
