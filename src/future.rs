//! Future types

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use crate::budget::Budget;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio_util::sync::DropGuard;
use tower_service::Service;

use crate::attempt::Attempt;
use crate::body::ResponseBody;
use crate::budget::RetryBudget;
use crate::call::{CallPolicy, failure_response};
use crate::replay::ReplayBody;
use crate::trace::{CallEnd, Metrics, NoMetrics};

type Retrying<S, B, Bu, M> = tower::retry::future::ResponseFuture<
    CallPolicy<Bu, M>,
    Attempt<S, B, Bu, M>,
    Request<ReplayBody<B>>,
>;

pin_project! {
    /// Response future of [`RetryService`](crate::RetryService).
    ///
    /// Dropping it cancels the attempt in flight, or the backoff wait between
    /// attempts, and ends the drains of attempts cut by their own timeout;
    /// nothing is left running.
    // NOTE: the bounds are those the type of `inner` needs (tower's retry
    // future names its service's future); none is on `S::Error`, so a call
    // can be spawned whatever the inner service's error type.
    pub struct ResponseFuture<S, B, RB, Bu = RetryBudget, M = NoMetrics>
    where
        S: Service<Request<B>, Response = Response<RB>>,
        S: Clone,
        B: From<ReplayBody<B>>,
        B: Send,
        B: 'static,
        Bu: Budget,
        M: Metrics,
    {
        #[pin]
        inner: Retrying<S, B, Bu, M>,
        // The call's end, for its metrics.
        end: CallEnd<M>,
        // Cancels the drains of the call's abandoned attempts if it is
        // dropped before its answer.
        cancel: Option<DropGuard>,
        _error: PhantomData<fn() -> S::Error>,
    }
}

impl<S, B, RB, Bu, M> ResponseFuture<S, B, RB, Bu, M>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    B: From<ReplayBody<B>> + Send + 'static,
    Bu: Budget,
    M: Metrics,
{
    pub(crate) fn new(
        inner: Retrying<S, B, Bu, M>,
        end: CallEnd<M>,
        cancel: Option<DropGuard>,
    ) -> Self {
        Self {
            inner,
            end,
            cancel,
            _error: PhantomData,
        }
    }
}

impl<S, B, RB, Bu, M> Future for ResponseFuture<S, B, RB, Bu, M>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    B: From<ReplayBody<B>> + Send + 'static,
    Bu: Budget,
    M: Metrics,
{
    type Output = Result<Response<ResponseBody<RB, M>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // NOTE: the call policy turns every failure into a status response
        // before `Retry` hands it over; the mapping below only makes that total.
        let this = self.project();
        let mut response = match ready!(this.inner.poll(cx)) {
            Ok(response) => response,
            Err(failure) => failure_response(&failure, 1),
        };
        this.end.ready(&mut response);
        // The call has its answer: attempts it abandoned drain to their end.
        if let Some(cancel) = this.cancel.take() {
            cancel.disarm();
        }
        Poll::Ready(Ok(response))
    }
}

impl<S, B, RB, Bu, M> std::fmt::Debug for ResponseFuture<S, B, RB, Bu, M>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    B: From<ReplayBody<B>> + Send + 'static,
    Bu: Budget,
    M: Metrics,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
