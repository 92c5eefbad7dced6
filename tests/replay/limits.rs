//! Replay limits as grpc-java's: 1 MiB per call by default, and a
//! limit for the copies of all of a layer's calls in flight together (16 MiB
//! by default). A body over either is sent whole and at once, not retried,
//! and counted. Mock tests under paused time.

use std::time::Duration;

use crate::support::*;
use bytes::Bytes;
use http::Request;
use http_body_util::BodyExt;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::{RetryLayer, RetryPolicy};
use tower::{Layer, ServiceExt};
use tower_test::mock;

/// A unary request whose body is `len` bytes in one chunk.
fn request_of(len: usize) -> Request<Body> {
    let mut req = request();
    *req.body_mut() = Body::new(http_body_util::Full::new(Bytes::from(vec![7u8; len])));
    req
}

fn layer_with_memory(policy: RetryPolicy, memory: usize) -> (Svc, Handle, RetryLayer) {
    let layer = RetryLayer::new(policy, budget()).with_replay_memory(memory);
    let (inner, handle) = mock::pair();
    (layer.layer(inner), handle, layer)
}

#[test]
fn the_defaults_are_grpc_javas() {
    assert_eq!(RetryPolicy::DEFAULT_REPLAY_LIMIT, 1 << 20);
    let policy = RetryPolicy::default();
    let (_, _, layer) = setup(policy, budget());
    assert_eq!(layer.replay_memory_in_use(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_100_kib_call_that_fails_once_is_retried_with_the_defaults() {
    let (mut svc, mut handle, layer) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request_of(100 << 10)).await;
    let (req, send, _) = next(&mut handle).await;
    assert_eq!(
        req.into_body().collect().await.unwrap().to_bytes().len(),
        100 << 10
    );
    assert_eq!(
        layer.replay_memory_in_use(),
        100 << 10,
        "the copy is counted"
    );
    send.send_response(status(Code::Unavailable));
    let (req, send, _) = next(&mut handle).await;
    let replayed = req.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(replayed.len(), 100 << 10, "replayed whole");
    assert!(replayed.iter().all(|&b| b == 7));
    send.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
    assert_eq!(layer.metrics().retries(), 1);
    assert_eq!(layer.metrics().body_too_large(), 0);
    assert_eq!(layer.replay_memory_in_use(), 0, "the copy is given back");
}

#[tokio::test(start_paused = true)]
async fn a_body_over_the_calls_limit_is_counted_as_too_large() {
    let policy = RetryPolicy::default().with_replay_limit(1024);
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let call = spawn_call(&mut svc, request_of(1025)).await;
    let (req, send, _) = next(&mut handle).await;
    assert_eq!(
        req.into_body().collect().await.unwrap().to_bytes().len(),
        1025
    );
    send.send_response(status(Code::Unavailable));
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Unavailable);
    assert_eq!(layer.metrics().retries(), 0);
    assert_eq!(layer.metrics().body_too_large(), 1);
    assert_eq!(layer.replay_memory_in_use(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_failure_not_retried_for_another_reason_is_not_counted_as_too_large() {
    let policy = RetryPolicy::default().with_replay_limit(1024);
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let call = spawn_call(&mut svc, request_of(4096)).await;
    let (_, send, _) = next(&mut handle).await;
    // A final code: the body's size does not matter.
    send.send_response(status(Code::InvalidArgument));
    assert_eq!(
        code_of(&call.await.unwrap().unwrap()),
        Code::InvalidArgument
    );
    assert_eq!(layer.metrics().body_too_large(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_call_that_finds_the_layers_memory_full_is_sent_at_once_and_not_retried() {
    // Room for one 8-byte copy, not two.
    let (mut svc, mut handle, layer) = layer_with_memory(RetryPolicy::default(), 12);
    let first = spawn_call(&mut svc, request_of(8)).await;
    let (req, send_first, _) = next(&mut handle).await;
    assert_eq!(req.into_body().collect().await.unwrap().to_bytes().len(), 8);
    assert_eq!(layer.replay_memory_in_use(), 8);

    // The second call is not held back: it arrives, whole, while the first
    // still holds its copy.
    let second = spawn_call(&mut svc, request_of(8)).await;
    let (req, send_second, _) = next(&mut handle).await;
    assert_eq!(req.into_body().collect().await.unwrap().to_bytes().len(), 8);
    assert_eq!(
        layer.replay_memory_in_use(),
        8,
        "only the first copy is held"
    );
    send_second.send_response(status(Code::Unavailable));
    let second = second.await.unwrap().unwrap();
    assert_eq!(code_of(&second), Code::Unavailable, "not retried");
    assert!(
        message_of(&second).contains("from the server"),
        "the server's own answer, not one of the layer's"
    );
    assert_eq!(layer.metrics().body_too_large(), 1);

    // The first call kept its copy, so its retry goes out whole.
    send_first.send_response(status(Code::Unavailable));
    let (req, send, _) = next(&mut handle).await;
    assert_eq!(req.into_body().collect().await.unwrap().to_bytes().len(), 8);
    send.send_response(ok());
    assert_eq!(code_of(&first.await.unwrap().unwrap()), Code::Ok);
    assert_eq!(layer.metrics().retries(), 1);
    assert_eq!(layer.replay_memory_in_use(), 0);
}

#[tokio::test(start_paused = true)]
async fn memory_comes_back_when_a_call_commits() {
    let (mut svc, mut handle, layer) = layer_with_memory(RetryPolicy::default(), 1 << 20);
    let call = spawn_call(&mut svc, request_of(64)).await;
    let (req, send, _) = next(&mut handle).await;
    req.into_body().collect().await.unwrap();
    assert_eq!(layer.replay_memory_in_use(), 64);
    let (tx, response) = streaming_response();
    send.send_response(response);
    let response = call.await.unwrap().unwrap();
    // Committed: no retry can follow, so the copy is gone though the
    // response still streams.
    assert_eq!(layer.replay_memory_in_use(), 0);
    tx.send(data("\0\0\0\0\x01x")).unwrap();
    drop(tx);
    drop(response);
}

#[tokio::test(start_paused = true)]
async fn memory_comes_back_when_the_caller_drops_the_call() {
    let (svc, mut handle, layer) = layer_with_memory(RetryPolicy::default(), 1 << 20);
    let mut svc = svc;
    let svc = svc.ready().await.unwrap();
    let call = tokio::spawn(tower::Service::call(svc, request_of(64)));
    let (req, send, _) = next(&mut handle).await;
    req.into_body().collect().await.unwrap();
    assert_eq!(layer.replay_memory_in_use(), 64);
    // The caller gives up while the attempt is in flight.
    call.abort();
    let _ = call.await;
    drop(send);
    assert_eq!(layer.replay_memory_in_use(), 0);
}

#[tokio::test(start_paused = true)]
async fn many_calls_in_flight_hold_no_more_than_the_layers_limit() {
    // 100 calls of 1 KiB in flight at once under a 10 KiB limit: the first ten
    // keep copies, the others are sent without one, none waits.
    let (mut svc, mut handle, layer) = layer_with_memory(RetryPolicy::default(), 10 << 10);
    let mut calls = Vec::new();
    let mut sends = Vec::new();
    for _ in 0..100 {
        calls.push(spawn_call(&mut svc, request_of(1024)).await);
        let (req, send, _) = next(&mut handle).await;
        req.into_body().collect().await.unwrap();
        sends.push(send);
        assert!(layer.replay_memory_in_use() <= 10 << 10);
    }
    assert_eq!(layer.replay_memory_in_use(), 10 << 10);
    for send in sends {
        send.send_response(status(Code::Unavailable));
    }
    // The ten with copies retry; answer them.
    for _ in 0..10 {
        let (req, send, _) = next(&mut handle).await;
        assert_eq!(
            req.into_body().collect().await.unwrap().to_bytes().len(),
            1024
        );
        send.send_response(ok());
    }
    let mut ok_calls = 0;
    for call in calls {
        if code_of(&call.await.unwrap().unwrap()) == Code::Ok {
            ok_calls += 1;
        }
    }
    assert_eq!(ok_calls, 10);
    assert_eq!(layer.metrics().body_too_large(), 90);
    assert_eq!(layer.replay_memory_in_use(), 0);
}

/// The retry is decided, then the attempt before it reads on during the
/// backoff (an HTTP/2 stream still pulls the body after an early answer) and
/// its copy outgrows `limit`: the retry is not sent, nor paid for, and the
/// caller gets the server's answer to the attempt that was sent.
async fn outgrown_during_the_backoff(policy: RetryPolicy, memory: usize) {
    let layer = RetryLayer::new(policy, budget()).with_replay_memory(memory);
    let (inner, mut handle) = mock::pair();
    let mut svc = layer.layer(inner);
    let (tx, req) = streaming_request();
    tx.send(data("aaaa")).unwrap();
    let call = spawn_call(&mut svc, req).await;
    let (mut first, send, _) = next(&mut handle).await;
    assert_eq!(next_data(first.body_mut()).await, "aaaa");
    send.send_response(status(Code::Unavailable));
    // The layer has decided to retry and waits out its backoff.
    tokio::time::sleep(MS).await;
    tx.send(data("bbbbbbbbbb")).unwrap();
    assert_eq!(
        next_data(first.body_mut()).await,
        "bbbbbbbbbb",
        "the chunk flows on"
    );
    assert_eq!(layer.replay_memory_in_use(), 0, "the copy was dropped");

    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Unavailable);
    assert!(
        message_of(&response).contains("from the server"),
        "the server's answer to the attempt sent: {:?}",
        message_of(&response)
    );
    assert!(
        handle.next_request().now_or_never().is_none(),
        "no retry sent"
    );
    assert_eq!(layer.metrics().retries(), 0, "none paid for");
    assert_eq!(layer.budget().available(), 100.0);
    assert_eq!(layer.metrics().body_too_large(), 1);
    assert_eq!(layer.metrics().marked(), 0, "not retried, so not marked");
}

#[tokio::test(start_paused = true)]
async fn a_copy_that_outgrows_the_layers_memory_during_the_backoff_is_not_retried() {
    outgrown_during_the_backoff(RetryPolicy::default(), 12).await;
}

#[tokio::test(start_paused = true)]
async fn a_copy_that_outgrows_the_calls_limit_during_the_backoff_is_not_retried() {
    outgrown_during_the_backoff(RetryPolicy::default().with_replay_limit(12), 1 << 20).await;
}

#[tokio::test(start_paused = true)]
async fn a_body_over_the_limit_by_its_size_that_no_attempt_read_is_sent_whole_on_the_next() {
    // The first attempt waits for a service that is never ready and is cut
    // before it is sent; nothing was read from the body, so the next attempt
    // can send it whole even though its size is over the replay limit.
    let policy = RetryPolicy::default()
        .with_replay_limit(4)
        .with_attempt_timeout(Duration::from_millis(50));
    let (mut svc, mut handle, layer) = setup(policy, budget());
    handle.allow(0);
    let ready = svc.ready().await.expect("never holds the caller");
    let call = tokio::spawn(tower::Service::call(ready, request_of(8)));
    tokio::time::sleep(Duration::from_millis(60)).await;
    handle.allow(1);
    let (req, send, _) = next(&mut handle).await;
    assert_eq!(req.into_body().collect().await.unwrap().to_bytes().len(), 8);
    send.send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
    assert_eq!(layer.metrics().body_too_large(), 0);
}
