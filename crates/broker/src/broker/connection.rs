//! Client connections: connect, feed input and take output, timers
//! (heartbeats, handshake), login and vhost access, channel close (unacked
//! deliveries requeued), disconnect and operator-forced close.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::BytesMut;
use warren_amqp::{AmqpError, ChannelId, CloseReason, Connection, Credentials, Event, ReplyCode};

use super::command::method_ids;
use super::dispatch::Settle;
use super::state::{Channel, Conn, Departed, IdMap};
use super::{Broker, ConnId, Waker, err, stats};
use crate::auth::{self, Permission};

/// connection.close's class and method ids.
const CONNECTION_CLOSE: (u16, u16) = (10, 50);
impl Broker {
    /// Connection `id`'s client speaks TLS `version` (RabbitMQ's name:
    /// `tlsv1.3`), as the management API shows.
    pub fn set_tls(&mut self, id: ConnId, version: &'static str) {
        if let Some(c) = self.conns.get_mut(&id) {
            c.tls = Some(version);
        }
    }

    /// A new client connection from `peer`; `waker` wakes its task when
    /// another connection's work left output for it.
    pub fn connect(&mut self, peer: SocketAddr, waker: Waker) -> ConnId {
        let id = self.next_conn;
        self.next_conn += 1;
        let mut cfg = self.cfg.amqp.clone();
        cfg.cluster_name
            .get_or_insert_with(|| self.cfg.node_name.clone());
        let mut amqp = Connection::new(cfg);
        amqp.hold_publishes(self.alarmed());
        self.conns.insert(
            id,
            Conn {
                amqp,
                peer,
                tls: None,
                user: String::new(),
                vhost: String::new(),
                perm: None,
                channels: IdMap::default(),
                waker,
                woken: false,
                out_pending: 0,
                throttled: false,
                confirm_dirty: Vec::new(),
                closed: false,
                client_closed: false,
                link: None,
                publisher: false,
                // Only a shell that can move it says so (`may_move`).
                placed: true,
                moving: None,
                resume: None,
                targets: Vec::new(),
                committing: None,
                replies_waiting: 0,
                counters: stats::MessageCounters::default(),
                latency: stats::LatencyHistogram::default(),
                octets: stats::Octets::default(),
            },
        );
        id
    }

    /// Feeds bytes read from connection `id`'s socket (consumes every
    /// complete frame) and does all the work they ask for. `now_ms` is the
    /// wall clock in milliseconds.
    pub fn handle_input(&mut self, id: ConnId, buf: &mut BytesMut, now_ms: u64) {
        self.now = now_ms;
        self.current = id;
        let Some(c) = self.conns.get_mut(&id) else {
            buf.clear();
            return;
        };
        let before = buf.len();
        c.amqp.handle_bytes(buf);
        c.octets.received += (before - buf.len()) as u64;
        if !c.publisher && c.amqp.has_published() && c.link.is_none() {
            // A publish has begun (its content may not be here yet): from
            // now on a resource alarm blocks this connection, so partial
            // messages cannot slip past the memory watermark.
            c.publisher = true;
            if self.alarmed() {
                let reason = self.alarms.cluster().to_string();
                self.conn(id).amqp.block(&reason);
            }
        }
        self.process_events(id, Some(buf));
    }

    /// Moves connection `id`'s pending output into `dst` (write it with one
    /// write); returns false once the connection is over (write `dst`, then
    /// close the socket and call [`disconnect`](Self::disconnect)).
    pub fn take_output(&mut self, id: ConnId, dst: &mut BytesMut) -> bool {
        // Commands that waited for an earlier reply (a get, a declare) go on now.
        let resumed = self.conns.get(&id).is_some_and(|c| {
            c.replies_waiting == 0 && c.committing.is_none() && c.amqp.has_events()
        });
        if resumed {
            self.current = id;
            self.process_events(id, None);
        }
        let start = dst.len();
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        c.flush_confirms(self.now);
        c.amqp.take_output(dst);
        c.woken = false;
        c.out_pending = 0;
        if c.throttled {
            c.throttled = false;
            self.resume_deliveries(id);
            if let Some(c) = self.conns.get_mut(&id) {
                c.amqp.take_output(dst);
                c.out_pending = 0;
                // Still more to hand out: come back once this is written.
                if c.throttled {
                    c.woken = true;
                    (c.waker)();
                }
            }
        }
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        c.octets.sent += (dst.len() - start) as u64;
        // A closed connection whose close-ok waits for a commit stays.
        !c.closed || c.committing.is_some()
    }

    /// Hands out again to connection `id`'s consumers, which deliveries
    /// skipped while its output was over [`OUTPUT_HIGH_WATER`](super::OUTPUT_HIGH_WATER).
    pub(crate) fn resume_deliveries(&mut self, id: ConnId) {
        let Some(c) = self.conns.get(&id) else {
            return;
        };
        let vhost = c.vhost.clone();
        let queues: Vec<Arc<str>> = c
            .channels
            .values()
            .flat_map(|ch| ch.consumers.values().cloned())
            .collect();
        self.current = id;
        for q in queues {
            self.after_queue_op(&vhost, &q);
        }
    }

    /// When connection `id`'s timers (heartbeats, handshake, close) need
    /// [`handle_conn_tick`](Self::handle_conn_tick), on the same clock as `now_ms`.
    #[must_use]
    pub fn poll_conn_timeout(&self, id: ConnId) -> Option<u64> {
        self.conns.get(&id).and_then(|c| c.amqp.poll_timeout())
    }

    /// Advances connection `id`'s timers.
    pub fn handle_conn_tick(&mut self, id: ConnId, now_ms: u64) {
        self.now = now_ms;
        self.current = id;
        if let Some(c) = self.conns.get_mut(&id) {
            c.amqp.handle_tick(now_ms);
        }
        self.process_events(id, None);
    }

    /// The shell holds connection `id`'s input unread (it is paused and the
    /// shell's buffer for it is full), or bytes arrived that wait unread:
    /// either way the client is not silent, so its missed-heartbeat clock
    /// starts again.
    pub fn hold_input(&mut self, id: ConnId) {
        if let Some(c) = self.conns.get_mut(&id) {
            c.amqp.input_held();
        }
    }

    /// Connection `id`'s socket is gone: its channels close (unacked
    /// messages are requeued), its exclusive queues are deleted. What it
    /// owned (unfinished messages can be large) is returned, to be dropped
    /// after the broker's lock is released.
    #[must_use = "drop it outside the broker's lock"]
    pub fn disconnect(&mut self, id: ConnId, now_ms: u64) -> Option<Departed> {
        self.now = now_ms;
        self.current = id;
        self.detached(|b| b.cleanup_conn(id));
        let c = self.conns.remove(&id)?;
        self.retired_counters.add(&c.counters);
        self.retired_latency.add(&c.latency);
        Some(Departed(Box::new(c)))
    }

    /// Closes connection `id` as an operator asked (`close_connection`,
    /// `DELETE /api/connections/NAME`): the client gets connection.close
    /// 320 CONNECTION_FORCED with `reason`, as RabbitMQ sends. Returns false
    /// if there is no such client connection.
    pub fn close_connection(&mut self, id: ConnId, reason: &str) -> bool {
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        // Forwarding links are not clients; one already closing is gone.
        if c.link.is_some() || c.amqp.is_closing() {
            return false;
        }
        tracing::info!(peer = %c.peer, user = %c.user, %reason, "closing connection on request");
        c.amqp
            .connection_error(err(ReplyCode::ConnectionForced, reason.to_owned()));
        c.woken = true;
        (c.waker)();
        true
    }

    /// Closes every connection with 320 CONNECTION_FORCED (their tasks
    /// write the close) before a shutdown.
    pub fn close_all(&mut self, text: &str) {
        for c in self.conns.values_mut() {
            c.amqp
                .connection_error(err(ReplyCode::ConnectionForced, text.to_owned()));
            c.woken = true;
            (c.waker)();
        }
    }

    /// One of connection `id`'s waiting replies (`Conn::replies_waiting`)
    /// went out: once none waits, its input goes on (its task is woken, and
    /// [`take_output`](Self::take_output) handles the commands that
    /// waited).
    pub(super) fn reply_answered(&mut self, id: ConnId) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        c.replies_waiting = c.replies_waiting.saturating_sub(1);
        if c.replies_waiting == 0 {
            c.woken = true;
            (c.waker)();
        }
    }

    pub(super) fn process_events(&mut self, id: ConnId, mut buf: Option<&mut BytesMut>) {
        loop {
            let Some(c) = self.conns.get_mut(&id) else {
                return;
            };
            if c.committing.is_some() || c.replies_waiting > 0 || c.moving.is_some() {
                // Its input waits until the commit is reported, its
                // waiting replies have gone out, or it has moved.
                return;
            }
            let Some(ev) = c.resume.take().or_else(|| c.amqp.poll_event()) else {
                break;
            };
            match ev {
                Event::Authenticate(creds) => {
                    let ok = self.check_login(id, &creds);
                    if let Some(c) = self.conns.get_mut(&id) {
                        if ok {
                            c.user = creds.username.clone();
                            c.amqp.accept_login();
                        } else {
                            tracing::warn!(user = %creds.username, peer = %c.peer, "login refused");
                            c.amqp.refuse_login();
                        }
                        if let Some(b) = buf.as_deref_mut() {
                            c.amqp.handle_bytes(b);
                        }
                    }
                }
                Event::OpenVhost { vhost } => {
                    let c = self.conns.get_mut(&id).expect("connection present");
                    match self.vhosts.get(&vhost) {
                        None => c.amqp.refuse_vhost(AmqpError::vhost_not_found(&vhost)),
                        Some(v) => match v.permissions.get(&c.user) {
                            None => c
                                .amqp
                                .refuse_vhost(AmqpError::vhost_access_refused(&vhost, &c.user)),
                            Some(p) => {
                                c.perm = Some(Permission::new(p));
                                c.vhost = vhost;
                                c.amqp.accept_vhost();
                            }
                        },
                    }
                    if let Some(b) = buf.as_deref_mut() {
                        c.amqp.handle_bytes(b);
                    }
                }
                Event::ChannelOpened(ch) => {
                    c.channels.insert(ch, Channel::default());
                }
                Event::ChannelClosed { channel, .. } => {
                    self.detached(|b| b.close_channel(id, channel));
                }
                Event::Command { channel, command } => {
                    // Its first command naming a queue may move it to
                    // the queue's shard first (`moving.rs`).
                    let Some(command) = self.place(id, channel, command) else {
                        return;
                    };
                    let ids = method_ids(&command);
                    // Exchange and queue methods may change metadata.
                    let mark = if matches!(ids.0, 40 | 50) {
                        self.begin_recording(id)
                    } else {
                        None
                    };
                    let result = self.command(id, channel, command);
                    if let Err(mut e) = result {
                        if e.class_id == 0 {
                            e = e.with_method(ids.0, ids.1);
                        }
                        if let Some(c) = self.conns.get_mut(&id) {
                            if e.code.is_hard() {
                                c.amqp.connection_error(e);
                            } else {
                                c.amqp.channel_error(channel, e);
                            }
                        }
                    }
                    if let Some(mark) = mark {
                        self.end_recording(id, mark, ids);
                    }
                }
                Event::Closed(reason) => {
                    tracing::debug!(conn = id, ?reason, "connection closed");
                    if let (CloseReason::ServerClosed(e), Some(c)) = (&reason, self.conns.get(&id))
                        && c.amqp.vhost().is_empty()
                        && e.code != ReplyCode::AccessRefused
                    {
                        // Refused while starting: the client got no
                        // connection.close (as from RabbitMQ), so the reason
                        // is only here.
                        tracing::warn!(peer = %c.peer, error = %e.reply_text(), "refused AMQP connection before it opened");
                    }
                    let client_closed = matches!(reason, CloseReason::ClientClosed { .. });
                    // Its close-ok (and what precedes it) may wait for the
                    // deletes of its end to be committed (`close_waits`).
                    let mark = if client_closed && self.meta.close_waits() {
                        self.begin_recording(id).map(|_| 0)
                    } else {
                        None
                    };
                    match mark {
                        Some(mark) => {
                            self.cleanup_conn(id);
                            self.end_recording(id, mark, CONNECTION_CLOSE);
                        }
                        None => self.detached(|b| b.cleanup_conn(id)),
                    }
                    if let Some(c) = self.conns.get_mut(&id) {
                        c.closed = true;
                        c.client_closed = client_closed;
                    }
                }
                _ => {}
            }
        }
        if let Some(c) = self.conns.get_mut(&id) {
            c.flush_confirms(self.now);
        }
    }

    fn check_login(&self, id: ConnId, creds: &Credentials) -> bool {
        let Some(c) = self.conns.get(&id) else {
            return false;
        };
        let Some(u) = self.users.get(&creds.username) else {
            return false;
        };
        if u.loopback_only && !c.peer.ip().is_loopback() {
            return false;
        }
        auth::check_password(&u.password_hash, &creds.password)
    }

    pub(super) fn cleanup_conn(&mut self, id: ConnId) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let chans: Vec<ChannelId> = c.channels.keys().copied().collect();
        let vhost = c.vhost.clone();
        for ch in chans {
            self.close_channel(id, ch);
        }
        let Some(v) = self.vhosts.get(&vhost) else {
            return;
        };
        let exclusive: Vec<Arc<str>> = v
            .queues
            .values()
            .filter(|q| q.owner == Some(id))
            .map(|q| q.name.clone())
            .collect();
        for q in exclusive {
            self.delete_queue(&vhost, &q);
        }
    }

    fn close_channel(&mut self, id: ConnId, ch_id: ChannelId) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let Some(ch) = c.channels.remove(&ch_id) else {
            return;
        };
        let vhost = c.vhost.clone();
        let Some(v) = self.vhosts.get_mut(&vhost) else {
            return;
        };
        let mut touched: Vec<Arc<str>> = Vec::new();
        let mut forwarded = Vec::new();
        for (tag, qname) in &ch.consumers {
            if let Some(q) = v.queues.get_mut(qname) {
                if let Some(node) = &q.remote {
                    for x in &q.consumers {
                        if x.conn == id && x.channel == ch_id && &x.tag == tag {
                            forwarded.push((node.clone(), x.remote_cid));
                        }
                    }
                }
                q.consumers
                    .retain(|x| !(x.conn == id && x.channel == ch_id && &x.tag == tag));
                q.consumer_left();
                touched.push(qname.clone());
            }
        }
        let mut settle_remote = Vec::new();
        for u in ch.unacked.into_values() {
            if let Some(node) = u.remote {
                settle_remote.push((node, u.bq_tag));
                continue;
            }
            if let Some(q) = v.queues.get_mut(&u.queue) {
                if let Err(e) = q.store.requeue(u.bq_tag) {
                    q.settle_failed("requeue", &e);
                }
                touched.push(u.queue);
            }
        }
        for (node, cid) in forwarded {
            self.link_cancel(&node, &vhost, cid);
        }
        self.link_settle_all(&vhost, settle_remote, Settle::Requeue);
        touched.sort();
        touched.dedup();
        for q in touched {
            if self.auto_delete_if_unused(&vhost, &q) {
                continue;
            }
            self.after_queue_op(&vhost, &q);
        }
    }

    pub(super) fn conn(&mut self, id: ConnId) -> &mut Conn {
        self.conns.get_mut(&id).expect("connection present")
    }
}
