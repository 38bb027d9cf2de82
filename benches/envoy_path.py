#!/usr/bin/env python3
"""The Envoy path side by side: what each proxy adds over the engines, at a
fixed rate, on loopback.

Setups (each in front of the same fake engines):

- ``direct``: the load generator talks to one engine.
- ``envoy-rr``: Envoy 1.40 (``--concurrency 2``), examples/envoy.yaml without
  the ext_proc filter and with round robin over the engines cluster.
- ``envoy-routecore``: examples/envoy.yaml as shipped (its addresses changed),
  in front of ``routecore serve`` with examples/routecore.yaml (scraping on,
  ``worker_threads: 2``, the demo tenant's admission, its tokens/s raised
  1,000-fold so that it admits every request of the run). ``--modes`` adds one
  such setup per other shipped Envoy file (``envoy-routecore:NAME``), all
  served by the same routecore; ``--before DIR`` one more,
  ``envoy-routecore@before``, served by the routecore package in ``DIR``
  (another build: a same-run A/B of routecore's code).
- ``vllm-rr`` / ``vllm-ca``: ``vllm-router`` 0.1.17 (PyPI), round robin / cache
  aware; ``sglang-rr`` / ``sglang-ca``: ``sglang-router`` 0.3.2, the same.
  Each is installed by this script into its own venv under the cache folder.

The engines: one nginx (Debian's ``nginx``, installed with apt-get when
absent) listening on four ports, answering every request with the captured vLLM answer
(tests/fixtures/vllm/chat.json, usage in proportion to the body) and ``GET
/metrics`` with the captured vLLM page (tests/fixtures/vllm/metrics.txt).

The load: oha (crates.io; ``cargo install oha`` into the cache folder the first
time, a few minutes), open loop at a fixed rate (``-q``) with
``--latency-correction`` (latencies counted from when each request was due:
coordinated omission corrected), 64 connections, POST of a chat body of 1 KB
or 16 KB. Runs are interleaved (every setup once per rate and body, the
order rotated each repeat) and repeated. A proxy's CPU is its processes'
user + system time from /proc over the run, divided by the requests answered;
routecore's scraper thread is shown apart (``scrape``: it scrapes the engines
at its interval whatever the request rate).

Prints the table of what each setup adds over ``direct`` in the same round
(ranges over the repeats). A run is *saturated* when fewer than 97 % of the
requests due were answered 2xx or its p50 passed 20 ms.

Run (the full run is about 7 setups x 4 rates x 2 bodies x repeats x duration):
    .venv/bin/python benches/envoy_path.py --duration 15 --repeats 3
    .venv/bin/python benches/envoy_path.py --smoke     # about 40 s, every setup once
    # where routecore's time goes per request (threads' CPU and context
    # switches, Envoy's ext_proc messages and bytes, the shards' syscalls):
    .venv/bin/python benches/envoy_path.py --setups envoy-routecore --diagnose --strace \
        --rates 1000 --bodies 1024 --duration 8 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from envoy_proxy import EXAMPLES, Envoy, on_socket, shipped_config  # noqa: E402
from server_fixtures import Spawned, free_port  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "vllm"
#: What the script installs (oha, the two routers' venvs): under target/, which git ignores.
CACHE = Path(os.environ.get("ROUTECORE_BENCH_CACHE", ROOT / "target" / "envoy-path"))
OHA_VERSION = "1.16.0"
ROUTERS = {"vllm": ("vllm-router", "0.1.17"), "sglang": ("sglang-router", "0.3.2")}
CONNECTIONS = 64
ENGINES = 4
KEY = "demo-key"
#: Seconds a setup gets to answer its first request.
READY_S = 60.0
#: A run is held when at least this share of the requests due were answered 2xx.
HELD_SHARE = 0.97
#: ... and its p50 stayed under this (seconds).
HELD_P50_S = 0.020


# --- tools ---------------------------------------------------------------


def oha() -> str:
    """The oha binary, installed from crates.io into the cache the first time
    (its build folder kept there: an interrupted install resumes)."""
    root = CACHE / f"oha-{OHA_VERSION}"
    binary = root / "bin" / "oha"
    if not binary.exists():
        print(f"installing oha {OHA_VERSION} into {root} (cargo install, about 10 min)")
        # TLS from the system's OpenSSL (libssl-dev): rustls's C crypto takes long to build.
        argv = ["cargo", "install", "oha", "--locked", "--version", OHA_VERSION]
        argv += ["--no-default-features", "--features", "native-tls"]
        argv += ["--root", str(root), "--target-dir", str(CACHE / "oha-build")]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return str(binary)


def router(kind: str) -> str:
    """The router's command, from PyPI into a venv of its own the first time."""
    package, version = ROUTERS[kind]
    venv = CACHE / f"{package}-{version}"
    binary = venv / "bin" / package
    if not binary.exists():
        print(f"installing {package}=={version} into {venv}")
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", f"{package}=={version}"], check=True
        )
    return str(binary)


def nginx() -> str:
    """Debian's nginx, installed with apt-get when absent and this is root;
    otherwise the script stops and says what to install."""
    paths = ("/usr/sbin/nginx", "/usr/bin/nginx")
    if not any(os.access(p, os.X_OK) for p in paths) and os.geteuid() == 0:
        print("installing nginx (apt-get)")
        quiet = {"stdout": subprocess.DEVNULL, "check": False}
        subprocess.run(["apt-get", "update", "-q"], **quiet)
        subprocess.run(["apt-get", "install", "-y", "-q", "nginx"], **quiet)
    for path in paths:
        if os.access(path, os.X_OK):
            return path
    sys.exit("nginx is needed for the fake engines: apt-get install nginx (as root)")


# --- processes -----------------------------------------------------------


def ticks(pid: int) -> int:
    """User + system time of a process and the children it waited for, in
    clock ticks (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return sum(int(f) for f in fields[11:15])


#: routecore's scraper thread (rust/serve/scrape.rs ``THREAD``; Linux keeps
#: 15 characters of a thread's name): its CPU is counted apart, as ``scrape``.
SCRAPER = "routecore-scrape"[:15]


def scraper_ticks(pid: int) -> int:
    """User + system time of ``pid``'s scraper thread, in clock ticks."""
    total = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name, fields = stat.split("(", 1)[1].rsplit(")", 1)
        if name == SCRAPER:
            total += sum(int(f) for f in fields.split()[11:13])
    return total


def threads(pid: int) -> dict[str, list[int]]:
    """Per thread name of ``pid``: [threads, clock ticks (user + system),
    voluntary and involuntary context switches] summed over its threads."""
    out: dict[str, list[int]] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
            status = (task / "status").read_text()
        except OSError:
            continue
        name, fields = stat.split("(", 1)[1].rsplit(")", 1)
        switches = dict(
            line.split(":\t") for line in status.splitlines() if "ctxt_switches" in line
        )
        row = out.setdefault(name, [0, 0, 0, 0])
        row[0] += 1
        row[1] += sum(int(f) for f in fields.split()[11:13])
        row[2] += int(switches["voluntary_ctxt_switches"])
        row[3] += int(switches["nonvoluntary_ctxt_switches"])
    return out


def tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def post(url: str, body: bytes, timeout: float = 5.0) -> int:
    req = urllib.request.Request(url, body, {"content-type": "application/json", "x-api-key": KEY})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def wait_answering(url: str, body: bytes, what: str) -> None:
    deadline = time.monotonic() + READY_S
    status = 0
    while time.monotonic() < deadline:
        status = post(url, body)
        if status == 200:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} does not answer 200 at {url} (last status {status})")


@dataclass
class Setup:
    """One way to reach the engines: its URL and the processes it costs
    (name -> pid, each counted with the processes below it)."""

    name: str
    url: str
    processes: dict[str, int] = field(default_factory=dict)

    def cpu(self) -> dict[str, int]:
        """Clock ticks per process; routecore's scraper thread apart, as
        ``scrape`` (it costs the same at any request rate)."""
        out = {n: sum(ticks(p) for p in tree(pid)) for n, pid in self.processes.items()}
        if "routecore" in self.processes:
            out["scrape"] = scraper_ticks(self.processes["routecore"])
            out["routecore"] -= out["scrape"]
        return out


class Stack:
    """Every setup, started on free loopback ports; :meth:`close` stops them."""

    def __init__(
        self, directory: Path, names: list[str], modes: list[str], before: Path | None = None
    ) -> None:
        self.dir = directory
        self.procs: list[subprocess.Popen] = []
        self.envoys: list[Envoy] = []
        self.routecore: Spawned | None = None
        #: routecore served from ``before`` (--before), stopped with the rest.
        self.others: list[Spawned] = []
        self.setups: list[Setup] = []
        try:
            self._start(names, modes, before)
        except BaseException:
            self.close()
            raise

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = (self.dir / f"{name}.log").open("w")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def _engines(self) -> list[str]:
        ports = [free_port() for _ in range(ENGINES)]
        answer = (FIXTURES / "chat.json").read_text().strip()
        # usage.prompt_tokens about a quarter of the body's bytes
        answer = answer.replace('"prompt_tokens":90', '"prompt_tokens":$prompt_tokens')
        assert "$prompt_tokens" in answer and "'" not in answer
        user = "user root;" if os.geteuid() == 0 else ""
        conf = f"""
{user}
worker_processes 1;
daemon off;
pid {self.dir}/nginx.pid;
error_log {self.dir}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {self.dir}/nginx-body;
  keepalive_requests 1000000;
  keepalive_timeout 600s;
  client_max_body_size 8m;
  map $content_length $prompt_tokens {{
    default 250;
    "~^[0-9]{{5,}}$" 4000;
  }}
  server {{
    {" ".join(f"listen 127.0.0.1:{p};" for p in ports)}
    location = /metrics {{
      default_type "text/plain; version=0.0.4; charset=utf-8";
      alias {FIXTURES / "metrics.txt"};
    }}
    location / {{
      default_type application/json;
      return 200 '{answer}';
    }}
  }}
}}
"""
        path = self.dir / "nginx.conf"
        path.write_text(conf)
        self._spawn("nginx", [nginx(), "-c", str(path), "-e", str(self.dir / "nginx-error.log")])
        return [f"127.0.0.1:{p}" for p in ports]

    def _start(self, names: list[str], modes: list[str], before: Path | None) -> None:
        engines = self._engines()
        probe = chat_body(1024)
        for e in engines:
            wait_answering(f"http://{e}/v1/chat/completions", probe, "nginx")
        self.setups.append(Setup("direct", f"http://{engines[0]}"))
        if "envoy-rr" in names:
            port = free_port()
            config = shipped_config("envoy.yaml", port, ["127.0.0.1:1"], engines)
            resources = config["static_resources"]
            manager = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            manager["http_filters"] = [
                f for f in manager["http_filters"] if "ext_proc" not in f["typed_config"]["@type"]
            ]
            resources["clusters"] = [c for c in resources["clusters"] if c["name"] == "engines"]
            resources["clusters"][0].pop("load_balancing_policy")  # round robin
            envoy = Envoy(config, self.dir, concurrency=2)
            self.envoys.append(envoy)
            self.setups.append(Setup("envoy-rr", envoy.url, {"envoy": envoy.proc.pid}))
        if "envoy-routecore" in names:
            config = yaml.safe_load((EXAMPLES / "routecore.yaml").read_text())
            short, long = engines[:2], engines[2:]
            config["pools"][0]["endpoints"] = short
            config["pools"][1]["endpoints"] = long
            # Admission runs for every request, with rates the load never
            # reaches (16 KB bodies at 3,000/s are 12M tokens/s: the shipped
            # 1M would answer 429, which is not what is measured here).
            admission = config["admission"]
            for entry in admission["quotas"] + admission["entitlements"]:
                entry["tokens_per_s"] *= 1000
            # Flow control runs for every request too, but its utilization
            # detector counts what was sent to an endpoint since its last
            # scrape as queued: with engines that answer at once, max_waiting 5
            # over a 50 ms scrape lets a pool of two endpoints take about 200
            # requests/s and holds the rest (the path then saturates at about
            # 200/s whatever the proxy). Raised so that the path is measured.
            config["flow_control"]["saturation"]["max_waiting"] = 1e6
            # ext_proc on a Unix socket too, for the files that reach it so
            # (envoy-uds.yaml): one routecore serves every mode of the run.
            sock = self.dir / "ext_proc.sock"
            config["server"]["unix_socket"] = str(sock)
            self.routecore = Spawned(self.dir / "routecore.yaml", config, "--log-level", "warning")
            for mode in modes:
                name = "envoy-routecore" + ("" if mode == modes[0] else f":{mode}")
                self._envoy_routecore(name, mode, self.routecore, sock, engines)
            if before is not None:
                # The same, served by the routecore package in ``before`` (an
                # A/B of routecore's code in one run: same Envoy file, same load).
                config["server"]["unix_socket"] = str(self.dir / "ext_proc-before.sock")
                env = os.environ.get("PYTHONPATH")
                os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(before), env]))
                try:
                    other = Spawned(self.dir / "before.yaml", config, "--log-level", "warning")
                finally:
                    os.environ.pop("PYTHONPATH")
                    if env is not None:
                        os.environ["PYTHONPATH"] = env
                self.others.append(other)
                sock = Path(config["server"]["unix_socket"])
                self._envoy_routecore("envoy-routecore@before", modes[0], other, sock, engines)
        urls = [f"http://{e}" for e in engines]
        for kind in ROUTERS:
            for policy, short in (("round_robin", "rr"), ("cache_aware", "ca")):
                name = f"{kind}-{short}"
                if name not in names:
                    continue
                port = free_port()
                argv = [router(kind)] + (["launch"] if kind == "sglang" else [])
                argv += ["--host", "127.0.0.1", "--port", str(port), "--policy", policy]
                argv += ["--worker-urls", *urls, "--prometheus-port", str(free_port())]
                argv += ["--log-level", "warning" if kind == "vllm" else "warn"]
                proc = self._spawn(name, argv)
                self.setups.append(Setup(name, f"http://127.0.0.1:{port}", {"router": proc.pid}))
        for s in self.setups:
            wait_answering(s.url + "/v1/chat/completions", probe, s.name)

    def _envoy_routecore(
        self, name: str, mode: str, routecore: Spawned, sock: Path, engines: list[str]
    ) -> None:
        """Envoy with the shipped file ``mode`` in front of ``routecore``."""
        target = f"unix:{sock}" if on_socket(mode) else routecore.target
        envoy = Envoy(shipped_config(mode, free_port(), [target], engines), self.dir, concurrency=2)
        self.envoys.append(envoy)
        pids = {"envoy": envoy.proc.pid, "routecore": routecore.proc.pid}
        self.setups.append(Setup(name, envoy.url, pids))

    def close(self) -> None:
        for e in self.envoys:
            e.stop()
        for r in [self.routecore, *self.others]:
            if r is not None:
                r.stop()
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


# --- load ----------------------------------------------------------------


def chat_body(size: int) -> bytes:
    """A chat completion request of ``size`` bytes (a system and a user message)."""
    base = {
        "model": "m",
        "max_tokens": 64,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": ""},
        ],
    }
    pad = size - len(json.dumps(base, separators=(",", ":")))
    words = ("the quick brown fox jumps over the lazy dog " * (pad // 44 + 1))[:pad]
    base["messages"][1]["content"] = words
    out = json.dumps(base, separators=(",", ":")).encode()
    assert len(out) == size, (len(out), size)
    return out


@dataclass
class Run:
    setup: str
    rate: int
    body: int
    repeat: int
    p50: float
    p99: float
    answered: int
    due: int
    cpu: dict[str, float]

    @property
    def held(self) -> bool:
        return self.answered >= HELD_SHARE * self.due and self.p50 < HELD_P50_S

    def cpu_per_request(self) -> dict[str, float]:
        return {n: s / max(self.answered, 1) for n, s in self.cpu.items()}


def drive(setup: Setup, body_file: Path, rate: int, seconds: float) -> dict:
    """One oha run at ``rate``/s for ``seconds``: its JSON summary and the CPU."""
    argv = [oha(), "-z", f"{seconds}s", "-q", str(rate), "--latency-correction"]
    argv += ["-c", str(CONNECTIONS), "--no-tui", "--output-format", "json", "-m", "POST"]
    argv += ["-H", "content-type: application/json", "-H", f"x-api-key: {KEY}"]
    argv += ["-D", str(body_file), setup.url + "/v1/chat/completions"]
    before = setup.cpu()
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    after = setup.cpu()
    hz = os.sysconf("SC_CLK_TCK")
    result = json.loads(out)
    result["cpu"] = {n: (after[n] - before[n]) / hz for n in before}
    return result


def measure(stack: Stack, args: argparse.Namespace) -> list[Run]:
    bodies = {}
    for size in args.bodies:
        path = stack.dir / f"body-{size}.json"
        path.write_bytes(chat_body(size))
        bodies[size] = path
    for s in stack.setups:  # connections open, caches warm
        drive(s, bodies[args.bodies[0]], 200, args.warmup)
    runs = []
    n = len(stack.setups)
    for repeat in range(args.repeats):
        for rate in args.rates:
            for size in args.bodies:
                k = (repeat + len(runs)) % n
                for s in stack.setups[k:] + stack.setups[:k]:
                    r = drive(s, bodies[size], rate, args.duration)
                    codes = r.get("statusCodeDistribution", {})
                    ok = sum(v for c, v in codes.items() if c.startswith("2"))
                    pct = r["latencyPercentiles"]
                    run = Run(
                        s.name,
                        rate,
                        size,
                        repeat,
                        pct["p50"] or float("inf"),
                        pct["p99"] or float("inf"),
                        ok,
                        round(rate * args.duration),
                        r["cpu"],
                    )
                    runs.append(run)
                    print(
                        f"  {s.name:>24} {rate:>5}/s {size:>6} B: p50 {run.p50 * 1e3:7.3f} ms"
                        f" p99 {run.p99 * 1e3:8.3f} ms  {ok}/{run.due} 2xx"
                        f"  cpu/req {fmt_cpu(run.cpu_per_request())}",
                        flush=True,
                    )
    return runs


# --- where routecore's time goes (--diagnose) -----------------------------

#: Envoy's counters read by --diagnose: its ext_proc filter's messages and
#: streams, and the bytes on its connections to routecore.
ENVOY_STATS = r"ext_proc\.|cluster\.routecore\.upstream_(cx_(rx|tx)_bytes_total|cx_total|rq_total)"
#: routecore's data-plane shards (rust/serve/runtime.rs's thread name).
SHARD = "routecore-dp"


def envoy_stats(envoy: Envoy) -> dict[str, int]:
    stats = json.loads(envoy.admin(f"stats?format=json&filter={ENVOY_STATS}"))["stats"]
    return {s["name"]: int(s["value"]) for s in stats if "value" in s}


def strace_counts(pids: list[int], run) -> tuple[dict[str, tuple[int, int]], dict]:
    """Syscalls (calls, errors) of the threads ``pids`` while ``run()`` runs
    (``strace -c``: it slows them; count, never time, with it), and what
    ``run()`` returned."""
    out = Path(tempfile.mkstemp(suffix=".strace")[1])
    argv = ["strace", "-c", "-qq", "-o", str(out)] + [a for p in pids for a in ("-p", str(p))]
    tracer = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached
    try:
        result = run()
    finally:
        tracer.send_signal(2)
        tracer.wait(timeout=30)
    counts = {}
    for line in out.read_text().splitlines():
        f = line.split()
        if len(f) >= 5 and f[3].isdigit() and not line.startswith("100.00"):
            errors = int(f[4]) if len(f) == 6 else 0
            counts[f[-1]] = (int(f[3]), errors)
    out.unlink()
    return counts, result


def diagnose(stack: Stack, args: argparse.Namespace) -> None:
    """Per request answered, for each Envoy + routecore setup at the first
    rate and body: routecore's CPU and context switches per thread name,
    the ext_proc messages and bytes each way (Envoy's counters) and, with
    ``--strace``, the shards' syscalls."""
    assert stack.routecore is not None, "--diagnose needs the envoy-routecore setup"
    rate, size = args.rates[0], args.bodies[0]
    body = stack.dir / f"body-{size}.json"
    body.write_bytes(chat_body(size))
    hz = os.sysconf("SC_CLK_TCK")
    setups = [s for s in stack.setups if "routecore" in s.processes]
    for s in setups:
        drive(s, body, 200, args.warmup)
    for repeat in range(args.repeats):
        for s in setups[repeat % len(setups) :] + setups[: repeat % len(setups)]:
            pid = s.processes["routecore"]
            envoy = next(e for e in stack.envoys if e.url == s.url)
            t0, e0 = threads(pid), envoy_stats(envoy)
            r = drive(s, body, rate, args.duration)
            t1, e1 = threads(pid), envoy_stats(envoy)
            n = max(sum(v for c, v in r["statusCodeDistribution"].items() if c[0] == "2"), 1)
            cpu = r["cpu"]
            print(
                f"{s.name} {rate}/s {size} B, repeat {repeat}: {n} answered,"
                f" p50 {r['latencyPercentiles']['p50'] * 1e3:.3f} ms,"
                f" envoy {cpu['envoy'] / n * 1e3:.3f} ms/req,"
                f" routecore {cpu['routecore'] / n * 1e3:.3f} ms/req"
                f" (+ scrape {cpu['scrape'] / n * 1e3:.3f})"
            )
            print(
                f"  {'thread':<16} {'n':>3} {'cpu ms/req':>11} {'vol cs/req':>11} {'invol/req':>10}"
            )
            for name in sorted(t1, key=lambda k: -(t1[k][1] - t0.get(k, [0, 0])[1])):
                a, b = t0.get(name, [0, 0, 0, 0]), t1[name]
                d = [y - x for x, y in zip(a, b)]
                print(
                    f"  {name:<16} {b[0]:>3} {d[1] / hz / n * 1e3:>11.4f}"
                    f" {d[2] / n:>11.3f} {d[3] / n:>10.3f}"
                )
            streams = max(
                e1.get("http.llm.ext_proc.streams_started", 0)
                - e0.get("http.llm.ext_proc.streams_started", 0),
                1,
            )
            for k in sorted(e1):
                if e1[k] != e0.get(k, 0):
                    d = e1[k] - e0.get(k, 0)
                    print(f"  {k:<60} {d / n:>10.3f}/req {d / streams:>10.3f}/stream")
    for s in setups if args.strace else []:
        pid = s.processes["routecore"]
        shards = [
            int(t.name)
            for t in Path(f"/proc/{pid}/task").glob("*")
            if (t / "comm").read_text().strip() == SHARD
        ]
        counts, got = strace_counts(shards, partial(drive, s, body, rate, args.duration))
        n = max(sum(v for c, v in got["statusCodeDistribution"].items() if c[0] == "2"), 1)
        print(
            f"{s.name}: shards' syscalls per request ({len(shards)} threads, {n} answered,"
            " under strace):"
        )
        for name, (calls, errors) in sorted(counts.items(), key=lambda kv: -kv[1][0]):
            print(f"    {name:<16} {calls / n:>8.3f}  errors {errors / n:.3f}")


# --- the table -----------------------------------------------------------


def span(values: list[float], digits: int = 2) -> str:
    lo, hi = min(values), max(values)
    if f"{lo:.{digits}f}" == f"{hi:.{digits}f}":
        return f"{lo:.{digits}f}"
    return f"{lo:.{digits}f}-{hi:.{digits}f}"


def fmt_cpu(per: dict[str, float]) -> str:
    total = sum(per.values()) * 1e3
    if len(per) < 2:
        return f"{total:.3f}"
    parts = " + ".join(f"{n} {v * 1e3:.3f}" for n, v in per.items())
    return f"{total:.3f} ({parts})"


def table(runs: list[Run], setups: list[str]) -> str:
    direct = {(r.rate, r.body, r.repeat): r for r in runs if r.setup == "direct"}
    lines = [
        "| rate | body | setup | added p50 over direct | added p99 | proxy CPU per request |",
        "|---|---|---|---|---|---|",
    ]
    for rate in sorted({r.rate for r in runs}):
        for body in sorted({r.body for r in runs}):
            for name in setups:
                mine = [r for r in runs if (r.setup, r.rate, r.body) == (name, rate, body)]
                if not mine:
                    continue
                size = f"{body // 1024} KB"
                head = f"| {rate:,}/s | {size} | {name} |"
                if name == "direct":
                    p50 = span([r.p50 * 1e3 for r in mine])
                    p99 = span([r.p99 * 1e3 for r in mine])
                    lines.append(f"{head} (p50 {p50} ms) | (p99 {p99} ms) | |")
                    continue
                held = [r for r in mine if r.held]
                cpu = cpu_cell(mine)
                if len(held) < len(mine):
                    worst = span([r.p50 * 1e3 for r in mine if not r.held], 1)
                    note = f"**saturated** in {len(mine) - len(held)} of {len(mine)} runs"
                    lines.append(f"{head} {note} (p50 {worst} ms) | | {cpu} |")
                    if not held:
                        continue
                base = [direct[(r.rate, r.body, r.repeat)] for r in held]
                add50 = span([(r.p50 - d.p50) * 1e3 for r, d in zip(held, base)])
                add99 = span([(r.p99 - d.p99) * 1e3 for r, d in zip(held, base)], 1)
                if len(held) < len(mine):
                    lines.append(f"{head} held runs: {add50} ms | {add99} ms | |")
                else:
                    lines.append(f"{head} {add50} ms | {add99} ms | {cpu} |")
    return "\n".join(lines)


def cpu_cell(runs: list[Run]) -> str:
    per = [r.cpu_per_request() for r in runs]
    total = span([sum(p.values()) * 1e3 for p in per])
    if len(per[0]) < 2:
        return f"{total} ms"
    parts = " + ".join(f"{n} {span([p[n] * 1e3 for p in per])}" for n in per[0])
    return f"{total} ms ({parts})"


def main(argv: list[str] | None = None) -> int:
    all_setups = ["envoy-rr", "envoy-routecore", "vllm-rr", "vllm-ca", "sglang-rr", "sglang-ca"]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=15.0, help="seconds per run (15)")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds per setup, once (2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rates", type=int, nargs="+", default=[200, 1000, 2000, 3000])
    p.add_argument("--bodies", type=int, nargs="+", default=[1024, 16384], help="bytes")
    p.add_argument("--setups", nargs="+", default=all_setups, choices=all_setups)
    p.add_argument(
        "--modes",
        nargs="+",
        default=["envoy.yaml"],
        help="shipped Envoy files for envoy-routecore (the first named plainly)",
    )
    p.add_argument(
        "--before",
        type=Path,
        help="a folder holding a routecore package built from other code (a copy of"
        " python/routecore with its _core): one more setup, envoy-routecore@before, served by it",
    )
    p.add_argument("--json", type=Path, help="write every run here")
    p.add_argument("--smoke", action="store_true", help="every setup once, 2 s at 200/s, 1 KB")
    p.add_argument(
        "--diagnose",
        action="store_true",
        help="where routecore's time goes per request (first rate and body), no table",
    )
    p.add_argument("--strace", action="store_true", help="with --diagnose: the shards' syscalls")
    args = p.parse_args(argv)
    if args.smoke:
        args.duration, args.warmup, args.repeats = 2.0, 0.5, 1
        args.rates, args.bodies = [200], [1024]
    oha()
    with tempfile.TemporaryDirectory(prefix="envoy-path-") as d:
        stack = Stack(Path(d), args.setups, args.modes, args.before)
        try:
            names = [s.name for s in stack.setups]
            print("setups:", ", ".join(names), flush=True)
            if args.diagnose:
                diagnose(stack, args)
                return 0
            runs = measure(stack, args)
        finally:
            stack.close()
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in runs], indent=1))
    print()
    print(table(runs, names))
    medians = {
        n: statistics.median(sum(r.cpu_per_request().values()) for r in runs if r.setup == n)
        for n in names
        if n != "direct"
    }
    print("\nmedian proxy CPU per request over every run (ms):")
    for n, v in medians.items():
        ratio = f"  ({v / medians['envoy-rr']:.2f}x envoy-rr)" if "envoy-rr" in medians else ""
        print(f"  {n:>24} {v * 1e3:.3f}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
