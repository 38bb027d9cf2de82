"""Exact token counts: routecore.Tokenizer against the Hugging Face `tokenizers`
package on a tokenizer trained at test time, chat templates, the token-budget
router on exact counts, and the errors at load and at request time."""

from __future__ import annotations

import asyncio
import json
import shutil

import grpc
import numpy as np
import pytest
import tokenizers
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from hypothesis import given, settings
from hypothesis import strategies as st
from mock_kv_publisher import MockKvPublisher, subscribe, synced
from server_fixtures import Running, base_config, wait_for
from tokenizer_fixtures import CHAT_TEMPLATE, WORDS, build_tokenizer, render_chatml

from routecore import (
    DataPlane,
    EndpointPicker,
    KvEventIndex,
    Pool,
    TokenBudgetRouter,
    Tokenizer,
    block_hashes,
)
from routecore.config import ConfigError, parse_config
from routecore.server.envoy_client import buffered, chat_body, http_headers, usage_body
from routecore.server.gen import routecore_pb2 as rc
from routecore.server.gen import routecore_pb2_grpc as rc_grpc


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="module")
def reference(tokenizer_path):
    return tokenizers.Tokenizer.from_file(str(tokenizer_path))


@pytest.fixture(scope="module")
def tok(tokenizer_path):
    return Tokenizer(tokenizer_path, chat_template=CHAT_TEMPLATE)


texts = st.one_of(
    st.text(max_size=300),
    st.lists(st.sampled_from(WORDS + [" ", "\n", "  ", "\t"]), max_size=200).map("".join),
)


@settings(max_examples=200, deadline=None)
@given(text=texts, special=st.booleans())
def test_encode_matches_the_tokenizers_package(tok, reference, text, special):
    expected = reference.encode(text, add_special_tokens=special).ids
    ids = tok.encode(text, add_special_tokens=special)
    assert ids.dtype == np.uint32
    assert ids.tolist() == expected
    assert tok.count(text, add_special_tokens=special) == len(expected)


def test_special_tokens_come_from_the_post_processor(tok, reference):
    bos = reference.token_to_id("<s>")
    assert tok.encode("route").tolist()[0] == bos
    assert tok.count("route") == tok.count("route", add_special_tokens=False) + 1
    assert tok.vocab_size == reference.get_vocab_size(with_added_tokens=True)


@settings(max_examples=50, deadline=None)
@given(text=texts, block_size=st.integers(1, 32))
def test_block_hashes_of_real_token_ids(tok, reference, text, block_size):
    """Prefix hashing over the tokenizer's ids (read in place) is the hashing
    of the reference ids (test_prefix checks block_hashes against xxh3)."""
    ids = tok.encode(text)
    expected = block_hashes(reference.encode(text).ids, block_size)
    assert len(expected) == len(ids) // block_size
    assert block_hashes(ids, block_size).tolist() == expected.tolist()


def test_chat_template_renders_and_counts(tok, reference):
    messages = [
        {"role": "system", "content": "route the prompt"},
        {"role": "user", "content": "count the tokens  exact\nper pool"},
    ]
    text = tok.render_chat(messages)
    assert text == render_chatml(messages)
    expected = reference.encode(text, add_special_tokens=False).ids
    assert tok.encode_chat(messages).tolist() == expected
    assert tok.count_chat(messages) == len(expected)
    # The template's markers are single special tokens.
    assert expected.count(reference.token_to_id("<|im_start|>")) == 3
    body = json.dumps({"model": "m", "messages": messages})
    assert tok.encode_request(body).tolist() == expected


def test_the_tokenizers_output_keys_the_precise_picker(tok):
    """A chat's token ids from Tokenizer.encode_chat, as an engine stored them
    (its KV events), lead a precise-prefix picker to that engine."""
    messages = [
        {"role": "system", "content": "route the prompt " * 20},
        {"role": "user", "content": "which engine holds my prefix"},
    ]
    ids = tok.encode_chat(messages)
    engine = MockKvPublisher(block_size=4, capacity_blocks=1024)
    index = KvEventIndex(block_size=4)
    try:
        subscribe(index, "e1", engine)
        engine.serve(ids.tolist())
        wait_for(synced(index, "e1", engine), what="the chat's blocks indexed")
        picker = EndpointPicker(["e0", "e1"], preset="precise-prefix", kv_index=index)
        assert picker.rank(ids, now=0.0) == ["e1", "e0"]
        # The same chat as text keys only the approximate index: no match yet.
        assert picker.rank(tok.render_chat(messages), now=0.0)[0] == "e0"
    finally:
        index.close()
        engine.close()


def test_template_sees_tools_and_python_methods(tokenizer_path):
    template = (
        "{% for m in messages %}{{ m['content'].strip().upper() }}|{% endfor %}"
        "{% if tools %}{{ tools | length }} tools: {{ tools[0]['function']['name'] }}{% endif %}"
    )
    t = Tokenizer(tokenizer_path, chat_template=template)
    tools = [{"type": "function", "function": {"name": "lookup"}}]
    assert t.render_chat([{"role": "user", "content": " hi "}], tools) == "HI|1 tools: lookup"
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    assert (
        t.encode_request(json.dumps(body)).tolist()
        == t.encode_chat(body["messages"], tools).tolist()
    )


def test_special_tokens_are_given_to_the_template(tokenizer_path, reference):
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    messages = [{"role": "user", "content": "route"}]
    assert Tokenizer(tokenizer_path, template).render_chat(messages) == "route"
    t = Tokenizer(tokenizer_path, template, bos_token="<s>", eos_token="<|im_end|>")
    assert (t.bos_token, t.eos_token) == ("<s>", "<|im_end|>")
    assert t.render_chat(messages) == "<s>route<|im_end|>"
    expected = reference.encode("<s>route<|im_end|>", add_special_tokens=False).ids
    assert t.encode_chat(messages).tolist() == expected
    assert expected[0] == reference.token_to_id("<s>")
    with pytest.raises(ValueError, match="bos_token: only with a chat_template"):
        Tokenizer(tokenizer_path, bos_token="<s>")


def test_requests_without_a_template_count_their_texts(tokenizer_path, reference):
    t = Tokenizer(tokenizer_path)
    assert t.chat_template is None
    chat = {"messages": [{"role": "user", "content": "route"}, {"role": "user", "content": " it"}]}
    assert (
        t.encode_request(json.dumps(chat)).tolist()
        == reference.encode("route it", add_special_tokens=False).ids
    )
    completion = {"prompt": "count me"}
    assert t.encode_request(json.dumps(completion)).tolist() == reference.encode("count me").ids
    assert t.encode_request(b'{"prompt": [7, 8, 9]}').tolist() == [7, 8, 9]
    with pytest.raises(ValueError, match="no chat_template"):
        t.render_chat([{"role": "user", "content": "x"}])


def test_bad_files_are_refused_at_load(tmp_path):
    for unreadable in (tmp_path / "missing.json", tmp_path):  # missing, a directory
        with pytest.raises(ValueError, match="tokenizer: cannot read"):
            Tokenizer(unreadable)
    for name, content in [("a.json", '{"hello": 1}'), ("b.json", "not json"), ("c.txt", "")]:
        (tmp_path / name).write_text(content)
        with pytest.raises(ValueError, match="not a Hugging Face tokenizer.json"):
            Tokenizer(tmp_path / name)


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}",  # does not compile
        "{{ raise_exception('roles must alternate') }}",  # fails on every conversation
        "{{ messages[0]['content'] | no_such_filter }}",
    ],
)
def test_templates_that_fail_are_refused_at_load(tokenizer_path, template):
    with pytest.raises(ValueError, match="chat_template"):
        Tokenizer(tokenizer_path, chat_template=template)


STRICT = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ raise_exception('no tool messages') }}{% endif %}{{ m['content'] }}{% endfor %}"
)


def test_template_failing_on_one_conversation_is_that_calls_error(tokenizer_path):
    t = Tokenizer(tokenizer_path, chat_template=STRICT)
    with pytest.raises(ValueError, match="no tool messages"):
        t.count_chat([{"role": "tool", "content": "x"}])
    assert t.count_chat([{"role": "user", "content": "route"}]) == t.count("route", False)
    with pytest.raises(ValueError, match="JSON-serializable"):
        t.count_chat([{"role": "user", "content": object()}])


def test_router_routes_on_the_exact_count(tok, reference):
    router = TokenBudgetRouter([Pool("short", 64), Pool("long", 4096)])
    messages = [{"role": "user", "content": "exact " * 10}]
    exact = len(reference.encode(render_chatml(messages), add_special_tokens=False).ids)
    body = json.dumps({"model": "m", "messages": messages, "max_tokens": 64 - exact})
    r = router.route_request(body, tokenizer=tok)
    assert r.decision.est_input_tokens == exact
    assert r.decision.pool == "short"  # exact + max_tokens == 64: fits
    assert r.compression is None and r.body == body.encode()
    # One token more does not fit; the estimate alone would have said otherwise.
    longer = json.dumps({"model": "m", "messages": messages, "max_tokens": 65 - exact})
    assert router.route_request(longer, tokenizer=tok).decision.pool == "long"
    estimated = router.route_request(longer).decision
    assert estimated.est_input_tokens != exact
    assert router.in_flight("short") + router.in_flight("long") == 3


def test_router_refuses_what_the_template_refuses_and_counts_nothing(tokenizer_path):
    t = Tokenizer(tokenizer_path, chat_template=STRICT)
    router = TokenBudgetRouter([Pool("p", 4096)])
    body = json.dumps({"messages": [{"role": "tool", "content": "x"}]})
    with pytest.raises(ValueError, match="no tool messages"):
        router.route_request(body, tokenizer=t)
    with pytest.raises(ValueError, match="malformed JSON"):
        router.route_request("{", tokenizer=t)
    assert router.in_flight("p") == 0


# -- the serve configuration and the data plane ------------------------------


def models_config(tokenizer_path, template_path=None, name="m") -> list[dict]:
    model = {"name": name, "tokenizer": str(tokenizer_path)}
    if template_path is not None:
        model["chat_template"] = str(template_path)
    return [model]


def test_config_models_carry_tokenizer_and_template(tokenizer_path, tmp_path):
    template = tmp_path / "chatml.jinja"
    template.write_text(CHAT_TEMPLATE)
    config = parse_config(base_config(models=models_config(tokenizer_path, template)))
    (model,) = config.models
    assert (model.name, model.tokenizer, model.chat_template) == (
        "m",
        str(tokenizer_path),
        CHAT_TEMPLATE,
    )
    spec = json.loads(config.spec_json())
    assert spec["models"] == [
        {
            "name": "m",
            "tokenizer": str(tokenizer_path),
            "chat_template": CHAT_TEMPLATE,
            "bos_token": None,
            "eos_token": None,
        }
    ]
    assert json.loads(parse_config(base_config()).spec_json())["models"] == []


def test_config_errors_name_the_model_key(tokenizer_path, tmp_path):
    bad_template = tmp_path / "bad.jinja"
    bad_template.write_text("{% for m in messages %}")
    not_a_tokenizer = tmp_path / "not.json"
    not_a_tokenizer.write_text('{"hello": 1}')
    cases = [
        (models_config(tmp_path / "missing.json"), r"models\[0\]\.tokenizer: cannot read"),
        (models_config(not_a_tokenizer), r"models\[0\]\.tokenizer: .* not a Hugging Face"),
        (models_config(tokenizer_path, bad_template), r"models\[0\]\.chat_template: "),
        (
            models_config(tokenizer_path, tmp_path / "nope.jinja"),
            r"models\[0\]\.chat_template: cannot read",
        ),
        ([{"name": "m"}], r"models\[0\]\.tokenizer: required"),
        ([{"name": "m", "tokenizer": str(tokenizer_path), "x": 1}], r"models\[0\]\.x: unknown"),
        (models_config(tokenizer_path) * 2, r"models\[1\]\.name: expected a unique"),
        (
            [{**models_config(tokenizer_path)[0], "bos_token": "<s>"}],
            r"models\[0\]\.bos_token: only with a chat_template",
        ),
    ]
    for models, message in cases:
        with pytest.raises(ConfigError, match=message):
            parse_config(base_config(models=models))


@pytest.mark.parametrize("inline_bytes", [0, 1 << 30], ids=["handed-off", "inline"])
def test_serve_routes_on_the_tokenizers_count(tokenizer_path, reference, tmp_path, inline_bytes):
    """End to end: with a tokenizer configured for model "m", a request's routed
    input tokens are the tokenizer's count of its rendered chat; another model's
    request, and one the template refuses, are estimated (the refusal is logged
    and counted), and the server keeps routing; alike whether the data plane
    tokenizes inline or on its blocking pool."""
    template = tmp_path / "strict.jinja"
    template.write_text("{{ bos_token }}" + STRICT)
    models = models_config(tokenizer_path, template)
    models[0]["bos_token"] = "<|im_start|>"
    config = base_config(
        models=models,
        router={"policy": "prefix", "prefix_block_size": 4},
        limits={"tokenize_inline_bytes": inline_bytes},
    )
    server = Running(tmp_path / "routecore.yaml", config)
    try:
        check_exact_routing(server, reference)
    finally:
        server.stop()


def check_exact_routing(server: Running, reference) -> None:
    text = "exact token counts per pool " * 20
    with grpc.insecure_channel(server.api_target) as channel:
        stub = rc_grpc.RouteCoreStub(channel)

        def route(body: bytes):
            resp = stub.Route(rc.RouteRequest(body=body, api_key="demo-key"))
            assert resp.admission.admitted
            stub.Feedback(rc.FeedbackRequest(request_id=resp.request_id, api_key="demo-key"))
            return resp

        exact = len(reference.encode("<|im_start|>" + text, add_special_tokens=False).ids)
        assert exact < len(text) // 4  # the estimate would differ
        resp = route(chat_body(text, 50))
        assert (resp.est_input_tokens, resp.est_output_tokens) == (exact, 50)
        other = json.loads(chat_body(text, 50))
        other["model"] = "other"
        assert route(json.dumps(other).encode()).est_input_tokens == len(text) // 4
        refused = json.loads(chat_body(text, 50))
        refused["messages"][0]["role"] = "tool"
        assert route(json.dumps(refused).encode()).est_input_tokens == len(text) // 4
        assert server.metric("tokenize_skipped") == 1
        assert route(chat_body(text, 50)).est_input_tokens == exact
    assert server.metric("tokenize_skipped") == 1


def test_the_data_plane_uses_the_tokenizers_the_config_loaded(tokenizer_path, reference, tmp_path):
    """Each tokenizer file is read once, when the configuration is validated:
    the data plane is handed the loaded tokenizer, so it counts exactly even
    when the file is gone by the time it starts. Without the hand-over it
    reads the file itself, and its error names the model's key."""
    path = tmp_path / "tokenizer.json"
    shutil.copy(tokenizer_path, path)
    template = tmp_path / "chatml.jinja"
    template.write_text(CHAT_TEMPLATE)
    config = parse_config(base_config(models=models_config(path, template)))
    path.unlink()
    text = "count the prompt once " * 10
    rendered = render_chatml([{"role": "user", "content": text}])
    exact = len(reference.encode(rendered, add_special_tokens=False).ids)
    plane = DataPlane.start(config.spec_json(), tokenizers=config.tokenizers())
    try:
        routed = plane.route_body(chat_body(text, 50))
        assert routed["est_input_tokens"] == exact  # the estimate is len(text) // 4
        plane.finish(routed["request_id"])
        with pytest.raises(ValueError, match='tokenizers: "x" is not a model'):
            plane.reload(config.spec_json(), tokenizers={"x": config.tokenizers()["m"]})
        with pytest.raises(ValueError, match=r"models\[0\]\.tokenizer: cannot read"):
            plane.reload(config.spec_json())
        assert plane.route_body(chat_body(text, 50))["est_input_tokens"] == exact
    finally:
        plane.drain(0)
    with pytest.raises(ValueError, match=r"models\[0\]\.tokenizer: cannot read"):
        DataPlane.start(config.spec_json())


def test_a_long_prompt_being_tokenized_does_not_hold_the_worker(tokenizer_path, tmp_path):
    """One data-plane worker thread: while a prompt of about 400K tokens is
    tokenized (off the worker), a short request on another stream is routed
    and answered: its whole conversation ends before the long one is routed.
    Tokenized inline, it would wait."""
    template = tmp_path / "chatml.jinja"
    template.write_text(CHAT_TEMPLATE)
    config = parse_config(
        base_config(
            limits={"max_body_bytes": 4 << 20},
            pools=[{"name": "short", "max_context": 1 << 24, "endpoints": ["127.0.0.1:8001"]}],
            models=models_config(tokenizer_path, template),
        )
    )
    plane = DataPlane.start(config.spec_json(), worker_threads=1, tokenizers=config.tokenizers())
    target = f"127.0.0.1:{plane.port}"
    headers = {"x-api-key": "demo-key"}
    long_text = "the request router counts every token of a long prompt " * 40_000
    finished: list[str] = []

    async def short() -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            conv = await buffered(stub, headers, chat_body("hello", 10), [usage_body(10, 1)])
            assert conv.routing is not None, conv.responses
            finished.append("short")

    async def long() -> None:
        """Headers, then the long body; the short conversation starts once the
        body is written (gRPC flow control: the server has read all but a
        window of it, so its tokenization is about to start, not over)."""
        async with grpc.aio.insecure_channel(target) as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(pb.ProcessingRequest(request_headers=http_headers(headers)))
            await call.read()
            body = pb.HttpBody(body=chat_body(long_text, 10), end_of_stream=True)
            await call.write(pb.ProcessingRequest(request_body=body))
            other = asyncio.create_task(short())
            routed = await call.read()
            assert routed.request_body.response.header_mutation.set_headers, routed
            finished.append("long")
            call.cancel()
            await other

    try:
        asyncio.run(long())
    finally:
        plane.drain(1)
    assert finished == ["short", "long"]
