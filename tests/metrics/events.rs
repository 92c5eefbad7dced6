//! The tracing events the layer emits. In a test binary of its own: tracing
//! caches each event's interest process-wide, so a test running without a
//! subscriber on another thread could otherwise switch these events off.

use std::sync::Arc;

use crate::support::*;
use tonic::Code;
use tonic_retry::RetryPolicy;

/// Collects the fields of every event the layer emits.
#[derive(Clone, Default)]
struct Events(Arc<std::sync::Mutex<Vec<Fields>>>);

/// One event's fields, as `(name, value)`.
type Fields = Vec<(String, String)>;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Events {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Visitor(Fields);
        impl tracing::field::Visit for Visitor {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.0.push((field.name().to_owned(), format!("{value:?}")));
            }
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                self.0.push((field.name().to_owned(), value.to_owned()));
            }
        }
        let level = event.metadata().level().to_string();
        let mut fields = Visitor(vec![("level".to_owned(), level)]);
        event.record(&mut fields);
        self.0.lock().unwrap().push(fields.0);
    }
}

#[tokio::test(start_paused = true)]
async fn every_attempt_emits_one_event_with_its_numbers() {
    use tracing_subscriber::layer::SubscriberExt;
    let events = Events::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(events.clone()));

    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, with_timeout(request(), "1S")).await;
    let (_, send, _) = next(&mut handle).await;
    send.send_response(status_from("instance-a", Code::Unavailable));
    let (_, send, _) = next(&mut handle).await;
    send.send_response(ok());
    call.await.unwrap().unwrap();

    let events = events.0.lock().unwrap().clone();
    let attempts: Vec<_> = events
        .iter()
        .filter(|fields| fields.iter().any(|(k, _)| k == "attempt"))
        .collect();
    assert_eq!(attempts.len(), 2, "one event per attempt: {events:?}");
    let get = |fields: &Fields, key: &str| {
        fields
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(get(attempts[0], "attempt").as_deref(), Some("1"));
    assert_eq!(get(attempts[0], "code").as_deref(), Some("UNAVAILABLE"));
    assert!(get(attempts[0], "delay").is_some(), "the retry's delay");
    assert!(get(attempts[0], "remaining").is_some(), "the time left");
    // The token is taken when the retry is sent, after this event.
    assert_eq!(get(attempts[0], "tokens").as_deref(), Some("100.0"));
    assert_eq!(get(attempts[0], "instance").as_deref(), Some("instance-a"));
    let key = get(attempts[0], "key").expect("the call's idempotency key");
    assert_eq!(key.len(), 32);
    assert_eq!(
        get(attempts[1], "key"),
        Some(key),
        "one key for the whole call"
    );
    assert_eq!(get(attempts[1], "attempt").as_deref(), Some("2"));
    assert_eq!(get(attempts[1], "code").as_deref(), Some("OK"));
    // One token paid for the retry; the success earns its tenth when its
    // trailers say OK, after this event.
    assert_eq!(get(attempts[1], "tokens").as_deref(), Some("99.0"));
}

#[tokio::test(start_paused = true)]
async fn the_event_says_when_a_layer_below_already_retried_and_when_this_one_marks() {
    use tracing_subscriber::layer::SubscriberExt;
    let events = Events::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(events.clone()));

    // A failure that a layer below gave up on: passed up, and said so.
    let (mut svc, mut handle, _) = setup(RetryPolicy::default(), budget());
    let call = spawn_call(&mut svc, request()).await;
    let (_, send, _) = next(&mut handle).await;
    let mut marked = status(Code::Unavailable);
    marked.headers_mut().insert(
        "grpc-retry-pushback-ms",
        http::HeaderValue::from_static("-1"),
    );
    send.send_response(marked);
    call.await.unwrap().unwrap();

    // A failure this layer gives up on after retrying: marked, and said so.
    unavailable_every_time(&mut svc, &mut handle, 3).await;

    let events = events.0.lock().unwrap().clone();
    let get = |fields: &Fields, key: &str| {
        fields
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    };
    let attempts: Vec<_> = events
        .iter()
        .filter(|fields| fields.iter().any(|(k, _)| k == "attempt"))
        .collect();
    assert_eq!(attempts.len(), 4, "{events:?}");
    assert_eq!(
        get(attempts[0], "message").as_deref(),
        Some("not retried: a layer below already retried")
    );
    assert_eq!(get(attempts[0], "marked").as_deref(), Some("false"));
    assert_eq!(
        get(attempts[3], "message").as_deref(),
        Some("no attempts left")
    );
    assert_eq!(get(attempts[3], "marked").as_deref(), Some("true"));
}

#[tokio::test(start_paused = true)]
async fn a_body_too_large_to_retry_is_said_at_warn_with_its_limit() {
    use tracing_subscriber::layer::SubscriberExt;
    let events = Events::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(events.clone()));

    let policy = RetryPolicy::default().with_replay_limit(4);
    let (mut svc, mut handle, layer) = setup(policy, budget());
    // `request()` carries a 10-byte message: over the 4-byte limit. The
    // attempt reads it, so no copy is left to send again.
    let call = spawn_call(&mut svc, request()).await;
    let (req, send, _) = next(&mut handle).await;
    http_body_util::BodyExt::collect(req.into_body())
        .await
        .unwrap();
    send.send_response(status(Code::Unavailable));
    call.await.unwrap().unwrap();
    assert_eq!(layer.metrics().body_too_large(), 1);

    let events = events.0.lock().unwrap().clone();
    let get = |fields: &Fields, key: &str| {
        fields
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    };
    let warnings: Vec<_> = events
        .iter()
        .filter(|fields| get(fields, "level").as_deref() == Some("WARN"))
        .collect();
    assert_eq!(warnings.len(), 1, "{events:?}");
    assert_eq!(get(warnings[0], "limit").as_deref(), Some("4"));
    let message = get(warnings[0], "message").unwrap();
    assert!(
        message.starts_with("not retried: the request body outgrew"),
        "{message}"
    );
    // The attempt's own event names the reason too.
    let attempt = events
        .iter()
        .find(|fields| get(fields, "attempt").is_some())
        .unwrap();
    assert_eq!(
        get(attempt, "message").as_deref(),
        Some("request body outgrew the replay limit")
    );
}

#[test]
fn a_service_config_field_the_layer_does_not_apply_is_said_at_load() {
    use tracing_subscriber::layer::SubscriberExt;
    let events = Events::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(events.clone()));

    let config: tonic_retry::service_config::ServiceConfig = r#"{"methodConfig": [{
          "name": [{"service": "library.v1.Library"}], "waitForReady": true }]}"#
        .parse()
        .unwrap();
    assert_eq!(config.not_applied().count(), 1);

    let events = events.0.lock().unwrap().clone();
    let get = |fields: &Fields, key: &str| {
        fields
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(get(&events[0], "level").as_deref(), Some("WARN"));
    assert_eq!(
        get(&events[0], "field").as_deref(),
        Some("methodConfig[0].waitForReady")
    );
    assert!(
        get(&events[0], "instead")
            .unwrap()
            .contains("retries under the call's deadline"),
        "{events:?}"
    );
}
