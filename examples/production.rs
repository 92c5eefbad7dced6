//! `cargo run --example production --all-features`
//!
//! The stack a service in production runs, whole: a gRPC service config with
//! a retried method (`ListBooks`), a hedged one (`GetBook`) and a write never
//! retried (`ReserveStock`), the config's `retryThrottling` as the budget,
//! the `PreferUntried` balancer over three instances, gRPC's standard
//! metrics through OpenTelemetry, and the client's type named through an
//! alias. The instances run on loopback: `a` fails a fifth of its calls
//! `UNAVAILABLE`, `b` answers a tenth of them 200 ms late, `c` is healthy.

#[path = "../tests/support/library.rs"]
mod library;

use std::time::Duration;

use library::pb::library_client::LibraryClient;
use library::pb::{GetBookRequest, ListBooksRequest, ReserveStockRequest};
use library::{Instance, Shelf};
use opentelemetry::metrics::MeterProvider;
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use tonic::transport::Channel;
use tonic_retry::balance::PreferUntried;
use tonic_retry::budgets::RetryThrottle;
use tonic_retry::fault::{Fault, FaultLayer, Rule};
use tonic_retry::otel::{GrpcMetrics, Metered};
use tonic_retry::service_config::ServiceConfig;
use tonic_retry::{RetryLayer, RetryPolicy};
use tower::ServiceBuilder;

/// The client the rest of the program holds.
type Library = LibraryClient<Metered<PreferUntried<Channel>, RetryThrottle>>;

/// What grpc-go and grpc-java would read too. `ReserveStock` has no
/// `retryPolicy`: a write the server cannot deduplicate is sent once (the
/// layer still gives it its deadline and idempotency key). A method no entry
/// names is not retried either.
const SERVICE_CONFIG: &str = r#"{
  "methodConfig": [
    {
      "name": [{ "service": "library.v1.Library", "method": "ListBooks" }],
      "timeout": "2s",
      "retryPolicy": {
        "maxAttempts": 3,
        "initialBackoff": "0.02s",
        "maxBackoff": "0.2s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"]
      }
    },
    {
      "name": [{ "service": "library.v1.Library", "method": "GetBook" }],
      "timeout": "1s",
      "hedgingPolicy": {
        "maxAttempts": 2,
        "hedgingDelay": "0.05s",
        "nonFatalStatusCodes": ["UNAVAILABLE"]
      }
    },
    {
      "name": [{ "service": "library.v1.Library", "method": "ReserveStock" }],
      "timeout": "0.5s"
    }
  ],
  "retryThrottling": { "maxTokens": 100, "tokenRatio": 0.5 }
}"#;

const CALLS: usize = 100;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let instances = [
        Instance::start(
            Shelf::with_stock("978-0", u32::MAX),
            FaultLayer::new("a")?.with(Rule::rate(0.2, Fault::unavailable())?),
        )
        .await,
        Instance::start(
            Shelf::with_stock("978-0", u32::MAX),
            FaultLayer::new("b")?.with(Rule::rate(0.1, Fault::slow(Duration::from_millis(200)))?),
        )
        .await,
        Instance::start(Shelf::with_stock("978-0", u32::MAX), FaultLayer::new("c")?).await,
    ];

    // The metrics: any OpenTelemetry meter (an OTLP exporter in production).
    let exporter = InMemoryMetricExporter::default();
    let provider = SdkMeterProvider::builder()
        .with_reader(PeriodicReader::builder(exporter.clone()).build())
        .build();
    let metrics = GrpcMetrics::new(&provider.meter("library-client"), "dns:///library")
        .with_methods([
            "/library.v1.Library/GetBook",
            "/library.v1.Library/ListBooks",
            "/library.v1.Library/ReserveStock",
        ])?;

    // The layer: the config's policies over the defaults, with what A6 has
    // no field for (a cap on hedges: 10 % of calls, after a first burst of
    // 50), its throttle as the budget, and the metrics.
    let config: ServiceConfig = SERVICE_CONFIG.parse()?;
    let policies = config.policies_with_hedging(&RetryPolicy::default(), |hedge| {
        hedge.with_max_extra_load(Some(0.1))
    })?;
    let layer =
        RetryLayer::with_budget(policies, config.retry_throttle()).with_grpc_metrics(metrics);

    // The balancer: each instance by the id its responses carry
    // (`x-instance-id`), so a retry or a hedge goes to another one.
    let balancer = PreferUntried::new(
        ["a", "b", "c"]
            .into_iter()
            .zip(&instances)
            .map(|(id, instance)| (id.to_owned(), instance.channel())),
    )?;
    let client: Library =
        LibraryClient::new(ServiceBuilder::new().layer(layer.clone()).service(balancer));

    // Calls from many tasks at once, as a server's handlers make them.
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..CALLS {
        let mut library = client.clone();
        calls.spawn(async move {
            let book = library.get_book(GetBookRequest {
                isbn: format!("978-{i}"),
            });
            (0, book.await.is_ok())
        });
        let mut library = client.clone();
        calls.spawn(async move {
            let list = ListBooksRequest {
                author: String::new(),
                limit: 2,
            };
            let Ok(stream) = library.list_books(list).await else {
                return (1, false);
            };
            let mut stream = stream.into_inner();
            let mut whole = true;
            while let Some(item) = stream.message().await.transpose() {
                whole &= item.is_ok();
            }
            (1, whole)
        });
        let mut library = client.clone();
        calls.spawn(async move {
            let reserve = ReserveStockRequest {
                isbn: "978-0".into(),
                quantity: 1,
            };
            (2, library.reserve_stock(reserve).await.is_ok())
        });
    }
    let mut ok = [0; 3];
    while let Some(done) = calls.join_next().await {
        let (method, succeeded) = done?;
        ok[method] += usize::from(succeeded);
    }

    println!(
        "{CALLS} calls of each method, from as many tasks, over instances a (20 % UNAVAILABLE), b (10 % 200 ms late), c:"
    );
    println!("  GetBook (hedged)            {:>3} OK", ok[0]);
    println!("  ListBooks (retried)         {:>3} OK", ok[1]);
    println!("  ReserveStock (sent once)    {:>3} OK", ok[2]);
    let seen = |method: &str| {
        instances
            .iter()
            .map(|i| {
                i.faults
                    .seen()
                    .iter()
                    .filter(|s| s.path.ends_with(method))
                    .count()
            })
            .sum::<usize>()
    };
    println!(
        "  attempts at the servers: GetBook {}, ListBooks {}, ReserveStock {}",
        seen("/GetBook"),
        seen("/ListBooks"),
        seen("/ReserveStock")
    );
    let requests: Vec<_> = instances.iter().map(|i| i.faults.seen().len()).collect();
    println!(
        "  requests at a, b, c: {}, {}, {}",
        requests[0], requests[1], requests[2]
    );
    let m = layer.metrics();
    println!(
        "  layer: {} retries, {} hedges, {} refused by the throttle ({:.1} of {:.0} tokens left)",
        m.retries(),
        m.hedges(),
        m.refused_by_budget(),
        layer.budget().available(),
        layer.budget().max_tokens()
    );

    provider.force_flush()?;
    let exported = exporter.get_finished_metrics()?;
    let names: Vec<_> = exported
        .last()
        .into_iter()
        .flat_map(|m| m.scope_metrics())
        .flat_map(|s| s.metrics())
        .map(|m| m.name().to_owned())
        .collect();
    println!("  exported: {}", names.join(", "));
    Ok(())
}
