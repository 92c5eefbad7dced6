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
        pub(crate) fn ends_call(&mut self) -> bool {
            false
        }

        #[inline(always)]
        pub(crate) fn is_on(&self) -> bool {
            false
        }
    }
}

use crate::body::ResponseBody;

/// The end of a call its response future is waiting for: `CANCELLED` if
/// the future is dropped first; otherwise its response's (a status answer
/// ends the call at once, a streamed one when its body ends).
#[derive(Default)]
pub(crate) struct CallEnd(Option<Trace>);

impl CallEnd {
    pub(crate) fn new(trace: Trace) -> Self {
        Self(trace.is_on().then_some(trace))
    }

    /// The response future is ready with `response`, which the caller gets:
    /// the call ends now if its headers say how, else when its body ends.
    pub(crate) fn ready<B>(&mut self, response: &mut http::Response<ResponseBody<B>>) {
        if let Some(trace) = self.0.take() {
            let code = crate::status::code_at_headers(response.status(), response.headers());
            match code {
                Some(code) => trace.end(code),
                None => {
                    if !response.body_mut().ends_call() {
                        // No attempt's metrics in the body: nothing else
                        // would end the call.
                        trace.end(tonic::Code::Unknown);
                    }
                }
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
