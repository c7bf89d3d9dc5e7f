#!/bin/sh
# Client libraries' own acceptance suites against Warren or RabbitMQ 3.10.
# See docs/client-suites.md. Not part of CI: fetching needs PyPI, npm and
# crates.io.
#
#   docs/client-suites/run.sh fetch      # suites, a venv and node modules into $SUITES
#   docs/client-suites/run.sh warren     # start target/debug/warren, run every suite, stop it
#   docs/client-suites/run.sh warren-shards N  # the same with `warren --shards N`
#   docs/client-suites/run.sh rabbitmq   # the same with Debian's rabbitmq-server
#   docs/client-suites/run.sh suites     # run every suite against whatever listens
#   docs/client-suites/run.sh warren-cluster all|others
#                                        # three nodes (127.0.0.1-3), every queue mirrored:
#                                        # to all of them (its master where declared), or to
#                                        # nodes 2 and 3 only (the client's node 1 forwards)
#   docs/client-suites/run.sh rabbitmq-cluster all|others
#                                        # the same with three RabbitMQ nodes
#
# The broker listens on 127.0.0.1:5672 (AMQPS on 5671, with aiormq's test
# certificates): nothing else may use those ports. Results go to
# $SUITES/results/SUITE-BROKER.txt and a summary to stdout.
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
SUITES=${SUITES:-/tmp/warren-client-suites}
PY=$SUITES/venv/bin/python
CERTS=$SUITES/pypi/aiormq-7.2.4/tests/certs

fetch() {
    mkdir -p "$SUITES/pypi" "$SUITES/npm" "$SUITES/results"
    cd "$SUITES/pypi"
    pip download -q --no-deps --no-binary :all: amqp==5.4.2 kombu==5.7.0
    pip download -q --no-deps --no-binary aiormq,aio-pika aiormq==7.2.4 aio-pika==10.2.1
    pip download -q --no-deps --no-binary :all: amqpstorm==3.1.4 rabbitpy==3.0.2
    for f in *.tar.gz; do tar xzf "$f"; done
    python3 -m venv "$SUITES/venv"
    "$PY" -m pip install -q -e amqp-5.4.2 -e kombu-5.7.0 -e aiormq-7.2.4 -e aio_pika-10.2.1 \
        pytest pytest-rerunfailures aiomisc aiomisc-pytest shortuuid timeout-decorator \
        pytest-rst hypothesis pytest-freezer
    "$PY" -m pip install -q -e amqpstorm-3.1.4 -e rabbitpy-3.0.2 mock requests python-dotenv
    "$PY" "$HERE/patch_aio.py" "$SUITES/pypi"
    cd "$SUITES/npm"
    npm pack -q amqplib@2.0.0 >/dev/null
    rm -rf amqplib && mkdir amqplib && tar xzf amqplib-2.0.0.tgz -C amqplib
    (cd amqplib/package && npm install -q --no-save --ignore-scripts --no-audit --no-fund \
        buffer-more-ints@~1.0.0 claire@0.4.1 >/dev/null)
    # The Go clients, from Debian's packages (their sources ship the tests),
    # built in GOPATH mode: no Go module proxy is needed.
    apt-get install -y -qq golang-go golang-github-rabbitmq-amqp091-go-dev \
        golang-github-streadway-amqp-dev golang-uber-goleak-dev >/dev/null
    g=$SUITES/go && rm -rf "$g" && mkdir -p "$g/src/github.com/rabbitmq" \
        "$g/src/github.com/streadway" "$g/src/go.uber.org"
    cp -r /usr/share/gocode/src/github.com/rabbitmq/amqp091-go "$g/src/github.com/rabbitmq/"
    cp -r /usr/share/gocode/src/github.com/streadway/amqp "$g/src/github.com/streadway/"
    cp -rL /usr/share/gocode/src/go.uber.org/goleak "$g/src/go.uber.org/"
    (cd "$g/src/github.com/rabbitmq/amqp091-go" && GOPATH=$g GO111MODULE=off \
        go test -c -tags integration -o "$g/amqp091-go.test" .)
    (cd "$g/src/github.com/streadway/amqp" && GOPATH=$g GO111MODULE=off \
        go test -c -tags integration -o "$g/streadway-amqp.test" .)
    # lapin: the crate Warren's own tests use (its package ships tests/).
    (cd "$ROOT" && cargo fetch -q)
    crate=$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/lapin-4.12.3.crate | head -1)
    rm -rf "$SUITES/lapin-4.12.3" && tar xzf "$crate" -C "$SUITES"
    cp "$ROOT/Cargo.lock" "$SUITES/lapin-4.12.3/"
}

wait_port() {
    w=0
    until "$PY" -c "import socket; socket.create_connection(('${2:-127.0.0.1}', $1), 1)" 2>/dev/null; do
        w=$((w + 1)); [ $w -lt 120 ] || { echo "nothing on port $1" >&2; exit 1; }
        sleep 1
    done
}

# The listeners in RabbitMQ's config format, which Warren reads too.
listeners() {
    printf '%s\n' "listeners.tcp.default = 127.0.0.1:5672" "listeners.ssl.default = 127.0.0.1:5671" \
        "ssl_options.cacertfile = $CERTS/ca.pem" "ssl_options.certfile = $CERTS/server.pem" \
        "ssl_options.keyfile = $CERTS/server.key"
}

# One Warren node; its arguments follow (`--shards N`).
start_warren() {
    bin=${WARREN_BIN:-$ROOT/target/debug/warren}
    d=$SUITES/warren && rm -rf "$d" && mkdir -p "$d"
    listeners > "$d/warren.conf"
    "$bin" --config "$d/warren.conf" --data-dir "$d/data" --http-addr 127.0.0.1:15682 \
        --prometheus-addr 127.0.0.1:15702 "$@" > "$d/log" 2>&1 &
    echo $! > "$d/pid"
    wait_port 5672
}

# Three Warren nodes on 127.0.0.1, .2 and .3 (node 1 with the listeners of
# `start_warren`) and a policy mirroring every queue: `all` (to every node,
# the master on the declaring node 1) or `others` (to nodes 2 and 3 alone,
# so that node 1, where the suites connect, forwards every queue).
start_warren_cluster() {
    bin=${WARREN_BIN:-$ROOT/target/debug/warren}
    d=$SUITES/warren-cluster && rm -rf "$d" && mkdir -p "$d"
    printf 'warren-suites-%s\n' "$$" > "$d/secret"
    for i in 1 2 3; do
        if [ $i = 1 ]; then listeners; else echo "listeners.tcp.default = 127.0.0.$i:5672"; fi \
            > "$d/node$i.conf"
        join= && [ $i = 1 ] || join="--join 127.0.0.1:25672"
        http=127.0.0.$i:15672 && [ $i = 1 ] && http=127.0.0.1:15682
        # shellcheck disable=SC2086
        "$bin" --config "$d/node$i.conf" --data-dir "$d/node$i" --node-name "warren@127.0.0.$i" \
            --http-addr "$http" --prometheus-addr "127.0.0.$i:15702" \
            --peer-addr "127.0.0.$i:25672" --cluster-secret-file "$d/secret" $join \
            > "$d/node$i.log" 2>&1 &
        echo $! > "$d/pid$i"
        wait_port 5672 "127.0.0.$i"
        # The next node joins once this one is a running member.
        "$PY" - "$i" <<'PYEOF'
import base64, json, sys, time, urllib.request
req = urllib.request.Request("http://127.0.0.1:15682/api/nodes")
req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
for _ in range(120):
    try:
        nodes = json.load(urllib.request.urlopen(req, timeout=5))
        if sum(1 for n in nodes if n.get("running")) >= int(sys.argv[1]):
            sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
sys.exit("the cluster did not form")
PYEOF
    done
    case $1 in
        all) def='{"ha-mode":"all"}' ;;
        others) def='{"ha-mode":"nodes","ha-params":["warren@127.0.0.2","warren@127.0.0.3"]}' ;;
        *) echo "warren-cluster all|others" >&2; exit 2 ;;
    esac
    "$PY" - "$def" <<'PYEOF'
import base64, json, sys, urllib.request
body = json.dumps({"pattern": ".*", "apply-to": "queues", "definition": json.loads(sys.argv[1])})
req = urllib.request.Request("http://127.0.0.1:15682/api/policies/%2F/suites", body.encode(), method="PUT")
req.add_header("Content-Type", "application/json")
req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
urllib.request.urlopen(req, timeout=30).read()
PYEOF
}

stop_warren_cluster() {
    d=$SUITES/warren-cluster
    for i in 3 2 1; do
        [ -f "$d/pid$i" ] && kill "$(cat "$d/pid$i")" && rm -f "$d/pid$i"
        sleep 1
    done
}

start_rabbitmq() {
    d=$SUITES/rabbitmq && rm -rf "$d" && mkdir -p "$d/log"
    listeners > "$d/rabbitmq.conf"
    printf 'ssl_options.verify = verify_peer\nssl_options.fail_if_no_peer_cert = false\n' \
        >> "$d/rabbitmq.conf"
    # The management API on 15672, for AMQPStorm's management tests.
    printf 'management.tcp.port = 15672\nmanagement.tcp.ip = 127.0.0.1\n' >> "$d/rabbitmq.conf"
    echo '[rabbitmq_management].' > "$d/enabled_plugins"
    env RABBITMQ_NODENAME=suites@localhost RABBITMQ_NODE_PORT=5672 RABBITMQ_DIST_PORT=25812 \
        RABBITMQ_MNESIA_BASE="$d/mnesia" RABBITMQ_LOG_BASE="$d/log" \
        RABBITMQ_CONFIG_FILE="$d/rabbitmq" RABBITMQ_ENABLED_PLUGINS_FILE="$d/enabled_plugins" \
        HOME="$d" /usr/lib/rabbitmq/bin/rabbitmq-server > "$d/stdout" 2>&1 &
    echo $! > "$d/pid"
    wait_port 5672
    sleep 3
}

# Three RabbitMQ nodes (suites1..3@localhost; node 1 with the listeners of
# `start_rabbitmq`, nodes 2 and 3 on 5692 and 5693: lapin's tests expect
# 5673 closed) joined in one cluster,
# with the same policy as `start_warren_cluster`: the comparison for its runs.
start_rabbitmq_cluster() {
    port() { if [ "$1" = 1 ]; then echo 5672; else echo $((5690 + $1)); fi; }
    d=$SUITES/rabbitmq-cluster && rm -rf "$d" && mkdir -p "$d"
    printf 'WARRENSUITES%s' "$$" > "$d/.erlang.cookie" && chmod 400 "$d/.erlang.cookie"
    for i in 1 2 3; do
        mkdir -p "$d/node$i/log"
        if [ $i = 1 ]; then
            listeners > "$d/node$i/rabbitmq.conf"
            printf 'ssl_options.verify = verify_peer\nssl_options.fail_if_no_peer_cert = false\n' \
                >> "$d/node$i/rabbitmq.conf"
            printf 'management.tcp.port = 15672\nmanagement.tcp.ip = 127.0.0.1\n' >> "$d/node$i/rabbitmq.conf"
            echo '[rabbitmq_management].' > "$d/node$i/enabled_plugins"
        else
            echo "listeners.tcp.default = 127.0.0.1:$(port $i)" > "$d/node$i/rabbitmq.conf"
            echo '[rabbitmq_management_agent].' > "$d/node$i/enabled_plugins"
        fi
        env RABBITMQ_NODENAME=suites$i@localhost RABBITMQ_NODE_PORT="$(port $i)" \
            RABBITMQ_DIST_PORT=$((25811 + i)) RABBITMQ_MNESIA_BASE="$d/node$i/mnesia" \
            RABBITMQ_LOG_BASE="$d/node$i/log" RABBITMQ_CONFIG_FILE="$d/node$i/rabbitmq" \
            RABBITMQ_ENABLED_PLUGINS_FILE="$d/node$i/enabled_plugins" \
            HOME="$d" /usr/lib/rabbitmq/bin/rabbitmq-server > "$d/node$i/stdout" 2>&1 &
        echo $! > "$d/pid$i"
        wait_port "$(port $i)"
        if [ $i != 1 ]; then
            for a in stop_app "join_cluster suites1@localhost" start_app; do
                # shellcheck disable=SC2086
                HOME="$d" /usr/lib/rabbitmq/bin/rabbitmqctl -n suites$i@localhost $a >/dev/null
            done
        fi
    done
    case $1 in
        all) def='{"ha-mode":"all"}' ;;
        others) def='{"ha-mode":"nodes","ha-params":["suites2@localhost","suites3@localhost"]}' ;;
        *) echo "rabbitmq-cluster all|others" >&2; exit 2 ;;
    esac
    HOME="$d" /usr/lib/rabbitmq/bin/rabbitmqctl -n suites1@localhost set_policy \
        --apply-to queues suites '.*' "$def" >/dev/null
    sleep 3
}

stop_rabbitmq_cluster() {
    d=$SUITES/rabbitmq-cluster
    for i in 3 2 1; do
        [ -f "$d/pid$i" ] || continue
        pid=$(cat "$d/pid$i")
        HOME="$d" /usr/lib/rabbitmq/bin/rabbitmqctl -n suites$i@localhost stop >/dev/null 2>&1 ||
            kill $(pgrep -P "$pid") "$pid"
        rm -f "$d/pid$i"
    done
}

# Stops the broker this script started, by its PID (RabbitMQ's is the shell
# script's: its process group holds the Erlang VM).
stop() {
    d=$SUITES/$1
    [ -f "$d/pid" ] || return 0
    pid=$(cat "$d/pid")
    if [ "$1" = rabbitmq ]; then
        # Not /usr/sbin/rabbitmqctl: as root it runs as the rabbitmq user,
        # whose Erlang cookie is not this node's.
        HOME="$d" /usr/lib/rabbitmq/bin/rabbitmqctl -n suites@localhost stop >/dev/null 2>&1 ||
            kill $(pgrep -P "$pid") "$pid"
    else
        kill "$pid"
    fi
    rm -f "$d/pid"
}

suites() {
    b=$1
    r=$SUITES/results && mkdir -p "$r"
    cd "$SUITES/pypi/amqp-5.4.2"
    # The TLS tests need certificates the sdist does not ship and badssl.com.
    "$PY" -m pytest t/integration -p no:cacheprovider -p no:rerunfailures -q -rfE -W ignore \
        -k "not tls" > "$r/py-amqp-$b.txt" 2>&1 || true
    cd "$SUITES/pypi/kombu-5.7.0"
    "$PY" -m pytest t/integration/test_py_amqp.py -p no:cacheprovider -p no:rerunfailures -q -rfE \
        -W ignore > "$r/kombu-$b.txt" 2>&1 || true
    cd "$SUITES/pypi/aiormq-7.2.4"
    "$PY" -m pytest tests -p no:cacheprovider -q -rfE -W ignore > "$r/aiormq-$b.txt" 2>&1 || true
    cd "$SUITES/pypi/aio_pika-10.2.1"
    "$PY" -m pytest tests -p no:cacheprovider -q -rfE -W ignore > "$r/aio-pika-$b.txt" 2>&1 || true
    cd "$SUITES/npm/amqplib/package"
    # The package's --test-timeout=1000 also bounds each file; 10 s lets them finish.
    URL=amqp://127.0.0.1:5672 node --test --test-timeout=10000 > "$r/amqplib-$b.txt" 2>&1 || true
    cd "$SUITES/lapin-4.12.3"
    CARGO_TARGET_DIR=$SUITES/lapin-target AMQP_ADDR=amqp://127.0.0.1:5672/%2f \
        cargo test -q --tests > "$r/lapin-$b.txt" 2>&1 || true
    # AMQPStorm's functional tests (its management ones on the broker's
    # HTTP API: Warren's on 15682, RabbitMQ's on 15672), without the TLS ones.
    http=15672 && case $b in warren*) http=15682 ;; esac
    cd "$SUITES/pypi/amqpstorm-3.1.4"
    AMQP_HOST=127.0.0.1 AMQP_USERNAME=guest AMQP_PASSWORD=guest \
        AMQP_URI='amqp://guest:guest@127.0.0.1:5672/%2F' AMQP_HTTP_URL=http://127.0.0.1:$http \
        "$PY" -m pytest amqpstorm/tests/functional -p no:cacheprovider -q -rfE \
        --ignore=amqpstorm/tests/functional/ssl \
        --deselect amqpstorm/tests/functional/management/test_api.py::ApiFunctionalTests::test_api_ssl_test \
        > "$r/amqpstorm-$b.txt" 2>&1 || true
    cd "$SUITES/pypi/rabbitpy-3.0.2"
    RABBITMQ_URL='amqp://guest:guest@127.0.0.1:5672/%2F' "$PY" -m pytest \
        tests/test_integration.py tests/integration -p no:cacheprovider -q -rfE \
        > "$r/rabbitpy-$b.txt" 2>&1 || true
    for t in amqp091-go streadway-amqp; do
        AMQP_URL=amqp://guest:guest@127.0.0.1:5672/ "$SUITES/go/$t.test" -test.v -test.count=1 \
            -test.timeout 600s > "$r/$t-$b.txt" 2>&1 || true
        printf 'go: %s passed, %s failed\n' "$(grep -c -- '--- PASS' "$r/$t-$b.txt")" \
            "$(grep -c -- '--- FAIL' "$r/$t-$b.txt")" >> "$r/$t-$b.txt"
    done
    for f in "$r"/*-"$b".txt; do
        printf '%-24s %s\n' "$(basename "$f" .txt)" \
            "$(grep -E '(passed|failed).* in [0-9.]+s|^# (pass|fail|cancelled) |^test result|^go: ' "$f" | tr '\n' ' ')"
    done
}

case ${1:-} in
    fetch) fetch ;;
    warren) start_warren; trap 'stop warren' EXIT; suites warren ;;
    warren-shards)
        start_warren --shards "${2:-2}"; trap 'stop warren' EXIT; suites "warren-shards${2:-2}" ;;
    rabbitmq) start_rabbitmq; trap 'stop rabbitmq' EXIT; suites rabbitmq ;;
    suites) suites "${2:-broker}" ;;
    warren-cluster)
        start_warren_cluster "${2:-}"; trap stop_warren_cluster EXIT; suites "warren-cluster-$2" ;;
    rabbitmq-cluster)
        start_rabbitmq_cluster "${2:-}"; trap stop_rabbitmq_cluster EXIT; suites "rabbitmq-cluster-$2" ;;
    *) sed -n 2,15p "$0"; exit 2 ;;
esac
