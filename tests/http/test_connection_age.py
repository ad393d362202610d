"""--max-connection-age-seconds on the HTTP port: a keep-alive connection older than the age gets its answer whole
with `Connection: close` and is then closed, so the client's next request opens a new connection (which a
Service in front may send to another replica); younger connections and a worker without an age keep theirs."""

import http.client
import time

import pytest

from tests.serving import start


@pytest.fixture(scope="module")
def aged(tiny_artifacts):
    root, _ = tiny_artifacts
    srv = start(root, http_port=0, max_connection_age_s=0.5)
    yield srv
    srv.stop(grace=1)


def ask(conn: http.client.HTTPConnection) -> http.client.HTTPResponse:
    conn.request("GET", "/v2/health/live")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read() is not None
    return resp


def test_an_aged_connection_is_closed_after_a_whole_answer_and_the_next_request_reconnects(aged):
    conn = http.client.HTTPConnection("127.0.0.1", aged.http_port, timeout=10)
    try:
        first = ask(conn)
        port = conn.sock.getsockname()[1]
        assert not first.will_close and ask(conn).getheader("connection") != "close"
        assert conn.sock.getsockname()[1] == port  # kept alive while young
        time.sleep(0.7)
        old = ask(conn)  # a whole answer, then the close
        assert old.getheader("connection") == "close" and old.will_close
        assert conn.sock is None  # http.client let go of the socket the server closes
        again = ask(conn)  # http.client opens a new connection for the next request
        assert conn.sock.getsockname()[1] != port and not again.will_close
    finally:
        conn.close()


def test_without_an_age_keep_alive_connections_stay(tiny_artifacts):
    root, _ = tiny_artifacts
    srv = start(root, http_port=0)
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=10)
    try:
        ask(conn)
        port = conn.sock.getsockname()[1]
        time.sleep(0.7)
        assert ask(conn).getheader("connection") != "close" and conn.sock.getsockname()[1] == port
    finally:
        conn.close()
        srv.stop(grace=1)
