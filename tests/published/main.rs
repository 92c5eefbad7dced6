//! What the crate ships agrees with its sources: the committed generated code
//! and the tables the README copies from the docs.

#[path = "../support/mod.rs"]
mod support;

mod codegen;
mod docs_agree;
