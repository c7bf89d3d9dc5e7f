//! A seeded run of crashes, restarts, partitions and heals on five nodes,
//! with writes throughout: afterwards every acknowledged write is on every
//! node, and no command is in any node's log twice.

use std::collections::BTreeSet;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use warren_cluster::ClusterError;

use crate::harness::*;

async fn chaos(seed: u64, steps: usize) {
    let mut tc = TestCluster::new(seed);
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

/// One seed by default; `WARREN_CHAOS_SEEDS=N` runs seeds 50..50+N (a
/// failure names its seed; rerun it alone with `WARREN_CHAOS_SEED=S`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t50_seeded_chaos_on_five_nodes() {
    if let Some(seed) = std::env::var("WARREN_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return chaos(seed, 24).await;
    }
    let count: u64 = std::env::var("WARREN_CHAOS_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    for seed in 50..50 + count {
        chaos(seed, 24).await;
    }
}
