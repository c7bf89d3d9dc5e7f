//! `cargo xtask bench …`: runs a criterion bench and prints its results as one table.

use std::path::Path;

use anyhow::bail;

/// Runs the named bench group.
pub(crate) fn run(root: &Path, which: &str, rest: &[&str]) -> anyhow::Result<()> {
    let _ = (root, rest);
    bail!("unknown bench `{which}`")
}
