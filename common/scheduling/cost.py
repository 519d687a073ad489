"""Cost models the conductor and the simulator share.

Prefill time is a polynomial in the new tokens ``n`` and the cached tokens ``c`` of a
request::

    T_prefill(n, c) = c0 + c_new*n + c_cached*c + c_new_cached*n*c + c_new_sq*n^2

(linear layers scale with ``n``; causal attention with ``n*c + n^2/2``; ``c_cached`` covers
loading cached KV when it is not overlapped). Decode time between tokens (TBT) of one batch
step is ``d0 + d_batch*B + d_ctx*K`` for batch size ``B`` and ``K`` context tokens in the
batch (weights read once per step, KV read per token, per-sequence compute). A worker that
steps at most ``M`` sequences at once serves a larger batch in ``R = ceil(B/M)`` turns, so a
sequence waits ``R*d0 + d_batch*B + d_ctx*K`` between tokens (the per-step cost is paid R
times; the per-sequence and per-token costs once). A live cluster corrects both online
(services/conductor/calibration.py): TTFT = ``prefill_overhead_s + prefill_scale *
T_prefill``, TBT = ``decode_scale *`` the above. Transfer time is ``bytes / bandwidth``.
Formulas and the named profiles are written down in docs/simulator.md.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

PREFILL_TERMS = ("c0", "c_new", "c_cached", "c_new_cached", "c_new_sq")


@dataclass(frozen=True)
class PrefillCoefficients:
    c0: float = 0.0
    c_new: float = 0.0
    c_cached: float = 0.0
    c_new_cached: float = 0.0
    c_new_sq: float = 0.0


@dataclass(frozen=True)
class DecodeCoefficients:
    d0: float = 0.0
    d_batch: float = 0.0
    d_ctx: float = 0.0


def _prefill_features(new_tokens: float, cached_tokens: float) -> list[float]:
    n, c = float(new_tokens), float(cached_tokens)
    return [1.0, n, c, n * c, n * n]


def fit_prefill_cost(samples: Sequence[tuple[int, int, float]]) -> PrefillCoefficients:
    """Least-squares fit of the prefill polynomial to (new, cached, seconds) samples.

    Terms that the samples cannot determine (e.g. no sample has cached tokens) get 0.
    """
    if not samples:
        raise ValueError("fit_prefill_cost needs at least one sample")
    x = np.array([_prefill_features(n, c) for n, c, _ in samples], dtype=np.float64)
    y = np.array([s for _, _, s in samples], dtype=np.float64)
    return PrefillCoefficients(*_nonnegative_lstsq(x, y))


def fit_decode_cost(samples: Sequence[tuple[int, int, float]]) -> DecodeCoefficients:
    """Least-squares fit of ``d0 + d_batch*B + d_ctx*K`` to (batch B, context tokens of
    the batch K, seconds per step) samples."""
    if not samples:
        raise ValueError("fit_decode_cost needs at least one sample")
    x = np.array([[1.0, b, k] for b, k, _ in samples], dtype=np.float64)
    y = np.array([s for _, _, s in samples], dtype=np.float64)
    return DecodeCoefficients(*_nonnegative_lstsq(x, y))


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares of the *relative* error (each sample weighted by 1/seconds: what a
    TTFT prediction is judged by; plain least squares fits the longest prompts and lets a
    short one's fixed cost go) with no negative coefficient: every term is a cost, and
    noisy samples (a busy machine, few sizes) fit a negative one that predicts nonsense
    away from them. The most negative term is dropped (0) and the others refitted, until
    none is. Terms the samples cannot determine (an all-zero column) get 0."""
    weight = 1.0 / np.maximum(y, 1e-4)
    x, y = x * weight[:, None], y * weight
    active = [j for j in range(x.shape[1]) if np.any(x[:, j])]
    coef = np.zeros(x.shape[1])
    while active:
        cols = x[:, active]
        scale = np.maximum(np.abs(cols).max(axis=0), 1e-12)  # condition the columns
        fit, *_ = np.linalg.lstsq(cols / scale, y, rcond=None)
        fit = fit / scale
        if fit.min() >= 0:
            coef[active] = fit
            break
        del active[int(np.argmin(fit))]
    return [float(v) for v in coef]

# LLaMA3-70B (80 layers, d_model 8192, 8 KV heads x 128, bf16) on one 8xA800-80GB node with
# tensor parallelism 8. Derivation in docs/simulator.md.
_LLAMA3_70B_FLOPS = 8 * 312e12 * 0.5          # 8 GPUs, bf16 peak, 50 % MFU in prefill
_LLAMA3_70B_HBM = 8 * 2.039e12 * 0.7          # bytes/s, 70 % of peak HBM bandwidth
_LLAMA3_70B_KV_BYTES = 2 * 80 * 8 * 128 * 2   # K and V, layers, kv heads, head dim, bf16
_PROFILES: dict[str, dict] = {
    "llama3-70b-8xa800": {
        "name": "llama3-70b-8xa800",
        "prefill": asdict(PrefillCoefficients(
            c0=0.02,
            c_new=2 * 70.6e9 / _LLAMA3_70B_FLOPS,
            c_new_cached=4 * 80 * 8192 / _LLAMA3_70B_FLOPS,
            c_new_sq=2 * 80 * 8192 / _LLAMA3_70B_FLOPS,
        )),
        "decode": asdict(DecodeCoefficients(
            d0=0.005 + 141.2e9 / _LLAMA3_70B_HBM,
            d_batch=2 * 70.6e9 / _LLAMA3_70B_FLOPS,
            d_ctx=_LLAMA3_70B_KV_BYTES / _LLAMA3_70B_HBM,
        )),
        "kv_bytes_per_token": _LLAMA3_70B_KV_BYTES,
        "transfer_bandwidth_bytes_per_s": 87e9,     # paper: 4x200 Gbps RDMA, measured
        "kv_capacity_tokens": 1_372_160,           # (640 - 141 - 50) GB of HBM for KV
    },
}


def _scale(tokens: int, long: float, short: Optional[float], short_tokens: int) -> float:
    """The live correction of the profile for a prompt of ``tokens`` to compute: by
    ``short`` where it is learned and the prompt has at most ``short_tokens``, else
    ``long`` (``CostModel.scale_for``, ``Scales``)."""
    return short if short is not None and tokens <= short_tokens else long


@dataclass(frozen=True)
class Scales:
    """A cost model's live corrections at one moment, for pricing what was computed by the
    profile (common/scheduling/queued.py: a queue priced once, scaled when asked)."""

    long: float = 1.0
    short: Optional[float] = None
    short_tokens: int = 0

    def of_tokens(self, tokens: int) -> float:
        return _scale(tokens, self.long, self.short, self.short_tokens)


class CostModel:
    """Predicts prefill seconds, decode TBT and KV transfer seconds."""

    def __init__(
        self,
        prefill: PrefillCoefficients,
        decode: DecodeCoefficients,
        kv_bytes_per_token: int,
        transfer_bandwidth_bytes_per_s: float,
        kv_capacity_tokens: int = 0,
        name: str = "custom",
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.kv_bytes_per_token = kv_bytes_per_token
        self.transfer_bandwidth_bytes_per_s = transfer_bandwidth_bytes_per_s
        self.kv_capacity_tokens = kv_capacity_tokens
        self.name = name
        # What a live cluster adds to the polynomial (services/conductor/calibration.py):
        # a request's TTFT beyond its compute (reservation, messages, the KV handover,
        # the worker's own work between steps) and the compute's speed against the profile
        self.prefill_overhead_s = 0.0
        self.prefill_scale = 1.0
        # Prompts of at most ``prefill_short_tokens`` to compute preempt a longer prompt's
        # step with one of their own, whose fixed cost is theirs alone: their own scale
        # once learned (None: ``prefill_scale``)
        self.prefill_short_tokens = 0
        self.prefill_short_scale: Optional[float] = None
        # a live decode step against the profile's (sampling, streaming, the inbox
        # between steps, a busier or quieter machine)
        self.decode_scale = 1.0

    def prefill_seconds(self, new_tokens: int, cached_tokens: int) -> float:
        """A request's TTFT on an idle instance: its overhead and its compute."""
        return self.prefill_overhead_s + self.prefill_compute_seconds(new_tokens, cached_tokens)

    def prefill_compute_seconds(self, new_tokens: int, cached_tokens: int) -> float:
        """The instance's compute for it: what a request queued behind it waits for (its
        overhead overlaps the next one's compute)."""
        return self.scale_for(new_tokens) * self.profile_prefill_seconds(new_tokens,
                                                                         cached_tokens)

    def prefill_key(self) -> tuple:
        """What ``profile_prefill_seconds`` depends on that the cluster may change (a
        worker's fitted coefficients, ``adopt``): a profile's time is current while this is
        equal. The online calibration's scales are not in it: they apply on top."""
        return (self.prefill,)

    def scale_for(self, new_tokens: int) -> float:
        """The live correction of the profile for a prompt of ``new_tokens`` to compute."""
        return _scale(new_tokens, self.prefill_scale, self.prefill_short_scale,
                      self.prefill_short_tokens)

    def scales(self) -> Scales:
        """Those corrections as they stand now."""
        return Scales(self.prefill_scale, self.prefill_short_scale, self.prefill_short_tokens)

    def profile_prefill_seconds(self, new_tokens: int, cached_tokens: int) -> float:
        """The polynomial alone (PipelineCost: the group's pipelined time of it)."""
        p = self.prefill
        n, c = float(new_tokens), float(cached_tokens)
        t = p.c0 + p.c_new * n + p.c_cached * c + p.c_new_cached * n * c + p.c_new_sq * n * n
        return max(t, 0.0)

    def decode_tbt_seconds(self, batch_size: float, total_context_tokens: float,
                           step_batch: Optional[int] = None) -> float:
        """Seconds between two tokens of one sequence in a batch of ``batch_size``;
        ``step_batch``: the most sequences one step runs (None: all of them)."""
        d = self.decode
        turns = 1
        if step_batch is not None and batch_size > step_batch:
            turns = math.ceil(batch_size / step_batch)
        return self.decode_scale * max(
            turns * d.d0 + d.d_batch * batch_size + d.d_ctx * total_context_tokens, 0.0)

    def profile_decode_seconds(self, steps: int, sequences: int, context_tokens: int) -> float:
        """The profile's time of ``steps`` decode steps of ``sequences`` and
        ``context_tokens`` in all (each step within the largest batch: one turn each)."""
        d = self.decode
        return max(d.d0 * steps + d.d_batch * sequences + d.d_ctx * context_tokens, 0.0)

    def with_decode_slowdown(self, factor: float) -> "CostModel":
        """The same model with every decode step ``factor`` times slower (a decode pool of
        slower or fewer accelerators); prefill and transfers unchanged."""
        if factor <= 0:
            raise ValueError("factor must be positive")
        d = self.decode
        decode = DecodeCoefficients(d.d0 * factor, d.d_batch * factor, d.d_ctx * factor)
        return CostModel(self.prefill, decode, self.kv_bytes_per_token,
                         self.transfer_bandwidth_bytes_per_s, self.kv_capacity_tokens,
                         f"{self.name}/decode-x{factor:g}")

    def transfer_seconds(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return nbytes / self.transfer_bandwidth_bytes_per_s

    def kv_transfer_seconds(self, tokens: int) -> float:
        return self.transfer_seconds(tokens * self.kv_bytes_per_token)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "prefill": asdict(self.prefill),
            "decode": asdict(self.decode),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "transfer_bandwidth_bytes_per_s": self.transfer_bandwidth_bytes_per_s,
            "kv_capacity_tokens": self.kv_capacity_tokens,
        }

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        return cls(
            prefill=PrefillCoefficients(**data.get("prefill", {})),
            decode=DecodeCoefficients(**data.get("decode", {})),
            kv_bytes_per_token=int(data["kv_bytes_per_token"]),
            transfer_bandwidth_bytes_per_s=float(data["transfer_bandwidth_bytes_per_s"]),
            kv_capacity_tokens=int(data.get("kv_capacity_tokens", 0)),
            name=str(data.get("name", "custom")),
        )

    def to_json(self, path: Union[str, Path]) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: Union[str, Path]) -> CostModel:
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def profile(cls, name: str) -> CostModel:
        """A named hardware/model profile, or a path to a coefficients JSON file."""
        if name in _PROFILES:
            return cls.from_dict(_PROFILES[name])
        if Path(name).is_file():
            return cls.from_json(name)
        raise KeyError(f"unknown cost profile {name!r}; known: {sorted(_PROFILES)}")

    @staticmethod
    def profile_names() -> list[str]:
        return sorted(_PROFILES)


HOP_S = 0.001  # a chunk's hidden states from one stage to the next (benchmarks/hidden_path.py)


class PipelineCost(CostModel):
    """A prefill group: ``stages`` processes, each holding 1/stages of the layers, compute a
    prompt in chunks of ``chunk`` tokens, chunk c on stage k while stage k-1 computes chunk
    c+1 (chunked pipeline parallelism, services/prefill/group.py). ``prefill`` stays the
    polynomial of one whole-model worker, T_1; a prompt of C chunks takes C + X - 1
    pipeline slots, each a chunk on one stage (T_1 / (C X)) and a hop to the next::

        T_X = (C + X - 1) * (T_1 / (C X) + hop)

    One chunk (a short prompt) gains nothing and pays the hops: T_1 + X hop; a long
    prompt tends to T_1 / X. The online calibration corrects it from the group's own
    prefills (``prefill_overhead_s``, ``prefill_scale``)."""

    def __init__(self, base: CostModel, stages: int, chunk: int, hop_s: float = HOP_S) -> None:
        if stages < 2 or chunk < 1:
            raise ValueError(f"a pipeline needs 2 or more stages and chunks of 1 or more "
                             f"tokens, not {stages} and {chunk}")
        super().__init__(base.prefill, base.decode, base.kv_bytes_per_token,
                         base.transfer_bandwidth_bytes_per_s, base.kv_capacity_tokens,
                         f"{base.name}/pipeline-x{stages}")
        self.stages, self.chunk, self.hop_s = stages, chunk, hop_s

    def _shape(self, new_tokens: int) -> tuple[int, int]:
        """(chunks, pipeline slots) of a prompt of ``new_tokens``."""
        chunks = max(1, math.ceil(new_tokens / self.chunk))
        return chunks, chunks + self.stages - 1

    def profile_prefill_seconds(self, new_tokens: int, cached_tokens: int) -> float:
        chunks, slots = self._shape(new_tokens)
        whole = super().profile_prefill_seconds(new_tokens, cached_tokens)
        return slots * (whole / (chunks * self.stages) + self.hop_s)
