//! A real tonic server and client on 127.0.0.1: unary `GetBook` calls, one at a
//! time, without and with `RetryLayer`, in the same run. Criterion times the
//! calls (their inverse is calls/s); then the clients take turns call by call
//! to read calls/s and p50/p99 latency under the same conditions.
//!
//! `LOOPBACK_SPIN_NS=n` adds a client for calibration: the bare client with a
//! 10 s timeout, spinning for `n` ns before each call, as a layer's own work
//! before it sends would. On this loop a call's latency is not linear in the
//! work done before it is sent (BENCHMARKS.md, "The timeout gap is a
//! threshold of the loop").

#[path = "../tests/support/library.rs"]
mod library;

use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use library::Shelf;
use library::pb::GetBookRequest;
use library::pb::library_client::LibraryClient;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use tonic::transport::Channel;
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy, RetryService};
use tower::ServiceBuilder;

type Plain = LibraryClient<Channel>;
type Layered = LibraryClient<RetryService<Channel>>;

fn request() -> GetBookRequest {
    GetBookRequest {
        isbn: "978-0-00-000000-0".into(),
    }
}

macro_rules! timed_calls {
    ($client:expr, $iters:expr) => {{
        let mut client = $client.clone();
        let start = Instant::now();
        for _ in 0..$iters {
            std::hint::black_box(
                client
                    .get_book(request())
                    .await
                    .expect("the server answers"),
            );
        }
        start.elapsed()
    }};
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let (plain, layered, no_key, enforcing) = rt.block_on(async {
        // A plain tonic server: no fault layer, nothing recorded.
        let addr = library::serve_plain(Shelf::default()).await;
        let plain: Plain = LibraryClient::new(library::channel(addr));
        // A bare client whose Channel enforces the timeout itself, with a
        // tokio timer for each call, as the layer does for its deadline.
        let enforcing: Plain = LibraryClient::new(
            library::endpoint(addr)
                .timeout(Duration::from_secs(10))
                .connect_lazy(),
        );
        enforcing
            .clone()
            .get_book(request())
            .await
            .expect("the server answers");
        let layer = RetryLayer::new(
            RetryPolicy::default(),
            RetryBudget::new(200, 0.1).expect("a budget"),
        );
        let layered: Layered = LibraryClient::new(
            ServiceBuilder::new()
                .layer(layer)
                .service(library::channel(addr)),
        );
        let no_key = RetryLayer::new(
            RetryPolicy::default().with_idempotency_key(false),
            RetryBudget::new(200, 0.1).expect("a budget"),
        );
        let no_key: Layered = LibraryClient::new(
            ServiceBuilder::new()
                .layer(no_key)
                .service(library::channel(addr)),
        );
        no_key
            .clone()
            .get_book(request())
            .await
            .expect("the server answers");
        // Connect both before measuring.
        plain
            .clone()
            .get_book(request())
            .await
            .expect("the server answers");
        layered
            .clone()
            .get_book(request())
            .await
            .expect("the server answers");
        (plain, layered, no_key, enforcing)
    });

    let mut c = Criterion::default().configure_from_args();
    {
        let mut group = c.benchmark_group("loopback");
        group.throughput(Throughput::Elements(1));
        group.bench_function("without_layer", |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let plain = plain.clone();
                async move { timed_calls!(plain, iters) }
            })
        });
        group.bench_function("with_layer", |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let layered = layered.clone();
                async move { timed_calls!(layered, iters) }
            })
        });
        group.bench_function("with_layer_no_key", |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let no_key = no_key.clone();
                async move { timed_calls!(no_key, iters) }
            })
        });
        group.finish();
    }
    c.final_summary();

    // Latency percentiles and throughput, the clients taking turns call by
    // call, so that drift on a shared machine hits them alike. The fourth is
    // the bare client sending a fresh random key of its own: what sending an
    // idempotency key costs on the wire and at the server, layer or not. The
    // fifth and sixth are the bare client and the layer without its key, each
    // call with a timeout of 10 s (`Request::set_timeout`), as most calls in
    // production have. The seventh is the bare client whose Channel enforces
    // a 10 s timeout (`Endpoint::timeout`), also sending `grpc-timeout`; the
    // eighth, only with `LOOPBACK_SPIN_NS`, the bare client with a timeout
    // spinning before each call.
    const ROUNDS: usize = 10_000;
    let spin = std::env::var("LOOPBACK_SPIN_NS")
        .ok()
        .map(|ns| Duration::from_nanos(ns.parse().expect("LOOPBACK_SPIN_NS is a count of ns")));
    const CLIENTS: usize = 8;
    let clients = if spin.is_some() { CLIENTS } else { CLIENTS - 1 };
    let timed = || {
        let mut req = tonic::Request::new(request());
        req.set_timeout(Duration::from_secs(10));
        req
    };
    let mut lat: [Vec<Duration>; CLIENTS] = Default::default();
    rt.block_on(async {
        let (mut p, mut l, mut n, mut k, mut e) = (
            plain.clone(),
            layered.clone(),
            no_key.clone(),
            plain.clone(),
            enforcing.clone(),
        );
        // NOTE: a new order each round, drawn from a fixed seed. Rotated, the
        // clients kept one cyclic order, so each always followed the same
        // one, and was charged what that one's call left for later (its
        // streams' and timers' clean-up, on both connections' tasks).
        let mut rng = rand::rngs::StdRng::seed_from_u64(15);
        let mut order: Vec<usize> = (0..clients).collect();
        for _ in 0..ROUNDS {
            order.shuffle(&mut rng);
            for &which in &order {
                let t = Instant::now();
                match which {
                    0 => drop(p.get_book(request()).await.expect("the server answers")),
                    1 => drop(l.get_book(request()).await.expect("the server answers")),
                    2 => drop(n.get_book(request()).await.expect("the server answers")),
                    3 => {
                        let mut req = tonic::Request::new(request());
                        let key = format!("{:032x}", rand::random::<u128>());
                        let mut key =
                            tonic::metadata::MetadataValue::try_from(key).expect("hex is ASCII");
                        key.set_sensitive(true);
                        req.metadata_mut().insert("x-idempotency-key", key);
                        drop(k.get_book(req).await.expect("the server answers"))
                    }
                    4 => drop(p.get_book(timed()).await.expect("the server answers")),
                    5 => drop(n.get_book(timed()).await.expect("the server answers")),
                    6 => drop(e.get_book(timed()).await.expect("the server answers")),
                    _ => {
                        let spin = spin.unwrap_or_default();
                        while t.elapsed() < spin {
                            std::hint::spin_loop();
                        }
                        drop(p.get_book(timed()).await.expect("the server answers"))
                    }
                }
                lat[which].push(t.elapsed());
            }
        }
    });
    let report = |name: &str, lat: &mut Vec<Duration>| {
        let total: Duration = lat.iter().sum();
        lat.sort();
        let pct = |p: f64| lat[((lat.len() - 1) as f64 * p).round() as usize];
        println!(
            "loopback {name:<36} {:>8.0} calls/s   p50 {:>7.1?}   p99 {:>7.1?}",
            lat.len() as f64 / total.as_secs_f64(),
            pct(0.50),
            pct(0.99)
        );
        lat.len() as f64 / total.as_secs_f64()
    };
    let [
        mut without,
        mut with,
        mut with_no_key,
        mut own_key,
        mut timed_without,
        mut timed_no_key,
        mut timed_enforcing,
        mut timed_spinning,
    ] = lat;
    let a = report("without layer", &mut without);
    let b = report("with layer", &mut with);
    let c = report("with layer, key generation off", &mut with_no_key);
    let d = report("without layer, own random key", &mut own_key);
    let e = report("without layer, 10 s timeout", &mut timed_without);
    let f = report("key off, 10 s timeout", &mut timed_no_key);
    let g = report("without layer, Endpoint::timeout", &mut timed_enforcing);
    if let Some(spin) = spin {
        report(
            &format!("without layer, 10 s, {spin:?} spin"),
            &mut timed_spinning,
        );
    }
    println!(
        "loopback throughput, % of without the layer: with {:.1} %, with key generation off {:.1} %, bare client sending its own key {:.1} %",
        100.0 * b / a,
        100.0 * c / a,
        100.0 * d / a
    );
    println!(
        "loopback throughput with a 10 s timeout on every call, key generation off: {:.1} % of the bare client with the same timeout; the bare client enforcing it with its Channel's timer: {:.1} %",
        100.0 * f / e,
        100.0 * g / e
    );
}
