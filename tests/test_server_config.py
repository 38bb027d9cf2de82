"""The serve configuration, the checked-in stubs and the example Envoy configuration."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401 - registers the type
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from envoy.extensions.load_balancing_policies.override_host.v3 import (  # noqa: F401 - the types
    override_host_pb2,
)
from envoy.extensions.load_balancing_policies.round_robin.v3 import round_robin_pb2  # noqa: F401
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2  # noqa: F401
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from google.protobuf import json_format
from server_fixtures import base_config

from routecore.config import ConfigError, find_tenant, load_config, parse_config

ROOT = Path(__file__).resolve().parent.parent
ENTITLEMENT = {
    "name": "e",
    "tenant": "demo",
    "quota": "gpu",
    "service_class": "spot",
    "slo_target_ms": 1000.0,
    "tokens_per_s": 10.0,
    "kv_bytes": 1,
    "concurrency": 1,
}


def test_example_config_loads():
    config = load_config(ROOT / "examples/routecore.yaml")
    assert [(p.name, p.max_context) for p in config.pools] == [("short", 8192), ("long", 65536)]
    assert all(e.startswith("127.0.0.1:") for p in config.pools for e in p.endpoints)
    assert config.server.key_header == "x-api-key"
    assert find_tenant(config.key_index(), "demo-key").name == "demo"
    assert find_tenant(config.key_index(), "demo-kez") is None
    assert "demo-key" not in repr(config)
    # The defaults a user gets: endpoints scraped, prefix + queue + KV use.
    assert config.router.policy == "prefix+queue+kv"
    assert config.scrape.enabled and config.scrape.interval_s == 0.05
    assert parse_config({"pools": [{"name": "p", "max_context": 10}]}).router.policy == (
        "prefix+queue+kv"
    )


def test_custom_engine_metric_names_reach_the_data_plane():
    import json

    config = base_config(
        scrape={
            "engines": {
                "tgi": {
                    "waiting": ["tgi_queue_size"],
                    "running": ["tgi_batch"],
                    "kv_usage": ["tgi_kv"],
                }
            }
        },  # fmt: skip
    )
    config["pools"][0]["engine"] = "tgi"
    spec = json.loads(parse_config(config).spec_json())
    assert spec["pools"][0]["engine"] == "tgi"
    assert spec["scrape"]["engines"]["tgi"]["adapters"] is None
    assert spec["scrape"]["engines"]["vllm"]["kv_usage"][1] == "vllm:gpu_cache_usage_perc"


def bad(path: str, value):
    """base_config with the value at a dotted path (list indices as numbers) replaced."""
    config = base_config()
    *parents, last = path.split(".")
    node = config
    for p in parents:
        node = node[int(p)] if p.isdigit() else node.setdefault(p, {})
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return config


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (bad("server.port", -1), "server.port"),
        (bad("server.failure_mode", "sideways"), "server.failure_mode"),
        (bad("server.default_pool", "medium"), "server.default_pool"),
        (bad("server.colour", "red"), "server.colour: unknown key"),
        (bad("limits.max_body_bytes", 0), "limits.max_body_bytes"),
        (bad("limits.request_timeout_s", float("nan")), "limits.request_timeout_s"),
        (bad("limits.max_body_bytes", True), "limits.max_body_bytes"),
        (bad("router.policy", "fastest"), "router.policy"),
        (bad("admission.backend", "redis"), "admission.redis.url"),
        (bad("pools", []), "pools: at least one pool"),
        (bad("pools.0.max_context", "big"), "pools[0].max_context"),
        (bad("pools.0.budget", 10_000), 'pools[0]: pool "short": budget 10000 exceeds'),
        (bad("pools.1.name", "short"), "pools[1].name"),
        (bad("pools.0.endpoints", ["127.0.0.1"]), "pools[0].endpoints[0]"),
        (bad("pools.0.endpoints", ["127.0.0.1:99999"]), "pools[0].endpoints[0]"),
        (bad("pools.0.endpoints", ["127.0.0.1:1", "127.0.0.1:1"]), "listed twice"),
        (bad("tenants.0.api_keys", []), "tenants[0].api_keys"),
        (bad("tenants.0.api_keys", ["short"]), "tenants[0].api_keys[0]"),
        (bad("tenants.1.api_keys", ["demo-key"]), "tenants[1].api_keys[0]: key already"),
        (bad("tenants.0.expires_at", "soon"), "tenants[0].expires_at"),
        (bad("tenants.0.entitlement", 5), "tenants[0].entitlement"),
        ([1, 2], "config: expected a mapping"),
        (
            bad("admission.entitlements", [{**ENTITLEMENT, "service_class": "gold"}]),
            "admission.entitlements[0]: service_class must be one of",
        ),
        (bad("admission.entitlements", [ENTITLEMENT]), "admission: "),  # no quota "gpu"
        (bad("admission.quotas", [{"name": "gpu"}]), "admission.quotas[0]"),
        (bad("admission.pools", []), "admission.pools: renamed to 'quotas'"),
        (
            bad("admission.entitlements", [{**ENTITLEMENT, "pool": "gpu"}]),
            "admission.entitlements[0].pool: renamed to 'quota'",
        ),
        (bad("admission.redis", {"host": "x"}), "admission.redis.host: unknown key"),
        (bad("scrape.interval_s", 0), "scrape.interval_s"),
        (bad("scrape.timeout_s", float("nan")), "scrape.timeout_s"),
        (bad("scrape.unhealthy_after", 0), "scrape.unhealthy_after"),
        (bad("scrape.enabled", "yes"), "scrape.enabled"),
        (bad("scrape.max_page_bytes", 10), "scrape.max_page_bytes"),
        (bad("scrape.max_series", 0), "scrape.max_series"),
        (
            bad("scrape.engines", {"tgi": {"waiting": ["q"]}}),
            "scrape.engines.tgi.running: required",
        ),
        (bad("scrape.engines", {"vllm": {"waiting": []}}), "scrape.engines.vllm.waiting"),
        (bad("scrape.engines", {"vllm": {"adapters": 5}}), "scrape.engines.vllm.adapters"),
        (bad("scrape.engines", [1]), "scrape.engines: expected a mapping"),
        (bad("pools.0.engine", "tgi"), "pools[0].engine"),
        (bad("pools.0.models", ["m", "m"]), "pools[0].models: a name is listed twice"),
        (bad("pools.0.adapters", [""]), "pools[0].adapters[0]"),
        (bad("router.fallbacks", -1), "router.fallbacks"),
        (bad("router.saturation", {"max_kv_usage": 2}), "router.saturation.max_kv_usage"),
        (bad("router.objectives", {"batch": "low"}), "router.objectives.batch"),
        (bad("router.objectives", {"": 1}), "router.objectives"),
    ],
)
def test_bad_config_names_the_key_and_never_the_api_key(config, message):
    with pytest.raises(ConfigError) as e:
        parse_config(config)
    assert message in str(e.value)
    assert "demo-key" not in str(e.value)


def test_load_config_reports_file_and_yaml_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("pools: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    path.write_text("pools: []\n")
    with pytest.raises(ConfigError, match=f"{path}: pools"):
        load_config(path)


def test_checked_in_stubs_are_current(tmp_path):
    gen = ROOT / "python/routecore/server/gen"
    subprocess.run(["bash", str(ROOT / "scripts/gen-proto"), str(tmp_path)], check=True)
    for name in ("routecore_pb2.py", "routecore_pb2.pyi", "routecore_pb2_grpc.py"):
        assert (tmp_path / name).read_text() == (gen / name).read_text(), (
            f"{name} is stale: run bash scripts/gen-proto"
        )


@pytest.mark.parametrize("name", ["envoy.yaml", "envoy-full-duplex.yaml", "envoy-fail-open.yaml"])
def test_example_envoy_config_parses_with_xds_protos_and_matches_routecore_yaml(name):
    # (Envoy 1.40 itself validates them: tests/test_envoy.py; the xds-protos
    # package may predate a field, e.g. override_host's selected_host_key.)
    raw = yaml.safe_load((ROOT / "examples" / name).read_text())
    bootstrap = json_format.ParseDict(raw, bootstrap_pb2.Bootstrap(), ignore_unknown_fields=True)
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    bootstrap.static_resources.listeners[0].filter_chains[0].filters[0].typed_config.Unpack(hcm)
    names = [f.name for f in hcm.http_filters]
    assert names == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    ext_proc = ext_proc_pb2.ExternalProcessor()
    assert hcm.http_filters[0].typed_config.Unpack(ext_proc)
    mode = ext_proc.processing_mode
    modes = processing_mode_pb2.ProcessingMode
    assert mode.request_header_mode == modes.SEND
    if name == "envoy.yaml":  # fail closed; header mutations only, no echo
        assert mode.request_body_mode == modes.STREAMED and not ext_proc.failure_mode_allow
        assert ext_proc.send_body_without_waiting_for_header_response
        assert mode.response_header_mode == modes.SKIP
        assert mode.response_body_mode == modes.STREAMED
    elif name == "envoy-full-duplex.yaml":  # fail closed, the GIE's streaming mode
        assert mode.request_body_mode == modes.FULL_DUPLEX_STREAMED
        assert mode.request_trailer_mode == modes.SEND and not ext_proc.failure_mode_allow
        assert mode.response_body_mode == modes.FULL_DUPLEX_STREAMED
    else:  # fail open: Envoy honours failure_mode_allow only with these
        assert mode.request_body_mode == modes.BUFFERED and ext_proc.failure_mode_allow
        assert mode.response_body_mode == modes.FULL_DUPLEX_STREAMED
    # routecore's envoy.lb metadata reaches the load balancer, and comes back.
    metadata = ext_proc.metadata_options
    assert list(metadata.receiving_namespaces.untyped) == ["envoy.lb"]
    assert list(metadata.forwarding_namespaces.untyped) == ["envoy.lb"]
    clusters = {c.name: c for c in bootstrap.static_resources.clusters}
    grpc_cluster = clusters[ext_proc.grpc_service.envoy_grpc.cluster_name]
    options = http_protocol_options_pb2.HttpProtocolOptions()
    grpc_cluster.typed_extension_protocol_options[
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ].Unpack(options)
    assert options.explicit_http_config.HasField("http2_protocol_options")
    routecore = load_config(ROOT / "examples/routecore.yaml")
    listener = bootstrap.static_resources.listeners[0]
    assert listener.per_connection_buffer_limit_bytes.value == routecore.limits.max_body_bytes
    route = hcm.route_config.virtual_hosts[0].routes[0]
    assert list(route.request_headers_to_remove) == [routecore.server.key_header]
    assert route.route.retry_policy.num_retries.value == routecore.router.fallbacks
    assert route.route.timeout.seconds == routecore.limits.request_timeout_s
    upstream = clusters[route.route.cluster]
    assert upstream.type == cluster_pb2.Cluster.STATIC
    (policy,) = upstream.load_balancing_policy.policies
    assert policy.typed_extension_config.name == "envoy.load_balancing_policies.override_host"


def test_serve_command_reports_a_bad_config(tmp_path, capsys):
    from routecore.cli import main

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad("pools.0.max_context", 0)))
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "routecore serve: error:" in err and "pools[0].max_context" in err


def test_config_never_imports_the_server_package():
    # Loading and checking a configuration (the control plane's first step,
    # also used by `routecore serve --check`) needs no gRPC server code.
    code = (
        "import sys\n"
        "from routecore.config import load_config\n"
        f"load_config({str(ROOT / 'examples/routecore.yaml')!r}).spec_json()\n"
        "print(sorted(m for m in sys.modules if m.startswith('routecore.server')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_token_limits_are_the_cores():
    # One MAX_TOKENS: the router's, refused alike by the configuration.
    from routecore import _core
    from routecore.admission import MAX_TOKENS

    assert MAX_TOKENS is _core.MAX_TOKENS
    raw = base_config()
    raw["pools"][0]["max_context"] = _core.MAX_TOKENS + 1
    with pytest.raises(ConfigError, match=f"{_core.MAX_TOKENS}"):
        parse_config(raw)
    raw["pools"][0]["max_context"] = _core.MAX_TOKENS
    parse_config(raw)


# -- YAML errors never show the file's text (issue 22, item 9) -------------------------

SECRET = "sk-live-0123456789abcdef"
CONFIG_TEXT = """\
scrape: {enabled: false}
pools:
  - {name: short, max_context: 8192, endpoints: ["127.0.0.1:8001"]}
tenants:
  - name: demo
    API_KEYS
"""
#: Syntax errors on or next to the ``api_keys`` line (each quoted PyYAML's
#: snippet, or a name from the line, with the key in clear).
BROKEN_KEYS = {
    "missing closing quote": f'api_keys: ["{SECRET}]',
    "missing closing single quote": f"api_keys: ['{SECRET}",
    "bad indent": f"api_keys:\n      - {SECRET}\n     - other-key-1234",
    "tab": f"api_keys:\n\t- {SECRET}",
    "tab after the value": f"api_keys: [{SECRET}]\t\n  x: y",
    "duplicate key": f'api_keys: ["{SECRET}"]\n    api_keys: ["other-key-1234"]',
    "mapping in a value": f"api_keys: {SECRET}: x",
    "unclosed flow": f"api_keys: [{SECRET}, {{]",
    "alias": f"api_keys: [*{SECRET}]",
    "tag": f"api_keys: [!{SECRET} x]",
}


@pytest.mark.parametrize("variant", sorted(BROKEN_KEYS))
def test_a_yaml_error_next_to_a_key_never_shows_it(tmp_path, capsys, variant):
    from routecore.cli import main

    path = tmp_path / "c.yaml"
    path.write_text(CONFIG_TEXT.replace("API_KEYS", f'api_keys: ["{SECRET}"]'))
    assert load_config(path).tenants[0].name == "demo"  # the file is good but for the error
    path.write_text(CONFIG_TEXT.replace("API_KEYS", BROKEN_KEYS[variant]))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    message = str(e.value)
    assert "not valid YAML" in message and re.search(r"line \d+, column \d+", message)
    assert SECRET not in message and SECRET[:8] not in message, message
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no chained snippet
    # The start error of `routecore serve`.
    assert main(["serve", "--config", str(path)]) == 2
    out = capsys.readouterr()
    assert "not valid YAML" in out.err and SECRET not in out.err + out.out


def test_a_reload_into_a_yaml_error_next_to_a_key_never_logs_it(serve, caplog):
    s = serve()
    caplog.set_level(logging.INFO, logger="routecore.server")
    for variant, text in BROKEN_KEYS.items():
        s.path.write_text(CONFIG_TEXT.replace("API_KEYS", text))
        assert s.run(s.server.reload) is False, variant
    failed = [r for r in caplog.records if r.getMessage() == "reload-failed"]
    assert len(failed) == len(BROKEN_KEYS)
    for r in failed:
        assert "not valid YAML" in r.fields["error"]
        assert SECRET not in r.fields["error"] and SECRET[:8] not in repr(r.__dict__)
