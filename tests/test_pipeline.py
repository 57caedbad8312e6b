"""Pipeline parallelism without processes: the pp coordinates, the split arithmetic, the stage
modules, the one-rank pipeline's gradients and every refused setting (issue 27)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accel
from accel import Parallelism, RunContext, along
from accel.config import config_settings, load_config
from accel.parallel import _stages
from accel.parallel._pipeline import available_schedules, stage_ids
from tests.models import batches, make_model


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _ctx(rank: int, **sizes: int) -> RunContext:
    world = 1
    for size in sizes.values():
        world *= size
    return RunContext(rank=rank, world_size=world, parallelism=Parallelism(**sizes))


def test_pp_is_the_outermost_dimension_and_dp_excludes_it() -> None:
    # pp=2 x dp_shard=2 x tp=2: ranks 0-3 hold stage 0, 4-7 stage 1; tp ranks adjacent.
    coords = [(c.pp_rank, c.dp_rank, c.tp_rank) for c in (_ctx(r, pp=2, dp_shard=2, tp=2)
                                                          for r in range(8))]  # fmt: skip
    assert coords == [(p, d, t) for p in range(2) for d in range(2) for t in range(2)]
    ctx = _ctx(5, pp=2, dp_shard=2, tp=2)
    assert (ctx.pp_size, ctx.dp_size, ctx.tp_size) == (2, 2, 2)
    assert (along(ctx, "pp").rank, along(ctx, "pp").world_size) == (1, 2)
    assert Parallelism(pp=2, dp_shard=2, tp=2).names() == ("pp", "dp_shard", "tp")
    assert Parallelism(pp=-1, tp=2).resolve(8).pp == 4
    # Meshes without pp are laid out as before: the pp size of 1 leaves every coordinate.
    assert [(_ctx(r, dp_shard=2, tp=2).dp_rank, _ctx(r, dp_shard=2, tp=2).tp_rank)
            for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # fmt: skip
    assert RunContext(rank=3, world_size=4).pp_size == 1
    assert "pp=2" in ctx.describe()


def test_pp_size_is_read_from_the_environment_and_accelerates_config(tmp_path: Path) -> None:
    from accel.config import env_settings

    found = env_settings({"ACCEL_PP_SIZE": "2", "ACCEL_DP_SHARD_SIZE": "-1"})
    assert found["parallelism"][0] == Parallelism(pp=2, dp_shard=-1)
    path = tmp_path / "config.yaml"
    path.write_text("num_processes: 4\nparallelism_config:\n  parallelism_config_pp_size: 2\n"
                    "  parallelism_config_tp_size: 2\n")  # fmt: skip
    config = load_config(path)
    assert dict(config.parallelism_config)["parallelism_config_pp_size"] == 2
    settings = config_settings(config, "file")
    assert settings["parallelism"][0].resolve(4) == Parallelism(pp=2, tp=2)
    from accel.cli import _launch  # what `accel launch` exports to its workers

    env = _launch.worker_environment(config)
    assert (env["ACCEL_PP_SIZE"], env["ACCEL_TP_SIZE"]) == ("2", "2")
    assert env_settings(env)["parallelism"][0] == Parallelism(pp=2, tp=2)


def test_units_split_evenly_and_by_name() -> None:
    model = make_model(layers=5)
    units = _stages.units(model)
    assert units == ["tok_embeddings", *(f"layers.{i}" for i in range(5)), "norm", "output"]
    points = _stages.even_split_points(model, 3, fn="f")
    assert points == ["layers.2", "layers.4"]  # 2, 2, 1 blocks: earlier stages take the extra
    assert _stages.stage_units(units, points, fn="f") == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3"],
        ["layers.4", "norm", "output"],
    ]
    assert stage_ids("loop", 1, 4, 2) == (1, 5)
    assert stage_ids("v", 0, 4, 2) == (0, 7)


def test_a_stage_keeps_its_units_under_their_names_and_runs_the_models_forward() -> None:
    model = make_model(layers=4)
    last = _stages.stage_module(model, ["layers.2", "layers.3", "norm", "output"])
    assert isinstance(last.tok_embeddings, nn.Identity)
    assert {n.split(".")[0] + "." + n.split(".")[1] for n in last.state_dict()
            if n.startswith("layers.")} == {"layers.2", "layers.3"}  # fmt: skip
    assert last.layers._modules["2"] is model.layers[2]  # shared, not copied
    first = _stages.stage_module(model, ["tok_embeddings", "layers.0", "layers.1"])
    tokens = batches(1, 2)[0]
    with torch.no_grad():
        assert torch.equal(last(first(tokens)), model(tokens))
    assert len(model.layers) == 4 and not isinstance(model.norm, nn.Identity)  # model untouched


def test_one_rank_pipeline_gives_the_full_batch_gradient() -> None:
    tokens = batches(1, 8)[0]
    reference = make_model(layers=2)
    token_loss(reference(tokens[:, :-1]), tokens[:, 1:]).backward()
    ctx = RunContext.single(device="cpu")
    stages = accel.pipeline_stages(ctx, make_model(layers=2), loss_fn=token_loss, microbatches=4)
    loss = accel.pipeline_step(ctx, stages, tokens[:, :-1], tokens[:, 1:])
    with torch.no_grad():
        assert loss.item() == pytest.approx(token_loss(reference(tokens[:, :-1]),
                                                       tokens[:, 1:]).item(), rel=1e-6)  # fmt: skip
    (module,) = stages.modules
    for (name, q), p in zip(module.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_refused_settings_name_the_value() -> None:
    ctx, model = _ctx(0, pp=4), make_model(layers=4)
    kw = {"loss_fn": token_loss, "microbatches": 4}
    with pytest.raises(ValueError, match=r"schedule='pipedream' is not supported.*'gpipe'"):
        accel.pipeline_stages(ctx, model, schedule="pipedream", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'layers\.9', which names no unit"):
        accel.pipeline_stages(ctx, model, split_points=("layers.1", "layers.2", "layers.9"), **kw)
    with pytest.raises(ValueError, match=r"8 stages but 'layers' holds 4 blocks"):
        accel.pipeline_stages(ctx, model, schedule="interleaved_1f1b", **kw)
    with pytest.raises(ValueError, match=r"'interleaved_1f1b' needs an int >= 2 stage"):
        accel.pipeline_stages(ctx, model, schedule="interleaved_1f1b",
                              split_points=("layers.1", "layers.2", "layers.3"), **kw)  # fmt: skip
    with pytest.raises(ValueError, match=r"'1f1b' needs 1 stage\(s\) per rank.*stages_per_rank=2"):
        accel.pipeline_stages(ctx, model, stages_per_rank=2, **kw)
    with pytest.raises(ValueError, match=r"'zbv' needs exactly 2"):
        accel.pipeline_stages(ctx, make_model(layers=12), schedule="zbv", stages_per_rank=3, **kw)
    with pytest.raises(ValueError, match=r"makes 2 stages, not a multiple of pp_size=4"):
        accel.pipeline_stages(ctx, model, split_points=("layers.1",), **kw)
    with pytest.raises(ValueError, match=r"must be distinct units in model order"):
        accel.pipeline_stages(ctx, model, split_points=("layers.2", "layers.1", "norm"), **kw)
    with pytest.raises(ValueError, match=r"microbatches=0 must be an int >= 1"):
        accel.pipeline_stages(ctx, model, loss_fn=token_loss, microbatches=0)
    with pytest.raises(ValueError, match=r"has no nn\.ModuleList"):
        accel.pipeline_stages(ctx, nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), **kw)
    rooted = make_model(layers=4)
    rooted.scale = nn.Parameter(torch.ones(()))
    with pytest.raises(NotImplementedError, match="holds parameters of its own"):
        accel.pipeline_stages(ctx, rooted, **kw)
    one = RunContext.single(device="cpu")
    stages = accel.pipeline_stages(one, model, loss_fn=token_loss, microbatches=3)
    tokens = batches(1, 8)[0]
    with pytest.raises(ValueError, match=r"batch size 8, which microbatches=3 does not divide"):
        accel.pipeline_step(one, stages, tokens[:, :-1], tokens[:, 1:])


def test_the_schedules_of_this_torch_are_offered() -> None:
    assert {"gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zbv"} <= set(available_schedules())


def test_one_rank_runs_a_multi_stage_schedules_stages_in_order() -> None:
    tokens = batches(1, 4)[0]
    reference = make_model(layers=2)
    token_loss(reference(tokens[:, :-1]), tokens[:, 1:]).backward()
    ctx = RunContext.single(device="cpu")
    stages = accel.pipeline_stages(
        ctx, make_model(layers=2), loss_fn=token_loss, microbatches=2, schedule="zbv"
    )
    assert stages.stage_ids == (0, 1) and stages.has_first and stages.has_last
    accel.pipeline_step(ctx, stages, tokens[:, :-1], tokens[:, 1:])
    grads = {n: q.grad for n, q in stages.model.named_parameters()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match=r"stages_per_rank=3 but split_points=\['layers.1'\]"):
        accel.pipeline_stages(
            ctx,
            make_model(layers=2),
            loss_fn=token_loss,
            microbatches=2,
            schedule="looped_bfs",
            split_points=["layers.1"],
            stages_per_rank=3,
        )


def test_a_mesh_with_pp_and_two_more_dimensions_has_the_stage_group() -> None:
    # wrap_model agrees on initial weights among the ranks holding one stage: with pp and two
    # more dimensions that is the flattened "stage" dimension (fake process group: topology only).
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from accel._mesh import with_mesh
    from accel.parallel._plan import agree_group

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        ctx = with_mesh(RunContext(rank=5, world_size=8), Parallelism(pp=2, dp_shard=2, tp=2),
                        source="test")  # fmt: skip
        assert ctx.mesh.mesh_dim_names == ("pp", "dp_shard", "tp")
        stage = ctx.mesh["dp_shard", "tp"]._flatten("stage")
        assert stage.mesh.flatten().tolist() == [4, 5, 6, 7]
        assert dist.get_world_size(agree_group(ctx)) == 4
    finally:
        dist.destroy_process_group()


def test_a_stage_built_on_meta_loads_only_its_own_weights(tmp_path: Path) -> None:
    source = make_model(layers=4)
    accel.save_model(RunContext.single(device="cpu"), source, tmp_path)
    with accel.init_empty_weights():
        model = make_model(layers=4)
    stage = _stages.stage_module(model, ["layers.2", "layers.3", "norm", "output"])
    result = accel.load_checkpoint_in_model(stage, tmp_path, strict=False)
    assert result.missing_keys == [] and "tok_embeddings.weight" in result.unexpected_keys
    for name, q in stage.named_parameters():
        assert torch.equal(q, source.get_parameter(name)), name
    assert model.tok_embeddings.weight.is_meta  # other stages' units were never materialised


def test_accelerates_rank_names_are_the_mesh_coordinates() -> None:
    # docs/migration.md: Accelerate reads each rank name as mesh.get_local_rank(dim); a
    # DeviceMesh lays ranks out row-major, as torch.arange(world).reshape(sizes) does.
    sizes = {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2}
    layout = torch.arange(16).reshape(*sizes.values())
    for rank in range(16):
        ctx = _ctx(rank, **sizes)
        pp, rep, shard, cp, tp = (int(i) for i in (layout == rank).nonzero()[0])
        assert ctx.pp_rank == pp  # pipeline_parallel_rank
        assert ctx.tp_rank == tp  # tensor_parallel_rank
        assert along(ctx, "dp_replicate").rank == rep  # data_parallel_rank
        assert along(ctx, "dp_shard").rank == shard  # data_parallel_shard_rank
        assert ctx.cp_rank == cp  # context_parallel_rank
        assert ctx.dp_rank == rep * 2 + shard
