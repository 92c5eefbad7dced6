//! A retry replays the body whole; the copy goes once no retry can follow, and
//! attempts that lost or failed never take what the live one needs.
//! `tower-test` mocks under paused time.

use crate::support::{bounded_paused, policy, *};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body::Frame;
use http_body_util::BodyExt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
use tower::{Service, ServiceExt};
use tower_test::mock;

/// What a retry sends beside the layer's own marks is the caller's request
/// as it was: method, URI, version, every value of every header in order
/// (a repeated header too, its sensitive flag kept) and the extensions.
#[tokio::test(start_paused = true)]
async fn a_retry_carries_the_callers_request_whole() {
    #[derive(Clone, Debug, PartialEq)]
    struct Tenant(&'static str);

    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let mut req = request();
    *req.version_mut() = http::Version::HTTP_2;
    req.headers_mut()
        .append("x-tag", HeaderValue::from_static("first"));
    req.headers_mut()
        .append("x-tag", HeaderValue::from_static("second"));
    let mut secret = HeaderValue::from_static("s3cret");
    secret.set_sensitive(true);
    req.headers_mut().insert("authorization", secret);
    req.extensions_mut().insert(Tenant("acme"));
    let call = spawn_call(&mut svc, req).await;

    let (first, send, _) = next(&mut handle).await;
    send.send_response(status_from("instance-a", Code::Unavailable));
    let (retry, send, _) = next(&mut handle).await;
    send.send_response(ok());
    call.await.unwrap().unwrap();

    assert_eq!(retry.method(), first.method());
    assert_eq!(retry.uri(), first.uri());
    assert_eq!(retry.version(), http::Version::HTTP_2);
    let tags: Vec<_> = retry.headers().get_all("x-tag").iter().collect();
    assert_eq!(tags, ["first", "second"]);
    assert!(retry.headers()["authorization"].is_sensitive());
    assert_eq!(retry.extensions().get::<Tenant>(), Some(&Tenant("acme")));
    // Every header of the first attempt is on the retry, once, with its
    // values; the retry adds only its marks.
    let mut expected = first.headers().clone();
    expected.insert("grpc-previous-rpc-attempts", HeaderValue::from_static("1"));
    expected.insert("x-already-tried", HeaderValue::from_static("instance-a"));
    assert_eq!(retry.headers(), &expected);
}

/// A request whose headers hold more values than a header map has room for
/// names (one name repeated past 24,576 values) is retried as any other:
/// the retry's map is never sized past what a map may reserve.
#[tokio::test(start_paused = true)]
async fn a_request_with_many_header_values_is_retried() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let mut req = request();
    for _ in 0..24_577 {
        req.headers_mut()
            .append("x-tag", HeaderValue::from_static("v"));
    }
    let call = spawn_call(&mut svc, req).await;

    let (first, send, _) = next(&mut handle).await;
    assert_eq!(first.headers().get_all("x-tag").iter().count(), 24_577);
    send.send_response(status(Code::Unavailable));
    let retry = tokio::time::timeout(Duration::from_secs(5), next(&mut handle)).await;
    let Ok((retry, send, _)) = retry else {
        let why = match call.await {
            Err(e) if e.is_panic() => "the call panicked".to_owned(),
            other => format!("{other:?}"),
        };
        panic!("no retry was sent: {why}");
    };
    assert_eq!(retry.headers().get_all("x-tag").iter().count(), 24_577);
    send.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
}

#[tokio::test(start_paused = true)]
async fn a_retry_replays_the_same_bytes_and_trailers() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let (tx, req) = streaming_request();
    for s in ["abc", "def"] {
        tx.send(data(s)).unwrap();
    }
    let mut trailers = HeaderMap::new();
    trailers.insert("x-checksum", HeaderValue::from_static("6"));
    tx.send(Ok(Frame::trailers(trailers))).unwrap();
    drop(tx);
    let call = spawn_call(&mut svc, req).await;
    let mut bodies = Vec::new();
    for n in 0..2 {
        let (req, send, _) = next(&mut handle).await;
        let collected = req.into_body().collect().await.expect("whole body");
        bodies.push((collected.trailers().cloned(), collected.to_bytes()));
        send.send_response(if n == 0 {
            status(Code::Unavailable)
        } else {
            ok()
        });
    }
    call.await.unwrap().unwrap();
    assert_eq!(bodies[0].1, "abcdef");
    assert_eq!(bodies[1].1, "abcdef");
    assert_eq!(bodies[1].0.as_ref().unwrap()["x-checksum"], "6");
}

#[tokio::test(start_paused = true)]
async fn a_body_over_the_replay_limit_is_delivered_whole_and_not_retried() {
    let policy = RetryPolicy::default().with_replay_limit(8);
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let (tx, req) = streaming_request();
    for s in ["0123", "4567", "89ab", "cdef"] {
        tx.send(data(s)).unwrap();
    }
    drop(tx);
    let call = spawn_call(&mut svc, req).await;
    let (req, send, _) = next(&mut handle).await;
    let body = req.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "0123456789abcdef", "never truncated");
    send.send_response(status(Code::Unavailable));
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Unavailable);
    assert_eq!(layer.metrics().retries(), 0);
    assert_eq!(layer.budget().available(), 100.0);
}

#[tokio::test(start_paused = true)]
async fn a_streaming_body_is_not_held_back_until_it_ends() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let (tx, req) = streaming_request();
    let call = spawn_call(&mut svc, req).await;
    // The attempt arrives before the caller has sent anything.
    let (req, send, _) = next(&mut handle).await;
    let mut body = req.into_body();
    tx.send(data("first")).unwrap();
    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), "first");
    // The body is still open; the server answers anyway.
    send.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
    tx.send(data("second")).unwrap();
    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), "second");
}

#[tokio::test(start_paused = true)]
async fn a_retry_mid_stream_replays_then_reads_on() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let (tx, req) = streaming_request();
    let call = spawn_call(&mut svc, req).await;
    let (req, send, _) = next(&mut handle).await;
    let mut body = req.into_body();
    tx.send(data("one,")).unwrap();
    assert_eq!(next_data(&mut body).await, "one,");
    send.send_response(status(Code::Unavailable));
    drop(body);
    let (req, send, _) = next(&mut handle).await;
    tx.send(data("two")).unwrap();
    drop(tx);
    let replayed = req.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(replayed, "one,two");
    send.send_response(ok());
    call.await.unwrap().unwrap();
}

// ---------------------------------------------------------------------------
// Replay memory ends when retries end
// ---------------------------------------------------------------------------

/// Sends chunk `i`, of fresh memory, down the caller's stream `tx` and has
/// the attempt whose body is `body` read it; a handle to the chunk tells
/// whether anyone else (a copy) still holds it.
async fn pass_chunk(tx: &Tx, body: &mut Body, i: usize) -> Bytes {
    let chunk = Bytes::from(format!("chunk {i}").into_bytes());
    tx.send(Ok(Frame::data(chunk.clone()))).unwrap();
    drop(body.frame().await.unwrap().unwrap());
    chunk
}

#[tokio::test(start_paused = true)]
async fn once_the_call_commits_the_replay_copy_goes_and_nothing_more_is_copied() {
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let (tx, req) = streaming_request();
    let call = spawn_call(&mut svc, req).await;
    let (req, send, _) = next(&mut handle).await;
    let mut body = req.into_body();
    let mut mine = pass_chunk(&tx, &mut body, 0).await;
    assert!(
        !mine.is_unique(),
        "kept for a retry while none has answered"
    );
    // Response headers: the call is committed, no retry can follow.
    send.send_response(ok());
    call.await.unwrap().unwrap();
    assert!(mine.is_unique(), "the copy was released at the commit");
    for i in 1..200 {
        mine = pass_chunk(&tx, &mut body, i).await;
        assert!(mine.is_unique(), "chunk {i} was copied after the commit");
    }
}

#[tokio::test(start_paused = true)]
async fn a_call_with_one_attempt_keeps_its_copy_only_until_its_answer_starts() {
    // A stream the server refuses is sent again whatever the policy, so a
    // call of one attempt keeps a copy too, but only until the answer
    // starts: then nothing is kept, and nothing more is copied.
    let (mut svc, mut handle, _) = setup(policy(1), budget());
    let (tx, req) = streaming_request();
    let call = spawn_call(&mut svc, req).await;
    let (req, send, _) = next(&mut handle).await;
    let mut body = req.into_body();
    let mine = pass_chunk(&tx, &mut body, 0).await;
    assert!(!mine.is_unique(), "kept while the stream may be refused");
    send.send_response(ok());
    call.await.unwrap().unwrap();
    assert!(mine.is_unique(), "the copy was released at the answer");
    let next = pass_chunk(&tx, &mut body, 1).await;
    assert!(next.is_unique(), "a chunk was copied after the answer");
}

#[tokio::test(start_paused = true)]
async fn the_last_attempt_drops_the_copy_once_its_answer_starts() {
    let (mut svc, mut handle, _) = setup(policy(2), budget());
    let (tx, req) = streaming_request();
    let call = spawn_call(&mut svc, req).await;
    let (req, send, _) = next(&mut handle).await;
    let mut body = req.into_body();
    let first = pass_chunk(&tx, &mut body, 0).await;
    drop(body);
    send.send_response(status(Code::Unavailable));
    // The second and last attempt replays the first chunk, then reads on;
    // the copy is kept while its stream may still be refused.
    let (req, send, _) = next(&mut handle).await;
    let mut body = req.into_body();
    drop(body.frame().await.unwrap().unwrap());
    let second = pass_chunk(&tx, &mut body, 1).await;
    send.send_response(ok());
    call.await.unwrap().unwrap();
    assert!(first.is_unique(), "the copy outlived the answer");
    assert!(second.is_unique(), "the copy outlived the answer");
    let third = pass_chunk(&tx, &mut body, 2).await;
    assert!(third.is_unique(), "a chunk was copied after the answer");
}

// ---------------------------------------------------------------------------
// The replay copy released while a retry still replays it
// ---------------------------------------------------------------------------

/// A client stream whose attempt 1 read `chunks` and failed (Trailers-Only
/// UNAVAILABLE), and whose attempt 2 has just arrived at the mock.
struct Retried {
    /// The caller's feed.
    tx: Tx,
    /// Attempt 1's request body, which its HTTP stream may still pull.
    dead: Body,
    /// Attempt 2, not answered yet.
    req2: Request<Body>,
    send2: mock::SendResponse<Response<Body>>,
    call: tokio::task::JoinHandle<Outcome>,
    /// Kept so that the inner service stays up.
    _handle: Handle,
}

async fn retried_after_reading(policy: RetryPolicy, chunks: &[&'static str]) -> Retried {
    let (mut svc, mut handle, _) = setup(policy, budget());
    let (tx, req) = streaming_request();
    let call = spawn_call(&mut svc, req).await;
    let (req1, send1, _) = next(&mut handle).await;
    let mut dead = req1.into_body();
    for &chunk in chunks {
        tx.send(data(chunk)).unwrap();
        assert_eq!(next_data(&mut dead).await, chunk);
    }
    send1.send_response(status(Code::Unavailable));
    let (req2, send2, _) = next(&mut handle).await;
    Retried {
        tx,
        dead,
        req2,
        send2,
        call,
        _handle: handle,
    }
}

#[derive(Clone)]
struct FailFirstAfterReading<S> {
    inner: S,
    first: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl<S> Service<Request<Body>> for FailFirstAfterReading<S>
where
    S: Service<Request<Body>, Response = Response<Body>> + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        if self.first.swap(false, std::sync::atomic::Ordering::SeqCst) {
            Box::pin(async move {
                let mut body = req.into_body();
                let mut frames = 0;
                while frames < 20 {
                    match body.frame().await {
                        Some(Ok(_)) => frames += 1,
                        _ => break,
                    }
                }
                Ok(tonic::Status::unavailable("failed after reading").into_http())
            })
        } else {
            Box::pin(self.inner.call(req))
        }
    }
}

/// A bidi / client-streaming call: attempt 1 reads two messages then fails
/// (Trailers-Only UNAVAILABLE); attempt 2 goes to a server whose handler
/// answers response headers at once (a server-streaming handler returns its
/// `Response` before reading the request stream). The commit releases the
/// copy while attempt 2 has not replayed it yet: attempt 2's request body
/// must still be sent whole (never truncated, never corrupted).
#[tokio::test(start_paused = true)]
async fn commit_while_the_retry_is_still_replaying_keeps_its_body_whole() {
    let Retried {
        tx,
        dead,
        req2,
        send2,
        call,
        ..
    } = retried_after_reading(policy(3), &["one ", "two "]).await;
    drop(dead);
    // Response headers first, request stream read afterwards.
    send2.send_response(ok());
    let response = bounded_paused(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Ok, "committed");

    tx.send(data("three")).unwrap();
    drop(tx);
    let got = bounded_paused(req2.into_body().collect()).await;
    match got {
        Ok(c) => assert_eq!(c.to_bytes(), "one two three"),
        Err(e) => panic!("attempt 2's request body failed: {e}"),
    }
}

/// The last attempt releases the copy once it has replayed it. But the failed
/// attempt's body may still be read by the transport (hyper's request-body
/// pipe runs until the server's RST_STREAM arrives, after the Trailers-Only
/// answer): that read must fail, not take a chunk that is no longer copied
/// and that the last attempt needs.
#[tokio::test(start_paused = true)]
async fn the_last_attempt_survives_a_late_read_by_the_failed_attempt() {
    let Retried {
        tx,
        dead: mut body1,
        req2,
        send2,
        call,
        ..
    } = retried_after_reading(policy(2), &["one "]).await;
    let mut body2 = req2.into_body();
    assert_eq!(next_data(&mut body2).await, "one ");
    // The failed attempt's pipe pulls the next chunk before its stream is
    // reset: it must not take it from the live attempt.
    tx.send(data("two")).unwrap();
    let late = body1.frame().await.unwrap();
    assert!(late.is_err(), "the dead attempt read on: {late:?}");
    drop(body1);
    drop(tx);
    let rest = bounded_paused(body2.collect()).await;
    match rest {
        Ok(c) => assert_eq!(c.to_bytes(), "two"),
        Err(e) => panic!("the last attempt's request body failed: {e}"),
    }
    send2.send_response(ok());
    call.await.unwrap().unwrap();
}

// ---------------------------------------------------------------------------
// Against a real tonic server: a bidi retry committed mid-replay
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_bidi_retry_committed_mid_replay_is_not_broken() {
    use crate::support::pb::Book;
    use crate::support::pb::library_client::LibraryClient;
    // A tonic server with HTTP/2's default 64 KiB flow-control windows (as
    // grpc-go and grpc-java servers start out), whose first SyncBooks reads
    // 20 messages of the stream and then fails UNAVAILABLE (Trailers-Only).
    let first = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tokio::spawn(
        tonic::transport::Server::builder()
            .initial_stream_window_size(65_535)
            .initial_connection_window_size(65_535)
            .layer(tower::layer::layer_fn(move |inner| FailFirstAfterReading {
                inner,
                first: first.clone(),
            }))
            .add_service(crate::support::pb::library_server::LibraryServer::new(
                crate::support::Shelf::default(),
            ))
            .serve_with_incoming(incoming),
    );
    let channel = crate::support::library::channel(addr);
    let layer = RetryLayer::new(
        RetryPolicy::default().with_replay_limit(16 << 20),
        RetryBudget::new(200, 0.1).unwrap(),
    );
    let mut client = LibraryClient::new(
        tower::ServiceBuilder::new()
            .layer(layer.clone())
            .service(channel),
    );
    let n = 64;
    let books: Vec<Book> = (0..n)
        .map(|i| Book {
            isbn: format!("isbn-{i:05}"),
            title: "t".repeat(16 * 1024),
            author: "a".into(),
        })
        .collect();
    let outbound = tokio_stream::iter(books.clone());
    let result = tokio::time::timeout(Duration::from_secs(20), async {
        let mut echoes = client.sync_books(outbound).await?.into_inner();
        let mut got = 0;
        while let Some(book) = echoes.message().await? {
            assert_eq!(book.isbn, format!("isbn-{got:05}"));
            got += 1;
        }
        Ok::<_, tonic::Status>(got)
    })
    .await
    .expect("hung");
    assert_eq!(
        layer.metrics().retries(),
        1,
        "the first attempt was retried"
    );
    match result {
        Ok(got) => assert_eq!(got, n),
        Err(status) => panic!("the retried bidi stream broke: {status:?}"),
    }
}

// ---------------------------------------------------------------------------
// The live attempt's replay
// ---------------------------------------------------------------------------

/// Attempt 1 fails (Trailers-Only UNAVAILABLE) while its transport still
/// pulls its request body (hyper's pipe runs until the server's RST_STREAM —
/// the hazard `the_last_attempt_survives_a_late_read_by_the_failed_attempt` models for the last attempt). Attempt 2 is live
/// and mid-replay, but not the last attempt, so no release has happened yet.
/// The dead clone's late read must fail, not push the copy over the replay
/// limit and so fail the live attempt, which delivers the body whole.
#[tokio::test(start_paused = true)]
async fn a_dead_attempts_late_read_cannot_push_the_live_attempt_over_the_cap() {
    let Retried {
        tx,
        dead: mut body1,
        req2,
        send2,
        call,
        ..
    } = retried_after_reading(policy(3).with_replay_limit(8), &["1234"]).await;
    let mut body2 = req2.into_body();
    assert_eq!(next_data(&mut body2).await, "1234");
    // The failed attempt's pipe pulls the next chunk before its reset arrives.
    tx.send(data("56789")).unwrap();
    let late = body1.frame().await.unwrap();
    drop(body1);
    drop(tx);
    let rest = bounded_paused(body2.collect()).await;
    send2.send_response(ok());
    let _ = call.await;
    match rest {
        Ok(c) => assert_eq!(c.to_bytes(), "56789"),
        Err(e) => {
            panic!("the live attempt's request body failed: {e} (the dead attempt read {late:?})")
        }
    }
}

/// After the release only the live clone may read. A dead clone that polled
/// the source last holds the source's waker; polled after the release, it
/// fails — and the live clone waiting for the source is still woken, without
/// waiting for the dead clone to be dropped.
#[tokio::test(start_paused = true)]
async fn live_clone_woken_after_dead_clone_errors() {
    let Retried {
        tx,
        dead: mut body1,
        req2,
        send2,
        call,
        ..
    } = retried_after_reading(policy(3), &["one "]).await;
    // The live attempt is read on its own task: replays "one ", then waits.
    let reader = tokio::spawn(async move { req2.into_body().collect().await });
    tokio::time::sleep(MS).await;
    // The dead attempt's task polls once more (Pending): it now owns the
    // source's waker. Its own task is a separate one.
    let (poll_tx, mut poll_rx) = mpsc::unbounded_channel::<()>();
    let dead = tokio::spawn(async move {
        let mut results = Vec::new();
        // Poll the dead body whenever woken, keep it after an error (as a
        // consumer that has not been dropped yet would).
        loop {
            let r = body1.frame().await;
            results.push(r.map(|r| r.is_ok()));
            if poll_rx.recv().await.is_none() {
                break;
            }
        }
        (results, body1)
    });
    tokio::time::sleep(MS).await;
    // Attempt 2 commits: only it may read from now on.
    send2.send_response(ok());
    let response = bounded_paused(call).await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Ok);
    tx.send(data("two")).unwrap();
    tx.send(Ok(Frame::trailers(ok_trailers()))).unwrap();
    drop(tx);
    let got = tokio::time::timeout(Duration::from_secs(10), reader).await;
    drop(poll_tx);
    let _ = dead.await;
    match got {
        Ok(Ok(Ok(c))) => assert_eq!(c.to_bytes(), "one two"),
        Ok(other) => panic!("the live body failed: {other:?}"),
        Err(_) => panic!("the live attempt's body was never woken"),
    }
}

// ---------------------------------------------------------------------------
// Probes that held up
// ---------------------------------------------------------------------------

/// The first attempt waited for readiness inside the call: its body is the
/// first epoch, and a commit before it read anything leaves it whole.
#[tokio::test(start_paused = true)]
async fn first_attempt_after_readiness_wait_commits_and_streams_whole() {
    let (mut svc, mut handle, _) = setup(policy(3), budget());
    handle.allow(0);
    let (tx, req) = streaming_request();
    let call = tokio::spawn(svc.ready().await.unwrap().call(req));
    tokio::time::sleep(10 * MS).await;
    handle.allow(1);
    let (req1, send1, _) = next(&mut handle).await;
    send1.send_response(ok());
    assert_eq!(
        code_of(&bounded_paused(call).await.unwrap().unwrap()),
        Code::Ok
    );
    tx.send(data("a")).unwrap();
    tx.send(data("b")).unwrap();
    tx.send(Ok(Frame::trailers(ok_trailers()))).unwrap();
    drop(tx);
    let c = bounded_paused(req1.into_body().collect()).await.unwrap();
    assert_eq!(c.trailers().unwrap()["grpc-status"], "0");
    assert_eq!(c.to_bytes(), "ab");
}

/// Release while the live clone is mid-replay, the source already ended with
/// trailers: data and trailers are replayed, size hint and end-of-stream right.
#[tokio::test(start_paused = true)]
async fn release_mid_replay_after_trailers() {
    let (mut svc, mut handle, _) = setup(policy(3), budget());
    let (tx, req) = streaming_request();
    let call = spawn_call(&mut svc, req).await;
    let (req1, send1, _) = next(&mut handle).await;
    tx.send(data("ab")).unwrap();
    tx.send(data("cd")).unwrap();
    tx.send(Ok(Frame::trailers(ok_trailers()))).unwrap();
    drop(tx);
    let c = req1.into_body().collect().await.unwrap();
    assert_eq!(c.to_bytes(), "abcd");
    send1.send_response(status(Code::Unavailable));
    let (req2, send2, _) = next(&mut handle).await;
    let mut body2 = req2.into_body();
    assert_eq!(next_data(&mut body2).await, "ab");
    send2.send_response(ok());
    assert_eq!(
        code_of(&bounded_paused(call).await.unwrap().unwrap()),
        Code::Ok
    );
    assert_eq!(http_body::Body::size_hint(&body2).exact(), Some(2));
    assert!(!http_body::Body::is_end_stream(&body2));
    let c = body2.collect().await.unwrap();
    assert_eq!(c.trailers().unwrap()["grpc-status"], "0");
    assert_eq!(c.to_bytes(), "cd");
}

/// Attempt 2 sent, attempt 3 (the last) cut before it was sent; the release
/// then leaves attempt 2's stream readable and attempt 1's failing.
#[tokio::test(start_paused = true)]
async fn second_retry_cut_unsent_then_release() {
    let (mut svc, mut handle, _) = setup(policy(3).with_attempt_timeout(100 * MS), budget());
    let (tx, req) = streaming_request();
    let call = spawn_call(&mut svc, req).await;
    let (req1, send1, _) = next(&mut handle).await;
    let mut body1 = req1.into_body();
    tx.send(data("x")).unwrap();
    body1.frame().await.unwrap().unwrap();
    send1.send_response(status(Code::Unavailable));
    let (req2, send2, _) = next(&mut handle).await;
    handle.allow(0);
    send2.send_response(status(Code::Unavailable));
    let response = bounded_paused(call).await.unwrap().unwrap();
    assert_eq!(
        code_of(&response),
        Code::DeadlineExceeded,
        "{}",
        message_of(&response)
    );
    tx.send(data("y")).unwrap();
    drop(tx);
    assert!(body1.frame().await.unwrap().is_err());
    assert_eq!(req2.into_body().collect().await.unwrap().to_bytes(), "xy");
}

/// Over the replay limit: not retried, attempt 1's body keeps streaming whole.
#[tokio::test(start_paused = true)]
async fn over_the_limit_then_release() {
    let (mut svc, mut handle, layer) = setup(policy(3).with_replay_limit(4), budget());
    let (tx, req) = streaming_request();
    let call = spawn_call(&mut svc, req).await;
    let (req1, send1, _) = next(&mut handle).await;
    let mut body1 = req1.into_body();
    tx.send(data("12345")).unwrap();
    body1.frame().await.unwrap().unwrap();
    send1.send_response(status(Code::Unavailable));
    assert_eq!(
        code_of(&bounded_paused(call).await.unwrap().unwrap()),
        Code::Unavailable
    );
    tx.send(data("6")).unwrap();
    drop(tx);
    assert_eq!(body1.collect().await.unwrap().to_bytes(), "6");
    assert_eq!(layer.metrics().attempts(), 1);
}
