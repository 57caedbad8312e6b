"""Tensor parallelism for `wrap_model`: resolve a plan of module-name patterns, then apply it.

A plan maps patterns such as "layers.*.attention.wq" (`*` stands for one name segment, as in
Hugging Face's `base_model_tp_plan`) to "colwise", "rowwise" or a torch `ParallelStyle`. Every
pattern must name at least one module, and the tp size must divide the dimension each style
splits, so a typo or a bad size is an error instead of a model that silently stays whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from types import MappingProxyType
from typing import Any

from torch import nn

_STYLES = ("colwise", "rowwise")
# The weight dim each style splits: colwise splits the output features, rowwise the input
# features. nn.Embedding stores (num_embeddings, embedding_dim), the transpose of nn.Linear.
_SPLIT_DIM = MappingProxyType(
    {("colwise", False): 0, ("rowwise", False): 1, ("colwise", True): 1, ("rowwise", True): 0}
)


def hf_plan(model: nn.Module) -> dict[str, Any]:
    """The tensor-parallel plan a Hugging Face model declares, keyed from `model` itself.

    Read duck-typed from `model.config.base_model_tp_plan` (no transformers import); its keys
    are relative to the base model (`model.<base_model_prefix>` for a model with a head).
    """
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(
            f"wrap_model: tp_plan='auto' reads model.config.base_model_tp_plan, which "
            f"{type(model).__name__} does not have ({plan!r}). Pass a plan, e.g. "
            "tp_plan={'layers.*.attention.wq': 'colwise', 'layers.*.attention.wo': 'rowwise'}."
        )
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if isinstance(prefix, str) and prefix else None
    lead = f"{prefix}." if isinstance(base, nn.Module) and base is not model else ""
    return {lead + key: style for key, style in plan.items()}


def check_plan(plan: Any) -> None:
    """Refuse a `tp_plan` that is not None, "auto" or a mapping of str patterns to styles."""
    if plan is None or plan == "auto":
        return
    if not isinstance(plan, Mapping):
        raise (ValueError if isinstance(plan, str) else TypeError)(
            f"wrap_model: tp_plan={plan!r} is not a plan; expected a dict of module-name pattern "
            '-> "colwise", "rowwise" or a torch ParallelStyle, or "auto" (a Hugging Face '
            "model's own plan). E.g. tp_plan={'layers.*.attention.wq': 'colwise'}."
        )
    for key in plan:
        if not isinstance(key, str):
            raise TypeError(
                f"wrap_model: tp_plan key {key!r} is not a module-name pattern; expected a str "
                "such as 'layers.*.attention.wq' ('*' stands for one name segment)."
            )


def _matches(pattern: str, name: str) -> bool:
    want, have = pattern.split("."), name.split(".")
    return len(want) == len(have) and all(
        fnmatchcase(h, w) for w, h in zip(want, have, strict=True)
    )


def named_by(model: nn.Module, plan: str, pattern: str, example: str) -> list[str]:
    """The module names `pattern` matches ('*' is one name segment); raise when none, naming
    `plan` (the argument) and an `example` pattern. tp_plan, sp_plan and ep_plan share it."""
    names = [n for n, _ in model.named_modules() if n and _matches(pattern, n)]
    if not names:
        sample = [n for n, _ in model.named_modules() if n][:8]
        raise ValueError(
            f"wrap_model: {plan} pattern {pattern!r} names no module of "
            f"{type(model).__name__}; module names look like {sample}. Fix the pattern "
            f"('*' stands for one name segment, e.g. {example!r})."
        )
    return names


def resolve_plan(model: nn.Module, plan: Mapping[str, Any], tp_size: int) -> dict[str, Any]:
    """Expand `plan`'s patterns to module names with torch styles; validate names and sizes."""
    from torch.distributed.tensor.parallel import ParallelStyle

    check_plan(plan)  # a Hugging Face config's plan too
    modules = dict(model.named_modules())
    resolved: dict[str, Any] = {}
    for pattern, style in plan.items():
        if not (style in _STYLES or isinstance(style, ParallelStyle)):
            raise ValueError(
                f"wrap_model: tp_plan[{pattern!r}]={style!r} is not a style accel applies; "
                f"expected one of {_STYLES} or a torch ParallelStyle (e.g. "
                "torch.distributed.tensor.parallel.SequenceParallel())."
            )
        names = named_by(model, "tp_plan", pattern, "layers.*.attention.wq")
        for name in names:
            if name in resolved:
                raise ValueError(
                    f"wrap_model: module {name!r} is named by two tp_plan patterns; each "
                    "module takes one style."
                )
            kind = _kind(style)
            if kind is not None:
                _check_divisible(pattern, style, kind, name, modules[name], tp_size)
            resolved[name] = _torch_style(style)
    return resolved


def _kind(style: Any) -> str | None:
    """ "colwise" or "rowwise" for those strings and torch's two styles; None for the others."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(style, str):
        return style
    if isinstance(style, ColwiseParallel):
        return "colwise"
    return "rowwise" if isinstance(style, RowwiseParallel) else None


def _check_divisible(
    pattern: str, style: Any, kind: str, name: str, module: nn.Module, tp: int
) -> None:
    shown = repr(style) if isinstance(style, str) else f"{type(style).__name__}()"
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        allowed = (
            "'colwise' and 'rowwise'"
            if isinstance(style, str)
            else "ColwiseParallel and RowwiseParallel"
        )
        raise ValueError(
            f"wrap_model: tp_plan[{pattern!r}]={shown} names {name!r}, a "
            f"{type(module).__name__}; {allowed} apply to nn.Linear and nn.Embedding. Name the "
            "linear layers inside it, or pass another torch ParallelStyle."
        )
    dim = _SPLIT_DIM[(kind, isinstance(module, nn.Embedding))]
    size = module.weight.shape[dim]
    if size % tp:
        raise ValueError(
            f"wrap_model: tp_plan[{pattern!r}]={shown} splits {name}.weight dim {dim} of size "
            f"{size} over tp={tp}, which does not divide it. Choose a tp size dividing {size}, "
            "or leave the module out of the plan."
        )


def _torch_style(style: Any) -> Any:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    return style


def apply_tp(model: nn.Module, mesh: Any, plan: dict[str, Any]) -> None:
    """Parallelize `model` in place over the 1-D tensor-parallel `mesh`."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh, plan)
