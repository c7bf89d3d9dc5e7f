//! Resource alarms, as RabbitMQ's: a memory high watermark and a disk free
//! limit. While either is exceeded (on this node or, through the links, on
//! any node of the cluster), connections that publish get
//! `connection.blocked` (when they announced the capability) and their
//! input is no longer read; consumers keep draining. The node samples its
//! resources and hands them in with [`Broker::observe_resources`]; this
//! module only compares.

use std::collections::BTreeMap;
use std::fmt;

use crate::Broker;

/// The memory high watermark (`vm_memory_high_watermark.relative` /
/// `.absolute`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MemoryLimit {
    /// A fraction of the machine's memory (RabbitMQ's default is 0.4).
    Relative(f64),
    /// Bytes.
    Absolute(u64),
}

impl Default for MemoryLimit {
    fn default() -> Self {
        Self::Relative(0.4)
    }
}

/// The free disk space limit (`disk_free_limit.relative` / `.absolute`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DiskLimit {
    /// A multiple of the machine's memory.
    Relative(f64),
    /// Bytes.
    Absolute(u64),
}

impl Default for DiskLimit {
    /// RabbitMQ's default: 50 MB.
    fn default() -> Self {
        Self::Absolute(50_000_000)
    }
}

/// A size in bytes: a number with an optional unit. `k`, `K`, `KiB`, `M`,
/// `MiB`, `G`, `GiB`, `T`, `TiB` count in powers of 1024; `kB`, `KB`,
/// `MB`, `GB`, `TB` (any case) in powers of 1000, as RabbitMQ does.
pub fn parse_size(v: &str) -> Result<u64, String> {
    let bad = || format!("{v:?} is not a size (e.g. 1073741824, 1024MiB, 2GB)");
    let digits = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let n: u64 = v[..digits].parse().map_err(|_| bad())?;
    let unit = v[digits..].trim();
    let mult: u64 = match unit {
        "" => 1,
        "k" | "K" | "KiB" | "kiB" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        "T" | "TiB" => 1 << 40,
        u => match u.to_ascii_lowercase().as_str() {
            "kb" => 1_000,
            "mb" => 1_000_000,
            "gb" => 1_000_000_000,
            "tb" => 1_000_000_000_000,
            _ => return Err(bad()),
        },
    };
    n.checked_mul(mult).ok_or_else(bad)
}

/// One reading of the node's resources, taken by the node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResourceSample {
    /// Memory the node process uses (resident set), bytes.
    pub memory_used: u64,
    /// The machine's memory, bytes.
    pub memory_total: u64,
    /// Free space (for unprivileged users) where the node keeps its data, bytes.
    pub disk_free: u64,
}

/// This node's resources, limits and alarms, as the management API shows them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResourceStatus {
    /// The latest sample.
    pub sample: ResourceSample,
    /// The memory limit in bytes (`mem_limit`).
    pub memory_limit: u64,
    /// The disk free limit in bytes (`disk_free_limit`).
    pub disk_free_limit: u64,
    /// Memory is over its limit here (`mem_alarm`).
    pub memory_alarm: bool,
    /// Free disk space is under its limit here (`disk_free_alarm`).
    pub disk_alarm: bool,
}

/// Which alarms are set, on one node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AlarmSet {
    /// The memory alarm.
    pub memory: bool,
    /// The disk alarm.
    pub disk: bool,
}

impl AlarmSet {
    /// Whether any alarm is set.
    #[must_use]
    pub fn any(self) -> bool {
        self.memory || self.disk
    }

    /// Both sets together.
    #[must_use]
    pub fn union(self, other: Self) -> Self {
        Self {
            memory: self.memory || other.memory,
            disk: self.disk || other.disk,
        }
    }
}

impl fmt::Display for AlarmSet {
    /// The reason given in `connection.blocked`, RabbitMQ's words.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.memory, self.disk) {
            (true, true) => f.write_str("low on memory & low on disk"),
            (true, false) => f.write_str("low on memory"),
            (false, true) => f.write_str("low on disk"),
            (false, false) => f.write_str("no alarm"),
        }
    }
}

/// How long another node's alarm counts without being repeated (nodes
/// repeat theirs every few seconds while it is set).
pub(crate) const REMOTE_ALARM_TTL_MS: u64 = 15_000;

/// The alarm state a broker keeps.
#[derive(Debug, Default)]
pub(crate) struct Alarms {
    memory_limit: MemoryLimit,
    disk_limit: DiskLimit,
    status: ResourceStatus,
    /// Alarms other nodes reported over the links, by node name, with
    /// when they last said so.
    remote: BTreeMap<String, (AlarmSet, u64)>,
}

impl Alarms {
    fn recompute(&mut self) {
        let s = self.status.sample;
        // With no sample yet (total memory unknown) no alarm is raised.
        let known = s.memory_total > 0;
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss
        )]
        let of_total = |f: f64| (s.memory_total as f64 * f) as u64;
        self.status.memory_limit = match self.memory_limit {
            MemoryLimit::Relative(f) => of_total(f),
            MemoryLimit::Absolute(b) => b,
        };
        self.status.disk_free_limit = match self.disk_limit {
            DiskLimit::Relative(f) => of_total(f),
            DiskLimit::Absolute(b) => b,
        };
        self.status.memory_alarm = known && s.memory_used > self.status.memory_limit;
        self.status.disk_alarm = known && s.disk_free < self.status.disk_free_limit;
    }

    fn local(&self) -> AlarmSet {
        AlarmSet {
            memory: self.status.memory_alarm,
            disk: self.status.disk_alarm,
        }
    }

    /// Every alarm set anywhere in the cluster.
    pub(crate) fn cluster(&self) -> AlarmSet {
        self.remote
            .values()
            .fold(self.local(), |acc, (a, _)| acc.union(*a))
    }
}

impl Broker {
    /// Sets the memory high watermark (`set_vm_memory_high_watermark`).
    pub fn set_memory_limit(&mut self, limit: MemoryLimit) {
        tracing::info!(?limit, "memory high watermark set");
        self.alarms.memory_limit = limit;
        self.update_alarms();
    }

    /// Sets the disk free limit (`set_disk_free_limit`).
    pub fn set_disk_limit(&mut self, limit: DiskLimit) {
        tracing::info!(?limit, "disk free limit set");
        self.alarms.disk_limit = limit;
        self.update_alarms();
    }

    /// A new reading of this node's resources: raises or clears its alarms.
    pub fn observe_resources(&mut self, sample: ResourceSample) {
        self.alarms.status.sample = sample;
        self.update_alarms();
    }

    /// Node `node` reported its alarms (over the link); an empty set clears them.
    pub(crate) fn set_remote_alarms(&mut self, node: &str, alarms: AlarmSet) {
        let before = self.alarms.cluster();
        if alarms.any() {
            if !self.alarms.remote.contains_key(node) {
                tracing::warn!(%node, %alarms, "resource alarm on another node: publishers here are blocked too");
            }
            self.alarms
                .remote
                .insert(node.to_owned(), (alarms, self.now));
        } else if self.alarms.remote.remove(node).is_some() {
            tracing::info!(%node, "resource alarm on another node cleared");
        }
        if self.alarms.cluster() != before {
            self.apply_alarms();
        }
    }

    /// Forgets other nodes' alarms not repeated within [`REMOTE_ALARM_TTL_MS`].
    pub(crate) fn expire_remote_alarms(&mut self, now_ms: u64) {
        let stale: Vec<String> = self
            .alarms
            .remote
            .iter()
            .filter(|(_, (_, at))| now_ms.saturating_sub(*at) > REMOTE_ALARM_TTL_MS)
            .map(|(n, _)| n.clone())
            .collect();
        for n in stale {
            self.set_remote_alarms(&n, AlarmSet::default());
        }
    }

    /// This node's resources, limits and local alarms.
    #[must_use]
    pub fn resources(&self) -> ResourceStatus {
        self.alarms.status
    }

    /// This node's own alarms (what it reports to the others).
    #[must_use]
    pub fn local_alarms(&self) -> AlarmSet {
        self.alarms.local()
    }

    /// Every alarm in force here: this node's and those other nodes reported.
    #[must_use]
    pub fn alarms_in_force(&self) -> Vec<(String, AlarmSet)> {
        let mut out = Vec::new();
        if self.alarms.local().any() {
            out.push((self.cfg.node_name.clone(), self.alarms.local()));
        }
        out.extend(self.alarms.remote.iter().map(|(n, (a, _))| (n.clone(), *a)));
        out
    }

    /// Whether publishers are held back by a resource alarm.
    pub(crate) fn alarmed(&self) -> bool {
        self.alarms.cluster().any()
    }

    fn update_alarms(&mut self) {
        let before = self.alarms.status;
        self.alarms.recompute();
        let after = self.alarms.status;
        let changes = [
            ("memory", before.memory_alarm, after.memory_alarm),
            ("disk", before.disk_alarm, after.disk_alarm),
        ];
        for (resource, was, is) in changes {
            if was == is {
                continue;
            }
            let node = &self.cfg.node_name;
            let (used, limit) = match resource {
                "memory" => (after.sample.memory_used, after.memory_limit),
                _ => (after.sample.disk_free, after.disk_free_limit),
            };
            if is {
                tracing::warn!(
                    used,
                    limit,
                    "{resource} resource limit alarm set on node {node}; publishers will be blocked until this alarm clears"
                );
            } else {
                tracing::warn!(
                    used,
                    limit,
                    "{resource} resource limit alarm cleared on node {node}"
                );
            }
        }
        self.apply_alarms();
    }

    /// Blocks every publishing client connection while an alarm is in force
    /// and unblocks them when none is.
    fn apply_alarms(&mut self) {
        let alarms = self.alarms.cluster();
        let reason = alarms.to_string();
        for c in self.conns.values_mut() {
            if c.link.is_some() {
                continue;
            }
            // Any client's publish that begins during the alarm gets no
            // further than its content header.
            c.amqp.hold_publishes(alarms.any());
            if !c.publisher {
                continue;
            }
            let changed = if alarms.any() {
                c.amqp.block(&reason)
            } else {
                c.amqp.unblock()
            };
            // Wake its task: to write the frame and to read again.
            if changed || !alarms.any() {
                c.woken = true;
                (c.waker)();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alarms(limit: MemoryLimit, disk: DiskLimit, s: ResourceSample) -> Alarms {
        let mut a = Alarms {
            memory_limit: limit,
            disk_limit: disk,
            ..Alarms::default()
        };
        a.status.sample = s;
        a.recompute();
        a
    }

    const GIB: u64 = 1 << 30;

    #[test]
    fn relative_limits_follow_the_machine_memory() {
        let s = ResourceSample {
            memory_used: GIB,
            memory_total: 10 * GIB,
            disk_free: 100 * GIB,
        };
        let a = alarms(MemoryLimit::default(), DiskLimit::Relative(1.5), s);
        assert_eq!(a.status.memory_limit, 4 * GIB);
        assert_eq!(a.status.disk_free_limit, 15 * GIB);
        assert_eq!(a.local(), AlarmSet::default());
        let a = alarms(MemoryLimit::Relative(0.05), DiskLimit::Relative(20.0), s);
        assert_eq!(
            a.local(),
            AlarmSet {
                memory: true,
                disk: true
            }
        );
        assert_eq!(a.local().to_string(), "low on memory & low on disk");
    }

    #[test]
    fn absolute_limits_and_no_sample_yet() {
        let none = alarms(
            MemoryLimit::Absolute(1),
            DiskLimit::Absolute(u64::MAX),
            ResourceSample::default(),
        );
        assert!(!none.local().any(), "no alarm before the first sample");
        let s = ResourceSample {
            memory_used: 200,
            memory_total: GIB,
            disk_free: 49_999_999,
        };
        let a = alarms(MemoryLimit::Absolute(100), DiskLimit::default(), s);
        assert_eq!(
            a.local(),
            AlarmSet {
                memory: true,
                disk: true
            }
        );
        let a = alarms(MemoryLimit::Absolute(200), DiskLimit::Absolute(1), s);
        assert!(!a.local().any(), "at the limit is not over it");
    }

    #[test]
    fn sizes_parse_like_rabbitmq() {
        assert_eq!(parse_size("50MB"), Ok(50_000_000));
        assert_eq!(parse_size("1024MiB"), Ok(1 << 30));
        assert_eq!(parse_size("7"), Ok(7));
        assert!(parse_size("lots").is_err());
    }

    #[test]
    fn remote_alarms_count_cluster_wide() {
        let mut a = Alarms::default();
        a.remote.insert(
            "warren@b".into(),
            (
                AlarmSet {
                    memory: false,
                    disk: true,
                },
                0,
            ),
        );
        assert_eq!(a.cluster().to_string(), "low on disk");
    }
}
