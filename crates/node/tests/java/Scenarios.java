// RabbitMQ's own Java client (com.rabbitmq:amqp-client, Debian's
// librabbitmq-client-java) driving a broker through the features its users
// lean on. Each scenario prints what the client saw, one line per
// observation, with nothing server-chosen (generated names, times) in it, so
// that the transcript from Warren can be compared with RabbitMQ 3.10's
// (tests/java.rs). Usage: java Scenarios AMQP_URI MANAGEMENT_URL [SCENARIO...]
import com.rabbitmq.client.*;
import java.io.IOException;
import java.math.BigDecimal;
import java.net.HttpURLConnection;
import java.net.URL;
import java.net.URLEncoder;
import java.nio.charset.StandardCharsets;
import java.util.*;
import java.util.concurrent.*;

public class Scenarios {
  static String uri;
  static String api;
  static final String P = "java-"; // every name this program makes

  interface Scenario {
    void run() throws Exception;
  }

  public static void main(String[] args) throws Exception {
    uri = args[0];
    api = args[1];
    Set<String> only = new HashSet<>(Arrays.asList(args).subList(2, args.length));
    LinkedHashMap<String, Scenario> all = new LinkedHashMap<>();
    all.put("handshake", Scenarios::handshake);
    all.put("field_types", Scenarios::fieldTypes);
    all.put("confirms", Scenarios::confirms);
    all.put("returns", Scenarios::returns);
    all.put("channel_errors", Scenarios::channelErrors);
    all.put("cancel_notification", Scenarios::cancelNotification);
    all.put("get_and_counts", Scenarios::getAndCounts);
    all.put("transactions", Scenarios::transactions);
    all.put("prefetch", Scenarios::prefetch);
    all.put("nack_requeue", Scenarios::nackRequeue);
    all.put("consumer_priorities", Scenarios::consumerPriorities);
    all.put("rpc", Scenarios::rpc);
    all.put("direct_reply_to", Scenarios::directReplyTo);
    all.put("large_message", Scenarios::largeMessage);
    all.put("exclusive_elsewhere", Scenarios::exclusiveElsewhere);
    all.put("heartbeats", Scenarios::heartbeats);
    all.put("recovery", Scenarios::recovery);
    for (Map.Entry<String, Scenario> e : all.entrySet()) {
      if (!only.isEmpty() && !only.contains(e.getKey())) continue;
      current = e.getKey();
      try {
        e.getValue().run();
      } catch (Exception ex) {
        say("failed: " + describe(ex));
      }
    }
    System.out.flush();
    System.exit(0);
  }

  static String current;

  static synchronized void say(String line) {
    System.out.println(current + ": " + line);
  }

  static Connection connect() throws Exception {
    ConnectionFactory f = new ConnectionFactory();
    f.setUri(uri);
    f.setAutomaticRecoveryEnabled(false);
    return f.newConnection("java-scenarios");
  }

  /** What a client exception says: the close's code and text when it has one. */
  static String describe(Throwable ex) {
    Throwable t = ex;
    while (t != null && !(t instanceof ShutdownSignalException)) t = t.getCause();
    if (t != null) {
      ShutdownSignalException s = (ShutdownSignalException) t;
      Object reason = s.getReason();
      if (reason instanceof AMQP.Channel.Close) {
        AMQP.Channel.Close c = (AMQP.Channel.Close) reason;
        return "channel closed " + c.getReplyCode() + " " + c.getReplyText();
      }
      if (reason instanceof AMQP.Connection.Close) {
        AMQP.Connection.Close c = (AMQP.Connection.Close) reason;
        return "connection closed " + c.getReplyCode() + " " + c.getReplyText();
      }
      return "shutdown " + reason;
    }
    return ex.getClass().getSimpleName() + " " + ex.getMessage();
  }

  static String fresh(Channel ch, String name) throws IOException {
    ch.queueDelete(P + name);
    ch.queueDeclare(P + name, false, false, false, null);
    return P + name;
  }

  static void handshake() throws Exception {
    try (Connection c = connect()) {
      Map<String, Object> props = c.getServerProperties();
      @SuppressWarnings("unchecked")
      Map<String, Object> caps = (Map<String, Object>) props.get("capabilities");
      say("capabilities " + new TreeMap<>(caps));
      say("channel_max " + c.getChannelMax() + " frame_max " + c.getFrameMax() + " heartbeat " + c.getHeartbeat());
      for (String k : new String[] {"product", "version", "platform", "copyright", "information", "cluster_name"})
        say("server property " + k + " present " + props.containsKey(k));
    }
  }

  /**
   * Waits (up to 10 s) until `seen` holds `n` things, then 300 ms more, so
   * that anything beyond what the rules allow shows too.
   */
  static void atLeast(Collection<?> seen, int n) throws InterruptedException {
    for (int i = 0; i < 1000 && seen.size() < n; i++) Thread.sleep(10);
    Thread.sleep(300);
  }

  static String typed(Object v) {
    if (v == null) return "null";
    if (v instanceof byte[]) return "byte[]" + Arrays.toString((byte[]) v);
    if (v instanceof List) {
      StringBuilder b = new StringBuilder("List[");
      for (Object o : (List<?>) v) b.append(typed(o)).append(',');
      return b.append(']').toString();
    }
    if (v instanceof Map) {
      StringBuilder b = new StringBuilder("Map{");
      for (Map.Entry<?, ?> e : new TreeMap<>((Map<?, ?>) v).entrySet())
        b.append(e.getKey()).append('=').append(typed(e.getValue())).append(',');
      return b.append('}').toString();
    }
    if (v instanceof Date) return "Date(" + ((Date) v).getTime() + ")";
    return v.getClass().getSimpleName() + "(" + v + ")";
  }

  static Map<String, Object> everyType() {
    Map<String, Object> h = new HashMap<>();
    h.put("string", "text ü");
    h.put("int", 42);
    h.put("long", 1L << 40);
    h.put("short", (short) -7);
    h.put("byte", (byte) 5);
    h.put("bool", true);
    h.put("double", 2.5d);
    h.put("float", 1.25f);
    h.put("decimal", new BigDecimal("12.345"));
    h.put("date", new Date(1700000000000L));
    h.put("bytes", new byte[] {1, 2, 3});
    h.put("list", Arrays.asList(1, "two", Arrays.asList(3L)));
    Map<String, Object> nested = new HashMap<>();
    nested.put("deeper", Collections.singletonMap("x", 1));
    nested.put("empty", new HashMap<String, Object>());
    h.put("table", nested);
    h.put("void", null);
    return h;
  }

  static void printProps(AMQP.BasicProperties p) {
    say("content_type " + p.getContentType() + " content_encoding " + p.getContentEncoding());
    say("delivery_mode " + p.getDeliveryMode() + " priority " + p.getPriority());
    say("correlation_id " + p.getCorrelationId() + " reply_to " + p.getReplyTo());
    say("expiration " + p.getExpiration() + " message_id " + p.getMessageId());
    say("timestamp " + (p.getTimestamp() == null ? null : p.getTimestamp().getTime()));
    say("type " + p.getType() + " user_id " + p.getUserId() + " app_id " + p.getAppId());
    if (p.getHeaders() != null)
      for (Map.Entry<String, Object> e : new TreeMap<>(p.getHeaders()).entrySet())
        say("header " + e.getKey() + " = " + typed(e.getValue()));
  }

  static void fieldTypes() throws Exception {
    try (Connection c = connect(); Channel ch = c.createChannel()) {
      Map<String, Object> args = new HashMap<>();
      args.put("x-max-priority", 5);
      ch.queueDelete(P + "types");
      ch.queueDeclare(P + "types", true, false, false, args);
      AMQP.BasicProperties props =
          new AMQP.BasicProperties.Builder()
              .contentType("application/json")
              .contentEncoding("gzip")
              .deliveryMode(2)
              .priority(3)
              .correlationId("corr-1")
              .replyTo("somewhere")
              .expiration("600000")
              .messageId("m-1")
              .timestamp(new Date(1700000000000L))
              .type("kind")
              .userId("guest")
              .appId("scenarios")
              .headers(everyType())
              .build();
      ch.basicPublish("", P + "types", props, "body".getBytes(StandardCharsets.UTF_8));
      // The same message through basic.get and through a consumer.
      GetResponse r = ch.basicGet(P + "types", false);
      String gotHeaders = typed(r.getProps().getHeaders());
      say("got " + new String(r.getBody(), StandardCharsets.UTF_8) + " remaining " + r.getMessageCount());
      printProps(r.getProps());
      ch.basicNack(r.getEnvelope().getDeliveryTag(), false, true);
      BlockingQueue<AMQP.BasicProperties> seen = new LinkedBlockingQueue<>();
      ch.basicConsume(
          P + "types",
          true,
          new DefaultConsumer(ch) {
            @Override
            public void handleDelivery(String tag, Envelope env, AMQP.BasicProperties p, byte[] body) {
              say("delivered redelivered " + env.isRedeliver());
              seen.add(p);
            }
          });
      AMQP.BasicProperties p = seen.poll(5, TimeUnit.SECONDS);
      say("same headers through a consumer " + (p != null && typed(p.getHeaders()).equals(gotHeaders)));
      ch.queueDelete(P + "types");
    }
  }

  static void confirms() throws Exception {
    try (Connection c = connect(); Channel ch = c.createChannel()) {
      String q = fresh(ch, "confirms");
      ch.confirmSelect();
      ConcurrentSkipListSet<Long> acked = new ConcurrentSkipListSet<>();
      int[] nacks = {0};
      ch.addConfirmListener(
          new ConfirmListener() {
            public void handleAck(long tag, boolean multiple) {
              if (multiple) for (long t = 1; t <= tag; t++) acked.add(t);
              else acked.add(tag);
            }

            public void handleNack(long tag, boolean multiple) {
              nacks[0]++;
            }
          });
      say("first sequence number " + ch.getNextPublishSeqNo());
      for (int i = 0; i < 500; i++)
        ch.basicPublish("", q, MessageProperties.PERSISTENT_BASIC, ("m" + i).getBytes());
      ch.waitForConfirmsOrDie(10000);
      say("confirmed " + acked.size() + " of 500, nacks " + nacks[0] + ", next " + ch.getNextPublishSeqNo());
      // A publish to a missing exchange in confirm mode: channel error, not a confirm.
      Channel doomed = c.createChannel();
      doomed.confirmSelect();
      try {
        doomed.basicPublish("no-such-exchange", "", null, "x".getBytes());
        doomed.waitForConfirmsOrDie(5000);
        say("missing exchange confirmed");
      } catch (Exception ex) {
        say("missing exchange: " + describe(ex));
      }
      say("messages " + ch.messageCount(q));
      ch.queueDelete(q);
    }
  }

  static void returns() throws Exception {
    try (Connection c = connect(); Channel ch = c.createChannel()) {
      BlockingQueue<String> returned = new LinkedBlockingQueue<>();
      ch.addReturnListener(
          (code, text, exchange, key, props, body) ->
              returned.add(code + " " + text + " exchange=" + exchange + " key=" + key + " body=" + new String(body)));
      ch.confirmSelect();
      ch.basicPublish("amq.direct", "nowhere", true, null, "lost".getBytes());
      ch.waitForConfirmsOrDie(5000);
      say("returned " + returned.poll(5, TimeUnit.SECONDS));
      ch.basicPublish("amq.direct", "nowhere", false, null, "dropped".getBytes());
      ch.waitForConfirmsOrDie(5000);
      say("not mandatory returned " + returned.poll(500, TimeUnit.MILLISECONDS));
    }
  }

  static void channelErrors() throws Exception {
    try (Connection c = connect()) {
      String[] what = {
        "passive queue", "passive exchange", "redeclare other type", "bind to missing", "ack unknown tag",
        "delete amq.direct", "delete amq.missing", "delete default", "declare amq.x", "consume missing",
        "passive reply-to", "declare default", "bind from default", "bind to default", "unbind from default"
      };
      Channel setup = c.createChannel();
      setup.exchangeDeclare(P + "fanout", BuiltinExchangeType.FANOUT, false, true, null);
      setup.queueDeclare(P + "fanout-q", false, false, true, null);
      for (String w : what) {
        Channel ch = c.createChannel();
        try {
          switch (w) {
            case "passive queue":
              ch.queueDeclarePassive(P + "missing");
              break;
            case "passive exchange":
              ch.exchangeDeclarePassive(P + "missing");
              break;
            case "redeclare other type":
              ch.exchangeDeclare(P + "fanout", BuiltinExchangeType.TOPIC, false, true, null);
              break;
            case "bind to missing":
              ch.queueBind(P + "missing", "amq.fanout", "");
              break;
            case "ack unknown tag":
              ch.basicAck(99, false);
              ch.queueDeclarePassive("missing-" + P); // any round trip shows the error
              break;
            case "delete amq.direct":
              ch.exchangeDelete("amq.direct");
              break;
            case "delete amq.missing":
              ch.exchangeDelete("amq.missing");
              break;
            case "delete default":
              ch.exchangeDelete("");
              break;
            case "passive reply-to":
              AMQP.Queue.DeclareOk ok = ch.queueDeclarePassive("amq.rabbitmq.reply-to");
              say(w + ": " + ok.getQueue() + " " + ok.getMessageCount() + " " + ok.getConsumerCount());
              break;
            case "declare default":
              ch.exchangeDeclare("", BuiltinExchangeType.DIRECT);
              break;
            case "bind from default":
              ch.queueBind(P + "fanout-q", "", "k");
              break;
            case "bind to default":
              ch.exchangeBind("", P + "fanout", "k");
              break;
            case "unbind from default":
              ch.queueUnbind(P + "fanout-q", "", "k");
              break;
            case "declare amq.x":
              ch.exchangeDeclare("amq.x", BuiltinExchangeType.DIRECT);
              break;
            case "consume missing":
              ch.basicConsume(P + "missing", new DefaultConsumer(ch));
              break;
          }
          say(w + ": ok");
        } catch (Exception ex) {
          say(w + ": " + describe(ex));
        }
        say(w + ": channel open " + ch.isOpen() + ", connection open " + c.isOpen());
      }
      setup.exchangeDelete(P + "fanout");
      setup.queueDelete(P + "fanout-q");
    }
  }

  static void cancelNotification() throws Exception {
    try (Connection c = connect(); Channel ch = c.createChannel(); Channel other = c.createChannel()) {
      String q = fresh(ch, "cancelled");
      CountDownLatch cancelled = new CountDownLatch(1);
      String tag =
          ch.basicConsume(
              q,
              false,
              "my-tag",
              new DefaultConsumer(ch) {
                @Override
                public void handleCancel(String consumerTag) {
                  say("handleCancel " + consumerTag);
                  cancelled.countDown();
                }
              });
      say("consumer tag " + tag);
      other.queueDelete(q);
      say("cancel seen " + cancelled.await(5, TimeUnit.SECONDS) + ", channel open " + ch.isOpen());
    }
  }

  static void getAndCounts() throws Exception {
    try (Connection c = connect(); Channel ch = c.createChannel()) {
      String q = fresh(ch, "counts");
      say("empty get " + ch.basicGet(q, true));
      ch.confirmSelect();
      for (int i = 0; i < 3; i++) ch.basicPublish("", q, null, ("m" + i).getBytes());
      ch.waitForConfirmsOrDie(5000); // the publishes have landed
      AMQP.Queue.DeclareOk ok = ch.queueDeclarePassive(q);
      say("declare-ok messages " + ok.getMessageCount() + " consumers " + ok.getConsumerCount());
      GetResponse r = ch.basicGet(q, false);
      say("get " + new String(r.getBody()) + " remaining " + r.getMessageCount() + " tag " + r.getEnvelope().getDeliveryTag());
      ch.basicRecover(true);
      r = ch.basicGet(q, true);
      say("after recover " + new String(r.getBody()) + " redelivered " + r.getEnvelope().isRedeliver());
      say("purged " + ch.queuePurge(q).getMessageCount());
      ch.basicPublish("", q, null, "x".getBytes());
      Channel doomed = c.createChannel();
      try {
        doomed.queueDelete(q, false, true);
        say("delete if-empty of a non-empty queue: ok");
      } catch (Exception ex) {
        say("delete if-empty of a non-empty queue: " + describe(ex));
      }
      say("deleted with " + ch.queueDelete(q).getMessageCount());
    }
  }

  static void transactions() throws Exception {
    try (Connection c = connect()) {
      Channel ch = c.createChannel();
      String q = fresh(ch, "tx");
      ch.txSelect();
      ch.basicPublish("", q, null, "rolled back".getBytes());
      ch.txRollback();
      ch.basicPublish("", q, null, "committed".getBytes());
      say("before commit " + ch.messageCount(q));
      ch.txCommit();
      say("after commit " + ch.messageCount(q));
      GetResponse r = ch.basicGet(q, false);
      say("got " + new String(r.getBody()));
      ch.basicAck(r.getEnvelope().getDeliveryTag(), false);
      ch.txRollback();
      say("ack rolled back, messages " + ch.messageCount(q));
      ch.basicRecover(true);
      GetResponse again = ch.basicGet(q, false);
      say("again " + (again == null ? null : new String(again.getBody()) + " redelivered " + again.getEnvelope().isRedeliver()));
      if (again != null) ch.basicAck(again.getEnvelope().getDeliveryTag(), false);
      ch.txCommit();
      say("ack committed, messages " + ch.messageCount(q));
      ch.queueDelete(q);
      try {
        ch.confirmSelect();
        say("confirm.select in tx: ok");
      } catch (Exception ex) {
        say("confirm.select in tx: " + describe(ex));
      }
    }
  }

  static void prefetch() throws Exception {
    try (Connection c = connect(); Channel ch = c.createChannel()) {
      String q = fresh(ch, "prefetch");
      for (int i = 0; i < 5; i++) ch.basicPublish("", q, null, ("m" + i).getBytes());
      ch.basicQos(2);
      BlockingQueue<Long> tags = new LinkedBlockingQueue<>();
      ch.basicConsume(
          q,
          false,
          new DefaultConsumer(ch) {
            @Override
            public void handleDelivery(String t, Envelope env, AMQP.BasicProperties p, byte[] body) {
              tags.add(env.getDeliveryTag());
            }
          });
      atLeast(tags, 2); // prefetch 2
      say("unacked deliveries " + tags.size());
      long last = 0;
      for (Long t : tags) last = t;
      tags.clear();
      ch.basicAck(last, true);
      atLeast(tags, 2);
      say("after a multiple ack " + tags.size());
      while (tags.poll() != null) {}
      ch.basicNack(0, true, false); // everything outstanding, dropped
      atLeast(tags, 1); // the one message left
      say("after nack of all " + tags.size());
      for (Long t : tags) ch.basicAck(t, false);
      Thread.sleep(300);
      say("messages left " + c.createChannel().messageCount(q));
      ch.queueDelete(q);
    }
  }

  static void nackRequeue() throws Exception {
    try (Connection c = connect(); Channel ch = c.createChannel()) {
      String q = fresh(ch, "requeue");
      ch.basicPublish("", q, null, "again".getBytes());
      BlockingQueue<Boolean> redelivered = new LinkedBlockingQueue<>();
      ch.basicConsume(
          q,
          false,
          new DefaultConsumer(ch) {
            @Override
            public void handleDelivery(String t, Envelope env, AMQP.BasicProperties p, byte[] body) throws IOException {
              redelivered.add(env.isRedeliver());
              if (!env.isRedeliver()) ch.basicReject(env.getDeliveryTag(), true);
              else ch.basicAck(env.getDeliveryTag(), false);
            }
          });
      say("first " + redelivered.poll(5, TimeUnit.SECONDS) + " then " + redelivered.poll(5, TimeUnit.SECONDS));
      ch.queueDelete(q);
    }
  }

  static void consumerPriorities() throws Exception {
    try (Connection c = connect(); Channel ch = c.createChannel()) {
      String q = fresh(ch, "priorities");
      ch.basicQos(3);
      List<String> order = Collections.synchronizedList(new ArrayList<>());
      for (int p : new int[] {1, 10, 5}) {
        ch.basicConsume(
            q,
            false,
            "prio-" + p,
            false,
            false,
            Collections.singletonMap("x-priority", p),
            new DefaultConsumer(ch) {
              @Override
              public void handleDelivery(String t, Envelope env, AMQP.BasicProperties pr, byte[] body) {
                order.add(t);
              }
            });
      }
      for (int i = 0; i < 7; i++) ch.basicPublish("", q, null, ("m" + i).getBytes());
      atLeast(order, 7);
      Map<String, Integer> counts = new TreeMap<>();
      for (String t : order) counts.merge(t, 1, Integer::sum);
      say("deliveries by consumer " + counts);
      ch.queueDelete(q);
    }
  }

  static void rpc() throws Exception {
    try (Connection c = connect(); Channel server = c.createChannel(); Channel client = c.createChannel()) {
      String q = fresh(server, "rpc");
      StringRpcServer rpcServer =
          new StringRpcServer(server, q) {
            @Override
            public String handleStringCall(String request) {
              return "reply to " + request;
            }
          };
      Thread t = new Thread(() -> {
        try {
          rpcServer.mainloop();
        } catch (Exception ignored) {
        }
      });
      t.setDaemon(true);
      t.start();
      RpcClient rpc = new RpcClient(client, "", q, 5000);
      say(rpc.stringCall("one"));
      say(rpc.stringCall("two"));
      rpc.close();
      rpcServer.terminateMainloop();
      server.queueDelete(q);
    }
  }

  static void directReplyTo() throws Exception {
    try (Connection c = connect(); Channel server = c.createChannel(); Channel client = c.createChannel()) {
      String q = fresh(server, "direct-rpc");
      String[] address = {null};
      server.basicConsume(
          q,
          true,
          new DefaultConsumer(server) {
            @Override
            public void handleDelivery(String t, Envelope env, AMQP.BasicProperties p, byte[] body) throws IOException {
              say("request reply_to is pseudo-queue " + p.getReplyTo().startsWith("amq.rabbitmq.reply-to."));
              address[0] = p.getReplyTo();
              AMQP.BasicProperties rp = new AMQP.BasicProperties.Builder().correlationId(p.getCorrelationId()).build();
              server.basicPublish("", p.getReplyTo(), rp, ("re: " + new String(body)).getBytes());
            }
          });
      BlockingQueue<String> replies = new LinkedBlockingQueue<>();
      client.basicConsume(
          "amq.rabbitmq.reply-to",
          true,
          new DefaultConsumer(client) {
            @Override
            public void handleDelivery(String t, Envelope env, AMQP.BasicProperties p, byte[] body) {
              replies.add(p.getCorrelationId() + " " + new String(body) + " key-is-pseudo-queue " + env.getRoutingKey().startsWith("amq.rabbitmq.reply-to."));
            }
          });
      for (int i = 1; i <= 3; i++) {
        AMQP.BasicProperties p =
            new AMQP.BasicProperties.Builder().correlationId("c" + i).replyTo("amq.rabbitmq.reply-to").build();
        client.basicPublish("", q, p, ("q" + i).getBytes());
        say("reply " + replies.poll(5, TimeUnit.SECONDS));
      }
      Channel probe = c.createChannel();
      AMQP.Queue.DeclareOk ok = probe.queueDeclarePassive(address[0]);
      say("its address declared: messages " + ok.getMessageCount() + " consumers " + ok.getConsumerCount());
      ok = probe.queueDeclare("amq.rabbitmq.reply-to", false, false, false, null);
      say("pseudo-queue declared: messages " + ok.getMessageCount() + " consumers " + ok.getConsumerCount());
      try {
        probe.queueDeclarePassive("amq.rabbitmq.reply-to.nothing");
        say("a made-up address: declared");
      } catch (Exception ex) {
        say("a made-up address: " + describe(ex));
      }
      try {
        Channel other = c.createChannel();
        other.basicPublish("", q, new AMQP.BasicProperties.Builder().replyTo("amq.rabbitmq.reply-to").build(), "x".getBytes());
        other.basicQos(0);
        say("reply-to without consuming: ok");
      } catch (Exception ex) {
        say("reply-to without consuming: " + describe(ex));
      }
      server.queueDelete(q);
    }
  }

  static void largeMessage() throws Exception {
    try (Connection c = connect(); Channel ch = c.createChannel()) {
      String q = fresh(ch, "large");
      byte[] body = new byte[3 * 1024 * 1024 + 17];
      for (int i = 0; i < body.length; i++) body[i] = (byte) (i * 31 + 7);
      ch.confirmSelect();
      ch.basicPublish("", q, MessageProperties.PERSISTENT_BASIC, body);
      ch.basicPublish("", q, null, new byte[0]);
      ch.waitForConfirmsOrDie(10000);
      GetResponse r = ch.basicGet(q, true);
      say("large body length " + r.getBody().length + " equal " + Arrays.equals(body, r.getBody()));
      r = ch.basicGet(q, true);
      say("empty body length " + r.getBody().length);
      ch.queueDelete(q);
    }
  }

  static void exclusiveElsewhere() throws Exception {
    Connection a = connect();
    try (Connection b = connect()) {
      Channel ca = a.createChannel();
      String named = ca.queueDeclare().getQueue();
      say("server-named prefix amq.gen- " + named.startsWith("amq.gen-"));
      ca.queueDeclare(P + "mine", false, true, false, null);
      Channel cb = b.createChannel();
      try {
        cb.queueDeclarePassive(P + "mine");
        say("passive from another connection: ok");
      } catch (Exception ex) {
        say("passive from another connection: " + describe(ex));
      }
      cb = b.createChannel();
      try {
        cb.basicConsume(P + "mine", new DefaultConsumer(cb));
        say("consume from another connection: ok");
      } catch (Exception ex) {
        say("consume from another connection: " + describe(ex));
      }
      a.close();
      // Deleted with its connection (at once or a little after).
      String outcome = "exists";
      for (int i = 0; i < 100; i++) {
        cb = b.createChannel();
        try {
          cb.queueDeclarePassive(P + "mine");
          cb.close();
          outcome = "exists";
        } catch (Exception ex) {
          outcome = describe(ex);
          if (!outcome.startsWith("channel closed 405")) break; // 405: not deleted yet
        }
        Thread.sleep(100);
      }
      say("after the owner closed: " + outcome);
    }
  }

  static void heartbeats() throws Exception {
    ConnectionFactory f = new ConnectionFactory();
    f.setUri(uri);
    f.setRequestedHeartbeat(1);
    f.setAutomaticRecoveryEnabled(false);
    try (Connection c = f.newConnection()) {
      say("negotiated heartbeat " + c.getHeartbeat());
      Thread.sleep(4000);
      say("open after 4 idle seconds " + c.isOpen());
      Channel ch = c.createChannel();
      say("declare works " + (ch.queueDeclare().getQueue() != null));
    }
  }

  static void recovery() throws Exception {
    ConnectionFactory f = new ConnectionFactory();
    f.setUri(uri);
    f.setAutomaticRecoveryEnabled(true);
    f.setTopologyRecoveryEnabled(true);
    f.setNetworkRecoveryInterval(500);
    String name = "java-recovery-" + System.nanoTime();
    Connection c = f.newConnection(name);
    CountDownLatch recovered = new CountDownLatch(1);
    ((Recoverable) c)
        .addRecoveryListener(
            new RecoveryListener() {
              public void handleRecovery(Recoverable r) {
                recovered.countDown();
              }

              public void handleRecoveryStarted(Recoverable r) {}
            });
    Channel ch = c.createChannel();
    String q = ch.queueDeclare().getQueue();
    ch.exchangeDeclare(P + "recovery", BuiltinExchangeType.DIRECT, false, true, null);
    ch.queueBind(q, P + "recovery", "k");
    BlockingQueue<String> got = new LinkedBlockingQueue<>();
    ch.basicConsume(
        q,
        true,
        new DefaultConsumer(ch) {
          @Override
          public void handleDelivery(String t, Envelope env, AMQP.BasicProperties p, byte[] body) {
            got.add(new String(body));
          }
        });
    ch.basicPublish(P + "recovery", "k", null, "before".getBytes());
    say("before " + got.poll(5, TimeUnit.SECONDS));
    // Closed by the operator, through the management API.
    String conn = null;
    for (int i = 0; i < 50 && conn == null; i++) {
      String list = http("GET", api + "/api/connections");
      int at = list.indexOf("\"" + name + "\"");
      if (at < 0) {
        Thread.sleep(200);
        continue;
      }
      conn = nameOf(list, at);
    }
    say("connection listed " + (conn != null));
    String code = http("DELETE", api + "/api/connections/" + URLEncoder.encode(conn, "UTF-8").replace("+", "%20"));
    say("closed by the operator " + code);
    say("recovered " + recovered.await(15, TimeUnit.SECONDS));
    // The server-named queue comes back under a new name; the binding and the consumer with it.
    ch.basicPublish(P + "recovery", "k", null, "after".getBytes());
    say("after " + got.poll(5, TimeUnit.SECONDS));
    ch.exchangeDelete(P + "recovery");
    c.close();
  }

  /** The "name" of the top-level object of a JSON array that holds index `at`. */
  static String nameOf(String list, int at) {
    int depth = 0, start = -1;
    boolean inString = false;
    for (int i = 0; i < list.length(); i++) {
      char ch = list.charAt(i);
      if (inString) {
        if (ch == '\\') i++;
        else if (ch == '"') inString = false;
      } else if (ch == '"') inString = true;
      else if (ch == '{' && ++depth == 1 && i < at) start = i;
      else if (ch == '}' && --depth == 0 && i > at) {
        String obj = list.substring(start, i);
        int n = obj.indexOf("\"name\":\"");
        return obj.substring(n + 8, obj.indexOf('"', n + 8));
      }
    }
    return null;
  }

  static String http(String method, String url) throws Exception {
    HttpURLConnection h = (HttpURLConnection) new URL(url).openConnection();
    h.setRequestMethod(method);
    String auth = Base64.getEncoder().encodeToString("guest:guest".getBytes());
    h.setRequestProperty("Authorization", "Basic " + auth);
    int code = h.getResponseCode();
    if (method.equals("GET")) return new String(h.getInputStream().readAllBytes(), StandardCharsets.UTF_8);
    return String.valueOf(code);
  }
}
