//! Future types

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use crate::budget::Budget;
use http::{Request, Response, request};
use pin_project_lite::pin_project;
use tokio_util::sync::DropGuard;
use tower_service::Service;

use crate::attempt::{Attempt, AttemptFuture};
use crate::body::ResponseBody;
use crate::budget::RetryBudget;
use crate::call::{Backoff, CallRetry, failure_response};
use crate::first::{FirstCopy, FirstTimeout};
use crate::replay::ReplayBody;
use crate::trace::{CallEnd, Metrics, NoMetrics};

type Retrying<S, B, Bu, M> = tower::retry::future::ResponseFuture<
    CallRetry<Bu, M>,
    Attempt<S, B, Bu, M>,
    Request<ReplayBody<B>>,
>;

/// What a retry of the call needs once its first attempt has failed: the
/// copy of its request, its policy and its attempts' service.
struct Retry<S, B, Bu, M>
where
    S: Service<Request<B>>,
    M: Metrics,
{
    copy: FirstCopy<B>,
    call: CallRetry<Bu, M>,
    attempt: Attempt<S, B, Bu, M>,
}

pin_project! {
    #[project = StepProj]
    enum Step<S, B, RB, Bu, M>
    where
        S: Service<Request<B>, Response = Response<RB>>,
        S: Clone,
        B: From<ReplayBody<B>>,
        B: Send,
        B: 'static,
        Bu: Budget,
        M: Metrics,
    {
        /// The first attempt, which the layer sends itself; `retry`, if
        /// the call can be retried.
        First {
            #[pin]
            future: AttemptFuture<S, B, Bu, M>,
            retry: Option<Retry<S, B, Bu, M>>,
        },
        /// The wait before the first retry.
        Waiting {
            #[pin]
            backoff: Backoff,
            retry: Option<Retry<S, B, Bu, M>>,
        },
        /// The retries, in tower's `Retry`.
        Retrying {
            #[pin]
            future: Retrying<S, B, Bu, M>,
        },
    }
}

pin_project! {
    /// Response future of [`RetryService`](crate::RetryService).
    ///
    /// Dropping it cancels the attempt in flight, or the backoff wait between
    /// attempts, and ends the drains of attempts cut by their own timeout;
    /// nothing is left running.
    // NOTE: the bounds are those the type of `step` needs (tower's retry
    // future names its service's future); none is on `S::Error`, so a call
    // can be spawned whatever the inner service's error type.
    pub struct ResponseFuture<
        S,
        Bu = RetryBudget,
        B = tonic::body::Body,
        RB = tonic::body::Body,
        M = NoMetrics,
    >
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
        step: Step<S, B, RB, Bu, M>,
        // The call's end, for its metrics.
        end: CallEnd<M>,
        // Cancels the drains of the call's abandoned attempts if it is
        // dropped before its answer.
        cancel: Option<DropGuard>,
        _error: PhantomData<fn() -> S::Error>,
    }
}

#[cfg(test)]
impl<S, B, RB, Bu, M> ResponseFuture<S, Bu, B, RB, M>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    B: From<ReplayBody<B>> + Send + 'static,
    Bu: Budget,
    M: Metrics,
{
    /// A hedged call's driver, for its steps' unit tests.
    pub(crate) fn hedge_driver(
        self: Pin<&mut Self>,
    ) -> Option<&mut crate::hedge::HedgeFuture<S, B, Bu, M>> {
        match self.project().step.project() {
            StepProj::First { future, .. } => future.hedge_driver(),
            _ => None,
        }
    }
}

impl<S, B, RB, Bu, M> ResponseFuture<S, Bu, B, RB, M>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    B: From<ReplayBody<B>> + Send + 'static,
    Bu: Budget,
    M: Metrics,
{
    /// The call of the request of `head` and `body`: its first attempt sent
    /// now through `attempt` on `readied`, the instance the caller polled,
    /// and its retries, if `call` asks for them, through tower's `Retry`.
    /// `timeout`: what the first attempt may say its time is; `retimed`: the
    /// caller sent a `grpc-timeout` and the call has a deadline.
    // NOTE: what tower's `Retry::call` does for the first attempt (keep a
    // copy, send the request), without building a `Retry` to clone into the
    // future and drop: a call that succeeds at once never needs one. The
    // retry loop is tower's, from the first retry on, fed the same policy,
    // service and copy its `call` would have kept.
    #[inline(always)]
    pub(crate) fn new(
        call: CallRetry<Bu, M>,
        mut attempt: Attempt<S, B, Bu, M>,
        readied: &mut S,
        (head, body): (request::Parts, ReplayBody<B>),
        (timeout, retimed): (Option<FirstTimeout>, bool),
        end: CallEnd<M>,
        cancel: Option<DropGuard>,
    ) -> Self {
        let copy = call.first_copy(&head, &body, retimed);
        let future = attempt.call_first(readied, head, body, timeout);
        let retry = copy.map(|copy| Retry {
            copy,
            call,
            attempt,
        });
        Self {
            step: Step::First { future, retry },
            end,
            cancel,
            _error: PhantomData,
        }
    }
}

impl<S, B, RB, Bu, M> Future for ResponseFuture<S, Bu, B, RB, M>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    B: From<ReplayBody<B>> + Send + 'static,
    Bu: Budget,
    M: Metrics,
{
    type Output = Result<Response<ResponseBody<RB, M>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // NOTE: the call policy turns every failure into a status response
        // before the caller is handed it; the mapping below only makes that
        // total.
        let mut this = self.project();
        let result = loop {
            match this.step.as_mut().project() {
                StepProj::First { future, retry } => {
                    let mut result = ready!(future.poll(cx));
                    let backoff = match retry.as_mut() {
                        Some(r) => r.call.after(&mut r.copy, &mut result),
                        None => None,
                    };
                    let Some(backoff) = backoff else {
                        // The answer: handed over from here, as most calls'
                        // first attempt's is (one move of it fewer).
                        return Poll::Ready(Ok(finish(result, this.end, this.cancel)));
                    };
                    let retry = retry.take();
                    this.step.set(Step::Waiting { backoff, retry });
                }
                StepProj::Waiting { backoff, retry } => {
                    ready!(backoff.poll(cx));
                    let Some(Retry {
                        copy,
                        call,
                        attempt,
                    }) = retry.take()
                    else {
                        panic!("a call was polled after it completed");
                    };
                    // As tower's own loop does after a wait: the attempts'
                    // service is always ready, and the retry goes out now.
                    let copy = copy.into_request();
                    let future = tower::retry::Retry::new(call, attempt).call(copy);
                    this.step.set(Step::Retrying { future });
                }
                StepProj::Retrying { future } => break ready!(future.poll(cx)),
            }
        };
        Poll::Ready(Ok(finish(result, this.end, this.cancel)))
    }
}

/// The call's answer, from its last attempt's `result`.
#[inline(always)]
fn finish<RB, M: Metrics>(
    result: Result<Response<ResponseBody<RB, M>>, crate::attempt::Failure>,
    end: &mut CallEnd<M>,
    cancel: &mut Option<DropGuard>,
) -> Response<ResponseBody<RB, M>> {
    let mut response = match result {
        Ok(response) => response,
        Err(failure) => failure_response(&failure, 1),
    };
    end.ready(&mut response);
    // The call has its answer: attempts it abandoned drain to their end.
    if let Some(cancel) = cancel.take() {
        cancel.disarm();
    }
    response
}

impl<S, B, RB, Bu, M> std::fmt::Debug for ResponseFuture<S, Bu, B, RB, M>
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
