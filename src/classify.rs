//! Reading one attempt's outcome: may the same request, sent again, get a
//! different answer?
//!
//! Only *Trailers-Only* responses — a status in the response headers, which is
//! how tonic, grpc-go, grpc-java and grpcio servers send early errors — and
//! plain HTTP errors are judged. A response that starts normally is committed:
//! the caller gets it untouched, whatever its trailers later say (gRPC A6).
//!
//! Everything here reads what a server or a network sent, so nothing here may
//! panic, and nothing malformed may turn a response into a retryable one.

use std::time::Duration;

use base64::Engine as _;
use base64::alphabet;
use base64::engine::DecodePaddingMode;
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig};
use http::{HeaderMap, HeaderName, StatusCode};
use tonic::Code;
use tonic_types::StatusExt as _;

use crate::policy::RetryableCodes;

pub(crate) const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
pub(crate) const GRPC_STATUS_DETAILS: HeaderName =
    HeaderName::from_static("grpc-status-details-bin");
pub(crate) const GRPC_RETRY_PUSHBACK: HeaderName =
    HeaderName::from_static("grpc-retry-pushback-ms");

/// The base64 flavour tonic decodes `grpc-status-details-bin` with: standard
/// alphabet, padding optional. Checking with the same rules is what keeps
/// `tonic::Status::from_header_map` from panicking on what we let through.
const DETAILS_BASE64: GeneralPurpose = GeneralPurpose::new(
    &alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// What one attempt's outcome means for the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The response started normally: the caller gets it, as it is.
    Committed,
    /// A final status (OK, or an error no retry can change).
    Final(Code),
    /// A retryable failure. `server_delay`, when the server named one (pushback
    /// or `RetryInfo.retry_delay`), replaces the computed backoff.
    Retryable {
        code: Code,
        server_delay: Option<Duration>,
    },
}

impl Verdict {
    /// The code to name in messages and events.
    pub(crate) fn code(self) -> Code {
        match self {
            Verdict::Committed => Code::Ok,
            Verdict::Final(code) | Verdict::Retryable { code, .. } => code,
        }
    }
}

/// Judges a response from its status line and headers.
pub(crate) fn classify_response(
    status: StatusCode,
    headers: &HeaderMap,
    retryable: RetryableCodes,
) -> Verdict {
    let code = match headers.get(GRPC_STATUS) {
        Some(value) => match parse_code(value.as_bytes()) {
            Some(code) => code,
            // A status nobody can read is reported as UNKNOWN and never retried,
            // whatever the retryable set says about UNKNOWN.
            None => return Verdict::Final(Code::Unknown),
        },
        None if status == StatusCode::OK => return Verdict::Committed,
        None => code_for_http_status(status),
    };
    if code == Code::Ok || !retryable.contains(code) {
        return Verdict::Final(code);
    }
    let server_delay = match pushback(headers) {
        Pushback::Absent => None,
        Pushback::After(delay) => Some(delay),
        Pushback::Stop => return Verdict::Final(code),
    };
    // Without RetryInfo, RESOURCE_EXHAUSTED is a wall (queue full, memory
    // guard), not a rate limit with a time to come back: retrying hits it again.
    let retry_info = match code {
        Code::ResourceExhausted | Code::Unavailable | Code::DeadlineExceeded => retry_info(headers),
        _ => None,
    };
    if code == Code::ResourceExhausted && retry_info.is_none() {
        return Verdict::Final(code);
    }
    Verdict::Retryable {
        code,
        server_delay: server_delay.or(retry_info.flatten()),
    }
}

/// A failure of the inner service: no response headers arrived, so the request
/// never reached the application as far as the caller can tell.
pub(crate) fn classify_error(retryable: RetryableCodes) -> Verdict {
    if retryable.contains(Code::Unavailable) {
        Verdict::Retryable {
            code: Code::Unavailable,
            server_delay: None,
        }
    } else {
        Verdict::Final(Code::Unavailable)
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

/// A `grpc-status` value: one to three ASCII digits, nothing else.
fn parse_code(value: &[u8]) -> Option<Code> {
    if value.is_empty() || value.len() > 3 || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n = value.iter().fold(0i32, |n, d| n * 10 + i32::from(d - b'0'));
    // Numbers outside 0..=16 are well-formed but unknown: tonic reads them as UNKNOWN.
    Some(Code::from_i32(n))
}

/// The gRPC code for an HTTP response that carries no `grpc-status`, as gRPC
/// clients map it.
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

enum Pushback {
    Absent,
    After(Duration),
    Stop,
}

/// `grpc-retry-pushback-ms` (gRPC A6): a non-negative integer means "retry after
/// exactly this long"; anything else — negative, junk, several values — means
/// "do not retry".
fn pushback(headers: &HeaderMap) -> Pushback {
    let mut values = headers.get_all(GRPC_RETRY_PUSHBACK).iter();
    let Some(value) = values.next() else {
        return Pushback::Absent;
    };
    if values.next().is_some() {
        return Pushback::Stop;
    }
    let digits = value.as_bytes();
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return Pushback::Stop;
    }
    digits
        .iter()
        .try_fold(0u64, |n, d| {
            n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
        })
        .map_or(Pushback::Stop, |ms| {
            Pushback::After(Duration::from_millis(ms))
        })
}

/// `google.rpc.RetryInfo` from `grpc-status-details-bin`: `None` without one
/// (absent header, bad base64, bad protobuf, no such detail), else the delay it
/// names, if it names one.
fn retry_info(headers: &HeaderMap) -> Option<Option<Duration>> {
    let encoded = headers.get(GRPC_STATUS_DETAILS)?;
    let details = DETAILS_BASE64.decode(encoded.as_bytes()).ok()?;
    // `with_details` only stores the bytes; tonic-types decodes them, and
    // reports malformed protobuf as "no RetryInfo".
    let status = tonic::Status::with_details(Code::ResourceExhausted, "", details.into());
    status.get_details_retry_info().map(|info| info.retry_delay)
}

/// Drops a `grpc-status-details-bin` header that is not valid base64.
///
/// tonic's client decodes that header with `expect`, so passing such a header
/// on would crash the caller's task. The code and message stay; only the
/// undecodable details go. Returns whether anything was removed.
pub(crate) fn repair_status_details(headers: &mut HeaderMap) -> bool {
    let Some(value) = headers.get(GRPC_STATUS_DETAILS) else {
        return false;
    };
    if DETAILS_BASE64.decode(value.as_bytes()).is_ok() {
        return false;
    }
    tracing::warn!(
        header = GRPC_STATUS_DETAILS.as_str(),
        len = value.len(),
        "dropping a status details header that is not valid base64"
    );
    headers.remove(GRPC_STATUS_DETAILS);
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use tonic_types::{ErrorDetails, StatusExt};

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    fn trailers_only(code: i32) -> HeaderMap {
        headers(&[("grpc-status", &code.to_string())])
    }

    fn judge(h: &HeaderMap) -> Verdict {
        classify_response(StatusCode::OK, h, RetryableCodes::default())
    }

    /// The `grpc-status-details-bin` value a server sends for `RetryInfo`.
    fn retry_info_header(delay: Option<Duration>) -> String {
        let status = tonic::Status::with_error_details(
            Code::ResourceExhausted,
            "slow down",
            ErrorDetails::with_retry_info(delay),
        );
        DETAILS_BASE64.encode(status.details())
    }

    #[test]
    fn every_code_by_default() {
        for n in 0..=16 {
            let code = Code::from_i32(n);
            let got = judge(&trailers_only(n));
            let want = match code {
                Code::Unavailable | Code::DeadlineExceeded => Verdict::Retryable {
                    code,
                    server_delay: None,
                },
                // RESOURCE_EXHAUSTED without RetryInfo is final; see below.
                _ => Verdict::Final(code),
            };
            assert_eq!(got, want, "grpc-status {n} ({code:?})");
        }
    }

    #[test]
    fn committed_responses_are_not_judged() {
        let h = headers(&[("content-type", "application/grpc")]);
        assert_eq!(judge(&h), Verdict::Committed);
    }

    #[test]
    fn http_status_without_grpc_status_maps_as_grpc_does() {
        let table = [
            (400, Code::Internal),
            (401, Code::Unauthenticated),
            (403, Code::PermissionDenied),
            (404, Code::Unimplemented),
            (429, Code::Unavailable),
            (502, Code::Unavailable),
            (503, Code::Unavailable),
            (504, Code::Unavailable),
            (500, Code::Unknown),
            (302, Code::Unknown),
        ];
        for (http_status, code) in table {
            let got = classify_response(
                StatusCode::from_u16(http_status).unwrap(),
                &HeaderMap::new(),
                RetryableCodes::default(),
            );
            assert_eq!(got.code(), code, "HTTP {http_status}");
            assert_eq!(
                matches!(got, Verdict::Retryable { .. }),
                code == Code::Unavailable,
                "HTTP {http_status}"
            );
        }
    }

    #[test]
    fn grpc_status_wins_over_http_status() {
        let got = classify_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &trailers_only(5),
            RetryableCodes::default(),
        );
        assert_eq!(got, Verdict::Final(Code::NotFound));
    }

    #[test]
    fn malformed_grpc_status_is_unknown_and_never_retried() {
        let everything: RetryableCodes = (0..=16).map(Code::from_i32).collect();
        for bad in ["", "x", "14 ", " 14", "1.4", "-14", "0014", "99999"] {
            let h = headers(&[("grpc-status", bad)]);
            let got = classify_response(StatusCode::OK, &h, everything);
            assert_eq!(got, Verdict::Final(Code::Unknown), "grpc-status {bad:?}");
        }
        let h = headers(&[("grpc-status", "99")]);
        assert_eq!(judge(&h), Verdict::Final(Code::Unknown), "unknown number");
        let mut h = HeaderMap::new();
        h.insert("grpc-status", HeaderValue::from_bytes(b"1\xff").unwrap());
        assert_eq!(judge(&h), Verdict::Final(Code::Unknown), "non-UTF-8");
    }

    #[test]
    fn resource_exhausted_needs_retry_info() {
        let bare = trailers_only(8);
        assert_eq!(judge(&bare), Verdict::Final(Code::ResourceExhausted));

        let with_delay = retry_info_header(Some(Duration::from_millis(250)));
        let h = headers(&[
            ("grpc-status", "8"),
            ("grpc-status-details-bin", &with_delay),
        ]);
        assert_eq!(
            judge(&h),
            Verdict::Retryable {
                code: Code::ResourceExhausted,
                server_delay: Some(Duration::from_millis(250)),
            }
        );

        let without_delay = retry_info_header(None);
        let h = headers(&[
            ("grpc-status", "8"),
            ("grpc-status-details-bin", &without_delay),
        ]);
        assert_eq!(
            judge(&h),
            Verdict::Retryable {
                code: Code::ResourceExhausted,
                server_delay: None,
            },
            "RetryInfo without a delay: retry after the computed backoff"
        );
    }

    #[test]
    fn malformed_details_never_make_a_call_retryable() {
        let not_retry_info = DETAILS_BASE64.encode(
            tonic::Status::with_error_details(
                Code::ResourceExhausted,
                "",
                ErrorDetails::with_error_info("QUOTA", "example.com", []),
            )
            .details(),
        );
        for bad in ["!!!not base64!!!", "AAAA", "CAgSBQ", &not_retry_info] {
            let h = headers(&[("grpc-status", "8"), ("grpc-status-details-bin", bad)]);
            assert_eq!(
                judge(&h),
                Verdict::Final(Code::ResourceExhausted),
                "details {bad:?}"
            );
            // ... nor stop one that is retryable anyway.
            let h = headers(&[("grpc-status", "14"), ("grpc-status-details-bin", bad)]);
            assert!(
                matches!(judge(&h), Verdict::Retryable { .. }),
                "details {bad:?}"
            );
        }
    }

    #[test]
    fn pushback_sets_the_delay_or_forbids_the_retry() {
        let h = headers(&[("grpc-status", "14"), ("grpc-retry-pushback-ms", "1000")]);
        assert_eq!(
            judge(&h),
            Verdict::Retryable {
                code: Code::Unavailable,
                server_delay: Some(Duration::from_secs(1)),
            }
        );
        let h = headers(&[("grpc-status", "14"), ("grpc-retry-pushback-ms", "0")]);
        assert_eq!(
            judge(&h),
            Verdict::Retryable {
                code: Code::Unavailable,
                server_delay: Some(Duration::ZERO),
            }
        );
        for junk in ["-1", "xxx", "", "1.5", "+5", "99999999999999999999999"] {
            let h = headers(&[("grpc-status", "14"), ("grpc-retry-pushback-ms", junk)]);
            assert_eq!(
                judge(&h),
                Verdict::Final(Code::Unavailable),
                "pushback {junk:?}"
            );
        }
        let h = headers(&[
            ("grpc-status", "14"),
            ("grpc-retry-pushback-ms", "10"),
            ("grpc-retry-pushback-ms", "20"),
        ]);
        assert_eq!(judge(&h), Verdict::Final(Code::Unavailable), "two values");
    }

    #[test]
    fn pushback_overrides_retry_info() {
        let info = retry_info_header(Some(Duration::from_secs(5)));
        let h = headers(&[
            ("grpc-status", "8"),
            ("grpc-status-details-bin", &info),
            ("grpc-retry-pushback-ms", "7"),
        ]);
        assert_eq!(
            judge(&h),
            Verdict::Retryable {
                code: Code::ResourceExhausted,
                server_delay: Some(Duration::from_millis(7)),
            }
        );
    }

    #[test]
    fn pushback_does_not_make_a_final_code_retryable() {
        let h = headers(&[("grpc-status", "10"), ("grpc-retry-pushback-ms", "5")]);
        assert_eq!(judge(&h), Verdict::Final(Code::Aborted));
    }

    #[test]
    fn configured_codes_are_honoured() {
        let codes = RetryableCodes::empty().with(Code::Aborted);
        let got = classify_response(StatusCode::OK, &trailers_only(10), codes);
        assert!(matches!(
            got,
            Verdict::Retryable {
                code: Code::Aborted,
                ..
            }
        ));
        let got = classify_response(StatusCode::OK, &trailers_only(14), codes);
        assert_eq!(got, Verdict::Final(Code::Unavailable));
        assert_eq!(classify_error(codes), Verdict::Final(Code::Unavailable));
        assert!(matches!(
            classify_error(RetryableCodes::default()),
            Verdict::Retryable {
                code: Code::Unavailable,
                ..
            }
        ));
    }

    #[test]
    fn repair_drops_only_undecodable_details() {
        let good = retry_info_header(Some(Duration::from_millis(1)));
        let mut h = headers(&[("grpc-status", "8"), ("grpc-status-details-bin", &good)]);
        assert!(!repair_status_details(&mut h));
        assert!(h.contains_key("grpc-status-details-bin"));

        let mut h = headers(&[
            ("grpc-status", "14"),
            ("grpc-message", "down"),
            ("grpc-status-details-bin", "%%%"),
        ]);
        assert!(repair_status_details(&mut h));
        assert!(!h.contains_key("grpc-status-details-bin"));
        // What is left is now safe for tonic's own parser, code and message kept.
        let status = tonic::Status::from_header_map(&h).expect("a status");
        assert_eq!(status.code(), Code::Unavailable);
        assert_eq!(status.message(), "down");

        let mut none = trailers_only(14);
        assert!(!repair_status_details(&mut none));
    }

    #[test]
    fn unpadded_details_are_valid_as_tonic_reads_them() {
        let padded = retry_info_header(Some(Duration::from_millis(1)));
        let unpadded = padded.trim_end_matches('=');
        let mut h = headers(&[("grpc-status", "8"), ("grpc-status-details-bin", unpadded)]);
        assert!(!repair_status_details(&mut h));
        assert!(
            tonic::Status::from_header_map(&h)
                .unwrap()
                .get_details_retry_info()
                .is_some()
        );
    }
}
