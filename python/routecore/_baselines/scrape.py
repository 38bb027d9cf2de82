"""The engines' metrics, scraped in plain Python: what a Python endpoint
picker would do (aiohttp client, the same line filter, prometheus_client's
parser), beside routecore's Rust scraper. Also the bench's page server: a
separate process answering every ``GET`` with the same full vLLM-sized page
(as an engine that ignores the ``name[]`` filter would)."""

from __future__ import annotations

import asyncio
import sys

from prometheus_client.parser import text_string_to_metric_families

READ = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:lora_requests_info",
)
HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_inference_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_params_max_tokens",
    "request_params_n",
    "request_max_num_generation_tokens",
    "iteration_tokens_total",
    "time_per_output_token_seconds",
)
BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5)
BUCKETS += (10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


def vllm_page() -> bytes:
    """A metrics page the size and shape of a real vLLM one (~45 KB)."""
    labels = 'engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"'
    out = []
    for name, kind, value in (
        ("num_requests_running", "gauge", 3),
        ("num_requests_waiting", "gauge", 1),
        ("kv_cache_usage_perc", "gauge", 0.42),
        ("prompt_tokens_total", "counter", 123456),
        ("generation_tokens_total", "counter", 654321),
        ("num_preemptions_total", "counter", 0),
        ("prefix_cache_queries_total", "counter", 99999),
        ("prefix_cache_hits_total", "counter", 55555),
    ):
        out += [f"# HELP vllm:{name} {name}.", f"# TYPE vllm:{name} {kind}"]
        out.append(f"vllm:{name}{{{labels}}} {value}")
    out += ["# HELP vllm:lora_requests_info Running stats on lora requests."]
    out += ["# TYPE vllm:lora_requests_info gauge"]
    out.append(
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql-lora,chat-lora",'
        'waiting_lora_adapters=""} 1.7e+09'
    )
    for h in HISTOGRAMS:
        out += [f"# HELP vllm:{h} Histogram of {h}.", f"# TYPE vllm:{h} histogram"]
        for lab in (labels,):
            for i, le in enumerate(BUCKETS):
                out.append(f'vllm:{h}_bucket{{{lab},le="{le}"}} {i * 7}.0')
            out.append(f'vllm:{h}_bucket{{{lab},le="+Inf"}} 200.0')
            out += [f"vllm:{h}_count{{{lab}}} 200.0", f"vllm:{h}_sum{{{lab}}} 123.4"]
    for i in range(40):  # the process / python collectors' lines
        out.append(f'python_gc_objects_collected_total{{generation="{i % 3}"}} {i}.0')
    return ("\n".join(out) + "\n").encode()


def wanted(line: str) -> bool:
    return any(line.startswith(n) and line[len(n) : len(n) + 1] in ("{", " ") for n in READ)


def read_page(page: bytes) -> dict[str, float]:
    """The same job as routecore's ``read_page``: keep the lines read, parse them."""
    kept = "\n".join(line for line in page.decode().splitlines() if wanted(line))
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(kept + "\n"):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def scrape_all(endpoints: list[str], interval_s: float, seconds: float) -> int:
    """Scrapes every endpoint every ``interval_s`` for ``seconds``; returns the pages read."""
    import aiohttp

    done = 0
    query = "&".join(f"name[]={n}" for n in READ)

    async def one(session: aiohttp.ClientSession, endpoint: str, stop: float) -> None:
        nonlocal done
        loop = asyncio.get_running_loop()
        while loop.time() < stop:
            tick = loop.time()
            async with session.get(f"http://{endpoint}/metrics?{query}") as resp:
                read_page(await resp.read())
            done += 1
            await asyncio.sleep(max(0.0, interval_s - (loop.time() - tick)))

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        stop = asyncio.get_running_loop().time() + seconds
        await asyncio.gather(*(one(session, e, stop) for e in endpoints))
    return done


class PageServer(asyncio.Protocol):
    """Answers every request on a kept-alive connection with the same page."""

    response = b""

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            _, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
            self.transport.write(self.response)


async def serve_pages(n: int) -> None:
    page = vllm_page()
    head = f"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {len(page)}\r\n\r\n"
    PageServer.response = head.encode() + page
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(PageServer, "127.0.0.1", 0) for _ in range(n)]
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    print(" ".join(map(str, ports)), flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until the bench closes stdin


if __name__ == "__main__":
    asyncio.run(serve_pages(int(sys.argv[1])))
