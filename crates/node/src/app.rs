//! `warrenctl stop`, `stop_app` and `start_app`: the node's side of
//! [`warren_management::NodeControl`]. The management API sends requests
//! to the accept loop in `main.rs`, which owns the AMQP listener.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use warren_management::{ClusterFuture, NodeControl};

use crate::{Shared, lock};

/// What the API asks of the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Request {
    /// Stop the node (as SIGTERM does).
    Stop,
    /// Close client connections and the AMQP listener.
    StopApp,
    /// Open the AMQP listener again.
    StartApp,
}

type Reply = oneshot::Sender<Result<(), String>>;

/// The API's handle: sends [`Request`]s to the accept loop.
#[derive(Debug)]
pub(crate) struct AppControl {
    tx: mpsc::UnboundedSender<(Request, Reply)>,
    running: Arc<AtomicBool>,
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
}

impl App {
    /// The app around a bound AMQP listener, the API's requests to it and
    /// the API's handle that sends them.
    pub(crate) fn new(listener: TcpListener) -> std::io::Result<(Self, Requests, Arc<AppControl>)> {
        let addr = listener.local_addr()?;
        let (tx, rx) = mpsc::unbounded_channel();
        let running = Arc::new(AtomicBool::new(true));
        let control = Arc::new(AppControl {
            tx,
            running: running.clone(),
        });
        let app = Self {
            listener: Some(listener),
            addr,
            running,
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

    /// The next client; pending for ever while the app is stopped.
    pub(crate) async fn accept(&self) -> std::io::Result<(TcpStream, SocketAddr)> {
        match &self.listener {
            Some(l) => l.accept().await,
            None => std::future::pending().await,
        }
    }

    /// Carries out `StopApp` or `StartApp` and answers it; `Stop` is
    /// answered and left to the caller, which shuts down.
    pub(crate) async fn handle(&mut self, broker: &Shared, r: Request, reply: Reply) {
        let result = match r {
            Request::Stop => Ok(()),
            Request::StopApp => {
                self.listener = None;
                self.running.store(false, Ordering::SeqCst);
                lock(broker).close_all("broker shutdown");
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
    }
}
