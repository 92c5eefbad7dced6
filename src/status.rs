//! gRPC status on the wire: the header names the layer reads and writes, and
//! the Trailers-Only responses it answers with when it ends a call itself.

use http::{HeaderName, HeaderValue, Response};
use tonic::Code;

pub(crate) const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
pub(crate) const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
pub(crate) const GRPC_STATUS_DETAILS: HeaderName =
    HeaderName::from_static("grpc-status-details-bin");
/// `grpc-retry-pushback-ms`, as a `&str` for tonic's metadata map.
pub(crate) const RETRY_PUSHBACK: &str = "grpc-retry-pushback-ms";
pub(crate) const GRPC_RETRY_PUSHBACK: HeaderName = HeaderName::from_static(RETRY_PUSHBACK);

/// A gRPC Trailers-Only response carrying a status the layer decided itself:
/// HTTP 200, `content-type: application/grpc`, `grpc-status`, `grpc-message`.
pub(crate) fn status_response<B: Default>(code: Code, message: impl Into<String>) -> Response<B> {
    tonic::Status::new(code, message).into_http()
}

/// The code tonic's client reports for a `grpc-status` and the first
/// `grpc-message` beside it, as `Status::from_header_map` reads them: the code
/// as `Code::from_bytes` reads it, but `UNKNOWN` whatever the code if the
/// message does not percent-decode to UTF-8.
pub(crate) fn code_as_tonic_reads(status: &HeaderValue, message: Option<&HeaderValue>) -> Code {
    let code = Code::from_bytes(status.as_bytes());
    match message {
        Some(message)
            if code != Code::Unknown
                && percent_encoding::percent_decode(message.as_bytes())
                    .decode_utf8()
                    .is_err() =>
        {
            Code::Unknown
        }
        _ => code,
    }
}

/// The canonical upper-case name of a code, as gRPC documents and logs it.
pub(crate) fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}
