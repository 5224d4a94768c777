//! `omnistage-fleet`: tenant shares and caps across omnistage nodes, through Redis.
//!
//! Without a `[cluster]` section a node is alone, as before. With one, every node runs a
//! thread ([`node`]) that every `sync_ms`:
//!
//! 1. publishes, per tenant and per bound resource (CPU, link bytes), its demand and its use
//!    ([`entry`]), under a key that expires after 1.9 × `sync_ms`;
//! 2. reads every node's entry and water-fills the fleet-wide shares by weight under placement
//!    ([`water`]): a tenant present on few nodes gets its fleet share there, one present
//!    everywhere yields where it can be served elsewhere;
//! 3. sets its local weights from its part of the fill (the runtime's `set_activity` for CPU,
//!    the server's send scheduler for link bytes); local scheduling stays what it is;
//! 4. renews its leases of the fleet caps ([`lease`]): tokens taken in batches from one
//!    token bucket per cap in Redis by a Lua script (atomic), spent locally.
//!
//! Failure is local: no request waits for Redis (the request path reads only local atomics);
//! with Redis down, slow or restarted a node goes back to its configured weights and to
//! `fleet cap / nodes last seen` (credited for the time since each pool's last refill), logs
//! once per episode, counts episodes, and resynchronises when Redis answers again (reconnects
//! after repeated failures back off, jittered, up to two sync intervals: [`store::Backoff`]); when only a
//! lease renewal fails, the fill's weights stay and only that cap is refilled locally. Every
//! Redis call has a deadline for its whole exchange ([`conn`]: a server that trickles its
//! reply cannot hold the thread), and stopping waits for the thread only a bounded time. What
//! one sync reads is bounded ([`store`]: at most `NODES_MAX` entries of at most
//! `ENTRY_BYTES_MAX` each), and garbage in Redis (non-UTF-8 set members, entries without a
//! TTL, oversized values, numbers out of range) is removed and counted once. The Redis host is
//! an IP address (the resolver has no deadline). A panic in a sync is caught: the local state
//! is put back, the restart counted, and the thread goes on after a pause ([`node`]). A node that dies stops refreshing its
//! key, which expires, and the others reclaim its share within 3 × `sync_ms`.
//!
//! The layer sits between the admin API and the HTTP server (ARCHITECTURE.md's `fleet`): it
//! uses the server's and the runtime's public API; what the admin API shows of it goes
//! through the server's [`omnistage_http::server::FleetStatus`]. `water`, `entry` and `lease`
//! are pure (no clock, no I/O) and tested with exact expectations; `node`, `store` and
//! `conn` do the I/O.

pub mod conn;
pub mod entry;
pub mod lease;
pub mod node;
pub mod store;
pub mod water;

pub use node::{FleetNode, NodeConfig};
