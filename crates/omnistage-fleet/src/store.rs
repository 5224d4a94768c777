//! store: the fleet's state in Redis, through the `redis` crate's command and script types on a
//! connection of our own ([`crate::conn`]).
//!
//! Keys (all under one prefix, `omnistage:fleet:` by default):
//!
//! ```text
//! <prefix>node:<node>        string   the node's entry (entry.rs), PX 1.9 × sync_ms
//! <prefix>nodes              set      names of nodes that have published (members whose
//!                                     entry expired are removed by whoever reads them)
//! <prefix>cap:<tenant>:req   hash     a fleet cap's token bucket: tokens, ts (µs, Redis TIME)
//! <prefix>cap:<tenant>:bytes hash     the same for fleet_net_cap
//! ```
//!
//! Every call has a deadline for its whole exchange (connect and handshake, one command, one
//! pipeline, one script): `timeout`, however the server trickles its reply, so a sync that
//! meets a slow, dead or hostile Redis gives up within a few timeouts and the node falls back.
//! Any error drops the connection; the next sync connects afresh (a restarted Redis is found
//! again, and the Lua script is loaded again on `NOSCRIPT`).
//!
//! Garbage is never trusted: a member of the nodes set that is not a node name, a key of the
//! wrong type, or a bucket whose fields are not numbers is removed and counted.

use crate::conn::DeadlineConnection;
use crate::entry;
use redis::{Commands, ConnectionInfo, ConnectionLike, RedisError};
use std::time::Duration;

/// Most nodes read per sync (members beyond it are ignored, in name order).
pub const NODES_MAX: usize = 1024;
/// How long an idle cap's bucket is kept (a fresh bucket starts full, which is what an idle
/// one is after `burst / rate`).
const BUCKET_TTL_MS: u64 = 60_000;

/// The lease script: one token bucket per cap, refilled at `rate` per second from Redis's own
/// clock, holding at most `burst`; `ask > 0` takes up to `ask` whole tokens, `ask < 0` gives
/// `-ask` back. Returns `{granted, garbage}` (garbage = 1 when the stored state was not a
/// bucket and was reset). Runs atomically (a script is one command to Redis).
const LEASE_LUA: &str = r#"
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local ask = tonumber(ARGV[3])
local ttl = tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local garbage = 0
local v = redis.pcall('HMGET', KEYS[1], 'tokens', 'ts')
if type(v) == 'table' and v.err then
  redis.call('DEL', KEYS[1])
  garbage = 1
  v = {false, false}
end
local tokens = tonumber(v[1])
local ts = tonumber(v[2])
if (v[1] or v[2]) and (tokens == nil or ts == nil or tokens ~= tokens or ts ~= ts
    or tokens > burst or tokens < -burst) then
  garbage = 1
end
if garbage == 1 or tokens == nil or ts == nil then
  tokens = burst
  ts = now
end
if now > ts then
  tokens = math.min(burst, tokens + (now - ts) * rate / 1000000)
end
local granted = 0
if ask > 0 then
  granted = math.floor(math.min(ask, tokens))
  if granted < 0 then granted = 0 end
  tokens = tokens - granted
elseif ask < 0 then
  tokens = math.min(burst, tokens - ask)
  granted = ask
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', tokens), 'ts', string.format('%.0f', now))
redis.call('PEXPIRE', KEYS[1], ttl)
return {granted, garbage}
"#;

/// What one sync read: every live node's entry value, and the garbage removed on the way.
#[derive(Debug, Default)]
pub struct Read {
    /// `(node, value)` for every node whose key was still there.
    pub entries: Vec<(String, Vec<u8>)>,
    /// Set members that were not node names.
    pub garbage: u64,
}

/// A connection to the fleet's Redis, made lazily and dropped on any error.
pub struct Store {
    info: ConnectionInfo,
    con: Option<DeadlineConnection>,
    timeout: Duration,
    prefix: String,
    script: redis::Script,
}

impl Store {
    /// A store for `url` (checked here, not connected yet).
    pub fn new(url: &str, timeout: Duration, prefix: &str) -> Result<Store, String> {
        let client = redis::Client::open(url).map_err(|e| format!("redis {url:?}: {e}"))?;
        Ok(Store {
            info: client.get_connection_info().clone(),
            con: None,
            timeout,
            prefix: prefix.to_string(),
            script: redis::Script::new(LEASE_LUA),
        })
    }

    fn node_key(&self, node: &str) -> String {
        format!("{}node:{node}", self.prefix)
    }

    fn nodes_key(&self) -> String {
        format!("{}nodes", self.prefix)
    }

    /// The bucket key of a tenant's cap (`kind`: `req` or `bytes`).
    pub fn cap_key(&self, tenant: &str, kind: &str) -> String {
        format!("{}cap:{tenant}:{kind}", self.prefix)
    }

    /// Runs `f` on the connection (connecting first if there is none); an error drops it
    /// (the next call reconnects).
    fn with<T>(
        &mut self,
        f: impl FnOnce(&mut DeadlineConnection, &Store) -> Result<T, RedisError>,
    ) -> Result<T, RedisError> {
        let mut con = match self.con.take() {
            Some(c) => c,
            None => DeadlineConnection::connect(&self.info, self.timeout)?,
        };
        let r = f(&mut con, self);
        if r.is_ok() && con.is_open() {
            self.con = Some(con);
        }
        r
    }

    /// Publishes this node's entry (expiring after `ttl_ms`) and reads every node's.
    pub fn sync(&mut self, node: &str, value: &str, ttl_ms: u64) -> Result<Read, RedisError> {
        self.with(|con, st| {
            let nodes_key = st.nodes_key();
            let (members,): (Vec<String>,) = redis::pipe()
                .cmd("SET")
                .arg(st.node_key(node))
                .arg(value)
                .arg("PX")
                .arg(ttl_ms.max(1))
                .ignore()
                .sadd(&nodes_key, node)
                .ignore()
                .smembers(&nodes_key)
                .query(con)?;
            let mut read = Read::default();
            let mut names: Vec<String> = Vec::with_capacity(members.len().min(NODES_MAX));
            let mut bad: Vec<String> = Vec::new();
            for m in members {
                if entry::valid_node(&m) {
                    names.push(m);
                } else {
                    read.garbage += 1;
                    bad.push(m);
                }
            }
            names.sort_unstable();
            names.truncate(NODES_MAX);
            let keys: Vec<String> = names.iter().map(|n| st.node_key(n)).collect();
            let values: Vec<Option<Vec<u8>>> = if keys.is_empty() {
                Vec::new()
            } else {
                redis::cmd("MGET").arg(&keys).query(con)?
            };
            for (n, v) in names.into_iter().zip(values) {
                match v {
                    Some(v) => read.entries.push((n, v)),
                    // Its key expired: the node is gone (it adds itself again if it returns).
                    None => bad.push(n),
                }
            }
            if !bad.is_empty() {
                let _: () = con.srem(&nodes_key, &bad)?;
            }
            Ok(read)
        })
    }

    /// Renews a lease: asks the bucket at `key` for `ask` tokens (negative: gives them back).
    /// Returns `(granted, garbage)`.
    pub fn lease(
        &mut self,
        key: &str,
        rate_per_s: u64,
        burst: u64,
        ask: i64,
    ) -> Result<(i64, bool), RedisError> {
        self.with(|con, st| {
            let (granted, garbage): (i64, i64) = st
                .script
                .key(key)
                .arg(rate_per_s)
                .arg(burst)
                .arg(ask)
                .arg(BUCKET_TTL_MS)
                .invoke(con)?;
            let (granted, out_of_range) = crate::lease::clamp_grant(ask, granted);
            Ok((granted, garbage != 0 || out_of_range))
        })
    }

    /// Removes the nodes set (after it was found holding another type: garbage).
    pub fn delete_nodes_set(&mut self) -> Result<(), RedisError> {
        self.with(|con, st| con.del(st.nodes_key()))
    }

    /// Withdraws this node's entry at once (a clean stop; a dead node's expires instead).
    pub fn withdraw(&mut self, node: &str) -> Result<(), RedisError> {
        self.with(|con, st| {
            redis::pipe()
                .del(st.node_key(node))
                .ignore()
                .srem(st.nodes_key(), node)
                .ignore()
                .query(con)
        })
    }

    /// Forgets the connection (the next call reconnects).
    pub fn reset(&mut self) {
        self.con = None;
    }
}
