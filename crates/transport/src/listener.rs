//! A [`Listener`] fed by a background accept task.

use std::fmt;

use async_trait::async_trait;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::{Connection, Listener, PeerAddr, TransportError};

/// A listener whose accept task (which also runs the handshakes), or a
/// multiplexed port's, sends authenticated connections on a channel.
/// Dropping it stops its own task and runs the transport's clean-up hook
/// (unregistering an address, closing an endpoint).
pub struct ChannelListener {
    local: PeerAddr,
    accepted: mpsc::Receiver<Connection>,
    task: Option<JoinHandle<()>>,
    on_drop: Option<Box<dyn FnOnce() + Send>>,
}

impl ChannelListener {
    /// Wraps the accept `task` that feeds `accepted`; peers dial `local`.
    pub fn new(
        local: PeerAddr,
        accepted: mpsc::Receiver<Connection>,
        task: JoinHandle<()>,
    ) -> Self {
        Self {
            local,
            accepted,
            task: Some(task),
            on_drop: None,
        }
    }

    /// A listener fed by tasks it does not own (those of a multiplexed
    /// port, [`crate::mux`]); peers dial `local`.
    pub fn fed(local: PeerAddr, accepted: mpsc::Receiver<Connection>) -> Self {
        Self {
            local,
            accepted,
            task: None,
            on_drop: None,
        }
    }

    /// Runs `hook` when the listener is dropped, after the accept task stops.
    pub fn on_drop(mut self, hook: impl FnOnce() + Send + 'static) -> Self {
        self.on_drop = Some(Box::new(hook));
        self
    }
}

impl fmt::Debug for ChannelListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChannelListener")
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Listener for ChannelListener {
    fn local_addr(&self) -> PeerAddr {
        self.local.clone()
    }

    async fn accept(&mut self) -> Result<Connection, TransportError> {
        self.accepted.recv().await.ok_or(TransportError::Closed)
    }
}

impl Drop for ChannelListener {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
        if let Some(hook) = self.on_drop.take() {
            hook();
        }
    }
}
