//! Durable queues whose log failed (a full or failing disk): each is held,
//! its unconfirmed publishes nacked, until its log opens again
//! (`Broker::failed_logs`). This task tries every second, reading the log
//! off the broker's lock, and hands what it recovered back to the broker.

use std::collections::HashSet;
use std::time::Duration;

use crate::{Shared, lock};

/// How often a failed log is tried again.
const RETRY: Duration = Duration::from_secs(1);

/// Opens failed logs again, for the node's life.
pub(crate) async fn reopen(broker: Shared) {
    let mut iv = tokio::time::interval(RETRY);
    iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Queues already said to be failing to open, so that the log says it once.
    let mut told = HashSet::new();
    loop {
        iv.tick().await;
        let plans = lock(&broker).failed_logs();
        if plans.is_empty() {
            told.clear();
        }
        for plan in plans {
            let Ok((plan, opened)) = tokio::task::spawn_blocking(move || {
                let opened = plan.open();
                (plan, opened)
            })
            .await
            else {
                continue;
            };
            let key = (plan.vhost.clone(), plan.name.clone());
            match opened {
                Ok((bq, report)) => {
                    told.remove(&key);
                    if lock(&broker).reopened(&plan, bq) {
                        let cut = report
                            .truncated
                            .map(|(file, at)| format!("{}@{at}", file.display()));
                        tracing::info!(vhost = %plan.vhost, queue = %plan.name, messages = report.messages, torn_tail_cut = ?cut, "queue served again: its log opened after the failure");
                    }
                }
                Err(e) => {
                    if told.insert(key) {
                        tracing::warn!(vhost = %plan.vhost, queue = %plan.name, error = %e, "the queue's log does not open yet; retrying every second");
                    }
                }
            }
        }
    }
}
