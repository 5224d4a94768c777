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
//! again, and the Lua scripts are loaded again on `NOSCRIPT`), but after two or more failures
//! in a row only once a bounded, jittered exponential [`Backoff`] allows (at most two sync
//! intervals, [`BACKOFF_MAX_INTERVALS`], and [`BACKOFF_MAX`]): a Redis that is down costs one
//! connect attempt per backoff period, not one (and, for an unreachable host, one connect
//! deadline) per sync, and one that comes back is used again within three intervals.
//!
//! One sync is one script ([`SYNC_LUA`]) that publishes this node's entry and reads the others',
//! and that bounds what it sends back: at most [`NODES_MAX`] entries, each at most
//! [`entry::ENTRY_BYTES_MAX`]. All leases of a sync are one pipeline of the lease script.
//!
//! Garbage is never trusted: a member of the nodes set that is not a node name (non-UTF-8
//! included), a node key with no TTL or one longer than any node sets ([`ENTRY_TTL_MAX_MS`]),
//! of the wrong type or longer than [`entry::ENTRY_BYTES_MAX`], a nodes set of the wrong type,
//! or a bucket whose fields are not numbers is removed and counted.

use crate::conn::DeadlineConnection;
use crate::entry;
use redis::{ConnectionInfo, ConnectionLike, RedisError};
use std::time::{Duration, Instant};

/// Most nodes read per sync. A nodes set with more members (garbage, or more nodes than the
/// fleet is built for) is read one `SSCAN` batch of about this many per sync, from a cursor
/// kept across syncs, so the garbage in it is removed within `members / NODES_MAX` syncs while
/// no sync reads more than this (the fill then sees only the nodes of that batch).
pub const NODES_MAX: usize = 1024;
/// The longest TTL a node gives its entry: that of the longest `sync_ms` a node accepts
/// ([`crate::node::SYNC_MAX`]). A longer TTL, or none, is garbage: such a key never expires in
/// time, so a dead node would hold its share for ever. The bound is not this node's own TTL
/// because nodes may run different `sync_ms`, and a slower node's live entry is not garbage.
pub const ENTRY_TTL_MAX_MS: u64 =
    crate::node::entry_ttl_ms(crate::node::SYNC_MAX.as_millis() as u64);
/// Members removed per `SREM` inside the sync script (Lua's `unpack` is limited by its C
/// stack, about 8,000 values).
const SREM_BATCH: usize = 1000;
/// How long an idle cap's bucket is kept (a fresh bucket starts full, which is what an idle
/// one is after `burst / rate`).
const BUCKET_TTL_MS: u64 = 60_000;

/// The sync script. `KEYS[1]`: the nodes set; `KEYS[2]`: this node's key. `ARGV`: this node's
/// name, its entry, the entry's TTL (ms), the prefix of node keys, [`NODES_MAX`],
/// [`entry::ENTRY_BYTES_MAX`], [`ENTRY_TTL_MAX_MS`], the `SSCAN` cursor, [`SREM_BATCH`].
///
/// Publishes the entry (a nodes set of another type is deleted first, as garbage), then reads
/// the set: whole when it has at most `NODES_MAX` members, else one `SSCAN` batch from the
/// cursor. Each member that is not a node name (`[A-Za-z0-9_.-]{1,64}`, so non-UTF-8 bytes
/// are not) is garbage; of the other nodes' keys, an expired one is removed from the set
/// (the node left), and one with no TTL or a TTL over the bound, of another type, or longer
/// than the bound is garbage (key deleted, member removed). Returns
/// `{garbage, next cursor ("0": the whole set was read), {node, entry, node, entry, ...}}`
/// with at most `NODES_MAX` entries, each at most `ENTRY_BYTES_MAX` long.
pub const SYNC_LUA: &str = r#"
local node = ARGV[1]
local nodes_max = tonumber(ARGV[5])
local bytes_max = tonumber(ARGV[6])
local ttl_max = tonumber(ARGV[7])
local batch = tonumber(ARGV[9])
local garbage = 0
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= 'set' and t ~= 'none' then
  redis.call('DEL', KEYS[1])
  garbage = garbage + 1
end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('SADD', KEYS[1], node)
local members
local cursor = '0'
if redis.call('SCARD', KEYS[1]) <= nodes_max then
  members = redis.call('SMEMBERS', KEYS[1])
else
  local r = redis.call('SSCAN', KEYS[1], ARGV[8], 'COUNT', nodes_max)
  cursor = r[1]
  members = r[2]
end
local entries = {}
local read = 0
local gone = {}
for _, m in ipairs(members) do
  if #m > 64 or not string.find(m, '^[A-Za-z0-9_%.%-]+$') then
    gone[#gone + 1] = m
    garbage = garbage + 1
  elseif m ~= node and read < nodes_max then
    local key = ARGV[4] .. m
    local ttl = redis.call('PTTL', key)
    if ttl == -2 then
      gone[#gone + 1] = m
    elseif ttl == -1 or ttl > ttl_max then
      redis.call('DEL', key)
      gone[#gone + 1] = m
      garbage = garbage + 1
    else
      local len = redis.pcall('STRLEN', key)
      if type(len) ~= 'number' or len > bytes_max then
        redis.call('DEL', key)
        gone[#gone + 1] = m
        garbage = garbage + 1
      else
        entries[#entries + 1] = m
        entries[#entries + 1] = redis.call('GET', key)
        read = read + 1
      end
    end
  end
end
for i = 1, #gone, batch do
  redis.call('SREM', KEYS[1], unpack(gone, i, math.min(i + batch - 1, #gone)))
end
return {garbage, cursor, entries}
"#;

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

/// The longest a node waits between two attempts to reach Redis ([`Backoff`]).
pub const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// The longest delay as a multiple of the node's sync interval: a Redis that comes back is
/// used again within three intervals (the fleet's resync goal: at most two of backoff, then the
/// sync's own period). A 5 s ceiling alone kept a node on its local weights for up to 5 s after
/// a 5 s outage (`exp fleet`, session 27: resync 2.4 s against the goal's 0.3 s).
pub const BACKOFF_MAX_INTERVALS: u32 = 2;

/// When the next attempt to reach Redis may be made, after failed ones: a bounded exponential
/// backoff with jitter. After the first failure the next call tries again at once (a single
/// dropped connection, a restarted Redis or one failed lease costs nothing more); after the
/// `n`-th consecutive failure (`n >= 2`) no connection is tried for a delay drawn uniformly
/// from `[d / 2, d]`, `d = min(BACKOFF_MAX, BACKOFF_MAX_INTERVALS × base, base × 2^(n-2))`,
/// where `base` is the node's sync interval. A call that succeeds resets it. Pure: the caller
/// gives the time.
#[derive(Clone, Debug)]
pub struct Backoff {
    base: Duration,
    failures: u32,
    retry_at: Option<Instant>,
    rng: u64,
}

impl Backoff {
    /// A backoff from `base` (zero counts as 1 ms), its jitter drawn from `seed`.
    pub fn new(base: Duration, seed: u64) -> Backoff {
        Backoff {
            base: base.max(Duration::from_millis(1)),
            failures: 0,
            retry_at: None,
            // xorshift's state must not be 0.
            rng: seed | 1,
        }
    }

    /// The upper bound of the delay after `failures` consecutive failures (none after one).
    pub fn ceiling(&self, failures: u32) -> Duration {
        if failures < 2 {
            return Duration::ZERO;
        }
        let doublings = (failures - 2).min(30);
        self.base
            .saturating_mul(1u32 << doublings)
            .min(self.base.saturating_mul(BACKOFF_MAX_INTERVALS))
            .min(BACKOFF_MAX)
    }

    /// Whether an attempt may be made at `now`.
    pub fn allows(&self, now: Instant) -> bool {
        self.retry_at.is_none_or(|t| now >= t)
    }

    /// When the next attempt may be made (`None`: at once).
    pub fn retry_at(&self) -> Option<Instant> {
        self.retry_at
    }

    /// Consecutive failures so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// An attempt failed at `now`; returns the delay before the next one.
    pub fn failed(&mut self, now: Instant) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let d = self.ceiling(self.failures);
        let delay = if d.is_zero() {
            d
        } else {
            // xorshift64: uniform enough for a jitter.
            self.rng ^= self.rng << 13;
            self.rng ^= self.rng >> 7;
            self.rng ^= self.rng << 17;
            let half = d / 2;
            let span = (d - half).as_nanos() as u64;
            half + Duration::from_nanos(self.rng % (span + 1))
        };
        self.retry_at = (!delay.is_zero()).then(|| now + delay);
        delay
    }

    /// An attempt succeeded: the next failure starts again from none.
    pub fn succeeded(&mut self) {
        self.failures = 0;
        self.retry_at = None;
    }
}

/// A seed for a [`Backoff`]'s jitter that differs between nodes started together (so their
/// retries do not stay in step): the standard library's random hash keys.
fn jitter_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.finish()
}

/// The most garbage one sync can count: the nodes set's type, and each member it looked at
/// (`SMEMBERS` of at most [`NODES_MAX`], or one `SSCAN` batch, which may run past its `COUNT`).
pub const SYNC_GARBAGE_MAX: u64 = 1 + 16 * NODES_MAX as u64;

/// The sync script's garbage count and next cursor, checked: numbers that script cannot
/// return (a hostile server or proxy; Redis runs the script by its hash, so not another
/// script) are not trusted. A count over [`SYNC_GARBAGE_MAX`] counts as 1 (the reply), not as
/// itself (near `u64::MAX` it overflowed the node's sum: a panic in a debug build, a wrapped
/// counter in a release one); a cursor that is not a decimal `u64` starts the scan again from
/// "0" and counts 1 (kept, it would have failed every later `SSCAN`, for good).
pub fn check_reply(garbage: u64, cursor: Vec<u8>) -> (u64, Vec<u8>) {
    let mut counted = if garbage > SYNC_GARBAGE_MAX {
        1
    } else {
        garbage
    };
    let valid = !cursor.is_empty()
        && cursor.len() <= 20
        && cursor.iter().all(u8::is_ascii_digit)
        && std::str::from_utf8(&cursor)
            .ok()
            .and_then(|c| c.parse::<u64>().ok())
            .is_some();
    if valid {
        (counted, cursor)
    } else {
        counted += 1;
        (counted, b"0".to_vec())
    }
}

/// What one sync read: every live node's entry value, and the garbage removed on the way.
#[derive(Debug, Default)]
pub struct Read {
    /// `(node, value)` for every other node whose key was there, by name; at most
    /// [`NODES_MAX`], each value at most [`entry::ENTRY_BYTES_MAX`].
    pub entries: Vec<(String, Vec<u8>)>,
    /// Garbage removed (module doc).
    pub garbage: u64,
}

/// One lease renewal's outcome: the tokens granted (negative: given back; held to the ask) and
/// whether the bucket held garbage, or the error Redis gave for this renewal.
pub type Grant = Result<(i64, bool), RedisError>;

/// One lease renewal of [`Store::leases`].
#[derive(Clone, Debug)]
pub struct LeaseAsk {
    /// The bucket's key ([`Store::cap_key`]).
    pub key: String,
    pub rate_per_s: u64,
    pub burst: u64,
    /// Tokens asked for (negative: given back).
    pub ask: i64,
}

/// A connection to the fleet's Redis, made lazily and dropped on any error.
pub struct Store {
    info: ConnectionInfo,
    con: Option<DeadlineConnection>,
    timeout: Duration,
    prefix: String,
    sync_script: redis::Script,
    script: redis::Script,
    /// Where the next `SSCAN` of an oversized nodes set starts ("0": at the beginning).
    cursor: Vec<u8>,
    /// When a connection may be tried again after failures.
    backoff: Backoff,
    /// Connections tried (for tests and diagnostics).
    connects: u64,
}

impl Store {
    /// A store for `url` (checked here, not connected yet).
    pub fn new(url: &str, timeout: Duration, prefix: &str) -> Result<Store, String> {
        let client = redis::Client::open(url).map_err(|e| format!("redis {url:?}: {e}"))?;
        if let redis::ConnectionAddr::Tcp(host, _) = client.get_connection_info().addr() {
            if crate::conn::ip_literal(host).is_none() {
                return Err(format!(
                    "redis {url:?}: the host must be an IP address (host names are not \
                     resolved: the system's resolver has no deadline)"
                ));
            }
        }
        Ok(Store {
            info: client.get_connection_info().clone(),
            con: None,
            timeout,
            prefix: prefix.to_string(),
            sync_script: redis::Script::new(SYNC_LUA),
            script: redis::Script::new(LEASE_LUA),
            cursor: b"0".to_vec(),
            // The node sets its sync interval as the base ([`Store::set_backoff_base`]); a
            // node's deadline is half of it.
            backoff: Backoff::new(timeout.saturating_mul(2), jitter_seed()),
            connects: 0,
        })
    }

    /// The base of the reconnect backoff ([`Backoff`]): the node's sync interval.
    pub fn set_backoff_base(&mut self, base: Duration) {
        self.backoff = Backoff::new(base, jitter_seed());
    }

    /// The reconnect backoff's state.
    pub fn backoff(&self) -> &Backoff {
        &self.backoff
    }

    /// Connections tried since the store was made.
    pub fn connects(&self) -> u64 {
        self.connects
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
    /// (the next call reconnects). Without a connection, and while the [`Backoff`] holds
    /// (`gated`), fails at once without trying one. Every failure counts in the backoff, and
    /// every success resets it.
    fn with<T>(
        &mut self,
        gated: bool,
        f: impl FnOnce(&mut DeadlineConnection, &Store) -> Result<T, RedisError>,
    ) -> Result<T, RedisError> {
        let mut con = match self.con.take() {
            Some(c) => c,
            None => {
                let now = Instant::now();
                if gated && !self.backoff.allows(now) {
                    let wait = self
                        .backoff
                        .retry_at()
                        .map_or(Duration::ZERO, |t| t.saturating_duration_since(now));
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::WouldBlock,
                        format!(
                            "not reconnecting for {} ms more, after {} failed calls",
                            wait.as_millis(),
                            self.backoff.failures()
                        ),
                    )
                    .into());
                }
                self.connects += 1;
                match DeadlineConnection::connect(&self.info, self.timeout) {
                    Ok(c) => c,
                    Err(e) => {
                        self.backoff.failed(Instant::now());
                        return Err(e);
                    }
                }
            }
        };
        let r = f(&mut con, self);
        if r.is_ok() && con.is_open() {
            self.con = Some(con);
            self.backoff.succeeded();
        } else {
            self.backoff.failed(Instant::now());
        }
        r
    }

    /// Publishes this node's entry (expiring after `ttl_ms`) and reads the other nodes' (one
    /// script, [`SYNC_LUA`]).
    pub fn sync(&mut self, node: &str, value: &str, ttl_ms: u64) -> Result<Read, RedisError> {
        let cursor = self.cursor.clone();
        let (garbage, next, flat) = self.with(true, |con, st| {
            st.sync_script
                .key(st.nodes_key())
                .key(st.node_key(node))
                .arg(node)
                .arg(value)
                .arg(ttl_ms.max(1))
                .arg(format!("{}node:", st.prefix))
                .arg(NODES_MAX)
                .arg(entry::ENTRY_BYTES_MAX)
                .arg(ENTRY_TTL_MAX_MS)
                .arg(&cursor)
                .arg(SREM_BATCH)
                .invoke::<(u64, Vec<u8>, Vec<Vec<u8>>)>(con)
        })?;
        let (garbage, next) = check_reply(garbage, next);
        self.cursor = next;
        let mut read = Read {
            entries: Vec::new(),
            garbage,
        };
        let mut flat = flat.into_iter();
        while let (Some(name), Some(value)) = (flat.next(), flat.next()) {
            // The script checked both; a reply that breaks them (a script replaced in Redis)
            // is garbage too.
            match String::from_utf8(name) {
                Ok(n)
                    if entry::valid_node(&n)
                        && value.len() <= entry::ENTRY_BYTES_MAX
                        && read.entries.len() < NODES_MAX =>
                {
                    read.entries.push((n, value))
                }
                _ => read.garbage = read.garbage.saturating_add(1),
            }
        }
        read.entries.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        Ok(read)
    }

    /// Renews leases, all in one pipeline: per ask, `Ok((granted, garbage))` or the error
    /// Redis gave for it (the others are granted all the same). `Err`: no reply at all (what
    /// a script that ran before the connection failed took is lost, which only lowers the
    /// fleet's rate).
    pub fn leases(&mut self, asks: &[LeaseAsk]) -> Result<Vec<Grant>, RedisError> {
        if asks.is_empty() {
            return Ok(Vec::new());
        }
        self.with(true, |con, st| {
            let run = |con: &mut DeadlineConnection, which: &[usize]| {
                let mut pipe = redis::pipe();
                pipe.ignore_errors();
                for &i in which {
                    let a = &asks[i];
                    pipe.cmd("EVALSHA")
                        .arg(st.script.get_hash())
                        .arg(1)
                        .arg(&a.key)
                        .arg(a.rate_per_s)
                        .arg(a.burst)
                        .arg(a.ask)
                        .arg(BUCKET_TTL_MS);
                }
                pipe.query::<Vec<Result<(i64, i64), RedisError>>>(con)
            };
            let all: Vec<usize> = (0..asks.len()).collect();
            let mut out = run(con, &all)?;
            // A Redis without the script (restarted, flushed) refuses each EVALSHA, and runs
            // none: load it and ask again for those only.
            let missing: Vec<usize> = all
                .into_iter()
                .filter(|&i| matches!(&out[i], Err(e) if e.code() == Some("NOSCRIPT")))
                .collect();
            if !missing.is_empty() {
                st.script.load(con)?;
                for (i, r) in missing.iter().zip(run(con, &missing)?) {
                    out[*i] = r;
                }
            }
            Ok(out
                .into_iter()
                .zip(asks)
                .map(|(r, a)| {
                    r.map(|(granted, garbage)| {
                        let (granted, out_of_range) = crate::lease::clamp_grant(a.ask, granted);
                        (granted, garbage != 0 || out_of_range)
                    })
                })
                .collect())
        })
    }

    /// Renews one lease: asks the bucket at `key` for `ask` tokens (negative: gives them back).
    /// Returns `(granted, garbage)`.
    pub fn lease(
        &mut self,
        key: &str,
        rate_per_s: u64,
        burst: u64,
        ask: i64,
    ) -> Result<(i64, bool), RedisError> {
        let ask = LeaseAsk {
            key: key.to_string(),
            rate_per_s,
            burst,
            ask,
        };
        self.leases(std::slice::from_ref(&ask))?
            .pop()
            .expect("one reply per ask")
    }

    /// Withdraws this node's entry at once (a clean stop; a dead node's expires instead).
    pub fn withdraw(&mut self, node: &str) -> Result<(), RedisError> {
        // Not held by the backoff: one call at stop, bounded by its deadline.
        self.with(false, |con, st| {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_from_the_second_failure_within_its_bounds_and_resets() {
        let base = Duration::from_millis(100);
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut b = Backoff::new(base, 42);
        assert!(b.allows(t0));
        // The first failure is retried at once.
        assert_eq!(b.failed(t0), Duration::ZERO);
        assert!(b.allows(t0));
        // Then base × 2^(n-2), jittered into [d/2, d], capped at two intervals (and 5 s).
        let mut now = 0;
        for n in 2..=12u32 {
            let d = b.ceiling(n);
            assert_eq!(
                d,
                (base * (1 << (n - 2)))
                    .min(base * BACKOFF_MAX_INTERVALS)
                    .min(BACKOFF_MAX),
                "{n}"
            );
            let delay = b.failed(at(now));
            assert!(delay >= d / 2 && delay <= d, "{n}: {delay:?} against {d:?}");
            assert!(!b.allows(at(now)));
            let wait = delay.as_millis() as u64;
            if wait > 0 {
                assert!(!b.allows(at(now + wait - 1)), "{n}");
            }
            assert!(b.allows(at(now + wait + 1)), "{n}");
            now += wait + 1;
        }
        assert_eq!(b.ceiling(12), base * BACKOFF_MAX_INTERVALS);
        assert_eq!(b.ceiling(u32::MAX), base * BACKOFF_MAX_INTERVALS);
        // A long interval is held to 5 s.
        let slow = Backoff::new(Duration::from_secs(4), 1);
        assert_eq!(slow.ceiling(u32::MAX), BACKOFF_MAX);
        // A success resets it: the next failure is retried at once again.
        b.succeeded();
        assert!(b.allows(at(now)));
        assert_eq!(b.failures(), 0);
        assert_eq!(b.failed(at(now)), Duration::ZERO);
        assert!(b.allows(at(now)));
    }

    #[test]
    fn a_sync_reply_with_numbers_the_script_cannot_return_is_not_trusted() {
        assert_eq!(check_reply(3, b"0".to_vec()), (3, b"0".to_vec()));
        assert_eq!(check_reply(0, b"1234".to_vec()), (0, b"1234".to_vec()));
        assert_eq!(
            check_reply(SYNC_GARBAGE_MAX, b"0".to_vec()),
            (SYNC_GARBAGE_MAX, b"0".to_vec())
        );
        assert_eq!(check_reply(SYNC_GARBAGE_MAX + 1, b"0".to_vec()).0, 1);
        assert_eq!(check_reply(u64::MAX, b"0".to_vec()).0, 1);
        let max = u64::MAX.to_string().into_bytes();
        assert_eq!(check_reply(0, max.clone()), (0, max));
        for bad in [
            &b""[..],
            b"-1",
            b"abc",
            b"12 3",
            b"18446744073709551616",
            b"000000000000000000001",
        ] {
            assert_eq!(check_reply(2, bad.to_vec()), (3, b"0".to_vec()), "{bad:?}");
        }
    }

    #[test]
    fn the_jitter_spreads_nodes_that_failed_together() {
        // Two nodes with different seeds failing at the same instants do not retry in step.
        let base = Duration::from_millis(1000);
        let t0 = Instant::now();
        let (mut a, mut b) = (Backoff::new(base, 1), Backoff::new(base, 2));
        let mut differ = 0;
        for _ in 0..8 {
            if a.failed(t0) != b.failed(t0) {
                differ += 1;
            }
        }
        assert!(differ >= 6, "{differ}");
    }
}
