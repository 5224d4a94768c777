//! Units on the command line: rates (`500KiB/s`, `10MB/s`, `1Gbit/s`) and sizes (`64KiB`), to
//! bytes per second and bytes. Decimal prefixes are powers of 1000, binary (`Ki`, `Mi`, `Gi`,
//! `Ti`) of 1024; `bit` units are divided by eight. A bare number is bytes.

/// Parses a size such as `64KiB`, `1.5MB` or `4096` to bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let (value, unit) = split_number(text)?;
    let factor = unit_factor(unit).ok_or_else(|| {
        format!("unknown size unit {unit:?} in {text:?} (use B, KB, MB, GB, KiB, MiB, GiB, kbit, Mbit, Gbit)")
    })?;
    to_u64(value * factor, text)
}

/// Parses a rate such as `500KiB/s`, `10MB/s` or `1Gbit/s` to bytes per second. The `/s` is
/// optional (`1MiB` means 1 MiB/s).
pub fn parse_rate(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let t = t
        .strip_suffix("/s")
        .or_else(|| t.strip_suffix("ps"))
        .unwrap_or(t);
    let (value, unit) = split_number(t).map_err(|e| format!("rate {text:?}: {e}"))?;
    let factor = unit_factor(unit).ok_or_else(|| {
        format!("unknown rate unit {unit:?} in {text:?} (use B/s, KB/s, MB/s, KiB/s, MiB/s, GiB/s, kbit/s, Mbit/s, Gbit/s)")
    })?;
    let r = to_u64(value * factor, text)?;
    if r == 0 {
        return Err(format!("rate {text:?} is zero"));
    }
    Ok(r)
}

/// A rate for people: `1.00 MiB/s`.
pub fn format_rate(bytes_per_s: u64) -> String {
    format!("{}/s", format_size(bytes_per_s))
}

/// A size for people: `64.0 KiB`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[i])
    }
}

fn split_number(text: &str) -> Result<(f64, &str), String> {
    let t = text.trim();
    let end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(end);
    if num.is_empty() {
        return Err(format!("{text:?} does not start with a number"));
    }
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{num:?} in {text:?} is not a number"))?;
    Ok((value, unit.trim()))
}

fn unit_factor(unit: &str) -> Option<f64> {
    let f = match unit {
        "" | "B" => 1.0,
        "k" | "K" | "kB" | "KB" => 1e3,
        "M" | "MB" => 1e6,
        "G" | "GB" => 1e9,
        "T" | "TB" => 1e12,
        "Ki" | "KiB" => 1024.0,
        "Mi" | "MiB" => 1024.0 * 1024.0,
        "Gi" | "GiB" => 1024.0 * 1024.0 * 1024.0,
        "Ti" | "TiB" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        "bit" | "b" => 1.0 / 8.0,
        "kbit" | "Kbit" | "kb" => 1e3 / 8.0,
        "Mbit" | "Mb" => 1e6 / 8.0,
        "Gbit" | "Gb" => 1e9 / 8.0,
        _ => return None,
    };
    Some(f)
}

fn to_u64(v: f64, text: &str) -> Result<u64, String> {
    // 2^53 bytes is beyond any limit the shaper takes; the check keeps the cast exact.
    if !v.is_finite() || !(0.0..=9.0e15).contains(&v) {
        return Err(format!("{text:?} is out of range"));
    }
    Ok(v.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_take_the_documented_units() {
        assert_eq!(parse_rate("500KiB/s").unwrap(), 512_000);
        assert_eq!(parse_rate("10MB/s").unwrap(), 10_000_000);
        assert_eq!(parse_rate("1Gbit/s").unwrap(), 125_000_000);
        assert_eq!(parse_rate("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_rate("64KiB/s").unwrap(), 65_536);
        assert_eq!(parse_rate("1.5MB/s").unwrap(), 1_500_000);
        assert_eq!(parse_rate("800").unwrap(), 800);
    }

    #[test]
    fn sizes_take_the_documented_units() {
        assert_eq!(parse_size("64KiB").unwrap(), 65_536);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("1GB").unwrap(), 1_000_000_000);
        assert_eq!(parse_size("0").unwrap(), 0);
    }

    #[test]
    fn bad_units_are_refused_with_the_text() {
        for bad in ["", "fast", "10 furlongs/s", "-5MB/s", "0/s", "1e99", "KiB"] {
            let e = parse_rate(bad).unwrap_err();
            assert!(
                e.contains(&format!("{bad:?}")) || bad.is_empty(),
                "{bad}: {e}"
            );
        }
        assert!(parse_size("12parsecs").is_err());
        assert!(parse_size("99999999999999TB").is_err());
    }

    #[test]
    fn formatting_is_readable() {
        assert_eq!(format_rate(1 << 20), "1.00 MiB/s");
        assert_eq!(format_size(512), "512 B");
    }
}
