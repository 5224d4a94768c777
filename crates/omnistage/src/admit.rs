//! admit (in progress)
