//! `cargo run --release --example storm`
//!
//! The retry-storm simulation: what retries do to a failing service at the
//! bottom of 1, 2 and 3 stacked hops, each hop a client with its own
//! `RetryLayer`, without a budget, with `RetryBudget` and with tower's
//! `TpsBudget` plugged in through `TowerBudget` — each with the "do not
//! retry" mark of retry-at-one-layer off (how every retrying client behaved
//! before it) and on (the layer's default).
//!
//! Traffic is steady and open-loop: 50 clients, each starting a call every
//! 50–150 ms (without waiting for the last to finish) with a 1 s deadline. The bottom service is healthy for 5 s, fails every call for 10 s
//! (an outage), fails 20 % of calls at random for 10 s (a brown-out), then
//! recovers for 5 s. Time is tokio's paused clock, so the 30 s of traffic take
//! a few seconds to run and the figures do not depend on the machine's load.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response};
use http_body_util::BodyExt;
use rand::Rng;
use tokio::time::Instant;
use tonic::body::Body;
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
use tower::retry::budget::TpsBudget;
use tower::util::BoxCloneService;
use tower::{BoxError, Layer, ServiceExt};

type Hop = BoxCloneService<Request<Body>, Response<Body>, BoxError>;

const CLIENTS: usize = 50;
const BUCKET: Duration = Duration::from_millis(100);
/// Phases: name, start, end (seconds of simulated time), bottom failure rate.
const PHASES: [(&str, u64, u64, f64); 4] = [
    ("healthy", 0, 5, 0.0),
    ("outage", 5, 15, 1.0),
    ("brown-out", 15, 25, 0.2),
    ("recovered", 25, 30, 0.0),
];
const END: u64 = 30;

fn phase_at(t: Duration) -> usize {
    PHASES
        .iter()
        .position(|(_, start, end, _)| {
            t >= Duration::from_secs(*start) && t < Duration::from_secs(*end)
        })
        .unwrap_or(PHASES.len() - 1)
}

/// The request header telling the bottom in which phase the user's call
/// started, so attempts are counted against the calls that caused them.
const PHASE: &str = "x-storm-phase";
/// Set on calls started in the last 5 s of the outage.
const TAIL: &str = "x-storm-tail";

/// What the bottom service saw: attempts per 100 ms of simulated time, and
/// attempts per phase in which their user call started.
#[derive(Default)]
struct Load {
    buckets: Mutex<Vec<u64>>,
    by_phase: [AtomicU64; 4],
    tail: AtomicU64,
}

impl Load {
    fn record(&self, t: Duration, req: &Request<Body>) {
        let i = (t.as_millis() / BUCKET.as_millis()) as usize;
        {
            let mut b = self.buckets.lock().unwrap();
            if b.len() <= i {
                b.resize(i + 1, 0);
            }
            b[i] += 1;
        }
        let phase = req
            .headers()
            .get(PHASE)
            .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
            .unwrap_or(0);
        self.by_phase[phase.min(3)].fetch_add(1, Ordering::Relaxed);
        if req.headers().contains_key(TAIL) {
            self.tail.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The service at the bottom: answers after 2 ms, failing by the phase's rate.
fn bottom(start: Instant, load: Arc<Load>) -> Hop {
    BoxCloneService::new(tower::service_fn(move |req: Request<Body>| {
        let t = start.elapsed();
        load.record(t, &req);
        let fail = rand::rng().random_bool(PHASES[phase_at(t)].3);
        async move {
            tokio::time::sleep(Duration::from_millis(2)).await;
            Ok::<_, BoxError>(if fail {
                tonic::Status::unavailable("down").into_http()
            } else {
                // As a gRPC server answers a unary call: headers, the
                // message, then `OK` in the trailers.
                let mut trailers = http::HeaderMap::new();
                trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                let frames = [
                    Ok::<_, tonic::Status>(http_body::Frame::data(bytes::Bytes::from_static(
                        b"\0\0\0\0\0",
                    ))),
                    Ok(http_body::Frame::trailers(trailers)),
                ];
                Response::builder()
                    .header("content-type", "application/grpc")
                    .body(Body::new(http_body_util::StreamBody::new(
                        tokio_stream::iter(frames),
                    )))
                    .unwrap()
            })
        }
    }))
}

/// One hop: a client of `next` with a retry layer paying from `budget`.
fn hop<Bu: tonic_retry::budgets::Budget>(next: Hop, policy: RetryPolicy, budget: Bu) -> Hop {
    let layer = RetryLayer::with_budget(policy, budget);
    BoxCloneService::new(layer.layer(next).map_response(|r| r.map(Body::new)))
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    NoRetries,
    /// No budget; the "do not retry" mark on or off.
    None(bool),
    Ours(bool),
    Towers(bool),
}

impl Kind {
    const ALL: [Kind; 7] = [
        Kind::NoRetries,
        Kind::None(false),
        Kind::Ours(false),
        Kind::Towers(false),
        Kind::None(true),
        Kind::Ours(true),
        Kind::Towers(true),
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::NoRetries => "no retries",
            Kind::None(false) => "retries, no budget",
            Kind::Ours(false) => "RetryBudget(200, 0.1)",
            Kind::Towers(false) => "TpsBudget(10s, 10/s, 10%)",
            Kind::None(true) => "mark, no budget",
            Kind::Ours(true) => "mark + RetryBudget",
            Kind::Towers(true) => "mark + TpsBudget",
        }
    }
}

fn stack(depth: usize, kind: Kind, bottom: Hop) -> Hop {
    let retries = |mark| RetryPolicy::default().with_retry_at_one_layer(mark);
    // A budget too large to spend in the run: effectively none.
    let unlimited = || RetryBudget::new(u32::MAX, 1.0).unwrap();
    (0..depth).fold(bottom, |next, _| match kind {
        Kind::NoRetries => hop(
            next,
            RetryPolicy::new(1, Duration::ZERO, Duration::ZERO, 0.0).unwrap(),
            unlimited(),
        ),
        Kind::None(mark) => hop(next, retries(mark), unlimited()),
        Kind::Ours(mark) => hop(next, retries(mark), RetryBudget::new(200, 0.1).unwrap()),
        Kind::Towers(mark) => hop(
            next,
            retries(mark),
            tonic_retry::budgets::TowerBudget::new(TpsBudget::new(
                Duration::from_secs(10),
                10,
                0.1,
            )),
        ),
    })
}

/// Per phase: user calls started, succeeded; bottom attempts.
struct Report {
    calls: [u64; 4],
    ok: [u64; 4],
    bottom: [u64; 4],
    /// Bottom attempts per call started in the last 5 s of the outage, once
    /// any saved reserve is spent.
    outage_tail: f64,
    /// The bottom's busiest 100 ms during the outage, as a multiple of its
    /// healthy load.
    peak: f64,
    /// From the end of the brown-out until the bottom's load is back within
    /// 10 % of its healthy level.
    back_to_normal: Duration,
}

async fn run(depth: usize, kind: Kind) -> Report {
    let start = Instant::now();
    let load = Arc::new(Load::default());
    let top = stack(depth, kind, bottom(start, load.clone()));
    let calls: Arc<[AtomicU64; 4]> = Arc::new(Default::default());
    let ok: Arc<[AtomicU64; 4]> = Arc::new(Default::default());
    let tail_calls = Arc::new(AtomicU64::new(0));
    // Open loop: each client sends on its own schedule, whether or not its
    // earlier calls have finished, as independent users do.
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (top, calls, ok, tail_calls) =
                (top.clone(), calls.clone(), ok.clone(), tail_calls.clone());
            tokio::spawn(async move {
                let mut sent = tokio::task::JoinSet::new();
                loop {
                    let pause = rand::rng().random_range(50..=150);
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                    let t = start.elapsed();
                    if t >= Duration::from_secs(END) {
                        break;
                    }
                    let phase = phase_at(t);
                    calls[phase].fetch_add(1, Ordering::Relaxed);
                    let tail = t >= Duration::from_secs(10) && t < Duration::from_secs(15);
                    if tail {
                        tail_calls.fetch_add(1, Ordering::Relaxed);
                    }
                    let mut req = Request::new(Body::empty());
                    let headers = req.headers_mut();
                    headers.insert("grpc-timeout", http::HeaderValue::from_static("1S"));
                    headers.insert(PHASE, http::HeaderValue::from(phase));
                    if tail {
                        headers.insert(TAIL, http::HeaderValue::from_static("1"));
                    }
                    let (top, ok) = (top.clone(), ok.clone());
                    sent.spawn(async move {
                        // Read to the end, as a client does: the call's
                        // status is in the headers (Trailers-Only) or in the
                        // trailers, and each hop credits its budget there.
                        let good = match top.oneshot(req).await {
                            Ok(r) if r.headers().contains_key("grpc-status") => {
                                r.headers()["grpc-status"] == "0"
                            }
                            Ok(r) => r.into_body().collect().await.is_ok_and(|c| {
                                c.trailers()
                                    .is_some_and(|t| t.get("grpc-status").is_some_and(|s| s == "0"))
                            }),
                            Err(_) => false,
                        };
                        if good {
                            ok[phase].fetch_add(1, Ordering::Relaxed);
                        }
                    });
                }
                sent.join_all().await;
            })
        })
        .collect();
    for c in clients {
        c.await.expect("a client panicked");
    }

    let buckets = load.buckets.lock().unwrap().clone();
    let per_second = 1000 / BUCKET.as_millis() as u64;
    let bucket_range = |from: u64, to: u64| {
        let (a, b) = ((from * per_second) as usize, (to * per_second) as usize);
        buckets
            .get(a..b.min(buckets.len()))
            .unwrap_or(&[])
            .iter()
            .sum::<u64>()
    };
    let bottom = load.by_phase.each_ref().map(|n| n.load(Ordering::Relaxed));
    // Healthy load per bucket, skipping the first second of ramp-up.
    let healthy = bucket_range(1, 5) as f64 / (4 * per_second) as f64;
    let outage = (5 * per_second) as usize..(15 * per_second) as usize;
    let peak = buckets[outage].iter().copied().max().unwrap_or(0) as f64 / healthy;
    let recovery_start = (25 * per_second) as usize;
    let back = buckets[recovery_start..]
        .iter()
        .position(|&n| n as f64 <= healthy * 1.1)
        .unwrap_or(buckets.len() - recovery_start);
    Report {
        calls: calls.each_ref().map(|c| c.load(Ordering::Relaxed)),
        ok: ok.each_ref().map(|c| c.load(Ordering::Relaxed)),
        bottom,
        outage_tail: load.tail.load(Ordering::Relaxed) as f64
            / tail_calls.load(Ordering::Relaxed).max(1) as f64,
        peak,
        back_to_normal: BUCKET * back as u32,
    }
}

fn main() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a runtime");
    println!(
        "Retry storm: {CLIENTS} clients, each starting a call every 50-150 ms (open loop), 1 s deadline, 3 attempts a layer."
    );
    println!(
        "Bottom: healthy 0-5 s, outage (100 % UNAVAILABLE) 5-15 s, brown-out (20 %) 15-25 s, recovered 25-30 s."
    );
    println!();
    for depth in 1..=3usize {
        let worst = 3u32.pow(depth as u32);
        println!(
            "{depth} hop{} — worst case {worst} attempts per call at the bottom (3^{depth}) without the mark, 3 with it; if each layer re-fanned out, {}",
            if depth > 1 { "s" } else { "" },
            if depth == 1 {
                "1 copy".to_owned()
            } else {
                (0..depth)
                    .map(|k| (1u32 << k).to_string())
                    .collect::<Vec<_>>()
                    .join(" + ")
                    + &format!(" = {} copies", (1u32 << depth) - 1)
            }
        );
        println!(
            "  {:<26} {:>16} {:>16} {:>16} {:>16} {:>12} {:>10} {:>10}",
            "",
            "healthy",
            "outage",
            "brown-out",
            "recovered",
            "outage tail",
            "peak load",
            "to normal"
        );
        for kind in Kind::ALL {
            let r = runtime.block_on(run(depth, kind));
            let cell = |i: usize| {
                format!(
                    "{:>5.2} / {:>5.1} %",
                    r.bottom[i] as f64 / r.calls[i].max(1) as f64,
                    100.0 * r.ok[i] as f64 / r.calls[i].max(1) as f64
                )
            };
            println!(
                "  {:<26} {:>16} {:>16} {:>16} {:>16} {:>12.2} {:>9.1}x {:>10?}",
                kind.name(),
                cell(0),
                cell(1),
                cell(2),
                cell(3),
                r.outage_tail,
                r.peak,
                r.back_to_normal
            );
        }
        println!();
    }
    println!(
        "Each cell: bottom attempts per user call started in that phase / the success rate of those calls."
    );
    println!(
        "outage tail: bottom attempts per user call started in the last 5 s of the outage, once saved tokens are spent."
    );
    println!(
        "peak load: the bottom's busiest 100 ms in the outage, as a multiple of its healthy load."
    );
    println!(
        "to normal: from the end of the brown-out until the bottom's load is within 10 % of its healthy level."
    );
    println!(
        "mark: retry at one layer on — a layer that gives up after retrying, or is refused a retry by its budget or deadline, answers grpc-retry-pushback-ms: -1, and the layers above do not retry."
    );
}
