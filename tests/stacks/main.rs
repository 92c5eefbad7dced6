//! The layer in a tower stack: under buffers, timeouts and load shedding, over
//! balancers, with the capacity a caller readied below, and with the caller
//! dropping the call at each await.

#[path = "../support/mod.rs"]
mod support;

mod balancers;
mod cancelled;
mod readied;
mod tower;
