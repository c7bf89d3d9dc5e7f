//! Runs the cluster handshake ([`warren_wire::Handshake`]) over any frame halves.

use bytes::Bytes;
use warren_wire::{Handshake, HandshakeError, HandshakeStep, NodeName, Role};

use crate::{FrameReceiver, FrameSender, PeerAddr, TransportConfig, TransportError};

/// Runs the handshake as `role` over a fresh connection to `addr`, bounded by
/// the configured handshake timeout. Returns the peer's proven node name.
///
/// A refusal (either way) is logged with its reason; a refusal this side
/// decides is sent to the peer first so that it can log the reason too.
pub async fn run_handshake(
    sender: &mut dyn FrameSender,
    receiver: &mut dyn FrameReceiver,
    config: &TransportConfig,
    role: Role,
    addr: &PeerAddr,
) -> Result<NodeName, TransportError> {
    let timeout = config.handshake_timeout;
    let result = match tokio::time::timeout(timeout, exchange(sender, receiver, config, role)).await
    {
        Ok(result) => result,
        Err(_) => Err(Failure::Timeout),
    };
    result.map_err(|failure| {
        let err = match failure {
            Failure::Timeout => TransportError::HandshakeTimeout {
                addr: addr.clone(),
                after: timeout,
            },
            Failure::Handshake(source) => TransportError::Handshake {
                addr: addr.clone(),
                source,
            },
            // The connection broke (a peer stopping, a cut): the failure
            // detector reports what it means.
            Failure::Transport(e) => {
                tracing::debug!(node = %config.node, peer_addr = %addr, ?role, error = %e, "peer connection lost during the handshake");
                return e;
            }
        };
        tracing::warn!(node = %config.node, peer_addr = %addr, ?role, error = %err, "peer handshake failed; connection refused");
        err
    })
}

enum Failure {
    Timeout,
    Handshake(HandshakeError),
    Transport(TransportError),
}

async fn exchange(
    sender: &mut dyn FrameSender,
    receiver: &mut dyn FrameReceiver,
    config: &TransportConfig,
    role: Role,
) -> Result<NodeName, Failure> {
    let nonce: [u8; 32] = rand::random();
    let mut hs = Handshake::new(role, config.node.clone(), config.secret.clone(), nonce);
    let mut out = Vec::new();
    hs.start(&mut out);
    send_all(sender, &mut out).await?;
    loop {
        let frame = match receiver.recv().await {
            Ok(Some(frame)) => frame,
            Ok(None) => {
                return Err(Failure::Transport(TransportError::ConnectionLost {
                    peer: "peer".into(),
                    reason: "closed during the handshake".into(),
                }));
            }
            Err(e) => return Err(Failure::Transport(e)),
        };
        let step = hs.handle(&frame, &mut out);
        // Send replies (or a refusal) before acting on the outcome; a failed
        // send of a refusal does not hide the reason for refusing.
        let sent = send_all(sender, &mut out).await;
        match step {
            Ok(HandshakeStep::Continue) => sent?,
            Ok(HandshakeStep::Established(peer)) => {
                sent?;
                return Ok(peer);
            }
            Err(e) => return Err(Failure::Handshake(e)),
        }
    }
}

async fn send_all(sender: &mut dyn FrameSender, out: &mut Vec<Vec<u8>>) -> Result<(), Failure> {
    if out.is_empty() {
        return Ok(());
    }
    for frame in out.drain(..) {
        sender
            .feed(Bytes::from(frame))
            .map_err(Failure::Transport)?;
    }
    sender.flush().await.map_err(Failure::Transport)
}
