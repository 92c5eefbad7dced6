//! A layer given gRPC's standard metrics and dropped leaves nothing behind in
//! the meter provider: a client that builds a channel and its layer per
//! backend, or again on each config reload, holds no more memory for it.
//! (One test in this file: the allocator's count is the whole process's.)
#![cfg(feature = "opentelemetry")]
#![allow(unsafe_code)]

mod support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use support::exported::Exported;
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};

/// The system allocator, counting the bytes live.
struct Counting;
static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; only a
// counter is kept beside it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract for `dealloc`, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Builds and drops `n` layers, with metrics on `exported` when given;
/// returns the bytes still held afterwards.
fn churn(exported: Option<&Exported>, n: usize) -> isize {
    let before = LIVE.load(Ordering::Relaxed);
    for i in 0..n {
        let layer = RetryLayer::new(RetryPolicy::default(), RetryBudget::new(10, 0.1).unwrap());
        match exported {
            Some(exported) => {
                drop(layer.with_grpc_metrics(
                    exported.metrics(&format!("dns:///backend-{}:50051", i % 4)),
                ))
            }
            None => drop(layer),
        }
    }
    LIVE.load(Ordering::Relaxed) - before
}

#[test]
fn dropped_layers_leave_nothing_behind_in_the_meter_provider() {
    const LAYERS: usize = 10_000;
    let bare = churn(None, LAYERS);
    assert!(
        bare < 100_000,
        "{LAYERS} layers without metrics hold {bare} bytes"
    );

    let exported = Exported::new();
    // The instruments and their four series are made once, by the first.
    churn(Some(&exported), 10);
    exported.flush();
    let held = churn(Some(&exported), LAYERS);
    exported.flush();
    // What a dropped layer kept would grow with the layers dropped: 10,000
    // of them at even 10 bytes each would hold 100,000.
    assert!(
        held < 100_000,
        "{LAYERS} dropped layers still hold {held} bytes ({} per layer)",
        held / LAYERS as isize
    );
}
