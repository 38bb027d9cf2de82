"""``routecore init-config [DIR]``: the shipped configuration is examples/, and works."""

from __future__ import annotations

from pathlib import Path

import pytest

from routecore.cli import main
from routecore.commands.init_config import FILES, SHIPPED, example

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name", SHIPPED)
def test_the_shipped_files_are_byte_identical_to_examples(name):
    # examples/ is the one source: after editing it, copy it to
    # python/routecore/data/examples/ (this test names the file that differs).
    assert example(name) == (EXAMPLES / name).read_bytes(), f"data/examples/{name} != examples/"


def test_writes_both_files_into_a_new_directory(tmp_path, capsys):
    out = tmp_path / "a" / "b"
    assert main(["init-config", str(out)]) == 0
    for name in FILES:
        assert (out / name).read_bytes() == (EXAMPLES / name).read_bytes()
    assert f"routecore serve --config {out / 'routecore.yaml'}" in capsys.readouterr().out


def test_refuses_to_overwrite_without_force(tmp_path, capsys):
    (tmp_path / "envoy.yaml").write_text("mine")
    assert main(["init-config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "already exist" in err and "--force" in err and err.count("\n") == 1
    assert (tmp_path / "envoy.yaml").read_text() == "mine"
    assert not (tmp_path / "routecore.yaml").exists()
    assert main(["init-config", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "envoy.yaml").read_bytes() == (EXAMPLES / "envoy.yaml").read_bytes()


def test_the_written_configuration_loads(tmp_path, monkeypatch):
    pytest.importorskip("yaml")
    from routecore.config import load_config

    monkeypatch.chdir(tmp_path)
    assert main(["init-config"]) == 0
    config = load_config(tmp_path / "routecore.yaml")
    assert [p.name for p in config.pools] == ["short", "long"]


def test_the_default_metrics_port_is_not_prometheus_own(tmp_path):
    pytest.importorskip("yaml")
    from routecore.config import ServerConfig, load_config

    assert ServerConfig.metrics_port == 9464  # 9090 is Prometheus's own port
    assert main(["init-config", str(tmp_path)]) == 0
    assert load_config(tmp_path / "routecore.yaml").server.metrics_port == 9464


def test_no_scrape_writes_the_example_with_scraping_off_and_nothing_else(tmp_path):
    """Scraping off, and flow control's detector the one that needs no scrape."""
    pytest.importorskip("yaml")
    import yaml

    from routecore.config import load_config

    assert main(["init-config", str(tmp_path), "--no-scrape"]) == 0
    written = (tmp_path / "routecore.yaml").read_text()
    assert load_config(tmp_path / "routecore.yaml").scrape.enabled is False
    example = yaml.safe_load((EXAMPLES / "routecore.yaml").read_text())
    example["scrape"]["enabled"] = False
    example["flow_control"]["saturation"]["detector"] = "concurrency"
    assert yaml.safe_load(written) == example
    assert load_config(tmp_path / "routecore.yaml").flow_control.queue is not None
    assert "# A complete routecore serve" in written  # the comments are kept
    assert (tmp_path / "envoy.yaml").read_bytes() == (EXAMPLES / "envoy.yaml").read_bytes()


def test_fail_open_writes_the_fail_open_envoy_configuration_as_envoy_yaml(tmp_path):
    assert main(["init-config", str(tmp_path), "--fail-open"]) == 0
    written = (tmp_path / "envoy.yaml").read_bytes()
    assert written == (EXAMPLES / "envoy-fail-open.yaml").read_bytes()
    assert b"failure_mode_allow: true" in written
    assert (tmp_path / "routecore.yaml").read_bytes() == (EXAMPLES / "routecore.yaml").read_bytes()
    assert not (tmp_path / "envoy-fail-open.yaml").exists()
    assert main(["init-config", str(tmp_path), "--force"]) == 0
    written = (tmp_path / "envoy.yaml").read_bytes()
    assert b"failure_mode_allow: false" in written


def test_the_written_config_turns_flow_control_on_with_its_thresholds(tmp_path):
    pytest.importorskip("yaml")
    from routecore.config import load_config

    assert main(["init-config", str(tmp_path)]) == 0
    flow = load_config(tmp_path / "routecore.yaml").flow_control
    assert flow.queue is not None and flow.queue["ttl_s"] == 30
    assert (flow.detector, flow.max_waiting, flow.max_kv_usage) == ("utilization", 5.0, 0.8)
    assert '"flow_control": {"queue"' in load_config(tmp_path / "routecore.yaml").spec_json()
