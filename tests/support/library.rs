//! A `Library` gRPC server for tests and the demo: real tonic, on loopback,
//! with the crate's fault-injection layer in front, and a write path that
//! deduplicates by idempotency key.

#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Request, Response, Status, Streaming};
use tonic_retry::fault::FaultLayer;

#[allow(unreachable_pub, missing_docs, clippy::all)]
pub mod pb {
    include!("../../proto/gen/library.v1.rs");
}

use pb::library_server::{Library, LibraryServer};
use pb::*;

/// The shelf: stock per ISBN, and the replies already given per idempotency key.
#[derive(Clone, Default)]
pub struct Shelf {
    stock: Arc<Mutex<HashMap<String, u32>>>,
    replies: Arc<Mutex<HashMap<String, ReserveStockReply>>>,
    /// Reservations applied (each decrements stock once).
    pub applied: Arc<AtomicU64>,
    /// Reservations answered from the dedup table instead.
    pub deduplicated: Arc<AtomicU64>,
    /// `(books, bytes)` of every import the server read to its end.
    pub imports: Arc<Mutex<Vec<(u32, u64)>>>,
    /// `GetBook` requests answered (a request whose stream the client reset
    /// while a fault delayed it is never answered).
    pub books_answered: Arc<AtomicU64>,
}

impl Shelf {
    pub fn with_stock(isbn: &str, count: u32) -> Self {
        let shelf = Self::default();
        shelf.stock.lock().unwrap().insert(isbn.to_owned(), count);
        shelf
    }

    pub fn stock(&self, isbn: &str) -> u32 {
        self.stock.lock().unwrap().get(isbn).copied().unwrap_or(0)
    }
}

/// The bytes of a book's fields, as `ImportBooks` counts them.
pub fn book_bytes(book: &Book) -> u64 {
    (book.isbn.len() + book.title.len() + book.author.len()) as u64
}

type BookStream = Pin<Box<dyn Stream<Item = Result<Book, Status>> + Send>>;

#[tonic::async_trait]
impl Library for Shelf {
    async fn get_book(&self, req: Request<GetBookRequest>) -> Result<Response<Book>, Status> {
        self.books_answered.fetch_add(1, Ordering::SeqCst);
        let isbn = req.into_inner().isbn;
        Ok(Response::new(Book {
            title: format!("Book {isbn}"),
            author: "Anonymous".into(),
            isbn,
        }))
    }

    async fn reserve_stock(
        &self,
        req: Request<ReserveStockRequest>,
    ) -> Result<Response<ReserveStockReply>, Status> {
        let key = req
            .metadata()
            .get("x-idempotency-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .ok_or_else(|| Status::invalid_argument("x-idempotency-key is required"))?;
        let ReserveStockRequest { isbn, quantity } = req.into_inner();
        // One lock for check-and-apply, so a key is applied at most once.
        let mut replies = self.replies.lock().unwrap();
        if let Some(reply) = replies.get(&key) {
            self.deduplicated.fetch_add(1, Ordering::SeqCst);
            return Ok(Response::new(*reply));
        }
        let mut stock = self.stock.lock().unwrap();
        let left = stock.entry(isbn).or_default();
        if *left < quantity {
            return Err(Status::aborted("not enough stock: re-read and decide"));
        }
        *left -= quantity;
        let reply = ReserveStockReply { remaining: *left };
        replies.insert(key, reply);
        self.applied.fetch_add(1, Ordering::SeqCst);
        Ok(Response::new(reply))
    }

    async fn import_books(
        &self,
        req: Request<Streaming<Book>>,
    ) -> Result<Response<ImportSummary>, Status> {
        let mut stream = req.into_inner();
        let (mut count, mut bytes) = (0, 0);
        while let Some(book) = stream.next().await {
            let book = book?;
            count += 1;
            bytes += book_bytes(&book);
        }
        self.imports.lock().unwrap().push((count, bytes));
        Ok(Response::new(ImportSummary { count, bytes }))
    }

    type ListBooksStream = BookStream;

    async fn list_books(
        &self,
        req: Request<ListBooksRequest>,
    ) -> Result<Response<BookStream>, Status> {
        let ListBooksRequest { author, limit } = req.into_inner();
        let books = (0..limit).map(move |n| {
            Ok(Book {
                isbn: n.to_string(),
                title: format!("Volume {n}"),
                author: author.clone(),
            })
        });
        Ok(Response::new(Box::pin(tokio_stream::iter(books))))
    }

    type SyncBooksStream = BookStream;

    async fn sync_books(
        &self,
        req: Request<Streaming<Book>>,
    ) -> Result<Response<BookStream>, Status> {
        Ok(Response::new(Box::pin(req.into_inner())))
    }
}

/// A running server instance that can be stopped and started again on the
/// same port (a rolling restart).
pub struct Instance {
    pub addr: SocketAddr,
    pub faults: FaultLayer,
    shelf: Shelf,
    running: Option<(oneshot::Sender<()>, JoinHandle<()>)>,
}

impl Instance {
    /// Starts `shelf` behind `faults` on `127.0.0.1:0`.
    pub async fn start(shelf: Shelf, faults: FaultLayer) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local address");
        let mut instance = Self {
            addr,
            faults,
            shelf,
            running: None,
        };
        instance.serve(listener);
        instance
    }

    /// `GetBook` requests this instance answered.
    pub fn books_answered(&self) -> u64 {
        self.shelf.books_answered.load(Ordering::SeqCst)
    }

    /// Starts a plain instance whose faults are given by `faults`' rules.
    pub async fn with_faults(faults: FaultLayer) -> Self {
        Self::start(Shelf::default(), faults).await
    }

    fn serve(&mut self, listener: tokio::net::TcpListener) {
        let (stop, stopped) = oneshot::channel::<()>();
        // Without TCP_NODELAY on the server's side, small responses wait on
        // Nagle's algorithm and every call takes a millisecond or more.
        let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
        let server = Server::builder()
            .layer(self.faults.clone())
            .add_service(LibraryServer::new(self.shelf.clone()))
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stopped.await;
            });
        let task = tokio::spawn(async move {
            let _ = server.await;
        });
        self.running = Some((stop, task));
    }

    /// Stops serving: from now on connections to `addr` are refused.
    pub async fn stop(&mut self) {
        if let Some((stop, mut task)) = self.running.take() {
            let _ = stop.send(());
            // A graceful shutdown closes the idle connections too (GOAWAY), so
            // clients must reconnect, and are refused.
            if tokio::time::timeout(std::time::Duration::from_secs(5), &mut task)
                .await
                .is_err()
            {
                task.abort();
            }
        }
    }

    /// Serves again on the same address.
    pub async fn restart(&mut self) {
        let listener = tokio::net::TcpListener::bind(self.addr)
            .await
            .expect("rebind the same port");
        self.serve(listener);
    }

    pub fn shelf(&self) -> &Shelf {
        &self.shelf
    }

    pub fn channel(&self) -> Channel {
        channel(self.addr)
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        if let Some((_, task)) = self.running.take() {
            task.abort();
        }
    }
}

/// Serves `shelf` on `127.0.0.1:0` with no fault layer and nothing recorded,
/// for measurements; the server runs until the runtime stops.
pub async fn serve_plain(shelf: Shelf) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local address");
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    tokio::spawn(
        Server::builder()
            .add_service(LibraryServer::new(shelf))
            .serve_with_incoming(incoming),
    );
    addr
}

/// A loopback listener's connections, counted as they are accepted, each
/// with `TCP_NODELAY` if `nodelay`: for a server whose clients' reconnects
/// are measured. The address, the count, and the stream to serve.
pub async fn counted_incoming(
    nodelay: bool,
) -> (
    SocketAddr,
    Arc<AtomicU64>,
    impl Stream<Item = std::io::Result<tokio::net::TcpStream>>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local address");
    let accepted = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&accepted);
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).map(move |stream| {
        counted.fetch_add(1, Ordering::Relaxed);
        let stream = stream?;
        if nodelay {
            stream.set_nodelay(true)?;
        }
        Ok(stream)
    });
    (addr, accepted, incoming)
}

pub fn channel(addr: SocketAddr) -> Channel {
    endpoint(addr).connect_lazy()
}

/// The endpoint [`channel`] connects to, for a channel set up otherwise.
pub fn endpoint(addr: SocketAddr) -> Endpoint {
    Endpoint::from_shared(format!("http://{addr}"))
        .expect("a valid URI")
        // Attempts cut by a per-attempt timeout reset their streams; h2
        // remembers only 50 resets by default, and frames arriving on
        // forgotten ones close the connection (see
        // `RetryPolicy::with_attempt_timeout`).
        .http2_max_concurrent_reset_streams(4096)
}
