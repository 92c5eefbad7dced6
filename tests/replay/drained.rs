//! The request body of an attempt being drained:
//! a drained attempt's transport may still have to send it (failing it would
//! reset the stream after all), so it stays readable, and the replay copy is
//! kept, while the drain lasts; then the copy goes. Hedged calls' losers and
//! retried calls' attempts cut by their own timeout. Mocks under paused time.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::support::*;
use bytes::Bytes;
use http::{Request, Response};
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::sync::mpsc;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::{HedgePolicy, RetryPolicy};

fn hedge(attempts: u32, delay_ms: u64) -> HedgePolicy {
    HedgePolicy::new(attempts, Duration::from_millis(delay_ms))
        .unwrap()
        .with_max_extra_load(None)
        .unwrap()
}

/// A client stream whose size is known up front (exact size hint), fed by
/// the test chunk by chunk.
struct KnownSize {
    rx: mpsc::UnboundedReceiver<Bytes>,
    size: u64,
}

impl http_body::Body for KnownSize {
    type Data = Bytes;
    type Error = tonic::Status;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        self.rx
            .poll_recv(cx)
            .map(|chunk| chunk.map(|c| Ok(Frame::data(c))))
    }
    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.size)
    }
}

/// A call hedged at once (two attempts), whose request is a client stream
/// of `size` bytes known up front, `first` sent and read by attempt 1: the
/// stream's sender, the call, and both attempts, as the mock sees them.
async fn hedged_stream(
    svc: &mut Svc,
    handle: &mut Handle,
    timeout: &'static str,
    size: usize,
    first: Bytes,
) -> (mpsc::UnboundedSender<Bytes>, Call, Sent, Sent) {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut req = with_timeout(request(), timeout);
    *req.body_mut() = Body::new(KnownSize {
        rx,
        size: size as u64,
    });
    tx.send(first.clone()).unwrap();
    let call = spawn_call(svc, req).await;
    let (mut r1, a1, _) = next(handle).await;
    let (r2, a2, _) = next(handle).await;
    assert_eq!(next_data(r1.body_mut()).await, first);
    (tx, call, (r1, a1), (r2, a2))
}

type Call = tokio::task::JoinHandle<Outcome>;
type Sent = (
    Request<Body>,
    tower_test::mock::SendResponse<Response<Body>>,
);

/// Once a call can no longer be retried the replay copy is released
/// and no further chunk is copied: a long client or bidi stream holds no
/// copy for its lifetime. A loser being drained keeps the body until its
/// transport lets it go; then the winner's stream holds no copy, and what it
/// sends from then on is not copied.
#[tokio::test(start_paused = true)]
async fn once_the_losers_drains_end_the_winners_stream_holds_no_copy() {
    let (mut svc, mut handle, layer) = setup(hedge(2, 0).into(), budget());
    const BIG: usize = 64 * 1024;
    let abc = Bytes::from_static(b"abc");
    let (tx, call, (mut r1, a1), (r2, a2)) =
        hedged_stream(&mut svc, &mut handle, "10S", 3 + BIG, abc).await;

    // The first attempt commits: the server answers headers first, as a
    // client-streaming or bidi server does.
    let (_resp_tx, resp) = streaming_response();
    a1.send_response(resp);
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Ok);
    settle().await;
    assert_eq!(layer.metrics().draining(), 1, "the loser drains");

    // The loser's server answers; its drain ends, and its transport lets
    // go of its request (hyper drops the body when the stream ends).
    a2.send_response(status(Code::Unavailable));
    drop(r2);
    settle().await;
    assert_eq!(layer.metrics().draining(), 0, "the drain ended");

    // The winner's client stream goes on.
    let (big, freed) = watched_chunk(BIG);
    tx.send(big).unwrap();
    let got = next_data(r1.body_mut()).await;
    assert_eq!(got.len(), BIG);
    drop(got);
    settle().await;

    let in_use = layer.replay_memory_in_use();
    let big_freed = freed.load(Ordering::SeqCst);
    drop((r1, response, tx));
    assert_eq!(
        (in_use, big_freed),
        (0, true),
        "(layer replay memory in use, chunk sent after the commit freed) \
         after the commit and the end of every drain"
    );
}

/// The same call with nothing drained (the loser answered before the
/// winner): the copy goes at the commit.
#[tokio::test(start_paused = true)]
async fn without_a_drain_the_copy_goes_at_the_commit() {
    let (mut svc, mut handle, layer) = setup(hedge(2, 0).into(), budget());
    const BIG: usize = 64 * 1024;
    let abc = Bytes::from_static(b"abc");
    let (tx, call, (mut r1, a1), (r2, a2)) =
        hedged_stream(&mut svc, &mut handle, "10S", 3 + BIG, abc).await;
    // A third hedge is not allowed (max 2): the loser fails first.
    a2.send_response(status(Code::Unavailable));
    drop(r2);
    settle().await;
    let (_resp_tx, resp) = streaming_response();
    a1.send_response(resp);
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Ok);
    let (big, freed) = watched_chunk(BIG);
    tx.send(big).unwrap();
    let got = next_data(r1.body_mut()).await;
    drop(got);
    settle().await;
    assert_eq!(
        (layer.replay_memory_in_use(), freed.load(Ordering::SeqCst)),
        (0, true)
    );
    drop((r1, response, tx));
}

/// The same, past the call's deadline: the winner's response was cut at the
/// deadline and every drain is over, so the layer's replay memory is
/// not held for a call that can never be retried, however long its
/// request stream stays open.
#[tokio::test(start_paused = true)]
async fn past_the_deadline_a_hedged_call_whose_loser_drained_holds_no_replay_memory() {
    let (mut svc, mut handle, layer) = setup(hedge(2, 0).into(), budget());
    let ten = Bytes::from(vec![b'a'; 10]);
    let (tx, call, (r1, a1), (r2, a2)) =
        hedged_stream(&mut svc, &mut handle, "1S", 1000, ten).await;
    let (_resp_tx, resp) = streaming_response();
    a1.send_response(resp);
    let response = call.await.unwrap().unwrap();
    settle().await;
    a2.send_response(status(Code::Unavailable));
    drop(r2);
    tokio::time::sleep(Duration::from_secs(2)).await;
    settle().await;
    assert_eq!(layer.metrics().draining(), 0);
    assert_eq!(read_to_end(response).await, Code::DeadlineExceeded);
    let in_use = layer.replay_memory_in_use();
    drop((r1, tx));
    assert_eq!(in_use, 0, "replay memory held 1 s past the call's deadline");
}

/// A retried call: the attempt cut by its own timeout is drained, and its
/// transport has yet to read its body (its connection's send window full)
/// when the retry goes out. It sends the body whole after the retry, and
/// after the call ended.
#[tokio::test(start_paused = true)]
async fn a_drained_cut_attempt_that_has_yet_to_send_its_body_sends_it_whole() {
    let policy = exact_policy(3).with_attempt_timeout(100 * MS);
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let call = spawn_call(&mut svc, with_timeout(request(), "1S")).await;
    let (r1, slow, _) = next(&mut handle).await;
    let (r2, retry, _) = next(&mut handle).await;
    settle().await;
    assert_eq!(layer.metrics().draining(), 1, "the cut attempt drains");
    let second = r2.into_body().collect().await.unwrap().to_bytes();
    // The cut attempt's transport now gets to its body.
    let first = r1.into_body().collect().await.map(|c| c.to_bytes());
    retry.send_response(answer(Code::Ok));
    assert_eq!(read_to_end(call.await.unwrap().unwrap()).await, Code::Ok);
    slow.send_response(answer(Code::Ok));
    assert_eq!(
        first.as_ref().ok(),
        Some(&second),
        "the drained attempt's body: {first:?}"
    );
    // The drain over, nothing of the call's copy is held.
    settle().await;
    assert_eq!(layer.metrics().draining(), 0);
    assert_eq!(layer.replay_memory_in_use(), 0);
}

/// A retried call's drained attempt never reads the caller's stream ahead of
/// the live retry: what it read would have to be kept for the retry, and could
/// push the copy past its limit, failing the live retry's body.
#[tokio::test(start_paused = true)]
async fn a_drained_attempt_does_not_read_ahead_of_the_live_retry() {
    let policy = exact_policy(3)
        .with_attempt_timeout(100 * MS)
        .with_replay_limit(16);
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let (tx, req) = streaming_request();
    let req = with_timeout(req, "10S");
    tx.send(data("abc")).unwrap();
    let call = spawn_call(&mut svc, req).await;
    let (mut r1, _slow, _) = next(&mut handle).await;
    assert_eq!(&next_data(r1.body_mut()).await[..], b"abc");
    // Attempt 1 is cut at 100 ms and drained; the retry is sent.
    let (r2, retry, _) = next(&mut handle).await;
    settle().await;
    assert_eq!(layer.metrics().draining(), 1, "the cut attempt drains");
    tx.send(big(32)).unwrap();
    // The drained attempt's transport asks first: it waits for the retry.
    let early = tokio::time::timeout(MS, r1.body_mut().frame()).await;
    assert!(early.is_err(), "the drained attempt read ahead: {early:?}");
    drop(tx);
    let second = r2.into_body().collect().await.map(|c| c.to_bytes());
    retry.send_response(answer(Code::Ok));
    assert_eq!(read_to_end(call.await.unwrap().unwrap()).await, Code::Ok);
    let mut expected = b"abc".to_vec();
    expected.extend_from_slice(&[b'x'; 32]);
    assert_eq!(
        second
            .as_ref()
            .map(|b| b.to_vec())
            .map_err(|e| e.to_string()),
        Ok(expected),
        "the live retry's request body"
    );
}

fn big(n: usize) -> Result<http_body::Frame<Bytes>, tonic::Status> {
    Ok(http_body::Frame::data(Bytes::from(vec![b'x'; n])))
}

/// A hedged call: an attempt cut by its own timeout is drained, not in
/// flight when another commits; its transport may still have to send the body,
/// and sends it whole.
#[tokio::test(start_paused = true)]
async fn a_hedged_attempt_cut_by_its_own_timeout_and_drained_sends_its_body_whole() {
    let policy: RetryPolicy = hedge(2, 1000).into();
    let policy = policy.with_attempt_timeout(100 * MS);
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let call = spawn_call(&mut svc, with_timeout(request(), "10S")).await;
    // Attempt 1's transport has yet to read its body (send window full).
    let (r1, slow, _) = next(&mut handle).await;
    // Cut by its own timeout at 100 ms: drained, and the next hedge goes
    // at once (no response is non-fatal).
    let (r2, fast, _) = next(&mut handle).await;
    settle().await;
    assert_eq!(layer.metrics().draining(), 1, "the cut attempt drains");
    let second = r2.into_body().collect().await.unwrap().to_bytes();
    fast.send_response(answer(Code::Ok));
    assert_eq!(read_to_end(call.await.unwrap().unwrap()).await, Code::Ok);
    settle().await;
    assert_eq!(layer.metrics().draining(), 1, "still drained");
    // The drained attempt's transport now gets to its body.
    let first = r1.into_body().collect().await.map(|c| c.to_bytes());
    slow.send_response(answer(Code::Ok));
    assert_eq!(
        first.as_ref().ok(),
        Some(&second),
        "the drained hedged attempt's body: {:?}",
        first.as_ref().map_err(|e| e.to_string())
    );
}

/// A retried call whose cut attempt sent its body whole (its clone gone) holds
/// no copy once the call has ended, though that attempt's drain goes on: the
/// layer's replay memory is free for other calls' retries.
#[tokio::test(start_paused = true)]
async fn a_finished_call_whose_cut_attempt_drains_holds_replay_memory_no_clone_needs() {
    let policy = exact_policy(3).with_attempt_timeout(100 * MS);
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let layer_limit = 16;
    let layer = layer.with_replay_memory(layer_limit);
    let call = spawn_call(&mut svc, with_timeout(request(), "10S")).await;
    // Attempt 1's transport sends its whole body and lets it go (hyper
    // drops a request body once sent); its server is slow.
    let (r1, _slow, _) = next(&mut handle).await;
    let first = r1.into_body().collect().await.unwrap().to_bytes();
    // Cut at 100 ms, drained; the retry goes, reads its body, answers OK.
    let (r2, retry, _) = next(&mut handle).await;
    let second = r2.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(first, second);
    retry.send_response(answer(Code::Ok));
    assert_eq!(read_to_end(call.await.unwrap().unwrap()).await, Code::Ok);
    settle().await;
    assert_eq!(
        layer.metrics().draining(),
        1,
        "the cut attempt still drains"
    );
    // Every clone of the call's body is gone; the call is over.
    tokio::time::sleep(Duration::from_secs(1)).await;
    settle().await;
    let held = layer.replay_memory_in_use();

    // Another call, failing once: not retried for want of layer memory.
    let retried = another_call_failing_once_is_retried(&mut svc, &mut handle).await;
    assert_eq!(
        (held, retried),
        (0, true),
        "(layer replay memory held 1 s after the call ended with no clone alive, \
         the next call retried)"
    );
}

/// Between the cut and the retry's send (its backoff, or its service not yet
/// ready) no attempt is live but the drained one: it must still not read the
/// caller's body at the front, or what it reads is copied and can push the
/// copy past its limit, and the retry is never sent.
#[tokio::test(start_paused = true)]
async fn a_drained_attempt_does_not_read_ahead_during_the_backoff() {
    let r1 = cut_attempt_asking_during_the_backoff(false).await;
    // What the retry read went past the limit, so there is no copy for the
    // drained attempt to replay: that is what the limit costs it.
    let replayed = r1.into_body().collect().await.map(|c| c.to_bytes().len());
    let error = replayed.expect_err("no copy past the limit");
    assert!(
        error.to_string().contains("outgrew the replay limit"),
        "{error}"
    );
}

/// Once every clone of a call's body is gone and the call is over, a drain
/// still running holds neither the layer's replay memory nor the caller's
/// request stream (whose sender must learn the call is over).
#[tokio::test(start_paused = true)]
async fn a_drain_outliving_every_clone_holds_neither_the_copy_nor_the_callers_stream() {
    let policy = exact_policy(3).with_attempt_timeout(100 * MS);
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let (tx, call, r1, _slow) =
        streamed_call(&mut svc, &mut handle, Bytes::from_static(b"abc")).await;
    // Cut at 100 ms and drained; the retry goes at 110 ms.
    let (r2, retry, _) = next(&mut handle).await;
    settle().await;
    assert_eq!(layer.metrics().draining(), 1, "the cut attempt drains");
    // The drained attempt's transport lets its body go (its stream reset by
    // the server, say); its server never answers.
    drop(r1);
    the_retry_answers_unread(retry, r2, call, &layer).await;
    assert_eq!(
        (layer.replay_memory_in_use(), tx.is_closed()),
        (0, true),
        "(layer replay memory held, the caller's request stream closed)"
    );
}

/// After the last retry committed, nothing more is copied, even while
/// an earlier attempt drains: that attempt waits rather than fail (which
/// would reset its stream after all) when the live one reads on past what
/// was kept.
#[tokio::test(start_paused = true)]
async fn after_the_commit_nothing_is_copied_and_a_drained_attempt_does_not_fail() {
    let policy = exact_policy(2)
        .with_attempt_timeout(100 * MS)
        .with_replay_limit(16);
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let (tx, call, mut r1, _slow) =
        streamed_call(&mut svc, &mut handle, Bytes::from_static(b"abc")).await;
    // Cut at 100 ms and drained; the last retry goes at 110 ms.
    let (mut r2, retry, _) = next(&mut handle).await;
    assert_eq!(&next_data(r2.body_mut()).await[..], b"abc");
    // The retry commits (headers first, as a client-streaming server does).
    let (_resp_tx, resp) = streaming_response();
    retry.send_response(resp);
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Ok);
    settle().await;
    assert_eq!(layer.metrics().draining(), 1, "the cut attempt drains");
    let mut in_use = Vec::new();
    let mut drained = Vec::new();
    for _ in 0..3 {
        tx.send(data("12345678")).unwrap();
        assert_eq!(&next_data(r2.body_mut()).await[..], b"12345678");
        in_use.push(layer.replay_memory_in_use());
        // The drained attempt's transport follows the live one.
        let frame = tokio::time::timeout(MS, r1.body_mut().frame()).await;
        drained.push(match frame {
            Ok(Some(Ok(f))) => format!("data {:?}", f.into_data().map(|d| d.len())),
            Ok(Some(Err(e))) => format!("error: {e}"),
            Ok(None) => "end".to_owned(),
            Err(_) => "pending".to_owned(),
        });
    }
    assert_eq!(
        (in_use, drained),
        (vec![3, 0, 0], vec!["pending".to_owned(); 3]),
        "(layer replay memory after each chunk sent after the commit: only the copy made \
         before it, until the drained attempt is past it; what the drained attempt's \
         transport got)"
    );
}

/// A call with a 10 s deadline whose body streams from the sender returned,
/// `first` sent already; and its first attempt, which has read `first`.
async fn streamed_call(
    svc: &mut Svc,
    handle: &mut Handle,
    first: Bytes,
) -> (
    Tx,
    tokio::task::JoinHandle<Outcome>,
    Request<Body>,
    tower_test::mock::SendResponse<Response<Body>>,
) {
    let (tx, req) = streaming_request();
    tx.send(Ok(Frame::data(first.clone()))).unwrap();
    let call = spawn_call(svc, with_timeout(req, "10S")).await;
    let (mut r1, answer, _) = next(handle).await;
    assert_eq!(next_data(r1.body_mut()).await, first);
    (tx, call, r1, answer)
}

/// The size of a body the layer's memory (`big_call_setup`) just holds.
const BIG: usize = 40 * 1024;

/// A layer whose calls are tried twice, cut at 100 ms, and whose memory for
/// copies holds one of `BIG` bytes.
fn big_call_setup() -> (Svc, Handle, tonic_retry::RetryLayer) {
    let policy = exact_policy(2).with_attempt_timeout(100 * MS);
    let (svc, handle, layer) = setup(policy, budget());
    (svc, handle, layer.with_replay_memory(BIG + 5))
}

/// The drained attempt `r1`'s transport, past every chunk kept, waits; and
/// no copy is held, so another call, failing once, is retried.
async fn assert_the_copy_is_gone(
    r1: &mut Request<Body>,
    layer: &tonic_retry::RetryLayer,
    svc: &mut Svc,
    handle: &mut Handle,
) {
    assert!(
        tokio::time::timeout(MS, r1.body_mut().frame())
            .await
            .is_err()
    );
    let held = layer.replay_memory_in_use();
    let retried = another_call_failing_once_is_retried(svc, handle).await;
    assert_eq!(
        (held, retried),
        (0, true),
        "(layer replay memory held, the next call retried)"
    );
}

/// The retry `r2`'s server answers before reading the request, and its
/// transport drops the retry's body unread: the call ends with that answer,
/// and a second later the cut attempt still drains.
async fn the_retry_answers_unread(
    retry: tower_test::mock::SendResponse<Response<Body>>,
    r2: Request<Body>,
    call: tokio::task::JoinHandle<Outcome>,
    layer: &tonic_retry::RetryLayer,
) {
    retry.send_response(status(Code::PermissionDenied));
    drop(r2);
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::PermissionDenied);
    drop(response);
    tokio::time::sleep(Duration::from_secs(1)).await;
    settle().await;
    assert_eq!(
        layer.metrics().draining(),
        1,
        "the cut attempt still drains"
    );
}

/// Whether another call, failing once, is retried (it is not, if the layer's
/// replay memory has no room for its copy).
async fn another_call_failing_once_is_retried(svc: &mut Svc, handle: &mut Handle) -> bool {
    let other = spawn_call(svc, with_timeout(request(), "10S")).await;
    let (r, send, _) = next(handle).await;
    let _ = r.into_body().collect().await;
    send.send_response(status(Code::Unavailable));
    settle().await;
    let retried = tokio::time::timeout(Duration::from_millis(500), handle.next_request())
        .await
        .is_ok();
    if !retried {
        let _ = other.await;
    }
    retried
}

/// The last attempt is itself cut by its own timeout and drained while the
/// first still drains: the call is over, and the last attempt is the one
/// reader left (the earlier one only replays what it reads), so it reads the
/// caller's stream on to its end, or its server (waiting for the whole client
/// stream) would never answer and both drains would end at the deadline.
#[tokio::test(start_paused = true)]
async fn a_drained_last_attempt_reads_on_while_an_earlier_attempt_drains() {
    let policy = exact_policy(2).with_attempt_timeout(100 * MS);
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let (tx, call, _r1, _slow1) =
        streamed_call(&mut svc, &mut handle, Bytes::from_static(b"abc")).await;
    // Cut at 100 ms and drained; the last attempt goes at 110 ms.
    let (mut r2, _slow2, _) = next(&mut handle).await;
    assert_eq!(&next_data(r2.body_mut()).await[..], b"abc");
    // The last attempt is cut too (210 ms) and drained: the call ends.
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::DeadlineExceeded);
    settle().await;
    assert_eq!(layer.metrics().draining(), 2, "both cut attempts drain");
    tx.send(data("def")).unwrap();
    drop(tx);
    let rest = tokio::time::timeout(Duration::from_secs(1), r2.body_mut().collect())
        .await
        .map(|r| r.map(|c| c.to_bytes()).map_err(|e| e.to_string()));
    assert_eq!(rest, Ok(Ok(Bytes::from_static(b"def"))));
    assert_eq!(layer.metrics().draining(), 2);
}

/// As `a_drained_attempt_does_not_read_ahead_during_the_backoff`, but the
/// cut attempt's server answers during the backoff, so its drain is over
/// while its transport still holds its request body: it still does not read
/// the caller's body before the retry is sent.
#[tokio::test(start_paused = true)]
async fn a_cut_attempt_whose_drain_is_over_does_not_read_ahead_during_the_backoff() {
    cut_attempt_asking_during_the_backoff(true).await;
}

/// A call whose first attempt is cut at 100 ms and drained (its server
/// answering during the backoff if `answered`, which ends the drain), whose
/// caller sends 32 bytes more during the backoff, which the cut attempt's
/// transport asks for first: it gets nothing, and the retry, sent at 150 ms,
/// sends the body whole (past the call's replay limit of 16). The cut
/// attempt's body.
async fn cut_attempt_asking_during_the_backoff(answered: bool) -> Request<Body> {
    let policy = RetryPolicy::new(3, 50 * MS, 100 * MS, 0.0)
        .unwrap()
        .with_attempt_timeout(100 * MS)
        .with_replay_limit(16);
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let (tx, call, mut r1, slow) =
        streamed_call(&mut svc, &mut handle, Bytes::from_static(b"abc")).await;
    tokio::time::sleep(110 * MS).await;
    settle().await;
    assert_eq!(layer.metrics().draining(), 1, "the cut attempt drains");
    if answered {
        slow.send_response(answer(Code::Ok));
        settle().await;
        assert_eq!(layer.metrics().draining(), 0, "the drain ended");
    }
    tx.send(big(32)).unwrap();
    let early = tokio::time::timeout(MS, r1.body_mut().frame()).await;
    assert!(early.is_err(), "the cut attempt read ahead: {early:?}");
    drop(tx);
    let (r2, send, _) = next(&mut handle).await;
    let second = r2.into_body().collect().await.map(|c| c.to_bytes().len());
    send.send_response(answer(Code::Ok));
    let code = read_to_end(call.await.unwrap().unwrap()).await;
    assert_eq!(
        (second.map_err(|e| e.to_string()), code),
        (Ok(35), Code::Ok)
    );
    r1
}

/// After the last retry committed, once the drained attempt has replayed all
/// the copy holds and the live one has read past it, no clone can need the
/// copy: it goes at once, not when the drain ends, and another call can be
/// retried with the layer's memory it held.
#[tokio::test(start_paused = true)]
async fn a_copy_no_clone_can_need_is_not_held_while_the_drain_lasts() {
    let (mut svc, mut handle, layer) = big_call_setup();
    let (tx, call, mut r1, _slow) =
        streamed_call(&mut svc, &mut handle, Bytes::from(vec![b'x'; BIG])).await;
    // Cut at 100 ms and drained; the last retry goes at 110 ms and commits.
    let (mut r2, retry, _) = next(&mut handle).await;
    assert_eq!(next_data(r2.body_mut()).await.len(), BIG);
    let (_resp_tx, resp) = streaming_response();
    retry.send_response(resp);
    let response = call.await.unwrap().unwrap();
    assert_eq!(code_of(&response), Code::Ok);
    settle().await;
    assert_eq!(layer.metrics().draining(), 1, "the cut attempt drains");
    tx.send(data("12345678")).unwrap();
    assert_eq!(&next_data(r2.body_mut()).await[..], b"12345678");
    // The drained attempt's transport is past every kept chunk.
    assert_the_copy_is_gone(&mut r1, &layer, &mut svc, &mut handle).await;
    drop((r1, r2, tx, response));
}

/// The last retry's transport lets its body go before replaying the copy
/// (its server answered at once, before reading the request) while the cut
/// first attempt drains: once the drained attempt has replayed all the copy
/// holds, no clone can read it again, and it goes at once, not when the
/// drain ends.
#[tokio::test(start_paused = true)]
async fn a_copy_is_not_held_while_the_drain_lasts_once_the_last_attempts_body_is_gone() {
    let (mut svc, mut handle, layer) = big_call_setup();
    let (tx, call, mut r1, _slow) =
        streamed_call(&mut svc, &mut handle, Bytes::from(vec![b'x'; BIG])).await;
    // Cut at 100 ms and drained; the last retry goes at 110 ms.
    let (r2, retry, _) = next(&mut handle).await;
    settle().await;
    assert_eq!(layer.metrics().draining(), 1, "the cut attempt drains");
    the_retry_answers_unread(retry, r2, call, &layer).await;
    // The drained attempt's transport has replayed every kept chunk.
    assert_the_copy_is_gone(&mut r1, &layer, &mut svc, &mut handle).await;
    drop((r1, tx));
}
