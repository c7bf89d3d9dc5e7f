//! Heartbeats and timeouts, on a virtual millisecond clock.

use amq_protocol::frame::AMQPFrame;
use warren_amqp::{CloseReason, Config, Event};

use crate::Harness;

const HEARTBEAT: [u8; 8] = [8, 0, 0, 0, 0, 0, 0, 0xCE];

#[test]
fn heartbeat_sent_after_half_an_idle_interval() {
    let mut h = Harness::open_with(Config::default(), 131_072, 10);
    assert_eq!(h.conn.poll_timeout(), Some(0));
    h.conn.handle_tick(1_000);
    assert!(h.output().is_empty());
    assert_eq!(h.conn.poll_timeout(), Some(6_000));
    h.conn.handle_tick(5_999);
    assert!(h.output().is_empty());
    h.conn.handle_tick(6_000);
    assert_eq!(h.frames(), vec![AMQPFrame::Heartbeat]);
    assert_eq!(h.conn.poll_timeout(), Some(11_000));
}

#[test]
fn traffic_out_postpones_heartbeats() {
    let mut h = Harness::open_with(Config::default(), 131_072, 10);
    h.conn.handle_tick(0);
    h.send(&crate::channel_open(1));
    h.output(); // open-ok written: counts as traffic
    h.conn.handle_tick(4_000);
    assert!(h.output().is_empty());
    h.conn.handle_tick(8_000);
    assert!(h.output().is_empty(), "last send was at 4000");
    h.conn.handle_tick(9_000);
    assert_eq!(h.frames(), vec![AMQPFrame::Heartbeat]);
}

#[test]
fn silent_peer_dropped_after_two_intervals() {
    let mut h = Harness::open_with(Config::default(), 131_072, 10);
    h.conn.handle_tick(0);
    let mut t = 0;
    // The client's heartbeats keep it alive.
    while t < 60_000 {
        t += 5_000;
        h.send(&HEARTBEAT);
        h.conn.handle_tick(t);
        h.output();
    }
    assert!(!h.conn.is_closed());
    h.events();
    // Then silence.
    h.conn.handle_tick(t + 19_999);
    assert!(!h.conn.is_closed());
    h.conn.handle_tick(t + 20_000);
    assert_eq!(
        h.events(),
        vec![Event::Closed(CloseReason::HeartbeatTimeout)]
    );
    assert!(h.conn.is_closed());
    assert_eq!(h.conn.poll_timeout(), None);
}

#[test]
fn heartbeat_zero_disables_timers() {
    let mut h = Harness::open_with(Config::default(), 131_072, 0);
    h.conn.handle_tick(0);
    assert_eq!(h.conn.poll_timeout(), None);
    h.conn.handle_tick(10_000_000);
    assert!(!h.conn.is_closed());
    assert!(h.output().is_empty());
}

#[test]
fn slow_handshake_times_out() {
    let mut h = Harness::new(Config::default());
    h.conn.handle_tick(100);
    h.send(b"AMQP\x00\x00\x09\x01");
    assert_eq!(h.conn.poll_timeout(), Some(10_100));
    h.conn.handle_tick(10_099);
    assert!(!h.conn.is_closed());
    h.conn.handle_tick(10_100);
    assert_eq!(
        h.events(),
        vec![Event::Closed(CloseReason::HandshakeTimeout)]
    );
}
