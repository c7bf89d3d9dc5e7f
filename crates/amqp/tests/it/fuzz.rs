//! Garbage never panics, and the state machine always ends up consistent.

use amq_protocol::protocol::BasicProperties;
use bytes::BytesMut;
use proptest::prelude::*;
use warren_amqp::{Config, Connection, Event};

use crate::{Harness, body, channel_open, header, publish};

fn drive(conn: &mut Connection, chunks: &[Vec<u8>]) {
    let mut buf = BytesMut::new();
    let mut now = 0;
    for chunk in chunks {
        buf.extend_from_slice(chunk);
        conn.handle_bytes(&mut buf);
        while let Some(ev) = conn.poll_event() {
            match ev {
                Event::Authenticate(_) => conn.accept_login(),
                Event::OpenVhost { .. } => conn.accept_vhost(),
                _ => {}
            }
        }
        conn.handle_bytes(&mut buf);
        let mut out = BytesMut::new();
        conn.take_output(&mut out);
        now += 1_000;
        conn.handle_tick(now);
        // Frames we emit always parse.
        let mut rest: &[u8] = &out;
        while !rest.is_empty() && rest != b"AMQP\x00\x00\x09\x01" {
            let (r, _) = amq_protocol::frame::parse_frame(rest).expect("output parses");
            rest = r;
        }
    }
}

fn valid_pieces() -> Vec<Vec<u8>> {
    vec![
        channel_open(1),
        channel_open(2),
        publish(1, "", "q"),
        header(1, 4, BasicProperties::default()),
        header(1, 0, BasicProperties::default()),
        body(1, b"abcd"),
        body(2, b"ab"),
        vec![8, 0, 0, 0, 0, 0, 0, 0xCE],
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn garbage_from_the_start(chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..64), 0..8)) {
        let mut conn = Connection::new(Config::default());
        let mut first = b"AMQP\x00\x00\x09\x01".to_vec();
        if let Some(c) = chunks.first() { first.extend_from_slice(c); }
        let mut all = vec![first];
        all.extend(chunks.into_iter().skip(1));
        drive(&mut conn, &all);
    }

    #[test]
    fn garbage_after_handshake(garbage in prop::collection::vec(any::<u8>(), 0..512)) {
        let mut h = Harness::with_channel(1);
        h.send(&garbage);
        h.conn.handle_tick(1);
        let _ = h.frames();
        let _ = h.events();
    }

    #[test]
    fn shuffled_valid_frames_with_flipped_bytes(
        picks in prop::collection::vec(0usize..8, 0..40),
        flip in prop::option::of((0usize..2000, any::<u8>())),
    ) {
        let pieces = valid_pieces();
        let mut bytes: Vec<u8> = picks.iter().flat_map(|&i| pieces[i].clone()).collect();
        if let Some((at, v)) = flip
            && !bytes.is_empty()
        {
            let at = at % bytes.len();
            bytes[at] = v;
        }
        let mut h = Harness::open_with(Config::default(), 4096, 5);
        let chunks: Vec<Vec<u8>> = bytes.chunks(37).map(<[u8]>::to_vec).collect();
        drive(&mut h.conn, &chunks);
    }

    #[test]
    fn any_tune_ok_is_accepted_or_refused_by_the_rules(
        server_frame_max in prop_oneof![Just(0u32), 0u32..300_000],
        client_frame_max in prop_oneof![Just(0u32), 0u32..300_000],
        client_channel_max in any::<u16>(),
        heartbeat in any::<u16>(),
    ) {
        let config = Config { frame_max: server_frame_max, ..Config::default() };
        let server = Connection::new(config.clone()).frame_max();
        let mut h = Harness::new(config);
        h.send(b"AMQP\x00\x00\x09\x01");
        h.send(&crate::start_ok("u", "p", true));
        h.events();
        h.conn.accept_login();
        h.output();
        h.send(&crate::tune_ok(client_channel_max, client_frame_max, heartbeat));
        let frame_ok = (client_frame_max == 0 || client_frame_max >= 4096)
            && (server == 0 || (client_frame_max != 0 && client_frame_max <= server));
        let channel_ok = client_channel_max != 0 && client_channel_max <= 2047;
        // A refusal while tuning answers nothing (RabbitMQ closes the
        // socket 3 s later).
        prop_assert!(h.output().is_empty());
        prop_assert_eq!(h.conn.is_closing(), !(frame_ok && channel_ok));
        h.conn.handle_tick(0);
        h.conn.handle_tick(u64::from(heartbeat) * 3000);
    }
}
