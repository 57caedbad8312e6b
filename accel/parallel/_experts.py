"""Expert parallelism for `wrap_model`: each ep rank holds num_experts / ep of every
mixture-of-experts layer's experts, and a dispatcher sends each routed token to its expert.

An experts module (transformers' `MixtralExperts`, `Qwen2MoeExperts`, `Qwen3MoeExperts`, or
one of your own) holds every expert's weights stacked on dim 0 and is called as
`experts(hidden (tokens, dim), top_k_index (tokens, k), top_k_weights (tokens, k))`, returning
the weighted sum of each token's k experts (tokens, dim). Under ep its parameters become
DTensors sharded on dim 0 over the ep ranks (so checkpoints reshard to any ep size) and its
forward becomes the dispatcher: sort this rank's (token, slot) assignments by expert, drop
those past an expert's capacity (counted), one all-to-all of the counts and one of the tokens
to the ranks holding their experts, each local expert run once on everything it received, an
all-to-all back, and the weighted sum. The router and the rest of the model are untouched.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from accel.parallel._alltoall import all_to_all
from accel.parallel._tp import named_by

ExpertFn = Callable[[nn.Module, Mapping[str, torch.Tensor], torch.Tensor], torch.Tensor]
"""`fn(module, weights, tokens) -> outputs`: one expert on its tokens; `weights` maps each
parameter name of the experts module to this expert's slice (`param[e]`)."""


def gate_up_down(module: nn.Module, w: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """One expert of transformers' layout: `gate_up_proj` (2 x inter, dim), `down_proj`
    (dim, inter) and the module's `act_fn`, as `MixtralExperts.forward` computes it."""
    gate, up = F.linear(x, w["gate_up_proj"]).chunk(2, dim=-1)
    return F.linear(module.act_fn(gate) * up, w["down_proj"])  # type: ignore[operator]


# transformers' experts classes of the gate_up_proj / down_proj / act_fn layout: ep_plan="auto"
PRESETS = frozenset({"MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts", "Qwen3_5MoeExperts"})


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertParallel:
    """How `wrap_model` runs one experts module under expert parallelism (an `ep_plan` value).

    Example:
        >>> from accel import ExpertParallel
        >>> ExpertParallel(capacity_factor=1.25).capacity_factor
        1.25
    """

    expert_fn: ExpertFn | Literal["gate_up_down"] = "gate_up_down"
    """One expert's computation, `fn(module, weights, tokens)`; "gate_up_down" (default):
    transformers' gate_up_proj / down_proj / act_fn layout."""
    capacity_factor: float | None = None
    """None: every routed token is computed (dropless). A number c: each expert takes at most
    ceil(c x tokens x top_k / num_experts) of a rank's assignments, in token order; the rest
    are dropped (they add nothing; the residual connection carries the token) and counted in
    the module's `dropped_tokens` buffer."""

    def __post_init__(self) -> None:
        if self.expert_fn != "gate_up_down" and not callable(self.expert_fn):
            raise TypeError(
                f"ExpertParallel: expert_fn={self.expert_fn!r} must be a function "
                "fn(module, weights, tokens) -> outputs computing one expert, or "
                "'gate_up_down' (transformers' layout)."
            )
        c = self.capacity_factor
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or c <= 0):
            raise ValueError(
                f"ExpertParallel: capacity_factor={c!r} must be a positive number (1.25 lets an "
                "expert take 25% over an even share), or None for no capacity (dropless)."
            )


def _style(value: Any, pattern: str) -> ExpertParallel:
    if isinstance(value, ExpertParallel):
        return value
    if value == "gate_up_down" or callable(value):
        return ExpertParallel(expert_fn=value)
    raise TypeError(
        f"wrap_model: ep_plan[{pattern!r}]={value!r} is not an experts style; expected "
        "'gate_up_down' (transformers' layout), a function fn(module, weights, tokens) "
        "computing one expert, or accel.ExpertParallel(expert_fn=..., capacity_factor=...)."
    )


def resolve_plan(model: nn.Module, plan: Any, ep: int) -> tuple[tuple[str, ExpertParallel], ...]:
    """(name, style) of each experts module `plan` names; every one checked against `ep`."""
    modules = dict(model.named_modules())
    if plan == "auto":
        found = [(n, ExpertParallel()) for n, m in modules.items() if type(m).__name__ in PRESETS]
        if not found:
            raise ValueError(
                f"wrap_model: ep_plan='auto' finds transformers' experts classes "
                f"{sorted(PRESETS)}, and {type(model).__name__} has none. Name your experts "
                "modules, e.g. ep_plan={'layers.*.moe.experts': my_expert_fn}."
            )
    elif isinstance(plan, Mapping) and plan and all(isinstance(k, str) for k in plan):
        found = [
            (n, _style(value, pattern))
            for pattern, value in plan.items()
            for n in named_by(model, "ep_plan", pattern, "layers.*.moe.experts")
        ]
    else:
        raise (ValueError if isinstance(plan, str) else TypeError)(
            f"wrap_model: ep_plan={plan!r} is not a plan; expected 'auto' (transformers' "
            "experts classes) or a dict of module-name pattern -> experts style, e.g. "
            "ep_plan={'layers.*.moe.experts': my_expert_fn}."
        )
    for name, _ in found:
        _check_module(name, modules[name], ep)
    return tuple(found)


def _check_module(name: str, module: nn.Module, ep: int) -> None:
    params = dict(module.named_parameters())
    sizes = {n: p.shape[0] if p.dim() else None for n, p in params.items()}
    num = getattr(module, "num_experts", None)
    if not isinstance(num, int) or not params or set(sizes.values()) != {num}:
        raise ValueError(
            f"wrap_model: ep_plan names {name} ({type(module).__name__}), whose parameters "
            f"{sizes} do not all stack num_experts={num!r} experts on dim 0; expert "
            "parallelism splits dim 0 over ep. Name the module holding the stacked experts "
            "(with its num_experts attribute, as transformers' experts modules have)."
        )
    count = next(iter(sizes.values()))
    assert count is not None
    if count % ep:
        raise ValueError(
            f"wrap_model: {name} holds {count} experts, which ep={ep} does not divide; each ep "
            f"rank holds num_experts / ep of them. Choose an ep size dividing {count}."
        )


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward scales the gradient (the expert weights' share of the mean
    over data-parallel ranks that FSDP2 does not divide by: the ep ranks)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def shard_experts(module: nn.Module, mesh: Any) -> None:
    """Turn the module's parameters into DTensors sharded on dim 0 over the ep `mesh`."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for name, param in list(module.named_parameters(recurse=False)):
        shard = distribute_tensor(param.detach(), mesh, [Shard(0)])
        module.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))


def dispatch(
    module: nn.Module, style: ExpertParallel, group: Any, ep: int, device: torch.device
) -> None:
    """Replace the module's forward with the token dispatcher over `group` (ep ranks); its
    counters are buffers on `device`, the run's."""
    num_experts = next(iter(module.parameters())).shape[0]
    module.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64,
                           device=device), persistent=False)  # fmt: skip
    module.register_buffer("dropped_tokens", torch.zeros((), dtype=torch.int64, device=device),
                           persistent=False)  # fmt: skip
    run = functools.partial(_forward, module, style, group, ep, num_experts)
    module.forward = functools.wraps(module.forward)(run)


def _forward(
    module: nn.Module, style: ExpertParallel, group: Any, ep: int, num_experts: int,
    x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The dispatcher: route, exchange, compute each local expert once, exchange back, sum."""
    k = top_k_index.shape[-1]
    experts = top_k_index.reshape(-1)
    order = torch.argsort(experts, stable=True)  # assignments grouped by expert, token order kept
    counts = torch.bincount(experts, minlength=num_experts)
    with torch.no_grad():
        module.tokens_per_expert += counts  # type: ignore[operator]
    if style.capacity_factor is not None:
        order, counts = _cap(module, order, counts, experts, style.capacity_factor, k)
    local = num_experts // ep
    got = all_to_all(counts, group)  # got[j * local + e]: rank j's tokens for my expert e
    sent, received = counts.view(ep, local).sum(1).tolist(), got.view(ep, local).sum(1).tolist()
    tokens = all_to_all(x[order // k], group, out_splits=received, in_splits=sent)
    outputs = _run_experts(module, style, tokens, got.view(ep, local), ep)
    back = all_to_all(outputs, group, out_splits=sent, in_splits=received)
    weights = top_k_weights.reshape(-1)[order].unsqueeze(-1).to(back.dtype)
    return torch.zeros_like(x).index_add(0, order // k, (back * weights).to(x.dtype))


def _cap(
    module: nn.Module, order: torch.Tensor, counts: torch.Tensor, experts: torch.Tensor,
    factor: float, k: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Keep each expert's first `capacity` assignments (in token order); count the rest."""
    capacity = math.ceil(factor * experts.numel() / counts.numel())
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[experts[order]]
    keep = rank_in_expert < capacity
    with torch.no_grad():
        module.dropped_tokens += (~keep).sum()  # type: ignore[operator]
    return order[keep], counts.clamp(max=capacity)


def _run_experts(
    module: nn.Module, style: ExpertParallel, tokens: torch.Tensor, got: torch.Tensor, ep: int
) -> torch.Tensor:
    """Each local expert once over the tokens every rank sent it; outputs in arrival order."""
    sizes = got.reshape(-1).tolist()  # arrival order: source rank, then expert
    local = got.shape[1]
    chunks = list(torch.split(tokens, sizes))
    params = dict(module.named_parameters(recurse=False))
    expert_fn = gate_up_down if style.expert_fn == "gate_up_down" else style.expert_fn
    weights = {n: _ScaleGrad.apply(_local(p), 1.0 / ep) for n, p in params.items()}  # type: ignore[no-untyped-call]
    out: list[torch.Tensor | None] = [None] * len(chunks)
    for e in range(local):
        mine = [j * local + e for j in range(ep)]
        joined = torch.cat([chunks[i] for i in mine])
        result = expert_fn(module, {n: w[e] for n, w in weights.items()}, joined)
        parts = torch.split(result, [sizes[i] for i in mine])
        for i, part in zip(mine, parts, strict=True):
            out[i] = part
    return torch.cat([o for o in out if o is not None]) if out else tokens


def _local(param: torch.Tensor) -> torch.Tensor:
    to_local = getattr(param, "to_local", None)
    return to_local() if callable(to_local) else param
