"""Exact token counts: a 4K-token chat prompt tokenized in Rust
(`routecore.Tokenizer`, chat template rendered with minijinja) beside the
bytes-per-token estimate and the plain-Python reference (the `tokenizers`
package's `encode` after rendering in Python), same run.

The tokenizer is a byte-level BPE trained at bench time on a small synthetic
corpus (no download), so absolute times are for its vocabulary, not a
production one; the ratios are the point.

Run: .venv/bin/python -m pytest benches/bench_tokenize.py
"""

import json

import pytest

from routecore import Calibrator, Pool, TokenBudgetRouter, Tokenizer
from routecore._baselines.tokenize import ReferenceCounter
from tests.tokenizer_fixtures import CHAT_TEMPLATE, build_tokenizer, corpus

PROMPT_TOKENS = 4096


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """The tokenizer, its reference, and a chat of about 4K tokens."""
    path = build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", 2000, 5000)
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
