"""``routecore client --target`` without ``--load``: one ext_proc conversation
against a routecore server the test starts, printed as Envoy acts on it."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest
import yaml

pytest.importorskip("grpc")
pytest.importorskip("envoy")

from server_fixtures import SHORT, Running, base_config, free_port, wait_settled  # noqa: E402
from test_readme import PAGES  # noqa: E402

from routecore import cli  # noqa: E402


@pytest.fixture
def server(tmp_path):
    r = Running(tmp_path / "routecore.yaml", base_config())
    yield r
    r.stop()


def client_json(capsys, *argv: str) -> tuple[int, dict]:
    code = cli.main(["client", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_one_conversation_shows_the_routing_answer_as_envoy_sees_it(server, capsys):
    code, out = client_json(capsys, "--target", server.target)
    assert code == 0 and out["routed"] and out["http_status"] is None
    assert out["endpoint"] in SHORT and out["pool"] == "short"
    assert sorted([out["endpoint"], *out["fallbacks"]]) == SHORT
    phases = [a["phase"] for a in out["answers"]]
    assert phases == ["request_headers", "request_body"]
    body = out["answers"][1]
    assert body["status"] == "CONTINUE" and body["clear_route_cache"]
    listed = ",".join([out["endpoint"], *out["fallbacks"]])
    assert body["set_headers"]["x-gateway-destination-endpoint"] == listed
    lb = body["dynamic_metadata"]["envoy.lb"]
    assert lb["x-gateway-destination-endpoint"] == listed
    assert out["added_ms"] > 0
    # the request phase alone: the server releases it when the stream closes
    wait_settled(server)


def test_usage_sends_the_response_phase_and_the_server_learns(server, capsys):
    before = server.server.plane.calibrator.to_bytes()
    code, out = client_json(capsys, "--target", server.target, "--usage", "40:20")
    assert code == 0
    phases = [a["phase"] for a in out["answers"]]
    assert phases == ["request_headers", "request_body", "response_headers", "response_body"]
    wait_settled(server)
    assert server.server.plane.calibrator.to_bytes() != before


def test_a_refusal_prints_the_http_status_and_exits_1(server, capsys):
    code, out = client_json(capsys, "--target", server.target, "--api-key", "wrong")
    assert code == 1 and not out["routed"]
    assert out["http_status"] == 401 and out["endpoint"] is None
    assert out["answers"][-1]["phase"] == "immediate_response"
    assert cli.main(["client", "--target", server.target, "--api-key", "expired-key"]) == 1
    text = capsys.readouterr().out
    assert "immediate_response: HTTP 403" in text and text.rstrip().splitlines()[-1].startswith(
        "refused: HTTP 403"
    )


def test_no_key_at_all_is_refused_401(server, capsys):
    code, out = client_json(capsys, "--target", server.target, "--api-key", "")
    assert (code, out["http_status"]) == (1, 401)


def test_a_missing_body_file_is_one_error_line(server, tmp_path, capsys):
    argv = ["client", "--target", server.target, "--body", str(tmp_path / "nope.json")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("routecore client: error: ") and err.count("\n") == 1


def test_text_output_names_the_endpoint_header_and_metadata(server, tmp_path, capsys):
    body = tmp_path / "body.json"
    body.write_text(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
    argv = ["client", "--target", server.target, "--body", str(body), "--header", "x-trace: 7"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "request_body: CONTINUE clear_route_cache" in text
    assert "set x-gateway-destination-endpoint: 127.0.0.1:800" in text
    assert '"envoy.lb"' in text
    assert text.rstrip().splitlines()[-1].startswith("routed to 127.0.0.1:800")


def test_a_body_too_long_for_every_pool_is_refused_400(server, capsys):
    code, out = client_json(
        capsys, "--target", server.target, "--prompt", "word " * 10, "--max-tokens", "100000"
    )
    assert code == 1 and out["http_status"] == 400


def test_nothing_listening_is_said_at_once_not_after_the_timeout(capsys):
    argv = ["client", "--target", f"127.0.0.1:{free_port()}", "--timeout", "60"]
    start = time.monotonic()
    assert cli.main(argv) == 2
    assert time.monotonic() - start < 30  # the refusal, not the 60 s timeout
    err = capsys.readouterr().err
    assert err.startswith("routecore client: error: cannot connect") and err.count("\n") == 1
    assert "connection refused" in err


def test_a_server_that_accepts_and_stalls_gets_the_timeout(capsys):
    with socket.socket() as listener:  # the kernel accepts; nothing ever answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert cli.main(["client", "--target", f"127.0.0.1:{port}", "--timeout", "0.5"]) == 2
    err = capsys.readouterr().err
    assert f"cannot connect to 127.0.0.1:{port} within 0.5 s" in err


def test_wait_keeps_trying_until_a_server_starts(tmp_path, capsys):
    port = free_port()
    result: list[int] = []
    argv = ["client", "--target", f"127.0.0.1:{port}", "--wait", "60", "--json"]
    client = threading.Thread(target=lambda: result.append(cli.main(argv)))
    client.start()
    time.sleep(0.5)  # the client finds nothing listening, and keeps trying
    server = Running(tmp_path / "routecore.yaml", base_config(), port=port)
    try:
        client.join(timeout=90)
        assert result == [0]
        assert json.loads(capsys.readouterr().out)["routed"]
    finally:
        server.stop()


@pytest.mark.parametrize(
    "bad",
    [["--usage", "40"], ["--usage", "0:5"], ["--header", "novalue"], ["--max-tokens", "0"],
     ["--timeout", "-1"]],
)  # fmt: skip
def test_bad_options_are_refused_in_one_line(bad, capsys):
    assert cli.main(["client", "--target", "127.0.0.1:1", *bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("routecore client: error: ") and bad[0] in err


def test_every_client_option_has_help():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["client"]
    for action in sub._actions:
        assert action.help, action.option_strings
    assert "200" in sub.format_help() and "(default 10)" in sub.format_help()


def test_the_readmes_sample_output_is_what_client_prints(tmp_path, capsys):
    pages = "".join(page.read_text("utf-8") for page in PAGES)
    sample = r"```text\n(\$ routecore client --target 127\.0\.0\.1:9002\n.*?)```"
    text = re.search(sample, pages, re.S)
    assert text, "no client sample in README.md or docs/"
    samples = re.split(r"^\$ routecore (.*)\n", text.group(1), flags=re.M)[1:]

    def same(output: str) -> str:
        # what varies from run to run: the latency, and which of the two
        # equally free endpoints comes first
        output = re.sub(r"added latency [\d.]+ ms", "added latency X ms", output)
        return re.sub(r"127\.0\.0\.1:800[12]", "127.0.0.1:800N", output)

    # the quick start's server: init-config --no-scrape
    assert cli.main(["init-config", str(tmp_path), "--no-scrape"]) == 0
    config = yaml.safe_load((tmp_path / "routecore.yaml").read_text())
    server = Running(tmp_path / "served.yaml", config)
    try:
        capsys.readouterr()
        for command, sample in zip(samples[::2], samples[1::2]):
            argv = command.replace("127.0.0.1:9002", server.target).split()
            cli.main(argv)
            assert same(capsys.readouterr().out) == same(sample), command
    finally:
        server.stop()
