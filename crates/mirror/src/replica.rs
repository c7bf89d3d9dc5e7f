//! The sans-IO replica: one queue's master or mirror role as a state machine.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bytes::Bytes;
use warren_backing_queue::{
    BackingQueue, Delivery, DeliveryTag, Dropped, LazySnapshot, NewMessage, Op, OpOutcome,
    QueueConfig, QueueError, SeqId, Stats, StoreError, SyncJob,
};
use warren_gm::{MemberId, RingEvent, Seq, View, ViewVersion};
use warren_policy::{DEFAULT_SYNC_BATCH_SIZE, HaPolicy, PromoteOn, SyncMode};

use crate::held::{HeldPublishes, Holds};
use crate::wire::{Body, PublishId, RingMsg};

/// A queue record as the mirror layer sees it: the placement part of
/// `warren_cluster::QueueRecord`, by node name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordView {
    /// The record's view version (grows at every change).
    pub version: u64,
    /// The master's node.
    pub master: String,
    /// Mirror nodes, oldest first.
    pub mirrors: Vec<String>,
    /// Synchronised mirror nodes, in join order.
    pub synchronised: Vec<String>,
}

impl RecordView {
    fn same_placement(&self, other: &RecordView) -> bool {
        self.master == other.master
            && self.mirrors == other.mirrors
            && self.synchronised == other.synchronised
    }
}

/// Bytes of message bodies and properties a ring message gathers before it
/// takes no more messages: one carries at most this and one message more
/// (a broadcast of one turn's ops as a sync batch), so that however many
/// large messages a turn publishes or a sync sends, each fits a peer frame.
const RING_MSG_BYTES: usize = 4 << 20;

/// The mirroring settings of one queue (from its effective `ha-*` policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// `ha-sync-mode` (default manual).
    pub sync_mode: SyncMode,
    /// `ha-sync-batch-size` (default 4096).
    pub sync_batch_size: u64,
    /// `ha-promote-on-failure` (Warren's default: when-synced).
    pub promote_on_failure: PromoteOn,
    /// `ha-promote-on-shutdown` (default: when-synced).
    pub promote_on_shutdown: PromoteOn,
    /// `ha-min-sync-replicas` (default 1): confirms wait while fewer members
    /// (the master included) are synchronised.
    pub min_sync_replicas: u32,
    /// Keep dropped messages (expired, over the limits, rejected) for
    /// dead-lettering: reported as [`Output::Dropped`] on the master.
    pub report_dropped: bool,
    /// The queue's `x-max-priority` (an argument, not a policy key): every
    /// backing queue this replica makes is a priority queue with it, so that
    /// mirrors order messages as the master does.
    pub max_priority: Option<u8>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            sync_mode: SyncMode::Manual,
            sync_batch_size: DEFAULT_SYNC_BATCH_SIZE,
            promote_on_failure: PromoteOn::WhenSynced,
            promote_on_shutdown: PromoteOn::WhenSynced,
            min_sync_replicas: 1,
            report_dropped: false,
            max_priority: None,
        }
    }
}

impl Settings {
    /// The settings an `ha-*` policy gives (defaults where it is silent).
    pub fn from_policy(ha: &HaPolicy) -> Self {
        let d = Self::default();
        Self {
            sync_mode: ha.sync_mode(),
            sync_batch_size: ha.sync_batch_size(DEFAULT_SYNC_BATCH_SIZE).max(1),
            promote_on_failure: ha.promote_on_failure.unwrap_or(d.promote_on_failure),
            promote_on_shutdown: ha.promote_on_shutdown.unwrap_or(d.promote_on_shutdown),
            min_sync_replicas: ha.min_sync_replicas.map_or(1, |n| n.get()),
            report_dropped: false,
            max_priority: None,
        }
    }
}

/// Makes a fresh, empty backing queue for this replica (durable queues: an
/// empty log directory, old content deleted). The replica sets `record_ops`.
pub type QueueFactory = Box<dyn FnMut(QueueConfig) -> Result<BackingQueue, StoreError> + Send>;

/// Why a replica refused an operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MirrorError {
    /// Only the master serves this; the caller should forward to it.
    #[error("this replica is not the queue's master")]
    NotMaster,
    /// The replica has stopped (deposed, removed from the ring, or shut down).
    #[error("the replica has stopped")]
    Stopped,
    /// The master is stopping (handing over or shutting down): it takes
    /// no new work; the next master will.
    #[error("the queue's master is stopping")]
    Stopping,
    /// The queue has no mirror to synchronise.
    #[error("the queue is not mirrored")]
    NotMirrored,
    /// This node is cut off from a majority of the cluster: the master
    /// takes no publish it could not replicate.
    #[error("this node is cut off from a majority of the cluster")]
    Isolated,
    /// The backing queue refused the operation.
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// Making a fresh backing queue failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A publish that may be held already ([`Replica::publish_again`])
    /// came to a master that cannot tell: it started from a copy whose
    /// holdings it does not know (recovered from disk), and has heard
    /// nothing from the publish's publisher since. Enqueued, it might be
    /// held twice; the publisher is told it may be lost.
    #[error("the queue's master cannot tell whether it holds this publish already")]
    UnknownPublisher,
}

/// The role a replica plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Serves the queue and broadcasts every operation.
    Master,
    /// Applies the master's operations.
    Mirror,
    /// Out of the game: deposed, removed from the ring or stopped. Start a new
    /// replica (a fresh mirror) to take part again.
    Stopped,
}

/// What `sync` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncStart {
    /// A sync started (or was already running) for these many mirrors.
    Started {
        /// Mirrors being synchronised.
        targets: usize,
    },
    /// Every mirror is already synchronised.
    AlreadySynced,
}

/// A sync's progress: messages sent (master) or received (mirror) of the total.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncProgress {
    /// Messages synced so far.
    pub synced: u64,
    /// Messages to sync.
    pub total: u64,
}

/// A replica's role and synchronisation state, for `list_queues` and the API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// The role.
    pub role: Role,
    /// The master epoch it follows (or leads).
    pub epoch: u64,
    /// Whether it holds everything the master holds (the master always does).
    pub synchronised: bool,
    /// A sync in progress (master: sending; mirror: receiving).
    pub syncing: Option<SyncProgress>,
    /// Members the master counts as synchronised (the master excluded).
    pub synced_members: Vec<MemberId>,
}

/// What the replica asks its driver (or broker) to do or to know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Broadcast this payload on the ring. The replica numbers its own
    /// broadcasts 1, 2, … in output order: the ring's sequence numbers.
    Broadcast(Bytes),
    /// Send this payload to ring member `to` alone (one hop; it may be lost
    /// or overtake broadcasts): a mirror's disk reports to its master. Hand
    /// it to the receiver's [`Replica::handle_message`].
    Send {
        /// The receiver.
        to: MemberId,
        /// The payload.
        payload: Bytes,
    },
    /// Compare-and-set the queue record: set this placement if the record is
    /// still at `expected_version`; feed the outcome (or the current record on
    /// a conflict) back with [`Replica::record_settled`].
    ProposeRecord {
        /// The version the change is based on.
        expected_version: u64,
        /// The new placement (`version` is ignored).
        view: RecordView,
    },
    /// These publishes are confirmed (send `basic.ack`).
    Confirmed(Vec<PublishId>),
    /// These publishes will never be confirmed by this replica (send
    /// `basic.nack`; the publisher resends).
    Nacked(Vec<PublishId>),
    /// A fetch finished: the delivery may now go to the consumer.
    Fetched {
        /// The token [`Replica::fetch`] returned.
        token: u64,
        /// The message, or `None` if the queue was empty.
        delivery: Option<Delivery>,
    },
    /// A fetch will never finish (the master was deposed or stopped).
    FetchFailed {
        /// The token [`Replica::fetch`] returned.
        token: u64,
    },
    /// This replica became the master at `epoch` and its takeover is
    /// confirmed on the ring: every publish up to `held[publisher]` is held
    /// (confirm them); the others pending at the old master were lost (nack).
    Promoted {
        /// The new epoch.
        epoch: u64,
        /// Publishes held, per publisher.
        held: HeldPublishes,
    },
    /// This master lost its role to a newer master: its pending publishes
    /// were nacked and its fetches failed.
    Deposed {
        /// The epoch it had.
        epoch: u64,
    },
    /// This mirror holds everything the master holds (it told the master,
    /// which commits it to the queue record).
    SyncComplete,
    /// Messages the master dropped (expired, over the limits, rejected), for
    /// dead-lettering (only with [`Settings::report_dropped`]).
    Dropped(Vec<Dropped>),
}

/// A broadcast's ops, its publishes and its refusals ([`Body::Ops`]).
type OpsBatch = (Vec<Op>, Vec<PublishId>, Vec<PublishId>);

#[derive(Debug)]
struct PendingConfirm {
    /// The ring sequence number of the broadcast that carries it (0: not broadcast yet).
    gm_seq: Seq,
    /// The queue seq the local fsync must cover, for persistent messages of durable queues.
    bq_seq: Option<SeqId>,
    /// Props and body bytes of the publish (0 for a promotion).
    bytes: usize,
    what: Confirmable,
}

#[derive(Debug)]
enum Confirmable {
    Publish(PublishId),
    Promotion { epoch: u64, held: HeldPublishes },
}

#[derive(Debug)]
struct PendingFetch {
    gm_seq: Seq,
    token: u64,
    delivery: Option<Delivery>,
}

/// The master's running sync.
#[derive(Debug)]
struct SyncRun {
    id: u64,
    targets: BTreeSet<MemberId>,
    /// What is left to send, bodies still on disk where the queue paged
    /// them out.
    rest: LazySnapshot,
    total: u64,
    sent: u64,
    /// The ring sequence numbers of the batches sent and not yet confirmed
    /// round the ring: at most [`SYNC_BATCHES_IN_FLIGHT`].
    in_flight: VecDeque<Seq>,
    end: Body,
}

/// Sync batches a master has on its ring at once: the next goes when the
/// ring confirms one, so a sync of any backlog holds a few batches in
/// memory (each at most [`RING_MSG_BYTES`]), not the queue.
const SYNC_BATCHES_IN_FLIGHT: usize = 2;

/// A mirror's synchronisation state.
#[derive(Debug)]
enum MirrorSync {
    /// Holds nothing; ignores the master's ops.
    Idle,
    /// Receiving a sync into a new backing queue, a batch at a time
    /// (bodies past its memory budget go to its log as they come); buffers
    /// the master's ops that follow the sync point.
    Receiving {
        sync: u64,
        total: u64,
        received: u64,
        bq: Box<BackingQueue>,
        buffered: Vec<OpsBatch>,
    },
    /// Holds the master's state (the backing queue is present) and applies its ops.
    Holding,
}

/// How often a mirror that holds nothing asks its master for a sync while
/// none comes (see `Replica::tick`).
const SYNC_ASK_AGAIN_MS: u64 = 2_000;

/// How long after a sync started for a mirror the master takes that
/// mirror's asks from before it (they crossed the sync on the ring) as
/// stale; an ask still that old after this means the mirror missed the sync,
/// and it gets another.
const SYNC_ASK_STALE_MS: u64 = 10_000;

/// A sync sent (or being sent) to a mirror that has not said it holds it.
#[derive(Debug, Clone, Copy)]
struct SyncSent {
    /// The sync's id.
    sync: u64,
    /// When it started (the replica's clock).
    at_ms: u64,
    /// How many messages it copies.
    messages: u64,
}

/// How long a mirror waits for a master before it warns (see
/// `Replica::waiting`).
const WAITING_WARN_MS: u64 = 5_000;

/// How long a stopping master waits for the ring and its mirrors' disks
/// to confirm what it took before it gives up and nacks the rest
/// ([`Replica::stop`]).
const DRAIN_LIMIT_MS: u64 = 5_000;

/// A mirror's wait for a master.
#[derive(Debug, Clone, Copy)]
struct Waiting {
    /// The ring view it began in.
    view: ViewVersion,
    /// The first tick that saw it.
    since_ms: Option<u64>,
    /// Warned about already.
    warned: bool,
}

/// One replica of a mirrored queue: master or mirror, as a sans-IO state machine.
///
/// Inputs: the caller's operations on the master ([`publish`](Self::publish),
/// [`fetch`](Self::fetch), [`ack`](Self::ack), …), the ring's events
/// ([`handle_deliver`](Self::handle_deliver), [`handle_confirm`](Self::handle_confirm),
/// [`handle_view`](Self::handle_view), [`handle_removed`](Self::handle_removed)),
/// the queue record ([`handle_record`](Self::handle_record),
/// [`record_settled`](Self::record_settled)), time ([`tick`](Self::tick)),
/// and the local fsync ([`sync_storage`](Self::sync_storage)). Outputs:
/// [`Output`]s, drained with [`poll_output`](Self::poll_output). Call
/// [`flush`](Self::flush) when the input queue runs dry: it turns the ops
/// applied since the last flush into one broadcast (and sends a sync batch).
pub struct Replica {
    queue: String,
    node: String,
    member: MemberId,
    role: Role,
    settings: Settings,
    factory: QueueFactory,
    bq: Option<BackingQueue>,
    epoch: u64,
    master_member: Option<MemberId>,
    view: View,
    record: RecordView,
    broadcasts: Seq,
    gm_confirmed: Seq,
    outputs: VecDeque<Output>,
    /// The publishes this replica's copy holds (not complete for a master
    /// started from a copy recovered from disk, nor for a mirror it
    /// synchronised, which a sync tells).
    held: HeldPublishes,
    synced_members: BTreeSet<MemberId>,
    /// The synchronised members the ring confirmed carrying the master's
    /// announcement of (`Body::SyncedSet`) to every member: only those go
    /// into the queue record, so a mirror the record names synchronised
    /// knows it, and can take over from a master that hands over on it.
    announced: BTreeSet<MemberId>,
    /// Announcements on their way round: (broadcast seq, members).
    announcing: VecDeque<(Seq, BTreeSet<MemberId>)>,
    // Master.
    out_ops: Vec<Op>,
    out_pubs: Vec<PublishId>,
    /// Publishes refused since the last broadcast (they go before
    /// `out_pubs` in it: see [`Replica::publish_refused`]).
    out_refused: Vec<PublishId>,
    /// Bytes of the messages published into `out_ops`.
    out_bytes: usize,
    confirms: VecDeque<PendingConfirm>,
    /// `confirms` holds a promotion: it waits for the local disk to be
    /// clean, so a commit is awaited ([`Replica::awaits_storage_sync`]).
    promotion_pending: bool,
    /// The `bytes` of `confirms`, summed.
    confirm_bytes: usize,
    fetches: VecDeque<PendingFetch>,
    next_token: u64,
    sync_run: Option<SyncRun>,
    /// Mirrors a sync runs or ran for that have not said they hold it yet.
    sync_awaiting: BTreeMap<MemberId, SyncSent>,
    /// Per mirror, the queue seq up to which it reported its persistent
    /// messages on disk ([`Body::Stored`]).
    stored: BTreeMap<MemberId, SeqId>,
    next_sync: u64,
    record_inflight: bool,
    // Mirror.
    msync: MirrorSync,
    master_stopping: bool,
    promoting: bool,
    asked_sync: bool,
    /// A sync could not be installed (its disk failed): ask again on the
    /// next tick, not at once (each sync carries the whole queue).
    sync_retry: bool,
    /// When this mirror last asked for a sync ([`Body::NeedSync`]).
    asked_at_ms: u64,
    /// The newest sync of the master it follows that this mirror saw start
    /// for it ([`Body::NeedSync`]'s `after`).
    seen_sync: u64,
    /// The time of the last [`tick`](Self::tick).
    now_ms: u64,
    /// Since when this mirror waits for a master (its master gone, no
    /// synchronised mirror to take over): said at once, and warned about
    /// only if it lasts ([`WAITING_WARN_MS`]; a deleted queue's mirrors wait
    /// the moment before the deletion reaches them).
    waiting: Option<Waiting>,
    /// The node of the master this mirror follows.
    master_node: Option<String>,
    /// The highest queue seq this mirror has applied.
    applied_seq: SeqId,
    /// The `up_to` of this mirror's last [`Body::Stored`].
    reported_stored: SeqId,
    refused: u64,
    /// This node sees no majority of the cluster ([`Replica::set_isolated`]).
    isolated: bool,
    /// This master's disk failed: it stopped (see `lost_storage`).
    storage_failed: bool,
    /// Since when this master has been stopping ([`Replica::stop`]): it
    /// takes no new publish or fetch and stops once what it took is
    /// confirmed.
    draining_since: Option<u64>,
    /// A draining master told its mirrors it stops (`Body::Stopping`).
    stopping_sent: bool,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("queue", &self.queue)
            .field("node", &self.node)
            .field("member", &self.member)
            .field("role", &self.role)
            .field("epoch", &self.epoch)
            .finish_non_exhaustive()
    }
}

fn queue_config(settings: &Settings, limits: warren_backing_queue::Limits) -> QueueConfig {
    QueueConfig {
        limits,
        record_ops: true,
        report_dropped: settings.report_dropped,
        max_priority: settings.max_priority,
    }
}

impl Replica {
    /// The master of a queue, at `epoch` (the queue record's version at which
    /// this node became or re-claimed master), holding `bq` (a new queue, or
    /// one recovered from disk) and the publishes `held` says it holds
    /// ([`Self::held`] of the replica whose copy `bq` is; empty for a new
    /// queue; [`HeldPublishes::unknown`] for a copy recovered from disk).
    /// `bq` must have been made with `record_ops`.
    #[allow(clippy::too_many_arguments)]
    pub fn new_master(
        queue: impl Into<String>,
        node: impl Into<String>,
        member: MemberId,
        settings: Settings,
        factory: QueueFactory,
        bq: BackingQueue,
        held: HeldPublishes,
        record: RecordView,
    ) -> Self {
        let mut r = Self::blank(queue, node, member, settings, factory, record);
        r.held = held;
        let mut bq = bq;
        bq.set_record_ops(true);
        r.role = Role::Master;
        r.epoch = r.record.version;
        r.master_member = Some(member);
        r.bq = Some(bq);
        r.msync = MirrorSync::Holding;
        r.push_msg(Body::Master { from: 0 });
        tracing::info!(node = %r.node, queue = %r.queue, view = r.epoch, "queue master started");
        r
    }

    /// A mirror: starts empty and unsynchronised, whatever the node held before.
    pub fn new_mirror(
        queue: impl Into<String>,
        node: impl Into<String>,
        member: MemberId,
        settings: Settings,
        factory: QueueFactory,
        record: RecordView,
    ) -> Self {
        let mut r = Self::blank(queue, node, member, settings, factory, record);
        r.role = Role::Mirror;
        r.epoch = 0;
        tracing::info!(node = %r.node, queue = %r.queue, view = r.record.version, "queue mirror started");
        r
    }

    fn blank(
        queue: impl Into<String>,
        node: impl Into<String>,
        member: MemberId,
        settings: Settings,
        factory: QueueFactory,
        record: RecordView,
    ) -> Self {
        Self {
            queue: queue.into(),
            node: node.into(),
            member,
            role: Role::Mirror,
            settings,
            factory,
            bq: None,
            epoch: 0,
            master_member: None,
            view: View::empty(),
            record,
            broadcasts: 0,
            gm_confirmed: 0,
            outputs: VecDeque::new(),
            held: HeldPublishes::new(),
            synced_members: BTreeSet::new(),
            announced: BTreeSet::new(),
            announcing: VecDeque::new(),
            out_ops: Vec::new(),
            out_pubs: Vec::new(),
            out_refused: Vec::new(),
            out_bytes: 0,
            confirms: VecDeque::new(),
            promotion_pending: false,
            confirm_bytes: 0,
            fetches: VecDeque::new(),
            next_token: 1,
            sync_run: None,
            sync_awaiting: BTreeMap::new(),
            stored: BTreeMap::new(),
            next_sync: 1,
            record_inflight: false,
            msync: MirrorSync::Idle,
            master_stopping: false,
            promoting: false,
            asked_sync: false,
            sync_retry: false,
            asked_at_ms: 0,
            seen_sync: 0,
            now_ms: 0,
            waiting: None,
            master_node: None,
            applied_seq: 0,
            reported_stored: 0,
            refused: 0,
            isolated: false,
            draining_since: None,
            stopping_sent: false,
            storage_failed: false,
        }
    }

    // ----- queries -------------------------------------------------------

    /// The ring member this replica speaks through.
    pub fn member(&self) -> MemberId {
        self.member
    }

    /// The replica's role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// Whether it is a mirror that claimed the master's place in the
    /// queue record and has not taken it yet: the claim may still be on
    /// its way when the replica stops, and then decide that this node's
    /// copy is the queue's.
    pub fn promoting(&self) -> bool {
        self.role != Role::Master && self.promoting
    }

    /// Whether it is a master that is stopping ([`Replica::stop`]).
    pub fn draining(&self) -> bool {
        self.role == Role::Master && self.draining_since.is_some()
    }

    /// Whether a publish may be given to it now: it is a master that is
    /// not stopping, or it is cut off from the majority (and refuses the
    /// publish at once, [`MirrorError::Isolated`]).
    pub fn takes_publishes(&self) -> bool {
        (self.role == Role::Master && self.draining_since.is_none()) || self.isolated
    }

    /// Whether this replica was a master that stopped because its disk
    /// failed: its log is poisoned, so its node must not serve the queue
    /// again from it (a synchronised mirror takes over, or the queue waits
    /// for this node's restart).
    pub fn storage_failed(&self) -> bool {
        self.storage_failed
    }

    /// The master epoch it follows or leads.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The queue record as last seen.
    pub fn record(&self) -> &RecordView {
        &self.record
    }

    /// Ring messages refused (older epoch, undecodable).
    pub fn refused(&self) -> u64 {
        self.refused
    }

    /// Message counts, if the replica holds the queue's state.
    pub fn stats(&self) -> Option<Stats> {
        match self.msync {
            MirrorSync::Holding => self.bq.as_ref().map(BackingQueue::stats),
            _ => None,
        }
    }

    /// The ready messages' seqs, head first (empty unless holding state).
    pub fn ready_seqs(&self) -> Vec<SeqId> {
        match (&self.msync, &self.bq) {
            (MirrorSync::Holding, Some(bq)) => bq.ready_seqs().collect(),
            _ => Vec::new(),
        }
    }

    /// Publishes held, per publisher.
    pub fn held(&self) -> &HeldPublishes {
        &self.held
    }

    /// Role and synchronisation state.
    pub fn status(&self) -> Status {
        let syncing = match (&self.role, &self.msync, &self.sync_run) {
            (Role::Master, _, Some(run)) => Some(SyncProgress {
                synced: run.sent,
                total: run.total,
            }),
            (
                Role::Mirror,
                MirrorSync::Receiving {
                    total, received, ..
                },
                _,
            ) => Some(SyncProgress {
                synced: *received,
                total: *total,
            }),
            _ => None,
        };
        Status {
            role: self.role,
            epoch: self.epoch,
            synchronised: self.role == Role::Master
                || (matches!(self.msync, MirrorSync::Holding)
                    && self.synced_members.contains(&self.member)),
            syncing,
            synced_members: self.synced_members.iter().copied().collect(),
        }
    }

    /// The [`digest`](warren_backing_queue::BackingQueue::digest) of the
    /// messages this replica holds; `None` while it holds no copy of the
    /// queue (an unsynchronised or stopped mirror). A synchronised mirror
    /// that applied the master's operations up to the same point has the
    /// master's digest.
    pub fn digest(&self) -> Option<u64> {
        match (self.role, &self.msync) {
            (Role::Master, _) | (Role::Mirror, MirrorSync::Holding) => {
                self.bq.as_ref().map(BackingQueue::digest)
            }
            _ => None,
        }
    }

    /// Publishes and fetches waiting for the ring (or the disk): what flow
    /// control holds publishers back on.
    pub fn backlog(&self) -> usize {
        self.confirms.len() + self.fetches.len()
    }

    /// Bytes of the publishes in [`backlog`](Self::backlog): what the ring
    /// and the mirrors may still hold of them.
    pub fn backlog_bytes(&self) -> usize {
        self.confirm_bytes
    }

    /// Whether no other member is alive in the ring's view.
    pub fn alone(&self) -> bool {
        self.view.alive().all(|m| m == self.member)
    }

    /// Arms the local backing queue's unsynced hook again
    /// ([`BackingQueue::arm_unsynced`]).
    pub fn arm_storage_unsynced(&mut self) -> bool {
        self.bq.as_mut().is_some_and(BackingQueue::arm_unsynced)
    }

    /// Calls the local backing queue's unsynced hook if a change failed to
    /// ([`BackingQueue::tell_unsynced`]).
    pub fn tell_storage_unsynced(&mut self) -> bool {
        self.bq.as_mut().is_some_and(BackingQueue::tell_unsynced)
    }

    /// Whether the local backing queue has appended data to fsync.
    pub fn needs_storage_sync(&self) -> bool {
        self.bq.as_ref().is_some_and(BackingQueue::needs_sync)
    }

    /// Whether a confirm waits for the local fsync: a publish was logged
    /// since the last ([`BackingQueue::awaits_sync`]), or a promotion waits
    /// for the disk to hold everything (the requeues it made too).
    pub fn awaits_storage_sync(&self) -> bool {
        self.bq
            .as_ref()
            .is_some_and(|bq| bq.awaits_sync() || (self.promotion_pending && bq.needs_sync()))
    }

    /// The next output, if any.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    /// All outputs, in order.
    pub fn drain_outputs(&mut self) -> impl Iterator<Item = Output> + '_ {
        self.outputs.drain(..)
    }

    /// When [`tick`](Self::tick) next has work (the head message's expiry), if ever.
    pub fn next_timer_ms(&self) -> Option<u64> {
        match self.role {
            Role::Master => self.bq.as_ref().and_then(BackingQueue::next_expiry_ms),
            _ => None,
        }
    }

    // ----- master operations --------------------------------------------

    fn master_bq(&mut self) -> Result<&mut BackingQueue, MirrorError> {
        match self.role {
            Role::Master => self.bq.as_mut().ok_or(MirrorError::Stopped),
            Role::Mirror => Err(MirrorError::NotMaster),
            Role::Stopped => Err(MirrorError::Stopped),
        }
    }

    /// Moves the ops the backing queue recorded into the outgoing batch.
    fn collect_ops(&mut self) {
        let Some(bq) = self.bq.as_mut() else { return };
        self.out_ops.extend(bq.take_ops());
        if self.settings.report_dropped {
            let mut dropped = Vec::new();
            bq.take_dropped(&mut dropped);
            if !dropped.is_empty() {
                self.outputs.push_back(Output::Dropped(dropped));
            }
        }
    }

    /// Publishes a message (master only). It is confirmed with
    /// [`Output::Confirmed`] once every member of the view holds it, the
    /// local fsync covers it (persistent message, durable queue) and enough
    /// members are synchronised.
    ///
    /// A publish this replica already holds (`id` at or below
    /// [`held`](Self::held) for its publisher: sent again after the master
    /// that took it went down, or over a new link to the same master) is
    /// not enqueued twice: it is confirmed with the first, or, if that was
    /// confirmed already (or came from an earlier master), once the ring
    /// has everything this master sent so far. A publish refused (an
    /// error) is noted refused ([`Self::publish_refused`]).
    pub fn publish(
        &mut self,
        now_ms: u64,
        id: PublishId,
        msg: NewMessage,
    ) -> Result<(), MirrorError> {
        let taken = self.take_publish(now_ms, id, msg);
        if taken.is_err() {
            self.publish_refused(id);
        }
        taken
    }

    /// Notes that the master refused publish `id` (a full queue's
    /// `x-overflow: reject-publish`, or an error of [`Self::publish`]), so
    /// that it is not taken for held when it comes again after a later
    /// publish of its publisher was held (its nack lost with a link); the
    /// mirrors note it too, with the next broadcast. Nothing for a publish
    /// it holds, nor on a mirror.
    pub fn publish_refused(&mut self, id: PublishId) {
        if self.role != Role::Master || self.held.holds(id) != Holds::No {
            return;
        }
        // A broadcast lists its refusals before its publishes.
        if !self.out_pubs.is_empty() {
            self.flush_ops();
        }
        self.held.refuse(id);
        self.out_refused.push(id);
    }

    fn take_publish(
        &mut self,
        now_ms: u64,
        id: PublishId,
        msg: NewMessage,
    ) -> Result<(), MirrorError> {
        if self.isolated && self.role == Role::Master {
            return Err(MirrorError::Isolated);
        }
        if self.draining_since.is_some() {
            return Err(MirrorError::Stopping);
        }
        if self.held.holds(id) == Holds::Yes {
            self.master_bq()?;
            self.confirm_again(id);
            return Ok(());
        }
        if self.out_bytes >= RING_MSG_BYTES {
            self.flush_ops();
        }
        let len = msg.props.len() + msg.body.len();
        let published = self.master_bq()?.publish(now_ms, msg)?;
        self.collect_ops();
        self.out_bytes += len;
        self.out_pubs.push(id);
        self.held.note(id);
        self.confirm_bytes += len;
        self.confirms.push_back(PendingConfirm {
            gm_seq: 0,
            bq_seq: published.needs_sync.then_some(published.seq),
            bytes: len,
            what: Confirmable::Publish(id),
        });
        Ok(())
    }

    /// Publishes a message that this replica may hold already: sent again
    /// after the master it was sent to went down, or passed on by a node
    /// that was not the master. As [`Self::publish`], but refused with
    /// [`MirrorError::UnknownPublisher`] when this master cannot tell
    /// whether it holds it (its copy's holdings are not known, and it has
    /// heard nothing from `id`'s publisher since it started).
    pub fn publish_again(
        &mut self,
        now_ms: u64,
        id: PublishId,
        msg: NewMessage,
    ) -> Result<(), MirrorError> {
        if self.held.holds(id) == Holds::Unknown {
            return Err(MirrorError::UnknownPublisher);
        }
        self.publish(now_ms, id, msg)
    }

    /// Confirms publish `id`, which this replica holds already: with its
    /// first copy if that is still waiting, else once the ring has the next
    /// broadcast (an empty one if no op comes): everything before it, the
    /// first copy included, is on the ring then, and a promotion before it
    /// is confirmed. Never at once: the caller learns of the publish's
    /// confirm only after `publish` returns.
    fn confirm_again(&mut self, id: PublishId) {
        let waiting = self
            .confirms
            .iter()
            .any(|c| matches!(c.what, Confirmable::Publish(p) if p == id));
        tracing::debug!(node = %self.node, queue = %self.queue, view = self.epoch, publisher = id.publisher, seq = id.seq, waiting, "a publish this replica holds came again: not enqueued twice");
        if waiting {
            return;
        }
        self.confirms.push_back(PendingConfirm {
            gm_seq: 0,
            bq_seq: None,
            bytes: 0,
            what: Confirmable::Publish(id),
        });
    }

    /// Says whether this node is cut off from a majority of the cluster.
    /// A master so cut off fails fast instead of leaving its publishers
    /// waiting for a heal: every publish it has not confirmed is nacked
    /// ([`Output::Nacked`]; the ring may still deliver it, as a nack allows)
    /// and, until the majority is back, new publishes are refused
    /// ([`MirrorError::Isolated`]). Its ring cannot change views without
    /// that majority, so nothing it holds could be confirmed before then.
    pub fn set_isolated(&mut self, isolated: bool) {
        if self.isolated == isolated {
            return;
        }
        self.isolated = isolated;
        if !isolated || self.role != Role::Master {
            return;
        }
        let mut nacked = Vec::new();
        self.confirms.retain(|c| match c.what {
            Confirmable::Publish(id) => {
                nacked.push(id);
                false
            }
            Confirmable::Promotion { .. } => true,
        });
        // Promotions carry no bytes.
        self.confirm_bytes = 0;
        tracing::warn!(node = %self.node, queue = %self.queue, view = self.epoch, nacked = nacked.len(), "cut off from a majority of the cluster: unconfirmed publishes nacked, new ones refused until it is back");
        if !nacked.is_empty() {
            self.outputs.push_back(Output::Nacked(nacked));
        }
    }

    /// Fetches the next message (master only). The result comes as
    /// [`Output::Fetched`] with the returned token once the ring has the
    /// fetch, so that a new master never hands out a delivered message again
    /// without the redelivered flag.
    pub fn fetch(&mut self, now_ms: u64) -> Result<u64, MirrorError> {
        if self.draining_since.is_some() {
            return Err(MirrorError::Stopping);
        }
        let delivery = self.master_bq()?.fetch(now_ms)?;
        self.collect_ops();
        let token = self.next_token;
        self.next_token += 1;
        self.fetches.push_back(PendingFetch {
            gm_seq: 0,
            token,
            delivery,
        });
        Ok(token)
    }

    /// The store a settlement of one of this replica's own deliveries
    /// applies to: a master's, or the copy a master that stopped keeps
    /// ([`Replica::into_queue`], for this node's next replica). A client's
    /// ack or close in the moment between its master stopping and the copy
    /// being taken must count there: otherwise the copy, served again,
    /// holds that delivery unacknowledged with no one to settle it.
    fn settling_bq(&mut self) -> Result<&mut BackingQueue, MirrorError> {
        if self.role == Role::Stopped && self.master_member == Some(self.member) {
            return self.bq.as_mut().ok_or(MirrorError::Stopped);
        }
        self.master_bq()
    }

    /// Moves what a settlement recorded into the outgoing batch, unless
    /// this replica stopped (its copy's ops are not broadcast).
    fn collect_settled(&mut self) {
        if self.role != Role::Stopped {
            self.collect_ops();
        }
    }

    /// Acks a delivery (master only, or a stopped master's kept copy).
    pub fn ack(&mut self, tag: DeliveryTag) -> Result<(), MirrorError> {
        self.settling_bq()?.ack(tag)?;
        self.collect_settled();
        Ok(())
    }

    /// Requeues a delivery (master only, or a stopped master's kept copy):
    /// back to its place, redelivered.
    pub fn requeue(&mut self, tag: DeliveryTag) -> Result<(), MirrorError> {
        self.settling_bq()?.requeue(tag)?;
        self.collect_settled();
        Ok(())
    }

    /// Rejects a delivery without requeue (master only, or a stopped
    /// master's kept copy).
    pub fn discard(&mut self, tag: DeliveryTag) -> Result<(), MirrorError> {
        self.settling_bq()?.discard(tag)?;
        self.collect_settled();
        Ok(())
    }

    /// Purges the ready messages (master only); returns how many.
    pub fn purge(&mut self) -> Result<u64, MirrorError> {
        let n = self.master_bq()?.purge()?;
        self.collect_ops();
        Ok(n)
    }

    /// Changes how many body bytes this replica's store keeps in memory (a
    /// policy changed the queue's mode): in any role, each replica pages
    /// its own store (what could not be written out stays in memory).
    pub fn set_resident_bytes_max(&mut self, bytes: u64) {
        if let Some(bq) = self.bq.as_mut()
            && let Err(e) = bq.set_resident_bytes_max(bytes)
        {
            tracing::warn!(node = %self.node, queue = %self.queue, view = self.epoch, error = %e, "paging the queue out failed: its messages stay in memory");
        }
    }

    /// Changes the queue's limits (master only; a policy changed).
    pub fn set_limits(&mut self, limits: warren_backing_queue::Limits) -> Result<(), MirrorError> {
        self.master_bq()?.set_limits(limits)?;
        self.collect_ops();
        Ok(())
    }

    /// Changes the mirroring settings (a policy changed). Switching to
    /// automatic starts a sync of unsynchronised mirrors.
    pub fn set_settings(&mut self, settings: Settings) {
        self.settings = settings;
        self.maybe_auto_sync();
        self.release();
    }

    /// Time passes (master: expires messages at the head; a mirror that
    /// could not install a sync asks for one again).
    pub fn tick(&mut self, now_ms: u64) {
        self.now_ms = now_ms;
        if self.role == Role::Mirror && std::mem::take(&mut self.sync_retry) && self.bq.is_none() {
            self.ask_sync();
        }
        // A mirror that holds nothing and receives nothing asks again now
        // and then: its ask, or the master's sync, may have been lost with
        // a link or a view.
        if self.role == Role::Mirror
            && self.settings.sync_mode == SyncMode::Automatic
            && self.asked_sync
            && self.bq.is_none()
            && matches!(self.msync, MirrorSync::Idle)
            && now_ms.saturating_sub(self.asked_at_ms) >= SYNC_ASK_AGAIN_MS
        {
            self.ask_sync();
        }
        self.check_waiting(now_ms);
        if self.role != Role::Master {
            return;
        }
        if self
            .draining_since
            .is_some_and(|t| now_ms.saturating_sub(t) >= DRAIN_LIMIT_MS)
        {
            tracing::warn!(node = %self.node, queue = %self.queue, view = self.epoch, pending = self.confirms.len(), "stopping master: the ring did not confirm in time; nacking the rest");
            self.end_stop();
            return;
        }
        let due = self
            .bq
            .as_ref()
            .and_then(BackingQueue::next_expiry_ms)
            .is_some_and(|t| t < now_ms);
        if due && let Some(bq) = self.bq.as_mut() {
            if let Err(e) = bq.expire(now_ms) {
                tracing::warn!(node = %self.node, queue = %self.queue, view = self.epoch, error = %e, "expiry failed");
            }
            self.collect_ops();
        }
        // RabbitMQ's natural synchronisation, as far as Warren has it: in
        // manual mode a mirror that joined while the queue held messages
        // is synchronised once its consumers have drained it.
        let drained = self.bq.as_ref().is_some_and(|bq| {
            let s = bq.stats();
            s.ready + s.unacked == 0
        });
        if drained && self.settings.sync_mode == SyncMode::Manual {
            self.maybe_auto_sync();
        }
    }

    /// Runs the local group commit (fsync) if there is anything to sync, then
    /// releases the confirms it covers.
    pub fn sync_storage(&mut self) -> Result<(), MirrorError> {
        if let Some(bq) = self.bq.as_mut()
            && bq.needs_sync()
            && let Err(e) = bq.sync()
        {
            self.lost_storage();
            return Err(e.into());
        }
        self.release();
        self.report_stored();
        Ok(())
    }

    /// Starts a group commit of the local backing queue (see
    /// [`BackingQueue::prepare_sync`]): run the job off the caller's lock,
    /// then hand it to [`complete_storage_sync`](Self::complete_storage_sync).
    pub fn prepare_storage_sync(&mut self) -> Result<Option<SyncJob>, MirrorError> {
        match self.bq.as_mut() {
            Some(bq) if bq.needs_sync() => bq.prepare_sync().map_err(|e| {
                // (A log poisoned by a failed write or sync.)
                self.lost_storage();
                e.into()
            }),
            _ => Ok(None),
        }
    }

    /// Finishes a group commit started by
    /// [`prepare_storage_sync`](Self::prepare_storage_sync) and releases the
    /// confirms it covers.
    pub fn complete_storage_sync(&mut self, job: &SyncJob) -> Result<(), MirrorError> {
        if let Some(bq) = self.bq.as_mut() {
            if let Err(e) = bq.complete_sync(job) {
                self.lost_storage();
                return Err(e.into());
            }
            let mut seqs = Vec::new();
            bq.drain_confirmed(&mut seqs);
        }
        self.release();
        self.report_stored();
        Ok(())
    }

    /// A mirror whose disk failed no longer holds the master's state: it
    /// drops it and asks for a sync (the master takes it out of the
    /// synchronised set meanwhile). A master whose disk failed can confirm
    /// nothing more from its log: it stops as on a clean shutdown (its
    /// unconfirmed publishes nacked, the mirrors told), so that a
    /// synchronised mirror takes over as `ha-promote-on-shutdown` says;
    /// [`storage_failed`](Self::storage_failed) tells the driver why.
    fn lost_storage(&mut self) {
        match self.role {
            Role::Mirror if self.bq.is_some() => {
                tracing::error!(node = %self.node, queue = %self.queue, view = self.epoch, "mirror's disk failed: dropping its state and asking for a sync");
                self.bq = None;
                self.msync = MirrorSync::Idle;
                self.ask_sync();
            }
            Role::Master => {
                let view = &self.view;
                let successor = self.synced_members.iter().any(|m| view.is_alive(*m));
                tracing::error!(node = %self.node, queue = %self.queue, view = self.epoch, successor, "master's disk failed: stopping (unconfirmed publishes nacked; a synchronised mirror takes over, or this node opens the queue's log again once its disk works)");
                self.storage_failed = true;
                self.end_stop();
            }
            Role::Mirror | Role::Stopped => {}
        }
    }

    /// A mirror holding the master's state tells the master how far its disk
    /// covers the persistent messages it applied: the master confirms a
    /// persistent message only once every synchronised mirror has it on disk.
    /// Everything applied counts once nothing is left to fsync.
    fn report_stored(&mut self) {
        if self.role != Role::Mirror || !matches!(self.msync, MirrorSync::Holding) {
            return;
        }
        let Some(bq) = self.bq.as_ref() else { return };
        let stored = if bq.needs_sync() {
            bq.synced_seq().min(self.applied_seq)
        } else {
            self.applied_seq
        };
        if stored > self.reported_stored
            && let Some(master) = self.master_member
        {
            self.reported_stored = stored;
            let msg = RingMsg {
                epoch: self.epoch,
                body: Body::Stored { up_to: stored },
            };
            self.outputs.push_back(Output::Send {
                to: master,
                payload: msg.encode(),
            });
        }
    }

    /// How far the local backing queue's log is on disk (its
    /// [`synced_seq`](BackingQueue::synced_seq)); `None` while it holds nothing.
    #[must_use]
    pub fn synced_seq(&self) -> Option<SeqId> {
        self.bq.as_ref().map(BackingQueue::synced_seq)
    }

    /// Gives the backing queue back (a master whose queue stops being
    /// mirrored keeps serving it alone); `None` for a replica that holds
    /// nothing. Stop the replica's ring member first.
    pub fn into_queue(self) -> Option<BackingQueue> {
        let mut bq = self.bq?;
        bq.end_snapshot();
        bq.set_record_ops(false);
        let _ = bq.take_ops();
        Some(bq)
    }

    /// Starts synchronising the unsynchronised mirrors (master only); the
    /// queue keeps serving while the sync runs.
    pub fn sync(&mut self) -> Result<SyncStart, MirrorError> {
        self.master_bq()?;
        if let Some(run) = &self.sync_run {
            return Ok(SyncStart::Started {
                targets: run.targets.len(),
            });
        }
        if self.view.alive().all(|m| m == self.member) {
            return Err(MirrorError::NotMirrored);
        }
        let targets = self.unsynced_mirrors();
        if targets.is_empty() {
            return Ok(SyncStart::AlreadySynced);
        }
        self.start_sync(targets.clone())?;
        Ok(SyncStart::Started {
            targets: targets.len(),
        })
    }

    /// Cancels a running sync (master only): its mirrors drop what they got
    /// and stay unsynchronised. `false` if no sync was running.
    pub fn cancel_sync(&mut self) -> Result<bool, MirrorError> {
        self.master_bq()?;
        let Some(run) = self.end_sync_run() else {
            return Ok(false);
        };
        self.sync_awaiting.retain(|_, sent| sent.sync != run.id);
        tracing::info!(node = %self.node, queue = %self.queue, view = self.epoch, "synchronisation cancelled");
        self.push_msg(Body::SyncCancel { sync: run.id });
        Ok(true)
    }

    /// Clean stop of this replica. A master first drains: it takes no new
    /// publish or fetch ([`MirrorError::Stopping`]: the caller holds the
    /// publish for the next master) and waits until the ring and its
    /// synchronised mirrors' disks hold what it took, confirming it, for
    /// at most [`DRAIN_LIMIT_MS`]; a master cut off from the majority does
    /// not wait. Then it tells the mirrors (promotion follows
    /// `ha-promote-on-shutdown`), nacks what is still unconfirmed and
    /// stops. Flush and send the outputs before leaving the ring.
    pub fn stop(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
        if self.role == Role::Master && !self.isolated && self.draining_since.is_none() {
            self.draining_since = Some(self.now_ms);
            tracing::debug!(node = %self.node, queue = %self.queue, view = self.epoch, pending = self.confirms.len(), "master stopping: draining");
            self.flush_ops();
            self.release();
            return;
        }
        self.end_stop();
    }

    /// Stops at once: a master tells its mirrors and nacks what it has not
    /// confirmed.
    fn end_stop(&mut self) {
        if self.role == Role::Master {
            if !self.stopping_sent {
                self.push_msg(Body::Stopping);
            }
            self.fail_pending();
        }
        self.role = Role::Stopped;
    }

    /// Sends what accumulated: the ops applied since the last flush as one
    /// broadcast, then (while a sync runs) one sync batch.
    pub fn flush(&mut self) {
        if self.role != Role::Master {
            return;
        }
        self.flush_ops();
        self.send_sync_batch();
        self.release();
    }

    // ----- ring and record inputs ---------------------------------------

    /// The ring installed a view.
    pub fn handle_view(&mut self, view: View) {
        if view.version <= self.view.version {
            return;
        }
        self.view = view;
        match self.role {
            Role::Master => {
                let before = self.synced_members.len();
                let view = &self.view;
                self.synced_members.retain(|m| view.is_alive(*m));
                self.sync_awaiting.retain(|m, _| view.is_alive(*m));
                self.stored.retain(|m, _| view.is_alive(*m));
                let mut cancel = false;
                if let Some(run) = &mut self.sync_run {
                    run.targets.retain(|m| view.is_alive(*m));
                    cancel = run.targets.is_empty();
                }
                if self.synced_members.len() != before {
                    self.announce_synced();
                }
                if cancel {
                    let _ = self.cancel_sync();
                }
                self.reconcile_record();
                self.maybe_auto_sync();
                self.release();
            }
            Role::Mirror => {
                if !self.asked_sync && self.view.is_alive(self.member) {
                    self.asked_sync = true;
                    self.ask_sync();
                }
                self.maybe_promote();
            }
            Role::Stopped => {}
        }
    }

    /// An unsynchronised mirror asks the master for a sync (the master's
    /// broadcasts before it saw this member in its view never reach it).
    fn ask_sync(&mut self) {
        if matches!(self.msync, MirrorSync::Idle) {
            self.asked_at_ms = self.now_ms;
            self.push_msg(Body::NeedSync {
                after: self.seen_sync,
            });
        }
    }

    /// The ring confirmed this replica's broadcasts up to `up_to`.
    pub fn handle_confirm(&mut self, up_to: Seq) {
        self.gm_confirmed = self.gm_confirmed.max(up_to);
        let mut announced = None;
        while let Some((seq, _)) = self.announcing.front()
            && *seq <= self.gm_confirmed
        {
            announced = self.announcing.pop_front().map(|(_, set)| set);
        }
        if self.role == Role::Master {
            if let Some(set) = announced {
                self.announced = set;
                self.reconcile_record();
            }
            // Room for the next sync batch.
            self.send_sync_batch();
        }
        self.release();
    }

    /// This replica's ring member was removed from the ring: it is out.
    pub fn handle_removed(&mut self) {
        if self.role == Role::Master {
            self.fail_pending();
            self.outputs
                .push_back(Output::Deposed { epoch: self.epoch });
        }
        tracing::warn!(node = %self.node, queue = %self.queue, view = self.epoch, "replica removed from the ring");
        self.role = Role::Stopped;
    }

    /// The queue record changed (or was read).
    pub fn handle_record(&mut self, rec: RecordView) {
        if rec.version < self.record.version {
            return;
        }
        self.record = rec;
        match self.role {
            Role::Master => {
                if self.record.master != self.node {
                    tracing::warn!(node = %self.node, queue = %self.queue, view = self.epoch, new_master = %self.record.master, "master deposed by the queue record");
                    self.depose();
                } else {
                    self.reconcile_record();
                    self.maybe_auto_sync();
                    self.release();
                }
            }
            Role::Mirror => {
                if self.record.master == self.node {
                    let synced = matches!(self.msync, MirrorSync::Holding)
                        && self.synced_members.contains(&self.member);
                    if self.promoting || synced {
                        self.become_master();
                        return;
                    }
                }
                self.maybe_promote();
            }
            Role::Stopped => {}
        }
    }

    /// A [`Output::ProposeRecord`] finished: `rec` is the record it wrote, or
    /// the current record if the compare-and-set lost (or failed: then the
    /// last known one).
    pub fn record_settled(&mut self, rec: RecordView) {
        self.record_inflight = false;
        let promoting = self.promoting;
        self.promoting = false;
        if rec.version < self.record.version {
            self.maybe_promote();
            return;
        }
        if self.role == Role::Mirror && rec.master == self.node && promoting {
            self.promoting = true;
        }
        self.handle_record(rec);
    }

    /// An event of the replica's ring member. A view change
    /// ([`RingEvent::View`]) is ignored here: the driver fetches the view
    /// from the authority and hands it to [`handle_view`](Self::handle_view).
    pub fn handle_ring_event(&mut self, event: RingEvent) {
        match event {
            RingEvent::Deliver {
                publisher, payload, ..
            } => self.handle_deliver(publisher, &payload),
            RingEvent::Confirm { up_to } => self.handle_confirm(up_to),
            RingEvent::Message { from, payload } => self.handle_message(from, &payload),
            RingEvent::Removed => self.handle_removed(),
            RingEvent::LinkReset => {
                // The last disk report may have been lost with the old link.
                self.reported_stored = 0;
                self.report_stored();
            }
            RingEvent::View { .. } => {}
        }
    }

    /// A message sent to this replica alone by member `from` ([`Output::Send`]).
    pub fn handle_message(&mut self, from: MemberId, payload: &[u8]) {
        let Some(msg) = RingMsg::decode(payload) else {
            self.refused += 1;
            return;
        };
        match msg.body {
            // A report about this master's stream only: a mirror that still
            // follows an older master speaks of another stream.
            Body::Stored { up_to } if self.role == Role::Master && msg.epoch == self.epoch => {
                let e = self.stored.entry(from).or_insert(0);
                *e = (*e).max(up_to);
                self.release();
            }
            Body::Stored { .. } => {}
            _ => self.refused += 1,
        }
    }

    /// A ring delivery from `publisher` (the replica's own are ignored).
    pub fn handle_deliver(&mut self, publisher: MemberId, payload: &[u8]) {
        if publisher == self.member || self.role == Role::Stopped {
            return;
        }
        let Some(msg) = RingMsg::decode(payload) else {
            self.refused += 1;
            return;
        };
        if let Body::SyncDone { sync } = msg.body {
            self.on_sync_done(publisher, msg.epoch, sync);
            return;
        }
        if let Body::NeedSync { after } = msg.body {
            if self.role == Role::Master {
                if let Some(sent) = self.sync_awaiting.get(&publisher)
                    && sent.sync > after
                    && sent.messages > 0
                    && self.now_ms.saturating_sub(sent.at_ms) < SYNC_ASK_STALE_MS
                {
                    // Asked before the sync on its way reached it: that
                    // sync answers it (another would copy the queue again).
                    // An empty one costs nothing to send again, and the
                    // mirror may have missed its start (it joined the ring
                    // as it went round): in manual mode, where only an empty
                    // queue is synchronised, nothing would ask again.
                    tracing::debug!(node = %self.node, queue = %self.queue, view = self.epoch, mirror = %publisher, sync = sent.sync, "an ask that predates its sync: ignored");
                    return;
                }
                // A mirror that asks for a sync does not hold this state.
                if self.synced_members.remove(&publisher) {
                    tracing::warn!(node = %self.node, queue = %self.queue, view = self.epoch, mirror = %publisher, "mirror left the synchronised set");
                    self.announce_synced();
                    self.reconcile_record();
                    // Confirms no longer wait for it.
                    self.release();
                }
                self.sync_awaiting.remove(&publisher);
                // A running sync it missed the start of gives it nothing.
                let missed = self
                    .sync_run
                    .as_mut()
                    .is_some_and(|run| run.targets.remove(&publisher) && run.targets.is_empty());
                if missed {
                    let _ = self.cancel_sync();
                }
                self.maybe_auto_sync();
            }
            return;
        }
        if msg.epoch < self.epoch {
            self.refused += 1;
            tracing::debug!(node = %self.node, queue = %self.queue, view = self.epoch, old = msg.epoch, "message of a deposed master refused");
            return;
        }
        if msg.epoch > self.epoch {
            if self.role == Role::Master {
                tracing::warn!(node = %self.node, queue = %self.queue, view = self.epoch, newer = msg.epoch, "a newer master speaks: deposed");
                self.depose();
                return;
            }
            let from = match msg.body {
                Body::Master { from } => Some(from),
                _ => None,
            };
            self.follow(publisher, msg.epoch, from);
        } else if self.role == Role::Master {
            self.refused += 1;
            return;
        } else if self.master_member.is_none() {
            self.master_member = Some(publisher);
            self.master_node = Some(
                self.node_of(publisher)
                    .unwrap_or_else(|| self.record.master.clone()),
            );
        } else if self.master_member != Some(publisher) {
            self.refused += 1;
            return;
        }
        self.on_master_msg(msg.body);
    }

    // ----- internals -------------------------------------------------------

    fn push_msg(&mut self, body: Body) {
        if !matches!(body, Body::Ops { .. }) {
            self.flush_ops();
        }
        let msg = RingMsg {
            epoch: self.epoch,
            body,
        };
        self.broadcasts += 1;
        self.outputs.push_back(Output::Broadcast(msg.encode()));
    }

    fn flush_ops(&mut self) {
        // A publish held already (`confirm_again`) waits for a broadcast
        // even when no op comes.
        if self.out_ops.is_empty()
            && self.out_refused.is_empty()
            && self.confirms.back().is_none_or(|c| c.gm_seq != 0)
        {
            return;
        }
        let ops = std::mem::take(&mut self.out_ops);
        let publishes = std::mem::take(&mut self.out_pubs);
        let refused = std::mem::take(&mut self.out_refused);
        self.out_bytes = 0;
        self.push_msg(Body::Ops {
            ops,
            publishes,
            refused,
        });
        let seq = self.broadcasts;
        for c in self.confirms.iter_mut().rev() {
            if c.gm_seq != 0 {
                break;
            }
            c.gm_seq = seq;
        }
        for f in self.fetches.iter_mut().rev() {
            if f.gm_seq != 0 {
                break;
            }
            f.gm_seq = seq;
        }
    }

    fn synced_alive(&self) -> usize {
        self.synced_members
            .iter()
            .filter(|m| self.view.is_alive(**m))
            .count()
    }

    fn release(&mut self) {
        if self.role != Role::Master || self.bq.is_none() {
            return;
        }
        if !self.confirms.is_empty() {
            self.release_confirms();
        }
        while let Some(f) = self.fetches.front() {
            if f.gm_seq == 0 || f.gm_seq > self.gm_confirmed {
                break;
            }
            if let Some(f) = self.fetches.pop_front() {
                self.outputs.push_back(Output::Fetched {
                    token: f.token,
                    delivery: f.delivery,
                });
            }
        }
        if self.draining_since.is_some() && self.confirms.is_empty() && self.fetches.is_empty() {
            self.finish_drain();
        }
    }

    /// A draining master with nothing left to confirm or hand out tells its
    /// mirrors it stops, and stops once the ring has confirmed everything it
    /// broadcast: the settlements of its last deliveries too (a no-ack
    /// delivery's ack, made as the broker hands the message out, after
    /// this), which a promoted mirror would otherwise deliver again.
    fn finish_drain(&mut self) {
        if !self.stopping_sent {
            self.stopping_sent = true;
            self.push_msg(Body::Stopping);
        }
        if self.out_ops.is_empty() && self.gm_confirmed >= self.broadcasts {
            self.role = Role::Stopped;
        }
    }

    /// Whether the record counts synchronised a node whose alive ring
    /// members this master has synchronised none of: a master started from
    /// its own copy while a mirror of the master before it still runs, say.
    /// That mirror may be promoted on the record's word, without what this
    /// master confirms, so nothing is confirmed until the record stops
    /// counting its node ([`Self::reconcile_record`] proposes it).
    fn record_overstates(&self) -> bool {
        self.record.synchronised.iter().any(|n| {
            let on_n = || {
                (self.view.entries.iter())
                    .filter(|e| e.alive && e.id != self.member && e.node.as_str() == n.as_str())
            };
            on_n().next().is_some() && !on_n().any(|e| self.synced_members.contains(&e.id))
        })
    }

    /// Confirms the publishes (and promotions) at the head of `confirms`
    /// that the ring and every synchronised replica's disk now hold.
    fn release_confirms(&mut self) {
        let Some(bq) = self.bq.as_ref() else { return };
        // A persistent message is on disk everywhere once the local fsync and
        // every synchronised mirror's cover it.
        let synced_seq = self
            .synced_members
            .iter()
            .filter(|m| self.view.is_alive(**m))
            .map(|m| self.stored.get(m).copied().unwrap_or(0))
            .fold(bq.synced_seq(), SeqId::min);
        let storage_clean = !bq.needs_sync();
        let enough = 1 + self.synced_alive() >= self.settings.min_sync_replicas as usize;
        let record_true = !self.record_overstates();
        let mut confirmed = Vec::new();
        while let Some(c) = self.confirms.front() {
            let ring = c.gm_seq != 0 && c.gm_seq <= self.gm_confirmed;
            let disk = c.bq_seq.is_none_or(|s| s <= synced_seq);
            let ok = match c.what {
                Confirmable::Publish(_) => ring && disk && enough && record_true,
                Confirmable::Promotion { .. } => ring && storage_clean,
            };
            if !ok {
                break;
            }
            let Some(c) = self.confirms.pop_front() else {
                break;
            };
            self.confirm_bytes -= c.bytes;
            match c.what {
                Confirmable::Publish(id) => confirmed.push(id),
                Confirmable::Promotion { epoch, held } => {
                    self.promotion_pending = false;
                    if !confirmed.is_empty() {
                        self.outputs
                            .push_back(Output::Confirmed(std::mem::take(&mut confirmed)));
                    }
                    tracing::info!(node = %self.node, queue = %self.queue, view = epoch, "promotion confirmed on the ring");
                    self.outputs.push_back(Output::Promoted { epoch, held });
                }
            }
        }
        if !confirmed.is_empty() {
            self.outputs.push_back(Output::Confirmed(confirmed));
        }
    }

    fn fail_pending(&mut self) {
        self.confirm_bytes = 0;
        self.promotion_pending = false;
        let nacked: Vec<PublishId> = self
            .confirms
            .drain(..)
            .filter_map(|c| match c.what {
                Confirmable::Publish(id) => Some(id),
                Confirmable::Promotion { .. } => None,
            })
            .collect();
        if !nacked.is_empty() {
            self.outputs.push_back(Output::Nacked(nacked));
        }
        for f in self.fetches.drain(..) {
            // Never handed out: back in the local queue (redelivered), for
            // whoever serves it next from here.
            if let (Some(d), Some(bq)) = (&f.delivery, self.bq.as_mut())
                && let Err(e) = bq.requeue(d.tag)
            {
                tracing::warn!(node = %self.node, queue = %self.queue, view = self.epoch, error = %e, "requeue of an unfinished fetch failed");
            }
            self.outputs
                .push_back(Output::FetchFailed { token: f.token });
        }
    }

    fn depose(&mut self) {
        self.fail_pending();
        self.end_sync_run();
        self.outputs
            .push_back(Output::Deposed { epoch: self.epoch });
        self.role = Role::Stopped;
    }

    fn announce_synced(&mut self) {
        let members = self.synced_members.iter().copied().collect();
        self.push_msg(Body::SyncedSet(members));
        self.announcing
            .push_back((self.broadcasts, self.synced_members.clone()));
    }

    fn unsynced_mirrors(&self) -> BTreeSet<MemberId> {
        self.view
            .alive()
            .filter(|m| *m != self.member && !self.synced_members.contains(m))
            .collect()
    }

    fn node_of(&self, m: MemberId) -> Option<String> {
        self.view.entry(m).map(|e| e.node.as_str().to_owned())
    }

    /// The placement the master wants the record to show.
    fn desired_record(&self) -> RecordView {
        let mut alive: Vec<(u64, String, MemberId)> = self
            .view
            .entries
            .iter()
            .filter(|e| e.alive && e.id != self.member && e.node.as_str() != self.node)
            .map(|e| (e.joined_at, e.node.as_str().to_owned(), e.id))
            .collect();
        alive.sort();
        let mut mirrors: Vec<String> = self
            .record
            .mirrors
            .iter()
            .filter(|n| alive.iter().any(|(_, an, _)| an == *n))
            .cloned()
            .collect();
        for (_, n, _) in &alive {
            if !mirrors.contains(n) {
                mirrors.push(n.clone());
            }
        }
        let synced_nodes: BTreeSet<String> = self
            .synced_members
            .iter()
            .filter(|m| self.view.is_alive(**m) && self.announced.contains(*m))
            .filter_map(|m| self.node_of(*m))
            .collect();
        let synchronised = mirrors
            .iter()
            .filter(|n| synced_nodes.contains(*n))
            .cloned()
            .collect();
        RecordView {
            version: self.record.version,
            master: self.node.clone(),
            mirrors,
            synchronised,
        }
    }

    fn reconcile_record(&mut self) {
        if self.role != Role::Master || self.record_inflight || self.view.version == 0 {
            return;
        }
        let desired = self.desired_record();
        if desired.same_placement(&self.record) {
            return;
        }
        self.record_inflight = true;
        self.outputs.push_back(Output::ProposeRecord {
            expected_version: self.record.version,
            view: desired,
        });
    }

    fn maybe_auto_sync(&mut self) {
        if self.role != Role::Master || self.sync_run.is_some() || self.view.version == 0 {
            return;
        }
        let mut targets = self.unsynced_mirrors();
        targets.retain(|m| !self.sync_awaiting.contains_key(m));
        if targets.is_empty() {
            return;
        }
        let empty = self
            .bq
            .as_ref()
            .is_some_and(|bq| bq.stats().ready + bq.stats().unacked == 0);
        if (self.settings.sync_mode == SyncMode::Automatic || empty)
            && let Err(e) = self.start_sync(targets)
        {
            tracing::warn!(node = %self.node, queue = %self.queue, view = self.epoch, error = %e, "could not start synchronisation");
        }
    }

    fn start_sync(&mut self, targets: BTreeSet<MemberId>) -> Result<(), MirrorError> {
        // The sync point: everything applied so far goes out first.
        self.flush_ops();
        let (snap, digest) = match self.bq.as_mut() {
            Some(bq) => (bq.snapshot_lazy(), sync_digest(bq)),
            None => return Err(MirrorError::Stopped),
        };
        let id = self.next_sync;
        self.next_sync += 1;
        let total = snap.len() as u64;
        let sent = SyncSent {
            sync: id,
            at_ms: self.now_ms,
            messages: total,
        };
        self.sync_awaiting
            .extend(targets.iter().map(|&m| (m, sent)));
        tracing::info!(node = %self.node, queue = %self.queue, view = self.epoch, sync = id, mirrors = targets.len(), messages = total, batch = self.settings.sync_batch_size, "synchronising");
        self.push_msg(Body::SyncStart {
            sync: id,
            targets: targets.iter().copied().collect(),
            total,
            digest,
        });
        let end = Body::SyncEnd {
            sync: id,
            next_seq: snap.next_seq,
            next_tag: snap.next_tag,
            limits: snap.limits,
            held: self.held.clone(),
        };
        self.sync_run = Some(SyncRun {
            id,
            targets,
            rest: snap,
            total,
            sent: 0,
            in_flight: VecDeque::new(),
            end,
        });
        self.send_sync_batch();
        Ok(())
    }

    /// Ends the running sync, if any: the queue's log may retire and compact
    /// again.
    fn end_sync_run(&mut self) -> Option<SyncRun> {
        let run = self.sync_run.take()?;
        if let Some(bq) = self.bq.as_mut() {
            bq.end_snapshot();
        }
        Some(run)
    }

    fn send_sync_batch(&mut self) {
        let confirmed = self.gm_confirmed;
        let (Some(run), Some(bq)) = (self.sync_run.as_mut(), self.bq.as_mut()) else {
            return;
        };
        while run.in_flight.front().is_some_and(|&s| s <= confirmed) {
            run.in_flight.pop_front();
        }
        if !run.rest.is_empty() {
            if run.in_flight.len() >= SYNC_BATCHES_IN_FLIGHT {
                return;
            }
            // `ha-sync-batch-size` messages, fewer when they are large.
            let n = (self.settings.sync_batch_size as usize).max(1);
            let msgs = match bq.snapshot_batch(&mut run.rest, n, RING_MSG_BYTES) {
                Ok(msgs) => msgs,
                Err(e) => {
                    // Its mirrors stay unsynchronised and ask again.
                    tracing::warn!(node = %self.node, queue = %self.queue, view = self.epoch, error = %e, "reading the queue for a sync failed: cancelling it");
                    let _ = self.cancel_sync();
                    return;
                }
            };
            run.sent += msgs.len() as u64;
            let sync = run.id;
            self.push_msg(Body::SyncBatch { sync, msgs });
            let seq = self.broadcasts;
            if let Some(run) = self.sync_run.as_mut() {
                run.in_flight.push_back(seq);
            }
            return;
        }
        if let Some(run) = self.end_sync_run() {
            tracing::info!(node = %self.node, queue = %self.queue, view = self.epoch, sync = run.id, messages = run.total, "synchronisation sent");
            self.push_msg(run.end);
            // Mirrors that asked while it ran (a sync spans ring rounds).
            self.maybe_auto_sync();
        }
    }

    fn on_sync_done(&mut self, from: MemberId, epoch: u64, sync: u64) {
        if self.role != Role::Master || epoch != self.epoch || sync >= self.next_sync {
            return;
        }
        self.sync_awaiting.remove(&from);
        if !self.view.is_alive(from) || !self.synced_members.insert(from) {
            return;
        }
        tracing::info!(node = %self.node, queue = %self.queue, view = self.epoch, mirror = %from, "mirror synchronised");
        self.announce_synced();
        self.reconcile_record();
        self.release();
    }

    /// A newer master (higher epoch) speaks: follow it.
    /// Follows `master`, which took over at `epoch` continuing the state of
    /// the master of epoch `from` (`None`: not said, its first message
    /// missed). A copy of another master's state is dropped: the new
    /// master's ops would apply to a state it does not hold (chaos seed
    /// 50003: a mirror synchronised by a master started again from its
    /// kept copy then followed a mirror promoted from the old ring, and
    /// failed on its first ack, an unknown delivery tag; an op that happens
    /// to apply leaves a copy that differs, unseen).
    fn follow(&mut self, master: MemberId, epoch: u64, from: Option<u64>) {
        tracing::info!(node = %self.node, queue = %self.queue, view = epoch, master = %master, "following a new master");
        if matches!(self.msync, MirrorSync::Holding) && from != Some(self.epoch) {
            tracing::info!(node = %self.node, queue = %self.queue, view = epoch, held = self.epoch, from = ?from, "the new master continues another state: dropping this copy and asking for a sync");
            self.bq = None;
            self.msync = MirrorSync::Idle;
            self.asked_sync = true;
        }
        self.epoch = epoch;
        self.master_member = Some(master);
        // The new master hears of this disk from scratch, and numbers its
        // syncs afresh.
        self.reported_stored = 0;
        self.seen_sync = 0;
        self.master_node = Some(
            self.node_of(master)
                .unwrap_or_else(|| self.record.master.clone()),
        );
        self.master_stopping = false;
        self.promoting = false;
        if let MirrorSync::Receiving { .. } = self.msync {
            // The old master's sync will never finish.
            self.msync = MirrorSync::Idle;
        }
        if self.asked_sync {
            self.ask_sync();
        }
    }

    fn on_master_msg(&mut self, body: Body) {
        match body {
            Body::Master { .. }
            | Body::SyncDone { .. }
            | Body::NeedSync { .. }
            | Body::Stored { .. } => {}
            Body::Ops {
                ops,
                publishes,
                refused,
            } => match &mut self.msync {
                MirrorSync::Holding => self.apply_ops(ops, &publishes, &refused),
                MirrorSync::Receiving { buffered, .. } => {
                    buffered.push((ops, publishes, refused));
                }
                MirrorSync::Idle => {}
            },
            Body::SyncedSet(members) => {
                let was = self.synced_members.contains(&self.member);
                self.synced_members = members.into_iter().collect();
                if !was && self.synced_members.contains(&self.member) {
                    tracing::info!(node = %self.node, queue = %self.queue, view = self.epoch, "mirror counted as synchronised");
                }
                self.maybe_promote();
            }
            Body::Stopping => {
                self.master_stopping = true;
                self.maybe_promote();
            }
            Body::SyncStart {
                sync,
                targets,
                total,
                digest,
            } => {
                if targets.contains(&self.member) {
                    self.seen_sync = self.seen_sync.max(sync);
                }
                let same = self.bq.as_ref().is_some_and(|bq| sync_digest(bq) == digest);
                if targets.contains(&self.member)
                    && matches!(self.msync, MirrorSync::Holding)
                    && same
                {
                    // Already holding the master's state: nothing to receive.
                    self.push_msg(Body::SyncDone { sync });
                } else if targets.contains(&self.member) {
                    if matches!(self.msync, MirrorSync::Holding) {
                        tracing::warn!(node = %self.node, queue = %self.queue, view = self.epoch, sync, "mirror differs from its master: receiving its state again");
                    }
                    // The old state (and a sync received before) goes
                    // before the new queue opens the same log directory.
                    self.bq = None;
                    self.msync = MirrorSync::Idle;
                    match (self.factory)(queue_config(&self.settings, Default::default())) {
                        Ok(bq) => {
                            self.msync = MirrorSync::Receiving {
                                sync,
                                total,
                                received: 0,
                                bq: Box::new(bq),
                                buffered: Vec::new(),
                            };
                        }
                        Err(e) => {
                            tracing::warn!(node = %self.node, queue = %self.queue, view = self.epoch, error = %e, "could not open a queue for the sync; asking again on the next tick");
                            self.sync_retry = true;
                        }
                    }
                }
            }
            Body::SyncBatch { sync, msgs } => {
                let MirrorSync::Receiving {
                    sync: s,
                    received,
                    bq,
                    ..
                } = &mut self.msync
                else {
                    return;
                };
                if *s != sync {
                    return;
                }
                *received += msgs.len() as u64;
                let res = bq.install_part(msgs);
                if !matches!(res, Ok(true)) {
                    let e = res.err().map(|e| e.to_string()).unwrap_or_default();
                    tracing::warn!(node = %self.node, queue = %self.queue, view = self.epoch, error = %e, "could not take a sync batch; asking again on the next tick");
                    self.msync = MirrorSync::Idle;
                    self.sync_retry = true;
                }
            }
            Body::SyncEnd {
                sync,
                next_seq,
                next_tag,
                limits,
                held,
            } => {
                if !matches!(self.msync, MirrorSync::Receiving { sync: s, .. } if s == sync) {
                    return;
                }
                let MirrorSync::Receiving { bq, buffered, .. } =
                    std::mem::replace(&mut self.msync, MirrorSync::Idle)
                else {
                    return;
                };
                if let Err(e) = self.install(*bq, (next_seq, next_tag, limits), held, buffered) {
                    tracing::warn!(node = %self.node, queue = %self.queue, view = self.epoch, error = %e, "could not install the sync; asking again on the next tick");
                    self.bq = None;
                    self.sync_retry = true;
                    return;
                }
                if self.bq.is_none() {
                    // An op buffered during the sync failed (it asked again).
                    return;
                }
                self.msync = MirrorSync::Holding;
                tracing::info!(node = %self.node, queue = %self.queue, view = self.epoch, sync, "mirror holds the master's state");
                self.push_msg(Body::SyncDone { sync });
                self.outputs.push_back(Output::SyncComplete);
                self.report_stored();
            }
            Body::SyncCancel { sync } => {
                if matches!(self.msync, MirrorSync::Receiving { sync: s, .. } if s == sync) {
                    self.msync = MirrorSync::Idle;
                }
            }
        }
    }

    /// Ends a received sync: `bq` (which took its batches) holds the
    /// master's state at the sync point with its counters and limits, then
    /// applies the ops that followed.
    fn install(
        &mut self,
        mut bq: BackingQueue,
        (next_seq, next_tag, limits): (SeqId, DeliveryTag, warren_backing_queue::Limits),
        held: HeldPublishes,
        buffered: Vec<OpsBatch>,
    ) -> Result<(), MirrorError> {
        self.applied_seq = next_seq.saturating_sub(1);
        self.reported_stored = 0;
        if !bq.finish_install(next_seq, next_tag, limits)? {
            return Err(MirrorError::Stopped);
        }
        // Its hook told while it received the sync, when the group commit
        // still looked at the replica's old queue: tell it again.
        bq.arm_unsynced();
        self.bq = Some(bq);
        self.held = held;
        for (ops, pubs, refused) in buffered {
            self.apply_ops(ops, &pubs, &refused);
        }
        Ok(())
    }

    fn apply_ops(&mut self, ops: Vec<Op>, publishes: &[PublishId], refused: &[PublishId]) {
        let Some(bq) = self.bq.as_mut() else { return };
        for op in ops {
            match bq.apply(op) {
                Ok(OpOutcome::Published(p)) => self.applied_seq = self.applied_seq.max(p.seq),
                Ok(_) => {}
                Err(e) => {
                    // It no longer holds the master's state: out of the
                    // synchronised set until a sync gives it that state again.
                    tracing::error!(node = %self.node, queue = %self.queue, view = self.epoch, error = %e, "mirror could not apply the master's op: dropping its state and asking for a sync");
                    self.bq = None;
                    self.msync = MirrorSync::Idle;
                    self.ask_sync();
                    return;
                }
            }
        }
        bq.take_ops();
        let mut dropped = Vec::new();
        bq.take_dropped(&mut dropped);
        // In the master's order: a broadcast's refusals came before its
        // publishes.
        for id in refused {
            self.held.refuse(*id);
        }
        for id in publishes {
            self.held.note(*id);
        }
    }

    /// The master this mirror follows, if it is known or can be inferred.
    fn master_is_gone(&self) -> bool {
        let record_master_alive = self
            .view
            .entries
            .iter()
            .any(|e| e.alive && e.node.as_str() == self.record.master);
        if self.record.master == self.node {
            return false;
        }
        match self.master_member {
            // Gone only once its alias is erased: every message it broadcast
            // that any survivor holds has been delivered here. An alive
            // member on the dead master's own node is a new incarnation (a
            // mirror), not a master.
            Some(m) => {
                let elsewhere = self.master_node.as_deref() != Some(self.record.master.as_str());
                self.view.entry(m).is_none() && !(elsewhere && record_master_alive)
            }
            None => !record_master_alive && self.view.entries.iter().all(|e| e.alive),
        }
    }

    /// Warns once a wait for a master ([`Self::waiting`]) has lasted
    /// [`WAITING_WARN_MS`]; forgets it once there is a master again.
    fn check_waiting(&mut self, now_ms: u64) {
        let still = self.role == Role::Mirror && self.master_is_gone();
        let Some(w) = self.waiting.as_mut().filter(|_| still) else {
            self.waiting = None;
            return;
        };
        let since = *w.since_ms.get_or_insert(now_ms);
        if !w.warned && now_ms.saturating_sub(since) >= WAITING_WARN_MS {
            w.warned = true;
            tracing::warn!(node = %self.node, queue = %self.queue, view = self.epoch, ring = self.view.version, waited_ms = now_ms - since, "master gone and no synchronised mirror: the queue waits for its master");
        }
    }

    fn maybe_promote(&mut self) {
        tracing::debug!(node = %self.node, queue = %self.queue, view = self.epoch, promoting = self.promoting, inflight = self.record_inflight, ring = self.view.version, gone = self.master_is_gone(), "promotion check");
        if self.role != Role::Mirror
            || self.promoting
            || self.record_inflight
            || self.view.version == 0
            || !self.view.is_alive(self.member)
            || !self.master_is_gone()
        {
            return;
        }
        let policy = if self.master_stopping {
            self.settings.promote_on_shutdown
        } else {
            self.settings.promote_on_failure
        };
        // Oldest first: by the node's place among the record's mirrors (join
        // order), then by when the member joined the ring.
        let rank = |node: &str| {
            self.record
                .mirrors
                .iter()
                .position(|n| n == node)
                .unwrap_or(usize::MAX)
        };
        // Each alive member, oldest first, and whether the record lists its
        // node as synchronised: a master that went on without a mirror (it
        // left the master's ring view, say) takes it out of the record
        // before it confirms or hands out what that mirror never saw, so a
        // mirror the record no longer lists may miss deliveries and
        // confirmed messages, whatever the ring last said.
        let mut alive: Vec<(usize, u64, MemberId, bool)> = self
            .view
            .entries
            .iter()
            .filter(|e| e.alive)
            .map(|e| {
                let node = e.node.as_str();
                let listed = self.record.synchronised.iter().any(|n| n == node);
                (rank(node), e.joined_at, e.id, listed)
            })
            .collect();
        alive.sort();
        let synced: Vec<MemberId> = alive
            .iter()
            .filter(|(_, _, m, listed)| *listed && self.synced_members.contains(m))
            .map(|(_, _, m, _)| *m)
            .collect();
        let candidate = match synced.first() {
            Some(m) => Some(*m),
            None if policy == PromoteOn::Always => alive.first().map(|(_, _, m, _)| *m),
            None => None,
        };
        let holding = matches!(self.msync, MirrorSync::Holding);
        if candidate == Some(self.member) && !holding && !synced.is_empty() {
            // Counted synchronised but holding nothing: never take over empty.
            tracing::error!(node = %self.node, queue = %self.queue, view = self.epoch, "synchronised mirror without state: not promoting");
            return;
        }
        if candidate != Some(self.member) {
            if candidate.is_none() && self.waiting.is_none_or(|w| w.view != self.view.version) {
                self.waiting = Some(Waiting {
                    view: self.view.version,
                    since_ms: None,
                    warned: false,
                });
                tracing::info!(node = %self.node, queue = %self.queue, view = self.epoch, ring = self.view.version, "master gone and no synchronised mirror: waiting for the master");
            }
            return;
        }
        if synced.is_empty() && matches!(self.msync, MirrorSync::Holding) {
            // Promoting an unsynchronised mirror: say so.
            tracing::warn!(node = %self.node, queue = %self.queue, view = self.epoch, "promoting an unsynchronised mirror (ha-promote-on-* = always): messages may be lost");
        }
        let old_master = self.record.master.clone();
        let keep = |n: &String| n != &self.node && n != &old_master;
        let view = RecordView {
            version: self.record.version,
            master: self.node.clone(),
            mirrors: self
                .record
                .mirrors
                .iter()
                .filter(|n| keep(n))
                .cloned()
                .collect(),
            synchronised: self
                .record
                .synchronised
                .iter()
                .filter(|n| keep(n))
                .cloned()
                .collect(),
        };
        tracing::info!(node = %self.node, queue = %self.queue, view = self.record.version, old_master = %old_master, "promoting this mirror to master");
        self.promoting = true;
        self.record_inflight = true;
        self.outputs.push_back(Output::ProposeRecord {
            expected_version: self.record.version,
            view,
        });
    }

    fn become_master(&mut self) {
        let epoch = self.record.version;
        // The state it holds is the master's it followed.
        let from = self.epoch;
        tracing::info!(node = %self.node, queue = %self.queue, view = epoch, "promoted to master");
        self.role = Role::Master;
        self.epoch = epoch;
        self.master_member = Some(self.member);
        self.promoting = false;
        self.master_stopping = false;
        self.record_inflight = false;
        if !matches!(self.msync, MirrorSync::Holding) || self.bq.is_none() {
            match (self.factory)(queue_config(
                &self.settings,
                warren_backing_queue::Limits::default(),
            )) {
                Ok(bq) => self.bq = Some(bq),
                Err(e) => {
                    tracing::error!(node = %self.node, queue = %self.queue, view = epoch, error = %e, "no backing queue for the new master");
                    self.role = Role::Stopped;
                    return;
                }
            }
        }
        self.msync = MirrorSync::Holding;
        let me = self.member;
        let view = &self.view;
        self.synced_members
            .retain(|m| *m != me && view.is_alive(*m));
        // Every mirror knew these synchronised under the old master.
        self.announced = self.synced_members.clone();
        self.push_msg(Body::Master { from });
        self.announce_synced();
        // Every delivered but unacked message goes back, redelivered.
        if let Some(bq) = self.bq.as_mut() {
            for tag in bq.unacked_tags() {
                if let Err(e) = bq.requeue(tag) {
                    tracing::warn!(node = %self.node, queue = %self.queue, view = epoch, error = %e, "requeue at promotion failed");
                }
            }
        }
        self.collect_ops();
        self.flush_ops();
        let bq_seq = None;
        self.promotion_pending = true;
        self.confirms.push_back(PendingConfirm {
            gm_seq: self.broadcasts,
            bq_seq,
            bytes: 0,
            what: Confirmable::Promotion {
                epoch,
                held: self.held.clone(),
            },
        });
        self.reconcile_record();
        self.maybe_auto_sync();
        self.release();
    }
}

/// What a sync's start compares between the master and a mirror: the
/// queue's digest and the seq its next message takes. The digest of an
/// empty queue is the same whatever its counters, and a mirror whose seqs
/// run apart from its master's reports its disk (`Stored { up_to }`) in
/// another numbering: its master's confirms of persistent messages then
/// wait for ever (simulation seed 225 of the schedules with nodes taken for
/// dead: a mirror 42 seqs behind claimed the empty master's state).
fn sync_digest(bq: &BackingQueue) -> u64 {
    (bq.digest().rotate_left(5) ^ bq.next_seq()).wrapping_mul(0x517c_c1b7_2722_0a95)
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_backing_queue::StoreConfig;
    use warren_gm::ViewChange;
    use warren_wire::NodeName;

    fn alone(member: MemberId) -> View {
        View::empty()
            .apply(&ViewChange::Join {
                member,
                after: None,
                node: NodeName::new("a").unwrap(),
            })
            .unwrap()
    }

    /// [`alone`]`(master)` joined by `mirror` on node b.
    fn with_mirror(master: MemberId, mirror: MemberId) -> View {
        alone(master)
            .apply(&ViewChange::Join {
                member: mirror,
                after: Some(master),
                node: NodeName::new("b").unwrap(),
            })
            .unwrap()
    }

    fn record(master: &str, version: u64) -> RecordView {
        RecordView {
            version,
            master: master.into(),
            ..RecordView::default()
        }
    }

    fn memory() -> QueueFactory {
        Box::new(|cfg| Ok(BackingQueue::in_memory(cfg)))
    }

    fn confirmed(r: &mut Replica) -> Vec<u64> {
        r.drain_outputs()
            .filter_map(|o| match o {
                Output::Confirmed(ids) => Some(ids),
                _ => None,
            })
            .flatten()
            .map(|id| id.seq)
            .collect()
    }

    #[test]
    fn persistent_publishes_wait_for_the_local_fsync() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = QueueConfig {
            record_ops: true,
            ..QueueConfig::default()
        };
        let (bq, _) = BackingQueue::open(dir.path(), cfg, StoreConfig::default()).unwrap();
        let me = MemberId(1);
        let mut r = Replica::new_master(
            "q",
            "a",
            me,
            Settings::default(),
            memory(),
            bq,
            HeldPublishes::new(),
            record("a", 2),
        );
        r.handle_view(alone(me));
        let id = |seq| PublishId { publisher: 1, seq };
        r.publish(10, id(1), NewMessage::new(1, &b"p"[..], true))
            .unwrap();
        r.publish(10, id(2), NewMessage::new(2, &b"t"[..], false))
            .unwrap();
        confirm_round(&mut r);
        assert!(
            confirmed(&mut r).is_empty(),
            "the ring has it, the disk not yet"
        );
        assert!(r.needs_storage_sync());
        r.sync_storage().unwrap();
        assert_eq!(confirmed(&mut r), vec![1, 2]);
    }

    fn msg(epoch: u64, body: Body) -> Bytes {
        RingMsg { epoch, body }.encode()
    }

    #[test]
    fn messages_of_a_deposed_master_are_refused() {
        let me = MemberId(5);
        let mut r =
            Replica::new_mirror("q", "b", me, Settings::default(), memory(), record("a", 3));
        r.handle_deliver(MemberId(1), &msg(3, Body::Master { from: 0 }));
        assert_eq!(r.epoch(), 3);
        // A new master at epoch 7 speaks: followed.
        r.handle_deliver(MemberId(2), &msg(7, Body::Master { from: 0 }));
        assert_eq!(r.epoch(), 7);
        // The old one (epoch 3) is refused, and so is a stranger at the same epoch.
        let ops = Body::Ops {
            ops: vec![Op::Purge],
            publishes: vec![],
            refused: vec![],
        };
        r.handle_deliver(MemberId(1), &msg(3, ops.clone()));
        r.handle_deliver(MemberId(9), &msg(7, ops));
        assert_eq!(r.refused(), 2);
        r.handle_deliver(MemberId(2), b"garbage");
        assert_eq!(r.refused(), 3);
    }

    /// A master of queue "q" on node "a", in-memory, at record epoch 2.
    fn master_at_epoch_2(me: MemberId) -> Replica {
        let bq = BackingQueue::in_memory(QueueConfig {
            record_ops: true,
            ..QueueConfig::default()
        });
        Replica::new_master(
            "q",
            "a",
            me,
            Settings::default(),
            memory(),
            bq,
            HeldPublishes::new(),
            record("a", 2),
        )
    }

    /// A master started from its own copy (a deposed master's, say) while
    /// the record still counts node b synchronised and b's member, which
    /// followed the master before, runs in the ring: nothing is confirmed
    /// until the record stops counting b, or b could be promoted on the
    /// record's word without it. Before, the publish was confirmed at once
    /// (chaos seed 54003: a master restarted from its copy confirmed a
    /// batch for 30 ms, the old master's mirror on another node was
    /// promoted, and the batch was lost).
    #[test]
    fn a_master_confirms_nothing_while_the_record_counts_a_mirror_it_has_not_synchronised() {
        let me = MemberId(1);
        let mut r = master_at_epoch_2(me);
        let b_synchronised = RecordView {
            version: 2,
            master: "a".into(),
            mirrors: vec!["b".into()],
            synchronised: vec!["b".into()],
        };
        r.handle_record(b_synchronised.clone());
        r.handle_view(with_mirror(me, MemberId(2)));
        publish_seq(&mut r, 1).unwrap();
        r.flush();
        let outputs: Vec<Output> = r.drain_outputs().collect();
        let proposed = outputs.iter().find_map(|o| match o {
            Output::ProposeRecord { view, .. } => Some(view.synchronised.clone()),
            _ => None,
        });
        assert_eq!(
            proposed,
            Some(Vec::new()),
            "the master proposes a record without b synchronised"
        );
        // The ring confirms everything broadcast.
        let sent = outputs
            .iter()
            .filter(|o| matches!(o, Output::Broadcast(_)))
            .count();
        r.handle_confirm(sent as u64);
        assert_eq!(
            confirmed(&mut r),
            Vec::<u64>::new(),
            "confirmed while the record counts b"
        );
        r.record_settled(RecordView {
            version: 3,
            synchronised: Vec::new(),
            ..b_synchronised
        });
        assert_eq!(confirmed(&mut r), vec![1]);
    }

    /// Publishes message `seq` (body "x") as publisher 4's `seq`.
    fn publish_seq(r: &mut Replica, seq: u64) -> Result<(), MirrorError> {
        r.publish(
            1,
            PublishId { publisher: 4, seq },
            NewMessage::new(seq, &b"x"[..], false),
        )
    }

    /// [`master_at_epoch_2`], the only member of its ring.
    fn lone_master(me: MemberId) -> Replica {
        let mut r = master_at_epoch_2(me);
        r.handle_view(alone(me));
        r
    }

    /// Flushes `r`'s batch and confirms every broadcast it sent.
    fn confirm_round(r: &mut Replica) {
        r.flush();
        let sent = r
            .drain_outputs()
            .filter(|o| matches!(o, Output::Broadcast(_)))
            .count() as u64;
        r.handle_confirm(sent);
    }

    /// A publish sent again (over a new link to the same master) is held
    /// once: confirmed with its first copy while that waits, at once after.
    #[test]
    fn a_publish_sent_again_is_held_once_and_confirmed() {
        let mut r = lone_master(MemberId(1));
        publish_seq(&mut r, 1).unwrap();
        publish_seq(&mut r, 2).unwrap();
        // Again before the first copies are confirmed: no new message.
        publish_seq(&mut r, 1).unwrap();
        assert_eq!(r.stats().unwrap().ready, 2);
        confirm_round(&mut r);
        assert_eq!(confirmed(&mut r), vec![1, 2]);
        let before = r.broadcasts;
        // Again after: confirmed once the ring has the next broadcast.
        publish_seq(&mut r, 3).unwrap();
        publish_seq(&mut r, 2).unwrap();
        assert_eq!(r.stats().unwrap().ready, 3);
        r.flush();
        let out: Vec<Output> = r.drain_outputs().collect();
        assert!(
            out.iter().all(|o| matches!(o, Output::Broadcast(_))),
            "behind publish 3's broadcast: {out:?}"
        );
        assert_eq!(r.broadcasts, before + 1);
        r.handle_confirm(before + 1);
        assert_eq!(confirmed(&mut r), vec![3, 2]);
        // With no op to carry it: an empty broadcast, never at once.
        publish_seq(&mut r, 1).unwrap();
        assert!(confirmed(&mut r).is_empty());
        r.flush();
        assert_eq!(r.drain_outputs().count(), 1, "one broadcast");
        r.handle_confirm(before + 2);
        assert_eq!(confirmed(&mut r), vec![1]);
        assert_eq!(r.stats().unwrap().ready, 3);
    }

    #[test]
    fn a_master_hearing_a_newer_epoch_is_deposed_and_nacks() {
        let me = MemberId(1);
        let mut r = lone_master(me);
        publish_seq(&mut r, 9).unwrap();
        let token = r.fetch(1).unwrap();
        r.drain_outputs().for_each(drop);
        r.handle_deliver(MemberId(2), &msg(5, Body::Master { from: 0 }));
        assert_eq!(r.role(), Role::Stopped);
        let out: Vec<Output> = r.drain_outputs().collect();
        assert!(out.contains(&Output::Nacked(vec![PublishId {
            publisher: 4,
            seq: 9
        }])));
        assert!(out.contains(&Output::FetchFailed { token }));
        assert!(out.contains(&Output::Deposed { epoch: 2 }));
        assert!(matches!(publish_seq(&mut r, 10), Err(MirrorError::Stopped)));
    }

    /// A master started again from a stopped master's kept copy holds what
    /// that one held: a publish sent again to it is not enqueued twice
    /// (chaos seed 1: a master removed from its ring and started again from
    /// its copy took 20 publishes a second time, delivered again without
    /// the redelivered flag). One started from a copy whose holdings are not
    /// known (recovered from disk) refuses a publish sent again from a
    /// publisher it has not heard since, and takes one it has.
    #[test]
    fn a_master_from_a_kept_copy_holds_what_its_copy_held() {
        let mut r = lone_master(MemberId(1));
        publish_seq(&mut r, 1).unwrap();
        publish_seq(&mut r, 2).unwrap();
        r.handle_removed();
        let held = r.held().clone();
        let bq = r.into_queue().expect("the kept copy");
        let again = |r: &mut Replica, publisher, seq| {
            r.publish_again(
                1,
                PublishId { publisher, seq },
                NewMessage::new(seq, &b"x"[..], false),
            )
        };
        let mut next = Replica::new_master(
            "q",
            "a",
            MemberId(3),
            Settings::default(),
            memory(),
            bq,
            held,
            record("a", 4),
        );
        next.handle_view(alone(MemberId(3)));
        again(&mut next, 4, 2).unwrap();
        again(&mut next, 4, 3).unwrap();
        assert_eq!(next.stats().unwrap().ready, 3, "2 held once, 3 new");
        confirm_round(&mut next);
        assert_eq!(confirmed(&mut next), vec![2, 3]);

        let recovered = next.into_queue().expect("a copy");
        let mut r = Replica::new_master(
            "q",
            "a",
            MemberId(5),
            Settings::default(),
            memory(),
            recovered,
            HeldPublishes::unknown(),
            record("a", 6),
        );
        r.handle_view(alone(MemberId(5)));
        assert!(matches!(
            again(&mut r, 4, 3),
            Err(MirrorError::UnknownPublisher)
        ));
        publish_seq(&mut r, 7).unwrap();
        again(&mut r, 4, 7).unwrap();
        again(&mut r, 4, 8).unwrap();
        assert_eq!(r.stats().unwrap().ready, 5, "7 held once, 8 new");
    }

    /// A master removed from its ring keeps its copy for this node's next
    /// replica; a client's ack and a closed channel's requeue that come
    /// before the copy is taken count in it (chaos seed 46 with four
    /// queues: 8 deliveries acked in that moment stayed unacknowledged in
    /// the copy, served again, for ever).
    #[test]
    fn settlements_after_a_master_stopped_count_in_its_kept_copy() {
        let mut r = lone_master(MemberId(1));
        publish_seq(&mut r, 1).unwrap();
        publish_seq(&mut r, 2).unwrap();
        let tokens = [r.fetch(1).unwrap(), r.fetch(1).unwrap()];
        confirm_round(&mut r);
        let tags: Vec<DeliveryTag> = r
            .drain_outputs()
            .filter_map(|o| match o {
                Output::Fetched {
                    token,
                    delivery: Some(d),
                } if tokens.contains(&token) => Some(d.tag),
                _ => None,
            })
            .collect();
        assert_eq!(tags.len(), 2, "both fetches handed out");
        r.handle_removed();
        assert_eq!(r.role(), Role::Stopped);
        r.ack(tags[0]).unwrap();
        r.requeue(tags[1]).unwrap();
        let bq = r.into_queue().expect("the kept copy");
        let stats = bq.stats();
        assert_eq!(
            (stats.ready, stats.unacked),
            (1, 0),
            "one acked, one back in the queue"
        );
        // A mirror's copy holds no delivery of its own to settle.
        let mut m = Replica::new_mirror(
            "q",
            "b",
            MemberId(2),
            Settings::default(),
            memory(),
            record("a", 2),
        );
        m.handle_removed();
        assert!(matches!(m.ack(1), Err(MirrorError::Stopped)));
    }

    /// A mirror that joined the ring as the master's sync of an empty queue
    /// went round missed its start; its ask is answered at once (in manual
    /// mode nothing would ask again), while an ask that predates a sync
    /// with messages still waits for it.
    #[test]
    fn an_ask_after_an_empty_sync_is_answered_with_another() {
        let (me, mirror) = (MemberId(1), MemberId(2));
        let mut r = master_at_epoch_2(me);
        r.handle_view(alone(me));
        let both = with_mirror(me, mirror);
        r.handle_view(both.clone());
        assert_eq!(
            r.sync_awaiting[&mirror].sync, 1,
            "an empty queue is synchronised"
        );
        r.handle_deliver(mirror, &msg(2, Body::NeedSync { after: 0 }));
        assert_eq!(r.sync_awaiting[&mirror].sync, 2, "synchronised again");

        let mut r = master_at_epoch_2(me);
        r.handle_view(alone(me));
        publish_seq(&mut r, 1).unwrap();
        r.set_settings(Settings {
            sync_mode: SyncMode::Automatic,
            ..Settings::default()
        });
        r.handle_view(both);
        assert_eq!(r.sync_awaiting[&mirror].sync, 1);
        r.handle_deliver(mirror, &msg(2, Body::NeedSync { after: 0 }));
        assert_eq!(
            r.sync_awaiting[&mirror].sync, 1,
            "the sync on its way answers it"
        );
    }

    /// `m` (member 1, holding message 1, automatic sync) and a mirror
    /// (member 2) it has synchronised, the ring's messages carried between
    /// them by hand.
    fn synchronised_pair(mut m: Replica) -> (Replica, Replica) {
        let (me, mirror) = (MemberId(1), MemberId(2));
        m.set_settings(Settings {
            sync_mode: SyncMode::Automatic,
            ..Settings::default()
        });
        m.handle_view(alone(me));
        publish_seq(&mut m, 1).unwrap();
        let both = with_mirror(me, mirror);
        let mut r = Replica::new_mirror(
            "q",
            "b",
            mirror,
            Settings::default(),
            memory(),
            record("a", 2),
        );
        m.handle_view(both.clone());
        r.handle_view(both);
        for _ in 0..4 {
            relay(&mut m, &mut r);
        }
        (m, r)
    }

    /// Hands what each of master `m` (member 1) and mirror `r` (member 2)
    /// broadcast to the other.
    fn relay(m: &mut Replica, r: &mut Replica) {
        let sent = |r: &mut Replica| -> Vec<Bytes> {
            r.flush();
            r.drain_outputs()
                .filter_map(|o| match o {
                    Output::Broadcast(b) => Some(b),
                    _ => None,
                })
                .collect()
        };
        for b in sent(m) {
            r.handle_deliver(MemberId(1), &b);
        }
        for b in sent(r) {
            m.handle_deliver(MemberId(2), &b);
        }
    }

    /// A publish the master refused is not held, though a later one of its
    /// publisher is, on the master and on its mirrors (which may take over
    /// before the publish comes again: its nack lost with a link).
    #[test]
    fn a_refused_publish_is_not_held_on_the_master_nor_its_mirrors() {
        let (mut m, mut r) = synchronised_pair(master_at_epoch_2(MemberId(1)));
        let id = |seq| PublishId { publisher: 4, seq };
        m.publish_refused(id(2));
        publish_seq(&mut m, 3).unwrap();
        m.publish_refused(id(4));
        relay(&mut m, &mut r);
        for held in [&m.held, &r.held] {
            let got: Vec<Holds> = (1..=4).map(|s| held.holds(id(s))).collect();
            assert_eq!(got, [Holds::Yes, Holds::No, Holds::Yes, Holds::No]);
        }
        // Refused while cut off from the majority: noted too.
        m.set_isolated(true);
        assert!(publish_seq(&mut m, 5).is_err());
        assert_eq!(m.held.holds(id(5)), Holds::No);
        m.set_isolated(false);
        publish_seq(&mut m, 6).unwrap();
        assert_eq!(m.held.holds(id(5)), Holds::No);
    }

    /// A mirror synchronised by a master that does not know everything its
    /// copy holds (started from a copy recovered from disk) knows it does
    /// not either, so that, promoted, it refuses a publish sent again from
    /// a publisher it has not heard, as that master would
    /// ([`Replica::publish_again`]).
    #[test]
    fn a_mirror_synchronised_by_a_master_recovered_from_disk_knows_it() {
        let recovered = |held| {
            let bq = BackingQueue::in_memory(QueueConfig {
                record_ops: true,
                ..QueueConfig::default()
            });
            let s = Settings::default();
            Replica::new_master("q", "a", MemberId(1), s, memory(), bq, held, record("a", 2))
        };
        let (m, r) = synchronised_pair(recovered(HeldPublishes::unknown()));
        assert!(r.digest().is_some() && r.digest() == m.digest());
        assert!(!r.held.is_complete(), "not known on the mirror either");
        let (_, r) = synchronised_pair(recovered(HeldPublishes::new()));
        assert!(r.held.is_complete());
    }

    /// A mirror that holds one master's state keeps it for a new master
    /// that continues that state (a mirror promoted from the same ring),
    /// and drops it, asking for a sync, for one that does not (a master
    /// started from a copy of its own): that one's ops apply to its state
    /// only.
    #[test]
    fn a_mirror_keeps_its_copy_only_for_a_master_that_continues_it() {
        let (m, mut r) = synchronised_pair(master_at_epoch_2(MemberId(1)));
        assert_eq!(
            r.digest(),
            m.digest(),
            "the mirror holds the master's state"
        );
        assert!(r.digest().is_some());
        r.handle_deliver(MemberId(3), &msg(3, Body::Master { from: 2 }));
        assert_eq!(r.digest(), m.digest(), "kept for a master continuing it");
        r.drain_outputs().for_each(drop);
        r.handle_deliver(MemberId(4), &msg(4, Body::Master { from: 0 }));
        assert_eq!(r.digest(), None, "dropped for a master of its own copy");
        let asked = r.drain_outputs().any(|o| {
            matches!(o, Output::Broadcast(b)
                if RingMsg::decode(&b).is_some_and(|m| matches!(m.body, Body::NeedSync { .. })))
        });
        assert!(asked, "a sync asked for");
    }

    #[test]
    fn a_record_naming_another_master_deposes() {
        let me = MemberId(1);
        let mut r = master_at_epoch_2(me);
        r.handle_record(record("b", 3));
        assert_eq!(r.role(), Role::Stopped);
        assert!(r.drain_outputs().any(|o| o == Output::Deposed { epoch: 2 }));
    }
}
