//! Retries that do not multiply load: budgets pay for every retry, a layer
//! that gives up marks the failure so the layers above do not retry it, and
//! retrying stays at one layer under attempt timeouts and overload.

#[path = "../support/mod.rs"]
mod support;

mod attempt_timeouts;
mod budget;
mod fleet;
mod give_up_mark;
mod overload;
mod three_hops;
