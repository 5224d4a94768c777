//! omnistage: a staged, event-driven runtime that shares a machine among activities.
//!
//! Layers, each a module that owns one thing; arrows point down only:
//!
//! ```text
//! exec ─────── per-core workers: the tree, the dispatch loop, routing, timers, mailboxes;
//!              the only layer that reads a clock or owns a thread
//! admit ────── admission predicates and controllers (threshold, token bucket, p90, batching)
//! activity ─── the activity tree: paths, weights, caps; validated changes
//! account ──── records, the ledger of (activity, stage, core) counters, snapshots
//! sched ────── policies and scheduling trees as pure data structures
//! ```
//!
//! `sched`, `account`, `activity` and `admit` are pure: they take time and costs as
//! arguments, so they are tested under a simulated clock with exact expectations.

pub mod account;
pub mod activity;
pub mod admit;
pub mod exec;
pub mod sched;

pub use exec::task;
