//! A [tower] layer that retries gRPC calls — made by [tonic] clients, or by
//! anything that speaks gRPC through a `tower::Service<http::Request<B>>` — only
//! where a retry can succeed, with every wait charged to one overall deadline
//! and every retry paid for from a process-wide [`RetryBudget`].
//!
//! Retries are how a client rides out a restarting instance or a dropped
//! connection. Done carelessly they do harm: they turn a blip into a retry
//! storm (every caller multiplies its traffic just when the service is
//! weakest), they send attempts that cannot finish in time, and they apply a
//! write twice. This layer does the careful version:
//!
//! * **Only retryable outcomes** are retried (see the table below). The
//!   question is not how bad an error is, but whether the same request, sent
//!   again, could get a different answer.
//! * **Exponential backoff with independent jitter**: before retry *k* it waits
//!   `min(base · 2^(k-1), max) · (1 ± jitter)`, drawn afresh for every retry of
//!   every call. A server's `RetryInfo` or `grpc-retry-pushback-ms` replaces it.
//! * **One deadline for the whole call**, from the request's `grpc-timeout`
//!   (tonic's `Request::set_timeout`) or [`RetryPolicy::with_total_timeout`].
//!   Every attempt is sent with `grpc-timeout` rewritten to the time left (a
//!   first attempt sent at once, within a thousandth of the timeout and at
//!   most 1 ms, says the call's timeout itself, as tonic's own client does,
//!   which HPACK then sends as one byte), and cut when it runs out; backoff sleeps, server-given delays, waiting for the
//!   service below to be ready and a committed response's body are all
//!   charged to it too. No retry is sent without room for its backoff plus a
//!   minimum attempt (20 ms).
//! * **A retry budget**: a lock-free token account; successes deposit a
//!   fraction of a token, each retry really sent costs one. With the reference setting
//!   (`RetryBudget::new(200, 0.1)`) retries stay near 10 % of traffic once the
//!   saved balance is spent, however hard a dependency fails.
//! * **The same idempotency key** (`x-idempotency-key`) on every attempt, so a
//!   server can deduplicate a write whose response was lost.
//! * **Marks for the load balancer**: attempt *n + 1* carries
//!   `grpc-previous-rpc-attempts: n` and names the instances that already
//!   failed this call (the [`x-already-tried`](marks::ALREADY_TRIED) header and the
//!   [`AlreadyTried`](marks::AlreadyTried) request extension), so a balancer can send the retry
//!   elsewhere. A balancer reports each attempt's instance through the
//!   [`PickedInstance`](marks::PickedInstance) request extension, so attempts that got no response
//!   name theirs too.
//! * **A replayable body** ([`ReplayBody`](replay::ReplayBody)): the first attempt streams as the
//!   caller writes, while a zero-copy copy is kept (1 MiB by default, and 16
//!   MiB across the layer's calls in flight) for retries. A bigger body is
//!   sent whole and not retried; streaming calls
//!   never wait for their body to end, and the copy is released as soon as no
//!   retry is possible. A unary call's body, all there when the call is made,
//!   is read whole before the first attempt and replayed without a lock.
//!
//! # What is retried
//!
//! | outcome of one attempt | retried? |
//! |---|---|
//! | `UNAVAILABLE` | yes |
//! | a stream the server's HTTP/2 library turned away before its application saw it (`REFUSED_STREAM`, or above a graceful `GOAWAY`'s last stream) | at once, once a call, whatever the method's policy (one attempt, or hedging): gRPC's *transparent retry*, not counted toward `max_attempts` nor paid for from the budget |
//! | no response at all otherwise (connection refused or reset) | yes, as `UNAVAILABLE` |
//! | `DEADLINE_EXCEEDED`, or the attempt's time ran out (the layer's cut, the Channel's `grpc-timeout`, a server's `CANCELLED` for it) | while the call's deadline has room |
//! | `RESOURCE_EXHAUSTED` | only with `google.rpc.RetryInfo`, after its `retry_delay` (a set you write retries it always, as A6 does: `RetryWhen`) |
//! | `ABORTED` | never: a conflict the caller must re-read and resolve |
//! | `NOT_FOUND`, `INVALID_ARGUMENT`, `PERMISSION_DENIED`, `UNAUTHENTICATED`, `UNIMPLEMENTED`, `INTERNAL`, any other code, `OK` | never |
//! | a response that started normally (headers without `grpc-status`) | never: it is committed and handed over untouched |
//!
//! Only *Trailers-Only* error responses (the status in the response headers,
//! as tonic, grpc-go, grpc-java and grpcio servers send early errors) and HTTP
//! errors are judged; HTTP statuses map as gRPC clients map them (429, 502,
//! 503, 504 → `UNAVAILABLE`; a 200 that is not gRPC → `UNKNOWN`). Metadata is
//! read exactly as tonic's client reads it (`grpc-status: 014` is `UNKNOWN`).
//! The set is configurable ([`RetryPolicy::with_retryable_codes`]). Malformed
//! metadata never panics and never makes a call retryable; a
//! `grpc-status-details-bin` that is not valid base64 — which would make
//! tonic's client panic — is removed before the caller sees it. A server-given
//! delay longer than [`RetryPolicy::with_max_server_delay`] (30 s) is not
//! waited for.
//!
//! When the layer itself ends a call — no time left, or no budget — the caller
//! gets a gRPC Trailers-Only response with `DEADLINE_EXCEEDED` or
//! `RESOURCE_EXHAUSTED`, naming the last attempt's code, which a tonic client
//! reports as a [`tonic::Status`]. A call whose last attempt got no response at
//! all ends as `UNAVAILABLE`, naming the transport error.
//!
//! # What the answer tells the caller
//!
//! A call answered by a later attempt says how many came before it:
//! [`grpc-previous-rpc-attempts`](marks::PREVIOUS_ATTEMPTS) on the response's
//! metadata, or its status's (gRPC A6 allows it), for retries and hedges
//! alike; a call answered by its first attempt gets nothing added. A failed
//! call hands back the idempotency key its attempts carried
//! ([`x-idempotency-key`](marks::IDEMPOTENCY_KEY), on its status's metadata), so
//! that its caller can send a write again later under the same key, and a
//! server that applied it once applies it once. (A failure a server sends
//! in the trailers of an answer that had begun is handed over as the server
//! sent it: the count is on the answer's headers, the key is not added.) A
//! tonic caller reads both from `response.metadata()` or
//! `status.metadata()`:
//!
//! ```
//! use tonic::body::Body;
//! use tonic_retry::{marks::IDEMPOTENCY_KEY, marks::PREVIOUS_ATTEMPTS, RetryBudget, RetryLayer, RetryPolicy};
//! use tower::{BoxError, Layer, ServiceExt};
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), BoxError> {
//! let down = tower::service_fn(|_req: http::Request<Body>| async {
//!     Ok::<_, BoxError>(tonic::Status::unavailable("down").into_http::<Body>())
//! });
//! let layer = RetryLayer::new(RetryPolicy::default(), RetryBudget::new(200, 0.1)?);
//! let response = layer.layer(down).oneshot(http::Request::new(Body::empty())).await?;
//! let status = tonic::Status::from_header_map(response.headers()).expect("a status");
//! assert_eq!(status.code(), tonic::Code::Unavailable);
//! // Two attempts came before the third, which answered...
//! assert_eq!(status.metadata().get(PREVIOUS_ATTEMPTS.as_str()).unwrap(), "2");
//! // ...and the key all three carried comes back.
//! assert!(status.metadata().get(IDEMPOTENCY_KEY.as_str()).is_some());
//! # Ok(())
//! # }
//! ```
//!
//! # Readiness and backpressure
//!
//! The layer's `poll_ready` never holds a caller: a call's deadline is only
//! known from its request, so waiting for the service below to be ready
//! happens inside the call, under its deadline and per-attempt timeout. A
//! saturated concurrency limit below the layer therefore ends calls with
//! `DEADLINE_EXCEEDED` at their deadlines instead of hanging them; put
//! `load_shed` or `concurrency_limit` above the layer to bound how many calls
//! wait.
//!
//! # Example
//!
//! With a tonic client, the layer goes between the `Channel` and the generated
//! client:
//!
//! ```no_run
//! use std::time::Duration;
//! use tonic::transport::Endpoint;
//! use tonic_health::pb::health_client::HealthClient;
//! use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
//! use tower::ServiceBuilder;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let channel = Endpoint::from_static("http://[::1]:50051").connect_lazy();
//! // Calls without a deadline of their own get 5 s, all attempts included.
//! let policy = RetryPolicy::default().with_total_timeout(Duration::from_secs(5));
//! let svc = ServiceBuilder::new()
//!     .concurrency_limit(64)
//!     .layer(RetryLayer::new(policy, RetryBudget::new(200, 0.1)?))
//!     .service(channel);
//! let client = HealthClient::new(svc); // any generated client
//! # let _ = client;
//! # Ok(())
//! # }
//! ```
//!
//! # Where each timeout belongs
//!
//! * **The call's deadline**: `tonic::Request::set_timeout` (sent as
//!   `grpc-timeout`), else [`RetryPolicy::with_total_timeout`]; a method's
//!   limit ([`RetryPolicy::with_max_timeout`], a service config's `timeout`)
//!   caps either. It bounds every attempt, wait and streamed body of the call.
//!   A long-lived stream (a watch) is cut at it too: give such methods a
//!   policy without a total timeout ([`MethodPolicies`]).
//! * **One attempt**: [`RetryPolicy::with_attempt_timeout`], or a tower
//!   `Timeout` *below* the layer.
//! * A tower `timeout` *above* the layer is neither: the layer never learns
//!   it, and when it fires it drops the call, retries and all; a tonic client
//!   reports `UNKNOWN: request timed out`.
//!
//! The same layer around an in-memory service, which fails once:
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use tonic::body::Body;
//! use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
//! use tower::{BoxError, ServiceBuilder, ServiceExt};
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), BoxError> {
//! let calls = Arc::new(AtomicUsize::new(0));
//! let seen = calls.clone();
//! let inner = tower::service_fn(move |_req: http::Request<Body>| {
//!     let n = seen.fetch_add(1, Ordering::SeqCst);
//!     async move {
//!         let status = if n == 0 { tonic::Code::Unavailable } else { tonic::Code::Ok };
//!         Ok::<_, BoxError>(tonic::Status::new(status, "").into_http::<Body>())
//!     }
//! });
//! let layer = RetryLayer::new(RetryPolicy::default(), RetryBudget::new(200, 0.1)?);
//! let svc = ServiceBuilder::new().layer(layer.clone()).service(inner);
//!
//! let response = svc.oneshot(http::Request::new(Body::empty())).await?;
//! assert_eq!(response.headers()["grpc-status"], "0");
//! assert_eq!(calls.load(Ordering::SeqCst), 2);
//! assert_eq!(layer.metrics().retries(), 1);
//! assert_eq!(layer.budget().available(), 99.1); // one token spent, 0.1 earned
//! # Ok(())
//! # }
//! ```
//!
//! # Limits worth knowing
//!
//! * Retrying does not fix slowness. A server that always needs 600 ms behind
//!   a 300 ms per-attempt timeout yields timeouts, not successes — and three
//!   times the load.
//! * Retries multiply across layers: three hops each making 3 attempts make
//!   27 calls to the bottom one. The layer retries at one layer: a failure it
//!   gives up on after retrying (or that its budget or the deadline refused
//!   to retry) goes up marked `grpc-retry-pushback-ms: -1`, gRPC A6's "do not
//!   retry", which every A6 client honours — 3 calls at the bottom instead of
//!   27 ([`RetryPolicy::with_retry_at_one_layer`], [`RetryMarkExt`](marks::RetryMarkExt)). The
//!   budget keeps a stack of retrying layers near `1 + deposit` per layer once
//!   the saved balance is spent.
//! * The budget is per process by design: a cluster-wide exact quota would
//!   cost a remote call per request.
//! * A successful call is one whose response started normally (or was `OK`);
//!   errors that arrive later in trailers are the caller's to see, and are not
//!   retried (gRPC A6 calls such a response committed).
//! * The layer needs a tokio runtime with the time driver enabled, as tonic does.
//!
//! # Also in this crate
//!
//! * [`HedgePolicy`]: hedging, for slowness rather than failure (gRPC A6's
//!   `hedgingPolicy`): another copy of a slow attempt goes to another
//!   instance, and the first good answer wins (its docs explain).
//!   Usable wherever a [`RetryPolicy`] is.
//! * [`balance::PreferUntried`]: an in-process balancer that honours the
//!   already-tried mark, so retries land on another instance.
//! * `fault` (cargo feature `fault`): a server-side layer injecting gRPC
//!   failures, delays, pushback and lost responses by rule, to rehearse retry
//!   settings against real servers.
//! * [`RetryLayer::with_budget`]: pay for retries from any [`Budget`](budgets::Budget):
//!   [`OutcomeBudget`] charges only the retries that fail, and holds a fleet
//!   up through a failure's onset, a brown-out and an overload
//!   ([the guide](guide::budgets) compares them);
//!   [`RetryThrottle`](budgets::RetryThrottle) is gRPC's own retry throttling, and [`TowerBudget`](budgets::TowerBudget)
//!   takes any `tower` retry budget (tower's `TpsBudget`, say).
//! * [`MethodPolicies`]: a policy per gRPC method (method, else service, else
//!   default), and [`CallPolicy`], one call's own (no retries, or a policy of
//!   its own), set by its caller as a request extension; and, with the `service-config` feature,
//!   `service_config::ServiceConfig`: the gRPC service config JSON grpc-go and
//!   grpc-java read (per-method `retryPolicy` and `timeout`,
//!   `retryThrottling`).
//! * `otel` (cargo feature `opentelemetry`): the metrics gRPC's own clients
//!   export (gRFC A66 and A96) for the calls through a layer, on an
//!   OpenTelemetry `Meter` (`RetryLayer::with_grpc_metrics`).
//!
//! # Observability
//!
//! Every finished attempt emits a `tracing` event at `DEBUG` level (attempt
//! number, code, delay, time remaining, tokens left); a retry refused because
//! the request body outgrew a replay limit is said at `WARN` too.
//! [`RetryLayer::metrics`] counts attempts, retries, retries refused by the
//! budget or the deadline, and failures not retried because the body was too
//! large to replay; [`RetryBudget::available`] is the budget gauge.
//!
//! [tower]: https://docs.rs/tower
//! [tonic]: https://docs.rs/tonic

#![forbid(unsafe_code)]

mod attempt;
pub mod balance;
mod body;
mod budget;
pub mod budgets {
    //! Budgets other than [`RetryBudget`](crate::RetryBudget), the layer's
    //! default, and the trait every budget implements: what pays for retries
    //! and hedges, shared by every call through one layer.
    //!
    //! * [`OutcomeBudget`](crate::OutcomeBudget): a token account whose
    //!   retries that succeed cost nothing (the guide's
    //!   [budgets](crate::guide::budgets) page compares them all).
    //! * [`RetryThrottle`]: gRPC's `retryThrottling` (gRFC A6), a token
    //!   bucket that stops retries once failures pass half of it, as a
    //!   service config's `retryThrottling` asks.
    //! * [`TowerBudget`]: any of tower's `retry::budget::Budget`s, such as
    //!   `TpsBudget`.
    //! * [`Budget`]: the trait, to bring one's own.

    pub use crate::budget::{Budget, TowerBudget};
    pub use crate::throttle::RetryThrottle;

    /// The service a layer paying with [`RetryThrottle`] makes: a throttled
    /// client over a tonic `Channel` is a `LibraryClient<Throttled<Channel>>`.
    pub type Throttled<S, B = tonic::body::Body, M = crate::metrics::NoMetrics> =
        crate::RetryService<S, RetryThrottle, B, M>;
}
mod call;
mod classify;
mod deadline;
mod drain;
mod error;
#[cfg(feature = "fault")]
pub mod fault;
mod first;
pub mod future;
mod hedge;
mod layer;
pub mod marks;
mod methods;
pub mod metrics;
#[cfg(feature = "opentelemetry")]
pub mod otel;
mod outcome;
mod policy;
pub mod replay;
mod service;
#[cfg(feature = "service-config")]
pub mod service_config;
mod shared;
mod status;
mod stripes;
mod throttle;
mod trace;

pub use body::ResponseBody;
pub use budget::RetryBudget;
pub use deadline::forward_deadline;
pub use error::ConfigError;
pub use hedge::HedgePolicy;
pub use layer::RetryLayer;
pub use methods::{CallPolicy, MethodPolicies};
pub use outcome::OutcomeBudget;
pub use policy::{RetryPolicy, RetryWhen, RetryableCodes};
pub use service::RetryService;

// The README's snippets compile (and run, where they need no server) as doc
// tests, so what a newcomer pastes works.
// (With every feature the snippets use, as the README's test command builds.)
#[cfg(all(
    doctest,
    feature = "fault",
    feature = "service-config",
    feature = "opentelemetry"
))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// The guide: the long topics, one module each.
#[cfg(any(
    all(doc, not(doctest)),
    all(
        doctest,
        feature = "fault",
        feature = "service-config",
        feature = "opentelemetry"
    )
))]
pub mod guide {
    #[doc = include_str!("guide/why.md")]
    pub mod why {}
    #[doc = include_str!("guide/timeouts.md")]
    pub mod timeouts {}
    #[doc = include_str!("guide/settings.md")]
    pub mod settings {}
    #[doc = include_str!("guide/method_policies.md")]
    pub mod method_policies {}
    #[doc = include_str!("guide/deadline.md")]
    pub mod deadline {}
    #[doc = include_str!("guide/amplification.md")]
    pub mod amplification {}
    #[doc = include_str!("guide/budgets.md")]
    pub mod budgets {}
    #[doc = include_str!("guide/hedging.md")]
    pub mod hedging {}
    #[doc = include_str!("guide/demo.md")]
    pub mod demo {}
    #[doc = include_str!("guide/already_tried.md")]
    pub mod already_tried {}
    #[doc = include_str!("guide/faults.md")]
    pub mod faults {}
    #[doc = include_str!("guide/observability.md")]
    pub mod observability {}
}
