//! What the two `upper` examples share: the tenants, the work, and a client that checks a run.

use omnistage::account::ActivityId;
use omnistage::activity::ActivitySpec;
use omnistage::exec::{Builder, Runtime};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};

/// The tenants: activity path and weight. Each has its own listening port.
pub const TENANTS: [(&str, u32); 2] = [("/gold", 3), ("/bronze", 1)];
/// Longest line a client may send, bytes (a longer one closes its connection).
pub const LINE_MAX: usize = 4096;

/// The service's work: one line in, one line out.
pub fn upper(line: &[u8]) -> Vec<u8> {
    let mut out = line.to_ascii_uppercase();
    out.push(b'\n');
    out
}

/// Adds the tenants' activities; returns them with a listener each (port 0: free ports).
pub fn tenants(mut b: Builder) -> (Builder, Vec<(ActivityId, TcpListener)>) {
    let mut out = Vec::new();
    for (path, weight) in TENANTS {
        let (nb, id) = b
            .activity(path, ActivitySpec::weight(weight))
            .expect("activity");
        b = nb;
        let l = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
        out.push((id, l));
    }
    (b, out)
}

/// Sends a few lines to each tenant's port, checks the answers, prints the ledger's rows.
pub fn check(rt: &Runtime, addrs: &[SocketAddr]) {
    for (addr, (path, _)) in addrs.iter().zip(TENANTS) {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .expect("timeout");
        let mut r = BufReader::new(s.try_clone().expect("clone"));
        for line in ["hello", "omnistage", "two styles"] {
            s.write_all(format!("{line}\n").as_bytes()).expect("write");
            let mut got = String::new();
            r.read_line(&mut got).expect("read");
            assert_eq!(got, format!("{}\n", line.to_uppercase()), "from {path}");
            print!("{path}: {got}");
        }
    }
    let snap = rt.snapshot();
    for (path, _) in TENANTS {
        let id = rt.activity_id(path).expect("tenant");
        for row in snap.rows.iter().filter(|r| r.activity == id) {
            println!(
                "  ledger {path} stage {:<8} dispatches {:>3} cpu {:>7} ns",
                rt.stage_name(row.stage).unwrap_or("?"),
                row.dispatches,
                row.cpu_ns
            );
        }
    }
}
