"""Exact token counts: a 4K-token chat prompt tokenized in Rust
(`routecore.Tokenizer`, chat template rendered with minijinja) beside the
bytes-per-token estimate and the plain-Python reference (the `tokenizers`
package's `encode` after rendering in Python), same run; and what handing the
tokenizing to another thread (the data plane's blocking pool) costs a routed
request, by prompt size, beside tokenizing it inline.

The tokenizer is a byte-level BPE trained at bench time on a small synthetic
corpus (no download), so absolute times are for its vocabulary, not a
production one; the ratios are the point.

Run: .venv/bin/python -m pytest benches/bench_tokenize.py
"""

import json

import pytest

from routecore import Calibrator, DataPlane, Pool, TokenBudgetRouter, Tokenizer
from routecore._baselines.tokenize import ReferenceCounter
from routecore.config import parse_config
from tests.tokenizer_fixtures import CHAT_TEMPLATE, build_tokenizer, corpus

PROMPT_TOKENS = 4096


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", 2000, 5000)


@pytest.fixture(scope="module")
def chat(tokenizer_path):
    """The tokenizer, its reference, and a chat of about 4K tokens."""
    path = tokenizer_path
    tok = Tokenizer(path, chat_template=CHAT_TEMPLATE)
    lines, messages = corpus(2000, seed=1), [{"role": "system", "content": "Route well."}]
    user = ""
    for line in lines:
        user += line + "\n"
        if tok.count_chat(messages + [{"role": "user", "content": user}]) >= PROMPT_TOKENS:
            break
    messages.append({"role": "user", "content": user})
    reference = ReferenceCounter(path)
    assert tok.count_chat(messages) == reference.count_chat(messages) >= PROMPT_TOKENS
    return tok, reference, messages


@pytest.mark.benchmark(group="count a 4K-token chat prompt")
def test_count_chat_routecore(benchmark, chat):
    tok, reference, messages = chat
    assert benchmark(tok.count_chat, messages) == reference.count_chat(messages)


@pytest.mark.benchmark(group="count a 4K-token chat prompt")
def test_count_chat_tokenizers_package(benchmark, chat):
    tok, reference, messages = chat
    assert benchmark(reference.count_chat, messages) == tok.count_chat(messages)


@pytest.mark.benchmark(group="count a 4K-token chat prompt")
def test_bytes_per_token_estimate(benchmark, chat):
    _, _, messages = chat
    calibrator = Calibrator()
    nbytes = sum(len(m["content"].encode()) for m in messages)
    assert benchmark(calibrator.estimate_tokens, nbytes, "prose") == -(-nbytes // 4)


def body_and_router(messages):
    body = json.dumps({"model": "m", "messages": messages, "max_tokens": 256}).encode()
    return body, TokenBudgetRouter([Pool("short", 8192), Pool("long", 65536)])


@pytest.mark.benchmark(group="route_request: a 4K-token chat body")
def test_route_request_exact(benchmark, chat):
    tok, _, messages = chat
    body, router = body_and_router(messages)
    r = benchmark(router.route_request, body, tokenizer=tok)
    assert r.decision.est_input_tokens == tok.count_chat(messages)


@pytest.mark.benchmark(group="route_request: a 4K-token chat body")
def test_route_request_estimate(benchmark, chat):
    _, _, messages = chat
    body, router = body_and_router(messages)
    assert benchmark(router.route_request, body).decision.pool == "short"


#: Prompt sizes (tokens) for the hand-off bench: a one-line question, a
#: paragraph, a page, the 4K chat.
HANDOFF_TOKENS = [16, 64, 256, 1024, PROMPT_TOKENS]


@pytest.fixture(scope="module")
def planes(tokenizer_path, tmp_path_factory):
    """Two data planes for model "m" with the tokenizer: one tokenizing every
    body inline, one handing every body to its blocking pool."""
    template = tmp_path_factory.mktemp("tpl") / "chatml.jinja"
    template.write_text(CHAT_TEMPLATE)
    started = {}
    for mode, inline_bytes in (("inline", 1 << 40), ("handed off", 0)):
        config = parse_config(
            {
                "pools": [{"name": "short", "max_context": 65536, "endpoints": ["127.0.0.1:8001"]}],
                "scrape": {"enabled": False},
                "limits": {"tokenize_inline_bytes": inline_bytes},
                "models": [
                    {"name": "m", "tokenizer": str(tokenizer_path), "chat_template": str(template)}
                ],
            }
        )
        started[mode] = DataPlane.start(
            config.spec_json(), worker_threads=1, tokenizers=config.tokenizers()
        )
    yield started
    for plane in started.values():
        plane.drain(0)


def chat_of(tok, tokens: int) -> list[dict[str, str]]:
    """A one-message chat of about ``tokens`` tokens (template included)."""
    words = " ".join(corpus(4000, seed=2)).split()
    lo, hi = 1, len(words)
    while lo < hi:  # the fewest words that reach `tokens`
        mid = (lo + hi) // 2
        if tok.count_chat([{"role": "user", "content": " ".join(words[:mid])}]) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    return [{"role": "user", "content": " ".join(words[:lo])}]


@pytest.mark.parametrize("tokens", HANDOFF_TOKENS)
@pytest.mark.parametrize("mode", ["inline", "handed off"])
@pytest.mark.benchmark(group="DataPlane.route_body + finish: tokenized inline or handed off")
def test_route_body_tokenized(benchmark, chat, planes, mode, tokens):
    tok = chat[0]
    messages = chat_of(tok, tokens)
    body = json.dumps({"model": "m", "messages": messages, "max_tokens": 16}).encode()
    plane = planes[mode]

    def route_and_finish():
        routed = plane.route_body(body)
        plane.finish(routed["request_id"])
        return routed

    routed = benchmark(route_and_finish)
    assert routed["est_input_tokens"] == tok.count_chat(messages)
    benchmark.extra_info["body_bytes"] = len(body)
