//! The layer between a real tonic client and real tonic servers on loopback.

#[path = "../support/mod.rs"]
mod support;

mod calls;
mod faults;
