//! Where a call's standard metrics are recorded: a layer's type says by what.
//!
//! A layer records nothing unless it was given gRPC's standard metrics
//! (`RetryLayer::with_grpc_metrics`, feature `opentelemetry`), which changes
//! its type. The recorder is a type parameter of every call's types, not a
//! value checked at run time: with [`NoMetrics`], the default, every trace
//! is of no size and every step of it is nothing, so a layer without metrics
//! is the same code whether the feature is compiled or not.

use std::fmt;

use tonic::Code;

use crate::body::ResponseBody;

/// What records a layer's calls into gRPC's standard metrics: [`NoMetrics`],
/// the default, or (feature `opentelemetry`) `otel::Recorder`, which
/// `RetryLayer::with_grpc_metrics` gives a layer, or `Option<otel::Recorder>`
/// (`RetryLayer::with_optional_grpc_metrics`). Sealed: these are the only
/// ones.
pub trait Metrics: sealed::Record + Clone + fmt::Debug + Send + Sync + 'static {}

/// The default of a layer given no metrics: nothing is recorded, and nothing
/// is paid for it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoMetrics;

impl Metrics for NoMetrics {}

pub(crate) mod sealed {
    use std::fmt;

    use tonic::Code;

    use crate::metrics::Event;

    /// How a [`Metrics`](super::Metrics) records.
    pub trait Record {
        /// A call's trace.
        type Call: CallRecord<Attempt = Self::Attempt>;
        /// An attempt's trace, ended once: by its outcome, or `CANCELLED` when
        /// dropped first.
        type Attempt: AttemptRecord;

        /// The trace of a call to `path` starting now.
        fn call(&self, path: &str) -> Self::Call;

        /// The budget's balance may have moved: `tokens` reads it. `gauged`
        /// is what every recorder of the budget last set the gauge to.
        fn balance(&self, gauged: &Gauged, tokens: impl FnOnce() -> Option<f64>);

        /// The layer counted `event` (the standard metrics record the
        /// refused retries).
        fn record(&self, event: Event);
    }

    /// What the budget's gauge was last set to, by any recorder of the
    /// budget: a stamp of the balance and the series (the target) it was set
    /// in, 0 before the first.
    #[derive(Debug, Default)]
    pub struct Gauged(
        #[cfg_attr(not(feature = "opentelemetry"), allow(dead_code))]
        pub(crate)  std::sync::atomic::AtomicU64,
    );

    pub trait CallRecord: Clone + Send + Sync + 'static {
        /// Whether it records anything: a trace that does not is of no size,
        /// and every check of this is gone at compile time.
        const ON: bool;

        type Attempt;

        /// An attempt is sent now: counted, timed until it ends.
        fn attempt(&self) -> Self::Attempt;

        /// A retry the policy decided is being sent.
        fn retry(&self);

        /// A transparent retry is being sent: the attempt before it was
        /// refused by the server's HTTP/2 library.
        fn transparent_retry(&self);

        /// A hedge is being sent.
        fn hedge(&self);

        /// The call ends now with `code` (only its first end counts).
        fn end(&self, code: Code);
    }

    pub trait AttemptRecord: Default + fmt::Debug + Send + Sync + 'static {
        /// Not started (an attempt not sent yet, or a body with no attempt
        /// to end).
        const NONE: Self;

        /// Whether the attempt is open (started, not ended).
        fn is_open(&self) -> bool;

        /// The attempt ended with `code`.
        fn end(&mut self, code: Code);

        /// The attempt got no response at all: ends `UNAVAILABLE`.
        fn no_response(&mut self);

        /// The attempt's response goes to the caller: its end is the call's.
        /// Whether the attempt is still open, to end it.
        fn ends_call(&mut self) -> bool;
    }

    impl Record for super::NoMetrics {
        type Call = super::NoMetrics;
        type Attempt = super::NoMetrics;

        #[inline(always)]
        fn call(&self, _path: &str) -> Self::Call {
            super::NoMetrics
        }

        #[inline(always)]
        fn balance(&self, _gauged: &Gauged, _tokens: impl FnOnce() -> Option<f64>) {}

        #[inline(always)]
        fn record(&self, _event: Event) {}
    }

    impl CallRecord for super::NoMetrics {
        const ON: bool = false;
        type Attempt = super::NoMetrics;

        #[inline(always)]
        fn attempt(&self) -> Self::Attempt {
            super::NoMetrics
        }

        #[inline(always)]
        fn retry(&self) {}

        #[inline(always)]
        fn transparent_retry(&self) {}

        #[inline(always)]
        fn hedge(&self) {}

        #[inline(always)]
        fn end(&self, _code: Code) {}
    }

    impl AttemptRecord for super::NoMetrics {
        const NONE: Self = super::NoMetrics;

        #[inline(always)]
        fn is_open(&self) -> bool {
            false
        }

        #[inline(always)]
        fn end(&mut self, _code: Code) {}

        #[inline(always)]
        fn no_response(&mut self) {}

        #[inline(always)]
        fn ends_call(&mut self) -> bool {
            false
        }
    }
}

pub(crate) use sealed::{AttemptRecord, CallRecord, Gauged, Record};

/// A call's trace, as its layer records it.
pub(crate) type Trace<M> = <M as Record>::Call;

/// An attempt's trace, as its layer records it.
pub(crate) type AttemptTrace<M> = <M as Record>::Attempt;

/// The end of a call its response future is waiting for: `CANCELLED` if
/// the future is dropped first; otherwise its response's (a status answer
/// ends the call at once, a streamed one when its body ends).
pub(crate) struct CallEnd<M: Metrics>(Option<Trace<M>>);

impl<M: Metrics> CallEnd<M> {
    #[inline(always)]
    pub(crate) fn new(trace: Trace<M>) -> Self {
        Self(<Trace<M> as CallRecord>::ON.then_some(trace))
    }

    /// The response future is ready with `response`, which the caller gets:
    /// the call ends now if its headers say how, else when its body ends.
    #[inline(always)]
    pub(crate) fn ready<B>(&mut self, response: &mut http::Response<ResponseBody<B, M>>) {
        if <Trace<M> as CallRecord>::ON
            && let Some(trace) = self.0.take()
        {
            let code = crate::status::code_at_headers(response.status(), response.headers());
            match code {
                Some(code) => trace.end(code),
                None => {
                    if !response.body_mut().ends_call() {
                        // No attempt's metrics in the body: nothing else
                        // would end the call.
                        trace.end(Code::Unknown);
                    }
                }
            }
        }
    }
}

impl<M: Metrics> Drop for CallEnd<M> {
    #[inline(always)]
    fn drop(&mut self) {
        if <Trace<M> as CallRecord>::ON
            && let Some(trace) = self.0.take()
        {
            trace.end(Code::Cancelled);
        }
    }
}

impl<M: Metrics> fmt::Debug for CallEnd<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CallEnd")
    }
}
