//! Instructions per call with gRPC's standard metrics recorded (feature
//! `opentelemetry`), for `valgrind --tool=callgrind`, as `--bench
//! instructions` counts them: `STACK` is `a` (no layer) or `c-otel` (the
//! layer of `instructions`' `c`, given a meter on the real SDK). A binary of
//! its own, so that `instructions` built with the feature holds only layers
//! without metrics, as a user's binary that gives none does.
//!
//! ```text
//! cargo bench --bench instructions_otel --features opentelemetry --no-run
//! BIN=$(ls -t target/release/deps/instructions_otel-* | grep -v '\.d$' | head -1)
//! for n in 1000 11000; do
//!   STACK=c-otel N=$n valgrind --tool=callgrind --callgrind-out-file=/dev/null $BIN 2>&1 | grep Collected
//! done   # (second - first) / 10000 = instructions per call
//! ```

mod common;

use common::*;
use opentelemetry::metrics::MeterProvider;
use tonic_retry::RetryPolicy;
use tower::Layer;

fn main() {
    run_stack(|stack, n| async move {
        let payload = &SMALL[..];
        match stack.as_str() {
            "a" => timed(inner_ok(), n, payload).await,
            "c-otel" => {
                // Recorded on the real SDK (its in-memory exporter is never
                // flushed here).
                let exporter = opentelemetry_sdk::metrics::InMemoryMetricExporter::default();
                let reader = opentelemetry_sdk::metrics::PeriodicReader::builder(exporter).build();
                let provider = opentelemetry_sdk::metrics::SdkMeterProvider::builder()
                    .with_reader(reader)
                    .build();
                let metrics =
                    tonic_retry::otel::GrpcMetrics::new(&provider.meter("bench"), "bench")
                        .with_methods(["/library.v1.Library/GetBook"])
                        .expect("a method path");
                let budget = tonic_retry::RetryBudget::new(1_000, 0.1).expect("a valid budget");
                let layer = tonic_retry::RetryLayer::new(RetryPolicy::default(), budget)
                    .with_grpc_metrics(metrics);
                timed(layer.layer(inner_ok()), n, payload).await
            }
            other => panic!("STACK must be a or c-otel, not {other:?}"),
        }
    });
}
