//! A real tonic `Library` server on loopback whose failures are scripted.

#![allow(dead_code, unreachable_pub)]

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_stream::{Stream, StreamExt};
use tonic::transport::Server;
use tonic::{Code, Request, Response, Status, Streaming};

#[allow(unreachable_pub, missing_docs, clippy::all)]
pub mod pb {
    include!("../../proto/gen/library.v1.rs");
}

use pb::library_server::{Library, LibraryServer};
use pb::*;

/// What the server saw of one request.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: &'static str,
    pub grpc_timeout: Option<String>,
    pub idempotency_key: Option<String>,
    pub previous_attempts: Option<String>,
}

/// One scripted answer: wait `delay`, then fail with `code` (or succeed).
#[derive(Clone, Copy, Debug)]
pub struct Step {
    pub delay: Duration,
    pub code: Option<Code>,
}

pub fn fail(code: Code) -> Step {
    Step {
        delay: Duration::ZERO,
        code: Some(code),
    }
}

pub fn slow_fail(delay: Duration, code: Code) -> Step {
    Step {
        delay,
        code: Some(code),
    }
}

#[derive(Clone, Default)]
pub struct Flaky {
    /// Answers for the next requests, in order; once empty, every call succeeds.
    script: Arc<Mutex<VecDeque<Step>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Flaky {
    pub fn new(script: impl IntoIterator<Item = Step>) -> Self {
        Self {
            script: Arc::new(Mutex::new(script.into_iter().collect())),
            seen: Arc::default(),
        }
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    async fn admit<T>(&self, method: &'static str, req: &Request<T>) -> Result<(), Status> {
        let header = |name: &str| {
            req.metadata()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        self.seen.lock().unwrap().push(Seen {
            method,
            grpc_timeout: header("grpc-timeout"),
            idempotency_key: header("x-idempotency-key"),
            previous_attempts: header("grpc-previous-rpc-attempts"),
        });
        let step = self.script.lock().unwrap().pop_front();
        if let Some(step) = step {
            tokio::time::sleep(step.delay).await;
            if let Some(code) = step.code {
                return Err(Status::new(code, format!("scripted {method} failure")));
            }
        }
        Ok(())
    }
}

type BookStream = Pin<Box<dyn Stream<Item = Result<Book, Status>> + Send>>;

#[tonic::async_trait]
impl Library for Flaky {
    async fn get_book(&self, req: Request<GetBookRequest>) -> Result<Response<Book>, Status> {
        self.admit("GetBook", &req).await?;
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
        self.admit("ReserveStock", &req).await?;
        Ok(Response::new(ReserveStockReply { remaining: 0 }))
    }

    async fn import_books(
        &self,
        req: Request<Streaming<Book>>,
    ) -> Result<Response<ImportSummary>, Status> {
        self.admit("ImportBooks", &req).await?;
        let mut stream = req.into_inner();
        let (mut count, mut bytes) = (0, 0);
        while let Some(book) = stream.next().await {
            let book = book?;
            count += 1;
            bytes += (book.isbn.len() + book.title.len() + book.author.len()) as u64;
        }
        Ok(Response::new(ImportSummary { count, bytes }))
    }

    type ListBooksStream = BookStream;

    async fn list_books(
        &self,
        req: Request<ListBooksRequest>,
    ) -> Result<Response<BookStream>, Status> {
        self.admit("ListBooks", &req).await?;
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
        self.admit("SyncBooks", &req).await?;
        Ok(Response::new(Box::pin(req.into_inner())))
    }
}

/// Serves `library` on `127.0.0.1:0`; returns the address. The server stops
/// when the test's runtime does.
pub async fn serve(library: Flaky) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tokio::spawn(
        Server::builder()
            .add_service(LibraryServer::new(library))
            .serve_with_incoming(incoming),
    );
    addr
}

pub fn channel(addr: SocketAddr) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy()
}
