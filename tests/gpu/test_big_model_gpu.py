"""A GPT-2-124M-shaped checkpoint through dispatch_checkpoint with maps over the GPU, the CPU and
disk, and device_map="auto" under a GPU budget: logits and greedy tokens equal the model loaded
whole on the GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import accel
from tests.gpu import plumbing

PROMPT, NEW_TOKENS = 8, 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, device: torch.device) -> Path:
    folder = tmp_path_factory.mktemp("gpt2")
    shape = plumbing.gpt2_shape(device)
    shard = "100MB" if plumbing.on_gpu(device) else "200KB"  # several shards either way
    accel.save_model(accel.RunContext.single(device="cpu"), plumbing.make_gpt2(shape), folder,
                     max_shard_size=shard)  # fmt: skip
    assert len(list(folder.glob("*.safetensors"))) > 1
    return folder


def _empty(device: torch.device) -> torch.nn.Module:
    with accel.init_empty_weights():
        return plumbing.make_gpt2(plumbing.gpt2_shape(device))


def _whole(device: torch.device, checkpoint: Path) -> torch.nn.Module:
    model = _empty(device)
    accel.load_checkpoint_in_model(model, checkpoint, device=device)
    return model.eval()


def _budget(device: torch.device, checkpoint: Path) -> dict[int | str, int]:
    """An execution-device budget of about 40% of the weights: the rest goes to cpu and disk."""
    size = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
    if plumbing.on_gpu(device):
        return {0: int(size * 0.4), "cpu": int(size * 0.3)}
    return {"cpu": int(size * 0.4)}


@pytest.mark.parametrize("how", ["split-map", "auto-under-budget"])
def test_dispatched_model_equals_the_model_loaded_whole(
    device: torch.device, checkpoint: Path, how: str
) -> None:
    shape = plumbing.gpt2_shape(device)
    prompt = torch.randint(0, shape.vocab, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    prompt = prompt.to(device)
    whole = _whole(device, checkpoint)
    with torch.no_grad():
        expected_logits = whole(prompt)
    expected_tokens = plumbing.greedy(whole, prompt, NEW_TOKENS)
    del whole
    if how == "split-map":
        kwargs = {"device_map": plumbing.split_map(device, shape.layers)}
    else:
        kwargs = {"device_map": "auto", "max_memory": _budget(device, checkpoint)}
    model = accel.dispatch_checkpoint(_empty(device), checkpoint, **kwargs).eval()
    placed = set(model.hf_device_map.values())
    assert "disk" in placed and plumbing.gpu_key(device) in placed
    if plumbing.on_gpu(device):
        assert "cpu" in placed
    with torch.no_grad():
        logits = model(prompt)
    assert logits.device == device
    assert torch.equal(logits, expected_logits)
    assert torch.equal(plumbing.greedy(model, prompt, NEW_TOKENS), expected_tokens)
    accel.remove_hooks(model)


def test_transformers_gpt2_over_a_gpu_budget_smaller_than_its_embedding(
    device: torch.device, tmp_path: Path
) -> None:
    """transformers' GPT2LMHeadModel (tied wte and lm_head), saved with save_pretrained, under
    {0: "120MB", "cpu": "20GB"}: its 154 MB embedding fits no GPU budget, so every module is
    offloaded, and each runs on the GPU, one layer's weights there at a time. On an H200 the
    first forward failed: `index is on cuda:0, different from other tensors on cpu`. Under
    the dry run a tiny config goes to disk and runs on the CPU."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if plumbing.on_gpu(device):
        config, budget = GPT2Config(), {0: "120MB", "cpu": "20GB"}
    else:
        config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4)
        budget = {"cpu": 1}  # nothing fits: all of it on disk
    torch.manual_seed(0)
    reference = GPT2LMHeadModel(config).eval()
    reference.save_pretrained(tmp_path)
    prompt = torch.randint(0, config.vocab_size, (2, PROMPT), generator=torch.Generator())
    prompt = prompt.to(device)
    with torch.no_grad():
        expected = reference.to(device)(prompt).logits
    del reference
    with accel.init_empty_weights():
        empty = GPT2LMHeadModel(config)
    model = accel.dispatch_checkpoint(
        empty, tmp_path, device_map="auto", max_memory=budget, no_split=["GPT2Block"]
    ).eval()
    assert set(model.hf_device_map.values()) <= {"cpu", "disk"}  # nothing fitted on the GPU
    assert model.lm_head.weight is model.transformer.wte.weight
    with torch.no_grad():
        logits = model(prompt).logits
    assert logits.device == device
    assert torch.equal(logits, expected)
    accel.remove_hooks(model)
