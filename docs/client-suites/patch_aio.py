"""Point aiormq's and aio-pika's test fixtures at a broker on 127.0.0.1
instead of a docker container (AMQP_PORT, default 5672; AMQPS_PORT, 5671).
Only fixture plumbing changes; no test is edited."""
import pathlib, re, sys

root = pathlib.Path(sys.argv[1])
SHIM = '''

# --- added by the Warren client-suites harness: a local broker, no docker ---
import os as _os

class _LocalContainer:
    id = "local"
    host = "127.0.0.1"
    ports = {
        "5672/tcp": int(_os.environ.get("AMQP_PORT", "5672")),
        "5671/tcp": int(_os.environ.get("AMQPS_PORT", "5671")),
    }

@pytest.fixture(scope="session")
def rabbitmq_container():
    return _LocalContainer()
'''
# aiormq: the sdist's conftest uses rabbitmq_container and amqp_direct_url
# without defining them.
p = root / "aiormq-7.2.4/tests/conftest.py"
s = p.read_text()
if "Warren client-suites" not in s:
    s += SHIM + '''
@pytest.fixture(scope="session")
def amqp_direct_url(rabbitmq_container):
    return URL.build(scheme="amqp", user="guest", password="guest", path="//",
                     host=rabbitmq_container.host,
                     port=rabbitmq_container.ports["5672/tcp"])
'''
    p.write_text(s)
# aio-pika: no docker check, and the container fixture replaced.
p = root / "aio_pika-10.2.1/tests/conftest.py"
s = p.read_text()
if "Warren client-suites" not in s:
    s = s.replace("        _docker_host_info = check_docker_available()",
                  "        pass")
    s = re.sub(r'@pytest.fixture\(scope="session"\)\ndef rabbitmq_container\(docker\).*?\n\n\n',
               "", s, flags=re.S)
    assert "def rabbitmq_container(docker)" not in s
    s += SHIM
    p.write_text(s)
