//! Retrying stays at one layer under attempt timeouts, in a service with a
//! capacity: three retrying layers stacked in process (each reads the
//! deadline and the attempt's end the layer above sent), every one with a 150 ms
//! attempt timeout and no budget, over a bottom of 16 workers and a FIFO
//! queue that serves every request, even one whose caller has gone. Calls
//! arrive at 65 % of capacity; for 2 s the capacity drops to a third, the
//! queue grows and every hop's attempts time out. However many layers cut
//! their attempts, the bottom sees no more attempts per call than one layer
//! makes.
//!
//! Paused time and seeded draws: the run takes a few seconds of real time.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::{HeaderValue, Request, Response};
use http_body_util::BodyExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tonic::body::Body;
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
use tower::util::BoxCloneService;
use tower::{BoxError, Layer, ServiceExt};

type Hop = BoxCloneService<Request<Body>, Response<Body>, BoxError>;

const WORKERS: usize = 16;
/// Workers left during the drop.
const DROPPED_TO: usize = 5;
/// Each request takes 8–12 ms: 1,600 a second at full capacity.
const SERVICE_MS: std::ops::RangeInclusive<u64> = 8..=12;
/// Calls a second: 65 % of capacity.
const RATE: f64 = 0.65 * 1_600.0;
const DROP_START: Duration = Duration::from_secs(2);
const DROP_END: Duration = Duration::from_secs(4);
const END: Duration = Duration::from_secs(6);
/// Set on calls started during the drop.
const DURING: &str = "x-during-drop";

struct Job {
    answer: oneshot::Sender<()>,
}

/// Attempts the bottom was sent: all, and those of calls started during the
/// drop.
#[derive(Default)]
struct Seen {
    all: AtomicU64,
    during: AtomicU64,
}

/// The bottom: a FIFO queue served by `WORKERS` workers, `DROPPED_TO` of
/// them during the drop. Returns the service and the workers' tasks.
fn bottom(start: Instant, seen: Arc<Seen>) -> (Hop, Vec<tokio::task::JoinHandle<()>>) {
    let (tx, rx) = mpsc::unbounded_channel::<Job>();
    let rx = Arc::new(tokio::sync::Mutex::new(rx));
    let workers = (0..WORKERS)
        .map(|i| {
            let rx = Arc::clone(&rx);
            tokio::spawn(async move {
                let mut rng = StdRng::seed_from_u64(i as u64);
                loop {
                    let t = start.elapsed();
                    if i >= DROPPED_TO && t >= DROP_START && t < DROP_END {
                        tokio::time::sleep_until(start + DROP_END).await;
                        continue;
                    }
                    let Some(job) = rx.lock().await.recv().await else {
                        return;
                    };
                    let ms = rng.random_range(SERVICE_MS);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    // Served whether or not its caller is still there.
                    let _ = job.answer.send(());
                }
            })
        })
        .collect();
    let service = tower::service_fn(move |req: Request<Body>| {
        let during = req.headers().contains_key(DURING);
        seen.all.fetch_add(1, Ordering::Relaxed);
        if during {
            seen.during.fetch_add(1, Ordering::Relaxed);
        }
        let (answer, answered) = oneshot::channel();
        let _ = tx.send(Job { answer });
        async move {
            answered.await.map_err(|_| BoxError::from("bottom gone"))?;
            Ok::<_, BoxError>(crate::support::answer(tonic::Code::Ok))
        }
    });
    (BoxCloneService::new(service), workers)
}

/// `depth` layers over `bottom`, each with the default policy, a 150 ms
/// attempt timeout and a budget too large to spend.
fn stack(depth: usize, bottom: Hop) -> Hop {
    (0..depth).fold(bottom, |next, _| {
        let policy = RetryPolicy::default().with_attempt_timeout(Duration::from_millis(150));
        let budget = RetryBudget::new(u32::MAX, 1.0).unwrap();
        let layer = RetryLayer::new(policy, budget);
        BoxCloneService::new(layer.layer(next).map_response(|r| r.map(Body::new)))
    })
}

/// Runs the model through `depth` layers: calls started during the drop,
/// and the bottom's attempts for them.
async fn run(depth: usize) -> (u64, u64) {
    let start = Instant::now();
    let seen = Arc::new(Seen::default());
    let (bottom, workers) = bottom(start, Arc::clone(&seen));
    let top = stack(depth, bottom);
    let mut rng = StdRng::seed_from_u64(7);
    let mut calls = tokio::task::JoinSet::new();
    let mut during = 0;
    // Poisson arrivals: exponential gaps, each arrival at its own time. (A
    // sleep per gap would not do: tokio's timer wakes on whole milliseconds,
    // so gaps of under a millisecond, most of them at this rate, would each
    // take one or two, and the load would be some 40 % rather than 65 %.)
    let mut next = Duration::ZERO;
    loop {
        next += Duration::from_secs_f64(-(1.0 - rng.random::<f64>()).ln() / RATE);
        if next >= END {
            break;
        }
        if start.elapsed() < next {
            tokio::time::sleep_until(start + next).await;
        }
        let t = next;
        let mut req = Request::new(Body::empty());
        req.headers_mut()
            .insert("grpc-timeout", HeaderValue::from_static("500m"));
        if t >= DROP_START && t < DROP_END {
            during += 1;
            req.headers_mut()
                .insert(DURING, HeaderValue::from_static("1"));
        }
        let top = top.clone();
        calls.spawn(async move {
            // Read to the end, as a client does.
            if let Ok(r) = top.oneshot(req).await {
                let _ = r.into_body().collect().await;
            }
        });
    }
    calls.join_all().await;
    // Let every drain below end (each is bounded by its call's deadline).
    tokio::time::sleep(Duration::from_secs(1)).await;
    for w in workers {
        w.abort();
    }
    (during, seen.during.load(Ordering::Relaxed))
}

#[tokio::test(start_paused = true)]
async fn three_layers_with_attempt_timeouts_send_one_layers_attempts_in_an_overload() {
    let (one_calls, one_attempts) = run(1).await;
    let (three_calls, three_attempts) = run(3).await;
    // The model's load is as stated: 2 s of calls at `RATE`, within 5 %.
    let expected = RATE * (DROP_END - DROP_START).as_secs_f64();
    for calls in [one_calls, three_calls] {
        assert!(
            (calls as f64 - expected).abs() < 0.05 * expected,
            "{calls} calls during the drop, {expected:.0} expected"
        );
    }
    let one = one_attempts as f64 / one_calls as f64;
    let three = three_attempts as f64 / three_calls as f64;
    eprintln!("attempts per call at the bottom: 1 layer {one:.2}, 3 layers {three:.2}");
    // The model's check: the drop overloads the bottom enough that one
    // layer retries (its calls' first attempts time out).
    assert!(one > 1.5, "one layer: {one:.2} attempts per call");
    assert!(
        three <= 3.0,
        "three layers: {three:.2} attempts per call at the bottom (one layer: {one:.2})"
    );
}
