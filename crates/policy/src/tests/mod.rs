//! Table-driven tests and proptests for the whole crate.

mod locator;
mod matching;
mod placement;
mod props;
mod validation;

/// Owned node names from string literals.
fn nodes(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| (*n).to_owned()).collect()
}
