//! Crash test: a child process publishes with confirms (and consumes some)
//! and is SIGKILLed at a random moment; every confirmed, un-acked message must
//! come back.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};

use warren_backing_queue::{BackingQueue, NewMessage, QueueConfig, StoreConfig};

const DIR_VAR: &str = "WARREN_BQ_CRASH_DIR";
const START_VAR: &str = "WARREN_BQ_CRASH_START";

fn store() -> StoreConfig {
    StoreConfig {
        segment_bytes: 64 << 10,
        resident_bytes_max: 32 << 10,
        skip_corrupt: false,
    }
}

/// The child's body: runs only when re-executed by `sigkill_never_loses_a_confirmed_message`.
#[test]
fn crash_child() {
    let (Ok(dir), Ok(start)) = (std::env::var(DIR_VAR), std::env::var(START_VAR)) else {
        return;
    };
    let mut id: u64 = start.parse().unwrap();
    let (mut q, _) = BackingQueue::open(Path::new(&dir), QueueConfig::default(), store()).unwrap();
    let mut out = std::io::stdout().lock();
    let mut seq_to_id = std::collections::VecDeque::new();
    let mut confirmed = Vec::new();
    let mut rng = id;
    for round in 0u64..100_000 {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let batch = 1 + (rng >> 33) % 40;
        for _ in 0..batch {
            let len = ((rng >> 20) % 3000) as usize;
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1);
            let p = q
                .publish(0, NewMessage::new(id, vec![id as u8; len], true))
                .unwrap();
            seq_to_id.push_back((p.seq, id));
            id += 1;
        }
        // Consume some: ack most, requeue a few, keep a few unacked.
        for _ in 0..batch / 2 {
            let Some(d) = q.fetch(0).unwrap() else { break };
            assert!(d.body.iter().all(|&b| b == d.id as u8));
            match (d.id + round) % 5 {
                0 => q.requeue(d.tag).unwrap(),
                1 => {}
                _ => {
                    // Announce before acking: the ack may reach the disk at any time from now.
                    writeln!(out, "A {}", d.id).unwrap();
                    out.flush().unwrap();
                    q.ack(d.tag).unwrap();
                }
            }
        }
        q.sync().unwrap();
        q.drain_confirmed(&mut confirmed);
        for s in confirmed.drain(..) {
            while let Some((seq, mid)) = seq_to_id.pop_front() {
                if seq == s {
                    writeln!(out, "C {mid}").unwrap();
                    break;
                }
            }
        }
        out.flush().unwrap();
    }
}

#[test]
fn sigkill_never_loses_a_confirmed_message() {
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut must: BTreeSet<u64> = BTreeSet::new();
    let mut max_id = 0;
    let mut rng: u64 = 0x9e37_79b9_7f4a_7c15;
    for round in 0..4u64 {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let kill_after = 20 + (rng >> 33) % 3000;
        let start = round * 10_000_000;
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "crash::crash_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(DIR_VAR, dir.path())
            .env(START_VAR, start.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut confirms = 0;
        let mut killed = false;
        for line in BufReader::new(stdout).lines() {
            let line = line.unwrap();
            if let Some(id) = line.strip_prefix("C ") {
                let id: u64 = id.parse().unwrap();
                must.insert(id);
                max_id = max_id.max(id);
                confirms += 1;
            } else if let Some(id) = line.strip_prefix("A ") {
                must.remove(&id.parse::<u64>().unwrap());
            }
            if confirms >= kill_after && !killed {
                child.kill().unwrap(); // SIGKILL
                killed = true;
            }
        }
        let status = child.wait().unwrap();
        assert!(killed, "child exited by itself: {status}");

        let (mut q, _) = BackingQueue::open(dir.path(), QueueConfig::default(), store())
            .expect("recovery after SIGKILL");
        let mut got = Vec::new();
        let mut tags = Vec::new();
        while let Some(d) = q.fetch(0).unwrap() {
            assert!(d.body.iter().all(|&b| b == d.id as u8), "body of {}", d.id);
            got.push(d.id);
            tags.push(d.tag);
        }
        assert!(got.windows(2).all(|w| w[0] < w[1]), "recovered in order");
        let got_set: BTreeSet<u64> = got.iter().copied().collect();
        let lost: Vec<_> = must.difference(&got_set).collect();
        assert!(
            lost.is_empty(),
            "round {round}: confirmed messages lost: {lost:?}"
        );
        // Leave them in the queue (requeued) for the next round.
        for t in tags.into_iter().rev() {
            q.requeue(t).unwrap();
        }
        q.sync().unwrap();
        must = got_set;
    }
    assert!(max_id > 0);
}
