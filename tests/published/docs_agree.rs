//! The README carries two tables the crate docs carry too (what is retried,
//! and a policy's defaults), for readers who never open docs.rs: each is
//! written once in the docs and copied into the README, and this checks the
//! copies still match, row for row.

const README: &str = include_str!("../../README.md");
const LIB: &str = include_str!("../../src/lib.rs");
const POLICY: &str = include_str!("../../src/policy.rs");

/// The table rows of `text` after the line `after`, each with `prefix`
/// (a doc comment's) taken off: the first run of lines that are table rows.
fn table(text: &str, after: &str, prefix: &str) -> Vec<String> {
    let mut lines = text.lines().skip_while(|line| line.trim_end() != after);
    assert!(lines.next().is_some(), "no line {after:?}");
    lines
        .map(|line| line.strip_prefix(prefix).unwrap_or(""))
        .skip_while(|line| !line.starts_with('|'))
        .take_while(|line| line.starts_with('|'))
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_readmes_table_of_what_is_retried_is_the_crate_docs() {
    let docs = table(LIB, "//! # What is retried", "//! ");
    assert!(docs.len() > 5, "{docs:#?}");
    assert_eq!(table(README, "## What is retried", ""), docs);
}

#[test]
fn the_readmes_table_of_defaults_is_the_policys() {
    // `RetryPolicy`'s docs have the crate's one table of this header.
    assert_eq!(POLICY.matches("/// | setting | default |").count(), 1);
    let docs = table(POLICY, "/// is valid.", "/// ");
    assert!(docs.len() > 5, "{docs:#?}");
    assert_eq!(table(README, "## Defaults", ""), docs);
}
