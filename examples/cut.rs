//! `cargo run --release --example cut [-- RUNS]`
//!
//! Attempts cut by a per-attempt timeout, under load, with tonic's default
//! client and server settings: does any connection close? One `Library`
//! server on loopback answers in 1 ms, or (3 % of requests) in 150 ms; 64
//! tasks send 200,000 calls over one default tonic `Channel`, each with a
//! 1 s deadline, retried up to 3 attempts with a 100 ms attempt timeout.
//!
//! Two rows, each on a fresh server and channel:
//! - the layer's `with_attempt_timeout`: a cut attempt is drained, and the
//!   server is sent the call's deadline;
//! - the control, as the layer was before it drained: the attempt's limit
//!   sent as the attempt's `grpc-timeout` (set below the layer, which retries
//!   what the limit cuts), so tonic's Channel resets the stream at 100 ms
//!   while the server answers `CANCELLED` for the same limit. It shows what
//!   the count below catches.
//!
//! For each: calls, attempts the server saw, failed calls, and connections
//! the server accepted beyond the first (a connection the client lost to
//! h2's reset guards, or to anything else, is reopened and counted here).

#[path = "../tests/support/library.rs"]
mod library;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use library::Shelf;
use library::pb::GetBookRequest;
use library::pb::library_client::LibraryClient;
use library::pb::library_server::LibraryServer;
use tonic::transport::{Endpoint, Server};
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy, metrics::RetryMetrics};
use tonic_retry::{fault::Fault, fault::FaultLayer, fault::Rule};
use tower::ServiceExt;

const CALLS: usize = 200_000;
const TASKS: usize = 64;
const ATTEMPT_TIMEOUT: Duration = Duration::from_millis(100);

struct Instance {
    addr: SocketAddr,
    faults: FaultLayer,
    accepted: Arc<AtomicU64>,
}

async fn instance() -> Instance {
    let faults = FaultLayer::new("a")
        .unwrap()
        .with(Rule::rate(0.03, Fault::slow(Duration::from_millis(150))).unwrap())
        .with(Rule::always(Fault::slow(Duration::from_millis(1))));
    let (addr, accepted, incoming) = library::counted_incoming(true).await;
    // tonic's default server settings.
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

type Layered<S> = tonic_retry::RetryService<S>;
type Control = tower::util::MapRequest<
    tonic::transport::Channel,
    fn(http::Request<tonic::body::Body>) -> http::Request<tonic::body::Body>,
>;

/// The client of a row: the two stacks differ in type.
#[derive(Clone)]
enum Client {
    Layer(LibraryClient<Layered<tonic::transport::Channel>>),
    Control(LibraryClient<Layered<Control>>),
}

impl Client {
    async fn get_book(
        &mut self,
        req: tonic::Request<GetBookRequest>,
    ) -> Result<tonic::Response<library::pb::Book>, tonic::Status> {
        match self {
            Client::Layer(c) => c.get_book(req).await,
            Client::Control(c) => c.get_book(req).await,
        }
    }
}

#[derive(Clone, Copy)]
enum Row {
    Layer,
    Channel,
}

impl Row {
    fn name(self) -> &'static str {
        match self {
            Row::Layer => "layer's attempt timeout (drained)",
            Row::Channel => "control: limit sent, stream reset",
        }
    }
}

struct RowResult {
    failed: Vec<(tonic::Code, usize)>,
    attempts: u64,
    reconnects: u64,
    metrics: RetryMetrics,
}

async fn run_row(row: Row) -> RowResult {
    let instance = instance().await;
    // tonic's default client settings; for the control, only its timeout.
    let endpoint = Endpoint::from_shared(format!("http://{}", instance.addr)).unwrap();
    let policy =
        RetryPolicy::new(3, Duration::from_millis(5), Duration::from_millis(20), 0.2).unwrap();
    let channel = endpoint.connect_lazy();
    let layer = |policy| RetryLayer::new(policy, RetryBudget::new(100_000, 1.0).unwrap());
    let (metrics, client) = match row {
        Row::Layer => {
            let layer = layer(policy.with_attempt_timeout(ATTEMPT_TIMEOUT));
            let svc = tower::Layer::layer(&layer, channel);
            (
                layer.metrics().clone(),
                Client::Layer(LibraryClient::new(svc)),
            )
        }
        Row::Channel => {
            let layer = layer(policy);
            let limited: Control = channel.map_request(send_the_attempts_limit);
            let svc = tower::Layer::layer(&layer, limited);
            (
                layer.metrics().clone(),
                Client::Control(LibraryClient::new(svc)),
            )
        }
    };
    let next = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let mut client = client.clone();
            let next = Arc::clone(&next);
            tokio::spawn(async move {
                let mut failed = Vec::new();
                while next.fetch_add(1, Ordering::Relaxed) < CALLS {
                    let mut req = tonic::Request::new(GetBookRequest { isbn: "1".into() });
                    req.set_timeout(Duration::from_secs(1));
                    if let Err(status) = client.get_book(req).await {
                        failed.push(status.code());
                    }
                }
                failed
            })
        })
        .collect();
    let mut failed: Vec<(tonic::Code, usize)> = Vec::new();
    for task in tasks {
        for code in task.await.unwrap() {
            match failed.iter_mut().find(|(c, _)| *c == code) {
                Some((_, n)) => *n += 1,
                None => failed.push((code, 1)),
            }
        }
    }
    // Let the last drains end before counting connections.
    tokio::time::sleep(Duration::from_millis(300)).await;
    RowResult {
        failed,
        attempts: instance.faults.requests(),
        reconnects: instance.accepted.load(Ordering::Relaxed).saturating_sub(1),
        metrics,
    }
}

/// The control's `grpc-timeout`: the attempt's 100 ms, shorter than any
/// call's time left, as the layer sent before it drained cut attempts.
fn send_the_attempts_limit(
    mut req: http::Request<tonic::body::Body>,
) -> http::Request<tonic::body::Body> {
    let limit = http::HeaderValue::from_static("100m");
    req.headers_mut().insert("grpc-timeout", limit);
    req
}

#[tokio::main]
async fn main() {
    let runs: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1);
    println!(
        "{CALLS} calls, {TASKS} tasks, one loopback server answering in 1 ms (97 %) or 150 ms (3 %); \
         1 s deadline, 3 attempts, 100 ms attempt timeout; tonic's default client and server settings"
    );
    for run in 1..=runs {
        println!("\nrun {run}");
        println!(
            "  {:<36} {:>9} {:>9} {:>8} {:>11}   failed calls",
            "", "attempts", "retries", "drained", "reconnects"
        );
        for row in [Row::Layer, Row::Channel] {
            let r = run_row(row).await;
            let failed: Vec<String> = r.failed.iter().map(|(c, n)| format!("{n} {c:?}")).collect();
            println!(
                "  {:<36} {:>9} {:>9} {:>8} {:>11}   {}",
                row.name(),
                r.attempts,
                r.metrics.retries(),
                r.metrics.drained(),
                r.reconnects,
                if failed.is_empty() {
                    "0".to_owned()
                } else {
                    failed.join(", ")
                }
            );
        }
    }
}
