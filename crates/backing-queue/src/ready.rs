//! The ready messages of a queue in delivery order: one FIFO by seq, or for
//! a priority queue (`x-max-priority`) one FIFO by seq per priority, the
//! highest priority first. As RabbitMQ's priority queue (one backing queue
//! per priority), the whole order is (priority descending, seq ascending):
//! fetch, expiry and drop-head all work on its head, and a requeued message
//! goes back to its place in its priority.

use std::collections::VecDeque;

use crate::core::Entry;

/// Ready messages, head first.
#[derive(Debug)]
pub(crate) enum Ready {
    /// A queue without priorities (today's one deque, no extra cost).
    Fifo(VecDeque<Entry>),
    /// A priority queue.
    Prio(Levels),
}

impl Default for Ready {
    fn default() -> Self {
        Self::Fifo(VecDeque::new())
    }
}

/// One FIFO per priority `0 ..= max`, and which of them hold messages.
#[derive(Debug)]
pub(crate) struct Levels {
    /// Index: the priority.
    fifos: Vec<VecDeque<Entry>>,
    /// Bit `p` set: `fifos[p]` is not empty.
    nonempty: [u64; 4],
    len: usize,
}

impl Levels {
    fn new(max: u8) -> Self {
        Self {
            fifos: (0..=max).map(|_| VecDeque::new()).collect(),
            nonempty: [0; 4],
            len: 0,
        }
    }

    /// The highest priority that holds a message.
    fn top(&self) -> Option<usize> {
        (0..4).rev().find_map(|w| {
            let bits = self.nonempty[w];
            (bits != 0).then(|| w * 64 + 63 - bits.leading_zeros() as usize)
        })
    }

    fn mark(&mut self, p: usize) {
        let (w, b) = (p / 64, p % 64);
        if self.fifos[p].is_empty() {
            self.nonempty[w] &= !(1 << b);
        } else {
            self.nonempty[w] |= 1 << b;
        }
    }

    /// The level of a message: its priority, at most the queue's maximum.
    fn level(&self, e: &Entry) -> usize {
        usize::from(e.priority).min(self.fifos.len() - 1)
    }
}

impl Ready {
    /// Empty; with priorities `0 ..= max` if `max_priority` is given.
    pub(crate) fn new(max_priority: Option<u8>) -> Self {
        match max_priority {
            None => Self::Fifo(VecDeque::new()),
            Some(max) => Self::Prio(Levels::new(max)),
        }
    }

    /// The priority a message asking for `requested` gets: capped at the
    /// maximum, always 0 without priorities.
    pub(crate) fn priority_for(&self, requested: u8) -> u8 {
        match self {
            Self::Fifo(_) => 0,
            Self::Prio(l) => requested.min((l.fifos.len() - 1) as u8),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Fifo(d) => d.len(),
            Self::Prio(l) => l.len,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The next message to deliver.
    pub(crate) fn front(&self) -> Option<&Entry> {
        match self {
            Self::Fifo(d) => d.front(),
            Self::Prio(l) => l.fifos[l.top()?].front(),
        }
    }

    /// Takes the next message to deliver.
    pub(crate) fn pop_front(&mut self) -> Option<Entry> {
        match self {
            Self::Fifo(d) => d.pop_front(),
            Self::Prio(l) => {
                let p = l.top()?;
                let e = l.fifos[p].pop_front();
                l.mark(p);
                l.len -= 1;
                e
            }
        }
    }

    /// Adds a message behind every other of its priority (its seq is the
    /// highest so far, or the messages come in seq order).
    pub(crate) fn push_back(&mut self, e: Entry) {
        match self {
            Self::Fifo(d) => d.push_back(e),
            Self::Prio(l) => {
                let p = l.level(&e);
                l.fifos[p].push_back(e);
                l.mark(p);
                l.len += 1;
            }
        }
    }

    /// Puts a message back at its place by seq within its priority.
    pub(crate) fn insert_by_seq(&mut self, e: Entry) {
        match self {
            Self::Fifo(d) => insert_sorted(d, e),
            Self::Prio(l) => {
                let p = l.level(&e);
                insert_sorted(&mut l.fifos[p], e);
                l.mark(p);
                l.len += 1;
            }
        }
    }

    /// Takes every ready message out, head first.
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = Entry> + '_ {
        if let Self::Prio(l) = self {
            l.nonempty = [0; 4];
            l.len = 0;
        }
        self.fifos_mut().iter_mut().rev().flat_map(std::mem::take)
    }

    /// The FIFOs, lowest priority first (one for a queue without priorities).
    fn fifos(&self) -> &[VecDeque<Entry>] {
        match self {
            Self::Fifo(d) => std::slice::from_ref(d),
            Self::Prio(l) => &l.fifos,
        }
    }

    fn fifos_mut(&mut self) -> &mut [VecDeque<Entry>] {
        match self {
            Self::Fifo(d) => std::slice::from_mut(d),
            Self::Prio(l) => &mut l.fifos,
        }
    }

    /// Every ready message, head first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Entry> + '_ {
        self.fifos().iter().rev().flat_map(VecDeque::iter)
    }

    /// Every ready message, head first, mutably (their order must not change).
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Entry> + '_ {
        self.fifos_mut()
            .iter_mut()
            .rev()
            .flat_map(VecDeque::iter_mut)
    }
}

impl Extend<Entry> for Ready {
    /// Adds messages in seq order, each behind those of its priority.
    fn extend<I: IntoIterator<Item = Entry>>(&mut self, iter: I) {
        match self {
            Self::Fifo(d) => d.extend(iter),
            Self::Prio(_) => iter.into_iter().for_each(|e| self.push_back(e)),
        }
    }
}

/// Inserts `e` into `d` (ordered by seq) at its place.
fn insert_sorted(d: &mut VecDeque<Entry>, e: Entry) {
    match d.back() {
        Some(b) if b.seq > e.seq => {
            let pos = d.partition_point(|x| x.seq < e.seq);
            d.insert(pos, e);
        }
        _ => d.push_back(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::StoreRef;
    use crate::message::NewMessage;

    fn entry(seq: u64, priority: u8) -> Entry {
        let mut m = NewMessage::new(seq, "x", false);
        m.priority = priority;
        let mut e = Entry::new_message(&m, u64::MAX, StoreRef::NONE);
        e.seq = seq;
        e
    }

    fn seqs(r: &Ready) -> Vec<u64> {
        r.iter().map(|e| e.seq).collect()
    }

    #[test]
    fn fifo_ignores_priorities() {
        let mut r = Ready::new(None);
        assert_eq!(r.priority_for(9), 0);
        r.push_back(entry(1, 0));
        r.push_back(entry(2, 0));
        assert_eq!(seqs(&r), [1, 2]);
    }

    #[test]
    fn highest_priority_first_fifo_within() {
        let mut r = Ready::new(Some(255));
        for (seq, p) in [(1, 0), (2, 200), (3, 64), (4, 200), (5, 63), (6, 255)] {
            r.push_back(entry(seq, p));
        }
        assert_eq!(seqs(&r), [6, 2, 4, 3, 5, 1]);
        assert_eq!(r.front().map(|e| e.seq), Some(6));
        let mut out = Vec::new();
        while let Some(e) = r.pop_front() {
            out.push(e.seq);
        }
        assert_eq!(out, [6, 2, 4, 3, 5, 1]);
        assert!(r.is_empty());
        assert!(r.front().is_none());
    }

    #[test]
    fn requeue_goes_back_to_its_place_in_its_priority() {
        let mut r = Ready::new(Some(3));
        for (seq, p) in [(1, 1), (2, 3), (3, 1), (4, 3)] {
            r.push_back(entry(seq, p));
        }
        let a = r.pop_front().unwrap();
        let b = r.pop_front().unwrap();
        let c = r.pop_front().unwrap();
        assert_eq!([a.seq, b.seq, c.seq], [2, 4, 1]);
        r.insert_by_seq(b);
        r.insert_by_seq(c);
        r.insert_by_seq(a);
        assert_eq!(seqs(&r), [2, 4, 1, 3]);
        assert_eq!(r.len(), 4);
        assert_eq!(r.drain().map(|e| e.seq).collect::<Vec<_>>(), [2, 4, 1, 3]);
        assert!(r.is_empty() && r.front().is_none());
    }

    #[test]
    fn priorities_above_the_maximum_count_as_the_maximum() {
        let mut r = Ready::new(Some(2));
        assert_eq!(r.priority_for(7), 2);
        r.push_back(entry(1, 2));
        r.push_back(entry(2, 7));
        r.push_back(entry(3, 1));
        assert_eq!(seqs(&r), [1, 2, 3]);
    }
}
