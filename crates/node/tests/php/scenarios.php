<?php
// php-amqplib (PHP's most used AMQP client, Debian's php-amqplib) driving a
// broker through the features its users lean on. Each scenario prints what
// the client saw, one line per observation, with nothing server-chosen in
// it, so that the transcript from Warren can be compared with RabbitMQ
// 3.10's (tests/scripted.rs). Usage: php scenarios.php AMQP_URI
require '/usr/share/php/PhpAmqpLib/autoload.php';

use PhpAmqpLib\Connection\AMQPStreamConnection;
use PhpAmqpLib\Message\AMQPMessage;
use PhpAmqpLib\Wire\AMQPTable;

$uri = parse_url($argv[1]);
$host = $uri['host'];
$port = (int) $uri['port'];
$current = '';

function say(string $line): void
{
    global $current;
    echo "$current: " . preg_replace('/amq\.gen-[A-Za-z0-9_-]+/', 'amq.gen-*', $line) . "\n";
}

function connect(): AMQPStreamConnection
{
    global $host, $port;
    return new AMQPStreamConnection($host, $port, 'guest', 'guest');
}

/** What a client exception says: its class, code and text. */
function describe(\Throwable $e): string
{
    return (new \ReflectionClass($e))->getShortName() . ' ' . $e->getCode() . ' ' . $e->getMessage();
}

function scenario(string $name, callable $f): void
{
    global $current;
    $current = $name;
    try {
        $f();
    } catch (\Throwable $e) {
        say('failed: ' . describe($e));
    }
}

/** The queue's ready count once it has `n` (5 s at most). */
function until_count($ch, string $queue, int $n): int
{
    for ($i = 0; $i < 500; $i++) {
        [, $count] = $ch->queue_declare($queue, true);
        if ($count >= $n) {
            return $count;
        }
        usleep(10000);
    }
    return $count;
}

$c = connect();

scenario('handshake', function () use ($c) {
    $props = $c->getServerProperties();
    $caps = $props['capabilities'][1];
    ksort($caps);
    say('capabilities ' . json_encode($caps));
    foreach (['product', 'version', 'platform', 'copyright', 'information', 'cluster_name'] as $k) {
        say("server property $k present " . json_encode(isset($props[$k])));
    }
});

scenario('publish_and_get', function () use ($c) {
    $ch = $c->channel();
    $ch->queue_delete('php-q');
    [$q, $n, $consumers] = $ch->queue_declare('php-q', false, true, false, false);
    say("declared $q with $n messages, $consumers consumers");
    $headers = new AMQPTable(['s' => 'str', 'i' => 42, 'big' => 2 ** 40, 'f' => 1.5, 'b' => true,
        'arr' => [1, 'x'], 'tbl' => ['k' => 'v'], 'n' => null]);
    for ($i = 0; $i < 3; $i++) {
        $ch->basic_publish(new AMQPMessage("body$i", ['content_type' => 'text/plain',
            'delivery_mode' => 2, 'priority' => 1, 'message_id' => "m$i", 'timestamp' => 1600000000,
            'application_headers' => $headers, 'correlation_id' => 'c', 'reply_to' => 'r',
            'expiration' => '60000', 'type' => 't', 'user_id' => 'guest', 'app_id' => 'a']), '', 'php-q');
    }
    say('ready ' . until_count($ch, 'php-q', 3));
    $m = $ch->basic_get('php-q');
    say('got ' . $m->getBody() . ' redelivered ' . json_encode($m->get('redelivered'))
        . ' message count ' . $m->getMessageCount() . ' routing key ' . $m->getRoutingKey());
    foreach (['content_type', 'delivery_mode', 'priority', 'message_id', 'timestamp', 'correlation_id',
        'reply_to', 'expiration', 'type', 'user_id', 'app_id'] as $k) {
        say("property $k " . json_encode($m->get($k)));
    }
    $h = $m->get('application_headers')->getNativeData();
    ksort($h);
    say('headers ' . json_encode($h));
    $m->ack();
    $m = $ch->basic_get('php-q');
    $m->nack(true);
    $m = $ch->basic_get('php-q');
    say('after a nack with requeue: ' . $m->getBody() . ' redelivered ' . json_encode($m->get('redelivered')));
    $m->reject(false);
    say('purged ' . $ch->queue_purge('php-q'));
    say('deleted with ' . json_encode($ch->queue_delete('php-q')));
    $ch->close();
});

scenario('confirms_and_returns', function () use ($c) {
    $ch = $c->channel();
    $ch->queue_declare('php-confirms', false, false, false, false);
    $acks = 0;
    $nacks = 0;
    $returned = [];
    $ch->set_ack_handler(function () use (&$acks) { $acks++; });
    $ch->set_nack_handler(function () use (&$nacks) { $nacks++; });
    $ch->set_return_listener(function ($code, $text, $x, $key, $m) use (&$returned) {
        $returned[] = "$code $text '$x' $key " . $m->getBody();
    });
    $ch->confirm_select();
    for ($i = 0; $i < 50; $i++) {
        $ch->basic_publish(new AMQPMessage("m$i"), '', 'php-confirms');
    }
    $ch->basic_publish(new AMQPMessage('lost'), '', 'php-nowhere', true);
    $ch->wait_for_pending_acks_returns(5);
    say("acks $acks nacks $nacks returned " . json_encode($returned));
    $ch->queue_delete('php-confirms');
    $ch->close();
});

scenario('consume', function () use ($c) {
    $ch = $c->channel();
    $ch->queue_declare('php-consume', false, false, false, true);
    $ch->basic_qos(null, 3, null);
    for ($i = 0; $i < 10; $i++) {
        $ch->basic_publish(new AMQPMessage("m$i"), '', 'php-consume');
    }
    until_count($ch, 'php-consume', 10);
    $got = [];
    $tag = $ch->basic_consume('php-consume', 'php-tag', false, false, false, false,
        function ($m) use (&$got) { $got[] = $m; });
    $wait = function () use ($ch, &$got) {
        try {
            while (count($got) < 10) {
                $ch->wait(null, false, 0.5);
            }
        } catch (\PhpAmqpLib\Exception\AMQPTimeoutException $e) {
        }
    };
    $wait();
    say("prefetch 3, no ack: " . count($got) . " deliveries, consumer tag $tag");
    end($got)->ack(true);
    $wait();
    say('after a multiple ack: ' . count($got));
    $ch->basic_cancel('php-tag');
    $ch->close();
});

scenario('channel_errors', function () {
    $cases = [
        'passive declare of a missing queue' => fn($ch) => $ch->queue_declare('php-none', true),
        'exclusive queue of another connection' => function ($ch) {
            connect()->channel()->queue_declare('php-exclusive', false, false, true, true);
            $ch->queue_declare('php-exclusive', false, false, false, false);
        },
        'bind to a missing exchange' => function ($ch) {
            $ch->queue_declare('php-bind', false, false, false, true);
            $ch->queue_bind('php-bind', 'php-nox');
        },
        'ack of an unknown tag' => function ($ch) {
            $ch->basic_ack(77);
            $ch->queue_declare('php-after-ack', false, false, false, true);
        },
        'redeclared durable' => function ($ch) {
            $ch->queue_declare('php-eq', false, false, false, true);
            $ch->queue_declare('php-eq', false, true, false, true);
        },
        'x-max-length a string' => fn($ch) => $ch->queue_declare('php-arg', false, false, false, true,
            false, new AMQPTable(['x-max-length' => 'ten'])),
        'amq. exchange' => fn($ch) => $ch->exchange_declare('amq.php', 'direct'),
        'delete amq.direct' => fn($ch) => $ch->exchange_delete('amq.direct'),
    ];
    foreach ($cases as $name => $act) {
        $conn = connect();
        try {
            $act($conn->channel());
            say("$name: ok");
        } catch (\Throwable $e) {
            say("$name: " . describe($e));
        }
        try {
            $conn->close();
        } catch (\Throwable $e) {
        }
    }
});

$c->close();
echo "done\n";
