//! Heap allocations per successful call: (a) no layer, (b) tower's `Retry` with
//! a body-buffering policy and `Arc<TpsBudget>`, (c) `RetryLayer`, counted by a
//! global allocator that counts. Not a timing: the counts are exact and
//! repeatable.

// A global allocator is an unsafe trait; this one only counts and delegates.
#![allow(unsafe_code)]

mod common;
#[path = "../tests/support/library.rs"]
mod library;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::*;
use tonic_retry::RetryPolicy;

struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

// SAFETY: every method delegates to `System` with the caller's arguments.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc` is passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(new_size as u64, Ordering::Relaxed);
        // SAFETY: as for `alloc` and `dealloc`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const CALLS: u64 = 10_000;

async fn count<S, R>(mut svc: S, payload: &'static [u8]) -> (f64, f64)
where
    S: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<R>,
            Error = tower::BoxError,
        >,
    R: http_body::Body,
    R::Error: std::fmt::Debug,
{
    // Warm up: thread-locals, the random generator, lazily built statics.
    for _ in 0..100 {
        call(&mut svc, payload).await;
    }
    let (a0, b0) = (
        ALLOCATIONS.load(Ordering::Relaxed),
        BYTES.load(Ordering::Relaxed),
    );
    for _ in 0..CALLS {
        call(&mut svc, payload).await;
    }
    let (a1, b1) = (
        ALLOCATIONS.load(Ordering::Relaxed),
        BYTES.load(Ordering::Relaxed),
    );
    (
        (a1 - a0) as f64 / CALLS as f64,
        (b1 - b0) as f64 / CALLS as f64,
    )
}

/// Allocations per call over a real tonic client and server on loopback,
/// both sides counted (they share the process).
async fn loopback() {
    use library::pb::GetBookRequest;
    use library::pb::library_client::LibraryClient;
    use tonic_retry::{RetryBudget, RetryLayer};
    use tower::ServiceBuilder;

    let addr = library::serve_plain(library::Shelf::default()).await;
    let layer = |policy: RetryPolicy| {
        RetryLayer::new(policy, RetryBudget::new(200, 0.1).expect("a budget"))
    };
    let mut plain = LibraryClient::new(library::channel(addr));
    let mut with = LibraryClient::new(
        ServiceBuilder::new()
            .layer(layer(RetryPolicy::default()))
            .service(library::channel(addr)),
    );
    let mut no_key = LibraryClient::new(
        ServiceBuilder::new()
            .layer(layer(RetryPolicy::default().with_idempotency_key(false)))
            .service(library::channel(addr)),
    );
    const N: u64 = 2_000;
    macro_rules! per_call {
        ($client:expr) => {{
            for _ in 0..100 {
                $client
                    .get_book(GetBookRequest::default())
                    .await
                    .expect("the server answers");
            }
            let before = ALLOCATIONS.load(Ordering::Relaxed);
            for _ in 0..N {
                $client
                    .get_book(GetBookRequest::default())
                    .await
                    .expect("the server answers");
            }
            (ALLOCATIONS.load(Ordering::Relaxed) - before) as f64 / N as f64
        }};
    }
    println!(
        "\nallocations per call over tonic on loopback, client and server together ({N} calls each)"
    );
    println!("{:<42} {:>12.1}", "no layer", per_call!(plain));
    println!("{:<42} {:>12.1}", "RetryLayer", per_call!(with));
    println!("{:<42} {:>12.1}", "RetryLayer, no key", per_call!(no_key));
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(loopback());
    rt.block_on(async {
        println!("allocations per successful call ({CALLS} calls each, in-memory OK service)");
        println!("{:<42} {:>12} {:>14}", "stack", "allocations", "bytes");
        for (label, payload) in [("16 B", &SMALL[..]), ("16 KiB", &LARGE[..])] {
            let rows = [
                ("a no layer", count(inner_ok(), payload).await),
                (
                    "b tower Retry + TpsBudget",
                    count(tower_retry(inner_ok()), payload).await,
                ),
                (
                    "c RetryLayer",
                    count(layered(inner_ok(), RetryPolicy::default()), payload).await,
                ),
                (
                    "c RetryLayer, no key",
                    count(
                        layered(
                            inner_ok(),
                            RetryPolicy::default().with_idempotency_key(false),
                        ),
                        payload,
                    )
                    .await,
                ),
                (
                    "c RetryLayer, 10 s total timeout",
                    count(
                        layered(
                            inner_ok(),
                            RetryPolicy::default().with_total_timeout(Duration::from_secs(10)),
                        ),
                        payload,
                    )
                    .await,
                ),
            ];
            for (name, (allocs, bytes)) in rows {
                println!(
                    "{:<42} {allocs:>12.2} {bytes:>14.1}",
                    format!("{name} ({label})")
                );
            }
        }
    });
}
