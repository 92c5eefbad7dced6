//! A retried call whose body is all there when it is made: the body is read
//! before the first attempt and kept whole, and still counted in the layer's
//! replay memory only while it may be replayed or an attempt has yet to read
//! it, and never read where it could not be polled.

use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use crate::support::*;
use bytes::Bytes;
use http::{Request, Response};
use http_body::Frame;
use http_body_util::BodyExt;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::{RetryLayer, RetryPolicy};
use tower::{Layer, Service, ServiceExt};
use tower_test::mock;

/// A unary request whose body is `len` bytes in one chunk.
fn request_of(len: usize) -> Request<Body> {
    let mut req = request();
    *req.body_mut() = Body::new(http_body_util::Full::new(Bytes::from(vec![7u8; len])));
    req
}

/// A call of 8 bytes through `svc`, sent, its body read, failing once: the
/// call, and whether its retry was sent.
async fn a_call_failing_once(
    svc: &mut Svc,
    handle: &mut Handle,
) -> (tokio::task::JoinHandle<Outcome>, bool) {
    let call = spawn_call(svc, request_of(8)).await;
    let (r, send, _) = next(handle).await;
    assert_eq!(r.into_body().collect().await.unwrap().to_bytes().len(), 8);
    send.send_response(status(Code::Unavailable));
    let retried = tokio::time::timeout(Duration::from_secs(10), handle.next_request())
        .await
        .is_ok();
    (call, retried)
}

/// The layer-wide limit is across the calls in flight. A call still
/// waiting for its service to be ready has sent nothing and read nothing,
/// and holds no replay memory: a call that was sent and fails meanwhile
/// finds room, and is retried.
#[tokio::test(start_paused = true)]
async fn a_call_waiting_for_its_service_holds_no_replay_memory() {
    // Room for one 8-byte copy, not two.
    let layer = RetryLayer::new(RetryPolicy::default(), budget()).with_replay_memory(12);
    let (inner_a, mut handle_a) = mock::pair::<Request<Body>, Response<Body>>();
    let (inner_b, mut handle_b) = mock::pair::<Request<Body>, Response<Body>>();
    let mut svc_a: Svc = layer.layer(inner_a);
    let mut svc_b: Svc = layer.layer(inner_b);

    // Service A is not ready (a full buffer, a concurrency limit, a
    // reconnecting channel): its call waits inside the layer, unsent.
    handle_a.allow(0);
    let queued = spawn_call(&mut svc_a, request_of(8)).await;
    settle().await;
    let held_by_queued = layer.replay_memory_in_use();

    // A call through B is sent, its body read, and fails once.
    let (call, was_retried) = a_call_failing_once(&mut svc_b, &mut handle_b).await;
    let too_large = layer.metrics().body_too_large();
    drop((call, queued, handle_a));
    assert_eq!(
        (held_by_queued, was_retried, too_large),
        (0, true, 0),
        "(replay memory held by a call not yet sent, the sent call retried, body_too_large)"
    );
}

/// The copy is counted while a clone still has to read it. The
/// last attempt is sent, but its transport has not read its body yet (its
/// send window full): the copy's bytes are still held for it, and counted,
/// so the layer admits no second copy past its limit.
#[tokio::test(start_paused = true)]
async fn the_copy_is_counted_until_the_last_attempt_has_read_it() {
    let policy = exact_policy(2);
    let layer = RetryLayer::new(policy, budget()).with_replay_memory(12);
    let (inner, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut svc: Svc = layer.layer(inner);

    let first = spawn_call(&mut svc, request_of(8)).await;
    let (r1, send1, _) = next(&mut handle).await;
    assert_eq!(r1.into_body().collect().await.unwrap().to_bytes().len(), 8);
    send1.send_response(status(Code::Unavailable));
    // The last attempt is sent; its body not read yet.
    let (r2, _slow, _) = next(&mut handle).await;
    let held = layer.replay_memory_in_use();

    // Another call, failing once: its copy and the one still held for the
    // first call's last attempt would be 16 bytes, past the layer's 12.
    let (other, was_retried) = a_call_failing_once(&mut svc, &mut handle).await;
    // The first call's last attempt reads its body only now: all of it.
    assert_eq!(r2.into_body().collect().await.unwrap().to_bytes().len(), 8);
    drop((first, other));
    assert_eq!(
        (held, was_retried),
        (8, false),
        "(replay memory counted for the last attempt's unread copy, a second copy admitted past the limit)"
    );
}

/// An attempt cut by its own timeout is drained, its transport
/// yet to send its body. Once the call ends (its retry answered), the copy
/// is still held for the drained attempt, and stays counted while it has
/// yet to read it.
#[tokio::test(start_paused = true)]
async fn a_copy_a_drained_attempt_has_yet_to_send_stays_counted() {
    let policy = exact_policy(3).with_attempt_timeout(100 * MS);
    let (mut svc, mut handle, layer) = setup(policy, budget());
    let call = spawn_call(&mut svc, with_timeout(request(), "10S")).await;
    // Attempt 1's transport has yet to read its body; its server is slow.
    let (r1, _slow, _) = next(&mut handle).await;
    // Cut at 100 ms, drained; the retry reads its body and answers OK.
    let (r2, retry, _) = next(&mut handle).await;
    let second = r2.into_body().collect().await.unwrap().to_bytes();
    retry.send_response(answer(Code::Ok));
    assert_eq!(read_to_end(call.await.unwrap().unwrap()).await, Code::Ok);
    settle().await;
    assert_eq!(layer.metrics().draining(), 1, "the cut attempt drains");
    let held = layer.replay_memory_in_use();
    // The drained attempt's transport gets to its body: it is all there.
    let first = r1.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(first, second);
    assert_eq!(
        held,
        second.len(),
        "replay memory counted for the copy the drained attempt has yet to send"
    );
}

/// A body that paces itself with tokio's timer: its first poll makes a
/// `Sleep` (which needs a tokio runtime).
struct Paced {
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    done: bool,
}

impl http_body::Body for Paced {
    type Data = Bytes;
    type Error = tonic::Status;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(Duration::ZERO)));
        ready!(sleep.as_mut().poll(cx));
        self.done = true;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"hello")))))
    }
}

/// A call made in a task (a server's handler, a spawned client) reads its
/// body at once, as one made in `block_on` (`#[tokio::main]`) does: it is
/// counted in the layer's replay memory as soon as the call is made.
#[tokio::test]
async fn a_call_made_in_a_task_or_in_block_on_reads_its_body_at_once() {
    // The bytes held once a call of 8 bytes is made, before it is polled.
    async fn held_once_made() -> usize {
        let (mut svc, _handle, layer) = setup(RetryPolicy::default(), budget());
        let ready = svc.ready().await.unwrap();
        let _future = ready.call(request_of(8));
        layer.replay_memory_in_use()
    }
    let in_block_on = held_once_made().await;
    let in_task = tokio::spawn(held_once_made()).await.unwrap();
    assert_eq!((in_block_on, in_task), (8, 8), "(in block_on, in a task)");
}

/// A call can be made on one thread and spawned on a runtime (e.g.
/// `handle.spawn(svc.call(req))` from a thread outside the runtime): `call`
/// reads nothing of the caller's body there, where a body whose poll needs
/// the runtime would panic.
#[test]
fn a_call_made_outside_a_runtime_is_sent_on_it() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (mut svc, mut handle, _layer) = setup(RetryPolicy::default(), budget());
    let mut req = request();
    *req.body_mut() = Body::new(Paced {
        sleep: None,
        done: false,
    });
    let ready = svc.ready().now_or_never().unwrap().unwrap();
    let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ready.call(req)));
    let future = made.expect("RetryService::call panicked outside a runtime");
    rt.block_on(async move {
        let call = tokio::spawn(future);
        let (r, send, _) = next(&mut handle).await;
        assert_eq!(r.into_body().collect().await.unwrap().to_bytes(), "hello");
        send.send_response(ok());
        assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
    });
}

/// A task of a `LocalSet` polled outside any runtime (by an executor
/// that is not tokio's) has a task id but no runtime: `call` reads nothing
/// of the caller's body there either.
#[test]
fn a_call_made_in_a_local_set_task_outside_a_runtime_reads_nothing_in_call() {
    assert!(
        tokio::runtime::Handle::try_current().is_err(),
        "no runtime here"
    );
    let (mut svc, _handle, _layer) = setup(RetryPolicy::default(), budget());
    let mut req = request();
    *req.body_mut() = Body::new(Paced {
        sleep: None,
        done: false,
    });
    let local = tokio::task::LocalSet::new();
    let task = local.spawn_local(async move {
        let in_task = tokio::task::try_id().is_some();
        let ready = svc.ready().await.unwrap();
        let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ready.call(req)));
        (in_task, made.is_ok())
    });
    // As `futures::executor::block_on` polls it, on a thread with no runtime.
    let mut run = std::pin::pin!(local.run_until(task));
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let out = (0..100)
        .find_map(|_| match run.as_mut().poll(&mut cx) {
            Poll::Ready(r) => Some(r.unwrap()),
            Poll::Pending => None,
        })
        .expect("the LocalSet's task finished");
    assert_eq!(
        out,
        (true, true),
        "(in a task, RetryService::call did not panic)"
    );
}

/// A call whose first attempt is cut before it is sent (a per-attempt
/// timeout of zero for its method) has sent nothing, and holds no replay
/// memory through its backoffs: a call sent meanwhile, failing once, finds
/// room and is retried.
#[tokio::test(start_paused = true)]
async fn a_call_whose_first_attempt_was_cut_unsent_holds_no_replay_memory_in_its_backoff() {
    let slow = RetryPolicy::new(3, 1000 * MS, 1000 * MS, 0.0)
        .unwrap()
        .with_attempt_timeout(Duration::ZERO);
    let policies = tonic_retry::MethodPolicies::with_default(RetryPolicy::default())
        .with_method("library.v1.Library", "Slow", slow)
        .unwrap();
    // Room for one 8-byte copy, not two.
    let layer = RetryLayer::new(policies, budget()).with_replay_memory(12);
    let (inner, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let mut svc: Svc = layer.layer(inner);

    // A: sent nothing; in its first backoff.
    let mut a_req = request_of(8);
    *a_req.uri_mut() = "http://library/library.v1.Library/Slow".parse().unwrap();
    let a = spawn_call(&mut svc, a_req).await;
    settle().await;
    assert!(!a.is_finished(), "A waits out its backoff");
    let held_by_a = layer.replay_memory_in_use();

    // B is sent, its body read, and fails once.
    let (b, b_retried) = a_call_failing_once(&mut svc, &mut handle).await;
    let too_large = layer.metrics().body_too_large();
    a.abort();
    b.abort();
    assert_eq!(
        (held_by_a, b_retried, too_large),
        (0, true, 0),
        "(replay memory held by a call that sent nothing, the sent call retried, body_too_large)"
    );
}

/// With a deadline: the attempt's timer is made when the call is first
/// polled, on the runtime, not where the call was made.
#[test]
fn a_call_with_a_deadline_made_outside_a_runtime_is_sent_on_it() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (mut svc, mut handle, _layer) = setup(RetryPolicy::default(), budget());
    let req = with_timeout(request(), "10S");
    let ready = svc.ready().now_or_never().unwrap().unwrap();
    let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ready.call(req)));
    let future = made.expect("RetryService::call panicked outside a runtime");
    rt.block_on(async move {
        let call = tokio::spawn(future);
        let (r, send, _) = next(&mut handle).await;
        assert_eq!(r.into_body().collect().await.unwrap().to_bytes().len(), 10);
        send.send_response(ok());
        assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
    });
}

/// A body whose one message takes `work` to make, on the thread that polls it
/// (as tonic's client encodes its message when its body is first polled).
struct SlowToEncode {
    work: Duration,
    done: bool,
}

impl http_body::Body for SlowToEncode {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if std::mem::replace(&mut self.done, true) {
            return Poll::Ready(None);
        }
        std::thread::sleep(self.work);
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"\0\0\0\0\x01x")))))
    }
}

/// A call with a deadline of `total` whose body takes `work` to read: when its
/// first attempt was sent, if it was, counted from just before `call`, with the
/// `grpc-timeout` it carried; and the code the caller read.
async fn a_call_slow_to_encode(
    total: Duration,
    work: Duration,
) -> (Option<(Duration, Duration)>, Code) {
    let sent = std::sync::Arc::new(std::sync::Mutex::new(None));
    let seen = std::sync::Arc::clone(&sent);
    let before = tokio::time::Instant::now();
    let inner = tower::service_fn(move |req: Request<Body>| {
        let header = req.headers()["grpc-timeout"].to_str().unwrap().to_owned();
        *seen.lock().unwrap() = Some((before.elapsed(), parse_timeout(&header)));
        async { Ok::<_, tower::BoxError>(answer(Code::Ok)) }
    });
    let policy = RetryPolicy::default().with_total_timeout(total);
    let mut svc = RetryLayer::new(policy, budget()).layer(inner);
    let mut req = request();
    *req.body_mut() = Body::new(SlowToEncode { work, done: false });
    let response = svc.ready().await.unwrap().call(req).await.unwrap();
    let code = read_to_end(response).await;
    let sent = *sent.lock().unwrap();
    (sent, code)
}

// NOTE: these wait in real time, for a few tens of milliseconds: the time is
// spent inside a body's poll, on the calling thread, which tokio's paused
// clock cannot stand for.
#[tokio::test]
async fn a_body_slow_to_read_at_once_is_time_the_deadline_counts() {
    let work = Duration::from_millis(30);
    // Time left when the body is read: the first attempt says what is left.
    let total = Duration::from_secs(10);
    let (sent, code) = a_call_slow_to_encode(total, work).await;
    let (at, header) = sent.expect("the first attempt is sent");
    assert!(at >= work);
    // Half the work as margin: a sleep and tokio's clock need not agree to
    // the nanosecond on every platform. Sent without the work counted, it
    // would say the whole 10 s.
    assert!(
        header <= total - work / 2,
        "sent {at:?} into the call with grpc-timeout {header:?}"
    );
    assert_eq!(code, Code::Ok);

    // None left: the attempt is not sent, and the caller reads the deadline.
    let (sent, code) = a_call_slow_to_encode(Duration::from_millis(5), work).await;
    assert_eq!(sent, None, "an attempt sent after the call's deadline");
    assert_eq!(code, Code::DeadlineExceeded);
}
