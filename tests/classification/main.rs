//! What the layer retries and what a failure reads as: gRPC codes, transport and
//! readiness errors, answers that are not gRPC, and the waits between attempts
//! (backoff, the server's pushback and `RetryInfo`).

#[path = "../support/mod.rs"]
mod support;

mod backoff;
mod codes;
