//! Choosing the policy: gRPC service config, per-method policies, and a
//! caller's per-call decisions.

#[path = "../support/mod.rs"]
mod support;

mod per_call;
mod service_config;
