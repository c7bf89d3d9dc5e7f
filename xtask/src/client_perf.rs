//! Runs `lapin_perf` (`crates/node/examples/lapin_perf.rs`, a PerfTest-like
//! load on lapin, a standard client) for the benches' lapin rows, and reads
//! its result line.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::Context;

/// 16 B transient messages, no confirms, auto-ack: `lapin_perf`'s flags.
pub(crate) const TRANSIENT: [&str; 3] = ["--size", "16", "--auto-ack"];

/// 1 KiB persistent messages, 100 confirms in flight per producer, manual
/// acks with prefetch 200: `lapin_perf`'s flags.
pub(crate) const PERSISTENT: [&str; 7] = [
    "--size",
    "1024",
    "--persistent",
    "--confirms",
    "100",
    "--prefetch",
    "200",
];

/// What one `lapin_perf` run reported.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct LapinResult {
    /// Messages published per second.
    pub(crate) published: f64,
    /// Publishes confirmed per second (0 without confirms).
    pub(crate) confirmed: f64,
    /// Messages consumed per second.
    pub(crate) consumed: f64,
    /// Publish to delivery, p50 and p99 (ms; NaN when nothing was consumed).
    pub(crate) e2e_ms: [f64; 2],
    /// Publish to confirm, p50 and p99 (ms; NaN without confirms).
    pub(crate) confirm_ms: [f64; 2],
    /// Messages consumed over the run.
    pub(crate) consumed_total: f64,
    /// Messages published but not consumed when the run ended.
    pub(crate) backlog: f64,
}

impl LapinResult {
    /// Parses `lapin_perf`'s `result secs=… published=… …` line out of its
    /// output.
    pub(crate) fn parse(text: &str) -> anyhow::Result<Self> {
        let line = text
            .lines()
            .find(|l| l.starts_with("result "))
            .with_context(|| format!("no result line in lapin_perf's output: {text}"))?;
        let field = |key: &str| crate::bench::result_field(line, key);
        Ok(Self {
            published: field("published")?,
            confirmed: field("confirmed")?,
            consumed: field("consumed")?,
            e2e_ms: [field("e2e_p50_ms")?, field("e2e_p99_ms")?],
            confirm_ms: [field("confirm_p50_ms")?, field("confirm_p99_ms")?],
            consumed_total: field("consumed_total")?,
            backlog: field("backlog")?,
        })
    }
}

/// Runs the release `lapin_perf` with `args` for `duration` seconds (killed
/// if it has not finished a minute after) and returns what it reported.
pub(crate) fn run(root: &Path, args: &[&str], duration: u64) -> anyhow::Result<LapinResult> {
    let bin = crate::bench::target_dir(root).join("release/examples/lapin_perf");
    let mut cmd = Command::new(bin);
    cmd.args(args).args(["--duration", &duration.to_string()]);
    let limit = Duration::from_secs(duration + 60);
    let text = crate::bench_mirrored::output_within(&mut cmd, "lapin_perf", limit)?;
    LapinResult::parse(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_result_line() {
        let text = "warming up\nresult secs=3.0 published=1200 confirmed=0 consumed=1100 e2e_p50_ms=0.41 e2e_p99_ms=2.50 confirm_p50_ms=NaN confirm_p99_ms=NaN consumed_total=3300 backlog=300\n";
        let r = LapinResult::parse(text).expect("parses");
        assert_eq!(r.published, 1200.0);
        assert_eq!(r.consumed, 1100.0);
        assert_eq!(r.e2e_ms, [0.41, 2.5]);
        assert!(r.confirm_ms[0].is_nan());
        assert_eq!((r.consumed_total, r.backlog), (3300.0, 300.0));
        // `consumed_total` is not taken for `consumed`, nor the reverse.
        assert!(LapinResult::parse("result published=1 consumed_total=2").is_err());
    }
}
