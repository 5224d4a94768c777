//! Shaping unmodified programs (TAP, the fifth seed): the logic behind `omnistage shape` and its
//! preload library (`crates/omnistage-shape-preload`, `libomnistage_shape_preload.so`).
//!
//! - [`units`]: rates and sizes on the command line.
//! - [`meter`]: a group's buckets (omnistage's own `sched::Shaper`) and members, and the rules
//!   deciding what a transfer may move; safe and clock-free, tested under a simulated clock.
//! - [`hooks`]: what an interposed call does, in safe code.
//! - [`sys`]: every `unsafe` (libc, dlsym, shared memory), and the interposed symbols as a macro
//!   that only the preload crate expands.
//! - [`launch`]: the command's side: the group segment, the environment, the child process.
//! - [`link`]: the group's link to a running omnistage's admin API (`--admin`, `--activity`):
//!   its bytes reported there, its network and disk rates taken from there.

pub mod hooks;
pub mod launch;
pub mod link;
pub mod meter;
pub mod sys;
pub mod units;
