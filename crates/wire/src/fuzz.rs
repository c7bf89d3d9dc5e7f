//! One entry point that pushes arbitrary bytes through every decoder a peer
//! can reach: the frame envelope, both handshake roles and the peer frames.
//!
//! `fuzz/fuzz_targets/peer_bytes.rs` (cargo-fuzz, nightly) calls it with
//! coverage-guided input; the test suite calls it with proptest's random
//! input on every CI run. Either way, any panic is a bug.

use bytes::BytesMut;

use crate::{ClusterSecret, FrameDecoder, Handshake, NodeName, PeerFrame, Role, decode_message};

/// Feeds `data` to every peer-facing decoder. Never panics on any input.
pub fn exercise(data: &[u8]) {
    // As raw frame bytes with a small maximum (exercises the size checks
    // and the joining of split frames).
    let mut decoder = FrameDecoder::new(1024);
    let mut buf = BytesMut::from(data);
    let mut frames = Vec::new();
    while let Ok(Some(frame)) = decoder.decode(&mut buf) {
        frames.push(frame);
    }
    // Whole input and each frame as a handshake message, for both roles.
    let node = NodeName::new("fuzz@localhost").expect("a valid name");
    for role in [Role::Dialer, Role::Acceptor] {
        let mut hs = Handshake::new(role, node.clone(), ClusterSecret::new("fuzz"), [7; 32]);
        let mut out = Vec::new();
        hs.start(&mut out);
        for frame in std::iter::once(data).chain(frames.iter().map(|f| &f[..])) {
            if hs.handle(frame, &mut out).is_err() {
                break;
            }
        }
    }
    // Whole input and each frame as a peer frame.
    let _ = decode_message::<PeerFrame>(data);
    for frame in &frames {
        let _ = decode_message::<PeerFrame>(frame);
    }
}
