//! The request body every attempt sends: replayed whole, bounded by its limits,
//! released as soon as no retry can follow, and kept for attempts being
//! drained.

#[path = "../support/mod.rs"]
mod support;

mod copies;
mod drained;
mod limits;
mod read_at_once;
