use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use http::{Request, Response};
use tower::BoxError;
use tower_layer::Layer;
use tower_service::Service;

use crate::budget::RetryBudget;
use crate::methods::MethodPolicies;
use crate::metrics::RetryMetrics;
use crate::policy::RetryPolicy;
use crate::service::RetryService;
use crate::shared::Shared;
use crate::trace::{Metrics, NoMetrics};

/// Applies [`RetryService`] to a service: see the [crate docs](crate).
///
/// Clones share the budget and the [`RetryMetrics`].
///
/// The budget is a [`RetryBudget`] unless the layer is made with
/// [`with_budget`](RetryLayer::with_budget), which takes any
/// [`Budget`](crate::budgets::Budget): gRPC's [`RetryThrottle`](crate::budgets::RetryThrottle),
/// or a `tower` budget (tower's `TpsBudget`, say) in a
/// [`TowerBudget`](crate::budgets::TowerBudget).
///
/// `B` is the type of the request bodies the layer's services take: tonic's
/// [`Body`](tonic::body::Body), what tonic's `Channel` and generated clients
/// use, unless [`for_body`](RetryLayer::for_body) says otherwise.
///
/// `M` is what records gRPC's standard metrics: [`NoMetrics`], nothing,
/// unless the layer was given them with `with_grpc_metrics` (feature
/// `opentelemetry`).
pub struct RetryLayer<Bu = RetryBudget, B = tonic::body::Body, M = NoMetrics> {
    shared: Arc<Shared<Bu>>,
    recorder: M,
    _body: PhantomData<fn(B)>,
}

impl RetryLayer {
    /// A layer retrying by `policy`, paying for each retry from `budget`.
    ///
    /// `policy` is one [`RetryPolicy`] for every method, or
    /// [`MethodPolicies`] choosing one per method. Give several layers clones
    /// of one budget to make them share it.
    pub fn new(policy: impl Into<MethodPolicies>, budget: RetryBudget) -> Self {
        Self::with_budget(policy, budget)
    }
}

impl<Bu> RetryLayer<Bu> {
    /// A layer paying for retries from `budget`: a [`RetryBudget`], a
    /// [`RetryThrottle`](crate::budgets::RetryThrottle) (gRPC's retry throttling), any
    /// `tower` retry budget wrapped in a [`TowerBudget`](crate::budgets::TowerBudget),
    /// or a [`Budget`](crate::budgets::Budget) of your own.
    ///
    /// The layer deposits on each successful call (one that ends with `OK`:
    /// for a committed response, when its trailers say so) and withdraws once
    /// per retry sent. The budget is shared by every call, on any thread: it
    /// must be `Send + Sync`. A budget of `Cell`s is refused here, where it is
    /// made, not at the first call:
    ///
    /// ```compile_fail
    /// use std::cell::Cell;
    /// use tonic_retry::{RetryLayer, RetryPolicy, budgets::TowerBudget};
    ///
    /// struct Local(Cell<u32>);
    /// impl tower::retry::budget::Budget for Local {
    ///     fn deposit(&self) {}
    ///     fn withdraw(&self) -> bool {
    ///         false
    ///     }
    /// }
    /// let budget = TowerBudget::new(Local(Cell::new(0)));
    /// let layer = RetryLayer::with_budget(RetryPolicy::default(), budget);
    /// ```
    pub fn with_budget(policy: impl Into<MethodPolicies>, budget: Bu) -> Self
    where
        Bu: crate::budget::Budget,
    {
        Self {
            shared: Shared::new(policy.into(), budget),
            recorder: NoMetrics,
            _body: PhantomData,
        }
    }
}

impl<Bu, B, M> RetryLayer<Bu, B, M> {
    /// The same layer (the same budget and counters) for services taking
    /// request bodies of type `B2` — for a body that is not tonic's, such as
    /// http-body-util's `UnsyncBoxBody<Bytes, BoxError>`:
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http_body_util::combinators::UnsyncBoxBody;
    /// use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
    /// use tower::BoxError;
    ///
    /// # fn main() -> Result<(), tonic_retry::ConfigError> {
    /// let layer = RetryLayer::new(RetryPolicy::default(), RetryBudget::new(200, 0.1)?)
    ///     .for_body::<UnsyncBoxBody<Bytes, BoxError>>();
    /// # let _ = layer;
    /// # Ok(())
    /// # }
    /// ```
    pub fn for_body<B2>(self) -> RetryLayer<Bu, B2, M> {
        RetryLayer {
            shared: self.shared,
            recorder: self.recorder,
            _body: PhantomData,
        }
    }

    /// The default policy: the only one, unless the layer was given
    /// [`MethodPolicies`].
    pub fn policy(&self) -> &RetryPolicy {
        self.shared.policies.default_policy()
    }

    /// The policies by method.
    pub fn policies(&self) -> &MethodPolicies {
        &self.shared.policies
    }

    /// The budget retries are paid from; a [`RetryBudget`]'s
    /// [`available`](RetryBudget::available) balance is the
    /// `retry_budget_available` gauge.
    pub fn budget(&self) -> &Bu {
        &self.shared.budget
    }

    /// What this layer's services have done so far.
    pub fn metrics(&self) -> &RetryMetrics {
        &self.shared.metrics
    }

    /// Bounds the bytes the replay copies of all calls in flight through this
    /// layer (and its clones) may hold together; 16 MiB by default, grpc-java's
    /// retry buffer size. Each call also has its own limit,
    /// [`RetryPolicy::with_replay_limit`] (1 MiB by default).
    ///
    /// A call whose copy would pass it drops its copy: its body is still sent
    /// whole and at once — no call waits for memory, none fails for it — but
    /// the call is not retried, which [`RetryMetrics::body_too_large`] counts
    /// and a `WARN` event says. Memory comes back as each call commits,
    /// ends, or can no longer be retried.
    ///
    /// ```
    /// use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
    ///
    /// # fn main() -> Result<(), tonic_retry::ConfigError> {
    /// let layer = RetryLayer::new(RetryPolicy::default(), RetryBudget::new(200, 0.1)?)
    ///     .with_replay_memory(64 << 20);
    /// assert_eq!(layer.replay_memory_in_use(), 0);
    /// # Ok(())
    /// # }
    /// ```
    #[must_use]
    pub fn with_replay_memory(self, bytes: usize) -> Self {
        self.shared.replay_memory.set_limit(bytes);
        self
    }

    /// The bytes the replay copies of this layer's calls in flight hold now.
    pub fn replay_memory_in_use(&self) -> usize {
        self.shared.replay_memory.used()
    }
}

impl<Bu, B> RetryLayer<Bu, B> {
    /// Records gRPC's standard client metrics (gRFC A66 and A96) for every
    /// call through the layer, as [`GrpcMetrics`](crate::otel::GrpcMetrics)
    /// says (feature `opentelemetry`).
    ///
    /// The layer returned is of another type, `RetryLayer<Bu, B,
    /// otel::Recorder>`: its metrics are a type parameter, so a layer without
    /// them pays nothing for them, not even a check. The services it makes,
    /// and its clones, record; a clone taken before this call is a layer
    /// without metrics (its type says so) that shares the budget and the
    /// counters. Give a layer its metrics before cloning it, and build a
    /// layer of its own for each target. To choose at run time whether to
    /// record, see [`with_optional_grpc_metrics`](Self::with_optional_grpc_metrics).
    ///
    /// ```
    /// use opentelemetry::metrics::MeterProvider;
    /// use tonic_retry::otel::GrpcMetrics;
    /// use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let provider = opentelemetry_sdk::metrics::SdkMeterProvider::default();
    /// let meter = provider.meter("library-client");
    /// let layer = RetryLayer::new(RetryPolicy::default(), RetryBudget::new(200, 0.1)?)
    ///     .with_grpc_metrics(GrpcMetrics::new(&meter, "dns:///library:50051").with_any_method(100));
    /// # let _ = layer;
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "opentelemetry")]
    #[must_use]
    pub fn with_grpc_metrics(
        self,
        metrics: crate::otel::GrpcMetrics,
    ) -> RetryLayer<Bu, B, crate::otel::Recorder>
    where
        Bu: crate::budget::Budget,
    {
        let recorder = self.recorder_of(metrics);
        self.recorded_by(recorder)
    }

    /// As [`with_grpc_metrics`](Self::with_grpc_metrics), with metrics
    /// chosen at run time (from configuration, say): with `None` nothing is
    /// recorded. One type for both, `RetryLayer<Bu, B, Option<otel::Recorder>>`,
    /// at the cost of a check on each step of a call's trace when `None`.
    ///
    /// ```
    /// use opentelemetry::metrics::MeterProvider;
    /// use tonic_retry::{otel::GrpcMetrics, otel::Recorder};
    /// use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
    ///
    /// fn layer(
    ///     metrics: Option<GrpcMetrics>,
    /// ) -> Result<RetryLayer<RetryBudget, tonic::body::Body, Option<Recorder>>, tonic_retry::ConfigError> {
    ///     let layer = RetryLayer::new(RetryPolicy::default(), RetryBudget::new(200, 0.1)?);
    ///     Ok(layer.with_optional_grpc_metrics(metrics))
    /// }
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let provider = opentelemetry_sdk::metrics::SdkMeterProvider::default();
    /// let meter = provider.meter("library-client");
    /// let recorded = layer(Some(GrpcMetrics::new(&meter, "dns:///library:50051")))?;
    /// let not_recorded = layer(None)?;
    /// # let _ = (recorded, not_recorded);
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "opentelemetry")]
    #[must_use]
    pub fn with_optional_grpc_metrics(
        self,
        metrics: Option<crate::otel::GrpcMetrics>,
    ) -> RetryLayer<Bu, B, Option<crate::otel::Recorder>>
    where
        Bu: crate::budget::Budget,
    {
        let recorder = metrics.map(|metrics| self.recorder_of(metrics));
        self.recorded_by(recorder)
    }

    #[cfg(feature = "opentelemetry")]
    fn recorder_of(&self, metrics: crate::otel::GrpcMetrics) -> crate::otel::Recorder
    where
        Bu: crate::budget::Budget,
    {
        let throttle = self.shared.budget.refusal_keeps_status();
        crate::otel::Recorder::new(metrics.build(throttle))
    }

    /// This layer, its calls recorded by `recorder` (which is given the
    /// budget's balance now).
    #[cfg(feature = "opentelemetry")]
    fn recorded_by<M: Metrics>(self, recorder: M) -> RetryLayer<Bu, B, M>
    where
        Bu: crate::budget::Budget,
    {
        let shared = &self.shared;
        recorder.balance(&shared.gauged, || shared.budget.balance());
        RetryLayer {
            shared: self.shared,
            recorder,
            _body: PhantomData,
        }
    }
}

impl<Bu, B, M: Clone> Clone for RetryLayer<Bu, B, M> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
            recorder: self.recorder.clone(),
            _body: PhantomData,
        }
    }
}

// NOTE: the inner service's error is proven to convert into `BoxError` here,
// and its futures and bodies to be sendable to a drain task, where the
// service is made, so that no impl a call's future needs asks for
// it (see `RetryService`'s "Spawning calls").
impl<S, Bu, B, RB, M> Layer<S> for RetryLayer<Bu, B, M>
where
    S: Service<Request<B>, Response = Response<RB>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    RB: http_body::Body + Send + 'static,
    M: Metrics,
{
    type Service = RetryService<S, Bu, B, M>;

    fn layer(&self, inner: S) -> Self::Service {
        RetryService::from_shared(inner, Arc::clone(&self.shared), self.recorder.clone())
    }
}

impl<Bu: fmt::Debug, B, M: fmt::Debug> fmt::Debug for RetryLayer<Bu, B, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryLayer")
            .field("policies", &self.shared.policies)
            .field("budget", &self.shared.budget)
            .field("metrics", &self.shared.metrics)
            .field("recorder", &self.recorder)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RetryPolicy;
    use http::{Request, Response};
    use tonic::body::Body;
    use tower::{Service, ServiceExt};
    use tower_test::mock;

    /// A call, and every attempt and copy it makes, hold the layer through
    /// the handle of the service that made it, never the layer's own
    /// `Arc`: two threads calling through clones of one service write no
    /// count the other writes (`cargo bench --bench contended`).
    #[tokio::test(start_paused = true)]
    async fn a_call_in_flight_takes_no_hold_on_the_layer_itself() {
        let layer = RetryLayer::new(
            RetryPolicy::default(),
            RetryBudget::new(10, 0.1).expect("a valid budget"),
        );
        let (inner, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
        let mut svc = layer.layer(inner);
        let _other = svc.clone();
        let held = Arc::strong_count(&layer.shared);
        assert_eq!(held, 3, "the layer and its two services");

        let call = svc.ready().await.unwrap().call(Request::new(Body::empty()));
        let call = tokio::spawn(call);
        let (request, send) = handle.next_request().await.expect("the attempt");
        assert_eq!(
            Arc::strong_count(&layer.shared),
            held,
            "while the attempt is out"
        );
        send.send_response(tonic::Status::unavailable("down").into_http());
        drop(request);
        // Its retry, after the backoff.
        let (_request, send) = handle.next_request().await.expect("the retry");
        assert_eq!(
            Arc::strong_count(&layer.shared),
            held,
            "while the retry is out"
        );
        send.send_response(tonic::Status::new(tonic::Code::Ok, "").into_http());
        call.await.unwrap().expect("the answer");
        assert_eq!(Arc::strong_count(&layer.shared), held);
    }
}
