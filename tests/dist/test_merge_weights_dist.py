"""`accel merge-weights` on damaged and overlapping inputs: one line, nothing merged, nothing
touched outside DST.

One `save_state` checkpoint of an FSDP2 model is written by 2 ranks; each case damages a copy
of it and runs the command in this process (a traceback would escape `main` and fail the case).
The tree's bytes and mtimes outside DST are compared before and after every run.
"""

from __future__ import annotations

import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import accel
from accel.testing import run_world
from accel_cli import main
from tests.dist.test_sharded_io_dist import TIMEOUT, _save_state_sharded
from tests.models import Uneven

pytestmark = [pytest.mark.dist, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def _build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    src = tmp_path_factory.mktemp("merge") / "step-8"
    trained = run_world(_save_state_sharded, world_size=2, timeout=TIMEOUT, args=(str(src),))[0]
    return src, trained


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    return _build(tmp_path_factory)


def _copy(built: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> Path:
    src = tmp_path / "ckpts" / "step-8"
    shutil.copytree(built[0], src)
    return src


def _tree(root: Path, skip: Path | None) -> dict[str, tuple[bytes, int] | None]:
    """Every path under `root` (not under `skip`): its bytes and mtime (None for folders)."""
    out: dict[str, tuple[bytes, int] | None] = {}
    for path in sorted(root.rglob("*")):
        if skip is not None and (path == skip or skip in path.parents):
            continue
        if path.is_symlink() or path.is_file():
            out[str(path)] = (path.read_bytes(), path.lstat().st_mtime_ns)
        else:
            out[str(path)] = None
    return out


def _merge(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["merge-weights", *argv])
    captured = capsys.readouterr()
    return code, captured.err + captured.out


def _flip(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path, fraction: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])


def _distcp(src: Path) -> list[Path]:
    return sorted((src / "dcp").glob("*.distcp"))


class _Evil:
    def __reduce__(self) -> tuple[Callable[..., object], tuple[str]]:
        return (os.system, ("touch /tmp/accel-merge-pwned",))


def _pickle_metadata(src: Path, *, fix_manifest: bool) -> None:
    meta = src / "dcp" / ".metadata"
    meta.write_bytes(pickle.dumps(_Evil()))
    if fix_manifest:  # the manifest vouches for the planted file: the unpickler must refuse it
        import json

        manifest_path = src / "accel-manifest.json"
        manifest = json.loads(manifest_path.read_text())
        data = meta.read_bytes()
        manifest["files"]["dcp/.metadata"] = [len(data), zlib.crc32(data)]
        manifest_path.write_text(json.dumps(manifest))


# Each case: (damage the copy `src`; return (argv, text the one-line error must contain)).
Damage = Callable[[Path, Path], tuple[list[str], str]]


def _case_flip(i: int, where: float) -> Damage:
    def damage(src: Path, dst: Path) -> tuple[list[str], str]:
        path = _distcp(src)[i]
        _flip(path, where)
        return [str(src), str(dst)], str(path)

    return damage


def _case_truncate(i: int, fraction: float) -> Damage:
    def damage(src: Path, dst: Path) -> tuple[list[str], str]:
        path = _distcp(src)[i]
        _truncate(path, fraction)
        return [str(src), str(dst)], str(path)

    return damage


def _case_missing(i: int) -> Damage:
    def damage(src: Path, dst: Path) -> tuple[list[str], str]:
        path = _distcp(src)[i]
        path.unlink()
        return [str(src), str(dst)], str(path)

    return damage


def _on_metadata(action: Callable[[Path], None]) -> Damage:
    def damage(src: Path, dst: Path) -> tuple[list[str], str]:
        path = src / "dcp" / ".metadata"
        action(path)
        return [str(src), str(dst)], str(path)

    return damage


def _pickled(fix_manifest: bool) -> Damage:
    def damage(src: Path, dst: Path) -> tuple[list[str], str]:
        _pickle_metadata(src, fix_manifest=fix_manifest)
        return [str(src), str(dst)], str(src / "dcp" / ".metadata")

    return damage


def _bare_pickled(src: Path, dst: Path) -> tuple[list[str], str]:
    (src / "accel-manifest.json").unlink()  # a bare DCP folder: nothing vouches for it
    _pickle_metadata(src, fix_manifest=False)
    return [str(src / "dcp"), str(dst)], str(src / "dcp" / ".metadata")


def _bare_truncated_metadata(src: Path, dst: Path) -> tuple[list[str], str]:
    (src / "accel-manifest.json").unlink()
    _truncate(src / "dcp" / ".metadata", 0.3)
    return [str(src / "dcp"), str(dst)], str(src / "dcp" / ".metadata")


def _no_manifest(src: Path, dst: Path) -> tuple[list[str], str]:
    (src / "accel-manifest.json").unlink()
    return [str(src), str(dst)], str(src)


def _bad_manifest(src: Path, dst: Path) -> tuple[list[str], str]:
    (src / "accel-manifest.json").write_text("{not json")
    return [str(src), str(dst)], str(src / "accel-manifest.json")


def _unlisted_shard(src: Path, dst: Path) -> tuple[list[str], str]:
    import json

    manifest_path = src / "accel-manifest.json"
    manifest = json.loads(manifest_path.read_text())
    rel = f"dcp/{_distcp(src)[1].name}"
    del manifest["files"][rel]
    manifest_path.write_text(json.dumps(manifest))
    return [str(src), str(dst)], str(src / rel)


def _shard_is_folder(src: Path, dst: Path) -> tuple[list[str], str]:
    path = _distcp(src)[0]
    path.unlink()
    path.mkdir()
    return [str(src), str(dst)], str(path)


def _shard_linked_outside(src: Path, dst: Path) -> tuple[list[str], str]:
    path = _distcp(src)[0]
    outside = src.parent.parent / "elsewhere.distcp"
    shutil.move(path, outside)  # the same bytes, reached through a link out of the checkpoint
    path.symlink_to(outside)
    return [str(src), str(dst)], str(path)


def _same(src: Path, dst: Path) -> tuple[list[str], str]:
    return [str(src), str(src)], "overlap"


def _dst_inside(sub: str) -> Damage:
    def damage(src: Path, dst: Path) -> tuple[list[str], str]:
        return [str(src), str(src / sub)], "overlap"

    return damage


def _src_inside_dst(src: Path, dst: Path) -> tuple[list[str], str]:
    return [str(src / "dcp"), str(src)], "overlap"


def _dst_parent(src: Path, dst: Path) -> tuple[list[str], str]:
    return [str(src), str(src.parent)], "overlap"


def _dst_via_dots(src: Path, dst: Path) -> tuple[list[str], str]:
    return [str(src), str(src / "dcp" / ".." / "dcp")], "overlap"


def _dst_is_file(src: Path, dst: Path) -> tuple[list[str], str]:
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(b"a file, not a folder\n")
    return [str(src), str(dst)], str(dst)


def _missing_src(src: Path, dst: Path) -> tuple[list[str], str]:
    return [str(src.parent / "step-9"), str(dst)], str(src.parent / "step-9")


def _wrong_model(src: Path, dst: Path) -> tuple[list[str], str]:
    return [str(src), str(dst), "--model", "nope"], "nope"


CASES: dict[str, Damage] = {
    "flip-shard0-early": _case_flip(0, 0.05),
    "flip-shard0-middle": _case_flip(0, 0.5),
    "flip-shard1-late": _case_flip(1, 0.97),
    "truncate-shard0": _case_truncate(0, 0.5),
    "truncate-shard1-by-one": _case_truncate(1, 0.9999),
    "empty-shard0": _case_truncate(0, 0.0),
    "missing-shard0": _case_missing(0),
    "missing-shard1": _case_missing(1),
    "flip-metadata": _on_metadata(_flip),
    "truncate-metadata": _on_metadata(lambda p: _truncate(p, 0.5)),
    "missing-metadata": _on_metadata(lambda p: p.unlink()),
    "pickled-metadata": _pickled(fix_manifest=False),
    "pickled-metadata-vouched": _pickled(fix_manifest=True),
    "bare-dcp-pickled-metadata": _bare_pickled,
    "bare-dcp-truncated-metadata": _bare_truncated_metadata,
    "no-manifest": _no_manifest,
    "manifest-not-json": _bad_manifest,
    "shard-not-in-manifest": _unlisted_shard,
    "shard-is-a-folder": _shard_is_folder,
    "shard-linked-outside": _shard_linked_outside,
    "dst-equals-src": _same,
    "dst-is-the-dcp-folder": _dst_inside("dcp"),
    "dst-inside-src": _dst_inside("merged"),
    "dst-contains-src": _dst_parent,
    "src-dcp-dst-its-checkpoint": _src_inside_dst,
    "dst-through-dots": _dst_via_dots,
    "dst-is-a-file": _dst_is_file,
    "src-missing": _missing_src,
    "model-not-saved": _wrong_model,
}


def test_merge_weights_refuses_damaged_or_overlapping_inputs_in_one_line(
    built: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert len(CASES) >= 20
    failures = []
    for name, damage in CASES.items():
        case = tmp_path / name
        src = _copy(built, case)
        dst = case / "out" / "merged"
        argv, named = damage(src, dst)
        before = _tree(case, skip=dst if not dst.is_file() else None)
        try:
            code, text = _merge(argv, capsys)
        except BaseException as err:  # a traceback: the case failed
            failures.append(f"{name}: raised {type(err).__name__}: {err}")
            continue
        lines = text.strip().splitlines()
        if code == 0 or len(lines) != 1 or "merge-weights: error: " not in lines[0]:
            failures.append(f"{name}: exit {code}, {len(lines)} lines: {text[:300]!r}")
        elif named.lower() not in lines[0].lower():
            failures.append(f"{name}: does not name {named!r}: {lines[0]!r}")
        if _tree(case, skip=dst if not dst.is_file() else None) != before:
            failures.append(f"{name}: files outside DST changed")
        if dst.is_dir() and any(dst.iterdir()):
            failures.append(f"{name}: wrote {sorted(p.name for p in dst.iterdir())} into DST")
    assert not Path("/tmp/accel-merge-pwned").exists()
    assert failures == [], "\n".join(failures)


def test_merge_weights_of_an_intact_checkpoint_leaves_the_source_untouched(
    built: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src = _copy(built, tmp_path)
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "notes.txt").write_text("the user's own file\n")
    before = _tree(tmp_path / "ckpts", skip=None)
    code, text = _merge([str(src), str(dst), "--max-shard-size", "200"], capsys)
    assert code == 0, text
    assert _tree(tmp_path / "ckpts", skip=None) == before
    assert (dst / "notes.txt").read_text() == "the user's own file\n"
    model = Uneven()
    assert accel.load_checkpoint_in_model(model, dst) == accel.LoadResult([], [])
    for k, v in model.state_dict().items():
        assert torch.equal(v, built[1][k]), k
    bare = tmp_path / "bare-dcp"  # a DCP folder on its own: no manifest to verify against
    shutil.copytree(src / "dcp", bare)
    code, text = _merge([str(bare), str(tmp_path / "from-bare"), "--model", "model"], capsys)
    assert code == 0, text
    model = Uneven()
    accel.load_checkpoint_in_model(model, tmp_path / "from-bare")
    for k, v in model.state_dict().items():
        assert torch.equal(v, built[1][k]), k


def _file_size_limit() -> None:
    # A file-size limit makes the kernel refuse writes past it (EFBIG): a disk that fills
    # during the write, without mount rights.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300))


def test_merge_weights_on_a_full_disk_says_so_in_one_line_and_leaves_nothing(
    built: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    src = _copy(built, tmp_path)
    dst = tmp_path / "out" / "merged"
    before = _tree(tmp_path, skip=None)
    done = subprocess.run(
        [sys.executable, "-m", "accel", "merge-weights", str(src), str(dst)],
        preexec_fn=_file_size_limit, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert "merge-weights: error: " in lines[0] and str(dst) in lines[0], lines[0]
    assert "free space" in lines[0], lines[0]
    assert _tree(tmp_path, skip=None) == before  # no partial file, not even the new folders
