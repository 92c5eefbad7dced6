//! `cargo run --example metrics --features opentelemetry`
//!
//! gRPC's standard client metrics (gRFC A66, A96) from a small retried
//! workload: a loopback `Library` server that answers every third request
//! `UNAVAILABLE` and is slow now and then, 30 calls through the layer, and
//! what an OpenTelemetry exporter receives (the SDK's in-memory one here),
//! printed as an operator reads it: metric, unit, attributes, and count / sum
//! / buckets.

#[path = "../tests/support/library.rs"]
mod library;

use std::time::Duration;

use library::Shelf;
use library::pb::GetBookRequest;
use library::pb::library_client::LibraryClient;
use library::pb::library_server::LibraryServer;
use opentelemetry::metrics::MeterProvider;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use tonic::transport::{Endpoint, Server};
use tonic_retry::otel::GrpcMetrics;
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
use tonic_retry::{fault::Fault, fault::FaultLayer, fault::Rule};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The server: every third request UNAVAILABLE, one in ten 30 ms slow.
    let faults = FaultLayer::new("library-1")?
        .with(Rule::every(3, Fault::unavailable())?)
        .with(Rule::rate(0.1, Fault::slow(Duration::from_millis(30)))?);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(
        Server::builder()
            .layer(faults)
            .add_service(LibraryServer::new(Shelf::default()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );

    // The client: the three lines that wire the metrics up.
    let exporter = InMemoryMetricExporter::default();
    let provider = SdkMeterProvider::builder()
        .with_reader(PeriodicReader::builder(exporter.clone()).build())
        .build();
    let target = format!("dns:///{addr}");
    let meter = provider.meter("library-client");
    let metrics =
        GrpcMetrics::new(&meter, &target).with_methods(["/library.v1.Library/GetBook"])?;
    let layer = RetryLayer::new(RetryPolicy::default(), RetryBudget::new(200, 0.1)?)
        .with_grpc_metrics(metrics);

    let channel = Endpoint::from_shared(format!("http://{addr}"))?.connect_lazy();
    let mut client = LibraryClient::new(tower::ServiceBuilder::new().layer(layer).service(channel));
    let mut ok = 0;
    for _ in 0..30 {
        let mut req = tonic::Request::new(GetBookRequest { isbn: "1".into() });
        req.set_timeout(Duration::from_secs(2));
        if client.get_book(req).await.is_ok() {
            ok += 1;
        }
    }
    println!("30 calls to {target}, {ok} OK; what the exporter received:\n");

    provider.force_flush()?;
    let exported = exporter.get_finished_metrics()?;
    let Some(last) = exported.last() else {
        return Ok(());
    };
    for metric in last.scope_metrics().flat_map(|s| s.metrics()) {
        println!("{} ({})", metric.name(), metric.unit());
        // Sorted by key: the SDK keeps a series' attributes in no set order.
        let attributes = |kvs: &mut dyn Iterator<Item = &opentelemetry::KeyValue>| {
            let mut kvs: Vec<_> = kvs.map(|kv| format!("{}={}", kv.key, kv.value)).collect();
            kvs.sort();
            kvs.join(", ")
        };
        match metric.data() {
            AggregatedMetrics::F64(MetricData::Histogram(h)) => {
                for p in h.data_points() {
                    let buckets =
                        nonzero_buckets(p.bounds().collect(), p.bucket_counts().collect());
                    println!(
                        "  {{{}}}  count {}  sum {:.4}  buckets {buckets}",
                        attributes(&mut p.attributes()),
                        p.count(),
                        p.sum()
                    );
                }
            }
            AggregatedMetrics::U64(MetricData::Histogram(h)) => {
                for p in h.data_points() {
                    let buckets =
                        nonzero_buckets(p.bounds().collect(), p.bucket_counts().collect());
                    println!(
                        "  {{{}}}  count {}  sum {}  buckets {buckets}",
                        attributes(&mut p.attributes()),
                        p.count(),
                        p.sum()
                    );
                }
            }
            AggregatedMetrics::U64(MetricData::Sum(s)) => {
                for p in s.data_points() {
                    println!("  {{{}}}  {}", attributes(&mut p.attributes()), p.value());
                }
            }
            AggregatedMetrics::F64(MetricData::Gauge(g)) => {
                for p in g.data_points() {
                    println!("  {{{}}}  {}", attributes(&mut p.attributes()), p.value());
                }
            }
            other => println!("  {other:?}"),
        }
    }
    Ok(())
}

/// The buckets that counted something, as `(lower, upper]: count`.
fn nonzero_buckets(bounds: Vec<f64>, counts: Vec<u64>) -> String {
    let mut out = Vec::new();
    for (i, count) in counts.iter().enumerate() {
        if *count == 0 {
            continue;
        }
        let lower = if i == 0 {
            f64::NEG_INFINITY
        } else {
            bounds[i - 1]
        };
        let upper = bounds.get(i).copied().unwrap_or(f64::INFINITY);
        out.push(format!("({lower}, {upper}]: {count}"));
    }
    out.join("  ")
}
