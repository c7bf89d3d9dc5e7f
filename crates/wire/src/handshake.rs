//! The handshake that opens every peer connection, as a sans-IO state machine.
//!
//! ```text
//! dialer                                   acceptor
//!   Hello{version, node, nonce_d}  ───────▶  checks the version
//!                                  ◀───────  Hello{version, node, nonce_a}
//!   Proof{mac_d}                   ───────▶  checks mac_d
//!                                  ◀───────  Proof{mac_a}
//!   checks mac_a
//! ```
//!
//! `mac_x = HMAC-SHA256(secret, "warren-handshake-v1" ‖ x ‖ nonce_d ‖ nonce_a ‖
//! dialer name ‖ acceptor name)`, where `x` says which side made it, so a
//! proof can never be reflected back to its maker and a recorded proof is
//! useless against fresh nonces. The secret itself never crosses the wire.
//!
//! A side that refuses the other (wrong version, wrong proof, garbage) sends a
//! [`RefuseReason`] before it closes, so both ends can say why.

use std::fmt;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::{NodeName, WireError};

/// The peer protocol version this build speaks. Peers must speak the same one.
pub const PROTOCOL_VERSION: u32 = 1;

/// The largest frame a side accepts before the peer has proven the cluster
/// secret. Every handshake message fits in a few hundred bytes (a `Hello`
/// with a 255-byte node name is under 300), so a peer that announces more is
/// not a Warren node and is refused before its frame is buffered.
pub const HANDSHAKE_MAX_FRAME_LEN: usize = 4096;

/// First bytes of every `Hello`, so a stray client is recognised at once.
const MAGIC: [u8; 4] = *b"WRRN";
const MAC_LABEL: &[u8] = b"warren-handshake-v1";

/// The shared cluster secret that every node of one cluster knows.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret(Vec<u8>);

impl ClusterSecret {
    /// Wraps the secret's bytes (for example a file's contents, trimmed).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Self(bytes.into())
    }

    /// A 32-byte key derived from the secret for one purpose, named by
    /// `label` (HMAC-SHA256 keyed by the secret): nodes sharing the secret
    /// derive the same key, and the key does not reveal the secret.
    pub fn derive_key(&self, label: &[u8]) -> [u8; 32] {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        mac.update(label);
        mac.finalize().into_bytes().into()
    }
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(<redacted>)")
    }
}

/// Which end of the connection this side is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The side that connected.
    Dialer,
    /// The side that accepted.
    Acceptor,
}

/// Why a side refused the handshake; sent to the other side before closing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RefuseReason {
    /// The refusing side speaks another protocol version.
    VersionMismatch {
        /// The version the refusing side speaks.
        supported: u32,
    },
    /// The proof did not match the refusing side's cluster secret.
    WrongSecret,
    /// A handshake frame could not be decoded or came out of order.
    Malformed,
}

impl fmt::Display for RefuseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::VersionMismatch { supported } => write!(
                f,
                "it speaks peer protocol version {supported}, this node speaks {PROTOCOL_VERSION}"
            ),
            Self::WrongSecret => f.write_str("the cluster secrets differ"),
            Self::Malformed => f.write_str("this node's handshake frames were malformed"),
        }
    }
}

/// Why a handshake failed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The peer speaks another protocol version.
    #[error("peer {peer} speaks peer protocol version {theirs}, this node speaks {ours}")]
    VersionMismatch {
        /// The peer's name.
        peer: NodeName,
        /// This node's version.
        ours: u32,
        /// The peer's version.
        theirs: u32,
    },
    /// The peer's proof does not match this node's cluster secret.
    #[error("peer {peer} failed the cluster-secret check: the cluster secrets differ")]
    WrongSecret {
        /// The name the peer claimed.
        peer: NodeName,
    },
    /// The peer refused this node and said why.
    #[error("peer refused the handshake: {0}")]
    RefusedByPeer(RefuseReason),
    /// The peer sent something that is not a Warren handshake.
    #[error("not a Warren peer handshake: {0}")]
    Malformed(String),
}

#[derive(Debug, Serialize, Deserialize)]
enum HandshakeMsg {
    Hello {
        magic: [u8; 4],
        version: u32,
        node: NodeName,
        nonce: [u8; 32],
    },
    Proof {
        mac: [u8; 32],
    },
    Refuse {
        reason: RefuseReason,
    },
}

impl HandshakeMsg {
    fn encode(&self) -> Vec<u8> {
        postcard::to_stdvec(self).expect("handshake messages always serialise")
    }
}

/// What the caller should do after feeding the handshake a frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandshakeStep {
    /// Send the frames that were pushed to `out`, then wait for the next frame.
    Continue,
    /// Send the frames pushed to `out`; the peer is authenticated under this name.
    Established(NodeName),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    AwaitHello,
    AwaitProof,
    Done,
    Failed,
}

/// One side of a handshake. Feed it the peer's frames; it says what to send.
#[derive(Debug)]
pub struct Handshake {
    role: Role,
    node: NodeName,
    secret: ClusterSecret,
    nonce: [u8; 32],
    version: u32,
    peer: Option<(NodeName, [u8; 32])>,
    state: State,
}

impl Handshake {
    /// A new handshake for this node. `nonce` must be fresh random bytes.
    pub fn new(role: Role, node: NodeName, secret: ClusterSecret, nonce: [u8; 32]) -> Self {
        Self::with_version(role, node, secret, nonce, PROTOCOL_VERSION)
    }

    /// As [`Handshake::new`] but claiming another protocol version (for tests
    /// of version refusal).
    pub fn with_version(
        role: Role,
        node: NodeName,
        secret: ClusterSecret,
        nonce: [u8; 32],
        version: u32,
    ) -> Self {
        Self {
            role,
            node,
            secret,
            nonce,
            version,
            peer: None,
            state: State::AwaitHello,
        }
    }

    /// The frames to send before any frame arrives: the dialer's `Hello`.
    pub fn start(&mut self, out: &mut Vec<Vec<u8>>) {
        if self.role == Role::Dialer {
            out.push(self.hello());
        }
    }

    /// Feeds one frame from the peer. Frames to send are pushed to `out`; on
    /// an error, `out` may hold a refusal to send before closing.
    pub fn handle(
        &mut self,
        frame: &[u8],
        out: &mut Vec<Vec<u8>>,
    ) -> Result<HandshakeStep, HandshakeError> {
        let result = self.handle_inner(frame, out);
        if result.is_err() {
            self.state = State::Failed;
        }
        result
    }

    fn handle_inner(
        &mut self,
        frame: &[u8],
        out: &mut Vec<Vec<u8>>,
    ) -> Result<HandshakeStep, HandshakeError> {
        let msg: HandshakeMsg = match postcard::from_bytes(frame) {
            Ok(msg) => msg,
            Err(e) => return Err(self.refuse_malformed(format!("undecodable frame: {e}"), out)),
        };
        match (self.state, msg) {
            (_, HandshakeMsg::Refuse { reason }) => Err(HandshakeError::RefusedByPeer(reason)),
            (
                State::AwaitHello,
                HandshakeMsg::Hello {
                    magic,
                    version,
                    node,
                    nonce,
                },
            ) => {
                if magic != MAGIC {
                    return Err(self.refuse_malformed("bad magic bytes".into(), out));
                }
                if version != self.version {
                    out.push(
                        HandshakeMsg::Refuse {
                            reason: RefuseReason::VersionMismatch {
                                supported: self.version,
                            },
                        }
                        .encode(),
                    );
                    return Err(HandshakeError::VersionMismatch {
                        peer: node,
                        ours: self.version,
                        theirs: version,
                    });
                }
                self.peer = Some((node, nonce));
                match self.role {
                    Role::Acceptor => out.push(self.hello()),
                    Role::Dialer => out.push(
                        HandshakeMsg::Proof {
                            mac: self.mac(Role::Dialer),
                        }
                        .encode(),
                    ),
                }
                self.state = State::AwaitProof;
                Ok(HandshakeStep::Continue)
            }
            (State::AwaitProof, HandshakeMsg::Proof { mac }) => {
                let theirs = match self.role {
                    Role::Dialer => Role::Acceptor,
                    Role::Acceptor => Role::Dialer,
                };
                let (peer, _) = self.peer.clone().expect("a peer hello came first");
                if !self.verify(theirs, &mac) {
                    out.push(
                        HandshakeMsg::Refuse {
                            reason: RefuseReason::WrongSecret,
                        }
                        .encode(),
                    );
                    return Err(HandshakeError::WrongSecret { peer });
                }
                if self.role == Role::Acceptor {
                    out.push(
                        HandshakeMsg::Proof {
                            mac: self.mac(Role::Acceptor),
                        }
                        .encode(),
                    );
                }
                self.state = State::Done;
                Ok(HandshakeStep::Established(peer))
            }
            (state, msg) => Err(self.refuse_malformed(
                format!("unexpected {} in state {state:?}", msg_name(&msg)),
                out,
            )),
        }
    }

    fn refuse_malformed(&self, why: String, out: &mut Vec<Vec<u8>>) -> HandshakeError {
        out.push(
            HandshakeMsg::Refuse {
                reason: RefuseReason::Malformed,
            }
            .encode(),
        );
        HandshakeError::Malformed(why)
    }

    fn hello(&self) -> Vec<u8> {
        HandshakeMsg::Hello {
            magic: MAGIC,
            version: self.version,
            node: self.node.clone(),
            nonce: self.nonce,
        }
        .encode()
    }

    fn keyed_mac(&self, maker: Role) -> Hmac<Sha256> {
        let (peer, peer_nonce) = self.peer.as_ref().expect("a peer hello came first");
        let (dialer, acceptor, nonce_d, nonce_a) = match self.role {
            Role::Dialer => (&self.node, peer, &self.nonce, peer_nonce),
            Role::Acceptor => (peer, &self.node, peer_nonce, &self.nonce),
        };
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.secret.0).expect("HMAC takes keys of any length");
        mac.update(MAC_LABEL);
        mac.update(match maker {
            Role::Dialer => b"D",
            Role::Acceptor => b"A",
        });
        mac.update(nonce_d);
        mac.update(nonce_a);
        for name in [dialer, acceptor] {
            mac.update(&(name.as_str().len() as u32).to_be_bytes());
            mac.update(name.as_str().as_bytes());
        }
        mac
    }

    fn mac(&self, maker: Role) -> [u8; 32] {
        self.keyed_mac(maker).finalize().into_bytes().into()
    }

    fn verify(&self, maker: Role, mac: &[u8; 32]) -> bool {
        self.keyed_mac(maker).verify_slice(mac).is_ok()
    }
}

fn msg_name(msg: &HandshakeMsg) -> &'static str {
    match msg {
        HandshakeMsg::Hello { .. } => "Hello",
        HandshakeMsg::Proof { .. } => "Proof",
        HandshakeMsg::Refuse { .. } => "Refuse",
    }
}

/// Maps a frame-level error met during the handshake to a handshake error.
impl From<WireError> for HandshakeError {
    fn from(e: WireError) -> Self {
        Self::Malformed(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn name(s: &str) -> NodeName {
        NodeName::new(s).unwrap()
    }

    /// Runs two handshakes against each other until both finish.
    fn run(
        mut d: Handshake,
        mut a: Handshake,
    ) -> (
        Result<NodeName, HandshakeError>,
        Result<NodeName, HandshakeError>,
    ) {
        let mut to_a = Vec::new();
        d.start(&mut to_a);
        let mut d_res = None;
        let mut a_res = None;
        for _ in 0..10 {
            let mut to_d = Vec::new();
            for f in to_a.drain(..) {
                if a_res.is_none() {
                    match a.handle(&f, &mut to_d) {
                        Ok(HandshakeStep::Continue) => {}
                        Ok(HandshakeStep::Established(p)) => a_res = Some(Ok(p)),
                        Err(e) => a_res = Some(Err(e)),
                    }
                }
            }
            for f in to_d.drain(..) {
                if d_res.is_none() {
                    match d.handle(&f, &mut to_a) {
                        Ok(HandshakeStep::Continue) => {}
                        Ok(HandshakeStep::Established(p)) => d_res = Some(Ok(p)),
                        Err(e) => d_res = Some(Err(e)),
                    }
                }
            }
            if d_res.is_some() && a_res.is_some() {
                break;
            }
        }
        (
            d_res.expect("dialer finished"),
            a_res.expect("acceptor finished"),
        )
    }

    #[test]
    fn same_secret_authenticates_both_names() {
        let s = ClusterSecret::new("s3cret");
        let (d, a) = run(
            Handshake::new(Role::Dialer, name("a@h"), s.clone(), [1; 32]),
            Handshake::new(Role::Acceptor, name("b@h"), s, [2; 32]),
        );
        assert_eq!(d.unwrap(), name("b@h"));
        assert_eq!(a.unwrap(), name("a@h"));
    }

    #[test]
    fn wrong_secret_is_refused_and_both_sides_say_so() {
        let (d, a) = run(
            Handshake::new(
                Role::Dialer,
                name("a@h"),
                ClusterSecret::new("one"),
                [1; 32],
            ),
            Handshake::new(
                Role::Acceptor,
                name("b@h"),
                ClusterSecret::new("two"),
                [2; 32],
            ),
        );
        assert_eq!(
            a.unwrap_err(),
            HandshakeError::WrongSecret { peer: name("a@h") }
        );
        let d = d.unwrap_err();
        assert_eq!(d, HandshakeError::RefusedByPeer(RefuseReason::WrongSecret));
        assert!(d.to_string().contains("cluster secrets differ"), "{d}");
    }

    #[test]
    fn other_version_is_refused_naming_both_versions() {
        let s = ClusterSecret::new("s");
        let (d, a) = run(
            Handshake::with_version(Role::Dialer, name("a@h"), s.clone(), [1; 32], 7),
            Handshake::new(Role::Acceptor, name("b@h"), s, [2; 32]),
        );
        assert_eq!(
            a.unwrap_err(),
            HandshakeError::VersionMismatch {
                peer: name("a@h"),
                ours: PROTOCOL_VERSION,
                theirs: 7
            }
        );
        let d = d.unwrap_err();
        assert_eq!(
            d,
            HandshakeError::RefusedByPeer(RefuseReason::VersionMismatch {
                supported: PROTOCOL_VERSION
            })
        );
    }

    #[test]
    fn a_replayed_proof_fails_against_a_fresh_nonce() {
        let s = ClusterSecret::new("s");
        // Record a dialer's proof from one session…
        let mut d1 = Handshake::new(Role::Dialer, name("a@h"), s.clone(), [1; 32]);
        let mut a1 = Handshake::new(Role::Acceptor, name("b@h"), s.clone(), [2; 32]);
        let (mut to_a, mut to_d) = (Vec::new(), Vec::new());
        d1.start(&mut to_a);
        a1.handle(&to_a[0], &mut to_d).unwrap();
        let mut proof = Vec::new();
        d1.handle(&to_d[0], &mut proof).unwrap();
        // …and replay it to an acceptor that picked another nonce.
        let mut a2 = Handshake::new(Role::Acceptor, name("b@h"), s, [3; 32]);
        let mut sink = Vec::new();
        a2.handle(&to_a[0], &mut sink).unwrap();
        assert!(matches!(
            a2.handle(&proof[0], &mut sink),
            Err(HandshakeError::WrongSecret { .. })
        ));
    }

    #[test]
    fn proof_before_hello_is_malformed() {
        let mut a = Handshake::new(
            Role::Acceptor,
            name("b@h"),
            ClusterSecret::new("s"),
            [2; 32],
        );
        let proof = HandshakeMsg::Proof { mac: [0; 32] }.encode();
        let mut out = Vec::new();
        assert!(matches!(
            a.handle(&proof, &mut out),
            Err(HandshakeError::Malformed(_))
        ));
        assert_eq!(out.len(), 1, "a refusal is sent");
    }

    #[test]
    fn every_handshake_message_fits_the_pre_authentication_limit() {
        let longest = name(&"n".repeat(NodeName::MAX_LEN));
        let h = Handshake::new(Role::Dialer, longest, ClusterSecret::new("s"), [7; 32]);
        let refusals = [
            RefuseReason::VersionMismatch {
                supported: u32::MAX,
            },
            RefuseReason::WrongSecret,
            RefuseReason::Malformed,
        ];
        let sizes = refusals
            .into_iter()
            .map(|reason| HandshakeMsg::Refuse { reason }.encode().len())
            .chain([
                h.hello().len(),
                HandshakeMsg::Proof { mac: [0xff; 32] }.encode().len(),
            ]);
        for size in sizes {
            assert!(size <= 300, "{size} bytes");
        }
        const { assert!(300 < HANDSHAKE_MAX_FRAME_LEN) };
    }

    #[test]
    fn derived_keys_depend_on_the_secret_and_the_label() {
        let (a, b) = (ClusterSecret::new("one"), ClusterSecret::new("two"));
        assert_eq!(a.derive_key(b"ca"), a.clone().derive_key(b"ca"));
        assert_ne!(a.derive_key(b"ca"), b.derive_key(b"ca"));
        assert_ne!(a.derive_key(b"ca"), a.derive_key(b"other"));
    }

    #[test]
    fn secret_is_never_debug_printed() {
        assert!(!format!("{:?}", ClusterSecret::new("hunter2")).contains("hunter2"));
    }

    proptest! {
        #[test]
        fn garbage_never_panics(frames in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..200), 1..5)) {
            for role in [Role::Dialer, Role::Acceptor] {
                let mut h = Handshake::new(role, name("x@h"), ClusterSecret::new("s"), [9; 32]);
                let mut out = Vec::new();
                h.start(&mut out);
                for f in &frames {
                    if h.handle(f, &mut out).is_err() { break; }
                }
            }
        }
    }
}
