"""What one engine step costs: measured on this machine (linear) or derived from a chip (roofline).

A step runs prompt or extend chunks (``(new_tokens, context_tokens)`` each: tokens computed
now over tokens already cached) and one token for each of ``num_decode`` decoding sequences
whose contexts add up to ``decode_context_tokens``. Both models answer the same three
questions: how long a step takes, how fast KV is exported to wire frames, how fast it is
imported from them.
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

FEATURES = ("step", "new_tokens", "attention", "decode_sequences", "decode_context_tokens", "chunk_context_tokens")
"""The linear model's terms: a fixed cost per step, per computed token, per (new × context)
attention pair, per decoding sequence, per context token a decode step reads, per cached token
a prompt or extend chunk attends over. The last is not the decode step's: our engine runs a
chunk over cached blocks through a masked attention that costs per cached token whatever the
chunk's size (measured here: a 16-token extend over 1,024 cached tokens costs 0.28 s, as much as
a 100-token prefill from nothing; without this term the fit missed it by 40 %)."""


def step_features(chunks: list[tuple[int, int]], num_decode: int, decode_context_tokens: int) -> np.ndarray:
    """The linear model's feature vector of one step."""
    new = sum(n for n, _ in chunks)
    attention = sum(n * (context + n / 2) for n, context in chunks)
    chunk_context = sum(context for _, context in chunks)
    return np.asarray([1.0, new, attention, num_decode, decode_context_tokens, chunk_context])


def nonnegative_least_squares(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (a cost term cannot be negative): terms that
    come out negative are dropped and the rest refitted, until none is."""
    active = list(range(features.shape[1]))
    coefficients = np.zeros(features.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(features[:, active], seconds, rcond=None)
        if (solution >= 0).all():
            coefficients[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return coefficients


@dataclass(frozen=True)
class LinearCostModel:
    """A cost model fitted to measurements of one engine on one machine (``pdd profile``).

    Attributes:
        coefficients: Seconds per unit of each of :data:`FEATURES`.
        export_bytes_per_s: KV export (encode to wire frames) throughput.
        import_bytes_per_s: KV import (validate and write into the pool) throughput.
        kv_bytes_per_token: The model's KV size per token.
        max_batch_tokens: The engine's token budget per step.
        source: What was measured where (model, device, date).
        max_prefill_requests: Requests whose prompt chunks share one step (0: as many as the
            token budget takes, as our engine schedules them).
    """

    coefficients: tuple[float, ...]
    export_bytes_per_s: float
    import_bytes_per_s: float
    kv_bytes_per_token: int
    max_batch_tokens: int = 2048
    source: str = ""
    max_prefill_requests: int = 0

    def step_s(self, chunks: list[tuple[int, int]], num_decode: int = 0, decode_context_tokens: int = 0) -> float:
        """Seconds for one step."""
        return float(np.dot(self.coefficients, step_features(chunks, num_decode, decode_context_tokens)))

    def export_s(self, num_bytes: int) -> float:
        """Seconds to encode ``num_bytes`` of KV into frames."""
        return num_bytes / self.export_bytes_per_s

    def import_s(self, num_bytes: int) -> float:
        """Seconds to write ``num_bytes`` of received KV into the pool."""
        return num_bytes / self.import_bytes_per_s


@dataclass(frozen=True)
class ModelSpec:
    """A transformer's sizes, as its public config states them.

    Attributes:
        name: The model.
        params: Parameters used per token (a mixture of experts: the activated ones).
        weight_bytes: Bytes of all weights.
        num_layers: Transformer layers.
        attention_dim: FLOPs of one (query, key) pair in one layer of a prompt or extend chunk,
            over 4: query heads × head dim for multi-head and grouped attention (QKᵀ and PV are
            2 × heads × head dim each).
        kv_bytes_per_token: KV cache bytes per token (all layers, keys and values).
        source: Where the figures come from.
        decode_attention_dim: The same for a decode step, where it differs (multi-head latent
            attention decodes in its absorbed form, over the 512 + 64-wide latent); 0: as
            ``attention_dim``.
        expert_weight_bytes: Bytes of the routed experts' weights (0: a dense model).
        num_experts: Routed experts per layer.
        experts_per_token: Routed experts each token uses.
    """

    name: str
    params: float
    weight_bytes: float
    num_layers: int
    attention_dim: int
    kv_bytes_per_token: int
    source: str = ""
    decode_attention_dim: int = 0
    expert_weight_bytes: float = 0.0
    num_experts: int = 0
    experts_per_token: int = 0

    def weight_bytes_read(self, tokens: int) -> float:
        """Weight bytes one step over ``tokens`` tokens reads: every dense weight, and of the
        routed experts those at least one token picks (uniform routing: each expert is missed
        by a token with probability 1 - k/E)."""
        if not self.expert_weight_bytes or not self.num_experts:
            return self.weight_bytes
        touched = 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** max(1, tokens)
        return self.weight_bytes - self.expert_weight_bytes * (1.0 - touched)


@dataclass(frozen=True)
class ChipSpec:
    """A data-centre accelerator's public specifications and our price assumption.

    Attributes:
        name: The chip.
        peak_flops: Dense BF16 tensor FLOP/s.
        hbm_bytes_per_s: Memory bandwidth.
        hbm_bytes: Memory capacity.
        price: Relative price (the planner's unit of cost).
        sources: Where each figure comes from.
    """

    name: str
    peak_flops: float
    hbm_bytes_per_s: float
    hbm_bytes: float
    price: float = 1.0
    sources: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Efficiency:
    """How close an engine gets to the roofline (assumptions, stated in docs/planning.md).

    Attributes:
        flops: Fraction of peak FLOP/s a prefill or extend reaches.
        bandwidth: Fraction of peak bandwidth a decode step reaches.
        step_overhead_s: Fixed host cost per step (scheduling, launches).
        kv_memory_share: Share of the memory left after the weights that holds KV.
        transfer_bytes_per_s: KV export/import rate on the device (a copy through HBM).
    """

    flops: float = 0.5
    bandwidth: float = 0.7
    step_overhead_s: float = 0.003
    kv_memory_share: float = 0.9
    transfer_bytes_per_s: float = 100e9


@dataclass(frozen=True)
class RooflineCostModel:
    """A step's time from a chip's peak compute and bandwidth: max(FLOPs / compute, bytes /
    bandwidth) plus a fixed overhead.

    An instance may span ``chips`` chips (tensor or expert parallel, for a model whose weights
    one chip cannot hold): their compute, bandwidth and memory add up; the collective
    communication between them is not modelled, beyond what the efficiencies leave out.

    Attributes:
        chip: The accelerator.
        model: The model served.
        efficiency: Reachable share of the peaks.
        max_batch_tokens: Token budget per step (chunked prefill).
        chips: Chips in one instance.
        max_prefill_requests: Requests whose prompt chunks share one step (0: as many as the
            budget takes; 1: an engine that prefills one request at a time, so a request's small
            tail chunk runs alone).
    """

    chip: ChipSpec
    model: ModelSpec
    efficiency: Efficiency = Efficiency()
    max_batch_tokens: int = 8192
    chips: int = 1
    max_prefill_requests: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        """The model's KV size per token."""
        return self.model.kv_bytes_per_token

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV one instance holds."""
        spare = max(0.0, self.chip.hbm_bytes * self.chips - self.model.weight_bytes) * self.efficiency.kv_memory_share
        return int(spare // self.model.kv_bytes_per_token)

    def step_s(self, chunks: list[tuple[int, int]], num_decode: int = 0, decode_context_tokens: int = 0) -> float:
        """Seconds for one step."""
        spec = self.model
        new = sum(n for n, _ in chunks)
        chunk_pairs = sum(n * (context + n / 2) for n, context in chunks)
        flops = 2 * spec.params * (new + num_decode) + 4 * spec.num_layers * (
            spec.attention_dim * chunk_pairs + (spec.decode_attention_dim or spec.attention_dim) * decode_context_tokens
        )
        read_tokens = sum(context for _, context in chunks) + decode_context_tokens
        moved = spec.weight_bytes_read(new + num_decode) + spec.kv_bytes_per_token * (read_tokens + new + num_decode)
        compute_s = flops / (self.chip.peak_flops * self.chips * self.efficiency.flops)
        memory_s = moved / (self.chip.hbm_bytes_per_s * self.chips * self.efficiency.bandwidth)
        return max(compute_s, memory_s) + self.efficiency.step_overhead_s

    def export_s(self, num_bytes: int) -> float:
        """Seconds to stage ``num_bytes`` of KV for sending."""
        return num_bytes / self.efficiency.transfer_bytes_per_s

    def import_s(self, num_bytes: int) -> float:
        """Seconds to place ``num_bytes`` of received KV."""
        return num_bytes / self.efficiency.transfer_bytes_per_s


_CATALOGUE = Path(__file__).with_name("chips.json")


def catalogue() -> dict:
    """The chip and model catalogue (``chips.json``), sources included."""
    return json.loads(_CATALOGUE.read_text())


def chip(name: str, price: float | None = None) -> ChipSpec:
    """A chip from the catalogue (``price`` overrides its assumed relative price)."""
    entry = catalogue()["chips"][name]
    spec = ChipSpec(
        name,
        entry["peak_bf16_flops"]["value"],
        entry["hbm_bytes_per_s"]["value"],
        entry["hbm_bytes"]["value"],
        entry["price"]["value"],
        {key: value["source"] for key, value in entry.items() if isinstance(value, dict)},
    )
    return (
        spec
        if price is None
        else ChipSpec(spec.name, spec.peak_flops, spec.hbm_bytes_per_s, spec.hbm_bytes, price, spec.sources)
    )


def model(name: str) -> ModelSpec:
    """A model from the catalogue."""
    entry = catalogue()["models"][name]
    return ModelSpec(
        name,
        entry["params"],
        entry["weight_bytes"],
        entry["num_layers"],
        entry["attention_dim"],
        entry["kv_bytes_per_token"],
        entry["source"],
        entry.get("decode_attention_dim", 0),
        entry.get("expert_weight_bytes", 0.0),
        entry.get("num_experts", 0),
        entry.get("experts_per_token", 0),
    )


def load_linear(path: Path) -> LinearCostModel:
    """A profile written by ``pdd profile``."""
    data = json.loads(Path(path).read_text())["cost_model"]
    coefficients = list(data["coefficients"])
    coefficients += [0.0] * (len(FEATURES) - len(coefficients))  # a profile from before a term was added
    return LinearCostModel(
        tuple(coefficients),
        data["export_bytes_per_s"],
        data["import_bytes_per_s"],
        data["kv_bytes_per_token"],
        data["max_batch_tokens"],
        data.get("source", ""),
    )


def linear_as_json(model: LinearCostModel) -> dict:
    """The profile's ``cost_model`` object."""
    data = asdict(model)
    data["coefficients"] = list(model.coefficients)
    data["features"] = list(FEATURES)
    return data
