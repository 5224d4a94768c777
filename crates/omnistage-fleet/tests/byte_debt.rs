//! The bytes pool of `fleet_net_cap` is debited once per sync, and only while the cap is on:
//! an uncapped tenant builds no debt that a cap added later would inherit, and a sync whose
//! lease call fails (so the node refills that pool locally in the same tick) does not debit
//! twice.
//!
//! Bytes are charged to the tenant's activity directly (`Runtime::charge_external`), and
//! every assertion reads the pool's balance from a published [`FleetStatus`] (taken at the
//! end of a tick), each awaited with a bounded timeout; no speed is asserted.
//!
//! [`FleetStatus`]: omnistage_http::server::FleetStatus

mod common;

use common::{free_port, redis_installed, wait_for, Redis};
use omnistage::exec::ExternalBytes;
use omnistage_fleet::{FleetNode, NodeConfig};
use omnistage_http::config::{parse_config, Config};
use omnistage_http::server::{Server, ServerOptions};
use std::sync::Arc;
use std::time::Duration;

const SYNC: Duration = Duration::from_millis(50);
/// Far more than a pool can be refilled with in the test (the cap is 1 kB/s).
const SENT: u64 = 1_000_000_000;

fn config(redis_url: &str, cap: bool) -> Config {
    let cap = if cap { "fleet_net_cap = \"1KB/s\"" } else { "" };
    parse_config(&format!(
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
{cap}
"#
    ))
    .expect("config")
}

fn node(server: &Arc<Server>, url: &str, prefix: &str) -> FleetNode {
    FleetNode::start(
        server.clone(),
        NodeConfig {
            redis: url.to_string(),
            node: "t1".into(),
            sync: SYNC,
            prefix: prefix.to_string(),
        },
    )
    .expect("node")
}

/// Charges `bytes` sent to tenant a, once the node has taken its first sample (so the next
/// tick measures them).
fn send(server: &Server, bytes: u64) {
    wait_for("a first status", || server.fleet_status().is_some());
    let rt = server.runtime();
    let id = rt
        .with_activities(|t| t.lookup("/tenants/a"))
        .expect("tenant a");
    rt.charge_external(
        id,
        ExternalBytes {
            net_out: bytes,
            ..Default::default()
        },
    )
    .expect("charge");
}

/// Tenant a's bytes pool balance in the latest status.
fn status_bytes(server: &Server) -> Option<i64> {
    server.fleet_status().and_then(|s| {
        s.tenants
            .iter()
            .find(|t| t.name == "a")
            .map(|t| t.lease_bytes)
    })
}

fn stop(mut node: FleetNode, server: Arc<Server>) {
    node.stop();
    if let Ok(s) = Arc::try_unwrap(server) {
        s.drain(Duration::from_secs(1));
    }
}

#[test]
fn a_cap_added_later_does_not_inherit_what_the_tenant_sent_uncapped() {
    // Nothing listens there: every tick falls back (the refill is local, at the cap).
    let url = format!("redis://127.0.0.1:{}", free_port());
    let server =
        Arc::new(Server::start(config(&url, false), ServerOptions::default()).expect("start"));
    let node = node(&server, &url, "d1:");
    let hooks = server.fleet_tenants()[0].hooks.clone();
    send(&server, SENT);
    assert!(!hooks.bytes.is_limited());
    // The operator adds the cap: the pool starts from nothing, and its refill admits requests.
    // (Whether a tick measured the bytes before the reload or measures them with the cap on,
    // they were sent uncapped: nothing is owed for them.)
    server.reload(config(&url, true)).expect("reload");
    wait_for("the capped tenant admitted", || {
        hooks.bytes.is_limited() && status_bytes(&server).is_some_and(|b| b > 0)
    });
    assert!(hooks.admit());
    stop(node, server);
}

#[test]
fn a_failed_lease_after_a_good_sync_debits_the_bytes_once() {
    if !redis_installed("byte_debt") {
        return;
    }
    let r = Redis::start();
    // Syncs succeed, every lease call is refused (NOPERM: the buckets' keys are not allowed):
    // each tick syncs, renews, fails, refills the pool locally. (Denying EVALSHA would fail
    // the sync too: it is a script.)
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("default")
        .arg("resetkeys")
        .arg("~d2:node:*")
        .arg("~d2:nodes")
        .query(&mut r.con())
        .expect("acl");
    let server =
        Arc::new(Server::start(config(&r.url(), true), ServerOptions::default()).expect("start"));
    let node = node(&server, &r.url(), "d2:");
    let hooks = server.fleet_tenants()[0].hooks.clone();
    wait_for("the cap on", || hooks.bytes.is_limited());
    send(&server, SENT);
    // The first status after the debit: the balance before it was at least 0, and the local
    // refills since only add, so a single debit leaves at least -SENT.
    let mut after = 0;
    wait_for("the bytes debited", || {
        after = status_bytes(&server).unwrap_or(0);
        after < 0
    });
    assert!(after >= -(SENT as i64), "debited twice: {after}");
    stop(node, server);
}
