//! `cargo xtask`: the one entry point for Warren's developer tasks.
//!
//! - `cargo xtask test` — what CI runs: fmt check, clippy, cargo-deny, nextest.
//! - `cargo xtask bench transports` — the transport bench, printed as one table.
//! - `cargo xtask bench all [--quick]` — every bench, into `docs/bench/report.md`.
//! - `cargo xtask cluster up|down` — a local cluster of `warren` processes.
//! - `cargo xtask scenario N|all` — the seed's recovery scenarios (`scenario`).
//! - `cargo xtask chaos [--seed S] [--duration SECS]` — a seeded fault schedule (`chaos`).
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod amqp_bench;
mod bench;
mod bench_all;
mod bench_mirrored;
mod bench_report;
mod chaos;
mod cluster;
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
        ["bench", "mirrored", rest @ ..] => bench_mirrored::mirrored(&workspace_root(), rest),
        ["bench", "many-queues", rest @ ..] => bench_mirrored::many_queues(&workspace_root(), rest),
        ["bench", which, rest @ ..] => bench::run(&workspace_root(), which, rest),
        ["cluster", rest @ ..] => cluster::run(&workspace_root(), rest),
        ["scenario", rest @ ..] => scenario::main(&workspace_root(), rest),
        ["chaos", rest @ ..] => chaos::main(&workspace_root(), rest),
        _ => {
            eprintln!("usage: cargo xtask <command>");
            eprintln!();
            eprintln!(
                "  test [--no-deny]          fmt check, clippy -D warnings, cargo deny, nextest"
            );
            eprintln!("  bench transports [--quick]  transport bench, one table with ratios");
            eprintln!("  bench gm | backing-queue  the GM ring and backing-queue benches");
            eprintln!("  bench amqp [--duration S]  Warren vs RabbitMQ (if installed), same load");
            eprintln!(
                "  bench mirrored | many-queues  3-node mirrored queues (vs RabbitMQ; --rounds N for medians); 1,000 queues"
            );
            eprintln!("  bench all [--quick]       every bench: docs/bench/report.md and a chart");
            eprintln!(
                "  cluster up [--nodes N] [--transport tcp|quic]   a local cluster on 127.0.0.1..N"
            );
            eprintln!("  cluster down              stop the cluster started by `cluster up`");
            eprintln!("  scenario 1..6|all         the seed's two-node recovery scenarios");
            eprintln!("  chaos [--seed S] [--duration SECS] [--nodes 3|5]  seeded fault schedule");
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

/// Runs one step, printing it first, failing with its name if it fails.
fn step(name: &str, program: &str, args: &[&str]) -> anyhow::Result<()> {
    println!("==> {name}: {program} {}", args.join(" "));
    let status = Command::new(program)
        .args(args)
        .current_dir(workspace_root())
        .status()
        .with_context(|| format!("could not start `{program}` for step `{name}`"))?;
    if !status.success() {
        bail!("step `{name}` failed ({status})");
    }
    Ok(())
}

/// The test command: everything CI checks, in the order that fails fastest.
fn test(rest: &[&str]) -> anyhow::Result<()> {
    step("format", "cargo", &["fmt", "--all", "--check"])?;
    step(
        "clippy",
        "cargo",
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
        step(
            "deny",
            "cargo",
            &["deny", "check", "bans", "licenses", "sources"],
        )?;
    }
    step(
        "tests",
        "cargo",
        &["nextest", "run", "--workspace", "--no-fail-fast"],
    )?;
    step("doc tests", "cargo", &["test", "--workspace", "--doc"])?;
    println!("==> all checks passed");
    Ok(())
}
