//! Synthetic endpoints for experiments, enabled per tenant by `synthetic = true`:
//!
//! - `/_burn?us=N` spends N microseconds of CPU in the tenant's activity (N ≤ [`BURN_US_MAX`]);
//! - `/_bytes?n=N` answers with an N-byte body (N ≤ [`BYTES_N_MAX`]).
//!
//! [`parse_synthetic`] only recognizes them; the glue does the work. It must call it only for
//! tenants with `synthetic = true` (otherwise these paths are ordinary files, normally 404).
//! The query is a `&`-separated list of `key=value`; other keys are ignored, a missing, repeated,
//! non-decimal or out-of-range value is 400.

use crate::error::HttpError;

/// Most microseconds one `/_burn` may spend: 1 s.
pub const BURN_US_MAX: u64 = 1_000_000;
/// Largest `/_bytes` body: 1 GiB.
pub const BYTES_N_MAX: u64 = 1 << 30;
/// Longest decimal value accepted (u64 holds 19 full digits).
const VALUE_DIGITS_MAX: usize = 19;

/// A synthetic request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Synthetic {
    /// Spend `us` microseconds of CPU, then answer 200 with a short body.
    Burn {
        /// Microseconds of CPU to spend.
        us: u64,
    },
    /// Answer 200 with `n` bytes of body.
    Bytes {
        /// Body length in bytes.
        n: u64,
    },
}

/// `None` when `path` (decoded, from [`crate::path::decode_target`]) is not a synthetic
/// endpoint; otherwise the parsed request or a 400.
pub fn parse_synthetic(path: &str, query: Option<&str>) -> Option<Result<Synthetic, HttpError>> {
    match path {
        "/_burn" => Some(query_u64(query, "us", BURN_US_MAX).map(|us| Synthetic::Burn { us })),
        "/_bytes" => Some(query_u64(query, "n", BYTES_N_MAX).map(|n| Synthetic::Bytes { n })),
        _ => None,
    }
}

fn query_u64(query: Option<&str>, key: &str, max: u64) -> Result<u64, HttpError> {
    let mut found: Option<&str> = None;
    for pair in query.unwrap_or("").split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if k == key {
            if found.is_some() {
                return Err(HttpError::BadParameter("parameter given twice"));
            }
            found = Some(v);
        }
    }
    let v = found.ok_or(HttpError::BadParameter("missing parameter"))?;
    if v.is_empty() || v.len() > VALUE_DIGITS_MAX || !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(HttpError::BadParameter("parameter is not a decimal number"));
    }
    let n: u64 = v
        .parse()
        .map_err(|_| HttpError::BadParameter("parameter is not a decimal number"))?;
    if n > max {
        return Err(HttpError::BadParameter("parameter out of range"));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognizes_endpoints() {
        assert_eq!(
            parse_synthetic("/_burn", Some("us=250")),
            Some(Ok(Synthetic::Burn { us: 250 }))
        );
        assert_eq!(
            parse_synthetic("/_bytes", Some("n=0")),
            Some(Ok(Synthetic::Bytes { n: 0 }))
        );
        assert_eq!(
            parse_synthetic("/_bytes", Some("x=1&n=4096&y")),
            Some(Ok(Synthetic::Bytes { n: 4096 }))
        );
        assert_eq!(
            parse_synthetic("/_burn", Some("us=1000000")),
            Some(Ok(Synthetic::Burn { us: BURN_US_MAX }))
        );
        assert_eq!(
            parse_synthetic("/_bytes", Some("n=1073741824")),
            Some(Ok(Synthetic::Bytes { n: BYTES_N_MAX }))
        );
    }

    #[test]
    fn other_paths_are_not_synthetic() {
        for p in [
            "/",
            "/_burn/",
            "/_burnx",
            "/a/_burn",
            "/_BYTES",
            "/_bytes.html",
        ] {
            assert_eq!(parse_synthetic(p, Some("n=1")), None, "{p}");
        }
    }

    #[test]
    fn bad_parameters_are_400() {
        let bad = [
            ("/_burn", None),
            ("/_burn", Some("")),
            ("/_burn", Some("us=")),
            ("/_burn", Some("us=-1")),
            ("/_burn", Some("us=1e3")),
            ("/_burn", Some("us=+5")),
            ("/_burn", Some("us=1000001")),
            ("/_burn", Some("us=1&us=2")),
            ("/_burn", Some("n=5")),
            ("/_bytes", Some("n=1073741825")),
            ("/_bytes", Some("n=99999999999999999999999")),
            ("/_bytes", Some("n=18446744073709551616")),
        ];
        for (p, q) in bad {
            let e = parse_synthetic(p, q)
                .expect("synthetic")
                .expect_err("should be refused");
            assert_eq!(e.status(), 400, "{p}?{q:?}");
            assert!(!e.closes_connection());
        }
    }
}
