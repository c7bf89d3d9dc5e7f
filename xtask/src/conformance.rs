//! `cargo xtask conformance --record`: runs the queue-feature scenarios
//! (`crates/node/tests/conformance/scenarios.py`, pika) against a 3-node
//! RabbitMQ cluster (Debian's `rabbitmq-server`) with the scenarios'
//! policies, and stores RabbitMQ's outcomes next to them
//! (`rabbitmq-3.10.json`). `crates/node/tests/conformance.rs` runs the same
//! scenarios against Warren in CI and compares.

use std::io::{BufRead as _, BufReader, Write as _};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};

use crate::bench_mirrored::{
    RabbitNode, epmd_pids, eventually, rabbit_cluster, rabbit_synced_or, stop_new_epmd,
};
use crate::client_perf::JAVA_CLASSPATH;

/// The scenario library and its recorded outcomes, under the workspace root.
const DIR: &str = "crates/node/tests/conformance";

/// What `scenarios.py FLAG` prints (`--policies`, `--settings`), as JSON.
fn scenarios_json(script: &Path, flag: &str) -> anyhow::Result<serde_json::Value> {
    let out = Command::new("python3")
        .arg(script)
        .arg(flag)
        .output()
        .context("running python3")?;
    serde_json::from_slice(&out.stdout).with_context(|| format!("reading scenarios.py {flag}"))
}

/// Runs `conformance --record [--only SCENARIO[,SCENARIO…]]` or
/// `conformance --record-java|--record-bunny|--record-php`.
pub(crate) fn main(root: &Path, args: &[&str]) -> anyhow::Result<()> {
    match args {
        ["--record-java"] => return record_transcript(root, Scripted::Java),
        ["--record-bunny"] => return record_transcript(root, Scripted::Bunny),
        ["--record-php"] => return record_transcript(root, Scripted::Php),
        _ => {}
    }
    if args.first() != Some(&"--record") {
        bail!(
            "usage: cargo xtask conformance --record [--only SCENARIO[,SCENARIO…]]\n\
             \x20      cargo xtask conformance --record-java|--record-bunny|--record-php\n\
             (the Warren side runs in CI: cargo nextest run -p warren-node --test conformance --test java --test scripted)"
        );
    }
    let only: Vec<&str> = match args {
        [_, "--only", s] => vec!["--only", s],
        _ => Vec::new(),
    };
    let script = root.join(DIR).join("scenarios.py");
    let work = crate::bench::target_dir(root).join("conformance");
    let settings = scenarios_json(&script, "--settings")?;
    crate::bench_mirrored::set_rabbit_settings(
        settings
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| format!("{k} = {v}\n"))
            .collect(),
    );
    let epmd_before = epmd_pids();
    let result = (|| -> anyhow::Result<String> {
        println!("==> RabbitMQ: starting 3 nodes ({})", work.display());
        let mut nodes = rabbit_cluster(&work, 3)?
            .context("rabbitmq-server is not installed (apt-get install rabbitmq-server)")?;
        let policies = scenarios_json(&script, "--policies")?;
        for (name, p) in policies.as_object().into_iter().flatten() {
            nodes[0].ctl(&[
                "set_policy",
                "--apply-to",
                "queues",
                "--priority",
                &p["priority"].to_string(),
                name,
                p["pattern"].as_str().unwrap_or_default(),
                &p["definition"].to_string(),
            ])?;
        }
        let urls: Vec<String> = nodes.iter().map(|n| n.url()).collect();
        println!("==> running the scenarios (progress on stderr)");
        let mut child = Command::new("python3")
            .arg(&script)
            .args(["--urls", &urls.join(","), "--failover"])
            .args(&only)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("running the scenarios")?;
        let mut answer = child.stdin.take().context("the scenarios' stdin")?;
        let mut json = String::new();
        for line in BufReader::new(child.stdout.take().context("the scenarios' stdout")?).lines() {
            let line = line?;
            match line.strip_prefix("FAILOVER ") {
                Some(queue) => {
                    fail_over(&mut nodes, queue)?;
                    writeln!(answer, "ok")?;
                }
                None => {
                    json.push_str(&line);
                    json.push('\n');
                }
            }
        }
        if !child.wait()?.success() {
            bail!("the scenarios failed");
        }
        Ok(json)
    })();
    stop_new_epmd(&epmd_before);
    let outcomes = result?;
    let file = root.join(DIR).join("rabbitmq-3.10.json");
    let merged = if only.is_empty() {
        outcomes
    } else {
        // Some scenarios re-recorded: merged into the others' outcomes.
        let mut all: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(&file).unwrap_or_default())
                .unwrap_or_default();
        let new: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&outcomes)?;
        all.extend(new);
        // The script's layout (Python's `indent=1`), so a re-recorded
        // scenario changes only its own lines.
        let mut buf = Vec::new();
        let fmt = serde_json::ser::PrettyFormatter::with_indent(b" ");
        serde::Serialize::serialize(
            &all,
            &mut serde_json::Serializer::with_formatter(&mut buf, fmt),
        )?;
        buf.push(b'\n');
        String::from_utf8(buf)?
    };
    std::fs::write(&file, merged)?;
    println!("==> RabbitMQ's outcomes written to {}", file.display());
    Ok(())
}

/// A standard client whose scenarios print a transcript, recorded from
/// RabbitMQ (`conformance --record-java`, `--record-bunny`,
/// `--record-php`) and compared with Warren's in CI
/// (`crates/node/tests/java.rs`, `scripted.rs`).
#[derive(Clone, Copy)]
enum Scripted {
    /// RabbitMQ's own Java client (`crates/node/tests/java`).
    Java,
    /// Bunny, Ruby (`crates/node/tests/bunny`).
    Bunny,
    /// php-amqplib, PHP (`crates/node/tests/php`).
    Php,
}

impl Scripted {
    /// The scenarios and their transcript, under the workspace root.
    fn dir(self) -> &'static str {
        match self {
            Self::Java => "crates/node/tests/java",
            Self::Bunny => "crates/node/tests/bunny",
            Self::Php => "crates/node/tests/php",
        }
    }

    /// The prefix of the queues its scenarios name (mirrored on all nodes).
    fn prefix(self) -> &'static str {
        match self {
            Self::Java => "java-",
            Self::Bunny => "rb-",
            Self::Php => "php-",
        }
    }

    /// The command that runs the scenarios against `url`, the management
    /// API at `api` (compiled first, for Java).
    fn command(self, root: &Path, url: &str, api: &str) -> anyhow::Result<Command> {
        let script = |name: &str| root.join(self.dir()).join(name);
        Ok(match self {
            Self::Java => {
                let classes = crate::bench::target_dir(root).join("java-scenarios");
                std::fs::create_dir_all(&classes)?;
                let compiled = Command::new("javac")
                    .arg("-d")
                    .arg(&classes)
                    .args(["-cp", JAVA_CLASSPATH])
                    .arg(script("Scenarios.java"))
                    .status()
                    .context(
                        "javac (apt-get install default-jdk-headless librabbitmq-client-java)",
                    )?;
                if !compiled.success() {
                    bail!("javac failed");
                }
                let mut c = Command::new("java");
                c.arg("-cp")
                    .arg(format!("{}:{JAVA_CLASSPATH}", classes.display()))
                    .args(["Scenarios", url, api]);
                c
            }
            Self::Bunny => {
                let mut c = Command::new("ruby");
                c.arg(script("scenarios.rb")).arg(url);
                c
            }
            Self::Php => {
                let mut c = Command::new("php");
                c.arg(script("scenarios.php")).arg(url);
                c
            }
        })
    }
}

/// `conformance --record-java|--record-bunny|--record-php`: the client's
/// scenarios against node 2 of a 3-node RabbitMQ cluster whose queues of
/// the scenarios are mirrored on all nodes (their masters on node 2, the
/// client's), the transcript stored as `rabbitmq-3.10.txt` beside them.
fn record_transcript(root: &Path, client: Scripted) -> anyhow::Result<()> {
    crate::bench_mirrored::rabbit_with_management();
    let work = crate::bench::target_dir(root).join("conformance-clients");
    let epmd_before = epmd_pids();
    let result = (|| -> anyhow::Result<Vec<u8>> {
        println!("==> RabbitMQ: starting 3 nodes ({})", work.display());
        let nodes = rabbit_cluster(&work, 3)?
            .context("rabbitmq-server is not installed (apt-get install rabbitmq-server)")?;
        nodes[0].ctl(&[
            "set_policy",
            "--apply-to",
            "queues",
            "scenarios-all",
            &format!("^{}", client.prefix()),
            r#"{"ha-mode":"all","ha-sync-mode":"automatic"}"#,
        ])?;
        let api = format!(
            "http://127.0.0.1:{}",
            crate::bench_mirrored::RABBIT_MANAGEMENT + 2
        );
        println!("==> the scenarios on rabbit2 ({api})");
        let out = client
            .command(root, &nodes[1].url(), &api)?
            .stderr(Stdio::inherit())
            .output()
            .context("running the scenarios")?;
        if !out.status.success() {
            bail!("the scenarios failed");
        }
        Ok(out.stdout)
    })();
    stop_new_epmd(&epmd_before);
    let transcript = result?;
    let file = root.join(client.dir()).join("rabbitmq-3.10.txt");
    std::fs::write(&file, transcript)?;
    println!("==> RabbitMQ's transcript written to {}", file.display());
    Ok(())
}

/// The failover placement's step (see `scenarios.py`): once `queue` has its
/// two synchronised mirrors, kills node 1 (its master) abruptly, waits for a
/// mirror to take over and starts node 1 again.
fn fail_over(nodes: &mut [RabbitNode], queue: &str) -> anyhow::Result<()> {
    println!("    failover of {queue}: killing rabbit1");
    // Synchronised first, unless it is gone (an x-expires queue may expire).
    rabbit_synced_or(&nodes[0], queue, 2, true)?;
    nodes[0].crash()?;
    eventually(
        &format!("a mirror of {queue} to take over"),
        Duration::from_secs(60),
        || {
            let out = nodes[1].ctl(&["list_queues", "-q", "--no-table-headers", "name", "pid"])?;
            // Taken over, or gone (an x-expires queue may expire meanwhile).
            let mut pids = out.lines().filter_map(|l| {
                let mut f = l.split_whitespace();
                (f.next() == Some(queue)).then(|| f.next().unwrap_or_default().to_owned())
            });
            Ok(match pids.next() {
                Some(pid) => !pid.contains("rabbit1@"),
                None => true,
            })
        },
    )?;
    nodes[0].restart(1)?;
    Ok(())
}
