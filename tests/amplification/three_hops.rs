//! Retries multiply across layers: three hops, each a real tonic
//! client and server with a retry layer of its own, over a bottom service in a
//! total outage. Without budgets and without the "do not retry" mark every
//! user call becomes 3 · 3 · 3 = 27 calls at the bottom; with budgets the
//! growth is bounded by what the budgets hold; with the mark (on by
//! default) the retries happen once, at the lowest hop: 3.

use std::time::Duration;

use crate::support::pb::library_client::LibraryClient;
use crate::support::pb::library_server::{Library, LibraryServer};
use crate::support::pb::*;
use crate::support::{Instance, Shelf};
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status, Streaming};
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy, RetryService, marks::RetryMarkExt};
use tonic_retry::{fault::Fault, fault::FaultLayer, fault::Rule};
use tower::ServiceBuilder;

type Client = LibraryClient<RetryService<Channel>>;

/// How a middle hop answers when the next hop fails.
#[derive(Clone, Copy, PartialEq)]
enum Answer {
    /// Passes the next hop's status up unchanged (`?`).
    Same,
    /// Answers with a status of its own.
    Fresh,
    /// Answers with a status of its own, keeping the "do not retry" mark.
    FreshKeepingTheMark,
}

/// A middle hop: answers `GetBook` by asking the next hop, through its own
/// retry layer.
#[derive(Clone)]
struct Forward(Client, Answer);

#[tonic::async_trait]
impl Library for Forward {
    async fn get_book(&self, req: Request<GetBookRequest>) -> Result<Response<Book>, Status> {
        let book = match (self.0.clone().get_book(req.into_inner()).await, self.1) {
            (Ok(book), _) => book,
            (Err(status), Answer::Same) => return Err(status),
            (Err(_), Answer::Fresh) => return Err(Status::unavailable("the next hop failed")),
            (Err(status), Answer::FreshKeepingTheMark) => {
                return Err(Status::unavailable("the next hop failed").keep_retry_mark(&status));
            }
        };
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

fn client(channel: Channel, budget: RetryBudget, mark: bool) -> Client {
    let policy = RetryPolicy::new(3, Duration::from_millis(1), Duration::from_millis(2), 0.2)
        .unwrap()
        .with_retry_at_one_layer(mark);
    LibraryClient::new(
        ServiceBuilder::new()
            .layer(RetryLayer::new(policy, budget))
            .service(channel),
    )
}

async fn serve_forward(next: Client, answer: Answer) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tokio::spawn(
        Server::builder()
            .add_service(LibraryServer::new(Forward(next, answer)))
            .serve_with_incoming(incoming),
    );
    addr
}

/// Builds user → hop 1 → hop 2 → bottom, each arrow a retrying client; returns
/// the user's client and the bottom instance.
async fn stack(budget: impl Fn() -> RetryBudget, mark: bool, answer: Answer) -> (Client, Instance) {
    let bottom = Instance::start(
        Shelf::default(),
        FaultLayer::new("bottom")
            .unwrap()
            .with(Rule::always(Fault::unavailable())),
    )
    .await;
    let hop2 = serve_forward(client(bottom.channel(), budget(), mark), answer).await;
    let hop1 = serve_forward(
        client(crate::support::library::channel(hop2), budget(), mark),
        answer,
    )
    .await;
    (
        client(crate::support::library::channel(hop1), budget(), mark),
        bottom,
    )
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

/// A budget far larger than the test can spend: effectively none.
fn no_budget() -> RetryBudget {
    RetryBudget::new(1_000_000, 1.0).unwrap()
}

#[tokio::test]
async fn without_budgets_or_the_mark_three_hops_make_27_attempts_per_call() {
    let (mut client, bottom) = stack(no_budget, false, Answer::Same).await;
    user_calls(&mut client, 2).await;
    assert_eq!(bottom.faults.requests(), 2 * 27);
}

#[tokio::test]
async fn with_the_mark_three_hops_make_3_attempts_per_call() {
    // No budgets: only the mark keeps the upper hops from retrying.
    let (mut client, bottom) = stack(no_budget, true, Answer::Same).await;
    user_calls(&mut client, 2).await;
    assert_eq!(bottom.faults.requests(), 2 * 3);
}

#[tokio::test]
async fn a_handler_answering_with_a_fresh_status_keeps_the_mark_only_if_told() {
    let (mut client, bottom) = stack(no_budget, true, Answer::Fresh).await;
    user_calls(&mut client, 1).await;
    assert_eq!(
        bottom.faults.requests(),
        27,
        "a fresh status loses the mark"
    );

    let (mut client, bottom) = stack(no_budget, true, Answer::FreshKeepingTheMark).await;
    user_calls(&mut client, 1).await;
    assert_eq!(bottom.faults.requests(), 3, "keep_retry_mark carries it up");
}

#[tokio::test]
async fn with_budgets_the_growth_is_bounded_by_the_reserves() {
    const CALLS: u64 = 20;
    // Each hop has its own budget (they are separate processes): 10 tokens at
    // most, so 5 to start with, and failures earn nothing.
    let (mut client, bottom) =
        stack(|| RetryBudget::new(10, 0.1).unwrap(), false, Answer::Same).await;
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
