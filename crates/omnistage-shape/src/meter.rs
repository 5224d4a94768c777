//! The shaping decisions, in safe code and without a clock: the state of one shaping group (its
//! buckets and its members) as a plain `#[repr(C)]` struct that lives in a shared-memory segment
//! (see `sys`), and the rules that decide, for a member about to move bytes, how many it may move
//! now or until when it must wait.
//!
//! The buckets are omnistage's own [`Shaper`]s: their running state is kept here as plain numbers
//! and rebuilt around each decision with [`Shaper::from_state`].
//!
//! Rules:
//! - A stream transfer (a file, a TCP socket) reserves its bytes before the call and gives back
//!   what the call did not move. A token bucket lets it start once the bucket holds
//!   `min(want, depth / 2)` bytes and grants what the bucket holds, so over any window `T` a
//!   bucket passes at most `rate·T + depth`. A token bucket's depth is its burst; a leaky
//!   bucket's is one quantum (10 ms at the rate), as TAP builds its leaky bucket: a token bucket
//!   limited to one token (see [`BucketCfg::depth`]).
//! - A message transfer (UDP, SEQPACKET) cannot be cut: it waits until the bucket is out of debt
//!   and is charged afterwards, for what it moved.
//! - An atomic transfer (a write to a file, which the kernel makes in one piece) starts as a
//!   stream transfer does and is granted all its bytes, charged before the call: the bucket
//!   goes into debt for what it lacked, and the next transfer waits it out. Over any window `T`
//!   at most `rate·T + depth + ` the largest such write; over time, the rate (a debt deeper
//!   than an hour at the rate is cut to that by [`Shaper::from_state`]).
//! - A deferred transfer (a blocking read from a stream socket, which may wait long for its
//!   peer) starts and is granted as a stream transfer but reserves nothing while it waits: it is
//!   charged afterwards for what it moved ([`Mode::Deferred`]).
//! - Members share each bucket by weight (start-time fair queueing): a member waiting for a
//!   bucket lets a waiting member with a smaller virtual time go first; a member whose virtual
//!   time is smallest, or who has nobody waiting beside it, goes. Idle members bank nothing (a
//!   member that becomes active again starts at the active members' smallest virtual time), and
//!   a member that stops asking stops counting within [`WAIT_GRACE_NS`]: the group is work
//!   conserving, and a dead member's share returns at once (its slot is freed when its owner
//!   process is found dead).

use omnistage::sched::{Shaper, ShaperKind, ShaperSpec};

/// Buckets a group can have: all I/O, network, disk, reads, writes. A transfer is charged to every
/// configured bucket that covers it.
pub const BUCKETS: usize = 5;
pub const BUCKET_NAMES: [&str; BUCKETS] = ["all", "net", "disk", "read", "write"];
const B_ALL: usize = 0;
pub(crate) const B_NET: usize = 1;
pub(crate) const B_DISK: usize = 2;
const B_READ: usize = 3;
const B_WRITE: usize = 4;

/// Kinds of bytes a group counts for its reports: network in, network out, disk read, disk
/// written.
pub const IO_KINDS: usize = 4;
pub const IO_NAMES: [&str; IO_KINDS] = ["net_in", "net_out", "disk_read", "disk_write"];
/// Longest activity path a group can report to (the runtime's paths are shorter).
pub const ACTIVITY_BYTES_MAX: usize = 256;

/// Members in one group (processes started by separate `omnistage shape` commands).
pub const MEMBERS_MAX: usize = 64;
/// Largest weight of a member.
pub const WEIGHT_MAX: u32 = 10_000;
/// Virtual time advances by `bytes * VT_SCALE / weight`.
const VT_SCALE: u64 = 1 << 16;
/// A waiting member counts as a contender until this long after the time it said it would come
/// back: a member that died or gave up stops holding the others back after this.
pub const WAIT_GRACE_NS: u64 = 20_000_000;
/// A member that has not asked for this long is idle: when it comes back it banks nothing.
pub const ACTIVE_NS: u64 = 100_000_000;
/// A member that lost its turn looks again after at most this long.
pub const TURN_NS: u64 = 1_000_000;
/// Dead owners are looked for at most this often.
pub const REAP_EVERY_NS: u64 = 100_000_000;
/// A leaky bucket's quantum is this fraction of a second at its rate (10 ms).
const QUANTUM_DIV: u64 = 100;

/// What a descriptor is, for shaping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    Net,
    Disk,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    Read,
    Write,
}

/// How a transfer may be cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Any prefix of the bytes may move (files, stream sockets).
    Stream,
    /// All or nothing (datagram and message sockets): charged after the call.
    Whole,
    /// All in one call, as the kernel makes it atomic (a write to a file: with `O_APPEND`, or
    /// on a description shared across `fork`, another writer's bytes never land inside it).
    /// Starts when a stream transfer would, and is granted and charged all its bytes before the
    /// call (see [`GroupState::request`]).
    Atomic,
    /// A stream transfer that may wait in the kernel for its peer (a blocking read from a stream
    /// socket): starts and is granted as [`Mode::Stream`], but reserves nothing; it is charged
    /// after the call for what it moved.
    ///
    /// Reserved, a read waiting for its peer would hold the tokens all that time, from every
    /// other transfer of the group (a thread's download got 1 to 2 % of the rate beside a
    /// thread waiting on a quiet socket: the tokens went back only when a byte came, and were
    /// taken again at once). The grant still caps what the read may move; readers that started
    /// on the same tokens put the bucket in debt by what they moved beyond them, which the next
    /// transfer waits out, so the rate holds over time (any window `T`: `rate·T + depth` plus
    /// what concurrent readers were granted twice). Waiting for readability first (a real poll)
    /// would keep the reservation exact, but would have to redo what the kernel does in a
    /// blocking `recv` (`SO_RCVTIMEO`, restarting after a signal or not), and another thread
    /// may still take the bytes between the poll and the `recv`.
    Deferred,
}

/// How many times a transfer's bytes count against each bucket (a `sendfile` from a file to a
/// socket counts once as a disk read and once as a network write; with `--rate`, twice in `all`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Need {
    pub mult: [u8; BUCKETS],
    /// How many times the bytes count as each of [`IO_NAMES`] in the group's reports.
    pub io: [u8; IO_KINDS],
}

impl Need {
    pub fn add(&mut self, class: Class, dir: Dir) {
        self.mult[B_ALL] += 1;
        self.mult[if class == Class::Net { B_NET } else { B_DISK }] += 1;
        self.mult[if dir == Dir::Read { B_READ } else { B_WRITE }] += 1;
        self.io[match (class, dir) {
            (Class::Net, Dir::Read) => 0,
            (Class::Net, Dir::Write) => 1,
            (Class::Disk, Dir::Read) => 2,
            (Class::Disk, Dir::Write) => 3,
        }] += 1;
    }
    pub fn of(class: Class, dir: Dir) -> Need {
        let mut n = Need::default();
        n.add(class, dir);
        n
    }
}

/// One bucket's configuration as the segment holds it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BucketCfg {
    /// 1 if this bucket is configured.
    pub present: u32,
    /// 0 token, 1 leaky.
    pub kind: u32,
    pub rate_per_s: u64,
    pub burst: u64,
}

impl BucketCfg {
    /// The bucket's depth: the burst of a token bucket; one quantum (10 ms at the rate) for a
    /// leaky bucket, TAP's "token bucket limited to one token". A zero-tolerance meter would
    /// lose whatever accrues while the program wakes up late (about a tenth of the rate measured
    /// through curl), a quantum's tolerance keeps the rate and still bounds any window `T` to
    /// `rate·T + quantum`.
    pub fn depth(&self) -> u64 {
        if self.kind == 1 {
            (self.rate_per_s / QUANTUM_DIV).max(1)
        } else {
            self.burst
        }
    }
    /// The omnistage shaper that runs this bucket (see [`BucketCfg::depth`]).
    pub fn spec(&self) -> ShaperSpec {
        ShaperSpec::token(self.rate_per_s, self.depth().max(1))
    }
    pub fn from_spec(spec: ShaperSpec) -> BucketCfg {
        BucketCfg {
            present: 1,
            kind: u32::from(spec.kind == ShaperKind::Leaky),
            rate_per_s: spec.rate_per_s,
            burst: spec.burst,
        }
    }
}

/// A group's configuration: one optional bucket per [`BUCKET_NAMES`] entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupCfg {
    pub buckets: [BucketCfg; BUCKETS],
}

impl GroupCfg {
    pub fn is_unlimited(&self) -> bool {
        self.buckets.iter().all(|b| b.present == 0)
    }
    pub fn validate(&self) -> Result<(), String> {
        for (i, b) in self.buckets.iter().enumerate() {
            if b.present != 0 {
                b.spec()
                    .validate()
                    .map_err(|e| format!("{} bucket: {e}", BUCKET_NAMES[i]))?;
                if b.kind == 0 && b.burst == 0 {
                    return Err(format!(
                        "{} bucket: a token bucket needs a burst of at least 1 byte",
                        BUCKET_NAMES[i]
                    ));
                }
            }
        }
        Ok(())
    }
    /// `all=1.00 MiB/s token burst 10.00 KiB, ...` for messages.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .buckets
            .iter()
            .enumerate()
            .filter(|(_, b)| b.present != 0)
            .map(|(i, b)| {
                if b.kind == 1 {
                    format!(
                        "{}={} leaky",
                        BUCKET_NAMES[i],
                        crate::units::format_rate(b.rate_per_s)
                    )
                } else {
                    format!(
                        "{}={} token burst {}",
                        BUCKET_NAMES[i],
                        crate::units::format_rate(b.rate_per_s),
                        crate::units::format_size(b.burst)
                    )
                }
            })
            .collect();
        if parts.is_empty() {
            "unlimited".into()
        } else {
            parts.join(", ")
        }
    }
}

/// A bucket's running state (the [`Shaper`]'s balance split in two words, and its clock).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BucketRun {
    pub balance_lo: u64,
    pub balance_hi: i64,
    pub last_ns: u64,
    /// Bytes charged to this bucket since the group began (a counter for reports).
    pub bytes: u64,
}

impl BucketRun {
    fn balance(&self) -> i128 {
        (i128::from(self.balance_hi) << 64) | i128::from(self.balance_lo)
    }
    pub(crate) fn store(&mut self, s: &Shaper) {
        let (b, last) = s.state();
        self.balance_lo = b as u64;
        self.balance_hi = (b >> 64) as i64;
        self.last_ns = last;
    }
}

/// One member of a group.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Member {
    pub in_use: u32,
    pub weight: u32,
    /// The process that owns the slot; the slot is freed when it is found dead.
    pub owner_pid: i32,
    /// Changes each time the slot is taken, so a process holding a stale slot notices.
    pub generation: u32,
    pub vtime: [u64; BUCKETS],
    /// When this member said it would come back for each bucket (0: not waiting).
    pub waiting_until_ns: [u64; BUCKETS],
    /// When this member last asked for each bucket.
    pub last_seen_ns: [u64; BUCKETS],
    /// When [`GroupState::ready_at`] first let this member go for each bucket since it last
    /// asked for bytes (0: not since): a program that polled a socket and, so far, read nothing
    /// from it. [`WAIT_GRACE_NS`] after that, it no longer counts as active, however often it
    /// polls.
    pub released_ns: [u64; BUCKETS],
    pub bytes: u64,
}

impl Member {
    /// Whether this member counts as active on bucket `b`: it asked within [`ACTIVE_NS`] (a
    /// poll counts, but not for longer than [`WAIT_GRACE_NS`] after a poll let it go and it did
    /// not ask for bytes), or it waits for the bucket now. An inactive member that comes back
    /// banks nothing.
    ///
    /// Why a grace after the poll: programs poll again before they read (curl checks its socket
    /// with a zero-timeout poll before each read); counting that second poll as a return from
    /// idleness took each member back to the others' virtual time at every read, and two curls
    /// at weights 2:1 shared 1:1.
    fn active(&self, b: usize, now_ns: u64) -> bool {
        let released = self.released_ns[b];
        let asked = self.last_seen_ns[b] != 0
            && self.last_seen_ns[b].saturating_add(ACTIVE_NS) >= now_ns
            && (released == 0 || released.saturating_add(WAIT_GRACE_NS) >= now_ns);
        asked || self.waits(b, now_ns)
    }

    /// Whether this member waits for bucket `b` (until the time it said it would come back,
    /// and [`WAIT_GRACE_NS`] after).
    fn waits(&self, b: usize, now_ns: u64) -> bool {
        self.waiting_until_ns[b] != 0
            && self.waiting_until_ns[b].saturating_add(WAIT_GRACE_NS) >= now_ns
    }
}

/// The whole shared state of a group.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GroupState {
    pub cfg: GroupCfg,
    pub run: [BucketRun; BUCKETS],
    pub members: [Member; MEMBERS_MAX],
    pub generation_next: u32,
    /// Set when the last member left and the segment is being removed: joiners must start anew.
    pub closed: u32,
    pub last_reap_ns: u64,
    /// Bytes the group moved since it began, by [`IO_NAMES`] (counted while `counted` is set).
    pub io: [u64; IO_KINDS],
    /// The part of `io` a reporter has sent on (see `link`).
    pub io_reported: [u64; IO_KINDS],
    /// 1 once a reporter claimed the group: the hooks count bytes even without a bucket.
    pub counted: u32,
    /// Set when `cfg` or `counted` changed; the segment's lock clears it and bumps the epoch
    /// the hooks watch (`sys`).
    pub cfg_changed: u32,
    /// The launcher that reports the group's bytes (0: none).
    pub reporter_pid: i32,
    /// The activity the group reports to (`activity_len` bytes of UTF-8).
    pub activity_len: u32,
    pub activity: [u8; ACTIVITY_BYTES_MAX],
}

/// A member's handle: its slot and the slot's generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub index: u32,
    pub generation: u32,
}

/// The outcome of [`GroupState::request`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Move at most this many bytes now (reserved for a stream transfer); call
    /// [`GroupState::settle`] afterwards with what moved.
    Go(u64),
    /// Nothing may move before this time.
    Wait(u64),
}

/// When bucket `s` (refilled to `now_ns`) will hold `units`.
fn holds_at(s: &Shaper, units: u64, now_ns: u64) -> u64 {
    let (balance, _) = s.state();
    let deficit = i128::from(units) * 1_000_000_000 - balance;
    let rate = i128::from(s.spec().rate_per_s);
    let wait = ((deficit + rate - 1) / rate).clamp(1, i128::from(u64::MAX / 2));
    now_ns.saturating_add(wait as u64)
}

impl GroupState {
    /// A new group with full buckets at `now_ns`.
    pub fn new(cfg: GroupCfg, now_ns: u64) -> Result<GroupState, String> {
        cfg.validate()?;
        let mut g = GroupState {
            cfg,
            run: [BucketRun::default(); BUCKETS],
            members: [Member::default(); MEMBERS_MAX],
            generation_next: 1,
            closed: 0,
            last_reap_ns: now_ns,
            io: [0; IO_KINDS],
            io_reported: [0; IO_KINDS],
            counted: 0,
            cfg_changed: 0,
            reporter_pid: 0,
            activity_len: 0,
            activity: [0; ACTIVITY_BYTES_MAX],
        };
        for i in 0..BUCKETS {
            if cfg.buckets[i].present != 0 {
                let s = Shaper::new(cfg.buckets[i].spec(), now_ns);
                g.run[i].store(&s);
            }
        }
        Ok(g)
    }

    /// Members in use.
    pub fn member_count(&self) -> usize {
        self.members.iter().filter(|m| m.in_use != 0).count()
    }

    /// Takes a free slot for a member of `weight` owned by process `pid`.
    pub fn join(&mut self, pid: i32, weight: u32, now_ns: u64) -> Result<Slot, String> {
        if weight == 0 || weight > WEIGHT_MAX {
            return Err(format!("weight must be in 1..={WEIGHT_MAX}, got {weight}"));
        }
        let vmin = self.active_vmin(None, now_ns);
        let Some(index) = self.members.iter().position(|m| m.in_use == 0) else {
            return Err(format!("the group is full ({MEMBERS_MAX} members)"));
        };
        let generation = self.generation_next;
        self.generation_next = self.generation_next.wrapping_add(1).max(1);
        self.members[index] = Member {
            in_use: 1,
            weight,
            owner_pid: pid,
            generation,
            vtime: vmin,
            waiting_until_ns: [0; BUCKETS],
            last_seen_ns: [0; BUCKETS],
            released_ns: [0; BUCKETS],
            bytes: 0,
        };
        Ok(Slot {
            index: index as u32,
            generation,
        })
    }

    /// Whether `slot` is still the member it was given to.
    pub fn holds(&self, slot: Slot) -> bool {
        self.members
            .get(slot.index as usize)
            .is_some_and(|m| m.in_use != 0 && m.generation == slot.generation)
    }

    /// Frees `slot` (a no-op if it was already freed or taken by someone else).
    pub fn leave(&mut self, slot: Slot) {
        if self.holds(slot) {
            self.members[slot.index as usize] = Member::default();
        }
    }

    /// Frees the slots whose owner is dead, at most every [`REAP_EVERY_NS`].
    pub fn reap(&mut self, now_ns: u64, alive: impl Fn(i32) -> bool) {
        if now_ns < self.last_reap_ns.saturating_add(REAP_EVERY_NS) {
            return;
        }
        self.last_reap_ns = now_ns;
        for m in self.members.iter_mut() {
            if m.in_use != 0 && !alive(m.owner_pid) {
                *m = Member::default();
            }
        }
    }

    /// The smallest virtual time per bucket over active members other than `except`.
    fn active_vmin(&self, except: Option<usize>, now_ns: u64) -> [u64; BUCKETS] {
        let mut v = [u64::MAX; BUCKETS];
        for (i, m) in self.members.iter().enumerate() {
            if m.in_use == 0 || Some(i) == except {
                continue;
            }
            for (b, vb) in v.iter_mut().enumerate() {
                if m.active(b, now_ns) {
                    *vb = (*vb).min(m.vtime[b]);
                }
            }
        }
        for vb in v.iter_mut() {
            if *vb == u64::MAX {
                *vb = 0;
            }
        }
        v
    }

    /// Whether a member other than `me` waits for bucket `b` with a smaller virtual time.
    fn someone_before(&self, me: usize, b: usize, now_ns: u64) -> bool {
        let mine = self.members[me].vtime[b];
        self.members
            .iter()
            .enumerate()
            .any(|(i, m)| i != me && m.in_use != 0 && m.waits(b, now_ns) && m.vtime[b] < mine)
    }

    pub(crate) fn shaper(&self, b: usize) -> Shaper {
        let run = &self.run[b];
        Shaper::from_state(self.cfg.buckets[b].spec(), run.balance(), run.last_ns)
            .unwrap_or_else(|_| Shaper::new(ShaperSpec::leaky(1), run.last_ns))
    }

    /// May `slot` move up to `want` bytes needing `need` now? On [`Verdict::Go`] the bytes are
    /// reserved (stream: what the bucket holds; atomic: all `want`, the bucket going into debt
    /// for what it lacks; deferred: nothing, charged in `settle`) and the member is marked as
    /// served; on [`Verdict::Wait`] it is marked as
    /// waiting until then, so that the others let it take its turn.
    pub fn request(
        &mut self,
        slot: Slot,
        need: &Need,
        want: u64,
        mode: Mode,
        now_ns: u64,
    ) -> Verdict {
        let me = slot.index as usize;
        if !self.holds(slot) || want == 0 {
            return Verdict::Go(want);
        }
        // A member coming back from idleness starts at the active members' smallest virtual time.
        let vmin = self.active_vmin(Some(me), now_ns);
        let mut grant = want;
        let mut until = 0u64;
        for (b, &vmin_b) in vmin.iter().enumerate() {
            let mult = u64::from(need.mult[b]);
            if mult == 0 || self.cfg.buckets[b].present == 0 {
                continue;
            }
            let m = &mut self.members[me];
            // `last_seen_ns` counts polls too: a member that a poll let go and that asks now
            // (the program reading what it polled for) keeps its place, although ready_at does
            // not count it as active (`Member::active`). A member back from a wait is not idle
            // however long the wait was (half a large burst to refill, an atomic write's debt):
            // taken back to the others' virtual time, it lost its turn to whoever had just
            // been served, and a member of weight 1 beside one of weight 2 got 2 % of the rate.
            let was_active = (m.last_seen_ns[b] != 0
                && m.last_seen_ns[b].saturating_add(ACTIVE_NS) >= now_ns)
                || m.waits(b, now_ns);
            if !was_active {
                m.vtime[b] = m.vtime[b].max(vmin_b);
            }
            m.last_seen_ns[b] = now_ns;
            m.released_ns[b] = 0;
            let cfg = self.cfg.buckets[b];
            let mut s = self.shaper(b);
            let (g, ready_at) = match mode {
                Mode::Whole => (want, s.eligible_at(now_ns)),
                Mode::Stream | Mode::Atomic | Mode::Deferred => {
                    let avail = s.available(now_ns) / mult;
                    // Half the depth is enough to start: a member woken a little late still
                    // finds room in the bucket for what accrued meanwhile (waiting for a full
                    // bucket would lose every token earned past the full mark).
                    let threshold = want.min((cfg.depth() / 2 / mult).max(1));
                    if avail < threshold {
                        (0, holds_at(&s, threshold * mult, now_ns))
                    } else if mode == Mode::Atomic {
                        // All of it, paid now: what the bucket lacks is a debt that the next
                        // transfer waits out (request() grants nothing while the bucket is
                        // below its threshold), so over time the rate holds exactly. Over a
                        // window T at most rate·T + depth + the largest such transfer pass,
                        // since that is what the kernel moves in one call. Waiting first
                        // until the bucket held it all could not work past the depth (a
                        // bucket never holds more), and waiting for a full bucket would lose
                        // what accrues past it while the program wakes.
                        (want, now_ns)
                    } else {
                        (avail, now_ns)
                    }
                }
            };
            self.run[b].store(&s);
            let mut at = ready_at;
            if self.someone_before(me, b, now_ns) {
                at = at.max(now_ns + TURN_NS);
            }
            if at > now_ns {
                until = until.max(at);
            } else {
                grant = grant.min(g);
            }
        }
        if until > now_ns {
            let m = &mut self.members[me];
            for b in 0..BUCKETS {
                if need.mult[b] != 0 && self.cfg.buckets[b].present != 0 {
                    m.waiting_until_ns[b] = until;
                }
            }
            return Verdict::Wait(until);
        }
        let grant = grant.max(1).min(want);
        for b in 0..BUCKETS {
            let mult = u64::from(need.mult[b]);
            if mult == 0 || self.cfg.buckets[b].present == 0 {
                continue;
            }
            self.members[me].waiting_until_ns[b] = 0;
            // Reserved now: stream and atomic transfers (a deferred one is charged in settle).
            if mode == Mode::Stream || mode == Mode::Atomic {
                let mut s = self.shaper(b);
                s.charge(grant * mult, now_ns);
                self.run[b].store(&s);
                let w = u64::from(self.members[me].weight.max(1));
                let v = &mut self.members[me].vtime[b];
                *v = v.saturating_add(grant * mult * VT_SCALE / w);
            }
        }
        Verdict::Go(grant)
    }

    /// After a transfer granted `granted` bytes moved `moved` (0 on error): gives back the unused
    /// reservation (stream, atomic) or charges what moved (whole, deferred).
    pub fn settle(
        &mut self,
        slot: Slot,
        need: &Need,
        mode: Mode,
        granted: u64,
        moved: u64,
        now_ns: u64,
    ) {
        if !self.holds(slot) {
            return;
        }
        let me = slot.index as usize;
        let w = u64::from(self.members[me].weight.max(1));
        self.members[me].bytes = self.members[me].bytes.saturating_add(moved);
        if self.counted != 0 {
            for (total, &times) in self.io.iter_mut().zip(need.io.iter()) {
                *total = total.saturating_add(moved * u64::from(times));
            }
        }
        for b in 0..BUCKETS {
            let mult = u64::from(need.mult[b]);
            if mult == 0 || self.cfg.buckets[b].present == 0 {
                continue;
            }
            let mut s = self.shaper(b);
            let v = &mut self.members[me].vtime[b];
            match mode {
                Mode::Stream | Mode::Atomic => {
                    let unused = granted.saturating_sub(moved) * mult;
                    s.refund(unused, now_ns);
                    *v = v.saturating_sub(unused * VT_SCALE / w);
                }
                Mode::Whole | Mode::Deferred => {
                    s.charge(moved * mult, now_ns);
                    *v = v.saturating_add(moved * mult * VT_SCALE / w);
                }
            }
            self.run[b].store(&s);
            self.run[b].bytes = self.run[b].bytes.saturating_add(moved * mult);
        }
    }

    /// When could `slot` move bytes needing `need`? `None`: now. Marks the member as waiting
    /// when it cannot (a program waiting in poll for a descriptor it may not use yet), and as
    /// no longer waiting when it can.
    ///
    /// A poll says nothing of whether the program has bytes to move: it may poll a socket with
    /// nothing to read, again and again. So a poll is no transfer: a member that was not active
    /// comes to the poll at the active members' smallest virtual time, as it would to a
    /// transfer (it banks nothing), and a member the poll lets go stops being waited for at
    /// once (others yielded to it while it was held) and, if it does not ask for bytes within
    /// [`WAIT_GRACE_NS`], counts as inactive until it does (it read nothing; see
    /// [`Member::active`]). Without this, a member polling an idle socket every 50 ms kept
    /// the virtual time it had when it began, was waited for by the others at every poll and
    /// for [`WAIT_GRACE_NS`] after (a bulk member of the group lost a third of the rate), and
    /// banked the difference for when it would read.
    pub fn ready_at(&mut self, slot: Slot, need: &Need, now_ns: u64) -> Option<u64> {
        if !self.holds(slot) {
            return None;
        }
        let me = slot.index as usize;
        let vmin = self.active_vmin(Some(me), now_ns);
        for (b, &vmin_b) in vmin.iter().enumerate() {
            if need.mult[b] != 0
                && self.cfg.buckets[b].present != 0
                && !self.members[me].active(b, now_ns)
            {
                let v = &mut self.members[me].vtime[b];
                *v = (*v).max(vmin_b);
            }
        }
        let mut until = 0u64;
        for b in 0..BUCKETS {
            if need.mult[b] == 0 || self.cfg.buckets[b].present == 0 {
                continue;
            }
            let cfg = self.cfg.buckets[b];
            let mut s = self.shaper(b);
            // What request() needs before it grants a transfer of half the depth or more.
            let threshold = (cfg.depth() / 2).max(1);
            let at = if s.available(now_ns) >= threshold {
                now_ns
            } else {
                holds_at(&s, threshold, now_ns)
            };
            self.run[b].store(&s);
            let at = if self.someone_before(me, b, now_ns) {
                at.max(now_ns + TURN_NS)
            } else {
                at
            };
            until = until.max(at);
        }
        let held = until > now_ns;
        for b in 0..BUCKETS {
            if need.mult[b] != 0 && self.cfg.buckets[b].present != 0 {
                let m = &mut self.members[me];
                m.last_seen_ns[b] = now_ns;
                if held {
                    m.waiting_until_ns[b] = until;
                } else if m.waiting_until_ns[b] <= now_ns {
                    // Let go. A wait still to come is another descriptor's or direction's
                    // (this poll's read held, its write not), or another thread's: it stays.
                    m.waiting_until_ns[b] = 0;
                    if m.released_ns[b] == 0 {
                        m.released_ns[b] = now_ns.max(1);
                    }
                }
            }
        }
        held.then_some(until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn one(kind: u32, rate: u64, burst: u64, bucket: usize) -> GroupCfg {
        let mut cfg = GroupCfg::default();
        cfg.buckets[bucket] = BucketCfg {
            present: 1,
            kind,
            rate_per_s: rate,
            burst,
        };
        cfg
    }

    /// A group of `rate` (token, 10 KB burst) with members of weights `weight_a` and 1.
    fn two(rate: u64, weight_a: u32) -> (GroupState, Slot, Slot) {
        let mut g = GroupState::new(one(0, rate, 10_000, B_ALL), 0).unwrap();
        let a = g.join(1, weight_a, 0).unwrap();
        let b = g.join(2, 1, 0).unwrap();
        (g, a, b)
    }

    /// Runs `members` greedy stream readers of `chunk` bytes on `bucket` for `seconds` of simulated
    /// time, each coming back when told; returns the bytes each moved.
    fn simulate(
        g: &mut GroupState,
        slots: &[Slot],
        need: Need,
        chunk: u64,
        end_ns: u64,
        stop_ns: &[u64],
    ) -> Vec<u64> {
        let mut next = vec![0u64; slots.len()];
        let mut moved = vec![0u64; slots.len()];
        loop {
            // The member due first acts.
            let (i, &t) = next
                .iter()
                .enumerate()
                .filter(|(i, _)| next[*i] < stop_ns[*i])
                .min_by_key(|(_, t)| **t)
                .unwrap_or((usize::MAX, &u64::MAX));
            if i == usize::MAX || t >= end_ns {
                break;
            }
            match g.request(slots[i], &need, chunk, Mode::Stream, t) {
                Verdict::Go(n) => {
                    g.settle(slots[i], &need, Mode::Stream, n, n, t);
                    moved[i] += n;
                    next[i] = t + 1000; // a microsecond to use the bytes
                }
                Verdict::Wait(until) => {
                    assert!(until > t);
                    next[i] = until;
                }
            }
        }
        moved
    }

    #[test]
    fn token_bucket_grants_the_burst_then_the_rate() {
        let mut g = GroupState::new(one(0, 1_000_000, 10_000, B_ALL), 0).unwrap();
        let s = g.join(1, 1, 0).unwrap();
        let need = Need::of(Class::Disk, Dir::Read);
        assert_eq!(
            g.request(s, &need, 65_536, Mode::Stream, 0),
            Verdict::Go(10_000)
        );
        g.settle(s, &need, Mode::Stream, 10_000, 10_000, 0);
        // Empty: a transfer starts once half a burst (5 000 bytes) is in: 5 ms at 1 MB/s...
        assert_eq!(
            g.request(s, &need, 65_536, Mode::Stream, 0),
            Verdict::Wait(5 * MS)
        );
        // ...and takes what the bucket holds when it comes (late here: 7 ms, 7 000 bytes).
        assert_eq!(
            g.request(s, &need, 65_536, Mode::Stream, 7 * MS),
            Verdict::Go(7_000)
        );
        // A short transfer gives back what it did not use.
        g.settle(s, &need, Mode::Stream, 7_000, 4_000, 7 * MS);
        assert_eq!(
            g.request(s, &need, 100, Mode::Stream, 7 * MS),
            Verdict::Go(100)
        );
    }

    #[test]
    fn a_long_run_stays_within_rate_times_window_plus_burst() {
        for (kind, burst) in [(0u32, 5_000u64), (1, 0)] {
            let rate = 1_000_000;
            let mut g = GroupState::new(one(kind, rate, burst, B_NET), 0).unwrap();
            let s = g.join(1, 1, 0).unwrap();
            let need = Need::of(Class::Net, Dir::Read);
            let mut t = 0;
            let mut log: Vec<(u64, u64)> = Vec::new();
            while t < 2_000 * MS {
                match g.request(s, &need, 16_384, Mode::Stream, t) {
                    Verdict::Go(n) => {
                        g.settle(s, &need, Mode::Stream, n, n, t);
                        log.push((t, n));
                        t += 1000;
                    }
                    Verdict::Wait(u) => t = u,
                }
            }
            let total: u64 = log.iter().map(|x| x.1).sum();
            // 2 s at 1 MB/s, plus the first burst.
            assert!(total <= 2 * rate + burst + rate / 100, "{kind}: {total}");
            assert!(total >= 2 * rate - rate / 100, "{kind}: {total}");
            let quantum = if kind == 1 { rate / 100 } else { burst };
            for w in 0..20 {
                let (a, b) = (w * 100 * MS, (w + 1) * 100 * MS);
                let in_w: u64 = log
                    .iter()
                    .filter(|x| x.0 >= a && x.0 < b)
                    .map(|x| x.1)
                    .sum();
                assert!(in_w <= rate / 10 + quantum, "{kind} window {w}: {in_w}");
            }
        }
    }

    #[test]
    fn weighted_members_share_two_to_one_and_an_idle_share_goes_to_the_other() {
        let rate = 1_000_000;
        let (mut g, a, b) = two(rate, 2);
        let need = Need::of(Class::Net, Dir::Read);
        let moved = simulate(
            &mut g,
            &[a, b],
            need,
            16_384,
            3_000 * MS,
            &[u64::MAX, u64::MAX],
        );
        let share_a = moved[0] as f64 / (moved[0] + moved[1]) as f64;
        assert!((share_a - 2.0 / 3.0).abs() < 0.02, "{moved:?}");
        let total = moved[0] + moved[1];
        assert!(
            total as f64 >= 2.9 * rate as f64,
            "work conserving: {total}"
        );
        // b stops at 1 s: a takes the whole rate from then on.
        let (mut g, a, b) = two(rate, 2);
        let moved = simulate(
            &mut g,
            &[a, b],
            need,
            16_384,
            3_000 * MS,
            &[u64::MAX, 1_000 * MS],
        );
        assert!(moved[1] as f64 <= 0.36 * rate as f64, "{moved:?}");
        assert!(moved[0] as f64 >= 2.6 * rate as f64, "{moved:?}");
    }

    #[test]
    fn an_idle_member_banks_nothing() {
        let rate = 1_000_000;
        let (mut g, a, b) = two(rate, 1);
        let need = Need::of(Class::Net, Dir::Read);
        // a alone for 1 s, then both: from then on they split evenly (b does not catch up).
        let first = simulate(&mut g, &[a, b], need, 16_384, 1_000 * MS, &[u64::MAX, 0]);
        assert!(first[0] > 900_000);
        let mut next = [1_000 * MS; 2];
        let mut moved = [0u64; 2];
        while next.iter().min().copied().unwrap() < 2_000 * MS {
            let i = if next[0] <= next[1] { 0 } else { 1 };
            let s = [a, b][i];
            match g.request(s, &need, 16_384, Mode::Stream, next[i]) {
                Verdict::Go(n) => {
                    g.settle(s, &need, Mode::Stream, n, n, next[i]);
                    moved[i] += n;
                    next[i] += 1000;
                }
                Verdict::Wait(u) => next[i] = u,
            }
        }
        let share_b = moved[1] as f64 / (moved[0] + moved[1]) as f64;
        assert!((share_b - 0.5).abs() < 0.03, "{moved:?}");
    }

    #[test]
    fn a_member_polling_without_transferring_does_not_stall_the_others() {
        // a reads greedily; b polls a socket that has no data, a poll every 50 ms: each poll
        // asks ready_at until the bucket would let b read (the held wait), then waits in the
        // kernel for the rest of its 50 ms. b never moves a byte, so a must get the rate.
        let rate = 1_000_000;
        let (mut g, a, b) = two(rate, 1);
        let need = Need::of(Class::Net, Dir::Read);
        let end = 3_000 * MS;
        let (mut next_a, mut next_b, mut poll_b) = (0u64, 0u64, 0u64);
        let mut moved = 0u64;
        let mut polls = 0;
        while next_a.min(next_b) < end {
            if next_a <= next_b {
                match g.request(a, &need, 16_384, Mode::Stream, next_a) {
                    Verdict::Go(n) => {
                        g.settle(a, &need, Mode::Stream, n, n, next_a);
                        moved += n;
                        next_a += 1000;
                    }
                    Verdict::Wait(u) => next_a = u,
                }
            } else {
                let deadline = poll_b + 50 * MS;
                match g.ready_at(b, &need, next_b) {
                    // Held: the poll sleeps until the bucket would let b read.
                    Some(u) if u < deadline => next_b = u,
                    // Polled as asked (or held to the end): nothing comes, the poll's 50 ms
                    // run out, and b polls again.
                    _ => {
                        poll_b = deadline;
                        next_b = deadline;
                        polls += 1;
                    }
                }
            }
        }
        assert!(polls >= 50, "b polled {polls} times");
        assert!(
            moved as f64 >= 0.95 * 3.0 * rate as f64,
            "a moved {moved} in 3 s at {rate} B/s"
        );
        // Polling banked b nothing: when it starts reading too, the two split the rate.
        let mut next = [end; 2];
        let mut moved = [0u64; 2];
        while next.iter().min().copied().unwrap() < end + 1_000 * MS {
            let i = if next[0] <= next[1] { 0 } else { 1 };
            let s = [a, b][i];
            match g.request(s, &need, 16_384, Mode::Stream, next[i]) {
                Verdict::Go(n) => {
                    g.settle(s, &need, Mode::Stream, n, n, next[i]);
                    moved[i] += n;
                    next[i] += 1000;
                }
                Verdict::Wait(u) => next[i] = u,
            }
        }
        let share_b = moved[1] as f64 / (moved[0] + moved[1]) as f64;
        assert!((share_b - 0.5).abs() < 0.05, "{moved:?}");
    }

    #[test]
    fn a_poll_let_go_in_one_direction_still_waits_in_the_other() {
        // A read bucket that is empty and an `all` bucket that is not: a poll asking to read
        // and to write is held for its read, on both buckets, and let go for its write; the
        // wait it still has (on `all`) stays.
        let mut cfg = one(0, 1_000_000, 10_000, B_ALL);
        cfg.buckets[B_READ] = BucketCfg {
            present: 1,
            kind: 0,
            rate_per_s: 1_000,
            burst: 100,
        };
        let mut g = GroupState::new(cfg, 0).unwrap();
        let s = g.join(1, 1, 0).unwrap();
        let read = Need::of(Class::Net, Dir::Read);
        assert_eq!(g.request(s, &read, 100, Mode::Stream, MS), Verdict::Go(100));
        g.settle(s, &read, Mode::Stream, 100, 100, MS);
        let until = g.ready_at(s, &read, 2 * MS).expect("the read is held");
        assert_eq!(
            g.ready_at(s, &Need::of(Class::Net, Dir::Write), 2 * MS),
            None
        );
        let m = g.members[s.index as usize];
        assert_eq!(m.waiting_until_ns[B_ALL], until);
        assert_eq!(m.released_ns[B_ALL], 0);
        // When it comes back and is let go, it waits no more.
        assert_eq!(g.ready_at(s, &read, until), None);
        let m = g.members[s.index as usize];
        assert_eq!(m.waiting_until_ns[B_ALL], 0);
        assert_eq!(m.waiting_until_ns[B_READ], 0);
    }

    #[test]
    fn members_that_poll_before_they_read_keep_their_weights() {
        // Two programs that poll (ready_at) until the bucket lets them read, poll again and
        // read (as curl does), weights 2 and 1: a poll is no transfer, but it must not cost a
        // member that reads its place either.
        let rate = 1_000_000;
        let (mut g, a, b) = two(rate, 2);
        let need = Need::of(Class::Net, Dir::Read);
        let mut next = [0u64; 2];
        let mut moved = [0u64; 2];
        while next.iter().min().copied().unwrap() < 3_000 * MS {
            let i = if next[0] <= next[1] { 0 } else { 1 };
            let s = [a, b][i];
            if let Some(u) = g.ready_at(s, &need, next[i]) {
                next[i] = u;
                continue;
            }
            // Polled as asked, and the socket is readable. Like curl, the program checks it
            // again with a zero-timeout poll, 20 µs later, and then reads.
            next[i] += 20_000;
            if let Some(u) = g.ready_at(s, &need, next[i]) {
                next[i] = u;
                continue;
            }
            match g.request(s, &need, 16_384, Mode::Stream, next[i]) {
                Verdict::Go(n) => {
                    g.settle(s, &need, Mode::Stream, n, n, next[i]);
                    moved[i] += n;
                    next[i] += 1000;
                }
                Verdict::Wait(u) => next[i] = u,
            }
        }
        let share_a = moved[0] as f64 / (moved[0] + moved[1]) as f64;
        assert!((share_a - 2.0 / 3.0).abs() < 0.03, "{moved:?}");
        let total = moved[0] + moved[1];
        assert!(total as f64 >= 2.9 * rate as f64, "{total}");
    }

    #[test]
    fn weights_hold_when_a_turn_takes_longer_than_the_idle_mark() {
        // Waits longer than ACTIVE_NS: a burst of 100,000 at 100,000 B/s (half a second to
        // refill half of it), or atomic writes of 16 KiB with a burst of 1,000 (each puts the
        // bucket 150 ms in debt). A member back from such a wait was waiting its turn, not
        // idle: it keeps its virtual time, and weights 2:1 still share 2:1.
        let need = Need::of(Class::Disk, Dir::Write);
        for (mode, burst, chunk) in [
            (Mode::Stream, 100_000, 65_536),
            (Mode::Atomic, 1_000, 16_384),
        ] {
            let mut g = GroupState::new(one(0, 100_000, burst, B_DISK), 0).unwrap();
            let a = g.join(1, 2, 0).unwrap();
            let b = g.join(2, 1, 0).unwrap();
            let mut next = [0u64; 2];
            let mut moved = [0u64; 2];
            while next.iter().min().copied().unwrap() < 30_000 * MS {
                let i = if next[0] <= next[1] { 0 } else { 1 };
                let s = [a, b][i];
                match g.request(s, &need, chunk, mode, next[i]) {
                    Verdict::Go(n) => {
                        g.settle(s, &need, mode, n, n, next[i]);
                        moved[i] += n;
                        next[i] += 1000;
                    }
                    Verdict::Wait(u) => next[i] = u,
                }
            }
            let share_a = moved[0] as f64 / (moved[0] + moved[1]) as f64;
            assert!((share_a - 2.0 / 3.0).abs() < 0.03, "{mode:?}: {moved:?}");
        }
    }

    #[test]
    fn a_dead_member_stops_holding_the_others_back() {
        let mut g = GroupState::new(one(0, 1_000_000, 10_000, B_ALL), 0).unwrap();
        let a = g.join(1, 1, 0).unwrap();
        let b = g.join(2, 1, 0).unwrap();
        let need = Need::of(Class::Net, Dir::Read);
        // b asks first, then a takes the bucket: b waits with a small virtual time...
        g.members[b.index as usize].vtime[B_ALL] = 0;
        g.members[a.index as usize].vtime[B_ALL] = 1 << 30;
        g.members[a.index as usize].last_seen_ns[B_ALL] = 1;
        g.members[b.index as usize].waiting_until_ns[B_ALL] = 5 * MS;
        // ...so a must let it go first.
        assert_eq!(
            g.request(a, &need, 1000, Mode::Stream, 2 * MS),
            Verdict::Wait(3 * MS)
        );
        // b never comes back (killed): after its time plus the grace, a goes.
        assert!(matches!(
            g.request(a, &need, 1000, Mode::Stream, 5 * MS + WAIT_GRACE_NS + 1),
            Verdict::Go(_)
        ));
        // Its slot is freed once its owner is found dead.
        g.reap(REAP_EVERY_NS + 1, |pid| pid != 2);
        assert!(!g.holds(b) && g.holds(a));
        assert_eq!(g.member_count(), 1);
    }

    #[test]
    fn an_atomic_transfer_goes_whole_and_its_debt_keeps_the_rate() {
        // 100,000 B/s, burst 1,000: 2,000-byte records (longer than the bucket is deep) each
        // go in one grant, and a greedy writer still moves no more than the rate allows.
        let rate = 100_000;
        let mut g = GroupState::new(one(0, rate, 1_000, B_DISK), 0).unwrap();
        let s = g.join(1, 1, 0).unwrap();
        let need = Need::of(Class::Disk, Dir::Write);
        assert_eq!(
            g.request(s, &need, 2_000, Mode::Atomic, 0),
            Verdict::Go(2_000)
        );
        g.settle(s, &need, Mode::Atomic, 2_000, 2_000, 0);
        // 1,000 bytes of debt: the next starts at half the depth, 15 ms later.
        assert_eq!(
            g.request(s, &need, 2_000, Mode::Atomic, 0),
            Verdict::Wait(15 * MS)
        );
        // A short write (a full disk) gives back what it did not move.
        assert_eq!(
            g.request(s, &need, 2_000, Mode::Atomic, 15 * MS),
            Verdict::Go(2_000)
        );
        g.settle(s, &need, Mode::Atomic, 2_000, 500, 15 * MS);
        // Back at 0 (not 1,500 in debt): half the depth is there 5 ms later.
        assert_eq!(
            g.request(s, &need, 2_000, Mode::Atomic, 15 * MS),
            Verdict::Wait(20 * MS)
        );
        // A greedy writer of 2,000-byte records for 4 s: every grant whole, the total within
        // the rate (plus the bucket and one record).
        let mut g = GroupState::new(one(0, rate, 1_000, B_DISK), 0).unwrap();
        let s = g.join(1, 1, 0).unwrap();
        let (mut t, mut total) = (0u64, 0u64);
        while t < 4_000 * MS {
            match g.request(s, &need, 2_000, Mode::Atomic, t) {
                Verdict::Go(n) => {
                    assert_eq!(n, 2_000);
                    g.settle(s, &need, Mode::Atomic, n, n, t);
                    total += n;
                    t += 1_000;
                }
                Verdict::Wait(u) => t = u,
            }
        }
        assert!(total <= 4 * rate + 1_000 + 2_000, "{total}");
        assert!(total >= 4 * rate - 2_000, "{total}");
    }

    #[test]
    fn a_deferred_transfer_holds_no_tokens_while_it_waits() {
        // 1 MB/s, burst 10,000; one member: a read waiting for its peer is granted the bucket
        // but reserves nothing, so another read of the same member goes meanwhile, and each
        // is charged for what it moved.
        let mut g = GroupState::new(one(0, 1_000_000, 10_000, B_NET), 0).unwrap();
        let s = g.join(1, 1, 0).unwrap();
        let need = Need::of(Class::Net, Dir::Read);
        assert_eq!(
            g.request(s, &need, 65_536, Mode::Deferred, 0),
            Verdict::Go(10_000)
        );
        assert_eq!(
            g.request(s, &need, 65_536, Mode::Deferred, 0),
            Verdict::Go(10_000)
        );
        g.settle(s, &need, Mode::Deferred, 10_000, 10_000, 0);
        // The waiting one comes back with one byte 2 ms later: 2,000 bytes accrued, 1 spent.
        g.settle(s, &need, Mode::Deferred, 10_000, 1, 2 * MS);
        assert_eq!(g.shaper(B_NET).available(2 * MS), 1_999);
        assert_eq!(g.run[B_NET].bytes, 10_001);
        // Both moved all they were granted: the second's debt is waited out.
        let mut g = GroupState::new(one(0, 1_000_000, 10_000, B_NET), 0).unwrap();
        let s = g.join(1, 1, 0).unwrap();
        for _ in 0..2 {
            assert_eq!(
                g.request(s, &need, 65_536, Mode::Deferred, 0),
                Verdict::Go(10_000)
            );
        }
        g.settle(s, &need, Mode::Deferred, 10_000, 10_000, 0);
        g.settle(s, &need, Mode::Deferred, 10_000, 10_000, 0);
        // 10,000 in debt: half the depth (5,000) is there 15 ms later.
        assert_eq!(
            g.request(s, &need, 65_536, Mode::Deferred, 0),
            Verdict::Wait(15 * MS)
        );
    }

    #[test]
    fn whole_messages_are_charged_after_and_wait_out_the_debt() {
        let mut g = GroupState::new(one(0, 1000, 100, B_NET), 0).unwrap();
        let s = g.join(1, 1, 0).unwrap();
        let need = Need::of(Class::Net, Dir::Write);
        assert_eq!(g.request(s, &need, 1500, Mode::Whole, 0), Verdict::Go(1500));
        g.settle(s, &need, Mode::Whole, 1500, 1500, 0);
        // 1400 bytes of debt at 1000 B/s: 1.4 s (plus one unit-ns).
        match g.request(s, &need, 1500, Mode::Whole, 0) {
            Verdict::Wait(u) => assert_eq!(u, 1_400_000_001),
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn buckets_apply_by_class_and_direction() {
        let mut cfg = one(0, 1000, 100, B_DISK);
        cfg.buckets[B_WRITE] = BucketCfg {
            present: 1,
            kind: 0,
            rate_per_s: 1000,
            burst: 50,
        };
        let mut g = GroupState::new(cfg, 0).unwrap();
        let s = g.join(1, 1, 0).unwrap();
        // A network read touches neither bucket.
        assert_eq!(
            g.request(
                s,
                &Need::of(Class::Net, Dir::Read),
                1 << 20,
                Mode::Stream,
                0
            ),
            Verdict::Go(1 << 20)
        );
        // A disk write is held by the smaller of the two.
        assert_eq!(
            g.request(s, &Need::of(Class::Disk, Dir::Write), 1000, Mode::Stream, 0),
            Verdict::Go(50)
        );
        // A sendfile from disk to a socket: disk read and net write.
        let mut need = Need::of(Class::Disk, Dir::Read);
        need.add(Class::Net, Dir::Write);
        assert!(matches!(
            g.request(s, &need, 1000, Mode::Stream, 0),
            Verdict::Wait(_)
        ));
    }

    #[test]
    fn limits_are_checked() {
        let mut g = GroupState::new(one(0, 1000, 100, B_NET), 0).unwrap();
        assert!(g.join(1, 0, 0).is_err());
        assert!(g.join(1, WEIGHT_MAX + 1, 0).is_err());
        for i in 0..MEMBERS_MAX {
            g.join(i as i32, 1, 0).unwrap();
        }
        assert!(g.join(99, 1, 0).unwrap_err().contains("full"));
        assert!(GroupState::new(one(0, 0, 100, B_NET), 0).is_err());
        assert!(GroupState::new(one(0, 1000, 0, B_NET), 0).is_err());
        // A stale slot is not served and does not disturb the group.
        let stale = Slot {
            index: 0,
            generation: 999,
        };
        assert_eq!(
            g.request(stale, &Need::of(Class::Net, Dir::Read), 10, Mode::Stream, 0),
            Verdict::Go(10)
        );
    }
}
