//! Hostile servers, generated: random response metadata (`grpc-status` bytes,
//! `grpc-status-details-bin` as random bytes, bad base64 and real
//! `google.rpc.Status` values with RetryInfo at extreme delays, pushback
//! strings, HTTP statuses, content types), transport and timer errors, slow,
//! stalled and failing readiness, committed bodies that stall or end in junk
//! trailers, and random caller `grpc-timeout`s — run through the layer under
//! paused tokio time.
//!
//! A third of the cases with more than one attempt hedge instead of
//! retrying, with a random delay.
//!
//! Every case checks: no panic; never more attempts than `max_attempts`; never
//! a retry after a final answer (for a hedged call: no attempt started after
//! an answer that commits); with a valid deadline the call — its response
//! body included — ends by it (to tokio's timer resolution: the first
//! millisecond tick at or after it); and tonic's `Status::from_header_map` can
//! read whatever the caller gets.
//!
//! Seeded and reproducible: `TONIC_RETRY_FUZZ_CASES` sets the number of cases
//! (default 100,000) and `TONIC_RETRY_FUZZ_SEED` the first seed (default 0);
//! case `n` runs with seed `first + n`, and a failure names its seed. The
//! million-case run:
//!
//! ```text
//! TONIC_RETRY_FUZZ_CASES=1000000 cargo test --release --test hostile -- --nocapture
//! ```

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response};
use http_body::Frame;
use http_body_util::BodyExt;
use prost::Message as _;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::time::{Instant, Sleep};
use tonic::body::Body;
use tonic_retry::{HedgePolicy, RetryBudget, RetryLayer, RetryPolicy};
use tower::{BoxError, Layer, Service, ServiceExt};

const MS: Duration = Duration::from_millis(1);

/// Hedges sent over all cases, to show the hedged cases hedge.
static HEDGES: AtomicUsize = AtomicUsize::new(0);

/// How an attempt finds the service's readiness.
#[derive(Clone, Copy, Debug)]
enum Readiness {
    Now,
    After(Duration),
    Fail,
}

/// What a committed response's body does.
#[derive(Clone, Debug)]
enum BodyPlan {
    Empty,
    Chunks(u8),
    ChunksThenTrailers(u8, Vec<(HeaderName, HeaderValue)>),
    /// Sends a chunk and then nothing, ever (only with a deadline).
    Stall,
}

/// What the server (or the network) answers one attempt with.
#[derive(Clone, Debug)]
enum Answer {
    Response {
        status: u16,
        headers: Vec<(HeaderName, HeaderValue)>,
        body: BodyPlan,
    },
    Transport,
    Timer,
    Status(i32),
    /// No answer at all (only where a limit cuts the attempt).
    Never,
}

#[derive(Clone, Debug)]
struct Plan {
    ready: Readiness,
    delay: Duration,
    answer: Answer,
}

/// The inner service: plays the scripted plans, one per attempt.
struct Scripted {
    plans: Arc<Mutex<VecDeque<Plan>>>,
    calls: Arc<AtomicUsize>,
    /// Each attempt: when it started, when its answer comes, and whether
    /// that answer commits.
    log: Arc<Mutex<Vec<(Instant, Instant, bool)>>>,
    /// This clone's wait for a slow readiness.
    waiting: Option<Pin<Box<Sleep>>>,
}

impl Clone for Scripted {
    /// A clone shares the script; its wait for readiness is its own.
    fn clone(&self) -> Self {
        Self {
            plans: Arc::clone(&self.plans),
            calls: Arc::clone(&self.calls),
            log: Arc::clone(&self.log),
            waiting: None,
        }
    }
}

impl Service<Request<Body>> for Scripted {
    type Response = Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        let ready = self.plans.lock().unwrap().front().map(|p| p.ready);
        match ready {
            None | Some(Readiness::Now) => Poll::Ready(Ok(())),
            Some(Readiness::Fail) => {
                self.plans.lock().unwrap().pop_front();
                Poll::Ready(Err("the service's worker is gone".into()))
            }
            Some(Readiness::After(d)) => {
                let sleep = self
                    .waiting
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(d)));
                match sleep.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        self.waiting = None;
                        Poll::Ready(Ok(()))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn call(&mut self, _req: Request<Body>) -> Self::Future {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let plan = self.plans.lock().unwrap().pop_front();
        if let Some(plan) = &plan {
            let now = Instant::now();
            let commits = commits(&plan.answer);
            self.log
                .lock()
                .unwrap()
                .push((now, now + plan.delay, commits));
        }
        Box::pin(async move {
            let Some(plan) = plan else {
                return Ok(grpc_ok());
            };
            tokio::time::sleep(plan.delay).await;
            match plan.answer {
                Answer::Response {
                    status,
                    headers,
                    body,
                } => {
                    let mut response = Response::new(make_body(body));
                    *response.status_mut() = http::StatusCode::from_u16(status).unwrap();
                    for (k, v) in headers {
                        response.headers_mut().append(k, v);
                    }
                    Ok(response)
                }
                Answer::Transport => Err("connection reset by peer".into()),
                Answer::Timer => Err(Box::new(tonic::TimeoutExpired(())) as BoxError),
                Answer::Status(code) => Err(Box::new(tonic::Status::new(
                    tonic::Code::from_i32(code),
                    "from an error",
                )) as BoxError),
                Answer::Never => std::future::pending().await,
            }
        })
    }
}

/// Whether an answer starts a normal gRPC response: it commits the call.
fn commits(answer: &Answer) -> bool {
    let Answer::Response {
        status, headers, ..
    } = answer
    else {
        return false;
    };
    let get = |name: &str| headers.iter().find(|(k, _)| k == name).map(|(_, v)| v);
    let grpc = get("content-type").is_some_and(|v| {
        let v = v.as_bytes();
        v.starts_with(b"application/grpc")
            && matches!(v.get(b"application/grpc".len()), None | Some(b'+' | b';'))
    });
    *status == 200 && grpc && get("grpc-status").is_none()
}

fn grpc_ok() -> Response<Body> {
    Response::builder()
        .header("content-type", "application/grpc")
        .body(Body::empty())
        .unwrap()
}

fn make_body(plan: BodyPlan) -> Body {
    let chunk = || Ok::<_, BoxError>(Frame::data(Bytes::from_static(b"\0\0\0\0\x01x")));
    match plan {
        BodyPlan::Empty => Body::empty(),
        BodyPlan::Chunks(n) => Body::new(http_body_util::StreamBody::new(tokio_stream::iter(
            (0..n).map(move |_| chunk()).collect::<Vec<_>>(),
        ))),
        BodyPlan::ChunksThenTrailers(n, trailers) => {
            let mut map = HeaderMap::new();
            for (k, v) in trailers {
                map.append(k, v);
            }
            let frames: Vec<_> = (0..n)
                .map(move |_| chunk())
                .chain(std::iter::once(Ok(Frame::trailers(map))))
                .collect();
            Body::new(http_body_util::StreamBody::new(tokio_stream::iter(frames)))
        }
        BodyPlan::Stall => {
            use tokio_stream::StreamExt as _;
            let stalled = tokio_stream::iter([chunk()]).chain(tokio_stream::pending());
            Body::new(http_body_util::StreamBody::new(stalled))
        }
    }
}

// ---------------------------------------------------------------------------
// Generators
// ---------------------------------------------------------------------------

/// Bytes a header value may hold (visible ASCII, tab, space, obs-text).
fn header_bytes(rng: &mut StdRng, max: usize) -> HeaderValue {
    let len = rng.random_range(0..=max);
    let bytes: Vec<u8> = (0..len)
        .map(|_| match rng.random_range(0..10) {
            0 => rng.random_range(0x80..=0xff),
            1 => b' ',
            _ => rng.random_range(0x21..=0x7e),
        })
        .collect();
    HeaderValue::from_bytes(&bytes).unwrap()
}

fn pick<T: Copy>(rng: &mut StdRng, items: &[T]) -> T {
    items[rng.random_range(0..items.len())]
}

fn grpc_status(rng: &mut StdRng) -> HeaderValue {
    match rng.random_range(0..6) {
        0..=2 => HeaderValue::from(rng.random_range(0..=16)),
        3 => HeaderValue::from_static(pick(
            rng,
            &[
                "014", "00", "+14", " 14", "14 ", "4.0", "-4", "17", "99", "", "0x0e",
            ],
        )),
        4 => HeaderValue::from(rng.random_range(-1000i64..100_000)),
        _ => header_bytes(rng, 4),
    }
}

fn extreme_i64(rng: &mut StdRng) -> i64 {
    let (any, small) = (rng.random(), rng.random_range(0..5));
    pick(
        rng,
        &[
            i64::MIN,
            i64::MIN + 1,
            -1,
            0,
            1,
            30,
            315_576_000_000,
            315_576_000_001,
            i64::MAX,
            any,
            small,
        ],
    )
}

fn extreme_i32(rng: &mut StdRng) -> i32 {
    let (any, valid) = (rng.random(), rng.random_range(0..1_000_000_000));
    pick(
        rng,
        &[
            i32::MIN,
            -1,
            0,
            1,
            999_999_999,
            1_000_000_000,
            i32::MAX,
            any,
            valid,
        ],
    )
}

fn status_details(rng: &mut StdRng) -> HeaderValue {
    let b64 = base64::engine::general_purpose::STANDARD;
    match rng.random_range(0..5) {
        // Random bytes, validly encoded.
        0 => {
            let len = rng.random_range(0..64);
            let bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            HeaderValue::try_from(b64.encode(bytes)).unwrap()
        }
        // Not base64 at all (tonic's client would panic on it).
        1 => header_bytes(rng, 24),
        // A real google.rpc.Status with a RetryInfo at extreme values.
        2 | 3 => {
            let mut details = Vec::new();
            for _ in 0..rng.random_range(1..3) {
                let info = tonic_types::pb::RetryInfo {
                    retry_delay: rng.random_bool(0.9).then(|| prost_types::Duration {
                        seconds: extreme_i64(rng),
                        nanos: extreme_i32(rng),
                    }),
                };
                details.push(prost_types::Any {
                    type_url: tonic_types::RetryInfo::TYPE_URL.into(),
                    value: info.encode_to_vec(),
                });
            }
            if rng.random_bool(0.2) {
                // A RetryInfo whose payload is not a RetryInfo.
                details.insert(
                    0,
                    prost_types::Any {
                        type_url: tonic_types::RetryInfo::TYPE_URL.into(),
                        value: vec![0xff, 0xff, 0xff],
                    },
                );
            }
            let status = tonic_types::pb::Status {
                code: rng.random_range(0..17),
                message: "hostile".into(),
                details,
            };
            let encoded = b64.encode(status.encode_to_vec());
            let encoded = if rng.random_bool(0.3) {
                encoded.trim_end_matches('=').to_owned()
            } else {
                encoded
            };
            HeaderValue::try_from(encoded).unwrap()
        }
        // Truncated base64 of a real status.
        _ => {
            let status = tonic_types::pb::Status {
                code: 8,
                message: String::new(),
                details: vec![],
            };
            let mut encoded = b64.encode(status.encode_to_vec());
            encoded.truncate(rng.random_range(0..=encoded.len()));
            HeaderValue::try_from(encoded).unwrap()
        }
    }
}

fn pushback(rng: &mut StdRng) -> HeaderValue {
    match rng.random_range(0..4) {
        0 => HeaderValue::from(rng.random_range(0u64..200)),
        1 => HeaderValue::from_static(pick(
            rng,
            &[
                "-1",
                "xxx",
                "",
                "1.5",
                "+5",
                "-0",
                "-00",
                "+",
                "+-1",
                "4000000000",
                "18446744073709551615",
                "99999999999999999999999",
                " 10",
            ],
        )),
        2 => HeaderValue::from(rng.random::<i64>()),
        _ => header_bytes(rng, 8),
    }
}

fn metadata(rng: &mut StdRng) -> Vec<(HeaderName, HeaderValue)> {
    let mut headers = Vec::new();
    if rng.random_bool(0.85) {
        headers.push((HeaderName::from_static("grpc-status"), grpc_status(rng)));
        if rng.random_bool(0.05) {
            headers.push((HeaderName::from_static("grpc-status"), grpc_status(rng)));
        }
    }
    if rng.random_bool(0.5) {
        let ct = match rng.random_range(0..6) {
            0..=2 => HeaderValue::from_static("application/grpc"),
            3 => HeaderValue::from_static("application/grpc+proto"),
            4 => HeaderValue::from_static("text/html"),
            _ => header_bytes(rng, 20),
        };
        headers.push((http::header::CONTENT_TYPE, ct));
    }
    if rng.random_bool(0.4) {
        headers.push((
            HeaderName::from_static("grpc-status-details-bin"),
            status_details(rng),
        ));
    }
    if rng.random_bool(0.3) {
        headers.push((
            HeaderName::from_static("grpc-retry-pushback-ms"),
            pushback(rng),
        ));
        if rng.random_bool(0.1) {
            headers.push((
                HeaderName::from_static("grpc-retry-pushback-ms"),
                pushback(rng),
            ));
        }
    }
    if rng.random_bool(0.3) {
        headers.push((
            HeaderName::from_static("grpc-message"),
            header_bytes(rng, 40),
        ));
    }
    if rng.random_bool(0.3) {
        headers.push((
            HeaderName::from_static("x-instance-id"),
            header_bytes(rng, 200),
        ));
    }
    headers
}

fn http_status(rng: &mut StdRng) -> u16 {
    match rng.random_range(0..8) {
        0..=4 => 200,
        5 => pick(rng, &[400u16, 401, 403, 404, 429, 500, 502, 503, 504]),
        _ => rng.random_range(100..1000),
    }
}

fn answer(rng: &mut StdRng, may_hang: bool, may_stall: bool) -> Answer {
    match rng.random_range(0..20) {
        0..=13 => {
            let body = match rng.random_range(0..5) {
                0 | 1 => BodyPlan::Empty,
                2 => BodyPlan::Chunks(rng.random_range(1..4)),
                3 => BodyPlan::ChunksThenTrailers(rng.random_range(0..3), metadata(rng)),
                _ if may_stall => BodyPlan::Stall,
                _ => BodyPlan::Empty,
            };
            Answer::Response {
                status: http_status(rng),
                headers: metadata(rng),
                body,
            }
        }
        14 | 15 => Answer::Transport,
        16 => Answer::Timer,
        17 => Answer::Status(rng.random_range(0..17)),
        _ if may_hang => Answer::Never,
        _ => Answer::Transport,
    }
}

fn caller_timeout(rng: &mut StdRng) -> Option<HeaderValue> {
    match rng.random_range(0..6) {
        0 | 1 => None,
        2 | 3 => {
            let unit = pick(rng, &["m", "m", "S", "u", "n", "M", "H"]);
            let n: u64 = match unit {
                "m" => rng.random_range(0..3000),
                "S" => rng.random_range(0..5),
                "u" => rng.random_range(0..3_000_000),
                "n" => rng.random_range(0..99_999_999),
                _ => rng.random_range(0..3),
            };
            Some(HeaderValue::try_from(format!("{n}{unit}")).unwrap())
        }
        4 => Some(HeaderValue::from_static(pick(
            rng,
            &[
                "",
                "m",
                "100",
                "123456789m",
                "1.5S",
                "-1S",
                "10x",
                "99999999H",
                " 5m",
            ],
        ))),
        _ => Some(header_bytes(rng, 10)),
    }
}

/// The deadline a valid `grpc-timeout` sets, read independently of the layer.
fn valid_timeout(value: &HeaderValue) -> Option<Duration> {
    let s = value.to_str().ok()?;
    let (digits, unit) = s.split_at(s.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Whether an answer is final by the plain rules of gRPC's status codes, with the
/// default retryable set: no retry may follow it. Answers whose fate depends
/// on more (RetryInfo, deadline room) are not judged here.
fn clearly_final(answer: &Answer) -> bool {
    let Answer::Response {
        status, headers, ..
    } = answer
    else {
        return matches!(answer, Answer::Status(c) if ![4, 8, 14].contains(c));
    };
    let get = |name: &str| headers.iter().find(|(k, _)| k == name).map(|(_, v)| v);
    if let Some(value) = get("grpc-retry-pushback-ms") {
        let all: Vec<_> = headers
            .iter()
            .filter(|(k, _)| k == "grpc-retry-pushback-ms")
            .collect();
        // A non-negative integer, as gRPC's clients read one: a sign may
        // lead, and "-0" is zero.
        let text = value.to_str().unwrap_or("x");
        let (negative, digits) = match text.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, text.strip_prefix('+').unwrap_or(text)),
        };
        let plain = !digits.is_empty()
            && digits.bytes().all(|d| d.is_ascii_digit())
            && !(negative && digits.bytes().any(|d| d != b'0'));
        let canonical_code = get("grpc-status")
            .is_some_and(|v| ["4", "8", "14"].contains(&v.to_str().unwrap_or("")));
        if canonical_code && (all.len() > 1 || !plain) {
            return true;
        }
    }
    // A message tonic's client cannot decode makes any code UNKNOWN: final.
    if let (Some(code), Some(message)) = (get("grpc-status"), get("grpc-message")) {
        let mut both = http::HeaderMap::new();
        both.insert("grpc-status", code.clone());
        both.insert("grpc-message", message.clone());
        if tonic::Status::from_header_map(&both).map(|s| s.code()) == Some(tonic::Code::Unknown) {
            return true;
        }
    }
    match get("grpc-status") {
        Some(v) => {
            let canonical: Vec<String> = (0..=16).map(|c| c.to_string()).collect();
            match v.to_str() {
                Ok(s) if canonical.iter().any(|c| c == s) => !["4", "8", "14"].contains(&s),
                // Anything else is UNKNOWN to tonic: final.
                _ => true,
            }
        }
        None => *status == 200 || ![429, 502, 503, 504].contains(status),
    }
}

/// One generated case.
#[derive(Debug)]
struct Case {
    attempts: u32,
    /// The call hedges, with this delay, instead of retrying.
    hedge: Option<Duration>,
    attempt_timeout: Option<Duration>,
    timeout: Option<HeaderValue>,
    plans: Vec<Plan>,
}

fn case(seed: u64) -> Case {
    let mut rng = StdRng::seed_from_u64(seed);
    let attempts = rng.random_range(1..=5);
    let hedge = (attempts > 1 && rng.random_bool(0.3)).then(|| rng.random_range(0..60) * MS);
    let attempt_timeout = rng.random_bool(0.3).then(|| rng.random_range(0..400) * MS);
    let timeout = caller_timeout(&mut rng);
    // Servers may hang only where a limit the harness can wait for ends the
    // call (an 11,000-year `99999999H` deadline would, but not in time).
    let has_deadline = timeout
        .as_ref()
        .and_then(valid_timeout)
        .is_some_and(|d| d < Duration::from_secs(3600));
    let may_hang = has_deadline || attempt_timeout.is_some();
    let plans = (0..attempts)
        .map(|_| Plan {
            ready: match rng.random_range(0..12) {
                0 => Readiness::Fail,
                1 | 2 => Readiness::After(rng.random_range(0..500) * MS),
                _ => Readiness::Now,
            },
            delay: match rng.random_range(0..3) {
                0 => Duration::ZERO,
                1 => rng.random_range(0..50) * MS,
                _ => rng.random_range(0..600) * MS,
            },
            answer: answer(&mut rng, may_hang, has_deadline),
        })
        .collect();
    Case {
        attempts,
        hedge,
        attempt_timeout,
        timeout,
        plans,
    }
}

/// Runs one case; panics (naming what broke) if an invariant fails.
async fn run(seed: u64) {
    let case = case(seed);
    let mut policy = RetryPolicy::new(case.attempts, 5 * MS, 200 * MS, 0.2).unwrap();
    if let Some(t) = case.attempt_timeout {
        policy = policy.with_attempt_timeout(t);
    }
    let budget = RetryBudget::new(1000, 0.1).unwrap();
    let layer = match case.hedge {
        Some(delay) => {
            let hedging = HedgePolicy::new(case.attempts, delay)
                .unwrap()
                .with_max_extra_load(None)
                .unwrap()
                .with_settings_of(&policy);
            RetryLayer::new(hedging, budget)
        }
        None => RetryLayer::new(policy, budget),
    };
    let calls = Arc::new(AtomicUsize::new(0));
    let log = Arc::new(Mutex::new(Vec::new()));
    let inner = Scripted {
        plans: Arc::new(Mutex::new(case.plans.iter().cloned().collect())),
        calls: calls.clone(),
        log: log.clone(),
        waiting: None,
    };
    let mut req = Request::builder()
        .method("POST")
        .uri("http://hostile/library.v1.Library/GetBook")
        .header("content-type", "application/grpc")
        .body(Body::new(http_body_util::Full::new(Bytes::from_static(
            b"\0\0\0\0\x01x",
        ))))
        .unwrap();
    if let Some(t) = &case.timeout {
        req.headers_mut().insert("grpc-timeout", t.clone());
    }
    let deadline = case.timeout.as_ref().and_then(valid_timeout);
    let start = Instant::now();

    let outcome = tokio::time::timeout(Duration::from_secs(36_000), async {
        let mut svc = layer.layer(inner);
        let response = match svc.ready().await {
            Ok(svc) => svc.call(req).await,
            Err(e) => Err(e),
        };
        let response = match response {
            Ok(r) => r,
            Err(e) => {
                if std::env::var("FUZZ_DEBUG").is_ok() {
                    eprintln!("error: {e:?}");
                }
                return (None, None);
            }
        };
        let (parts, body) = response.into_parts();
        let trailers = match body.collect().await {
            Ok(collected) => collected.trailers().cloned(),
            Err(_) => None,
        };
        (Some(parts.headers), trailers)
    })
    .await;
    let (headers, trailers) =
        outcome.unwrap_or_else(|_| panic!("seed {seed}: the call hung: {case:?}"));
    let elapsed = start.elapsed();

    // What the caller gets, tonic can read.
    if let Some(h) = &headers {
        let _ = tonic::Status::from_header_map(h);
    }
    if let Some(t) = &trailers {
        let _ = tonic::Status::from_header_map(t);
    }
    let made = calls.load(Ordering::SeqCst);
    HEDGES.fetch_add(layer.metrics().hedges() as usize, Ordering::Relaxed);
    assert!(
        made <= case.attempts as usize,
        "seed {seed}: {made} attempts with max_attempts {}: {case:?}",
        case.attempts
    );
    if case.hedge.is_some() {
        // A hedged call's attempts overlap: none may start once an answer
        // that commits has come (and was seen: not cut by a limit first).
        let log = log.lock().unwrap();
        // An attempt's own timeout runs from when the layer made it, which
        // may be long before it was sent (it waits for a ready service under
        // that timeout): an answer that came once the call's first
        // attempt timeout had passed may have been cut.
        let cut = |_started: Instant, at: Instant| {
            case.attempt_timeout.is_some_and(|t| at >= start + t)
                || deadline.is_some_and(|d| at >= start + d)
        };
        let commit = log
            .iter()
            .filter(|(started, at, commits)| *commits && !cut(*started, *at))
            .map(|(_, at, _)| *at)
            .min();
        if let Some(commit) = commit {
            assert!(
                log.iter().all(|(started, _, _)| *started <= commit),
                "seed {seed}: an attempt started after the call committed: {case:?}"
            );
        }
    } else {
        assert_retries_follow_the_answers(seed, &case, made);
    }
    if let Some(deadline) = deadline {
        // tokio's timers fire on the first millisecond tick at or after their
        // instant: the layer never cuts early, so it may end up to 1 ms late.
        assert!(
            elapsed <= deadline + MS,
            "seed {seed}: the call took {elapsed:?} past its {deadline:?} deadline: {case:?}"
        );
    }
    // Only a service that fails the caller's own `poll_ready` makes an error.
    assert!(
        headers.is_some() || matches!(case.plans[0].ready, Readiness::Fail),
        "seed {seed}: the call failed instead of answering: {case:?}"
    );
}

/// A retried call's attempts follow the plans' answers: plan `i` answers the
/// `i`-th attempt sent; a readiness failure ends the call; a final answer
/// allows no attempt after it.
fn assert_retries_follow_the_answers(seed: u64, case: &Case, made: usize) {
    let limit = case
        .plans
        .iter()
        .enumerate()
        .find_map(|(i, p)| {
            // An answer slower than the attempt's timeout is never seen.
            let wait = match p.ready {
                Readiness::After(d) => d,
                _ => Duration::ZERO,
            };
            let seen = case.attempt_timeout.is_none_or(|t| wait + p.delay < t);
            match p.ready {
                Readiness::Fail => Some(i),
                _ if seen && clearly_final(&p.answer) => Some(i + 1),
                _ => None,
            }
        })
        .unwrap_or(case.plans.len());
    assert!(
        made <= limit,
        "seed {seed}: {made} attempts, but attempt {limit} ended the call: {case:?}"
    );
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn hostile_servers_never_break_the_promises() {
    let cases = env_u64("TONIC_RETRY_FUZZ_CASES", 100_000);
    let first = env_u64("TONIC_RETRY_FUZZ_SEED", 0);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    let started = std::time::Instant::now();
    runtime.block_on(async {
        for seed in first..first + cases {
            let task = tokio::spawn(run(seed));
            if let Err(e) = task.await {
                eprintln!("seed {seed} failed: {:?}", case(seed));
                if e.is_panic() {
                    std::panic::resume_unwind(e.into_panic());
                }
                panic!("seed {seed}: {e}");
            }
        }
    });
    println!(
        "{cases} hostile cases (seeds {first}..{}) in {:?}, {} hedges sent",
        first + cases,
        started.elapsed(),
        HEDGES.load(Ordering::Relaxed)
    );
}
