// A PerfTest-like load on RabbitMQ's own Java client (com.rabbitmq:amqp-client,
// Debian's librabbitmq-client-java; the client PerfTest is built on), for the
// benches' java rows: each publish and each basic.ack is its own call, as
// applications make them. The same flags and result line as
// `crates/node/examples/lapin_perf.rs` and `benches/amqplib/perf.js`:
//
//   java -cp DIR:/usr/share/java/amqp-client.jar:/usr/share/java/slf4j-api.jar JavaPerf \
//       --url amqp://guest:guest@127.0.0.1:5672/%2f \
//       --size 1024 --persistent --confirms 100 --prefetch 200 --duration 15
//
// `--multi-ack N` (Java only; PerfTest's --multi-ack-every) acks with
// `multiple` once every N deliveries instead of each. The run
// prints `result secs=… published=… confirmed=… consumed=… e2e_p50_ms=…
// e2e_p99_ms=… confirm_p50_ms=… confirm_p99_ms=… consumed_total=… backlog=…`.
// `cargo xtask bench amqp` and `bench mirrored` compile it into
// target/bench-java and run it there.
import com.rabbitmq.client.*;
import java.nio.ByteBuffer;
import java.time.Instant;
import java.time.temporal.ChronoUnit;
import java.util.*;
import java.util.concurrent.*;
import java.util.concurrent.atomic.AtomicLong;

public class JavaPerf {
  static List<String> urls = List.of("amqp://guest:guest@127.0.0.1:5672/%2f");
  static List<String> consumeUrls = List.of();
  static String queue = "perf";
  static boolean transientQueue, keepQueue, persistent, autoAck;
  static int producers = 1, consumers = 1, size = 16, confirms, prefetch, multiAck;
  static double rate, duration = 15;

  static final AtomicLong published = new AtomicLong();
  static final AtomicLong confirmed = new AtomicLong();
  static final AtomicLong consumed = new AtomicLong();
  static final List<Samples> e2eUs = Collections.synchronizedList(new ArrayList<>());
  static final List<Samples> confirmUs = Collections.synchronizedList(new ArrayList<>());
  static volatile boolean stop;

  /** A growable list of latencies (µs), one per producer or consumer. */
  static final class Samples {
    long[] v = new long[1 << 16];
    int n;

    synchronized void add(long x) {
      if (n == v.length) v = Arrays.copyOf(v, n * 2);
      v[n++] = x;
    }

    synchronized long[] taken() {
      return Arrays.copyOf(v, n);
    }
  }

  /** Wall-clock microseconds, comparable across the processes of one host. */
  static long nowUs() {
    return ChronoUnit.MICROS.between(Instant.EPOCH, Instant.now());
  }

  static void parse(String[] argv) {
    for (int i = 0; i < argv.length; i++) {
      String k = argv[i];
      String val = i + 1 < argv.length ? argv[i + 1] : null;
      switch (k) {
        case "--transient-queue": transientQueue = true; continue;
        case "--keep-queue": keepQueue = true; continue;
        case "--persistent": persistent = true; continue;
        case "--auto-ack": autoAck = true; continue;
        default: break;
      }
      if (val == null) throw new IllegalArgumentException(k + " needs a value");
      i++;
      switch (k) {
        case "--url": urls = list(val); break;
        case "--consume-url": consumeUrls = list(val); break;
        case "--queue": queue = val; break;
        case "--producers": producers = Integer.parseInt(val); break;
        case "--consumers": consumers = Integer.parseInt(val); break;
        case "--size": size = Integer.parseInt(val); break;
        case "--confirms": confirms = Integer.parseInt(val); break;
        case "--prefetch": prefetch = Integer.parseInt(val); break;
        case "--multi-ack": multiAck = Integer.parseInt(val); break;
        case "--rate": rate = Double.parseDouble(val); break;
        case "--duration": duration = Double.parseDouble(val); break;
        default: throw new IllegalArgumentException("unknown flag " + k);
      }
    }
    if (consumeUrls.isEmpty()) consumeUrls = urls;
  }

  static List<String> list(String v) {
    List<String> out = new ArrayList<>();
    for (String s : v.split(",")) if (!s.isEmpty()) out.add(s);
    return out;
  }

  static Connection connect(String url, String name) throws Exception {
    ConnectionFactory f = new ConnectionFactory();
    f.setUri(url);
    f.setAutomaticRecoveryEnabled(false);
    return f.newConnection(name);
  }

  static void producer(String url) throws Exception {
    Connection conn = connect(url, "perf-producer");
    Channel ch = conn.createChannel();
    Semaphore window = new Semaphore(confirms > 0 ? confirms : 1);
    ConcurrentSkipListMap<Long, Long> sentAt = new ConcurrentSkipListMap<>();
    Samples latencies = new Samples();
    confirmUs.add(latencies);
    if (confirms > 0) {
      ch.confirmSelect();
      ch.addConfirmListener(
          new ConfirmListener() {
            void settle(long tag, boolean multiple, boolean ack) {
              long now = nowUs();
              Map<Long, Long> done = multiple ? sentAt.headMap(tag, true) : null;
              List<Long> times = new ArrayList<>();
              if (done != null) {
                times.addAll(done.values());
                done.clear();
              } else {
                Long t = sentAt.remove(tag);
                if (t != null) times.add(t);
              }
              if (ack) {
                for (long t : times) latencies.add(now - t);
                confirmed.addAndGet(times.size());
              }
              window.release(times.size());
            }

            public void handleAck(long tag, boolean multiple) {
              settle(tag, multiple, true);
            }

            public void handleNack(long tag, boolean multiple) {
              settle(tag, multiple, false);
            }
          });
    }
    AMQP.BasicProperties props = persistent ? MessageProperties.PERSISTENT_BASIC : MessageProperties.BASIC;
    byte[] body = new byte[Math.max(size, 8)];
    long started = System.nanoTime();
    long sent = 0;
    while (!stop) {
      if (rate > 0) {
        long due = started + (long) (sent * 1e9 / rate);
        long wait = due - System.nanoTime();
        if (wait > 0) TimeUnit.NANOSECONDS.sleep(wait);
      }
      if (confirms > 0 && !window.tryAcquire(100, TimeUnit.MILLISECONDS)) continue;
      long t = nowUs();
      ByteBuffer.wrap(body).putLong(t);
      if (confirms > 0) sentAt.put(ch.getNextPublishSeqNo(), t);
      ch.basicPublish("", queue, props, body);
      sent++;
      published.incrementAndGet();
    }
    long deadline = System.nanoTime() + 5_000_000_000L;
    while (confirms > 0 && !sentAt.isEmpty() && System.nanoTime() < deadline) Thread.sleep(10);
    conn.close();
  }

  static Connection consumer(String url) throws Exception {
    Connection conn = connect(url, "perf-consumer");
    Channel ch = conn.createChannel();
    if (prefetch > 0) ch.basicQos(prefetch);
    Samples latencies = new Samples();
    e2eUs.add(latencies);
    ch.basicConsume(
        queue,
        autoAck,
        new DefaultConsumer(ch) {
          int unacked;

          @Override
          public void handleDelivery(String tag, Envelope env, AMQP.BasicProperties p, byte[] b)
              throws java.io.IOException {
            if (b.length >= 8) latencies.add(nowUs() - ByteBuffer.wrap(b).getLong());
            consumed.incrementAndGet();
            if (autoAck) return;
            // One ack per delivery, or (PerfTest's --multi-ack-every) one
            // `multiple` ack every `multiAck` deliveries.
            if (multiAck <= 1) ch.basicAck(env.getDeliveryTag(), false);
            else if (++unacked >= multiAck) {
              ch.basicAck(env.getDeliveryTag(), true);
              unacked = 0;
            }
          }
        });
    return conn;
  }

  static double percentile(List<Samples> samples, double p) {
    List<long[]> parts = new ArrayList<>();
    synchronized (samples) {
      for (Samples s : samples) parts.add(s.taken());
    }
    int n = 0;
    for (long[] a : parts) n += a.length;
    if (n == 0) return Double.NaN;
    long[] all = new long[n];
    int at = 0;
    for (long[] a : parts) {
      System.arraycopy(a, 0, all, at, a.length);
      at += a.length;
    }
    Arrays.sort(all);
    return all[(int) Math.round((n - 1) * p)] / 1000.0;
  }

  public static void main(String[] argv) throws Exception {
    parse(argv);
    Connection setup = connect(urls.get(0), "perf-setup");
    Channel sch = setup.createChannel();
    sch.queueDeclare(queue, !transientQueue, false, false, null);
    if (!keepQueue) sch.queuePurge(queue);
    List<Connection> consumerConns = new ArrayList<>();
    for (int i = 0; i < consumers; i++) consumerConns.add(consumer(consumeUrls.get(i % consumeUrls.size())));
    ExecutorService pool = Executors.newFixedThreadPool(Math.max(producers, 1));
    List<Future<?>> tasks = new ArrayList<>();
    for (int i = 0; i < producers; i++) {
      String url = urls.get(i % urls.size());
      tasks.add(
          pool.submit(
              () -> {
                producer(url);
                return null;
              }));
    }
    long started = System.nanoTime();
    Thread.sleep((long) (duration * 1000));
    long[] counts = {published.get(), confirmed.get(), consumed.get()};
    double secs = (System.nanoTime() - started) / 1e9;
    stop = true;
    for (Future<?> t : tasks) {
      try {
        t.get(10, TimeUnit.SECONDS);
      } catch (Exception e) {
        System.err.println("task failed: " + e);
      }
    }
    pool.shutdownNow();
    for (Connection c : consumerConns) c.close();
    if (!keepQueue) sch.queueDelete(queue);
    setup.close();
    System.out.printf(
        Locale.ROOT,
        "result secs=%.1f published=%.0f confirmed=%.0f consumed=%.0f e2e_p50_ms=%.2f e2e_p99_ms=%.2f"
            + " confirm_p50_ms=%.2f confirm_p99_ms=%.2f consumed_total=%d backlog=%d%n",
        secs,
        counts[0] / secs,
        counts[1] / secs,
        counts[2] / secs,
        percentile(e2eUs, 0.5),
        percentile(e2eUs, 0.99),
        percentile(confirmUs, 0.5),
        percentile(confirmUs, 0.99),
        counts[2],
        Math.max(0, counts[0] - counts[2]));
    System.exit(0);
  }
}
