//! The response body type of [`RetryService`](crate::RetryService).

use std::pin::Pin;
use std::task::{Context, Poll};

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::classify::repair_status_details;

pin_project! {
    /// The inner service's response body, passed through frame by frame, or the
    /// empty body of a status the layer answered itself.
    ///
    /// Data frames are untouched. Trailers get one repair: a
    /// `grpc-status-details-bin` trailer that is not valid base64 is dropped
    /// (with a warning), because tonic's client would panic decoding it.
    #[derive(Debug)]
    pub struct ResponseBody<B> {
        #[pin]
        inner: Option<B>,
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn new(inner: B) -> Self {
        Self { inner: Some(inner) }
    }

    /// An empty body, as sent with a status the layer answered itself.
    pub const fn empty() -> Self {
        Self { inner: None }
    }

    /// The inner service's body, or `None` for a status the layer answered.
    pub fn into_inner(self) -> Option<B> {
        self.inner
    }
}

impl<B> Default for ResponseBody<B> {
    fn default() -> Self {
        Self::empty()
    }
}

impl<B: Body> Body for ResponseBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let Some(inner) = self.project().inner.as_pin_mut() else {
            return Poll::Ready(None);
        };
        inner.poll_frame(cx).map(|frame| {
            frame.map(|frame| {
                frame.map(|frame| match frame.into_trailers() {
                    Ok(mut trailers) => {
                        repair_status_details(&mut trailers);
                        Frame::trailers(trailers)
                    }
                    Err(frame) => frame,
                })
            })
        })
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(B::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), B::size_hint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http::HeaderMap;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn data_passes_and_bad_details_trailer_is_dropped() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", "14".parse().unwrap());
        trailers.insert("grpc-status-details-bin", "***".parse().unwrap());
        let inner = http_body_util::StreamBody::new(tokio_stream::iter([
            Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from_static(b"abc"))),
            Ok(Frame::trailers(trailers)),
        ]));
        let collected = ResponseBody::new(inner).collect().await.unwrap();
        let trailers = collected.trailers().cloned().expect("trailers pass");
        assert_eq!(trailers["grpc-status"], "14");
        assert!(!trailers.contains_key("grpc-status-details-bin"));
        assert_eq!(collected.to_bytes(), "abc");
    }

    #[test]
    fn empty_is_empty() {
        let b = ResponseBody::<http_body_util::Full<Bytes>>::empty();
        assert!(b.is_end_stream());
        assert_eq!(b.size_hint().exact(), Some(0));
    }
}
