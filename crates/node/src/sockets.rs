//! The node's budget of client sockets, RabbitMQ's `sockets_total`.
//!
//! Every client connection (AMQP or AMQPS) holds one socket from accept to
//! close. Left unbounded, clients could take every file descriptor the
//! process may open, and a durable declare or a queue's next log segment
//! would then fail for want of one. As RabbitMQ 3.10 does, the budget is
//! nine tenths of the open-files limit after 100 kept for files and peers
//! (a limit of 300 gives 180 sockets, as measured on RabbitMQ); at the
//! budget the listeners stop accepting, so a new client waits until another
//! leaves (RabbitMQ's documented "stop accepting new network connections").
//!
//! The tenth left is the queues' log files' ([`file_budget`]): past it the
//! files not used lately are closed and opened again when next used, so
//! that a node may hold more durable queues than it may open files.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Descriptors kept out of the client and file budgets: the journal,
/// metadata, peers, HTTP (RabbitMQ's `RESERVED_FOR_OTHERS`).
const RESERVED: u64 = 100;

/// Client sockets the node may hold at once, and those it holds.
#[derive(Debug, Clone)]
pub(crate) struct ClientSockets {
    permits: Arc<Semaphore>,
    /// `None`: the open-files limit is unlimited, so is the budget.
    total: Option<u64>,
    /// Sockets of accepted clients (not counting the permit a listener
    /// holds while it waits for the next client).
    held: Arc<AtomicU64>,
}

/// One socket of the budget, taken before accepting; given back when dropped.
#[derive(Debug)]
pub(crate) struct Reserved {
    permit: OwnedSemaphorePermit,
    held: Arc<AtomicU64>,
}

impl Reserved {
    /// The socket, now an accepted client's until it is dropped.
    pub(crate) fn hold(self) -> HeldSocket {
        self.held.fetch_add(1, Ordering::Relaxed);
        HeldSocket {
            _permit: self.permit,
            held: self.held,
        }
    }
}

/// An accepted client's socket, counted in `sockets_used` until dropped.
#[derive(Debug)]
pub(crate) struct HeldSocket {
    _permit: OwnedSemaphorePermit,
    held: Arc<AtomicU64>,
}

impl Drop for HeldSocket {
    fn drop(&mut self) {
        self.held.fetch_sub(1, Ordering::Relaxed);
    }
}

impl ClientSockets {
    /// The budget of an open-files limit (`None`: unlimited).
    pub(crate) fn for_fd_limit(limit: Option<u64>) -> Self {
        let total = limit.map(budget);
        let permits = total
            .and_then(|t| usize::try_from(t).ok())
            .unwrap_or(usize::MAX)
            .min(Semaphore::MAX_PERMITS);
        Self {
            permits: Arc::new(Semaphore::new(permits)),
            total,
            held: Arc::default(),
        }
    }

    /// Waits for a free socket, to take before accepting a client.
    pub(crate) async fn reserve(&self) -> Reserved {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .expect("the client socket budget is never closed");
        Reserved {
            permit,
            held: self.held.clone(),
        }
    }

    /// Client sockets held now, and the budget (`None`: unlimited).
    pub(crate) fn used_and_total(&self) -> (u64, Option<u64>) {
        (self.held.load(Ordering::Relaxed), self.total)
    }
}

/// The log files a node keeps open at once under open-files limit `limit`:
/// what the sockets' budget and [`RESERVED`] leave, at least 8.
pub(crate) fn file_budget(limit: u64) -> u64 {
    limit
        .saturating_sub(RESERVED)
        .saturating_sub(budget(limit))
        .max(8)
}

/// Nine tenths of what the limit leaves after [`RESERVED`], at least one.
fn budget(limit: u64) -> u64 {
    (limit.saturating_sub(RESERVED) * 9 / 10).max(1)
}

/// Raises the soft open-files limit to the hard one (as Go's runtime does):
/// a login shell's soft 1,024 would otherwise cap a node that may open far
/// more, one descriptor per client and per durable queue's log. Returns the
/// limit in force afterwards (`None`: unlimited).
pub(crate) fn raise_fd_limit() -> Option<u64> {
    let Rlimit { current, maximum } = getrlimit(Resource::Nofile);
    let current = current?;
    // An unlimited hard limit still stops at the kernel's `nr_open`.
    let target = maximum.or_else(nr_open)?;
    if target > current {
        let raised = Rlimit {
            current: Some(target),
            maximum,
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => {
                tracing::info!(from = current, to = target, "open-files limit raised");
                return Some(target);
            }
            Err(e) => tracing::debug!(error = %e, "the open-files limit could not be raised"),
        }
    }
    Some(current)
}

/// The kernel's ceiling on a process's open files.
fn nr_open() -> Option<u64> {
    std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_rabbitmqs() {
        // Measured on RabbitMQ 3.10.8 with `ulimit -n 300`: sockets_total 180.
        assert_eq!(budget(300), 180);
        assert_eq!(budget(1024), 831);
        assert_eq!(budget(50), 1);
        assert_eq!(file_budget(20_000), 1_990);
        assert_eq!(file_budget(300), 20);
        assert_eq!(file_budget(50), 8);
    }

    #[tokio::test]
    async fn a_held_socket_counts_until_it_is_dropped() {
        let s = ClientSockets::for_fd_limit(Some(102));
        let reserved = s.reserve().await;
        // A listener waiting with a socket reserved holds no client's.
        assert_eq!(s.used_and_total(), (0, Some(1)));
        let held = reserved.hold();
        assert_eq!(s.used_and_total(), (1, Some(1)));
        let waiting = tokio::spawn({
            let s = s.clone();
            async move { s.reserve().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "the budget is spent");
        drop(held);
        assert_eq!(s.used_and_total(), (0, Some(1)));
        let _next = waiting.await.unwrap().hold();
        assert_eq!(s.used_and_total(), (1, Some(1)));
    }
}
