//! CPU time and memory of processes, from `/proc`, for the benches' cost
//! columns (CPU per message, per queue).

use std::process::Command;

/// CPU time (user + system, in clock ticks) and resident memory (KiB) of a process.
pub(crate) fn usage(pid: u32) -> anyhow::Result<(u64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Ok((stat_fields(&stat).ticks, rss))
}

/// CPU time (clock ticks) of a process and all its descendants alive now:
/// a broker started through a script (RabbitMQ's `rabbitmq-server` runs
/// the Erlang VM as its child) is counted whole.
pub(crate) fn tree_ticks(root: u32) -> u64 {
    let mut procs = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
                let f = stat_fields(&stat);
                procs.push((pid, f.ppid, f.ticks));
            }
        }
    }
    let mut tree = vec![root];
    let mut total = 0;
    while let Some(pid) = tree.pop() {
        for &(child, parent, ticks) in &procs {
            if child == pid {
                total += ticks;
            }
            if parent == pid {
                tree.push(child);
            }
        }
    }
    total
}

/// Clock ticks per second (`getconf CLK_TCK`, 100 on Linux).
pub(crate) fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// CPU time (clock ticks) of this process's children that it has waited
/// for (`cutime` + `cstime`): the clients a bench ran to completion.
pub(crate) fn children_ticks() -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    Ok(stat_fields(&stat).children_ticks)
}

/// The parent and the CPU ticks from a `/proc/PID/stat` line.
struct StatFields {
    ppid: u32,
    ticks: u64,
    children_ticks: u64,
}

fn stat_fields(stat: &str) -> StatFields {
    // The fields after the command name, which is in parentheses: state,
    // ppid, …; utime and stime are fields 14 and 15 of the line, 12 and 13
    // after the name; cutime and cstime 16 and 17.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, r)| r.split_whitespace().collect())
        .unwrap_or_default();
    let num = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    StatFields {
        ppid: num(1) as u32,
        ticks: num(11) + num(12),
        children_ticks: num(13) + num(14),
    }
}
