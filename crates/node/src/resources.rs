//! Samples this node's memory and disk once a second for the resource
//! alarms ([`warren_broker::Broker::observe_resources`]): the process's
//! resident memory against the machine's, and the free space of the
//! filesystem holding the data directory.

use std::path::{Path, PathBuf};
use std::time::Duration;

use warren_broker::ResourceSample;

use crate::{Shared, lock};

/// How often resources are sampled.
const INTERVAL: Duration = Duration::from_secs(1);

/// Takes a first sample now, then samples every [`INTERVAL`] in a task.
pub(crate) fn start(broker: Shared, data_dir: PathBuf) {
    lock(&broker).observe_resources(sample(&data_dir));
    tokio::spawn(async move {
        let mut iv = tokio::time::interval(INTERVAL);
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            iv.tick().await;
            let s = sample(&data_dir);
            lock(&broker).observe_resources(s);
        }
    });
}

/// One reading; a value that cannot be read is 0 (and raises no alarm:
/// with `memory_total` 0 the broker raises none).
fn sample(data_dir: &Path) -> ResourceSample {
    ResourceSample {
        memory_used: resident_bytes(),
        memory_total: meminfo_total(),
        disk_free: rustix::fs::statvfs(data_dir).map_or(u64::MAX, |s| s.f_bavail * s.f_frsize),
    }
}

/// The process's resident set (`/proc/self/statm`, in pages).
fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|t| t.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * rustix::param::page_size() as u64)
}

/// The machine's memory (`MemTotal` in `/proc/meminfo`).
fn meminfo_total() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            let line = t.lines().find(|l| l.starts_with("MemTotal:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kb| kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_this_process_and_machine() {
        let dir = tempfile::tempdir().unwrap();
        let s = sample(dir.path());
        assert!(s.memory_used > 0, "{s:?}");
        assert!(s.memory_total > s.memory_used, "{s:?}");
        assert!(s.disk_free > 0 && s.disk_free < u64::MAX, "{s:?}");
    }
}
