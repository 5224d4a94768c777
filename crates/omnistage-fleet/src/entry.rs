//! entry: what one node publishes to Redis every `sync_ms`, written and read as text.
//!
//! One Redis string per node, key `<prefix>node:<node>`, set with a TTL of 1.9 × `sync_ms` (`NodeConfig::ttl_ms`):
//!
//! ```text
//! omnistage-fleet/1 node=n1 cpu=2000000000 link=10000000
//! t a 4 1 2000000000 1400000000 1 10000000 9800000
//! t b 1 0 12000 12000 0 3000 3000
//! ```
//!
//! The header names the node (it must match the key) and its capacities in units per second
//! (CPU: ns/s of all its workers; link: its `net_link_cap` in bytes/s, 0 without one). Each
//! `t` line is a tenant with demand there: name, weight, then for CPU and for link bytes
//! `backlogged (0|1) want used` in units per second.
//!
//! Anything else is garbage and is ignored and counted, never trusted: a value that is not
//! UTF-8, too long, without the header, or naming another node is dropped whole (one count);
//! a malformed, duplicate or out-of-range tenant line is dropped alone (one count each).
//! Limits: [`ENTRY_BYTES_MAX`], [`TENANT_LINES_MAX`], [`VALUE_MAX`], names as the config's.
//! Pure; tested by feeding bytes.

use crate::water::Demand;
use std::fmt::Write as _;

/// First word of every entry (the format's version is its last part).
pub const MAGIC: &str = "omnistage-fleet/1";
/// Longest entry read (a longer value is garbage).
pub const ENTRY_BYTES_MAX: usize = 1 << 20;
/// Most tenant lines read from one entry (later lines are garbage).
pub const TENANT_LINES_MAX: usize = 10_000;
/// Largest number accepted in an entry: 10^15 units/s (1 PB/s, or a million cores).
pub const VALUE_MAX: u64 = 1_000_000_000_000_000;
/// Longest node name.
pub const NODE_BYTES_MAX: usize = 64;

/// One node's published state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeEntry {
    pub node: String,
    /// ns/s of CPU the node's workers can give.
    pub cpu_capacity: u64,
    /// Bytes/s of its link cap (0: no link cap, the link is not a bound resource there).
    pub link_capacity: u64,
    pub tenants: Vec<TenantEntry>,
}

/// One tenant on one node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantEntry {
    pub name: String,
    /// Its configured weight on the publishing node.
    pub weight: u32,
    pub cpu: Demand,
    pub link: Demand,
}

/// Whether `s` is a valid node name: `[A-Za-z0-9_.-]{1,64}` (a host name fits).
pub fn valid_node(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= NODE_BYTES_MAX
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// Whether `s` is a valid tenant name (the config's rule: `[a-z0-9_-]{1,64}`).
pub fn valid_tenant(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= omnistage_http::config::NAME_BYTES_MAX
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-'))
}

/// The entry as text (see the module doc).
pub fn encode(e: &NodeEntry) -> String {
    let mut s = String::with_capacity(64 + 64 * e.tenants.len());
    let _ = writeln!(
        s,
        "{MAGIC} node={} cpu={} link={}",
        e.node, e.cpu_capacity, e.link_capacity
    );
    for t in &e.tenants {
        let _ = writeln!(
            s,
            "t {} {} {} {} {} {} {} {}",
            t.name,
            t.weight,
            u8::from(t.cpu.backlogged),
            t.cpu.want,
            t.cpu.used,
            u8::from(t.link.backlogged),
            t.link.want,
            t.link.used
        );
    }
    s
}

/// An entry read back: what could be used, and how many pieces of it were garbage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parsed {
    /// `None` when the whole value was garbage.
    pub entry: Option<NodeEntry>,
    /// Pieces dropped (the whole value counts once).
    pub garbage: u64,
}

fn number(s: &str) -> Option<u64> {
    // Digits only (no sign, no '+', no spaces), at most VALUE_MAX.
    if s.is_empty() || s.len() > 16 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse::<u64>().ok().filter(|&v| v <= VALUE_MAX)
}

fn flag(s: &str) -> Option<bool> {
    match s {
        "0" => Some(false),
        "1" => Some(true),
        _ => None,
    }
}

fn header(line: &str, key_node: &str) -> Option<(u64, u64)> {
    let mut w = line.split(' ');
    if w.next()? != MAGIC {
        return None;
    }
    let node = w.next()?.strip_prefix("node=")?;
    let cpu = number(w.next()?.strip_prefix("cpu=")?)?;
    let link = number(w.next()?.strip_prefix("link=")?)?;
    (w.next().is_none() && node == key_node).then_some((cpu, link))
}

fn tenant_line(line: &str) -> Option<TenantEntry> {
    let w: Vec<&str> = line.split(' ').collect();
    if w.len() != 9 || w[0] != "t" || !valid_tenant(w[1]) {
        return None;
    }
    let weight = number(w[2]).filter(|&x| (1..=u64::from(u32::MAX)).contains(&x))? as u32;
    let demand = |b: &str, want: &str, used: &str| {
        Some(Demand {
            backlogged: flag(b)?,
            want: number(want)?,
            used: number(used)?,
        })
    };
    Some(TenantEntry {
        name: w[1].to_string(),
        weight,
        cpu: demand(w[3], w[4], w[5])?,
        link: demand(w[6], w[7], w[8])?,
    })
}

/// Reads the value stored under node `key_node`'s key (module doc for what is garbage).
pub fn parse(key_node: &str, value: &[u8]) -> Parsed {
    let whole = Parsed {
        entry: None,
        garbage: 1,
    };
    if value.len() > ENTRY_BYTES_MAX {
        return whole;
    }
    let Ok(text) = std::str::from_utf8(value) else {
        return whole;
    };
    let mut lines = text.lines();
    let Some((cpu_capacity, link_capacity)) = lines.next().and_then(|l| header(l, key_node)) else {
        return whole;
    };
    let mut entry = NodeEntry {
        node: key_node.to_string(),
        cpu_capacity,
        link_capacity,
        tenants: Vec::new(),
    };
    let mut garbage = 0;
    let mut seen = std::collections::HashSet::new();
    for line in lines {
        if line.is_empty() {
            continue;
        }
        match tenant_line(line) {
            Some(t) if entry.tenants.len() < TENANT_LINES_MAX && seen.insert(t.name.clone()) => {
                entry.tenants.push(t)
            }
            _ => garbage += 1,
        }
    }
    Parsed {
        entry: Some(entry),
        garbage,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> NodeEntry {
        NodeEntry {
            node: "n1".into(),
            cpu_capacity: 2_000_000_000,
            link_capacity: 10_000_000,
            tenants: vec![
                TenantEntry {
                    name: "a".into(),
                    weight: 4,
                    cpu: Demand {
                        backlogged: true,
                        want: 2_000_000_000,
                        used: 1_400_000_000,
                    },
                    link: Demand {
                        backlogged: true,
                        want: 10_000_000,
                        used: 9_800_000,
                    },
                },
                TenantEntry {
                    name: "b".into(),
                    weight: 1,
                    cpu: Demand {
                        backlogged: false,
                        want: 12_000,
                        used: 12_000,
                    },
                    link: Demand {
                        backlogged: false,
                        want: 3000,
                        used: 3000,
                    },
                },
            ],
        }
    }

    #[test]
    fn encodes_as_documented_and_reads_back() {
        let text = encode(&sample());
        assert_eq!(
            text,
            "omnistage-fleet/1 node=n1 cpu=2000000000 link=10000000\n\
             t a 4 1 2000000000 1400000000 1 10000000 9800000\n\
             t b 1 0 12000 12000 0 3000 3000\n"
        );
        assert_eq!(
            parse("n1", text.as_bytes()),
            Parsed {
                entry: Some(sample()),
                garbage: 0
            }
        );
    }

    #[test]
    fn a_bad_value_is_garbage_whole() {
        let good = encode(&sample());
        let cases: Vec<Vec<u8>> = vec![
            b"".to_vec(),
            b"hello".to_vec(),
            vec![0xff, 0xfe, 0x00],
            good.replace("omnistage-fleet/1", "omnistage-fleet/2")
                .into_bytes(),
            good.replace("node=n1", "node=n2").into_bytes(),
            good.replace("cpu=2000000000", "cpu=-1").into_bytes(),
            good.replace("cpu=2000000000", "cpu=").into_bytes(),
            good.replace("link=10000000", "link=10000000 extra")
                .into_bytes(),
            good.replace("cpu=2000000000", "cpu=99999999999999999")
                .into_bytes(),
            vec![b'x'; ENTRY_BYTES_MAX + 1],
        ];
        for c in cases {
            let p = parse("n1", &c);
            assert_eq!(p.entry, None, "{:?}", String::from_utf8_lossy(&c));
            assert_eq!(p.garbage, 1);
        }
    }

    #[test]
    fn a_bad_line_is_dropped_alone_and_counted() {
        let good = encode(&sample());
        let bad_lines = [
            "t",
            "x a 4 1 1 1 1 1 1",
            "t A 4 1 1 1 1 1 1",
            "t c 0 1 1 1 1 1 1",
            "t c 4 2 1 1 1 1 1",
            "t c 4 1 -1 1 1 1 1",
            "t c 4 1 1 1 1 1",
            "t c 4 1 1 1 1 1 1 1",
            "t c 4 1 1 1 1 1 1000000000000001",
            "t c  4 1 1 1 1 1 1",
            "t a 4 1 1 1 1 1 1",
        ];
        for l in bad_lines {
            let text = format!("{good}{l}\n");
            let p = parse("n1", text.as_bytes());
            assert_eq!(p.entry, Some(sample()), "{l}");
            assert_eq!(p.garbage, 1, "{l}");
        }
        // Empty lines are not garbage.
        assert_eq!(parse("n1", format!("{good}\n\n").as_bytes()).garbage, 0);
    }

    #[test]
    fn tenant_lines_past_the_limit_are_garbage() {
        let mut e = sample();
        e.tenants.clear();
        let mut text = encode(&e);
        for i in 0..TENANT_LINES_MAX + 3 {
            text.push_str(&format!("t t{i} 1 0 1 1 0 1 1\n"));
        }
        let p = parse("n1", text.as_bytes());
        assert_eq!(p.entry.expect("kept").tenants.len(), TENANT_LINES_MAX);
        assert_eq!(p.garbage, 3);
    }

    #[test]
    fn names() {
        assert!(valid_node("n1") && valid_node("web-3.example_x"));
        assert!(!valid_node("") && !valid_node("a b") && !valid_node("a:b"));
        assert!(!valid_node(&"n".repeat(NODE_BYTES_MAX + 1)));
        assert!(valid_node(&"n".repeat(NODE_BYTES_MAX)));
        assert!(valid_tenant("a_b-1") && !valid_tenant("A") && !valid_tenant(""));
    }
}
