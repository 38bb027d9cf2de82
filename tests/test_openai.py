"""parse_openai_request: the fields routing needs, read in Rust."""

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routecore import Compressor, Pool, TokenBudgetRouter, parse_openai_request


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


# --- what the estimate covers: tools, tool calls, schemas, media, n (issue 12) ---


def big_tool_schema(target_bytes: int = 86_000) -> list[dict]:
    """Function tools whose compact JSON is about ``target_bytes`` long."""
    tools = []
    while len(json.dumps(tools, separators=(",", ":"))) < target_bytes:
        i = len(tools)
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": f"lookup_record_{i}",
                    "description": f"Looks up record kind {i} by its key and returns its fields.",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            f"field_{j}": {"type": "string", "description": f"filter {j} of {i}"}
                            for j in range(8)
                        },
                        "required": ["field_0"],
                    },
                },
            }
        )
    return tools


def chat(content="hi", **fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], **fields}).encode()


def two_pools() -> TokenBudgetRouter:
    return TokenBudgetRouter([Pool("short", 8192), Pool("long", 65536)])


def test_a_big_tool_schema_is_counted_and_routed_to_a_pool_that_fits_it():
    tools = big_tool_schema()
    body = chat(tools=tools, max_tokens=256)
    assert len(body) > 86_000
    schema = json.dumps(tools, separators=(",", ":"))
    assert parse_openai_request(body)["prompt_bytes"] == len("hi") + len(schema)
    d = two_pools().route_request(body).decision
    # Today's count was "hi" alone: 1 token + 256, the 8K pool.
    assert d.est_input_tokens >= len(schema) / 4.0
    assert d.est_total_tokens > 8192 and d.pool == "long"


def test_tool_calls_tool_results_and_untyped_parts_are_counted():
    arguments = json.dumps({"city": "Paris", "days": 3})
    body = {
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "forecast", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": [{"text": "sunny, 21 C"}]},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no more"}]},
        ]
    }
    p = parse_openai_request(json.dumps(body))
    calls = len("call_1") + len("function") + len("forecast") + len(arguments)
    assert p["prompt_bytes"] == len("weather?") + calls + len("sunny, 21 C") + len("no more")


def test_response_format_and_functions_are_counted_as_their_json():
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}
    functions = [{"name": "f", "parameters": {"type": "object"}}]
    p = parse_openai_request(chat("hi", response_format=fmt, functions=functions))
    compact = [json.dumps(x, separators=(",", ":")) for x in (functions, fmt)]
    assert p["prompt_bytes"] == 2 + sum(map(len, compact))


def test_image_and_audio_parts_cost_a_configurable_number_of_tokens():
    parts = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 50_000}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ]
    body = chat(parts, max_tokens=10)
    p = parse_openai_request(body)
    assert (p["prompt_bytes"], p["media_tokens"]) == (len("what is this?"), 2 * 765 + 750)
    p = parse_openai_request(body, image_tokens=1000, audio_tokens=0)
    assert p["media_tokens"] == 2000
    r = TokenBudgetRouter([Pool("short", 2048), Pool("long", 65536)])
    assert r.route_request(body).decision.pool == "long"  # 2,280 media tokens
    routed = r.route_request(body, image_tokens=85, audio_tokens=100)
    assert routed.media_tokens == 270 and routed.decision.pool == "short"
    assert routed.decision.est_input_tokens == r.calibrator.estimate_tokens(13, "prose") + 270
    for bad in ({"image_tokens": -1}, {"audio_tokens": 2**31}):
        with pytest.raises(ValueError, match="_tokens must be in"):
            parse_openai_request(body, **bad)
        with pytest.raises(ValueError, match="_tokens must be in"):
            r.route_request(body, **bad)


def test_n_and_best_of_multiply_the_output_bound():
    p = parse_openai_request(chat("hi", n=4, max_tokens=3000))
    assert (p["n"], p["max_output_tokens"]) == (4, 12_000)
    assert parse_openai_request(b'{"prompt": "x", "best_of": 3}')["max_output_tokens"] == 3 * 4096
    d = two_pools().route_request(chat("hi", n=4, max_tokens=3000)).decision
    assert d.est_output_tokens == 12_000 and d.pool == "long"
    for bad in ({"n": 0}, {"n": 129}, {"n": "2"}, {"best_of": -1}, {"n": 2, "max_tokens": 2**30}):
        with pytest.raises(ValueError):
            parse_openai_request(chat("hi", **bad))


def test_compression_rewrites_message_prose_never_tool_schemas():
    prose = " ".join(f"Sentence {i} is about topic{i % 7} and topic{i % 5}." for i in range(285))
    tools = big_tool_schema(4_000)
    body = {
        "messages": [
            {"role": "user", "content": prose},
            {"role": "user", "content": "Summarise the document above."},
        ],
        "tools": tools,
        "max_tokens": 512,
    }
    raw = json.dumps(body).encode()
    router = TokenBudgetRouter([Pool("short", 4096), Pool("long", 65536)], compress_band=1.5)
    est = parse_openai_request(raw)["prompt_bytes"] / 4.0
    # Over the short pool only with the schema counted, and within the band.
    assert (len(prose) + 29) / 4.0 + 512 <= 4096 < est + 512 <= 1.5 * 4096
    routed = router.route_request(raw, Compressor())
    d = routed.decision
    assert (d.pool, d.action) == ("short", "compress")
    sent = json.loads(routed.body)
    assert sent["tools"] == tools and sent["messages"][1] == body["messages"][1]
    assert len(sent["messages"][0]["content"]) < len(prose)
    after = router.calibrator.estimate_tokens(
        parse_openai_request(routed.body)["prompt_bytes"], "prose"
    )
    assert after + 512 <= 4096


_part = st.one_of(
    st.text(max_size=40).map(lambda t: {"type": "text", "text": t}),
    st.text(max_size=40).map(lambda t: {"text": t}),
    st.just({"type": "image_url", "image_url": {"url": "x"}}),
    st.just({"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}),
)
_tool = st.dictionaries(st.text(max_size=8), st.text(max_size=30), max_size=4).map(
    lambda props: {"type": "function", "function": {"name": "f", "parameters": props}}
)


@settings(max_examples=150, deadline=None)
@given(
    parts=st.lists(_part, max_size=5),
    tools=st.lists(_tool, max_size=3),
    extra_part=_part,
    extra_tool=_tool,
)
def test_the_estimate_never_falls_when_parts_or_tools_are_added(
    parts, tools, extra_part, extra_tool
):
    def estimate(parts, tools):
        body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 1}
        if tools:
            body["tools"] = tools
        p = parse_openai_request(json.dumps(body))
        # A fresh calibrator: every category at its cold-start ratio.
        d = two_pools().route_request(json.dumps(body)).decision
        return p["prompt_bytes"], p["media_tokens"], d.est_input_tokens

    before = estimate(parts, tools)
    for more in (estimate(parts + [extra_part], tools), estimate(parts, tools + [extra_tool])):
        assert all(m >= b for m, b in zip(more, before))
    assert estimate(copy.deepcopy(parts), tools) == before


def test_the_server_routes_and_admits_a_tool_heavy_request_on_the_whole_estimate(tmp_path):
    pytest.importorskip("grpc")
    from server_fixtures import Running, admission, base_config, tenants

    from routecore.config import ConfigError, parse_config

    config = base_config(
        limits={"image_tokens": 1000, "audio_tokens": 10},
        admission=admission(10),
        tenants=tenants(),
    )
    server = Running(tmp_path / "routecore.yaml", config)
    try:
        plane = server.server.plane
        image = {"type": "image_url", "image_url": {"url": "x"}}
        body = chat([image, {"type": "text", "text": "hi"}], tools=big_tool_schema())
        lease = plane.route_body(body, b"demo-key")  # the data plane, admission included
        assert lease["admitted"] and lease["pool"] == "long"
        routed = TokenBudgetRouter([Pool("s", 8192), Pool("l", 65536)]).route_request(
            body, image_tokens=1000
        )
        est = (routed.decision.est_input_tokens, routed.decision.est_output_tokens)
        assert (lease["est_input_tokens"], lease["est_output_tokens"]) == est
        assert routed.media_tokens == 1000
        assert plane.in_flight()["admission"] == 1
        # A request with an image part is not learned from (its usage is not text).
        assert plane.finish(lease["request_id"], 30_000, 5)
        assert plane.calibrator.count("prose") == 0
    finally:
        server.stop()
    for key, value in (("image_tokens", -1), ("audio_tokens", 2**31), ("image_tokens", "765")):
        with pytest.raises(ConfigError, match=f"limits.{key}"):
            parse_config(base_config(limits={key: value}))
