//! Instructions per call on the real path, for `valgrind --tool=callgrind`: a
//! real tonic server and client in one process on 127.0.0.1, unary `GetBook`
//! calls one at a time, everything on one thread (the server's and the
//! client's work alike: hyper, h2 and HPACK on both ends, the loopback
//! socket's calls into the kernel not counted). `--bench loopback`'s
//! wall-clock share of the bare client's throughput moves by several points
//! between runs on a shared machine; these counts move by up to about 1 % of
//! a call of about 126,000 between runs of one binary (malloc's own work
//! moves with the allocator's state), so a smaller change is read from the
//! inclusive counts of the functions it touches (`--callgrind-out-file` and
//! `callgrind_annotate --inclusive=yes`), as BENCHMARKS.md does.
//!
//! `STACK` is one of:
//! - `bare`: tonic's generated client on its `Channel`;
//! - `bare-key`: the same, each call sending an `x-idempotency-key` of 32
//!   hex digits marked sensitive (never indexed by HPACK), made once and
//!   cloned: what a never-repeating key costs on the wire and at the server,
//!   with no layer and nothing generated;
//! - `layer`: the client through `RetryLayer` with its defaults;
//! - `layer-no-key`: the same, key generation off;
//! - `layer-no-report`: the same, and no instance ids learnt, so no
//!   balancer's report slot (`PickedInstance`) on the attempt;
//! - `bare-timeout` and `layer-no-key-timeout`: `bare` and `layer-no-key`,
//!   each call with a timeout of 10 s (tonic's `Request::set_timeout`, sent
//!   as `grpc-timeout`, which the server keeps with a timer of its own, and
//!   the layer with its deadline).
//!
//! The cost of one call is the difference between two runs, which cancels
//! start-up and the connection's set-up:
//!
//! ```text
//! cargo bench --bench loopback_instructions --no-run
//! BIN=$(ls -t target/release/deps/loopback_instructions-* | grep -v '\.d$' | head -1)
//! for n in 1000 3000; do
//!   STACK=layer N=$n valgrind --tool=callgrind --callgrind-out-file=/dev/null $BIN 2>&1 | grep Collected
//! done   # (second - first) / 2000 = instructions per call
//! ```

#[path = "../tests/support/library.rs"]
mod library;

use library::Shelf;
use library::pb::GetBookRequest;
use library::pb::library_client::LibraryClient;
use tonic::codegen::{Body, Bytes, StdError};
use tonic::metadata::MetadataValue;
use tonic_retry::{RetryBudget, RetryLayer, RetryPolicy};
use tower::ServiceBuilder;

/// `n` calls, one after another, each with `key` if given, and each with a
/// timeout of `timeout` (tonic's `Request::set_timeout`, sent as
/// `grpc-timeout`) if given.
async fn calls<T>(
    mut client: LibraryClient<T>,
    n: u64,
    key: Option<MetadataValue<tonic::metadata::Ascii>>,
    timeout: Option<std::time::Duration>,
) where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<StdError>,
    T::ResponseBody: Body<Data = Bytes> + Send + 'static,
    <T::ResponseBody as Body>::Error: Into<StdError> + Send,
{
    for _ in 0..n {
        let mut request = tonic::Request::new(GetBookRequest {
            isbn: "978-0-00-000000-0".into(),
        });
        if let Some(key) = &key {
            request
                .metadata_mut()
                .insert("x-idempotency-key", key.clone());
        }
        if let Some(timeout) = timeout {
            request.set_timeout(timeout);
        }
        std::hint::black_box(client.get_book(request).await.expect("the server answers"));
    }
}

/// The timeout of the `-timeout` stacks' calls.
const TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

fn layer(policy: RetryPolicy) -> RetryLayer {
    RetryLayer::new(policy, RetryBudget::new(200, 0.1).expect("a budget"))
}

fn main() {
    let stack = std::env::var("STACK").unwrap_or_default();
    let n = std::env::var("N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async move {
        let addr = library::serve_plain(Shelf::default()).await;
        let channel = library::channel(addr);
        let bare = LibraryClient::new(channel.clone());
        // Connect before counting.
        calls(bare.clone(), 1, None, None).await;
        match stack.as_str() {
            "bare" => calls(bare, n, None, None).await,
            "bare-key" => {
                let mut key = MetadataValue::from_static("0123456789abcdef0123456789abcdef");
                key.set_sensitive(true);
                calls(bare, n, Some(key), None).await
            }
            "layer" => {
                let svc = ServiceBuilder::new()
                    .layer(layer(RetryPolicy::default()))
                    .service(channel);
                calls(LibraryClient::new(svc), n, None, None).await
            }
            "layer-no-key" => {
                let policy = RetryPolicy::default().with_idempotency_key(false);
                let svc = ServiceBuilder::new().layer(layer(policy)).service(channel);
                calls(LibraryClient::new(svc), n, None, None).await
            }
            "layer-no-report" => {
                let policy = RetryPolicy::default()
                    .with_idempotency_key(false)
                    .with_instance_header(None);
                let svc = ServiceBuilder::new().layer(layer(policy)).service(channel);
                calls(LibraryClient::new(svc), n, None, None).await
            }
            "bare-timeout" => calls(bare, n, None, Some(TIMEOUT)).await,
            "layer-no-key-timeout" => {
                let policy = RetryPolicy::default().with_idempotency_key(false);
                let svc = ServiceBuilder::new().layer(layer(policy)).service(channel);
                calls(LibraryClient::new(svc), n, None, Some(TIMEOUT)).await
            }
            other => panic!(
                "STACK must be bare, bare-key, layer, layer-no-key, layer-no-report, bare-timeout or layer-no-key-timeout, not {other:?}"
            ),
        }
    });
}
