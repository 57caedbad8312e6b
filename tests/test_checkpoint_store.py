"""Checkpoints on object storage, in one process, against a real S3-compatible server.

The session's moto server (tests/s3_server.py) is reached through s3fs with the variables a
user sets (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...). What is checked: every checkpoint function
takes a URL and round-trips bit for bit; a URL accel cannot honour is refused in one line and
never becomes a local folder; the commit rule (a manifest written last; a half-written step is
never picked and is swept by the next save, which deletes only accel's files); and the errors
of item 3 (a missing bucket, a denied request, a network that fails for a while or for good),
each one line.
"""

from __future__ import annotations

import copy
import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel import PerRank, RunContext
from accel._safetensors.header import CorruptFileError
from tests.s3_server import FlakyProxy, fresh_clients

CTX = RunContext.single()
pytestmark = pytest.mark.slow  # a session's server, a client's start-up: seconds, not millis


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _trained(seed: int = 0) -> dict[str, Any]:
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        model(torch.randn(5, 8)).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return {"model": model, "optimizer": opt, "scheduler": sched}


def _fresh() -> dict[str, Any]:
    model = _model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return {"model": model, "optimizer": opt, "scheduler": sched}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    for key in ("model", "optimizer", "scheduler"):
        if repr(a[key].state_dict()) != repr(b[key].state_dict()):
            return False
    return all(
        torch.equal(x, y)
        for x, y in zip(a["model"].state_dict().values(), b["model"].state_dict().values(),
                        strict=True)
    ) and all(
        torch.equal(x, y)
        for s, t in zip(a["optimizer"].state_dict()["state"].values(),
                        b["optimizer"].state_dict()["state"].values(), strict=True)
        for x, y in zip(s.values(), t.values(), strict=True)
    )  # fmt: skip


def _protocol(url: str) -> str:
    return url.split("://")[0]


def _bucket(url: str) -> str:
    return url.split("://")[1]


def _objects(url: str) -> dict[str, int]:
    import fsspec

    fs = fsspec.filesystem(_protocol(url))
    fs.invalidate_cache()
    bucket = _bucket(url)
    return {k[len(bucket) + 1 :]: v["size"] for k, v in fs.find(bucket, detail=True).items()}


@pytest.fixture(params=["s3", "gs"])
def store(request: pytest.FixtureRequest) -> str:
    """A new bucket on the session's S3 server, or on its GCS emulator: the same tests for both."""
    return str(request.getfixturevalue(request.param))


# ------------------------------------------------------------------------------ round trips


def test_save_state_and_load_state_round_trip_through_a_store_bit_for_bit(store: str) -> None:
    state = _trained()
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(123)
    expected_rng = torch.rand(3)
    torch.manual_seed(123)
    accel.save_state(CTX, f"{store}/state", {**state, "gen": gen, "mine": PerRank(gen)})
    torch.manual_seed(0)
    fresh = _fresh()
    gen2 = torch.Generator()
    manifest = accel.load_state(
        CTX, f"{store}/state", {**fresh, "gen": gen2, "mine": PerRank(gen2)}
    )
    assert _same(state, fresh)
    assert torch.equal(gen2.get_state(), gen.get_state())
    assert torch.equal(torch.rand(3), expected_rng)  # the RNG state came back too
    assert manifest["world_size"] == 1 and set(manifest["objects"]) >= {"model", "optimizer"}
    objects = _objects(store)
    assert "state/accel-manifest.json" in objects
    assert not [k for k in objects if ".accel-" in k]  # the save's records are gone
    # nothing was written locally under a folder named after the protocol
    assert not Path(f"{_protocol(store)}:").exists()


def test_save_checkpoint_latest_and_rotation_in_a_store(store: str) -> None:
    root = f"{store}/run"
    assert accel.latest_checkpoint(root) is None
    state = _trained()
    for step in (1, 2, 3):
        handle = accel.save_checkpoint(CTX, root, state, step=step, keep=2)
        assert handle.wait() == f"{root}/step-{step}"
    assert accel.latest_checkpoint(root) == f"{root}/step-3"
    steps = {k.split("/")[1] for k in _objects(store) if k.startswith("run/")}
    assert steps == {"step-2", "step-3"}  # step-1 deleted once step-3 was committed
    fresh = _fresh()
    assert accel.load_state(CTX, f"{root}/step-3", fresh)["step"] == 3
    assert _same(state, fresh)


def test_a_background_save_returns_before_the_upload_and_wait_returns_the_url(store: str) -> None:
    state = _trained()
    saved = copy.deepcopy(state)
    handle = accel.save_checkpoint(CTX, f"{store}/run", state, step=5, blocking=False)
    with torch.no_grad():  # training goes on: the save holds its own copy
        for p in state["model"].parameters():
            p.add_(1.0)
    assert handle.wait() == f"{store}/run/step-5"
    fresh = _fresh()
    accel.load_state(CTX, accel.latest_checkpoint(f"{store}/run"), fresh)
    assert _same(saved, fresh)


def test_memory_urls_round_trip_and_file_urls_are_local_paths(tmp_path: Path) -> None:
    state = _trained()
    url = f"memory://accel-test/{os.getpid()}/state"
    accel.save_state(CTX, url, state)
    fresh = _fresh()
    accel.load_state(CTX, url, fresh)
    assert _same(state, fresh)
    accel.save_state(CTX, f"file://{tmp_path}/local", state)
    assert (tmp_path / "local" / "accel-manifest.json").is_file()  # the local code, as a path
    fresh = _fresh()
    accel.load_state(CTX, tmp_path / "local", fresh)
    assert _same(state, fresh)


def test_replacing_a_committed_checkpoint_under_one_name(store: str) -> None:
    first, second = _trained(0), _trained(5)
    accel.save_state(CTX, f"{store}/latest", first)
    accel.save_state(CTX, f"{store}/latest", second)
    fresh = _fresh()
    accel.load_state(CTX, f"{store}/latest", fresh)
    assert _same(second, fresh)
    assert not [k for k in _objects(store) if ".accel-" in k]


# ------------------------------------------------------------------------------ commit rule


def test_a_half_written_step_is_never_picked_and_the_next_save_sweeps_only_its_files(
    store: str,
) -> None:
    import fsspec

    root = f"{store}/run"
    state = _trained()
    accel.save_checkpoint(CTX, root, state, step=1)
    # What a save killed during its upload leaves: its record, some files, no manifest.
    fs = fsspec.filesystem(_protocol(store))
    bucket = _bucket(store)
    record = {"writing": ["model.json", "model.safetensors", "rng/rank0.json"]}
    fs.pipe_file(f"{bucket}/run/step-2/.accel-rank0.json", json.dumps(record).encode())
    fs.pipe_file(f"{bucket}/run/step-2/model.safetensors", b"half of it")
    fs.pipe_file(f"{bucket}/run/step-2/notes.txt", b"the user's own file")
    assert accel.latest_checkpoint(root) == f"{root}/step-1"
    accel.save_checkpoint(CTX, root, state, step=3)
    left = sorted(k for k in _objects(store) if k.startswith("run/step-2/"))
    assert left == ["run/step-2/notes.txt"]  # accel's files swept, the user's kept
    assert accel.latest_checkpoint(root) == f"{root}/step-3"


def test_a_step_whose_file_is_missing_or_short_is_not_committed(store: str) -> None:
    import fsspec

    root = f"{store}/run"
    accel.save_checkpoint(CTX, root, _trained(), step=1)
    accel.save_checkpoint(CTX, root, _trained(), step=2)
    fs = fsspec.filesystem(_protocol(store))
    fs.pipe_file(f"{_bucket(store)}/run/step-2/model.safetensors", b"truncated")
    assert accel.latest_checkpoint(root) == f"{root}/step-1"
    with pytest.raises(CorruptFileError, match=r"(s3|gs)://.*/run/step-2/model\.safetensors"):
        accel.load_state(CTX, f"{root}/step-2", _fresh())


def test_a_prefix_holding_other_objects_is_refused(store: str) -> None:
    import fsspec

    fsspec.filesystem(_protocol(store)).pipe_file(f"{_bucket(store)}/theirs/data.bin", b"x")
    with pytest.raises(FileExistsError, match=r"not an accel checkpoint's.*data\.bin"):
        accel.save_state(CTX, f"{store}/theirs", _trained())
    assert set(_objects(store)) == {"theirs/data.bin"}


def test_loading_a_prefix_with_no_manifest_names_it(store: str) -> None:
    with pytest.raises(FileNotFoundError, match=r"(s3|gs)://.*/nothing.* not a committed accel"):
        accel.load_state(CTX, f"{store}/nothing", _fresh())


# ------------------------------------------------------------------------------ store errors


def test_a_missing_bucket_is_one_line_at_the_first_call(store: str) -> None:
    missing = f"{store}-missing/run"
    with pytest.raises(
        FileNotFoundError, match=r"the bucket of '(s3|gs)://.*-missing/run' does not"
    ) as e:
        accel.latest_checkpoint(missing)
    assert "\n" not in str(e.value)
    # gcsfs answers a missing bucket as a missing object: accel asks for the bucket itself.
    make = "gcloud storage buckets create" if store.startswith("gs") else "aws s3 mb"
    assert make in str(e.value)
    with pytest.raises(FileNotFoundError, match=r"save_checkpoint: the bucket of") as e:
        accel.save_checkpoint(CTX, missing, _trained(), step=1, blocking=False)
    assert "\n" not in str(e.value)


def test_a_denied_request_is_one_line_at_the_first_call(
    s3: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import moto.core.responses as responses
    from moto import settings

    # The server starts checking credentials (as S3 always does); this key does not exist.
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    monkeypatch.setattr(responses.ActionAuthenticatorMixin, "request_count", 1)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "a-secret-that-must-not-show")
    fresh_clients()
    with pytest.raises(
        PermissionError, match=r"save_checkpoint: the store denied a request on 's3://"
    ) as e:
        accel.save_checkpoint(CTX, f"{s3}/run", _trained(), step=1, blocking=False)
    assert "\n" not in str(e.value) and "a-secret-that-must-not-show" not in str(e.value)
    fresh_clients()


def test_a_transient_failure_is_retried_and_the_save_succeeds(
    s3: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = FlakyProxy(s3_endpoint.removeprefix("http://"), failures=3)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # the client's own retries off: accel's act
        fresh_clients()
        state = _trained()
        accel.save_checkpoint(CTX, f"{s3}/run", state, step=1)
        assert proxy.refused == 3
        fresh = _fresh()
        accel.load_state(CTX, f"{s3}/run/step-1", fresh)
        assert _same(state, fresh)
    finally:
        proxy.close()
        fresh_clients()


def test_a_store_that_stays_unreachable_is_one_line_naming_the_url(
    s3: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = f"{s3}/run"
    state = _trained()
    accel.save_checkpoint(CTX, root, state, step=1)
    with socket.socket() as sock:  # a port nothing listens on: the network is down
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    fresh_clients()
    with pytest.raises(OSError, match=r"save_checkpoint: 's3://.*/run' failed after 5 attempts.*"
                       r"Could not connect to the endpoint URL") as e:  # fmt: skip
        accel.save_checkpoint(CTX, root, state, step=2, blocking=False)
    assert "\n" not in str(e.value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    fresh_clients()
    assert accel.latest_checkpoint(root) == f"{root}/step-1"  # nothing lost


def _failing_background_save(s3: str, proxy: FlakyProxy, step: int) -> Any:
    """A background save whose upload the store starts denying once the call has returned."""
    big = nn.Linear(2048, 2048)  # 16 MB: the upload is still running when the proxy denies
    handle = accel.save_checkpoint(CTX, f"{s3}/run", {"model": big}, step=step, blocking=False)
    proxy.deny()
    return handle


@pytest.mark.parametrize("surfaced_by", ["wait", "next save", "shutdown"])
def test_a_background_upload_error_is_raised_by_wait_the_next_save_or_shutdown(
    s3: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, surfaced_by: str
) -> None:
    proxy = FlakyProxy(s3_endpoint.removeprefix("http://"))
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        fresh_clients()
        handle = _failing_background_save(s3, proxy, step=1)
        if surfaced_by == "wait":
            with pytest.raises(RuntimeError, match=r"saving 's3://.*/run/step-1' failed: .*"
                               r"the store denied a request on 's3://") as e:  # fmt: skip
                handle.wait()
        elif surfaced_by == "next save":
            with pytest.raises(RuntimeError, match=r"save_checkpoint: the background save of "
                               r"'s3://.*/run/step-1' failed: .*denied") as e:  # fmt: skip
                accel.save_checkpoint(CTX, f"{s3}/run", {"model": _model()}, step=2)
        else:
            with pytest.raises(RuntimeError, match=r"shutdown: the background save of "
                               r"'s3://.*/run/step-1' failed: .*denied") as e:  # fmt: skip
                accel.shutdown(CTX)
        assert "\n" not in str(e.value)
        accel.shutdown(CTX)  # reported once: nothing left to raise
    finally:
        proxy.close()
        fresh_clients()


# ------------------------------------------------------------------------------ model exports


def test_save_model_and_load_checkpoint_in_model_through_a_store(store: str) -> None:
    model = _model(3)
    accel.save_model(CTX, model, f"{store}/export")
    assert set(_objects(store)) == {"export/model.safetensors", "export/accel-manifest.json"}
    for where in (f"{store}/export", f"{store}/export/model.safetensors"):
        fresh = _model(4)
        assert accel.load_checkpoint_in_model(fresh, where) == ([], [])
        assert all(
            torch.equal(a, b)
            for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True)
        )
    # Another layout (shards and an index) replaces the single file, which is removed.
    accel.save_model(CTX, model, f"{store}/export", max_shard_size=300)
    names = {k.removeprefix("export/") for k in _objects(store)}
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    assert {n for n in names if n.startswith("model-")} and "accel-manifest.json" in names
    for where in (f"{store}/export", f"{store}/export/model.safetensors.index.json"):
        with accel.init_empty_weights():
            empty = _model(5)
        accel.load_checkpoint_in_model(empty, where)
        assert all(
            torch.equal(a, b)
            for a, b in zip(model.state_dict().values(), empty.state_dict().values(), strict=True)
        )


def test_a_damaged_export_in_the_store_is_refused_naming_the_url(store: str) -> None:
    import fsspec

    accel.save_model(CTX, _model(), f"{store}/export")
    path = f"{_bucket(store)}/export/model.safetensors"
    fs = fsspec.filesystem(_protocol(store))
    data = bytearray(fs.cat_file(path))
    data[-1] ^= 1
    fs.pipe_file(path, bytes(data))
    with pytest.raises(
        CorruptFileError, match=r"'(s3|gs)://.*/export/model\.safetensors' fails its"
    ):
        accel.load_checkpoint_in_model(_model(), f"{store}/export")


def test_dispatch_checkpoint_from_a_store(store: str, tmp_path: Path) -> None:
    model = _model(3)
    accel.save_model(CTX, model, f"{store}/export", max_shard_size=300)
    x = torch.randn(2, 8)
    with accel.init_empty_weights():
        empty = _model(5)
    loaded = accel.dispatch_checkpoint(empty, f"{store}/export", device_map={"": "cpu"})
    assert torch.equal(loaded(x), model(x))
    with accel.init_empty_weights():
        empty = _model(5)
    with pytest.raises(ValueError, match=r"on 'disk'.*in a store.*Pass offload_dir="):
        accel.dispatch_checkpoint(empty, f"{store}/export", device_map={"": "disk"})
    with accel.init_empty_weights():
        empty = _model(5)
    on_disk = accel.dispatch_checkpoint(
        empty, f"{store}/export", device_map={"": "disk"}, offload_dir=tmp_path / "offload"
    )
    assert torch.equal(on_disk(x), model(x))
    accel.remove_hooks(on_disk)
