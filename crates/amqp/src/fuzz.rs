//! One entry point that pushes arbitrary bytes through every decoder a
//! client can reach: a connection from its protocol header, a connection past
//! login (frames with nested and oversized values), and stored properties.
//!
//! `fuzz/fuzz_targets/amqp_bytes.rs` (cargo-fuzz, nightly) calls it with
//! coverage-guided input; the test suite calls it with proptest's input,
//! nested tables and arrays of any depth among it, on every CI run. Either
//! way, any panic or stack overflow is a bug.

use bytes::BytesMut;

use crate::{Config, Connection, Event, decode_properties};

/// Feeds `data` to a fresh connection, to a logged-in one with channel 1
/// open, and to the stored-properties decoder. Never panics on any input.
pub fn exercise(data: &[u8]) {
    let mut fresh = BytesMut::from(&b"AMQP\x00\x00\x09\x01"[..]);
    fresh.extend_from_slice(data);
    drive(&mut Connection::new(Config::default()), &mut fresh);

    let mut conn = Connection::new(Config::default());
    let mut login = BytesMut::from(LOGIN);
    drive(&mut conn, &mut login);
    let mut rest = BytesMut::from(data);
    drive(&mut conn, &mut rest);

    let _ = decode_properties(data);
}

/// Feeds `buf`, accepting every login and vhost, ticking the clock once.
fn drive(conn: &mut Connection, buf: &mut BytesMut) {
    for _ in 0..4 {
        conn.handle_bytes(buf);
        while let Some(ev) = conn.poll_event() {
            match ev {
                Event::Authenticate(_) => conn.accept_login(),
                Event::OpenVhost { .. } => conn.accept_vhost(),
                _ => {}
            }
        }
    }
    conn.handle_tick(1);
    let mut out = BytesMut::new();
    conn.take_output(&mut out);
}

/// A client's handshake: protocol header, start-ok (PLAIN guest/guest, no
/// properties), tune-ok (channel_max 2047, frame_max 131072, heartbeat 0),
/// connection.open "/", channel.open 1.
pub const LOGIN: &[u8] = &[
    b'A', b'M', b'Q', b'P', 0, 0, 9, 1, // protocol header
    1, 0, 0, 0, 0, 0, 36, 0, 10, 0, 11, 0, 0, 0, 0, // start-ok, empty client-properties
    5, b'P', b'L', b'A', b'I', b'N', 0, 0, 0, 12, 0, b'g', b'u', b'e', b's', b't', 0, b'g', b'u',
    b'e', b's', b't', 5, b'e', b'n', b'_', b'U', b'S', 0xCE, //
    1, 0, 0, 0, 0, 0, 12, 0, 10, 0, 31, 0x07, 0xFF, 0, 2, 0, 0, 0, 0, 0xCE, // tune-ok
    1, 0, 0, 0, 0, 0, 8, 0, 10, 0, 40, 1, b'/', 0, 0, 0xCE, // connection.open "/"
    1, 0, 1, 0, 0, 0, 5, 0, 20, 0, 10, 0, 0xCE, // channel.open 1
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_login_prefix_opens_channel_1() {
        let mut conn = Connection::new(Config::default());
        drive(&mut conn, &mut BytesMut::from(LOGIN));
        assert!(conn.is_open());
        let mut buf = BytesMut::from(&[1, 0, 1, 0, 0, 0, 5, 0, 20, 0, 10, 0, 0xCE][..]);
        conn.handle_bytes(&mut buf);
        let mut out = BytesMut::new();
        conn.take_output(&mut out);
        // A second channel.open on 1 is a 504 connection error: 1 is open.
        assert!(out.windows(2).any(|w| w == [0x01, 0xF8]), "{out:?}");
    }
}
