//! The hardening promises against real tonic servers on loopback: a
//! saturated concurrency limit below the layer, a slow instance behind the
//! balancer under concurrent traffic, the three racing timers, a server that
//! is down, and a peer that drops the connection. Times here are real but
//! short, and every call is bounded.

use crate::support::bounded;
use std::time::{Duration, Instant};

use crate::support::Instance;
use crate::support::pb::GetBookRequest;
use crate::support::pb::library_client::LibraryClient;
use tonic::Code;
use tonic_retry::balance::PreferUntried;
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
use tonic_retry::{fault::Fault, fault::FaultLayer, fault::Rule};
use tower::ServiceBuilder;

const MS: Duration = Duration::from_millis(1);

fn get(isbn: &str) -> GetBookRequest {
    GetBookRequest { isbn: isbn.into() }
}

fn faults(id: &str) -> FaultLayer {
    FaultLayer::new(id).unwrap()
}

fn budget() -> RetryBudget {
    RetryBudget::new(1000, 0.1).unwrap()
}

#[tokio::test]
async fn calls_with_a_deadline_end_at_it_behind_a_saturated_concurrency_limit() {
    // The first two calls take 3 s and hold both permits of the limit below
    // the layer; the server would answer everything else at once.
    let server = Instance::with_faults(
        faults("a").with(Rule::first(2, Fault::slow(Duration::from_secs(3)))),
    )
    .await;
    let layer = RetryLayer::new(RetryPolicy::default(), budget());
    let client = LibraryClient::new(
        ServiceBuilder::new()
            .layer(layer.clone())
            .concurrency_limit(2)
            .service(server.channel()),
    );
    let hogs: Vec<_> = (0..2)
        .map(|i| {
            let mut client = client.clone();
            tokio::spawn(async move { client.get_book(get(&format!("hog {i}"))).await })
        })
        .collect();
    while server.faults.requests() < 2 {
        tokio::time::sleep(MS).await;
    }

    let deadline = 200 * MS;
    let calls: Vec<_> = (0..8)
        .map(|i| {
            let mut client = client.clone();
            tokio::spawn(async move {
                let mut req = tonic::Request::new(get(&i.to_string()));
                req.set_timeout(deadline);
                let started = Instant::now();
                let result = client.get_book(req).await;
                (result, started.elapsed())
            })
        })
        .collect();
    let mut overshoots = Vec::new();
    for call in calls {
        let (result, took) = bounded(call).await.unwrap();
        let status = result.expect_err("no permit came free in time");
        assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
        assert!(took >= deadline - MS, "ended early: {took:?}");
        overshoots.push(took.saturating_sub(deadline));
    }
    println!("past the 200 ms deadline by: {overshoots:?}");
    assert!(
        overshoots.iter().all(|o| *o < 50 * MS),
        "a call outlived its deadline: {overshoots:?}"
    );
    assert_eq!(server.faults.requests(), 2, "no call got past the limit");
    for hog in hogs {
        bounded(hog).await.unwrap().expect("the slow calls finish");
    }
}

#[tokio::test]
async fn a_slow_instance_is_retried_elsewhere_under_concurrent_traffic() {
    // a never answers in time; b is healthy. Concurrent calls keep moving the
    // balancer's round-robin cursor, so only the instance the balancer reports
    // for the cut attempt keeps the retry off a.
    let a =
        Instance::with_faults(faults("a").with(Rule::always(Fault::slow(Duration::from_secs(5)))))
            .await;
    let b = Instance::with_faults(faults("b")).await;
    let balancer =
        PreferUntried::new([("a".to_owned(), a.channel()), ("b".to_owned(), b.channel())]).unwrap();
    let policy = RetryPolicy::default().with_attempt_timeout(100 * MS);
    let layer = RetryLayer::new(policy, budget());
    let client = LibraryClient::new(ServiceBuilder::new().layer(layer.clone()).service(balancer));
    let calls: Vec<_> = (0..24)
        .map(|i| {
            let mut client = client.clone();
            tokio::spawn(async move {
                let mut req = tonic::Request::new(get(&i.to_string()));
                req.set_timeout(Duration::from_secs(2));
                client.get_book(req).await
            })
        })
        .collect();
    for call in calls {
        bounded(call).await.unwrap().expect("b answers every call");
    }
    let on_a = a.faults.seen();
    assert!(!on_a.is_empty(), "some first attempts went to a");
    assert!(
        on_a.iter().all(|s| s.previous_attempts.is_none()),
        "a retry went back to the slow instance"
    );
    let on_b = b.faults.seen();
    for cut in &on_a {
        let retry = on_b
            .iter()
            .find(|s| s.idempotency_key == cut.idempotency_key)
            .expect("the cut call was retried on b");
        assert_eq!(retry.already_tried.as_deref(), Some("a"));
    }
}

#[tokio::test]
async fn racing_timers_never_surface_as_cancelled() {
    // Every answer takes about as long as the attempt's limit: the layer's
    // cut, the Channel enforcing grpc-timeout and the server's own timer race.
    let server = Instance::with_faults(faults("a").with(Rule::always(Fault::slow(30 * MS)))).await;
    let policy = RetryPolicy::new(2, MS, 2 * MS, 0.2)
        .unwrap()
        .with_attempt_timeout(30 * MS);
    let layer = RetryLayer::new(policy, budget());
    let client = LibraryClient::new(
        ServiceBuilder::new()
            .layer(layer.clone())
            .service(server.channel()),
    );
    let mut codes = std::collections::BTreeMap::<String, u32>::new();
    for round in 0..10 {
        let calls: Vec<_> = (0..16)
            .map(|i| {
                let mut client = client.clone();
                tokio::spawn(async move {
                    let mut req = tonic::Request::new(get(&format!("{round}-{i}")));
                    req.set_timeout(Duration::from_secs(1));
                    client.get_book(req).await.map(|_| ())
                })
            })
            .collect();
        for call in calls {
            let code = match bounded(call).await.unwrap() {
                Ok(()) => Code::Ok,
                Err(status) => status.code(),
            };
            *codes.entry(format!("{code:?}")).or_default() += 1;
        }
    }
    println!("160 calls racing a 30 ms attempt limit: {codes:?}");
    assert!(!codes.contains_key("Cancelled"), "{codes:?}");
    assert!(!codes.contains_key("Unknown"), "{codes:?}");
}

#[tokio::test]
async fn a_server_that_is_down_is_reported_as_unavailable() {
    let mut server = Instance::with_faults(faults("a")).await;
    server.stop().await;
    for attempts in [1, 3] {
        let policy = RetryPolicy::new(attempts, MS, 2 * MS, 0.2).unwrap();
        let mut client = LibraryClient::new(
            ServiceBuilder::new()
                .layer(RetryLayer::new(policy, budget()))
                .service(server.channel()),
        );
        let status = bounded(client.get_book(get("1")))
            .await
            .expect_err("nobody listens");
        assert_eq!(
            status.code(),
            Code::Unavailable,
            "not tonic's raw transport error: {status:?}"
        );
        assert!(
            status.message().contains("no response from the server"),
            "{status:?}"
        );
    }
}

/// A peer that accepts the connection, reads what the client sends, and
/// drops the connection without a response: the attempts find no server to
/// answer them, and the call ends as UNAVAILABLE naming the transport error,
/// whatever the number of attempts. (tonic's own client reports
/// this as UNKNOWN "transport error".)
#[tokio::test]
async fn a_connection_dropped_before_the_response_ends_as_unavailable() {
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let dropper = tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                // The preface, SETTINGS and the request: then gone.
                let mut buf = [0u8; 1024];
                let _ =
                    tokio::time::timeout(Duration::from_millis(200), socket.read(&mut buf)).await;
            });
        }
    });
    for attempts in [1, 3] {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_lazy();
        let layer = RetryLayer::new(
            RetryPolicy::new(attempts, MS, 2 * MS, 0.2).unwrap(),
            budget(),
        );
        let mut client =
            LibraryClient::new(ServiceBuilder::new().layer(layer.clone()).service(channel));
        let status = bounded(client.get_book(get("1")))
            .await
            .expect_err("the peer never answers");
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(
            status.message().contains("no response from the server"),
            "{status:?}"
        );
        assert_eq!(
            layer.metrics().attempts(),
            u64::from(attempts),
            "{status:?}"
        );
        // A give-up after retrying carries the mark up; one attempt does not.
        let marked = status.metadata().get("grpc-retry-pushback-ms").is_some();
        assert_eq!(marked, attempts > 1, "{status:?}");
    }
    dropper.abort();
}
