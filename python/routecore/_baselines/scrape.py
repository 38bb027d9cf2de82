"""The engines' metrics, scraped in plain Python: what a Python endpoint
picker would do (aiohttp client, the same line filter, prometheus_client's
parser), beside routecore's Rust scraper. Also the bench's page server: a
separate process answering every ``GET`` with the same full page (vLLM 0.32's,
which ignores the ``name[]`` filter)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

READ = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:lora_requests_info",
)


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


async def serve_pages(n: int, page: bytes) -> None:
    head = (
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=1.0.0; charset=utf-8\r\n"
        f"content-length: {len(page)}\r\n\r\n"
    )
    PageServer.response = head.encode() + page
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(PageServer, "127.0.0.1", 0) for _ in range(n)]
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    print(" ".join(map(str, ports)), flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until the bench closes stdin


if __name__ == "__main__":
    # python -m routecore._baselines.scrape N PAGE_FILE
    asyncio.run(serve_pages(int(sys.argv[1]), Path(sys.argv[2]).read_bytes()))
