//! A node against a real `redis-server` of the test's own (skipped with a message when it is
//! not installed): its entry is published with a TTL under 2 × sync_ms (1.9 ×), garbage in
//! Redis is removed and counted once, the lease script grants and takes back tokens
//! atomically, a fleet cap's pool is filled from Redis, other nodes' entries move the local
//! weights (tenants known only from other nodes do not dilute the local configured shares) and
//! a dead node's share comes back when its entry expires, a lease that fails after a good sync
//! leaves the fill in place and refills locally only that cap, with Redis killed the node falls
//! back (configured weights, one episode, the caps refilled locally) and resynchronises when
//! Redis is back, and against a server that never finishes a reply the caps are refilled
//! locally and the node stops; a node whose thread is stuck stops all the same, within its
//! bound. A node refuses an interval it cannot run at.
//!
//! Assertions are on states, each awaited with a bounded timeout; no speed is asserted.

mod common;

use common::{redis_installed, wait_for, within_wait, FullUnixSocket, Redis, Trickle, WAIT};
use omnistage_fleet::entry::{self, NodeEntry, TenantEntry};
use omnistage_fleet::store::Store;
use omnistage_fleet::water::{Demand, WEIGHT_FLOOR, WEIGHT_SCALE};
use omnistage_fleet::{FleetNode, NodeConfig};
use omnistage_http::config::{parse_config, SYNC_MS_MAX};
use omnistage_http::server::{FleetStatus, FleetTenantStatus, Server, ServerOptions};
use redis::Commands;
use std::mem::ManuallyDrop;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SYNC: Duration = Duration::from_millis(50);
/// The sync interval of a test that asserts no fallback episode: each Redis call's deadline is
/// half an interval (`NodeConfig::timeout`), and at SYNC's 25 ms one slow answer from Redis on
/// a loaded machine starts an episode.
const QUIET_SYNC: Duration = Duration::from_millis(200);

fn server(redis_url: &str) -> Arc<Server> {
    server_with(redis_url, "")
}

/// The test server, with `more` appended to its config (more tenants).
fn server_with(redis_url: &str, more: &str) -> Arc<Server> {
    let text = format!(
        r#"
[server]
listen = ["127.0.0.1:0"]
workers = 1

[cluster]
redis = "{redis_url}"
node = "t1"
sync_ms = 50

[[tenant]]
name = "a"
hosts = ["a.test"]
docroot = "."
synthetic = true
weight = 4

[[tenant]]
name = "b"
hosts = ["b.test"]
docroot = "."
synthetic = true
weight = 1

[[tenant]]
name = "c"
hosts = ["c.test"]
docroot = "."
synthetic = true
weight = 1
fleet_rate_per_s = 100
{more}
"#
    );
    Arc::new(
        Server::start(
            parse_config(&text).expect("config"),
            ServerOptions::default(),
        )
        .expect("start"),
    )
}

fn node_config(url: &str, prefix: &str) -> NodeConfig {
    NodeConfig {
        redis: url.to_string(),
        node: "t1".into(),
        sync: SYNC,
        prefix: prefix.to_string(),
    }
}

fn weight(server: &Server, path: &str) -> u32 {
    server.runtime().with_activities(|t| {
        t.lookup(path)
            .and_then(|id| t.get(id))
            .map(|a| a.spec.weight)
            .expect("activity")
    })
}

/// Another node's entry: one core, tenant b backlogged on CPU using `used` ns/s.
fn b_backlogged_on(name: &str, used: u64) -> NodeEntry {
    NodeEntry {
        node: name.into(),
        cpu_capacity: 1_000_000_000,
        link_capacity: 0,
        tenants: vec![TenantEntry {
            name: "b".into(),
            weight: 1,
            cpu: Demand {
                backlogged: true,
                want: 1_000_000_000,
                used,
            },
            link: Demand::default(),
        }],
    }
}

/// Publishes `e` as a node would (refreshed while it lives, a TTL of 2 intervals).
fn publish(con: &mut redis::Connection, prefix: &str, e: &NodeEntry) {
    let _: () = redis::cmd("SET")
        .arg(format!("{prefix}node:{}", e.node))
        .arg(entry::encode(e))
        .arg("PX")
        .arg(2 * SYNC.as_millis() as u64)
        .query(con)
        .unwrap();
    let _: () = con.sadd(format!("{prefix}nodes"), &e.node).unwrap();
}

/// Stops the node and drains the server, which a stopped node no longer holds (the CLI drains
/// only a server it holds alone: a node that kept its reference made `serve` exit without a
/// drain).
fn stop(mut node: FleetNode, server: Arc<Server>) {
    node.stop();
    let s = Arc::try_unwrap(server)
        .ok()
        .expect("a stopped node lets go of the server");
    drop(node);
    s.drain(Duration::from_secs(1));
}

#[test]
fn the_entry_is_published_with_a_ttl_of_at_most_two_intervals_and_withdrawn_on_stop() {
    if !redis_installed("entry_ttl") {
        return;
    }
    let r = Redis::start();
    let server = server(&r.url());
    let cfg = NodeConfig {
        sync: QUIET_SYNC,
        ..node_config(&r.url(), "p1:")
    };
    let node = FleetNode::start(server.clone(), cfg).expect("node");
    let mut con = r.con();
    // The entry's TTL and value read together, until there is an entry: read apart, a stall
    // between them could outlast the TTL (PTTL -2, no value).
    let mut read = (0, None);
    wait_for("the entry", || {
        read = redis::pipe()
            .atomic()
            .pttl("p1:node:t1")
            .get("p1:node:t1")
            .query::<(i64, Option<Vec<u8>>)>(&mut con)
            .unwrap();
        read.1.is_some()
    });
    let (ttl, value) = (read.0, read.1.unwrap());
    assert!(
        ttl > 0 && ttl <= 2 * QUIET_SYNC.as_millis() as i64,
        "pttl {ttl}"
    );
    let parsed = entry::parse("t1", &value);
    assert_eq!(parsed.garbage, 0);
    let e = parsed.entry.expect("an entry");
    assert_eq!(e.cpu_capacity, 1_000_000_000);
    assert_eq!(e.link_capacity, 0);
    let members: Vec<String> = con.smembers("p1:nodes").unwrap();
    assert_eq!(members, ["t1"]);
    // The status the wait saw: a later one could come from a sync after the entry's checks.
    let mut status = None;
    wait_for("a status", || {
        status = server.fleet_status().filter(|s| s.connected && s.syncs > 0);
        status.is_some()
    });
    let s = status.unwrap();
    assert_eq!((s.node.as_str(), s.nodes_seen, s.episodes), ("t1", 1, 0));
    stop(node, server);
    assert!(!con.exists::<_, bool>("p1:node:t1").unwrap(), "withdrawn");
}

#[test]
fn garbage_in_redis_is_removed_and_counted_once() {
    if !redis_installed("garbage") {
        return;
    }
    let r = Redis::start();
    let mut con = r.con();
    // Three pieces of garbage, all there before the node starts, none that lasts: an entry
    // with no TTL (it would never expire), a set member that is no node name, a bucket of
    // another type. The bucket is touched only when the node's pool runs short, which with no
    // requests is its first lease only: written after the start, it could miss it.
    let _: () = con.set("p2:node:junk", "hello").unwrap();
    let _: () = con.sadd("p2:nodes", &["junk", "not a node!"]).unwrap();
    let _: () = con.set("p2:cap:c:req", "not a hash").unwrap();
    let server = server(&r.url());
    let cfg = NodeConfig {
        sync: QUIET_SYNC,
        ..node_config(&r.url(), "p2:")
    };
    let node = FleetNode::start(server.clone(), cfg).expect("node");
    let garbage = || node.counters().garbage.load(Ordering::Relaxed);
    let syncs = || node.counters().syncs.load(Ordering::Relaxed);
    let episodes = || node.counters().episodes.load(Ordering::Relaxed);
    // All three are removed by the first tick that reaches Redis (the sync, then the first
    // lease).
    wait_for("the three pieces removed", || {
        con.smembers::<_, Vec<String>>("p2:nodes")
            .is_ok_and(|m| m == ["t1"])
            && !con.exists::<_, bool>("p2:node:junk").unwrap()
            && redis::cmd("TYPE")
                .arg("p2:cap:c:req")
                .query::<String>(&mut con)
                .is_ok_and(|t| t == "hash")
    });
    // Removed, so counted once: three more good syncs count nothing. (Exactly, unless a call
    // whose reply came past its deadline, an episode, removed a piece uncounted.)
    let seen = syncs();
    wait_for("three more syncs", || syncs() >= seen + 3);
    if episodes() == 0 {
        assert_eq!(garbage(), 3);
    } else {
        assert!(garbage() <= 3, "{}", garbage());
    }
    wait_for("the node carries on", || {
        server
            .fleet_status()
            .is_some_and(|s| s.connected && s.nodes_seen == 1)
    });
    // A nodes set of another type: removed and counted once, and the set is back.
    let (before, episodes_before) = (garbage(), episodes());
    let _: () = con.del("p2:nodes").unwrap();
    let _: () = con.set("p2:nodes", "x").unwrap();
    wait_for("the nodes set replaced", || {
        redis::cmd("TYPE")
            .arg("p2:nodes")
            .query::<String>(&mut con)
            .is_ok_and(|t| t == "set")
    });
    let seen = syncs();
    wait_for("three more syncs", || syncs() >= seen + 3);
    if episodes() == episodes_before {
        assert_eq!(garbage(), before + 1);
    } else {
        assert!(garbage() <= before + 1, "{}", garbage());
    }
    stop(node, server);
}

#[test]
fn the_lease_script_grants_within_the_bucket_and_takes_tokens_back() {
    if !redis_installed("lease_script") {
        return;
    }
    let r = Redis::start();
    let mut st = Store::new(&r.url(), Duration::from_secs(1), "p3:").expect("store");
    let key = st.cap_key("x", "req");
    // A new bucket is full (burst 10): an ask of 4 gets 4, one of 100 the rest (6, and at
    // most what 1 token/s refilled meanwhile).
    let t0 = Instant::now();
    // Whole tokens 1 token/s can have refilled since the first lease (on the test's clock,
    // which runs from before it: calls are usually ms apart, but a stalled machine may take
    // seconds).
    let refilled = || t0.elapsed().as_secs_f64().ceil() as i64;
    assert_eq!(st.lease(&key, 1, 10, 4).unwrap(), (4, false));
    let (g2, garbage) = st.lease(&key, 1, 10, 100).unwrap();
    assert!((6..=6 + refilled()).contains(&g2) && !garbage, "{g2}");
    // Empty: nothing more (bar a refill), and a give-back is taken.
    let (g3, _) = st.lease(&key, 1, 10, 5).unwrap();
    assert!(4 + g2 + g3 <= 10 + refilled(), "{g2} then {g3}");
    assert_eq!(st.lease(&key, 1, 10, -3).unwrap(), (-3, false));
    let (g, _) = st.lease(&key, 1, 10, 3).unwrap();
    assert!((3..=4).contains(&g), "{g}");
    // A bucket whose fields are not numbers is garbage, reset to full.
    let mut con = r.con();
    let _: () = con.hset(&key, "tokens", "lots").unwrap();
    assert_eq!(st.lease(&key, 1, 10, 2).unwrap(), (2, true));
    // Redis down: an error, at once (no hang), and the store reconnects afterwards.
    let port = r.port;
    drop(r);
    assert!(st.lease(&key, 1, 10, 1).is_err());
    let _r = Redis::start_on(port);
    assert_eq!(st.lease(&key, 1, 10, 1).unwrap(), (1, false));
}

#[test]
fn other_nodes_entries_move_the_local_weights_and_a_dead_nodes_share_comes_back() {
    if !redis_installed("fill") {
        return;
    }
    let r = Redis::start();
    let server = server(&r.url());
    let node = FleetNode::start(server.clone(), node_config(&r.url(), "p4:")).expect("node");
    let mut con = r.con();
    // Two other nodes where b is backlogged on CPU and a is absent; this node has no demand
    // of its own, so its weights are the configured shares (a 4 : b 1 : c 1 of 10,000).
    wait_for("configured shares", || {
        weight(&server, "/tenants/a") == 6667 && weight(&server, "/tenants/b") == 1667
    });
    let (n2, n3) = (
        b_backlogged_on("n2", 900_000_000),
        b_backlogged_on("n3", 900_000_000),
    );
    // The status that saw all three, kept: n2's and n3's entries live 2 intervals (100 ms)
    // after this loop's last publish, so a status read after it may already have lost one.
    let mut seen = None;
    wait_for("three nodes seen", || {
        publish(&mut con, "p4:", &n2);
        publish(&mut con, "p4:", &n3);
        // Connected too: a fallback status still counts the nodes seen in the last ticks, but
        // its targets are the configured ones.
        seen = server
            .fleet_status()
            .filter(|s| s.connected && s.nodes_seen == 3);
        seen.is_some()
    });
    let s = seen.unwrap();
    let b = s.tenants.iter().find(|t| t.name == "b").unwrap();
    // b has two thirds of the fleet's CPU as its target, and 1.8 cores of use seen.
    assert!((b.cpu_share_target - 2.0 / 3.0).abs() < 1e-9, "{b:?}");
    assert_eq!(b.cpu_fleet_used_ns_per_s, 1_800_000_000);
    // Node n3 dies: its entry expires and its part of b's target goes with it.
    wait_for("n3 reclaimed", || {
        publish(&mut con, "p4:", &n2);
        server.fleet_status().is_some_and(|s| {
            s.nodes_seen == 2
                && s.tenants
                    .iter()
                    .any(|t| t.name == "b" && (t.cpu_share_target - 0.5).abs() < 1e-9)
        })
    });
    stop(node, server);
}

#[test]
fn skewed_cpu_demand_gives_the_confined_tenant_this_node() {
    if !redis_installed("skew") {
        return;
    }
    let r = Redis::start();
    let server = server(&r.url());
    let addr = server.local_addrs()[0];
    let node = FleetNode::start(server.clone(), node_config(&r.url(), "p5:")).expect("node");
    let mut con = r.con();
    // a and b both backlogged here (closed-loop CPU burners), b also backlogged on two other
    // nodes: the fill gives this node to a, and b keeps the floor.
    let stop_load = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = Vec::new();
    for host in ["a.test", "a.test", "b.test", "b.test"] {
        let stop_load = stop_load.clone();
        clients.push(std::thread::spawn(move || {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect(addr).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            // One write per request, sent at once: `write!` wrote the head in three pieces,
            // and Nagle held the later ones until the server's delayed ACK (up to 40 ms), so
            // the burners kept the worker about 20 % busy, neither tenant looked backlogged,
            // and the test failed about one run in four.
            s.set_nodelay(true).unwrap();
            let request = format!("GET /_burn?us=2000 HTTP/1.1\r\nHost: {host}\r\n\r\n");
            let mut buf = [0u8; 4096];
            while !stop_load.load(Ordering::Relaxed) {
                s.write_all(request.as_bytes()).unwrap();
                let mut got = Vec::new();
                while !got.ends_with(b"burned\n") {
                    let n = s.read(&mut buf).expect("read");
                    assert!(n > 0);
                    got.extend_from_slice(&buf[..n]);
                }
            }
        }));
    }
    let others = [
        b_backlogged_on("n2", 1_000_000_000),
        b_backlogged_on("n3", 1_000_000_000),
    ];
    wait_for("a gets this node, b the floor", || {
        for e in &others {
            publish(&mut con, "p5:", e);
        }
        weight(&server, "/tenants/a") == WEIGHT_SCALE
            && weight(&server, "/tenants/b") == WEIGHT_FLOOR
    });
    stop_load.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    stop(node, server);
}

#[test]
fn redis_killed_falls_back_and_restarted_resyncs() {
    if !redis_installed("fallback") {
        return;
    }
    let mut r = Redis::start();
    let port = r.port;
    let server = server(&r.url());
    let node = FleetNode::start(server.clone(), node_config(&r.url(), "p6:")).expect("node");
    let c = server.fleet_tenants()[2].hooks.clone();
    // The capped tenant's pool is limited and filled from Redis (its first lease: 1 token,
    // no demand yet).
    wait_for("a lease", || {
        c.requests.is_limited() && c.requests.tokens() >= 1
    });
    let mut con = r.con();
    assert!(con.exists::<_, bool>("p6:cap:c:req").unwrap());
    // Moves a's weight away from the configured one, as a fill would, to see it come back.
    let move_a_away = || {
        server
            .runtime()
            .set_activity(
                "/tenants/a",
                omnistage::activity::ActivitySpec::weight(1234),
            )
            .unwrap()
    };
    move_a_away();
    // Episodes so far, from a connected status: with a 25 ms deadline per Redis call, a slow
    // answer before the kill may already have started (and ended) one, and one still open at
    // the kill would count the kill's failures as its own (then no new episode would come).
    let mut before = 0;
    wait_for("connected before the kill", || {
        server.fleet_status().is_some_and(|s| {
            before = s.episodes;
            s.connected
        })
    });
    r.kill();
    wait_for("fallback", || {
        server
            .fleet_status()
            .is_some_and(|s| !s.connected && s.episodes > before)
    });
    let outage = node.counters().episodes.load(Ordering::Relaxed);
    // Configured shares again, and the cap refilled locally (cap / 1 node seen): emptied, the
    // pool has tokens again while Redis is down.
    wait_for("configured weight", || weight(&server, "/tenants/a") == 4);
    assert!(c.requests.is_limited());
    while c.requests.try_take(1) {}
    wait_for("the cap refilled locally", || c.requests.tokens() > 0);
    assert!(server.fleet_status().is_some_and(|s| !s.connected));
    // Moved away again and put back by a later sync of the same outage.
    move_a_away();
    wait_for("configured weight again", || {
        weight(&server, "/tenants/a") == 4
    });
    // One episode for the whole outage (Redis is dead: nothing but the kill can have counted).
    assert_eq!(node.counters().episodes.load(Ordering::Relaxed), outage);
    let syncs = node.counters().syncs.load(Ordering::Relaxed);
    let _r = Redis::start_on(port);
    let mut resynced = None;
    wait_for("resync", || {
        resynced = server
            .fleet_status()
            .filter(|s| s.connected && s.syncs > syncs);
        resynced.is_some()
    });
    // Nor does the resync count one. A status carries the counters at the end of its sync,
    // and a sync that succeeds starts no episode, so the first one after the restart shows
    // the outage's count exactly; a later one may show a new episode of a slow answer since,
    // so the count is judged only when this loop saw the first (it polls 5 times an interval).
    let s = resynced.unwrap();
    if s.syncs == syncs + 1 {
        assert_eq!(s.episodes, outage, "{s:?}");
    }
    // The state is back in the new Redis.
    let mut con = _r.con();
    wait_for("entry republished", || {
        con.exists::<_, bool>("p6:node:t1").unwrap()
    });
    stop(node, server);
}

#[test]
fn a_node_refuses_an_interval_it_cannot_run_at() {
    // Refused before the thread starts; the accepted ones fall back (nothing listens there).
    let url = "redis://127.0.0.1:1";
    let server = server(url);
    for sync in [
        Duration::ZERO,
        Duration::from_micros(500),
        Duration::from_millis(SYNC_MS_MAX as u64 + 1),
    ] {
        let cfg = NodeConfig {
            sync,
            ..node_config(url, "p10:")
        };
        let r = FleetNode::start(server.clone(), cfg);
        assert!(r.is_err(), "{sync:?} accepted");
    }
    // The bounds themselves are accepted.
    for sync in [
        Duration::from_millis(1),
        Duration::from_millis(SYNC_MS_MAX as u64),
    ] {
        let cfg = NodeConfig {
            sync,
            ..node_config(url, "p10:")
        };
        let mut node = FleetNode::start(server.clone(), cfg).expect("accepted");
        node.stop();
    }
}

/// Tenant `name`'s row in the latest status.
fn row(s: &FleetStatus, name: &str) -> FleetTenantStatus {
    s.tenants
        .iter()
        .find(|t| t.name == name)
        .cloned()
        .expect("tenant row")
}

#[test]
fn against_a_server_that_never_finishes_a_reply_the_caps_refill_locally_and_the_node_stops() {
    let t = Trickle::start();
    let server = server(&t.url());
    // Not dropped by a failing assertion: on a node that hangs, the drop would hang the test.
    // A deadline per Redis call of 100 ms: each byte (20 ms apart) comes well within it, so a
    // timeout per read never fires.
    let cfg = NodeConfig {
        sync: QUIET_SYNC,
        ..node_config(&t.url(), "p7:")
    };
    let node = ManuallyDrop::new(FleetNode::start(server.clone(), cfg).expect("node"));
    let c = server.fleet_tenants()[2].hooks.clone();
    wait_for("the cap on and refilled locally", || {
        c.requests.is_limited() && c.requests.tokens() > 0
    });
    while c.requests.try_take(1) {}
    wait_for("refilled again", || c.requests.tokens() > 0);
    wait_for("a fallback status", || {
        server
            .fleet_status()
            .is_some_and(|s| !s.connected && s.episodes == 1 && s.syncs == 0)
    });
    let stopped = within_wait(move || {
        let mut node = ManuallyDrop::into_inner(node);
        node.stop();
    });
    assert!(stopped.is_some(), "stop did not return within {WAIT:?}");
    // Stopped: configured weights, caps off.
    assert!(!c.requests.is_limited());
    assert_eq!(weight(&server, "/tenants/a"), 4);
}

#[test]
fn a_node_whose_thread_is_stuck_stops_within_its_bound_and_puts_the_local_state_back() {
    // The fleet thread's first sync connects to a Unix socket whose backlog is full: such a
    // connect has no deadline (as host-name resolution has none), and the thread stays in it.
    // (The config takes redis:// URLs only; a NodeConfig takes any the redis crate parses.)
    let sock = FullUnixSocket::bind("omnistage-fleet-stuck");
    let url = format!("redis+unix://{}", sock.path.display());
    let server = server("redis://127.0.0.1:1");
    let node = ManuallyDrop::new(
        FleetNode::start(server.clone(), node_config(&url, "p11:")).expect("node"),
    );
    // What a fill and a lease would have set, for the stop to undo.
    server
        .runtime()
        .set_activity(
            "/tenants/a",
            omnistage::activity::ActivitySpec::weight(1234),
        )
        .unwrap();
    let c = server.fleet_tenants()[2].hooks.clone();
    c.requests.set_limited(true);
    let stopped = within_wait(move || {
        let mut node = ManuallyDrop::into_inner(node);
        node.stop();
    });
    assert!(stopped.is_some(), "stop did not return within {WAIT:?}");
    assert_eq!(weight(&server, "/tenants/a"), 4);
    assert!(!c.requests.is_limited());
    assert!(server.fleet_status().is_none());
    // Dropping the socket wakes the thread, which then ends by itself.
    drop(sock);
}

#[test]
fn a_failed_lease_after_a_good_sync_keeps_the_fill_and_refills_only_the_failed_cap() {
    if !redis_installed("lease_fails") {
        return;
    }
    let r = Redis::start();
    // Entries and c's bucket are allowed, d's bucket is not (NOPERM): every sync goes through,
    // c's lease too, d's fails.
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("default")
        .arg("resetkeys")
        .arg("~p8:node:*")
        .arg("~p8:nodes")
        .arg("~p8:cap:c:*")
        .query(&mut r.con())
        .expect("acl");
    let d = r#"
[[tenant]]
name = "d"
hosts = ["d.test"]
docroot = "."
synthetic = true
weight = 1
fleet_rate_per_s = 100
"#;
    let server = server_with(&r.url(), d);
    let node = FleetNode::start(server.clone(), node_config(&r.url(), "p8:")).expect("node");
    let mut con = r.con();
    let n2 = b_backlogged_on("n2", 900_000_000);
    // d is asked for requests (its pool's demand, so every renewal asks Redis for more and
    // fails); what d admits came from local refills, its only source.
    let dh = server.fleet_tenants()[3].hooks.clone();
    let mut admitted = 0;
    // The status of a tick whose sync went through (it saw n2) and whose lease of d failed,
    // after d was refilled locally: the fill stands (b's target is n2's core; a, with no
    // demand anywhere, has its configured share as a fill weight, 4 of 7 of 10,000, not its
    // configured weight 4 of a fallback), and c, renewed from Redis (its target is 1 token: no
    // demand), was not refilled locally on top (which gives it 2 or more a tick). Awaited as a
    // whole: a tick whose sync or whole pipeline failed (a reply past its deadline on a loaded
    // machine) publishes another status, a fallback's; the old code published only those.
    let mut seen = None;
    wait_for("the fill kept and only d refilled locally", || {
        publish(&mut con, "p8:", &n2);
        if dh.requests.try_take(1) {
            admitted += 1;
        }
        seen = server.fleet_status().filter(|s| {
            !s.connected
                && s.nodes_seen == 2
                && (row(s, "b").cpu_share_target - 0.5).abs() < 1e-9
                && row(s, "a").cpu_weight == 5714
                && row(s, "c").lease_requests <= 2
        });
        admitted > 0 && seen.is_some()
    });
    let s = seen.unwrap();
    assert!(s.episodes >= 1);
    stop(node, server);
}

#[test]
fn tenants_known_only_from_other_nodes_do_not_dilute_the_local_configured_shares() {
    if !redis_installed("dilute") {
        return;
    }
    let r = Redis::start();
    let server = server(&r.url());
    let cfg = NodeConfig {
        sync: QUIET_SYNC,
        ..node_config(&r.url(), "p9:")
    };
    let node = FleetNode::start(server.clone(), cfg).expect("node");
    let mut con = r.con();
    // Another node where tenant z, unknown here, is backlogged with the largest weight.
    let mut n2 = b_backlogged_on("n2", 900_000_000);
    n2.tenants[0].name = "z".into();
    n2.tenants[0].weight = WEIGHT_SCALE;
    let mut seen = None;
    wait_for("two nodes seen", || {
        publish(&mut con, "p9:", &n2);
        seen = server
            .fleet_status()
            .filter(|s| s.connected && s.nodes_seen == 2);
        seen.is_some()
    });
    // Nobody has demand here: a, b, c get their configured shares among themselves (4 : 1 : 1
    // of 10,000), whatever z weighs.
    let s = seen.unwrap();
    let w: Vec<u32> = ["a", "b", "c"]
        .iter()
        .map(|n| row(&s, n).cpu_weight)
        .collect();
    assert_eq!(w, [6667, 1667, 1667], "{s:?}");
    stop(node, server);
}

#[test]
fn a_panic_on_the_fleet_thread_is_recovered_counted_and_the_node_syncs_on() {
    if !redis_installed("panic") {
        return;
    }
    let r = Redis::start();
    let server = server(&r.url());
    let node = FleetNode::start(server.clone(), node_config(&r.url(), "p13:")).expect("node");
    // The fill moves a's weight away from its configured 4 (alone, a's share of 4 + 1 + 1 on
    // the 10,000 scale).
    wait_for("the fill's weight", || weight(&server, "/tenants/a") != 4);
    let syncs = node.counters().syncs.load(Ordering::Relaxed);
    node.panic_once();
    // The thread's next good sync panics after its fill; the restart is counted in the status.
    let mut seen = None;
    wait_for("the restart in the status", || {
        seen = server.fleet_status().filter(|s| s.restarts == 1);
        seen.is_some()
    });
    let s = seen.unwrap();
    // The recovery's own status says not connected, with the weights it put back (read back
    // from the runtime); the next tick comes 1 s later (`RESTART_MIN`), so this poll (every
    // 10 ms) sees that status first but for a stall of the test thread, then judged not at all.
    if !s.connected {
        assert_eq!(row(&s, "a").cpu_weight, 4, "{s:?}");
        assert_eq!(row(&s, "b").cpu_weight, 1, "{s:?}");
    }
    // The thread syncs on after the restart: the fill is back.
    wait_for("syncs after the restart", || {
        server
            .fleet_status()
            .is_some_and(|s| s.connected && s.restarts == 1 && s.syncs > syncs)
    });
    wait_for("the fill's weight again", || {
        weight(&server, "/tenants/a") != 4
    });
    assert_eq!(node.counters().restarts.load(Ordering::Relaxed), 1);
    stop(node, server);
}
