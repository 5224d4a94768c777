//! Access log lines: Common Log Format with the activity path appended, one line per response,
//! written into a caller-owned buffer (the glue batches and writes them):
//!
//! ```text
//! 127.0.0.1 - - [21/Nov/2026:23:00:00 +0000] "GET /x HTTP/1.1" 200 1024 /tenants/a
//! ```
//!
//! Times are UTC. `bytes` is the body bytes sent, written as a number even when 0 (like
//! Apache's `%B`). In the method, target and activity, `"` and `\` are escaped with a backslash
//! and control characters, non-ASCII bytes (and, in the activity, spaces) are written `\xHH`, so
//! one line is always one record. A target longer than [`LOG_TARGET_BYTES_MAX`] is cut and ends
//! with `...`. An empty method or target (a request that never parsed) is written as `-`.

use std::io::Write;
use std::net::IpAddr;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::response::push_u64;

/// Longest target written before cutting.
pub const LOG_TARGET_BYTES_MAX: usize = 2048;
/// Longest method or activity written before cutting.
pub const LOG_FIELD_BYTES_MAX: usize = 256;

const MONTHS: [&str; 12] = [
    "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
];

/// Appends one access log line, ending in `\n`, to `out`.
#[allow(clippy::too_many_arguments)]
pub fn clf_line(
    out: &mut Vec<u8>,
    peer: IpAddr,
    time: SystemTime,
    method: &str,
    target: &str,
    version_minor: u8,
    status: u16,
    bytes: u64,
    activity: &str,
) {
    // Formatted straight into the buffer: no `String` per line.
    let _ = write!(out, "{peer}");
    out.extend_from_slice(b" - - [");
    push_clf_time(out, time);
    out.extend_from_slice(b"] \"");
    push_escaped(out, method, LOG_FIELD_BYTES_MAX, false);
    out.push(b' ');
    push_escaped(out, target, LOG_TARGET_BYTES_MAX, false);
    out.extend_from_slice(b" HTTP/1.");
    push_u64(out, u64::from(version_minor));
    out.extend_from_slice(b"\" ");
    push_u64(out, u64::from(status));
    out.push(b' ');
    push_u64(out, bytes);
    out.push(b' ');
    push_escaped(out, activity, LOG_FIELD_BYTES_MAX, true);
    out.push(b'\n');
}

fn push_escaped(out: &mut Vec<u8>, field: &str, max: usize, escape_space: bool) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    if field.is_empty() {
        out.push(b'-');
        return;
    }
    let bytes = field.as_bytes();
    let cut = bytes.len() > max;
    for &b in &bytes[..bytes.len().min(max)] {
        match b {
            b'"' | b'\\' => {
                out.push(b'\\');
                out.push(b);
            }
            b' ' if escape_space => out.extend_from_slice(b"\\x20"),
            0x21..=0x7e | b' ' => out.push(b),
            _ => {
                out.extend_from_slice(b"\\x");
                out.push(HEX[usize::from(b >> 4)]);
                out.push(HEX[usize::from(b & 0xf)]);
            }
        }
    }
    if cut {
        out.extend_from_slice(b"...");
    }
}

/// `21/Nov/2026:23:00:00 +0000`
fn push_clf_time(out: &mut Vec<u8>, time: SystemTime) {
    let secs = time
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = secs / 86_400;
    let rem = secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    push_2(out, day);
    out.push(b'/');
    out.extend_from_slice(MONTHS[(month - 1) as usize].as_bytes());
    out.push(b'/');
    push_u64(out, year);
    out.push(b':');
    push_2(out, rem / 3600);
    out.push(b':');
    push_2(out, rem % 3600 / 60);
    out.push(b':');
    push_2(out, rem % 60);
    out.extend_from_slice(b" +0000");
}

fn push_2(out: &mut Vec<u8>, n: u64) {
    out.push(b'0' + (n / 10 % 10) as u8);
    out.push(b'0' + (n % 10) as u8);
}

/// Days since 1970-01-01 → (year, month 1..=12, day 1..=31), proleptic Gregorian
/// (H. Hinnant's `civil_from_days`, for non-negative day counts).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};
    use std::time::Duration;

    fn line(method: &str, target: &str, activity: &str) -> String {
        let mut out = Vec::new();
        clf_line(
            &mut out,
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            UNIX_EPOCH + Duration::from_secs(1_795_302_000),
            method,
            target,
            1,
            200,
            1024,
            activity,
        );
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn example_line() {
        assert_eq!(
            line("GET", "/x", "/tenants/a"),
            "127.0.0.1 - - [21/Nov/2026:23:00:00 +0000] \"GET /x HTTP/1.1\" 200 1024 /tenants/a\n"
        );
        let mut out = Vec::new();
        clf_line(
            &mut out,
            IpAddr::V6(Ipv6Addr::LOCALHOST),
            UNIX_EPOCH,
            "",
            "",
            0,
            400,
            0,
            "/infra",
        );
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "::1 - - [01/Jan/1970:00:00:00 +0000] \"- - HTTP/1.0\" 400 0 /infra\n"
        );
    }

    #[test]
    fn escapes() {
        let l = line("GET", "/a\"b\\c\r\nd\x01é", "/tenants/a b");
        assert!(
            l.contains("\"GET /a\\\"b\\\\c\\x0d\\x0ad\\x01\\xc3\\xa9 HTTP/1.1\""),
            "{l}"
        );
        assert!(l.ends_with(" /tenants/a\\x20b\n"), "{l}");
        assert_eq!(l.matches('\n').count(), 1);
        let long = line(
            "GET",
            &format!("/{}", "a".repeat(LOG_TARGET_BYTES_MAX + 10)),
            "/t",
        );
        assert!(long.contains(&format!(
            "/{}... HTTP",
            "a".repeat(LOG_TARGET_BYTES_MAX - 1)
        )));
    }

    #[test]
    fn dates_match_httpdate() {
        // Check the calendar against httpdate over leap years and century boundaries.
        for secs in [
            0u64,
            951_782_400,
            951_868_800,
            1_709_164_800,
            4_107_456_000,
            4_102_444_799,
            253_402_300_799,
            1_795_302_000,
            68_169_600,
        ] {
            let t = UNIX_EPOCH + Duration::from_secs(secs);
            let mut out = Vec::new();
            push_clf_time(&mut out, t);
            let clf = String::from_utf8(out).unwrap();
            // "Sun, 06 Nov 1994 08:49:37 GMT" → "06/Nov/1994:08:49:37 +0000"
            let http = httpdate::fmt_http_date(t);
            let p: Vec<&str> = http.split(' ').collect();
            assert_eq!(
                clf,
                format!("{}/{}/{}:{} +0000", p[1], p[2], p[3], p[4]),
                "{secs}"
            );
        }
    }
}
