//! Every retry (and hedge) of a call with a deadline says exactly one
//! `grpc-timeout`, the time left, whatever the caller sent (one header,
//! several, or one the layer cannot read beside a policy's timeout); a call
//! without a deadline carries the caller's values as sent. Every other header,
//! in order, and the extensions are the same on every attempt.

use std::time::Duration;

use http::{HeaderValue, Request};
use tokio::time::Instant;
use tonic::Code;
use tonic::body::Body;
use tonic_retry::RetryPolicy;

use crate::support::*;

#[derive(Clone, Debug, PartialEq)]
struct Ext(u32);

/// Headers other than those the layer owns, in order.
fn others(req: &Request<Body>) -> Vec<(String, HeaderValue)> {
    req.headers()
        .iter()
        .filter(|(n, _)| {
            !matches!(
                n.as_str(),
                "grpc-timeout" | "grpc-previous-rpc-attempts" | "x-already-tried"
            )
        })
        .map(|(n, v)| (n.to_string(), v.clone()))
        .collect()
}

async fn scenario(
    name: &str,
    policy: RetryPolicy,
    headers: &[&'static str],
    expect_deadline: Option<Duration>,
    hang_first: bool,
) {
    let (mut svc, mut handle, _) = setup(policy, budget());
    let mut req = request();
    for h in headers {
        req.headers_mut()
            .append("grpc-timeout", HeaderValue::from_static(h));
    }
    req.headers_mut()
        .append("x-custom", HeaderValue::from_static("a"));
    req.headers_mut()
        .append("x-custom", HeaderValue::from_static("b"));
    req.extensions_mut().insert(Ext(7));
    let start = Instant::now();
    let call = spawn_call(&mut svc, req).await;
    let mut first_others = None;
    for n in 0..3 {
        let (req, send, at) = next(&mut handle).await;
        let t = grpc_timeouts(&req);
        let o = others(&req);
        assert_eq!(
            req.extensions().get::<Ext>(),
            Some(&Ext(7)),
            "{name} attempt {n}"
        );
        match &first_others {
            None => first_others = Some(o),
            Some(f) => assert_eq!(f, &o, "{name} attempt {n}: other headers changed"),
        }
        if n > 0 {
            match expect_deadline {
                Some(d) => {
                    assert_eq!(t.len(), 1, "{name} attempt {n}: {t:?}");
                    let left = parse_timeout(t[0].to_str().unwrap());
                    let real = (start + d).saturating_duration_since(at);
                    assert!(left >= real, "{name} attempt {n}: {left:?} < {real:?}");
                    let slack = if left > Duration::from_secs(1_000_000) {
                        Duration::from_secs(3600)
                    } else {
                        Duration::from_millis(1)
                    };
                    assert!(
                        left <= real + slack,
                        "{name} attempt {n}: {left:?} vs {real:?}"
                    );
                }
                None => {
                    let sent: Vec<_> = headers
                        .iter()
                        .map(|h| HeaderValue::from_static(h))
                        .collect();
                    assert_eq!(t, sent, "{name} attempt {n}");
                }
            }
        }
        if n == 0 && hang_first {
            // Never answered: the per-attempt timeout cuts it.
            std::mem::forget(send);
            continue;
        }
        tokio::time::sleep(50 * MS).await;
        if n < 2 {
            send.send_response(status(Code::Unavailable));
        } else {
            send.send_response(ok());
        }
    }
    let r = call.await.unwrap().unwrap();
    assert_eq!(code_of(&r), Code::Ok, "{name}");
}

/// A name, a policy, the caller's `grpc-timeout` headers, the call's timeout
/// if it has a deadline, and whether the first attempt hangs until its own
/// timeout cuts it.
type Scenario = (
    &'static str,
    RetryPolicy,
    &'static [&'static str],
    Option<Duration>,
    bool,
);

#[tokio::test(start_paused = true)]
async fn every_retry_says_one_time_left() {
    let s = Duration::from_secs;
    let d = RetryPolicy::default;
    let scenarios: [Scenario; 16] = [
        ("caller", d(), &["2S"], Some(s(2)), false),
        ("caller x2", d(), &["2S", "9S"], Some(s(2)), false),
        (
            "caller bad then good, no policy",
            d(),
            &["2x", "2S"],
            None,
            false,
        ),
        (
            "caller bad then good + total",
            d().with_total_timeout(s(3)),
            &["2x", "2S"],
            Some(s(3)),
            false,
        ),
        (
            "caller + max",
            d().with_max_timeout(s(1)),
            &["2S"],
            Some(s(1)),
            false,
        ),
        (
            "caller + bigger max",
            d().with_max_timeout(s(5)),
            &["2S"],
            Some(s(2)),
            false,
        ),
        (
            "caller + total",
            d().with_total_timeout(s(1)),
            &["2S"],
            Some(s(2)),
            false,
        ),
        (
            "bad caller + total",
            d().with_total_timeout(s(1)),
            &["12x"],
            Some(s(1)),
            false,
        ),
        (
            "bad caller + max",
            d().with_max_timeout(s(1)),
            &["12x"],
            Some(s(1)),
            false,
        ),
        ("bad caller", d(), &["12x"], None, false),
        (
            "bad caller + overflowing total",
            d().with_total_timeout(Duration::MAX),
            &["12x"],
            None,
            false,
        ),
        (
            "huge caller",
            d(),
            &["99999999H"],
            Some(s(99_999_999 * 3600)),
            false,
        ),
        (
            "caller + attempt timeout",
            d().with_attempt_timeout(300 * MS),
            &["2S"],
            Some(s(2)),
            true,
        ),
        (
            "caller + attempt timeout, no hang",
            d().with_attempt_timeout(300 * MS),
            &["2S", "1H"],
            Some(s(2)),
            false,
        ),
        (
            "no caller + total",
            d().with_total_timeout(s(1)),
            &[],
            Some(s(1)),
            false,
        ),
        ("no caller", d(), &[], None, false),
    ];
    for (name, policy, headers, deadline, hang_first) in scenarios {
        scenario(name, policy, headers, deadline, hang_first).await;
    }
}

#[tokio::test(start_paused = true)]
async fn every_hedge_says_one_time_left() {
    let policy: RetryPolicy = tonic_retry::HedgePolicy::new(3, 100 * MS).unwrap().into();
    let (mut svc, mut handle, _) = setup(policy, budget());
    let mut req = request();
    req.headers_mut()
        .append("grpc-timeout", HeaderValue::from_static("2S"));
    req.headers_mut()
        .append("grpc-timeout", HeaderValue::from_static("9S"));
    let start = Instant::now();
    let call = spawn_call(&mut svc, req).await;
    let mut sends = vec![];
    for n in 0..3 {
        let (req, send, at) = next(&mut handle).await;
        let t = grpc_timeouts(&req);
        assert_eq!(t.len(), 1, "hedge {n}: {t:?}");
        let left = parse_timeout(t[0].to_str().unwrap());
        let real = (start + Duration::from_secs(2)).saturating_duration_since(at);
        assert!(
            left >= real && left <= real + MS,
            "hedge {n}: {left:?} {real:?}"
        );
        sends.push(send);
    }
    sends.pop().unwrap().send_response(ok());
    assert_eq!(code_of(&call.await.unwrap().unwrap()), Code::Ok);
}
