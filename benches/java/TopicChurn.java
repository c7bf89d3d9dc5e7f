import com.rabbitmq.client.*;
import java.util.concurrent.atomic.AtomicLong;

/**
 * Connection churn beside many bindings (docs/benchmarks.md, "Many queues
 * and bindings"): THREADS threads each connect, declare a server-named
 * exclusive queue, bind it to amq.topic with its own pattern, consume from
 * it and close, over and over, while one publisher sends RATE msg/s of 16 B
 * to amq.topic with keys k.0.x … k.9999.x (the bindings a run of
 * benches/many_queues.py leaves, or none). Prints connections/s.
 *
 *   java -cp .:amqp-client.jar:slf4j-api.jar TopicChurn URL SECONDS THREADS RATE
 */
public class TopicChurn {
    public static void main(String[] a) throws Exception {
        String url = a[0];
        int secs = Integer.parseInt(a[1]), threads = Integer.parseInt(a[2]), rate = Integer.parseInt(a[3]);
        ConnectionFactory f = new ConnectionFactory();
        f.setUri(url);
        AtomicLong churned = new AtomicLong(), published = new AtomicLong();
        long end = System.nanoTime() + secs * 1_000_000_000L;
        Thread pub = new Thread(() -> {
            try (Connection c = f.newConnection()) {
                Channel ch = c.createChannel();
                long t0 = System.nanoTime();
                for (long i = 0; System.nanoTime() < end; i++) {
                    ch.basicPublish("amq.topic", "k." + (i % 10000) + ".x", null, new byte[16]);
                    published.incrementAndGet();
                    long wait = t0 + (i + 1) * 1_000_000_000L / rate - System.nanoTime();
                    if (wait > 0) Thread.sleep(wait / 1_000_000, (int) (wait % 1_000_000));
                }
            } catch (Exception e) {
                e.printStackTrace();
            }
        });
        pub.start();
        Thread[] ts = new Thread[threads];
        for (int k = 0; k < threads; k++) {
            ts[k] = new Thread(() -> {
                while (System.nanoTime() < end) {
                    try (Connection c = f.newConnection()) {
                        Channel ch = c.createChannel();
                        String q = ch.queueDeclare().getQueue();
                        ch.queueBind(q, "amq.topic", "c." + q + ".#");
                        ch.basicConsume(q, true, (tag, d) -> {}, tag -> {});
                        churned.incrementAndGet();
                    } catch (Exception e) {
                        e.printStackTrace();
                        return;
                    }
                }
            });
            ts[k].start();
        }
        for (Thread t : ts) t.join();
        pub.join();
        System.out.printf("connections/s=%.1f published/s=%.1f%n", churned.get() / (double) secs, published.get() / (double) secs);
    }
}
