//! Retries multiply across layers (SPEC §9): three hops, each a real tonic
//! client and server with a retry layer of its own, over a bottom service in a
//! total outage. Without budgets every user call becomes 3 · 3 · 3 = 27 calls at
//! the bottom; with budgets the growth is bounded by what the budgets hold.

mod common;

use std::time::Duration;

use common::pb::library_client::LibraryClient;
use common::pb::library_server::{Library, LibraryServer};
use common::pb::*;
use common::{Instance, Shelf};
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status, Streaming};
use tonic_retry::fault::{Fault, FaultLayer, Rule};
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy, RetryService};
use tower::ServiceBuilder;

type Client = LibraryClient<RetryService<Channel>>;

/// A middle hop: answers `GetBook` by asking the next hop, through its own
/// retry layer, and passes the next hop's status up unchanged.
#[derive(Clone)]
struct Forward(Client);

#[tonic::async_trait]
impl Library for Forward {
    async fn get_book(&self, req: Request<GetBookRequest>) -> Result<Response<Book>, Status> {
        let book = self.0.clone().get_book(req.into_inner()).await?;
        Ok(Response::new(book.into_inner()))
    }

    async fn reserve_stock(
        &self,
        _: Request<ReserveStockRequest>,
    ) -> Result<Response<ReserveStockReply>, Status> {
        Err(Status::unimplemented("a forwarding hop"))
    }

    async fn import_books(
        &self,
        _: Request<Streaming<Book>>,
    ) -> Result<Response<ImportSummary>, Status> {
        Err(Status::unimplemented("a forwarding hop"))
    }

    type ListBooksStream = tokio_stream::Empty<Result<Book, Status>>;

    async fn list_books(
        &self,
        _: Request<ListBooksRequest>,
    ) -> Result<Response<Self::ListBooksStream>, Status> {
        Err(Status::unimplemented("a forwarding hop"))
    }

    type SyncBooksStream = tokio_stream::Empty<Result<Book, Status>>;

    async fn sync_books(
        &self,
        _: Request<Streaming<Book>>,
    ) -> Result<Response<Self::SyncBooksStream>, Status> {
        Err(Status::unimplemented("a forwarding hop"))
    }
}

fn client(channel: Channel, budget: RetryBudget) -> Client {
    let policy =
        RetryPolicy::new(3, Duration::from_millis(1), Duration::from_millis(2), 0.2).unwrap();
    LibraryClient::new(
        ServiceBuilder::new()
            .layer(RetryLayer::new(policy, budget))
            .service(channel),
    )
}

async fn serve_forward(next: Client) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tokio::spawn(
        Server::builder()
            .add_service(LibraryServer::new(Forward(next)))
            .serve_with_incoming(incoming),
    );
    addr
}

/// Builds user → hop 1 → hop 2 → bottom, each arrow a retrying client; returns
/// the user's client and the bottom instance.
async fn stack(budget: impl Fn() -> RetryBudget) -> (Client, Instance) {
    let bottom = Instance::start(
        Shelf::default(),
        FaultLayer::new("bottom")
            .unwrap()
            .with(Rule::always(Fault::unavailable())),
    )
    .await;
    let hop2 = serve_forward(client(bottom.channel(), budget())).await;
    let hop1 = serve_forward(client(common::library::channel(hop2), budget())).await;
    (client(common::library::channel(hop1), budget()), bottom)
}

async fn user_calls(client: &mut Client, n: u32) {
    for i in 0..n {
        let call = client.get_book(GetBookRequest {
            isbn: i.to_string(),
        });
        let status = tokio::time::timeout(Duration::from_secs(20), call)
            .await
            .expect("a call hung")
            .expect_err("the bottom is down");
        assert!(
            matches!(
                status.code(),
                tonic::Code::Unavailable | tonic::Code::ResourceExhausted
            ),
            "{status:?}"
        );
    }
}

#[tokio::test]
async fn without_budgets_three_hops_make_27_attempts_per_call() {
    // A budget far larger than the test can spend: effectively none.
    let (mut client, bottom) = stack(|| RetryBudget::new(1_000_000, 1.0).unwrap()).await;
    user_calls(&mut client, 2).await;
    assert_eq!(bottom.faults.requests(), 2 * 27);
}

#[tokio::test]
async fn with_budgets_the_growth_is_bounded_by_the_reserves() {
    const CALLS: u64 = 20;
    // Each hop has its own budget (they are separate processes): 10 tokens at
    // most, so 5 to start with, and failures earn nothing.
    let (mut client, bottom) = stack(|| RetryBudget::new(10, 0.1).unwrap()).await;
    user_calls(&mut client, CALLS as u32).await;
    let at_bottom = bottom.faults.requests();
    // Each layer can add at most its 5 saved retries to what reaches it:
    // user → hop 1 ≤ N + 5, → hop 2 ≤ N + 10, → bottom ≤ N + 15.
    assert!(
        at_bottom <= CALLS + 15,
        "{at_bottom} calls reached the bottom"
    );
    assert!(
        at_bottom >= CALLS,
        "every user call reached the bottom at least once"
    );
    println!(
        "{CALLS} user calls: {at_bottom} at the bottom ({:.2} per call; worst case without budgets 27)",
        at_bottom as f64 / CALLS as f64
    );
}
