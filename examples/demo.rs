//! `cargo run --example demo`
//!
//! Three `Library` instances on loopback, each with faults of its own — one
//! goes through a rolling restart (connections refused, then back) — and the
//! same few hundred calls sent twice through `ServiceBuilder` with a timeout,
//! a concurrency limit and a balancer: once without the retry layer, once with
//! it. Prints how a few retried calls went, attempt by attempt, then both runs
//! side by side.

#[path = "../tests/support/library.rs"]
mod library;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use library::pb::GetBookRequest;
use library::pb::library_client::LibraryClient;
use library::{Instance, Shelf};
use tonic::Code;
use tonic_retry::balance::PreferUntried;
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
use tonic_retry::{fault::Fault, fault::FaultLayer, fault::Rule};
use tower::ServiceBuilder;
use tower::util::BoxCloneService;
use tracing_subscriber::layer::SubscriberExt;

const CALLS: usize = 400;
const WORKERS: usize = 8;
const CALL_TIMEOUT: Duration = Duration::from_millis(400);

type Body = tonic::body::Body;
type Svc = BoxCloneService<http::Request<Body>, http::Response<Body>, tonic::Status>;

/// What one run of the traffic gave.
struct Run {
    ok: usize,
    codes: BTreeMap<String, usize>,
    latencies: Vec<Duration>,
    downstream: u64,
    took: Duration,
}

/// Sends `CALLS` calls from `WORKERS` workers; instance `b` goes down after a
/// fifth of the calls and comes back after a half. `sent` counts the requests
/// the balancer sends to any instance, refused connections included.
async fn traffic(client: LibraryClient<Svc>, instances: &mut [Instance], sent: &AtomicU64) -> Run {
    let before = sent.load(Ordering::Relaxed);
    let done = Arc::new(AtomicUsize::new(0));
    let next = Arc::new(AtomicUsize::new(0));
    let results = Arc::new(Mutex::new(Vec::with_capacity(CALLS)));
    let started = Instant::now();
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let (mut client, done, next, results) =
                (client.clone(), done.clone(), next.clone(), results.clone());
            tokio::spawn(async move {
                while next.fetch_add(1, Ordering::Relaxed) < CALLS {
                    let mut req = tonic::Request::new(GetBookRequest {
                        isbn: "978-0".into(),
                    });
                    req.set_timeout(CALL_TIMEOUT);
                    let t = Instant::now();
                    let code = match client.get_book(req).await {
                        Ok(_) => Code::Ok,
                        Err(status) => status.code(),
                    };
                    results.lock().unwrap().push((code, t.elapsed()));
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();

    // The rolling restart of instance b, paced by the traffic itself.
    let b = &mut instances[1];
    while done.load(Ordering::Relaxed) < CALLS / 5 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    b.stop().await;
    while done.load(Ordering::Relaxed) < CALLS / 2 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    b.restart().await;
    for w in workers {
        w.await.expect("a worker panicked");
    }

    let took = started.elapsed();
    let results = std::mem::take(&mut *results.lock().unwrap());
    let mut codes = BTreeMap::new();
    for (code, _) in &results {
        *codes.entry(format!("{code:?}")).or_insert(0) += 1;
    }
    let mut latencies: Vec<_> = results.iter().map(|(_, t)| *t).collect();
    latencies.sort();
    Run {
        ok: results.iter().filter(|(c, _)| *c == Code::Ok).count(),
        codes,
        latencies,
        downstream: sent.load(Ordering::Relaxed) - before,
        took,
    }
}

/// `Some(12.345678ms)` → `12.3ms`; `None` → `-`.
fn short(debug: &str) -> String {
    let inner = debug.trim_start_matches("Some(").trim_end_matches(')');
    let Some(split) = inner.find(|c: char| c.is_ascii_alphabetic()) else {
        return "-".to_owned();
    };
    let (number, unit) = inner.split_at(split);
    match number.parse::<f64>() {
        Ok(n) => format!("{n:.1}{unit}"),
        Err(_) => "-".to_owned(),
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).copied().unwrap_or_default()
}

fn client(
    instances: &[Instance],
    sent: &Arc<AtomicU64>,
    retry: Option<&RetryLayer>,
) -> LibraryClient<Svc> {
    let endpoints = instances.iter().map(|i| {
        let sent = sent.clone();
        let counted = ServiceBuilder::new()
            .map_request(move |r: http::Request<Body>| {
                sent.fetch_add(1, Ordering::Relaxed);
                r
            })
            .service(i.channel());
        (i.faults.instance().to_owned(), counted)
    });
    let balancer = PreferUntried::new(endpoints).expect("three named instances");
    let stack = ServiceBuilder::new()
        .map_err(tonic::Status::from_error)
        .timeout(Duration::from_secs(2))
        .concurrency_limit(32);
    let svc = match retry {
        Some(retry) => BoxCloneService::new(
            stack
                .map_response(|r: http::Response<_>| r.map(Body::new))
                .layer(retry.clone())
                .service(balancer),
        ),
        None => BoxCloneService::new(stack.service(balancer)),
    };
    LibraryClient::new(svc)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let events = Events::default();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(events.clone()))?;

    let mut instances = vec![
        // a: a fifth of its answers are UNAVAILABLE (an overloaded instance).
        Instance::start(
            Shelf::default(),
            FaultLayer::new("a")?.with(Rule::rate(0.2, Fault::unavailable())?),
        )
        .await,
        // b: healthy, but restarted part-way through each run.
        Instance::start(Shelf::default(), FaultLayer::new("b")?).await,
        // c: sometimes rate-limits with RetryInfo, sometimes too slow for one attempt.
        Instance::start(
            Shelf::default(),
            FaultLayer::new("c")?
                .with(Rule::rate(
                    0.1,
                    Fault::rate_limited(Duration::from_millis(30)),
                )?)
                .with(Rule::rate(0.05, Fault::slow(Duration::from_millis(600)))?),
        )
        .await,
    ];
    println!(
        "tonic-retry demo: {CALLS} GetBook calls, {WORKERS} at a time, {CALL_TIMEOUT:?} deadline each."
    );
    println!("instances on loopback:");
    for i in &instances {
        println!("  {} at {}", i.faults.instance(), i.addr);
    }
    println!(
        "  a: 20 % UNAVAILABLE | b: rolling restart (refused from call {} to {}) | c: 10 % RESOURCE_EXHAUSTED + RetryInfo(30ms), 5 % slow (600 ms)\n",
        CALLS / 5,
        CALLS / 2
    );

    let sent = Arc::new(AtomicU64::new(0));
    let without = traffic(client(&instances, &sent, None), &mut instances, &sent).await;

    let layer = RetryLayer::new(
        RetryPolicy::default().with_attempt_timeout(Duration::from_millis(250)),
        RetryBudget::new(200, 0.1)?,
    );
    events.record(true);
    let with = traffic(
        client(&instances, &sent, Some(&layer)),
        &mut instances,
        &sent,
    )
    .await;
    events.record(false);

    println!("A few retried calls, attempt by attempt (from the layer's tracing events):");
    for (key, attempts) in events.retried_calls(4) {
        println!("  call {}…", &key[..8]);
        for e in attempts {
            println!(
                "    attempt {} on {:<2} {:<18} {:<17} delay {:<12} time left {}",
                e.get("attempt"),
                e.get("instance"),
                e.get("code"),
                e.get("message"),
                short(e.get("delay")),
                short(e.get("remaining")),
            );
        }
    }

    println!("\n  {:<30}{:<20}with the layer", "", "without the layer");
    let row = |name: &str, a: String, b: String| println!("  {name:<30}{a:<20}{b}");
    row(
        "success rate",
        format!("{:.1} %", 100.0 * without.ok as f64 / CALLS as f64),
        format!("{:.1} %", 100.0 * with.ok as f64 / CALLS as f64),
    );
    row(
        "attempts sent per call",
        format!("{:.2}", without.downstream as f64 / CALLS as f64),
        format!("{:.2}", with.downstream as f64 / CALLS as f64),
    );
    row(
        "p50 latency",
        format!("{:.1?}", percentile(&without.latencies, 0.5)),
        format!("{:.1?}", percentile(&with.latencies, 0.5)),
    );
    row(
        "p99 latency",
        format!("{:.1?}", percentile(&without.latencies, 0.99)),
        format!("{:.1?}", percentile(&with.latencies, 0.99)),
    );
    row(
        "run took",
        format!("{:.2?}", without.took),
        format!("{:.2?}", with.took),
    );
    println!("\n  outcomes without the layer: {:?}", without.codes);
    println!("  outcomes with the layer:    {:?}", with.codes);
    let m = layer.metrics();
    println!(
        "  with the layer: {} retries, {} refused by the budget, {} refused by the deadline; budget {:.1} of {} tokens",
        m.retries(),
        m.refused_by_budget(),
        m.refused_by_deadline(),
        layer.budget().available(),
        layer.budget().max_tokens(),
    );
    Ok(())
}

/// Keeps the fields of the layer's per-attempt events, grouped by call.
#[derive(Clone, Default)]
struct Events {
    on: Arc<std::sync::atomic::AtomicBool>,
    by_key: Arc<Mutex<Vec<Call>>>,
}

/// One call's idempotency key and its attempts' events, in order.
type Call = (String, Vec<Event>);

#[derive(Default)]
struct Event(BTreeMap<&'static str, String>);

impl Event {
    fn get(&self, field: &str) -> &str {
        self.0.get(field).map_or("-", String::as_str)
    }
}

impl Events {
    fn record(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    /// Up to `n` calls that needed more than one attempt, each showing a
    /// different first failure (instance and code).
    fn retried_calls(&self, n: usize) -> Vec<Call> {
        let mut shown = std::collections::BTreeSet::new();
        std::mem::take(&mut *self.by_key.lock().unwrap())
            .into_iter()
            .filter(|(_, attempts)| attempts.len() > 1)
            .filter(|(_, attempts)| {
                let first = &attempts[0];
                shown.insert((
                    first.get("instance").to_owned(),
                    first.get("code").to_owned(),
                ))
            })
            .take(n)
            .collect()
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Events {
    fn enabled(
        &self,
        meta: &tracing::Metadata<'_>,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        meta.target().starts_with("tonic_retry")
    }

    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Visit<'a>(&'a mut Event);
        impl tracing::field::Visit for Visit<'_> {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.0.0.insert(field.name(), format!("{value:?}"));
            }
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                self.0.0.insert(field.name(), value.to_owned());
            }
        }
        if !self.on.load(Ordering::Relaxed) {
            return;
        }
        let mut e = Event::default();
        event.record(&mut Visit(&mut e));
        let Some(key) = e.0.get("key").cloned() else {
            return;
        };
        let mut calls = self.by_key.lock().unwrap();
        match calls.iter_mut().find(|(k, _)| *k == key) {
            Some((_, attempts)) => attempts.push(e),
            None => calls.push((key, vec![e])),
        }
    }
}
