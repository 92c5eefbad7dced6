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

use std::error::Error;
use std::time::Duration;

use base64::Engine as _;
use base64::alphabet;
use base64::engine::DecodePaddingMode;
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig};
use http::{HeaderMap, HeaderValue, StatusCode};
use prost::Message as _;
use tonic::Code;

use crate::policy::{RetryWhen, RetryableCodes};
use crate::status::{
    GRPC_RETRY_PUSHBACK, GRPC_STATUS_DETAILS, StatusHeaders, code_as_tonic_reads,
    code_for_http_status,
};

/// The base64 flavour tonic decodes `grpc-status-details-bin` with: standard
/// alphabet, padding optional. Checking with the same rules is what keeps
/// `tonic::Status::from_header_map` from panicking on what we let through.
const DETAILS_BASE64: GeneralPurpose = GeneralPurpose::new(
    &alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// The longest `google.protobuf.Duration` there is (10,000 years), as the
/// protobuf definition bounds it.
const MAX_PROTO_DURATION_SECS: i64 = 315_576_000_000;

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
    /// A retryable code carrying A6's "do not retry" mark (a negative
    /// `grpc-retry-pushback-ms`): a retry layer below already retried it and
    /// gave up, or the server asks for no retry. Final.
    RetriedBelow(Code),
}

impl Verdict {
    /// The code to name in messages and events.
    pub(crate) fn code(self) -> Code {
        match self {
            Verdict::Committed => Code::Ok,
            Verdict::Final(code)
            | Verdict::Retryable { code, .. }
            | Verdict::RetriedBelow(code) => code,
        }
    }

    /// Whether the call succeeded: a committed response, or `OK`.
    pub(crate) fn is_success(self) -> bool {
        matches!(self, Verdict::Committed | Verdict::Final(Code::Ok))
    }
}

/// Judges a response from its status line and headers, exactly as a tonic
/// client will read it.
pub(crate) fn classify_response(
    status: StatusCode,
    headers: &HeaderMap,
    retryable: RetryableCodes,
) -> Verdict {
    let StatusHeaders {
        status: grpc_status,
        message: grpc_message,
        content_type,
    } = StatusHeaders::of(headers);
    let code = match grpc_status {
        // As tonic's client reads it: only the canonical forms (`14`, never
        // `014`, `+14` or ` 14`) are codes, and a message it cannot decode
        // makes any code UNKNOWN — final whatever the retryable set says.
        Some(value) => match code_as_tonic_reads(value, grpc_message) {
            Code::Unknown => return Verdict::Final(Code::Unknown),
            code => code,
        },
        None if status == StatusCode::OK && is_grpc(content_type) => return Verdict::Committed,
        // A 200 that is not gRPC (a proxy's HTML page) is no answer of the
        // server's: gRPC reads it as UNKNOWN.
        None if status == StatusCode::OK => return Verdict::Final(Code::Unknown),
        None => code_for_http_status(status),
    };
    retryable_verdict(code, headers, retryable)
}

/// The verdict for an error `code`, given the metadata the server sent with it.
fn retryable_verdict(code: Code, headers: &HeaderMap, retryable: RetryableCodes) -> Verdict {
    let when = match retryable.when(code) {
        Some(when) if code != Code::Ok => when,
        _ => return Verdict::Final(code),
    };
    let server_delay = match pushback(headers) {
        Pushback::Absent => None,
        Pushback::After(delay) => Some(delay),
        Pushback::Refused => return Verdict::RetriedBelow(code),
        Pushback::Stop => return Verdict::Final(code),
    };
    let info_delay = match retry_info(headers) {
        RetryInfo::Delay(delay) => Some(delay),
        // A delay nobody can read is no reason to retry, and no time to wait.
        RetryInfo::Malformed => return Verdict::Final(code),
        // A code retried only with RetryInfo (by default RESOURCE_EXHAUSTED:
        // without it a wall, a full queue or a memory guard, that a retry
        // only hits again) is final without one.
        RetryInfo::Absent if when == RetryWhen::WithRetryInfo => return Verdict::Final(code),
        RetryInfo::Absent => None,
    };
    Verdict::Retryable {
        code,
        server_delay: server_delay.or(info_delay.flatten()),
    }
}

/// A failure of the inner service: no response headers arrived, so the request
/// never reached the application as far as the caller can tell.
pub(crate) fn classify_error(retryable: RetryableCodes) -> Verdict {
    without_metadata(Code::Unavailable, retryable)
}

/// An attempt whose time limit ran out (the layer's cut, a channel's
/// `grpc-timeout`, or a server's): `DEADLINE_EXCEEDED`, retryable while the
/// call has time if the set allows it.
pub(crate) fn classify_timeout(retryable: RetryableCodes) -> Verdict {
    without_metadata(Code::DeadlineExceeded, retryable)
}

/// The verdict for `code` when no server sent it, so no metadata can change
/// it: a code retried only with `RetryInfo` has none here.
fn without_metadata(code: Code, retryable: RetryableCodes) -> Verdict {
    match retryable.when(code) {
        Some(RetryWhen::Always) => Verdict::Retryable {
            code,
            server_delay: None,
        },
        _ => Verdict::Final(code),
    }
}

/// Whether the response says it is gRPC: `application/grpc`, alone or
/// followed by `+` (a subtype) or `;` (parameters), as gRPC clients check it.
pub(crate) fn is_grpc(content_type: Option<&HeaderValue>) -> bool {
    const GRPC: &[u8] = b"application/grpc";
    content_type.is_some_and(|value| {
        let value = value.as_bytes();
        value.starts_with(GRPC) && matches!(value.get(GRPC.len()), None | Some(b'+' | b';'))
    })
}

pub(crate) enum Pushback {
    Absent,
    After(Duration),
    /// A negative integer: "do not retry", as a retry layer that gave up says it.
    Refused,
    /// Junk or several values: no retry either.
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
    pushback_value(value.as_bytes())
}

/// One `grpc-retry-pushback-ms` value, read as the integer grpc-go, grpc-java
/// and C-core read it: an optional sign, then decimal digits. `-0` is zero,
/// not negative; `+5` is 5.
pub(crate) fn pushback_value(value: &[u8]) -> Pushback {
    let (negative, digits) = match value {
        [b'-', digits @ ..] => (true, digits),
        [b'+', digits @ ..] => (false, digits),
        digits => (false, digits),
    };
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return Pushback::Stop;
    }
    if negative && digits.iter().any(|&d| d != b'0') {
        return Pushback::Refused;
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

/// What `grpc-status-details-bin` says about `google.rpc.RetryInfo`.
#[derive(Debug, PartialEq, Eq)]
enum RetryInfo {
    /// No RetryInfo: no header, or details nobody can decode.
    Absent,
    /// A RetryInfo, with the delay it names, if it names one.
    Delay(Option<Duration>),
    /// A RetryInfo whose delay is negative, out of range or undecodable.
    Malformed,
}

/// Reads `google.rpc.RetryInfo` from `grpc-status-details-bin`.
///
/// The protobuf is decoded with tonic-types' message types, but the delay is
/// checked here before it becomes a `Duration`: the conversion tonic-types
/// uses (prost-types' `TryFrom`) negates the seconds of a negative delay, which
/// overflows — a panic in debug builds — for `seconds = i64::MIN`.
fn retry_info(headers: &HeaderMap) -> RetryInfo {
    let Some(encoded) = headers.get(GRPC_STATUS_DETAILS) else {
        return RetryInfo::Absent;
    };
    let Ok(details) = DETAILS_BASE64.decode(encoded.as_bytes()) else {
        return RetryInfo::Absent;
    };
    let Ok(status) = tonic_types::pb::Status::decode(details.as_slice()) else {
        return RetryInfo::Absent;
    };
    let Some(any) = status
        .details
        .iter()
        .find(|any| any.type_url == tonic_types::RetryInfo::TYPE_URL)
    else {
        return RetryInfo::Absent;
    };
    let Ok(info) = tonic_types::pb::RetryInfo::decode(any.value.as_slice()) else {
        return RetryInfo::Malformed;
    };
    match info.retry_delay {
        None => RetryInfo::Delay(None),
        Some(delay) => proto_duration(delay.seconds, delay.nanos)
            .map_or(RetryInfo::Malformed, |d| RetryInfo::Delay(Some(d))),
    }
}

/// A `google.protobuf.Duration` as a `Duration`, if it is a valid, non-negative
/// one: seconds within the type's documented range, nanos within `0..1e9`.
fn proto_duration(seconds: i64, nanos: i32) -> Option<Duration> {
    if !(0..=MAX_PROTO_DURATION_SECS).contains(&seconds) || !(0..1_000_000_000).contains(&nanos) {
        return None;
    }
    // Both checked non-negative and in range just above.
    Some(Duration::new(seconds.unsigned_abs(), nanos.unsigned_abs()))
}

/// Whether an inner service's error says a time limit below the layer ran
/// out: tonic's Channel enforcing `grpc-timeout` (`TimeoutExpired`, which tonic
/// would report as CANCELLED) or a `tower::timeout` layer (`Elapsed`).
pub(crate) fn is_timeout(error: &(dyn Error + 'static)) -> bool {
    sources(error)
        .any(|e| e.is::<tonic::TimeoutExpired>() || e.is::<tower::timeout::error::Elapsed>())
}

/// Whether an inner service's error says the server's HTTP/2 library turned
/// the stream away before its application saw it: the stream was reset with
/// `REFUSED_STREAM`, or a `GOAWAY` said the server would process no stream
/// numbered as high as this one. gRPC retries such an attempt once, at once,
/// whatever the method's policy ("transparent retries"): nothing was done,
/// and the request is known not to have been read.
///
/// Only what the peer said counts: a reset or `GOAWAY` this side sent
/// (a cancelled call, a connection this side closed) is not one. And only a
/// graceful `GOAWAY` (`NO_ERROR`): when a connection closes after a `GOAWAY`
/// with an error code, h2 fails the streams the server may have processed
/// with that same error, so it does not tell the refused ones apart.
pub(crate) fn is_refused_stream(error: &(dyn Error + 'static)) -> bool {
    sources(error)
        .filter_map(|e| e.downcast_ref::<h2::Error>())
        .any(|e| {
            e.is_remote()
                && match e.reason() {
                    Some(h2::Reason::REFUSED_STREAM) => e.is_reset(),
                    Some(h2::Reason::NO_ERROR) => e.is_go_away(),
                    _ => false,
                }
        })
}

/// A `tonic::Status` carried by an inner service's error, which tonic's client
/// would report as that status.
pub(crate) fn status_in<'a>(error: &'a (dyn Error + 'static)) -> Option<&'a tonic::Status> {
    sources(error).find_map(|e| e.downcast_ref::<tonic::Status>())
}

/// An error and its sources, joined by `: ` (repeats skipped), at most about
/// 512 bytes: for the message of the status a caller gets instead.
pub(crate) fn describe(error: &(dyn Error + 'static)) -> String {
    const MAX: usize = 512;
    let mut out = String::new();
    let mut last = String::new();
    for e in sources(error) {
        let text = e.to_string();
        if text.is_empty() || last.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
        last = text;
        if out.len() > MAX {
            let mut cut = MAX;
            while !out.is_char_boundary(cut) {
                cut -= 1;
            }
            out.truncate(cut);
            out.push('…');
            break;
        }
    }
    out
}

fn sources<'a>(
    error: &'a (dyn Error + 'static),
) -> impl Iterator<Item = &'a (dyn Error + 'static)> {
    // Bounded, in case an error type's `source` chain loops.
    std::iter::successors(Some(error), |&e| e.source()).take(32)
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
        // Each of these is UNKNOWN to tonic's client (`Code::from_bytes`), so it
        // is UNKNOWN here: never retried, and never a success (`00`).
        for bad in [
            "", "x", "14 ", " 14", "+14", "1.4", "-14", "014", "0014", "00", "000", "99", "17",
            "99999",
        ] {
            let h = headers(&[("grpc-status", bad)]);
            let got = classify_response(StatusCode::OK, &h, everything);
            assert_eq!(got, Verdict::Final(Code::Unknown), "grpc-status {bad:?}");
            assert!(!got.is_success(), "grpc-status {bad:?}");
            let tonic_reads = tonic::Status::from_header_map(&h).map(|s| s.code());
            assert_eq!(tonic_reads, Some(Code::Unknown), "tonic reads {bad:?}");
        }
        let mut h = HeaderMap::new();
        h.insert("grpc-status", HeaderValue::from_bytes(b"1\xff").unwrap());
        assert_eq!(judge(&h), Verdict::Final(Code::Unknown), "non-UTF-8");
    }

    #[test]
    fn a_message_tonic_cannot_decode_makes_any_code_unknown() {
        let everything: RetryableCodes = (0..=16).map(Code::from_i32).collect();
        let messages: &[&[u8]] = &[
            b"plain",
            b"caf%C3%A9",
            b"%FF",
            b"\xe9t\xe9",
            b"cut %E2%82",
            b"%zz and %",
            b"%25",
            b"",
        ];
        for code in ["0", "4", "14", "99"] {
            for message in messages {
                let mut h = HeaderMap::new();
                h.insert("grpc-status", HeaderValue::from_static(code));
                h.insert("grpc-message", HeaderValue::from_bytes(message).unwrap());
                let tonic_code = tonic::Status::from_header_map(&h).unwrap().code();
                let got = classify_response(StatusCode::OK, &h, everything);
                assert_eq!(got.code(), tonic_code, "{code} {message:?}");
                if tonic_code == Code::Unknown {
                    assert_eq!(got, Verdict::Final(Code::Unknown), "{code} {message:?}");
                }
            }
        }
    }

    #[test]
    fn every_status_reads_as_tonic_reads_it() {
        // All one- and two-byte values: the layer and tonic's client agree.
        let everything: RetryableCodes = (0..=16).map(Code::from_i32).collect();
        for len in 1..=2usize {
            for n in 0..256usize.pow(len as u32) {
                let bytes: Vec<u8> = (0..len).map(|i| (n >> (8 * i)) as u8).collect();
                let Ok(value) = HeaderValue::from_bytes(&bytes) else {
                    continue;
                };
                let mut h = HeaderMap::new();
                h.insert("grpc-status", value);
                let tonic_code = tonic::Status::from_header_map(&h).unwrap().code();
                assert_eq!(
                    classify_response(StatusCode::OK, &h, everything).code(),
                    tonic_code,
                    "{bytes:?}"
                );
            }
        }
    }

    #[test]
    fn a_200_that_is_not_grpc_is_unknown_and_not_a_success() {
        for (content_type, committed) in [
            (Some("application/grpc"), true),
            (Some("application/grpc+proto"), true),
            (Some("application/grpc;charset=utf-8"), true),
            (Some("text/html"), false),
            (Some("application/grpcx"), false),
            (Some("application/json"), false),
            (Some("APPLICATION/GRPC"), false),
            (None, false),
        ] {
            let h = match content_type {
                Some(ct) => headers(&[("content-type", ct)]),
                None => HeaderMap::new(),
            };
            let got = judge(&h);
            let want = if committed {
                Verdict::Committed
            } else {
                Verdict::Final(Code::Unknown)
            };
            assert_eq!(got, want, "content-type {content_type:?}");
            assert_eq!(got.is_success(), committed, "content-type {content_type:?}");
        }
        // With grpc-status, the content type does not matter.
        let h = headers(&[("grpc-status", "14"), ("content-type", "text/html")]);
        assert!(matches!(judge(&h), Verdict::Retryable { .. }));
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
    fn a_code_listed_always_is_retried_without_retry_info_and_keeps_its_delay() {
        // As A6's `retryableStatusCodes` (grpc-go, grpc-java, grpcio): a code
        // in the set the user wrote is retried, RetryInfo or not.
        let written = RetryableCodes::empty()
            .with(Code::Unavailable)
            .with(Code::ResourceExhausted);
        let bare = trailers_only(8);
        assert_eq!(
            classify_response(StatusCode::OK, &bare, written),
            Verdict::Retryable {
                code: Code::ResourceExhausted,
                server_delay: None,
            }
        );
        // A RetryInfo delay is still the server's time to come back.
        let with_delay = retry_info_header(Some(Duration::from_millis(250)));
        let h = headers(&[
            ("grpc-status", "8"),
            ("grpc-status-details-bin", &with_delay),
        ]);
        assert_eq!(
            classify_response(StatusCode::OK, &h, written),
            Verdict::Retryable {
                code: Code::ResourceExhausted,
                server_delay: Some(Duration::from_millis(250)),
            }
        );
        // And for any code the set retries, not only the default three.
        let aborted = RetryableCodes::empty().with(Code::Aborted);
        let h = headers(&[
            ("grpc-status", "10"),
            ("grpc-status-details-bin", &with_delay),
        ]);
        assert_eq!(
            classify_response(StatusCode::OK, &h, aborted),
            Verdict::Retryable {
                code: Code::Aborted,
                server_delay: Some(Duration::from_millis(250)),
            }
        );
    }

    #[test]
    fn a_code_listed_with_retry_info_needs_it_whatever_the_code() {
        let codes = RetryableCodes::empty().with_retry_info(Code::Unavailable);
        assert_eq!(
            classify_response(StatusCode::OK, &trailers_only(14), codes),
            Verdict::Final(Code::Unavailable)
        );
        let info = retry_info_header(Some(Duration::from_millis(5)));
        let h = headers(&[("grpc-status", "14"), ("grpc-status-details-bin", &info)]);
        assert_eq!(
            classify_response(StatusCode::OK, &h, codes),
            Verdict::Retryable {
                code: Code::Unavailable,
                server_delay: Some(Duration::from_millis(5)),
            }
        );
        // A failure with no status at all carries no RetryInfo either.
        assert_eq!(classify_error(codes), Verdict::Final(Code::Unavailable));
        let timeouts = RetryableCodes::empty().with_retry_info(Code::DeadlineExceeded);
        assert_eq!(
            classify_timeout(timeouts),
            Verdict::Final(Code::DeadlineExceeded)
        );
        // Switching the rule replaces it.
        let always = codes.with(Code::Unavailable);
        assert!(matches!(classify_error(always), Verdict::Retryable { .. }));
        assert!(matches!(
            classify_response(StatusCode::OK, &trailers_only(14), always),
            Verdict::Retryable { .. }
        ));
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

    /// A `grpc-status-details-bin` value whose RetryInfo delay is raw
    /// `seconds` and `nanos`, as a hostile server could send it.
    fn raw_retry_info_header(seconds: i64, nanos: i32) -> String {
        let info = tonic_types::pb::RetryInfo {
            retry_delay: Some(prost_types::Duration { seconds, nanos }),
        };
        let status = tonic_types::pb::Status {
            code: 8,
            message: String::new(),
            details: vec![prost_types::Any {
                type_url: tonic_types::RetryInfo::TYPE_URL.to_owned(),
                value: info.encode_to_vec(),
            }],
        };
        DETAILS_BASE64.encode(status.encode_to_vec())
    }

    #[test]
    fn extreme_retry_info_delays_never_panic_and_are_not_retried() {
        for (seconds, nanos) in [
            (i64::MIN, 0),
            (i64::MIN, -1),
            (i64::MIN, i32::MIN),
            (-1, 0),
            (0, -1),
            (-1, 999_999_999),
            (0, 1_000_000_000),
            (0, i32::MAX),
            (i64::MAX, 0),
            (i64::MAX, i32::MAX),
            (MAX_PROTO_DURATION_SECS + 1, 0),
        ] {
            for code in ["8", "14", "4"] {
                let h = headers(&[
                    ("grpc-status", code),
                    (
                        "grpc-status-details-bin",
                        &raw_retry_info_header(seconds, nanos),
                    ),
                ]);
                let got = judge(&h);
                assert!(
                    matches!(got, Verdict::Final(_)),
                    "delay ({seconds}, {nanos}) with code {code}: {got:?}"
                );
            }
        }
        // The largest valid delay is read exactly (the cap on waiting is the
        // call policy's business).
        let h = headers(&[
            ("grpc-status", "8"),
            (
                "grpc-status-details-bin",
                &raw_retry_info_header(MAX_PROTO_DURATION_SECS, 999_999_999),
            ),
        ]);
        assert_eq!(
            judge(&h),
            Verdict::Retryable {
                code: Code::ResourceExhausted,
                server_delay: Some(Duration::new(315_576_000_000, 999_999_999)),
            }
        );
    }

    #[test]
    fn timer_errors_and_statuses_are_found_in_the_source_chain() {
        #[derive(Debug)]
        struct Wrap(Box<dyn Error + Send + Sync>);
        impl std::fmt::Display for Wrap {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("transport error")
            }
        }
        impl Error for Wrap {
            fn source(&self) -> Option<&(dyn Error + 'static)> {
                Some(&*self.0)
            }
        }
        let timeout = Wrap(Box::new(tonic::TimeoutExpired(())));
        assert!(is_timeout(&timeout));
        assert!(is_timeout(&tower::timeout::error::Elapsed::new()));
        let refused = Wrap("connection refused".into());
        assert!(!is_timeout(&refused));
        assert_eq!(describe(&refused), "transport error: connection refused");
        assert!(status_in(&refused).is_none());
        let status = Wrap(Box::new(tonic::Status::permission_denied("no")));
        assert_eq!(status_in(&status).unwrap().code(), Code::PermissionDenied);

        let long = Wrap("x".repeat(10_000).into());
        assert!(describe(&long).len() < 600);
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
        // A sign is read as gRPC's clients read one: "-0" is zero, "+5" five.
        for (value, ms) in [("-0", 0), ("-000", 0), ("+5", 5), ("+0", 0), ("007", 7)] {
            let h = headers(&[("grpc-status", "14"), ("grpc-retry-pushback-ms", value)]);
            assert_eq!(
                judge(&h),
                Verdict::Retryable {
                    code: Code::Unavailable,
                    server_delay: Some(Duration::from_millis(ms)),
                },
                "pushback {value:?}"
            );
        }
        for junk in [
            "xxx",
            "",
            "1.5",
            "+",
            "+-1",
            "-+1",
            " 5",
            "5 ",
            "-",
            "--1",
            "99999999999999999999999",
        ] {
            let h = headers(&[("grpc-status", "14"), ("grpc-retry-pushback-ms", junk)]);
            assert_eq!(
                judge(&h),
                Verdict::Final(Code::Unavailable),
                "pushback {junk:?}"
            );
        }
        // A negative integer is the "do not retry" mark a layer below sets
        // when it gave up after retrying.
        for mark in ["-1", "-250", "-99999999999999999999999"] {
            let h = headers(&[("grpc-status", "14"), ("grpc-retry-pushback-ms", mark)]);
            assert_eq!(
                judge(&h),
                Verdict::RetriedBelow(Code::Unavailable),
                "pushback {mark:?}"
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
