//! What goes on the wire: the idempotency key, attempt numbers and instance
//! marks the layer writes and trusts, and transparent retries of streams a
//! server refused.

#[path = "../support/mod.rs"]
mod support;

mod marks;
mod transparent_retries;
