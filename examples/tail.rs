//! `cargo run --release --example tail [-- RUNS [ROW...]]`
//!
//! The tail-latency benchmark of hedging. Three `Library` instances on
//! loopback whose answers take 1 ms (98 % of calls), 50 ms (1.5 %) or 200 ms
//! (0.5 %); 32 tasks send 20,000 calls through `PreferUntried` over one
//! default tonic `Channel` per instance, with tonic's default client and
//! server settings. Side by side, each on fresh instances and channels: no
//! hedging, `tower::hedge` (its p95 over 1 s periods, 100 points), this
//! crate's fixed 10 ms hedge, its adaptive delay, and a stress row hedging
//! every call at once (delay 0). For each: p50 / p99 / p99.9 over the whole
//! run and after its first second, the extra attempts the servers saw (% of
//! calls), failed calls, and connections the servers accepted beyond the
//! three each row opens (a connection the client lost, to h2's reset
//! guards or anything else, is reopened and counted here), and for the
//! layer's rows the hedges its extra-load cap refused, and the longest
//! pause of the runtime in the row (a 1 ms timer's lateness: a pause holds
//! every call in flight, whatever the client does).
//!
//! `ROW` runs only the rows named (`none`, `tower`, `fixed`, `adaptive`,
//! `stress`), e.g. `-- 30 adaptive` to look at one row's spread.
//!
//! `-- RUNS lone` runs a second case instead: one `Channel` to one tonic
//! server served with `serve_with_incoming` from a plain listener, as a
//! careful user might write it, so that its sockets lack `TCP_NODELAY`
//! (tonic's `serve` sets it; `serve_with_incoming` leaves the sockets as they
//! come); 2 % of attempts take 200 ms, the rest 1 ms; 16 tasks send 5,000
//! calls. Rows: no hedging, a fixed 10 ms hedge that resets its loser (the
//! loser's future dropped, as `tower::hedge` does), and this crate's
//! `HedgePolicy::new(2, 10 ms)`, whose losers are drained (with its default
//! 5 % extra-load cap: `capped` counts the hedges it refused); each with the
//! server's sockets as they come, then with `TCP_NODELAY` set. Beside the
//! latencies: calls whose latency was at least 5 ms and under 12 ms, hedges
//! the server received after it had already answered the call's first
//! attempt (an answer that took more than the hedge delay to reach the
//! client), and the delayed ACKs the whole machine sent meanwhile (Linux's
//! `TcpExt: DelayedACKs`).

#[path = "../tests/support/library.rs"]
mod library;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use library::Shelf;
use library::pb::GetBookRequest;
use library::pb::library_client::LibraryClient;
use library::pb::library_server::LibraryServer;
use tonic::body::Body;
use tonic::transport::{Channel, Endpoint, Server};
use tonic_retry::balance::PreferUntried;
use tonic_retry::marks::IDEMPOTENCY_KEY;
use tonic_retry::{HedgePolicy, RetryBudget, RetryLayer, metrics::RetryMetrics};
use tonic_retry::{fault::Fault, fault::FaultLayer, fault::Rule};
use tower::util::BoxCloneService;
use tower::{BoxError, Service, ServiceExt};

const CALLS: usize = 20_000;
const TASKS: usize = 32;

// The error is a `Status`, not a `BoxError`: tonic's client over a service
// whose own type names `BoxError` cannot be spawned (see tests/stacks/tower.rs).
type Boxed = BoxCloneService<http::Request<Body>, http::Response<Body>, tonic::Status>;

fn status(error: impl Into<BoxError>) -> tonic::Status {
    tonic::Status::from_error(error.into())
}

/// One instance: its address, its faults (which count its requests), and the
/// connections it accepted.
struct Instance {
    addr: SocketAddr,
    faults: FaultLayer,
    accepted: Arc<AtomicU64>,
}

async fn instance(id: &str) -> Instance {
    let faults = FaultLayer::new(id)
        .unwrap()
        .with(Rule::rate(0.005, Fault::slow(Duration::from_millis(200))).unwrap())
        .with(Rule::rate(0.015 / 0.995, Fault::slow(Duration::from_millis(50))).unwrap())
        .with(Rule::always(Fault::slow(Duration::from_millis(1))));
    let (addr, accepted, incoming) = library::counted_incoming(true).await;
    let server = Server::builder()
        .layer(faults.clone())
        .add_service(LibraryServer::new(Shelf::default()))
        .serve_with_incoming(incoming);
    tokio::spawn(server);
    Instance {
        addr,
        faults,
        accepted,
    }
}

/// A default channel: tonic's own settings, nothing raised.
fn channel(addr: SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy()
}

#[derive(Clone, Copy, Debug)]
enum Row {
    None,
    TowerHedge,
    Fixed,
    Adaptive,
    Stress,
}

impl Row {
    const ALL: [Row; 5] = [
        Row::None,
        Row::TowerHedge,
        Row::Fixed,
        Row::Adaptive,
        Row::Stress,
    ];

    /// The row a command-line argument names.
    fn parse(arg: &str) -> Option<Row> {
        Some(match arg {
            "none" => Row::None,
            "tower" => Row::TowerHedge,
            "fixed" => Row::Fixed,
            "adaptive" => Row::Adaptive,
            "stress" => Row::Stress,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            Row::None => "no hedging",
            Row::TowerHedge => "tower::hedge (p95, 1 s)",
            Row::Fixed => "fixed 10 ms",
            Row::Adaptive => "adaptive (p98, floor 2 ms)",
            Row::Stress => "stress: every call, delay 0",
        }
    }
}

/// tower's hedge needs a request it can clone: the body, buffered.
#[derive(Clone)]
struct CloneBuffered;

impl tower::hedge::Policy<http::Request<Bytes>> for CloneBuffered {
    fn clone_request(&self, req: &http::Request<Bytes>) -> Option<http::Request<Bytes>> {
        let mut clone = http::Request::new(req.body().clone());
        *clone.method_mut() = req.method().clone();
        *clone.uri_mut() = req.uri().clone();
        *clone.headers_mut() = req.headers().clone();
        Some(clone)
    }

    fn can_retry(&self, _req: &http::Request<Bytes>) -> bool {
        true
    }
}

/// Buffers the request body, then calls `inner` with the bytes.
#[derive(Clone)]
struct BufferBody<S>(S);

impl<S> Service<http::Request<Body>> for BufferBody<S>
where
    S: Service<http::Request<Bytes>, Response = http::Response<Body>, Error = BoxError>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<http::Response<Body>, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let inner = self.0.clone();
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let bytes = body.collect().await?.to_bytes();
            inner.oneshot(http::Request::from_parts(parts, bytes)).await
        })
    }
}

/// The row's client stack, and the layer's counters for the rows that have one.
fn stack(row: Row, instances: &[Instance]) -> (Boxed, Option<RetryMetrics>) {
    let endpoints = instances
        .iter()
        .map(|i| (i.faults.instance().to_owned(), channel(i.addr)));
    let balancer = PreferUntried::new(endpoints).unwrap();
    // Enough to pay for every hedge the policy wants: the rows compare
    // delays, not budgets.
    let hedged = |policy: HedgePolicy| {
        let layer = RetryLayer::new(policy, RetryBudget::new(1_000_000, 1.0).unwrap());
        let service = BoxCloneService::new(
            tower::Layer::layer(&layer, balancer.clone())
                .map_response(|r| r.map(Body::new))
                .map_err(status),
        );
        (service, Some(layer.metrics().clone()))
    };
    match row {
        Row::None => (BoxCloneService::new(balancer.map_err(status)), None),
        Row::TowerHedge => {
            let inner = tower::service_fn(move |req: http::Request<Bytes>| {
                let balancer = balancer.clone();
                async move {
                    let req = req.map(|b| Body::new(http_body_util::Full::new(b)));
                    balancer.oneshot(req).await.map_err(BoxError::from)
                }
            });
            let hedge = tower::hedge::Hedge::new::<http::Request<Bytes>>(
                inner,
                CloneBuffered,
                100,
                0.95,
                Duration::from_secs(1),
            );
            // tower's `Hedge` is not `Clone`: shared through a buffer, whose
            // worker only starts each call, which then runs in the caller's task.
            let shared = tower::buffer::Buffer::new(hedge, 1024);
            let service = BoxCloneService::new(ServiceExt::<http::Request<Body>>::map_err(
                BufferBody(shared),
                status,
            ));
            (service, None)
        }
        Row::Fixed => hedged(
            HedgePolicy::new(2, Duration::from_millis(10))
                .unwrap()
                .with_max_extra_load(Some(0.05))
                .unwrap(),
        ),
        Row::Adaptive => hedged(
            HedgePolicy::new(2, Duration::from_millis(10))
                .unwrap()
                .with_adaptive_delay(0.98, Duration::from_secs(10), Duration::from_millis(2))
                .unwrap()
                .with_max_extra_load(Some(0.05))
                .unwrap(),
        ),
        Row::Stress => hedged(
            HedgePolicy::new(2, Duration::ZERO)
                .unwrap()
                .with_max_extra_load(None)
                .unwrap(),
        ),
    }
}

/// What one row gave.
struct RowResult {
    /// (started after the run's start, latency) of each successful call.
    latencies: Vec<(Duration, Duration)>,
    failed: usize,
    extra: f64,
    reconnects: u64,
    /// Hedges the extra-load cap refused (the layer's rows).
    capped: Option<u64>,
    /// The longest a 1 ms timer fired late in the row: how long the runtime
    /// (or the machine) kept every task waiting at once. No client's p99.9
    /// can be below a pause that held all 32 calls in flight.
    stall: Duration,
}

/// Sleeps 1 ms at a time until `done`, and returns the most any sleep
/// overran it by.
async fn probe(done: Arc<std::sync::atomic::AtomicBool>) -> Duration {
    let mut worst = Duration::ZERO;
    while !done.load(Ordering::Relaxed) {
        let asked = Instant::now() + Duration::from_millis(1);
        tokio::time::sleep_until(asked.into()).await;
        worst = worst.max(Instant::now().saturating_duration_since(asked));
    }
    worst
}

/// Sends `calls` calls from `tasks` tasks through `client`, each with a 2 s
/// deadline: each successful call's start (after `start`) and latency, and
/// the calls that failed.
async fn drive(
    client: LibraryClient<Boxed>,
    calls: usize,
    tasks: usize,
    start: Instant,
) -> (Vec<(Duration, Duration)>, usize) {
    let next = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..tasks)
        .map(|_| {
            let mut client = client.clone();
            let next = Arc::clone(&next);
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut failed = 0;
                while next.fetch_add(1, Ordering::Relaxed) < calls {
                    let begun = Instant::now();
                    let mut req = tonic::Request::new(GetBookRequest { isbn: "1".into() });
                    req.set_timeout(Duration::from_secs(2));
                    match client.get_book(req).await {
                        Ok(_) => latencies.push((begun - start, begun.elapsed())),
                        Err(_) => failed += 1,
                    }
                }
                (latencies, failed)
            })
        })
        .collect();
    let mut latencies = Vec::with_capacity(calls);
    let mut failed = 0;
    for task in tasks {
        let (l, f) = task.await.unwrap();
        latencies.extend(l);
        failed += f;
    }
    (latencies, failed)
}

async fn run_row(row: Row) -> RowResult {
    let instances = [
        instance("a").await,
        instance("b").await,
        instance("c").await,
    ];
    let (stack, metrics) = stack(row, &instances);
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let prober = tokio::spawn(probe(Arc::clone(&done)));
    let client = LibraryClient::new(stack);
    let start = Instant::now();
    let (latencies, failed) = drive(client, CALLS, TASKS, start).await;
    done.store(true, Ordering::Relaxed);
    let stall = prober.await.unwrap();
    let requests: u64 = instances.iter().map(|i| i.faults.requests()).sum();
    let accepted: u64 = instances
        .iter()
        .map(|i| i.accepted.load(Ordering::Relaxed))
        .sum();
    RowResult {
        latencies,
        failed,
        extra: requests as f64 / CALLS as f64 - 1.0,
        reconnects: accepted.saturating_sub(instances.len() as u64),
        capped: metrics.map(|m| m.hedges_capped()),
        stall,
    }
}

fn percentiles(mut latencies: Vec<Duration>) -> [Duration; 3] {
    latencies.sort();
    let at = |p: f64| {
        if latencies.is_empty() {
            return Duration::ZERO;
        }
        let i = ((latencies.len() as f64 * p).ceil() as usize).clamp(1, latencies.len()) - 1;
        latencies[i]
    };
    [at(0.5), at(0.99), at(0.999)]
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let runs: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1);
    let mut lone = false;
    let mut rows: Vec<Row> = args
        .filter(|a| {
            lone |= a == "lone";
            a != "lone"
        })
        .map(|a| {
            Row::parse(&a).unwrap_or_else(|| {
                eprintln!("no row named {a:?}: none, tower, fixed, adaptive, stress, or lone");
                std::process::exit(2)
            })
        })
        .collect();
    if lone {
        return lone_server(runs).await;
    }
    if rows.is_empty() {
        rows = Row::ALL.to_vec();
    }
    println!(
        "{CALLS} calls, {TASKS} tasks, three loopback instances answering in 1 ms (98 %), 50 ms (1.5 %), 200 ms (0.5 %); tonic's default settings"
    );
    for run in 1..=runs {
        println!("\nrun {run}");
        println!(
            "  {:<30} {:>26}   {:>26}   {:>7} {:>7} {:>11} {:>7} {:>9}",
            "",
            "whole run p50/p99/p99.9 ms",
            "after 1 s p50/p99/p99.9 ms",
            "extra",
            "failed",
            "reconnects",
            "capped",
            "stall ms"
        );
        for &row in &rows {
            let result = run_row(row).await;
            let whole = percentiles(result.latencies.iter().map(|(_, l)| *l).collect());
            let after = percentiles(
                result
                    .latencies
                    .iter()
                    .filter(|(started, _)| *started >= Duration::from_secs(1))
                    .map(|(_, l)| *l)
                    .collect(),
            );
            let show = |p: [Duration; 3]| format!("{} / {} / {}", ms(p[0]), ms(p[1]), ms(p[2]));
            println!(
                "  {:<30} {:>26}   {:>26}   {:>6.2}% {:>7} {:>11} {:>7} {:>9}",
                row.name(),
                show(whole),
                show(after),
                result.extra * 100.0,
                result.failed,
                result.reconnects,
                result.capped.map_or("-".to_owned(), |c| c.to_string()),
                ms(result.stall)
            );
        }
    }
}

const LONE_CALLS: usize = 5_000;
const LONE_TASKS: usize = 16;

/// How many delayed ACKs this machine's TCP has sent (Linux's
/// `TcpExt: DelayedACKs`): ACKs a receiver held back, hoping to send each
/// with data of its own, and sent alone when its timer ran out. `None` where
/// the count cannot be read.
fn delayed_acks() -> Option<u64> {
    let netstat = std::fs::read_to_string("/proc/net/netstat").ok()?;
    let mut lines = netstat.lines().filter(|line| line.starts_with("TcpExt:"));
    let (names, values) = (lines.next()?, lines.next()?);
    let at = names
        .split_whitespace()
        .position(|name| name == "DelayedACKs")?;
    values.split_whitespace().nth(at)?.parse().ok()
}

/// The lone server's rows.
#[derive(Clone, Copy, Debug)]
enum Lone {
    None,
    Reset,
    Layer,
}

impl Lone {
    fn name(self) -> &'static str {
        match self {
            Lone::None => "no hedging",
            Lone::Reset => "10 ms, loser reset",
            Lone::Layer => "this crate, 10 ms",
        }
    }
}

/// What the server saw of each call, by its idempotency key: whether its
/// first attempt was answered; and the attempts that came after that.
#[derive(Default)]
struct Seen {
    answered: Mutex<HashMap<http::HeaderValue, bool>>,
    after_answer: AtomicU64,
}

/// Watches the calls a server answers (outside its faults).
#[derive(Clone)]
struct Watch<S> {
    inner: S,
    seen: Arc<Seen>,
}

impl<S, B> Service<http::Request<B>> for Watch<S>
where
    S: Service<http::Request<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let key = req.headers().get(IDEMPOTENCY_KEY).cloned();
        let first = key.as_ref().is_some_and(|key| {
            let mut answered = self.seen.answered.lock().unwrap();
            match answered.get(key) {
                None => {
                    answered.insert(key.clone(), false);
                    true
                }
                Some(done) => {
                    if *done {
                        self.seen.after_answer.fetch_add(1, Ordering::Relaxed);
                    }
                    false
                }
            }
        });
        let answer = self.inner.call(req);
        let seen = Arc::clone(&self.seen);
        Box::pin(async move {
            let response = answer.await;
            if let (true, Some(key)) = (first, key) {
                seen.answered.lock().unwrap().insert(key, true);
            }
            response
        })
    }
}

/// The lone server, its sockets with `TCP_NODELAY` only if `nodelay`.
async fn lone_instance(nodelay: bool) -> (Instance, Arc<Seen>) {
    let faults = FaultLayer::new("lone")
        .unwrap()
        .with(Rule::rate(0.02, Fault::slow(Duration::from_millis(200))).unwrap())
        .with(Rule::always(Fault::slow(Duration::from_millis(1))));
    let seen = Arc::new(Seen::default());
    let (addr, accepted, incoming) = library::counted_incoming(nodelay).await;
    let watched = Arc::clone(&seen);
    let server = Server::builder()
        .layer(tower::layer::layer_fn(move |inner| Watch {
            inner,
            seen: Arc::clone(&watched),
        }))
        .layer(faults.clone())
        .add_service(LibraryServer::new(Shelf::default()))
        .serve_with_incoming(incoming);
    tokio::spawn(server);
    let instance = Instance {
        addr,
        faults,
        accepted,
    };
    (instance, seen)
}

/// A fixed 10 ms hedge that resets its loser: the attempt that has not
/// answered when the other does is dropped (its stream reset). Its attempts
/// carry one key, as the layer's do, for the server's count.
async fn reset_hedge(
    channel: Channel,
    req: http::Request<Bytes>,
) -> Result<http::Response<Body>, BoxError> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let key = http::HeaderValue::from(NEXT.fetch_add(1, Ordering::Relaxed));
    let attempt = || {
        let mut attempt =
            http::Request::new(Body::new(http_body_util::Full::new(req.body().clone())));
        *attempt.method_mut() = req.method().clone();
        *attempt.uri_mut() = req.uri().clone();
        *attempt.headers_mut() = req.headers().clone();
        attempt.headers_mut().insert(IDEMPOTENCY_KEY, key.clone());
        channel.clone().oneshot(attempt)
    };
    let first = attempt();
    tokio::pin!(first);
    tokio::select! {
        answer = &mut first => return answer.map_err(Into::into),
        () = tokio::time::sleep(Duration::from_millis(10)) => {}
    }
    let second = attempt();
    tokio::select! {
        answer = first => answer.map_err(Into::into),
        answer = second => answer.map_err(Into::into),
    }
}

/// The lone server's row's client stack, and the layer's counters for its row.
fn lone_stack(row: Lone, addr: SocketAddr) -> (Boxed, Option<RetryMetrics>) {
    let channel = channel(addr);
    let stack = match row {
        Lone::None => BoxCloneService::new(channel.map_err(status)),
        Lone::Reset => {
            let inner = tower::service_fn(move |req: http::Request<Bytes>| {
                reset_hedge(channel.clone(), req)
            });
            BoxCloneService::new(ServiceExt::<http::Request<Body>>::map_err(
                BufferBody(inner),
                status,
            ))
        }
        Lone::Layer => {
            // As a user would write it: the policy's default extra-load cap
            // (5 %) stays, and the row says how many hedges it refused.
            let layer = RetryLayer::new(
                HedgePolicy::new(2, Duration::from_millis(10)).unwrap(),
                RetryBudget::new(1_000_000, 1.0).unwrap(),
            );
            let metrics = layer.metrics().clone();
            let stack = BoxCloneService::new(
                tower::Layer::layer(&layer, channel)
                    .map_response(|r| r.map(Body::new))
                    .map_err(status),
            );
            return (stack, Some(metrics));
        }
    };
    (stack, None)
}

async fn lone_server(runs: usize) {
    println!(
        "{LONE_CALLS} calls, {LONE_TASKS} tasks, one Channel to one server answering in 1 ms (98 %) or 200 ms (2 %), served with serve_with_incoming"
    );
    for run in 1..=runs {
        println!("\nrun {run}");
        println!(
            "  {:<34} {:>22} {:>7} {:>7} {:>10} {:>14} {:>11} {:>7} {:>13}",
            "",
            "p50/p99/p99.9 ms",
            "extra",
            "failed",
            "5-12 ms",
            "after answer",
            "reconnects",
            "capped",
            "delayed ACKs"
        );
        for nodelay in [false, true] {
            for row in [Lone::None, Lone::Reset, Lone::Layer] {
                let (instance, seen) = lone_instance(nodelay).await;
                let acks_before = delayed_acks();
                let (stack, metrics) = lone_stack(row, instance.addr);
                let client = LibraryClient::new(stack);
                let (latencies, failed) =
                    drive(client, LONE_CALLS, LONE_TASKS, Instant::now()).await;
                let latencies: Vec<Duration> = latencies.into_iter().map(|(_, l)| l).collect();
                let acks = delayed_acks()
                    .zip(acks_before)
                    .map_or("-".to_owned(), |(after, before)| {
                        (after - before).to_string()
                    });
                let between = latencies
                    .iter()
                    .filter(|l| (5..12).contains(&l.as_millis()))
                    .count();
                let p = percentiles(latencies);
                let name = format!(
                    "{}{}",
                    row.name(),
                    if nodelay { ", TCP_NODELAY" } else { "" }
                );
                println!(
                    "  {:<34} {:>22} {:>6.2}% {:>7} {:>10} {:>14} {:>11} {:>7} {:>13}",
                    name,
                    format!("{} / {} / {}", ms(p[0]), ms(p[1]), ms(p[2])),
                    (instance.faults.requests() as f64 / LONE_CALLS as f64 - 1.0) * 100.0,
                    failed,
                    between,
                    seen.after_answer.load(Ordering::Relaxed),
                    instance.accepted.load(Ordering::Relaxed).saturating_sub(1),
                    metrics.map_or("-".to_owned(), |m| m.hedges_capped().to_string()),
                    acks,
                );
            }
        }
    }
}
