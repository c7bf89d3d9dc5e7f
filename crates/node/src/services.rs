//! What runs beside each shard's broker: its group commit on a thread of
//! its own (the queues' log writes and `fdatasync`, off the broker's lock),
//! its 50 ms tick (expiry, timeouts, link housekeeping) and the reopening of
//! its queues' failed logs.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;

use crate::shards::Shards;
use crate::{Shared, failed_logs, lock, now_ms};

/// Wakes the group-commit thread.
#[derive(Debug, Default)]
struct SyncSignal {
    state: Mutex<(bool, bool)>,
    cv: Condvar,
}

impl SyncSignal {
    fn notify(&self) {
        let mut s = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.0 = true;
        self.cv.notify_one();
    }

    fn stop(&self) {
        let mut s = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.1 = true;
        self.cv.notify_one();
    }

    /// Waits for work; false once stopped.
    fn wait(&self) -> bool {
        let mut s = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while !s.0 && !s.1 {
            s = self
                .cv
                .wait(s)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        s.0 = false;
        !s.1
    }
}

/// The group-commit thread of `broker`: runs each commit the broker
/// prepares, off its lock, until stopped.
fn sync_loop(broker: Shared, signal: Arc<SyncSignal>) {
    while signal.wait() {
        loop {
            let mut batch = lock(&broker).prepare_sync();
            if batch.is_empty() {
                break;
            }
            let started = Instant::now();
            batch.run();
            batch.ran_for(started.elapsed());
            if !lock(&broker).complete_sync(batch, now_ms()) {
                break;
            }
        }
    }
}

/// The services of every shard, running.
#[derive(Debug)]
pub(crate) struct Services {
    syncers: Vec<(Arc<SyncSignal>, std::thread::JoinHandle<()>)>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Services {
    /// Starts each shard's group-commit thread, tick and log reopener.
    pub(crate) fn start(shards: &Shards) -> anyhow::Result<Self> {
        let mut syncers = Vec::new();
        let mut tasks = Vec::new();
        for (k, b) in shards.all().iter().enumerate() {
            let signal = Arc::new(SyncSignal::default());
            {
                let sig = signal.clone();
                lock(b).set_sync_waker(Arc::new(move || sig.notify()));
            }
            let thread = {
                let (b, s) = (b.clone(), signal.clone());
                std::thread::Builder::new()
                    .name(if k == 0 {
                        "warren-sync".into()
                    } else {
                        format!("warren-sync-{k}")
                    })
                    .spawn(move || sync_loop(b, s))
                    .context("starting the sync thread")?
            };
            syncers.push((signal, thread));
            let ticking = b.clone();
            tasks.push(shards.spawn(k, async move {
                let mut iv = tokio::time::interval(Duration::from_millis(50));
                iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    iv.tick().await;
                    lock(&ticking).tick(now_ms());
                }
            }));
            tasks.push(shards.spawn(k, failed_logs::reopen(b.clone())));
        }
        Ok(Self { syncers, tasks })
    }

    /// Stops them, then makes everything each shard holds durable.
    pub(crate) async fn stop(self, shards: &Shards) {
        for task in self.tasks {
            task.abort();
        }
        for (signal, thread) in self.syncers {
            signal.stop();
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        for b in shards.all() {
            lock(b).sync_all();
        }
    }
}
