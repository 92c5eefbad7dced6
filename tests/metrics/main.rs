//! What the layer reports: its events and gRPC's standard OpenTelemetry
//! metrics.

#[path = "../support/mod.rs"]
mod support;

mod events;
mod otel;
mod over_tonic;
