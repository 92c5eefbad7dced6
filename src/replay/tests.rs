use super::*;
use http_body_util::{BodyExt, Full, StreamBody};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

type Source = StreamBody<UnboundedReceiverStream<Result<Frame<Bytes>, BoxError>>>;

/// A body fed by hand: returns the sender and the wrapped body.
fn fixture(
    limit: usize,
) -> (
    mpsc::UnboundedSender<Result<Frame<Bytes>, BoxError>>,
    ReplayBody<Source>,
) {
    let (tx, rx) = mpsc::unbounded_channel();
    let body = ReplayBody::new(StreamBody::new(UnboundedReceiverStream::new(rx)), limit);
    (tx, body)
}

/// The source `fixture` wraps, for a body made another way.
fn fixture_source() -> (
    mpsc::UnboundedSender<Result<Frame<Bytes>, BoxError>>,
    Source,
) {
    let (tx, rx) = mpsc::unbounded_channel();
    (tx, StreamBody::new(UnboundedReceiverStream::new(rx)))
}

fn data(s: &'static str) -> Result<Frame<Bytes>, BoxError> {
    Ok(Frame::data(Bytes::from_static(s.as_bytes())))
}

fn trailers(k: &'static str, v: &'static str) -> HeaderMap {
    let mut t = HeaderMap::new();
    t.insert(k, v.parse().unwrap());
    t
}

async fn collect(body: ReplayBody<Source>) -> (Vec<u8>, Option<HeaderMap>) {
    let c = body
        .collect()
        .await
        .expect("body should be collected whole");
    let t = c.trailers().cloned();
    (c.to_bytes().to_vec(), t)
}

#[tokio::test]
async fn one_chunk_replays() {
    let (tx, first) = fixture(64);
    let second = first.clone();
    tx.send(data("hello")).unwrap();
    drop(tx);
    assert_eq!(collect(first).await.0, b"hello");
    assert!(second.is_replayable());
    assert_eq!(
        collect(second).await.0,
        b"hello",
        "the retry sends the same bytes"
    );
}

#[tokio::test]
async fn many_chunks_and_trailers_replay_in_order() {
    let (tx, first) = fixture(64);
    let second = first.clone();
    for s in ["a", "bc", "def"] {
        tx.send(data(s)).unwrap();
    }
    tx.send(Ok(Frame::trailers(trailers("x-sum", "6"))))
        .unwrap();
    drop(tx);
    let (bytes, t) = collect(first).await;
    assert_eq!(bytes, b"abcdef");
    assert_eq!(t.unwrap()["x-sum"], "6");
    let (bytes, t) = collect(second).await;
    assert_eq!(bytes, b"abcdef");
    assert_eq!(t.expect("trailers should be replayed")["x-sum"], "6");
}

#[tokio::test]
async fn replay_is_zero_copy() {
    let (tx, mut first) = fixture(64);
    let mut second = first.clone();
    tx.send(data("shared")).unwrap();
    let a = first.frame().await.unwrap().unwrap().into_data().unwrap();
    let b = second.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(
        a.as_ptr(),
        b.as_ptr(),
        "the replayed chunk is the same memory"
    );
}

#[tokio::test]
async fn a_clone_switched_in_mid_body_replays_then_reads_on() {
    let (tx, mut first) = fixture(64);
    let second = first.clone();
    tx.send(data("one ")).unwrap();
    assert_eq!(
        first.frame().await.unwrap().unwrap().into_data().unwrap(),
        "one "
    );
    // The first attempt fails here; its body is dropped mid-stream.
    drop(first);
    tx.send(data("two")).unwrap();
    drop(tx);
    assert_eq!(collect(second).await.0, b"one two");
}

#[tokio::test]
async fn two_clones_reading_at_once_both_see_everything() {
    let (tx, first) = fixture(64);
    let second = first.clone();
    let feed = async move {
        for s in ["x", "y", "z"] {
            tokio::task::yield_now().await;
            tx.send(data(s)).unwrap();
        }
    };
    let (a, b, ()) = tokio::join!(collect(first), collect(second), feed);
    assert_eq!(a.0, b"xyz");
    assert_eq!(b.0, b"xyz", "the waiting clone was woken");
}

#[tokio::test]
async fn over_the_limit_the_body_is_delivered_whole_but_not_replayable() {
    let (tx, first) = fixture(8);
    let mut second = first.clone();
    for s in ["1234", "5678", "9"] {
        tx.send(data(s)).unwrap();
    }
    drop(tx);
    assert_eq!(collect(first).await.0, b"123456789", "never truncated");
    assert!(!second.is_replayable());
    assert!(second.is_capped());
    let err = second.frame().await.unwrap().unwrap_err();
    assert_eq!(
        err.downcast_ref::<ReplayError>(),
        Some(&ReplayError::Capped)
    );
}

#[tokio::test]
async fn exactly_the_limit_is_still_replayable() {
    let (tx, first) = fixture(8);
    let second = first.clone();
    tx.send(data("12345678")).unwrap();
    drop(tx);
    assert_eq!(collect(first).await.0, b"12345678");
    assert!(second.is_replayable());
    assert_eq!(collect(second).await.0, b"12345678");
}

#[tokio::test]
async fn a_size_hint_over_the_limit_keeps_nothing() {
    let body = ReplayBody::new(
        http_body_util::Full::new(Bytes::from_static(b"0123456789")),
        4,
    );
    assert!(body.is_capped());
    let bytes = body.collect().await.unwrap().to_bytes();
    assert_eq!(bytes, "0123456789");
}

/// How many chunks the shared copy holds.
fn kept(body: &ReplayBody<Source>) -> usize {
    let shared = body.state().ok().expect("a streamed body");
    usize::from(shared.copy.chunks.first.is_some()) + shared.copy.chunks.rest.len()
}

#[tokio::test]
async fn after_release_the_stream_goes_on_and_nothing_is_copied() {
    let (tx, mut first) = fixture(1 << 20);
    tx.send(data("before")).unwrap();
    first.frame().await.unwrap().unwrap();
    assert_eq!(kept(&first), 1);
    // The response committed: no retry can follow.
    first.release();
    assert_eq!(kept(&first), 0, "the copy is dropped at once");
    assert!(!first.is_replayable());
    for _ in 0..100 {
        tx.send(data("streamed on")).unwrap();
        let chunk = first.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(chunk, "streamed on", "the stream is not disturbed");
    }
    assert_eq!(kept(&first), 0, "nothing is copied after the release");
    let mut late = first.clone();
    let err = late.frame().await.unwrap().unwrap_err();
    assert_eq!(
        err.downcast_ref::<ReplayError>(),
        Some(&ReplayError::Released)
    );
}

#[tokio::test]
async fn the_last_attempt_releases_the_copy_once_it_has_replayed_it() {
    let (tx, mut first) = fixture(1 << 20);
    tx.send(data("a")).unwrap();
    tx.send(data("b")).unwrap();
    first.frame().await.unwrap().unwrap();
    first.frame().await.unwrap().unwrap();
    let mut last = first.clone();
    drop(first);
    last.mark_last();
    last.sent();
    assert_eq!(
        last.frame().await.unwrap().unwrap().into_data().unwrap(),
        "a"
    );
    assert_eq!(kept(&last), 2, "still replaying");
    assert_eq!(
        last.frame().await.unwrap().unwrap().into_data().unwrap(),
        "b"
    );
    assert_eq!(kept(&last), 0, "replayed whole: the copy goes");
    tx.send(data("c")).unwrap();
    drop(tx);
    assert_eq!(
        last.frame().await.unwrap().unwrap().into_data().unwrap(),
        "c"
    );
    assert_eq!(kept(&last), 0, "and nothing more is copied");
    assert!(last.frame().await.is_none());
}

#[tokio::test]
async fn a_failed_source_fails_later_clones_too() {
    let (tx, mut first) = fixture(64);
    let mut second = first.clone();
    tx.send(Err("boom".into())).unwrap();
    assert!(first.frame().await.unwrap().is_err());
    assert!(!second.is_replayable());
    let err = second.frame().await.unwrap().unwrap_err();
    assert_eq!(
        err.downcast_ref::<ReplayError>(),
        Some(&ReplayError::SourceFailed)
    );
}

#[tokio::test]
async fn end_of_stream_and_size_hints() {
    let body = ReplayBody::new(http_body_util::Empty::<Bytes>::new(), 4);
    assert!(
        body.is_end_stream(),
        "an empty body says so before being polled"
    );
    let full = ReplayBody::new(http_body_util::Full::new(Bytes::from_static(b"abc")), 64);
    assert_eq!(full.size_hint().exact(), Some(3));
    let again = full.clone();
    let (bytes, _) = {
        let c = full.collect().await.unwrap();
        (c.to_bytes(), ())
    };
    assert_eq!(bytes, "abc");
    assert_eq!(
        again.size_hint().exact(),
        Some(3),
        "replay knows its exact size"
    );
    assert!(!again.is_end_stream());
    assert_eq!(again.collect().await.unwrap().to_bytes(), "abc");
}

#[tokio::test]
async fn the_first_attempt_streams_before_the_body_ends() {
    let (tx, mut first) = fixture(64);
    tx.send(data("early")).unwrap();
    // The sender is still open: the body has not ended, yet the chunk flows.
    let chunk = first.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(chunk, "early");
    assert!(!first.is_complete());
    drop(tx);
    assert!(first.frame().await.is_none());
    assert!(first.is_complete());
}

#[tokio::test]
async fn a_copy_the_layer_has_no_room_for_is_dropped_and_says_why() {
    let memory = Arc::new(ReplayMemory::new(4));
    let (tx, source) = tokio::sync::mpsc::unbounded_channel();
    let source = http_body_util::StreamBody::new(
        tokio_stream::wrappers::UnboundedReceiverStream::new(source),
    );
    let first = ReplayBody::sharing(source, 64, Some(Arc::clone(&memory) as Arc<dyn Account>));
    let second = first.clone();
    tx.send(data("abc")).unwrap();
    tx.send(data("def")).unwrap();
    drop(tx);
    let sent = first.collect().await.unwrap().to_bytes();
    assert_eq!(sent, "abcdef", "the first attempt gets the whole body");
    assert_eq!(second.replay_state(), Err(ReplayError::LayerFull));
    assert_eq!(memory.used(), 0, "what the copy held is given back");
    let err = second.collect().await.unwrap_err();
    assert_eq!(
        err.downcast_ref::<ReplayError>(),
        Some(&ReplayError::LayerFull)
    );
}

/// A body the layer's memory counts, read at once as a retried call's is.
fn at_once<T>(source: T, limit: usize, memory: &Arc<ReplayMemory>) -> ReplayBody<T>
where
    T: Body<Data = Bytes> + Unpin,
    T::Error: Into<BoxError>,
{
    let memory = Some(Arc::clone(memory) as Arc<dyn Account>);
    ReplayBody::at_once(source, limit, memory)
}

#[tokio::test]
async fn a_body_all_there_is_read_whole_and_replayed_without_its_source() {
    let memory = Arc::new(ReplayMemory::new(1 << 20));
    let (tx, source) = fixture_source();
    tx.send(data("ab")).unwrap();
    tx.send(data("cd")).unwrap();
    tx.send(Ok(Frame::trailers(trailers("x-t", "1")))).unwrap();
    let first = at_once(source, 64, &memory);
    assert!(matches!(first.state, State::Whole(_)));
    assert!(first.is_complete() && first.is_replayable() && !first.is_capped());
    assert_eq!(memory.used(), 4, "the copy is counted from the start");
    let second = first.clone();
    let third = first.clone();
    // The caller's body is not read again: its sender may go.
    drop(tx);
    for body in [first, second] {
        let (bytes, t) = collect(body).await;
        assert_eq!(bytes, b"abcd");
        assert_eq!(t.unwrap()["x-t"], "1");
    }
    // No retry follows: a clone can no longer be sent, and the layer's
    // memory gets back what the copy held.
    third.release();
    assert_eq!(third.whole(), Err(ReplayError::Released));
    assert_eq!(memory.used(), 0);
    drop(third);
    assert_eq!(memory.used(), 0, "given back once");
}

#[tokio::test]
async fn a_body_read_whole_gives_the_memory_back_when_its_last_clone_goes() {
    let memory = Arc::new(ReplayMemory::new(1 << 20));
    let first = at_once(Full::new(Bytes::from_static(b"hello")), 64, &memory);
    let second = first.clone();
    assert_eq!(memory.used(), 5);
    drop(first);
    assert_eq!(memory.used(), 5, "a clone still holds the copy");
    drop(second);
    assert_eq!(memory.used(), 0, "a call dropped unreleased holds nothing");
}

#[tokio::test]
async fn a_body_not_all_there_sends_what_was_read_then_streams_on() {
    let memory = Arc::new(ReplayMemory::new(1 << 20));
    let (tx, source) = fixture_source();
    tx.send(data("early")).unwrap();
    let mut first = at_once(source, 64, &memory);
    assert!(matches!(first.state, State::Streamed(_)));
    let second = first.clone();
    let chunk = first.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(chunk, "early", "what was read at once goes first");
    tx.send(data(" late")).unwrap();
    drop(tx);
    assert_eq!(collect(first).await.0, b" late");
    assert_eq!(
        collect(second).await.0,
        b"early late",
        "a retry replays all"
    );
}

#[tokio::test]
async fn a_body_failing_at_once_fails_its_first_attempt_and_is_not_replayed() {
    let memory = Arc::new(ReplayMemory::new(1 << 20));
    let (tx, source) = fixture_source();
    tx.send(data("ok")).unwrap();
    tx.send(Err("the caller's body broke".into())).unwrap();
    let mut first = at_once(source, 64, &memory);
    let second = first.clone();
    assert!(
        second.whole().is_ok(),
        "nothing is known broken before it is sent"
    );
    let chunk = first.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(chunk, "ok");
    let err = first.frame().await.unwrap().unwrap_err();
    assert_eq!(err.to_string(), "the caller's body broke");
    assert_eq!(second.replay_state(), Err(ReplayError::SourceFailed));
    drop(tx);
}

#[tokio::test]
async fn a_body_over_the_limit_read_at_once_is_sent_whole_and_not_replayed() {
    let memory = Arc::new(ReplayMemory::new(1 << 20));
    let (tx, source) = fixture_source();
    tx.send(data("0123")).unwrap();
    tx.send(data("4567")).unwrap();
    drop(tx);
    let first = at_once(source, 6, &memory);
    let second = first.clone();
    assert_eq!(collect(first).await.0, b"01234567", "sent whole");
    assert_eq!(second.replay_state(), Err(ReplayError::Capped));
    assert_eq!(memory.used(), 0);
}

#[tokio::test]
async fn a_body_the_layer_has_no_room_for_is_sent_whole_and_not_replayed() {
    let memory = Arc::new(ReplayMemory::new(3));
    let first = at_once(Full::new(Bytes::from_static(b"hello")), 64, &memory);
    let second = first.clone();
    assert_eq!(first.collect().await.unwrap().to_bytes(), "hello");
    assert_eq!(second.replay_state(), Err(ReplayError::LayerFull));
    assert_eq!(memory.used(), 0);
}

#[tokio::test]
async fn no_more_than_a_few_frames_are_read_before_the_first_attempt() {
    let memory = Arc::new(ReplayMemory::new(1 << 20));
    let (tx, source) = fixture_source();
    for _ in 0..AT_ONCE_FRAMES * 4 {
        tx.send(data("x")).unwrap();
    }
    let first = at_once(source, 1 << 20, &memory);
    match &first.state {
        State::Streamed(shared) => {
            let shared = shared.lock().unwrap();
            assert_eq!(
                shared.input.head.len(),
                AT_ONCE_FRAMES,
                "the rest waits its turn"
            );
        }
        State::Whole(_) => panic!("an unfinished body is not read whole"),
    }
    drop(tx);
    let sent = collect(first).await.0;
    assert_eq!(
        sent.len(),
        AT_ONCE_FRAMES * 4,
        "nothing lost, nothing twice"
    );
}

#[tokio::test]
async fn the_first_attempt_says_its_size_as_the_callers_body_did() {
    let memory = Arc::new(ReplayMemory::new(1 << 20));
    // A body that knows its size says so; one that does not (a stream, as
    // tonic's encoder is) does not start to, so a client adds no
    // `content-length` the caller's body would not have had.
    let known = at_once(Full::new(Bytes::from_static(b"hello")), 64, &memory);
    assert_eq!(known.size_hint().exact(), Some(5));
    let (tx, source) = fixture_source();
    tx.send(data("hello")).unwrap();
    drop(tx);
    let unknown = at_once(source, 64, &memory);
    assert!(matches!(unknown.state, State::Whole(_)));
    assert_eq!(unknown.size_hint().exact(), None);
    assert_eq!(unknown.size_hint().lower(), 5);
    // A retry's clone of a body all read knows its size.
    assert_eq!(unknown.clone().size_hint().exact(), Some(5));
}

#[tokio::test]
async fn an_empty_body_is_read_whole_and_ends_at_once() {
    let memory = Arc::new(ReplayMemory::new(1 << 20));
    let first = at_once(http_body_util::Empty::<Bytes>::new(), 64, &memory);
    assert!(first.is_end_stream());
    assert!(first.clone().is_end_stream() && first.is_replayable());
}

/// What one frame read was: data (its text), trailers, the end, or an error
/// (its `ReplayError`).
fn frame_kind(frame: Option<Result<Frame<Bytes>, BoxError>>) -> String {
    match frame {
        None => "end".into(),
        Some(Ok(frame)) => match frame.into_data() {
            Ok(data) => String::from_utf8_lossy(&data).into_owned(),
            Err(_) => "trailers".into(),
        },
        Some(Err(e)) => format!("{:?}", e.downcast_ref::<ReplayError>()),
    }
}

/// Attempts 1 and 2 of a hedged call whose body is `template`, both sent.
fn two_hedges(template: &ReplayBody<Source>) -> (ReplayBody<Source>, ReplayBody<Source>) {
    template.set_concurrent();
    let mut first = template.clone();
    first.set_attempt(1);
    first.sent();
    let mut second = template.clone();
    second.set_attempt(2);
    second.sent();
    (first, second)
}

#[tokio::test]
async fn a_hedged_call_committed_then_released_lets_its_winner_read_on() {
    let (tx, source) = fixture_source();
    let template = ReplayBody::hedged(source, 64, None);
    let (mut winner, mut loser) = two_hedges(&template);
    tx.send(data("x")).unwrap();
    assert_eq!(frame_kind(winner.frame().await), "x");
    template.release_to(1);
    template.release();
    tx.send(data("y")).unwrap();
    assert_eq!(frame_kind(winner.frame().await), "y", "the winner reads on");
    assert_eq!(frame_kind(loser.frame().await), "x", "the loser replays");
}

#[tokio::test]
async fn a_call_released_stays_released_when_a_hedge_commits_after() {
    let memory = Arc::new(ReplayMemory::new(1 << 20));
    let (tx, source) = fixture_source();
    let account = Arc::clone(&memory) as Arc<dyn Account>;
    let template = ReplayBody::hedged(source, 64, Some(account));
    let (mut first, _second) = two_hedges(&template);
    tx.send(data("x")).unwrap();
    assert_eq!(frame_kind(first.frame().await), "x");
    template.release();
    assert_eq!(frame_kind(first.frame().await), "Some(Released)");
    template.release_to(2);
    tx.send(data("y")).unwrap();
    assert_eq!(
        frame_kind(first.frame().await),
        "Some(Released)",
        "a clone refused never reads again"
    );
    assert_eq!(memory.used(), 1, "nothing more is copied");
}

#[tokio::test]
async fn a_drain_started_after_the_release_finds_its_clone_released() {
    let (tx, source) = fixture_source();
    let template = ReplayBody::sharing(source, 64, None);
    let mut cut = template.clone();
    cut.sent();
    let lingering = cut
        .drainable()
        .expect("a retried call's attempt may be drained");
    let mut last = template.clone();
    last.mark_last();
    last.sent();
    tx.send(data("b")).unwrap();
    let _drain = lingering.drain();
    template.release();
    let mut cx = Context::from_waker(Waker::noop());
    let read = match Pin::new(&mut cut).poll_frame(&mut cx) {
        Poll::Pending => "pending".to_owned(),
        Poll::Ready(frame) => frame_kind(frame),
    };
    assert_eq!(read, "Some(Released)");
}

#[tokio::test]
async fn a_commit_to_an_attempt_out_of_range_leaves_the_call_released() {
    let (_tx, source) = fixture_source();
    let template = ReplayBody::hedged(source, 64, None);
    let (_first, second) = two_hedges(&template);
    template.release_to(1);
    template.release_to(7);
    assert_eq!(template.replay_state(), Err(ReplayError::Released));
    drop(second);
    assert_eq!(template.replay_state(), Err(ReplayError::Released));
}
