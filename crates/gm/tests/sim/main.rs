//! Deterministic simulation of GM rings (see `harness.rs`).
//!
//! - `sim_seed_sweep` runs `GM_SEEDS` seeds (default 1000) from `GM_SEED_BASE` (default 0).
//! - `sim_replay` replays the seed in `GM_SEED`:
//!   `GM_SEED=1234 cargo test -p warren-gm --test sim sim_replay -- --nocapture`.

mod harness;

use std::panic::{AssertUnwindSafe, catch_unwind};

use harness::{Fault, Sim, SimConfig};

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

fn run_seed(seed: u64) -> Result<harness::Outcome, String> {
    match catch_unwind(AssertUnwindSafe(|| Sim::from_seed(seed).run())) {
        Ok(result) => result,
        Err(_) => Err(format!(
            "GM simulation seed {seed} panicked\nreplay: GM_SEED={seed} cargo test -p warren-gm --test sim sim_replay -- --nocapture"
        )),
    }
}

#[test]
fn sim_seed_sweep() {
    let base = env_u64("GM_SEED_BASE").unwrap_or(0);
    let count = env_u64("GM_SEEDS").unwrap_or(1000);
    let mut failures = Vec::new();
    let mut totals = (0u64, 0u64, 0usize);
    let mut coverage = (0usize, 0usize, 0usize, 0u64);
    for seed in base..base + count {
        match run_seed(seed) {
            Ok(o) => {
                totals.0 += o.broadcasts;
                totals.1 += o.deliveries;
                totals.2 += o.casualties;
                coverage.0 += o.join_failures;
                coverage.1 += o.false_removals;
                coverage.2 += o.erasures;
                coverage.3 = coverage.3.max(o.final_version);
            }
            Err(msg) => {
                failures.push(msg);
                if failures.len() >= 3 {
                    break;
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failing seed(s):\n{}",
        failures.len(),
        failures.join("\n\n")
    );
    assert!(totals.0 > count * 50, "too little traffic: {totals:?}");
    assert!(totals.2 > 0, "no faults injected: {totals:?}");
    if count >= 100 {
        // Every kind of trouble happened somewhere in the sweep.
        assert!(
            coverage.0 > 0 && coverage.1 > 0 && coverage.2 > 0 && coverage.3 > 10,
            "thin coverage (join failures, false removals, erasures, max version): {coverage:?}"
        );
    }
}

#[test]
fn sim_replay() {
    let seed = env_u64("GM_SEED").unwrap_or(42);
    let outcome = run_seed(seed).unwrap_or_else(|msg| panic!("{msg}"));
    // Tests may not print; the outcome is in the assertion message on failure only.
    assert!(outcome.members > 0, "{outcome:?}");
}

#[test]
fn sim_is_deterministic() {
    for seed in [1, 7, 99] {
        let a = run_seed(seed).unwrap_or_else(|m| panic!("{m}"));
        let b = run_seed(seed).unwrap_or_else(|m| panic!("{m}"));
        assert_eq!(
            a.trace_hash, b.trace_hash,
            "seed {seed} is not deterministic"
        );
    }
}

fn scenario(seed: u64, members: usize, faults: Vec<Fault>) -> harness::Outcome {
    let cfg = SimConfig {
        initial_members: members,
        chaos_time: 30_000,
        op_gap: 60,
        faults,
        batch_bytes_max: 2048,
    };
    Sim::new(seed, cfg).run().unwrap_or_else(|m| panic!("{m}"))
}

#[test]
fn t10_five_members_no_faults() {
    let o = scenario(10, 5, vec![]);
    assert_eq!(o.casualties, 0);
    assert!(o.deliveries >= o.broadcasts * 5, "{o:?}");
}

#[test]
fn t20_sender_crashes_mid_broadcast() {
    for seed in 0..20 {
        let o = scenario(seed, 4, vec![Fault::CrashSenderMidBroadcast]);
        assert!(o.casualties >= 1, "{o:?}");
    }
}

#[test]
fn t30_two_neighbours_crash_at_once() {
    for seed in 0..20 {
        let o = scenario(seed, 5, vec![Fault::CrashNeighbours]);
        assert!(o.casualties >= 2, "{o:?}");
    }
}

#[test]
fn t40_joiner_crashes() {
    for seed in 0..20 {
        let o = scenario(seed, 3, vec![Fault::CrashJoiner, Fault::CrashJoiner]);
        assert!(o.members >= 5, "{o:?}");
    }
}

#[test]
fn t50_joins_under_heavy_traffic() {
    for seed in 0..20 {
        let cfg = SimConfig {
            initial_members: 3,
            chaos_time: 30_000,
            op_gap: 15,
            faults: vec![Fault::Join, Fault::Join, Fault::Join],
            batch_bytes_max: 64 * 1024,
        };
        let o = Sim::new(seed, cfg).run().unwrap_or_else(|m| panic!("{m}"));
        assert!(o.members >= 6, "{o:?}");
    }
}

#[test]
fn t60_partitions_heal() {
    for seed in 0..20 {
        scenario(seed, 4, vec![Fault::Partition, Fault::Partition]);
    }
}
