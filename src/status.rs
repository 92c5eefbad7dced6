//! gRPC status on the wire: the header names the layer reads and writes, and
//! the Trailers-Only responses it answers with when it ends a call itself.

use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use tonic::Code;

pub(crate) const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
pub(crate) const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
pub(crate) const GRPC_STATUS_DETAILS: HeaderName =
    HeaderName::from_static("grpc-status-details-bin");
/// `grpc-retry-pushback-ms`, as a `&str` for tonic's metadata map.
pub(crate) const RETRY_PUSHBACK: &str = "grpc-retry-pushback-ms";
pub(crate) const GRPC_RETRY_PUSHBACK: HeaderName = HeaderName::from_static(RETRY_PUSHBACK);

/// The headers a response's gRPC status is read from, each its first value,
/// found in one pass.
// NOTE: a lookup of a custom header name (`grpc-status`) hashes it byte by
// byte, which costs more than comparing the few headers a response has.
#[derive(Clone, Copy)]
pub(crate) struct StatusHeaders<'a> {
    pub(crate) status: Option<&'a HeaderValue>,
    pub(crate) message: Option<&'a HeaderValue>,
    pub(crate) content_type: Option<&'a HeaderValue>,
}

impl<'a> StatusHeaders<'a> {
    #[inline]
    pub(crate) fn of(headers: &'a HeaderMap) -> Self {
        let (mut status, mut message, mut content_type) = (None, None, None);
        for (name, value) in headers {
            if name == GRPC_STATUS {
                status = status.or(Some(value));
            } else if name == GRPC_MESSAGE {
                message = message.or(Some(value));
            } else if name == CONTENT_TYPE {
                content_type = content_type.or(Some(value));
            }
        }
        Self {
            status,
            message,
            content_type,
        }
    }
}

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

/// The gRPC code for an HTTP response that carries no `grpc-status`, as gRPC
/// clients map it (tonic's client among them, when the body ends).
pub(crate) fn code_for_http_status(status: StatusCode) -> Code {
    match status.as_u16() {
        400 => Code::Internal,
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        404 => Code::Unimplemented,
        429 | 502 | 503 | 504 => Code::Unavailable,
        _ => Code::Unknown,
    }
}

/// The code a response ends with as its headers already say: its
/// `grpc-status` (a Trailers-Only answer) as tonic's client reads it, or, with
/// none, the code an HTTP error or a page that is not gRPC maps to (the
/// layer hands such an answer up as that status, see [`as_grpc_status`]).
/// `None` for a gRPC response whose body's trailers will say.
#[cfg_attr(not(feature = "opentelemetry"), allow(dead_code))]
pub(crate) fn code_at_headers(status: StatusCode, headers: &HeaderMap) -> Option<Code> {
    let found = StatusHeaders::of(headers);
    match found.status {
        Some(code) => Some(code_as_tonic_reads(code, found.message)),
        None if status != StatusCode::OK => Some(code_for_http_status(status)),
        None if crate::classify::is_grpc(found.content_type) => None,
        None => Some(Code::Unknown),
    }
}

/// A response with no `grpc-status` that the caller is given as the end of
/// its call (an HTTP error, or a page that is not gRPC: a proxy's answer,
/// never committed) becomes the Trailers-Only status `code` it maps to.
/// Handed up as it is, tonic's client would read its body as gRPC messages
/// and report `INTERNAL` whatever the HTTP status said. Its other
/// headers are kept: a "do not retry" mark, an instance's id.
pub(crate) fn as_grpc_status<B: Default>(response: &mut Response<B>, code: Code) {
    if response.headers().contains_key(GRPC_STATUS) {
        return;
    }
    let message = match response.headers().get(http::header::CONTENT_TYPE) {
        Some(kind) => format!(
            "the server answered HTTP {} ({}) with no gRPC status",
            response.status(),
            String::from_utf8_lossy(kind.as_bytes())
        ),
        None => format!(
            "the server answered HTTP {} with no gRPC status",
            response.status()
        ),
    };
    let headers = std::mem::take(response.headers_mut());
    *response = status_response(code, message);
    // NOTE: a header map's iterator names each value's header only at the
    // first of its values.
    // What described the page, or a status that is not one.
    let replaced = [
        http::header::CONTENT_TYPE,
        http::header::CONTENT_LENGTH,
        GRPC_MESSAGE,
        GRPC_STATUS_DETAILS,
    ];
    let mut name = None;
    for (next, value) in headers {
        if next.is_some() {
            name = next;
        }
        let Some(name) = &name else { continue };
        if !replaced.contains(name) {
            response.headers_mut().append(name.clone(), value);
        }
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
