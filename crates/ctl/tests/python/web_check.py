"""Drives the management web page in headless Chromium over the DevTools
protocol: log in, create the seed's mirroring policy in Admin -> Policies,
see the inline validation error for a bad one, see the queue take the policy
in the queues list and on its page (node, mirrors, ring), press the sync
actions through the API the page uses; then, while a client publishes, gets
and acks, see the rates and charts on the overview and the queue's page, the
every listener in Ports and contexts, the Connections, Channels and
Exchanges views and their pages (no NaN, no undefined), close the client's
connection with Force close, and take screenshots of each.

Usage: web_check.py HTTP_ADDR OUT_DIR   (exits non-zero on a failed check)
"""

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import websocket  # websocket-client

addr, out_dir = sys.argv[1], sys.argv[2]
browser = shutil.which("chromium") or shutil.which("chromium-browser")
profile = tempfile.mkdtemp()
chrome = subprocess.Popen(
    [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0",
     f"--user-data-dir={profile}", "--window-size=1200,900", "about:blank"],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def devtools_port():
    path = os.path.join(profile, "DevToolsActivePort")
    for _ in range(900):
        if os.path.exists(path):
            text = open(path).read().split()
            if text:
                return int(text[0])
        time.sleep(0.1)
    raise SystemExit("Chromium did not start")


try:
    port = devtools_port()
    tabs = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json"))
    tab = [t for t in tabs if t["type"] == "page"][0]
    ws = websocket.create_connection(tab["webSocketDebuggerUrl"], timeout=60)
    seq = [0]

    def call(method, **params):
        seq[0] += 1
        ws.send(json.dumps({"id": seq[0], "method": method, "params": params}))
        while True:
            m = json.loads(ws.recv())
            if m.get("id") == seq[0]:
                return m.get("result", {})

    def ev(expr):
        r = call("Runtime.evaluate", expression=expr, awaitPromise=True, returnByValue=True)
        return r.get("result", {}).get("value")

    def wait_for(expr, what):
        for _ in range(1200):
            v = ev(expr)
            if v:
                return v
            time.sleep(0.05)
        raise SystemExit(f"timed out waiting for {what}")

    def shot(name):
        data = call("Page.captureScreenshot", format="png")["data"]
        with open(os.path.join(out_dir, f"{name}.png"), "wb") as f:
            f.write(base64.b64decode(data))

    call("Page.navigate", url=f"http://{addr}/")
    wait_for("!!document.getElementById('login-btn')", "the login form")
    ev("document.getElementById('pass').value='guest'; document.getElementById('login-btn').click()")
    wait_for("!!document.getElementById('totals')", "the overview")
    shot("overview")
    main_text = ev("document.getElementById('main').innerText")
    assert "NaN" not in main_text and "undefined" not in main_text, main_text

    # Admin -> Policies: a bad definition shows the validator's message inline.
    ev("location.hash = '#/policies'")
    wait_for("!!document.getElementById('policy-form')", "the policy form")
    ev("""document.getElementById('p-name').value = 'bad';
          document.getElementById('p-pattern').value = '^x';
          document.querySelector('.shortcuts a[data-key="ha-mode"]').click();
          document.querySelector('.def-row .def-value').value = 'exactly';
          document.getElementById('p-submit').click()""")
    err = wait_for("document.getElementById('policy-error').textContent", "the inline error")
    assert "ha-params" in err, err
    shot("policy-error")

    # The seed's policy through the form: HA mode, HA params, HA sync mode.
    ev("location.hash = '#/'")
    wait_for("!!document.getElementById('totals')", "the overview")
    ev("location.hash = '#/policies'")
    wait_for("!!document.getElementById('policy-form')", "the policy form")
    ev("""const set = (key, value, type) => {
            document.querySelector(`.shortcuts a[data-key="${key}"]`).click();
            const rows = [...document.querySelectorAll('.def-row')].filter(r => r.querySelector('.def-key').value === key);
            rows[0].querySelector('.def-value').value = value;
          };
          document.getElementById('p-name').value = 'hello-ha';
          document.getElementById('p-pattern').value = '^hello';
          document.getElementById('p-apply').value = 'queues';
          set('ha-mode', 'exactly'); set('ha-params', '2'); set('ha-sync-mode', 'automatic');
          document.getElementById('p-submit').click()""")
    wait_for("[...document.querySelectorAll('#policies-table td')].some(td => td.textContent === 'hello-ha')",
             "the new policy in the table")
    shot("policies")

    # The queue takes the policy: queues list, then its page.
    ev("location.hash = '#/queues'")
    wait_for("[...document.querySelectorAll('#queues td')].some(td => td.textContent === 'hello-ha')",
             "the queue with its policy")
    node = ev("document.querySelector('#queues td.node').textContent")
    assert node.startswith("warren@"), node
    shot("queues")
    ev("location.hash = '#/queues/%2F/hello.world'")
    wait_for("!!document.getElementById('ring')", "the queue page")
    effective = ev("document.getElementById('q-effective').textContent")
    assert json.loads(effective) == {"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"}, effective
    assert ev("document.getElementById('q-policy').textContent") == "hello-ha"
    roles = ev("[...document.querySelectorAll('.ring-member')].map(g => g.dataset.role).join(',')")
    assert roles.startswith("master"), roles
    shot("queue")
    # Synchronise as the page's button does (the button shows only while a
    # mirror is unsynchronised; a single node has none).
    status = ev("""fetch('/api/queues/%2F/hello.world/actions', {method: 'POST',
                    headers: {'Authorization': 'Basic ' + sessionStorage.getItem('auth'), 'Content-Type': 'application/json'},
                    body: JSON.stringify({action: 'sync'})}).then(r => r.status)""")
    assert status == 204, status

    def clean(view):
        text = ev("document.getElementById('main').innerText")
        assert "NaN" not in text and "undefined" not in text, f"{view}: {text}"
        return text

    def some_rate(cells, what):
        # A rate cell reads "12.3/s" or "1.2 KiB/s"; a dash is no rate.
        wait_for(f"[...document.querySelectorAll({json.dumps(cells)})].some(td => parseFloat(td.textContent) > 0)", what)

    # Overview: the client's rates, then charts of the last samples (taken
    # every second here; the page refreshes every 5 s).
    ev("location.hash = '#/'")
    some_rate("#rates td", "a non-zero rate on the overview")
    wait_for("!!document.querySelector('#chart-rates polyline') && !!document.querySelector('#chart-queued polyline')",
             "the overview's charts")
    protocols = ev("[...document.querySelectorAll('#listeners tr td:first-child')].map(td => td.textContent).join(',')")
    for p in ["amqp", "http", "http/prometheus"]:
        assert p in protocols.split(","), protocols
    clean("overview")
    shot("overview-rates")

    # The queue the client uses: its rates in the list and on its page.
    ev("location.hash = '#/queues'")
    wait_for("[...document.querySelectorAll('#queues td a')].some(a => a.textContent === 'rated')", "the rated queue")
    clean("queues")
    ev("location.hash = '#/queues/%2F/rated'")
    some_rate("#q-rates td", "the queue's rates")
    wait_for("!!document.querySelector('#chart-q-rates polyline')", "the queue's rate chart")
    clean("queue")
    shot("queue-rates")

    # Connections: the client's, with its data rates; its page and channel.
    ev("location.hash = '#/connections'")
    some_rate("#connections td:nth-child(8)", "the connection's data rate from the client")
    clean("connections")
    shot("connections")
    ev("document.querySelector('#connections a').click()")
    wait_for("document.querySelectorAll('#conn-channels tr').length > 1", "the connection's channel")
    wait_for("!!document.querySelector('#chart-octets polyline')", "the connection's data rate chart")
    clean("connection")
    shot("connection")

    # Channels: the client's confirm-mode channel, its rates and page.
    ev("location.hash = '#/channels'")
    some_rate("#channels td:nth-child(10)", "the channel's publish rate")
    assert ev("document.querySelector('#channels tr:nth-child(2) td:nth-child(5)').textContent") == "C"
    clean("channels")
    shot("channels")
    ev("document.querySelector('#channels a').click()")
    some_rate("#chan-rates td", "the channel page's rates")
    clean("channel")
    shot("channel")

    # Exchanges: the list, one exchange's bindings, the default exchange.
    ev("location.hash = '#/exchanges'")
    wait_for("[...document.querySelectorAll('#exchanges td a')].some(a => a.textContent === 'hello.x')", "the exchange list")
    clean("exchanges")
    shot("exchanges")
    ev("[...document.querySelectorAll('#exchanges td a')].find(a => a.textContent === 'hello.x').click()")
    wait_for("[...document.querySelectorAll('#x-from td')].some(td => td.textContent === 'hello.world')", "the exchange's binding")
    clean("exchange")
    shot("exchange")
    ev("location.hash = '#/exchanges/%2F/amq.default'")
    wait_for("(document.getElementById('x-name') || {}).textContent === '(AMQP default)'", "the default exchange")
    clean("default exchange")

    # Force close the client's connection from its page.
    ev("location.hash = '#/connections'")
    wait_for("!!document.querySelector('#connections a')", "the connection list")
    ev("document.querySelector('#connections a').click()")
    wait_for("!!document.getElementById('close-conn')", "the close button")
    ev("document.getElementById('close-reason').value = 'closed by the web test'; document.getElementById('close-conn').click()")
    wait_for("document.getElementById('close-msg').textContent.includes('Closed.')", "the connection closed")
    shot("connection-closed")
    ev("location.hash = '#/connections'")
    wait_for("document.querySelectorAll('#connections tr').length === 1", "no connection left")
    print("OK", file=sys.stderr)
finally:
    chrome.kill()
    chrome.wait()
    shutil.rmtree(profile, ignore_errors=True)
