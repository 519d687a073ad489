"""A mixture of experts in place of a layer's MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
DeepSeek V2 and V3; ``ModelConfig.num_experts``): a router scores every expert for each token, the token's MLP
is the sum of its ``k`` best experts' gated MLPs, each weighted by its softmax probability
(renormalized over the k where the family does), plus a shared expert, gated by a sigmoid
where the family has one (Qwen2-MoE). DeepSeek's routers choose within each token's best
groups of experts and scale the weights; V3's score by sigmoids and choose with a bias.

Each expert multiplies only the rows routed to it, gathered into one block, on the same
kernels as a dense linear (common/model/linear.py: quantized experts stay so on the CPU,
where each projection of all the experts is one kernel call: cpu_linear.ExpertLinears).
A token's k results are added in the order its router ranked them, one [T, hidden] add at
a time: a row's answer is the same alone as in any batch, on any device (no scattered
atomic adds), given kernels whose rows do not depend on each other (the CPU's).

On a CUDA device in bfloat16 the experts' weights are stacked and each projection of all of
them is one ``torch._grouped_mm`` over the routed rows (``Mixture.stack``); elsewhere the
loop over the experts reads the routed counts back to the host once a layer. Neither is
captured in CUDA graphs yet (``DecoderModel.graphable``; not yet run on a GPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F

from common.model.cpu_linear import ExpertLinears
from common.model.linear import Linear

Adapt = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class GatedMLP:
    gate_up: Linear  # gate and up in one matmul
    down: Linear

    def __call__(self, x: torch.Tensor, gated: Callable[[torch.Tensor], torch.Tensor],
                 adapt: Optional[Adapt] = None) -> torch.Tensor:
        """``adapt(slot, x, y)``: y, linear ``slot`` of x, with LoRA updates added
        (common/model/lora.py ``LoraRows.add``)."""
        if adapt is None:
            return self.down(gated(self.gate_up(x)))
        a = gated(adapt("gate_up", x, self.gate_up(x)))
        return adapt("down", a, self.down(a))

    def linears(self) -> Iterator[tuple[str, Linear]]:
        yield from (("gate_up", self.gate_up), ("down", self.down))


@dataclass
class Mixture:
    router: Linear  # [experts, hidden], in the model's dtype (llama.cpp keeps it unquantized)
    experts: list[GatedMLP]
    top_k: int
    normalize: bool  # the k probabilities renormalized to sum to 1
    shared: Optional[GatedMLP] = None
    shared_gate: Optional[Linear] = None  # [1, hidden]: sigmoid(x . g) scales ``shared``
    # DeepSeek's routers (ModelConfig.router_scoring ...): V3's sigmoid scores, ``bias``
    # added to them to choose (not to weigh), the choice within each row's best
    # ``groups_per_token`` of ``groups`` groups, the weights times ``scale``
    sigmoid: bool = False
    bias: Optional[torch.Tensor] = None  # float32 [experts]
    groups: int = 1
    groups_per_token: int = 1
    group_score: int = 2  # a group's score: the sum of its best this many
    scale: float = 1.0

    def __post_init__(self) -> None:
        # quantized experts on the CPU: each projection of all of them in one kernel call
        self.grouped: Optional[tuple[ExpertLinears, ExpertLinears]] = None
        # or all the experts' weights stacked for torch._grouped_mm (``stack``)
        self.stacked: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        if any(e.gate_up.bias is not None or e.down.bias is not None for e in self.experts):
            return
        gate_up = ExpertLinears.of([e.gate_up.native for e in self.experts])
        down = ExpertLinears.of([e.down.native for e in self.experts])
        if gate_up is not None and down is not None:
            self.grouped = gate_up, down
        elif _grouped_mm_serves(self.experts[0].gate_up.weight):
            self.stack()

    def stack(self) -> None:
        """Each projection of all the experts as one ``torch._grouped_mm`` over their
        weights stacked [experts, out, in] (each expert's ``Linear`` then holds its slice:
        no copy kept): a step's routed rows in two matmuls, no count read back to the
        host. Done at build on a CUDA model in bfloat16 (cuBLAS's grouped GEMM); any
        device can run it (tests run it on the CPU)."""
        stacks = []
        for name in ("gate_up", "down"):
            linears = [getattr(e, name) for e in self.experts]
            weights = [lin.weight for lin in linears]
            if any(w is None for w in weights):
                raise ValueError("stacking experts needs their weights as plain tensors")
            stack = torch.stack(weights)  # type: ignore[arg-type]
            for i, lin in enumerate(linears):
                lin.weight = stack[i]
            stacks.append(stack.transpose(1, 2))  # [experts, in, out]: grouped_mm's B
        self.stacked = stacks[0], stacks[1]

    def linears(self) -> Iterator[tuple[str, Linear]]:
        yield "router", self.router
        for e, expert in enumerate(self.experts):
            yield from ((f"experts.{e}.{name}", lin) for name, lin in expert.linears())
        if self.shared is not None and self.shared_gate is not None:
            yield from ((f"shared.{name}", lin) for name, lin in self.shared.linears())
            yield "shared_gate", self.shared_gate

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, experts [T, k]) of each row, best first."""
        logits = self.router(x).float()
        scores = _row_sigmoid(logits) if self.sigmoid else torch.softmax(logits, dim=-1)
        choice = scores if self.bias is None else scores + self.bias
        if self.groups > 1:  # only the experts of the row's best groups
            t = choice.shape[0]
            by_group = choice.view(t, self.groups, -1)
            best = (by_group.topk(self.group_score, dim=-1).values.sum(-1)
                    .topk(self.groups_per_token, dim=-1))
            keep = torch.zeros(t, self.groups, 1, dtype=torch.bool, device=x.device)
            keep[torch.arange(t, device=x.device)[:, None], best.indices] = True
            choice = by_group.masked_fill(~keep, float("-inf")).view(t, -1)
        chosen = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * self.scale).to(x.dtype), chosen

    def __call__(self, x: torch.Tensor, gated: Callable[[torch.Tensor], torch.Tensor]
                 ) -> torch.Tensor:
        t, k = x.shape[0], self.top_k
        weights, chosen = self.route(x)
        if t == 1 and self.grouped is None and self.stacked is None:
            # one row on the expert-by-expert path: its experts in rank order
            out = torch.cat([self.experts[e](x, gated) for e in chosen[0].tolist()])
        else:
            flat = chosen.reshape(-1)  # row r's j-th choice at r * k + j
            order = torch.argsort(flat, stable=True)  # grouped by expert, rows ascending
            ys = self._routed(x.index_select(0, order // k), flat, gated)
            out = torch.empty_like(ys)
            out[order] = ys  # back to [row, choice]
        out = out.view(t, k, -1) * weights.unsqueeze(-1)
        total = out[:, 0]
        for j in range(1, k):  # in rank order, as a row alone adds them
            total = total + out[:, j]
        if self.shared is not None:
            shared = self.shared(x, gated)
            total = total + (shared if self.shared_gate is None
                             else _row_sigmoid(self.shared_gate(x)) * shared)
        return total

    def _routed(self, xs: torch.Tensor, flat: torch.Tensor,
                gated: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The routed rows ``xs``, grouped by expert in ascending order (``flat``: each
        row's expert, unsorted), each through its expert."""
        experts = len(self.experts)
        if self.stacked is not None:  # offsets made on the device: nothing read back
            ends = torch.zeros(experts, dtype=torch.int64, device=xs.device)
            offsets = ends.scatter_add_(0, flat, torch.ones_like(flat)).cumsum_(0).int()
            gate_up, down = self.stacked
            return torch._grouped_mm(gated(torch._grouped_mm(xs, gate_up, offs=offsets)),
                                     down, offs=offsets)
        counts = torch.bincount(flat, minlength=experts)
        if self.grouped is not None:
            starts = torch.zeros(experts + 1, dtype=torch.int64)
            torch.cumsum(counts, 0, out=starts[1:])
            gate_up, down = self.grouped
            return down(gated(gate_up(xs, starts)), starts).to(xs.dtype)
        return torch.cat([expert(rows, gated) for expert, rows
                          in zip(self.experts, xs.split(counts.tolist())) if rows.shape[0]])


def _grouped_mm_serves(weight: Optional[torch.Tensor]) -> bool:
    """Whether ``torch._grouped_mm`` serves experts of this weight at build: bfloat16 on a
    CUDA device (cuBLAS's grouped GEMM on Hopper; elsewhere it may be a loop)."""
    return (weight is not None and weight.device.type == "cuda"
            and weight.dtype is torch.bfloat16 and hasattr(torch, "_grouped_mm"))


def _row_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """sigmoid of [T, n], each row's the same whatever T: torch computes a contiguous
    run's whole vectors one way and its tail another, so each row is made a whole number
    of 64 values (of any CPU's unrolled vectors) first: a column spread, wider rows
    padded."""
    n = x.shape[1]
    wide = (x.expand(-1, 64).contiguous() if n == 1
            else F.pad(x, (0, -n % 64)) if n % 64 else x)
    return torch.sigmoid(wide)[:, :n]
