//! A raw HTTP/2 server on loopback, for what a gRPC server library does
//! before its application sees a call: refusing a stream
//! (`RST_STREAM(REFUSED_STREAM)`) or going away (`GOAWAY` below the
//! stream). Every stream takes the next step of a script; once the script
//! is done, each is answered with a `Book`.

#![allow(dead_code, unreachable_pub)]

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Response};
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tonic::Code;

use super::pb::Book;

/// What the server does with the next stream (or, for `GoAway`, the next
/// connection).
#[derive(Clone, Copy, Debug)]
pub enum Step {
    /// `RST_STREAM(REFUSED_STREAM)` before reading anything: the server
    /// library turned the stream away.
    Refuse,
    /// `RST_STREAM(REFUSED_STREAM)` after this long, the request unread.
    RefuseAfter(Duration),
    /// A Trailers-Only answer with this code.
    Status(Code),
    /// A `Book` answer, after this long.
    AnswerAfter(Duration),
    /// The next connection gets a graceful `GOAWAY` whose last stream id is
    /// 0 as soon as a stream's headers arrive, and is closed.
    GoAway,
}

/// The server: what it saw, and its task.
pub struct RawServer {
    pub addr: SocketAddr,
    script: Arc<Mutex<VecDeque<Step>>>,
    /// The request headers of every stream, in the order they arrived
    /// (refused and gone-away ones included).
    seen: Arc<Mutex<Vec<HeaderMap>>>,
    task: JoinHandle<()>,
}

impl Drop for RawServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RawServer {
    /// A lazily connecting tonic `Channel` to the server.
    pub fn channel(&self) -> tonic::transport::Channel {
        tonic::transport::Endpoint::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect_lazy()
    }

    /// A `Library` client of the server whose calls go through a layer of
    /// `policy` and `budget`, and the layer (for its metrics).
    pub fn client<Bu: tonic_retry::budgets::Budget>(
        &self,
        policy: tonic_retry::RetryPolicy,
        budget: Bu,
    ) -> (
        super::pb::library_client::LibraryClient<
            tonic_retry::RetryService<tonic::transport::Channel, Bu>,
        >,
        tonic_retry::RetryLayer<Bu>,
    ) {
        let layer = tonic_retry::RetryLayer::with_budget(policy, budget);
        let service = tower::Layer::layer(&layer, self.channel());
        (
            super::pb::library_client::LibraryClient::new(service),
            layer,
        )
    }

    pub async fn start(script: impl IntoIterator<Item = Step>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let script = Arc::new(Mutex::new(script.into_iter().collect::<VecDeque<_>>()));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let task = tokio::spawn({
            let (script, seen) = (script.clone(), seen.clone());
            async move {
                loop {
                    let Ok((socket, _)) = listener.accept().await else {
                        return;
                    };
                    let _ = socket.set_nodelay(true);
                    let go_away = {
                        let mut script = script.lock().unwrap();
                        matches!(script.front(), Some(Step::GoAway))
                            .then(|| script.pop_front())
                            .is_some()
                    };
                    let (script, seen) = (script.clone(), seen.clone());
                    if go_away {
                        tokio::spawn(go_away_at_first_stream(socket, seen));
                    } else {
                        tokio::spawn(serve(socket, script, seen));
                    }
                }
            }
        });
        Self {
            addr,
            script,
            seen,
            task,
        }
    }

    /// Streams the server saw.
    pub fn streams(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    /// The value of `name` on every stream, in order.
    pub fn header(&self, name: &str) -> Vec<Option<String>> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|h| h.get(name).map(|v| v.to_str().unwrap().to_owned()))
            .collect()
    }
}

async fn serve(
    socket: TcpStream,
    script: Arc<Mutex<VecDeque<Step>>>,
    seen: Arc<Mutex<Vec<HeaderMap>>>,
) {
    let Ok(mut conn) = h2::server::handshake(socket).await else {
        return;
    };
    while let Some(Ok((request, mut respond))) = conn.accept().await {
        seen.lock().unwrap().push(request.headers().clone());
        let step = script.lock().unwrap().pop_front();
        tokio::spawn(async move {
            let (_, mut body) = request.into_parts();
            match step {
                Some(Step::Refuse) => {
                    respond.send_reset(h2::Reason::REFUSED_STREAM);
                    return;
                }
                Some(Step::RefuseAfter(wait)) => {
                    tokio::time::sleep(wait).await;
                    respond.send_reset(h2::Reason::REFUSED_STREAM);
                    return;
                }
                _ => {}
            }
            // Read the request whole first, as a gRPC server does.
            while let Some(Ok(chunk)) = body.data().await {
                let _ = body.flow_control().release_capacity(chunk.len());
            }
            match step {
                Some(Step::Status(code)) => {
                    let _ = respond.send_response(status(code), true);
                }
                Some(Step::AnswerAfter(wait)) => {
                    tokio::time::sleep(wait).await;
                    answer(&mut respond);
                }
                _ => answer(&mut respond),
            }
        });
    }
}

fn grpc_headers() -> Response<()> {
    let mut response = Response::new(());
    response
        .headers_mut()
        .insert("content-type", HeaderValue::from_static("application/grpc"));
    response
}

fn status(code: Code) -> Response<()> {
    let mut response = grpc_headers();
    response
        .headers_mut()
        .insert("grpc-status", HeaderValue::from(code as i32));
    response
}

fn answer(respond: &mut h2::server::SendResponse<Bytes>) {
    let Ok(mut stream) = respond.send_response(grpc_headers(), false) else {
        return;
    };
    let book = Book {
        isbn: "1".into(),
        title: "Raw".into(),
        ..Default::default()
    }
    .encode_to_vec();
    let mut frame = BytesMut::with_capacity(5 + book.len());
    frame.extend_from_slice(&[0]);
    frame.extend_from_slice(&(book.len() as u32).to_be_bytes());
    frame.extend_from_slice(&book);
    let _ = stream.send_data(frame.freeze(), false);
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    let _ = stream.send_trailers(trailers);
}

/// Speaks just enough HTTP/2 by hand to answer the first stream's headers
/// with `GOAWAY(last_stream_id = 0, NO_ERROR)`: the stream was never
/// processed, which h2's server API cannot say once it has handed a stream
/// over.
async fn go_away_at_first_stream(mut socket: TcpStream, seen: Arc<Mutex<Vec<HeaderMap>>>) {
    const PREFACE: usize = 24;
    let mut preface = [0u8; PREFACE];
    if socket.read_exact(&mut preface).await.is_err() {
        return;
    }
    // Our SETTINGS (none).
    if socket.write_all(&frame(0x4, 0, 0, &[])).await.is_err() {
        return;
    }
    loop {
        let mut head = [0u8; 9];
        if socket.read_exact(&mut head).await.is_err() {
            return;
        }
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let (kind, flags) = (head[3], head[4]);
        let mut payload = vec![0u8; len];
        if socket.read_exact(&mut payload).await.is_err() {
            return;
        }
        match kind {
            // SETTINGS, not an ACK: acknowledged.
            0x4 if flags & 0x1 == 0
                && socket.write_all(&frame(0x4, 0x1, 0, &[])).await.is_err() =>
            {
                return;
            }
            // HEADERS: the stream is turned away, unprocessed.
            0x1 => {
                seen.lock().unwrap().push(HeaderMap::new());
                let mut go_away = [0u8; 8];
                // Last stream id 0, error code NO_ERROR (0).
                go_away[..4].copy_from_slice(&0u32.to_be_bytes());
                let _ = socket.write_all(&frame(0x7, 0, 0, &go_away)).await;
                let _ = socket.flush().await;
                tokio::time::sleep(Duration::from_millis(50)).await;
                return;
            }
            _ => {}
        }
    }
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u32).to_be_bytes();
    let mut out = vec![len[1], len[2], len[3], kind, flags];
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}
