//! The layer between tonic generated clients and real tonic servers on
//! loopback, with faults injected by the crate's own `FaultLayer`. Times here
//! are real but short, and every call is bounded.

use crate::support::bounded;
use std::time::{Duration, Instant};

use crate::support::parse_timeout;
use crate::support::pb::library_client::LibraryClient;
use crate::support::pb::{
    Book, GetBookRequest, ImportSummary, ListBooksRequest, ReserveStockRequest,
};
use crate::support::{Instance, Shelf};
use http::HeaderValue;
use tonic::Code;
use tonic_retry::balance::PreferUntried;
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
use tonic_retry::{fault::Fault, fault::FaultLayer, fault::Rule};
use tower::ServiceBuilder;

const MS: Duration = Duration::from_millis(1);

fn layer() -> RetryLayer {
    RetryLayer::new(RetryPolicy::default(), RetryBudget::new(200, 0.1).unwrap())
}

fn faults(id: &str) -> FaultLayer {
    FaultLayer::new(id).unwrap()
}

fn get(isbn: &str) -> GetBookRequest {
    GetBookRequest { isbn: isbn.into() }
}

type Client = LibraryClient<tonic_retry::RetryService<tonic::transport::Channel>>;

fn connect(instance: &Instance, layer: &RetryLayer) -> Client {
    LibraryClient::new(
        ServiceBuilder::new()
            .layer(layer.clone())
            .service(instance.channel()),
    )
}

#[tokio::test]
async fn a_generated_client_gets_through_two_unavailable_answers() {
    let server =
        Instance::with_faults(faults("a").with(Rule::first(2, Fault::unavailable()))).await;
    let mut client = connect(&server, &layer());

    let book = bounded(client.get_book(get("42")))
        .await
        .expect("third attempt succeeds");
    assert_eq!(book.into_inner().title, "Book 42");

    let seen = server.faults.seen();
    assert_eq!(seen.len(), 3);
    let attempts: Vec<_> = seen.iter().map(|s| s.previous_attempts).collect();
    assert_eq!(attempts, [None, Some(1), Some(2)]);
    let key = seen[0].idempotency_key.clone().expect("a generated key");
    assert!(
        seen.iter()
            .all(|s| s.idempotency_key.as_deref() == Some(key.as_str()))
    );
}

#[tokio::test]
async fn rolling_restart_the_call_succeeds_once_the_instance_is_back() {
    let mut server = Instance::with_faults(faults("a")).await;
    let policy = RetryPolicy::new(5, 20 * MS, 200 * MS, 0.2).unwrap();
    let layer = RetryLayer::new(policy, RetryBudget::new(200, 0.1).unwrap());
    let mut client = connect(&server, &layer);
    bounded(client.get_book(get("1")))
        .await
        .expect("healthy at first");

    server.stop().await;
    // Down: connections are refused until the instance is back.
    let restarted = tokio::spawn(async move {
        tokio::time::sleep(60 * MS).await;
        server.restart().await;
        server
    });
    let book = bounded(client.get_book(get("2")))
        .await
        .expect("a retry reaches the restarted instance");
    assert_eq!(book.into_inner().isbn, "2");
    let server = restarted.await.unwrap();
    assert!(
        layer.metrics().retries() >= 1,
        "the refused attempts were retried"
    );
    assert_eq!(
        server.faults.seen().last().unwrap().path,
        "/library.v1.Library/GetBook"
    );
}

#[tokio::test]
async fn resource_exhausted_is_retried_after_retry_info_and_not_without() {
    let delay = Duration::from_millis(300);
    let server =
        Instance::with_faults(faults("a").with(Rule::first(1, Fault::rate_limited(delay)))).await;
    let mut client = connect(&server, &layer());
    let started = Instant::now();
    bounded(client.get_book(get("1")))
        .await
        .expect("retried after the server's delay");
    assert!(started.elapsed() >= delay, "waited {:?}", started.elapsed());
    assert_eq!(server.faults.requests(), 2);

    let server = Instance::with_faults(
        faults("b").with(Rule::first(1, Fault::status(Code::ResourceExhausted))),
    )
    .await;
    let mut client = connect(&server, &layer());
    let status = bounded(client.get_book(get("1"))).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(server.faults.requests(), 1, "a wall is not retried");
}

#[tokio::test]
async fn final_codes_reach_the_client_after_one_attempt() {
    for code in [
        Code::Aborted,
        Code::NotFound,
        Code::InvalidArgument,
        Code::PermissionDenied,
        Code::Unauthenticated,
        Code::Unimplemented,
        Code::Internal,
    ] {
        let server =
            Instance::with_faults(faults("a").with(Rule::first(1, Fault::status(code)))).await;
        let mut client = connect(&server, &layer());
        let status = bounded(client.get_book(get("1"))).await.unwrap_err();
        assert_eq!(status.code(), code);
        assert!(status.message().starts_with("injected"), "{status:?}");
        assert_eq!(server.faults.requests(), 1, "{code:?} was retried");
    }
}

#[tokio::test]
async fn a_stock_conflict_is_never_retried() {
    let shelf = Shelf::with_stock("isbn-1", 1);
    let server = Instance::start(shelf, faults("a")).await;
    let mut client = connect(&server, &layer());
    let reserve = || ReserveStockRequest {
        isbn: "isbn-1".into(),
        quantity: 1,
    };
    bounded(client.reserve_stock(reserve()))
        .await
        .expect("one in stock");
    let status = bounded(client.reserve_stock(reserve())).await.unwrap_err();
    assert_eq!(status.code(), Code::Aborted);
    assert_eq!(server.faults.requests(), 2, "the conflict was sent once");
}

#[tokio::test]
async fn one_deadline_covers_every_attempt_and_ends_as_deadline_exceeded() {
    // The book's example: 800 ms for the whole call; every attempt takes 300 ms to fail.
    let slow = Fault::unavailable().after(300 * MS);
    let server = Instance::with_faults(faults("a").with(Rule::always(slow))).await;
    let mut client = connect(&server, &layer());

    let mut req = tonic::Request::new(get("7"));
    req.set_timeout(800 * MS);
    let started = Instant::now();
    let status = bounded(client.get_book(req)).await.unwrap_err();
    let took = started.elapsed();

    assert_eq!(
        status.code(),
        Code::DeadlineExceeded,
        "not CANCELLED: {status:?}"
    );
    assert!(took >= 790 * MS, "ended early: {took:?}");
    assert!(
        took < Duration::from_secs(3),
        "the deadline did not hold: {took:?}"
    );

    let timeouts: Vec<Duration> = server
        .faults
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
    assert!(timeouts[0] <= 800 * MS);
    for pair in timeouts.windows(2) {
        // Each attempt spent 300 ms, plus a backoff, before the next.
        assert!(pair[0] - pair[1] >= 300 * MS, "{timeouts:?}");
    }
    // No attempt was sent without its backoff plus 20 ms of room.
    assert!(timeouts.iter().all(|t| *t > 20 * MS), "{timeouts:?}");
}

#[tokio::test]
async fn a_lost_write_is_retried_with_its_key_and_applied_exactly_once() {
    const CALLS: u32 = 40;
    let shelf = Shelf::with_stock("isbn-9", 1_000);
    // Every call's first attempt is applied, then its response is lost.
    let lossy = Rule::every(2, Fault::lose_response(Code::Unavailable))
        .unwrap()
        .on_method("ReserveStock");
    let server = Instance::start(shelf.clone(), faults("a").with(lossy)).await;
    let layer = RetryLayer::new(
        RetryPolicy::new(5, 2 * MS, 10 * MS, 0.2).unwrap(),
        RetryBudget::new(1_000, 0.1).unwrap(),
    );
    let mut client = connect(&server, &layer);
    let mut ok = 0;
    for _ in 0..CALLS {
        let req = ReserveStockRequest {
            isbn: "isbn-9".into(),
            quantity: 1,
        };
        ok += u32::from(bounded(client.reserve_stock(req)).await.is_ok());
    }
    let applied = shelf.applied.load(std::sync::atomic::Ordering::SeqCst);
    let deduplicated = shelf.deduplicated.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(applied, u64::from(CALLS), "every call's write applied once");
    assert_eq!(
        shelf.stock("isbn-9"),
        1_000 - CALLS,
        "stock decremented exactly once per call"
    );
    assert!(
        deduplicated > 0,
        "some retries were answered from the dedup table"
    );
    assert!(ok >= CALLS - 2, "{ok} of {CALLS} calls succeeded");
    // Every retry of a call carried that call's key.
    let seen = server.faults.seen();
    let mut keys: Vec<_> = seen
        .iter()
        .filter_map(|s| s.idempotency_key.clone())
        .collect();
    assert_eq!(keys.len(), seen.len());
    keys.sort();
    keys.dedup();
    assert_eq!(
        keys.len(),
        CALLS as usize,
        "one key per call, shared by its attempts"
    );
}

#[tokio::test]
async fn behind_the_balancer_a_retry_goes_to_the_other_instance() {
    let a = Instance::with_faults(faults("a").with(Rule::always(Fault::unavailable()))).await;
    let b = Instance::with_faults(faults("b")).await;
    let balancer =
        PreferUntried::new([("a".to_owned(), a.channel()), ("b".to_owned(), b.channel())]).unwrap();
    let mut client = LibraryClient::new(ServiceBuilder::new().layer(layer()).service(balancer));
    for n in 0..6 {
        bounded(client.get_book(get(&n.to_string())))
            .await
            .expect("b answers");
    }
    // Whatever a saw was a first attempt; each was retried on b, never on a.
    let on_a = a.faults.seen();
    let on_b = b.faults.seen();
    assert!(!on_a.is_empty());
    assert!(
        on_a.iter().all(|s| s.previous_attempts.is_none()),
        "a retry went back to a"
    );
    for first in &on_a {
        let retry = on_b
            .iter()
            .find(|s| s.idempotency_key == first.idempotency_key)
            .expect("the failed call was retried on b");
        assert_eq!(retry.previous_attempts, Some(1));
        assert_eq!(retry.already_tried.as_deref(), Some("a"));
    }
    assert_eq!(on_b.len(), 6, "every call ended on b exactly once");
}

/// Calls carrying a caller's `x-already-tried: a,b` behind a balancer over
/// a, b and c: how many reached each instance.
async fn steered(trusted: bool) -> [usize; 3] {
    let a = Instance::with_faults(faults("a")).await;
    let b = Instance::with_faults(faults("b")).await;
    let c = Instance::with_faults(faults("c")).await;
    let balancer = PreferUntried::new([
        ("a".to_owned(), a.channel()),
        ("b".to_owned(), b.channel()),
        ("c".to_owned(), c.channel()),
    ])
    .unwrap();
    let policy = RetryPolicy::default().with_callers_mark_trusted(trusted);
    let layer = RetryLayer::new(policy, RetryBudget::new(200, 0.1).unwrap());
    let mut client = LibraryClient::new(ServiceBuilder::new().layer(layer).service(balancer));
    for n in 0..6 {
        let mut request = tonic::Request::new(get(&n.to_string()));
        request
            .metadata_mut()
            .insert("x-already-tried", "a,b".parse().unwrap());
        bounded(client.get_book(request)).await.expect("answered");
    }
    [
        a.faults.seen().len(),
        b.faults.seen().len(),
        c.faults.seen().len(),
    ]
}

#[tokio::test]
async fn a_callers_mark_does_not_steer_calls_unless_trusted() {
    let spread = steered(false).await;
    assert_eq!(spread.iter().sum::<usize>(), 6);
    assert!(
        spread[0] + spread[1] > 0,
        "a remote caller's header sent every call to c: {spread:?}"
    );
    assert_eq!(steered(true).await, [0, 0, 6], "trusted, the mark steers");
}

#[tokio::test]
async fn in_a_total_outage_the_budget_stops_retries() {
    let server = Instance::with_faults(faults("a").with(Rule::always(Fault::unavailable()))).await;
    // 10 tokens at most: 5 to start with; failures earn nothing.
    let layer = RetryLayer::new(
        RetryPolicy::new(3, MS, 2 * MS, 0.2).unwrap(),
        RetryBudget::new(10, 0.1).unwrap(),
    );
    let mut client = connect(&server, &layer);
    let mut codes = Vec::new();
    let mut attempts = Vec::new();
    for _ in 0..8 {
        let before = server.faults.requests();
        codes.push(bounded(client.get_book(get("1"))).await.unwrap_err().code());
        attempts.push(server.faults.requests() - before);
    }
    assert_eq!(
        attempts,
        [3, 3, 2, 1, 1, 1, 1, 1],
        "5 retries in all, then one attempt per call"
    );
    assert_eq!(&codes[..2], [Code::Unavailable; 2]);
    assert!(
        codes[2..].iter().all(|c| *c == Code::ResourceExhausted),
        "{codes:?}"
    );
    assert_eq!(layer.budget().available(), 0.0);
}

#[tokio::test]
async fn pushback_is_honoured_and_negative_pushback_is_not_retried() {
    let pushback = Fault::unavailable().with_pushback(HeaderValue::from_static("250"));
    let server = Instance::with_faults(faults("a").with(Rule::first(1, pushback))).await;
    let mut client = connect(&server, &layer());
    let started = Instant::now();
    bounded(client.get_book(get("1")))
        .await
        .expect("retried after the pushback");
    assert!(started.elapsed() >= 250 * MS);
    assert_eq!(server.faults.requests(), 2);

    let stop = Fault::unavailable().with_pushback(HeaderValue::from_static("-1"));
    let server = Instance::with_faults(faults("b").with(Rule::first(1, stop))).await;
    let mut client = connect(&server, &layer());
    let status = bounded(client.get_book(get("1"))).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(server.faults.requests(), 1);
}

fn books(n: u32) -> Vec<Book> {
    (0..n)
        .map(|i| Book {
            isbn: format!("isbn-{i:05}"),
            title: "t".repeat(64),
            author: "a".repeat(16),
        })
        .collect()
}

fn summary(books: &[Book]) -> ImportSummary {
    let bytes = books.iter().map(crate::support::library::book_bytes).sum();
    ImportSummary {
        count: books.len() as u32,
        bytes,
    }
}

#[tokio::test]
async fn client_streaming_is_replayed_on_retry() {
    let server = Instance::with_faults(
        faults("a").with(Rule::first(1, Fault::unavailable()).on_method("ImportBooks")),
    )
    .await;
    let mut client = connect(&server, &layer());
    let sent = books(20);
    let got = bounded(client.import_books(tokio_stream::iter(sent.clone())))
        .await
        .unwrap();
    assert_eq!(got.into_inner(), summary(&sent));
    assert_eq!(server.faults.requests(), 2);
    assert_eq!(
        *server.shelf().imports.lock().unwrap(),
        [(20, summary(&sent).bytes)]
    );
}

#[tokio::test]
async fn a_streamed_body_over_the_replay_limit_is_delivered_whole_and_not_retried() {
    // The server reads the whole stream, then the answer is lost.
    let lost = Rule::always(Fault::lose_response(Code::Unavailable)).on_method("ImportBooks");
    let server = Instance::with_faults(faults("a").with(lost)).await;
    let layer = RetryLayer::new(
        RetryPolicy::default().with_replay_limit(1024),
        RetryBudget::new(200, 0.1).unwrap(),
    );
    let mut client = connect(&server, &layer);
    let sent = books(200); // about 19 KiB
    let status = bounded(client.import_books(tokio_stream::iter(sent.clone())))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(server.faults.requests(), 1, "not retried");
    assert_eq!(
        *server.shelf().imports.lock().unwrap(),
        [(200, summary(&sent).bytes)],
        "the server read every book"
    );
}

#[tokio::test]
async fn server_streaming_and_bidirectional_calls_neither_hang_nor_lose_data() {
    let server = Instance::with_faults(
        faults("a")
            .with(Rule::first(1, Fault::unavailable()).on_method("ListBooks"))
            .with(Rule::first(1, Fault::unavailable()).on_method("SyncBooks")),
    )
    .await;
    let mut client = connect(&server, &layer());

    let mut stream = bounded(client.list_books(ListBooksRequest {
        author: "A".into(),
        limit: 500,
    }))
    .await
    .unwrap()
    .into_inner();
    let mut n = 0;
    while let Some(book) = bounded(stream.message()).await.unwrap() {
        assert_eq!(book.isbn, n.to_string());
        n += 1;
    }
    assert_eq!(n, 500);

    // Bidirectional, in lock step: each book is sent only after the previous
    // echo came back, so the request body is still open while the response
    // streams. A layer that waited for the body to end would hang here.
    let (tx, rx) = tokio::sync::mpsc::channel::<Book>(1);
    let outbound = tokio_stream::wrappers::ReceiverStream::new(rx);
    let first = books(1).remove(0);
    tx.send(first.clone()).await.unwrap();
    let mut echoes = bounded(client.sync_books(outbound))
        .await
        .unwrap()
        .into_inner();
    let mut received = vec![
        bounded(echoes.message())
            .await
            .unwrap()
            .expect("first echo"),
    ];
    for book in books(10).into_iter().skip(1) {
        tx.send(book).await.unwrap();
        received.push(bounded(echoes.message()).await.unwrap().expect("an echo"));
    }
    drop(tx);
    assert!(bounded(echoes.message()).await.unwrap().is_none());
    assert_eq!(received, books(10));
    assert_eq!(received[0], first);
}

#[tokio::test]
async fn works_under_timeout_concurrency_limit_and_load_shed() {
    let server =
        Instance::with_faults(faults("a").with(Rule::rate(0.3, Fault::unavailable()).unwrap()))
            .await;
    let layer = layer();
    let svc = ServiceBuilder::new()
        .timeout(Duration::from_secs(5))
        .load_shed()
        .concurrency_limit(4)
        .layer(layer.clone())
        .service(server.channel());
    let client = LibraryClient::new(svc);
    let calls: Vec<_> = (0..32)
        .map(|n| {
            let mut client = client.clone();
            tokio::spawn(async move { client.get_book(get(&n.to_string())).await })
        })
        .collect();
    let mut ok = 0;
    let mut shed = 0;
    for call in calls {
        match bounded(call).await.unwrap() {
            Ok(book) => {
                assert!(!book.into_inner().isbn.is_empty());
                ok += 1;
            }
            // What load_shed's `Overloaded` becomes in a tonic client.
            Err(status) if status.code() == Code::ResourceExhausted => shed += 1,
            Err(status) => assert_eq!(status.code(), Code::Unavailable, "{status:?}"),
        }
    }
    assert!(ok > 0, "nothing got through ({shed} shed)");
    assert!(layer.metrics().attempts() >= ok);
}

#[tokio::test]
async fn a_client_stream_still_being_written_is_replayed_and_continued_on_retry() {
    // The first attempt is refused at once, while the caller is still writing
    // its stream; the retry must replay what was written and then carry on.
    let server = Instance::with_faults(
        faults("a").with(Rule::first(1, Fault::unavailable()).on_method("ImportBooks")),
    )
    .await;
    let mut client = connect(&server, &layer());
    let sent = books(12);
    let (tx, rx) = tokio::sync::mpsc::channel::<Book>(4);
    let writer = {
        let sent = sent.clone();
        tokio::spawn(async move {
            for (i, book) in sent.into_iter().enumerate() {
                if i == 3 || i == 8 {
                    tokio::time::sleep(50 * MS).await;
                }
                tx.send(book).await.expect("the call is still reading");
            }
        })
    };
    let call = client.import_books(tokio_stream::wrappers::ReceiverStream::new(rx));
    let got = bounded(call).await.expect("the retry succeeds");
    writer.await.unwrap();
    assert_eq!(got.into_inner(), summary(&sent));
    assert_eq!(server.faults.requests(), 2);
    assert_eq!(
        *server.shelf().imports.lock().unwrap(),
        [(12, summary(&sent).bytes)]
    );
}
