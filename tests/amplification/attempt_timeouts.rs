//! Retrying stays at one layer under attempt timeouts too: three retrying
//! layers stacked through real tonic hops (each passing its caller's
//! deadline and attempt's end on with `forward_deadline`), every one with
//! the same attempt timeout, over a slow bottom. A hop whose caller stops
//! waiting when its attempt is cut has no time for a retry of its own, and
//! gives up unmarked: only the top layer retries, and the bottom never sees
//! more attempts than one layer makes.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::pb::library_client::LibraryClient;
use crate::support::pb::library_server::{Library, LibraryServer};
use crate::support::pb::*;
use tonic::transport::{Channel, Server};
use tonic::{Code, Request, Response, Status, Streaming};
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy, RetryService};
use tower::ServiceBuilder;

type Client = LibraryClient<RetryService<Channel>>;

const ATTEMPT_TIMEOUT: Duration = Duration::from_millis(150);

/// A hop: answers `GetBook` by asking the next hop through its own retry
/// layer, under the deadline its caller sent.
#[derive(Clone)]
struct Forward(Client);

/// The bottom: answers each `GetBook` after `slow` for the first request of
/// an ISBN (each user call asks for its own) and `fast` after that.
#[derive(Clone, Default)]
struct Bottom {
    slow: Duration,
    fast: Duration,
    requests: Arc<AtomicU64>,
    seen: Arc<Mutex<HashMap<String, u32>>>,
}

/// A server of the stack: a hop, or the bottom.
#[derive(Clone)]
enum Hop {
    Forward(Forward),
    Bottom(Bottom),
}

impl Forward {
    async fn get_book(&self, req: Request<GetBookRequest>) -> Result<Response<Book>, Status> {
        let mut next = Request::new(req.get_ref().clone());
        tonic_retry::forward_deadline(&req, &mut next);
        let book = self.0.clone().get_book(next).await?;
        Ok(Response::new(book.into_inner()))
    }
}

impl Bottom {
    async fn get_book(&self, req: Request<GetBookRequest>) -> Result<Response<Book>, Status> {
        self.requests.fetch_add(1, Ordering::SeqCst);
        let isbn = req.into_inner().isbn;
        let first = {
            let mut seen = self.seen.lock().unwrap();
            let n = seen.entry(isbn.clone()).or_default();
            *n += 1;
            *n == 1
        };
        tokio::time::sleep(if first { self.slow } else { self.fast }).await;
        Ok(Response::new(Book {
            isbn,
            ..Default::default()
        }))
    }
}

#[tonic::async_trait]
impl Library for Hop {
    async fn get_book(&self, req: Request<GetBookRequest>) -> Result<Response<Book>, Status> {
        match self {
            Hop::Forward(hop) => hop.get_book(req).await,
            Hop::Bottom(bottom) => bottom.get_book(req).await,
        }
    }

    async fn reserve_stock(
        &self,
        _: Request<ReserveStockRequest>,
    ) -> Result<Response<ReserveStockReply>, Status> {
        Err(Status::unimplemented("GetBook only"))
    }

    async fn import_books(
        &self,
        _: Request<Streaming<Book>>,
    ) -> Result<Response<ImportSummary>, Status> {
        Err(Status::unimplemented("GetBook only"))
    }

    type ListBooksStream = tokio_stream::Empty<Result<Book, Status>>;

    async fn list_books(
        &self,
        _: Request<ListBooksRequest>,
    ) -> Result<Response<Self::ListBooksStream>, Status> {
        Err(Status::unimplemented("GetBook only"))
    }

    type SyncBooksStream = tokio_stream::Empty<Result<Book, Status>>;

    async fn sync_books(
        &self,
        _: Request<Streaming<Book>>,
    ) -> Result<Response<Self::SyncBooksStream>, Status> {
        Err(Status::unimplemented("GetBook only"))
    }
}

async fn serve(service: Hop) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tokio::spawn(
        Server::builder()
            .add_service(LibraryServer::new(service))
            .serve_with_incoming(incoming),
    );
    addr
}

/// A retrying client of `addr`: 3 attempts, the attempt timeout, and a
/// budget too large to spend (no budget).
fn client(addr: SocketAddr) -> (Client, RetryLayer) {
    let policy = RetryPolicy::new(3, Duration::from_millis(1), Duration::from_millis(2), 0.2)
        .unwrap()
        .with_attempt_timeout(ATTEMPT_TIMEOUT);
    let layer = RetryLayer::new(policy, RetryBudget::new(1_000_000, 1.0).unwrap());
    let channel = crate::support::library::channel(addr);
    let client = LibraryClient::new(ServiceBuilder::new().layer(layer.clone()).service(channel));
    (client, layer)
}

/// user → layer → hop 1 → layer → hop 2 → layer → bottom: the user's
/// client, and the layers from the top down.
async fn stack(bottom: Bottom) -> (Client, [RetryLayer; 3]) {
    let bottom = serve(Hop::Bottom(bottom)).await;
    let (to_bottom, lowest) = client(bottom);
    let hop2 = serve(Hop::Forward(Forward(to_bottom))).await;
    let (to_hop2, middle) = client(hop2);
    let hop1 = serve(Hop::Forward(Forward(to_hop2))).await;
    let (top, highest) = client(hop1);
    (top, [highest, middle, lowest])
}

async fn call(client: &mut Client, isbn: u32) -> Result<Response<Book>, Status> {
    let mut req = Request::new(GetBookRequest {
        isbn: isbn.to_string(),
    });
    req.set_timeout(Duration::from_secs(1));
    tokio::time::timeout(Duration::from_secs(5), client.get_book(req))
        .await
        .expect("the call ended")
}

#[tokio::test]
async fn a_slow_bottom_gets_at_most_one_layers_attempts() {
    let bottom = Bottom {
        slow: Duration::from_millis(400),
        fast: Duration::from_millis(400),
        ..Default::default()
    };
    let requests = Arc::clone(&bottom.requests);
    let (mut client, _) = stack(bottom).await;
    const CALLS: u64 = 3;
    for i in 0..CALLS {
        let status = call(&mut client, i as u32).await.unwrap_err();
        assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    }
    // Attempts abandoned below are drained, not reset: let any retry a hop
    // made in the background reach the bottom before counting.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let at_bottom = requests.load(Ordering::SeqCst);
    assert!(
        at_bottom <= 3 * CALLS,
        "{at_bottom} attempts reached the bottom for {CALLS} calls"
    );
}

#[tokio::test]
async fn the_layer_with_time_for_a_retry_makes_it() {
    // Each call's first attempt at the bottom takes 200 ms, past every
    // hop's attempt timeout; any later one 1 ms.
    let bottom = Bottom {
        slow: Duration::from_millis(200),
        fast: Duration::from_millis(1),
        ..Default::default()
    };
    let requests = Arc::clone(&bottom.requests);
    let (mut client, [top, middle, lowest]) = stack(bottom).await;
    const CALLS: u64 = 3;
    for i in 0..CALLS {
        let book = call(&mut client, i as u32).await.expect("a retry answers");
        assert_eq!(book.get_ref().isbn, i.to_string());
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Each call retried once, by the top layer, the one with time: the
    // bottom saw its slow first attempt and one fast one.
    let at_bottom = requests.load(Ordering::SeqCst);
    assert_eq!(
        at_bottom,
        2 * CALLS,
        "attempts at the bottom for {CALLS} calls"
    );
    assert_eq!(top.metrics().retries(), CALLS);
    assert_eq!(middle.metrics().retries(), 0);
    assert_eq!(lowest.metrics().retries(), 0);
    // The hops below gave up for lack of their caller's time, unmarked.
    assert_eq!(middle.metrics().marked() + lowest.metrics().marked(), 0);
}
