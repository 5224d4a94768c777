//! The fair-queue policies, SFQ and WFQ: virtual-time fair queuing over the 4-ary heap of
//! [`super::heap`], with lazy deletion, shared (machine-wide) tags and a wake credit.
//!
//! Kept apart from the other policies (`policy.rs`) because it is the runtime's default and
//! the one whose per-decision path is tuned: its calls are inlined into `Tree`'s walks (through
//! `Interior` → [`FqCore`]), and its client state is laid out one cache line per client, in
//! lines the tree keeps one per node (see [`FqClient`]).

use super::heap::{Entry, TagHeap};
use super::policy::{
    ClientId, ClientParams, ClientStats, Scheduler, SharedTag, VT_SCALE, WEIGHT_MAX, WEIGHT_MIN,
};
use std::sync::Arc;

/// Which tag a [`FairQueue`] orders by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FairQueueMode {
    /// Start-time fair queuing (Goyal, Vin, Cheng): smallest start tag first. Needs no cost
    /// estimate, so it suits retrospective charging; nested SFQ nodes are H-SFQ.
    Start,
    /// Weighted fair queuing (Demers, Keshav, Shenker) with retrospective charging: smallest
    /// *estimated* finish tag `S + est_cost * VT_SCALE / w` first, where `est_cost` is an EWMA of
    /// the client's recent costs (cost is known only after dispatch).
    Finish,
}

/// One client's state, one cache line: everything a decision and its charge touch for the
/// client is in this line (the statistics, when kept, are apart: a tree keeps them in its
/// nodes), so a decision under a cold cache costs one miss per client it looks at.
///
/// Where the lines live is the owner's choice ([`FqCore`]'s calls take them as a slice): a
/// [`FairQueue`] keeps its own, indexed by client id; a [`super::Tree`] keeps one per node,
/// indexed by node id, so that a fair queue's client id *is* the child node's id and a
/// decision reaches the child's node and its client line from the heap entry at once,
/// instead of one after the other.
#[derive(Clone, Debug, Default)]
#[repr(align(64))]
pub(crate) struct FqClient {
    registered: bool,
    ready: bool,
    in_service: bool,
    weight: u32,
    /// The [`FqCore::owner`] of the queue the client is registered with. Entries of a client
    /// that moved to another queue stay behind in the old heap, and a sequence number there
    /// could equal the one the new queue gave it: the owner tells them apart.
    owner: u32,
    /// Sequence number of this client's live heap entry; any other entry of it is stale
    /// (lazy deletion). Kept when the client is removed, so that its old entries stay stale
    /// if it comes back.
    live_seq: u32,
    /// Remainder of `cost * VT_SCALE / weight` carried to the next charge, so the tag is
    /// exactly floor(W * VT_SCALE / w) and rounding never drifts (< weight <= 10,000).
    remainder: u32,
    /// Local start tag (normalized service) when `shared` is `None`.
    tag: u64,
    shared: Option<Arc<SharedTag>>,
    /// EWMA of recent costs (WFQ's estimate), cost units.
    cost_estimate: u64,
    /// The node's wake credit in this client's virtual units (`wake_credit * VT_SCALE /
    /// weight`), kept beside the tag so a wake-up divides nothing.
    credit_vt: u64,
}

impl FqClient {
    fn start_tag(&self) -> u64 {
        match &self.shared {
            Some(s) => s.load(),
            None => self.tag,
        }
    }

    /// Whether heap entry `e` (one of this client's) is its live entry in the queue of
    /// `owner`: the client is ready there and `e` is its latest entry (lazy deletion).
    #[inline(always)]
    fn is_live_in(&self, owner: u32, e: &Entry) -> bool {
        self.ready && self.live_seq == e.seq() && self.owner == owner
    }

    /// Whether a queue holds this client (its slot is in use).
    pub(crate) fn is_registered(&self) -> bool {
        self.registered
    }

    /// Applies a new wake credit (cost units) to a registered client (from its next wake-up).
    pub(crate) fn set_wake_credit(&mut self, credit: u64) {
        self.credit_vt = credit_vt(credit, self.weight);
    }

    /// Back to unregistered, keeping what tells its old heap entries stale.
    fn reset(&mut self) {
        *self = FqClient {
            live_seq: self.live_seq,
            ..Default::default()
        };
    }
}

/// `credit` cost units in the virtual units of a client of `weight`.
fn credit_vt(credit: u64, weight: u32) -> u64 {
    credit.saturating_mul(VT_SCALE) / u64::from(weight.max(1))
}

/// The queue itself, without its clients' lines: every call that touches a client takes the
/// lines as a slice indexed by client id (see [`FqClient`]). [`FairQueue`] pairs it with its
/// own lines; [`super::Tree`] with the lines of its nodes.
#[derive(Debug)]
pub(crate) struct FqCore {
    mode: FairQueueMode,
    /// Which queue this is, among the queues that share one slice of client lines (a tree's
    /// node id; 0 for a queue with lines of its own). See [`FqClient::owner`].
    owner: u32,
    heap: TagHeap,
    /// The top entry of the heap belongs to a client that went idle when it was charged; it
    /// was left in place so that the next push can take its slot (one sift-down instead of a
    /// pop and a push: a leaf that empties and refills is the common case).
    top_dead: bool,
    /// Node virtual time: the start tag of the last client taken into service.
    vtime: u64,
    seq: u32,
    ready: usize,
    /// A client is in service (taken by `schedule`, not yet recorded); which one, its own
    /// `in_service` flag says.
    serving: bool,
    /// Cost units of service a waking client may take ahead of `vtime` (0: no banking).
    wake_credit: u64,
}

impl FqCore {
    pub(crate) fn new(mode: FairQueueMode, owner: u32) -> Self {
        FqCore {
            mode,
            owner,
            heap: TagHeap::default(),
            top_dead: false,
            vtime: 0,
            seq: 0,
            ready: 0,
            serving: false,
            wake_credit: 0,
        }
    }

    /// Sets the credit given to clients added, or re-weighted, from now on
    /// ([`FqClient::set_wake_credit`] applies it to a registered one).
    pub(crate) fn set_wake_credit(&mut self, credit: u64) {
        self.wake_credit = credit;
    }

    /// Makes this the queue of `owner` (see [`FqCore::owner`]); only while it has no
    /// clients.
    pub(crate) fn set_owner(&mut self, owner: u32) {
        assert!(
            self.heap.len() == 0 && self.ready == 0,
            "a queue changes its owner only while empty"
        );
        self.owner = owner;
    }

    /// The heap key of client `c` in `mode` (a free function over the fields it needs, so the
    /// hot paths can hold `&mut` to the client while they compute it).
    #[inline(always)]
    fn key(mode: FairQueueMode, c: &FqClient) -> u64 {
        let start = c.start_tag();
        match mode {
            FairQueueMode::Start => start,
            FairQueueMode::Finish => {
                start.saturating_add(c.cost_estimate * VT_SCALE / u64::from(c.weight))
            }
        }
    }

    fn next_seq(&mut self) -> u32 {
        // Wraps after 2^32 entries: a stale entry could then alias a live one of the same
        // client, which at worst orders that client once by an old key (never unsafe).
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Whether heap entry `e` is its client's live entry in this queue.
    #[inline(always)]
    fn is_live(&self, c: &FqClient, e: &Entry) -> bool {
        c.is_live_in(self.owner, e)
    }

    /// Pushes a fresh entry for `id`; any older entry of it becomes stale.
    #[inline(always)]
    fn push(&mut self, cl: &mut [FqClient], id: ClientId) {
        let seq = self.next_seq();
        let c = &mut cl[id as usize];
        c.live_seq = seq;
        let key = Self::key(self.mode, c);
        if std::mem::take(&mut self.top_dead) {
            self.heap.replace_top(Entry::new(key, seq, id));
            return;
        }
        self.heap.push(Entry::new(key, seq, id));
        // Lazy deletion leaves dead entries behind; rebuild when they dominate so the heap
        // stays O(ready clients).
        if self.heap.len() > 2 * self.ready + 64 {
            let owner = self.owner;
            self.heap
                .retain(|e| cl[e.id() as usize].is_live_in(owner, e));
        }
    }

    /// The client the next decision will take if nothing changes before it: a hint (the top
    /// may be stale). Reads only the heap's copy of its top, no client line.
    #[inline]
    pub(crate) fn next_hint(&self) -> Option<ClientId> {
        self.heap.peek().map(|e| e.id())
    }

    /// Hints the cache with the first lines the next sift of this node's heap reads (when
    /// its top is served and comes back, or is replaced, the sift starts at the top).
    #[inline]
    pub(crate) fn hint_heap(&self) {
        self.heap.prefetch_below_top();
    }

    /// [`FqCore::schedule`] in general: drops stale entries and re-keys live ones whose
    /// key grew, until the top is a live entry with its current key (called with no client
    /// in service and no dead top, which `schedule` has checked and dropped).
    #[inline(never)]
    fn schedule_general(&mut self, cl: &mut [FqClient]) -> Option<ClientId> {
        // Each iteration drops a stale entry or re-keys a live one whose shared tag grew (tags
        // only grow, so a stale key is a lower bound). The re-key bound guards against tags
        // that keep growing under us from other cores.
        let mut rekeys_left = self.ready + 8;
        loop {
            let top = *self.heap.peek()?;
            let id = top.id();
            // One lookup of the client for the whole decision (at thousands of clients its
            // line is the decision's likeliest miss).
            let c = &mut cl[id as usize];
            if !self.is_live(c, &top) {
                self.heap.pop();
                continue;
            }
            let start = c.start_tag();
            let key = match self.mode {
                // A local start tag never changes while its entry is queued: the entry's key
                // is the tag (only a shared one can have grown since).
                FairQueueMode::Start if c.shared.is_none() => top.key(),
                mode => Self::key(mode, c),
            };
            if key > top.key() && rekeys_left > 0 && self.heap.len() > 1 {
                rekeys_left -= 1;
                self.heap.replace_top(top.with_key(key));
                continue;
            }
            c.in_service = true;
            self.vtime = self.vtime.max(start);
            self.serving = true;
            return Some(id);
        }
    }

    /// [`Scheduler::add_client`] over the lines `cl` (which must have room for `id`).
    pub(crate) fn add_client(&mut self, cl: &mut [FqClient], id: ClientId, params: &ClientParams) {
        let c = &mut cl[id as usize];
        assert!(!c.registered, "client {id} added twice");
        assert!((WEIGHT_MIN..=WEIGHT_MAX).contains(&params.weight));
        *c = FqClient {
            registered: true,
            weight: params.weight,
            owner: self.owner,
            live_seq: c.live_seq,
            tag: self.vtime,
            shared: params.shared.clone(),
            credit_vt: credit_vt(self.wake_credit, params.weight),
            ..Default::default()
        };
        // A new client has missed nothing: a fresh shared tag (a new or moved activity's
        // starts at 0) would otherwise bring the whole wake credit on its first wake.
        if let Some(s) = &c.shared {
            s.raise_to(self.vtime);
        }
    }

    /// [`Scheduler::update_client`] over the lines `cl`.
    pub(crate) fn update_client(
        &mut self,
        cl: &mut [FqClient],
        id: ClientId,
        params: &ClientParams,
    ) {
        assert!((WEIGHT_MIN..=WEIGHT_MAX).contains(&params.weight));
        let vtime = self.vtime;
        let c = &mut cl[id as usize];
        // (A tree routes a node's changes to its own parent's queue; a client that is not
        // registered is only a standalone queue's, and takes the update as it always has.)
        debug_assert!(!c.registered || c.owner == self.owner);
        if c.weight != params.weight {
            c.weight = params.weight;
            c.remainder = 0;
            c.credit_vt = credit_vt(self.wake_credit, params.weight);
        }
        let mut rekey = self.mode == FairQueueMode::Finish;
        match (&c.shared, &params.shared) {
            (None, Some(s)) => {
                // Attaching a shared tag must not bring credit: clamp it at V (no wake credit:
                // this is no wake).
                s.raise_to(c.tag.max(vtime));
                c.shared = Some(s.clone());
                rekey = true;
            }
            (Some(old), Some(s)) if !Arc::ptr_eq(old, s) => {
                s.raise_to(vtime);
                c.shared = Some(s.clone());
                rekey = true;
            }
            (Some(old), None) => {
                c.tag = old.load().max(vtime);
                c.shared = None;
                rekey = true;
            }
            _ => {}
        }
        // The start tag keeps the service already received; the new weight applies to what
        // is charged from now on.
        if rekey && c.ready && !c.in_service {
            self.push(cl, id);
        }
    }

    /// [`Scheduler::remove_client`] over the lines `cl`.
    pub(crate) fn remove_client(&mut self, cl: &mut [FqClient], id: ClientId) {
        self.client_suspended(cl, id);
        cl[id as usize].reset();
    }

    /// [`Scheduler::client_ready`] over the lines `cl`.
    #[inline(always)]
    pub(crate) fn client_ready(&mut self, cl: &mut [FqClient], id: ClientId) {
        let vtime = self.vtime;
        let c = &mut cl[id as usize];
        debug_assert!(c.registered && c.owner == self.owner);
        if c.ready {
            return;
        }
        c.ready = true;
        // No banking beyond the wake credit: an idle client rejoins at the node's virtual time
        // less its credit at the earliest (the credit is 0 unless the node was given one).
        let floor = vtime.saturating_sub(c.credit_vt);
        match &c.shared {
            Some(s) => {
                s.raise_to(floor);
            }
            None => c.tag = c.tag.max(floor),
        }
        self.ready += 1;
        self.push(cl, id);
    }

    /// [`Scheduler::client_suspended`] over the lines `cl`.
    pub(crate) fn client_suspended(&mut self, cl: &mut [FqClient], id: ClientId) {
        let c = &mut cl[id as usize];
        // Suspending (or removing) a client twice is a no-op, as for the other policies.
        debug_assert!(!c.registered || c.owner == self.owner);
        assert!(!c.in_service, "cannot suspend a client in service");
        if c.ready {
            c.ready = false;
            self.ready -= 1;
        }
    }

    /// [`Scheduler::schedule`] over the lines `cl`.
    #[inline(always)]
    pub(crate) fn schedule(&mut self, cl: &mut [FqClient]) -> Option<ClientId> {
        assert!(!self.serving, "schedule before the last record");
        if std::mem::take(&mut self.top_dead) {
            self.heap.pop();
        }
        // The common decision, inline: a live top entry of an SFQ client whose start tag is
        // still the entry's key (always so for a tag of its own, which does not change while
        // its entry is queued; for a shared tag, unless it moved since: another core charged
        // or raised it), so there is nothing to re-key. Anything else (a stale entry, a
        // shared tag that grew, WFQ's key) goes the general way, out of line.
        let top = *self.heap.peek()?;
        let c = &mut cl[top.id() as usize];
        let start = c.start_tag();
        if self.is_live(c, &top) && self.mode == FairQueueMode::Start && start == top.key() {
            c.in_service = true;
            self.vtime = self.vtime.max(start);
            self.serving = true;
            return Some(top.id());
        }
        self.schedule_general(cl)
    }

    /// [`Scheduler::resource_record`] over the lines `cl`.
    #[inline(always)]
    pub(crate) fn resource_record(
        &mut self,
        cl: &mut [FqClient],
        id: ClientId,
        cost: u64,
        still_ready: bool,
    ) {
        let top = self.heap.peek().copied();
        let mode = self.mode;
        let c = &mut cl[id as usize];
        assert!(
            self.serving && c.in_service && c.owner == self.owner,
            "record for a client not in service"
        );
        self.serving = false;
        c.in_service = false;
        let scaled = cost
            .saturating_mul(VT_SCALE)
            .saturating_add(u64::from(c.remainder));
        let weight = u64::from(c.weight);
        let delta = scaled / weight;
        c.remainder = (scaled % weight) as u32;
        match &c.shared {
            Some(s) => {
                s.add(delta);
            }
            None => c.tag = c.tag.saturating_add(delta),
        }
        if mode == FairQueueMode::Finish {
            // Only WFQ's key reads the estimate.
            c.cost_estimate = if c.cost_estimate == 0 {
                cost
            } else {
                (3 * c.cost_estimate + cost) / 4
            };
        }
        let top_is_ours = top.is_some_and(|e| e.id() == id && e.seq() == c.live_seq);
        if still_ready {
            self.seq = self.seq.wrapping_add(1);
            let seq = self.seq;
            c.live_seq = seq;
            let key = Self::key(mode, c);
            if top_is_ours {
                self.heap.replace_top(Entry::new(key, seq, id));
            } else {
                self.heap.push(Entry::new(key, seq, id));
            }
        } else {
            c.ready = false;
            self.ready -= 1;
            // Its entry is now stale; if it is the top, the next push replaces it (or the next
            // decision pops it).
            self.top_dead = top_is_ours;
        }
    }
}

/// SFQ and WFQ: virtual-time fair queuing over a binary heap of ready clients.
///
/// Lag bound (no banking, with the default wake credit of 0): when a client becomes ready its
/// start tag is raised to the node's virtual time `V` (the start tag of the most recent client
/// taken into service), so a client that was idle returns with at most the same claim as the
/// client just served. Over any
/// interval in which clients i and j are both continuously ready, SFQ keeps
/// `|W_i/w_i - W_j/w_j| <= l_i/w_i + l_j/w_j` (Goyal et al., Theorem 1; `l` the largest cost),
/// in virtual units scaled by [`VT_SCALE`]; the property tests check it.
///
/// Wake credit (off by default, [`FairQueue::set_wake_credit`]): a waking client's tag is
/// raised only to `V - credit * VT_SCALE / w`, so a client that was idle may take up to
/// `credit` cost units of service ahead of the clients that stayed busy before it alternates
/// with them: a burst of a light client is served at once instead of at its share. What it
/// takes is service it missed while idle (its tag was further behind), never more: its
/// normalized service still never runs more than `credit / w` ahead of `V`, so the bound above
/// grows by `credit / w_i` for a client that wakes (EEVDF's bounded lag, CFS's wake-up
/// placement), and a client that stays busy at this node gets no credit at all. (With a
/// [`SharedTag`], "missed" is against this node's `V`: an activity busy on another core that
/// wakes here may take up to its credit here.) A client added to the node starts at `V`, its
/// shared tag included, so a new client has missed nothing.
///
/// Hot path: the client taken into service keeps its entry at the top of the heap; when it is
/// charged and still ready (the common case) its key is updated in place and sifted down once,
/// instead of a pop and a push.
#[derive(Debug)]
pub struct FairQueue {
    core: FqCore,
    /// Per-client state, a cache line each (at 10,000 clients a decision's cost is its cache
    /// misses). Empty in a tree's fair queues, whose client lines the tree keeps.
    clients: Vec<FqClient>,
    /// Per-client statistics, kept apart from the clients' lines and only while
    /// `keep_stats` ([`FairQueue::forget_client_stats`]: a tree keeps the same sums in its
    /// nodes, so its fair queues keep none, and a charge writes one line less).
    stats: Vec<ClientStats>,
    keep_stats: bool,
}

impl FairQueue {
    pub fn new(mode: FairQueueMode) -> Self {
        FairQueue {
            core: FqCore::new(mode, 0),
            clients: Vec::new(),
            stats: Vec::new(),
            keep_stats: true,
        }
    }

    /// Lets a client that wakes take up to `credit` cost units of service ahead of the
    /// clients that stayed busy (see the type's docs); 0, the default, banks nothing. Applies
    /// from each client's next wake-up.
    pub fn set_wake_credit(&mut self, credit: u64) {
        self.core.set_wake_credit(credit);
        for c in self.clients.iter_mut().filter(|c| c.registered) {
            c.set_wake_credit(credit);
        }
    }

    /// Stops keeping per-client statistics ([`Scheduler::client_statistics`] then answers
    /// zeros): for a caller that keeps the same sums itself, as [`super::Tree`] does.
    pub(crate) fn forget_client_stats(&mut self) {
        self.keep_stats = false;
        self.stats = Vec::new();
    }

    /// The queue without its client lines, for a caller that keeps the lines itself
    /// ([`super::Tree`]; it must then make every call through the core, with its lines).
    #[inline(always)]
    pub(crate) fn core(&mut self) -> &mut FqCore {
        &mut self.core
    }

    /// The queue without its client lines (shared).
    #[inline(always)]
    pub(crate) fn core_ref(&self) -> &FqCore {
        &self.core
    }

    /// Which tag it orders by.
    #[inline]
    pub fn mode(&self) -> FairQueueMode {
        self.core.mode
    }

    /// The node's virtual time (scaled normalized service).
    pub fn virtual_time(&self) -> u64 {
        self.core.vtime
    }

    /// A client's current start tag.
    pub fn start_tag(&self, id: ClientId) -> u64 {
        self.clients[id as usize].start_tag()
    }
}

impl Scheduler for FairQueue {
    fn add_client(&mut self, id: ClientId, params: &ClientParams) {
        let i = id as usize;
        if self.clients.len() <= i {
            self.clients.resize(i + 1, FqClient::default());
        }
        self.core.add_client(&mut self.clients, id, params);
        if self.keep_stats {
            if self.stats.len() <= i {
                self.stats.resize(i + 1, ClientStats::default());
            }
            self.stats[i] = ClientStats::default();
        }
    }
    fn update_client(&mut self, id: ClientId, params: &ClientParams) {
        self.core.update_client(&mut self.clients, id, params);
    }
    fn remove_client(&mut self, id: ClientId) {
        self.core.remove_client(&mut self.clients, id);
        if let Some(s) = self.stats.get_mut(id as usize) {
            *s = ClientStats::default();
        }
    }
    #[inline(always)]
    fn client_ready(&mut self, id: ClientId) {
        self.core.client_ready(&mut self.clients, id);
    }
    fn client_suspended(&mut self, id: ClientId) {
        self.core.client_suspended(&mut self.clients, id);
    }
    #[inline(always)]
    fn schedule(&mut self) -> Option<ClientId> {
        self.core.schedule(&mut self.clients)
    }
    #[inline(always)]
    fn resource_record(&mut self, id: ClientId, cost: u64, still_ready: bool) {
        self.core
            .resource_record(&mut self.clients, id, cost, still_ready);
        if self.keep_stats {
            let s = &mut self.stats[id as usize];
            s.charged += cost;
            s.dispatches += 1;
        }
    }
    fn client_statistics(&self, id: ClientId) -> ClientStats {
        self.stats.get(id as usize).copied().unwrap_or_default()
    }
    #[inline]
    fn ready_count(&self) -> usize {
        self.core.ready
    }
}

#[cfg(test)]
mod layout {
    /// A decision under a cold cache costs one miss per client line it looks at only while a
    /// client's state is one line (the owner took 4 of the bytes the statistics left).
    #[test]
    fn a_fair_queue_client_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<super::FqClient>(), 64);
    }
}
