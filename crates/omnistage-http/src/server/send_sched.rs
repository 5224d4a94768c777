//! The send scheduler's state ([`SendSched`]): a scheduling tree charged in bytes (SFQ under a
//! link shaper, one node per tenant with its weight and cap, a leaf per connection), and per
//! tenant with a `send_order` other than `fair` one leaf whose ordered queue (FIFO, shortest or
//! longest first, with aging) picks the response. Pure data: the `http.send` stage drives it.

use super::tenants::{cap_kind, Live, TenantRuntime};
use crate::config::SendOrder;
use omnistage::account::ActivityId;
use omnistage::sched::{
    ClientParams, NodeId, PolicyKind, ShaperKind, ShaperLost, ShaperSpec, Tree,
};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Bytes one pick of the send scheduler may write before it decides again: the quantum of
/// byte-fairness between connections.
pub(super) const SEND_QUANTUM_BYTES: usize = 16 * 1024;
/// Most picks per dispatch of the send stage before it yields to the CPU scheduler.
pub(super) const SEND_PICKS_PER_DISPATCH: usize = 64;
/// Aging of `shortest_first` and `longest_first`: a response's rank improves by one byte for
/// every this many bytes its tenant sent after it arrived, so no response waits behind
/// newcomers for more than this many times its own size (or, longest first, the largest
/// newcomer's) of its tenant's traffic.
const SEND_ORDER_AGING_FACTOR: u64 = 16;
/// Stale entries an ordered send queue may hold beyond twice its live ones before it is
/// compacted.
const SEND_QUEUE_SLACK: usize = 64;

/// The network send resource stage of one core: a scheduling tree charged in bytes.
pub(super) struct SendSched {
    pub(super) tree: Tree,
    pub(super) link: NodeId,
    pub(super) tenants: HashMap<ActivityId, NodeId>,
    pub(super) leaves: HashMap<u64, NodeId>,
    pub(super) conn_of: HashMap<NodeId, u64>,
    /// An immediate `Pump` is queued.
    pub(super) pump_queued: bool,
    /// A `Pump` waits on a timer for a shaper (it does not stand for the immediate one: a
    /// tenant that is not throttled must not wait for one that is).
    pub(super) pump_timer: bool,
    /// Per tenant with a `send_order` other than `fair`: the one leaf that stands for all its
    /// connections (created on its first send; at most one per tenant).
    pub(super) queue_leaf: HashMap<ActivityId, NodeId>,
    /// The ordered queue behind each such leaf.
    pub(super) queues: HashMap<NodeId, OrderedQueue>,
    /// Connection → (queue leaf, entry id) of its one live entry in an ordered queue.
    pub(super) queued: HashMap<u64, (NodeId, u64)>,
    /// Connection → when its pending output arrived in its ordered queue (kept while it waits
    /// for the socket or the disk; forgotten when the output is done).
    pub(super) arrivals: HashMap<u64, Arrival>,
    /// Each configured tenant's `send_order`, by activity (refreshed by `configure`).
    pub(super) order_of: HashMap<ActivityId, SendOrder>,
    /// What each tenant node's bucket had discarded when last reported to its tenant's
    /// counters (which sum the cores).
    pub(super) lost_reported: HashMap<NodeId, ShaperLost>,
}

/// What one pick of the send scheduler did with a connection.
pub(super) struct Sent {
    pub(super) bytes: usize,
    /// Output still pending in memory or to be read (false when `waiting`).
    pub(super) more: bool,
    /// The socket said `WouldBlock`.
    pub(super) blocked: bool,
    /// The connection failed and must be closed.
    pub(super) failed: bool,
    /// Waiting for the disk stage to bring the next chunk.
    pub(super) waiting: bool,
}

impl Sent {
    /// The connection can go on sending at its next turn (it has output and nothing stopped
    /// it: neither its socket, a failure nor the disk).
    pub(super) fn goes_on(&self) -> bool {
        self.more && !self.blocked && !self.failed && !self.waiting
    }
}

/// When a response arrived in an ordered queue.
#[derive(Clone, Copy)]
pub(super) struct Arrival {
    /// The queue's bytes sent by then (the clock of aging).
    pub(super) sent_bytes: u64,
    /// Arrival number in the queue (the FIFO order, and the tie-break of the others).
    pub(super) seq: u64,
    /// Bytes the connection had to send when it arrived.
    pub(super) bytes: u64,
}

/// A tenant's pending responses in its `send_order`: a binary heap of
/// `(rank, arrival seq, entry id, connection)`, smallest first, with lazy deletion (an entry is
/// live while `SendSched::queued` names it). A decision is O(log n); entries are reused, and
/// stale ones are compacted away once they outnumber the live ones (plus a slack), so the
/// heap stays within twice the tenant's connections on this core.
pub(super) struct OrderedQueue {
    pub(super) order: SendOrder,
    pub(super) heap: BinaryHeap<Reverse<(u64, u64, u64, u64)>>,
    pub(super) live: usize,
    pub(super) next_entry: u64,
    pub(super) next_arrival: u64,
    pub(super) sent_bytes: u64,
}

/// The heap rank of a response (smaller goes first). Shortest first ranks by the bytes left
/// (SRPT); longest first by the bytes the response had when it arrived (ranking it by the
/// bytes left would be LRPT, which evens out the large responses until every one, small ones
/// too, finishes together at the end).
fn send_rank(order: SendOrder, remaining_bytes: u64, arrival: Arrival) -> u64 {
    let age = arrival.sent_bytes / SEND_ORDER_AGING_FACTOR;
    // Byte counts are far below 2^62 (a body is bounded by a file size).
    const TOP: u64 = 1 << 62;
    match order {
        SendOrder::Fair | SendOrder::Fifo => 0,
        SendOrder::ShortestFirst => remaining_bytes.min(TOP).saturating_add(age),
        SendOrder::LongestFirst => (TOP - arrival.bytes.min(TOP)).saturating_add(age),
    }
}

pub(super) fn bucket(kind: ShaperKind, rate_per_s: u64) -> ShaperSpec {
    ShaperSpec {
        kind,
        rate_per_s,
        burst: net_cap_burst_bytes(rate_per_s),
        // Either kind sends in grains of 1 ms of its rate (at most a quantum, at least 1 KiB):
        // the send stage writes no more than the bucket holds, so a leaky bucket's 100 ms
        // window carries no more than the rate and one grain, and a drained bucket of either
        // kind wakes its tenant (or the link) ≤ ~1,000 times/s. A token bucket needs the grain
        // too: charges are whole bytes but refills are fractional, so after the send stage takes
        // the whole bytes a drained bucket holds, it keeps a fraction of a byte, which is a
        // positive balance; without a grain the next pick found no whole byte, wrote one byte
        // anyway, and throttled for ~1e9/rate ns: hundreds of thousands of one-byte writes
        // and timers a second in `/infra`. Its bound is unchanged (`rate·T + burst`: the burst
        // is at least a quantum, so nothing is lost waiting for a grain).
        grain: net_cap_grain_bytes(rate_per_s),
    }
}

/// The bucket depth of a tenant's `net_cap` of `rate_per_s` (either kind): 10 ms of the rate,
/// at least one send quantum (a smaller bucket could never admit a write). What a token bucket
/// may send at once after a pause.
pub fn net_cap_burst_bytes(rate_per_s: u64) -> u64 {
    (rate_per_s / 100).max(SEND_QUANTUM_BYTES as u64)
}

/// The grain in which a `net_cap` (or the link cap) of `rate_per_s` sends once its bucket is
/// drained (see [`bucket`]): the least one write takes, and, for a leaky bucket, what one
/// 100 ms window may carry beyond the rate.
pub fn net_cap_grain_bytes(rate_per_s: u64) -> u64 {
    (rate_per_s / NET_CAP_GRAINS_PER_S).clamp(NET_CAP_GRAIN_MIN_BYTES, SEND_QUANTUM_BYTES as u64)
}

/// A capped tenant's (or link's) bytes go out in grains of `rate / NET_CAP_GRAINS_PER_S`...
const NET_CAP_GRAINS_PER_S: u64 = 1000;
/// ...and at least this many bytes: a smaller write costs more in syscalls than it smooths, and
/// is well below a TCP segment's payload (about 1,448 bytes on Ethernet), so each one would go
/// out as a short segment of its own (the sockets have `TCP_NODELAY`).
const NET_CAP_GRAIN_MIN_BYTES: u64 = 1024;

impl SendSched {
    /// A scheduler with only the link node (bytes as costs) and no tenants yet.
    pub(super) fn empty() -> SendSched {
        let mut tree = Tree::new(PolicyKind::Sfq);
        // Costs are bytes: no minimum beyond one byte.
        tree.set_min_cost(1);
        let link = tree
            .add_interior(tree.root(), ClientParams::default(), PolicyKind::Sfq)
            .expect("a new tree has room");
        SendSched {
            tree,
            link,
            tenants: HashMap::new(),
            leaves: HashMap::new(),
            conn_of: HashMap::new(),
            pump_queued: false,
            pump_timer: false,
            queue_leaf: HashMap::new(),
            queues: HashMap::new(),
            queued: HashMap::new(),
            arrivals: HashMap::new(),
            order_of: HashMap::new(),
            lost_reported: HashMap::new(),
        }
    }

    /// A send scheduler if the configuration caps the link or any tenant's network rate, its
    /// buckets full at `now_ns` (the worker's clock).
    pub(super) fn for_config(live: &Live, now_ns: u64) -> Option<SendSched> {
        let config = &live.config;
        let any_cap = config.server.net_link_cap_bytes_per_s.is_some()
            || config
                .tenants
                .iter()
                .any(|t| t.net_cap_bytes_per_s.is_some());
        if !any_cap {
            return None;
        }
        let mut s = SendSched::empty();
        s.configure(live, now_ns);
        Some(s)
    }

    /// Follows a reload on this core at `now_ns` (the worker's clock): reconfigures the
    /// scheduler, or makes one if the new configuration caps anything. A bucket put on an
    /// existing node starts full at `now_ns` (made at 0, its first refill counted the server's
    /// uptime at its rate as discarded while idle), and a throttled node's release is
    /// recomputed from it.
    pub(super) fn follow_reload(send: &mut Option<SendSched>, live: &Live, now_ns: u64) {
        match send {
            Some(ss) => ss.configure(live, now_ns),
            None => *send = SendSched::for_config(live, now_ns),
        }
    }

    /// Re-weights the tenants' nodes after a change of the fleet layer's send weights (caps,
    /// orders and the link's bucket are left as they are).
    pub(super) fn reweight(&mut self, live: &Live) {
        for (t, tr) in live.config.tenants.iter().zip(&live.tenants) {
            if let Some(&n) = self.tenants.get(&tr.activity) {
                let _ = self
                    .tree
                    .set_params(n, ClientParams::weight(send_weight(t, tr)));
            }
        }
    }

    /// Applies the link cap and the weight and cap of every tenant that has a node (after a
    /// reload, too).
    pub(super) fn configure(&mut self, live: &Live, now_ns: u64) {
        let link_cap = live
            .config
            .server
            .net_link_cap_bytes_per_s
            .map(|r| bucket(ShaperKind::Token, r));
        let _ = self.tree.set_shaper(self.link, link_cap, now_ns);
        self.order_of.clear();
        for (t, tr) in live.config.tenants.iter().zip(&live.tenants) {
            self.order_of.insert(tr.activity, t.send_order);
            if let Some(&n) = self.tenants.get(&tr.activity) {
                let cap = t
                    .net_cap_bytes_per_s
                    .map(|r| bucket(cap_kind(t.cap_kind), r));
                let _ = self
                    .tree
                    .set_params(n, ClientParams::weight(send_weight(t, tr)));
                let _ = self.tree.set_shaper(n, cap, now_ns);
            }
            // A changed order ranks the entries pushed from now on; a tenant that went back to
            // `fair` keeps its queue until it drains (its connections move to their own leaves
            // as they next get output).
            if t.send_order != SendOrder::Fair {
                if let Some(q) = self
                    .queue_leaf
                    .get(&tr.activity)
                    .and_then(|l| self.queues.get_mut(l))
                {
                    q.order = t.send_order;
                }
            }
        }
    }

    /// The ordered queue's leaf of a tenant, created under its node on first use.
    pub(super) fn queue_leaf(
        &mut self,
        activity: ActivityId,
        node: NodeId,
        order: SendOrder,
    ) -> Option<NodeId> {
        if let Some(&l) = self.queue_leaf.get(&activity) {
            return Some(l);
        }
        let l = self.tree.add_leaf(node, ClientParams::default()).ok()?;
        self.queue_leaf.insert(activity, l);
        self.queues.insert(
            l,
            OrderedQueue {
                order,
                heap: BinaryHeap::new(),
                live: 0,
                next_entry: 0,
                next_arrival: 0,
                sent_bytes: 0,
            },
        );
        Some(l)
    }

    /// Puts a connection's pending output in an ordered queue (a no-op if it is there).
    /// Returns whether it was pushed.
    pub(super) fn enqueue(&mut self, leaf: NodeId, key: u64, remaining_bytes: u64) -> bool {
        match self.queued.get(&key) {
            Some(&(l, _)) if l == leaf => return false,
            Some(_) => self.dequeue(key),
            None => {}
        }
        let Some(q) = self.queues.get_mut(&leaf) else {
            return false;
        };
        let arrival = *self.arrivals.entry(key).or_insert_with(|| {
            q.next_arrival += 1;
            Arrival {
                sent_bytes: q.sent_bytes,
                seq: q.next_arrival,
                bytes: remaining_bytes,
            }
        });
        q.next_entry += 1;
        let entry = q.next_entry;
        let rank = send_rank(q.order, remaining_bytes, arrival);
        q.heap.push(Reverse((rank, arrival.seq, entry, key)));
        q.live += 1;
        self.queued.insert(key, (leaf, entry));
        true
    }

    /// Takes the first live connection out of an ordered queue.
    pub(super) fn pop_queued(&mut self, leaf: NodeId) -> Option<u64> {
        let q = self.queues.get_mut(&leaf)?;
        while let Some(Reverse((_, _, entry, key))) = q.heap.pop() {
            if self.queued.get(&key) == Some(&(leaf, entry)) {
                self.queued.remove(&key);
                q.live -= 1;
                return Some(key);
            }
        }
        None
    }

    /// Withdraws a connection from its ordered queue, if it is in one (the queue's leaf goes
    /// idle when nothing live is left). Not for a leaf in service.
    pub(super) fn dequeue(&mut self, key: u64) {
        let Some((leaf, _)) = self.queued.remove(&key) else {
            return;
        };
        let queued = &self.queued;
        if let Some(q) = self.queues.get_mut(&leaf) {
            q.live -= 1;
            if q.live == 0 {
                q.heap.clear();
                self.tree.leaf_idle(leaf);
            } else if q.heap.len() > 2 * q.live + SEND_QUEUE_SLACK {
                q.heap
                    .retain(|Reverse((_, _, e, k))| queued.get(k) == Some(&(leaf, *e)));
            }
        }
    }

    /// Settles the pick of `leaf`, which served connection `key` (from its own leaf, or
    /// `ordered` from its tenant's queue) and did `sent`: puts the connection back in its
    /// queue if it goes on (with `remaining` bytes left), charges the tree what was written,
    /// and forgets the connection's arrival once its response is done.
    pub(super) fn settle_pick(
        &mut self,
        leaf: NodeId,
        key: u64,
        ordered: bool,
        sent: &Sent,
        remaining: u64,
        now_ns: u64,
    ) {
        let still = sent.goes_on();
        if ordered {
            if still {
                self.enqueue(leaf, key, remaining);
            }
            if let Some(q) = self.queues.get_mut(&leaf) {
                q.sent_bytes += sent.bytes as u64;
            }
            let backlogged = self.queue_live(leaf) > 0;
            self.tree
                .charge(leaf, sent.bytes.max(1) as u64, backlogged, now_ns);
        } else {
            self.tree
                .charge(leaf, sent.bytes.max(1) as u64, still, now_ns);
        }
        // The response is done: the next one arrives afresh. One waiting for the disk is not
        // (`send_some` reports it with `more` false: what is pending is being read): it keeps
        // its arrival, so the disk's answer puts it back in its place, with its aging.
        if !sent.more && !sent.waiting {
            self.arrivals.remove(&key);
        }
    }

    /// Live connections in an ordered queue (0 for a leaf that is not one).
    pub(super) fn queue_live(&self, leaf: NodeId) -> usize {
        self.queues.get(&leaf).map_or(0, |q| q.live)
    }

    /// The tenant's node, created with its weight and cap on its first send.
    pub(super) fn tenant_node(
        &mut self,
        tr: &TenantRuntime,
        t: &crate::config::TenantConfig,
        now_ns: u64,
    ) -> Option<NodeId> {
        let activity = tr.activity;
        let params = ClientParams::weight(send_weight(t, tr));
        let cap = t
            .net_cap_bytes_per_s
            .map(|r| bucket(cap_kind(t.cap_kind), r));
        match self.tenants.get(&activity) {
            Some(&n) => Some(n),
            None => {
                let n = self
                    .tree
                    .add_interior(self.link, params, PolicyKind::Sfq)
                    .ok()?;
                let _ = self.tree.set_shaper(n, cap, now_ns);
                self.tenants.insert(activity, n);
                Some(n)
            }
        }
    }

    /// What a tenant node's bucket discarded since the last call (zero without a bucket).
    pub(super) fn take_lost(&mut self, node: NodeId) -> ShaperLost {
        let now = self.tree.shaper_lost(node).unwrap_or_default();
        let seen = self.lost_reported.entry(node).or_default();
        let d = ShaperLost {
            backlogged: now.backlogged.saturating_sub(seen.backlogged),
            idle: now.idle.saturating_sub(seen.idle),
        };
        *seen = now;
        d
    }

    /// Whether output of a tenant waits here (its node has a ready client).
    pub(super) fn tenant_waits(&self, activity: ActivityId) -> bool {
        self.tenants
            .get(&activity)
            .is_some_and(|&n| self.tree.has_work(n))
    }

    pub(super) fn forget(&mut self, key: u64) {
        self.dequeue(key);
        self.arrivals.remove(&key);
        self.forget_leaf(key);
    }

    /// Removes a connection's own leaf (`fair`), if it has one.
    /// Whether the connection's output waits here for its turn (its own leaf backlogged, or an
    /// entry in its tenant's ordered queue): then the server holds its bytes, not the client.
    pub(super) fn holds(&self, key: u64) -> bool {
        self.queued.contains_key(&key)
            || self
                .leaves
                .get(&key)
                .is_some_and(|&leaf| self.tree.has_work(leaf))
    }

    pub(super) fn forget_leaf(&mut self, key: u64) {
        if let Some(leaf) = self.leaves.remove(&key) {
            self.conn_of.remove(&leaf);
            self.tree.leaf_idle(leaf);
            // Refused only for a leaf in service, which `close` never meets: the pump charges
            // before it closes.
            let _ = self.tree.remove(leaf);
        }
    }
}

/// A tenant's weight in the send scheduler: the fleet layer's, else the configured one.
fn send_weight(t: &crate::config::TenantConfig, tr: &TenantRuntime) -> u32 {
    tr.fleet.send_weight().unwrap_or(t.weight)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A send scheduler with one tenant (activity 7) and its ordered queue's leaf.
    fn sched(order: SendOrder) -> (SendSched, NodeId) {
        let mut ss = SendSched::empty();
        let node = ss
            .tree
            .add_interior(ss.link, ClientParams::default(), PolicyKind::Sfq)
            .unwrap();
        let leaf = ss.queue_leaf(7, node, order).unwrap();
        (ss, leaf)
    }

    /// Pops every live connection, in queue order.
    fn drain(ss: &mut SendSched, leaf: NodeId) -> Vec<u64> {
        std::iter::from_fn(|| ss.pop_queued(leaf)).collect()
    }

    /// The running configuration of `toml` as a reload hands it to the cores: tenant `i` is
    /// activity `100 + i`.
    fn live(toml: &str) -> Live {
        use std::sync::atomic::{AtomicU64, AtomicUsize};
        use std::sync::Arc;
        let config = crate::config::parse_config(toml).unwrap();
        let tenants = (config.tenants.iter().enumerate())
            .map(|(i, t)| {
                Arc::new(TenantRuntime {
                    name: t.name.clone(),
                    activity: 100 + i as ActivityId,
                    path: format!("/tenants/{}", t.name),
                    open: AtomicUsize::new(0),
                    cache_bytes: AtomicU64::new(0),
                    disk_bytes: AtomicU64::new(0),
                    net_cap_lost_backlogged_bytes: AtomicU64::new(0),
                    net_cap_lost_idle_bytes: AtomicU64::new(0),
                    fleet: Default::default(),
                })
            })
            .collect();
        let classes = vec![Vec::new(); config.tenants.len()];
        Live {
            config,
            tenants,
            classes,
            tls: None,
        }
    }

    /// A server under a 1 GB/s link cap with one synthetic tenant `t` and `tenant_extra` in
    /// its table.
    fn one_tenant(tenant_extra: &str) -> Live {
        live(&format!(
            "[server]\nlisten = [\"127.0.0.1:0\"]\nnet_link_cap = \"1GB/s\"\n\n\
             [[tenant]]\nname = \"t\"\ndocroot = '/'\nsynthetic = true\n{tenant_extra}"
        ))
    }

    const S: u64 = 1_000_000_000;

    /// A cap a reload puts on a tenant that already has a node starts full at the reload, not
    /// at time 0: its first refill counted the uptime at the cap's rate as discarded while
    /// idle (`net_cap_lost_idle_bytes`: 1 GB after 100 s at 10 MB/s; 864 GB after a day).
    #[test]
    fn a_cap_added_by_a_reload_starts_at_the_reload() {
        let before = one_tenant("");
        let mut send = SendSched::for_config(&before, 0);
        let ss = send.as_mut().expect("the link is capped");
        let node = ss
            .tenant_node(&before.tenants[0], &before.config.tenants[0], S)
            .unwrap();
        let leaf = ss.tree.add_leaf(node, ClientParams::default()).unwrap();
        ss.tree.leaf_ready(leaf, S);
        assert_eq!(ss.tree.pick(S), Some(leaf));
        ss.tree.charge(leaf, 1000, false, S);
        // At 100 s the tenant gets a cap of 10 MB/s, and sends again.
        let t = 100 * S;
        let after = one_tenant("net_cap = \"10MB/s\"\n");
        SendSched::follow_reload(&mut send, &after, t);
        let ss = send.as_mut().unwrap();
        ss.tree.leaf_ready(leaf, t);
        assert_eq!(ss.tree.pick(t), Some(leaf), "a new bucket is full");
        ss.tree.charge(leaf, 1000, false, t);
        assert_eq!(ss.take_lost(node), ShaperLost::default());
    }

    /// A tenant throttled when a reload changes its cap stays throttled until its bucket holds
    /// a grain at the new rate. (It did with the reload at time 0 too: the release computed
    /// from 0 was stale at once, but a release re-checks the bucket at the real time, and the
    /// pump picks, which releases, before it asks when to wake up. A guard, not a regression.)
    #[test]
    fn a_throttled_tenant_stays_throttled_across_a_reload() {
        let before = one_tenant("net_cap = \"8MB/s\"\n");
        let mut send = SendSched::for_config(&before, 0);
        let ss = send.as_mut().unwrap();
        let t = 50 * S;
        let node = ss
            .tenant_node(&before.tenants[0], &before.config.tenants[0], t)
            .unwrap();
        let leaf = ss.tree.add_leaf(node, ClientParams::default()).unwrap();
        ss.tree.leaf_ready(leaf, t);
        // It spends its burst at `t` (whole quanta, the last one into debt).
        let mut sent = 0;
        while let Some(l) = ss.tree.pick(t) {
            ss.tree.charge(l, SEND_QUANTUM_BYTES as u64, true, t);
            sent += SEND_QUANTUM_BYTES as u64;
        }
        assert!(sent > net_cap_burst_bytes(8_000_000), "in debt");
        let due = ss.tree.next_decision_ns(t).unwrap();
        assert!(due > 0);
        // The reload halves its cap: still throttled, and the pump's next wake-up is not now.
        let after = one_tenant("net_cap = \"4MB/s\"\n");
        SendSched::follow_reload(&mut send, &after, t);
        let ss = send.as_mut().unwrap();
        assert_eq!(ss.tree.pick(t), None);
        assert!(
            ss.tree.next_decision_ns(t).unwrap() > 0,
            "a wake-up due at once"
        );
        // Released once its bucket holds a grain at the new rate (the wake-up at the old
        // release, a stale heap entry, finds it still in debt).
        let debt = sent - net_cap_burst_bytes(8_000_000);
        let release = t + (debt + net_cap_grain_bytes(4_000_000)) * S / 4_000_000;
        let mut now = t;
        while ss.tree.pick(now).is_none() {
            now += ss.tree.next_decision_ns(now).unwrap();
            assert!(now <= release, "not released by {release}");
        }
        assert_eq!(now, release);
        assert_eq!(due, (debt + net_cap_grain_bytes(8_000_000)) * S / 8_000_000);
    }

    /// One backlogged connection under a bucket of `kind` at `rate` B/s, on the tenant's node or
    /// (`on_link`) the link's, driven for one simulated second as the pump drives it: pick,
    /// write what the buckets on its path hold (at most a quantum, at least one byte), charge;
    /// when nothing is eligible the clock moves to the next decision plus 5 µs (a timer that
    /// fires late, as timers do). Returns each write's bytes.
    fn drive_one_second(kind: ShaperKind, rate: u64, on_link: bool) -> Vec<u64> {
        let mut ss = SendSched::empty();
        let node = ss
            .tree
            .add_interior(ss.link, ClientParams::default(), PolicyKind::Sfq)
            .unwrap();
        let shaped = if on_link { ss.link } else { node };
        ss.tree
            .set_shaper(shaped, Some(bucket(kind, rate)), 0)
            .unwrap();
        let leaf = ss.tree.add_leaf(node, ClientParams::default()).unwrap();
        ss.tree.leaf_ready(leaf, 0);
        let (mut now, mut writes) = (0u64, Vec::new());
        while now < 1_000_000_000 {
            let Some(l) = ss.tree.pick(now) else {
                let d = ss.tree.next_decision_ns(now).expect("backlogged");
                now += d + 5_000;
                continue;
            };
            let n = ss
                .tree
                .shaped_room(l, now)
                .map_or(SEND_QUANTUM_BYTES as u64, |r| {
                    r.min(SEND_QUANTUM_BYTES as u64).max(1)
                });
            ss.tree.charge(l, n, true, now);
            writes.push(n);
            // Hundreds of thousands of writes is the failure this guards against; stop early.
            if writes.len() > 100_000 {
                break;
            }
        }
        writes
    }

    /// A drained bucket sends in grains, not in one-byte writes on nanosecond timers, and still
    /// at its rate. Token buckets (a tenant's default `cap_kind`, and always the link's) kept a
    /// fraction of a byte after each write, which made them eligible with no whole byte to
    /// send: a one-byte write, then a timer of ~1e9/rate ns, over and over. The least write
    /// asserted is 1 KiB, the send stage's smallest grain (at 8 MB/s its grain is 1 ms of the
    /// rate, 8,000 bytes, so about 1,000 writes once the burst is spent); the leaky bucket,
    /// which already had its grain, is held to the same and is unchanged.
    #[test]
    fn a_drained_bucket_sends_in_grains_at_its_rate() {
        let rate = 8_000_000u64;
        let burst = net_cap_burst_bytes(rate);
        for (kind, on_link) in [
            (ShaperKind::Token, false),
            (ShaperKind::Token, true),
            (ShaperKind::Leaky, false),
        ] {
            let writes = drive_one_second(kind, rate, on_link);
            let what = format!(
                "{kind:?} on the {}",
                if on_link { "link" } else { "tenant" }
            );
            let small = writes.iter().filter(|&&n| n < 1024).count();
            assert_eq!(
                small,
                0,
                "{what}: {small} writes under 1 KiB of {}",
                writes.len()
            );
            // One write per millisecond of the rate, plus the burst's quanta.
            let picks_max = 1000 + burst / SEND_QUANTUM_BYTES as u64 + 2;
            assert!(
                writes.len() as u64 <= picks_max,
                "{what}: {} writes in a second (at most {picks_max})",
                writes.len()
            );
            // The rate is kept: never more than a second of it and the burst (a token bucket's;
            // a leaky one has none), and no less than that minus a grain and a late timer.
            let sent: u64 = writes.iter().sum();
            let allowed = rate
                + match kind {
                    ShaperKind::Token => burst,
                    ShaperKind::Leaky => 0,
                };
            assert!(
                sent <= allowed,
                "{what}: {sent} B in a second, over {allowed}"
            );
            assert!(
                sent + rate / 100 >= allowed,
                "{what}: {sent} B in a second, under {allowed} by more than 1 %"
            );
        }
    }

    #[test]
    fn ordered_queue_serves_by_order() {
        // Connections 1, 2, 3 arrive in that order with 500, 5, 50 bytes to send.
        let sizes = [(1, 500), (2, 5), (3, 50)];
        for (order, want) in [
            (SendOrder::Fifo, vec![1, 2, 3]),
            (SendOrder::ShortestFirst, vec![2, 3, 1]),
            (SendOrder::LongestFirst, vec![1, 3, 2]),
        ] {
            let (mut ss, leaf) = sched(order);
            for (key, bytes) in sizes {
                assert!(ss.enqueue(leaf, key, bytes));
                assert!(!ss.enqueue(leaf, key, bytes), "queued twice");
            }
            assert_eq!(ss.queue_live(leaf), 3);
            assert_eq!(drain(&mut ss, leaf), want, "{order:?}");
            assert_eq!(ss.queue_live(leaf), 0);
        }
    }

    #[test]
    fn fifo_keeps_a_response_at_the_head_across_quanta() {
        let (mut ss, leaf) = sched(SendOrder::Fifo);
        ss.enqueue(leaf, 1, 100);
        ss.enqueue(leaf, 2, 10);
        // Served one quantum, still pending: it keeps its arrival.
        assert_eq!(ss.pop_queued(leaf), Some(1));
        ss.enqueue(leaf, 1, 90);
        assert_eq!(ss.pop_queued(leaf), Some(1));
        // Blocked on its socket, then back: still first.
        ss.enqueue(leaf, 1, 80);
        assert_eq!(drain(&mut ss, leaf), vec![1, 2]);
    }

    /// What a pick did, as `send_some` reports it.
    fn sent(bytes: usize, more: bool, waiting: bool) -> Sent {
        Sent {
            bytes,
            more,
            blocked: false,
            failed: false,
            waiting,
        }
    }

    /// A response that waits for the disk keeps its place in its tenant's queue, as one that
    /// waits for its socket does: `send_some` reports a disk wait with `more` false, and the
    /// pick's bookkeeping took that for a finished response and forgot its arrival, so the
    /// disk's answer queued it as a newcomer (FIFO: behind everything queued meanwhile, at
    /// every 64 KiB chunk; longest first: re-ranked by the bytes left; aging restarted).
    #[test]
    fn a_response_waiting_for_the_disk_keeps_its_arrival() {
        const Q: usize = SEND_QUANTUM_BYTES;
        for order in [
            SendOrder::Fifo,
            SendOrder::ShortestFirst,
            SendOrder::LongestFirst,
        ] {
            let (mut ss, leaf) = sched(order);
            // Two responses of 100,000 bytes; 1 arrived first.
            ss.enqueue(leaf, 1, 100_000);
            ss.enqueue(leaf, 2, 100_000);
            let before = ss.arrivals[&1];
            ss.tree.leaf_ready(leaf, 0);
            assert_eq!(ss.tree.pick(0), Some(leaf));
            assert_eq!(ss.pop_queued(leaf), Some(1));
            // It writes a quantum, then its next chunk is read by the disk stage.
            ss.settle_pick(leaf, 1, true, &sent(Q, false, true), 0, 0);
            assert!(
                ss.arrivals.contains_key(&1),
                "{order:?}: the arrival is forgotten while the response waits for the disk"
            );
            // The disk's answer makes it ready again (`schedule_send`).
            ss.enqueue(leaf, 1, 100_000 - Q as u64);
            ss.tree.leaf_ready(leaf, 0);
            let after = ss.arrivals[&1];
            assert_eq!(
                (after.seq, after.sent_bytes, after.bytes),
                (before.seq, before.sent_bytes, before.bytes),
                "{order:?}"
            );
            assert_eq!(drain(&mut ss, leaf), vec![1, 2], "{order:?}");
            // Done (its last bytes written, nothing pending): the next response arrives afresh.
            ss.enqueue(leaf, 1, 10);
            assert_eq!(ss.tree.pick(0), Some(leaf));
            assert_eq!(ss.pop_queued(leaf), Some(1));
            ss.settle_pick(leaf, 1, true, &sent(10, false, false), 0, 0);
            assert!(!ss.arrivals.contains_key(&1), "{order:?}");
        }
    }

    /// Queues one response of `waiting_bytes`, then newcomers of `newcomer_bytes` one at a time,
    /// each served whole, until the waiting one is picked; returns how many overtook it.
    fn overtaken_before_aged(order: SendOrder, waiting_bytes: u64, newcomer_bytes: u64) -> u64 {
        let (mut ss, leaf) = sched(order);
        ss.enqueue(leaf, 1, waiting_bytes);
        let bound =
            SEND_ORDER_AGING_FACTOR * waiting_bytes.abs_diff(newcomer_bytes) / newcomer_bytes + 1;
        let mut key = 2;
        let mut overtaken = 0;
        loop {
            ss.enqueue(leaf, key, newcomer_bytes);
            let next = ss.pop_queued(leaf).unwrap();
            ss.queues.get_mut(&leaf).unwrap().sent_bytes += newcomer_bytes;
            if next == 1 {
                return overtaken;
            }
            ss.arrivals.remove(&next);
            overtaken += 1;
            key += 1;
            assert!(overtaken <= bound, "starved: {overtaken} > {bound}");
        }
    }

    #[test]
    fn shortest_first_ages_a_large_response() {
        // Newcomers of 10 bytes overtake a 1000-byte response until the tenant has sent the
        // aging factor times the size difference after it arrived (the bound is asserted inside).
        let overtaken = overtaken_before_aged(SendOrder::ShortestFirst, 1000, 10);
        assert!(overtaken > 10, "aging too fast: {overtaken}");
    }

    #[test]
    fn longest_first_ages_a_small_response() {
        let overtaken = overtaken_before_aged(SendOrder::LongestFirst, 10, 1000);
        assert!(overtaken > 1, "aging too fast: {overtaken}");
    }

    #[test]
    fn withdrawn_entries_are_compacted() {
        let (mut ss, leaf) = sched(SendOrder::ShortestFirst);
        let n = 1000u64;
        for key in 0..n {
            ss.enqueue(leaf, key, 1 + key);
        }
        // Connections close while queued (all but the 10 largest).
        for key in 0..n - 10 {
            ss.forget(key);
        }
        let q = &ss.queues[&leaf];
        assert_eq!(q.live, 10);
        assert!(
            q.heap.len() <= 2 * q.live + SEND_QUEUE_SLACK + 1,
            "{} entries for {} live",
            q.heap.len(),
            q.live
        );
        assert_eq!(drain(&mut ss, leaf), (n - 10..n).collect::<Vec<_>>());
        // Withdrawing the last one empties the heap.
        ss.enqueue(leaf, 5, 1);
        ss.forget(5);
        assert!(ss.queues[&leaf].heap.is_empty());
        assert!(!ss.arrivals.contains_key(&5));
    }
}
