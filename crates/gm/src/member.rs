//! The sans-IO ring member.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bytes::Bytes;

use crate::frame::{Frame, FrameKind, PUB_OVERHEAD, Pub, Seq, StreamBatch};
use crate::view::{MemberId, View, ViewVersion};

/// Tuning knobs of a [`Member`].
#[derive(Debug, Clone)]
pub struct Config {
    /// Flush the outgoing batch once it holds about this many bytes.
    pub batch_bytes_max: usize,
    /// Frames of a newer view held until that view is installed; beyond this
    /// they are dropped and a catchup is asked for instead.
    pub stash_frames_max: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            batch_bytes_max: 256 * 1024,
            stash_frames_max: 4096,
        }
    }
}

/// Where a member is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Not yet in any installed view.
    Waiting,
    /// In the view, waiting for its left neighbour's catchup (its initial state).
    Joining,
    /// Carrying messages.
    Ready,
    /// Out of the ring (dead, removed or failed to join); inert.
    Removed,
}

/// What a [`Member`] asks its driver to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send `frame` to member `to` (always the right neighbour, or the left for `NeedCatchup`).
    Send {
        /// The receiver.
        to: MemberId,
        /// The frame.
        frame: Frame,
    },
    /// Hand a broadcast to the application: per publisher in sequence order, exactly once.
    Deliver {
        /// Who broadcast it.
        publisher: MemberId,
        /// Its sequence number.
        seq: Seq,
        /// The payload.
        payload: Bytes,
    },
    /// Every own broadcast up to `up_to` has been delivered by every member of the current view.
    Confirm {
        /// The highest confirmed sequence number (cumulative).
        up_to: Seq,
    },
    /// A view was installed.
    ViewInstalled {
        /// Its version.
        version: ViewVersion,
    },
    /// A frame of a newer view arrived: fetch the authority's current view and install it.
    NeedView {
        /// The version seen.
        version: ViewVersion,
    },
    /// Ask the authority to erase the dead member `dead`: nothing of it is in flight any more.
    Erase {
        /// The dead member this member inherited.
        dead: MemberId,
    },
    /// The joiner lost its left neighbour before getting its state: ask the authority to
    /// remove it, then join again under a new id. The member is inert from now on.
    JoinFailed,
    /// A view without this member (or with it dead) was installed: it is inert from now on.
    Removed,
}

/// Why a [`Member::broadcast`] was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GmError {
    /// No view with this member has been installed yet.
    #[error("not joined yet: no view with this member installed")]
    NotJoined,
    /// The member has left the ring.
    #[error("the member is out of the ring")]
    Removed,
}

/// One publisher's stream as this member knows it (gm.erl's `#member{}`).
#[derive(Debug, Default, Clone)]
struct Stream {
    /// Broadcast and not yet acked, in sequence order: `(last_ack, last_pub]`.
    pending: VecDeque<Pub>,
    last_pub: Seq,
    last_ack: Seq,
}

impl Stream {
    fn retire(&mut self, up_to: Seq) {
        self.last_ack = self.last_ack.max(up_to);
        self.last_pub = self.last_pub.max(up_to);
        while self.pending.front().is_some_and(|p| p.seq <= up_to) {
            self.pending.pop_front();
        }
    }
}

/// The outgoing batch for the right neighbour.
#[derive(Debug, Default)]
struct Outbox {
    streams: Vec<StreamBatch>,
    bytes: usize,
}

impl Outbox {
    fn batch(&mut self, publisher: MemberId) -> &mut StreamBatch {
        let idx = match self.streams.iter().rposition(|b| b.publisher == publisher) {
            Some(i) => i,
            None => {
                self.streams.push(StreamBatch {
                    publisher,
                    pubs: Vec::new(),
                    ack: 0,
                });
                self.streams.len() - 1
            }
        };
        &mut self.streams[idx]
    }

    fn push_pub(&mut self, publisher: MemberId, p: Pub) {
        self.bytes += p.payload.len() + PUB_OVERHEAD;
        self.batch(publisher).pubs.push(p);
    }

    fn push_ack(&mut self, publisher: MemberId, seq: Seq) {
        self.bytes += PUB_OVERHEAD;
        let b = self.batch(publisher);
        b.ack = b.ack.max(seq);
    }

    fn clear(&mut self) {
        self.streams.clear();
        self.bytes = 0;
    }
}

/// One member of a GM ring, as a sans-IO state machine.
///
/// Inputs: [`handle_view`](Self::handle_view), [`handle_frame`](Self::handle_frame),
/// [`broadcast`](Self::broadcast), [`handle_tick`](Self::handle_tick),
/// [`flush`](Self::flush) and [`handle_link_reset`](Self::handle_link_reset).
/// Outputs: [`Action`]s, drained with [`poll_action`](Self::poll_action) after
/// every input. Outgoing publishes and acks are batched: a frame leaves when
/// the batch reaches [`Config::batch_bytes_max`], on `flush` and on
/// `handle_tick`. Drivers call `flush` when their input queue runs dry.
#[derive(Debug)]
pub struct Member {
    id: MemberId,
    config: Config,
    phase: Phase,
    view: View,
    join_version: ViewVersion,
    founder: bool,
    left: MemberId,
    right: MemberId,
    inherited: Vec<MemberId>,
    streams: BTreeMap<MemberId, Stream>,
    own_seq: Seq,
    confirmed: Seq,
    held: Vec<Pub>,
    out: Outbox,
    stash: Vec<Frame>,
    stash_dropped: bool,
    view_requested: ViewVersion,
    needs_catchup: bool,
    erase_asked: BTreeSet<MemberId>,
    refused_frames: u64,
    actions: VecDeque<Action>,
}

impl Member {
    /// A member that will join once a view containing it is installed.
    pub fn new(id: MemberId, config: Config) -> Self {
        Self {
            id,
            config,
            phase: Phase::Waiting,
            view: View::empty(),
            join_version: 0,
            founder: false,
            left: id,
            right: id,
            inherited: Vec::new(),
            streams: BTreeMap::new(),
            own_seq: 0,
            confirmed: 0,
            held: Vec::new(),
            out: Outbox::default(),
            stash: Vec::new(),
            stash_dropped: false,
            view_requested: 0,
            needs_catchup: false,
            erase_asked: BTreeSet::new(),
            refused_frames: 0,
            actions: VecDeque::new(),
        }
    }

    /// This member's id.
    pub fn id(&self) -> MemberId {
        self.id
    }

    /// Where the member is in its life.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The installed view (empty before the first).
    pub fn view(&self) -> &View {
        &self.view
    }

    /// The version of the view that spliced this member in.
    pub fn join_version(&self) -> ViewVersion {
        self.join_version
    }

    /// The last own sequence number broadcast.
    pub fn last_broadcast(&self) -> Seq {
        self.own_seq
    }

    /// The highest own sequence number confirmed.
    pub fn last_confirmed(&self) -> Seq {
        self.confirmed
    }

    /// Messages held for retransmission (broadcast, not yet acked), over all publishers.
    pub fn pending_len(&self) -> usize {
        self.streams
            .values()
            .map(|s| s.pending.len())
            .sum::<usize>()
            + self.held.len()
    }

    /// Frames refused so far (older view, wrong sender, malformed for this member).
    pub fn refused_frames(&self) -> u64 {
        self.refused_frames
    }

    /// The next action for the driver, if any.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Whether actions wait to be drained.
    pub fn has_actions(&self) -> bool {
        !self.actions.is_empty()
    }

    /// All actions for the driver, in order.
    pub fn drain_actions(&mut self) -> impl Iterator<Item = Action> + '_ {
        self.actions.drain(..)
    }

    /// Broadcasts `payload` to every member; returns its sequence number.
    ///
    /// The member delivers it to itself at once. Before the joiner has its
    /// state the message is held, and sent once it has.
    pub fn broadcast(&mut self, payload: Bytes) -> Result<Seq, GmError> {
        match self.phase {
            Phase::Waiting => return Err(GmError::NotJoined),
            Phase::Removed => return Err(GmError::Removed),
            Phase::Joining | Phase::Ready => {}
        }
        self.own_seq += 1;
        let seq = self.own_seq;
        self.actions.push_back(Action::Deliver {
            publisher: self.id,
            seq,
            payload: payload.clone(),
        });
        let p = Pub {
            seq,
            view: self.view.version,
            payload,
        };
        if self.phase == Phase::Joining {
            self.held.push(p);
        } else {
            self.release(p);
        }
        Ok(seq)
    }

    fn release(&mut self, p: Pub) {
        let st = self.streams.entry(self.id).or_default();
        st.last_pub = p.seq;
        st.pending.push_back(p.clone());
        if self.right != self.id {
            self.out.push_pub(self.id, p);
            self.flush_if_full();
        }
    }

    fn flush_if_full(&mut self) {
        if self.out.bytes >= self.config.batch_bytes_max {
            self.flush();
        }
    }

    /// Sends the outgoing batch now (and, alone in the ring, confirms everything).
    pub fn flush(&mut self) {
        if self.phase != Phase::Ready {
            return;
        }
        if self.right == self.id {
            self.complete_alone();
            return;
        }
        if self.out.streams.is_empty() {
            return;
        }
        let frame = Frame {
            view: self.view.version,
            from: self.id,
            kind: FrameKind::Activity,
            streams: std::mem::take(&mut self.out.streams),
        };
        self.out.bytes = 0;
        self.actions.push_back(Action::Send {
            to: self.right,
            frame,
        });
    }

    /// A timer tick: flushes the outgoing batch.
    pub fn handle_tick(&mut self) {
        self.flush();
    }

    /// Alone in the ring, every message has gone all the way round.
    fn complete_alone(&mut self) {
        let owned: Vec<MemberId> = std::iter::once(self.id)
            .chain(self.inherited.iter().copied())
            .collect();
        for p in owned {
            if let Some(st) = self.streams.get_mut(&p)
                && st.last_pub > st.last_ack
            {
                let top = st.last_pub;
                st.retire(top);
                if p == self.id {
                    self.confirm(top);
                }
            }
        }
        self.ask_erasures();
    }

    fn confirm(&mut self, up_to: Seq) {
        if up_to > self.confirmed {
            self.confirmed = up_to;
            self.actions.push_back(Action::Confirm { up_to });
        }
    }

    /// The link to `peer` was reset (frames may have been lost): resend state
    /// to it if it is the right neighbour, ask it for state if it is the left.
    pub fn handle_link_reset(&mut self, peer: MemberId) {
        if self.phase != Phase::Ready || self.right == self.id {
            return;
        }
        if peer == self.right {
            self.send_catchup();
        }
        if peer == self.left {
            self.request_catchup();
        }
    }

    fn request_catchup(&mut self) {
        self.needs_catchup = true;
        self.actions.push_back(Action::Send {
            to: self.left,
            frame: Frame {
                view: self.view.version,
                from: self.id,
                kind: FrameKind::NeedCatchup,
                streams: Vec::new(),
            },
        });
    }

    /// Sends the whole state to the right neighbour (split into frames by size).
    fn send_catchup(&mut self) {
        self.out.clear();
        let mut frames = Vec::new();
        let mut current: Vec<StreamBatch> = Vec::new();
        let mut bytes = 0;
        for (&publisher, st) in &self.streams {
            let mut batch = StreamBatch {
                publisher,
                pubs: Vec::new(),
                ack: st.last_ack,
            };
            for p in &st.pending {
                if bytes >= self.config.batch_bytes_max {
                    current.push(std::mem::replace(
                        &mut batch,
                        StreamBatch {
                            publisher,
                            pubs: Vec::new(),
                            ack: st.last_ack,
                        },
                    ));
                    frames.push(std::mem::take(&mut current));
                    bytes = 0;
                }
                bytes += p.payload.len() + PUB_OVERHEAD;
                batch.pubs.push(p.clone());
            }
            current.push(batch);
        }
        frames.push(current);
        let count = frames.len();
        for (i, streams) in frames.into_iter().enumerate() {
            let kind = FrameKind::Catchup {
                last: i + 1 == count,
            };
            self.actions.push_back(Action::Send {
                to: self.right,
                frame: Frame {
                    view: self.view.version,
                    from: self.id,
                    kind,
                    streams,
                },
            });
        }
    }

    /// Installs a view from the authority (older or equal versions are ignored).
    pub fn handle_view(&mut self, view: View) {
        if self.phase == Phase::Removed || view.version <= self.view.version {
            return;
        }
        let entry = view.entry(self.id).cloned();
        match entry {
            None if self.phase == Phase::Waiting => return,
            Some(e) if e.alive => {
                if self.phase == Phase::Waiting {
                    self.phase = Phase::Joining;
                    self.join_version = e.joined_at;
                    self.founder = e.sponsor.is_none();
                }
            }
            _ => {
                self.view = view;
                self.phase = Phase::Removed;
                self.actions.push_back(Action::Removed);
                return;
            }
        }
        self.install(view);
    }

    fn install(&mut self, view: View) {
        let Some((left, right)) = view.left_of(self.id).zip(view.right_of(self.id)) else {
            return;
        };
        self.left = left;
        self.right = right;
        self.inherited = view.inherited_by(self.id);
        self.streams.retain(|p, _| view.entry(*p).is_some());
        self.view = view;
        self.out.clear();
        self.erase_asked.clear();
        self.actions.push_back(Action::ViewInstalled {
            version: self.view.version,
        });
        if self.phase == Phase::Joining {
            if !self.inherited.is_empty() {
                // The left neighbour died before handing over its state: this
                // member cannot know what it inherited (gm.erl's Lemma 2).
                self.phase = Phase::Removed;
                self.actions.push_back(Action::JoinFailed);
                return;
            }
            if self.right == self.id || self.founder {
                // A fresh ring has nothing in flight: start from empty state.
                self.become_ready();
            }
        } else if self.right == self.id {
            self.complete_alone();
        } else {
            self.needs_catchup = true;
            self.send_catchup();
            if self.stash_dropped {
                self.request_catchup();
            }
            self.ask_erasures();
        }
        self.stash_dropped = false;
        let version = self.view.version;
        let stash = std::mem::take(&mut self.stash);
        let (now, later): (Vec<_>, Vec<_>) = stash
            .into_iter()
            .filter(|f| f.view >= version)
            .partition(|f| f.view == version);
        self.stash = later;
        for frame in now {
            self.process(frame);
        }
    }

    fn become_ready(&mut self) {
        self.phase = Phase::Ready;
        self.needs_catchup = false;
        if self.right != self.id {
            self.send_catchup();
        }
        for p in std::mem::take(&mut self.held) {
            self.release(p);
        }
        if self.right == self.id {
            self.complete_alone();
        }
    }

    /// Handles a frame from a neighbour. Frames of an older view, from a
    /// member that is not the neighbour, or otherwise unexpected are refused
    /// (counted, never a panic); frames of a newer view wait for that view.
    pub fn handle_frame(&mut self, frame: Frame) {
        if self.phase == Phase::Removed || frame.view < self.view.version {
            self.refused_frames += 1;
            return;
        }
        if frame.view > self.view.version {
            if self.stash.len() >= self.config.stash_frames_max {
                self.stash_dropped = true;
                self.refused_frames += 1;
            } else {
                self.stash.push(frame.clone());
            }
            if frame.view > self.view_requested {
                self.view_requested = frame.view;
                self.actions.push_back(Action::NeedView {
                    version: frame.view,
                });
            }
            return;
        }
        self.process(frame);
    }

    fn process(&mut self, frame: Frame) {
        match frame.kind {
            FrameKind::NeedCatchup => {
                if frame.from == self.right && self.phase == Phase::Ready && self.right != self.id {
                    self.send_catchup();
                } else {
                    self.refused_frames += 1;
                }
            }
            FrameKind::Activity | FrameKind::Catchup { .. } => {
                if frame.from != self.left || self.left == self.id {
                    self.refused_frames += 1;
                    return;
                }
                let catchup = frame.kind != FrameKind::Activity;
                match self.phase {
                    Phase::Joining if catchup => {
                        for batch in frame.streams {
                            self.on_stream(batch);
                        }
                        // The joiner's own catchup carries everything to the right.
                        self.out.clear();
                        // Only a whole catchup is a state (gm.erl's Lemma 2): if
                        // the left dies half-way, the join fails.
                        if frame.kind == (FrameKind::Catchup { last: true }) {
                            self.become_ready();
                        }
                    }
                    Phase::Ready if catchup || !self.needs_catchup => {
                        self.needs_catchup = false;
                        for batch in frame.streams {
                            self.on_stream(batch);
                        }
                        self.flush_if_full();
                    }
                    _ => self.refused_frames += 1,
                }
            }
        }
    }

    fn on_stream(&mut self, batch: StreamBatch) {
        let p = batch.publisher;
        if self.view.entry(p).is_none() {
            return;
        }
        if p == self.id || self.inherited.contains(&p) {
            self.on_owned_stream(batch);
        } else {
            self.on_passing_stream(batch);
        }
    }

    /// Publishes of someone upstream: deliver what is new, keep it, pass it on.
    /// The publisher itself, when it is the right neighbour, gets them back
    /// without their payloads: it only counts them (its own messages came
    /// round), and this member keeps the whole messages for any catchup.
    fn on_passing_stream(&mut self, batch: StreamBatch) {
        let p = batch.publisher;
        let join_version = self.join_version;
        let back_to_publisher = self.right == p;
        let st = self.streams.entry(p).or_default();
        for msg in batch.pubs {
            if msg.seq <= st.last_pub {
                continue;
            }
            if msg.view >= join_version {
                self.actions.push_back(Action::Deliver {
                    publisher: p,
                    seq: msg.seq,
                    payload: msg.payload.clone(),
                });
            }
            st.last_pub = msg.seq;
            st.pending.push_back(msg.clone());
            if back_to_publisher {
                self.out.push_pub(
                    p,
                    Pub {
                        payload: Bytes::new(),
                        ..msg
                    },
                );
            } else {
                self.out.push_pub(p, msg);
            }
        }
        if batch.ack > st.last_ack {
            st.retire(batch.ack);
            self.out.push_ack(p, batch.ack);
        }
    }

    /// Own (or inherited) publishes coming back round: confirm them and start the ack lap.
    fn on_owned_stream(&mut self, batch: StreamBatch) {
        let p = batch.publisher;
        let own = p == self.id;
        let join_version = self.join_version;
        let st = self.streams.entry(p).or_default();
        let old_ack = st.last_ack;
        let mut top = old_ack;
        for msg in batch.pubs {
            if msg.seq <= old_ack {
                continue;
            }
            if msg.seq > st.last_pub {
                if own {
                    continue; // never broadcast: bad input
                }
                if msg.view >= join_version {
                    self.actions.push_back(Action::Deliver {
                        publisher: p,
                        seq: msg.seq,
                        payload: msg.payload,
                    });
                }
                st.last_pub = msg.seq;
            }
            top = top.max(msg.seq);
        }
        // An inherited publisher's own acks came round: retire, do not pass on.
        if !own && batch.ack > st.last_ack {
            st.retire(batch.ack);
        }
        if top > st.last_ack {
            st.retire(top);
            self.out.push_ack(p, top);
            if own {
                self.confirm(top);
            }
        }
        if !own {
            self.ask_erasures();
        }
    }

    /// Asks for the erasure of inherited dead members with nothing left in flight.
    fn ask_erasures(&mut self) {
        for &dead in &self.inherited {
            let drained = self
                .streams
                .get(&dead)
                .is_none_or(|st| st.last_ack >= st.last_pub);
            if drained && self.erase_asked.insert(dead) {
                self.actions.push_back(Action::Erase { dead });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::ViewChange;

    fn views(ids: &[u64]) -> Vec<View> {
        let mut v = View::empty();
        let mut out = Vec::new();
        let mut prev = None;
        for &id in ids {
            v = v
                .apply(&ViewChange::Join {
                    member: MemberId(id),
                    after: prev,
                    node: warren_wire::NodeName::new("n@test").unwrap(),
                })
                .unwrap();
            prev = Some(MemberId(id));
            out.push(v.clone());
        }
        out
    }

    #[test]
    fn alone_confirms_on_flush() {
        let mut m = Member::new(MemberId(1), Config::default());
        assert_eq!(m.broadcast(Bytes::new()), Err(GmError::NotJoined));
        m.handle_view(views(&[1])[0].clone());
        assert_eq!(m.phase(), Phase::Ready);
        assert_eq!(m.broadcast(Bytes::from_static(b"a")).unwrap(), 1);
        assert_eq!(m.broadcast(Bytes::from_static(b"b")).unwrap(), 2);
        m.flush();
        let actions: Vec<_> = m.drain_actions().collect();
        assert_eq!(
            actions,
            vec![
                Action::ViewInstalled { version: 1 },
                Action::Deliver {
                    publisher: MemberId(1),
                    seq: 1,
                    payload: Bytes::from_static(b"a")
                },
                Action::Deliver {
                    publisher: MemberId(1),
                    seq: 2,
                    payload: Bytes::from_static(b"b")
                },
                Action::Confirm { up_to: 2 },
            ]
        );
        assert_eq!(m.pending_len(), 0);
    }

    #[test]
    fn frames_of_older_views_and_strangers_are_refused() {
        let vs = views(&[1, 2, 3]);
        let mut m = Member::new(MemberId(2), Config::default());
        m.handle_view(vs[1].clone());
        m.handle_view(vs[2].clone());
        let frame = |view, from, kind| Frame {
            view,
            from: MemberId(from),
            kind,
            streams: vec![],
        };
        m.handle_frame(frame(2, 1, FrameKind::Catchup { last: true }));
        m.handle_frame(frame(3, 3, FrameKind::Catchup { last: true }));
        assert_eq!(m.refused_frames(), 2);
        assert_eq!(m.phase(), Phase::Joining);
        m.handle_frame(frame(3, 1, FrameKind::Catchup { last: false }));
        assert_eq!(m.phase(), Phase::Joining, "half a catchup is no state");
        m.handle_frame(frame(3, 1, FrameKind::Catchup { last: true }));
        assert_eq!(m.phase(), Phase::Ready);
        // A newer view's frame waits and asks for the view.
        m.handle_frame(frame(9, 1, FrameKind::Activity));
        assert!(
            m.drain_actions()
                .any(|a| a == Action::NeedView { version: 9 })
        );
    }

    #[test]
    fn messages_return_to_their_publisher_without_payloads() {
        let vs = views(&[1, 2, 3]);
        let mut m = Member::new(MemberId(3), Config::default());
        m.handle_view(vs[2].clone());
        let frame = |kind, streams| Frame {
            view: 3,
            from: MemberId(2),
            kind,
            streams,
        };
        m.handle_frame(frame(FrameKind::Catchup { last: true }, vec![]));
        assert_eq!(m.phase(), Phase::Ready);
        let batch = |publisher, payload| StreamBatch {
            publisher: MemberId(publisher),
            pubs: vec![Pub {
                seq: 1,
                view: 3,
                payload: Bytes::from_static(payload),
            }],
            ack: 0,
        };
        m.drain_actions().for_each(drop);
        m.handle_frame(frame(
            FrameKind::Activity,
            vec![batch(1, b"from 1"), batch(2, b"from 2")],
        ));
        m.flush();
        let actions: Vec<_> = m.drain_actions().collect();
        let delivered: Vec<_> = actions
            .iter()
            .filter_map(|a| match a {
                Action::Deliver { payload, .. } => Some(payload.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(delivered, [&b"from 1"[..], &b"from 2"[..]]);
        let Some(Action::Send { to, frame }) = actions.last() else {
            panic!("no frame sent: {actions:?}");
        };
        assert_eq!(*to, MemberId(1));
        let payloads: Vec<_> = frame
            .streams
            .iter()
            .map(|b| (b.publisher, b.pubs[0].payload.clone()))
            .collect();
        // Member 1 gets its own message back as a count; member 2's goes on whole.
        assert_eq!(
            payloads,
            [
                (MemberId(1), Bytes::new()),
                (MemberId(2), Bytes::from_static(b"from 2"))
            ]
        );
        // A catchup still carries the whole message.
        m.handle_link_reset(MemberId(1));
        let catchup = m.drain_actions().find_map(|a| match a {
            Action::Send { frame, .. } if frame.kind != FrameKind::Activity => Some(frame),
            _ => None,
        });
        let catchup = catchup.expect("a catchup to the right neighbour");
        assert!(
            catchup
                .streams
                .iter()
                .any(|b| b.publisher == MemberId(1) && b.pubs[0].payload == b"from 1"[..])
        );
    }
}
