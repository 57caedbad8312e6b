"""GPT-2- and Llama-shaped models in plain torch, named as transformers names them.

They reproduce what matters for loading, not transformers' code: GPT-2 ties its embedding and
head and keeps its 12 blocks in an `nn.ModuleList` (`transformer.h`, never called itself);
Llama has an untied head and a rotary table `inv_freq` that is an fp32 non-persistent buffer
(not in checkpoints) computed at build time, used in fp32 whatever the weights' dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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
