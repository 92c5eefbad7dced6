//! Future types

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tonic::Code;
use tower::BoxError;
use tower::retry::budget::Budget;
use tower_service::Service;

use crate::attempt::{Attempt, CallPolicy, Cut, status_response};
use crate::body::ResponseBody;
use crate::budget::RetryBudget;
use crate::replay::ReplayBody;

type Retrying<S, B, Bu> =
    tower::retry::future::ResponseFuture<CallPolicy<Bu>, Attempt<S, B>, Request<ReplayBody<B>>>;

pin_project! {
    /// Response future of [`RetryService`](crate::RetryService).
    ///
    /// Dropping it cancels the attempt in flight, or the backoff wait between
    /// attempts; nothing is left running.
    pub struct ResponseFuture<S, B, RB, Bu = RetryBudget>
    where
        S: Service<Request<B>, Response = Response<RB>>,
        B: Body<Data = Bytes>,
        B: From<ReplayBody<B>>,
        B: Unpin,
        B::Error: Into<BoxError>,
        Bu: Budget,
        Bu: 'static,
    {
        #[pin]
        inner: Retrying<S, B, Bu>,
        _body: PhantomData<fn() -> RB>,
    }
}

impl<S, B, RB, Bu> ResponseFuture<S, B, RB, Bu>
where
    S: Service<Request<B>, Response = Response<RB>>,
    B: Body<Data = Bytes> + From<ReplayBody<B>> + Unpin,
    B::Error: Into<BoxError>,
    Bu: Budget + 'static,
{
    pub(crate) fn new(inner: Retrying<S, B, Bu>) -> Self {
        Self {
            inner,
            _body: PhantomData,
        }
    }
}

impl<S, B, RB, Bu> Future for ResponseFuture<S, B, RB, Bu>
where
    S: Service<Request<B>, Response = Response<RB>>,
    B: Body<Data = Bytes> + From<ReplayBody<B>> + Unpin,
    B::Error: Into<BoxError>,
    Bu: Budget + 'static,
{
    type Output = Result<Response<ResponseBody<RB>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().inner.poll(cx)
    }
}

impl<S, B, RB, Bu> std::fmt::Debug for ResponseFuture<S, B, RB, Bu>
where
    S: Service<Request<B>, Response = Response<RB>>,
    B: Body<Data = Bytes> + From<ReplayBody<B>> + Unpin,
    B::Error: Into<BoxError>,
    Bu: Budget + 'static,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

pin_project! {
    /// One attempt: the inner service's future, cut at the attempt's limit.
    pub(crate) struct AttemptFuture<F, RB> {
        #[pin]
        inner: Option<F>,
        #[pin]
        sleep: Option<Sleep>,
        cut: Option<Cut>,
        _body: PhantomData<fn() -> RB>,
    }
}

impl<F, RB> AttemptFuture<F, RB> {
    pub(crate) fn new(inner: F, cut: Option<(Instant, Cut)>) -> Self {
        Self {
            inner: Some(inner),
            sleep: cut.map(|(at, _)| tokio::time::sleep_until(at)),
            cut: cut.map(|(_, why)| why),
            _body: PhantomData,
        }
    }

    /// An attempt with no time left to be sent at all.
    pub(crate) fn cut(why: Cut) -> Self {
        Self {
            inner: None,
            sleep: None,
            cut: Some(why),
            _body: PhantomData,
        }
    }
}

impl<F, RB, E> Future for AttemptFuture<F, RB>
where
    F: Future<Output = Result<Response<RB>, E>>,
{
    type Output = Result<Response<ResponseBody<RB>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        if let Some(inner) = this.inner.as_mut().as_pin_mut() {
            if let Poll::Ready(result) = inner.poll(cx) {
                return Poll::Ready(result.map(|response| response.map(ResponseBody::new)));
            }
            if let Some(sleep) = this.sleep.as_pin_mut() {
                ready!(sleep.poll(cx));
            } else {
                return Poll::Pending;
            }
            // NOTE: the attempt is dropped here, which cancels its HTTP stream.
            this.inner.set(None);
        }
        let why = this.cut.unwrap_or(Cut::Deadline);
        Poll::Ready(Ok(status_response(Code::DeadlineExceeded, why.message())))
    }
}

pin_project! {
    /// The wait before a retry. No delay means no timer: a zero-length `Sleep`
    /// would still wait for the timer's next tick, about a millisecond.
    #[derive(Debug)]
    pub(crate) struct Backoff {
        #[pin]
        sleep: Option<Sleep>,
    }
}

impl Backoff {
    pub(crate) fn new(delay: std::time::Duration) -> Self {
        Self {
            sleep: (!delay.is_zero()).then(|| tokio::time::sleep(delay)),
        }
    }
}

impl Future for Backoff {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match self.project().sleep.as_pin_mut() {
            Some(sleep) => sleep.poll(cx),
            None => Poll::Ready(()),
        }
    }
}
