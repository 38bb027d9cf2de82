"""What the tests build from the real engine's captured answers
(tests/fixtures/vllm/, scripts/capture-vllm-fixtures) still matches them:
the mock engine's chat and completion answers, field for field, and
routecore's tokenizer of the tiny model, token for token. No engine runs here.
"""

from __future__ import annotations

import itertools
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from mock_engine import MockEngine
from tiny_model import BOS, EOS, MODEL_NAME, TEMPLATE
from tokenizer_fixtures import build_tokenizer

import routecore

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
EXCHANGES = json.loads((FIXTURES / "exchanges.json").read_text())


def shape(value: Any) -> Any:
    """Keys in order and value types, recursively (a list by its first item)."""
    if isinstance(value, dict):
        return [(k, shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [shape(v) for v in value[:1]]
    return type(value).__name__


def events(body: bytes) -> list[str]:
    """The data of each SSE event; the body must be exactly ``data: ...\\n\\n`` events."""
    parts = body.split(b"\n\n")
    assert parts[-1] == b"", body[-40:]
    assert all(p.startswith(b"data: ") for p in parts[:-1])
    return [p[6:].decode() for p in parts[:-1]]


def stream_shape(body: bytes) -> list[Any]:
    """The shapes of a stream's events, runs of one shape counted once."""
    data = events(body)
    assert data[-1] == "[DONE]"
    return [k for k, _ in itertools.groupby(shape(json.loads(d)) for d in data[:-1])]


@pytest.fixture(scope="module")
def mock():
    engine = MockEngine(model=MODEL_NAME).start()
    yield engine
    engine.close()


def post(engine: MockEngine, name: str) -> tuple[str, bytes]:
    """Sends the captured request of fixture ``name`` to the mock; its
    Content-Type and body."""
    path = EXCHANGES["responses"][name]["path"]
    request = urllib.request.Request(
        f"http://{engine.address}{path}",
        data=json.dumps(EXCHANGES["requests"][name]).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        return r.headers["content-type"], r.read()


def captured_type(name: str) -> str:
    return EXCHANGES["responses"][name]["headers"]["content-type"]


@pytest.mark.parametrize("name", ["chat.json", "completion.json"])
def test_the_mock_answers_json_as_vllm_does(mock, name) -> None:
    content_type, body = post(mock, name)
    real = json.loads((FIXTURES / name).read_bytes())
    answer = json.loads(body)
    assert content_type == captured_type(name)
    assert shape(answer) == shape(real)
    assert answer["object"] == real["object"]
    assert answer["id"].split("-")[0] == real["id"].split("-")[0]
    usage = answer["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # vLLM writes JSON without spaces.
    assert body == json.dumps(answer, separators=(",", ":"), ensure_ascii=False).encode()


@pytest.mark.parametrize(
    "name", ["chat-stream.txt", "chat-stream-no-usage.txt", "completion-stream.txt"]
)
def test_the_mock_streams_as_vllm_does(mock, name) -> None:
    content_type, body = post(mock, name)
    real = (FIXTURES / name).read_bytes()
    assert content_type == captured_type(name)
    # The same kinds of events in the same order (role, tokens, the finish
    # reason, usage), each with vLLM's fields in vLLM's order.
    assert stream_shape(body) == stream_shape(real)
    mine = [json.loads(d) for d in events(body)[:-1]]
    theirs = [json.loads(d) for d in events(real)[:-1]]
    assert [e["object"] for e in mine[:1]] == [e["object"] for e in theirs[:1]]
    assert len({e["id"] for e in mine}) == 1
    finish = [c["finish_reason"] for e in mine for c in e["choices"]]
    assert finish == [None] * (len(finish) - 1) + ["length"]
    if "usage" in theirs[-1]:
        usage = mine[-1]["usage"]
        tokens = sum(1 for e in mine for c in e["choices"] if c.get("text", c.get("delta")))
        assert usage["completion_tokens"] == tokens - (
            1 if "delta" in theirs[0]["choices"][0] else 0
        )


def test_routecore_tokenizer_reproduces_the_captured_prompt_ids(tmp_path) -> None:
    """The tiny model's tokenizer, trained again here, and its template give
    vLLM's prompt ids of the captured chat (``/tokenize`` and
    ``return_token_ids`` agree)."""
    tokenizer = routecore.Tokenizer(
        build_tokenizer(tmp_path / "tokenizer.json"), TEMPLATE, bos_token=BOS, eos_token=EOS
    )
    request = EXCHANGES["requests"]["tokenize.json"]
    tokens = json.loads((FIXTURES / "tokenize.json").read_text())["tokens"]
    with_ids = json.loads((FIXTURES / "chat-token-ids.json").read_text())
    assert with_ids["prompt_token_ids"] == tokens
    assert tokenizer.encode_chat(request["messages"]).tolist() == tokens
    chat = EXCHANGES["requests"]["chat.json"]
    assert tokenizer.encode_request(json.dumps(chat)).tolist() == tokens
    assert json.loads((FIXTURES / "chat.json").read_text())["usage"]["prompt_tokens"] == len(tokens)
