//! A service with a capacity, and what retries do to it when something goes
//! wrong: the model behind `examples/overload.rs` and the budgets' overload
//! tests.
//!
//! The bottom is 16 workers taking requests from one FIFO queue, 8–12 ms
//! each (1,600 a second at full capacity). A worker serves every request it
//! takes, even one whose caller has stopped waiting: that is how a real
//! server spends its capacity on work nobody wants. Calls arrive as a
//! Poisson process at 65 % of capacity, each with a 500 ms deadline, through
//! one or three hops, each hop its own `RetryLayer` with its own budget and
//! the default `RetryPolicy` (with or without a 150 ms attempt timeout).
//!
//! After 3 s of health, one trigger:
//! * an outage: every attempt fails at once with `UNAVAILABLE`, for 10 s;
//! * a brown-out: 20 % of attempts, drawn at random, fail at once, for 10 s;
//! * a capacity drop: 5 workers of 16 for 2 s;
//! * a load spike: calls arrive twice as fast for 2 s.
//!
//! Then 8 s more, to see whether and when the service recovers. Time is
//! tokio's paused clock and the model's draws are seeded, so every row of a
//! trigger sees the same arrivals, service times and failures; the layer's
//! backoff jitter is its own, so a run moves some figures in their last digit.

use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{HeaderValue, Request, Response};
use http_body_util::BodyExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::budgets::{Budget, RetryThrottle, TowerBudget};
use tonic_retry::{OutcomeBudget, RetryBudget, RetryLayer, RetryPolicy};
use tower::retry::budget::TpsBudget;
use tower::util::BoxCloneService;
use tower::{BoxError, Layer, ServiceExt};

use super::{answer, status};

type Hop = BoxCloneService<Request<Body>, Response<Body>, BoxError>;

/// Workers at the bottom.
pub(crate) const WORKERS: usize = 16;
/// Workers left during a capacity drop.
pub(crate) const DROPPED_TO: usize = 5;
/// Each request takes 8–12 ms: 1,600 a second at full capacity.
const SERVICE_MS: std::ops::RangeInclusive<u64> = 8..=12;
/// Calls a second: 65 % of capacity.
pub(crate) const RATE: f64 = 0.65 * 1_600.0;
/// Each call's deadline.
const DEADLINE: &str = "500m";
/// The attempt timeout of the rows that have one.
pub(crate) const ATTEMPT_TIMEOUT: Duration = Duration::from_millis(150);
/// When the trigger starts.
pub(crate) const TRIGGER_AT: Duration = Duration::from_secs(3);
/// How long the run goes on after the trigger ends.
const AFTER: Duration = Duration::from_secs(8);
/// The healthy stretch the trigger is compared with (the first second warms up).
const HEALTHY: (Duration, Duration) = (Duration::from_secs(1), TRIGGER_AT);
/// Bins for the onset's peak.
const PEAK_BIN: Duration = Duration::from_millis(100);
/// Bins for goodput, when judging recovery.
const GOODPUT_BIN: Duration = Duration::from_millis(50);
/// How often the queue is sampled.
const SAMPLE: Duration = Duration::from_millis(10);
/// Tells the bottom when the call an attempt belongs to started, in ms.
const STARTED: &str = "x-call-started";

/// What goes wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Trigger {
    Outage,
    BrownOut,
    CapacityDrop,
    LoadSpike,
}

impl Trigger {
    pub(crate) const ALL: [Trigger; 4] = [
        Trigger::Outage,
        Trigger::BrownOut,
        Trigger::CapacityDrop,
        Trigger::LoadSpike,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Trigger::Outage => "outage (all fail fast, 10 s)",
            Trigger::BrownOut => "brown-out (20 % fail fast, 10 s)",
            Trigger::CapacityDrop => "capacity drop (16 workers to 5, 2 s)",
            Trigger::LoadSpike => "load spike (calls ×2, 2 s)",
        }
    }

    pub(crate) fn duration(self) -> Duration {
        match self {
            Trigger::Outage | Trigger::BrownOut => Duration::from_secs(10),
            Trigger::CapacityDrop | Trigger::LoadSpike => Duration::from_secs(2),
        }
    }

    fn end(self) -> Duration {
        TRIGGER_AT + self.duration()
    }

    fn on(self, t: Duration) -> bool {
        t >= TRIGGER_AT && t < self.end()
    }

    /// How many calls arrive at `t`, relative to health.
    fn load(self, t: Duration) -> f64 {
        if self == Trigger::LoadSpike && self.on(t) {
            2.0
        } else {
            1.0
        }
    }
}

/// Who pays for retries, at each hop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Row {
    /// One attempt per call.
    NoRetries,
    /// The default policy with a budget too large to spend.
    NoBudget,
    /// `RetryBudget::new(200, 0.1)`.
    RetryBudget,
    /// tower's `TpsBudget::default()` (10 s, 10 a second, 20 %) through `TowerBudget`.
    TpsBudget,
    /// gRPC's `retryThrottling` with `maxTokens` 10 and `tokenRatio` 0.1.
    Throttle,
    /// Envoy's `retry_budget`: retries in flight at most
    /// max(20 % of calls in flight, 3).
    Envoy,
    /// `OutcomeBudget::default()`.
    Outcome,
}

impl Row {
    pub(crate) const ALL: [Row; 7] = [
        Row::NoRetries,
        Row::NoBudget,
        Row::RetryBudget,
        Row::TpsBudget,
        Row::Throttle,
        Row::Envoy,
        Row::Outcome,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Row::NoRetries => "no retries",
            Row::NoBudget => "retries, no budget",
            Row::RetryBudget => "RetryBudget(200, 0.1)",
            Row::TpsBudget => "TpsBudget (tower's default)",
            Row::Throttle => "RetryThrottle(10, 0.1)",
            Row::Envoy => "Envoy: retries in flight ≤ max(20 %, 3)",
            Row::Outcome => "OutcomeBudget::default()",
        }
    }
}

/// One run of the model.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scenario {
    pub(crate) row: Row,
    pub(crate) trigger: Trigger,
    pub(crate) hops: usize,
    pub(crate) attempt_timeout: bool,
    pub(crate) seed: u64,
}

/// What a run measured.
#[derive(Clone, Debug)]
pub(crate) struct Measured {
    /// The busiest 100 ms of the trigger's first second at the bottom, as a
    /// multiple of the attempts that much offered load brings in health.
    pub(crate) onset_peak: f64,
    /// Attempts at the bottom per call started during the trigger.
    pub(crate) attempts_per_call: f64,
    /// The same, for calls started in the trigger's first second.
    pub(crate) attempts_first_second: f64,
    /// Calls started during the trigger that ended `OK`.
    pub(crate) success: f64,
    /// From the trigger's end until the queue is below the workers and every
    /// later 50 ms of calls succeeds as often as in health, within 5 %;
    /// `None` if that never comes before the run ends.
    pub(crate) recovery: Option<Duration>,
    /// The longest the queue grew.
    pub(crate) max_queue: i64,
    /// Calls started during the trigger.
    pub(crate) calls: u64,
}

/// The model's check on a run without retries: the service recovers from a
/// capacity drop or a load spike within a second or two, the time the queue
/// the trigger leaves takes to drain. Its recovery, if so.
pub(crate) fn recovers_alone(alone: &Measured) -> Option<Duration> {
    alone
        .recovery
        .filter(|d| *d >= Duration::from_secs(1) && *d <= Duration::from_millis(2_500))
}

/// The bottom's record.
#[derive(Default)]
struct Record {
    /// Each attempt: when it arrived and when its call started (ms).
    attempts: Mutex<Vec<(u32, u32)>>,
    /// Each call: when it started (ms) and whether it ended `OK`.
    calls: Mutex<Vec<(u32, bool)>>,
    /// The queue, every `SAMPLE`.
    queue: Mutex<Vec<i64>>,
}

fn ms(t: Duration) -> u32 {
    t.as_millis() as u32
}

/// The bottom: the queue, its workers, and the faults of `trigger`.
fn bottom(
    start: Instant,
    trigger: Trigger,
    seed: u64,
    record: Arc<Record>,
    queued: Arc<AtomicI64>,
) -> (Hop, Vec<tokio::task::JoinHandle<()>>) {
    // Each request waiting in the queue: how to tell its caller it was served.
    let (tx, rx) = mpsc::unbounded_channel::<oneshot::Sender<()>>();
    let rx = Arc::new(tokio::sync::Mutex::new(rx));
    let workers = (0..WORKERS)
        .map(|i| {
            let rx = Arc::clone(&rx);
            let queued = Arc::clone(&queued);
            tokio::spawn(async move {
                let mut rng = StdRng::seed_from_u64(seed ^ (i as u64 + 1) << 32);
                loop {
                    let t = start.elapsed();
                    if trigger == Trigger::CapacityDrop && i >= DROPPED_TO && trigger.on(t) {
                        tokio::time::sleep_until(start + trigger.end()).await;
                        continue;
                    }
                    let Some(served) = rx.lock().await.recv().await else {
                        return;
                    };
                    queued.fetch_sub(1, Ordering::Relaxed);
                    let ms = rng.random_range(SERVICE_MS);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    // Served whether or not its caller is still there.
                    let _ = served.send(());
                }
            })
        })
        .collect();
    let faults = Arc::new(Mutex::new(StdRng::seed_from_u64(seed.wrapping_mul(31))));
    let service = tower::service_fn(move |req: Request<Body>| {
        let t = start.elapsed();
        let started = req
            .headers()
            .get(STARTED)
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(u32::MAX);
        record.attempts.lock().unwrap().push((ms(t), started));
        let fails = trigger.on(t)
            && match trigger {
                Trigger::Outage => true,
                Trigger::BrownOut => faults.lock().unwrap().random_bool(0.2),
                _ => false,
            };
        let job = (!fails).then(|| {
            let (served, answered) = oneshot::channel();
            queued.fetch_add(1, Ordering::Relaxed);
            let _ = tx.send(served);
            answered
        });
        async move {
            match job {
                None => Ok::<_, BoxError>(status(Code::Unavailable)),
                Some(answered) => {
                    answered.await.map_err(|_| BoxError::from("bottom gone"))?;
                    Ok(answer(Code::Ok))
                }
            }
        }
    });
    (BoxCloneService::new(service), workers)
}

/// Calls and retries in flight at one hop, for the Envoy row.
#[derive(Clone, Default)]
struct InFlight {
    calls: Arc<AtomicUsize>,
    retries: Arc<AtomicUsize>,
}

/// Envoy's `retry_budget` with its defaults: a retry is sent while the
/// retries in flight are fewer than max(20 % of the calls in flight, 3).
struct EnvoyBound(InFlight);

impl Budget for EnvoyBound {
    fn deposit(&self) {}

    fn withdraw(&self) -> bool {
        let calls = self.0.calls.load(Ordering::Relaxed);
        let retries = self.0.retries.load(Ordering::Relaxed);
        retries < (calls / 5).max(3)
    }
}

/// Takes one off `counter` when dropped.
struct Counted(Arc<AtomicUsize>);

impl Counted {
    fn new(counter: &Arc<AtomicUsize>) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(counter))
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts what goes through `inner` in `counter` while it is in flight; only
/// retries (requests carrying `grpc-previous-rpc-attempts`), if `retries`.
fn counting(inner: Hop, counter: Arc<AtomicUsize>, retries: bool) -> Hop {
    BoxCloneService::new(tower::service_fn(move |req: Request<Body>| {
        let counted = (!retries || req.headers().contains_key("grpc-previous-rpc-attempts"))
            .then(|| Counted::new(&counter));
        let inner = inner.clone();
        async move {
            let response = inner.oneshot(req).await;
            drop(counted);
            response
        }
    }))
}

/// One hop over `next`: what its server forwards (a real server does not
/// pass on its caller's `grpc-previous-rpc-attempts`), then its client's
/// layer.
fn hop(scenario: &Scenario, next: Hop) -> Hop {
    let mut policy = if scenario.row == Row::NoRetries {
        RetryPolicy::no_retry()
    } else {
        RetryPolicy::default()
    };
    if scenario.attempt_timeout {
        policy = policy.with_attempt_timeout(ATTEMPT_TIMEOUT);
    }
    let client = match scenario.row {
        Row::NoRetries | Row::NoBudget => wrap(
            RetryLayer::new(policy, RetryBudget::new(u32::MAX, 1.0).expect("valid")),
            next,
        ),
        Row::RetryBudget => wrap(
            RetryLayer::new(policy, RetryBudget::new(200, 0.1).expect("valid")),
            next,
        ),
        Row::TpsBudget => wrap(
            RetryLayer::with_budget(policy, TowerBudget::new(TpsBudget::default())),
            next,
        ),
        Row::Throttle => wrap(
            RetryLayer::with_budget(policy, RetryThrottle::new(10.0, 0.1).expect("valid")),
            next,
        ),
        Row::Outcome => wrap(
            RetryLayer::with_budget(policy, OutcomeBudget::default()),
            next,
        ),
        Row::Envoy => {
            let in_flight = InFlight::default();
            let below = counting(next, Arc::clone(&in_flight.retries), true);
            let calls = Arc::clone(&in_flight.calls);
            let layer = RetryLayer::with_budget(policy, EnvoyBound(in_flight));
            counting(wrap(layer, below), calls, false)
        }
    };
    BoxCloneService::new(tower::service_fn(move |mut req: Request<Body>| {
        req.headers_mut().remove("grpc-previous-rpc-attempts");
        client.clone().oneshot(req)
    }))
}

/// `layer` over `next`, boxed.
fn wrap<Bu: Budget>(layer: RetryLayer<Bu>, next: Hop) -> Hop {
    BoxCloneService::new(layer.layer(next).map_response(|r| r.map(Body::new)))
}

/// Whether a call's response ends with `OK`.
async fn succeeded(response: Result<Response<Body>, BoxError>) -> bool {
    let Ok(response) = response else {
        return false;
    };
    if let Some(code) = response.headers().get("grpc-status") {
        return code == "0";
    }
    match response.into_body().collect().await {
        Ok(collected) => collected
            .trailers()
            .and_then(|t| t.get("grpc-status"))
            .is_some_and(|code| code == "0"),
        Err(_) => false,
    }
}

/// Runs `scenario` on the current runtime, whose clock must be paused.
pub(crate) async fn run(scenario: Scenario) -> Measured {
    let trigger = scenario.trigger;
    let start = Instant::now();
    let record = Arc::new(Record::default());
    let queued = Arc::new(AtomicI64::new(0));
    let (bottom, workers) = bottom(
        start,
        trigger,
        scenario.seed,
        Arc::clone(&record),
        Arc::clone(&queued),
    );
    let top = (0..scenario.hops).fold(bottom, |next, _| hop(&scenario, next));
    let end = trigger.end() + AFTER;
    let sampler = {
        let record = Arc::clone(&record);
        let queued = Arc::clone(&queued);
        tokio::spawn(async move {
            let mut at = start;
            loop {
                record
                    .queue
                    .lock()
                    .unwrap()
                    .push(queued.load(Ordering::Relaxed));
                at += SAMPLE;
                tokio::time::sleep_until(at).await;
            }
        })
    };
    let mut rng = StdRng::seed_from_u64(scenario.seed);
    let mut calls = tokio::task::JoinSet::new();
    // Poisson arrivals, each at its own time (a sleep per gap would round
    // every gap up to tokio's millisecond and lower the load).
    let mut next = Duration::ZERO;
    loop {
        let rate = RATE * trigger.load(next);
        next += Duration::from_secs_f64(-(1.0 - rng.random::<f64>()).ln() / rate);
        if next >= end {
            break;
        }
        if start.elapsed() < next {
            tokio::time::sleep_until(start + next).await;
        }
        let started = ms(next);
        let mut req = Request::new(Body::empty());
        req.headers_mut()
            .insert("grpc-timeout", HeaderValue::from_static(DEADLINE));
        req.headers_mut()
            .insert(STARTED, HeaderValue::from(started));
        let top = top.clone();
        let record = Arc::clone(&record);
        calls.spawn(async move {
            let ok = succeeded(top.oneshot(req).await).await;
            record.calls.lock().unwrap().push((started, ok));
        });
    }
    calls.join_all().await;
    sampler.abort();
    for w in workers {
        w.abort();
    }
    measure(&scenario, &record, end)
}

fn measure(scenario: &Scenario, record: &Record, end: Duration) -> Measured {
    let trigger = scenario.trigger;
    let (t0, t1) = (ms(TRIGGER_AT), ms(trigger.end()));
    let attempts = record.attempts.lock().unwrap();
    let calls = record.calls.lock().unwrap();
    let queue = record.queue.lock().unwrap();
    let within = |t: u32, (a, b): (u32, u32)| t >= a && t < b;
    let healthy = (ms(HEALTHY.0), ms(HEALTHY.1));
    // Attempts at the bottom against the calls offered at the top, in the
    // busiest window of the trigger's first second.
    let bin = ms(PEAK_BIN);
    let onset_peak = (0..(1_000 - bin) / 10 + 1)
        .map(|i| {
            let span = (t0 + i * 10, t0 + i * 10 + bin);
            let sent = attempts.iter().filter(|a| within(a.0, span)).count() as f64;
            let offered = calls.iter().filter(|c| within(c.0, span)).count() as f64;
            sent / offered.max(1.0)
        })
        .fold(0.0, f64::max);
    let per_call = |span: (u32, u32)| {
        let n = calls.iter().filter(|c| within(c.0, span)).count();
        let a = attempts.iter().filter(|a| within(a.1, span)).count();
        (a as f64 / n.max(1) as f64, n)
    };
    let (attempts_per_call, n) = per_call((t0, t1));
    let (attempts_first_second, _) = per_call((t0, t0 + 1_000));
    let success = calls
        .iter()
        .filter(|c| within(c.0, (t0, t1)) && c.1)
        .count() as f64
        / n.max(1) as f64;
    let healthy_ok = calls
        .iter()
        .filter(|c| within(c.0, healthy))
        .filter(|c| c.1)
        .count() as f64
        / calls.iter().filter(|c| within(c.0, healthy)).count().max(1) as f64;
    // Goodput per 50 ms of call starts, from the trigger's end on.
    let gbin = ms(GOODPUT_BIN);
    let nbins = ((ms(end) - t1) / gbin) as usize;
    let mut good = vec![(0u32, 0u32); nbins];
    for &(started, ok) in calls.iter().filter(|c| c.0 >= t1) {
        if let Some(b) = good.get_mut(((started - t1) / gbin) as usize) {
            b.0 += u32::from(ok);
            b.1 += 1;
        }
    }
    let healthy_bin = |b: &(u32, u32)| f64::from(b.0) >= 0.95 * healthy_ok * f64::from(b.1);
    // The first bin from which every later one is healthy.
    let first_good = good
        .iter()
        .rposition(|b| !healthy_bin(b))
        .map_or(0, |i| i + 1);
    let sample = ms(SAMPLE);
    let recovery = (first_good < nbins)
        .then(|| {
            // From there, the first sample with the queue below the workers.
            let from = t1 + first_good as u32 * gbin;
            (from / sample..queue.len() as u32)
                .find(|&i| queue[i as usize] < WORKERS as i64)
                .map(|i| Duration::from_millis(u64::from(i * sample - t1)))
        })
        .flatten();
    Measured {
        onset_peak,
        attempts_per_call,
        attempts_first_second,
        success,
        recovery,
        max_queue: queue.iter().copied().max().unwrap_or(0),
        calls: n as u64,
    }
}
