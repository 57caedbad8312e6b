"""The small models of the test suite, in plain torch: one definition each, imported from here.

A test that needs a new model adds it here, under the heading of what it is for. Changing a
definition changes the numbers of every test (and benchmark) that builds it, so don't: add another.

- A Llama-style model with its tensor-parallel plan, its data, loss and one-process reference:
  N-D parallelism (tests/dist/test_parallel_dist.py, tests/cli/test_launch_parallel.py,
  benchmarks/parallel.py). Attention infers the number of local heads from its input
  (`view(b, t, -1, head_dim)`), so column-wise split projections work unchanged, as in
  torchtitan's and Hugging Face's Llama.
- GPT-2- and Llama-shaped models named as transformers names them, for loading big models
  (tests/test_big_model_gpt2_llama.py, benchmarks/big_model.py). They reproduce what matters for
  loading, not transformers' code: GPT-2 ties its embedding and head and keeps its 12 blocks in
  an `nn.ModuleList` (`transformer.h`, never called itself); Llama has an untied head and a rotary
  table `inv_freq` that is an fp32 non-persistent buffer (not in checkpoints) computed at build
  time, used in fp32 whatever the weights' dtype.
- Small modules for sizes, device maps, checkpoints, sharded I/O and the training step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# ---- a Llama-style model for N-D parallelism ---------------------------------------------------

VOCAB, DIM, HEADS, LAYERS, SEQ = 32, 16, 4, 2, 9

TP_PLAN = {
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
}


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(
        self, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS, layers: int = LAYERS
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def make_model(seed: int = 0, **sizes: Any) -> Llama:
    torch.manual_seed(seed)
    return Llama(**sizes)


def batches(steps: int, global_batch: int, seed: int = 1) -> torch.Tensor:
    """(steps, global_batch, SEQ) token ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, global_batch, SEQ), generator=g)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def full_param(p: torch.Tensor) -> torch.Tensor:
    full = getattr(p, "full_tensor", None)
    return (full() if callable(full) else p).detach().clone()


def reference(data: torch.Tensor, *, lr: float, max_norm: float) -> dict[str, Any]:
    """One process, the full global batch per step: losses, grad norms and final parameters."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses, norms = [], []
    for tokens in data:
        loss = lm_loss(model, tokens)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "norms": norms,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


# ---- a mixture-of-experts Llama for expert parallelism (tests/dist/test_expert_parallel_dist.py)


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts, weights stacked on dim 0, called as transformers' experts
    modules are: `(tokens, top_k_index, top_k_weights) -> weighted sum of each token's k`."""

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden, dim) / math.sqrt(dim))
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden, dim) / math.sqrt(dim))
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden) / math.sqrt(hidden))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(index == e)
            w = {"w1": self.w1[e], "w2": self.w2[e], "w3": self.w3[e]}
            out.index_add_(0, token, swiglu_expert(self, w, x[token]) * weights[token, slot, None])
        return out


def swiglu_expert(module: nn.Module, w: Any, x: torch.Tensor) -> torch.Tensor:
    """One expert of `GroupedExperts` (its `ep_plan` style)."""
    return F.linear(F.silu(F.linear(x, w["w1"])) * F.linear(x, w["w3"]), w["w2"])


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, index = self.router(flat).softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return self.experts(flat, index, weights).view_as(x)


class MoEBlock(nn.Module):
    def __init__(self, dim: int, heads: int, num_experts: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.moe = MoE(dim, 2 * dim, num_experts, top_k=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.moe(self.ffn_norm(x))


class MoELlama(Llama):
    """The Llama-style model with a 4-expert top-2 MoE in place of each feed-forward."""

    def __init__(
        self, num_experts: int = 4, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS,
        layers: int = LAYERS,
    ) -> None:  # fmt: skip
        super().__init__(vocab, dim, heads, layers)
        self.layers = nn.ModuleList([MoEBlock(dim, heads, num_experts) for _ in range(layers)])


EP_PLAN = {"layers.*.moe.experts": swiglu_expert}


def sgd_reference(
    model: nn.Module, batches: Any, loss_of: Any, *, lr: float, max_norm: float
) -> dict[str, Any]:
    """One process, SGD with momentum 0.9 and clipping: each step's loss and gradient norm, the
    first step's gradients and the final parameters (the sp / ep tests' reference)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses, norms, grads = [], [], None
    for batch in batches:
        loss = loss_of(model, batch)
        loss.backward()
        if grads is None:
            grads = {n: q.grad.detach().clone() for n, q in model.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: q.detach().clone() for n, q in model.named_parameters()}
    return {"losses": losses, "norms": norms, "grads": grads, "params": params}


def max_relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest |a - b| of any tensor, relative to that tensor's largest |b|."""
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max()) for n in a)


# ---- GPT-2 and Llama, named as transformers names them ---------------------------------------


@dataclass(frozen=True)
class Shape:
    vocab: int = 256
    dim: int = 64
    heads: int = 4
    layers: int = 12
    positions: int = 64


GPT2_124M = Shape(vocab=50257, dim=768, heads=12, layers=12, positions=1024)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    b, t, d = q.shape
    q, k, v = (x.view(b, t, heads, d // heads).transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, t, d)


class GPT2Attention(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.heads = s.heads
        self.c_attn = nn.Linear(s.dim, 3 * s.dim)
        self.c_proj = nn.Linear(s.dim, s.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        return self.c_proj(_attention(q, k, v, self.heads))


class GPT2MLP(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.c_fc = nn.Linear(s.dim, 4 * s.dim)
        self.c_proj = nn.Linear(4 * s.dim, s.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(s.dim)
        self.attn = GPT2Attention(s)
        self.ln_2 = nn.LayerNorm(s.dim)
        self.mlp = GPT2MLP(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.wte = nn.Embedding(s.vocab, s.dim)
        self.wpe = nn.Embedding(s.positions, s.dim)
        self.h = nn.ModuleList(GPT2Block(s) for _ in range(s.layers))
        self.ln_f = nn.LayerNorm(s.dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHead(nn.Module):
    def __init__(self, s: Shape = Shape()) -> None:
        super().__init__()
        self.transformer = GPT2Model(s)
        self.lm_head = nn.Linear(s.dim, s.vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer(ids))


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        half = s.dim // s.heads
        inv_freq = 1.0 / (10000 ** (torch.arange(0, half, 2, dtype=torch.int64).float() / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # fp32 always
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.heads = s.heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(s.dim, s.dim, bias=False) for _ in range(4)
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.heads

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, hd).transpose(1, 2)

        q = _rotate(heads(self.q_proj(x)), cos, sin)
        k = _rotate(heads(self.k_proj(x)), cos, sin)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        return self.o_proj((probs @ heads(self.v_proj(x))).transpose(1, 2).reshape(b, t, d))


class LlamaMLP(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.dim, 3 * s.dim, bias=False)
        self.up_proj = nn.Linear(s.dim, 3 * s.dim, bias=False)
        self.down_proj = nn.Linear(3 * s.dim, s.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.dim)
        self.self_attn = LlamaAttention(s)
        self.post_attention_layernorm = RMSNorm(s.dim)
        self.mlp = LlamaMLP(s)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab, s.dim)
        self.layers = nn.ModuleList(LlamaLayer(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.dim)
        self.rotary_emb = Rotary(s)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        cos, sin = self.rotary_emb(x, torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, s: Shape = Shape(layers=4)) -> None:
        super().__init__()
        self.model = LlamaModel(s)
        self.lm_head = nn.Linear(s.dim, s.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(ids))


# ---- sizes, device maps and dispatch (tests/test_big_model.py) --------------------------------


class ResidualBlock(nn.Module):
    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.register_buffer("shift", torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(torch.relu(self.lin1(x))) + self.shift


class Pair(nn.Module):
    """Two Linear(4, 4) layers, 160 bytes, no buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(4, 4)
        self.lin2 = nn.Linear(4, 4)


class TiedLayers(nn.Module):
    """Embedding(10, 4), Linear(4, 4) and a head tied to the embedding, built in `order`."""

    def __init__(self, order: tuple[str, ...] = ("embed", "lin", "head")) -> None:
        super().__init__()
        for name in order:
            layer = nn.Embedding(10, 4) if name == "embed" else nn.Linear(4, 4)
            setattr(self, name, layer if name != "head" else nn.Linear(4, 10, bias=False))
        self.head.weight = self.embed.weight


class TinyLM(nn.Module):
    def __init__(self, dim: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*[ResidualBlock(dim) for _ in range(3)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("pos", torch.arange(5.0), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1], None].to(self.embed.weight.dtype)
        return self.head(self.norm(self.blocks(x)))


def linears(n: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


class ListModel(nn.Module):
    """Its layers in an `nn.ModuleList`, a container that is never called itself."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return x


# ---- Accelerate's device-map scenarios (tests/test_device_map_rules.py) -----------------------


class LinearBNLinear(nn.Module):
    """Accelerate's ModelForTest: linear1 64 B, batchnorm 72 B (with its int64 counter),
    linear2 100 B; 236 B in all."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.batchnorm(self.linear1(x)))


class Holder(nn.Module):
    def __init__(self, parameter: nn.Parameter) -> None:
        super().__init__()
        self.parameter = parameter


class LinearWithSub(nn.Linear):
    """`compute.weight` is tied to `compute.weight_submodule.parameter` (a name it prefixes)."""

    def __init__(self) -> None:
        super().__init__(3, 8)
        self.weight_submodule = Holder(self.weight)


# ---- checkpoints and sharded I/O ---------------------------------------------------------------


class TiedHeadLM(nn.Module):
    """Embedding(5, 3), Linear(3, 3) and a head tied to the embedding, as in language models."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.mid = nn.Linear(3, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight  # tied, as in language models

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.embed(x)))


class Uneven(nn.Module):
    """Uneven sizes (10, 7, 3 do not divide by 2 or 4), a tied pair, a bias-free layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 7)
        self.norm = nn.LayerNorm(7)
        self.head = nn.Linear(7, 3, bias=False)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.embed.weight  # tied


class Stack(nn.Module):
    """16 square layers of 1024: 64 MiB of fp32, each weight 4 MiB."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1024, 1024, bias=False) for _ in range(16))


def tied_lm() -> nn.Module:
    """Embedding 100x16 tied to the output head, a 16x32 hidden layer, and a buffer of 8.

    `accel estimate-memory tests.models:tied_lm` builds it by module path.
    """
    model = nn.Sequential(
        nn.Embedding(100, 16), nn.Linear(16, 32), nn.Linear(32, 16),
        nn.Linear(16, 100, bias=False),
    )  # fmt: skip
    model[3].weight = model[0].weight
    model.register_buffer("scale", torch.ones(8))
    return model


# ---- the training step and wrap_model ----------------------------------------------------------


class TokenModel(nn.Module):
    """Embedding(7, 6) and a Linear head, seeded with 2 when built."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.embed = nn.Embedding(7, 6)
        self.head = nn.Linear(6, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x)))


class HFLike(nn.Module):
    """A Hugging Face-shaped model: a base model under `base_model_prefix`, a config plan."""

    base_model_prefix = "model"

    def __init__(self, plan: dict[str, str]) -> None:
        super().__init__()
        self.model = make_model()
        self.config = type("Config", (), {"base_model_tp_plan": plan})()
