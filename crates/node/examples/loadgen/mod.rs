//! The lean AMQP load generator behind `examples/amqp_bench.rs` and the
//! in-process shards bench (`benches/shards.rs`): producers, consumers,
//! message size, confirms, persistence, duration; measures published/s,
//! consumed/s and the p50/p99 publish-to-delivery latency.
//!
//! It shares the machine with the brokers it measures, so it is built to
//! cost little: each connection is one task that speaks AMQP 0-9-1 through
//! `amq-protocol`'s codec, writes every frame that is ready in one write and
//! parses every frame of one read. A producer keeps exactly `--confirms`
//! publishes unconfirmed (as RabbitMQ's PerfTest `--confirm` does); a
//! consumer acks each delivery on its own (`basic.ack`, `multiple` false),
//! the acks of one read sent together. Connections come from a [`Dial`]:
//! TCP to a broker's address, or a byte stream inside the process.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, WriteContext, gen_frame, parse_frame};
use amq_protocol::protocol::{
    AMQPClass, BasicProperties, basic, channel, confirm, connection, queue,
};
use amq_protocol::types::{AMQPValue, FieldTable};
use amq_protocol::uri::AMQPUri;
use anyhow::{Context as _, bail};
use bytes::BytesMut;
use clap::Parser;
use futures::FutureExt as _;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// Load generator settings.
#[derive(Debug, Parser, Clone)]
pub struct Args {
    /// Broker URL.
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    pub url: String,
    /// Publishing connections.
    #[arg(long, default_value_t = 1)]
    pub producers: usize,
    /// Consuming connections.
    #[arg(long, default_value_t = 1)]
    pub consumers: usize,
    /// Message body size in bytes (at least 8: a timestamp).
    #[arg(long, default_value_t = 16)]
    pub size: usize,
    /// Publisher confirms in flight per producer (0 = no confirms).
    #[arg(long, default_value_t = 0)]
    pub confirms: usize,
    /// Persistent messages on a durable queue.
    #[arg(long)]
    pub persistent: bool,
    /// Manual acks (else auto-ack).
    #[arg(long)]
    pub manual_ack: bool,
    /// Consumer prefetch with manual acks.
    #[arg(long, default_value_t = 1000)]
    pub prefetch: u16,
    /// Seconds to run.
    #[arg(long, default_value_t = 10)]
    pub duration: u64,
    /// Queue name.
    #[arg(long, default_value = "warren-bench")]
    pub queue: String,
    /// A durable queue even for transient messages (`--persistent` implies it).
    #[arg(long)]
    pub durable: bool,
    /// Use the queue as it is: neither delete it before nor after the run (for
    /// a queue set up beforehand, e.g. mirrored and synchronised).
    #[arg(long)]
    pub keep_queue: bool,
    /// Seconds to wait, after publishing stopped, for the consumers to drain
    /// the queue (0 = as long as it takes); past it the run ends anyway and
    /// says so.
    #[arg(long, default_value_t = 0)]
    pub drain_timeout: u64,
}

/// The one channel each connection opens.
const CHANNEL: u16 = 1;
/// The largest frame this client asks for.
const FRAME_MAX: u32 = 128 * 1024;
/// Publishes written together when there are no confirms to wait for.
const UNCONFIRMED_BATCH: usize = 64;

/// A byte stream to a broker.
pub trait ByteStream: AsyncRead + AsyncWrite + Unpin + Send {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send> ByteStream for T {}

/// Opens a new connection's byte stream.
pub type Dial = Arc<
    dyn Fn() -> Pin<Box<dyn Future<Output = anyhow::Result<Box<dyn ByteStream>>> + Send>>
        + Send
        + Sync,
>;

/// Dials `args.url` over TCP.
pub fn tcp_dial(args: &Args) -> anyhow::Result<Dial> {
    let uri: AMQPUri = args
        .url
        .parse()
        .map_err(|e| anyhow::anyhow!("bad --url {}: {e}", args.url))?;
    let (host, port) = (uri.authority.host.clone(), uri.authority.port);
    Ok(Arc::new(move || {
        let host = host.clone();
        Box::pin(async move {
            let stream = TcpStream::connect((host.as_str(), port))
                .await
                .with_context(|| format!("connecting to {host}:{port}"))?;
            stream.set_nodelay(true)?;
            anyhow::Ok(Box::new(stream) as Box<dyn ByteStream>)
        })
    }))
}

/// What one run measured.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Publishes confirmed (or written, without confirms) per second,
    /// after the warm-up.
    pub published_per_s: f64,
    /// Deliveries per second, after the warm-up.
    pub consumed_per_s: f64,
    /// Publish-to-delivery latency, p50 and p99, in µs.
    pub latency_us: (u64, u64),
    /// Publishes the broker refused.
    pub nacked: u64,
    /// Deliveries over the whole run, warm-up and drain included.
    pub total_consumed: u64,
    /// Whether the consumers were still draining when `--drain-timeout`
    /// passed.
    pub drain_timed_out: bool,
}

/// Runs one load: declares `args.queue`, runs the producers and consumers
/// for a warm-up second and `args.duration`, drains the queue.
pub async fn run(args: Args, dial: Dial) -> anyhow::Result<Report> {
    let size = args.size.max(8);
    let uri: AMQPUri = args
        .url
        .parse()
        .map_err(|e| anyhow::anyhow!("bad --url {}: {e}", args.url))?;
    let connect = || {
        let (dial, uri) = (dial.clone(), uri.clone());
        async move { Client::handshake(dial().await?, &uri).await }
    };
    let mut setup = connect().await.context("connecting")?;
    if !args.keep_queue {
        setup.call(delete_queue(&args.queue)).await?;
    }
    setup
        .call(AMQPClass::Queue(queue::AMQPMethod::Declare(
            queue::Declare {
                queue: args.queue.as_str().into(),
                durable: args.persistent || args.durable,
                ..Default::default()
            },
        )))
        .await?;

    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let published = Arc::new(AtomicU64::new(0));
    let consumed = Arc::new(AtomicU64::new(0));
    let latencies: Arc<std::sync::Mutex<Vec<u64>>> = Arc::default();

    let mut consumers = Vec::new();
    for _ in 0..args.consumers {
        let client = connect().await?;
        let counters = Counters {
            stop: stop.clone(),
            consumed: consumed.clone(),
            latencies: latencies.clone(),
        };
        consumers.push(tokio::spawn(consume(client, args.clone(), start, counters)));
    }
    let mut producers = Vec::new();
    for _ in 0..args.producers {
        let client = connect().await?;
        let (args, stop, published) = (args.clone(), stop.clone(), published.clone());
        producers.push(tokio::spawn(produce(
            client, args, size, start, stop, published,
        )));
    }

    // Warm up for a second, then measure.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (p0, c0, t0) = (
        published.load(Ordering::Relaxed),
        consumed.load(Ordering::Relaxed),
        Instant::now(),
    );
    tokio::time::sleep(Duration::from_secs(args.duration)).await;
    let (p1, c1, secs) = (
        published.load(Ordering::Relaxed),
        consumed.load(Ordering::Relaxed),
        t0.elapsed().as_secs_f64(),
    );
    stop.store(true, Ordering::Relaxed);
    let mut nacked = 0;
    for p in producers {
        nacked += p.await??;
    }
    // An empty body ends each consumer's run.
    let (end, _) = publish_template(setup.frame_max, &args.queue, &BasicProperties::default(), 0)?;
    for _ in 0..args.consumers {
        setup.out.extend_from_slice(&end);
    }
    setup.flush().await?;
    let drain = async {
        for c in consumers {
            c.await??;
        }
        anyhow::Ok(())
    };
    let mut drain_timed_out = false;
    if args.drain_timeout == 0 {
        drain.await?;
    } else if let Ok(r) = tokio::time::timeout(Duration::from_secs(args.drain_timeout), drain).await
    {
        r?;
    } else {
        drain_timed_out = true;
    }
    // What the consumers measured, also those the drain timeout left behind.
    let mut lat = latencies.lock().map(|l| l.clone()).unwrap_or_default();
    lat.sort_unstable();
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    let report = Report {
        published_per_s: (p1 - p0) as f64 / secs,
        consumed_per_s: (c1 - c0) as f64 / secs,
        latency_us: (pct(0.50), pct(0.99)),
        nacked,
        total_consumed: consumed.load(Ordering::Relaxed),
        drain_timed_out,
    };
    if !args.keep_queue {
        setup.call(delete_queue(&args.queue)).await?;
    }
    setup.close().await?;
    Ok(report)
}

/// `queue.delete` of `queue` (deleting a missing queue is not an error).
fn delete_queue(queue: &str) -> AMQPClass {
    AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
        queue: queue.into(),
        ..Default::default()
    }))
}

/// One producer connection: publishes until `stop`, keeping `--confirms`
/// unconfirmed (or writing batches without confirms); returns how many
/// publishes were nacked.
async fn produce(
    mut client: Client,
    args: Args,
    size: usize,
    start: Instant,
    stop: Arc<AtomicBool>,
    published: Arc<AtomicU64>,
) -> anyhow::Result<u64> {
    let props = if args.persistent {
        BasicProperties::default().with_delivery_mode(2)
    } else {
        BasicProperties::default()
    };
    let (template, stamp_at) = publish_template(client.frame_max, &args.queue, &props, size)?;
    let publish = |out: &mut Vec<u8>| {
        let at = out.len() + stamp_at;
        out.extend_from_slice(&template);
        let now = start.elapsed().as_micros() as u64;
        out[at..at + 8].copy_from_slice(&now.to_be_bytes());
    };
    if args.confirms == 0 {
        while !stop.load(Ordering::Relaxed) {
            for _ in 0..UNCONFIRMED_BATCH {
                publish(&mut client.out);
            }
            client.flush().await?;
            published.fetch_add(UNCONFIRMED_BATCH as u64, Ordering::Relaxed);
            // Nothing is expected back; a close would be.
            client.read_ready()?;
            while let Some((_, frame)) = client.next_frame()? {
                refuse_close(&frame)?;
            }
        }
        client.close().await?;
        return Ok(0);
    }
    client
        .call(AMQPClass::Confirm(confirm::AMQPMethod::Select(
            confirm::Select::default(),
        )))
        .await?;
    let mut window = Unconfirmed::new();
    let mut nacked = 0;
    loop {
        let stopping = stop.load(Ordering::Relaxed);
        if stopping && window.is_empty() {
            break;
        }
        if !stopping {
            while window.len() < args.confirms {
                publish(&mut client.out);
                window.push();
            }
            client.flush().await?;
        }
        client.read_more().await?;
        while let Some((_, frame)) = client.next_frame()? {
            refuse_close(&frame)?;
            match frame {
                AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Ack(a))) => {
                    let n = window.settle(a.delivery_tag, a.multiple);
                    published.fetch_add(n, Ordering::Relaxed);
                }
                AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Nack(n))) => {
                    nacked += window.settle(n.delivery_tag, n.multiple);
                }
                _ => {}
            }
        }
    }
    client.close().await?;
    Ok(nacked)
}

/// What a consumer shares with `main`.
struct Counters {
    stop: Arc<AtomicBool>,
    consumed: Arc<AtomicU64>,
    /// Publish-to-delivery latencies (µs) seen before `stop`, added once a read.
    latencies: Arc<std::sync::Mutex<Vec<u64>>>,
}

/// A delivery whose body is still arriving.
struct Delivery {
    tag: u64,
    size: u64,
    received: u64,
    /// The publisher's timestamp, from the body's first 8 bytes.
    sent_us: u64,
}

/// One consumer connection: consumes until an empty body arrives.
async fn consume(
    mut client: Client,
    args: Args,
    start: Instant,
    counters: Counters,
) -> anyhow::Result<()> {
    if args.manual_ack {
        client
            .call(AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
                prefetch_count: args.prefetch,
                global: false,
            })))
            .await?;
    }
    client
        .call(AMQPClass::Basic(basic::AMQPMethod::Consume(
            basic::Consume {
                queue: args.queue.as_str().into(),
                no_ack: !args.manual_ack,
                ..Default::default()
            },
        )))
        .await?;
    let mut latencies = Vec::new();
    let mut current: Option<Delivery> = None;
    let mut done = false;
    while !done {
        client.read_more().await?;
        while let Some((_, frame)) = client.next_frame()? {
            refuse_close(&frame)?;
            match frame {
                AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Deliver(d))) => {
                    current = Some(Delivery {
                        tag: d.delivery_tag,
                        size: 0,
                        received: 0,
                        sent_us: 0,
                    });
                }
                AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Cancel(_))) => {
                    bail!("the broker cancelled the consumer");
                }
                AMQPFrame::Header(_, header) => {
                    if header.body_size == 0 {
                        done = true;
                    } else if let Some(d) = current.as_mut() {
                        d.size = header.body_size;
                    }
                }
                AMQPFrame::Body(_, body) => {
                    let Some(d) = current.as_mut() else { continue };
                    if d.received == 0 && body.len() >= 8 {
                        d.sent_us = u64::from_be_bytes(body[..8].try_into().unwrap_or([0; 8]));
                    }
                    d.received += body.len() as u64;
                    if d.received < d.size {
                        continue;
                    }
                    let (tag, sent_us) = (d.tag, d.sent_us);
                    current = None;
                    if !counters.stop.load(Ordering::Relaxed) {
                        let now = start.elapsed().as_micros() as u64;
                        latencies.push(now.saturating_sub(sent_us));
                    }
                    counters.consumed.fetch_add(1, Ordering::Relaxed);
                    if args.manual_ack {
                        client.method(AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                            delivery_tag: tag,
                            multiple: false,
                        })))?;
                    }
                }
                _ => {}
            }
        }
        client.flush().await?;
        if !latencies.is_empty()
            && let Ok(mut all) = counters.latencies.lock()
        {
            all.append(&mut latencies);
        }
    }
    client.close().await
}

/// A publish on [`CHANNEL`] to the default exchange (method, header and body
/// frames of a `size`-byte body), and where in it the body's first 8 bytes
/// (the timestamp) are.
fn publish_template(
    frame_max: u32,
    queue: &str,
    props: &BasicProperties,
    size: usize,
) -> anyhow::Result<(Vec<u8>, usize)> {
    let mut out = Vec::new();
    encode(
        &mut out,
        &AMQPFrame::Method(
            CHANNEL,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: "".into(),
                routing_key: queue.into(),
                ..Default::default()
            })),
        ),
    )?;
    encode(
        &mut out,
        &AMQPFrame::Header(
            CHANNEL,
            AMQPContentHeader {
                class_id: 60,
                body_size: size as u64,
                properties: props.clone(),
            },
        ),
    )?;
    let stamp_at = out.len() + 7;
    let body = vec![0u8; size];
    for piece in body.chunks((frame_max as usize - 8).max(8)) {
        encode(&mut out, &AMQPFrame::Body(CHANNEL, piece.to_vec()))?;
    }
    Ok((out, stamp_at))
}

/// Appends `frame`, encoded by `amq-protocol`, to `out`.
fn encode(out: &mut Vec<u8>, frame: &AMQPFrame) -> anyhow::Result<()> {
    let at = out.len();
    match gen_frame(frame)(WriteContext::from(std::mem::take(out))) {
        Ok(ctx) => {
            *out = ctx.into_inner().0;
            Ok(())
        }
        Err(e) => {
            out.truncate(at);
            bail!("amq-protocol cannot encode {frame:?}: {e}")
        }
    }
}

/// Fails on a `connection.close` or `channel.close` from the broker, naming
/// its reply code and text.
fn refuse_close(frame: &AMQPFrame) -> anyhow::Result<()> {
    match frame {
        AMQPFrame::Method(_, AMQPClass::Connection(connection::AMQPMethod::Close(c))) => bail!(
            "the broker closed the connection: {} {}",
            c.reply_code,
            c.reply_text
        ),
        AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::Close(c))) => bail!(
            "the broker closed the channel: {} {}",
            c.reply_code,
            c.reply_text
        ),
        _ => Ok(()),
    }
}

/// A producer's unconfirmed publishes, by delivery tag (1, 2, … in publish
/// order): the oldest's tag and, from it on, whether each is settled.
struct Unconfirmed {
    oldest: u64,
    settled: VecDeque<bool>,
}

impl Unconfirmed {
    /// None yet; the first publish after `confirm.select` is tag 1.
    fn new() -> Self {
        Self {
            oldest: 1,
            settled: VecDeque::new(),
        }
    }

    fn len(&self) -> usize {
        self.settled.len()
    }

    fn is_empty(&self) -> bool {
        self.settled.is_empty()
    }

    fn push(&mut self) {
        self.settled.push_back(false);
    }

    /// Settles `tag` (and, if `multiple`, every tag before it); returns how
    /// many publishes that settled.
    fn settle(&mut self, tag: u64, multiple: bool) -> u64 {
        let Some(last) = tag.checked_sub(self.oldest) else {
            return 0;
        };
        let first = if multiple { 0 } else { last };
        let mut n = 0;
        for i in first..=last {
            if let Some(s) = self.settled.get_mut(i as usize)
                && !*s
            {
                *s = true;
                n += 1;
            }
        }
        while self.settled.front() == Some(&true) {
            self.settled.pop_front();
            self.oldest += 1;
        }
        n
    }
}

/// One AMQP connection with channel [`CHANNEL`] open.
struct Client {
    stream: Box<dyn ByteStream>,
    input: BytesMut,
    out: Vec<u8>,
    frame_max: u32,
}

impl Client {
    /// Logs in over `stream` with PLAIN as `uri` says, and opens its vhost
    /// and the channel.
    async fn handshake(stream: Box<dyn ByteStream>, uri: &AMQPUri) -> anyhow::Result<Self> {
        let auth = &uri.authority;
        let mut c = Self {
            stream,
            input: BytesMut::with_capacity(128 * 1024),
            out: Vec::with_capacity(128 * 1024),
            frame_max: FRAME_MAX,
        };
        c.out.extend_from_slice(b"AMQP\x00\x00\x09\x01");
        c.flush().await?;
        let AMQPClass::Connection(connection::AMQPMethod::Start(start)) = c.recv_method().await?
        else {
            bail!("the broker did not start the connection");
        };
        if !String::from_utf8_lossy(start.mechanisms.as_bytes()).contains("PLAIN") {
            bail!("the broker does not offer PLAIN login");
        }
        let mut capabilities = FieldTable::default();
        for cap in ["publisher_confirms", "basic.nack", "consumer_cancel_notify"] {
            capabilities.insert(cap.into(), AMQPValue::Boolean(true));
        }
        let mut properties = FieldTable::default();
        properties.insert("product".into(), AMQPValue::LongString("amqp_bench".into()));
        properties.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
        let user = &auth.userinfo;
        let response = format!("\0{}\0{}", user.username, user.password);
        c.method0(AMQPClass::Connection(connection::AMQPMethod::StartOk(
            connection::StartOk {
                client_properties: properties,
                mechanism: "PLAIN".into(),
                response: response.into(),
                locale: "en_US".into(),
            },
        )))?;
        c.flush().await?;
        let AMQPClass::Connection(connection::AMQPMethod::Tune(tune)) = c.recv_method().await?
        else {
            bail!("the broker did not tune the connection (login refused?)");
        };
        if tune.frame_max != 0 {
            c.frame_max = tune.frame_max.min(FRAME_MAX);
        }
        c.method0(AMQPClass::Connection(connection::AMQPMethod::TuneOk(
            connection::TuneOk {
                channel_max: tune.channel_max,
                frame_max: c.frame_max,
                heartbeat: 0,
            },
        )))?;
        c.method0(AMQPClass::Connection(connection::AMQPMethod::Open(
            connection::Open {
                virtual_host: uri.vhost.as_str().into(),
            },
        )))?;
        c.flush().await?;
        c.recv_method().await?;
        c.call(AMQPClass::Channel(channel::AMQPMethod::Open(
            channel::Open {},
        )))
        .await?;
        Ok(c)
    }

    /// Queues a method frame on [`CHANNEL`].
    fn method(&mut self, class: AMQPClass) -> anyhow::Result<()> {
        encode(&mut self.out, &AMQPFrame::Method(CHANNEL, class))
    }

    /// Queues a method frame on channel 0 (the connection's).
    fn method0(&mut self, class: AMQPClass) -> anyhow::Result<()> {
        encode(&mut self.out, &AMQPFrame::Method(0, class))
    }

    /// Writes everything queued, in one syscall where the socket takes it.
    async fn flush(&mut self) -> anyhow::Result<()> {
        if !self.out.is_empty() {
            self.stream
                .write_all(&self.out)
                .await
                .context("writing to the broker")?;
            self.out.clear();
        }
        Ok(())
    }

    /// Waits for bytes from the broker and reads what is there.
    async fn read_more(&mut self) -> anyhow::Result<()> {
        self.input.reserve(64 * 1024);
        let n = self
            .stream
            .read_buf(&mut self.input)
            .await
            .context("reading from the broker")?;
        if n == 0 {
            bail!("the broker closed the connection");
        }
        Ok(())
    }

    /// Reads what the broker has sent, without waiting.
    fn read_ready(&mut self) -> anyhow::Result<()> {
        self.input.reserve(64 * 1024);
        match self.stream.read_buf(&mut self.input).now_or_never() {
            None => Ok(()),
            Some(Ok(0)) => bail!("the broker closed the connection"),
            Some(Ok(_)) => Ok(()),
            Some(Err(e)) => Err(e).context("reading from the broker"),
        }
    }

    /// The next whole frame read, if there is one.
    fn next_frame(&mut self) -> anyhow::Result<Option<(u16, AMQPFrame)>> {
        if self.input.len() < 7 {
            return Ok(None);
        }
        let size = u32::from_be_bytes([self.input[3], self.input[4], self.input[5], self.input[6]]);
        let total = 8 + size as usize;
        if self.input.len() < total {
            return Ok(None);
        }
        let raw = self.input.split_to(total);
        let frame = match parse_frame(&raw[..]) {
            Ok((_, frame)) => frame,
            Err(e) => bail!("the broker sent a frame amq-protocol cannot parse: {e}"),
        };
        let channel = u16::from_be_bytes([raw[1], raw[2]]);
        Ok(Some((channel, frame)))
    }

    /// Waits for the next method frame (other frames are dropped); fails on
    /// a close.
    async fn recv_method(&mut self) -> anyhow::Result<AMQPClass> {
        loop {
            while let Some((_, frame)) = self.next_frame()? {
                refuse_close(&frame)?;
                if let AMQPFrame::Method(_, class) = frame {
                    return Ok(class);
                }
            }
            self.read_more().await?;
        }
    }

    /// Sends a synchronous method on [`CHANNEL`] and waits for its answer.
    async fn call(&mut self, class: AMQPClass) -> anyhow::Result<AMQPClass> {
        self.method(class)?;
        self.flush().await?;
        self.recv_method().await
    }

    /// Closes the connection (`connection.close`, then waits a moment for
    /// `close-ok`).
    async fn close(mut self) -> anyhow::Result<()> {
        self.method0(AMQPClass::Connection(connection::AMQPMethod::Close(
            connection::Close {
                reply_code: 200,
                reply_text: "done".into(),
                class_id: 0,
                method_id: 0,
            },
        )))?;
        self.flush().await?;
        let close_ok = async {
            loop {
                while let Some((_, frame)) = self.next_frame()? {
                    if let AMQPFrame::Method(_, AMQPClass::Connection(_)) = frame {
                        return anyhow::Ok(());
                    }
                }
                self.read_more().await?;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(2), close_ok).await;
        Ok(())
    }
}

/// CPU time (user + system) this process used so far, every thread's; 0
/// where there is no `/proc`.
pub fn own_cpu_seconds() -> f64 {
    cpu_seconds("/proc/self/stat")
}

/// The CPU time (user + system) in a `/proc` `stat` file (a process's, or
/// a thread's: `/proc/thread-self/stat`), in USER_HZ ticks, 100 per second
/// on Linux; 0 if it cannot be read.
pub fn cpu_seconds(stat_path: &str) -> f64 {
    let stat = std::fs::read_to_string(stat_path).unwrap_or_default();
    // utime and stime are fields 14 and 15, 12 and 13 after the name's ')'.
    let fields: Vec<u64> = stat
        .rsplit_once(')')
        .map(|(_, rest)| {
            rest.split_whitespace()
                .map(|f| f.parse().unwrap_or(0))
                .collect()
        })
        .unwrap_or_default();
    (fields.get(11).unwrap_or(&0) + fields.get(12).unwrap_or(&0)) as f64 / 100.0
}
