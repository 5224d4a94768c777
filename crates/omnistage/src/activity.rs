//! activity (in progress)
