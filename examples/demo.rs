//! `cargo run --example demo`: a flaky Library server on loopback, and the same
//! traffic sent to it with and without the retry layer.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::Rng;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Code, Request, Response, Status, Streaming};
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
use tower::ServiceBuilder;

#[allow(unreachable_pub, missing_docs, clippy::all)]
mod pb {
    include!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/proto/gen/library.v1.rs"
    ));
}
use pb::library_client::LibraryClient;
use pb::library_server::{Library, LibraryServer};
use pb::*;

/// One request as the server saw it.
#[derive(Clone, Debug)]
struct Attempt {
    key: String,
    previous: String,
    timeout: String,
    code: Code,
}

/// Fails a share of calls with UNAVAILABLE, as a server mid-restart does.
#[derive(Clone)]
struct FlakyLibrary {
    failure_rate: f64,
    log: Arc<Mutex<Vec<Attempt>>>,
}

#[tonic::async_trait]
impl Library for FlakyLibrary {
    async fn get_book(&self, req: Request<GetBookRequest>) -> Result<Response<Book>, Status> {
        let header = |name: &str| {
            req.metadata()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-")
                .to_owned()
        };
        let fails = rand::rng().random_bool(self.failure_rate);
        let code = if fails { Code::Unavailable } else { Code::Ok };
        self.log.lock().unwrap().push(Attempt {
            key: header("x-idempotency-key"),
            previous: header("grpc-previous-rpc-attempts"),
            timeout: header("grpc-timeout"),
            code,
        });
        if fails {
            return Err(Status::unavailable("instance restarting"));
        }
        let isbn = req.into_inner().isbn;
        Ok(Response::new(Book {
            title: format!("Book {isbn}"),
            author: "Anonymous".into(),
            isbn,
        }))
    }

    async fn reserve_stock(
        &self,
        _: Request<ReserveStockRequest>,
    ) -> Result<Response<ReserveStockReply>, Status> {
        Err(Status::unimplemented("not in this demo"))
    }

    async fn import_books(
        &self,
        _: Request<Streaming<Book>>,
    ) -> Result<Response<ImportSummary>, Status> {
        Err(Status::unimplemented("not in this demo"))
    }

    type ListBooksStream = tokio_stream::Empty<Result<Book, Status>>;

    async fn list_books(
        &self,
        _: Request<ListBooksRequest>,
    ) -> Result<Response<Self::ListBooksStream>, Status> {
        Err(Status::unimplemented("not in this demo"))
    }

    type SyncBooksStream = tokio_stream::Empty<Result<Book, Status>>;

    async fn sync_books(
        &self,
        _: Request<Streaming<Book>>,
    ) -> Result<Response<Self::SyncBooksStream>, Status> {
        Err(Status::unimplemented("not in this demo"))
    }
}

async fn serve(library: FlakyLibrary) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local address");
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tokio::spawn(
        Server::builder()
            .add_service(LibraryServer::new(library))
            .serve_with_incoming(incoming),
    );
    addr
}

fn channel(addr: SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .expect("a valid URI")
        .connect_lazy()
}

fn request(n: usize) -> Request<GetBookRequest> {
    let mut req = Request::new(GetBookRequest {
        isbn: n.to_string(),
    });
    req.set_timeout(Duration::from_millis(500));
    req
}

const CALLS: usize = 300;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let log = Arc::new(Mutex::new(Vec::new()));
    let library = FlakyLibrary {
        failure_rate: 0.3,
        log: log.clone(),
    };
    let addr = serve(library).await;
    println!("A Library server on {addr} answers 30 % of calls with UNAVAILABLE.\n");

    // Without the layer.
    let mut plain = LibraryClient::new(channel(addr));
    let started = Instant::now();
    let mut ok = 0;
    for n in 0..CALLS {
        ok += usize::from(plain.get_book(request(n)).await.is_ok());
    }
    let plain_attempts = log.lock().unwrap().drain(..).count();
    println!(
        "without the layer: {ok}/{CALLS} calls succeeded ({:.1} %), {plain_attempts} server attempts, {:?}",
        100.0 * ok as f64 / CALLS as f64,
        started.elapsed()
    );

    // With it.
    let layer = RetryLayer::new(RetryPolicy::default(), RetryBudget::new(200, 0.1)?);
    let svc = ServiceBuilder::new()
        .timeout(Duration::from_secs(2))
        .concurrency_limit(32)
        .layer(layer.clone())
        .service(channel(addr));
    let mut client = LibraryClient::new(svc);
    let started = Instant::now();
    let mut ok = 0;
    for n in 0..CALLS {
        ok += usize::from(client.get_book(request(n)).await.is_ok());
    }
    let attempts: Vec<Attempt> = log.lock().unwrap().drain(..).collect();
    println!(
        "with the layer:    {ok}/{CALLS} calls succeeded ({:.1} %), {} server attempts ({:.2} per call), {:?}",
        100.0 * ok as f64 / CALLS as f64,
        attempts.len(),
        attempts.len() as f64 / CALLS as f64,
        started.elapsed()
    );
    let m = layer.metrics();
    println!(
        "  retries {}, refused by budget {}, refused by deadline {}, budget balance {:.1} of {} tokens\n",
        m.retries(),
        m.refused_by_budget(),
        m.refused_by_deadline(),
        layer.budget().available(),
        layer.budget().max_tokens()
    );

    // The attempts of the first call that needed a retry, as the server saw them.
    if let Some(retried) = attempts.iter().find(|a| a.previous != "-") {
        println!("one retried call, attempt by attempt (as the server saw it):");
        for (i, a) in attempts.iter().filter(|a| a.key == retried.key).enumerate() {
            println!(
                "  attempt {}: key {}  previous-attempts {:>2}  grpc-timeout {:>8}  -> {:?}",
                i + 1,
                &a.key[..12],
                a.previous,
                a.timeout,
                a.code
            );
        }
    }
    Ok(())
}
