//! The response body type of [`RetryService`](crate::RetryService).

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{HeaderMap, HeaderValue};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

use crate::classify::{repair_status_details, status_in};
use crate::deadline::timer_at;
use crate::status::{GRPC_MESSAGE, GRPC_STATUS, GRPC_STATUS_DETAILS, code_as_tonic_reads};
use crate::trace::{AttemptRecord, AttemptTrace, Metrics, NoMetrics};
use tonic::Code;
use tower::BoxError;

pin_project! {
    /// The inner service's response body, passed through frame by frame, or the
    /// empty body of a status the layer answered itself.
    ///
    /// Data frames are untouched. Trailers get one repair: a
    /// `grpc-status-details-bin` trailer that is not valid base64 is dropped
    /// (with a warning), because tonic's client would panic decoding it.
    ///
    /// The call's deadline holds for the body too: a response still streaming
    /// when it passes (a server stream, a stalled body) ends there with
    /// `DEADLINE_EXCEEDED` trailers, as grpc-go and grpc-java end such a call,
    /// and the inner body is dropped, which cancels its HTTP/2 stream. It ends
    /// there even if the rest of it had already arrived and waits unread: the
    /// layer cannot tell when a buffered frame arrived, and a body that is
    /// always ready must not outlive its deadline. The body of a Trailers-Only
    /// response (its status in its headers, which arrived in time) ends there
    /// too, but with no trailers: the status the server sent stands.
    ///
    /// The server got the deadline as `grpc-timeout`, and a server whose
    /// timer runs out mid-stream ends it with `CANCELLED` or resets it. Once
    /// the deadline has passed, either end reaches the caller as
    /// `DEADLINE_EXCEEDED` trailers: the caller cancelled nothing.
    ///
    /// A call whose response was committed is a success only if it ends with
    /// `OK`: the layer's budget is credited when the trailers say so, not
    /// when the headers arrive (a stream cut, failed or dropped unread
    /// credits nothing), as grpc-go counts a success when the call finishes.
    ///
    /// `M` is what records the call's standard metrics: see
    /// [`RetryLayer`](crate::RetryLayer).
    #[derive(Debug)]
    pub struct ResponseBody<RB, M = NoMetrics>
    where
        M: Metrics,
    {
        #[pin]
        inner: Option<RB>,
        // The call's deadline, while the body is still open.
        deadline: Option<Instant>,
        // Armed the first time the inner body has nothing ready, so a body
        // that is always ready costs no timer. Boxed to keep the body `Unpin`
        // whenever the inner one is.
        timer: Option<Pin<Box<Sleep>>>,
        // Credited if the trailers end the call with `OK`.
        on_ok: Option<OnOk>,
        // The response is Trailers-Only: its status is in its headers, and a
        // deadline that passes while its body is read adds none (see
        // `deadline_trailers`).
        status_in_headers: bool,
        // The metrics of the attempt (and call) this body ends.
        traced: AttemptTrace<M>,
    }
}

/// What a call that ends with `OK` is credited to: the layer's budget.
pub(crate) trait Credit: Send + Sync {
    /// `paid`: the call succeeded on a retry (or hedge) the budget paid for.
    fn credit(&self, paid: bool);
}

/// A [`Credit`] waiting for the trailers, and whether the attempt was paid for.
struct OnOk(Arc<dyn Credit>, bool);

impl fmt::Debug for OnOk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OnOk")
    }
}

impl<B, M: Metrics> ResponseBody<B, M> {
    /// The body of a response whose status is in its headers if
    /// `status_in_headers`, read under the call's `deadline`.
    pub(crate) fn new(inner: B, deadline: Option<Instant>, status_in_headers: bool) -> Self {
        Self {
            inner: Some(inner),
            deadline,
            timer: None,
            on_ok: None,
            status_in_headers,
            traced: AttemptTrace::<M>::NONE,
        }
    }

    /// Ends `traced` when the body ends.
    pub(crate) fn trace(&mut self, traced: AttemptTrace<M>) {
        self.traced = traced;
    }

    /// The caller reads this body: the attempt's end, when it ends, is the
    /// call's. Whether it carries an attempt's metrics still open.
    pub(crate) fn ends_call(&mut self) -> bool {
        self.traced.ends_call()
    }

    /// Credits `credit` once, if the body's trailers end the call with `OK`;
    /// `paid` if the attempt was a retry (or hedge) the budget paid for.
    pub(crate) fn credit_on_ok(&mut self, credit: Arc<dyn Credit>, paid: bool) {
        self.on_ok = Some(OnOk(credit, paid));
    }

    /// An empty body, as sent with a status the layer answered itself.
    pub const fn empty() -> Self {
        Self {
            inner: None,
            deadline: None,
            timer: None,
            on_ok: None,
            status_in_headers: true,
            traced: AttemptTrace::<M>::NONE,
        }
    }

    /// The inner service's body, or `None` for a status the layer answered.
    ///
    /// What the layer does for the body ends here: it is no longer cut at the
    /// call's deadline, an `OK` in its trailers refills no budget, and the
    /// call's standard metrics (feature `opentelemetry`) end now, as
    /// `CANCELLED`. Read the body through this type to keep them.
    pub fn into_inner(self) -> Option<B> {
        self.inner
    }
}

impl<B, M: Metrics> Default for ResponseBody<B, M> {
    fn default() -> Self {
        Self::empty()
    }
}

/// The trailers that end a body whose time ran out: at the call's deadline,
/// whether the layer or the server ended it.
fn timed_out_trailers(message: &'static str) -> HeaderMap {
    let mut trailers = HeaderMap::with_capacity(2);
    trailers.insert(GRPC_STATUS, HeaderValue::from_static("4"));
    trailers.insert(GRPC_MESSAGE, HeaderValue::from_static(message));
    trailers
}

const DEADLINE_PASSED: &str = "call deadline exceeded while receiving the response";

/// The trailers a body ends with once the call's deadline has passed:
/// `DEADLINE_EXCEEDED`, or none for a Trailers-Only response, whose status
/// (in its headers, which arrived in time) stands.
fn deadline_trailers(status_in_headers: bool) -> Option<HeaderMap> {
    (!status_in_headers).then(|| timed_out_trailers(DEADLINE_PASSED))
}
/// The code trailers end the call with, as tonic's client reads it (`None`
/// without `grpc-status`), and whether they carry status details. One pass:
/// trailers hold a handful of entries, where a lookup would hash each name.
fn read_trailers(trailers: &HeaderMap) -> (Option<Code>, bool) {
    let (mut status, mut message, mut details) = (None, None, false);
    for (name, value) in trailers {
        // Several values: tonic reads the first.
        if *name == GRPC_STATUS {
            status.get_or_insert(value);
        } else if *name == GRPC_MESSAGE {
            message.get_or_insert(value);
        } else if *name == GRPC_STATUS_DETAILS {
            details = true;
        }
    }
    let code = status.map(|v| code_as_tonic_reads(v, message));
    (code, details)
}

/// The code tonic's client reports for a body that failed with `error`: the
/// `Status` it is (the body error of tonic's `Channel`) or carries, else
/// `UNKNOWN`.
// NOTE: tonic reads a bare hyper or h2 error by its reason too; the layer
// does not depend on either, and tonic's `Channel` hands over a `Status`.
fn code_of_error(error: &(dyn Any + 'static)) -> Code {
    if let Some(status) = error.downcast_ref::<tonic::Status>() {
        return status.code();
    }
    if let Some(boxed) = error.downcast_ref::<BoxError>()
        && let Some(status) = status_in(&**boxed)
    {
        return status.code();
    }
    Code::Unknown
}

// NOTE: `B: 'static` (which every constructor of the layer's service asks
// already) lets a failed body's error be read for its metrics.
impl<B: Body + 'static, M: Metrics> Body for ResponseBody<B, M> {
    type Data = B::Data;
    type Error = B::Error;

    // NOTE: inlined whatever features are compiled: with `opentelemetry`
    // the caller grew past the inliner's limit and this went out of line,
    // a cost of its own on every call (`cargo bench --bench instructions_otel`).
    #[inline]
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let mut this = self.project();
        let Some(inner) = this.inner.as_mut().as_pin_mut() else {
            return Poll::Ready(None);
        };
        if let Some(deadline) = *this.deadline {
            // A body that is always ready is checked against the clock; once
            // it has had to wait, the timer says when the deadline passes.
            let passed = match this.timer.as_mut() {
                Some(timer) => timer.as_mut().poll(cx).is_ready(),
                None => Instant::now() >= deadline,
            };
            if passed {
                tracing::debug!("call deadline passed while receiving the response; ending it");
                // NOTE: dropping the inner body resets its HTTP/2 stream.
                this.inner.set(None);
                *this.timer = None;
                *this.deadline = None;
                *this.on_ok = None;
                let Some(trailers) = deadline_trailers(*this.status_in_headers) else {
                    return Poll::Ready(None);
                };
                this.traced.end(Code::DeadlineExceeded);
                return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
            }
        }
        let end = match inner.poll_frame(cx) {
            Poll::Pending => {
                if let Some(deadline) = *this.deadline
                    && this.timer.is_none()
                {
                    let timer = this.timer.insert(Box::pin(timer_at(deadline)));
                    if timer.as_mut().poll(cx).is_ready() {
                        // Passed while the body was being polled: be polled
                        // again at once, to end it.
                        cx.waker().wake_by_ref();
                    }
                }
                return Poll::Pending;
            }
            Poll::Ready(Some(Ok(frame))) => match frame.into_trailers() {
                Ok(trailers) => Some(Ok(trailers)),
                Err(data) => return Poll::Ready(Some(Ok(data))),
            },
            Poll::Ready(Some(Err(error))) => Some(Err(error)),
            Poll::Ready(None) => None,
        };
        // Trailers, an error or the end: the body is over, and its deadline
        // no longer applies.
        let deadline = this.deadline.take();
        *this.timer = None;
        let on_ok = this.on_ok.take();
        // The server ended the stream (CANCELLED, or a reset) once the
        // deadline had passed: its timer for the `grpc-timeout` we sent.
        let status_in_headers = *this.status_in_headers;
        let timed_out = || {
            let at = deadline?;
            (Instant::now() >= at).then_some(())?;
            deadline_trailers(status_in_headers)
        };
        let frame = match end {
            None => {
                // No trailers: tonic's client reads UNKNOWN.
                this.traced.end(Code::Unknown);
                return Poll::Ready(None);
            }
            Some(Err(error)) => match timed_out() {
                Some(trailers) => {
                    this.inner.set(None);
                    this.traced.end(Code::DeadlineExceeded);
                    Frame::trailers(trailers)
                }
                None => {
                    if this.traced.is_open() {
                        this.traced.end(code_of_error(&error));
                    }
                    return Poll::Ready(Some(Err(error)));
                }
            },
            Some(Ok(mut trailers)) => {
                let (code, details) = read_trailers(&trailers);
                match code {
                    Some(Code::Ok) => {
                        if let Some(OnOk(credit, paid)) = on_ok {
                            credit.credit(paid);
                        }
                    }
                    Some(Code::Cancelled) => {
                        if let Some(cut) = timed_out() {
                            trailers = cut;
                        }
                    }
                    _ => {}
                }
                if details {
                    repair_status_details(&mut trailers);
                }
                if this.traced.is_open() {
                    // What the caller reads, after the rewrite above.
                    let (code, _) = read_trailers(&trailers);
                    this.traced.end(code.unwrap_or(Code::Unknown));
                }
                Frame::trailers(trailers)
            }
        };
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(B::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), B::size_hint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::BodyExt;
    use std::time::Duration;

    #[tokio::test]
    async fn data_passes_and_bad_details_trailer_is_dropped() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", "14".parse().unwrap());
        trailers.insert("grpc-status-details-bin", "***".parse().unwrap());
        let inner = http_body_util::StreamBody::new(tokio_stream::iter([
            Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from_static(b"abc"))),
            Ok(Frame::trailers(trailers)),
        ]));
        let collected = ResponseBody::<_, NoMetrics>::new(inner, None, false)
            .collect()
            .await
            .unwrap();
        let trailers = collected.trailers().cloned().expect("trailers pass");
        assert_eq!(trailers["grpc-status"], "14");
        assert!(!trailers.contains_key("grpc-status-details-bin"));
        assert_eq!(collected.to_bytes(), "abc");
    }

    /// A body fed by hand.
    fn channel_body() -> (
        tokio::sync::mpsc::UnboundedSender<Result<Frame<Bytes>, std::convert::Infallible>>,
        impl Body<Data = Bytes, Error = std::convert::Infallible>,
    ) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let body = http_body_util::StreamBody::new(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
        );
        (tx, body)
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_body_ends_at_the_deadline_with_deadline_exceeded() {
        let (tx, inner) = channel_body();
        let start = Instant::now();
        let deadline = start + Duration::from_millis(300);
        let mut body = std::pin::pin!(ResponseBody::<_, NoMetrics>::new(
            inner,
            Some(deadline),
            false
        ));
        tx.send(Ok(Frame::data(Bytes::from_static(b"first"))))
            .unwrap();
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "first");
        // The server stalls; the deadline passes.
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(Instant::now(), deadline, "ended exactly at the deadline");
        let trailers = frame.into_trailers().expect("trailers end the cut body");
        assert_eq!(trailers["grpc-status"], "4");
        assert_eq!(
            tonic::Status::from_header_map(&trailers).unwrap().code(),
            tonic::Code::DeadlineExceeded
        );
        assert!(body.frame().await.is_none(), "nothing after the trailers");
        assert!(tx.is_closed(), "the inner body was dropped");
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_never_waits_is_still_cut_at_the_deadline() {
        // A server streaming without pause: the body is always ready.
        let inner =
            http_body_util::StreamBody::new(tokio_stream::iter(std::iter::repeat_with(|| {
                Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from_static(b"x")))
            })));
        let deadline = Instant::now() + Duration::from_millis(10);
        let mut body = std::pin::pin!(ResponseBody::<_, NoMetrics>::new(
            inner,
            Some(deadline),
            false
        ));
        let mut frames = 0;
        loop {
            let frame = body.frame().await.unwrap().unwrap();
            if frame.is_trailers() {
                assert_eq!(frame.into_trailers().unwrap()["grpc-status"], "4");
                break;
            }
            frames += 1;
            if frames % 100 == 0 {
                tokio::time::advance(Duration::from_millis(1)).await;
            }
            assert!(frames < 10_000, "the body was never cut");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_ends_in_time_is_untouched_and_its_timer_goes() {
        let (tx, inner) = channel_body();
        let deadline = Instant::now() + Duration::from_millis(300);
        let mut body = std::pin::pin!(ResponseBody::<_, NoMetrics>::new(
            inner,
            Some(deadline),
            false
        ));
        let reader = async {
            let mut got = Vec::new();
            while let Some(frame) = body.frame().await {
                got.push(frame.unwrap());
            }
            got
        };
        let writer = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            tx.send(Ok(Frame::data(Bytes::from_static(b"late but in time"))))
                .unwrap();
            let mut t = HeaderMap::new();
            t.insert("grpc-status", "0".parse().unwrap());
            tx.send(Ok(Frame::trailers(t))).unwrap();
            drop(tx);
        };
        let (got, ()) = tokio::join!(reader, writer);
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].trailers_ref().unwrap()["grpc-status"], "0");
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            body.frame().await.is_none(),
            "no deadline trailers after the end"
        );
    }

    #[test]
    fn trailers_read_as_tonic_reads_them() {
        let read = |pairs: &[(&'static str, &'static str)]| {
            let mut t = HeaderMap::new();
            for (k, v) in pairs {
                t.append(*k, HeaderValue::from_static(v));
            }
            let tonic_reads = tonic::Status::from_header_map(&t).map(|s| s.code());
            let (code, details) = read_trailers(&t);
            assert_eq!(code, tonic_reads, "{pairs:?}");
            (code, details)
        };
        assert_eq!(read(&[("grpc-status", "0")]), (Some(Code::Ok), false));
        assert_eq!(
            read(&[("grpc-status", "14")]),
            (Some(Code::Unavailable), false)
        );
        assert_eq!(read(&[("grpc-status", "00")]), (Some(Code::Unknown), false));
        assert_eq!(read(&[("grpc-message", "x")]), (None, false));
        assert_eq!(
            read(&[("grpc-status", "0"), ("grpc-status", "14")]),
            (Some(Code::Ok), false)
        );
        assert_eq!(
            read(&[("grpc-status-details-bin", "CAg="), ("grpc-status", "0")]),
            (Some(Code::Ok), true)
        );
        // A message tonic cannot decode makes the call UNKNOWN.
        assert_eq!(
            read(&[("grpc-status", "0"), ("grpc-message", "%FF")]),
            (Some(Code::Unknown), false)
        );
        assert_eq!(
            read(&[("grpc-status", "0"), ("grpc-message", "caf%C3%A9 %zz")]),
            (Some(Code::Ok), false)
        );
    }

    #[test]
    fn empty_is_empty() {
        let b = ResponseBody::<http_body_util::Full<Bytes>>::empty();
        assert!(b.is_end_stream());
        assert_eq!(b.size_hint().exact(), Some(0));
    }
}
