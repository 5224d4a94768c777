//! `Store` against a real `redis-server` of the test's own (skipped with a message when it is
//! not installed), with the URL's user, password and database, and against a fake server that
//! trickles its reply: the sync returns, with an error.

mod common;

use common::{redis_installed, within_wait, Redis, Trickle};
use omnistage_fleet::entry::{self, NodeEntry};
use omnistage_fleet::store::Store;
use redis::Commands;
use std::time::Duration;

const TTL_MS: u64 = 190;

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
