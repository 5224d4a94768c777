//! `Store::sync` against a real `redis-server` of the test's own (skipped with a message when
//! it is not installed) holding garbage that once broke or bloated a sync, and against a fake
//! server that trickles its reply: every sync returns, reads no more than its bounds, and
//! removes the garbage it met, counted once. And the leases of a tick: one pipeline, an
//! outcome per renewal.

mod common;

use common::{redis_installed, within_wait, Redis, Trickle};
use omnistage_fleet::entry::{self, NodeEntry, ENTRY_BYTES_MAX};
use omnistage_fleet::store::{LeaseAsk, Store, NODES_MAX};
use redis::Commands;
use std::time::Duration;

const TTL_MS: u64 = 190;

fn store(r: &Redis, prefix: &str) -> Store {
    Store::new(&r.url(), Duration::from_secs(1), prefix).expect("store")
}

fn members(con: &mut redis::Connection, key: &str) -> Vec<Vec<u8>> {
    let mut m: Vec<Vec<u8>> = con.smembers(key).unwrap();
    m.sort();
    m
}

/// A valid entry of node `name` (no tenants), as a node would publish it.
fn entry_text(name: &str) -> String {
    entry::encode(&NodeEntry {
        node: name.into(),
        cpu_capacity: 1_000_000_000,
        link_capacity: 0,
        tenants: Vec::new(),
    })
}

#[test]
fn a_non_utf8_member_is_garbage_removed_once() {
    if !redis_installed("non_utf8") {
        return;
    }
    let r = Redis::start();
    let mut con = r.con();
    let _: () = con.sadd("s1:nodes", &[0xffu8][..]).unwrap();
    let mut st = store(&r, "s1:");
    let first = st
        .sync("t1", &entry_text("t1"), TTL_MS)
        .expect("first sync");
    assert_eq!((first.garbage, first.entries.len()), (1, 0));
    assert_eq!(members(&mut con, "s1:nodes"), [b"t1".to_vec()]);
    let second = st
        .sync("t1", &entry_text("t1"), TTL_MS)
        .expect("second sync");
    assert_eq!((second.garbage, second.entries.len()), (0, 0));
}

#[test]
fn a_value_over_the_entry_bound_is_not_read_and_is_garbage() {
    if !redis_installed("huge_value") {
        return;
    }
    let r = Redis::start();
    let mut con = r.con();
    let _: () = redis::cmd("SET")
        .arg("s2:node:big")
        .arg(vec![b'x'; 10 << 20])
        .arg("PX")
        .arg(60_000)
        .query(&mut con)
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg("s2:node:n2")
        .arg(entry_text("n2"))
        .arg("PX")
        .arg(60_000)
        .query(&mut con)
        .unwrap();
    let _: () = con.sadd("s2:nodes", &["big", "n2"]).unwrap();
    let mut st = store(&r, "s2:");
    let read = st.sync("t1", &entry_text("t1"), TTL_MS).expect("sync");
    assert!(
        read.entries.iter().all(|(_, v)| v.len() <= ENTRY_BYTES_MAX),
        "a value over ENTRY_BYTES_MAX was read"
    );
    let names: Vec<&str> = read.entries.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["n2"]);
    assert_eq!(read.garbage, 1);
    assert!(!con.exists::<_, bool>("s2:node:big").unwrap(), "deleted");
    assert_eq!(
        members(&mut con, "s2:nodes"),
        [b"n2".to_vec(), b"t1".to_vec()]
    );
}

#[test]
fn an_entry_without_a_ttl_or_with_one_past_any_nodes_is_garbage_removed() {
    if !redis_installed("ghost") {
        return;
    }
    let r = Redis::start();
    let mut con = r.con();
    // Valid entries: one with no TTL, one with a TTL of a day (no node sets more than 114 s).
    let _: () = con.set("s3:node:ghost", entry_text("ghost")).unwrap();
    let _: () = redis::cmd("SET")
        .arg("s3:node:day")
        .arg(entry_text("day"))
        .arg("PX")
        .arg(86_400_000)
        .query(&mut con)
        .unwrap();
    // A node whose interval is the longest allowed (60 s): its entry is no garbage.
    let _: () = redis::cmd("SET")
        .arg("s3:node:slow")
        .arg(entry_text("slow"))
        .arg("PX")
        .arg(114_000)
        .query(&mut con)
        .unwrap();
    let _: () = con.sadd("s3:nodes", &["ghost", "day", "slow"]).unwrap();
    let mut st = store(&r, "s3:");
    let read = st.sync("t1", &entry_text("t1"), TTL_MS).expect("sync");
    let names: Vec<&str> = read.entries.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["slow"]);
    assert_eq!(read.garbage, 2);
    assert!(!con.exists::<_, bool>("s3:node:ghost").unwrap());
    assert!(!con.exists::<_, bool>("s3:node:day").unwrap());
    assert_eq!(
        members(&mut con, "s3:nodes"),
        [b"slow".to_vec(), b"t1".to_vec()]
    );
    let again = st.sync("t1", &entry_text("t1"), TTL_MS).expect("sync");
    assert_eq!((again.garbage, again.entries.len()), (0, 1));
}

#[test]
fn a_nodes_set_past_the_bound_is_read_in_batches_and_cleaned_over_syncs() {
    if !redis_installed("big_set") {
        return;
    }
    let r = Redis::start();
    let mut con = r.con();
    // 3 × NODES_MAX members: valid names whose entries are gone, and names that are none.
    let gone: Vec<String> = (0..2 * NODES_MAX).map(|i| format!("gone{i}")).collect();
    let bad: Vec<String> = (0..NODES_MAX).map(|i| format!("bad name {i}")).collect();
    let _: () = con.sadd("s4:nodes", &gone).unwrap();
    let _: () = con.sadd("s4:nodes", &bad).unwrap();
    let mut st = store(&r, "s4:");
    let mut garbage = 0;
    // Each sync removes one batch of about NODES_MAX; 3 × NODES_MAX go within a few more
    // syncs than 3 (SSCAN's batches are approximate).
    for _ in 0..20 {
        let read = st.sync("t1", &entry_text("t1"), TTL_MS).expect("sync");
        assert!(read.entries.len() <= NODES_MAX);
        garbage += read.garbage;
        if con.scard::<_, usize>("s4:nodes").unwrap() == 1 {
            break;
        }
    }
    assert_eq!(members(&mut con, "s4:nodes"), [b"t1".to_vec()]);
    assert_eq!(
        garbage, NODES_MAX as u64,
        "the bad names, each counted once"
    );
}

#[test]
fn a_user_password_and_database_in_the_url_are_used() {
    if !redis_installed("auth") {
        return;
    }
    let r = Redis::start();
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("fleet")
        .arg("on")
        .arg(">secret")
        .arg("~*")
        .arg("+@all")
        .query(&mut r.con())
        .expect("acl");
    let url = format!("redis://fleet:secret@127.0.0.1:{}/3", r.port);
    let mut st = Store::new(&url, Duration::from_secs(1), "s5:").expect("store");
    st.sync("t1", &entry_text("t1"), TTL_MS).expect("sync");
    let mut con = r.con();
    let _: () = redis::cmd("SELECT").arg(3).query(&mut con).unwrap();
    assert!(con.exists::<_, bool>("s5:node:t1").unwrap());
    let wrong = format!("redis://fleet:wrong@127.0.0.1:{}/3", r.port);
    let mut st = Store::new(&wrong, Duration::from_secs(1), "s5:").expect("store");
    assert!(st.sync("t1", &entry_text("t1"), TTL_MS).is_err());
}

#[test]
fn a_sync_against_a_trickling_server_ends_with_an_error() {
    let t = Trickle::start();
    let url = t.url();
    let r = within_wait(move || {
        let mut st = Store::new(&url, Duration::from_millis(100), "s6:").expect("store");
        st.sync("t1", &entry_text("t1"), TTL_MS).map(|_| ())
    });
    assert!(
        r.expect("the sync returned").is_err(),
        "a reply never finished"
    );
}

#[test]
fn leases_go_in_one_pipeline_each_with_its_own_outcome_and_the_script_is_reloaded() {
    if !redis_installed("leases") {
        return;
    }
    let r = Redis::start();
    // The buckets of x are allowed, those of y not (NOPERM for y's renewal alone).
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("default")
        .arg("resetkeys")
        .arg("~s7:cap:x:*")
        .query(&mut r.con())
        .expect("acl");
    let mut st = store(&r, "s7:");
    let ask = |tenant: &str, kind: &str, ask| LeaseAsk {
        key: st.cap_key(tenant, kind),
        rate_per_s: 1,
        burst: 10,
        ask,
    };
    let asks = [ask("x", "req", 4), ask("y", "req", 4), ask("x", "bytes", 3)];
    // A Redis that lost its scripts (restarted, flushed): loaded again, each ask run once.
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut r.con())
        .unwrap();
    let out = st.leases(&asks).expect("a reply");
    assert_eq!(out.len(), 3);
    assert_eq!(out[0].as_ref().ok(), Some(&(4, false)));
    assert!(
        out[1].as_ref().is_err_and(|e| e.code() == Some("NOPERM")),
        "{:?}",
        out[1]
    );
    assert_eq!(out[2].as_ref().ok(), Some(&(3, false)));
    // x's request bucket gave 4 of 10 once (not twice): 6 left, bar a refill of 1 a second.
    let (g, _) = st.lease(&asks[0].key, 1, 10, 100).expect("lease");
    assert!((6..=7).contains(&g), "{g}");
    assert!(st.leases(&[]).expect("nothing to ask").is_empty());
}

#[test]
fn a_host_name_is_refused_not_resolved() {
    // The system's resolver has no deadline: a name is refused when the store is made, with
    // the URL named, and never resolved on the fleet thread.
    for name in ["redis://localhost:6379", "redis://redis.internal:6379/2"] {
        let e = Store::new(name, Duration::from_secs(1), "s7:")
            .err()
            .unwrap_or_else(|| panic!("{name} accepted"));
        assert!(
            e.contains(name) && e.contains("must be an IP address"),
            "{name}: {e}"
        );
    }
    for ip in ["redis://127.0.0.1:6379", "redis://[::1]:6379"] {
        assert!(
            Store::new(ip, Duration::from_secs(1), "s7:").is_ok(),
            "{ip}"
        );
    }
}

/// A fake Redis on a loopback port that accepts every connection and closes it at once,
/// counting them: a Redis that is down as far as a sync can tell, whose connects can be
/// counted (a closed port's cannot). Stopped when dropped.
struct Dropper {
    port: u16,
    accepted: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Dropper {
    fn start() -> Dropper {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        use std::sync::Arc;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("addr").port();
        let accepted = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (a, s) = (accepted.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    // Counted before the close: the client's call ends only after it.
                    Ok((conn, _)) => {
                        a.fetch_add(1, Ordering::SeqCst);
                        drop(conn);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(1)),
                }
            }
        });
        Dropper {
            port,
            accepted,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Dropper {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn a_redis_that_fails_every_call_is_reconnected_to_after_a_backoff_not_every_sync() {
    // 20 syncs driven back to back against a Redis that drops every connection. The store's
    // backoff base is 2 × its 1 s deadline (a node's interval): the first failure is retried
    // at once, the second holds connects back for 1..=2 s, the third for 2..=4 s, and so on.
    // So the syncs try 2 connections if they take under 1 s (a few ms here), and never more
    // than 2 plus one per second they took; without a backoff each sync tried one (20).
    let d = Dropper::start();
    let url = format!("redis://127.0.0.1:{}", d.port);
    let mut st = Store::new(&url, Duration::from_secs(1), "s8:").expect("store");
    let t = std::time::Instant::now();
    for i in 0..20 {
        assert!(
            st.sync("t1", &entry_text("t1"), TTL_MS).is_err(),
            "sync {i} went through"
        );
    }
    let took = t.elapsed();
    let tried = d.accepted.load(std::sync::atomic::Ordering::SeqCst);
    assert!(tried >= 2, "{tried} connections");
    assert!(
        tried <= 2 + took.as_secs(),
        "{tried} connections in 20 syncs over {took:?}"
    );
    if took < Duration::from_secs(1) {
        assert_eq!(tried, 2, "over {took:?}");
    }
}

/// A fake Redis on a loopback port that answers every command of its one connection with
/// `reply`, keeping what it was sent. Stopped when dropped (it ends with its connection).
fn fake_replying(reply: &'static [u8]) -> (u16, std::thread::JoinHandle<Vec<u8>>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let t = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        s.set_read_timeout(Some(common::WAIT)).unwrap();
        let (mut all, mut cmd) = (Vec::new(), Vec::new());
        let mut buf = [0u8; 4096];
        loop {
            let n = match s.read(&mut buf) {
                Ok(0) | Err(_) => return all,
                Ok(n) => n,
            };
            cmd.extend_from_slice(&buf[..n]);
            all.extend_from_slice(&buf[..n]);
            // A command is `*N` and N `$len`/data line pairs (no CRLF in this test's data).
            let lines = cmd.windows(2).filter(|w| w == b"\r\n").count();
            let args: usize =
                std::str::from_utf8(&cmd[1..cmd.iter().position(|&b| b == b'\r').unwrap_or(1)])
                    .ok()
                    .and_then(|x| x.parse().ok())
                    .unwrap_or(usize::MAX / 4);
            if lines > 2 * args {
                cmd.clear();
                if s.write_all(reply).is_err() {
                    return all;
                }
            }
        }
    });
    (port, t)
}

#[test]
fn a_sync_reply_with_numbers_the_script_cannot_return_is_counted_not_trusted() {
    // A server (not Redis: Redis runs the script by its hash) replies a garbage count of
    // u64::MAX, a cursor that is no number and one pair with a name that is no node's. The
    // count once overflowed (a panic in this debug build), and the cursor was kept, so every
    // later SSCAN would have failed.
    let (port, fake) = fake_replying(
        b"*3\r\n$20\r\n18446744073709551615\r\n$3\r\nabc\r\n*2\r\n$3\r\nb:d\r\n$1\r\nx\r\n",
    );
    let url = format!("redis://127.0.0.1:{port}");
    let mut st = Store::new(&url, Duration::from_secs(2), "s9:").expect("store");
    for _ in 0..2 {
        let read = st.sync("t1", &entry_text("t1"), TTL_MS).expect("sync");
        // 1 for the count, 1 for the cursor, 1 for the pair.
        assert_eq!(read.garbage, 3);
        assert!(read.entries.is_empty());
    }
    drop(st);
    let sent = fake.join().expect("fake server");
    let sent = String::from_utf8_lossy(&sent);
    // Both syncs sent the cursor "0": the bad one was not kept.
    assert_eq!(sent.matches("EVALSHA").count(), 2, "{sent}");
    assert!(!sent.contains("\r\nabc\r\n"), "{sent}");
}
