//! `cargo xtask`: the one entry point for Warren's developer tasks.
//!
//! - `cargo xtask test` — what CI runs: fmt check, check-arch, clippy, cargo-deny, nextest
//!   (and the single-node suites again on nodes of two shards).
//! - `cargo xtask check-arch` — ARCHITECTURE.md's dependency rules, checked (`check_arch`).
//! - `cargo xtask bench transports` — the transport bench, printed as one table.
//! - `cargo xtask bench shards` — one node of 1 and 2 shards, in process (`bench_shards`).
//! - `cargo xtask bench all [--quick]` — every bench, into `docs/bench/report.md`.
//! - `cargo xtask cluster up|down` — a local cluster of `warren` processes.
//! - `cargo xtask scenario N|all` — the seed's recovery scenarios (`scenario`).
//! - `cargo xtask chaos [--seed S] [--duration SECS] [--nodes 3|5] [--queues 1-4]` — a seeded fault schedule (`chaos`).
//! - `cargo xtask conformance --record` — RabbitMQ's outcomes of the queue-feature scenarios;
//!   `--record-java`, `--record-bunny`, `--record-php` — what those clients see in their scenarios.
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod amqp_bench;
mod bench;
mod bench_all;
mod bench_mirrored;
mod bench_report;
mod bench_shards;
mod chaos;
mod check_arch;
mod client_perf;
mod cluster;
mod conformance;
mod cpu;
mod node;
mod scenario;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["test", rest @ ..] => test(rest),
        ["check-arch"] => check_arch::main(&workspace_root()),
        ["bench", "mirrored", rest @ ..] => bench_mirrored::mirrored(&workspace_root(), rest),
        ["bench", "many-queues", rest @ ..] => bench_mirrored::many_queues(&workspace_root(), rest),
        ["bench", "shards", rest @ ..] => bench_shards::run(&workspace_root(), rest),
        ["bench", which, rest @ ..] => bench::run(&workspace_root(), which, rest),
        ["cluster", rest @ ..] => cluster::run(&workspace_root(), rest),
        ["scenario", rest @ ..] => scenario::main(&workspace_root(), rest),
        ["chaos", rest @ ..] => chaos::main(&workspace_root(), rest),
        ["conformance", rest @ ..] => conformance::main(&workspace_root(), rest),
        _ => {
            eprintln!("usage: cargo xtask <command>");
            eprintln!();
            eprintln!(
                "  test [--no-deny]          fmt check, check-arch, clippy -D warnings, cargo deny, nextest"
            );
            eprintln!(
                "  check-arch                ARCHITECTURE.md's dependency rules (its arch-rules block)"
            );
            eprintln!("  bench transports [--quick]  transport bench, one table with ratios");
            eprintln!("  bench gm | backing-queue  the GM ring and backing-queue benches");
            eprintln!("  bench amqp [--duration S]  Warren vs RabbitMQ (if installed), same load");
            eprintln!(
                "  bench mirrored | many-queues  3-node mirrored queues (vs RabbitMQ; --rounds N for medians); 1,000 queues"
            );
            eprintln!(
                "  bench shards [--queues K] [--duration S] [--runs R]  1 and 2 shards, in process"
            );
            eprintln!("  bench all [--quick]       every bench: docs/bench/report.md and a chart");
            eprintln!(
                "  cluster up [--nodes N] [--transport tcp|quic]   a local cluster on 127.0.0.1..N"
            );
            eprintln!("  cluster down              stop the cluster started by `cluster up`");
            eprintln!("  scenario 1..6|all         the seed's two-node recovery scenarios");
            eprintln!(
                "  chaos [--seed S] [--duration SECS] [--nodes 3|5] [--queues 1-4]  seeded fault schedule"
            );
            eprintln!(
                "  conformance --record [--only S]  queue-feature scenarios on RabbitMQ: record its outcomes"
            );
            eprintln!(
                "  conformance --record-java|-bunny|-php  a client's scenarios on RabbitMQ: record its transcript"
            );
            bail!("unknown or missing command: {args:?}")
        }
    }
}

/// The workspace root (the parent of this crate's directory).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// Variables `cargo run` (the `cargo xtask` alias) sets for the program it
/// runs: they describe the xtask package and its build, not the user's.
/// A cargo started with them sees a changed environment — build scripts
/// such as ring's rerun when `CARGO_PKG_NAME` or `CARGO_MANIFEST_DIR`
/// change — and rebuilds what a plain `cargo build` had built.
const PACKAGE_VARS: &[&str] = &[
    "CARGO_MANIFEST_DIR",
    "CARGO_MANIFEST_PATH",
    "CARGO_MANIFEST_LINKS",
    "CARGO_CRATE_NAME",
    "CARGO_BIN_NAME",
    "CARGO_PRIMARY_PACKAGE",
    "CARGO_TARGET_TMPDIR",
    "CARGO_RUSTC_CURRENT_DIR",
    "OUT_DIR",
];

/// Prefixes of further such variables (`CARGO_PKG_NAME`, `CARGO_PKG_VERSION`…,
/// `CARGO_BIN_EXE_<name>` in tests).
const PACKAGE_VAR_PREFIXES: &[&str] = &["CARGO_PKG_", "CARGO_BIN_EXE_"];

/// Whether `name` is one of the variables `cargo run` set for the xtask.
fn is_package_var(name: &str) -> bool {
    PACKAGE_VARS.contains(&name) || PACKAGE_VAR_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// A `cargo` command in the workspace root with the xtask's package
/// variables removed, so that it shares its build with a plain `cargo
/// build` run from a shell. Every cargo the xtask starts is made here.
fn cargo() -> Command {
    let mut cmd = Command::new("cargo");
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(is_package_var) {
            cmd.env_remove(name);
        }
    }
    cmd.current_dir(workspace_root());
    cmd
}

/// Runs `cargo args…` as one step, printing it first, failing with its name
/// if it fails.
fn cargo_step(name: &str, args: &[&str]) -> anyhow::Result<()> {
    cargo_step_with(name, args, &[])
}

/// [`cargo_step`] with environment variables `envs` set.
fn cargo_step_with(name: &str, args: &[&str], envs: &[(&str, &str)]) -> anyhow::Result<()> {
    let shown: Vec<String> = envs.iter().map(|(k, v)| format!("{k}={v} ")).collect();
    println!("==> {name}: {}cargo {}", shown.concat(), args.join(" "));
    let status = cargo()
        .args(args)
        .envs(envs.iter().copied())
        .status()
        .with_context(|| format!("could not start cargo for step `{name}`"))?;
    if !status.success() {
        bail!("step `{name}` failed ({status})");
    }
    Ok(())
}

/// The test command: everything CI checks, in the order that fails fastest.
fn test(rest: &[&str]) -> anyhow::Result<()> {
    cargo_step("format", &["fmt", "--all", "--check"])?;
    println!("==> architecture: cargo xtask check-arch");
    check_arch::main(&workspace_root())?;
    cargo_step(
        "clippy",
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
    )?;
    if !rest.contains(&"--no-deny") {
        cargo_step("deny", &["deny", "check", "bans", "licenses", "sources"])?;
    }
    cargo_step(
        "tests",
        &["nextest", "run", "--workspace", "--no-fail-fast"],
    )?;
    // The single-node suites again against nodes of two shards.
    cargo_step_with(
        "tests on two shards",
        &[
            "nextest",
            "run",
            "-p",
            "warren-node",
            "--no-fail-fast",
            "--test",
            "amqp",
            "--test",
            "amqps",
            "--test",
            "http_api",
            "--test",
            "alarms",
            "--test",
            "disk_full",
            "--test",
            "hostile",
        ],
        &[("WARREN_TEST_SHARDS", "2")],
    )?;
    cargo_step("doc tests", &["test", "--workspace", "--doc"])?;
    println!("==> all checks passed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::is_package_var;

    #[test]
    fn package_variables_are_recognised_and_settings_kept() {
        for v in [
            "CARGO_PKG_NAME",
            "CARGO_PKG_VERSION_MAJOR",
            "CARGO_MANIFEST_DIR",
            "CARGO_CRATE_NAME",
            "CARGO_BIN_NAME",
            "CARGO_PRIMARY_PACKAGE",
            "CARGO_BIN_EXE_warren",
            "OUT_DIR",
        ] {
            assert!(is_package_var(v), "{v}");
        }
        // The user's own settings reach the inner cargo unchanged.
        for v in [
            "CARGO",
            "CARGO_HOME",
            "CARGO_TARGET_DIR",
            "CARGO_BUILD_JOBS",
            "CARGO_INCREMENTAL",
            "RUSTFLAGS",
            "PATH",
        ] {
            assert!(!is_package_var(v), "{v}");
        }
    }
}
