# Bunny (Ruby's most used AMQP client, Debian's ruby-bunny) driving a broker
# through the features its users lean on. Each scenario prints what the
# client saw, one line per observation, with nothing server-chosen
# (generated names, times) in it, so that the transcript from Warren can be
# compared with RabbitMQ 3.10's (tests/scripted.rs).
# Usage: ruby scenarios.rb AMQP_URI
require "bunny"
require "bigdecimal"
require "logger"

$uri = ARGV.fetch(0)
$current = nil
$stdout.sync = true
P = "rb-" # every name this program makes

def say(line)
  puts "#{$current}: #{line.to_s.gsub(/amq\.gen-[A-Za-z0-9_-]+/, 'amq.gen-*')}"
end

def connect
  Bunny.new($uri, automatically_recover: false, continuation_timeout: 5000,
                  logger: Logger.new(nil)).tap(&:start)
end

# What a client exception says: the close's code and text when it has one.
def describe(e)
  if e.respond_to?(:channel_close) && e.channel_close
    "channel closed #{e.channel_close.reply_code} #{e.channel_close.reply_text}"
  elsif e.respond_to?(:connection_close) && e.connection_close
    "connection closed #{e.connection_close.reply_code} #{e.connection_close.reply_text}"
  else
    "#{e.class} #{e.message}"
  end
end

def scenario(name)
  $current = name
  yield
rescue StandardError => e
  say "failed: #{describe(e)}"
end

def fresh(ch, name, **opts)
  ch.queue_delete(P + name)
  ch.queue(P + name, **opts)
end

# Waits (5 s at most) until the block is true, then 300 ms more, so that
# anything beyond what the rules allow shows too.
def settle
  500.times { break if yield; sleep 0.01 }
  sleep 0.3
end

def until_count(q, n)
  settle { q.message_count >= n }
  q.message_count
end

c = connect

scenario("handshake") do
  say "capabilities #{c.server_capabilities.sort.to_h}"
  say "frame_max #{c.frame_max} channel_max #{c.channel_max} heartbeat #{c.heartbeat}"
  %w[product version platform copyright information cluster_name].each do |k|
    say "server property #{k} present #{c.server_properties.key?(k)}"
  end
end

scenario("headers_and_properties") do
  ch = c.create_channel
  q = fresh(ch, "headers")
  h = { "s" => "str", "i" => 42, "big" => 2**40, "neg" => -7, "f" => 1.5, "t" => true,
        "n" => nil, "d" => BigDecimal("12"), "time" => Time.at(1_600_000_000),
        "a" => [1, "two", [3]], "h" => { "x" => { "y" => 1 } } }
  ch.default_exchange.publish(
    "body", routing_key: q.name, headers: h, content_type: "text/plain",
            content_encoding: "utf-8", persistent: true, priority: 3, correlation_id: "c1",
            reply_to: "r1", expiration: "60000", message_id: "m1", timestamp: 1_600_000_000,
            type: "ty", user_id: "guest", app_id: "app"
  )
  until_count(q, 1)
  di, props, body = q.pop
  say "body #{body} redelivered #{di.redelivered?} exchange '#{di.exchange}' key #{di.routing_key}"
  props.headers.sort.each { |k, v| say "header #{k} #{v.class} #{v.inspect}" }
  %i[content_type content_encoding delivery_mode priority correlation_id reply_to expiration
     message_id timestamp type user_id app_id].each do |k|
    say "property #{k} #{props.send(k).inspect}"
  end
  q.delete
  ch.close
end

scenario("exchanges") do
  ch = c.create_channel
  src = ch.topic(P + "src")
  dst = ch.fanout(P + "dst")
  hx = ch.headers(P + "hx")
  q = fresh(ch, "e2e")
  q2 = fresh(ch, "hq")
  dst.bind(src, routing_key: "a.#")
  q.bind(dst)
  q2.bind(hx, arguments: { "x-match" => "any", "k" => "v", "n" => 1 })
  src.publish("1", routing_key: "a.b.c")
  src.publish("2", routing_key: "b.a")
  hx.publish("3", headers: { "n" => 1 })
  hx.publish("4", headers: { "k" => "w" })
  say "through the exchange binding #{until_count(q, 1)} through headers #{until_count(q2, 1)}"
  dst.unbind(src, routing_key: "a.#")
  src.publish("5", routing_key: "a.b")
  sleep 0.3
  say "after unbind #{q.message_count}"
  begin
    ch.exchange_declare(P + "dst", "direct")
  rescue StandardError => e
    say "redeclared as another type: #{describe(e)}"
  end
  begin
    c.create_channel.exchange(P + "missing", type: :direct, passive: true)
  rescue StandardError => e
    say "passive declare of a missing exchange: #{describe(e)}"
  end
  cleanup = c.create_channel
  [src, dst, hx].each { |x| cleanup.exchange_delete(x.name) }
  [q, q2].each { |x| cleanup.queue_delete(x.name) }
  cleanup.close
end

scenario("confirms_and_returns") do
  ch = c.create_channel
  ch.confirm_select
  q = fresh(ch, "confirms")
  returned = Queue.new
  x = ch.direct(P + "unbound")
  x.on_return do |ri, _props, body|
    returned << "#{ri.reply_code} #{ri.reply_text} #{ri.exchange} #{ri.routing_key} #{body}"
  end
  100.times { |i| ch.default_exchange.publish("m#{i}", routing_key: q.name, persistent: true) }
  x.publish("lost", routing_key: "nowhere", mandatory: true)
  say "all confirmed #{ch.wait_for_confirms} nacked #{ch.nacked_set.size}"
  say "ready #{until_count(q, 100)}"
  settle { !returned.empty? }
  say "returned #{returned.pop}" until returned.empty?
  ch.exchange(P + "missing-x", type: :direct, no_declare: true).publish("z", routing_key: "k")
  settle { !ch.open? }
  say "after a publish to a missing exchange the channel is open: #{ch.open?}"
  c.create_channel.tap { |o| o.queue_delete(q.name) && o.exchange_delete(x.name) }.close
end

scenario("consume") do
  ch = c.create_channel
  ch.prefetch(5)
  q = fresh(ch, "consume")
  20.times { |i| ch.default_exchange.publish("m#{i}", routing_key: q.name) }
  got = Queue.new
  cons = q.subscribe(manual_ack: true, consumer_tag: "rb-tag") do |di, _p, body|
    got << [di.delivery_tag, body, di.consumer_tag, di.redelivered?]
  end
  settle { got.size >= 5 }
  say "before any ack #{got.size} (prefetch 5)"
  first = []
  first << got.pop until got.empty?
  say "bodies #{first.map { |d| d[1] }} consumer tag #{first.first[2]}"
  ch.ack(first.last[0], true)
  settle { got.size >= 5 }
  say "after a multiple ack #{got.size}"
  t, = got.pop
  ch.nack(t, false, true)
  settle { got.size >= 5 }
  seen = []
  seen << got.pop until got.empty?
  say "after a nack with requeue #{seen.size}, redelivered #{seen.map { |d| d[3] }}"
  ch.reject(seen.first[0], false)
  settle { !got.empty? }
  say "after a reject without requeue, room for #{got.size} more"
  cons.cancel
  settle { q.consumer_count.zero? }
  say "after cancel: ready #{q.message_count} consumers #{q.consumer_count}"
  ch.recover(true)
  say "after recover: ready #{until_count(q, 14)}"
  q.delete
  ch.close
end

scenario("cancel_notification") do
  ch = c.create_channel
  q = fresh(ch, "cancelled")
  cancelled = Queue.new
  cons = Bunny::Consumer.new(ch, q, "rb-cancel-tag", false)
  cons.on_delivery { |*_| nil }
  cons.on_cancellation { |bc| cancelled << bc.consumer_tag }
  q.subscribe_with(cons)
  c.create_channel.tap { |o| o.queue_delete(q.name) }.close
  settle { !cancelled.empty? }
  say "cancelled #{cancelled.size} tag #{cancelled.empty? ? '-' : cancelled.pop}"
  say "channel open #{ch.open?}"
  ch.close
end

scenario("channel_errors") do
  eq = ->(ch) { ch.queue(P + "eq", durable: false) }
  tries = {
    "passive declare of a missing queue" => ->(ch) { ch.queue(P + "none", passive: true) },
    "redeclared durable" => ->(ch) { eq.call(ch); ch.queue(P + "eq", durable: true) },
    "amq. prefix" => ->(ch) { ch.queue("amq.rb") },
    "x-priority a string" => lambda { |ch|
      eq.call(ch).subscribe(arguments: { "x-priority" => "high" }) { nil }
      eq.call(ch)
    },
    "exclusive consumer taken" => lambda { |ch|
      eq.call(ch).subscribe(exclusive: true) { nil }
      eq.call(ch.connection.create_channel).subscribe { nil }
    },
    "global qos" => ->(ch) { ch.basic_qos(10, true); eq.call(ch) },
    "bind to a missing exchange" => ->(ch) { eq.call(ch).bind(P + "nox") },
    "delete if empty" => lambda { |ch|
      q = eq.call(ch)
      ch.default_exchange.publish("x", routing_key: q.name)
      until_count(q, 1)
      q.delete(if_empty: true)
    },
    "x-max-length a string" => ->(ch) { ch.queue(P + "badarg", arguments: { "x-max-length" => "ten" }) },
    "x-message-ttl negative" => ->(ch) { ch.queue(P + "badttl", arguments: { "x-message-ttl" => -1 }) },
  }
  tries.each do |name, act|
    ch = c.create_channel
    begin
      act.call(ch)
      say "#{name}: ok"
    rescue StandardError => e
      say "#{name}: #{describe(e)}"
    end
    ch.close if ch.open?
  end
  ch = c.create_channel
  ch.basic_ack(999, false)
  settle { !ch.open? }
  say "ack of an unknown tag: the channel is open #{ch.open?}"
  say "connection open #{c.open?}"
  c.create_channel.tap { |o| o.queue_delete(P + "eq") }.close
end

scenario("transactions") do
  ch = c.create_channel
  q = fresh(ch, "tx")
  ch.tx_select
  ch.default_exchange.publish("a", routing_key: q.name)
  ch.tx_rollback
  ch.default_exchange.publish("b", routing_key: q.name)
  ch.tx_commit
  say "after commit: ready #{until_count(q, 1)}"
  di, = q.pop(manual_ack: true)
  ch.ack(di.delivery_tag)
  ch.tx_rollback
  say "the ack rolled back: ready #{q.message_count}"
  q.delete
  ch.close
end

scenario("dead_letters") do
  ch = c.create_channel
  dlx = ch.fanout(P + "dlx")
  dead = fresh(ch, "dead")
  dead.bind(dlx)
  q = fresh(ch, "live", arguments: { "x-dead-letter-exchange" => P + "dlx",
                                     "x-message-ttl" => 100, "x-max-length" => 2 })
  3.times { |i| ch.default_exchange.publish("d#{i}", routing_key: q.name) }
  n = until_count(dead, 3)
  say "dead #{n}"
  n.times do
    _, props, body = dead.pop
    xd = props.headers["x-death"]
    firsts = props.headers.select { |k, _| k.start_with?("x-first", "x-last") }.sort.to_h
    say "#{body} x-death #{xd.map { |d| d.except('time').sort.to_h }} time a #{xd.first['time'].class}"
    say "#{body} #{firsts}"
  end
  q.delete
  dead.delete
  dlx.delete
  ch.close
end

scenario("server_named_and_exclusive") do
  ch = c.create_channel
  q = ch.queue("", exclusive: true)
  say "server-named: #{q.name[0, 8]}, #{q.name.size} characters"
  other = connect
  begin
    other.create_channel.queue(q.name, passive: true)
    say "passive declare from another connection: ok"
  rescue StandardError => e
    say "passive declare from another connection: #{describe(e)}"
  end
  other.close
  ch.close
end

scenario("priorities_and_get") do
  ch = c.create_channel
  q = fresh(ch, "prio", arguments: { "x-max-priority" => 5 })
  [1, 5, 3, 9].each { |p| ch.default_exchange.publish("p#{p}", routing_key: q.name, priority: p) }
  until_count(q, 4)
  order = []
  while (got = q.pop) && got[2]
    order << "#{got[2]}/#{got[1].priority}"
  end
  say "in order #{order}"
  di, _props, body = q.pop
  say "a get from an empty queue: #{di.inspect} #{body.inspect}"
  q.delete
  ch.close
end

scenario("purge_and_delete") do
  ch = c.create_channel
  q = fresh(ch, "purge")
  5.times { ch.default_exchange.publish("x", routing_key: q.name) }
  until_count(q, 5)
  say "purged #{ch.queue_purge(q.name).message_count}"
  3.times { ch.default_exchange.publish("x", routing_key: q.name) }
  until_count(q, 3)
  say "deleted with #{ch.queue_delete(q.name).message_count}"
  say "deleted again with #{ch.queue_delete(q.name).message_count}"
  ch.close
end

c.close
puts "done"
