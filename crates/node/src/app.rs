//! `warrenctl stop`, `stop_app` and `start_app`: the node's side of
//! [`warren_management::NodeControl`]. The management API sends requests
//! to the accept loop in `main.rs`, which owns the AMQP listener; `join_cluster`
//! (`cluster.rs`) asks it to stop the node and restart it to join a cluster.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use warren_management::{ClusterFuture, NodeControl};

use crate::lock;
use crate::shards::Shards;
use crate::sockets::{ClientSockets, HeldSocket};

/// What the API asks of the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Request {
    /// Stop the node (as SIGTERM does).
    Stop,
    /// Close client connections and the AMQP listener.
    StopApp,
    /// Open the AMQP listener again.
    StartApp,
    /// Stop the node, then restart it reset to join the cluster of this
    /// member (a peer address): `join_cluster`.
    Rejoin(String),
}

/// Why the accept loop ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Exit {
    /// Stop the process.
    Stop,
    /// Restart the process, reset, to join the cluster of this member.
    Rejoin(String),
    /// Stop the process with this error: the node cannot go on (its Raft
    /// stopped on a storage fault).
    Failed(String),
}

type Reply = oneshot::Sender<Result<(), String>>;

/// The API's handle: sends [`Request`]s to the accept loop.
#[derive(Debug)]
pub(crate) struct AppControl {
    tx: mpsc::UnboundedSender<(Request, Reply)>,
    running: Arc<AtomicBool>,
    sockets: ClientSockets,
}

impl AppControl {
    fn ask(&self, r: Request) -> ClusterFuture {
        let (reply, answer) = oneshot::channel();
        let sent = self.tx.send((r, reply));
        Box::pin(async move {
            sent.map_err(|_| "the node is shutting down".to_owned())?;
            answer
                .await
                .map_err(|_| "the node is shutting down".to_owned())?
        })
    }
}

impl NodeControl for AppControl {
    fn stop(&self) -> ClusterFuture {
        self.ask(Request::Stop)
    }

    fn stop_app(&self) -> ClusterFuture {
        self.ask(Request::StopApp)
    }

    fn start_app(&self) -> ClusterFuture {
        self.ask(Request::StartApp)
    }

    fn app_running(&self) -> bool {
        self.running.load(Ordering::SeqCst)
    }

    fn client_sockets(&self) -> Option<(u64, Option<u64>)> {
        Some(self.sockets.used_and_total())
    }
}

impl AppControl {
    /// Asks the node to stop and restart to join the cluster of `seed`;
    /// refused while the app runs (RabbitMQ's `join_cluster` rule).
    pub(crate) fn rejoin(&self, seed: &str) -> ClusterFuture {
        self.ask(Request::Rejoin(seed.to_owned()))
    }
}

/// The API's requests, as the accept loop receives them.
#[derive(Debug)]
pub(crate) struct Requests {
    rx: mpsc::UnboundedReceiver<(Request, Reply)>,
}

impl Requests {
    /// The API's next request; pending for ever once the API is gone.
    pub(crate) async fn next(&mut self) -> (Request, Reply) {
        match self.rx.recv().await {
            Some(r) => r,
            None => std::future::pending().await,
        }
    }
}

/// The accept loop's AMQP listener, closed while the app is stopped.
#[derive(Debug)]
pub(crate) struct App {
    listener: Option<TcpListener>,
    addr: SocketAddr,
    running: Arc<AtomicBool>,
    sockets: ClientSockets,
}

impl App {
    /// The app around a bound AMQP listener, the API's requests to it and
    /// the API's handle that sends them. Unless `started`, the listener is
    /// closed at once and the app waits for `StartApp`. Clients, AMQPS's
    /// too, share `sockets`.
    pub(crate) fn new(
        listener: TcpListener,
        started: bool,
        sockets: ClientSockets,
    ) -> std::io::Result<(Self, Requests, Arc<AppControl>)> {
        let addr = listener.local_addr()?;
        let (tx, rx) = mpsc::unbounded_channel();
        let running = Arc::new(AtomicBool::new(started));
        let control = Arc::new(AppControl {
            tx,
            running: running.clone(),
            sockets: sockets.clone(),
        });
        let app = Self {
            listener: started.then_some(listener),
            addr,
            running,
            sockets,
        };
        Ok((app, Requests { rx }, control))
    }

    /// The AMQP listener's address.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The flag that says whether clients are admitted (cleared by
    /// `StopApp` before it closes every connection).
    pub(crate) fn running(&self) -> Arc<AtomicBool> {
        self.running.clone()
    }

    /// The node's budget of client sockets.
    pub(crate) fn sockets(&self) -> ClientSockets {
        self.sockets.clone()
    }

    /// The next client, with its share of the client sockets; pending for
    /// ever while the app is stopped, and while every socket is taken.
    pub(crate) async fn accept(&self) -> std::io::Result<(TcpStream, SocketAddr, HeldSocket)> {
        let Some(l) = &self.listener else {
            return std::future::pending().await;
        };
        let socket = self.sockets.reserve().await;
        let (stream, peer) = l.accept().await?;
        Ok((stream, peer, socket.hold()))
    }

    /// Carries out `StopApp` or `StartApp` and answers it; `Stop` and
    /// `Rejoin` (refused while the app runs) are answered and returned for
    /// the caller to carry out.
    pub(crate) async fn handle(
        &mut self,
        shards: &Shards,
        r: Request,
        reply: Reply,
    ) -> Option<Exit> {
        let mut exit = None;
        let result = match r {
            Request::Stop => {
                exit = Some(Exit::Stop);
                Ok(())
            }
            Request::Rejoin(_) if self.listener.is_some() => {
                Err("the app is running: stop it first with `warrenctl stop_app`".to_owned())
            }
            Request::Rejoin(seed) => {
                exit = Some(Exit::Rejoin(seed));
                Ok(())
            }
            Request::StopApp => {
                self.listener = None;
                self.running.store(false, Ordering::SeqCst);
                for broker in shards.all() {
                    lock(broker).close_all("broker shutdown");
                }
                tracing::info!("application stopped: AMQP listener closed");
                Ok(())
            }
            Request::StartApp if self.listener.is_some() => Ok(()),
            Request::StartApp => match TcpListener::bind(self.addr).await {
                Ok(l) => {
                    self.listener = Some(l);
                    self.running.store(true, Ordering::SeqCst);
                    tracing::info!(addr = %self.addr, "application started: AMQP listener open");
                    Ok(())
                }
                Err(e) => Err(format!("cannot listen for AMQP on {}: {e}", self.addr)),
            },
        };
        let _ = reply.send(result);
        exit
    }
}
