//! Server-side fault injection, to rehearse retry settings against the
//! failures they are meant for (cargo feature `fault`).
//!
//! [`FaultLayer`] wraps any gRPC server — a tonic `Server`, or any
//! `tower::Service<http::Request<B>>` answering `http::Response<RB>` — and,
//! by rules you set, answers some requests with a failure instead of (or after)
//! calling the service. It knows nothing of your protobuf types: faults are
//! gRPC statuses and delays, chosen by method path.
//!
//! Every response carries the instance's id in `x-instance-id`, the header
//! [`RetryPolicy::with_instance_header`](crate::RetryPolicy::with_instance_header)
//! reads by default, and every request is recorded ([`FaultLayer::seen`]).
//!
//! ```no_run
//! use std::time::Duration;
//! use tonic_retry::{fault::Fault, fault::FaultLayer, fault::Rule};
//!
//! # fn main() -> Result<(), tonic_retry::ConfigError> {
//! let faults = FaultLayer::new("instance-a")?
//!     .with(Rule::first(2, Fault::unavailable()))
//!     .with(Rule::rate(0.05, Fault::rate_limited(Duration::from_millis(200)))?)
//!     .with(Rule::always(Fault::lose_response(tonic::Code::Unavailable)).on_method("ReserveStock"));
//! // tonic::transport::Server::builder().layer(faults.clone()).add_service(...)
//! # let _ = faults;
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http::{HeaderName, HeaderValue, Request, Response};
use pin_project_lite::pin_project;
use rand::Rng;
use tokio::time::Sleep;
use tonic::Code;
use tonic_types::{ErrorDetails, StatusExt};
use tower_layer::Layer;
use tower_service::Service;

use crate::deadline::GRPC_TIMEOUT;
use crate::error::ConfigError;
use crate::marks::{ALREADY_TRIED, IDEMPOTENCY_KEY, INSTANCE_ID, PREVIOUS_ATTEMPTS};
use crate::status::{GRPC_RETRY_PUSHBACK, code_name};

/// The most requests [`FaultLayer::seen`] keeps; later ones are only counted.
pub const SEEN_LIMIT: usize = 100_000;

/// One injected failure: what to answer, and how long to wait first.
#[derive(Clone, Debug)]
pub struct Fault {
    delay: Duration,
    action: Action,
}

#[derive(Clone, Debug)]
enum Action {
    /// Pass the request to the service.
    Pass,
    /// Answer a status without calling the service.
    Status {
        code: Code,
        retry_delay: Option<Option<Duration>>,
        pushback: Option<HeaderValue>,
    },
    /// Call the service (so a write is applied), drop its answer, answer `code`.
    LoseResponse(Code),
}

impl Fault {
    /// Answer `code` (Trailers-Only, as a tonic server sends early errors).
    pub fn status(code: Code) -> Self {
        Self {
            delay: Duration::ZERO,
            action: Action::Status {
                code,
                retry_delay: None,
                pushback: None,
            },
        }
    }

    /// `UNAVAILABLE`: a restarting or overloaded instance.
    pub fn unavailable() -> Self {
        Self::status(Code::Unavailable)
    }

    /// `RESOURCE_EXHAUSTED` with `google.rpc.RetryInfo { retry_delay }`: a rate
    /// limit with a time to come back.
    pub fn rate_limited(retry_delay: Duration) -> Self {
        Self {
            delay: Duration::ZERO,
            action: Action::Status {
                code: Code::ResourceExhausted,
                retry_delay: Some(Some(retry_delay)),
                pushback: None,
            },
        }
    }

    /// Pass the request on after `delay`: a slow instance.
    pub fn slow(delay: Duration) -> Self {
        Self {
            delay,
            action: Action::Pass,
        }
    }

    /// Apply the request (call the service), then lose the response: the
    /// caller sees `code` although the work was done.
    pub fn lose_response(code: Code) -> Self {
        Self {
            delay: Duration::ZERO,
            action: Action::LoseResponse(code),
        }
    }

    /// Adds `grpc-retry-pushback-ms: value` to the failure. The value is sent
    /// as given, so malformed pushback can be rehearsed too.
    pub fn with_pushback(mut self, value: HeaderValue) -> Self {
        if let Action::Status { pushback, .. } = &mut self.action {
            *pushback = Some(value);
        }
        self
    }

    /// Waits `delay` before acting: a failure that takes time to arrive.
    pub fn after(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    fn label(&self) -> &'static str {
        match &self.action {
            Action::Pass => "OK",
            Action::Status { code, .. } | Action::LoseResponse(code) => code_name(*code),
        }
    }
}

/// When a [`Fault`] applies.
#[derive(Debug)]
pub struct Rule {
    fault: Fault,
    when: When,
    method: Option<String>,
}

#[derive(Debug)]
enum When {
    First(AtomicU64),
    Every { n: u64, seen: AtomicU64 },
    Rate(f64),
    Always,
}

impl Rule {
    /// The fault for the first `n` matching requests.
    pub fn first(n: u64, fault: Fault) -> Self {
        Self::new(When::First(AtomicU64::new(n)), fault)
    }

    /// The fault for every `n`th matching request: the 1st, the `n + 1`th, and
    /// so on. `every(2, ..)` fails the first attempt of each call of a client
    /// that calls one at a time and retries once: a deterministic rehearsal.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] if `n` is zero.
    pub fn every(n: u64, fault: Fault) -> Result<Self, ConfigError> {
        if n == 0 {
            return Err(ConfigError::new("n", "must be at least 1, got 0"));
        }
        Ok(Self::new(
            When::Every {
                n,
                seen: AtomicU64::new(0),
            },
            fault,
        ))
    }

    /// The fault for each matching request with probability `rate`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] unless `rate` is a number within `0.0..=1.0`.
    pub fn rate(rate: f64, fault: Fault) -> Result<Self, ConfigError> {
        if !(0.0..=1.0).contains(&rate) {
            return Err(ConfigError::new(
                "rate",
                format!("must be a probability within 0.0..=1.0, got {rate}"),
            ));
        }
        Ok(Self::new(When::Rate(rate), fault))
    }

    /// The fault for every matching request.
    pub fn always(fault: Fault) -> Self {
        Self::new(When::Always, fault)
    }

    /// Matches only requests whose path ends with `/{method}`, e.g.
    /// `"ReserveStock"`.
    pub fn on_method(mut self, method: &str) -> Self {
        self.method = Some(format!("/{method}"));
        self
    }

    fn new(when: When, fault: Fault) -> Self {
        Self {
            fault,
            when,
            method: None,
        }
    }

    fn fires(&self, path: &str) -> bool {
        if self.method.as_deref().is_some_and(|m| !path.ends_with(m)) {
            return false;
        }
        match &self.when {
            When::Always => true,
            When::Rate(p) => rand::rng().random_bool(*p),
            When::Every { n, seen } => seen.fetch_add(1, Ordering::Relaxed).is_multiple_of(*n),
            When::First(left) => left
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok(),
        }
    }
}

/// One request as the instance saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    /// The request path, e.g. `/library.v1.Library/GetBook`.
    pub path: String,
    /// `x-idempotency-key`, if sent.
    pub idempotency_key: Option<String>,
    /// `grpc-previous-rpc-attempts`, if sent.
    pub previous_attempts: Option<u32>,
    /// `grpc-timeout`, as sent.
    pub grpc_timeout: Option<String>,
    /// `x-already-tried`, as sent.
    pub already_tried: Option<String>,
    /// What this layer did: `"OK"` for a request passed on (whatever the
    /// service then answered), else the injected code's name.
    pub injected: &'static str,
}

struct State {
    instance: HeaderValue,
    rules: Mutex<Vec<Rule>>,
    requests: AtomicU64,
    seen: Mutex<Vec<Seen>>,
}

/// Injects [`Fault`]s into a gRPC server by [`Rule`]s; see the [module docs](self).
///
/// Clones share rules and records, so a test can keep one to change the rules
/// while the server runs.
#[derive(Clone)]
pub struct FaultLayer {
    state: Arc<State>,
}

impl FaultLayer {
    /// A layer for the instance named `instance` (sent in `x-instance-id`),
    /// with no rules yet: every request passes.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] if `instance` is not a valid header value.
    pub fn new(instance: &str) -> Result<Self, ConfigError> {
        let instance = HeaderValue::from_str(instance).map_err(|_| {
            ConfigError::new(
                "instance",
                format!("must be visible ASCII, got {instance:?}"),
            )
        })?;
        Ok(Self {
            state: Arc::new(State {
                instance,
                rules: Mutex::new(Vec::new()),
                requests: AtomicU64::new(0),
                seen: Mutex::new(Vec::new()),
            }),
        })
    }

    /// Adds a rule; the first rule that fires for a request decides it.
    #[must_use]
    pub fn with(self, rule: Rule) -> Self {
        self.push(rule);
        self
    }

    /// Adds a rule to a running layer.
    pub fn push(&self, rule: Rule) {
        lock(&self.state.rules).push(rule);
    }

    /// Removes every rule: from now on every request passes.
    pub fn clear(&self) {
        lock(&self.state.rules).clear();
    }

    /// The instance id this layer reports.
    pub fn instance(&self) -> &str {
        self.state.instance.to_str().unwrap_or_default()
    }

    /// How many requests reached this instance.
    pub fn requests(&self) -> u64 {
        self.state.requests.load(Ordering::Relaxed)
    }

    /// The requests this instance saw (the first [`SEEN_LIMIT`]), oldest first.
    pub fn seen(&self) -> Vec<Seen> {
        lock(&self.state.seen).clone()
    }

    fn admit<B>(&self, req: &Request<B>) -> Fault {
        let path = req.uri().path();
        let fault = lock(&self.state.rules)
            .iter()
            .find(|rule| rule.fires(path))
            .map(|rule| rule.fault.clone())
            .unwrap_or(Fault::slow(Duration::ZERO));
        self.state.requests.fetch_add(1, Ordering::Relaxed);
        let mut seen = lock(&self.state.seen);
        if seen.len() < SEEN_LIMIT {
            let header = |name: &HeaderName| {
                req.headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
            };
            seen.push(Seen {
                path: path.to_owned(),
                idempotency_key: header(&IDEMPOTENCY_KEY),
                previous_attempts: header(&PREVIOUS_ATTEMPTS).and_then(|v| v.parse().ok()),
                grpc_timeout: header(&GRPC_TIMEOUT),
                already_tried: header(&ALREADY_TRIED),
                injected: fault.label(),
            });
        }
        fault
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl fmt::Debug for FaultLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultLayer")
            .field("instance", &self.state.instance)
            .field("rules", &*lock(&self.state.rules))
            .field("requests", &self.requests())
            .finish()
    }
}

impl<S> Layer<S> for FaultLayer {
    type Service = FaultService<S>;

    fn layer(&self, inner: S) -> FaultService<S> {
        FaultService {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service made by [`FaultLayer`].
#[derive(Clone, Debug)]
pub struct FaultService<S> {
    inner: S,
    layer: FaultLayer,
}

impl<S, B, RB> Service<Request<B>> for FaultService<S>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    RB: Default,
{
    type Response = Response<RB>;
    type Error = S::Error;
    type Future = FaultFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let fault = self.layer.admit(&req);
        // NOTE: the readied instance serves this request (possibly after a
        // delay); a fresh clone stays behind for the next.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        FaultFuture {
            // NOTE: no timer for no delay: a zero-length `Sleep` still waits for
            // the timer's next tick, about a millisecond.
            state: FaultState::Waiting {
                sleep: (!fault.delay.is_zero()).then(|| tokio::time::sleep(fault.delay)),
            },
            inner: Some(inner),
            req: Some(req),
            action: fault.action,
            instance: self.layer.state.instance.clone(),
        }
    }
}

pin_project! {
    /// Response future of [`FaultService`].
    pub struct FaultFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        state: FaultState<S::Future>,
        inner: Option<S>,
        req: Option<Request<B>>,
        action: Action,
        instance: HeaderValue,
    }
}

pin_project! {
    #[project = FaultStateProj]
    enum FaultState<F> {
        Waiting { #[pin] sleep: Option<Sleep> },
        Calling { #[pin] future: F },
    }
}

impl<S, B> fmt::Debug for FaultFuture<S, B>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultFuture")
            .field("action", &self.action)
            .finish_non_exhaustive()
    }
}

fn injected<RB: Default>(
    code: Code,
    retry_delay: Option<Option<Duration>>,
    pushback: Option<HeaderValue>,
) -> Response<RB> {
    let message = format!("injected {}", code_name(code));
    let status = match retry_delay {
        Some(delay) => {
            tonic::Status::with_error_details(code, message, ErrorDetails::with_retry_info(delay))
        }
        None => tonic::Status::new(code, message),
    };
    let mut response = status.into_http::<RB>();
    if let Some(value) = pushback {
        response.headers_mut().insert(GRPC_RETRY_PUSHBACK, value);
    }
    response
}

impl<S, B, RB> Future for FaultFuture<S, B>
where
    S: Service<Request<B>, Response = Response<RB>>,
    RB: Default,
{
    type Output = Result<Response<RB>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                FaultStateProj::Waiting { sleep } => {
                    if let Some(sleep) = sleep.as_pin_mut() {
                        ready!(sleep.poll(cx));
                    }
                    let response = match &*this.action {
                        Action::Status {
                            code,
                            retry_delay,
                            pushback,
                        } => injected(*code, *retry_delay, pushback.clone()),
                        Action::Pass | Action::LoseResponse(_) => {
                            let mut inner = this.inner.take().expect("polled after completion");
                            let req = this.req.take().expect("polled after completion");
                            this.state.set(FaultState::Calling {
                                future: inner.call(req),
                            });
                            continue;
                        }
                    };
                    return Poll::Ready(Ok(stamp(response, this.instance)));
                }
                FaultStateProj::Calling { future } => {
                    let result = ready!(future.poll(cx));
                    let response = match (&*this.action, result) {
                        (Action::LoseResponse(code), Ok(_applied)) => injected(*code, None, None),
                        (_, result) => result?,
                    };
                    return Poll::Ready(Ok(stamp(response, this.instance)));
                }
            }
        }
    }
}

fn stamp<RB>(mut response: Response<RB>, instance: &HeaderValue) -> Response<RB> {
    response.headers_mut().insert(INSTANCE_ID, instance.clone());
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::ServiceExt;

    type Body = tonic::body::Body;

    fn echo()
    -> impl Service<Request<Body>, Response = Response<Body>, Error = tower::BoxError> + Clone {
        tower::service_fn(|_req: Request<Body>| async {
            Ok::<_, tower::BoxError>(tonic::Status::new(Code::Ok, "").into_http::<Body>())
        })
    }

    fn req(path: &str) -> Request<Body> {
        Request::builder().uri(path).body(Body::empty()).unwrap()
    }

    fn code(r: &Response<Body>) -> &str {
        r.headers()["grpc-status"].to_str().unwrap()
    }

    #[tokio::test]
    async fn first_n_then_pass_with_the_instance_stamped() {
        let layer = FaultLayer::new("a")
            .unwrap()
            .with(Rule::first(2, Fault::unavailable()));
        let svc = layer.layer(echo());
        for want in ["14", "14", "0", "0"] {
            let r = svc.clone().oneshot(req("/x.Y/Get")).await.unwrap();
            assert_eq!(code(&r), want);
            assert_eq!(r.headers()["x-instance-id"], "a");
        }
        assert_eq!(layer.requests(), 4);
        let injected: Vec<_> = layer.seen().iter().map(|s| s.injected).collect();
        assert_eq!(injected, ["UNAVAILABLE", "UNAVAILABLE", "OK", "OK"]);
    }

    #[tokio::test]
    async fn every_nth_request() {
        let layer = FaultLayer::new("a")
            .unwrap()
            .with(Rule::every(3, Fault::unavailable()).unwrap());
        let svc = layer.layer(echo());
        let mut got = Vec::new();
        for _ in 0..7 {
            let r = svc.clone().oneshot(req("/x.Y/Get")).await.unwrap();
            got.push(code(&r).to_owned());
        }
        assert_eq!(got, ["14", "0", "0", "14", "0", "0", "14"]);
    }

    #[tokio::test]
    async fn rules_can_target_one_method() {
        let layer = FaultLayer::new("a")
            .unwrap()
            .with(Rule::always(Fault::status(Code::Aborted)).on_method("Reserve"));
        let svc = layer.layer(echo());
        let r = svc.clone().oneshot(req("/x.Y/Reserve")).await.unwrap();
        assert_eq!(code(&r), "10");
        let r = svc.clone().oneshot(req("/x.Y/Get")).await.unwrap();
        assert_eq!(code(&r), "0");
    }

    #[tokio::test]
    async fn rate_limits_carry_retry_info_and_pushback_passes_as_given() {
        let layer = FaultLayer::new("a")
            .unwrap()
            .with(Rule::first(
                1,
                Fault::rate_limited(Duration::from_millis(300)),
            ))
            .with(Rule::first(
                1,
                Fault::unavailable().with_pushback(HeaderValue::from_static("-1")),
            ));
        let svc = layer.layer(echo());
        let r = svc.clone().oneshot(req("/x.Y/Get")).await.unwrap();
        let status = tonic::Status::from_header_map(r.headers()).unwrap();
        assert_eq!(status.code(), Code::ResourceExhausted);
        let info = status.get_details_retry_info().expect("RetryInfo");
        assert_eq!(info.retry_delay, Some(Duration::from_millis(300)));
        let r = svc.clone().oneshot(req("/x.Y/Get")).await.unwrap();
        assert_eq!(r.headers()["grpc-retry-pushback-ms"], "-1");
    }

    #[tokio::test]
    async fn a_lost_response_still_applies_the_request() {
        let applied = Arc::new(AtomicU64::new(0));
        let count = applied.clone();
        let inner = tower::service_fn(move |_req: Request<Body>| {
            count.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, tower::BoxError>(tonic::Status::new(Code::Ok, "").into_http::<Body>()) }
        });
        let layer = FaultLayer::new("a")
            .unwrap()
            .with(Rule::always(Fault::lose_response(Code::Unavailable)));
        let r = layer.layer(inner).oneshot(req("/x.Y/Write")).await.unwrap();
        assert_eq!(code(&r), "14");
        assert_eq!(applied.load(Ordering::SeqCst), 1, "the write happened");
    }

    #[tokio::test(start_paused = true)]
    async fn delays_are_waited() {
        let layer = FaultLayer::new("a")
            .unwrap()
            .with(Rule::always(Fault::slow(Duration::from_millis(300))));
        let start = tokio::time::Instant::now();
        let r = layer.layer(echo()).oneshot(req("/x.Y/Get")).await.unwrap();
        assert_eq!(code(&r), "0");
        assert_eq!(start.elapsed(), Duration::from_millis(300));
    }

    #[test]
    fn bad_settings_are_errors() {
        assert_eq!(
            Rule::rate(1.5, Fault::unavailable()).unwrap_err().field(),
            "rate"
        );
        assert_eq!(
            Rule::rate(f64::NAN, Fault::unavailable())
                .unwrap_err()
                .field(),
            "rate"
        );
        assert_eq!(FaultLayer::new("bad\nid").unwrap_err().field(), "instance");
        assert_eq!(
            Rule::every(0, Fault::unavailable()).unwrap_err().field(),
            "n"
        );
    }
}
