"""Ulysses sequence parallelism for `wrap_model`: two all-to-alls around each attention.

Every sp rank holds a slice of the sequence. Inside an attention module named by the plan,
the call to `torch.nn.functional.scaled_dot_product_attention` is caught: one all-to-all turns
q, k and v from (batch, heads, seq / sp, head_dim) into (batch, heads / sp, seq, head_dim), so
each rank attends over the whole sequence for its share of the heads with the kernel the model
chose, and a second all-to-all turns the output back into sequence slices (DeepSpeed-Ulysses,
arXiv 2309.14509). The gathered sequence is the whole sequence in order, so plain causal
attention over it is right; a mask tensor built for the local slice is not, and is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from accel.parallel._alltoall import all_to_all
from accel.parallel._tp import named_by

# transformers' attention classes whose forward runs SDPA through its attention interface
# (attn_implementation="sdpa") on (batch, heads, seq, head_dim) tensors: sp_plan="auto".
PRESETS = frozenset(
    {
        "LlamaAttention",
        "GPT2Attention",
        "MistralAttention",
        "MixtralAttention",
        "Qwen2Attention",
        "Qwen2MoeAttention",
        "Qwen3Attention",
        "Qwen3MoeAttention",
    }
)


def heads_to_sequence(x: torch.Tensor, group: Any, sp: int) -> torch.Tensor:
    """(b, h, s / sp, d) sequence slices -> (b, h / sp, s, d): the whole sequence, h / sp heads."""
    b, h, t, d = x.shape
    send = x.reshape(b, sp, h // sp, t, d).transpose(0, 1)  # chunk j: heads for rank j
    got = all_to_all(send, group)  # chunk j: rank j's sequence slice of my heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * t, d)


def sequence_to_heads(x: torch.Tensor, group: Any, sp: int) -> torch.Tensor:
    """(b, h / sp, s, d) -> (b, h, s / sp, d): the inverse of `heads_to_sequence`."""
    b, h, t, d = x.shape
    send = x.reshape(b, h, sp, t // sp, d).permute(2, 0, 1, 3, 4)  # chunk j: rank j's slice
    got = all_to_all(send, group)  # chunk j: my slice of rank j's heads
    return got.transpose(0, 1).reshape(b, sp * h, t // sp, d)


class _Ulysses(TorchFunctionMode):
    """Active during one attention module's forward: SDPA runs over the whole sequence."""

    def __init__(self, name: str, group: Any, sp: int) -> None:
        super().__init__()
        self.name, self.group, self.sp, self.calls = name, group, sp, 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        q, k, v = args[:3]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        self._check(q, k, mask)
        q, k, v = (heads_to_sequence(t, self.group, self.sp) for t in (q, k, v))
        out = func(q, k, v, *args[3:], **kwargs)
        return sequence_to_heads(out, self.group, self.sp)

    def _check(self, q: torch.Tensor, k: torch.Tensor, mask: Any) -> None:
        if q.dim() != 4:
            raise ValueError(
                f"sequence parallel: {self.name} calls scaled_dot_product_attention on q of "
                f"shape {tuple(q.shape)}; Ulysses needs (batch, heads, seq, head_dim). Call it "
                "on 4-d tensors, or leave the module out of sp_plan."
            )
        for what, heads in (("query", q.shape[1]), ("key/value", k.shape[1])):
            if heads % self.sp:
                raise ValueError(
                    f"sequence parallel: {self.name} has {heads} {what} heads on this rank "
                    f"(after tensor parallelism), which sp={self.sp} does not divide; each sp "
                    "rank attends with heads / sp of them. Choose an sp size dividing "
                    f"{heads}."
                )
        if isinstance(mask, torch.Tensor):
            raise NotImplementedError(
                f"sequence parallel: {self.name} passes scaled_dot_product_attention a mask "
                f"of shape {tuple(mask.shape)}, built for this rank's slice of the sequence "
                "(padding, sliding-window or document masks), which is wrong for the whole "
                "sequence the ranks attend over; Ulysses supports causal or full attention "
                "(is_causal, attn_mask=None). Train without a padding mask (pack sequences)."
            )


def ulysses(module: nn.Module, name: str, group: Any, sp: int) -> None:
    """Run `module`'s forward under the Ulysses mode; refuse a forward that ran no SDPA."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with _Ulysses(name, group, sp) as mode:
            out = inner(*args, **kwargs)
        if mode.calls == 0:
            raise RuntimeError(
                f"sequence parallel: {name} ({type(module).__name__}) ran no "
                "torch.nn.functional.scaled_dot_product_attention, so its attention saw only "
                "this rank's slice of the sequence. Use an SDPA attention (transformers: "
                "attn_implementation='sdpa'), or name the module that calls it in sp_plan."
            )
        return out

    module.forward = forward


def resolve_plan(model: nn.Module, plan: Any, *, sp: int, tp: int) -> tuple[str, ...]:
    """The attention modules `plan` names ("auto": transformers' presets), each checked."""
    modules = dict(model.named_modules())
    if plan == "auto":
        names = [n for n, m in modules.items() if type(m).__name__ in PRESETS]
        if not names:
            present = sorted({type(m).__name__ for m in modules.values()})
            raise ValueError(
                f"wrap_model: sp_plan='auto' finds transformers' attention classes "
                f"{sorted(PRESETS)}, and {type(model).__name__} has none (its classes: "
                f"{present[:12]}). Name your attention modules, e.g. "
                "sp_plan=('layers.*.attention',)."
            )
    elif isinstance(plan, (tuple, list)) and plan and all(isinstance(p, str) for p in plan):
        names = [n for p in plan for n in named_by(model, "sp_plan", p, "layers.*.attention")]
    else:
        raise (TypeError if not isinstance(plan, str) else ValueError)(
            f"wrap_model: sp_plan={plan!r} is not a plan; expected 'auto' (transformers' "
            "attention classes) or a non-empty tuple of module-name patterns naming the "
            "modules that call scaled_dot_product_attention, e.g. sp_plan=('layers.*.attention',)."
        )
    for name in names:
        _check_module(name, modules[name], sp=sp, tp=tp)
    return tuple(dict.fromkeys(names))


def _check_module(name: str, module: nn.Module, *, sp: int, tp: int) -> None:
    """Refuse, before anything changes, what a transformers attention module says cannot work."""
    config = getattr(module, "config", None)
    if config is None:
        return  # a plain module: its heads are checked at the first forward
    impl = getattr(config, "_attn_implementation", None)
    if impl not in (None, "sdpa"):
        raise NotImplementedError(
            f"wrap_model: {name} runs attn_implementation={impl!r}; accel's Ulysses wraps "
            "torch's scaled_dot_product_attention ('sdpa'), and another kernel would attend "
            "over this rank's slice only. Load the model with attn_implementation='sdpa'."
        )
    window = getattr(module, "sliding_window", None)
    if window or getattr(config, "use_sliding_window", False):
        raise NotImplementedError(
            f"wrap_model: {name} uses sliding-window attention (sliding_window={window!r}), "
            "whose mask is built for this rank's slice of the sequence; Ulysses supports "
            "causal attention only. Set config.use_sliding_window=False, or use sp=1."
        )
    for key in ("num_attention_heads", "num_key_value_heads", "n_head"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % (tp * sp):
            raise ValueError(
                f"wrap_model: {name} has config.{key}={heads}, which tp={tp} x sp={sp} does "
                "not divide; heads are split over tp first, then over sp. Choose sizes whose "
                f"product divides {heads}."
            )
