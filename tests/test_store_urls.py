"""Which paths and URLs the checkpoint functions take (accel/_store/urls.py).

A URL accel cannot honour (a protocol fsspec does not know, one whose package is missing, a URL
pathlib collapsed) is refused in one line by every checkpoint function, and never becomes a
local folder named after its protocol. Nothing here reaches a store.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel import RunContext
from accel._store.urls import hidden, locate

CTX = RunContext.single()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize(
    "call",
    [
        lambda url: accel.save_state(CTX, url, {"model": _model()}),
        lambda url: accel.load_state(CTX, url, {"model": _model()}),
        lambda url: accel.save_checkpoint(CTX, url, {"model": _model()}, step=1),
        lambda url: accel.latest_checkpoint(url),
        lambda url: accel.save_model(CTX, _model(), url),
        lambda url: accel.load_checkpoint_in_model(_model(), url),
        lambda url: accel.dispatch_checkpoint(_model(), url, device_map={"": "cpu"}),
    ],
    ids=["save_state", "load_state", "save_checkpoint", "latest_checkpoint", "save_model",
         "load_checkpoint_in_model", "dispatch_checkpoint"],
)  # fmt: skip
def test_an_unknown_protocol_is_refused_in_one_line_and_never_a_local_folder(
    call: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError, match=r"'nosuch' which fsspec does not know|'nosuch', which"
    ) as e:
        call("nosuch://bucket/run")
    assert "\n" not in str(e.value)
    # abfs:// is fsspec's (Azure's), through adlfs, which no extra of accel installs.
    with pytest.raises(ImportError, match=r"needs fsspec's package for it for abfs:// URLs") as e:
        call("abfs://container/run")
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []  # no folder named "nosuch:" or "abfs:"


MISSING_GCSFS = """
import sys
sys.modules["gcsfs"] = None  # as on an install without the gcs extra: `import gcsfs` fails
import accel
try:
    accel.latest_checkpoint("gs://bucket/run")
except ImportError as err:
    print(err)
"""


@pytest.mark.slow
def test_a_url_whose_extra_is_missing_names_the_extra(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", MISSING_GCSFS], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120, check=True)  # fmt: skip
    assert out.stdout.count("\n") == 1, out.stdout + out.stderr
    assert "needs gcsfs for gs:// URLs" in out.stdout
    assert "pip install 'accel-train[gcs]'" in out.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_url_pathlib_collapsed_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"pathlib collapsed.*root='s3://bucket/run'"):
        accel.save_checkpoint(CTX, Path("s3://bucket/run"), {"model": _model()}, step=1)
    assert list(tmp_path.iterdir()) == []


def test_merge_weights_refuses_an_unknown_protocol(tmp_path: Path) -> None:
    from accel.checkpoint._merge import merge_weights

    with pytest.raises(ValueError, match=r"merge-weights: src='nosuch://b/x'.*fsspec does not"):
        merge_weights("nosuch://b/x", tmp_path / "out")
    with pytest.raises(ValueError, match=r"merge-weights: dst='nosuch://b/y'.*fsspec does not"):
        merge_weights(tmp_path / "in", "nosuch://b/y")


def test_plain_paths_and_file_urls_are_local_paths(tmp_path: Path) -> None:
    assert locate("f", "root", str(tmp_path)) == tmp_path
    assert locate("f", "root", tmp_path) == tmp_path
    assert locate("f", "root", f"file://{tmp_path}") == tmp_path
    assert locate("f", "root", "relative/run") == Path("relative/run")


def test_credentials_in_a_url_never_show_in_a_message() -> None:
    assert hidden("s3://KEY:SECRET@bucket/run?token=abc") == "s3://***@bucket/run?***"
    with pytest.raises(ValueError) as e:
        locate("save_state", "directory", "nosuch://user:pa55word@host/x")
    assert "pa55word" not in str(e.value)
