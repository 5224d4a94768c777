//! Tenant specifications and URL mixes.
//!
//! Owns the `--tenant` syntax, `NAME:HOST:CONNS:MIX[,OPTION...]`, and the request paths each
//! tenant sends:
//!
//! | MIX | requests |
//! |---|---|
//! | `path=/x` | always `/x` |
//! | `zipf=N:ALPHA:/prefix` | `/prefix/K.bin`, K in `0..N`, Zipf-distributed with exponent ALPHA (K=0 most popular) |
//! | `zipf=FILE:ALPHA` | the paths listed in FILE (one per line, `#` comments), Zipf over their order |
//! | `weighted=FILE` | the paths listed in FILE as `WEIGHT PATH` lines, each drawn with probability WEIGHT / ΣWEIGHT (any popularity law, e.g. SPECweb99's class mix) |
//! | `burn=US` | `/_burn?us=US` (the server burns US microseconds of CPU) |
//! | `bytes=N` | `/_bytes?n=N` (the server answers N body bytes) |
//!
//! OPTIONs override the global loop for this tenant: `rate=R` (open loop, R requests/s) or
//! `think-ms=MS` (closed loop with that think time); `header=NAME:VALUE` adds one request
//! header to every request of the tenant (a server-side class selector, say). HOST is sent as the `Host` header and may not
//! contain `:`; NAME labels the tenant in the report.
//!
//! Everything is bounded by the named constants below, and every error says which part of which
//! spec is wrong.

use rand::{Rng, RngExt};
use rand_distr::{Distribution, Zipf};
use std::io::Write;

/// Most tenants in one run.
pub const MAX_TENANTS: usize = 64;
/// Longest tenant name.
pub const MAX_NAME_BYTES: usize = 64;
/// Longest Host header value.
pub const MAX_HOST_BYTES: usize = 253;
/// Longest request path (including the query).
pub const MAX_PATH_BYTES: usize = 2048;
/// Most files in a generated Zipf set (`zipf=N:ALPHA:/prefix`).
pub const MAX_ZIPF_FILES: u64 = 100_000_000;
/// Most paths in a Zipf list file.
pub const MAX_LIST_PATHS: usize = 1_000_000;
/// Largest Zipf list file.
pub const MAX_LIST_FILE_BYTES: u64 = 256 * 1024 * 1024;
/// Largest Zipf exponent.
pub const MAX_ZIPF_ALPHA: f64 = 10.0;
/// Largest `burn=` value: 10 seconds of CPU per request.
pub const MAX_BURN_US: u64 = 10_000_000;
/// Largest `bytes=` value: 1 GiB (the largest body this client reads).
pub const MAX_GENERATED_BODY_BYTES: u64 = crate::parse::MAX_BODY_BYTES;
/// Most connections for one tenant (the run as a whole has its own limit).
pub const MAX_TENANT_CONNECTIONS: usize = crate::MAX_CONNECTIONS_TOTAL;
/// Smallest per-tenant open-loop rate, requests/s.
pub const MIN_RATE_PER_S: f64 = 0.001;
/// Largest per-tenant open-loop rate, requests/s.
pub const MAX_RATE_PER_S: f64 = 10_000_000.0;
/// Longest `header=` option (name and value).
pub const MAX_HEADER_BYTES: usize = 1024;
/// Largest closed-loop think time.
pub const MAX_THINK_MS: f64 = 60_000.0;

/// How a tenant paces its requests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Pacing {
    /// One request outstanding per connection; the next is due `think_ms` after a response.
    Closed { think_ms: f64 },
    /// Requests are due on a fixed schedule of `rate_per_s` over all the tenant's connections;
    /// latency is measured from the scheduled time.
    Open { rate_per_s: f64 },
}

/// Which set a Zipf mix draws from.
#[derive(Debug, Clone)]
pub enum PathSet {
    /// Paths read from a list file, most popular first.
    List(Vec<String>),
    /// `/prefix/K.bin` for K in `0..n`.
    Generated { prefix: String, n: u64 },
}

impl PathSet {
    fn len(&self) -> u64 {
        match self {
            PathSet::List(v) => v.len() as u64,
            PathSet::Generated { n, .. } => *n,
        }
    }
}

/// The paths a tenant requests.
#[derive(Debug, Clone)]
pub enum Mix {
    /// The same path every time.
    Fixed(String),
    /// A Zipf-distributed choice from a set.
    Zipf { set: PathSet, zipf: Zipf<f64> },
    /// A choice from a list with given weights.
    Weighted(WeightedPaths),
}

/// Paths with weights, drawn by one uniform number and a binary search over the running sums
/// (no allocation per draw).
#[derive(Debug, Clone)]
pub struct WeightedPaths {
    paths: Vec<String>,
    /// `cumulative[i]` = weight of paths `0..=i`; strictly increasing, last = total.
    cumulative: Vec<f64>,
}

impl WeightedPaths {
    /// Builds the table from `(weight, path)` pairs; every weight must be finite and positive.
    pub fn new(entries: Vec<(f64, String)>) -> Result<Self, String> {
        if entries.is_empty() {
            return Err("no paths".into());
        }
        let mut total = 0.0;
        let mut paths = Vec::with_capacity(entries.len());
        let mut cumulative = Vec::with_capacity(entries.len());
        for (w, p) in entries {
            if !(w.is_finite() && w > 0.0) {
                return Err(format!("weight {w} of {p:?} must be a positive number"));
            }
            total += w;
            paths.push(p);
            cumulative.push(total);
        }
        if !total.is_finite() {
            return Err("the weights add up to more than a float holds".into());
        }
        Ok(WeightedPaths { paths, cumulative })
    }

    /// Index of the path for a uniform draw `u` in `[0, 1)`.
    fn index(&self, u: f64) -> usize {
        let total = *self.cumulative.last().expect("never empty");
        let x = u * total;
        self.cumulative
            .partition_point(|&c| c <= x)
            .min(self.paths.len() - 1)
    }

    /// The paths, in file order.
    pub fn paths(&self) -> &[String] {
        &self.paths
    }
}

impl Mix {
    /// Appends the next request path to `out`.
    pub fn write_path<R: Rng + ?Sized>(&self, rng: &mut R, out: &mut Vec<u8>) {
        match self {
            Mix::Fixed(p) => out.extend_from_slice(p.as_bytes()),
            Mix::Zipf { set, zipf } => {
                // Zipf samples ranks in 1..=n as floats; rank 1 is index 0.
                let rank = zipf.sample(rng) as u64;
                let index = rank.saturating_sub(1).min(set.len() - 1);
                match set {
                    PathSet::List(v) => out.extend_from_slice(v[index as usize].as_bytes()),
                    PathSet::Generated { prefix, .. } => {
                        // Writing to a Vec cannot fail.
                        let _ = write!(out, "{prefix}/{index}.bin");
                    }
                }
            }
            Mix::Weighted(w) => {
                let i = w.index(rng.random::<f64>());
                out.extend_from_slice(w.paths[i].as_bytes());
            }
        }
    }
}

/// One parsed `--tenant` value.
#[derive(Debug, Clone)]
pub struct TenantSpec {
    pub name: String,
    pub host: String,
    pub connections: usize,
    pub mix: Mix,
    /// The MIX part as written (for the report).
    pub mix_text: String,
    /// Per-tenant pacing from `,rate=` or `,think-ms=`; `None` means the global pacing.
    pub pacing: Option<Pacing>,
    /// One extra request header (name, value) from `,header=NAME:VALUE`.
    pub header: Option<(String, String)>,
}

/// Parses `NAME:HOST:CONNS:MIX[,OPTION...]`. Reads the list file of a `zipf=FILE:ALPHA` mix.
pub fn parse_tenant(spec: &str) -> Result<TenantSpec, String> {
    let err = |what: String| format!("--tenant {spec:?}: {what}");
    let mut parts = spec.splitn(4, ':');
    let (Some(name), Some(host), Some(conns), Some(rest)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(err(
            "expected NAME:HOST:CONNS:MIX (e.g. a:a.test:16:path=/index.html)".into(),
        ));
    };
    validate_name(name).map_err(err)?;
    validate_host(host).map_err(err)?;
    let connections: usize = conns
        .parse()
        .map_err(|_| err(format!("CONNS {conns:?} is not a whole number")))?;
    if connections == 0 || connections > MAX_TENANT_CONNECTIONS {
        return Err(err(format!(
            "CONNS must be in 1..={MAX_TENANT_CONNECTIONS}, got {connections}"
        )));
    }
    let mut fields = rest.split(',');
    let mix_text = fields.next().unwrap_or_default();
    let mix = parse_mix(mix_text).map_err(err)?;
    let mut pacing = None;
    let mut header = None;
    for opt in fields {
        let (key, value) = opt
            .split_once('=')
            .ok_or_else(|| err(format!("option {opt:?} is not KEY=VALUE")))?;
        if key == "header" {
            if header.is_some() {
                return Err(err("give at most one header=".into()));
            }
            header = Some(parse_header(value).map_err(err)?);
            continue;
        }
        let value: f64 = value
            .parse()
            .map_err(|_| err(format!("option {key}: {value:?} is not a number")))?;
        if pacing.is_some() {
            return Err(err("give at most one of rate= and think-ms=".into()));
        }
        pacing = Some(match key {
            "rate" => Pacing::Open {
                rate_per_s: check_rate(value).map_err(err)?,
            },
            "think-ms" => Pacing::Closed {
                think_ms: check_think(value).map_err(err)?,
            },
            _ => {
                return Err(err(format!(
                    "unknown option {key:?} (known: rate=R, think-ms=MS, header=NAME:VALUE)"
                )))
            }
        });
    }
    Ok(TenantSpec {
        name: name.to_string(),
        host: host.to_string(),
        connections,
        mix,
        mix_text: mix_text.to_string(),
        pacing,
        header,
    })
}

/// Parses `NAME:VALUE` of a `header=` option: a token name (not one the generator writes
/// itself), a non-empty value of visible ASCII and spaces, at most [`MAX_HEADER_BYTES`].
fn parse_header(text: &str) -> Result<(String, String), String> {
    if text.len() > MAX_HEADER_BYTES {
        return Err(format!("header= longer than {MAX_HEADER_BYTES} bytes"));
    }
    let Some((name, value)) = text.split_once(':') else {
        return Err(format!("header {text:?} must be NAME:VALUE"));
    };
    let (name, value) = (name.trim(), value.trim());
    let token = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
    if !token {
        return Err(format!("header name {name:?} is not an HTTP token"));
    }
    if [
        "host",
        "user-agent",
        "connection",
        "content-length",
        "transfer-encoding",
    ]
    .contains(&name.to_ascii_lowercase().as_str())
    {
        return Err(format!(
            "header {name:?} is written by the generator itself"
        ));
    }
    if value.is_empty() || !value.bytes().all(|b| b == b' ' || b.is_ascii_graphic()) {
        return Err(format!(
            "header value {value:?} must be non-empty visible ASCII"
        ));
    }
    Ok((name.to_string(), value.to_string()))
}

/// Checks an open-loop rate (requests/s).
pub fn check_rate(rate_per_s: f64) -> Result<f64, String> {
    if rate_per_s.is_finite() && (MIN_RATE_PER_S..=MAX_RATE_PER_S).contains(&rate_per_s) {
        Ok(rate_per_s)
    } else {
        Err(format!(
            "rate must be in {MIN_RATE_PER_S}..={MAX_RATE_PER_S} requests/s, got {rate_per_s}"
        ))
    }
}

/// Checks a closed-loop think time (ms).
pub fn check_think(think_ms: f64) -> Result<f64, String> {
    if think_ms.is_finite() && (0.0..=MAX_THINK_MS).contains(&think_ms) {
        Ok(think_ms)
    } else {
        Err(format!(
            "think time must be in 0..={MAX_THINK_MS} ms, got {think_ms}"
        ))
    }
}

fn validate_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES {
        return Err(format!("NAME must be 1..={MAX_NAME_BYTES} bytes"));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        return Err(format!(
            "NAME {name:?} may hold only letters, digits, '-', '_', '.'"
        ));
    }
    Ok(())
}

fn validate_host(host: &str) -> Result<(), String> {
    if host.is_empty() || host.len() > MAX_HOST_BYTES {
        return Err(format!("HOST must be 1..={MAX_HOST_BYTES} bytes"));
    }
    if !host
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        return Err(format!(
            "HOST {host:?} may hold only letters, digits, '-', '_', '.' (no port)"
        ));
    }
    Ok(())
}

/// Checks a request path: starts with `/`, visible ASCII only, bounded length.
fn validate_path(path: &str) -> Result<(), String> {
    if !path.starts_with('/') {
        return Err(format!("path {path:?} must start with '/'"));
    }
    if path.len() > MAX_PATH_BYTES {
        return Err(format!("path longer than {MAX_PATH_BYTES} bytes"));
    }
    if !path.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "path {path:?} may hold only visible ASCII (no spaces or control bytes)"
        ));
    }
    Ok(())
}

fn parse_u64(what: &str, s: &str, max: u64) -> Result<u64, String> {
    let v: u64 = s
        .parse()
        .map_err(|_| format!("{what} {s:?} is not a whole number"))?;
    if v > max {
        return Err(format!("{what} must be at most {max}, got {v}"));
    }
    Ok(v)
}

fn parse_alpha(s: &str) -> Result<f64, String> {
    let alpha: f64 = s
        .parse()
        .map_err(|_| format!("Zipf ALPHA {s:?} is not a number"))?;
    if !(alpha.is_finite() && alpha > 0.0 && alpha <= MAX_ZIPF_ALPHA) {
        return Err(format!(
            "Zipf ALPHA must be in (0, {MAX_ZIPF_ALPHA}], got {alpha}"
        ));
    }
    Ok(alpha)
}

/// Parses the MIX part of a tenant spec.
pub fn parse_mix(text: &str) -> Result<Mix, String> {
    let (kind, arg) = text.split_once('=').ok_or_else(|| {
        format!("MIX {text:?} must be path=/x, zipf=N:ALPHA:/prefix, zipf=FILE:ALPHA, weighted=FILE, burn=US or bytes=N")
    })?;
    match kind {
        "path" => {
            validate_path(arg)?;
            Ok(Mix::Fixed(arg.to_string()))
        }
        "burn" => {
            let us = parse_u64("burn US", arg, MAX_BURN_US)?;
            Ok(Mix::Fixed(format!("/_burn?us={us}")))
        }
        "bytes" => {
            let n = parse_u64("bytes N", arg, MAX_GENERATED_BODY_BYTES)?;
            Ok(Mix::Fixed(format!("/_bytes?n={n}")))
        }
        "zipf" => parse_zipf(arg),
        "weighted" => Ok(Mix::Weighted(read_weighted_list(arg)?)),
        _ => Err(format!(
            "unknown MIX kind {kind:?} (known: path, zipf, weighted, burn, bytes)"
        )),
    }
}

fn parse_zipf(arg: &str) -> Result<Mix, String> {
    let generated: Vec<&str> = arg.splitn(3, ':').collect();
    let set = match generated.as_slice() {
        [n, alpha, prefix] if n.bytes().all(|b| b.is_ascii_digit()) && !n.is_empty() => {
            let n = parse_u64("Zipf N", n, MAX_ZIPF_FILES)?;
            if n == 0 {
                return Err("Zipf N must be at least 1".into());
            }
            validate_path(prefix)?;
            if prefix.len() > MAX_PATH_BYTES - 32 {
                return Err(format!(
                    "Zipf prefix longer than {} bytes",
                    MAX_PATH_BYTES - 32
                ));
            }
            let prefix = prefix.trim_end_matches('/').to_string();
            (PathSet::Generated { prefix, n }, parse_alpha(alpha)?)
        }
        _ => {
            let (file, alpha) = arg
                .rsplit_once(':')
                .ok_or_else(|| "zipf needs N:ALPHA:/prefix or FILE:ALPHA".to_string())?;
            let alpha = parse_alpha(alpha)?;
            (PathSet::List(read_path_list(file)?), alpha)
        }
    };
    let (set, alpha) = set;
    let zipf = Zipf::new(set.len() as f64, alpha).map_err(|e| format!("Zipf: {e}"))?;
    Ok(Mix::Zipf { set, zipf })
}

/// Reads a list file of at most [`MAX_LIST_FILE_BYTES`]; `what` names it in errors.
fn read_list_text(what: &str, file: &str) -> Result<String, String> {
    let meta = std::fs::metadata(file).map_err(|e| format!("{what} {file:?}: {e}"))?;
    if meta.len() > MAX_LIST_FILE_BYTES {
        return Err(format!(
            "{what} {file:?} is larger than {MAX_LIST_FILE_BYTES} bytes"
        ));
    }
    std::fs::read_to_string(file).map_err(|e| format!("{what} {file:?}: {e}"))
}

/// Reads `WEIGHT PATH` lines (at most [`MAX_LIST_PATHS`]); blank lines and `#` comments are
/// skipped.
fn read_weighted_list(file: &str) -> Result<WeightedPaths, String> {
    let what = "weighted list";
    let text = read_list_text(what, file)?;
    let mut entries = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = |e: String| format!("{what} {file:?} line {}: {e}", i + 1);
        if entries.len() == MAX_LIST_PATHS {
            return Err(format!(
                "{what} {file:?} has more than {MAX_LIST_PATHS} paths"
            ));
        }
        let (w, path) = line
            .split_once(char::is_whitespace)
            .ok_or_else(|| at("expected WEIGHT PATH".into()))?;
        let w: f64 = w
            .parse()
            .map_err(|_| at(format!("weight {w:?} is not a number")))?;
        if !(w.is_finite() && w > 0.0) {
            return Err(at(format!("weight {w} must be a positive number")));
        }
        let path = path.trim();
        validate_path(path).map_err(at)?;
        entries.push((w, path.to_string()));
    }
    if entries.is_empty() {
        return Err(format!("{what} {file:?} has no paths"));
    }
    WeightedPaths::new(entries).map_err(|e| format!("{what} {file:?}: {e}"))
}

/// Reads a list of request paths, one per line; blank lines and `#` comments are skipped.
fn read_path_list(file: &str) -> Result<Vec<String>, String> {
    let text = read_list_text("Zipf list", file)?;
    let mut paths = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if paths.len() == MAX_LIST_PATHS {
            return Err(format!(
                "Zipf list {file:?} has more than {MAX_LIST_PATHS} paths"
            ));
        }
        validate_path(line).map_err(|e| format!("Zipf list {file:?} line {}: {e}", i + 1))?;
        paths.push(line.to_string());
    }
    if paths.is_empty() {
        return Err(format!("Zipf list {file:?} has no paths"));
    }
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn paths(mix: &Mix, n: usize) -> Vec<String> {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        (0..n)
            .map(|_| {
                let mut out = Vec::new();
                mix.write_path(&mut rng, &mut out);
                String::from_utf8(out).unwrap()
            })
            .collect()
    }

    #[test]
    fn fixed_mixes() {
        let t = parse_tenant("a:a.test:4:burn=250").unwrap();
        assert_eq!(
            (t.name.as_str(), t.host.as_str(), t.connections),
            ("a", "a.test", 4)
        );
        assert_eq!(paths(&t.mix, 1), vec!["/_burn?us=250"]);
        assert_eq!(t.pacing, None);
        let t = parse_tenant("b:b:1:bytes=1024,rate=500").unwrap();
        assert_eq!(paths(&t.mix, 1), vec!["/_bytes?n=1024"]);
        assert_eq!(t.pacing, Some(Pacing::Open { rate_per_s: 500.0 }));
        let t = parse_tenant("c:c:2:path=/x?y=1,think-ms=5").unwrap();
        assert_eq!(paths(&t.mix, 1), vec!["/x?y=1"]);
        assert_eq!(t.pacing, Some(Pacing::Closed { think_ms: 5.0 }));
        assert_eq!(t.header, None);
        let t = parse_tenant("h:h:128:burn=100,header=X-Class: high,think-ms=5").unwrap();
        assert_eq!(t.header, Some(("X-Class".into(), "high".into())));
        assert_eq!(t.pacing, Some(Pacing::Closed { think_ms: 5.0 }));
    }

    #[test]
    fn generated_zipf_prefers_low_ranks() {
        let t = parse_tenant("z:z:1:zipf=1000:1.2:/files/").unwrap();
        let ps = paths(&t.mix, 2000);
        assert!(ps
            .iter()
            .all(|p| p.starts_with("/files/") && p.ends_with(".bin")));
        let first = ps.iter().filter(|p| *p == "/files/0.bin").count();
        let tenth = ps.iter().filter(|p| *p == "/files/9.bin").count();
        assert!(first > tenth, "rank 1 {first} vs rank 10 {tenth}");
    }

    #[test]
    fn zipf_list_file() {
        let dir = std::env::temp_dir().join(format!("omnistage-load-mix-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("list.txt");
        std::fs::write(&file, "# popular first\n/a.html\n\n/b.css\n/c.js\n").unwrap();
        let t = parse_tenant(&format!("l:l:1:zipf={}:1.0", file.display())).unwrap();
        let ps = paths(&t.mix, 200);
        assert!(ps
            .iter()
            .all(|p| ["/a.html", "/b.css", "/c.js"].contains(&p.as_str())));
        std::fs::write(&file, "no-slash\n").unwrap();
        let e = parse_tenant(&format!("l:l:1:zipf={}:1.0", file.display())).unwrap_err();
        assert!(e.contains("line 1"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn weighted_index_follows_the_running_sums() {
        let w = WeightedPaths::new(vec![
            (1.0, "/a".into()),
            (2.0, "/b".into()),
            (1.0, "/c".into()),
        ])
        .unwrap();
        // Running sums 1, 3, 4 of total 4: [0, .25) -> a, [.25, .75) -> b, [.75, 1) -> c.
        assert_eq!(w.index(0.0), 0);
        assert_eq!(w.index(0.2499), 0);
        assert_eq!(w.index(0.25), 1);
        assert_eq!(w.index(0.7499), 1);
        assert_eq!(w.index(0.75), 2);
        assert_eq!(w.index(0.999_999_999), 2);
        assert_eq!(w.index(1.0), 2, "clamped to the last path");
        assert!(WeightedPaths::new(vec![]).is_err());
        assert!(WeightedPaths::new(vec![(0.0, "/a".into())]).is_err());
        assert!(WeightedPaths::new(vec![(f64::NAN, "/a".into())]).is_err());
    }

    #[test]
    fn weighted_list_file() {
        let dir = std::env::temp_dir().join(format!("omnistage-load-wmix-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("weights.txt");
        std::fs::write(&file, "# weight path\n0.9 /hot.html\n\n0.1\t/cold.bin\n").unwrap();
        let t = parse_tenant(&format!("w:w:1:weighted={}", file.display())).unwrap();
        let ps = paths(&t.mix, 10_000);
        let hot = ps.iter().filter(|p| *p == "/hot.html").count();
        let cold = ps.iter().filter(|p| *p == "/cold.bin").count();
        assert_eq!(hot + cold, 10_000);
        assert!(
            (8_700..=9_300).contains(&hot),
            "hot {hot} of 10000 at weight 0.9"
        );
        for (text, needle) in [
            ("/a\n", "expected WEIGHT PATH"),
            ("x /a\n", "not a number"),
            ("-1 /a\n", "positive"),
            ("inf /a\n", "positive"),
            ("1 a\n", "must start with '/'"),
            ("# nothing\n", "no paths"),
        ] {
            std::fs::write(&file, text).unwrap();
            let e = parse_tenant(&format!("w:w:1:weighted={}", file.display())).unwrap_err();
            assert!(e.contains(needle), "{text:?}: {e}");
        }
        // One path more than the limit.
        std::fs::write(&file, "1 /a\n".repeat(MAX_LIST_PATHS + 1)).unwrap();
        let e = parse_tenant(&format!("w:w:1:weighted={}", file.display())).unwrap_err();
        assert!(e.contains("more than"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
        let e = parse_tenant("w:w:1:weighted=/nonexistent/weights").unwrap_err();
        assert!(e.contains("weighted list"), "{e}");
    }

    #[test]
    fn spec_errors() {
        for (spec, needle) in [
            ("a:a.test:4", "expected NAME:HOST:CONNS:MIX"),
            ("a b:a:1:path=/", "NAME"),
            ("a:a:b:1:path=/", "CONNS"),
            ("a:a:0:path=/", "CONNS must be in"),
            ("a:a:1:path=x", "must start with '/'"),
            ("a:a:1:path=/a b", "visible ASCII"),
            ("a:a:1:zipf=10:0:/p", "ALPHA"),
            ("a:a:1:zipf=0:1:/p", "at least 1"),
            ("a:a:1:zipf=/nonexistent/list:1", "Zipf list"),
            ("a:a:1:burn=99999999999", "at most"),
            ("a:a:1:nope=1", "unknown MIX kind"),
            ("a:a:1:path=/,rate=0", "rate must be in"),
            ("a:a:1:path=/,rate=5,think-ms=1", "at most one"),
            ("a:a:1:path=/,speed=5", "unknown option"),
            ("a:a:1:path=/,header=novalue", "NAME:VALUE"),
            ("a:a:1:path=/,header=x:", "non-empty"),
            ("a:a:1:path=/,header=a b:c", "token"),
            ("a:a:1:path=/,header=Host:evil", "generator itself"),
            ("a:a:1:path=/,header=x:\u{7f}", "visible ASCII"),
            ("a:a:1:path=/,header=x:1,header=y:2", "at most one header"),
        ] {
            let e = parse_tenant(spec).unwrap_err();
            assert!(e.contains(needle), "{spec}: {e}");
        }
        // Just over the length limit.
        let spec = format!("a:a:1:path=/,header=x:{}", "v".repeat(MAX_HEADER_BYTES - 1));
        assert!(parse_tenant(&spec).unwrap_err().contains("longer than"));
    }
}
