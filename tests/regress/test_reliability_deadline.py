"""Issue 35 item 4, *no whole-request deadline*: every HTTP request the regression makes has an overall
deadline, a URL that can never answer is refused at once, and a 429 is honoured or named as a 429."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import pytest
from regress_helpers import MODEL, free_port, make_profile, run_cli, standin_command, wait_port

from overlay.regress.client import Client


@pytest.fixture
def server(tmp_path: Path):
    procs: list[subprocess.Popen[bytes]] = []

    def start(*extra: str) -> str:
        port = free_port()
        log = (tmp_path / f"standin-{port}.log").open("wb")
        procs.append(subprocess.Popen(standin_command(port, "healthy", *extra), stdout=log, stderr=subprocess.STDOUT))
        assert wait_port(port, 15)
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_trickled_reply_ends_at_the_requests_deadline(server) -> None:
    """Issue 35 item 4: a reply sent one byte a second never tripped httpx's per-read timeout: a chat or a
    stream ran for as long as the server kept trickling. Now each ends at its timeout, as a whole."""
    client = Client(server("--trickle", "1"), MODEL, timeout_s=3)
    for call in (lambda: client.chat("What is 3+4?", 16), lambda: client.stream_completion("hello", 8)):
        start = time.monotonic()
        with pytest.raises(httpx.ReadTimeout, match=r"no complete reply within 3 s \(the request's whole deadline\)"):
            call()
        assert time.monotonic() - start < 6
    assert client.health() and client.models() == [MODEL]  # GETs are not trickled: the server is alive


def test_a_trickling_server_ends_in_a_verdict_and_a_report(server, tmp_path: Path) -> None:
    """Issue 35 item 4: against a server sending its replies one byte every 2 s, ``regress`` ran past every
    timeout, with no verdict and no report (the subprocess timeout here ended it). Now each request ends
    at its deadline: a regression verdict, the report written, in seconds."""
    url = server("--trickle", "2")
    profile = make_profile(tmp_path, **{"long_context.request_timeout_s": 4, "latency.timeout_s": 4})
    start = time.monotonic()
    run = run_cli(profile, tmp_path / "out", "--base-url", url, "--skip", "gsm8k", timeout_s=120)
    assert time.monotonic() - start < 90
    assert run.code == 1, run.stderr
    assert (tmp_path / "out" / "report.md").is_file()
    assert (tmp_path / "out" / "verdict").read_text().strip() == "regression"
    messages = [f["message"] for f in run.findings("regression")]
    assert any("no complete reply within 4 s" in m for m in messages), messages


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://host/x", "http://", "localhost:8000"])
def test_a_base_url_that_is_not_http_is_refused_at_once(tmp_path: Path, url: str) -> None:
    """Issue 35 item 4: ``--base-url file:///...`` waited for the ready timeout (the profile's, an hour: the
    subprocess timeout here ended it), since httpx's "unsupported protocol" counted as an answer. Now
    one line, exit 2, before anything waits."""
    start = time.monotonic()
    run = run_cli(make_profile(tmp_path), tmp_path / "out", "--base-url", url, timeout_s=60)
    assert time.monotonic() - start < 30
    assert run.code == 2
    assert run.stderr.strip().splitlines() == [
        f"error: --base-url {url!r}: not an http:// or https:// server URL "
        + ("(it names no host)" if url == "http://" else f"(its scheme is {url.split(':', 1)[0]!r})")]
    assert (tmp_path / "out" / "verdict").read_text().strip() == "harness"


def test_a_ref_url_that_is_not_http_is_refused_at_once(tmp_path: Path) -> None:
    """Issue 35 item 4: the same for the differential check's reference (``--ref-url``, ``REF_URL``)."""
    run = run_cli(make_profile(tmp_path), tmp_path / "out", "--base-url", "http://127.0.0.1:9", "--ref-url",
                  "file:///tmp/ref", timeout_s=60)
    assert run.code == 2
    assert run.stderr.strip().splitlines()[-1].startswith("error: --ref-url (REF_URL) 'file:///tmp/ref': not an http")


def test_a_429_with_retry_after_is_waited_out(server, tmp_path: Path) -> None:
    """Issue 35 item 4: a 429 with ``Retry-After: 1`` (a gateway in front of the server) failed the request at
    once: long-context findings "request failed: HTTP 429", a regression. Now the client waits the
    Retry-After out and sends the request again: the run passes."""
    url = server("--rate-limit", "3", "--retry-after", "1")
    run = run_cli(make_profile(tmp_path), tmp_path / "out", "--base-url", url, "--skip", "gsm8k,latency",
                  timeout_s=120)
    assert run.code == 0, run.stderr
    assert run.findings() == []


def test_a_429_that_does_not_end_is_named_a_429_not_a_regression(server, tmp_path: Path) -> None:
    """Issue 35 item 4: a server that kept answering 429 (Retry-After past the deadline) ended as regressions
    of the build ("request failed: HTTP 429 ..."; GSM8K through lm-eval as "Session is closed" or its
    progress bar). Now every check says 429 Too Many Requests, as a harness failure: the server refused
    the load, nothing is known of the build."""
    url = server("--rate-limit", "1000000", "--retry-after", "120")
    profile = make_profile(tmp_path, **{"long_context.request_timeout_s": 5, "latency.timeout_s": 5,
                                        "gsm8k.limit": 2})
    run = run_cli(profile, tmp_path / "out", "--base-url", url, "--skip", "acceptance", timeout_s=240)
    assert run.code == 2, run.stderr
    assert run.findings("regression") == []
    by_check = {f["check"]: f["message"] for f in run.findings("harness")}
    assert set(by_check) == {"long_context", "gsm8k", "latency"}, by_check
    assert all("429 Too Many Requests" in m for m in by_check.values()), by_check
    assert "Retry-After: 120" in by_check["long_context"]


def test_describe_names_a_429_and_its_retry_after() -> None:
    """Issue 35 item 4: the one line a failed request becomes (new)."""
    from overlay.regress.client import describe

    request = httpx.Request("POST", "http://h/v1/completions")
    response = httpx.Response(429, headers={"Retry-After": "7"}, request=request)
    exc = httpx.HTTPStatusError("x", request=request, response=response)
    assert describe(exc).startswith("HTTP 429 Too Many Requests: the server refuses the load (Retry-After: 7")


def test_describe_names_an_error_of_an_unread_streamed_reply() -> None:
    """Issue 42 cause 4: ``describe`` of an HTTP error whose reply is a stream nobody read.

    Before: ``r.text`` raised ``httpx.ResponseNotRead`` (a ``StreamError``, not the ``HTTPError`` it caught), out
    of the very handler that was naming the failure.
    """
    from overlay.regress.client import describe

    class Unread(httpx.SyncByteStream):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield b'{"error": "boom"}'

    request = httpx.Request("POST", "http://h/v1/completions")
    response = httpx.Response(500, stream=Unread(), request=request)
    exc = httpx.HTTPStatusError("x", request=request, response=response)
    assert describe(exc) == "HTTP 500: (the reply's body was not read)"


def test_a_500_to_the_streamed_completion_is_named_not_a_crash(server, tmp_path: Path) -> None:
    """Issue 42 cause 4: a server answering the latency check's streamed completions with 500.

    Before: the latency check crashed: ``stream_completion`` raised the 500 with its reply unread, and
    ``describe`` raised ``ResponseNotRead`` reading it, so the finding was ``latency: ResponseNotRead: ...``
    (a crash) instead of the server's answer. Now the stream's error reply is read, and the finding names it:
    ``HTTP 500: {"error": ...}``.
    """
    url = server("--stream-status", "500")
    client = Client(url, MODEL, timeout_s=10)
    with pytest.raises(httpx.HTTPStatusError) as exc:
        client.stream_completion("hello", 8)
    from overlay.regress.client import describe

    assert describe(exc.value).startswith('HTTP 500: {"error": {"message": "stream failed"')
    run = run_cli(make_profile(tmp_path), tmp_path / "out", "--base-url", url, "--skip",
                  "gsm8k,long_context,differential,acceptance", timeout_s=120)
    messages = [f["message"] for f in run.findings()]
    assert messages and all("ResponseNotRead" not in m for m in messages), messages
    assert any("HTTP 500" in m for m in messages), messages


def test_a_port_out_of_range_is_refused_not_wrapped_onto_another_server(server, tmp_path: Path) -> None:
    """Issue 42 cause 5: ``--base-url http://127.0.0.1:<P + 65536>`` with a server on port P.

    Before: httpx took the port modulo 65536 and connected to P: the run judged that other server and
    reported **pass** (``:99999`` connected to 34463). Now one line naming the option, exit 2, nothing sent.
    """
    url = server()
    port = int(url.rsplit(":", 1)[1])
    wrapped = f"http://127.0.0.1:{port + 65536}"
    run = run_cli(make_profile(tmp_path), tmp_path / "out", "--base-url", wrapped, "--skip", "gsm8k",
                  env={"REGRESS_ATTACH_TIMEOUT": "5"}, timeout_s=120)
    assert run.code == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"error: --base-url {wrapped!r}: its port must be >= 1 and <= 65535, got {port + 65536}"]
    assert (tmp_path / "out" / "verdict").read_text().strip() == "harness"


@pytest.mark.parametrize(("url", "why"), [
    ("http://127.0.0.1:99999", "its port must be >= 1 and <= 65535, got 99999"),
    ("http://127.0.0.1:0", "its port must be >= 1 and <= 65535, got 0"),
    ("http://[::1]:70000/v1", "its port must be >= 1 and <= 65535, got 70000"),
    ("http://127.0.0.1:80a", "its port '80a' is not a number"),
])
def test_check_url_refuses_a_port_out_of_range(url: str, why: str) -> None:
    """Issue 42 cause 5: the one URL check (``--base-url``, ``--ref-url``/``REF_URL``) holds the port to 1-65535."""
    from overlay.errors import UsageError
    from overlay.regress.client import check_url

    with pytest.raises(UsageError) as exc:
        check_url(url, "--ref-url (REF_URL)")
    assert str(exc.value) == f"--ref-url (REF_URL) {url!r}: {why}"
    assert check_url("http://127.0.0.1:65535/v1", "--base-url") == "http://127.0.0.1:65535/v1"
