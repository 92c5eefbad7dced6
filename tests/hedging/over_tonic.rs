//! Hedging against real tonic servers on loopback: a slow instance is hedged
//! around, on another instance, and its attempts end as streams end (read to
//! their end, not reset); a service config's `hedgingPolicy` drives a real
//! channel. Times are real but short, and every call bounded.

use crate::support::bounded;
use std::time::{Duration, Instant};

use crate::support::Instance;
use crate::support::pb::GetBookRequest;
use crate::support::pb::library_client::LibraryClient;
use tonic_retry::balance::PreferUntried;
use tonic_retry::service_config::ServiceConfig;
use tonic_retry::{HedgePolicy, RetryBudget, RetryLayer, RetryPolicy};
use tonic_retry::{fault::Fault, fault::FaultLayer, fault::Rule};
use tower::{Layer, ServiceBuilder};

fn get(isbn: &str) -> GetBookRequest {
    GetBookRequest { isbn: isbn.into() }
}

#[tokio::test]
async fn a_slow_instance_is_hedged_around_on_another_one() {
    let slow = Instance::with_faults(
        FaultLayer::new("a")
            .unwrap()
            .with(Rule::always(Fault::slow(Duration::from_millis(400)))),
    )
    .await;
    let b = Instance::with_faults(FaultLayer::new("b").unwrap()).await;
    let c = Instance::with_faults(FaultLayer::new("c").unwrap()).await;
    let balancer = PreferUntried::new([
        ("a".to_owned(), slow.channel()),
        ("b".to_owned(), b.channel()),
        ("c".to_owned(), c.channel()),
    ])
    .unwrap();
    let policy = HedgePolicy::new(2, Duration::from_millis(30))
        .unwrap()
        .with_max_extra_load(None)
        .unwrap();
    let layer = RetryLayer::new(policy, RetryBudget::new(200, 0.1).unwrap());
    let mut client =
        LibraryClient::new(ServiceBuilder::new().layer(layer.clone()).service(balancer));
    for n in 0..6 {
        let started = Instant::now();
        let book = bounded(client.get_book(get(&n.to_string())))
            .await
            .expect("answered");
        assert_eq!(book.into_inner().isbn, n.to_string());
        assert!(
            started.elapsed() < Duration::from_millis(300),
            "call {n} waited for the slow instance: {:?}",
            started.elapsed()
        );
    }
    // Every call the slow instance got was hedged elsewhere, naming it.
    let first_on_a = slow.faults.seen().len();
    assert!(
        first_on_a >= 1,
        "round-robin sends some first attempts to a"
    );
    let hedges: Vec<_> = [&b, &c]
        .iter()
        .flat_map(|i| i.faults.seen())
        .filter(|s| s.previous_attempts == Some(1))
        .collect();
    assert_eq!(hedges.len(), first_on_a, "one hedge per call stuck on a");
    assert!(
        hedges
            .iter()
            .all(|s| s.already_tried.as_deref() == Some("a")),
        "each hedge names the instance in flight: {hedges:?}"
    );
    assert_eq!(layer.metrics().hedges(), first_on_a as u64);
    // The attempts left on the slow instance were not reset: each was read
    // to its end, so the instance answered every one (a reset stream, still
    // in its fault's delay, is never answered).
    let drained = async {
        while slow.books_answered() < first_on_a as u64 || layer.metrics().draining() > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    // Its answers take 400 ms: 2 s is ample.
    let _ = tokio::time::timeout(Duration::from_secs(2), drained).await;
    assert_eq!(slow.books_answered(), first_on_a as u64);
    assert_eq!(layer.metrics().drained(), first_on_a as u64);
    assert_eq!(layer.metrics().drain_cut(), 0);
}

#[tokio::test]
async fn a_service_configs_hedging_policy_drives_a_real_channel() {
    let config: ServiceConfig = r#"{"methodConfig": [{
          "name": [{ "service": "library.v1.Library" }],
          "hedgingPolicy": { "maxAttempts": 2, "hedgingDelay": "0.03s",
                             "nonFatalStatusCodes": ["UNAVAILABLE"] } }]}"#
        .parse()
        .unwrap();
    // The first request is slow; the hedge, on the same channel, is not.
    let server = Instance::with_faults(
        FaultLayer::new("a")
            .unwrap()
            .with(Rule::first(1, Fault::slow(Duration::from_millis(500)))),
    )
    .await;
    let layer = RetryLayer::with_budget(
        config.policies(&RetryPolicy::default()),
        config.retry_throttle(),
    );
    let mut client = LibraryClient::new(layer.layer(server.channel()));
    let started = Instant::now();
    let book = bounded(client.get_book(get("7"))).await.expect("answered");
    assert_eq!(book.into_inner().isbn, "7");
    assert!(
        started.elapsed() < Duration::from_millis(400),
        "the hedge answered: {:?}",
        started.elapsed()
    );
    let seen = server.faults.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].previous_attempts, None);
    assert_eq!(seen[1].previous_attempts, Some(1));
    assert_eq!(seen[0].idempotency_key, seen[1].idempotency_key);
}
