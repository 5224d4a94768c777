//! Validators and conditional requests (RFC 9110 §8.8, §13) and byte ranges (§14):
//! the `ETag` and `Last-Modified` of a file, whether a request is answered 304, and which bytes a
//! `Range` (guarded by `If-Range`) asks for.
//!
//! - [`etag`] is a strong tag `"<len hex>-<mtime secs hex>-<mtime nanos hex>"`: it changes when
//!   the file's length or modification time changes, to the nanosecond the filesystem keeps.
//! - [`not_modified`]: `If-None-Match` takes precedence and is compared weakly (`W/` ignored), with
//!   `*` and lists; only without it is `If-Modified-Since` used, at one-second granularity. A
//!   malformed header never yields 304.
//! - [`range`] honours one range: `bytes=a-b`, `bytes=a-`, `bytes=-n`. Several ranges are ignored
//!   (200 with the whole body; we do not send multipart), and so is anything malformed or with
//!   another unit, as RFC 9110 allows. A range starting at or past the end, or `bytes=-0`, is
//!   unsatisfiable (416 with `Content-Range: bytes */len`).
//! - [`range_for`] applies `If-Range` first: a range is honoured only if `If-Range` is absent or
//!   matches the current ETag (strongly) or Last-Modified (exactly).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::ascii::strip_prefix_ignore_ascii_case;
use crate::request::Request;

/// Longest `Range` header looked at; longer ones are ignored (whole body).
pub const RANGE_HEADER_BYTES_MAX: usize = 256;

/// The strong ETag (with its quotes) of a file with this length and modification time.
pub fn etag(len: u64, modified: SystemTime) -> String {
    let since = since_epoch(modified);
    format!(
        "\"{:x}-{:x}-{:x}\"",
        len,
        since.as_secs(),
        since.subsec_nanos()
    )
}

/// The `Last-Modified` value (IMF-fixdate) for a modification time.
pub fn last_modified(modified: SystemTime) -> String {
    httpdate::fmt_http_date(UNIX_EPOCH + Duration::from_secs(since_epoch(modified).as_secs()))
}

fn since_epoch(t: SystemTime) -> Duration {
    t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO)
}

/// True when the request's preconditions say the client's copy is current: answer 304.
pub fn not_modified(req: &Request, etag: &str, modified: SystemTime) -> bool {
    if let Some(inm) = req.if_none_match() {
        return if_none_match_matches(inm, etag);
    }
    if let Some(ims) = req.if_modified_since() {
        let Ok(since) = httpdate::parse_http_date(ims) else {
            return false;
        };
        return since_epoch(modified).as_secs() <= since_epoch(since).as_secs();
    }
    false
}

/// Weak comparison of `etag` against an `If-None-Match` list; `*` matches any.
fn if_none_match_matches(list: &str, etag: &str) -> bool {
    let Some(ours) = opaque(etag) else {
        return false;
    };
    let mut found = false;
    for_each_tag(list, |tag| {
        found = match tag {
            Tag::Any => true,
            Tag::Entity(theirs) => theirs == ours,
        };
        !found
    });
    found
}

enum Tag<'a> {
    Any,
    /// The opaque part, without `W/` and quotes.
    Entity(&'a str),
}

/// Calls `f` for each member of a comma-separated entity-tag list until it returns false.
/// Stops at the first malformed member (members before it were still visited).
fn for_each_tag<'a>(list: &'a str, mut f: impl FnMut(Tag<'a>) -> bool) {
    let mut rest = list;
    loop {
        rest = rest.trim_start_matches([' ', '\t', ',']);
        if rest.is_empty() {
            return;
        }
        if let Some(after) = rest.strip_prefix('*') {
            if !f(Tag::Any) {
                return;
            }
            rest = after;
            continue;
        }
        let tagged = rest.strip_prefix("W/").unwrap_or(rest);
        let Some(body) = tagged.strip_prefix('"') else {
            return;
        };
        let Some(close) = body.find('"') else {
            return;
        };
        if !f(Tag::Entity(&body[..close])) {
            return;
        }
        rest = &body[close + 1..];
        if !(rest.is_empty() || rest.starts_with([',', ' ', '\t'])) {
            return;
        }
    }
}

/// The opaque part of one entity tag (`W/` and quotes removed); `None` if malformed.
fn opaque(tag: &str) -> Option<&str> {
    let tag = tag.strip_prefix("W/").unwrap_or(tag);
    let inner = tag.strip_prefix('"')?.strip_suffix('"')?;
    (!inner.contains('"')).then_some(inner)
}

/// Which bytes to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeOutcome {
    /// The whole body (200).
    Full,
    /// Bytes `start..=end_inclusive` (206).
    Partial {
        /// First byte.
        start: u64,
        /// Last byte, inclusive.
        end_inclusive: u64,
    },
    /// 416, with `Content-Range: bytes */len`.
    Unsatisfiable,
}

/// Interprets a `Range` header for a body of `len` bytes; see the module doc.
pub fn range(header: Option<&str>, len: u64) -> RangeOutcome {
    let Some(header) = header else {
        return RangeOutcome::Full;
    };
    if header.len() > RANGE_HEADER_BYTES_MAX {
        return RangeOutcome::Full;
    }
    let header = header.trim();
    let Some(spec) = strip_prefix_ignore_ascii_case(header, "bytes=") else {
        return RangeOutcome::Full;
    };
    let spec = spec.trim();
    if spec.contains(',') {
        return RangeOutcome::Full;
    }
    let Some((first, last)) = spec.split_once('-') else {
        return RangeOutcome::Full;
    };
    let (first, last) = (first.trim(), last.trim());
    match (parse_digits(first), parse_digits(last)) {
        // bytes=-n: the last n bytes.
        (None, Some(n)) if first.is_empty() => {
            if n == 0 || len == 0 {
                RangeOutcome::Unsatisfiable
            } else {
                RangeOutcome::Partial {
                    start: len.saturating_sub(n),
                    end_inclusive: len - 1,
                }
            }
        }
        // bytes=a-
        (Some(a), None) if last.is_empty() => {
            if a >= len {
                RangeOutcome::Unsatisfiable
            } else {
                RangeOutcome::Partial {
                    start: a,
                    end_inclusive: len - 1,
                }
            }
        }
        // bytes=a-b
        (Some(a), Some(b)) => {
            if b < a {
                RangeOutcome::Full
            } else if a >= len {
                RangeOutcome::Unsatisfiable
            } else {
                RangeOutcome::Partial {
                    start: a,
                    end_inclusive: b.min(len - 1),
                }
            }
        }
        _ => RangeOutcome::Full,
    }
}

/// Decimal digits only; values beyond u64 saturate (a huge end clamps, a huge start is past
/// the end). Empty or non-digit → None.
fn parse_digits(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(s.bytes().fold(0u64, |acc, b| {
        acc.saturating_mul(10).saturating_add(u64::from(b - b'0'))
    }))
}

/// [`range`] of the request's `Range`, honoured only if `If-Range` is absent or still matches
/// (`etag` strongly, or `modified` to the second).
pub fn range_for(req: &Request, etag: &str, modified: SystemTime, len: u64) -> RangeOutcome {
    if req.range().is_none() {
        return RangeOutcome::Full;
    }
    if let Some(if_range) = req.if_range() {
        if !if_range_matches(if_range.trim(), etag, modified) {
            return RangeOutcome::Full;
        }
    }
    range(req.range(), len)
}

fn if_range_matches(if_range: &str, etag: &str, modified: SystemTime) -> bool {
    if if_range.starts_with('"') || if_range.starts_with("W/") {
        // Strong comparison: neither may be weak, and they must be identical.
        return !if_range.starts_with("W/") && !etag.starts_with("W/") && if_range == etag;
    }
    match httpdate::parse_http_date(if_range) {
        Ok(date) => since_epoch(date).as_secs() == since_epoch(modified).as_secs(),
        Err(_) => false,
    }
}

/// The `Content-Range` value for a 206 or 416, `None` for a full body.
pub fn content_range(outcome: &RangeOutcome, len: u64) -> Option<String> {
    match outcome {
        RangeOutcome::Full => None,
        RangeOutcome::Partial {
            start,
            end_inclusive,
        } => Some(format!("bytes {start}-{end_inclusive}/{len}")),
        RangeOutcome::Unsatisfiable => Some(format!("bytes */{len}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{parse, Limits, ParseOutcome, Request};

    /// A GET of `/` with the given header fields, as parsed from bytes.
    fn req_with(fields: &[(&str, &str)]) -> Request {
        let mut head = String::from("GET / HTTP/1.1\r\nHost: a\r\n");
        for (name, value) in fields {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        match parse(head.as_bytes(), &Limits::default()) {
            ParseOutcome::Complete { request, .. } => request,
            other => panic!("{head:?} gave {other:?}"),
        }
    }

    fn req() -> Request {
        req_with(&[])
    }

    fn t(secs: u64, nanos: u32) -> SystemTime {
        UNIX_EPOCH + Duration::new(secs, nanos)
    }

    #[test]
    fn validators() {
        assert_eq!(etag(255, t(0x10, 0x20)), "\"ff-10-20\"");
        assert_ne!(etag(1, t(5, 1)), etag(1, t(5, 2)));
        assert_ne!(etag(1, t(5, 0)), etag(2, t(5, 0)));
        assert_eq!(etag(0, UNIX_EPOCH - Duration::from_secs(1)), "\"0-0-0\"");
        assert_eq!(
            last_modified(t(784_111_777, 999_999_999)),
            "Sun, 06 Nov 1994 08:49:37 GMT"
        );
    }

    #[test]
    fn if_none_match() {
        let m = t(1000, 5);
        let tag = etag(10, m);
        let check = |inm: &str| {
            let r = req_with(&[("If-None-Match", inm)]);
            not_modified(&r, &tag, m)
        };
        assert!(check(&tag));
        assert!(check("*"));
        assert!(check(&format!("W/{tag}")));
        assert!(check(&format!("\"x\", {tag}")));
        assert!(check(&format!("\"x\",{tag} , \"y\"")));
        assert!(check(&format!("\"a,b\", {tag}")));
        assert!(!check("\"x\""));
        assert!(!check("\"x\", \"y\""));
        assert!(!check(""));
        assert!(!check("garbage"));
        assert!(!check(&tag[1..]));
        assert!(!check(&format!("\"x\"junk, {tag}")));
        // If-None-Match wins over If-Modified-Since, even when the date alone would say 304.
        let r = req_with(&[
            ("If-None-Match", "\"other\""),
            ("If-Modified-Since", &last_modified(m)),
        ]);
        assert!(!not_modified(&r, &tag, m));
    }

    #[test]
    fn if_modified_since() {
        let m = t(784_111_777, 500_000_000);
        let tag = etag(10, m);
        let check = |ims: &str| {
            let r = req_with(&[("If-Modified-Since", ims)]);
            not_modified(&r, &tag, m)
        };
        // Same second (sub-second part ignored), later: not modified.
        assert!(check("Sun, 06 Nov 1994 08:49:37 GMT"));
        assert!(check("Sun, 06 Nov 1994 08:49:38 GMT"));
        assert!(check("Sunday, 06-Nov-94 08:49:37 GMT"));
        assert!(check("Sun Nov  6 08:49:37 1994"));
        // Earlier, or malformed: send it.
        assert!(!check("Sun, 06 Nov 1994 08:49:36 GMT"));
        assert!(!check("yesterday"));
        assert!(!not_modified(&req(), &tag, m));
    }

    /// Once panicked (a `str` sliced inside 'ÿ' at byte 6), found by a mutation fuzzer.
    #[test]
    fn a_range_with_a_multibyte_char_at_the_unit_is_ignored_not_a_panic() {
        for h in [
            "bytes\u{ff}0-2",
            "byte\u{e9}=0-2",
            "\u{1f600}\u{1f600}",
            "bytes=\u{ff}-1",
        ] {
            assert_eq!(range(Some(h), 10), RangeOutcome::Full, "{h:?}");
        }
    }

    #[test]
    fn ranges() {
        use RangeOutcome::*;
        let r = |h: &str, len: u64| range(Some(h), len);
        assert_eq!(range(None, 10), Full);
        assert_eq!(
            r("bytes=0-4", 10),
            Partial {
                start: 0,
                end_inclusive: 4
            }
        );
        assert_eq!(
            r("bytes=5-", 10),
            Partial {
                start: 5,
                end_inclusive: 9
            }
        );
        assert_eq!(
            r("bytes=-3", 10),
            Partial {
                start: 7,
                end_inclusive: 9
            }
        );
        assert_eq!(
            r("bytes=-30", 10),
            Partial {
                start: 0,
                end_inclusive: 9
            }
        );
        assert_eq!(
            r("bytes=8-100", 10),
            Partial {
                start: 8,
                end_inclusive: 9
            }
        );
        assert_eq!(
            r("bytes=9-9", 10),
            Partial {
                start: 9,
                end_inclusive: 9
            }
        );
        assert_eq!(
            r("Bytes=0-0", 10),
            Partial {
                start: 0,
                end_inclusive: 0
            }
        );
        assert_eq!(
            r(" bytes= 2 - 3 ", 10),
            Partial {
                start: 2,
                end_inclusive: 3
            }
        );
        assert_eq!(
            r("bytes=0-99999999999999999999999", 10),
            Partial {
                start: 0,
                end_inclusive: 9
            }
        );
        // Unsatisfiable.
        assert_eq!(r("bytes=10-", 10), Unsatisfiable);
        assert_eq!(r("bytes=10-20", 10), Unsatisfiable);
        assert_eq!(r("bytes=-0", 10), Unsatisfiable);
        assert_eq!(r("bytes=0-", 0), Unsatisfiable);
        assert_eq!(r("bytes=-5", 0), Unsatisfiable);
        assert_eq!(r("bytes=99999999999999999999999-", 10), Unsatisfiable);
        // Ignored: several ranges, malformed, other units.
        for h in [
            "bytes=0-1,3-4",
            "bytes=0-1, 5-",
            "bytes=5-2",
            "bytes=",
            "bytes=-",
            "bytes=a-b",
            "bytes=1",
            "bytes=--1",
            "bytes=1-2-3",
            "items=0-1",
            "0-1",
            "bytes 0-1",
            "bytes=+1-2",
        ] {
            assert_eq!(r(h, 10), Full, "{h}");
        }
        let long = format!("bytes=0-{}", "1".repeat(RANGE_HEADER_BYTES_MAX));
        assert_eq!(r(&long, 10), Full);
    }

    #[test]
    fn if_range() {
        use RangeOutcome::*;
        let m = t(784_111_777, 0);
        let tag = etag(10, m);
        let with = |if_range: Option<&str>| {
            let r = match if_range {
                Some(v) => req_with(&[("Range", "bytes=0-1"), ("If-Range", v)]),
                None => req_with(&[("Range", "bytes=0-1")]),
            };
            range_for(&r, &tag, m, 10)
        };
        let partial = Partial {
            start: 0,
            end_inclusive: 1,
        };
        assert_eq!(with(None), partial);
        assert_eq!(with(Some(&tag)), partial);
        assert_eq!(with(Some("Sun, 06 Nov 1994 08:49:37 GMT")), partial);
        assert_eq!(with(Some("\"stale\"")), Full);
        assert_eq!(with(Some(&format!("W/{tag}"))), Full);
        assert_eq!(with(Some("Sun, 06 Nov 1994 08:49:36 GMT")), Full);
        assert_eq!(with(Some("nonsense")), Full);
        assert_eq!(range_for(&req(), &tag, m, 10), Full);
    }

    #[test]
    fn content_ranges() {
        assert_eq!(content_range(&RangeOutcome::Full, 10), None);
        assert_eq!(
            content_range(
                &RangeOutcome::Partial {
                    start: 2,
                    end_inclusive: 5
                },
                10
            )
            .as_deref(),
            Some("bytes 2-5/10")
        );
        assert_eq!(
            content_range(&RangeOutcome::Unsatisfiable, 10).as_deref(),
            Some("bytes */10")
        );
    }
}
