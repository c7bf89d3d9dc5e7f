//! Warren's GM ring: guaranteed multicast among the members of one group
//! (one ring per mirrored queue), after RabbitMQ's `gm.erl`.
//!
//! The members form a ring. A broadcast travels rightwards through every
//! member and comes back to its publisher, which then knows that every member
//! has it and *confirms* it; an ack follows it round so that members can drop
//! the copies they keep for retransmission. When a member dies, the next alive
//! member to its right *inherits* it (finishes its laps), and every member
//! sends its whole state (a *catchup*) to its right neighbour after every view
//! change, which re-sends whatever a dead or cut-off member may not have passed
//! on. Who is in the ring is not decided by the ring: it is decided by a
//! [`ViewAuthority`] through compare-and-set on the view version, so that all
//! membership changes are totally ordered.
//!
//! # Layers
//!
//! - [`Member`]: the sans-IO state machine. No clock, no sockets, no threads,
//!   no randomness, no hash maps with random state: input in, [`Action`]s out.
//! - [`View`], [`ViewChange`], [`ViewAuthority`], [`InMemoryAuthority`]: views
//!   (ordered ring, dead aliases, a version that only grows) and who decides them.
//! - [`Frame`]: what neighbours send; every frame carries its sender's view
//!   version, and frames of an older view than the receiver's are refused.
//! - [`GmNode`] (module [`driver`]): the tokio driver that runs a node's
//!   members over any `warren_transport::Transport`, one connection per pair
//!   of nodes shared by all rings, with a pluggable [`FailureDetector`]
//!   ([`HeartbeatDetector`]) whose suspicions become view changes. Only this
//!   module (and [`detector`], for its `Instant`) knows tokio.
//!
//! # Driving a [`Member`]
//!
//! 1. Create it with [`Member::new`], propose [`ViewChange::Join`] to the
//!    authority, and hand it every view it should know with
//!    [`Member::handle_view`] (pushed after changes, and fetched when it asks
//!    with [`Action::NeedView`]). Older views are ignored.
//! 2. After every input, drain [`Member::poll_action`] and carry the actions
//!    out in order: `Send` to the member `to` (its node is in the view entry),
//!    `Deliver`/`Confirm` to the application, `Erase` and `JoinFailed` as
//!    changes to the authority (`JoinFailed`: remove it, then join afresh
//!    under a new id), `Removed`: the member is inert.
//! 3. Call [`Member::flush`] when the input queue runs dry and
//!    [`Member::handle_tick`] periodically: outgoing publishes and acks are
//!    batched until then (or until a batch is full).
//! 4. Frames between two members must arrive in order. If some may have been
//!    lost (a connection broke), call [`Member::handle_link_reset`] on both
//!    sides before handing over any later frame on that link.
//!
//! # Guarantees
//!
//! A member *joins* at the version of the view that spliced it in
//! ([`ViewEntry::joined_at`]); a message is *broadcast at* the view version
//! its publisher had installed when it called [`Member::broadcast`]. A member
//! *stays in the view* if it is never removed (by death, failure suspicion or
//! a failed join). Given links that are FIFO and lose frames only when a
//! member dies, a link is reset ([`Member::handle_link_reset`]) or the view
//! changes, these hold:
//!
//! 1. **Exactly-once, per-sender FIFO.** Every message broadcast by a member
//!    that stays in the view is delivered exactly once to every member that
//!    stays in the view and joined at or before the message's broadcast view,
//!    in the sender's order and without gaps. Even when the sender dies, a
//!    member never delivers a message twice or out of order, and if one member
//!    that stays in the view delivers it, all of them (that joined before it
//!    was broadcast) do.
//! 2. **Confirms.** A [`Action::Confirm`] of `N` means: every member alive in
//!    the publisher's view at that moment that joined at or before `N`'s
//!    broadcast view has delivered `N` and everything the publisher broadcast
//!    before `N`.
//! 3. **Joiners.** A member that joins delivers every message broadcast at its
//!    join version or later, and none broadcast before.
//! 4. **The ring drains.** Once broadcasts stop and faults heal, every member's
//!    pending buffer empties ([`Member::pending_len`] is 0), every own
//!    broadcast of a member that stays is confirmed, and the dead members'
//!    aliases are erased from the view.
//!
//! Not guaranteed (as in gm.erl): any order between different senders
//! (causal or total), or delivery of messages whose sender died before any
//! member that stays received them.
//!
//! These are checked by the deterministic simulation in `tests/sim/` over
//! more than a thousand seeds; a failing seed prints the command that replays it.

#[cfg(feature = "driver")]
pub mod authority;
#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(feature = "driver")]
pub mod detector;
#[cfg(feature = "driver")]
pub mod driver;
pub mod event;
pub mod frame;
pub mod member;
pub mod view;

#[cfg(feature = "driver")]
pub use authority::{InMemoryAuthority, ViewAuthority};
#[cfg(feature = "driver")]
pub use detector::{FailureDetector, HeartbeatDetector};
#[cfg(feature = "driver")]
pub use driver::{DriverError, GmNode, NodeConfig, ReadyHook, RingHandle, abort_if_panics};
pub use event::RingEvent;
pub use frame::{Frame, FrameKind, Pub, Seq, StreamBatch};
pub use member::{Action, Config, GmError, Member, Phase};
pub use view::{MemberId, View, ViewChange, ViewEntry, ViewError, ViewVersion};
pub use warren_wire::NodeName;
