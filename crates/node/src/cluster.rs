//! Clustering for the `warren` node: the command line (`--peer-addr`,
//! `--join`, `--transport`, `--peer-tls`, `--cluster-secret-file`,
//! `--cluster-ca-dir`, `--boot-wait`), starting [`warren_cluster::Cluster`]
//! on its own runtime, and the broker's metadata kept in the cluster
//! ([`ClusterStore`]) with every change made elsewhere replayed on the local
//! broker ([`replay`]).
//!
//! Without `--peer-addr` none of this runs: the node is a single node with
//! its metadata in a JSON file, as before. A node that ran alone and is then
//! started with `--peer-addr` (and no `--join`) imports that file into the
//! new cluster once.
//!
//! `join_cluster` ([`Control`]'s `join`): with the app stopped and the seed
//! answering the cluster handshake, the node stops, leaves a marker holding
//! the seed in its data directory and re-executes itself (same PID,
//! arguments, name, ports and data directory). The new process finds the
//! marker, resets the node's own data (Raft state, metadata, queue logs),
//! joins through the seed exactly as a first start with `--join` does, and
//! starts with its app stopped, as RabbitMQ's `join_cluster` leaves it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::{Args, ValueEnum};
use imbl::ordmap::DiffItem;
use serde_json::{Value, json};
use tokio::sync::Notify;
use warren_amqp::amq_protocol::types::FieldTable;
use warren_broker::auth::{PermissionDef, UserDef};
use warren_broker::meta::{
    BindingDef, Change, Definitions, ExchangeDef, MetaError, MetadataStore, PolicyDef, QueueDef,
};
use warren_broker::{Broker, MetaCommit};
use warren_broker::{json_to_table, table_to_json};
use warren_cluster::{
    ArgValue, Arguments, BindingRecord, Cluster, ClusterConfig, ClusterError, Command,
    DestinationKind, ExchangeRecord, Metadata, NodeEvent, Outcome, Permissions, PolicyRecord,
    QueueRecord, Rejection, UserRecord,
};
use warren_lock::MeasuredMutex;
use warren_transport::mux::{Mux, Service};
use warren_transport::{ClusterSecret, NodeName, PeerAddr, Transport, TransportConfig};

use crate::app::AppControl;
use crate::mirroring::Mirroring;
use warren_mirror_driver::MetadataSource;

/// The clustering part of the command line.
#[derive(Debug, Clone, Args)]
pub(crate) struct ClusterArgs {
    /// Run as a cluster member: listen for peers on HOST:PORT, and bind
    /// HOST's IP when dialing peers. Without it the node runs alone.
    #[arg(long, value_name = "HOST:PORT")]
    pub peer_addr: Option<String>,
    /// A running member (its peer address) to join on first start; ignored
    /// once the node has cluster state in its data directory.
    #[arg(long, value_name = "HOST:PORT", requires = "peer_addr")]
    pub join: Option<String>,
    /// The transport between nodes.
    #[arg(long, value_enum, default_value_t = PeerTransport::Tcp)]
    pub transport: PeerTransport,
    /// TLS on TCP links between nodes: `on` encrypts them and has both ends
    /// prove a certificate from the cluster CA; `off` sends all peer traffic
    /// (messages, Raft) in the clear, for a trusted network only. QUIC is
    /// always TLS. Every node of a cluster needs the same setting.
    #[arg(long, value_enum, value_name = "on|off", default_value_t = PeerTls::On)]
    pub peer_tls: PeerTls,
    /// A file holding the cluster secret (shared by every node; required
    /// with `--peer-addr`). Without `--cluster-ca-dir` the cluster CA is
    /// derived from it too: make it long and random.
    #[arg(long, value_name = "FILE")]
    pub cluster_secret_file: Option<PathBuf>,
    /// The cluster CA for TLS between nodes: `ca.crt` and `ca.key` in this
    /// directory. The first node to start with an empty directory creates
    /// them; copy both files to every other host's directory. Without it,
    /// every node derives the same CA from the cluster secret.
    #[arg(long, value_name = "DIR")]
    pub cluster_ca_dir: Option<PathBuf>,
    /// How long a restarted node waits for a majority of its cluster before
    /// it gives up, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 300)]
    pub boot_wait: u64,
    /// A member silent for this long is down, in seconds (RabbitMQ's
    /// `net_ticktime`, whose default is 60). A member whose process is gone
    /// is down at once: its address refuses.
    #[arg(long, value_name = "SECONDS", default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    pub net_ticktime: u64,
}

/// The transports between nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum PeerTransport {
    /// TCP, with mutual TLS from the cluster CA unless `--peer-tls off`.
    Tcp,
    /// QUIC, always with mutual TLS from the cluster CA.
    Quic,
}

/// Whether TCP links between nodes run TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum PeerTls {
    /// Mutual TLS from the cluster CA.
    On,
    /// Plain TCP: only the handshake is authenticated (a trusted network only).
    Off,
}

/// Reads the cluster secret; refuses a missing, unreadable or empty file.
pub(crate) fn read_secret(path: Option<&Path>) -> anyhow::Result<ClusterSecret> {
    let Some(path) = path else {
        anyhow::bail!(
            "--peer-addr needs --cluster-secret-file FILE: every node of a cluster must be \
             started with the same secret"
        );
    };
    let text = std::fs::read(path)
        .with_context(|| format!("cannot read the cluster secret file {}", path.display()))?;
    let trimmed = text.trim_ascii();
    if trimmed.is_empty() {
        anyhow::bail!(
            "the cluster secret file {} is empty; put the cluster's shared secret in it",
            path.display()
        );
    }
    Ok(ClusterSecret::new(trimmed.to_vec()))
}

const CA_NAME: &str = "Warren cluster CA";

fn ca_params() -> rcgen::CertificateParams {
    let mut p = rcgen::CertificateParams::default();
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    p.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
    ];
    p.distinguished_name
        .push(rcgen::DnType::CommonName, CA_NAME);
    p
}

/// What the cluster secret is keyed with to derive the cluster CA's key.
const DERIVED_CA_LABEL: &[u8] = b"warren-cluster-ca-v1";

/// This node's certificate from the cluster CA: the one in `dir`
/// (`--cluster-ca-dir`), or else the one every node derives from the cluster
/// secret.
fn node_identity(
    dir: Option<&Path>,
    secret: &ClusterSecret,
    node: &str,
) -> anyhow::Result<warren_tls::NodeIdentity> {
    match dir {
        Some(dir) => ca_dir_identity(dir, node),
        None => warren_tls::ClusterCa::derive(&secret.derive_key(DERIVED_CA_LABEL))
            .and_then(|ca| ca.issue(node))
            .context("issuing the node certificate from the CA derived from the cluster secret"),
    }
}

/// Loads the cluster CA from `dir` (`ca.crt`, `ca.key`), creating it if
/// the directory has none (one node creates it; others starting at the same
/// time wait for it), and issues this node's identity from it.
fn ca_dir_identity(dir: &Path, node: &str) -> anyhow::Result<warren_tls::NodeIdentity> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating the cluster CA directory {}", dir.display()))?;
    let (crt, key) = (dir.join("ca.crt"), dir.join("ca.key"));
    let lock = dir.join("ca.lock");
    if !crt.exists() {
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&lock)
        {
            Ok(_) => {
                let kp = rcgen::KeyPair::generate().context("generating the CA key")?;
                let cert = ca_params()
                    .self_signed(&kp)
                    .context("self-signing the CA")?;
                write_atomic(&key, kp.serialize_pem().as_bytes())?;
                write_atomic(&crt, cert.pem().as_bytes())?;
                tracing::info!(dir = %dir.display(), "created a new cluster CA");
            }
            Err(_) => {
                // Another node creates it: wait a little for it.
                for _ in 0..100 {
                    if crt.exists() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }
    let ca_pem = std::fs::read_to_string(&crt)
        .with_context(|| format!("reading the cluster CA certificate {}", crt.display()))?;
    let key_pem = std::fs::read_to_string(&key)
        .with_context(|| format!("reading the cluster CA key {}", key.display()))?;
    let ca_key = rcgen::KeyPair::from_pem(&key_pem)
        .with_context(|| format!("parsing the cluster CA key {}", key.display()))?;
    let issuer = rcgen::Issuer::new(ca_params(), ca_key);
    let mut params =
        rcgen::CertificateParams::new(vec![warren_tls::CLUSTER_SERVER_NAME.to_owned()])
            .context("node certificate parameters")?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, node);
    let node_key = rcgen::KeyPair::generate().context("generating the node key")?;
    let cert = params
        .signed_by(&node_key, &issuer)
        .context("signing the node certificate")?;
    warren_tls::NodeIdentity::from_pem(&cert.pem(), &node_key.serialize_pem(), &ca_pem)
        .context("loading the node identity")
}

fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Starts this node's cluster member (call on the cluster's runtime).
pub(crate) async fn start(
    args: &ClusterArgs,
    node_name: &str,
    data_dir: &Path,
) -> anyhow::Result<(Cluster, Transports)> {
    let peer_addr = args
        .peer_addr
        .clone()
        .context("clustering needs --peer-addr")?;
    let secret = read_secret(args.cluster_secret_file.as_deref())?;
    let node = NodeName::new(node_name.to_owned())
        .map_err(|e| anyhow::anyhow!("invalid --node-name {node_name:?}: {e}"))?;
    let sock: SocketAddr = tokio::net::lookup_host(&peer_addr)
        .await
        .with_context(|| format!("resolving --peer-addr {peer_addr}"))?
        .next()
        .with_context(|| format!("--peer-addr {peer_addr} resolves to nothing"))?;
    let mut tc = TransportConfig::new(node.clone(), secret);
    tc.bind_ip = Some(sock.ip()).filter(|ip: &IpAddr| !ip.is_unspecified());
    let (cluster_dialer, broker_dialer) = peer_transports(args, &tc, node_name, sock.ip())?;
    // The one listener for peers, on this (the cluster's) runtime: Raft's
    // I/O never waits for the broker's runtime.
    let peer_addr = PeerAddr::new(peer_addr);
    let mux = Mux::listen(cluster_dialer.as_ref(), &peer_addr, tc.handshake_timeout)
        .await
        .with_context(|| format!("listening for peers on {peer_addr}"))?;
    let transports = Transports {
        raft: mux.service(Service::Metadata, cluster_dialer),
        rings: mux.service(Service::Rings, broker_dialer.clone()),
        links: mux.service(Service::Links, broker_dialer),
    };
    let mut cfg = ClusterConfig::new(node, peer_addr, data_dir, transports.raft.clone());
    cfg.join = args.join.clone().map(PeerAddr::new);
    cfg.boot_wait_retries = 1;
    cfg.boot_wait_timeout = Duration::from_secs(args.boot_wait.max(1));
    cfg.failure_timeout = Duration::from_secs(args.net_ticktime);
    let bootstrap = cfg.join.is_none();
    let cluster = Cluster::start(cfg)
        .await
        .context("starting the cluster member")?;
    // Everything committed before we start serving is applied here.
    let metadata = cluster
        .read_linearizable()
        .await
        .context("reading the cluster metadata")?;
    let file = data_dir.join("metadata.json");
    if bootstrap && metadata.vhosts.is_empty() && file.exists() {
        import_file_store(&cluster, &file).await?;
    }
    Ok((cluster, transports))
}

/// The services' views of the node's one peer port ([`Mux`]): the Raft
/// metadata store's (on the cluster's runtime), the GM rings' and the
/// forwarding links' (on the broker's, dialing with a transport of their own).
pub(crate) struct Transports {
    raft: Arc<dyn Transport>,
    rings: Arc<dyn Transport>,
    links: Arc<dyn Transport>,
}

/// The transports between nodes as `--transport` and `--peer-tls` ask for,
/// both with this node's identity: the cluster's (it also listens) and the
/// broker's, with which the GM rings and forwarding links dial: a QUIC
/// endpoint's socket is driven on the runtime that made it, and Raft's
/// runtime is not the broker's.
fn peer_transports(
    args: &ClusterArgs,
    tc: &TransportConfig,
    node_name: &str,
    ip: IpAddr,
) -> anyhow::Result<(Arc<dyn Transport>, Arc<dyn Transport>)> {
    use warren_transport_quic::{QuicOptions, QuicTransport};
    use warren_transport_tcp::TcpTransport;
    let identity = || node_identity(args.cluster_ca_dir.as_deref(), &tc.secret, node_name);
    let (cluster, broker): (Arc<dyn Transport>, Arc<dyn Transport>) =
        match (args.transport, args.peer_tls) {
            (PeerTransport::Tcp, PeerTls::Off) => {
                tracing::warn!(
                    "--peer-tls off: traffic between nodes (messages, Raft) is neither encrypted \
                     nor authenticated after the handshake; use it on a trusted network only"
                );
                (
                    Arc::new(TcpTransport::new(tc.clone())),
                    Arc::new(TcpTransport::new(tc.clone())),
                )
            }
            (PeerTransport::Tcp, PeerTls::On) => {
                let id = identity()?;
                let tcp = || {
                    TcpTransport::with_tls(tc.clone(), &id).context("setting up TLS between nodes")
                };
                (Arc::new(tcp()?), Arc::new(tcp()?))
            }
            (PeerTransport::Quic, PeerTls::Off) => {
                anyhow::bail!(
                    "--peer-tls off is for --transport tcp: QUIC between nodes is always TLS"
                )
            }
            (PeerTransport::Quic, PeerTls::On) => {
                let id = identity()?;
                let options = if ip.is_loopback() {
                    QuicOptions::loopback()
                } else {
                    QuicOptions::default()
                };
                let quic = || {
                    QuicTransport::new(tc.clone(), &id, &options)
                        .context("starting the QUIC transport")
                };
                (Arc::new(quic()?), Arc::new(quic()?))
            }
        };
    Ok((cluster, broker))
}

/// A node that ran alone and now starts a new cluster brings its durable
/// entities along: `metadata.json` is committed to the cluster once.
pub(crate) async fn import_file_store<S: MetadataSource>(
    cluster: &S,
    file: &Path,
) -> anyhow::Result<()> {
    let defs = warren_broker::meta::FileStore::open(file)?.load();
    let node = cluster.node().to_string();
    let mut changes: Vec<Change> = Vec::new();
    changes.extend(defs.vhosts.into_iter().map(Change::PutVhost));
    changes.extend(defs.users.into_iter().map(Change::PutUser));
    changes.extend(defs.permissions.into_iter().map(Change::PutPermission));
    changes.extend(defs.policies.into_iter().map(Change::PutPolicy));
    changes.extend(defs.exchanges.into_iter().map(Change::PutExchange));
    changes.extend(defs.queues.into_iter().map(Change::PutQueue));
    changes.extend(defs.bindings.into_iter().map(Change::PutBinding));
    let n = changes.len();
    for change in changes {
        cluster
            .write(to_command(change, &node))
            .await
            .with_context(|| format!("importing {} into the cluster", file.display()))?;
    }
    tracing::info!(file = %file.display(), entities = n, "imported the single-node metadata into the new cluster");
    Ok(())
}

// ------------------------------------------------------------ the store

/// How long a metadata change may take before the client gets an error.
const WRITE_TIMEOUT: Duration = Duration::from_secs(25);
/// How long a metadata change may take once this node sees no majority.
const NO_MAJORITY_WAIT: Duration = Duration::from_secs(2);

/// The broker's [`MetadataStore`] kept in the cluster's Raft store: every
/// change is committed by a majority (and applied on this node, so a replay
/// never sees older metadata than the broker already has) before
/// [`MetadataStore::apply`] returns.
pub(crate) struct ClusterStore<S: MetadataSource = Cluster> {
    cluster: S,
    rt: tokio::runtime::Handle,
    replaying: Arc<AtomicBool>,
    node: String,
    /// [`MetadataStore::close_waits`].
    close_waits: bool,
}

impl<S: MetadataSource> std::fmt::Debug for ClusterStore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterStore")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl<S: MetadataSource> ClusterStore<S> {
    /// A store over `cluster`, whose tasks run on `rt`. While `replaying` is
    /// set, changes are not written (they come from the cluster).
    pub(crate) fn new(cluster: S, rt: tokio::runtime::Handle, replaying: Arc<AtomicBool>) -> Self {
        let node = cluster.node().to_string();
        Self {
            cluster,
            rt,
            replaying,
            node,
            close_waits: false,
        }
    }

    /// The store of a sharded node's shard: a client's close-ok waits for
    /// its exclusive queues' deletes ([`MetadataStore::close_waits`]).
    pub(crate) fn closing_after_commit(mut self) -> Self {
        self.close_waits = true;
        self
    }

    /// Commits `cmds` in order, waiting (the broker's lock held) for
    /// [`commit`]: the definitions an operator changes through the
    /// management API. A client's declare, delete or bind is committed off
    /// the lock ([`commit_loop`]).
    fn commit_blocking(&self, cmds: Vec<Command>) -> Result<(), MetaError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let cluster = self.cluster.clone();
        self.rt.spawn(async move {
            let _ = tx.send(commit(&cluster, cmds).await);
        });
        match rx.recv_timeout(WRITE_TIMEOUT + Duration::from_secs(1)) {
            Ok(r) => r.map_err(MetaError::Cluster),
            Err(_) => Err(MetaError::Cluster(TIMED_OUT.into())),
        }
    }
}

const TIMED_OUT: &str = "the cluster did not answer in time (no majority?)";

/// Commits `cmds` in order, in at most [`WRITE_TIMEOUT`], or
/// [`NO_MAJORITY_WAIT`] once this node's failure detector sees no majority:
/// a node cut off from most of the cluster answers a declare with an error
/// within seconds. (Only shortened, not refused at once: under load the
/// detector can miss a majority that Raft still has, and the change then
/// goes through in milliseconds.)
async fn commit<S: MetadataSource>(cluster: &S, cmds: Vec<Command>) -> Result<(), String> {
    bounded(cluster, async {
        for cmd in cmds {
            let deleting = is_delete(&cmd);
            if let Err(e) = cluster.write_everywhere(cmd).await {
                settled(deleting, e)?;
            }
        }
        Ok(())
    })
    .await
}

/// Whether a command that failed with `e` counts as done: deleting what is
/// already gone is. Else the error, as the client is told it.
fn settled(deleting: bool, e: ClusterError) -> Result<(), String> {
    match e {
        ClusterError::Rejected(
            Rejection::NoVhost(_)
            | Rejection::NoUser(_)
            | Rejection::NoQueue { .. }
            | Rejection::NoExchange { .. },
        ) if deleting => Ok(()),
        e => Err(e.to_string()),
    }
}

/// Commits the commands of several client commands as one log entry
/// ([`Command::Batch`]: each applied as if on its own, in order), bounded as
/// [`commit`] is; the result of each.
async fn commit_together<S: MetadataSource>(
    cluster: &S,
    cmds: Vec<Command>,
) -> Vec<Result<(), String>> {
    let n = cmds.len();
    let deleting: Vec<bool> = cmds.iter().map(is_delete).collect();
    let mut each = Vec::with_capacity(n);
    let r = bounded(cluster, async {
        match cluster.write_everywhere(Command::Batch(cmds)).await {
            Ok(Outcome::Batch(results)) if results.len() == n => {
                for (result, deleting) in results.into_iter().zip(deleting) {
                    each.push(match result {
                        Ok(_) => Ok(()),
                        Err(rej) => settled(deleting, ClusterError::Rejected(rej)),
                    });
                }
                Ok(())
            }
            Ok(other) => Err(format!("unexpected answer to a batch: {other:?}")),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
    match r {
        Ok(()) => each,
        Err(e) => vec![Err(e); n],
    }
}

/// Runs `write` in at most [`WRITE_TIMEOUT`], or [`NO_MAJORITY_WAIT`] once
/// this node's failure detector sees no majority.
async fn bounded<S: MetadataSource>(
    cluster: &S,
    write: impl Future<Output = Result<(), String>>,
) -> Result<(), String> {
    const NO_MAJORITY: &str = "no majority of the cluster's nodes is reachable from this node";
    let mut majority = cluster.majority();
    let cut_off = async {
        if majority.wait_for(|m| !*m).await.is_err() {
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(NO_MAJORITY_WAIT).await;
    };
    tokio::select! {
        r = write => r,
        () = cut_off => Err(NO_MAJORITY.to_owned()),
        () = tokio::time::sleep(WRITE_TIMEOUT) => Err(TIMED_OUT.to_owned()),
    }
}

/// Makes the metadata commits that clients wait for
/// ([`Broker::take_commits`]), off the broker's lock, one at a time in the
/// order they were asked (a bind may need the declare before it); a
/// refused one wakes the replay loop, which undoes it here.
async fn commit_loop<S: MetadataSource>(
    cluster: S,
    rt: tokio::runtime::Handle,
    broker: Arc<MeasuredMutex<Broker>>,
    wake: Arc<Notify>,
    replay: Arc<Notify>,
) {
    let node = cluster.node().to_string();
    let majority = cluster.majority();
    // Once a commit failed in a minority, the next ones fail at once while
    // the minority lasts (each would wait as long again, one after the
    // other).
    let mut refused_for: Option<String> = None;
    loop {
        wake.notified().await;
        let batch = crate::lock(&broker).take_commits();
        // Client commands of one change each (a declare, a bind, a
        // delete), pending together, go to the log as one entry: their
        // order kept, one Raft round and one wait for the members instead
        // of one each. A command of several changes goes on its own, so
        // that its later changes are not made once an earlier one failed.
        let mut together: Vec<(u64, Command)> = Vec::new();
        let mut groups: Vec<Vec<(u64, Vec<Command>)>> = Vec::new();
        for MetaCommit { ticket, changes } in batch {
            let mut cmds: Vec<Command> =
                changes.into_iter().map(|c| to_command(c, &node)).collect();
            if cmds.len() == 1
                && let Some(cmd) = cmds.pop()
            {
                together.push((ticket, cmd));
                continue;
            }
            if !together.is_empty() {
                groups.push(
                    std::mem::take(&mut together)
                        .into_iter()
                        .map(|(t, c)| (t, vec![c]))
                        .collect(),
                );
            }
            groups.push(vec![(ticket, cmds)]);
        }
        if !together.is_empty() {
            groups.push(together.into_iter().map(|(t, c)| (t, vec![c])).collect());
        }
        for group in groups {
            let tickets: Vec<u64> = group.iter().map(|(t, _)| *t).collect();
            let c = cluster.clone();
            let results: Vec<Result<(), String>> =
                match refused_for.clone().filter(|_| !*majority.borrow()) {
                    Some(e) => vec![Err(e); tickets.len()],
                    None => {
                        let run = async move {
                            if group.len() == 1 {
                                let cmds = group.into_iter().flat_map(|(_, c)| c).collect();
                                vec![commit(&c, cmds).await]
                            } else {
                                let cmds = group.into_iter().flat_map(|(_, c)| c).collect();
                                commit_together(&c, cmds).await
                            }
                        };
                        match rt.spawn(run).await {
                            Ok(r) => r,
                            Err(e) => vec![Err(e.to_string()); tickets.len()],
                        }
                    }
                };
            refused_for = results
                .iter()
                .find_map(|r| r.as_ref().err())
                .filter(|_| !*majority.borrow())
                .cloned();
            let refused = results.iter().any(Result::is_err);
            {
                let mut b = crate::lock(&broker);
                for (ticket, result) in tickets.into_iter().zip(results) {
                    b.commit_done(ticket, result.map_err(MetaError::Cluster));
                }
            }
            if refused {
                replay.notify_one();
            }
        }
    }
}

fn is_delete(cmd: &Command) -> bool {
    matches!(
        cmd,
        Command::DeleteVhost { .. }
            | Command::DeleteUser { .. }
            | Command::ClearPermissions { .. }
            | Command::DeletePolicy { .. }
            | Command::DeleteExchange { .. }
            | Command::DeleteQueue { .. }
            | Command::Unbind(_)
    )
}

impl<S: MetadataSource> MetadataStore for ClusterStore<S> {
    fn load(&self) -> Definitions {
        to_definitions(&self.cluster.local())
    }

    fn apply(&mut self, change: Change) -> Result<(), MetaError> {
        if self.replaying.load(Ordering::SeqCst) {
            return Ok(());
        }
        let cmd = to_command(change, &self.node);
        self.commit_blocking(vec![cmd])
    }

    fn share(&mut self, change: Change) -> Result<(), MetaError> {
        self.apply(change)
    }

    fn shares(&self) -> bool {
        true
    }

    fn defers(&self) -> bool {
        true
    }

    fn close_waits(&self) -> bool {
        self.close_waits
    }

    fn is_member(&self, node: &str) -> bool {
        node != self.node.as_str()
            && self
                .cluster
                .local()
                .nodes
                .keys()
                .any(|n| n.as_str() == node)
    }

    fn master_candidates(&self) -> Option<Vec<(String, usize)>> {
        let meta = self.cluster.local();
        let up = self.cluster.up_nodes().borrow().clone();
        let mut masters: BTreeMap<&str, usize> = meta
            .nodes
            .keys()
            .filter(|n| *n == &self.node || up.iter().any(|u| u.as_str() == n.as_str()))
            .map(|n| (n.as_str(), 0))
            .collect();
        for q in meta.queues.values() {
            if let Some(c) = masters.get_mut(q.master.as_str()) {
                *c += 1;
            }
        }
        Some(
            masters
                .into_iter()
                .map(|(n, c)| (n.to_owned(), c))
                .collect(),
        )
    }
}

// ------------------------------------------------------------ conversions

/// Operator policies share the cluster's policy table under this prefix.
const OPERATOR_PREFIX: &str = "operator-policy:";

fn policy_name(name: &str, operator: bool) -> String {
    if operator {
        format!("{OPERATOR_PREFIX}{name}")
    } else {
        name.to_owned()
    }
}

fn json_to_arg(v: &Value) -> ArgValue {
    match v {
        Value::Null => ArgValue::Void,
        Value::Bool(b) => ArgValue::Bool(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => ArgValue::Int(i),
            None => ArgValue::Str(n.to_string()),
        },
        Value::String(s) => ArgValue::Str(s.clone()),
        Value::Array(a) => ArgValue::List(a.iter().map(json_to_arg).collect()),
        Value::Object(o) => {
            ArgValue::Table(o.iter().map(|(k, v)| (k.clone(), json_to_arg(v))).collect())
        }
    }
}

fn arg_to_json(v: &ArgValue) -> Value {
    match v {
        ArgValue::Void => Value::Null,
        ArgValue::Bool(b) => json!(b),
        ArgValue::Int(i) => json!(i),
        ArgValue::Str(s) => json!(s),
        ArgValue::Bytes(b) => json!(String::from_utf8_lossy(b)),
        ArgValue::List(l) => Value::Array(l.iter().map(arg_to_json).collect()),
        ArgValue::Table(t) => {
            Value::Object(t.iter().map(|(k, v)| (k.clone(), arg_to_json(v))).collect())
        }
    }
}

fn to_args(t: &FieldTable) -> Arguments {
    match json_to_arg(&table_to_json(t)) {
        ArgValue::Table(m) => m,
        _ => BTreeMap::new(),
    }
}

fn from_args(a: &Arguments) -> FieldTable {
    json_to_table(&Value::Object(
        a.iter().map(|(k, v)| (k.clone(), arg_to_json(v))).collect(),
    ))
}

fn binding_record(b: &BindingDef) -> BindingRecord {
    BindingRecord {
        vhost: b.vhost.clone(),
        source: b.source.clone(),
        destination_kind: if b.destination_is_exchange {
            DestinationKind::Exchange
        } else {
            DestinationKind::Queue
        },
        destination: b.destination.clone(),
        routing_key: b.routing_key.clone(),
        arguments: to_args(&b.arguments),
    }
}

fn to_command(change: Change, node: &str) -> Command {
    match change {
        Change::PutVhost(name) => Command::PutVhost { name },
        Change::DeleteVhost(name) => Command::DeleteVhost { name },
        Change::PutUser(u) => Command::PutUser(UserRecord {
            name: u.name,
            password_hash: u.password_hash,
            tags: u.tags,
        }),
        Change::DeleteUser(name) => Command::DeleteUser { name },
        Change::PutPermission(p) => Command::SetPermissions {
            vhost: p.vhost,
            user: p.user,
            permissions: Permissions {
                configure: p.configure,
                write: p.write,
                read: p.read,
            },
        },
        Change::DeletePermission { user, vhost } => Command::ClearPermissions { vhost, user },
        Change::PutExchange(e) => Command::DeclareExchange(ExchangeRecord {
            arguments: to_args(&e.arguments),
            vhost: e.vhost,
            name: e.name,
            kind: e.kind,
            durable: e.durable,
            auto_delete: e.auto_delete,
            internal: e.internal,
        }),
        Change::DeleteExchange { vhost, name } => Command::DeleteExchange { vhost, name },
        Change::PutQueue(q) => Command::DeclareQueue(QueueRecord {
            arguments: to_args(&q.arguments),
            vhost: q.vhost,
            name: q.name,
            durable: q.durable,
            // The node of the connection it is exclusive to.
            exclusive_owner: q.exclusive.then(|| node.to_owned()),
            auto_delete: q.auto_delete,
            master: q.master.unwrap_or_else(|| node.to_owned()),
            mirrors: Vec::new(),
            synchronised: Vec::new(),
            view_version: 0,
            serial: 0,
        }),
        Change::DeleteQueue { vhost, name } => Command::DeleteQueue {
            vhost,
            name,
            expected_version: None,
        },
        Change::PutBinding(b) => Command::Bind(binding_record(&b)),
        Change::DeleteBinding(b) => Command::Unbind(binding_record(&b)),
        Change::PutPolicy(p) => Command::PutPolicy(PolicyRecord {
            name: policy_name(&p.name, p.operator),
            vhost: p.vhost,
            pattern: p.pattern,
            apply_to: p.apply_to,
            priority: p.priority,
            definition: p.definition.to_string(),
        }),
        Change::DeletePolicy {
            vhost,
            name,
            operator,
        } => Command::DeletePolicy {
            vhost,
            name: policy_name(&name, operator),
        },
    }
}

/// The cluster's metadata as the broker's definitions.
pub(crate) fn to_definitions(m: &Metadata) -> Definitions {
    let mut d = Definitions::default();
    d.vhosts = m.vhosts.iter().cloned().collect();
    d.users = user_defs(m);
    d.permissions = permission_defs(m);
    d.exchanges = exchange_defs(m);
    d.queues = m
        .queues
        .values()
        .filter(|q| q.exclusive_owner.is_none())
        .map(queue_def)
        .collect();
    d.bindings = binding_defs(m);
    d.policies = policy_defs(m);
    d
}

fn user_defs(m: &Metadata) -> Vec<UserDef> {
    m.users
        .values()
        .map(|u| UserDef {
            name: u.name.clone(),
            password_hash: u.password_hash.clone(),
            tags: u.tags.clone(),
            loopback_only: u.name == "guest",
        })
        .collect()
}

fn permission_defs(m: &Metadata) -> Vec<PermissionDef> {
    m.permissions
        .iter()
        .map(|((vhost, user), p)| PermissionDef {
            user: user.clone(),
            vhost: vhost.clone(),
            configure: p.configure.clone(),
            write: p.write.clone(),
            read: p.read.clone(),
        })
        .collect()
}

fn exchange_defs(m: &Metadata) -> Vec<ExchangeDef> {
    m.exchanges
        .values()
        .map(|e| ExchangeDef {
            vhost: e.vhost.clone(),
            name: e.name.clone(),
            kind: e.kind.clone(),
            durable: e.durable,
            auto_delete: e.auto_delete,
            internal: e.internal,
            arguments: from_args(&e.arguments),
        })
        .collect()
}

fn queue_def(q: &QueueRecord) -> QueueDef {
    QueueDef {
        vhost: q.vhost.clone(),
        name: q.name.clone(),
        durable: q.durable,
        master: None,
        auto_delete: q.auto_delete,
        exclusive: q.exclusive_owner.is_some(),
        arguments: from_args(&q.arguments),
    }
}

fn binding_defs(m: &Metadata) -> Vec<BindingDef> {
    m.bindings
        .iter()
        .map(|b| BindingDef {
            vhost: b.vhost.clone(),
            source: b.source.clone(),
            destination: b.destination.clone(),
            destination_is_exchange: b.destination_kind == DestinationKind::Exchange,
            routing_key: b.routing_key.clone(),
            arguments: from_args(&b.arguments),
        })
        .collect()
}

fn policy_defs(m: &Metadata) -> Vec<PolicyDef> {
    m.policies
        .values()
        .map(|p| {
            let (name, operator) = match p.name.strip_prefix(OPERATOR_PREFIX) {
                Some(n) => (n.to_owned(), true),
                None => (p.name.clone(), false),
            };
            PolicyDef {
                vhost: p.vhost.clone(),
                name,
                pattern: p.pattern.clone(),
                apply_to: p.apply_to.clone(),
                priority: p.priority,
                definition: serde_json::from_str(&p.definition).unwrap_or(Value::Null),
                operator,
            }
        })
        .collect()
}

// ------------------------------------------------------------ replay

/// The parts of the cluster's metadata a replay brought the broker in line
/// with, kept to compare the next metadata with (not the metadata itself:
/// a reference held to it would have the Raft state machine copy the whole
/// metadata on each change it applies).
#[derive(Default)]
pub(crate) struct Replayed {
    vhosts: BTreeSet<String>,
    users: BTreeMap<String, UserRecord>,
    permissions: BTreeMap<(String, String), Permissions>,
    exchanges: BTreeMap<(String, String), ExchangeRecord>,
    bindings: Vec<BindingRecord>,
    policies: BTreeMap<(String, String), PolicyRecord>,
    /// Every queue's record: a persistent map that shares what did not
    /// change with the next metadata's, so that their diff skips it.
    queues: imbl::OrdMap<(String, String), QueueRecord>,
}

/// Brings the local broker in line with the cluster's metadata `m`:
/// creates what was declared on other nodes and removes what they deleted.
/// Call with `replaying` set (so the broker's own writes are skipped).
///
/// With `prev`, what the last replay brought the broker in line with, only
/// the parts of `m` that differ from it are gone over: the queue records'
/// masters, mirrors and ring views, which change many times a second while
/// mirrored queues are declared, cost nothing here, and a declare costs the
/// queues added, not every queue of the cluster. Without it, every part is
/// compared with what the broker holds.
pub(crate) fn replay(b: &mut Broker, prev: Option<Replayed>, m: &Metadata, me: &str) -> Replayed {
    let full = prev.is_none();
    let mut r = prev.unwrap_or_default();
    if full || r.vhosts != m.vhosts {
        replay_vhosts(b, m);
        r.vhosts.clone_from(&m.vhosts);
    }
    if full || r.users != m.users {
        replay_users(b, m);
        r.users.clone_from(&m.users);
    }
    if full || r.permissions != m.permissions {
        replay_permissions(b, m);
        r.permissions.clone_from(&m.permissions);
    }
    let exchanges_changed = full || r.exchanges != m.exchanges;
    if exchanges_changed {
        replay_exchanges(b, m);
        r.exchanges.clone_from(&m.exchanges);
    }
    if full {
        replay_queues(b, m, me);
    } else {
        replay_queues_since(b, &r.queues, m, me);
    }
    r.queues = m.queues.clone();
    if exchanges_changed || r.bindings != m.bindings {
        replay_bindings(b, m);
        r.bindings.clone_from(&m.bindings);
    }
    // Policies may have changed: every queue's settings follow (a queue
    // declared since took them when it was declared).
    if full || r.policies != m.policies {
        b.apply_policies(&policy_defs(m));
        r.policies.clone_from(&m.policies);
    }
    r
}

fn warn_replay(what: &str, e: &dyn std::fmt::Display) {
    tracing::warn!(what, error = %e, "could not apply a cluster metadata change locally");
}

fn replay_vhosts(b: &mut Broker, m: &Metadata) {
    let have: BTreeSet<String> = b.vhost_names().into_iter().collect();
    for v in &m.vhosts {
        if !have.contains(v)
            && let Err(e) = b.ensure_vhost(v)
        {
            warn_replay("vhost", &e);
        }
    }
    for v in have.iter().filter(|v| !m.vhosts.contains(*v)) {
        if let Err(e) = b.delete_vhost(v) {
            warn_replay("vhost delete", &e);
        }
    }
}

fn replay_users(b: &mut Broker, m: &Metadata) {
    let users: BTreeMap<String, UserDef> =
        b.users().into_iter().map(|u| (u.name.clone(), u)).collect();
    for u in user_defs(m) {
        let same = users
            .get(&u.name)
            .is_some_and(|x| x.password_hash == u.password_hash && x.tags == u.tags);
        if !same && let Err(e) = b.put_user(u) {
            warn_replay("user", &e);
        }
    }
    for name in users.keys().filter(|n| !m.users.contains_key(*n)) {
        if let Err(e) = b.delete_user(name) {
            warn_replay("user delete", &e);
        }
    }
}

fn replay_permissions(b: &mut Broker, m: &Metadata) {
    let perms = b.permissions();
    for p in permission_defs(m) {
        if !perms.contains(&p)
            && let Err(e) = b.set_permissions(p)
        {
            warn_replay("permissions", &e);
        }
    }
    for p in &perms {
        if !m
            .permissions
            .contains_key(&(p.vhost.clone(), p.user.clone()))
            && let Err(e) = b.clear_permissions(&p.user, &p.vhost)
        {
            warn_replay("permissions delete", &e);
        }
    }
}

/// Exchanges, durable and transient.
fn replay_exchanges(b: &mut Broker, m: &Metadata) {
    let exchanges: BTreeSet<(String, String)> = b
        .exchanges(None)
        .into_iter()
        .map(|e| (e.vhost, e.name))
        .collect();
    for e in exchange_defs(m) {
        if !exchanges.contains(&(e.vhost.clone(), e.name.clone()))
            && let Err(err) = b.admin_declare_exchange(e)
        {
            warn_replay("exchange", &err);
        }
    }
    for e in b.exchanges(None) {
        let builtin = e.name.is_empty() || e.name.starts_with("amq.");
        if !builtin
            && !m.exchanges.contains_key(&(e.vhost.clone(), e.name.clone()))
            && let Err(err) = b.admin_delete_exchange(&e.vhost, &e.name)
        {
            warn_replay("exchange delete", &err);
        }
    }
}

/// Declares queue `q` of the cluster here, served by its master from the
/// start: a queue declared on another node must not take publishes here,
/// even before the mirroring reconciler's next pass (they would be
/// confirmed into a local store that the queue's replica then replaces).
/// Whether `q` is exclusive to a connection of this node (`me`): the
/// broker has it from that connection (or, after a restart, never will;
/// `forget_transient_queues` deletes it).
fn own_exclusive(q: &QueueRecord, me: &str) -> bool {
    q.exclusive_owner.as_deref() == Some(me)
}

fn replay_declare(b: &mut Broker, q: &QueueRecord, me: &str) {
    let d = queue_def(q);
    if let Some(owner) = &q.exclusive_owner {
        if owner != me
            && let Err(e) = b.admin_know_exclusive_queue(d, owner)
        {
            warn_replay("exclusive queue", &e);
        }
        return;
    }
    if let Err(e) = b.admin_declare_queue(&d.vhost, &d.name, d.durable, d.auto_delete, d.arguments)
    {
        warn_replay("queue", &e);
        return;
    }
    if q.master != me {
        b.set_queue_master(&q.vhost, &q.name, Some(&q.master));
    }
}

/// Queues (but those exclusive to this node's connections, which are
/// theirs: shared again if the cluster lost them), compared with the
/// broker's.
fn replay_queues(b: &mut Broker, m: &Metadata, me: &str) {
    let local = b.queue_names();
    let have: BTreeSet<(&str, &str)> = local
        .iter()
        .map(|(v, q, _)| (v.as_str(), q.as_str()))
        .collect();
    for q in m.queues.values() {
        if !have.contains(&(q.vhost.as_str(), q.name.as_str())) {
            replay_declare(b, q, me);
        }
    }
    for (vhost, name, exclusive) in &local {
        if !m.queues.contains_key(&(vhost.clone(), name.clone())) {
            if *exclusive {
                b.share_again(vhost, name);
            } else {
                b.admin_delete_queue(vhost, name);
            }
        }
    }
}

/// Queues added to or removed from the cluster since the last replay
/// (`prev`: each queue then, whether it was exclusive to a connection of
/// this node and its serial). A
/// queue deleted and declared again elsewhere between two replays, with
/// other settings, replaces the predecessor the broker still holds (the
/// settings are what tells them apart: this node's own declare, whose
/// serial changes once committed, has the record's).
fn replay_queues_since(
    b: &mut Broker,
    prev: &imbl::OrdMap<(String, String), QueueRecord>,
    m: &Metadata,
    me: &str,
) {
    for change in prev.diff(&m.queues) {
        match change {
            DiffItem::Add(_, q) if !own_exclusive(q, me) => replay_declare(b, q, me),
            DiffItem::Update {
                old: (key, old),
                new: (_, q),
            } if old.serial != q.serial && !own_exclusive(q, me) => match declared_as(b, q) {
                Some(true) => {}
                Some(false) => {
                    b.admin_delete_queue(&key.0, &key.1);
                    replay_declare(b, q, me);
                }
                None => replay_declare(b, q, me),
            },
            // Unless its connection went: deleted by the other nodes, which
            // took this node for down.
            DiffItem::Remove(key, q) if own_exclusive(q, me) => b.share_again(&key.0, &key.1),
            DiffItem::Remove(key, _) => {
                b.admin_delete_queue(&key.0, &key.1);
            }
            // Masters, mirrors and ring views: the mirror driver's.
            DiffItem::Add(..) | DiffItem::Update { .. } => {}
        }
    }
}

/// Whether the broker's queue of `q`'s name is declared as `q` says
/// (durable, auto-delete, arguments); `None` if it has no such queue.
fn declared_as(b: &Broker, q: &QueueRecord) -> Option<bool> {
    let info = b
        .queues(Some(&q.vhost))
        .into_iter()
        .find(|i| i.name == q.name)?;
    // The record's arguments came from a broker's table through the same
    // conversion (floats become strings, for one): compared after it.
    let same_args = matches!(json_to_arg(&info.arguments), ArgValue::Table(a) if a == q.arguments);
    Some(info.durable == q.durable && info.auto_delete == q.auto_delete && same_args)
}

/// Bindings: drops those between shared entities (any exchange, a queue but
/// an exclusive one) that the cluster no longer has, then adds the missing
/// ones.
fn replay_bindings(b: &mut Broker, m: &Metadata) {
    let shared_q: BTreeSet<(String, String)> = b
        .queue_names()
        .into_iter()
        .filter(|(_, _, exclusive)| !exclusive)
        .map(|(v, q, _)| (v, q))
        .collect();
    let defs = binding_defs(m);
    let wanted: BTreeSet<(String, String, String, bool, String, String)> = defs
        .iter()
        .map(|d| {
            (
                d.vhost.clone(),
                d.source.clone(),
                d.destination.clone(),
                d.destination_is_exchange,
                d.routing_key.clone(),
                table_to_json(&d.arguments).to_string(),
            )
        })
        .collect();
    for bi in b.bindings(None) {
        let to_exchange = bi.destination_type == "exchange";
        if bi.source.is_empty()
            || !to_exchange && !shared_q.contains(&(bi.vhost.clone(), bi.destination.clone()))
        {
            continue;
        }
        let key = (
            bi.vhost.clone(),
            bi.source.clone(),
            bi.destination.clone(),
            to_exchange,
            bi.routing_key.clone(),
            bi.arguments.to_string(),
        );
        if !wanted.contains(&key) {
            let def = BindingDef {
                vhost: bi.vhost,
                source: bi.source,
                destination: bi.destination,
                destination_is_exchange: to_exchange,
                routing_key: bi.routing_key,
                arguments: json_to_table(&bi.arguments),
            };
            if let Err(e) = b.admin_unbind(&def) {
                warn_replay("unbind", &e);
            }
        }
    }
    for bd in defs {
        if let Err(e) = b.admin_bind(bd) {
            warn_replay("binding", &e);
        }
    }
}

/// Deletes the non-durable queues this node served alone before it
/// (re)started, and those exclusive to its connections then: their
/// messages lived in its memory only, and RabbitMQ drops such a queue with
/// its node. A mirrored one whose mirrors remain is theirs
/// (a mirror is promoted). Compare-and-set on the queue's view, so a queue
/// that changed meanwhile is left alone.
async fn forget_transient_queues(cluster: Cluster) {
    let me = cluster.node().to_string();
    let gone = |q: &QueueRecord| {
        // An exclusive queue of this node's went with its connection.
        ((!q.durable && q.exclusive_owner.is_none()) || own_exclusive(q, &me))
            && q.master == me
            && q.mirrors.is_empty()
    };
    delete_records(
        &cluster,
        gone,
        "a non-durable queue of this node's previous run",
        true,
    )
    .await;
}

/// Deletes the queue records `gone` picks, each only if its view is still
/// the one read (compare-and-set), logging each as `what`; a failed delete
/// is a warning if `warn`, else for debugging.
async fn delete_records(
    cluster: &Cluster,
    gone: impl Fn(&QueueRecord) -> bool,
    what: &str,
    warn: bool,
) {
    let picked: Vec<_> = cluster
        .local()
        .queues
        .values()
        .filter(|q| gone(q))
        .map(|q| (q.vhost.clone(), q.name.clone(), q.view_version))
        .collect();
    for (vhost, name, version) in picked {
        let cmd = Command::DeleteQueue {
            vhost: vhost.clone(),
            name: name.clone(),
            expected_version: Some(version),
        };
        match cluster.write(cmd).await {
            Ok(_) => tracing::info!(%vhost, queue = %name, "deleted {what}"),
            Err(e) if warn => {
                tracing::warn!(%vhost, queue = %name, error = %e, "could not delete {what}");
            }
            Err(e) => tracing::debug!(%vhost, queue = %name, error = %e, "did not delete {what}"),
        }
    }
}

/// Deletes the exclusive queues of each node the cluster sees go down, as
/// RabbitMQ does: their connections went with it, and a client that
/// reconnects elsewhere may declare the same name again. Every node tries;
/// the first delete wins (compare-and-set on the record), the others find
/// it gone. A node only cut off keeps its queue for its connection, and
/// shares it again once its replay sees the record gone (`share_again`).
async fn forget_exclusive_queues_of_down_nodes(cluster: Cluster) {
    let mut events = cluster.subscribe();
    loop {
        let down = match events.recv().await {
            Ok(NodeEvent::Down(n)) => n.to_string(),
            Ok(NodeEvent::Up(_)) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                continue;
            }
            Err(_) => return,
        };
        let what = format!("an exclusive queue of {down}, which went down");
        let gone = |q: &QueueRecord| q.exclusive_owner.as_deref() == Some(down.as_str());
        delete_records(&cluster, gone, &what, false).await;
    }
}

/// How often the broker is compared with the whole of the cluster's
/// metadata, rather than only with what changed since the last replay: a
/// broker that went astray some way the replays do not know of is back in
/// line within this.
const FULL_REPLAY_EVERY: Duration = Duration::from_secs(10);

/// Replays the cluster's metadata on the broker now and after every change:
/// in full at first, when asked (`again`: a commit was refused, the broker
/// holds a change the cluster does not) and every [`FULL_REPLAY_EVERY`];
/// otherwise only what changed since the last replay.
pub(crate) async fn replay_loop<S: MetadataSource>(
    cluster: S,
    broker: Arc<MeasuredMutex<Broker>>,
    replaying: Arc<AtomicBool>,
    again: Arc<Notify>,
) {
    let mut changes = cluster.changes();
    let me = cluster.node().to_string();
    // What the broker was last brought in line with (the cluster's
    // metadata and this node's changes in flight).
    let mut last: Option<Replayed> = None;
    let mut full_at = Instant::now();
    loop {
        {
            let mut b = broker.lock();
            replaying.store(true, Ordering::SeqCst);
            let (meta, index) = cluster.local_at();
            // What this node's clients changed and wait to see committed
            // stays (`commits.rs`): the cluster will have it, or refuse it
            // and send us round again.
            let in_flight = b.changes_in_flight();
            let meta = if in_flight.is_empty() {
                meta
            } else {
                let mut m = (*meta).clone();
                for change in in_flight {
                    let _ = m.apply(&to_command(change, &me));
                }
                Arc::new(m)
            };
            if full_at.elapsed() >= FULL_REPLAY_EVERY {
                last = None;
            }
            if last.is_none() {
                full_at = Instant::now();
            }
            last = Some(replay(&mut b, last.take(), &meta, &me));
            replaying.store(false, Ordering::SeqCst);
            // A client's change through another node is answered once
            // this broker has it (Cluster::write_everywhere).
            cluster.replayed(index);
        }
        tokio::select! {
            r = changes.changed() => if r.is_err() {
                return;
            },
            () = again.notified() => last = None,
        }
    }
}

/// Replays the metadata of `source` on `broker`, now and on every change,
/// and makes the metadata commits its clients wait for (on `rt`; the
/// broker's store, a [`ClusterStore`] over `source`, skips its writes while
/// `replaying` is set).
pub(crate) fn attach<S: MetadataSource>(
    source: S,
    rt: tokio::runtime::Handle,
    replaying: Arc<AtomicBool>,
    broker: Arc<MeasuredMutex<Broker>>,
) {
    let again = Arc::new(Notify::new());
    let wake = Arc::new(Notify::new());
    let w = wake.clone();
    crate::lock(&broker).set_commit_waker(Arc::new(move || w.notify_one()));
    tokio::spawn(commit_loop(
        source.clone(),
        rt,
        broker.clone(),
        wake,
        again.clone(),
    ));
    tokio::spawn(replay_loop(source, broker, replaying, again));
}

// ------------------------------------------------------------ the node's side

/// A running cluster member with its own runtime (so that a broker call
/// blocked on a metadata commit never starves Raft).
pub(crate) struct Clustered {
    cluster: Cluster,
    rt: tokio::runtime::Handle,
    replaying: Arc<AtomicBool>,
    transports: Transports,
    mirroring: Arc<std::sync::OnceLock<Arc<Mirroring>>>,
}

impl Clustered {
    /// Starts the cluster member if `--peer-addr` was given.
    pub(crate) async fn start(
        args: &ClusterArgs,
        node_name: &str,
        data_dir: &Path,
    ) -> anyhow::Result<Option<Self>> {
        if args.peer_addr.is_none() {
            return Ok(None);
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("warren-cluster")
            .enable_all()
            .build()
            .context("starting the cluster runtime")?;
        // The runtime lives as long as the process.
        let rt: &'static tokio::runtime::Runtime = Box::leak(Box::new(rt));
        let (args, name, dir) = (args.clone(), node_name.to_owned(), data_dir.to_owned());
        let (cluster, transports) = rt
            .spawn(async move { start(&args, &name, &dir).await })
            .await
            .context("the cluster start task failed")??;
        rt.spawn(forget_transient_queues(cluster.clone()));
        rt.spawn(forget_exclusive_queues_of_down_nodes(cluster.clone()));
        Ok(Some(Self {
            cluster,
            rt: rt.handle().clone(),
            replaying: Arc::new(AtomicBool::new(false)),
            transports,
            mirroring: Arc::new(std::sync::OnceLock::new()),
        }))
    }

    /// Resolves, with the error, once the node's Raft stopped on a storage
    /// fault ([`Cluster::failed`]).
    pub(crate) async fn failed(&self) -> String {
        self.cluster.failed().await
    }

    /// The address peers dial to reach this node.
    pub(crate) fn peer_addr(&self) -> String {
        self.cluster.peer_addr().to_string()
    }

    /// The broker's metadata store over the cluster.
    pub(crate) fn store(&self) -> Box<dyn MetadataStore> {
        Box::new(ClusterStore::new(
            self.cluster.clone(),
            self.rt.clone(),
            self.replaying.clone(),
        ))
    }

    /// Replays the cluster's metadata on `broker`, now and on every change,
    /// and makes the metadata commits its clients wait for.
    pub(crate) fn attach(&self, broker: Arc<MeasuredMutex<Broker>>) {
        attach(
            self.cluster.clone(),
            self.rt.clone(),
            self.replaying.clone(),
            broker,
        );
    }

    /// Starts forwarding and mirrored queues: this node's GM node and the
    /// reconciler that places replicas. They run on the caller's runtime, not
    /// the cluster's: they take the broker's lock, which a metadata commit
    /// holds while it waits for the cluster's runtime.
    pub(crate) async fn start_mirroring(
        &self,
        broker: Arc<MeasuredMutex<Broker>>,
    ) -> anyhow::Result<()> {
        let c = &self.cluster;
        crate::links::start(c.clone(), self.transports.links.clone(), broker.clone()).await?;
        let m = crate::mirroring::start(c.clone(), self.transports.rings.clone(), broker).await?;
        let _ = self.mirroring.set(m);
        Ok(())
    }

    /// Stops every replica cleanly (masters hand over to their synchronised
    /// mirrors), waiting at most a few seconds.
    pub(crate) async fn stop_mirroring(&self) {
        if let Some(m) = self.mirroring.get().cloned() {
            m.stop(Duration::from_secs(5)).await;
        }
    }

    /// What the management API's `/api/cluster` routes drive; `join_cluster`
    /// asks `app` to restart the node.
    pub(crate) fn control(
        &self,
        app: Arc<AppControl>,
    ) -> Arc<dyn warren_management::ClusterControl> {
        Arc::new(Control {
            cluster: self.cluster.clone(),
            rt: self.rt.clone(),
            transport: self.transports.raft.clone(),
            app,
        })
    }

    /// Records this node's client-facing listeners (RabbitMQ's protocol
    /// name, address) in the cluster, for the other members' management
    /// APIs to list; retried in the background while there is no majority.
    pub(crate) fn record_listeners(&self, listeners: &[(&str, SocketAddr)]) {
        let cmd = Command::SetNodeListeners {
            node: self.cluster.node().as_str().to_owned(),
            listeners: listeners
                .iter()
                .map(|(protocol, addr)| warren_cluster::Listener {
                    protocol: (*protocol).to_owned(),
                    addr: addr.to_string(),
                })
                .collect(),
        };
        let c = self.cluster.clone();
        self.rt.spawn(async move {
            while let Err(e) = c.write(cmd.clone()).await {
                tracing::debug!(error = %e, "recording the listeners failed; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
    }

    /// Where the management API reads a queue's master and mirrors.
    pub(crate) fn mirrors(&self) -> Arc<dyn warren_management::MirrorSource> {
        Arc::new(Records {
            cluster: self.cluster.clone(),
            mirroring: self.mirroring.clone(),
        })
    }

    /// Graceful stop: hands Raft leadership and its vote off first.
    pub(crate) async fn leave(&self) {
        let c = self.cluster.clone();
        match self.rt.spawn(async move { c.leave().await }).await {
            Ok(Ok(())) => tracing::info!("left the cluster's voting members"),
            Ok(Err(e)) => tracing::warn!(error = %e, "graceful cluster hand-off failed"),
            Err(e) => tracing::warn!(error = %e, "graceful cluster hand-off failed"),
        }
    }

    /// Stops the cluster member at once, without a hand-off: before the
    /// restart that `join_cluster` asked for (alone in its cluster, the node
    /// has nobody to hand off to).
    pub(crate) async fn shutdown(&self) {
        let c = self.cluster.clone();
        if let Err(e) = self.rt.spawn(async move { c.shutdown().await }).await {
            tracing::warn!(error = %e, "stopping the cluster member failed");
        }
    }
}

// ------------------------------------------------------------ join_cluster

/// What `join_cluster` leaves in the data directory (the file
/// `join_cluster`, JSON) for the process it restarts: the seed to join and
/// the addresses the node listened on, so that it keeps them even if it was
/// started with port 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Rejoin {
    /// The seed's peer address.
    pub seed: String,
    /// The AMQP listener.
    pub amqp_addr: String,
    /// The management listener, if it listened.
    pub http_addr: Option<String>,
    /// The Prometheus listener, if it listened.
    pub prometheus_addr: Option<String>,
    /// The peer listener.
    pub peer_addr: String,
}

/// The file [`Rejoin`] is kept in, in the data directory.
const JOIN_MARKER: &str = "join_cluster";

/// What a reset removes from the data directory: the node's cluster state,
/// its single-node metadata and its queues' logs.
const NODE_DATA: [&str; 6] = [
    "raft",
    "queues",
    "journal",
    "metadata.json",
    "metadata.json.tmp",
    "metadata.log",
];

impl Rejoin {
    /// Leaves this in `data_dir` for the next start.
    pub(crate) fn save(&self, data_dir: &Path) -> anyhow::Result<()> {
        let v = json!({
            "seed": self.seed, "amqp_addr": self.amqp_addr, "http_addr": self.http_addr,
            "prometheus_addr": self.prometheus_addr, "peer_addr": self.peer_addr,
        });
        write_atomic(&data_dir.join(JOIN_MARKER), v.to_string().as_bytes())
    }

    /// At start: what `join_cluster` left in `data_dir`, if anything, after
    /// resetting the node (its own cluster state, metadata and messages).
    /// The file stays until [`Rejoin::done`], so a start interrupted before
    /// the join resets the node and joins again.
    pub(crate) fn pending(data_dir: &Path) -> anyhow::Result<Option<Self>> {
        let path = data_dir.join(JOIN_MARKER);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        let v: Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
        let need = |k: &str| s(k).with_context(|| format!("{} has no {k}", path.display()));
        let rejoin = Self {
            seed: need("seed")?,
            amqp_addr: need("amqp_addr")?,
            http_addr: s("http_addr"),
            prometheus_addr: s("prometheus_addr"),
            peer_addr: need("peer_addr")?,
        };
        for name in NODE_DATA {
            let p = data_dir.join(name);
            let removed = if p.is_dir() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
            match removed {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(e).with_context(|| format!("resetting: removing {}", p.display()));
                }
                _ => {}
            }
        }
        tracing::warn!(seed = %rejoin.seed, data_dir = %data_dir.display(), "join_cluster: node reset (its own metadata and messages discarded); joining the seed's cluster");
        Ok(Some(rejoin))
    }

    /// Makes the restarted node join the seed at the addresses it had.
    pub(crate) fn apply(&self, args: &mut crate::Args) {
        args.cluster.join = Some(self.seed.clone());
        args.cluster.peer_addr = Some(self.peer_addr.clone());
        args.amqp_addr.clone_from(&self.amqp_addr);
        if let Some(a) = &self.http_addr {
            args.http_addr.clone_from(a);
        }
        if let Some(a) = &self.prometheus_addr {
            args.prometheus_addr.clone_from(a);
        }
    }

    /// The join is done: removes the file from `data_dir`.
    pub(crate) fn done(&self, data_dir: &Path) -> anyhow::Result<()> {
        let path = data_dir.join(JOIN_MARKER);
        std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        tracing::info!(seed = %self.seed, "joined the cluster as join_cluster asked; the app waits for start_app");
        Ok(())
    }
}

/// Replaces this process with a fresh start of the same binary with the
/// same arguments and environment (same PID), after `join_cluster`.
/// Returns only if that fails.
pub(crate) fn restart() -> anyhow::Error {
    use std::os::unix::process::CommandExt as _;
    tracing::info!("restarting (same process id) to join the cluster");
    let mut args = std::env::args_os();
    let arg0 = args.next().unwrap_or_default();
    // The running image itself, even if its file was replaced meanwhile.
    let e = std::process::Command::new("/proc/self/exe")
        .arg0(arg0)
        .args(args)
        .exec();
    anyhow::Error::new(e).context("restarting the node to join the cluster")
}

/// How long `join_cluster` waits for the seed's handshake.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct Control {
    cluster: Cluster,
    rt: tokio::runtime::Handle,
    transport: Arc<dyn Transport>,
    app: Arc<AppControl>,
}

impl warren_management::ClusterControl for Control {
    fn status(&self) -> warren_management::ClusterInfo {
        let s = self.cluster.cluster_status();
        let meta = self.cluster.local();
        warren_management::ClusterInfo {
            node: s.node,
            leader: s.leader,
            members: s
                .members
                .into_iter()
                .map(|m| warren_management::ClusterMember {
                    listeners: meta.nodes.get(&m.name).map_or_else(Vec::new, |n| {
                        n.listeners
                            .iter()
                            .map(|l| (l.protocol.clone(), l.addr.clone()))
                            .collect()
                    }),
                    name: m.name,
                    addr: m.addr,
                    voter: m.voter,
                    running: m.running,
                })
                .collect(),
        }
    }

    fn join(&self, seed: &str) -> warren_management::JoinFuture {
        use warren_management::{JoinOutcome, NodeControl as _};
        let status = self.cluster.cluster_status();
        let app_running = self.app.app_running();
        let (transport, rt, app) = (self.transport.clone(), self.rt.clone(), self.app.clone());
        let seed = seed.trim().to_owned();
        Box::pin(async move {
            let me = status.node.clone();
            if app_running {
                return Err(format!(
                    "this command requires the app to be stopped on node {me}, and the app is \
                     running: stop it first with `warrenctl stop_app`"
                ));
            }
            let member = |n: &str| status.members.iter().any(|m| m.name == n || m.addr == n);
            if member(&seed) {
                return Ok(JoinOutcome::AlreadyMember);
            }
            if seed.contains('@') {
                return Err(format!(
                    "{seed} is not a member of {me}'s cluster: to join another cluster, give the \
                     peer address HOST:PORT (--peer-addr) of one of its running members"
                ));
            }
            let addr = PeerAddr::new(seed.clone());
            let probe = rt.spawn(async move {
                let mut conn = tokio::time::timeout(PROBE_TIMEOUT, transport.connect(&addr))
                    .await
                    .map_err(|_| format!("no handshake within {PROBE_TIMEOUT:?}"))?
                    .map_err(|e| e.to_string())?;
                let name = conn.peer_node().to_string();
                let _ = conn.close().await;
                Ok::<_, String>(name)
            });
            let seed_node = probe
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r)
                .map_err(|e| {
                    format!("cannot join the cluster of {seed}: {e}; node {me} is unchanged")
                })?;
            if seed_node == me {
                return Err(format!(
                    "the node at {seed} is named {me}, as this node is: it is this node, or \
                     node names clash (they must be unique in a cluster); node {me} is unchanged"
                ));
            }
            if member(&seed_node) {
                return Ok(JoinOutcome::AlreadyMember);
            }
            let others: Vec<&str> = status
                .members
                .iter()
                .map(|m| m.name.as_str())
                .filter(|n| *n != me)
                .collect();
            if !others.is_empty() {
                return Err(format!(
                    "node {me} is clustered with {}: join_cluster resets only a node alone in its \
                     cluster; node {me} is unchanged",
                    others.join(", ")
                ));
            }
            app.rejoin(&seed).await?;
            Ok(JoinOutcome::Restarting { seed_node })
        })
    }

    fn forget(&self, node: &str) -> warren_management::ClusterFuture {
        let c = self.cluster.clone();
        let rt = self.rt.clone();
        let node = node.to_owned();
        Box::pin(async move {
            let name = NodeName::new(node.clone()).map_err(|e| format!("{node:?}: {e}"))?;
            rt.spawn(async move { c.forget_cluster_node(&name).await })
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())
        })
    }
}

#[derive(Debug)]
struct Records<S: MetadataSource = Cluster> {
    cluster: S,
    mirroring: Arc<std::sync::OnceLock<Arc<Mirroring>>>,
}

/// The management API's view of the queue records of `source` (each
/// queue's master and mirrors), with no mirroring running: a sharded
/// node's, where a queue's master is a shard.
pub(crate) fn records<S: MetadataSource>(source: S) -> Arc<dyn warren_management::MirrorSource> {
    Arc::new(Records {
        cluster: source,
        mirroring: Arc::new(std::sync::OnceLock::new()),
    })
}

impl<S: MetadataSource> Records<S> {
    fn on_master<T>(
        &self,
        vhost: &str,
        queue: &str,
        f: impl FnOnce(&Mirroring) -> Result<T, String>,
    ) -> Result<T, String> {
        let m = self.cluster.local();
        let q = m
            .queues
            .get(&(vhost.to_owned(), queue.to_owned()))
            .ok_or_else(|| format!("no queue '{queue}' in vhost '{vhost}'"))?;
        if q.master != self.cluster.node().as_str() {
            return Err(format!(
                "the master of queue '{queue}' is on node {}: ask that node",
                q.master
            ));
        }
        let mirroring = self
            .mirroring
            .get()
            .ok_or_else(|| "mirroring is not running on this node".to_owned())?;
        f(mirroring)
    }
}

impl<S: MetadataSource> warren_management::MirrorSource for Records<S> {
    fn mirrors(&self, vhost: &str, queue: &str) -> Option<warren_management::QueueMirrors> {
        let m = self.cluster.local();
        let q = m.queues.get(&(vhost.to_owned(), queue.to_owned()))?;
        Some(warren_management::QueueMirrors {
            node: q.master.clone(),
            slave_nodes: q.mirrors.clone(),
            synchronised_slave_nodes: q.synchronised.clone(),
            syncing: self.mirroring.get().and_then(|m| m.sync_left(vhost, queue)),
        })
    }

    fn sync(&self, vhost: &str, queue: &str) -> Result<(), String> {
        self.on_master(vhost, queue, |m| m.sync(vhost, queue))
    }

    fn cancel_sync(&self, vhost: &str, queue: &str) -> Result<(), String> {
        self.on_master(vhost, queue, |m| m.cancel_sync(vhost, queue))
    }

    fn hub(&self) -> Option<warren_management::HubCounts> {
        let stats = self.mirroring.get()?.hub_stats();
        Some(warren_management::HubCounts {
            turns: stats.turns,
            replicas_served: stats.replicas_served,
        })
    }
}

#[cfg(test)]
mod tests {
    use warren_broker::BrokerConfig;
    use warren_broker::meta::FileStore;
    use warren_cluster::QueueView;

    use super::*;

    fn declared(max_length: i64) -> Command {
        Command::DeclareQueue(QueueRecord {
            vhost: "/".into(),
            name: "q".into(),
            durable: true,
            exclusive_owner: None,
            auto_delete: false,
            arguments: [("x-max-length".to_owned(), ArgValue::Int(max_length))].into(),
            master: "n2".into(),
            mirrors: vec![],
            synchronised: vec![],
            view_version: 0,
            serial: 0,
        })
    }

    fn deleted(name: &str) -> Command {
        Command::DeleteQueue {
            vhost: "/".into(),
            name: name.into(),
            expected_version: None,
        }
    }

    /// A broker in `dir` and a metadata with the vhost `/`.
    fn broker_and_metadata(dir: &Path) -> (Broker, Metadata) {
        let store = FileStore::open(dir.join("metadata.json")).unwrap();
        let b = Broker::open(BrokerConfig::new(dir), Box::new(store)).unwrap();
        let mut m = Metadata::default();
        m.apply(&Command::PutVhost { name: "/".into() });
        (b, m)
    }

    fn max_length(b: &Broker) -> Value {
        let q = b.queues(Some("/")).into_iter().find(|q| q.name == "q");
        q.expect("queue q").arguments["x-max-length"].clone()
    }

    /// A queue deleted and declared again through another node, with other
    /// arguments, between two replays of this node: the broker's queue
    /// takes the new declaration (it kept its predecessor's before). Its
    /// serial changing alone (this node's own declare, committed) leaves
    /// it as it is.
    #[test]
    fn a_queue_declared_again_elsewhere_between_replays_takes_its_new_arguments() {
        let dir = tempfile::tempdir().unwrap();
        let (mut b, mut m) = broker_and_metadata(dir.path());
        m.apply(&declared(5));
        let r = replay(&mut b, None, &m, "n1");
        assert_eq!(max_length(&b), 5);
        let uid = b.queue_uid("/", "q");

        m.apply(&deleted("q"));
        m.apply(&declared(5));
        let r = replay(&mut b, Some(r), &m, "n1");
        assert_eq!(b.queue_uid("/", "q"), uid, "declared alike: kept");

        m.apply(&deleted("q"));
        m.apply(&declared(7));
        let r = replay(&mut b, Some(r), &m, "n1");
        assert_eq!(max_length(&b), 7, "the new declaration's arguments");

        // This node's own declare, with an argument the metadata keeps as
        // a string (a float), its serial changed: kept.
        let table = json_to_table(&json!({"x-ratio": 1.5}));
        b.admin_declare_queue("/", "f", true, false, table.clone())
            .unwrap();
        let uid = b.queue_uid("/", "f");
        let Command::DeclareQueue(mut f) = declared(0) else {
            unreachable!()
        };
        f.name = "f".into();
        f.arguments = to_args(&table);
        m.apply(&Command::DeclareQueue(f.clone()));
        let r = replay(&mut b, Some(r), &m, "n1");
        m.apply(&deleted("f"));
        m.apply(&Command::DeclareQueue(f));
        replay(&mut b, Some(r), &m, "n1");
        assert_eq!(b.queue_uid("/", "f"), uid, "its own declaration: kept");
    }

    fn named(name: &str) -> Command {
        let Command::DeclareQueue(mut q) = declared(0) else {
            unreachable!()
        };
        q.name = name.into();
        Command::DeclareQueue(q)
    }

    fn names(b: &Broker) -> BTreeSet<String> {
        b.queue_names().into_iter().map(|(_, q, _)| q).collect()
    }

    /// Between two replays the other nodes declared a queue, deleted one,
    /// and moved a third's master and then declared it again: the replay
    /// (which diffs the queue records against the last one's) declares and
    /// deletes those, keeps the moved queue and every other as they were,
    /// and takes the new declaration.
    #[test]
    fn a_replay_declares_and_deletes_what_changed_since_the_last() {
        let dir = tempfile::tempdir().unwrap();
        let (mut b, mut m) = broker_and_metadata(dir.path());
        for i in 0..200 {
            m.apply(&named(&format!("q{i}")));
        }
        let r = replay(&mut b, None, &m, "n1");
        assert_eq!(names(&b).len(), 200);
        let (kept, moved) = (b.queue_uid("/", "q150"), b.queue_uid("/", "q7"));

        let held = m.clone();
        m.apply(&named("new"));
        m.apply(&deleted("q3"));
        let q7 = m.queue("/", "q7").expect("q7");
        let (serial, version) = (q7.serial, q7.view_version);
        let moved_to = QueueView {
            master: "n3".into(),
            mirrors: vec!["n2".into()],
            synchronised: vec![],
        };
        let outcome = m.apply(&Command::SetQueueView {
            vhost: "/".into(),
            name: "q7".into(),
            serial,
            expected_version: version,
            view: moved_to,
        });
        assert!(outcome.result.is_ok(), "{outcome:?}");
        let r = replay(&mut b, Some(r), &m, "n1");
        let now = names(&b);
        assert!(now.contains("new") && !now.contains("q3"), "{now:?}");
        assert_eq!(now.len(), 200);
        assert_eq!(b.queue_uid("/", "q7"), moved, "a new master alone: kept");
        assert_eq!(b.queue_uid("/", "q150"), kept);

        m.apply(&deleted("q150"));
        m.apply(&declared(9));
        replay(&mut b, Some(r), &m, "n1");
        assert!(!names(&b).contains("q150"));
        assert_eq!(max_length(&b), 9, "q declared by another node");
        drop(held);
    }
}
