//! Runs the benches' standard-client rows and reads their result line: a
//! PerfTest-like load (each publish and each ack its own call, as
//! applications make them) on lapin (`crates/node/examples/lapin_perf.rs`),
//! on Node.js's amqplib (`benches/amqplib/perf.js`, amqplib installed from
//! npm into `target/bench-amqplib`) or on RabbitMQ's Java client
//! (`benches/java/JavaPerf.java`, Debian's `librabbitmq-client-java`,
//! compiled into `target/bench-java`). All take the same flags and print the
//! same `result …` line.

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

/// [`PERSISTENT`] with no prefetch limit (PerfTest's default): each
/// delivery acked as the consumer gets to it.
pub(crate) const PERSISTENT_UNLIMITED: [&str; 5] =
    ["--size", "1024", "--persistent", "--confirms", "100"];

/// The amqplib release the amqplib rows run on.
const AMQPLIB: &str = "amqplib@2.3.1";

/// RabbitMQ's Java client and the logging API it needs (Debian's paths).
pub(crate) const JAVA_CLASSPATH: &str =
    "/usr/share/java/amqp-client.jar:/usr/share/java/slf4j-api.jar";

/// The standard client library that drives a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PerfClient {
    /// lapin (Rust), `lapin_perf`.
    Lapin,
    /// amqplib (Node.js), `benches/amqplib/perf.js`.
    Amqplib,
    /// RabbitMQ's Java client, `benches/java/JavaPerf.java`.
    Java,
}

impl PerfClient {
    /// The client a row's name starts with (`"amqplib: …"`, `"java: …"`,
    /// else lapin).
    pub(crate) fn of(row: &str) -> Self {
        if row.starts_with("amqplib") {
            Self::Amqplib
        } else if row.starts_with("java") {
            Self::Java
        } else {
            Self::Lapin
        }
    }
}

/// Which clients can run here: why amqplib and the Java client cannot, if
/// they cannot (lapin is built with the benches).
pub(crate) struct Clients {
    amqplib: Result<(), String>,
    java: Result<(), String>,
}

impl Clients {
    /// Installs amqplib from npm and compiles the Java load, once each.
    pub(crate) fn prepare(root: &Path) -> Self {
        Self {
            amqplib: prepare_amqplib(root),
            java: prepare_java(root),
        }
    }

    /// Why `client`'s rows cannot run here, for the bench to say and skip
    /// them; `None` if they can.
    pub(crate) fn why_not(&self, client: PerfClient) -> Option<&str> {
        match client {
            PerfClient::Lapin => None,
            PerfClient::Amqplib => self.amqplib.as_ref().err().map(String::as_str),
            PerfClient::Java => self.java.as_ref().err().map(String::as_str),
        }
    }
}

/// What one client run reported.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct PerfResult {
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

impl PerfResult {
    /// Parses the `result secs=… published=… …` line out of a client's
    /// output.
    pub(crate) fn parse(text: &str) -> anyhow::Result<Self> {
        let line = text
            .lines()
            .find(|l| l.starts_with("result "))
            .with_context(|| format!("no result line in the client's output: {text}"))?;
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

/// Runs `client`'s load (lapin: the release `lapin_perf`) with `args` for
/// `duration` seconds (killed if it has not finished a minute after) and
/// returns what it reported.
pub(crate) fn run(
    root: &Path,
    client: PerfClient,
    args: &[&str],
    duration: u64,
) -> anyhow::Result<PerfResult> {
    let mut cmd = match client {
        PerfClient::Lapin => {
            Command::new(crate::bench::target_dir(root).join("release/examples/lapin_perf"))
        }
        PerfClient::Amqplib => {
            let mut cmd = Command::new("node");
            cmd.arg(root.join("benches/amqplib/perf.js"))
                .env("NODE_PATH", amqplib_dir(root).join("node_modules"));
            cmd
        }
        PerfClient::Java => {
            let mut cmd = Command::new("java");
            cmd.arg("-cp")
                .arg(format!("{}:{JAVA_CLASSPATH}", java_dir(root).display()))
                .arg("JavaPerf");
            cmd
        }
    };
    cmd.args(args).args(["--duration", &duration.to_string()]);
    let limit = Duration::from_secs(duration + 60);
    let what = match client {
        PerfClient::Lapin => "lapin_perf",
        PerfClient::Amqplib => "amqplib perf.js",
        PerfClient::Java => "JavaPerf",
    };
    let text = crate::bench_mirrored::output_within(&mut cmd, what, limit)?;
    PerfResult::parse(&text)
}

/// Where amqplib is installed for the benches.
fn amqplib_dir(root: &Path) -> std::path::PathBuf {
    crate::bench::target_dir(root).join("bench-amqplib")
}

/// Where the Java load is compiled for the benches.
fn java_dir(root: &Path) -> std::path::PathBuf {
    crate::bench::target_dir(root).join("bench-java")
}

/// Makes the Java rows runnable: the Java client installed and
/// `JavaPerf.java` compiled (again when it changed). Returns why not.
fn prepare_java(root: &Path) -> Result<(), String> {
    if !Path::new("/usr/share/java/amqp-client.jar").exists() {
        return Err(
            "RabbitMQ's Java client is not installed (apt-get install librabbitmq-client-java)"
                .into(),
        );
    }
    let source = root.join("benches/java/JavaPerf.java");
    let class = java_dir(root).join("JavaPerf.class");
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    if modified(&class).is_some() && modified(&class) >= modified(&source) {
        return Ok(());
    }
    let status = Command::new("javac")
        .arg("-d")
        .arg(java_dir(root))
        .args(["-cp", JAVA_CLASSPATH])
        .arg(&source)
        .status();
    match status {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(format!("javac JavaPerf.java failed ({s})")),
        Err(e) => Err(format!(
            "javac could not run (apt-get install default-jdk-headless): {e}"
        )),
    }
}

/// Makes the amqplib rows runnable: Node.js present and amqplib installed
/// from npm (once). Returns why not, for the bench to say and skip them.
fn prepare_amqplib(root: &Path) -> Result<(), String> {
    let node = Command::new("node").arg("--version").output();
    if !node.is_ok_and(|o| o.status.success()) {
        return Err("node (Node.js 18 or newer) is not installed".into());
    }
    let dir = amqplib_dir(root);
    if dir.join("node_modules/amqplib/package.json").exists() {
        return Ok(());
    }
    println!("==> npm install {AMQPLIB} into {}", dir.display());
    let _ = std::fs::create_dir_all(&dir);
    let status = Command::new("npm")
        .args(["install", "--no-audit", "--no-fund", "--prefix"])
        .arg(&dir)
        .arg(AMQPLIB)
        .status();
    match status {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(format!("npm install {AMQPLIB} failed ({s})")),
        Err(e) => Err(format!("npm could not run: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_result_line() {
        let text = "warming up\nresult secs=3.0 published=1200 confirmed=0 consumed=1100 e2e_p50_ms=0.41 e2e_p99_ms=2.50 confirm_p50_ms=NaN confirm_p99_ms=NaN consumed_total=3300 backlog=300\n";
        let r = PerfResult::parse(text).expect("parses");
        assert_eq!(r.published, 1200.0);
        assert_eq!(r.consumed, 1100.0);
        assert_eq!(r.e2e_ms, [0.41, 2.5]);
        assert!(r.confirm_ms[0].is_nan());
        assert_eq!((r.consumed_total, r.backlog), (3300.0, 300.0));
        // `consumed_total` is not taken for `consumed`, nor the reverse.
        assert!(PerfResult::parse("result published=1 consumed_total=2").is_err());
    }

    #[test]
    fn every_client_row_names_its_client_first() {
        let names = crate::amqp_bench::CLIENT_WORKLOADS
            .iter()
            .map(|(n, _)| *n)
            .chain(
                crate::bench_mirrored::CLIENT_WORKLOADS
                    .iter()
                    .map(|w| w.name),
            );
        for name in names {
            let client = PerfClient::of(name);
            let prefix = match client {
                PerfClient::Lapin => "lapin: ",
                PerfClient::Amqplib => "amqplib: ",
                PerfClient::Java => "java: ",
            };
            assert!(name.starts_with(prefix), "{name}");
        }
        assert_eq!(PerfClient::of("amqplib: x"), PerfClient::Amqplib);
        assert_eq!(PerfClient::of("java: x"), PerfClient::Java);
    }
}
