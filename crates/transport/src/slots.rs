//! A bound on the connections a listener is authenticating at once.
//!
//! Until a peer has proven the cluster secret it costs the listener a task,
//! a socket and its buffers while proving nothing. A listener takes a slot
//! for each accepted connection and gives it back when the handshake ends
//! (either way); with every slot taken, further connections are closed at
//! once, so that what strangers can make a node hold is bounded whatever
//! their number. Refusals are logged at warn, at most once per
//! [`WARN_EVERY`], with how many there were since the last warning.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::PeerAddr;

/// The shortest time between two warnings about refused connections.
pub const WARN_EVERY: Duration = Duration::from_secs(10);

/// The handshake slots of one listener.
#[derive(Debug)]
pub struct HandshakeSlots {
    listener: PeerAddr,
    free: Arc<Semaphore>,
    max: usize,
    refusals: Refusals,
}

/// A slot held by one connection until its handshake ends.
pub type HandshakeSlot = OwnedSemaphorePermit;

impl HandshakeSlots {
    /// At most `max` connections authenticating at once on `listener`.
    pub fn new(listener: PeerAddr, max: usize) -> Self {
        Self {
            listener,
            free: Arc::new(Semaphore::new(max)),
            max,
            refusals: Refusals::default(),
        }
    }

    /// A slot for the connection from `addr`, or `None` (logged) when every
    /// slot is taken: the caller then closes the connection.
    pub fn admit(&mut self, addr: &PeerAddr) -> Option<HandshakeSlot> {
        if let Ok(slot) = self.free.clone().try_acquire_owned() {
            return Some(slot);
        }
        if let Some(refused) = self.refusals.note(Instant::now()) {
            tracing::warn!(
                listener = %self.listener,
                last_peer_addr = %addr,
                refused,
                limit = self.max,
                "peer connections closed unauthenticated: the listener is already running its \
                 limit of handshakes (a flood of connections, or peers that never finish theirs)"
            );
        }
        None
    }
}

/// Refusals since the last warning, and when that was.
#[derive(Debug, Default)]
struct Refusals {
    last_warning: Option<Instant>,
    unreported: u64,
}

impl Refusals {
    /// Counts one refusal at `now`; the number to report when a warning is due.
    fn note(&mut self, now: Instant) -> Option<u64> {
        self.unreported += 1;
        let due = self
            .last_warning
            .is_none_or(|last| now.duration_since(last) >= WARN_EVERY);
        if !due {
            return None;
        }
        self.last_warning = Some(now);
        Some(std::mem::take(&mut self.unreported))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_run_out_and_come_back() {
        let mut slots = HandshakeSlots::new(PeerAddr::new("listener"), 2);
        let a = PeerAddr::new("peer");
        let first = slots.admit(&a).expect("a free slot");
        let _second = slots.admit(&a).expect("a free slot");
        assert!(slots.admit(&a).is_none(), "every slot is taken");
        drop(first);
        assert!(
            slots.admit(&a).is_some(),
            "a finished handshake frees its slot"
        );
    }

    #[test]
    fn warnings_come_at_most_once_per_period_with_the_count() {
        let mut r = Refusals::default();
        let t0 = Instant::now();
        assert_eq!(r.note(t0), Some(1), "the first refusal is reported at once");
        for i in 1..100u64 {
            assert_eq!(
                r.note(t0 + WARN_EVERY * u32::try_from(i).unwrap() / 100),
                None
            );
        }
        assert_eq!(
            r.note(t0 + WARN_EVERY),
            Some(100),
            "the next warning counts them all"
        );
        assert_eq!(r.note(t0 + WARN_EVERY * 3), Some(1));
    }
}
