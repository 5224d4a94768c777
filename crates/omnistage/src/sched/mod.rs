//! `sched`: scheduling policies and per-core scheduling trees as pure data structures.
//!
//! This layer owns *decisions*, never time or threads: every call that needs the time takes
//! `now_ns` as an argument, and every cost is handed in after the fact (retrospective charging,
//! Omni-Kernel's `resource_record`). That makes every policy testable under a simulated clock
//! with exact expectations.
//!
//! Pieces:
//! - [`Scheduler`]: the node-scheduler interface, after Omni-Kernel's Table III
//!   (`add_client`, `update_client`, `remove_client`, `client_ready`, `client_suspended`,
//!   `schedule`, `resource_record`, `client_statistics`).
//! - Policies: [`Fifo`], [`RoundRobin`], [`StrictPriority`], [`FairQueue`] (SFQ by start tag,
//!   WFQ by estimated finish tag; both can key clients by a [`SharedTag`] that all cores' trees
//!   read, which is how shares hold for the whole machine), and [`Drr`].
//! - [`Shaper`]: token and leaky buckets that wrap any node of a tree (non-work-conserving).
//! - [`SfqFloor`]: not a scheduler but a measuring reference: the least work one event of a
//!   two-level H-SFQ needs over the same heap, which `exp sched-cost` runs beside the tree.
//! - [`Tree`]: an arena of interior nodes (each with its own policy) and leaves (queues owned by
//!   the caller), with readiness propagated up and costs charged up the path. Its fair queues
//!   keep no client state of their own: the tree keeps each node's line as a client of its
//!   parent's fair queue (`fq.rs`'s `FqClient`, by node id), so a heap entry names the child
//!   node and a decision loads its node and its line at once (`interior.rs` routes the calls).
//!
//! Rules every policy keeps: an idle client banks no credit (its tag is clamped to the node's
//! virtual time when it wakes, less the tree's wake credit if it was given one, which is 0 by
//! default: [`Tree::set_wake_credit`]); every dispatch is charged at least the tree's minimum
//! cost; state that is touched per decision exists only for ready clients.

mod floor;
mod fq;
mod heap;
mod interior;
mod policy;
mod shaper;
mod tree;

pub use floor::SfqFloor;
pub use policy::{
    AnyPolicy, ClientId, ClientParams, ClientStats, Drr, FairQueue, FairQueueMode, Fifo,
    PolicyKind, RoundRobin, Scheduler, SharedTag, StrictPriority, DRR_QUANTUM_NS_PER_WEIGHT,
    VT_SCALE, WEIGHT_DEFAULT, WEIGHT_MAX, WEIGHT_MIN,
};
pub use shaper::{Shaper, ShaperKind, ShaperLost, ShaperSpec, LEAKY_CATCH_UP_NS};
pub use tree::{NodeId, NodeStats, Tree, TreeError, MIN_COST_DEFAULT, WAKE_CREDIT_MAX};

/// Hints the CPU to load the cache line at `ptr`. Only a hint: no effect on results, none at all
/// off x86-64; the pointer may be dangling or past the end (it is never dereferenced).
#[inline(always)]
pub(crate) fn prefetch<T>(ptr: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` only hints the cache: it never faults and never reads into the
    // program, whatever the address.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(ptr.cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = ptr;
}
