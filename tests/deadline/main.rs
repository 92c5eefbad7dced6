//! One deadline for the whole call: rewritten into `grpc-timeout` on every
//! attempt, attempts cut at it or at their own timeout, waits for readiness
//! bounded by it, and a caller's own attempt timeout respected.

#[path = "../support/mod.rs"]
mod support;

mod callers_attempt;
mod cuts;
mod grpc_timeout;
mod readiness;
mod retry_timeouts;
