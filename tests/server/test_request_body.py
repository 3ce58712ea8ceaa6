"""Hostile bodies and clients get a 4xx with OpenAI's error body, never a 500 or a traceback
in the log: a client that leaves mid-upload, lone surrogates, absurd nesting, NaN, non-JSON
content types. A connection stays usable after a 400, and is closed after an answer that
left the body unread."""

import gzip
import http.client
import json
import socket
import time

import httpx
import pytest

from tests.server.harness import error_of, wait_idle

pytestmark = pytest.mark.slow

JSON = {"content-type": "application/json"}


def post_raw(server, path: str, content: bytes, headers: dict | None = None) -> httpx.Response:
    headers = JSON if headers is None else headers
    return httpx.post(server.url + path, content=content, headers=headers, timeout=30)


# ---- a client that leaves mid-upload ----------------------------------------------------------


def test_client_leaving_mid_upload_is_quiet(server, model):
    since = server.log_size()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    "Content-Length: 100\r\n\r\n")
            sock.sendall(head.encode() + b'{"prompt": "Hi')  # 14 of 100 bytes, then gone
    time.sleep(1.0)  # the server notices the disconnect
    assert server.log_problems(since) == [], server.log_tail(20)
    wait_idle(server)  # nothing left behind in the engine
    body = {"model": model, "prompt": "Hi", "max_tokens": 1}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200


# ---- text that is not Unicode -----------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, where",
    [
        ("/v1/completions", b'{"prompt": "\\ud800 hi", "max_tokens": 2}', "prompt"),
        ("/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "\\udc00 hi"}], "max_tokens": 2}',
         "messages[0].content"),
        ("/tokenize", b'{"prompt": "\\ud800 hi"}', "prompt"),
        ("/v1/completions", b'{"prompt": "hi", "stop": ["ok", "\\ud83d"]}', "stop[1]"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(server, path, body, where):
    err = error_of(post_raw(server, path, body), 400, server)
    assert err["message"].startswith(where + ":") and "surrogate" in err["message"], err
    assert err["param"] == where.split("[")[0].split(".")[0], err


def test_surrogate_pairs_and_escaped_backslashes_are_fine(server, model):
    body = b'{"prompt": "\\ud83d\\ude00 \\\\ud800", "max_tokens": 1}'  # an emoji, a backslash
    assert post_raw(server, "/v1/completions", body).status_code == 200
    resp = post_raw(server, "/tokenize", b'{"prompt": "\\ud83d\\ude00"}')
    assert resp.status_code == 200 and resp.json()["count"] > 0, resp.text


def test_invalid_utf8_is_400(server):
    for body in (b'{"prompt": "\xff"}', b'{"prompt": "\xed\xa0\x80"}'):  # \xed..: a surrogate
        err = error_of(post_raw(server, "/v1/completions", body), 400, server)
        assert "UTF-8" in err["message"], err


# ---- JSON that is too deep or not JSON --------------------------------------------------------


def test_deep_nesting_is_400(server, model):
    err = error_of(post_raw(server, "/v1/completions", b"[" * 100_000 + b"]" * 100_000), 400,
                   server)
    assert "deeper than" in err["message"] and err["code"] == "invalid_json", err
    nested = {"model": model, "prompt": "Hi", "max_tokens": 1,
              "extra": json.loads("[" * 65 + "]" * 65)}
    err = error_of(httpx.post(server.url + "/v1/completions", json=nested, timeout=30), 400,
                   server)
    assert "64" in err["message"], err
    nested["extra"] = json.loads("[" * 60 + "]" * 60)  # within the limit: ignored field
    assert httpx.post(server.url + "/v1/completions", json=nested, timeout=30).status_code == 200


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_literals_are_not_json(server, literal):
    body = f'{{"prompt": "Hi", "max_tokens": 2, "temperature": {literal}}}'.encode()
    err = error_of(post_raw(server, "/v1/completions", body), 400, server)
    assert "not valid JSON" in err["message"] and literal in err["message"], err
    assert err["code"] == "invalid_json", err


FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "timeout"]


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("number", ["1e400", "-1e400"])
def test_infinite_numbers_are_400_naming_the_field(server, field, number):
    for path, base in (("/v1/completions", '"prompt": "Hi"'),
                       ("/v1/chat/completions", '"messages": [{"role": "user", "content": "Hi"}]')):
        body = f'{{{base}, "max_tokens": 2, "{field}": {number}}}'.encode()
        err = error_of(post_raw(server, path, body), 400, server)
        assert err["param"] == field and "finite" in err["message"], err


# ---- content types ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
     "application/json; charset=latin-1"],
)
def test_a_body_not_sent_as_json_is_415(server, model, content_type):
    body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 2}).encode()
    resp = post_raw(server, "/v1/completions", body, {"content-type": content_type})
    err = error_of(resp, 415, server)
    assert "application/json" in err["message"] and content_type in err["message"], err
    assert err["code"] == "unsupported_media_type", err
    assert resp.headers.get("connection") == "close", "the unread body is not drained"


def test_a_compressed_body_is_415(server, model):
    body = gzip.compress(json.dumps({"model": model, "prompt": "Hi"}).encode())
    resp = post_raw(server, "/v1/completions", body, {**JSON, "content-encoding": "gzip"})
    assert "uncompressed" in error_of(resp, 415, server)["message"]


@pytest.mark.parametrize(
    "content_type",
    [None, "application/json", "Application/JSON; charset=UTF-8", "application/vnd.api+json"],
)
def test_json_content_types_and_none_are_accepted(server, model, content_type):
    """No Content-Type at all is read as JSON, as most JSON APIs do."""
    body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 1}).encode()
    headers = {"content-type": content_type} if content_type else {}  # httpx adds none
    resp = post_raw(server, "/v1/completions", body, headers)
    assert resp.status_code == 200, resp.text


# ---- the connection after an error ------------------------------------------------------------


def test_connection_is_reused_after_a_400_and_closed_after_an_unread_body(server, model):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        bad = b'{"prompt": "\\ud800 hi", "max_tokens": 2}'  # once a 500 that reset the connection
        conn.request("POST", "/v1/completions", body=bad, headers=JSON)
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 400 and not resp.will_close, resp.headers
        sock = conn.sock
        good = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 1}).encode()
        conn.request("POST", "/v1/completions", body=good, headers=JSON)
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200 and conn.sock is sock, "the connection was not reused"
        conn.request("POST", "/v1/completions", body=good, headers={"content-type": "text/plain"})
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 415 and resp.will_close, resp.headers
    finally:
        conn.close()
