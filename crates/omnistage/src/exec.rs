//! exec (in progress)
