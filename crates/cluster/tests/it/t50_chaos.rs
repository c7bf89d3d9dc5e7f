//! A seeded run of crashes, restarts, partitions and heals on five nodes,
//! with writes throughout: afterwards every acknowledged write is on every
//! node, and no command is in any node's log twice.

use std::collections::BTreeSet;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use warren_cluster::ClusterError;

use crate::harness::*;

async fn chaos(seed: u64, steps: usize, snapshot_every: u64) {
    let mut tc = TestCluster::new(seed);
    tc.snapshot_every = snapshot_every;
    let names = ["a", "b", "c", "d", "e"];
    tc.form(&names).await;
    tc.node("a").write(vhost("/")).await.unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut down: BTreeSet<&str> = BTreeSet::new();
    let mut partitioned = false;
    let mut acked = Vec::new();
    for step in 0..steps {
        let alive: Vec<&str> = names
            .iter()
            .copied()
            .filter(|n| !down.contains(n))
            .collect();
        match rng.random_range(0..10) {
            0 | 1 if down.len() < 2 => {
                let victim = alive[rng.random_range(0..alive.len())];
                tracing::info!(seed, step, victim, "chaos: kill");
                tc.kill(victim).await;
                down.insert(victim);
            }
            2 | 3 if !down.is_empty() && !partitioned => {
                let back = *down.iter().nth(rng.random_range(0..down.len())).unwrap();
                tracing::info!(seed, step, back, "chaos: restart");
                tc.start(back, None).await;
                down.remove(back);
            }
            4 => {
                let mut shuffled: Vec<&str> = names.to_vec();
                for i in (1..shuffled.len()).rev() {
                    shuffled.swap(i, rng.random_range(0..=i));
                }
                let cut = rng.random_range(1..names.len());
                let left: Vec<_> = shuffled[..cut].iter().map(|s| n(s)).collect();
                let right: Vec<_> = shuffled[cut..].iter().map(|s| n(s)).collect();
                tracing::info!(seed, step, ?left, ?right, "chaos: partition");
                tc.net.partition(&[&left, &right]);
                partitioned = true;
            }
            5 => {
                tracing::info!(seed, step, "chaos: heal");
                tc.net.heal();
                partitioned = false;
            }
            _ => {
                let via = alive[rng.random_range(0..alive.len())];
                let name = format!("s{seed}-{step}");
                match tc.node(via).write(vhost(&name)).await {
                    Ok(_) => acked.push(name),
                    Err(ClusterError::NoMajority { .. } | ClusterError::Remote(_)) => {}
                    Err(e) => panic!("seed {seed} step {step}: {e}"),
                }
            }
        }
    }
    tc.net.heal();
    for back in std::mem::take(&mut down) {
        tc.start(back, None).await;
    }
    let context = format!("seed {seed}");
    check_every_ack_applied_once(&mut tc, &names, &acked, "a", &context).await;
}

/// The seeds to run: `WARREN_CHAOS_SEED=S` runs only `S`;
/// `WARREN_CHAOS_SEEDS=N` runs `base..base+N`; by default only `base`.
fn seeds(base: u64) -> Vec<u64> {
    let env = |k: &str| std::env::var(k).ok().and_then(|s| s.parse::<u64>().ok());
    if let Some(seed) = env("WARREN_CHAOS_SEED") {
        return vec![seed];
    }
    (base..base + env("WARREN_CHAOS_SEEDS").unwrap_or(1)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t50_seeded_chaos_on_five_nodes() {
    for seed in seeds(50) {
        chaos(seed, 24, 10_000).await;
    }
}

/// The same with snapshots every few entries: lagging and restarted nodes
/// catch up by snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t51_seeded_chaos_with_frequent_snapshots() {
    for seed in seeds(1050) {
        chaos(seed, 24, 4).await;
    }
}
