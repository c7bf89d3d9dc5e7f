//! What the reconciler's last pass saw of the metadata, so that a pass
//! after a change of queue records alone looks at the queues that changed
//! rather than at every queue (a mirrored declare is several changes: the
//! queue, each replica's claim, each ring join; with a pass over every
//! queue on each, declares grew slower with the queue count). The queue
//! records are a persistent map that shares what did not change with the
//! last pass's copy, so that finding the changes skips the rest.

use std::collections::{BTreeMap, BTreeSet};

use imbl::ordmap::DiffItem;
use warren_cluster::{Metadata, PolicyRecord, QueueRecord};

/// A queue's key in the metadata: (vhost, name).
pub(crate) type QueueKey = (String, String);

/// The parts of the metadata a reconciler's pass reads, as of its last pass.
#[derive(Debug, Default)]
pub(crate) struct Seen {
    /// False until the first pass (which looks at everything).
    primed: bool,
    queues: imbl::OrdMap<QueueKey, QueueRecord>,
    policies: BTreeMap<(String, String), PolicyRecord>,
    nodes: Vec<String>,
    running: Vec<String>,
}

impl Seen {
    /// Remembers `meta` and `running` for the next pass, and says what this
    /// pass must look at: `None`, everything (the first pass, or policies,
    /// cluster members or the nodes up changed); else the queues declared,
    /// deleted or changed since the last pass.
    pub(crate) fn update(
        &mut self,
        meta: &Metadata,
        running: &[String],
    ) -> Option<BTreeSet<QueueKey>> {
        let same_rest = self.primed
            && self.policies == meta.policies
            && self.nodes.iter().eq(meta.nodes.keys())
            && self.running == running;
        // The two maps share what did not change: the diff skips it.
        let changed: BTreeSet<QueueKey> = self
            .queues
            .diff(&meta.queues)
            .map(|d| match d {
                DiffItem::Add(key, _) | DiffItem::Remove(key, _) => key.clone(),
                DiffItem::Update { new: (key, _), .. } => key.clone(),
            })
            .collect();
        self.queues = meta.queues.clone();
        if same_rest {
            return Some(changed);
        }
        self.primed = true;
        self.policies.clone_from(&meta.policies);
        self.nodes = meta.nodes.keys().cloned().collect();
        self.running = running.to_vec();
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(name: &str, master: &str) -> QueueRecord {
        QueueRecord {
            vhost: "/".into(),
            name: name.into(),
            durable: true,
            exclusive_owner: None,
            auto_delete: false,
            arguments: Default::default(),
            master: master.into(),
            mirrors: vec![],
            synchronised: vec![],
            view_version: 1,
            serial: 1,
        }
    }

    fn key(name: &str) -> QueueKey {
        ("/".into(), name.into())
    }

    #[test]
    fn a_pass_after_queue_changes_alone_looks_at_those_queues() {
        let mut meta = Metadata::default();
        meta.queues.insert(key("a"), queue("a", "n1"));
        meta.queues.insert(key("b"), queue("b", "n1"));
        let running = vec!["n1".to_owned()];
        let mut seen = Seen::default();
        assert_eq!(seen.update(&meta, &running), None, "the first pass");
        assert_eq!(seen.update(&meta, &running), Some(BTreeSet::new()));

        meta.queues.get_mut(&key("a")).unwrap().master = "n2".into();
        meta.queues.remove(&key("b"));
        meta.queues.insert(key("c"), queue("c", "n1"));
        assert_eq!(
            seen.update(&meta, &running),
            Some([key("a"), key("b"), key("c")].into_iter().collect())
        );
        assert_eq!(seen.update(&meta, &running), Some(BTreeSet::new()));
    }

    #[test]
    fn a_change_of_policies_or_nodes_up_makes_a_full_pass() {
        let mut meta = Metadata::default();
        meta.queues.insert(key("a"), queue("a", "n1"));
        let mut seen = Seen::default();
        let running = vec!["n1".to_owned()];
        assert_eq!(seen.update(&meta, &running), None);
        let both = vec!["n1".to_owned(), "n2".to_owned()];
        assert_eq!(seen.update(&meta, &both), None, "a node came up");
        assert_eq!(seen.update(&meta, &both), Some(BTreeSet::new()));
        meta.policies.insert(
            ("/".into(), "ha".into()),
            PolicyRecord {
                vhost: "/".into(),
                name: "ha".into(),
                pattern: ".*".into(),
                apply_to: "queues".into(),
                priority: 0,
                definition: r#"{"ha-mode":"all"}"#.into(),
            },
        );
        assert_eq!(seen.update(&meta, &both), None, "a policy changed");
        assert_eq!(seen.update(&meta, &both), Some(BTreeSet::new()));
    }

    /// Seeded random changes to a metadata of many queues, each pass's
    /// answer compared with a scan of every queue record against a plain
    /// copy of the last pass's (what `update` did before it diffed).
    #[test]
    fn the_queues_a_pass_looks_at_are_those_a_full_scan_finds() {
        let mut meta = Metadata::default();
        for i in 0..2_000 {
            meta.queues
                .insert(key(&format!("q{i}")), queue(&format!("q{i}"), "n1"));
        }
        let running = vec!["n1".to_owned()];
        let mut seen = Seen::default();
        assert_eq!(seen.update(&meta, &running), None);
        let mut last: BTreeMap<QueueKey, QueueRecord> = meta.queues.clone().into_iter().collect();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for _ in 0..300 {
            // A reader's copy of the metadata, as the state machine's
            // readers hold one while it applies the next changes.
            let held = meta.clone();
            for _ in 0..next(6) {
                let name = format!("q{}", next(2_500));
                match next(3) {
                    0 => {
                        meta.queues.insert(key(&name), queue(&name, "n2"));
                    }
                    1 => {
                        meta.queues.remove(&key(&name));
                    }
                    _ => {
                        if let Some(q) = meta.queues.get_mut(&key(&name)) {
                            q.view_version += 1;
                        }
                    }
                }
            }
            let scanned: BTreeSet<QueueKey> = meta
                .queues
                .iter()
                .filter(|(k, q)| last.get(*k) != Some(*q))
                .map(|(k, _)| k.clone())
                .chain(
                    last.keys()
                        .filter(|k| !meta.queues.contains_key(*k))
                        .cloned(),
                )
                .collect();
            assert_eq!(seen.update(&meta, &running), Some(scanned));
            last = meta.queues.clone().into_iter().collect();
            drop(held);
        }
    }
}
