//! `cargo run --example service_config`
//!
//! Per-method retry policies from a gRPC service config file, the same JSON
//! grpc-go and grpc-java read: `examples/service_config.json` gives the
//! `Library` service three attempts, `GetBook` four (and also retries
//! `RESOURCE_EXHAUSTED`), and `ReserveStock` none; its `retryThrottling`
//! becomes the layer's budget. One channel to one faulty instance carries all
//! three methods; the server counts what each method's calls cost it.

#[path = "../tests/support/library.rs"]
mod library;

use std::collections::BTreeMap;
use std::time::Duration;

use library::pb::library_client::LibraryClient;
use library::pb::{GetBookRequest, ListBooksRequest, ReserveStockRequest};
use library::{Instance, Shelf};
use tonic::Code;
use tonic_retry::service_config::ServiceConfig;
use tonic_retry::{RetryLayer, RetryPolicy};
use tonic_retry::{fault::Fault, fault::FaultLayer, fault::Rule};
use tower::ServiceBuilder;

const CALLS: usize = 200;
const METHODS: [&str; 3] = ["GetBook", "ReserveStock", "ListBooks"];

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/service_config.json");
    // The one line that loads it:
    let config: ServiceConfig = std::fs::read_to_string(path)?.parse()?;
    let layer = RetryLayer::with_budget(
        config.policies(&RetryPolicy::default()),
        config.retry_throttle(),
    );

    println!("service config: examples/service_config.json");
    for method in METHODS {
        let policy = layer
            .policies()
            .policy_for(&format!("/library.v1.Library/{method}"));
        let timeout = policy.max_timeout().unwrap_or_default();
        if policy.max_attempts() == 1 {
            println!("  {method:<13} 1 attempt (not retried), timeout {timeout:?}");
        } else {
            println!(
                "  {method:<13} {} attempts, backoff {:?} ×{} up to {:?}, retries {:?}, timeout {timeout:?}",
                policy.max_attempts(),
                policy.base_delay(),
                policy.backoff_multiplier(),
                policy.max_delay(),
                policy.retryable_codes(),
            );
        }
    }

    // One instance: a fifth of every method's calls fail UNAVAILABLE, and a
    // tenth of GetBook's are rate-limited with RetryInfo.
    let server = Instance::start(
        Shelf::with_stock("978-0", u32::MAX),
        FaultLayer::new("a")?
            .with(
                Rule::rate(0.1, Fault::rate_limited(Duration::from_millis(10)))?
                    .on_method("GetBook"),
            )
            .with(Rule::rate(0.2, Fault::unavailable())?),
    )
    .await;
    let mut client = LibraryClient::new(
        ServiceBuilder::new()
            .layer(layer.clone())
            .service(server.channel()),
    );
    println!(
        "\n{CALLS} calls of each method over one channel; the instance fails 20 % of calls UNAVAILABLE, and 10 % of GetBook RESOURCE_EXHAUSTED with RetryInfo\n"
    );

    let mut outcomes: BTreeMap<&str, BTreeMap<String, usize>> = BTreeMap::new();
    for i in 0..CALLS {
        let isbn = format!("978-{i}");
        let codes = [
            code(client.get_book(GetBookRequest { isbn: isbn.clone() }).await),
            code(
                client
                    .reserve_stock(ReserveStockRequest {
                        isbn: "978-0".into(),
                        quantity: 1,
                    })
                    .await,
            ),
            match client
                .list_books(ListBooksRequest {
                    author: String::new(),
                    limit: 2,
                })
                .await
            {
                Ok(stream) => {
                    let mut stream = stream.into_inner();
                    let mut code = Code::Ok;
                    while let Some(item) = stream.message().await.transpose() {
                        if let Err(status) = item {
                            code = status.code();
                            break;
                        }
                    }
                    code
                }
                Err(status) => status.code(),
            },
        ];
        for (method, code) in METHODS.iter().zip(codes) {
            *outcomes
                .entry(method)
                .or_default()
                .entry(format!("{code:?}"))
                .or_default() += 1;
        }
    }

    let seen = server.faults.seen();
    println!(
        "  {:<13} {:>8} {:>18} {:>14}   outcomes",
        "method", "attempts", "attempts per call", "succeeded"
    );
    for method in METHODS {
        let attempts = seen
            .iter()
            .filter(|s| s.path.ends_with(&format!("/{method}")))
            .count();
        let ok = outcomes[method].get("Ok").copied().unwrap_or(0);
        println!(
            "  {method:<13} {attempts:>8} {:>18.2} {:>12.1} %   {:?}",
            attempts as f64 / CALLS as f64,
            100.0 * ok as f64 / CALLS as f64,
            outcomes[method]
        );
    }
    let m = layer.metrics();
    let throttle = layer.budget();
    println!(
        "\n  retries {}, refused by the throttle {}, throttle tokens {:.1} of {:.0}",
        m.retries(),
        m.refused_by_budget(),
        throttle.available(),
        throttle.max_tokens(),
    );
    Ok(())
}

fn code<T>(result: Result<T, tonic::Status>) -> Code {
    result.map_or_else(|status| status.code(), |_| Code::Ok)
}
