//! `omnistage tree`, `graph` and `set` against an admin server that puts terminal control
//! sequences in what it sends (names, the dot text, error reasons): what reaches the terminal
//! has them escaped, never raw.

mod common;

use common::run;
use omnistage::exec::Runtime;
use omnistage_admin::{InProcess, TenantChange, TenantError, Tenants};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

/// Retitles the terminal, clears the screen, an 8-bit CSI (U+009B) and a DEL.
const HOSTILE: &str = "evil\u{1b}]0;pwned\u{7}\u{1b}[2J\u{9b}31m\u{7f}\nfake line";

struct Bare(Runtime);

impl Tenants for Bare {
    fn set_tenant(&self, path: &str, _: &TenantChange) -> Result<(), TenantError> {
        Err(TenantError::NotATenant(path.into()))
    }
}

/// A real tree document whose first child is renamed to `HOSTILE`.
fn hostile_tree() -> String {
    let rt = Runtime::builder().workers(1).start().unwrap();
    let ip = InProcess::with_tenants(Arc::new(Bare(rt)), |b: &Bare| &b.0, None);
    let a = ip
        .answer(b"GET /api/v1/tree HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .unwrap();
    assert_eq!(a.status, 200);
    let mut v: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
    v["root"]["children"][0]["name"] = HOSTILE.into();
    v["root"]["children"][0]["policy"] = HOSTILE.into();
    // Valid JSON: serde_json escapes C0 controls in strings (the command decodes them) and
    // writes DEL and U+009B as they are.
    serde_json::to_string(&v).unwrap()
}

/// Answers every request on `listener` by its path, `count` of them.
fn fake_admin(listener: TcpListener, count: usize) -> std::thread::JoinHandle<()> {
    let tree = hostile_tree();
    std::thread::spawn(move || {
        for _ in 0..count {
            let Ok((mut s, _)) = listener.accept() else {
                return;
            };
            let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
            let head = read_head(&mut s);
            let path = head.split(' ').nth(1).unwrap_or("").to_string();
            let (status, ctype, body) = if path.starts_with("/api/v1/tree") {
                (200, "application/json", tree.clone())
            } else if path.starts_with("/api/v1/graph.dot") {
                (
                    200,
                    "text/vnd.graphviz",
                    format!("digraph g {{\n  \"{HOSTILE}\" -> \"x\";\n}}\n"),
                )
            } else if path.starts_with("/api/v1/graph") {
                (
                    200,
                    "application/json",
                    format!("{{\"stages\": [\"{}\"]}}\n", HOSTILE.replace('\n', "\\n")),
                )
            } else {
                (
                    409,
                    "application/json",
                    format!(
                        "{{\"status\": 409, \"error\": \"{}\"}}\n",
                        HOSTILE.replace('\n', "\\n")
                    ),
                )
            };
            let _ = write!(
                s,
                "HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n{body}",
                body.len()
            );
        }
    })
}

fn read_head(s: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut b = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut b) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&b[..n]),
        }
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// The control characters in `s` other than newlines and tabs.
fn controls(s: &str) -> Vec<char> {
    s.chars()
        .filter(|c| c.is_control() && *c != '\n' && *c != '\t')
        .collect()
}

#[test]
fn what_a_hostile_admin_server_sends_reaches_the_terminal_escaped() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let admin = format!("http://{}", listener.local_addr().unwrap());
    let cmds: [&[&str]; 5] = [
        &["tree"],
        &["tree", "--json"],
        &["graph"],
        &["graph", "--json"],
        &["set", "/x", "weight=5"],
    ];
    let server = fake_admin(listener, cmds.len() + 1);
    for cmd in cmds {
        let (code, out, err) = run(&[cmd, &["--admin", admin.as_str()][..]].concat());
        let shown = format!("{out}{err}");
        assert!(
            controls(&shown).is_empty(),
            "{cmd:?} (exit {code}) wrote control characters {:?}: {shown:?}",
            controls(&shown)
        );
        // Escaped, not dropped: the operator sees that something was there.
        assert!(shown.contains("evil"), "{cmd:?}: {shown:?}");
        assert!(shown.contains("\\u001b"), "{cmd:?}: {shown:?}");
    }
    // In the tree's table a newline in a name is escaped too: it cannot forge a line.
    let (_, out, _) = run(&["tree", "--admin", admin.as_str()]);
    assert!(!out.lines().any(|l| l.starts_with("fake line")), "{out}");
    server.join().unwrap();
}
