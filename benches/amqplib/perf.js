// A PerfTest-like load on amqplib, Node.js's standard AMQP 0-9-1 client, for
// the benches' amqplib rows: each publish and each basic.ack is its own call,
// as applications make them. The same flags and result line as
// `crates/node/examples/lapin_perf.rs`:
//
//   node benches/amqplib/perf.js --url amqp://guest:guest@127.0.0.1:5672/%2f \
//       --size 1024 --persistent --confirms 100 --prefetch 200 --duration 15
//
// prints `result secs=… published=… confirmed=… consumed=… e2e_p50_ms=…
// e2e_p99_ms=… confirm_p50_ms=… confirm_p99_ms=… consumed_total=… backlog=…`.
// `cargo xtask bench amqp` and `bench mirrored` install amqplib from npm
// into target/bench-amqplib and run this with NODE_PATH pointing there.
'use strict';

const amqp = require('amqplib');

function parseArgs(argv) {
  const a = {
    url: ['amqp://guest:guest@127.0.0.1:5672/%2f'],
    consumeUrl: [],
    queue: 'perf',
    transientQueue: false,
    keepQueue: false,
    producers: 1,
    consumers: 1,
    size: 16,
    persistent: false,
    confirms: 0,
    autoAck: false,
    prefetch: 0,
    rate: 0,
    duration: 15,
  };
  const list = (v) => v.split(',').filter((s) => s.length > 0);
  for (let i = 2; i < argv.length; i++) {
    const k = argv[i];
    const v = () => {
      i += 1;
      if (i >= argv.length) throw new Error(`${k} needs a value`);
      return argv[i];
    };
    switch (k) {
      case '--url': a.url = list(v()); break;
      case '--consume-url': a.consumeUrl = list(v()); break;
      case '--queue': a.queue = v(); break;
      case '--transient-queue': a.transientQueue = true; break;
      case '--keep-queue': a.keepQueue = true; break;
      case '--producers': a.producers = Number(v()); break;
      case '--consumers': a.consumers = Number(v()); break;
      case '--size': a.size = Number(v()); break;
      case '--persistent': a.persistent = true; break;
      case '--confirms': a.confirms = Number(v()); break;
      case '--auto-ack': a.autoAck = true; break;
      case '--prefetch': a.prefetch = Number(v()); break;
      case '--rate': a.rate = Number(v()); break;
      case '--duration': a.duration = Number(v()); break;
      default: throw new Error(`unknown flag ${k}`);
    }
  }
  if (a.consumeUrl.length === 0) a.consumeUrl = a.url;
  return a;
}

const args = parseArgs(process.argv);
const stats = { published: 0, confirmed: 0, consumed: 0, e2eUs: [], confirmUs: [] };
let stop = false;

function nowUs() {
  // Wall-clock microseconds, comparable across the processes of one host.
  return Math.round((performance.timeOrigin + performance.now()) * 1000);
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function producer(url) {
  const conn = await amqp.connect(url);
  const ch = args.confirms > 0 ? await conn.createConfirmChannel() : await conn.createChannel();
  const body = Buffer.alloc(Math.max(args.size, 8));
  const opts = { persistent: args.persistent };
  let inFlight = 0;
  let wake = null;
  const started = Date.now();
  let sent = 0;
  while (!stop) {
    if (args.rate > 0) {
      const due = started + (sent * 1000) / args.rate;
      const wait = due - Date.now();
      if (wait > 0) await sleep(wait);
    }
    if (args.confirms > 0) {
      while (inFlight >= args.confirms && !stop) {
        await new Promise((r) => { wake = r; });
      }
      if (stop) break;
    }
    const t = nowUs();
    body.writeBigUInt64BE(BigInt(t), 0);
    let ok;
    if (args.confirms > 0) {
      inFlight += 1;
      ok = ch.sendToQueue(args.queue, body, opts, (err) => {
        inFlight -= 1;
        if (!err) {
          stats.confirmed += 1;
          stats.confirmUs.push(nowUs() - t);
        }
        if (wake) { const w = wake; wake = null; w(); }
      });
    } else {
      ok = ch.sendToQueue(args.queue, body, opts);
    }
    sent += 1;
    stats.published += 1;
    if (!ok) {
      // The socket's buffer is full: wait for it to drain, as amqplib asks.
      await new Promise((r) => ch.once('drain', r));
    } else if (sent % 64 === 0) {
      // Let the event loop read confirms and deliveries.
      await new Promise((r) => setImmediate(r));
    }
  }
  if (wake) wake();
  const deadline = Date.now() + 5000;
  while (args.confirms > 0 && inFlight > 0 && Date.now() < deadline) await sleep(10);
  await conn.close().catch(() => {});
}

async function consumer(url) {
  const conn = await amqp.connect(url);
  const ch = await conn.createChannel();
  if (args.prefetch > 0) await ch.prefetch(args.prefetch);
  await ch.consume(args.queue, (msg) => {
    if (msg === null) return;
    if (msg.content.length >= 8) {
      stats.e2eUs.push(nowUs() - Number(msg.content.readBigUInt64BE(0)));
    }
    stats.consumed += 1;
    if (!args.autoAck) ch.ack(msg);
  }, { noAck: args.autoAck });
  while (!stop) await sleep(100);
  await conn.close().catch(() => {});
}

function percentile(v, p) {
  if (v.length === 0) return NaN;
  v.sort((x, y) => x - y);
  return v[Math.round((v.length - 1) * p)] / 1000;
}

async function main() {
  const setup = await amqp.connect(args.url[0]);
  const sch = await setup.createChannel();
  await sch.assertQueue(args.queue, { durable: !args.transientQueue });
  if (!args.keepQueue) await sch.purgeQueue(args.queue);
  const tasks = [];
  for (let i = 0; i < args.consumers; i++) {
    tasks.push(consumer(args.consumeUrl[i % args.consumeUrl.length]));
  }
  for (let i = 0; i < args.producers; i++) {
    tasks.push(producer(args.url[i % args.url.length]));
  }
  const started = Date.now();
  await sleep(args.duration * 1000);
  const counts = [stats.published, stats.confirmed, stats.consumed];
  const secs = (Date.now() - started) / 1000;
  stop = true;
  const results = await Promise.race([
    Promise.allSettled(tasks),
    sleep(10000).then(() => []),
  ]);
  for (const r of results) {
    if (r.status === 'rejected') console.error(`task failed: ${r.reason}`);
  }
  if (!args.keepQueue) await sch.deleteQueue(args.queue).catch(() => {});
  await setup.close().catch(() => {});
  const f = (x) => x.toFixed(2);
  console.log(
    `result secs=${secs.toFixed(1)} published=${(counts[0] / secs).toFixed(0)}` +
    ` confirmed=${(counts[1] / secs).toFixed(0)} consumed=${(counts[2] / secs).toFixed(0)}` +
    ` e2e_p50_ms=${f(percentile(stats.e2eUs, 0.5))} e2e_p99_ms=${f(percentile(stats.e2eUs, 0.99))}` +
    ` confirm_p50_ms=${f(percentile(stats.confirmUs, 0.5))} confirm_p99_ms=${f(percentile(stats.confirmUs, 0.99))}` +
    ` consumed_total=${counts[2]} backlog=${Math.max(0, counts[0] - counts[2])}`,
  );
  process.exit(0);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
