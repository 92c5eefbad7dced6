//! Hedged calls: when hedges go out, which attempt wins, what the losers'
//! bodies and streams do, and hedging over real tonic servers.

#[path = "../support/mod.rs"]
mod support;

mod bodies;
mod calls;
mod over_tonic;
