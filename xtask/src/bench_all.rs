//! `cargo xtask bench all [--quick]`: every bench in sequence — transports,
//! GM ring, backing queue, AMQP against RabbitMQ, mirrored queues on 3 and 5
//! nodes — collected into `docs/bench/report.md` with a chart of throughput
//! by transport and by cluster size (`docs/bench/throughput.svg`).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::bench_report::{Bars, Report, Section};
use crate::{amqp_bench, bench, bench_mirrored, bench_report};

/// The benches `bench all` runs, for the progress lines.
const STAGES: usize = 6;

/// Runs the benches one after the other, each timed, keeping its table (or
/// its error) in a [`Section`] and its numbers, when it succeeded.
struct Runner {
    started: Instant,
    stage: usize,
    sections: Vec<Section>,
}

impl Runner {
    fn stage<T>(
        &mut self,
        title: &str,
        command: String,
        run: impl FnOnce() -> anyhow::Result<(String, T)>,
    ) -> Option<T> {
        self.stage += 1;
        let k = self.stage;
        println!(
            "\n==> [{k}/{STAGES}] {title}: `{command}` ({:.0} s into the run)",
            self.started.elapsed().as_secs_f64()
        );
        let t0 = Instant::now();
        let (body, value) = match run() {
            Ok((body, value)) => (body, Some(value)),
            Err(e) => {
                println!("    {title} failed: {e:#}");
                (format!("Failed: {e:#}\n"), None)
            }
        };
        let elapsed = t0.elapsed();
        println!(
            "<== [{k}/{STAGES}] {title} took {:.0} s ({:.0} s into the run)",
            elapsed.as_secs_f64(),
            self.started.elapsed().as_secs_f64()
        );
        self.sections.push(Section {
            title: title.to_owned(),
            command,
            elapsed,
            body,
        });
        value
    }
}

/// Runs `bench mirrored` with `args` as one stage.
fn mirrored_stage(
    runner: &mut Runner,
    root: &Path,
    title: &str,
    args: &[&str],
) -> Option<bench_mirrored::Mirrored> {
    let command = format!("cargo xtask bench mirrored {}", args.join(" "));
    runner.stage(title, command.trim_end().to_owned(), || {
        let m = bench_mirrored::measure(root, &bench_mirrored::Options::parse(args)?)?;
        Ok((m.report.clone(), m))
    })
}

/// `bench all [--quick]`.
pub(crate) fn run(root: &Path, rest: &[&str]) -> anyhow::Result<()> {
    let quick = rest.contains(&"--quick");
    let q = if quick { " --quick" } else { "" };
    let load_before = load_average();
    let date = shell("date", &["-u", "+%Y-%m-%d %H:%M UTC"]);
    let mut runner = Runner {
        started: Instant::now(),
        stage: 0,
        sections: Vec::new(),
    };
    let transports = runner.stage(
        "Transports",
        format!("cargo xtask bench transports{q}"),
        || {
            let t = bench::transports(root, quick)?;
            Ok((t.table.clone(), t))
        },
    );
    let gm = runner.stage("GM ring", format!("cargo xtask bench gm{q}"), || {
        let g = bench::gm(quick)?;
        Ok((g.table.clone(), g))
    });
    runner.stage(
        "Backing queue",
        "cargo xtask bench backing-queue".to_owned(),
        || Ok((bench::backing_queue(root)?, ())),
    );
    let duration = if quick { "3" } else { "10" };
    let amqp = runner.stage(
        "AMQP, one node, Warren and RabbitMQ",
        format!("cargo xtask bench amqp --duration {duration}"),
        || {
            let rows = amqp_bench::measure(root, duration)?;
            Ok((amqp_bench::table(&rows)?, rows))
        },
    );
    let (three, five): (&[&str], &[&str]) = if quick {
        (
            &["--duration", "3", "--no-stalls"],
            &[
                "--nodes",
                "5",
                "--transports",
                "tcp",
                "--duration",
                "3",
                "--no-stalls",
            ],
        )
    } else {
        (&[], &["--nodes", "5"])
    };
    let mirrored3 = mirrored_stage(
        &mut runner,
        root,
        "Mirrored queues, 3 nodes, Warren and RabbitMQ",
        three,
    );
    let mirrored5 = mirrored_stage(
        &mut runner,
        root,
        "Mirrored queues, 5 nodes, Warren and RabbitMQ",
        five,
    );

    let mut charts = Vec::new();
    if let Some(t) = &transports {
        charts.push(transport_chart(t));
    }
    charts.push(mirrored_chart(mirrored3.as_ref()));
    for w in 0..bench_mirrored::WORKLOADS.len() {
        charts.push(cluster_chart(
            w,
            amqp.as_deref(),
            &[(3, mirrored3.as_ref()), (5, mirrored5.as_ref())],
        ));
    }
    if let Some(g) = &gm {
        charts.push(gm_chart(g));
    }
    let total = runner.started.elapsed();
    let report = Report {
        command: format!("cargo xtask bench all{q}"),
        date,
        machine: machine(),
        notes: notes(quick, &load_before, total),
        sections: runner.sections,
        charts,
    };
    let dir = root.join("docs/bench");
    bench_report::write(&dir, &report)?;
    println!(
        "\n==> all benches done in {:.0} s: {} and {}",
        total.as_secs_f64(),
        dir.join("report.md").display(),
        dir.join(bench_report::CHART).display()
    );
    Ok(())
}

/// The transports bench's frames/s at 64 B and 1 KiB, by transport.
fn transport_chart(t: &bench::Transports) -> Bars {
    let series = [(64, "64 B frames"), (1024, "1 KiB frames")]
        .into_iter()
        .map(|(size, name)| {
            let values = bench::KINDS
                .iter()
                .map(|k| t.rate.get(&(*k, size)).copied())
                .collect();
            (name.to_owned(), values)
        })
        .collect();
    Bars {
        title: "Transports: frames/s over one connection, by transport".to_owned(),
        unit: "frames/s".to_owned(),
        groups: ["in-memory", "TCP", "TCP+TLS", "QUIC"]
            .map(str::to_owned)
            .to_vec(),
        series,
    }
}

/// Short names of [`bench_mirrored::WORKLOADS`], for the charts.
const WORKLOAD_NAMES: [&str; 2] = ["1 KiB persistent, confirms", "16 B transient, auto-ack"];

/// The index in [`amqp_bench::WORKLOADS`] of the same load as mirrored workload `w`.
fn amqp_workload(w: usize) -> &'static str {
    amqp_bench::WORKLOADS[amqp_bench::WORKLOADS.len() - 1 - w].0
}

/// The 3-node mirrored bench's consumed msg/s, by Warren's cluster transport
/// and RabbitMQ.
fn mirrored_chart(m: Option<&bench_mirrored::Mirrored>) -> Bars {
    let series = [
        ("Warren TCP", "Warren TCP"),
        ("Warren QUIC", "Warren QUIC"),
        ("RabbitMQ", "RabbitMQ"),
    ]
    .into_iter()
    .map(|(name, broker)| {
        let values = (0..WORKLOAD_NAMES.len())
            .map(|w| m.and_then(|m| m.consumed(broker, w)))
            .collect();
        (name.to_owned(), values)
    })
    .collect();
    Bars {
        title: "Mirrored queue, 3 nodes: consumed msg/s by cluster transport".to_owned(),
        unit: "msg/s".to_owned(),
        groups: WORKLOAD_NAMES.map(str::to_owned).to_vec(),
        series,
    }
}

/// Consumed msg/s of mirrored workload `w` by cluster size: one node from
/// the AMQP bench, then each mirrored run (Warren over TCP).
fn cluster_chart(
    w: usize,
    amqp: Option<&[amqp_bench::AmqpRow]>,
    mirrored: &[(u16, Option<&bench_mirrored::Mirrored>)],
) -> Bars {
    let mut groups = vec!["1 node".to_owned()];
    groups.extend(mirrored.iter().map(|(n, _)| format!("{n} nodes")));
    let series = [
        ("Warren", "warren", "Warren TCP"),
        ("RabbitMQ", "rabbitmq", "RabbitMQ"),
    ]
    .into_iter()
    .map(|(name, one, many)| {
        let mut values =
            vec![amqp.and_then(|rows| amqp_bench::consumed(rows, one, amqp_workload(w)))];
        values.extend(
            mirrored
                .iter()
                .map(|(_, m)| m.and_then(|m| m.consumed(many, w))),
        );
        (name.to_owned(), values)
    })
    .collect();
    Bars {
        title: format!("{}: consumed msg/s by cluster size", WORKLOAD_NAMES[w]),
        unit: "msg/s".to_owned(),
        groups,
        series,
    }
}

/// The GM ring's confirmed broadcasts/s at 64 B, by ring size and transport.
fn gm_chart(g: &bench::Gm) -> Bars {
    let members = [1, 3, 5];
    let mut kinds: Vec<&str> = g.rate.keys().map(|(k, ..)| k.as_str()).collect();
    kinds.dedup();
    let series = kinds
        .into_iter()
        .map(|kind| {
            let values = members
                .iter()
                .map(|&m| g.rate.get(&(kind.to_owned(), m, "64B".to_owned())).copied())
                .collect();
            (format!("GM {kind}"), values)
        })
        .collect();
    Bars {
        title: "GM ring, 64 B: confirmed broadcasts/s by ring size".to_owned(),
        unit: "msg/s".to_owned(),
        groups: members
            .iter()
            .map(|&m| format!("{m} member{}", if m == 1 { "" } else { "s" }))
            .collect(),
        series,
    }
}

/// A command's trimmed stdout, or "?" when it cannot run.
fn shell(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|_| "?".to_owned())
}

/// The 1, 5 and 15 minute load averages.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".to_owned())
}

/// CPUs, memory, kernel and toolchain of this machine.
fn machine() -> Vec<(String, String)> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
        .unwrap_or_else(|| "?".to_owned());
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        })
        .map_or_else(
            || "?".to_owned(),
            |kib| format!("{:.1} GiB", kib / 1024.0 / 1024.0),
        );
    [
        (
            "CPUs (`nproc`)",
            format!("{} × {model}", shell("nproc", &[])),
        ),
        ("memory", memory),
        ("kernel", shell("uname", &["-srm"])),
        ("rustc", shell("rustc", &["--version"])),
    ]
    .map(|(k, v)| (k.to_owned(), v))
    .to_vec()
}

/// What a reader must know before comparing the numbers.
fn notes(quick: bool, load_before: &str, total: Duration) -> Vec<String> {
    let mut notes = vec![
        format!(
            "The benches ran one after the other ({:.0} min in all) on {} CPU cores **shared with other engineers' builds and tests** (load average {load_before} at the start, {} at the end): absolute numbers are noisy; compare within a table or a chart, not across runs.",
            total.as_secs_f64() / 60.0,
            shell("nproc", &[]),
            load_average()
        ),
        "Every broker, load generator and cluster node ran on this one machine over loopback, so a 3- or 5-node cluster shares the same cores as a single node. A bench's time includes the cargo builds it started.".to_owned(),
        "Cluster size: 1 node is `bench amqp` (Warren and RabbitMQ alone, queues not mirrored); 3 and 5 nodes are `bench mirrored` (policy ha-mode all: every node holds a mirror; Warren's cluster links over TCP).".to_owned(),
    ];
    if quick {
        notes.push("`--quick`: criterion's quick mode and the GM bench's short mode, 3 s load generator runs, no failover-stall measurements and a 5-node run of Warren over TCP only. Indicative numbers; `cargo xtask bench all` runs the full set.".to_owned());
    }
    notes
}
