//! What a TCP peer port gives a connection that has not authenticated yet:
//! small frames, one bounded handshake, a bounded number of slots; and a
//! TLS listener refuses plaintext dialers. Raw sockets play the strangers.

use std::sync::LazyLock;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use warren_tls::ClusterCa;
use warren_transport::conformance::{config, connects_eventually, within};
use warren_transport::{
    HANDSHAKE_MAX_FRAME_LEN, Listener, PeerAddr, Transport, TransportConfig, TransportError,
};
use warren_transport_tcp::TcpTransport;

const SECRET: &str = "pre-auth-secret";

static CA: LazyLock<ClusterCa> = LazyLock::new(|| ClusterCa::generate("pre-auth").expect("CA"));

/// A node's transport, with or without TLS.
fn transport(cfg: TransportConfig, tls: bool) -> TcpTransport {
    if tls {
        let id = CA.issue(cfg.node.as_str()).expect("node certificate");
        TcpTransport::with_tls(cfg, &id).expect("TLS config")
    } else {
        TcpTransport::new(cfg)
    }
}

/// A listener whose handshakes never time out within a test (so a refusal
/// seen here comes from something else), with `slots` handshake slots and
/// frames up to 512 MiB once authenticated.
async fn listener(tls: bool, slots: usize) -> Box<dyn Listener> {
    let mut cfg = config("server@pre-auth", SECRET, 512 << 20);
    cfg.handshake_timeout = Duration::from_secs(600);
    cfg.max_pending_handshakes = slots;
    transport(cfg, tls)
        .listen(&PeerAddr::new("127.0.0.1:0"))
        .await
        .expect("listen")
}

async fn raw(l: &dyn Listener) -> TcpStream {
    TcpStream::connect(l.local_addr().as_str())
        .await
        .expect("raw connect")
}

/// Waits until the listener closes `s`: end of stream or a reset. Whatever
/// it had sent before (a refusal, a TLS alert) is skipped.
async fn closed_by_listener(s: &mut TcpStream) {
    let mut buf = [0u8; 512];
    within("the listener closing the connection", async {
        while let Ok(n) = s.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
}

/// A peer that knows the secret connects (retrying while slots free up).
async fn a_member_connects(l: &mut dyn Listener, tls: bool) {
    let member = transport(config("member@pre-auth", SECRET, 1 << 20), tls);
    let conn = connects_eventually(&member, l).await;
    assert_eq!(conn.peer_node().as_str(), "server@pre-auth");
}

/// A stranger announcing a frame larger than any handshake message, whole
/// or split into pieces, is cut off at its length prefix, not after the
/// listener buffered the frame (16 MiB and 256 MiB fit the maximum after
/// authentication: only the pre-authentication limit refuses them).
#[tokio::test]
async fn a_huge_frame_before_the_handshake_is_refused_at_its_prefix() {
    let mut l = listener(false, 64).await;
    // The first piece of a split frame: its length (4 bytes), then 4 more.
    let split = [
        ((1u32 << 31) | 8).to_be_bytes(),
        (256u32 << 20).to_be_bytes(),
    ]
    .concat();
    for prefix in [
        (16u32 << 20).to_be_bytes().to_vec(),
        (HANDSHAKE_MAX_FRAME_LEN as u32 + 1).to_be_bytes().to_vec(),
        split,
    ] {
        let mut s = raw(l.as_ref()).await;
        s.write_all(&prefix).await.expect("prefix");
        closed_by_listener(&mut s).await;
    }
    a_member_connects(l.as_mut(), false).await;
}

/// Mutual TLS is not optional on a TLS listener: a plaintext Warren dialer
/// with the right secret is refused, and so is a raw stranger's garbage;
/// the listener then serves members as before.
#[tokio::test]
async fn a_tls_listener_refuses_plaintext_dialers() {
    let mut l = listener(true, 64).await;
    let plain = transport(config("plain@pre-auth", SECRET, 1 << 20), false);
    let err = within("a plaintext dial", plain.connect(&l.local_addr()))
        .await
        .expect_err("a plaintext dialer is refused");
    assert!(
        matches!(
            err,
            TransportError::FrameTooLarge(_)
                | TransportError::ConnectionLost { .. }
                | TransportError::Handshake { .. }
        ),
        "{err:?}"
    );
    let mut s = raw(l.as_ref()).await;
    s.write_all(&(16u32 << 20).to_be_bytes())
        .await
        .expect("prefix");
    closed_by_listener(&mut s).await;
    a_member_connects(l.as_mut(), true).await;
}

/// And the other way round: a plaintext listener refuses a TLS dialer (its
/// ClientHello reads as a frame far over the pre-authentication limit).
#[tokio::test]
async fn a_plaintext_listener_refuses_tls_dialers() {
    let l = listener(false, 64).await;
    let tls = transport(config("tls@pre-auth", SECRET, 1 << 20), true);
    within("a TLS dial", tls.connect(&l.local_addr()))
        .await
        .expect_err("a TLS dialer is refused");
}

/// Strangers that connect and send nothing hold the listener's handshake
/// slots; one more is closed at once, without waiting for a handshake
/// timeout. When a stranger leaves, its slot serves a member.
#[tokio::test]
async fn connections_over_the_handshake_slots_are_closed_at_once() {
    for tls in [false, true] {
        const SLOTS: usize = 4;
        let mut l = listener(tls, SLOTS).await;
        let mut silent = Vec::new();
        for _ in 0..SLOTS {
            silent.push(raw(l.as_ref()).await);
        }
        // The listener accepts in order: the silent ones took every slot.
        let mut extra = raw(l.as_ref()).await;
        closed_by_listener(&mut extra).await;
        drop(silent.pop());
        a_member_connects(l.as_mut(), tls).await;
    }
}

/// The handshake timeout bounds the whole time before authentication,
/// however a stranger spends it: silent, or trickling bytes of a frame (or
/// of a TLS record) that never completes.
#[tokio::test]
async fn a_silent_or_trickling_stranger_is_cut_off_by_the_handshake_timeout() {
    for tls in [false, true] {
        let mut cfg = config("server@pre-auth", SECRET, 1 << 20);
        cfg.handshake_timeout = Duration::from_millis(300);
        let l = transport(cfg, tls)
            .listen(&PeerAddr::new("127.0.0.1:0"))
            .await
            .expect("listen");
        let mut silent = raw(l.as_ref()).await;
        let mut trickler = raw(l.as_ref()).await;
        let trickle = async {
            // A frame (or TLS handshake record) announced as 1,000 bytes,
            // sent a byte at a time until the listener hangs up.
            let mut bytes = if tls {
                vec![0x16, 0x03, 0x01, 0x03, 0xe8]
            } else {
                1_000u32.to_be_bytes().to_vec()
            };
            bytes.resize(1_000, 0);
            for b in bytes {
                if trickler.write_all(&[b]).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        within("the trickler", trickle).await;
        closed_by_listener(&mut trickler).await;
        closed_by_listener(&mut silent).await;
    }
}
