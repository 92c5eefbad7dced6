//! gRPC's standard client metrics, on OpenTelemetry (feature `opentelemetry`).
//!
//! gRPC's own clients (grpc-go, grpc-java, C-core) export the metrics of gRFC
//! A66 and A96 under fixed names, so dashboards and alerts carry from one
//! client to another. [`GrpcMetrics`] records them for the calls through a
//! layer, on a [`Meter`] of yours:
//!
//! | metric | kind, unit | attributes | buckets |
//! |---|---|---|---|
//! | `grpc.client.attempt.started` | counter, `{attempt}` | `grpc.method`, `grpc.target` | |
//! | `grpc.client.attempt.duration` | histogram, `s` | `grpc.method`, `grpc.target`, `grpc.status` | A66 latency |
//! | `grpc.client.call.duration` | histogram, `s` | `grpc.method`, `grpc.target`, `grpc.status` | A66 latency |
//! | `grpc.client.call.retries` | histogram, `{retry}` | `grpc.method`, `grpc.target` | 1, 2, 3, 4, 5 |
//! | `grpc.client.call.transparent_retries` | histogram, `{transparent_retry}` | `grpc.method`, `grpc.target` | 1, 2, 3, 4, 5, 10 |
//! | `grpc.client.call.hedges` | histogram, `{hedge}` | `grpc.method`, `grpc.target` | 1, 2, 3, 4, 5 |
//! | `grpc.client.call.retry_delay` | histogram, `s` | `grpc.method`, `grpc.target` | A66 latency |
//! | `tonic_retry.budget.tokens` | gauge, `{token}` | `grpc.target` | |
//! | `tonic_retry.retries.refused` | counter, `{retry}` | `grpc.target`, `reason` | |
//!
//! * An attempt starts when it is sent to the inner service, and ends when its
//!   response ends: at its trailers for a streamed one (a server stream is
//!   measured to its end, not to its headers), at once for an answer that is
//!   only a status, or when the layer cuts it or no longer needs it
//!   (`CANCELLED`, for a hedge that lost).
//! * A call ends when the response the caller gets ends; a call the caller
//!   drops first ends `CANCELLED`. Its retry counts are recorded then, when
//!   not zero (A96): `retries` counts retries the policy sent (after a
//!   connection refused or dropped too: the policy paces and pays for
//!   those), `hedges` the hedges, `transparent_retries` gRPC's transparent
//!   retries, each the one attempt a call sends again at once because the
//!   server's HTTP/2 library refused the stream before its application saw
//!   it (`REFUSED_STREAM`, or a graceful `GOAWAY` that did not take it). `retry_delay` is the time the call had no attempt in
//!   flight after its first (backoffs, server-given delays, waiting for a
//!   ready service), recorded for calls that retried or hedged.
//! * `grpc.status` is the code's name as gRPC spells it (`OK`,
//!   `UNAVAILABLE`, ...), read as tonic's client reads it. An HTTP error or a
//!   page that is not gRPC (a proxy's answer) is the status it maps to, as
//!   the caller is given it (see the crate's "What is retried").
//! * What only tonic's client sees is not seen here: a response it refuses
//!   to decode (a message over its `max_decoding_message_size`, bad
//!   protobuf, an unsupported `grpc-encoding`) makes it drop the body and
//!   report `OUT_OF_RANGE`, `INTERNAL` or `UNIMPLEMENTED`, which the layer
//!   cannot tell from a caller that stopped reading: such calls are recorded
//!   `CANCELLED`. So is a call whose body is taken apart with
//!   [`ResponseBody::into_inner`](crate::ResponseBody::into_inner).
//! * `grpc.method` is bounded, as A66 asks: a method is named
//!   (`package.Service/Method`) only if you list it
//!   ([`with_methods`](GrpcMetrics::with_methods)) or let any well-formed
//!   method be named up to a number of distinct ones
//!   ([`with_any_method`](GrpcMetrics::with_any_method)); every other path a
//!   request carries is `other`.
//! * `tonic_retry.retries.refused` counts retries the layer decided and did
//!   not send, by `reason`: `budget` (no token; `throttle` with a
//!   [`RetryThrottle`](crate::budgets::RetryThrottle)) or `deadline` (no time left).
//!   The gauge is the budget's balance, for budgets that know it, set each
//!   time a call through the layer moves it (one series per `grpc.target`:
//!   layers with budgets of their own want targets of their own).
//!
//! The metrics are in the layer's type: [`RetryLayer::with_grpc_metrics`]
//! returns a `RetryLayer<Bu, B, Recorder>`, whose services are
//! `RetryService<S, Bu, B, Recorder>` and whose bodies are
//! `ResponseBody<RB, Recorder>`. A layer given none records nothing and
//! checks nothing: with [`NoMetrics`](crate::metrics::NoMetrics), its default, a call's
//! trace is of no size and every step of it compiles to nothing, so its call
//! path is the same code whether this feature is compiled or not
//! (`cargo bench --bench instructions`, with and without the feature; `cargo
//! bench --bench instructions_otel` measures what the metrics cost). A layer
//! whose metrics are chosen at run time is a `RetryLayer<Bu, B,
//! Option<Recorder>>`
//! ([`with_optional_grpc_metrics`](crate::RetryLayer::with_optional_grpc_metrics)).
//!
//! A layer's clones, and the services it makes, record with it; a clone
//! taken before it was given metrics is a layer without them, whose calls,
//! refusals included, are not recorded (it shares the budget, and the gauge
//! is set again at the next move of a call that records).
//!
//! [`RetryLayer::with_grpc_metrics`]: crate::RetryLayer::with_grpc_metrics

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Gauge, Histogram, Meter};
use tokio::time::Instant;
use tonic::Code;

use crate::error::ConfigError;
use crate::metrics::Event;
use crate::status::code_name;
use crate::trace::{AttemptRecord, CallRecord, Gauged, Metrics, Record};

/// A66's bucket boundaries for latencies, in seconds.
pub const LATENCY_BUCKETS: [f64; 41] = [
    0.0, 0.00001, 0.00005, 0.0001, 0.0003, 0.0006, 0.0008, 0.001, 0.002, 0.003, 0.004, 0.005,
    0.006, 0.008, 0.01, 0.013, 0.016, 0.02, 0.025, 0.03, 0.04, 0.05, 0.065, 0.08, 0.1, 0.13, 0.16,
    0.2, 0.25, 0.3, 0.4, 0.5, 0.65, 0.8, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0,
];

/// A96's bucket boundaries for retries and hedges per call.
pub const RETRY_BUCKETS: [f64; 5] = [1.0, 2.0, 3.0, 4.0, 5.0];

/// A96's bucket boundaries for transparent retries per call.
pub const TRANSPARENT_RETRY_BUCKETS: [f64; 6] = [1.0, 2.0, 3.0, 4.0, 5.0, 10.0];

/// The `grpc.method` of every method not named.
const OTHER: &str = "other";

/// The longest method path named.
const MAX_PATH: usize = 256;

/// gRPC's standard client metrics for the calls through one layer: give it
/// to [`RetryLayer::with_grpc_metrics`](crate::RetryLayer::with_grpc_metrics).
/// See the [module docs](self) for what is recorded.
///
/// ```
/// use opentelemetry::metrics::MeterProvider;
/// use tonic_retry::otel::GrpcMetrics;
/// use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let provider = opentelemetry_sdk::metrics::SdkMeterProvider::default();
/// let meter = provider.meter("library-client");
/// let metrics = GrpcMetrics::new(&meter, "dns:///library.internal:50051")
///     .with_methods(["/library.v1.Library/GetBook", "/library.v1.Library/ListBooks"])?;
/// let layer = RetryLayer::new(RetryPolicy::default(), RetryBudget::new(200, 0.1)?)
///     .with_grpc_metrics(metrics);
/// # let _ = layer;
/// # Ok(())
/// # }
/// ```
pub struct GrpcMetrics {
    meter: Meter,
    target: String,
    named: HashMap<Box<str>, KeyValue>,
    any: usize,
}

impl GrpcMetrics {
    /// Metrics on `meter`, every point with `grpc.target` = `target` (as
    /// A66 says: the channel's target URI, e.g. `dns:///host:port`).
    pub fn new(meter: &Meter, target: impl Into<String>) -> Self {
        Self {
            meter: meter.clone(),
            target: target.into(),
            named: HashMap::new(),
            any: 0,
        }
    }

    /// Names these methods in `grpc.method` (given as the request path,
    /// `/package.Service/Method`, or without its leading slash).
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming `methods` for one that is not a method path.
    pub fn with_methods<I, M>(mut self, methods: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = M>,
        M: AsRef<str>,
    {
        for method in methods {
            let method = method.as_ref();
            let path = if method.starts_with('/') {
                method.to_owned()
            } else {
                format!("/{method}")
            };
            if !is_method_path(&path) {
                return Err(ConfigError::new(
                    "methods",
                    format!("must be method paths such as /package.Service/Method, got {method:?}"),
                ));
            }
            let value = method_value(&path);
            self.named.insert(path.into_boxed_str(), value);
        }
        Ok(self)
    }

    /// Names any well-formed method in `grpc.method`, up to `max` distinct
    /// ones beyond those listed: the rest are `other`, so the attribute
    /// stays bounded whatever paths requests carry.
    #[must_use]
    pub fn with_any_method(mut self, max: usize) -> Self {
        self.any = max;
        self
    }
}

impl fmt::Debug for GrpcMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrpcMetrics")
            .field("target", &self.target)
            .field("methods", &self.named.len())
            .field("any", &self.any)
            .finish_non_exhaustive()
    }
}

/// `/package.Service/Method`: two non-empty parts of letters, digits, `_`
/// and `.` (and `-`, which some services use), within [`MAX_PATH`].
fn is_method_path(path: &str) -> bool {
    let Some(rest) = path.strip_prefix('/') else {
        return false;
    };
    let Some((service, method)) = rest.split_once('/') else {
        return false;
    };
    let part = |p: &str| {
        !p.is_empty()
            && p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    };
    path.len() <= MAX_PATH && part(service) && part(method)
}

/// The `grpc.method` attribute of a well-formed path.
fn method_value(path: &str) -> KeyValue {
    let name: Arc<str> = Arc::from(&path[1..]);
    KeyValue::new("grpc.method", name)
}

/// The instruments of one layer, and how it names methods.
pub(crate) struct Otel {
    attempt_started: Counter<u64>,
    attempt_duration: Histogram<f64>,
    call_duration: Histogram<f64>,
    retries: Histogram<u64>,
    transparent_retries: Histogram<u64>,
    hedges: Histogram<u64>,
    retry_delay: Histogram<f64>,
    target: KeyValue,
    named: HashMap<Box<str>, KeyValue>,
    any: usize,
    seen: RwLock<HashMap<Box<str>, KeyValue>>,
    other: KeyValue,
    /// The budget's balance.
    gauge: Gauge<f64>,
    /// The gauge's series, `target`, as a number to stamp a value set in it.
    series: u64,
    refusals: Refusals,
}

/// Retries refused, by reason.
struct Refusals {
    counter: Counter<u64>,
    budget: [KeyValue; 2],
    deadline: [KeyValue; 2],
}

impl Refusals {
    /// Counts `event` if it is a refused retry.
    fn record(&self, event: Event) {
        let reason = match event {
            Event::RefusedByBudget => &self.budget,
            Event::RefusedByDeadline => &self.deadline,
            _ => return,
        };
        self.counter.add(1, reason);
    }
}

impl GrpcMetrics {
    /// The layer's instruments; `throttle` says its budget is A6's throttle.
    pub(crate) fn build(self, throttle: bool) -> Otel {
        let m = &self.meter;
        let latency = |name: &'static str, description: &'static str| {
            m.f64_histogram(name)
                .with_unit("s")
                .with_description(description)
                .with_boundaries(LATENCY_BUCKETS.to_vec())
                .build()
        };
        let count =
            |name: &'static str, unit: &'static str, description: &'static str, buckets: &[f64]| {
                m.u64_histogram(name)
                    .with_unit(unit)
                    .with_description(description)
                    .with_boundaries(buckets.to_vec())
                    .build()
            };
        // A fixed hasher: recorders of one target stamp its series alike.
        let series = BuildHasherDefault::<DefaultHasher>::default().hash_one(&self.target);
        let target = KeyValue::new("grpc.target", self.target);
        // NOTE: a synchronous gauge, set when the balance moves, rather than
        // an observable one: OpenTelemetry keeps an observable instrument's
        // callback as long as its meter provider lives, so a layer built per
        // backend or per reload would leave one behind each time.
        let gauge = m
            .f64_gauge("tonic_retry.budget.tokens")
            .with_unit("{token}")
            .with_description("Tokens in the retry budget of the layer.")
            .build();
        let refused = m
            .u64_counter("tonic_retry.retries.refused")
            .with_unit("{retry}")
            .with_description("Retries the layer decided and did not send, by reason.")
            .build();
        let reason = |r: &'static str| [target.clone(), KeyValue::new("reason", r)];
        let refusals = Refusals {
            counter: refused,
            budget: reason(if throttle { "throttle" } else { "budget" }),
            deadline: reason("deadline"),
        };
        Otel {
            attempt_started: m
                .u64_counter("grpc.client.attempt.started")
                .with_unit("{attempt}")
                .with_description("Number of client call attempts started.")
                .build(),
            attempt_duration: latency(
                "grpc.client.attempt.duration",
                "End-to-end time taken to complete a client call attempt.",
            ),
            call_duration: latency(
                "grpc.client.call.duration",
                "Time taken by gRPC to complete an RPC from application's perspective.",
            ),
            retries: count(
                "grpc.client.call.retries",
                "{retry}",
                "Number of retries during the client call. If there were no retries, 0 is not reported.",
                &RETRY_BUCKETS,
            ),
            transparent_retries: count(
                "grpc.client.call.transparent_retries",
                "{transparent_retry}",
                "Number of transparent retries during the client call. If there were no transparent retries, 0 is not reported.",
                &TRANSPARENT_RETRY_BUCKETS,
            ),
            hedges: count(
                "grpc.client.call.hedges",
                "{hedge}",
                "Number of hedges during the client call. If there were no hedges, 0 is not reported.",
                &RETRY_BUCKETS,
            ),
            retry_delay: latency(
                "grpc.client.call.retry_delay",
                "Total time of delay while there is no active attempt during the client call.",
            ),
            target,
            named: self.named,
            any: self.any,
            seen: RwLock::default(),
            other: KeyValue::new("grpc.method", OTHER),
            gauge,
            series,
            refusals,
        }
    }
}

impl Otel {
    /// The budget's balance may have moved: sets the gauge, unless the
    /// last value any recorder of the budget set was this one, in this
    /// series.
    // NOTE: the stamp is shared by the budget's recorders, not kept by each:
    // two may write one series (clones of a layer given metrics for one
    // target), and one that skipped its own last value would leave the
    // other's standing. For one series the stamp is the balance's bits
    // turned by a constant, so no two balances share one; a stamp of another
    // series could only match one of these for one balance in 2^64. Two
    // threads moving the balance at once may set it out of order; the next
    // move sets it right.
    #[inline]
    pub(crate) fn balance(&self, gauged: &Gauged, tokens: Option<f64>) {
        if let Some(tokens) = tokens {
            let stamp = tokens.to_bits() ^ self.series;
            if gauged.0.load(Ordering::Relaxed) != stamp {
                self.set_balance(gauged, tokens, stamp);
            }
        }
    }

    #[inline(never)]
    fn set_balance(&self, gauged: &Gauged, tokens: f64, stamp: u64) {
        gauged.0.store(stamp, Ordering::Relaxed);
        self.gauge
            .record(tokens, std::slice::from_ref(&self.target));
    }

    /// The `grpc.method` of a request to `path`.
    fn method(&self, path: &str) -> KeyValue {
        if let Some(named) = self.named.get(path) {
            return named.clone();
        }
        if self.any == 0 || !is_method_path(path) {
            return self.other.clone();
        }
        let seen = self.seen.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(value) = seen.get(path) {
            return value.clone();
        }
        if seen.len() >= self.any {
            return self.other.clone();
        }
        drop(seen);
        let mut seen = self.seen.write().unwrap_or_else(PoisonError::into_inner);
        if seen.len() >= self.any && !seen.contains_key(path) {
            return self.other.clone();
        }
        seen.entry(path.into())
            .or_insert_with(|| method_value(path))
            .clone()
    }

    /// The trace of a call to `path` starting now.
    fn call(self: &Arc<Self>, path: &str) -> CallMetrics {
        let attributes = [self.method(path), self.target.clone()];
        CallMetrics(Arc::new(CallTrace {
            otel: Arc::clone(self),
            attributes,
            start: Instant::now(),
            state: Mutex::default(),
        }))
    }
}

/// One call's trace: its attributes, when it started, and what its attempts
/// did.
struct CallTrace {
    otel: Arc<Otel>,
    /// `grpc.method`, `grpc.target`.
    attributes: [KeyValue; 2],
    start: Instant,
    state: Mutex<CallState>,
}

#[derive(Default)]
struct CallState {
    retries: u64,
    transparent_retries: u64,
    hedges: u64,
    /// Time with no attempt in flight, after the first attempt started.
    delay: Duration,
    active: u32,
    /// Since when no attempt is in flight (after one was).
    idle_since: Option<Instant>,
    ended: bool,
}

impl CallTrace {
    fn state(&self) -> std::sync::MutexGuard<'_, CallState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn with_status(&self, code: Code) -> [KeyValue; 3] {
        let [method, target] = self.attributes.clone();
        [
            method,
            target,
            KeyValue::new("grpc.status", code_name(code)),
        ]
    }

    fn end(&self, code: Code) {
        let (retries, transparent, hedges, delay) = {
            let mut state = self.state();
            if std::mem::replace(&mut state.ended, true) {
                return;
            }
            (
                state.retries,
                state.transparent_retries,
                state.hedges,
                state.delay,
            )
        };
        let o = &self.otel;
        let elapsed = self.start.elapsed().as_secs_f64();
        o.call_duration.record(elapsed, &self.with_status(code));
        let attributes = &self.attributes;
        if retries > 0 {
            o.retries.record(retries, attributes);
        }
        if transparent > 0 {
            o.transparent_retries.record(transparent, attributes);
        }
        if hedges > 0 {
            o.hedges.record(hedges, attributes);
        }
        if retries + transparent + hedges > 0 {
            o.retry_delay.record(delay.as_secs_f64(), attributes);
        }
    }
}

/// gRPC's standard metrics as a layer given [`GrpcMetrics`] records them:
/// the type of its metrics (`RetryLayer<Bu, B, Recorder>`), which
/// [`RetryLayer::with_grpc_metrics`](crate::RetryLayer::with_grpc_metrics)
/// makes. Cloned with the layer and its services: one set of instruments.
#[derive(Clone)]
pub struct Recorder(Arc<Otel>);

/// The service a layer given [`GrpcMetrics`] makes: a metered client over a
/// tonic `Channel` is a `LibraryClient<Metered<Channel>>`, and
/// `Metered<Channel, RetryThrottle>` pays with gRPC's throttle.
pub type Metered<S, Bu = crate::RetryBudget, B = tonic::body::Body> =
    crate::RetryService<S, Bu, B, Recorder>;

impl fmt::Debug for Recorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Recorder").field(&self.0.target).finish()
    }
}

impl Recorder {
    pub(crate) fn new(otel: Otel) -> Self {
        Self(Arc::new(otel))
    }
}

impl Metrics for Recorder {}

impl Record for Recorder {
    type Call = CallMetrics;
    type Attempt = AttemptMetrics;

    #[inline]
    fn call(&self, path: &str) -> CallMetrics {
        self.0.call(path)
    }

    #[inline]
    fn balance(&self, gauged: &Gauged, tokens: impl FnOnce() -> Option<f64>) {
        self.0.balance(gauged, tokens());
    }

    fn record(&self, event: Event) {
        self.0.refusals.record(event);
    }
}

// NOTE: `pub` in a private module: named by the recorder's trait (so
// public), nameable by no user.
mod traces {
    use super::*;

    /// A call's metrics.
    #[derive(Clone)]
    pub struct CallMetrics(pub(super) Arc<CallTrace>);

    impl fmt::Debug for CallMetrics {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("CallMetrics")
        }
    }

    impl CallMetrics {
        #[inline(never)]
        fn start_attempt(call: &Arc<CallTrace>) -> AttemptMetrics {
            let now = Instant::now();
            {
                let mut state = call.state();
                if state.active == 0
                    && let Some(since) = state.idle_since.take()
                {
                    state.delay += now.saturating_duration_since(since);
                }
                state.active += 1;
            }
            call.otel.attempt_started.add(1, &call.attributes);
            AttemptMetrics(Some(Box::new(Started {
                call: Arc::clone(call),
                start: now,
                ends_call: false,
            })))
        }
    }

    impl CallRecord for CallMetrics {
        const ON: bool = true;
        type Attempt = AttemptMetrics;

        #[inline]
        fn attempt(&self) -> AttemptMetrics {
            Self::start_attempt(&self.0)
        }

        fn retry(&self) {
            self.0.state().retries += 1;
        }

        fn transparent_retry(&self) {
            self.0.state().transparent_retries += 1;
        }

        fn hedge(&self) {
            self.0.state().hedges += 1;
        }

        fn end(&self, code: Code) {
            self.0.end(code);
        }
    }

    /// One attempt's metrics, once it is sent. One pointer, boxed: the futures
    /// and bodies that carry it are moved on every call.
    #[derive(Default)]
    pub struct AttemptMetrics(Option<Box<Started>>);

    /// An attempt started.
    struct Started {
        call: Arc<CallTrace>,
        start: Instant,
        /// The caller reads this attempt's response: its end ends the call.
        ends_call: bool,
    }

    impl AttemptRecord for AttemptMetrics {
        const NONE: Self = Self(None);

        #[inline]
        fn is_open(&self) -> bool {
            self.0.is_some()
        }

        #[inline]
        fn end(&mut self, code: Code) {
            if let Some(started) = self.0.take() {
                (*started).end(code);
            }
        }

        fn no_response(&mut self) {
            self.end(Code::Unavailable);
        }

        fn ends_call(&mut self) -> bool {
            match &mut self.0 {
                Some(started) => {
                    started.ends_call = true;
                    true
                }
                None => false,
            }
        }
    }

    impl Started {
        #[inline(never)]
        fn end(self, code: Code) {
            let Started {
                call,
                start,
                ends_call,
            } = self;
            let now = Instant::now();
            let elapsed = now.saturating_duration_since(start).as_secs_f64();
            call.otel
                .attempt_duration
                .record(elapsed, &call.with_status(code));
            {
                let mut state = call.state();
                state.active = state.active.saturating_sub(1);
                if state.active == 0 {
                    state.idle_since = Some(now);
                }
            }
            if ends_call {
                call.end(code);
            }
        }
    }

    impl Drop for AttemptMetrics {
        #[inline]
        fn drop(&mut self) {
            self.end(Code::Cancelled);
        }
    }

    impl fmt::Debug for AttemptMetrics {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("AttemptMetrics")
        }
    }
}

use traces::{AttemptMetrics, CallMetrics};

/// A layer whose metrics were chosen at run time
/// ([`RetryLayer::with_optional_grpc_metrics`](crate::RetryLayer::with_optional_grpc_metrics)):
/// with `None`, nothing is recorded.
impl Metrics for Option<Recorder> {}

impl Record for Option<Recorder> {
    type Call = Option<CallMetrics>;
    type Attempt = AttemptMetrics;

    #[inline]
    fn call(&self, path: &str) -> Option<CallMetrics> {
        self.as_ref().map(|recorder| recorder.call(path))
    }

    #[inline]
    fn balance(&self, gauged: &Gauged, tokens: impl FnOnce() -> Option<f64>) {
        if let Some(recorder) = self {
            recorder.balance(gauged, tokens);
        }
    }

    fn record(&self, event: Event) {
        if let Some(recorder) = self {
            recorder.record(event);
        }
    }
}

impl CallRecord for Option<CallMetrics> {
    const ON: bool = true;
    type Attempt = AttemptMetrics;

    #[inline]
    fn attempt(&self) -> AttemptMetrics {
        match self {
            Some(call) => call.attempt(),
            None => AttemptMetrics::NONE,
        }
    }

    fn retry(&self) {
        if let Some(call) = self {
            call.retry();
        }
    }

    fn transparent_retry(&self) {
        if let Some(call) = self {
            call.transparent_retry();
        }
    }

    fn hedge(&self) {
        if let Some(call) = self {
            call.hedge();
        }
    }

    fn end(&self, code: Code) {
        if let Some(call) = self {
            call.end(code);
        }
    }
}
