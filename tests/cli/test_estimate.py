"""`accel estimate-memory` run through the installed `accel` command, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.cli.test_cli import _env

MODELS = """
import torch

def mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))

def broken():
    raise RuntimeError("no such checkpoint size\\nsecond line")
"""


def estimate(tmp_path: Path, model: str) -> subprocess.CompletedProcess[str]:
    """The `accel` script (not `python -m`, which would put the current folder on the path)."""
    command = Path(sys.executable).parent / "accel"
    return subprocess.run(
        [str(command), "estimate-memory", model], env=_env(tmp_path), cwd=tmp_path,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_a_module_in_the_current_folder_and_a_callable_that_raises(tmp_path: Path) -> None:
    (tmp_path / "mymodels.py").write_text(MODELS)
    out = estimate(tmp_path, "mymodels:mlp")
    assert out.returncode == 0, out.stderr
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))  # as in MODELS
    total, largest = sum(p.numel() for p in mlp.parameters()), mlp[0].weight.numel() + 16
    assert f"mymodels:mlp: {total} elements; largest layer '0' ({largest})" in out.stdout
    broken = estimate(tmp_path, "mymodels:broken")
    assert broken.returncode == 2 and broken.stderr.strip() == (
        "accel estimate-memory: error: model='mymodels:broken' could not be built: "
        "mymodels.broken() raised RuntimeError: no such checkpoint size"
    )
    missing = estimate(tmp_path, "nomodels:mlp")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1 and "nomodels" in missing.stderr


@pytest.mark.slow
def test_a_hugging_face_config_is_built_empty(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")  # the `test` extra installs it
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=64)
    config.architectures = ["GPT2LMHeadModel"]
    folder = tmp_path / "tiny-gpt2"
    config.save_pretrained(folder)
    reference = transformers.GPT2LMHeadModel(config)  # built for real, to count independently
    total = sum(p.numel() for p in reference.parameters())
    total += sum(b.numel() for b in reference.buffers())
    for spec in (str(folder / "config.json"), str(folder)):
        out = estimate(tmp_path, spec)
        assert out.returncode == 0, out.stderr
        assert f"Memory for {spec} (GPT2LMHeadModel): {total:,} elements" in out.stdout
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "no-such-model"}))
    out = estimate(tmp_path, str(bad))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "Traceback" not in out.stderr and "no-such-model" in out.stderr
