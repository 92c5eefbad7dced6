//! The layer between a tonic generated client and a real tonic server on
//! loopback. Times here are real but short, and bounded.

mod common;

use std::time::Duration;

use common::pb::library_client::LibraryClient;
use common::pb::{Book, GetBookRequest, ListBooksRequest};
use common::{Flaky, channel, fail, serve, slow_fail};
use tonic::Code;
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
use tower::ServiceBuilder;

fn layer() -> RetryLayer {
    RetryLayer::new(RetryPolicy::default(), RetryBudget::new(200, 0.1).unwrap())
}

fn get(isbn: &str) -> GetBookRequest {
    GetBookRequest { isbn: isbn.into() }
}

#[tokio::test]
async fn a_generated_client_gets_through_two_unavailable_answers() {
    let library = Flaky::new([fail(Code::Unavailable), fail(Code::Unavailable)]);
    let addr = serve(library.clone()).await;
    let svc = ServiceBuilder::new().layer(layer()).service(channel(addr));
    let mut client = LibraryClient::new(svc);

    let book = client
        .get_book(get("42"))
        .await
        .expect("third attempt succeeds")
        .into_inner();
    assert_eq!(book.title, "Book 42");

    let seen = library.seen();
    assert_eq!(seen.len(), 3);
    let attempts: Vec<_> = seen
        .iter()
        .map(|s| s.previous_attempts.as_deref())
        .collect();
    assert_eq!(attempts, [None, Some("1"), Some("2")]);
    let key = seen[0].idempotency_key.clone().expect("a generated key");
    assert!(
        seen.iter()
            .all(|s| s.idempotency_key.as_deref() == Some(key.as_str()))
    );
}

#[tokio::test]
async fn aborted_reaches_the_client_after_one_attempt() {
    let library = Flaky::new([fail(Code::Aborted)]);
    let addr = serve(library.clone()).await;
    let mut client =
        LibraryClient::new(ServiceBuilder::new().layer(layer()).service(channel(addr)));
    let status = client.get_book(get("1")).await.unwrap_err();
    assert_eq!(status.code(), Code::Aborted);
    assert_eq!(status.message(), "scripted GetBook failure");
    assert_eq!(library.seen().len(), 1);
}

#[tokio::test]
async fn one_deadline_covers_every_attempt_and_ends_as_deadline_exceeded() {
    // Every attempt takes 300 ms to fail; the caller allows 800 ms in all.
    let slow = slow_fail(Duration::from_millis(300), Code::Unavailable);
    let library = Flaky::new([slow; 5]);
    let addr = serve(library.clone()).await;
    let mut client =
        LibraryClient::new(ServiceBuilder::new().layer(layer()).service(channel(addr)));

    let mut req = tonic::Request::new(get("7"));
    req.set_timeout(Duration::from_millis(800));
    let started = std::time::Instant::now();
    let status = client.get_book(req).await.unwrap_err();
    let took = started.elapsed();

    assert_eq!(
        status.code(),
        Code::DeadlineExceeded,
        "not CANCELLED: {status:?}"
    );
    assert!(took >= Duration::from_millis(790), "ended early: {took:?}");
    assert!(
        took < Duration::from_secs(3),
        "the deadline did not hold: {took:?}"
    );

    let timeouts: Vec<Duration> = library
        .seen()
        .iter()
        .map(|s| {
            parse_timeout(
                s.grpc_timeout
                    .as_deref()
                    .expect("every attempt carries grpc-timeout"),
            )
        })
        .collect();
    assert_eq!(timeouts.len(), 3, "{timeouts:?}");
    assert!(timeouts[0] <= Duration::from_millis(800));
    for pair in timeouts.windows(2) {
        // Each attempt spent 300 ms, plus a backoff, before the next.
        assert!(
            pair[0] - pair[1] >= Duration::from_millis(300),
            "{timeouts:?}"
        );
    }
}

#[tokio::test]
async fn works_under_timeout_and_concurrency_limit_layers() {
    let library = Flaky::new([fail(Code::Unavailable)]);
    let addr = serve(library.clone()).await;
    let svc = ServiceBuilder::new()
        .timeout(Duration::from_secs(5))
        .concurrency_limit(4)
        .layer(layer())
        .service(channel(addr));
    let mut client = LibraryClient::new(svc);
    let book = client.get_book(get("9")).await.unwrap().into_inner();
    assert_eq!(book.isbn, "9");

    // Streaming calls pass through too.
    let mut stream = client
        .list_books(ListBooksRequest {
            author: "A".into(),
            limit: 3,
        })
        .await
        .unwrap()
        .into_inner();
    let mut n = 0;
    while let Some(book) = stream.message().await.unwrap() {
        assert_eq!(book.author, "A");
        n += 1;
    }
    assert_eq!(n, 3);
    let echoed: Vec<Book> = {
        let books = (0..3).map(|i| Book {
            isbn: i.to_string(),
            ..Default::default()
        });
        let mut s = client
            .sync_books(tokio_stream::iter(books))
            .await
            .unwrap()
            .into_inner();
        let mut out = Vec::new();
        while let Some(b) = s.message().await.unwrap() {
            out.push(b);
        }
        out
    };
    assert_eq!(echoed.len(), 3);
}

fn parse_timeout(s: &str) -> Duration {
    let (n, unit) = s.split_at(s.len() - 1);
    let n: u64 = n.parse().unwrap();
    match unit {
        "n" => Duration::from_nanos(n),
        "u" => Duration::from_micros(n),
        "m" => Duration::from_millis(n),
        "S" => Duration::from_secs(n),
        other => panic!("unexpected unit {other}"),
    }
}
