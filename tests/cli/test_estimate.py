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


@pytest.mark.slow
def test_a_layout_from_launch_flags_prints_each_role_and_json(tmp_path: Path) -> None:
    (tmp_path / "mymodels.py").write_text(MODELS + LLAMA)
    command = Path(sys.executable).parent / "accel"

    def run(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(command), "estimate-memory", "mymodels:llama", "--batch", "2x16", *flags],
            env=_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    out = run("--num_processes", "2", "--use_fsdp", "--mixed_precision", "bf16", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["world_size"] == 2 and data["strategy"] == "fsdp2" and data["precision"] == "bf16"
    assert data["ranks"][0]["ranks"] == [0, 1] and data["peak"] == data["ranks"][0]["peak"]
    # the same layout written as Accelerate's YAML, read by accel launch's own code
    (tmp_path / "fsdp.yaml").write_text(
        "distributed_type: FSDP\nnum_processes: 2\nmixed_precision: bf16\n"
        "fsdp_config:\n  fsdp_version: 2\n"
    )
    yaml = run("--config_file", "fsdp.yaml", "--json")
    assert yaml.returncode == 0, yaml.stderr
    assert json.loads(yaml.stdout) == data
    table = run("--num_processes", "2", "--use_fsdp")
    assert "| every rank | 0, 1 |" in table.stdout and "fsdp2" in table.stdout
    bad = run("--num_processes", "4", "--tp_size", "3")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "does not multiply to world_size=4" in bad.stderr
    stages = run("--num_processes", "2", "--parallelism_config_pp_size", "2", "--microbatches", "2",
                 "--pp_schedule", "gpipe")  # fmt: skip
    assert stages.returncode == 0, stages.stderr
    assert "| pp stage 0 | 0 |" in stages.stdout
    assert "| pp stage 1 (last: the head) | 1 |" in stages.stdout
    odd = run("--num_processes", "2", "--parallelism_config_pp_size", "2", "--microbatches", "3")
    assert odd.returncode == 2 and len(odd.stderr.strip().splitlines()) == 1
    assert "microbatches=3 does not divide the batch's 2 rows" in odd.stderr


LLAMA = """
import sys
from tests.models import Llama

def llama():
    return Llama(vocab=128, dim=32, heads=4, layers=2)
"""
