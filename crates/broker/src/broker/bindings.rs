//! An exchange's bindings, with the indexes that route a message without
//! looking at every binding: a map of keys for direct exchanges and a trie
//! of pattern words for topic exchanges (RabbitMQ's own structure for
//! them). Each index is built on the first publish after a change.
//!
//! Before, every publish tested every binding: with 1,000 topic bindings
//! on an exchange, RabbitMQ's Java client published 21.6k msg/s through it
//! (16 k consumed), against 111k with none, and RabbitMQ 3.10 41.5k.

use std::borrow::Cow;
use std::cell::OnceCell;
use std::collections::HashMap;
use std::ops::Deref;

use super::state::Binding;
use crate::routing::Kind;

/// An exchange's bindings in the order they were made; reads as a slice.
#[derive(Debug, Default)]
pub(super) struct Bindings {
    list: Vec<Binding>,
    direct: OnceCell<HashMap<String, Vec<u32>>>,
    topic: OnceCell<TopicTrie>,
}

impl Deref for Bindings {
    type Target = [Binding];

    fn deref(&self) -> &[Binding] {
        &self.list
    }
}

impl<'a> IntoIterator for &'a Bindings {
    type Item = &'a Binding;
    type IntoIter = std::slice::Iter<'a, Binding>;

    fn into_iter(self) -> Self::IntoIter {
        self.list.iter()
    }
}

impl Bindings {
    /// Adds a binding.
    pub(super) fn push(&mut self, b: Binding) {
        self.list.push(b);
        self.changed();
    }

    /// Removes the binding at `pos`.
    pub(super) fn remove(&mut self, pos: usize) -> Binding {
        let b = self.list.remove(pos);
        self.changed();
        b
    }

    /// Keeps the bindings `keep` says to.
    pub(super) fn retain(&mut self, keep: impl FnMut(&Binding) -> bool) {
        self.list.retain(keep);
        self.changed();
    }

    fn changed(&mut self) {
        self.direct = OnceCell::new();
        self.topic = OnceCell::new();
    }

    /// The positions, in order, of the bindings that routing key `rk`
    /// matches on an exchange of `kind`; `None` for a kind that looks at
    /// every binding (fanout, headers).
    pub(super) fn matching(&self, kind: Kind, rk: &str) -> Option<Cow<'_, [u32]>> {
        match kind {
            Kind::Direct => {
                let index = self.direct.get_or_init(|| {
                    let mut m: HashMap<String, Vec<u32>> = HashMap::new();
                    for (i, b) in self.list.iter().enumerate() {
                        m.entry(b.key.clone()).or_default().push(i as u32);
                    }
                    m
                });
                Some(
                    index
                        .get(rk)
                        .map_or(Cow::Borrowed(&[][..]), |v| Cow::Borrowed(v.as_slice())),
                )
            }
            Kind::Topic => Some(Cow::Owned(
                self.topic
                    .get_or_init(|| TopicTrie::new(&self.list))
                    .matching(rk),
            )),
            Kind::Fanout | Kind::Headers => None,
        }
    }
}

/// A node of the trie: one word of a pattern.
#[derive(Debug, Default)]
struct Node {
    words: HashMap<String, usize>,
    star: Option<usize>,
    hash: Option<usize>,
    /// Reached by a `#`: it takes any number of words.
    is_hash: bool,
    /// The bindings whose pattern ends here.
    bindings: Vec<u32>,
}

/// Topic patterns, word by word (`*` one word, `#` zero or more).
#[derive(Debug)]
struct TopicTrie {
    nodes: Vec<Node>,
}

impl TopicTrie {
    fn new(bindings: &[Binding]) -> Self {
        let mut t = Self {
            nodes: vec![Node::default()],
        };
        for (i, b) in bindings.iter().enumerate() {
            let mut at = 0;
            for word in b.key.split('.') {
                at = t.child(at, word);
            }
            t.nodes[at].bindings.push(i as u32);
        }
        t
    }

    fn child(&mut self, at: usize, word: &str) -> usize {
        let next = self.nodes.len();
        let slot = match word {
            "*" => self.nodes[at].star.get_or_insert(next),
            "#" => self.nodes[at].hash.get_or_insert(next),
            w => self.nodes[at].words.entry(w.to_owned()).or_insert(next),
        };
        let child = *slot;
        if child == next {
            self.nodes.push(Node {
                is_hash: word == "#",
                ..Node::default()
            });
        }
        child
    }

    /// Adds `n` and every `#` below it reached by no word (each at most
    /// once, by `seen`).
    fn add(&self, n: usize, set: &mut Vec<usize>, seen: &mut [bool]) {
        let mut at = Some(n);
        while let Some(n) = at {
            if std::mem::replace(&mut seen[n], true) {
                return;
            }
            set.push(n);
            at = self.nodes[n].hash;
        }
    }

    /// The bindings whose pattern matches `key`, in order. The nodes that
    /// the key's words so far reach, as a set: at most (key words) × (nodes)
    /// steps, however many `#`s the patterns hold.
    fn matching(&self, key: &str) -> Vec<u32> {
        let mut seen = vec![false; self.nodes.len()];
        let mut active = Vec::new();
        self.add(0, &mut active, &mut seen);
        for word in key.split('.') {
            // Only the nodes reached so far are marked.
            for &n in &active {
                seen[n] = false;
            }
            let mut next = Vec::new();
            for &n in &active {
                let node = &self.nodes[n];
                if let Some(&c) = node.words.get(word) {
                    self.add(c, &mut next, &mut seen);
                }
                if let Some(c) = node.star {
                    self.add(c, &mut next, &mut seen);
                }
                if node.is_hash {
                    self.add(n, &mut next, &mut seen);
                }
            }
            active = next;
            if active.is_empty() {
                return Vec::new();
            }
        }
        let mut out: Vec<u32> = active
            .iter()
            .flat_map(|&n| self.nodes[n].bindings.iter().copied())
            .collect();
        out.sort_unstable();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::Dest;
    use crate::routing::topic_matches;
    use warren_amqp::amq_protocol::types::FieldTable;

    fn found(b: &Bindings, kind: Kind, rk: &str) -> Option<Vec<u32>> {
        b.matching(kind, rk).map(Cow::into_owned)
    }

    fn bindings(keys: &[&str]) -> Bindings {
        let mut b = Bindings::default();
        for k in keys {
            b.push(Binding {
                dest: Dest::Queue((*k).into()),
                key: (*k).to_owned(),
                args: FieldTable::default(),
            });
        }
        b
    }

    /// The trie agrees with `topic_matches` binding by binding, over every
    /// pattern and key of a few words from a small alphabet.
    #[test]
    fn the_topic_trie_matches_what_each_pattern_matches() {
        let words = ["a", "b", "*", "#", ""];
        let mut patterns = vec![String::new()];
        for _ in 0..3 {
            let longer: Vec<String> = patterns
                .iter()
                .flat_map(|p| words.iter().map(move |w| format!("{p}.{w}")))
                .collect();
            patterns.extend(longer);
        }
        let patterns: Vec<String> = patterns
            .iter()
            .map(|p| p.strip_prefix('.').unwrap_or(p).to_owned())
            .collect();
        let keys: Vec<&String> = patterns
            .iter()
            .filter(|p| !p.contains('*') && !p.contains('#'))
            .collect();
        let refs: Vec<&str> = patterns.iter().map(String::as_str).collect();
        let b = bindings(&refs);
        for key in keys {
            let want: Vec<u32> = (0..refs.len() as u32)
                .filter(|&i| topic_matches(refs[i as usize], key))
                .collect();
            assert_eq!(found(&b, Kind::Topic, key), Some(want), "key {key:?}");
        }
    }

    #[test]
    fn many_hashes_against_a_long_key_answer_at_once() {
        let pattern = format!("{}x", "#.".repeat(20));
        let b = bindings(&[&pattern, &format!("{}w", "#.".repeat(20))]);
        let key = ["w"; 40].join(".");
        assert_eq!(found(&b, Kind::Topic, &key), Some(vec![1]));
    }

    #[test]
    fn an_index_follows_every_change() {
        let mut b = bindings(&["k", "a.*", "k"]);
        assert_eq!(found(&b, Kind::Direct, "k"), Some(vec![0, 2]));
        assert_eq!(found(&b, Kind::Topic, "a.z"), Some(vec![1]));
        b.remove(0);
        assert_eq!(found(&b, Kind::Direct, "k"), Some(vec![1]));
        b.retain(|x| x.key != "a.*");
        assert_eq!(found(&b, Kind::Topic, "a.z"), Some(vec![]));
        b.push(Binding {
            dest: Dest::Queue("q".into()),
            key: "a.#".into(),
            args: FieldTable::default(),
        });
        assert_eq!(found(&b, Kind::Topic, "a"), Some(vec![1]));
        assert_eq!(found(&b, Kind::Fanout, "a"), None);
    }
}
