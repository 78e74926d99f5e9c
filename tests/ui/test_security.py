"""The UI's server over real HTTP: loopback only, no change without the token, nothing
injected through refs or paths, and errors as messages, never tracebacks."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

import ckstore
from ckstore.errors import InvalidInputError
from ckstore.ui import security, server
from tests.ui.browser import Served, serve


def request(
    s: Served, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
    data = json.dumps(body).encode() if body is not None and not isinstance(body, bytes) else body
    hdrs = {"Host": f"127.0.0.1:{s.port}", **(headers or {})}
    if data is not None and "Content-Type" not in hdrs:
        hdrs["Content-Type"] = "application/json"
    conn.request(method, path, body=data, headers=hdrs)
    r = conn.getresponse()
    out = (r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    conn.close()
    return out


def test_the_page_and_its_assets_are_served_with_security_headers(served: Served) -> None:
    status, headers, body = request(served, "GET", "/")
    assert status == 200 and b'<script type="module" src="/static/js/main.js">' in body
    assert "script-src 'self'" in headers["content-security-policy"]
    assert headers["x-frame-options"] == "DENY" and headers["referrer-policy"] == "no-referrer"
    for asset in (
        "/static/js/main.js",
        "/static/vendor/uplot/uPlot.iife.min.js",
        "/static/style.css",
    ):
        assert request(served, "GET", asset)[0] == 200, asset


@pytest.mark.parametrize(
    "host", ["evil.example", "evil.example:80", "127.0.0.1.evil.example", "", "10.0.0.1"]
)
def test_requests_for_other_host_names_are_refused(served: Served, host: str) -> None:
    """DNS rebinding: a page on another name that resolves to 127.0.0.1 is refused."""
    status, _, body = request(served, "GET", "/api/overview", headers={"Host": host})
    assert status == 403 and b"refused" in body


@pytest.mark.parametrize(
    "host", ["localhost", "127.0.0.1", "127.0.0.2:1", "[::1]:8765", "LOCALHOST:1"]
)
def test_loopback_host_names_are_served(served: Served, host: str) -> None:
    assert request(served, "GET", "/api/runs", headers={"Host": host})[0] == 200


def test_actions_need_the_token(writable: Served) -> None:
    body = {"ref": "pretrain@0", "name": "mine"}
    assert request(writable, "POST", "/api/tag", body)[0] == 403
    assert request(writable, "POST", "/api/tag", body, {"X-Ckstore-Token": "wrong"})[0] == 403
    assert (
        request(writable, "POST", "/api/tag", body, {"Cookie": "x-ckstore-token=right-token"})[0]
        == 403
    )
    status, _, out = request(writable, "POST", "/api/tag", body, {"X-Ckstore-Token": "right-token"})
    assert status == 200 and json.loads(out)["tag"] == "mine"
    assert request(writable, "GET", "/api/tag?ref=pretrain@0&name=x")[0] == 405  # POST only


def test_actions_refuse_cross_origin_and_non_json_requests(writable: Served) -> None:
    token = {"X-Ckstore-Token": "right-token"}
    body = {"ref": "pretrain@0", "name": "x"}
    assert (
        request(writable, "POST", "/api/tag", body, {**token, "Origin": "http://evil.example"})[0]
        == 403
    )
    assert request(writable, "POST", "/api/tag", body, {**token, "Origin": "null"})[0] == 403
    own = {**token, "Origin": f"http://127.0.0.1:{writable.port}"}
    assert request(writable, "POST", "/api/tag", body, own)[0] == 200
    form = {**token, "Content-Type": "application/x-www-form-urlencoded"}
    assert request(writable, "POST", "/api/untag", b"name=x", form)[0] == 415
    assert request(writable, "POST", "/api/untag", b"[1, 2]", token)[0] == 400
    assert request(writable, "POST", "/api/untag", b"{oops", token)[0] == 400


@pytest.mark.parametrize(
    "origin",
    [
        "http://127.0.0.1:{other}",  # another local server: any loopback port was accepted
        "http://localhost:{port}",  # the same port under another name is another origin
        "http://127.0.0.2:{port}",
        "https://127.0.0.1:{port}",
        "http://127.0.0.1",
        "http://127.0.0.1:{port}/x",
    ],
)
def test_a_change_from_another_origin_is_refused(writable: Served, origin: str) -> None:
    token = {"X-Ckstore-Token": "right-token"}
    origin = origin.format(port=writable.port, other=writable.port + 1)
    status, _, body = request(
        writable,
        "POST",
        "/api/tag",
        {"ref": "pretrain@0", "name": "x"},
        {**token, "Origin": origin},
    )
    assert status == 403 and b"cross-origin" in body
    own = {**token, "Origin": f"http://127.0.0.1:{writable.port}"}
    assert request(writable, "POST", "/api/tag", {"ref": "pretrain@0", "name": "x"}, own)[0] == 200


def test_a_deeply_nested_body_is_a_json_400(writable: Served) -> None:
    token = {"X-Ckstore-Token": "right-token"}
    deep = b'{"name":' + b"[" * 30_000 + b"]" * 30_000 + b"}"
    assert len(deep) < 64 * 1024
    status, headers, body = request(writable, "POST", "/api/untag", deep, token)
    assert status == 400 and headers["content-type"].startswith("application/json")
    assert "nested" in json.loads(body)["error"]


def _raw(s: Served, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Send a request by hand; the status and whatever came back before the server closed."""
    import socket

    with socket.create_connection(("127.0.0.1", s.port), timeout=30) as sock:
        sock.sendall(head + body)
        sock.shutdown(socket.SHUT_WR) if body else None
        got = b""
        while b"\r\n\r\n" not in got or len(got) < 12:
            piece = sock.recv(65536)
            if not piece:
                break
            got += piece
    return int(got.split(b" ", 2)[1]), got


def test_a_body_announced_over_the_limit_is_refused_at_the_headers(writable: Served) -> None:
    head = (
        f"POST /api/untag HTTP/1.1\r\nHost: 127.0.0.1:{writable.port}\r\n"
        "X-Ckstore-Token: right-token\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000000000\r\n\r\n"
    ).encode()
    status, _ = _raw(writable, head)  # not one byte of the 1 GB is sent: the answer comes first
    assert status == 413


def test_a_chunked_body_is_cut_at_the_limit(writable: Served) -> None:
    """A body without a length is read up to the limit, then refused: the server answers while
    the client is still sending (before: it read until the client stopped)."""
    import socket
    import threading

    head = (
        f"POST /api/untag HTTP/1.1\r\nHost: 127.0.0.1:{writable.port}\r\n"
        "X-Ckstore-Token: right-token\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    piece = b" " * 65536
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    cap = 256 << 20
    sent = [0]
    with socket.create_connection(("127.0.0.1", writable.port), timeout=30) as sock:
        sock.sendall(head)

        def pour() -> None:  # never ends the body on its own: only the server's answer stops it
            try:
                while sent[0] < cap:
                    sock.sendall(chunk)
                    sent[0] += len(chunk)
            except OSError:
                pass

        t = threading.Thread(target=pour, daemon=True)
        t.start()
        got = sock.recv(65536)
    t.join(30)
    assert got.startswith(b"HTTP/1.1 413"), got[:200]
    assert sent[0] < cap


def test_delete_and_untag_through_the_api(writable: Served, store_copy: Path) -> None:
    token = {"X-Ckstore-Token": "right-token"}
    status, _, out = request(writable, "POST", "/api/delete", {"ref": "best"}, token)
    assert status == 409 and "tagged" in json.loads(out)["error"]  # a tagged snapshot needs force
    assert request(writable, "POST", "/api/untag", {"name": "best"}, token)[0] == 200
    assert request(writable, "POST", "/api/delete", {"ref": "sft-frozen@300"}, token)[0] == 200
    with ckstore.open(store_copy, create=False) as store:
        assert "best" not in store.tags() and len(store.log(run="sft-frozen")) == 3
    status, _, out = request(writable, "GET", "/api/overview")
    assert len(json.loads(out)["snaps"]["id"]) == 22  # the cached history was dropped


@pytest.mark.parametrize(
    "ref",
    ["' OR 1=1 --", "base'; DROP TABLE snapshots; --", "../../ckstore.json", "%", "_", "base@1 OR 1=1",
     "/etc/passwd", "base@-1", "\x00", "a" * 2000],
)  # fmt: skip
def test_refs_are_resolved_by_the_store_never_interpolated(served: Served, ref: str) -> None:
    status, headers, out = request(served, "GET", "/api/snapshot?ref=" + quote(ref))
    body = json.loads(out)
    assert status in (400, 404) and headers["content-type"] == "application/json"
    assert "Traceback" not in body["error"] and body["type"] in (
        "SnapshotNotFoundError",
        "InvalidInputError",
    )
    assert json.loads(request(served, "GET", "/api/runs")[2])["runs"]  # the index is intact


def test_diff_refs_and_paths_cannot_reach_files(served: Served) -> None:
    status, _, out = request(served, "GET", "/api/diff?a=" + quote("../index.sqlite") + "&b=base")
    assert status == 404 and json.loads(out)["type"] == "SnapshotNotFoundError"
    for path in (
        "/static/../../ckstore.json",
        "/static/%2e%2e/%2e%2e/store.py",
        "/static//etc/passwd",
    ):
        status, _, out = request(served, "GET", path)
        assert status == 404 and b"store_id" not in out, path
    assert request(served, "GET", "/api/health?run=diverged&limit=-3")[0] == 400


def test_a_damaged_manifest_is_an_error_message(store_copy: Path) -> None:
    with ckstore.open(store_copy, create=False) as store:
        target = store.get("best").record.manifest_id
    path = next(p for p in (store_copy / "manifests").rglob(target + "*"))
    path.chmod(0o644)
    path.write_bytes(b"{not json")
    s = serve(str(store_copy))
    try:
        status, _, out = request(s, "GET", "/api/diff?a=base&b=best")
        body = json.loads(out)
        assert status == 500 and body["type"] == "CorruptionError" and "manifest" in body["error"]
        assert request(s, "GET", "/api/overview")[0] == 200  # the rest of the store still shows
    finally:
        s.stop()


def test_a_malformed_store_gives_an_error_page(store_copy: Path) -> None:
    (store_copy / "index.sqlite").write_bytes(b"this is not a database" * 100)
    s = serve(str(store_copy))
    try:
        status, headers, out = request(s, "GET", "/")
        page = out.decode()
        assert status == 500 and headers["content-type"].startswith("text/html")
        assert (
            'id="error-message"' in page and "Traceback" not in page and "ckstore reindex" in page
        )
        status, _, out = request(s, "GET", "/api/overview")
        assert status == 500 and "Traceback" not in json.loads(out)["error"]
    finally:
        s.stop()


def test_the_server_binds_loopback_unless_a_host_is_given() -> None:
    with pytest.raises(InvalidInputError, match="--host"):
        server.serve(lambda: None, "t", label="x", host="0.0.0.0", open_browser=False)  # type: ignore[arg-type,return-value]
    sock = server.bind(server.DEFAULT_HOST, 0)
    try:
        assert sock.getsockname()[0] == "127.0.0.1"
        url = server.url_of(sock, server.DEFAULT_HOST, "a b")
        assert url.startswith("http://127.0.0.1:") and url.endswith("/?token=a%20b")
        with pytest.raises(InvalidInputError, match="--port 0"):
            server.bind(server.DEFAULT_HOST, sock.getsockname()[1])
    finally:
        sock.close()


def test_the_token_comes_from_the_option_the_environment_or_chance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(security.TOKEN_ENV, raising=False)
    assert security.new_token("given") == "given"
    a, b = security.new_token(), security.new_token()
    assert a != b and len(a) >= 32
    monkeypatch.setenv(security.TOKEN_ENV, "from-env")
    assert security.new_token() == "from-env"
    g = security.Guard("tok")
    assert (
        g.token_ok("tok")
        and not g.token_ok("tok2")
        and not g.token_ok(None)
        and not g.token_ok("ü")
    )


def test_the_cli_serves_and_prints_the_url_with_the_token(
    scenario: tuple[Path, dict[str, str]],
) -> None:
    env = {**os.environ, "CKSTORE_UI_TOKEN": "cli-token"}
    env.pop("CKSTORE_STORE", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckstore.cli", "--store", str(scenario[0]), "ui", "--port", "0", "--no-open"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(2)]
        url = lines[1].split("open ", 1)[1].strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/?token=cli-token")
        port = int(url.split(":")[2].split("/")[0])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/api/runs")
        assert conn.getresponse().status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_cli_refuses_a_missing_store(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "ckstore.cli", "--store", str(tmp_path / "none"), "ui", "--no-open"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 3 and "no ckstore store" in p.stderr and "Traceback" not in p.stderr
