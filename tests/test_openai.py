"""parse_openai_request: the fields routing needs, read in Rust."""

import json

import pytest

from routecore import parse_openai_request


def test_chat_counts_every_text_the_model_reads():
    body = {
        "model": "llama-3-70b",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "héllo"},
                    {"type": "image_url", "image_url": {"url": "http://x"}},
                    {"type": "text", "text": "日本"},
                ],
            },
            {"role": "assistant", "content": None, "tool_calls": []},
        ],
        "max_tokens": 100,
        "stream": True,
        "user": "u-1",
    }
    p = parse_openai_request(json.dumps(body).encode())
    assert p["kind"] == "chat"
    assert p["prompt_bytes"] == len("Be brief.") + len("héllo".encode()) + len("日本".encode())
    assert (p["max_output_tokens"], p["max_tokens_given"], p["stream"]) == (100, True, True)
    assert (p["model"], p["user"], p["messages"], p["prompt_tokens"]) == (
        "llama-3-70b",
        "u-1",
        3,
        None,
    )


def test_completion_forms_and_the_default_bound():
    p = parse_openai_request('{"prompt": "abcd", "max_completion_tokens": 7, "max_tokens": 9}')
    assert (p["kind"], p["prompt_bytes"], p["max_output_tokens"]) == ("completion", 4, 7)
    p = parse_openai_request(b'{"prompt": ["ab", "cd"]}', default_max_tokens=123)
    assert (p["prompt_bytes"], p["max_output_tokens"], p["max_tokens_given"]) == (4, 123, False)
    p = parse_openai_request(b'{"prompt": [1, 2, 3]}')
    assert (p["prompt_bytes"], p["prompt_tokens"]) == (0, 3)
    assert parse_openai_request(b'{"prompt": "x"}')["max_output_tokens"] == 4096


def test_category_comes_from_the_content():
    code = "def f(x):\n    return x + 1\n\nclass A:\n    pass\n"
    body = {"messages": [{"role": "user", "content": code}]}
    assert parse_openai_request(json.dumps(body))["category"] == "code"


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"[]",
        b"null",
        b'{"model": "m"}',
        b'{"messages": {}}',
        b'{"messages": [1]}',
        b'{"messages": [{"content": 5}]}',
        b'{"messages": [{"content": [{"type": "text"}]}]}',
        b'{"messages": [{"content": [3]}]}',
        b'{"prompt": "x", "messages": []}',
        b'{"prompt": {}}',
        b'{"prompt": [1, "a"]}',
        b'{"prompt": "x", "max_tokens": 0}',
        b'{"prompt": "x", "max_tokens": -3}',
        b'{"prompt": "x", "max_tokens": 1.5}',
        b'{"prompt": "x", "max_tokens": "10"}',
        b'{"prompt": "x", "max_tokens": 99999999999}',
        b'{"prompt": "x", "stream": "yes"}',
        b'{"prompt": "x", "model": 3}',
        b'{"prompt": "x", "user": []}',
        b"[" * 10_000 + b"]" * 10_000,
    ],
)
def test_malformed_bodies_raise_value_error(body):
    with pytest.raises(ValueError):
        parse_openai_request(body)


def test_limits():
    with pytest.raises(ValueError, match="limit"):
        parse_openai_request(b" " * (64 * 2**20 + 1))
    with pytest.raises(ValueError):
        parse_openai_request(b'{"prompt": "x"}', default_max_tokens=0)
    with pytest.raises(TypeError):
        parse_openai_request(42)
