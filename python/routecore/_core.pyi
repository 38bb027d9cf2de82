# Type stubs for routecore._core, the Rust extension. Kept honest by
# `python -m mypy.stubtest routecore._core` in the test command.
import pathlib
from typing import Any, ClassVar, Literal, final

import numpy as np
import numpy.typing as npt
from typing_extensions import Self, disjoint_base

__version__: str
#: The categories ``classify`` assigns and the calibrator learns.
CATEGORIES: tuple[str, ...]
#: The categories compress-and-route never compresses (code), in the router,
#: the planner and the simulator.
INCOMPRESSIBLE_CATEGORIES: tuple[str, ...]
#: The largest token count (prompt, output, budget) any call accepts, 2^30.
MAX_TOKENS: int

# --- conventions: the clock and the not-in-flight error -----------------------

class NotInFlightError(ValueError):
    """Ending a request that is not in flight; the state is unchanged."""

def monotonic() -> float: ...

# --- token-budget routing (capability 1) -------------------------------------

@final
class Calibrator:
    """Per-category bytes-per-token EMA learned from ``usage.prompt_tokens``."""

    DEFAULT_BETA: ClassVar[float]
    DEFAULT_GAMMA: ClassVar[float]
    DEFAULT_COLD_START: ClassVar[float]
    DEFAULT_MAX_CATEGORIES: ClassVar[int]
    def __new__(
        cls,
        beta: float = ...,
        gamma: float = ...,
        cold_start: float = ...,
        max_categories: int = ...,
    ) -> Self: ...
    def observe(self, category: str, prompt_bytes: int, prompt_tokens: int) -> None: ...
    def ratio(self, category: str) -> float: ...
    def sigma(self, category: str) -> float: ...
    def conservative_ratio(self, category: str) -> float: ...
    def estimate_tokens(self, prompt_bytes: int, category: str) -> int: ...
    def count(self, category: str) -> int: ...
    @property
    def categories(self) -> list[str]: ...
    @property
    def beta(self) -> float: ...
    @property
    def gamma(self) -> float: ...
    @property
    def cold_start(self) -> float: ...
    @property
    def max_categories(self) -> int: ...
    def to_bytes(self) -> bytes: ...
    @staticmethod
    def from_bytes(data: bytes) -> Calibrator: ...
    def __reduce__(self) -> tuple[Any, tuple[bytes]]: ...

@final
class Pool:
    """A pool of model instances sharing one context window."""

    def __new__(
        cls,
        name: str,
        max_context: int,
        budget: int | None = None,
        queue_limit: int | None = None,
    ) -> Self: ...
    @property
    def name(self) -> str: ...
    @property
    def max_context(self) -> int: ...
    @property
    def budget(self) -> int: ...
    @property
    def queue_limit(self) -> int | None: ...

@final
class RouteDecision:
    """One routing decision."""

    @property
    def pool(self) -> str | None: ...
    @property
    def index(self) -> int: ...
    @property
    def rejected(self) -> bool: ...
    @property
    def est_input_tokens(self) -> int: ...
    @property
    def est_output_tokens(self) -> int: ...
    @property
    def est_total_tokens(self) -> int: ...
    @property
    def spilled(self) -> bool: ...
    @property
    def reason(self) -> str: ...
    @property
    def action(self) -> Literal["route", "compress", "reject"]: ...
    @property
    def compress_target_tokens(self) -> int | None: ...

@final
class TokenBudgetRouter:
    """Token-budget pool routing (Chen et al. 2026, Algorithm 1) over N pools."""

    def __new__(
        cls,
        pools: list[Pool],
        calibrator: Calibrator | None = None,
        compress_band: float | None = None,
    ) -> Self: ...
    def route(self, prompt_bytes: int, category: str, max_output_tokens: int) -> RouteDecision: ...
    def route_tokens(self, prompt_tokens: int, max_output_tokens: int) -> RouteDecision: ...
    def route_many(
        self,
        prompt_bytes: npt.ArrayLike,
        category_ids: npt.ArrayLike,
        max_output_tokens: npt.ArrayLike,
    ) -> npt.NDArray[np.int64]: ...
    def category_id(self, name: str) -> int: ...
    def feedback(self, prompt_bytes: int, category: str, prompt_tokens: int) -> None: ...
    def complete(self, pool: str | int) -> None: ...
    def in_flight(self, pool: str | int) -> int: ...
    def set_in_flight(self, pool: str | int, count: int) -> None: ...
    @property
    def pools(self) -> list[Pool]: ...
    @property
    def calibrator(self) -> Calibrator: ...
    def route_request(
        self,
        body: str | bytes,
        compressor: Compressor | None = None,
        default_max_tokens: int = 4096,
        *,
        image_tokens: int = 765,
        audio_tokens: int = 750,
        tokenizer: Tokenizer | None = None,
    ) -> RoutedRequest: ...
    @property
    def compress_band(self) -> float | None: ...

@final
class Tokenizer:
    """A model's Hugging Face ``tokenizer.json`` and optional chat template (Jinja)."""

    def __new__(
        cls,
        path: str | os.PathLike[str],
        chat_template: str | None = None,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> Self: ...
    @property
    def path(self) -> pathlib.Path: ...
    @property
    def chat_template(self) -> str | None: ...
    @property
    def bos_token(self) -> str | None: ...
    @property
    def eos_token(self) -> str | None: ...
    @property
    def vocab_size(self) -> int: ...
    def encode(self, text: str, add_special_tokens: bool = True) -> npt.NDArray[np.uint32]: ...
    def count(self, text: str, add_special_tokens: bool = True) -> int: ...
    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str: ...
    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> npt.NDArray[np.uint32]: ...
    def count_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> int: ...
    def encode_request(self, body: str | bytes) -> npt.NDArray[np.uint32]: ...

def classify(text: str | bytes) -> Literal["prose", "code", "cjk", "mixed"]: ...
def parse_openai_request(
    body: str | bytes,
    default_max_tokens: int = 4096,
    *,
    image_tokens: int = 765,
    audio_tokens: int = 750,
) -> dict[str, Any]: ...

# --- batched model and endpoint assignment, RouteBalance (capability 6) ------

@final
class Endpoint:
    """One serving endpoint of a model: decode speed, per-token prices, slots."""

    def __new__(
        cls,
        name: str,
        model: str,
        tpot_s: float,
        price_in_per_mtok: float,
        price_out_per_mtok: float,
        max_batch: int,
        prefill_s_per_token: float | None = None,
    ) -> Self: ...
    @property
    def name(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def tpot_s(self) -> float: ...
    @property
    def price_in_per_mtok(self) -> float: ...
    @property
    def price_out_per_mtok(self) -> float: ...
    @property
    def max_batch(self) -> int: ...
    @property
    def prefill_s_per_token(self) -> float: ...
    def cost(self, in_tokens: float, out_len: float) -> float: ...
    def latency(
        self, in_tokens: float, out_len: float, pending_decode: float, batch_size: int
    ) -> float: ...

@final
class BatchScheduler:
    """RouteBalance's batched assignment of requests to model endpoints."""

    def __new__(
        cls,
        endpoints: list[Endpoint],
        weights: str | tuple[float, float, float] | None = None,
        lpt_key: Literal["max", "mean", "min"] = "max",
        budget_fallback: Literal["reject", "cheapest"] = "reject",
    ) -> Self: ...
    def assign(
        self,
        quality: npt.ArrayLike,
        out_len: npt.ArrayLike,
        in_tokens: npt.ArrayLike,
        budget: npt.ArrayLike | None,
        pending_decode: npt.ArrayLike,
        batch_size: npt.ArrayLike,
    ) -> npt.NDArray[np.int64]: ...
    def assign_one(
        self,
        quality: npt.ArrayLike,
        out_len: npt.ArrayLike,
        in_tokens: int,
        budget: float | None,
        pending_decode: npt.ArrayLike,
        batch_size: npt.ArrayLike,
    ) -> int: ...
    def lpt_order(self, out_len: npt.ArrayLike) -> npt.NDArray[np.int64]: ...
    @staticmethod
    def presets() -> list[tuple[str, tuple[float, float, float]]]: ...
    @property
    def endpoints(self) -> list[Endpoint]: ...
    @property
    def models(self) -> list[str]: ...
    @property
    def model_of(self) -> list[int]: ...
    @property
    def weights(self) -> tuple[float, float, float]: ...
    @property
    def lpt_key(self) -> str: ...
    @property
    def budget_fallback(self) -> str: ...
    def to_bytes(self) -> bytes: ...
    @staticmethod
    def from_bytes(data: bytes) -> BatchScheduler: ...
    def __reduce__(self) -> tuple[Any, tuple[bytes]]: ...

@final
class KnnEstimator:
    """Per-model quality and output length by distance-weighted cosine kNN."""

    def __new__(cls, k: int = 8) -> Self: ...
    def fit(
        self, embeddings: npt.ArrayLike, quality: npt.ArrayLike, out_len: npt.ArrayLike
    ) -> None: ...
    def predict(
        self, embeddings: npt.ArrayLike
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]: ...
    @property
    def k(self) -> int: ...
    @property
    def is_fitted(self) -> bool: ...
    def to_bytes(self) -> bytes: ...
    @staticmethod
    def from_bytes(data: bytes) -> KnnEstimator: ...
    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]: ...

def assign_eval(
    rate: float = 8.0,
    requests: int = 3000,
    seed: int = 0,
    max_batch: int = 16,
    interval_s: float = 0.05,
) -> list[dict[str, Any]]: ...

# --- prefix-cache-aware routing (capability 4) -------------------------------

def block_hashes(
    tokens: npt.ArrayLike | bytes | str, block_size: int, seed: int = 0
) -> npt.NDArray[np.uint64]: ...
def block_hashes_many(
    tokens: npt.ArrayLike | bytes | str,
    offsets: npt.ArrayLike,
    block_size: int,
    seed: int = 0,
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]]: ...

@final
class PrefixIndex:
    """Block hash -> the endpoints that hold it, for prefix-cache-aware routing."""

    def __new__(cls, capacity_blocks: int = 200000, ttl_s: float | None = None) -> Self: ...
    def record(
        self, hashes: npt.NDArray[np.uint64], endpoint: str, now: float | None = None
    ) -> None: ...
    def match_prefix(
        self, hashes: npt.NDArray[np.uint64], now: float | None = None
    ) -> dict[str, int]: ...
    def remove_endpoint(self, endpoint: str) -> int: ...
    def expire(self, now: float | None = None) -> int: ...
    def __len__(self) -> int: ...
    @property
    def capacity_blocks(self) -> int: ...
    @property
    def ttl_s(self) -> float | None: ...
    @property
    def endpoints(self) -> list[str]: ...
    def to_bytes(self) -> bytes: ...
    @staticmethod
    def from_bytes(data: bytes) -> PrefixIndex: ...
    def __reduce__(self) -> tuple[Any, tuple[bytes]]: ...

@final
class PrefixCacheRouter:
    """Prefix-cache-aware routing (the AIBrix algorithm) over named endpoints."""

    def __new__(
        cls,
        endpoints: list[str],
        block_size: int = 16,
        imbalance_abs_count: int = 16,
        std_factor: float = 2.0,
        index: PrefixIndex | None = None,
        seed: int = 0,
    ) -> Self: ...
    def route(
        self,
        tokens: npt.ArrayLike | bytes | str,
        running: npt.ArrayLike | None = None,
        now: float | None = None,
    ) -> tuple[str, float]: ...
    def route_many(
        self,
        tokens: npt.ArrayLike | bytes | str,
        offsets: npt.ArrayLike,
        running: npt.ArrayLike | None = None,
        now: float | None = None,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]: ...
    def complete(self, endpoint: str) -> None: ...
    def set_running(self, counts: npt.ArrayLike) -> None: ...
    def add_endpoint(self, endpoint: str) -> None: ...
    def remove_endpoint(self, endpoint: str) -> None: ...
    @property
    def endpoints(self) -> list[str]: ...
    @property
    def running(self) -> list[int]: ...
    @property
    def index(self) -> PrefixIndex: ...
    @property
    def block_size(self) -> int: ...
    @property
    def imbalance_abs_count(self) -> int: ...
    @property
    def std_factor(self) -> float: ...
    @property
    def seed(self) -> int: ...
    def to_bytes(self) -> bytes: ...
    @staticmethod
    def from_bytes(data: bytes) -> PrefixCacheRouter: ...
    def __reduce__(self) -> tuple[Any, tuple[bytes]]: ...

# --- VTC fairness routing (capability 5) -------------------------------------

@final
class VtcRouter:
    """VTC fairness routing (AIBrix ``vtc-basic``, after Sheng et al.)."""

    def __new__(
        cls,
        endpoints: list[str],
        window_s: float = 300.0,
        input_weight: float = 1.0,
        output_weight: float = 2.0,
        min_tokens: float = 1000.0,
        max_tokens: float = 8000.0,
        fairness_weight: float = 1.0,
        utilization_weight: float = 1.0,
        max_endpoint_load: float = 100.0,
        max_users: int = 100000,
    ) -> Self: ...
    def route(
        self,
        user: str,
        input_tokens: int,
        output_tokens: int,
        running: npt.ArrayLike | None = None,
        now: float | None = None,
    ) -> str: ...
    def route_many(
        self,
        users: list[str],
        input_tokens: npt.ArrayLike,
        output_tokens: npt.ArrayLike,
        running: npt.ArrayLike | None = None,
        now: float | None = None,
    ) -> npt.NDArray[np.int64]: ...
    def complete(
        self,
        endpoint: str,
        user: str,
        est_input_tokens: int,
        est_output_tokens: int,
        input_tokens: int,
        output_tokens: int,
        now: float | None = None,
    ) -> None: ...
    def user_tokens(self, user: str, now: float | None = None) -> float: ...
    @property
    def users(self) -> int: ...
    def set_running(self, counts: npt.ArrayLike) -> None: ...
    def add_endpoint(self, endpoint: str) -> None: ...
    def remove_endpoint(self, endpoint: str) -> None: ...
    @property
    def endpoints(self) -> list[str]: ...
    @property
    def running(self) -> list[int]: ...
    @property
    def window_s(self) -> float: ...
    @property
    def max_users(self) -> int: ...
    def to_bytes(self) -> bytes: ...
    @staticmethod
    def from_bytes(data: bytes) -> VtcRouter: ...
    def __reduce__(self) -> tuple[Any, tuple[bytes]]: ...

# --- endpoint picker (capability 10) ----------------------------------------

@final
class EndpointPicker:
    """Filters, weighted scorers and a picker choosing the endpoint of each request."""

    def __new__(
        cls,
        endpoints: list[str],
        preset: str | None = None,
        plugins: list[dict[str, Any]] | None = None,
        seed: int = 0,
        kv_index: KvEventIndex | None = None,
        *,
        roles: dict[str, Literal["prefill", "decode", "both"]] | None = None,
        decider: Literal["always", "never", "uncached-tokens", "prefill-load"] | None = None,
        threshold: float | None = None,
    ) -> Self: ...
    @staticmethod
    def presets() -> list[str]: ...
    def pick_pair(
        self,
        tokens: npt.ArrayLike | bytes | str | None = None,
        *,
        hashes: npt.NDArray[np.uint64] | None = None,
        adapter: str | None = None,
        subset: list[str] | None = None,
        fairness_id: str | None = None,
        session: str | None = None,
        input_tokens: int = 0,
        output_tokens: int = 0,
        now: float | None = None,
    ) -> tuple[str, str | None] | None: ...
    def completed_prefill(
        self, endpoint: str, input_tokens: int = 0, *, now: float | None = None
    ) -> None: ...
    @property
    def roles(self) -> list[Literal["prefill", "decode", "both"]] | None: ...
    @property
    def decider(self) -> Literal["always", "never", "uncached-tokens", "prefill-load"]: ...
    def pick(
        self,
        tokens: npt.ArrayLike | bytes | str | None = None,
        *,
        hashes: npt.NDArray[np.uint64] | None = None,
        adapter: str | None = None,
        subset: list[str] | None = None,
        fairness_id: str | None = None,
        session: str | None = None,
        input_tokens: int = 0,
        output_tokens: int = 0,
        now: float | None = None,
    ) -> str | None: ...
    def rank(
        self,
        tokens: npt.ArrayLike | bytes | str | None = None,
        *,
        hashes: npt.NDArray[np.uint64] | None = None,
        adapter: str | None = None,
        subset: list[str] | None = None,
        fairness_id: str | None = None,
        session: str | None = None,
        input_tokens: int = 0,
        output_tokens: int = 0,
        now: float | None = None,
    ) -> list[str]: ...
    def pick_many(
        self,
        tokens: npt.ArrayLike | bytes | str | None = None,
        offsets: npt.ArrayLike | None = None,
        *,
        input_tokens: npt.ArrayLike | None = None,
        output_tokens: npt.ArrayLike | None = None,
        fairness_ids: list[str] | None = None,
        sessions: list[str] | None = None,
        now: float | None = None,
    ) -> npt.NDArray[np.int64]: ...
    def started(
        self,
        endpoint: str,
        tokens: npt.ArrayLike | bytes | str | None = None,
        *,
        hashes: npt.NDArray[np.uint64] | None = None,
        fairness_id: str | None = None,
        session: str | None = None,
        input_tokens: int = 0,
        output_tokens: int = 0,
        now: float | None = None,
    ) -> None: ...
    def completed(
        self,
        endpoint: str,
        input_tokens: int = 0,
        output_tokens: int = 0,
        *,
        fairness_id: str | None = None,
        est_input_tokens: int = 0,
        est_output_tokens: int = 0,
        now: float | None = None,
    ) -> None: ...
    def set_state(
        self,
        endpoint: str,
        *,
        waiting: float | None = None,
        running: float | None = None,
        kv_usage: float | None = None,
        healthy: bool | None = None,
        adapters: list[str] | None = None,
    ) -> None: ...
    def state(self, endpoint: str) -> dict[str, Any]: ...
    def add_endpoint(self, endpoint: str) -> None: ...
    def remove_endpoint(self, endpoint: str) -> None: ...
    @property
    def endpoints(self) -> list[str]: ...
    @property
    def in_flight(self) -> list[int]: ...
    @property
    def preset(self) -> str | None: ...
    @property
    def plugins(self) -> list[dict[str, Any]]: ...
    def to_bytes(self) -> bytes: ...
    @staticmethod
    def from_bytes(data: bytes, kv_index: KvEventIndex | None = None) -> EndpointPicker: ...
    def __reduce__(self) -> tuple[Any, tuple[bytes]]: ...

# --- compress-and-route (capability 8) ---------------------------------------

@final
class Compressor:
    """Extractive prompt compression (FleetOpt section 5.2)."""

    def __new__(
        cls,
        textrank: float = 0.2,
        position: float = 0.4,
        tfidf: float = 0.35,
        novelty: float = 0.05,
        keep_first: int = 3,
        keep_last: int = 2,
    ) -> Self: ...
    def compress(
        self,
        text: str,
        token_budget: int,
        category: str | None = None,
        bytes_per_token: float | None = None,
    ) -> CompressionResult: ...
    def compress_request(
        self,
        body: str | bytes,
        token_budget: int,
        category: str | None = None,
        bytes_per_token: float | None = None,
    ) -> RequestCompression: ...
    @property
    def textrank(self) -> float: ...
    @property
    def position(self) -> float: ...
    @property
    def tfidf(self) -> float: ...
    @property
    def novelty(self) -> float: ...
    @property
    def keep_first(self) -> int: ...
    @property
    def keep_last(self) -> int: ...
    def __reduce__(self) -> tuple[Any, tuple[float, float, float, float, int, int]]: ...

@disjoint_base
class CompressionSummary:
    """Sizes and outcome shared by CompressionResult and RequestCompression."""

    @property
    def tokens_before(self) -> int: ...
    @property
    def tokens_after(self) -> int: ...
    @property
    def bytes_per_token(self) -> float: ...
    @property
    def status(self) -> Literal["fits", "compressed", "code", "impossible"]: ...
    @property
    def succeeded(self) -> bool: ...

@final
class CompressionResult(CompressionSummary):
    """The outcome of ``Compressor.compress``."""

    @property
    def text(self) -> str: ...
    @property
    def kept_sentence_indices(self) -> list[int]: ...
    @property
    def sentences(self) -> int: ...

@final
class RequestCompression(CompressionSummary):
    """The outcome of ``Compressor.compress_request``."""

    @property
    def body(self) -> bytes: ...
    @property
    def compressed_messages(self) -> list[int]: ...

@final
class RoutedRequest:
    """A request routed by ``TokenBudgetRouter.route_request``."""

    @property
    def decision(self) -> RouteDecision: ...
    @property
    def body(self) -> bytes: ...
    @property
    def compression(self) -> RequestCompression | None: ...
    @property
    def category(self) -> str: ...
    @property
    def prompt_bytes(self) -> int: ...
    @property
    def media_tokens(self) -> int: ...
    @property
    def max_output_tokens(self) -> int: ...

# --- Workloads and profiles (issue 3) ---

import os  # noqa: E402

@final
class Workload:
    """Input/output token pairs of a trace, or a weighted distribution from a CDF."""

    def __new__(
        cls,
        input_tokens: npt.ArrayLike,
        output_tokens: npt.ArrayLike,
        arrival_s: npt.ArrayLike | None = None,
        categories: list[str] | None = None,
    ) -> Self: ...
    @staticmethod
    def from_csv(
        path: str | os.PathLike[str],
        input_column: str = "ContextTokens",
        output_column: str = "GeneratedTokens",
        arrival_column: str | None = None,
        category_column: str | None = None,
    ) -> Workload: ...
    @staticmethod
    def azure_2023() -> Workload: ...
    @staticmethod
    def from_cdf(points: list[tuple[int, float]], input_fraction: float = 0.8) -> Workload: ...
    def sample(self, n: int, seed: int = 0) -> Workload: ...
    def __len__(self) -> int: ...
    def cdf(self, x: float) -> float: ...
    def quantile(self, q: float) -> int: ...
    def mean_tokens(self, lo: float = 0.0, hi: float = ...) -> float: ...
    @property
    def input_tokens(self) -> npt.NDArray[np.uint64]: ...
    @property
    def output_tokens(self) -> npt.NDArray[np.uint64]: ...
    @property
    def total_tokens(self) -> npt.NDArray[np.uint64]: ...
    @property
    def weights(self) -> npt.NDArray[np.float64]: ...
    @property
    def arrival_s(self) -> npt.NDArray[np.float64] | None: ...
    @property
    def categories(self) -> npt.NDArray[np.str_] | None: ...
    @property
    def category_names(self) -> list[str]: ...
    def __reduce__(self) -> tuple[Any, ...]: ...

@final
class Service:
    """One pool's service of a workload range (see ``Profile.service``)."""

    @property
    def n_slots(self) -> int: ...
    @property
    def fraction(self) -> float: ...
    @property
    def mean_s(self) -> float: ...
    @property
    def cs2(self) -> float: ...
    @property
    def mu_gpu(self) -> float: ...
    @property
    def t_iter_s(self) -> float: ...
    @property
    def prefill_p99_s(self) -> float: ...

@final
class Profile:
    """A model on a GPU type: KV memory, slots and iteration timing."""

    def __new__(
        cls,
        name: str,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype_bytes: float,
        gpu_memory_bytes: float,
        model_memory_bytes: float,
        w_s: float,
        h_s: float,
        utilization: float = 0.9,
        tensor_parallel: int = 1,
        c_chunk: int = 512,
        price_per_gpu_hour: float = 0.0,
        h_ref_tokens: int | None = None,
    ) -> Self: ...
    @staticmethod
    def llama3_70b_a100() -> Profile: ...
    @staticmethod
    def qwen3_235b_mi300x() -> Profile: ...
    def replace(self, **changes: Any) -> Profile: ...
    def fields(self) -> dict[str, Any]: ...
    @property
    def name(self) -> str: ...
    @property
    def layers(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype_bytes(self) -> float: ...
    @property
    def gpu_memory_bytes(self) -> float: ...
    @property
    def model_memory_bytes(self) -> float: ...
    @property
    def utilization(self) -> float: ...
    @property
    def tensor_parallel(self) -> int: ...
    @property
    def w_s(self) -> float: ...
    @property
    def h_s(self) -> float: ...
    @property
    def c_chunk(self) -> int: ...
    @property
    def price_per_gpu_hour(self) -> float: ...
    @property
    def h_ref_tokens(self) -> int | None: ...
    @property
    def kv_bytes_per_token(self) -> float: ...
    @property
    def kv_bytes_per_token_per_gpu(self) -> float: ...
    def slots(self, max_context: int) -> int: ...
    def t_iter(self, n: float) -> float: ...
    def service(
        self,
        workload: Workload,
        max_context: int,
        lo: float = 0.0,
        hi: float = ...,
        prefill_quantile: float = 0.99,
    ) -> Service: ...
    def __reduce__(self) -> tuple[Any, ...]: ...
    def __eq__(self, other: object, /) -> bool: ...

# --- Queueing and the FleetOpt planner (issue 3) ---

def erlang_b(servers: int, offered_load: float) -> float: ...
def erlang_c(servers: int, offered_load: float) -> float: ...
def erlang_c_many(
    servers: npt.ArrayLike, offered_load: npt.ArrayLike
) -> npt.NDArray[np.float64]: ...
def p99_wait(servers: int, service_rate: float, cs2: float, arrival_rate: float) -> float: ...

@final
class ErlangScan:
    """Erlang B and C while scanning the server count upward, O(1) per step."""

    def __new__(cls, servers: int, offered_load: float) -> Self: ...
    def advance(self, steps: int = 1) -> None: ...
    @property
    def servers(self) -> int: ...
    @property
    def offered_load(self) -> float: ...
    @property
    def erlang_b(self) -> float: ...
    @property
    def erlang_c(self) -> float: ...
    def to_bytes(self) -> bytes: ...
    @staticmethod
    def from_bytes(data: bytes) -> ErlangScan: ...
    def __reduce__(self) -> tuple[Any, tuple[bytes]]: ...

@final
class Candidate:
    """One (b_short, gamma) fleet of a plan."""

    @property
    def b_short(self) -> int: ...
    @property
    def gamma(self) -> float: ...
    @property
    def alpha(self) -> float: ...
    @property
    def beta(self) -> float: ...
    @property
    def alpha_prime(self) -> float: ...
    @property
    def n_short(self) -> int: ...
    @property
    def n_long(self) -> int: ...
    @property
    def gpus(self) -> int: ...
    @property
    def feasible(self) -> bool: ...
    @property
    def feasible_short(self) -> bool: ...
    @property
    def feasible_long(self) -> bool: ...
    @property
    def slots_short(self) -> int: ...
    @property
    def slots_long(self) -> int: ...
    @property
    def context_short(self) -> int: ...
    @property
    def context_long(self) -> int: ...
    @property
    def arrival_rate_short(self) -> float: ...
    @property
    def arrival_rate_long(self) -> float: ...
    @property
    def mu_gpu_short(self) -> float: ...
    @property
    def mu_gpu_long(self) -> float: ...
    @property
    def cs2_short(self) -> float: ...
    @property
    def cs2_long(self) -> float: ...
    @property
    def occupancy_short(self) -> float: ...
    @property
    def occupancy_long(self) -> float: ...
    @property
    def prefill_utilization_short(self) -> float: ...
    @property
    def prefill_utilization_long(self) -> float: ...
    @property
    def kv_utilization_short(self) -> float: ...
    @property
    def kv_utilization_long(self) -> float: ...
    @property
    def binding_short(self) -> str: ...
    @property
    def binding_long(self) -> str: ...
    @property
    def utilization_short(self) -> float: ...
    @property
    def utilization_long(self) -> float: ...
    @property
    def t_iter_short_s(self) -> float: ...
    @property
    def t_iter_long_s(self) -> float: ...
    @property
    def prefill_p99_short_s(self) -> float: ...
    @property
    def prefill_p99_long_s(self) -> float: ...
    @property
    def p99_wait_short_s(self) -> float: ...
    @property
    def p99_wait_long_s(self) -> float: ...
    @property
    def p99_ttft_short_s(self) -> float: ...
    @property
    def p99_ttft_long_s(self) -> float: ...
    @property
    def annual_cost_usd(self) -> float: ...
    @property
    def savings_vs_homogeneous(self) -> float | None: ...
    def as_dict(self) -> dict[str, Any]: ...

@final
class Plan:
    """The result of ``plan``."""

    @property
    def homogeneous(self) -> Candidate: ...
    @property
    def best(self) -> Candidate | None: ...
    @property
    def pool_routing(self) -> Candidate | None: ...
    @property
    def sweep(self) -> list[Candidate]: ...
    def candidate(self, b_short: int, gamma: float) -> Candidate: ...
    def __len__(self) -> int: ...

def plan(
    workload: Workload,
    arrival_rate: float,
    slo_ttft_s: float,
    profile: Profile | None = None,
    *,
    b_short: list[int] | None = None,
    gammas: list[float] | None = None,
    p_c: float = 1.0,
    p_c_by_category: dict[str, float] | None = None,
    phi: float = 1.0,
    rho_max: float | None = None,
    long_context: int = 65536,
    prefill_quantile: float = 0.99,
    model: str = "engine",
    slo_tpot_s: float | None = None,
) -> Plan: ...
def pool_routing_savings(alpha: float, rho: float) -> float: ...
def g_dual(alpha: float, arrival_rate: float, mu_short: float, mu_long: float) -> float: ...
def annual_cost_usd(
    gpus: float, price_per_gpu_hour: float, hours_per_year: float = 8760.0
) -> float: ...

# --- Fleet simulator (issue 4) ---

from collections.abc import Callable, Mapping, Sequence  # noqa: E402

@final
class SimPool:
    """A pool of identical simulated endpoints (vLLM engines)."""

    def __new__(
        cls,
        name: str,
        endpoints: int,
        max_context: int,
        max_num_seqs: int,
        kv_blocks: int | None = None,
        chunk: int = 512,
        w: float = 0.008,
        h: float = 0.00065,
        gpus_per_endpoint: int = 1,
        budget: int | None = None,
    ) -> Self: ...
    @property
    def name(self) -> str: ...
    @property
    def endpoints(self) -> int: ...
    @property
    def max_context(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def kv_blocks(self) -> int: ...
    @property
    def gpus(self) -> int: ...
    def __reduce__(self) -> tuple[Any, ...]: ...

@final
class SimReport:
    """The outcome of ``simulate``: per-request arrays, per-pool figures, summaries."""

    @property
    def ttft(self) -> npt.NDArray[np.float64]: ...
    @property
    def tpot(self) -> npt.NDArray[np.float64]: ...
    @property
    def e2e(self) -> npt.NDArray[np.float64]: ...
    @property
    def queue_wait(self) -> npt.NDArray[np.float64]: ...
    @property
    def cached_tokens(self) -> npt.NDArray[np.uint64]: ...
    @property
    def endpoint(self) -> npt.NDArray[np.int64]: ...
    @property
    def pool(self) -> npt.NDArray[np.int64]: ...
    @property
    def measured(self) -> npt.NDArray[np.bool_]: ...
    @property
    def rejected(self) -> npt.NDArray[np.bool_]: ...
    @property
    def compressed(self) -> npt.NDArray[np.bool_]: ...
    @property
    def router_rejections(self) -> int: ...
    @property
    def window(self) -> tuple[float, float]: ...
    @property
    def makespan(self) -> float: ...
    @property
    def pools(self) -> list[dict[str, Any]]: ...
    def summary(self) -> dict[str, dict[str, float]]: ...

def simulate(
    arrival_s: npt.ArrayLike,
    input_tokens: npt.ArrayLike,
    output_tokens: npt.ArrayLike,
    pools: Sequence[SimPool],
    *,
    category: npt.ArrayLike | None = None,
    session: npt.ArrayLike | None = None,
    categories: Sequence[tuple[str, float, bool]] | None = None,
    router: str = "token-budget",
    gamma: float = 1.5,
    dispatch: str | Sequence[Mapping[str, Any]] | None = None,
    arrivals: str = "trace",
    rate: float | None = None,
    seed: int = 0,
    warmup: float = 0.2,
    blocks: tuple[npt.NDArray[np.uint64], npt.ArrayLike] | None = None,
    block_tokens: npt.ArrayLike | None = None,
    scrape_interval: float = 0.0,
    progress: Callable[[int, int], object] | None = None,
) -> SimReport: ...

@final
class PrefixWorkload:
    """A seeded workload with shared prefixes (multi-turn sessions, shared system prompts)."""

    def __new__(
        cls,
        *,
        requests: int = 2000,
        rate: float = 20.0,
        sessions: int = 64,
        turns: tuple[int, int] = ...,
        system_prompts: int = 8,
        shared_fraction: float = 0.9,
        system_tokens: tuple[int, int] = ...,
        user_tokens: tuple[int, int] = ...,
        output_tokens: tuple[int, int] = ...,
        seed: int = 0,
    ) -> Self: ...
    def __len__(self) -> int: ...
    @property
    def arrival_s(self) -> npt.NDArray[np.float64]: ...
    @property
    def input_tokens(self) -> npt.NDArray[np.uint64]: ...
    @property
    def output_tokens(self) -> npt.NDArray[np.uint64]: ...
    @property
    def session(self) -> npt.NDArray[np.uint64]: ...
    @property
    def turn(self) -> npt.NDArray[np.uint64]: ...
    @property
    def system_prompt(self) -> npt.NDArray[np.int64]: ...
    @property
    def block_hashes(self) -> npt.NDArray[np.uint64]: ...
    @property
    def block_offsets(self) -> npt.NDArray[np.int64]: ...
    @property
    def block_tokens(self) -> npt.NDArray[np.uint32]: ...
    @property
    def blocks(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]]: ...

# --- multi-tenant admission: quotas (capability 7) ----------------------

@final
class Quota:
    """A capacity shared by tenants (the paper's token pool) in inference-native units."""

    def __new__(
        cls,
        name: str,
        tokens_per_s: float,
        kv_bytes: int,
        concurrency: int,
        kv_bytes_per_token: int = 0,
    ) -> Self: ...
    @property
    def name(self) -> str: ...
    @property
    def tokens_per_s(self) -> float: ...
    @property
    def kv_bytes(self) -> int: ...
    @property
    def concurrency(self) -> int: ...
    @property
    def kv_bytes_per_token(self) -> int: ...
    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]: ...

@final
class Entitlement:
    """A tenant's baseline share of one quota, with a service class and a state."""

    def __new__(
        cls,
        name: str,
        tenant: str,
        quota: str,
        service_class: str,
        slo_target_ms: float,
        tokens_per_s: float,
        kv_bytes: int,
        concurrency: int,
        state: str = "bound",
    ) -> Self: ...
    @property
    def name(self) -> str: ...
    @property
    def tenant(self) -> str: ...
    @property
    def quota(self) -> str: ...
    @property
    def service_class(self) -> str: ...
    @property
    def slo_target_ms(self) -> float: ...
    @property
    def tokens_per_s(self) -> float: ...
    @property
    def kv_bytes(self) -> int: ...
    @property
    def concurrency(self) -> int: ...
    @property
    def state(self) -> str: ...
    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]: ...

@final
class Admission:
    """One admission decision (status 200 admitted; 401, 403, 413, 429, 503 rejected)."""

    def __new__(
        cls,
        admitted: bool,
        status: int,
        reason: str,
        retry_after_s: float | None = None,
        ticket: int | None = None,
        priority: float = 0.0,
    ) -> Self: ...
    @property
    def admitted(self) -> bool: ...
    @property
    def status(self) -> int: ...
    @property
    def reason(self) -> str: ...
    @property
    def retry_after_s(self) -> float | None: ...
    @property
    def ticket(self) -> int | None: ...
    @property
    def priority(self) -> float: ...
    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]: ...

def priority_weight(
    service_class: str,
    slo_target_ms: float,
    quota_mean_slo_ms: float,
    burst: float = 0.0,
    debt: float = 0.0,
) -> float: ...
def load(
    target: str,
    requests: int = 200,
    concurrency: int = 8,
    rate: float | None = None,
    duration_s: float | None = None,
    body_bytes: int = 1024,
    api_key: str = "demo-key",
    server_pid: int | None = None,
    threads: int = 1,
    response_delay_s: float = 0.0,
    timeout_s: float = 10.0,
) -> dict[str, Any]: ...
def admission_lua() -> dict[str, str]: ...
def admission_redis_config(
    quotas: list[Quota],
    entitlements: list[Entitlement],
    window_s: float,
    lease_s: float,
    max_window_entries: int,
    max_window_entries_per_quota: int,
    max_void_markers: int,
) -> dict[str, str]: ...

@final
class AdmissionController:
    """Multi-tenant admission control over quotas (Cunningham 2026)."""

    def __new__(
        cls,
        quotas: list[Quota],
        entitlements: list[Entitlement],
        default_max_tokens: int = 4096,
        window_s: float = 60.0,
    ) -> Self: ...
    def admit(
        self,
        entitlement: str,
        input_tokens: int,
        max_tokens: int | None = None,
        now: float | None = None,
    ) -> Admission: ...
    def admit_many(
        self,
        entitlement_ids: npt.ArrayLike,
        input_tokens: npt.ArrayLike,
        max_tokens: npt.ArrayLike | None = None,
        now: float | None = None,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
    def entitlement_id(self, name: str) -> int: ...
    def complete(
        self,
        ticket: int,
        actual_input: int,
        actual_output: int,
        latency_s: float,
        now: float | None = None,
    ) -> None: ...
    def release(self, ticket: int, now: float | None = None) -> None: ...
    def evictions(self, now: float | None = None) -> list[int]: ...
    def priority(self, entitlement: str) -> float: ...
    def stats(self, entitlement: str) -> dict[str, float]: ...
    def quota_in_flight(self, quota: str) -> int: ...
    def set_state(self, entitlement: str, state: str) -> None: ...
    def set_capacity(
        self,
        quota: str,
        tokens_per_s: float | None = None,
        kv_bytes: int | None = None,
        concurrency: int | None = None,
    ) -> None: ...
    @property
    def quotas(self) -> list[Quota]: ...
    @property
    def entitlements(self) -> list[Entitlement]: ...
    @property
    def default_max_tokens(self) -> int: ...
    @property
    def window_s(self) -> float: ...
    def to_bytes(self) -> bytes: ...
    @staticmethod
    def from_bytes(data: bytes) -> AdmissionController: ...
    def __reduce__(self) -> tuple[Any, tuple[bytes]]: ...

# --- autoscaling from the capacity model (capability 14) ----------------------

@final
class Autoscaler:
    """Each pool's desired endpoint count from its live workload (a sliding
    window per pool and per entitlement), sized by the planner's engine
    model for the pool's SLO, within its bounds, damped; for benches and
    evaluations, not re-exported from ``routecore``."""

    def __new__(
        cls,
        config: Mapping[str, Any],
        profiles: Sequence[Profile],
        now: float | None = None,
    ) -> Self: ...
    def observe(
        self,
        pool: str,
        prompt_tokens: int,
        output_tokens: int,
        entitlement: str | None = None,
        now: float | None = None,
    ) -> None:
        """Counts a finished request in ``pool`` (and ``entitlement``)."""
    def observe_many(
        self,
        pool: str,
        prompt_tokens: npt.ArrayLike,
        output_tokens: npt.ArrayLike,
        now: npt.ArrayLike,
        entitlement: str | None = None,
    ) -> None:
        """``observe`` for arrays of equal length, all checked first."""
    def live(
        self, pool: str, entitlement: str | None = None, now: float | None = None
    ) -> dict[str, Any]:
        """The window's requests, rate, token means and percentiles."""
    def step(
        self,
        now: float | None = None,
        queued: Mapping[str, float] | None = None,
        promised: Mapping[str, float] | None = None,
    ) -> list[dict[str, Any]]:
        """One sizing step: per pool the damped ``endpoints`` and why."""

# --- autoscaling in the simulator (capability 14) -----------------------------

#: The policies ``autoscale_simulate`` runs: a static fleet at the peak, the
#: fleet sized in hindsight, the saturation rule and routecore's autoscaler.
AUTOSCALE_POLICIES: tuple[str, ...]

@final
class RateProfile:
    """A request rate over time from a spec (``step:500@0,2000@600``,
    ``diurnal:low=,high=,period=``, ``burst:base=,peak=,at=,length=[,every=]``)."""

    def __new__(cls, spec: str) -> Self: ...
    @property
    def spec(self) -> str: ...
    def rate(self, t: float) -> float:
        """The rate at ``t`` seconds, requests per second."""
    def cumulative(self, t: float) -> float:
        """The expected requests in ``[0, t]``."""
    def peak(self, until: float) -> float:
        """The highest rate in ``[0, until]``."""
    def rises(self, until: float) -> list[float]:
        """The times in ``(0, until)`` where the rate jumps up."""
    def arrivals(
        self, duration_s: float, *, seed: int = 0, trace_s: npt.ArrayLike | None = None
    ) -> npt.NDArray[np.float64]:
        """Poisson arrivals following the rate, or a trace's timestamps scaled to it."""

def autoscale_simulate(
    arrival_s: npt.ArrayLike,
    input_tokens: npt.ArrayLike,
    output_tokens: npt.ArrayLike,
    profile: Profile,
    config: Mapping[str, Any],
    *,
    rate_profile: RateProfile,
    policy: str,
    horizon_s: float,
    startup_s: float = 60.0,
    saturation: Mapping[str, float] | None = None,
    dispatch: str | Sequence[Mapping[str, Any]] | None = None,
    progress: Callable[[int, int], object] | None = None,
) -> dict[str, Any]: ...

# --- one request's steps (Dispatcher) -----------------------------------------

@final
class DispatchSteps:
    """``Dispatcher.acquire``'s steps (route, admit, pick) over Rust parts in
    one call, and a lease's release; used by ``routecore.Dispatcher``, not
    re-exported from ``routecore``."""

    def __new__(
        cls,
        refused: Callable[[str, int, str, float | None], BaseException],
        router: TokenBudgetRouter | None = None,
        pickers: EndpointPicker | Mapping[str, EndpointPicker] | None = None,
        admission: AdmissionController | None = None,
        clock: Callable[[], float] | None = None,
    ) -> Self: ...
    def acquire(
        self,
        max_output_tokens: int,
        prompt_bytes: int | None,
        category: str,
        input_tokens: int | None,
        entitlement: str | None,
        tokens: Any,
        fairness_id: str | None,
        session: str | None,
        now: float | None,
    ) -> tuple[int, RouteDecision | None, Admission | None, str | None, str | None]: ...
    def release(
        self,
        decision: RouteDecision | None,
        admission: Admission | None,
        endpoint: str | None,
        prefill_endpoint: str | None,
        fairness_id: str | None,
        input_tokens: int,
        max_output_tokens: int,
        actual_input: int,
        actual_output: int,
        latency_s: float,
        now: float | None,
    ) -> None: ...

# --- flow control (capability 12) ---------------------------------------------

#: A request that left a FlowQueue: (ticket, band, outcome, item, waited_s).
_FlowLeft = tuple[int, str, str, Any, float]

@final
class FlowQueue:
    """One pool's flow-control queue (WDRR across bands, fairness across
    flows, FCFS or earliest deadline inside a flow); for benches and
    evaluations, not re-exported from ``routecore``."""

    #: The floor of a flow's weight (the token-pool priority ``w_e``).
    MIN_WEIGHT: ClassVar[float]
    def __new__(cls, config: Mapping[str, Any] | None = None) -> Self: ...
    @property
    def bands(self) -> list[str]: ...
    def band_of(self, key: str | None = None) -> str: ...
    def __len__(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    def enqueue(
        self,
        band: str,
        flow: str,
        item: Any,
        bytes: int = 0,
        cost: float = 1.0,
        weight: float = 1.0,
        deadline: float | None = None,
        now: float | None = None,
    ) -> tuple[int | None, str, float | None, list[_FlowLeft]]: ...
    def dispatch(self, now: float | None = None) -> _FlowLeft | None: ...
    def cancel(self, ticket: int, now: float | None = None) -> _FlowLeft: ...
    def expire(self, now: float | None = None) -> list[_FlowLeft]: ...
    def drain(self, now: float | None = None) -> list[_FlowLeft]: ...
    def next_expiry(self) -> float | None: ...
    def retry_after_s(self, band: str, now: float | None = None) -> float: ...
    def stats(self, band: str) -> dict[str, int]: ...

def flow_eval(
    experiment: int, policy: str, scale: float = 1.0, ttl_s: float = 30.0, seed: int = 0
) -> dict[str, Any]: ...

# --- precise prefix routing from KV events (capability 11) --------------------

@final
class KvEventIndex:
    """The precise prefix index: what each endpoint's engine holds in its KV
    cache, built from the engine's KV-cache events (vLLM's ZeroMQ publisher),
    keyed by routecore's own chained block hashes of the events' token ids."""

    def __new__(
        cls,
        block_size: int = 16,
        capacity_blocks: int = 262144,
        seed: int = 0,
        stale_after_s: float | None = None,
        max_message_bytes: int = 16777216,
        max_batch_events: int = 131072,
        max_batch_blocks: int = 262144,
    ) -> Self: ...
    def subscribe(
        self, endpoint: str, zmq: str, topic: str = "", replay: str | None = None
    ) -> None: ...
    def endpoints(self) -> list[str]: ...
    def leading_blocks(
        self, token_ids: list[int] | npt.NDArray[np.uint32], adapter: str | None = None
    ) -> dict[str, int | None]: ...
    def blocks(self, endpoint: str) -> list[int]: ...
    def stats(self, endpoint: str) -> dict[str, Any]: ...
    def close(self) -> None: ...

# --- the data plane of routecore serve (capability 9) ------------------------

@final
class DataPlane:
    """The data plane of ``routecore serve``: Envoy's ext_proc (and
    ``grpc.health.v1``) served from Rust on a tokio runtime owned by this
    object, Prometheus metrics on their own port, structured JSON logs on
    stderr. A conversation never enters the interpreter."""

    @staticmethod
    def start(
        spec_json: str,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics_port: int | None = None,
        worker_threads: int = 2,
        calibrator: bytes | None = None,
        log_level: int = 20,
        *,
        tokenizers: dict[str, Tokenizer] | None = None,
        unix_socket: str | os.PathLike[str] | None = None,
        unix_socket_mode: int = 0o600,
    ) -> DataPlane:
        """Starts serving ``spec_json`` (``Config.spec_json()``) with the models'
        ``tokenizers`` handed over loaded (``Config.tokenizers()``), ext_proc on the
        ``unix_socket`` path too (``unix_socket_mode`` 0o600 or 0o660; a stale socket
        replaced, the file removed at the drain); ValueError for a bad spec, a port or
        a socket that cannot be bound."""
    @property
    def port(self) -> int:
        """The gRPC port (ext_proc and health)."""
    @property
    def metrics_port(self) -> int | None:
        """The metrics port, or None."""
    @property
    def ready(self) -> bool:
        """Whether the data plane reports ``readiness`` SERVING on its gRPC
        health service (what Envoy asks): every endpoint's state synced and
        the admission backend warm (a fail-closed Redis admission stays not
        ready while Redis is down); False again from the start of a drain."""
    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Blocks, the GIL released, until the data plane is :attr:`ready`
        (True), or until ``timeout_s`` passes (None: no limit) or a drain stops
        it first (False): woken by the change, never polling. Run it in a
        thread from asyncio (``await asyncio.to_thread(plane.wait_ready)``).
        ValueError for a negative or NaN ``timeout_s``."""
    def reload(self, spec_json: str, *, tokenizers: dict[str, Tokenizer] | None = None) -> None:
        """Swaps in a new configuration atomically; open streams finish on theirs."""
    def drain(self, grace_s: float) -> None:
        """Stops taking streams, gives open ones ``grace_s`` seconds, then stops."""
    @staticmethod
    def set_log_level(level: int) -> None:
        """Sets the log level (a Python logging level number)."""
    @property
    def calibrator(self) -> Calibrator:
        """The learned calibrator, live (shared with the data plane)."""
    def route_body(
        self, body: bytes, api_key: bytes | None = None, token_ids: list[int] | None = None
    ) -> dict[str, Any]:
        """Routes an OpenAI request body (``api_key`` None: no tenant; ``token_ids``
        key the prefix policies in place of the body's prompt)."""
    def route_fields(
        self,
        prompt_bytes: int,
        category: str,
        max_output_tokens: int,
        prompt_tokens: int | None = None,
        api_key: bytes | None = None,
        token_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        """Routes a request by its measured fields."""
    def finish(
        self,
        request_id: str,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
    ) -> bool:
        """Releases any request with its usage (a trusted caller); False when it is
        not in flight."""
    def feedback(
        self,
        request_id: str,
        api_key: bytes,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
    ) -> dict[str, Any]:
        """The RouteCore API's Feedback through the front door: releases a request
        the key's tenant routed through ``route_body`` / ``route_fields``;
        ``{"done": True}`` or ``{"done": False, "status", "reason", "message", ...}``
        (401 / 403 the key, 400 an id over 64 bytes, 404 none of the caller's)."""
    def authenticate(self, api_key: bytes) -> dict[str, Any]:
        """Checks a key as the front door does: ``{"authenticated": True, "tenant":
        name or None}`` or ``{"authenticated": False, "status", "reason", ...}``."""
    def reap(self) -> int:
        """Releases every request past its deadline now; returns how many."""
    def leases(self) -> list[str]:
        """The request ids in flight."""
    def in_flight(self) -> dict[str, Any]:
        """Everything requests in flight hold, summed over the live engines."""
    def endpoints(self) -> dict[str, dict[str, dict[str, Any]]]:
        """What the endpoint picker knows of each endpoint, by pool."""
    def metric(self, name: str, *labels: str) -> float | None:
        """A metric's current value by name (without ``routecore_``) and labels."""
    def autoscale(self) -> list[dict[str, Any]] | None:
        """The autoscaler's last step, one dict a scaled pool (as
        ``Autoscaler.step``); None when autoscaling is off."""
    def metrics_text(self) -> str:
        """The Prometheus exposition text."""
    def inject_fault(self, phase: str) -> None:
        """Makes one phase of the next request fail (tests of the failure paths)."""

# --- Prefill/decode disaggregation: planning and simulation (issue 25) ---

@final
class DisaggPlan:
    """A prefill/decode fleet beside the aggregated one, from ``plan_disaggregated``."""

    n_prefill: int
    n_decode: int
    n_aggregated: int
    gpus: int
    feasible: bool
    choice: str
    slots: int
    context: int
    arrival_rate: float
    transfer_q_s: float
    feasible_prefill: bool
    feasible_decode: bool
    feasible_aggregated: bool
    binding_prefill: str
    binding_decode: str
    binding_aggregated: str
    t_iter_prefill_s: float
    t_iter_decode_s: float
    t_iter_aggregated_s: float
    utilization_prefill: float
    utilization_decode: float
    utilization_aggregated: float
    prefill_utilization_prefill: float
    prefill_utilization_decode: float
    prefill_utilization_aggregated: float
    kv_utilization_prefill: float
    kv_utilization_decode: float
    kv_utilization_aggregated: float
    p99_wait_prefill_s: float
    p99_wait_decode_s: float
    p99_wait_aggregated_s: float
    p99_ttft_prefill_s: float
    p99_ttft_decode_s: float
    p99_ttft_aggregated_s: float
    def as_dict(self) -> dict[str, Any]: ...

def plan_disaggregated(
    workload: Workload,
    arrival_rate: float,
    slo_ttft_s: float,
    profile: Profile | None = None,
    *,
    slo_tpot_s: float | None = None,
    quantile: float = 0.99,
    context: int = 65536,
    bytes_per_token: float | None = None,
    bandwidth_bytes_s: float = 25e9,
    latency_s: float = 0.002,
) -> DisaggPlan: ...

@final
class DisaggReport:
    """The outcome of ``simulate_disaggregated``."""

    @property
    def ttft(self) -> npt.NDArray[np.float64]: ...
    @property
    def tpot(self) -> npt.NDArray[np.float64]: ...
    @property
    def e2e(self) -> npt.NDArray[np.float64]: ...
    @property
    def disaggregated(self) -> npt.NDArray[np.bool_]: ...
    @property
    def measured(self) -> npt.NDArray[np.bool_]: ...
    @property
    def window(self) -> tuple[float, float]: ...
    @property
    def makespan(self) -> float: ...
    @property
    def pools(self) -> list[dict[str, Any]]: ...
    def summary(self) -> dict[str, dict[str, float]]: ...

def simulate_disaggregated(
    arrival_s: npt.ArrayLike,
    input_tokens: npt.ArrayLike,
    output_tokens: npt.ArrayLike,
    decode: SimPool,
    prefill: SimPool | None = None,
    *,
    decider: str = "always",
    threshold: int = 0,
    bytes_per_token: float = 40960.0,
    bandwidth_bytes_s: float = 25e9,
    latency_s: float = 0.002,
    arrivals: str = "trace",
    rate: float | None = None,
    seed: int = 0,
    warmup: float = 0.2,
) -> DisaggReport: ...
