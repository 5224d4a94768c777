//! The process's shaping context, built lazily from the environment on the first hooked call:
//! the group's segment, this process's member slot, and the cached mask of what the group
//! limits or counts.

use super::*;

/// Environment variables the command passes to the program.
pub const ENV_GROUP: &str = "OMNISTAGE_SHAPE_GROUP";
pub const ENV_MEMBER: &str = "OMNISTAGE_SHAPE_MEMBER";
pub const ENV_WEIGHT: &str = "OMNISTAGE_SHAPE_WEIGHT";

pub struct Context {
    map: SegmentMap,
    /// Bit `b` set: bucket `b` is configured; [`COUNTED_BIT`]: the group counts its bytes (a
    /// reporter claimed it). Read again from the segment when its epoch moves.
    mask: AtomicU32,
    /// The segment's `cfg_epoch` that `mask` was read at.
    epoch: AtomicU64,
    weight: u32,
    /// `index << 32 | generation` of this process's member slot.
    slot: AtomicU64,
}

/// In [`Context`]'s mask: every transfer goes through the group to be counted.
const COUNTED_BIT: u32 = 1 << 31;

fn mask_of(cfg: &GroupCfg, counted: u32) -> u32 {
    let mut m = 0;
    for (b, c) in cfg.buckets.iter().enumerate() {
        if c.present != 0 {
            m |= 1 << b;
        }
    }
    if counted != 0 {
        m |= COUNTED_BIT;
    }
    m
}

impl Context {
    /// The group's mask now: one atomic load, and the mutex only after a change.
    fn mask(&self) -> u32 {
        let e = self.map.cfg_epoch();
        if e != self.epoch.load(Ordering::Relaxed) {
            let m = self.map.with(|g| mask_of(&g.cfg, g.counted));
            self.mask.store(m, Ordering::Relaxed);
            self.epoch.store(e, Ordering::Relaxed);
            return m;
        }
        self.mask.load(Ordering::Relaxed)
    }

    /// Whether a call may go straight through without the hook's guard: the cached mask says
    /// neither limited nor counted and the segment's epoch has not moved since it was read. No
    /// lock is taken (a signal handler's call while this thread holds the segment's mutex must
    /// not wait for it), so a moved epoch sends the call the slow way, which reads it again.
    #[inline]
    pub fn passes_through_now(&self) -> bool {
        self.mask.load(Ordering::Relaxed) == 0
            && self.map.cfg_epoch() == self.epoch.load(Ordering::Relaxed)
    }

    /// Neither limited nor counted: the hooks pass calls through untouched.
    pub fn is_unlimited(&self) -> bool {
        self.mask() == 0
    }

    /// Whether `need` must go through the group: a configured bucket covers it, or the group
    /// counts its bytes.
    pub fn limits(&self, need: &Need) -> bool {
        let m = self.mask();
        let covered = need
            .mult
            .iter()
            .enumerate()
            .any(|(b, &k)| k != 0 && m & (1 << b) != 0);
        covered || (m & COUNTED_BIT != 0 && need.mult.iter().any(|&k| k != 0))
    }

    fn with<R>(&self, f: impl FnOnce(&mut GroupState, Slot, u64) -> R) -> R {
        self.map.with(|g| {
            let now = now_ns();
            g.reap(now, alive);
            let packed = self.slot.load(Ordering::Relaxed);
            let mut slot = Slot {
                index: (packed >> 32) as u32,
                generation: packed as u32,
            };
            if !g.holds(slot) {
                // Our slot was freed (the command that started us is gone): join as ourselves.
                if let Ok(s) = g.join(getpid(), self.weight, now) {
                    slot = s;
                    self.slot.store(
                        u64::from(s.index) << 32 | u64::from(s.generation),
                        Ordering::Relaxed,
                    );
                }
            }
            f(g, slot, now)
        })
    }

    pub fn request(&self, need: &Need, want: u64, mode: Mode) -> Verdict {
        self.with(|g, s, now| g.request(s, need, want, mode, now))
    }

    pub fn settle(&self, need: &Need, mode: Mode, granted: u64, moved: u64) {
        self.with(|g, s, now| g.settle(s, need, mode, granted, moved, now))
    }

    pub fn ready_at(&self, need: &Need) -> Option<u64> {
        self.with(|g, s, now| g.ready_at(s, need, now))
    }
}

static CONTEXT: OnceLock<Option<Context>> = OnceLock::new();

/// Whether a hooked call may go straight to libc before any of the hook's own work (its
/// thread-local guard costs a `__tls_get_addr` call in a preloaded library, about a third of
/// the pass-through cost): the process is not shaped, or its group neither limits nor counts
/// and nothing changed. `false` before the context is built (the slow path builds it under
/// the guard).
#[inline]
pub fn passes_through() -> bool {
    match CONTEXT.get() {
        Some(None) => true,
        Some(Some(c)) => c.passes_through_now(),
        None => false,
    }
}

/// The process's context, or `None` when it is not being shaped (no or bad environment).
pub fn context() -> Option<&'static Context> {
    CONTEXT
        .get_or_init(|| {
            let e = errno();
            let c = init_context();
            set_errno(e);
            c
        })
        .as_ref()
}

fn init_context() -> Option<Context> {
    let group = std::env::var(ENV_GROUP).ok()?;
    let member = std::env::var(ENV_MEMBER).ok().unwrap_or_default();
    let weight: u32 = std::env::var(ENV_WEIGHT)
        .ok()
        .and_then(|w| w.parse().ok())
        .unwrap_or(1);
    let (map, _) = SegmentMap::open(&group, None).ok()?;
    let epoch = map.cfg_epoch();
    let mask = map.with(|g| mask_of(&g.cfg, g.counted));
    let (index, generation) = member.split_once(':').unwrap_or(("0", "0"));
    let slot = u64::from(index.parse::<u32>().unwrap_or(0)) << 32
        | u64::from(generation.parse::<u32>().unwrap_or(0));
    Some(Context {
        map,
        mask: AtomicU32::new(mask),
        epoch: AtomicU64::new(epoch),
        weight,
        slot: AtomicU64::new(slot),
    })
}
