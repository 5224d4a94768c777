//! fleet: what the server offers the fleet layer (crate `omnistage-fleet`), which runs beside
//! it and talks to Redis so that nothing here does.
//!
//! - [`LeasePool`]: the tokens of one fleet cap this node holds, spent on the request path
//!   with one atomic operation (no lock, no Redis round trip); the fleet thread renews them.
//! - [`FleetHooks`]: one per tenant (it lives as long as the tenant's name, across reloads):
//!   its two pools (requests, bytes), the send scheduler's counts of picks that left the
//!   tenant with output still waiting (its backlog on the link), and a weight for the tenant's
//!   node in the send scheduler that overrides the configured one.
//! - [`FleetStatus`]: what the fleet thread last computed, kept for the admin API.
//!
//! A tenant without fleet caps pays one relaxed load per request (the pools are off).

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};

/// The tokens one fleet cap has lent this node. Off (`limited == false`) it admits
/// everything without touching a shared counter.
#[derive(Debug, Default)]
pub struct LeasePool {
    limited: AtomicBool,
    tokens: AtomicI64,
    /// Admission checks while limited (the node's demand for the cap).
    attempts: AtomicU64,
    refused: AtomicU64,
}

impl LeasePool {
    /// Turns the cap on or off (off admits everything). Turned on, the pool starts from 0
    /// tokens: what it held or owed when it was last on belongs to a cap that no longer
    /// applied (while a pool is off nothing but the fleet thread, this one's caller, writes it).
    pub fn set_limited(&self, on: bool) {
        if on && !self.is_limited() {
            self.tokens.store(0, Ordering::Relaxed);
        }
        self.limited.store(on, Ordering::Relaxed);
    }

    pub fn is_limited(&self) -> bool {
        self.limited.load(Ordering::Relaxed)
    }

    /// Request path: takes `n` tokens if the pool holds them (or admits if the pool is off).
    pub fn try_take(&self, n: i64) -> bool {
        if !self.is_limited() {
            return true;
        }
        self.attempts.fetch_add(1, Ordering::Relaxed);
        let taken = self
            .tokens
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                (t >= n).then_some(t - n)
            })
            .is_ok();
        if !taken {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        taken
    }

    /// Request path for a pool that is debited after the fact (bytes): admits while the pool
    /// is positive (or off).
    pub fn admit_positive(&self) -> bool {
        if !self.is_limited() {
            return true;
        }
        self.attempts.fetch_add(1, Ordering::Relaxed);
        let ok = self.tokens.load(Ordering::Relaxed) > 0;
        if !ok {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }

    /// Adds (or, negative, removes) tokens; returns the new balance. The balance may go
    /// below zero (bytes sent beyond the lease: a debt the next lease repays).
    pub fn add(&self, n: i64) -> i64 {
        self.tokens
            .fetch_add(n, Ordering::Relaxed)
            .saturating_add(n)
    }

    /// Tokens held now (negative: a debt).
    pub fn tokens(&self) -> i64 {
        self.tokens.load(Ordering::Relaxed)
    }

    /// Admission checks made while limited, since the start.
    pub fn attempts(&self) -> u64 {
        self.attempts.load(Ordering::Relaxed)
    }

    /// Requests refused for want of tokens, since the start.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

/// One tenant's hooks for the fleet layer (module doc).
#[derive(Debug, Default)]
pub struct FleetHooks {
    /// `fleet_rate_per_s`: one token per request.
    pub requests: LeasePool,
    /// `fleet_net_cap`: bytes, debited by the fleet thread from the ledger after they are
    /// sent; a request is admitted while the pool is positive.
    pub bytes: LeasePool,
    send_picks: AtomicU64,
    send_picks_backlogged: AtomicU64,
    /// Output of the tenant waits in a send scheduler: set when a response of it becomes a
    /// client there, and after each pick of it and each close of one of its connections to
    /// whether any of its output still waits on that core (the latest event on any core wins).
    send_waiting: AtomicBool,
    /// Weight of the tenant's node in the send scheduler; 0: the configured weight.
    send_weight: AtomicU32,
}

impl FleetHooks {
    /// The request path's check: both caps allow the request (the bytes pool is checked first,
    /// so a refusal there costs no request token).
    pub fn admit(&self) -> bool {
        self.bytes.admit_positive() && self.requests.try_take(1)
    }

    /// The send scheduler served this tenant; `backlogged`: output of the tenant was still
    /// waiting on that core afterwards.
    pub(crate) fn note_pick(&self, backlogged: bool) {
        self.send_picks.fetch_add(1, Ordering::Relaxed);
        self.send_waiting.store(backlogged, Ordering::Relaxed);
        if backlogged {
            self.send_picks_backlogged.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Whether output of the tenant waits in a send scheduler (see the field).
    pub(crate) fn note_send_waiting(&self, waiting: bool) {
        self.send_waiting.store(waiting, Ordering::Relaxed);
    }

    /// Whether output of the tenant waited in a send scheduler at the latest pick, close or
    /// new response: the link backlog of a tenant picked less than once per sync interval.
    pub fn send_waiting(&self) -> bool {
        self.send_waiting.load(Ordering::Relaxed)
    }

    /// Picks of the send scheduler for this tenant, and those that left it backlogged, since
    /// the start (all cores).
    pub fn send_picks(&self) -> (u64, u64) {
        (
            self.send_picks.load(Ordering::Relaxed),
            self.send_picks_backlogged.load(Ordering::Relaxed),
        )
    }

    /// The send scheduler's weight for this tenant when it overrides the configured one.
    pub fn send_weight(&self) -> Option<u32> {
        match self.send_weight.load(Ordering::Relaxed) {
            0 => None,
            w => Some(w),
        }
    }

    pub(crate) fn set_send_weight(&self, w: Option<u32>) -> bool {
        let v = w.unwrap_or(0);
        self.send_weight.swap(v, Ordering::Relaxed) != v
    }
}

/// What the fleet layer last computed on this node (shown by the admin API and `/metrics`).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FleetStatus {
    /// This node's name in the fleet.
    pub node: String,
    /// The last sync reached Redis.
    pub connected: bool,
    /// Episodes of Redis being unreachable (each logged once).
    pub episodes: u64,
    /// Bad entries and bad lines read from Redis, ignored.
    pub garbage: u64,
    /// Syncs that reached Redis.
    pub syncs: u64,
    /// Panics of the fleet thread caught and recovered from (each put the configured weights
    /// back and lifted the fleet caps until the next sync).
    #[serde(default)]
    pub restarts: u64,
    /// Nodes whose entries the last good sync saw (this one included).
    pub nodes_seen: usize,
    pub tenants: Vec<FleetTenantStatus>,
}

/// One tenant in [`FleetStatus`].
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FleetTenantStatus {
    pub name: String,
    /// Its fleet-wide share target of CPU as this node computed it (0..=1).
    pub cpu_share_target: f64,
    /// Its fleet-wide share target of link bytes (0 without link caps).
    pub link_share_target: f64,
    /// Fleet-wide CPU use the nodes reported, ns/s.
    pub cpu_fleet_used_ns_per_s: u64,
    /// Fleet-wide link use the nodes reported, bytes/s.
    pub link_fleet_used_bytes_per_s: u64,
    /// The local weights set from the fill (CPU: the activity's; link: the send scheduler's).
    pub cpu_weight: u32,
    pub link_weight: u32,
    /// Lease tokens held: requests, bytes (negative: a debt).
    pub lease_requests: i64,
    pub lease_bytes: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_off_pool_admits_without_counting() {
        let p = LeasePool::default();
        assert!(p.try_take(1) && p.admit_positive());
        assert_eq!((p.attempts(), p.refused(), p.tokens()), (0, 0, 0));
    }

    #[test]
    fn a_limited_pool_spends_what_it_holds_and_counts_refusals() {
        let p = LeasePool::default();
        p.set_limited(true);
        assert!(!p.try_take(1));
        assert_eq!(p.add(2), 2);
        assert!(p.try_take(1) && p.try_take(1));
        assert!(!p.try_take(1));
        assert_eq!((p.attempts(), p.refused(), p.tokens()), (4, 2, 0));
        // Bytes: admitted while positive, debited afterwards, a debt refuses.
        assert!(!p.admit_positive());
        p.add(10);
        assert!(p.admit_positive());
        assert_eq!(p.add(-25), -15);
        assert!(!p.admit_positive());
        assert_eq!(p.refused(), 4);
    }

    #[test]
    fn a_pool_switched_on_starts_from_nothing() {
        let p = LeasePool::default();
        p.add(-1_000_000);
        p.set_limited(true);
        assert_eq!(p.tokens(), 0, "a debt run up while off is not kept");
        p.add(-5);
        p.set_limited(true);
        assert_eq!(p.tokens(), -5, "staying on keeps the balance");
        p.set_limited(false);
        p.set_limited(true);
        assert_eq!(p.tokens(), 0);
    }

    #[test]
    fn hooks_check_bytes_before_taking_a_request_token() {
        let h = FleetHooks::default();
        assert!(h.admit());
        h.requests.set_limited(true);
        h.bytes.set_limited(true);
        h.requests.add(1);
        assert!(!h.admit(), "no bytes");
        assert_eq!(h.requests.tokens(), 1, "the request token was kept");
        h.bytes.add(100);
        assert!(h.admit());
        assert_eq!(h.requests.tokens(), 0);
        assert!(h.set_send_weight(Some(7)));
        assert!(!h.set_send_weight(Some(7)));
        assert_eq!(h.send_weight(), Some(7));
        assert!(h.set_send_weight(None));
        assert_eq!(h.send_weight(), None);
        h.note_pick(true);
        assert!(h.send_waiting());
        h.note_pick(false);
        assert_eq!(h.send_picks(), (2, 1));
        assert!(!h.send_waiting(), "the latest pick left nothing waiting");
        h.note_send_waiting(true);
        assert!(h.send_waiting());
    }
}
