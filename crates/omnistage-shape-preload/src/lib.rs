//! The preload library of `omnistage shape` (`libomnistage_shape_preload.so`). It only defines the
//! interposed libc symbols; their bodies, and every `unsafe`, are in `omnistage_shape::sys`, the
//! shaping logic in `omnistage_shape::{hooks, meter}`. Loaded with `LD_PRELOAD` by the command,
//! which also passes the group and member in the environment.

omnistage_shape::export_interposers!();
