//! Where a call's standard metrics are recorded: by [`crate::otel`] with
//! feature `opentelemetry`; without it, by types of no size whose every
//! method does nothing, so the call path is the same code either way.

#[cfg(feature = "opentelemetry")]
pub(crate) use crate::otel::{AttemptTrace, Trace};

#[cfg(not(feature = "opentelemetry"))]
pub(crate) use off::{AttemptTrace, Trace};

#[cfg(not(feature = "opentelemetry"))]
mod off {
    use tonic::Code;

    #[derive(Clone, Default)]
    pub(crate) struct Trace;

    impl Trace {
        #[inline(always)]
        pub(crate) fn none() -> Self {
            Trace
        }

        #[inline(always)]
        pub(crate) fn attempt(&self) -> AttemptTrace {
            AttemptTrace
        }

        #[inline(always)]
        pub(crate) fn retry(&self) {}

        #[inline(always)]
        pub(crate) fn hedge(&self) {}

        #[inline(always)]
        pub(crate) fn end(&self, _code: Code) {}

        #[inline(always)]
        pub(crate) fn is_on(&self) -> bool {
            false
        }
    }

    #[derive(Debug, Default)]
    pub(crate) struct AttemptTrace;

    impl AttemptTrace {
        pub(crate) const NONE: Self = AttemptTrace;

        #[inline(always)]
        pub(crate) fn end(&mut self, _code: Code) {}

        #[inline(always)]
        pub(crate) fn no_response(&mut self) {}

        #[inline(always)]
        pub(crate) fn into_call_end(self) -> Self {
            self
        }

        #[inline(always)]
        pub(crate) fn is_on(&self) -> bool {
            false
        }
    }
}

/// The end of a call its response future is waiting for: `CANCELLED` if
/// the future is dropped first; otherwise its response's (a status answer
/// ends the call at once, a streamed one when its body ends).
#[derive(Default)]
pub(crate) struct CallEnd(Option<Trace>);

impl CallEnd {
    pub(crate) fn new(trace: Trace) -> Self {
        Self(trace.is_on().then_some(trace))
    }

    /// The response future is ready with `response`.
    pub(crate) fn ready<B>(&mut self, response: &http::Response<B>) {
        if let Some(trace) = self.0.take() {
            let headers = response.headers();
            if let Some(status) = headers.get(crate::status::GRPC_STATUS) {
                let message = headers.get(crate::status::GRPC_MESSAGE);
                trace.end(crate::status::code_as_tonic_reads(status, message));
            }
        }
    }
}

impl Drop for CallEnd {
    fn drop(&mut self) {
        if let Some(trace) = self.0.take() {
            trace.end(tonic::Code::Cancelled);
        }
    }
}
