//! Abandoned attempts, read to their end instead of reset.
//!
//! Dropping an attempt whose HTTP/2 stream is still open resets the stream.
//! The server's answer, already on its way, then arrives on a stream the
//! client reset; h2 remembers only so many such streams (50, for a second),
//! and a frame on one it has forgotten counts against the connection for the
//! rest of its life (1,024, then GOAWAY `too_many_internal_resets`, failing
//! every call on it). A hedged call abandons attempts on every call, and a
//! per-attempt timeout under load abandons many: so the layer does not drop
//! them. An attempt the call no longer needs is handed to a task of its own
//! that reads it to its end and throws the answer away, so its stream ends
//! as streams do and nothing crosses a reset.
//!
//! Draining is bounded: by the call's deadline (which is also what the
//! server was sent), else [`DRAIN_TIME`]; by [`DRAIN_BYTES`] of response
//! body; and by [`MAX_DRAINING`] attempts at once per layer. Past a bound,
//! or with no tokio runtime to run the task on, the attempt is dropped and
//! its stream reset, as before. A call the *caller* drops is not drained:
//! its attempts are cancelled at once, as the caller asked, and so are those
//! of its attempts already being drained (cut by their own timeout).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http::Response;
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::metrics::{Event, RetryMetrics};
use crate::replay::DrainGuard;

/// The longest an attempt is drained when its call has no deadline.
pub(crate) const DRAIN_TIME: Duration = Duration::from_secs(10);

/// The most response body bytes read from one drained attempt.
pub(crate) const DRAIN_BYTES: usize = 64 * 1024;

/// The most attempts one layer drains at once.
pub(crate) const MAX_DRAINING: u64 = 1024;

/// Hands an abandoned attempt's future to a task that reads it to its end.
///
/// A function rather than a bound on the impls that call it: the bounds a
/// task needs (`Send + 'static`) are proven where the layer's service is
/// made, as for the error conversion (see `RetryService`).
pub(crate) type Drainer<F> = fn(Pin<Box<F>>, Drain);

/// How long, and on whose account, an abandoned attempt is drained.
pub(crate) struct Drain {
    /// The call's deadline, if it has one.
    pub(crate) deadline: Option<Instant>,
    pub(crate) metrics: RetryMetrics,
    /// Cancelled if the caller drops the call before it ends: the attempt is
    /// then dropped (reset) at once, as the call's other attempts are.
    pub(crate) cancel: Option<CancellationToken>,
    /// The attempt's request body, which it may read on while drained.
    pub(crate) body: Option<DrainGuard>,
}

/// The [`Drainer`] for services whose futures and response bodies can be
/// sent to a task.
pub(crate) fn spawn<F, RB, E>(future: Pin<Box<F>>, drain: Drain)
where
    F: Future<Output = Result<Response<RB>, E>> + Send + 'static,
    RB: Body + Send + 'static,
{
    let Drain {
        deadline,
        metrics,
        cancel,
        body,
    } = drain;
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        metrics.record(Event::DrainRefused);
        return;
    };
    if !metrics.start_drain(MAX_DRAINING) {
        metrics.record(Event::DrainRefused);
        return;
    }
    let cap = Instant::now().checked_add(DRAIN_TIME);
    let until = match (deadline, cap) {
        (Some(d), Some(c)) => d.min(c),
        (d, c) => d.or(c).unwrap_or_else(Instant::now),
    };
    runtime.spawn(Draining {
        future: Some(future),
        body: None,
        left: DRAIN_BYTES,
        timer: tokio::time::sleep_until(until),
        cancelled: cancel.map(CancellationToken::cancelled_owned),
        permit: Permit {
            metrics,
            ended: false,
        },
        _body: body,
    });
}

/// One drain in progress, counted until it ends.
struct Permit {
    metrics: RetryMetrics,
    /// Read to its end (rather than cut by a bound, or dropped with the
    /// runtime).
    ended: bool,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let event = if self.ended {
            Event::Drained
        } else {
            Event::DrainCut
        };
        self.metrics.record(event);
        self.metrics.end_drain();
    }
}

pin_project! {
    /// The task: the response, then its body, to the end or to a bound.
    struct Draining<F, RB> {
        future: Option<Pin<Box<F>>>,
        body: Option<Pin<Box<RB>>>,
        // Body bytes still allowed.
        left: usize,
        #[pin]
        timer: Sleep,
        // The caller dropped the call.
        #[pin]
        cancelled: Option<WaitForCancellationFutureOwned>,
        permit: Permit,
        // Lets the attempt's request body be read until the drain ends.
        _body: Option<DrainGuard>,
    }
}

impl<F, RB, E> Future for Draining<F, RB>
where
    F: Future<Output = Result<Response<RB>, E>>,
    RB: Body,
{
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.project();
        if this.timer.poll(cx).is_ready() {
            // Out of time: dropped, and so reset.
            return Poll::Ready(());
        }
        if let Some(cancelled) = this.cancelled.as_pin_mut()
            && cancelled.poll(cx).is_ready()
        {
            // The caller dropped the call: dropped, and so reset.
            return Poll::Ready(());
        }
        if let Some(future) = this.future.as_mut() {
            match ready!(future.as_mut().poll(cx)) {
                Ok(response) => *this.body = Some(Box::pin(response.into_body())),
                Err(_) => {
                    // The stream already ended (or never began).
                    this.permit.ended = true;
                    return Poll::Ready(());
                }
            }
            *this.future = None;
        }
        let Some(body) = this.body.as_mut() else {
            this.permit.ended = true;
            return Poll::Ready(());
        };
        loop {
            match ready!(body.as_mut().poll_frame(cx)) {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        let len = bytes::Buf::remaining(data);
                        let Some(left) = this.left.checked_sub(len) else {
                            // Too much to read: dropped, and so reset.
                            return Poll::Ready(());
                        };
                        *this.left = left;
                    }
                }
                // The end, or an error that ended the stream.
                None | Some(Err(_)) => {
                    this.permit.ended = true;
                    return Poll::Ready(());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use bytes::Bytes;
    use http_body_util::StreamBody;
    use std::convert::Infallible;
    use tokio::sync::mpsc;

    type Frames = StreamBody<
        tokio_stream::wrappers::ReceiverStream<Result<http_body::Frame<Bytes>, Infallible>>,
    >;

    fn body() -> (
        mpsc::Sender<Result<http_body::Frame<Bytes>, Infallible>>,
        Frames,
    ) {
        let (tx, rx) = mpsc::channel(8);
        (
            tx,
            StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)),
        )
    }

    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    /// Drains `future` for a call with `deadline`; the layer's counters.
    fn drained<F>(future: F, deadline: Option<Instant>) -> RetryMetrics
    where
        F: Future<Output = Result<Response<Frames>, ()>> + Send + 'static,
    {
        let metrics = RetryMetrics::default();
        let drain = Drain {
            deadline,
            metrics: metrics.clone(),
            cancel: None,
            body: None,
        };
        spawn(Box::pin(future), drain);
        metrics
    }

    fn never() -> std::future::Pending<Result<Response<Frames>, ()>> {
        std::future::pending()
    }

    #[tokio::test(start_paused = true)]
    async fn an_abandoned_attempt_is_read_to_its_end() {
        let (tx, rx) = tokio::sync::oneshot::channel::<Response<Frames>>();
        let metrics = drained(async { rx.await.map_err(drop) }, None);
        assert_eq!(metrics.draining(), 1);
        let (frames, body) = body();
        tx.send(Response::new(body)).unwrap();
        frames
            .send(Ok(http_body::Frame::data(Bytes::from_static(b"abc"))))
            .await
            .unwrap();
        settle().await;
        assert_eq!(metrics.draining(), 1, "still reading");
        drop(frames);
        settle().await;
        assert_eq!(
            (metrics.draining(), metrics.drained(), metrics.drain_cut()),
            (0, 1, 0)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_drain_ends_at_the_deadline() {
        let deadline = Instant::now() + Duration::from_millis(300);
        let metrics = drained(never(), Some(deadline));
        tokio::time::sleep(Duration::from_millis(299)).await;
        settle().await;
        assert_eq!(metrics.draining(), 1);
        tokio::time::sleep(Duration::from_millis(2)).await;
        settle().await;
        assert_eq!(
            (metrics.draining(), metrics.drained(), metrics.drain_cut()),
            (0, 0, 1)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_deadline_a_drain_ends_after_its_cap() {
        let metrics = drained(never(), None);
        tokio::time::sleep(DRAIN_TIME - Duration::from_millis(1)).await;
        settle().await;
        assert_eq!(metrics.draining(), 1);
        tokio::time::sleep(Duration::from_millis(2)).await;
        settle().await;
        assert_eq!((metrics.draining(), metrics.drain_cut()), (0, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_larger_than_the_cap_is_dropped() {
        let (frames, body) = body();
        let metrics = drained(async move { Ok(Response::new(body)) }, None);
        let big = Bytes::from(vec![0u8; DRAIN_BYTES]);
        frames.send(Ok(http_body::Frame::data(big))).await.unwrap();
        settle().await;
        assert_eq!(metrics.draining(), 1, "exactly the cap is read");
        // One byte more is too much: the rest is not waited for.
        let one_more = Ok(http_body::Frame::data(Bytes::from_static(b"x")));
        frames.send(one_more).await.unwrap();
        settle().await;
        assert_eq!((metrics.draining(), metrics.drain_cut()), (0, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn no_more_than_the_limit_drain_at_once() {
        let metrics = RetryMetrics::default();
        for _ in 0..MAX_DRAINING + 3 {
            let drain = Drain {
                deadline: None,
                metrics: metrics.clone(),
                cancel: None,
                body: None,
            };
            spawn(Box::pin(never()), drain);
        }
        assert_eq!(metrics.draining(), MAX_DRAINING);
        assert_eq!(metrics.drain_refused(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_drain_ends_when_its_call_is_cancelled() {
        let metrics = RetryMetrics::default();
        let cancel = CancellationToken::new();
        let drain = Drain {
            deadline: None,
            metrics: metrics.clone(),
            cancel: Some(cancel.clone()),
            body: None,
        };
        spawn(Box::pin(never()), drain);
        settle().await;
        assert_eq!(metrics.draining(), 1);
        cancel.cancel();
        settle().await;
        assert_eq!((metrics.draining(), metrics.drain_cut()), (0, 1));
    }

    #[test]
    fn with_no_runtime_the_attempt_is_dropped() {
        let metrics = drained(never(), None);
        assert_eq!((metrics.draining(), metrics.drain_refused()), (0, 1));
    }
}
