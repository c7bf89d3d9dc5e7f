//! A mutex that counts how often it is taken, how long takers wait for it
//! and how long it is held.
//!
//! The node keeps its whole broker behind one lock (ARCHITECTURE.md,
//! "Invariants"): every client, ring and HTTP request of the node takes
//! it. [`MeasuredMutex`] is that lock with its own accounts, so that an
//! operator (Prometheus `warren_broker_lock_*`) and the benches see how much
//! of the node's time is serialised behind it: held seconds per second is
//! the lock's busy share (near 1, the lock binds whatever the cores), and
//! held seconds against the process's CPU seconds is the share of the
//! node's work done under it.
//!
//! Times are wall-clock: a holder preempted by the kernel still holds the
//! lock, and others still wait for it.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};
use std::time::{Duration, Instant};

/// A [`Mutex`] with accounts ([`MeasuredMutex::stats`]). A poisoned lock is
/// taken anyway: the data behind it stays the node's, as with the plain
/// lock it replaces.
#[derive(Debug, Default)]
pub struct MeasuredMutex<T> {
    inner: Mutex<T>,
    acquisitions: AtomicU64,
    contended: AtomicU64,
    wait_nanos: AtomicU64,
    held_nanos: AtomicU64,
}

/// What a [`MeasuredMutex`] has counted since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LockStats {
    /// How many times it was taken.
    pub acquisitions: u64,
    /// How many of those found it held and waited.
    pub contended: u64,
    /// How long takers waited for it, in total.
    pub wait: Duration,
    /// How long it was held, in total (up to the last release).
    pub held: Duration,
}

impl<T> MeasuredMutex<T> {
    /// A new unlocked mutex holding `value`, its accounts at zero.
    pub fn new(value: T) -> Self {
        Self {
            inner: Mutex::new(value),
            acquisitions: AtomicU64::new(0),
            contended: AtomicU64::new(0),
            wait_nanos: AtomicU64::new(0),
            held_nanos: AtomicU64::new(0),
        }
    }

    /// Takes the lock, waiting for it if another thread holds it.
    pub fn lock(&self) -> MeasuredGuard<'_, T> {
        let guard = match self.inner.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                let asked = Instant::now();
                let g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
                self.contended.fetch_add(1, Ordering::Relaxed);
                self.wait_nanos
                    .fetch_add(nanos(asked.elapsed()), Ordering::Relaxed);
                g
            }
        };
        self.acquisitions.fetch_add(1, Ordering::Relaxed);
        MeasuredGuard {
            guard,
            since: Instant::now(),
            held_nanos: &self.held_nanos,
        }
    }

    /// The accounts so far.
    pub fn stats(&self) -> LockStats {
        LockStats {
            acquisitions: self.acquisitions.load(Ordering::Relaxed),
            contended: self.contended.load(Ordering::Relaxed),
            wait: Duration::from_nanos(self.wait_nanos.load(Ordering::Relaxed)),
            held: Duration::from_nanos(self.held_nanos.load(Ordering::Relaxed)),
        }
    }

    /// The value, the lock no longer needed.
    pub fn into_inner(self) -> T {
        self.inner
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The lock held: derefs to the value; releasing it (drop) adds the time it
/// was held to the mutex's accounts.
#[derive(Debug)]
pub struct MeasuredGuard<'a, T> {
    guard: MutexGuard<'a, T>,
    since: Instant,
    held_nanos: &'a AtomicU64,
}

impl<T> Deref for MeasuredGuard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> DerefMut for MeasuredGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

impl<T> Drop for MeasuredGuard<'_, T> {
    fn drop(&mut self) {
        // Counted before the release: the lock is still ours here.
        self.held_nanos
            .fetch_add(nanos(self.since.elapsed()), Ordering::Relaxed);
    }
}
