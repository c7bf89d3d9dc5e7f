//! `warren`: one Warren node speaking AMQP 0-9-1.
//!
//! A tokio shell around [`warren_broker::Broker`]: one task per client
//! connection (read, feed the broker under its lock, write everything the
//! turn produced in one write), a thread running the group commits of
//! durable queues, a ticker for message and queue expiry, a task opening
//! failed queue logs again (`failed_logs`), and a management
//! HTTP API (`warren-management`) on `--http-addr`. Settings come from the
//! command line, `WARREN_*` variables and `warren.conf` (`config`).

#![allow(clippy::print_stdout, clippy::print_stderr)]

mod amqps;
mod app;
mod client;
mod cluster;
mod config;
mod failed_logs;
mod links;
mod metadata;
mod mirroring;
mod resources;
mod services;
pub mod shards;
mod sockets;

use std::io::{IsTerminal as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{CommandFactory as _, FromArgMatches as _, Parser};
use tokio::net::TcpListener;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use warren_broker::Broker;
use warren_broker::auth::{PermissionDef, UserDef, hash_password};
use warren_broker::meta::FileStore;
use warren_lock::{MeasuredGuard, MeasuredMutex};

use sockets::ClientSockets;

/// Command line of the `warren` binary.
#[derive(Debug, Parser)]
#[command(
    name = "warren",
    version,
    about = "A Warren message broker node (AMQP 0-9-1)"
)]
struct Args {
    /// Address of the AMQP listener.
    #[arg(long, default_value = "127.0.0.1:5672")]
    amqp_addr: String,
    /// Address of the HTTP management listener.
    #[arg(long, default_value = "127.0.0.1:15672")]
    http_addr: String,
    /// Address of the Prometheus listener (`/metrics`).
    #[arg(long, default_value = "127.0.0.1:15692")]
    prometheus_addr: String,
    /// Directory of the node's data (metadata and queue logs).
    #[arg(long, default_value = "./warren-data")]
    data_dir: PathBuf,
    /// The node's name.
    #[arg(long, default_value = "warren@localhost")]
    node_name: String,
    /// A RabbitMQ-style definitions JSON file (vhosts, users, permissions)
    /// to import at start.
    #[arg(long)]
    definitions: Option<PathBuf>,
    /// Broker shards: the node's queues spread over this many brokers,
    /// each behind its own lock and data directory, so that broker work
    /// runs on as many cores (a single node only; a data directory keeps
    /// the count it was first run with).
    #[arg(long, default_value_t = 1)]
    shards: usize,
    /// Clustering (`--peer-addr` turns it on).
    #[command(flatten)]
    cluster: cluster::ClusterArgs,
    /// A `warren.conf` file (RabbitMQ's `key = value` format; default:
    /// `$WARREN_CONFIG_FILE`). Flags and `WARREN_*` variables override it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// What the configuration file and the environment set beyond the flags.
    #[arg(skip)]
    settings: config::Settings,
}

type Shared = Arc<MeasuredMutex<Broker>>;

/// Whether an event is openraft's report of one failed call to one peer
/// (a leadership confirmation or a vote that timed out: the events of its
/// core that name a `target` peer and an `error`). A peer that is slow for a
/// moment or down makes several a second; the failure detector's "node
/// down" says what an operator needs, and a read or change that fails for
/// it is reported by whoever asked. openraft's other errors still show.
fn openraft_peer_call_failure(m: &tracing::Metadata<'_>) -> bool {
    m.is_event()
        && *m.level() == tracing::Level::ERROR
        && m.target() == "openraft::core::raft_core"
        && m.fields().field("target").is_some()
        && m.fields().field("error").is_some()
}

/// The log directives for openraft beside the node's level (see `main`).
const OPENRAFT_LOG: &str =
    "openraft=error,openraft::replication=off,openraft::engine::handler::replication_handler=off";

fn lock(b: &Shared) -> MeasuredGuard<'_, Broker> {
    b.lock()
}

/// The broker's time: the wall clock at start, advanced by the monotonic
/// clock (a step of the system clock moves no timer of the broker's).
fn now_ms() -> u64 {
    warren_mirror_driver::steady_clock_ms()
}

/// glibc's malloc keeps memory freed in its arenas for the next
/// allocations (and raises its mmap threshold to the largest block freed,
/// so message bodies up to 32 MiB come from there): a node that carried
/// 512 MiB of 1 MiB messages through a mirrored queue kept 1.2 GiB resident
/// once they were paged out. A thread of its own gives back, every second,
/// every whole page free in any arena (`malloc_trim`): 512 MiB of 1 MiB
/// messages through a 3-node mirrored queue leave 21–27 MiB resident after
/// the drain (85–88 without it). Fixing the threshold at 128 KiB instead,
/// as before, did as much for memory but mapped and faulted in every large
/// body afresh: 1 MiB messages moved at 41 % of the rate (353 against 873
/// a second, RabbitMQ's Java client, one node, docs/benchmarks.md).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn give_back_freed_memory() {
    let trim = || {
        loop {
            std::thread::sleep(Duration::from_secs(1));
            // SAFETY: malloc_trim only returns free pages to the system;
            // glibc locks each arena while it walks it.
            unsafe {
                libc::malloc_trim(0);
            }
        }
    };
    if let Err(e) = std::thread::Builder::new()
        .name("warren-trim".into())
        .spawn(trim)
    {
        tracing::warn!(error = %e, "no thread to give freed memory back to the system");
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn give_back_freed_memory() {}

/// Runs the `warren` binary: parses its command line and `warren.conf`,
/// starts the node and serves until it is stopped.
pub fn main() -> anyhow::Result<()> {
    let matches = Args::command().get_matches();
    let mut args = Args::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Err(e) = config::merge(&mut args, &matches, &|k| std::env::var(k).ok()) {
        eprintln!("Error: {e}");
        std::process::exit(1);
    }
    let level = args.settings.log_level.as_deref().unwrap_or("info");
    // openraft reports every failed call to a peer that is down (at error
    // level, several a second) and routine vote races: the failure
    // detector's "node down" says what an operator needs. `RUST_LOG`
    // shows them again.
    let from_env = tracing_subscriber::EnvFilter::try_from_default_env().ok();
    let quiet_calls = from_env.is_none();
    let filter = from_env
        .unwrap_or_else(|| tracing_subscriber::EnvFilter::new(format!("{level},{OPENRAFT_LOG}")));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        // Colour codes only on a terminal: a log file reads plain.
        .with_ansi(std::io::stderr().is_terminal());
    tracing_subscriber::registry()
        .with(filter)
        .with(
            fmt.with_filter(tracing_subscriber::filter::filter_fn(move |m| {
                !(quiet_calls && openraft_peer_call_failure(m))
            })),
        )
        .init();
    give_back_freed_memory();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(broker_threads())
        .enable_all()
        .build()
        .context("starting the runtime")?;
    match rt.block_on(run(args))? {
        app::Exit::Stop => Ok(()),
        // `join_cluster`: start again, reset, joining the seed's cluster.
        app::Exit::Rejoin(_) => Err(cluster::restart()),
        app::Exit::Failed(e) => Err(anyhow::anyhow!(
            "the node's cluster metadata store failed: {e}; start the node again once its disk works"
        )),
    }
}

/// Worker threads of the broker's runtime (connections, the management
/// API, the mirror driver): `TOKIO_WORKER_THREADS` if set, else one. All
/// broker work runs under one lock, so a second worker adds no throughput,
/// only wake-ups: every hand-off between two tasks (a client's turn, its
/// queue's replica, the ring's writer) woke a parked worker, ~25 µs each.
/// Measured with lapin (1 KiB persistent, 100 confirms in flight, manual
/// acks) on 3 mirrored nodes: 123 against 172 µs of CPU per message and
/// ~40 % more consumed per second with one worker (medians of 5 runs;
/// docs/benchmarks.md). Raft and the peer port keep their own runtime
/// (`cluster.rs`).
fn broker_threads() -> usize {
    std::env::var("TOKIO_WORKER_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1)
}

fn import_definitions(broker: &mut Broker, path: &Path) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading definitions {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("parsing definitions {}", path.display()))?;
    let s = |x: &serde_json::Value, k: &str| x.get(k).and_then(|v| v.as_str()).map(str::to_owned);
    for vh in v
        .get("vhosts")
        .and_then(|x| x.as_array())
        .into_iter()
        .flatten()
    {
        let name = s(vh, "name").context("a vhost without a name")?;
        broker.add_vhost(&name)?;
    }
    for u in v
        .get("users")
        .and_then(|x| x.as_array())
        .into_iter()
        .flatten()
    {
        let name = s(u, "name").context("a user without a name")?;
        let password_hash = match (s(u, "password_hash"), s(u, "password")) {
            (Some(h), _) => h,
            (None, Some(p)) => hash_password(&p),
            (None, None) => anyhow::bail!("user '{name}' has neither password nor password_hash"),
        };
        let tags = match u.get("tags") {
            Some(serde_json::Value::String(t)) => t
                .split(',')
                .filter(|t| !t.is_empty())
                .map(str::to_owned)
                .collect(),
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|t| t.as_str().map(str::to_owned))
                .collect(),
            _ => Vec::new(),
        };
        broker.put_user(UserDef {
            loopback_only: name == "guest",
            name,
            password_hash,
            tags,
        })?;
    }
    for p in v
        .get("permissions")
        .and_then(|x| x.as_array())
        .into_iter()
        .flatten()
    {
        broker.set_permissions(PermissionDef {
            user: s(p, "user").context("a permission without a user")?,
            vhost: s(p, "vhost").context("a permission without a vhost")?,
            configure: s(p, "configure").unwrap_or_default(),
            write: s(p, "write").unwrap_or_default(),
            read: s(p, "read").unwrap_or_default(),
        })?;
    }
    Ok(())
}

async fn run(mut args: Args) -> anyhow::Result<app::Exit> {
    let fd_limit = sockets::raise_fd_limit();
    if let Some(limit) = fd_limit {
        let files = sockets::file_budget(limit);
        warren_backing_queue::FsStorage::shared()
            .set_open_files_max(usize::try_from(files).unwrap_or(usize::MAX));
        tracing::info!(files, "queue log files kept open at most");
    }
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("creating data directory {}", args.data_dir.display()))?;
    // Restarted by `join_cluster`: reset, then join the seed at the same addresses.
    let rejoin = match &args.cluster.peer_addr {
        Some(_) => cluster::Rejoin::pending(&args.data_dir)?,
        None => None,
    };
    if let Some(r) = &rejoin {
        r.apply(&mut args);
    }
    let clustered =
        cluster::Clustered::start(&args.cluster, &args.node_name, &args.data_dir).await?;
    if let Some(r) = &rejoin {
        r.done(&args.data_dir)?;
    }
    // A single node writes its definitions file off the broker's lock
    // (`metadata.rs`); a cluster's nodes commit through Raft.
    shards::check(args.shards, clustered.is_some())?;
    let sharded = args.shards > 1;
    anyhow::ensure!(
        sharded || clustered.is_some() || !shards::was_sharded(&args.data_dir),
        "{} was run with --shards above 1; start it with the same --shards",
        args.data_dir.display()
    );
    let mut opening = if sharded {
        Some(shards::Opening::open(&args.data_dir, &args.node_name, args.shards).await?)
    } else {
        None
    };
    let mut brokers = Vec::with_capacity(args.shards);
    let mut file_committer = None;
    for k in 0..args.shards {
        let store: Box<dyn warren_broker::meta::MetadataStore> = match (&clustered, &mut opening) {
            (Some(c), _) => c.store(),
            (None, Some(opening)) => opening.store(k),
            (None, None) => {
                let mut file = FileStore::open(args.data_dir.join("metadata.json"))?;
                file_committer = Some(file.committer());
                Box::new(file)
            }
        };
        let first_start = {
            let d = store.load();
            d.vhosts.is_empty() && d.users.is_empty()
        };
        let data_dir = shards::shard_dir(&args.data_dir, k);
        let mut cfg = shards::config(&args.data_dir, &args.node_name, k, args.shards);
        if let Some(ms) = args.settings.consumer_timeout_ms {
            cfg.consumer_timeout_ms = ms;
        }
        if let Some(name) = &args.settings.product_name {
            cfg.amqp.product.clone_from(name);
        }
        if let Some(version) = &args.settings.product_version {
            cfg.amqp.version.clone_from(version);
        }
        let mut broker = Broker::open(cfg, store)
            .with_context(|| format!("opening the data in {}", data_dir.display()))?;
        if k == 0 {
            if first_start {
                args.settings.apply_default_user(&mut broker)?;
            }
            if let Some(path) = &args.definitions {
                import_definitions(&mut broker, path)?;
            }
        }
        args.settings.apply_limits(&mut broker);
        brokers.push(Arc::new(MeasuredMutex::new(broker)));
    }
    let shards = shards::Shards::new(brokers)?;
    let broker: Shared = shards.first().clone();
    let shard_meta = opening.map(|o| o.start(&shards));
    let (stop_commits, commits_stopped) = tokio::sync::watch::channel(false);
    let file_commits = file_committer.map(|committer| {
        let wake = Arc::new(tokio::sync::Notify::new());
        let w = wake.clone();
        lock(&broker).set_commit_waker(Arc::new(move || w.notify_one()));
        tokio::spawn(metadata::commit_loop(
            broker.clone(),
            committer,
            wake,
            commits_stopped,
        ))
    });
    for (k, b) in shards.all().iter().enumerate() {
        resources::start(b.clone(), shards::shard_dir(&args.data_dir, k));
    }
    if let Some(c) = &clustered {
        c.attach(broker.clone());
        c.start_mirroring(broker.clone()).await?;
    }

    let services = services::Services::start(&shards)?;

    let listener = TcpListener::bind(&args.amqp_addr)
        .await
        .with_context(|| format!("listening for AMQP on {}", args.amqp_addr))?;
    // After `join_cluster` the app waits for `start_app`, as in RabbitMQ.
    let sockets = ClientSockets::for_fd_limit(fd_limit);
    tracing::info!(sockets = ?sockets.used_and_total().1, "client socket budget");
    let (mut app, mut requests, app_control) = app::App::new(listener, rejoin.is_none(), sockets)?;
    let amqp_addr = app.addr();
    let amqps_addr = match &args.settings.tls.listener {
        Some(addr) => Some(
            amqps::start(
                *addr,
                &args.settings.tls,
                shards.clone(),
                app.running(),
                app.sockets(),
            )
            .await
            .context("starting the AMQPS listener")?,
        ),
        None => None,
    };
    let bind = |addr: &str, what: &'static str| {
        let addr = addr.to_owned();
        async move {
            match TcpListener::bind(&addr).await {
                Ok(l) => Some(l),
                Err(e) => {
                    tracing::warn!(%addr, error = %e, "{what} disabled: cannot listen");
                    None
                }
            }
        }
    };
    let http_listener = bind(&args.http_addr, "HTTP API").await;
    let metrics_listener = bind(&args.prometheus_addr, "metrics").await;
    let http = http_listener
        .as_ref()
        .map(TcpListener::local_addr)
        .transpose()?;
    let metrics_addr = metrics_listener
        .as_ref()
        .map(TcpListener::local_addr)
        .transpose()?;
    // Every client-facing listener, as the overview lists them (the other
    // members' management APIs too, from the cluster).
    let listeners: Vec<(&str, std::net::SocketAddr)> = [
        ("amqp", Some(amqp_addr)),
        ("amqp/ssl", amqps_addr),
        ("http", http),
        ("http/prometheus", metrics_addr),
    ]
    .into_iter()
    .filter_map(|(protocol, addr)| Some((protocol, addr?)))
    .collect();
    if let Some(c) = &clustered {
        c.record_listeners(&listeners);
    }
    if let (Some(l), Some(addr)) = (http_listener, http) {
        let mut api = warren_management::Management::new(broker.clone())
            .shards(shards.all()[1..].to_vec())
            .http_addr(addr)
            .node_control(app_control.clone());
        for (protocol, a) in &listeners {
            api = api.listener(protocol, *a);
        }
        if let Some(ms) = args.settings.stats_interval_ms {
            api = api.statistics_interval(Duration::from_millis(ms));
        }
        if let Some(c) = &clustered {
            api = api
                .cluster(c.control(app_control.clone()))
                .mirrors(c.mirrors());
        }
        if let Some(meta) = &shard_meta {
            api = api.mirrors(cluster::records(meta.clone()));
        }
        tokio::spawn(warren_management::serve(l, api));
    }
    if let Some(l) = metrics_listener {
        // The process gauges read the client sockets through the app.
        let mut metrics = warren_management::Management::new(broker.clone())
            .shards(shards.all()[1..].to_vec())
            .node_control(app_control);
        if let Some(c) = &clustered {
            // The ring gauges read the queue records' mirrors.
            metrics = metrics.mirrors(c.mirrors());
        }
        if let Some(meta) = &shard_meta {
            metrics = metrics.mirrors(cluster::records(meta.clone()));
        }
        tokio::spawn(warren_management::serve_metrics(l, metrics));
    }
    // Before the ready line: a SIGTERM or SIGINT sent as soon as it is read
    // stops the node cleanly (installed later, it killed the process).
    use tokio::signal::unix::{SignalKind, signal as unix_signal};
    let mut term =
        unix_signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = unix_signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let metrics_text = metrics_addr.map_or_else(|| "off".to_owned(), |a| a.to_string());
    let http_text = http.map_or_else(|| "off".to_owned(), |a| a.to_string());
    tracing::info!(node = %args.node_name, %amqp_addr, http = %http_text, metrics = %metrics_text, "ready");
    let amqps_text = amqps_addr.map_or_else(String::new, |a| format!(", AMQPS on {a}"));
    let peers_text = clustered
        .as_ref()
        .map_or_else(String::new, |c| format!(", peers on {}", c.peer_addr()));
    // Not println!: after `join_cluster` re-executes the node, whoever read
    // the first ready line may have closed stdout.
    let _ = writeln!(
        std::io::stdout(),
        "Warren node {} ready, AMQP on {amqp_addr}, HTTP on {http_text}, metrics on {metrics_text}{amqps_text}{peers_text}",
        args.node_name
    );

    // Accepts failed in a row (out of file descriptors: every 10 ms), so
    // that the log says so once per run of them, not a hundred times a second.
    let mut failed_accepts = 0u64;
    let exit = loop {
        tokio::select! {
            accepted = app.accept() => match accepted {
                Ok((stream, peer, socket)) => {
                    if failed_accepts > 0 {
                        tracing::info!(failed = failed_accepts, "accepting clients again");
                        failed_accepts = 0;
                    }
                    if let Err(e) = stream.set_nodelay(true) {
                        tracing::debug!(error = %e, "set_nodelay failed");
                    }
                    shards.serve_on(shards.pick(), stream, peer, app.running(), socket);
                }
                Err(e) => {
                    if failed_accepts == 0 {
                        tracing::warn!(error = %e, "accept failed; retrying every 10 ms");
                    }
                    failed_accepts += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            (request, reply) = requests.next() => {
                if let Some(exit) = app.handle(&shards, request, reply).await {
                    break exit;
                }
            }
            _ = term.recv() => break app::Exit::Stop,
            _ = int.recv() => break app::Exit::Stop,
            // Fail-stop: a node whose Raft stopped can neither commit nor
            // learn metadata, so it stops for its clients to go elsewhere
            // and its queues' mirrors to take over (as etcd exits when its
            // log cannot be written).
            fault = async {
                match &clustered {
                    Some(c) => c.failed().await,
                    None => std::future::pending().await,
                }
            } => {
                tracing::error!(error = %fault, "the cluster metadata store failed: stopping the node");
                break app::Exit::Failed(fault);
            }
        }
    };

    tracing::info!("shutting down");
    if let Some(c) = &clustered {
        c.stop_mirroring().await;
    }
    for b in shards.all() {
        lock(b).close_all("broker shutdown");
    }
    // Give connection tasks a moment to write their connection.close.
    tokio::time::sleep(Duration::from_millis(100)).await;
    // What the clients' departures changed (auto-deletes) reaches the file.
    let _ = stop_commits.send(true);
    if let Some(task) = file_commits {
        let _ = task.await;
    }
    services.stop(&shards).await;
    if let Some(c) = &clustered {
        match &exit {
            app::Exit::Stop => c.leave().await,
            app::Exit::Failed(_) => c.shutdown().await,
            app::Exit::Rejoin(seed) => {
                c.shutdown().await;
                let rejoin = cluster::Rejoin {
                    seed: seed.clone(),
                    amqp_addr: amqp_addr.to_string(),
                    http_addr: http.map(|a| a.to_string()),
                    prometheus_addr: metrics_addr.map(|a| a.to_string()),
                    peer_addr: c.peer_addr(),
                };
                rejoin.save(&args.data_dir)?;
            }
        }
    }
    tracing::info!("stopped, everything on disk");
    Ok(exit)
}
