"""precision="fp8": torchao's float8 training through wrap_model, at one process.

The tolerance of the fp8-vs-bf16 comparison is derived, not tuned. A float format with p
mantissa bits rounds with relative error at most u = 2^-(p+1): bf16 (p=7) u16 = 2^-8, float8
e4m3 (p=3, weights and activations) 2^-4, e5m2 (p=2, output gradients) 2^-3 = 32 * u16. To first
order a loss perturbed by rounding moves linearly in the roundoff of the matmul operands, and
fp8 replaces u16 by at most 32 * u16 in a subset of the matmuls bf16 rounds. So, measuring bf16's
own error against the exact (fp32) run of the same model and data, d = max over the steps of
|L_bf16 - L_fp32|, the fp8 run stays within |L_fp8 - L_fp32| <= 32 d and so
|L_fp8 - L_bf16| <= 33 d at every step (the max over steps keeps d from being a lucky
cancellation at one step). The run must also differ from bf16 (it is float8, not bf16 under
another name) and train (its loss falls).
"""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel import Float8Options, RunContext
from accel.config import parse_config
from tests.models import batches, lm_loss, make_model

STEPS, BATCH, LR, DIM = 10, 8, 1e-2, 32
FP8_OVER_BF16 = 2**-3 / 2**-8 + 1  # e5m2's roundoff over bf16's, plus bf16's own: 33
EXPECTED = {
    f"layers.{i}.{name}"
    for i in range(2)
    for name in (
        "attention.wq", "attention.wk", "attention.wv", "attention.wo",
        "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
    )
}  # fmt: skip  # every block Linear (dims multiples of 16); not the head `output` (32 x 32)
# These models are far below the sizes where float8 gains (tests run them on a CPU): the
# default filter would leave every layer in bf16, so they convert small layers too.
SMALL = Float8Options(skip_small=False)


def float8_names(model: nn.Module) -> set[str]:
    from torchao.float8.float8_linear import Float8Linear

    inner = accel.unwrap_model(model)
    return {n for n, m in inner.named_modules() if isinstance(m, Float8Linear)}


def train(ctx: RunContext, precision: str, **wrap: Any) -> tuple[list[float], nn.Module]:
    """The losses of STEPS AdamW steps on one repeated batch (the model can learn it)."""
    ctx = dataclasses.replace(ctx, precision=precision)  # type: ignore[arg-type]
    if precision == "fp8":
        wrap.setdefault("fp8", SMALL)
    model = accel.wrap_model(ctx, make_model(dim=DIM), **wrap)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    tokens = batches(1, BATCH)[0]
    per_rank = BATCH // ctx.dp_size
    mine = tokens[ctx.dp_rank * per_rank : (ctx.dp_rank + 1) * per_rank]
    losses = []
    for _ in range(STEPS):
        with accel.autocast(ctx):
            loss = lm_loss(model, mine)
        accel.scaled_backward(ctx, loss)
        accel.optimizer_step(ctx, opt)
        opt.zero_grad()
        losses.append(accel.reduce(accel.along(ctx, "dp"), loss.detach().float(), op="mean"))
    return [x.item() for x in losses], model


def check_tolerance(runs: dict[str, list[float]]) -> None:
    fp32, bf16, fp8 = runs["fp32"], runs["bf16"], runs["fp8"]
    d = max(abs(b - f) for b, f in zip(bf16, fp32, strict=True))
    gap = max(abs(a - b) for a, b in zip(fp8, bf16, strict=True))
    assert 0 < gap <= FP8_OVER_BF16 * d, (gap, d, runs)
    assert fp8[-1] < fp8[0] - 0.5, fp8  # it trains


@pytest.mark.slow
def test_fp8_trains_within_the_derived_tolerance_of_bf16_at_one_process() -> None:
    ctx = RunContext.single()
    runs = {p: train(ctx, p)[0] for p in ("fp32", "bf16")}
    runs["fp8"], model = train(ctx, "fp8")
    assert float8_names(model) == EXPECTED
    check_tolerance(runs)


def test_the_default_filter_converts_block_linears_and_keeps_the_head() -> None:
    model = accel.wrap_model(RunContext.single(precision="fp8"), make_model(dim=DIM), fp8=SMALL)
    assert float8_names(model) == EXPECTED
    assert type(model.output) is nn.Linear


def test_the_default_filter_skips_dims_not_multiples_of_16_and_the_last_linear() -> None:
    model = nn.Sequential(
        nn.Linear(16, 32), nn.Linear(32, 24), nn.Linear(24, 16), nn.Linear(16, 16)
    )
    wrapped = accel.wrap_model(RunContext.single(precision="fp8"), model, fp8=SMALL)
    assert float8_names(wrapped) == {"0"}  # 1, 2: 24 is no multiple of 16; 3: the last (head)


SIZES = (16, 1008, 1024, 1040, 2048, 2064, 4096, 4112, 8192)  # torchao's edges, either side


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_the_default_filter_converts_what_torchaos_size_thresholds_say(recipe: str) -> None:
    """Every (in, out) pair of SIZES against torchao's own auto filter for the recipe (torchao
    has none for rowwise_with_gw_hp, which gains less than rowwise: rowwise's is the least)."""
    from torchao.float8 import _auto_filter_for_recipe

    from accel.parallel._float8 import default_filter

    pairs = [(k, n) for k in SIZES for n in SIZES]
    layers = [nn.Linear(k, n, bias=False, device="meta") for k, n in pairs]
    model = nn.ModuleDict({f"l{i}": m for i, m in enumerate(layers)} | {"lm_head": nn.Linear(2, 2)})
    ours = default_filter(model, Float8Options(recipe=recipe))  # type: ignore[arg-type]
    torchaos = _auto_filter_for_recipe(recipe.replace("_with_gw_hp", ""), filter_fqns=["lm_head"])
    decisions = {f"l{i}": ours(m, f"l{i}") for i, m in enumerate(layers)}
    assert decisions == {f"l{i}": torchaos(m, f"l{i}") for i, m in enumerate(layers)}
    assert 0 < sum(decisions.values()) < len(pairs)
    assert not ours(model.lm_head, "lm_head")


def test_fp8_leaves_layers_too_small_to_gain_in_bf16() -> None:
    """tensorwise: a 2048 -> 1024 Linear loses (torchao: K <= 4096 and N <= 1024), 1024 -> 2048
    gains; skip_small=False converts both, and a user's filter still decides alone."""
    model = nn.Sequential(nn.Linear(2048, 1024), nn.Linear(1024, 2048), nn.Linear(2048, 16))
    fp8_ctx = RunContext.single(precision="fp8")
    assert float8_names(accel.wrap_model(fp8_ctx, copy.deepcopy(model))) == {"1"}
    assert float8_names(accel.wrap_model(fp8_ctx, copy.deepcopy(model), fp8=SMALL)) == {"0", "1"}
    mine = Float8Options(module_filter_fn=lambda m, name: name == "0")
    assert float8_names(accel.wrap_model(fp8_ctx, copy.deepcopy(model), fp8=mine)) == {"0"}
    with pytest.raises(ValueError, match=r"skip_small=False\)"):
        accel.wrap_model(fp8_ctx, nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 16)))


def test_a_users_filter_replaces_the_default() -> None:
    seen = []

    def only_attention(module: nn.Module, name: str) -> bool:
        seen.append(name)
        return ".attention." in name

    fp8 = Float8Options(module_filter_fn=only_attention)
    model = accel.wrap_model(RunContext.single(precision="fp8"), make_model(dim=DIM), fp8=fp8)
    assert float8_names(model) == {n for n in EXPECTED if ".attention." in n}
    assert len(seen) == len(set(seen)) == 15  # each Linear asked once, the head included


def test_fp8_autocasts_to_bf16_and_needs_no_scaler() -> None:
    ctx = RunContext.single(precision="fp8")
    with accel.autocast(ctx):
        assert nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.bfloat16
    assert accel.make_scaler(ctx) is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"module_filter_fn": "lm_head"}, TypeError, "module_filter_fn='lm_head' is not callable"),
        ({"recipe": "delayed"}, ValueError, "recipe='delayed' is not one of"),
        ({"pad_inner_dim": 1}, TypeError, "pad_inner_dim=1 must be True or False"),
        ({"skip_small": None}, TypeError, "skip_small=None must be True or False"),
        (
            {"skip_small": False, "module_filter_fn": lambda m, n: True},
            ValueError,
            "skip_small=False shapes the default filter",
        ),
        (
            {"recipe": "rowwise", "enable_fsdp_float8_all_gather": True},
            ValueError,
            "needs recipe='tensorwise'",
        ),
    ],
)
def test_bad_options_are_refused_by_name(kwargs: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Float8Options(**kwargs)


def test_bad_uses_are_refused_by_name() -> None:
    fp8_ctx = RunContext.single(precision="fp8")
    with pytest.raises(ValueError, match=r"ctx\.precision='bf16'; build the context"):
        accel.wrap_model(RunContext.single(precision="bf16"), make_model(), fp8=Float8Options())
    with pytest.raises(TypeError, match=r"returned 'yes' for 'layers\.0\.attention\.wq'"):
        accel.wrap_model(
            fp8_ctx, make_model(), fp8=Float8Options(module_filter_fn=lambda m, n: "yes")
        )
    with pytest.raises(ValueError, match=r"no nn\.Linear of Sequential passes the float8 filter"):
        accel.wrap_model(fp8_ctx, nn.Sequential(nn.Linear(3, 3)))
    with pytest.raises(ValueError, match="enable_fsdp_float8_all_gather=True\\) applies to FSDP2"):
        accel.wrap_model(
            fp8_ctx,
            make_model(),
            fp8=Float8Options(enable_fsdp_float8_all_gather=True, skip_small=False),
        )
    with pytest.raises(TypeError, match=r"fp8=3 is not an accel\.Float8Options"):
        accel.wrap_model(fp8_ctx, make_model(), fp8=3)  # type: ignore[arg-type]


@pytest.mark.slow
def test_fp8_without_torchao_names_the_extra() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torchao' or name.startswith('torchao.'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import accel\n"
        "from torch import nn\n"
        "assert 'torchao' not in sys.modules\n"
        "accel.wrap_model(accel.RunContext.single(precision='fp8'), nn.Linear(16, 16))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: wrap_model: ctx.precision='fp8' trains Linear layers")
    assert "`pip install torchao` (or `pip install -e '.[fp8]'` in accel's checkout)" in last


def test_import_accel_does_not_import_torchao() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import sys, accel; print('torchao' in sys.modules)"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert done.stdout.strip() == "False"


def test_config_accepts_fp8_and_accelerates_ao_recipe() -> None:
    config = parse_config({"mixed_precision": "fp8", "fp8_config": {"backend": "AO"}})
    assert config.mixed_precision == "fp8"
    flags = {"fp8_backend": "ao", "fp8_enable_fsdp_float8_all_gather": "true"}
    parse_config({"mixed_precision": "fp8", "fp8_config": flags})
    assert accel.init_distributed(precision="fp8").precision == "fp8"


@pytest.mark.parametrize(
    ("section", "error", "match"),
    [
        ({"backend": "TE"}, NotImplementedError, "backend='TE' \\(Transformer Engine\\)"),
        ({"backend": "MSAMP"}, NotImplementedError, "\\(MS-AMP\\) is not supported"),
        ({"fp8_margin": 0}, NotImplementedError, "margin=0 is a Transformer Engine setting"),
        ({"amax_history_len": 16}, NotImplementedError, "Transformer Engine setting"),
        ({"opt_level": "O2"}, NotImplementedError, "opt_level='O2' is an MS-AMP setting"),
        ({"pad_inner_dim": False}, NotImplementedError, "Float8Options\\(pad_inner_dim=False"),
        ({"recipe": "x"}, ValueError, "fp8_config has unknown key 'recipe'"),
    ],
)
def test_accelerates_fp8_config_is_honoured_or_refused_by_name(
    section: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        parse_config({"mixed_precision": "fp8", "fp8_config": section})


def test_fp8_config_without_fp8_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="mixed_precision='bf16'; set mixed_precision: fp8"):
        parse_config({"mixed_precision": "bf16", "fp8_config": {"backend": "AO"}})


def test_launch_flags_and_accelerates_yaml_carry_fp8_to_the_workers(tmp_path: Any) -> None:
    from accel.cli import _launch
    from accel.cli._accelerate_env import accelerate_environment
    from accel.config import load_config
    from accel_cli import build_parser

    script = tmp_path / "s.py"
    script.write_text("")
    args = build_parser().parse_args(
        ["launch", "--mixed_precision", "fp8", "--fp8_backend", "AO", "--config_file",
         str(tmp_path / "none.yaml"), str(script)]
    )  # fmt: skip
    (tmp_path / "none.yaml").write_text("{}\n")
    config = _launch.resolve_config(args)
    assert config.fp8_config == (("fp8_backend", "AO"),)
    assert _launch.worker_environment(config)["ACCEL_PRECISION"] == "fp8"
    assert accelerate_environment(config)[0]["ACCELERATE_FP8_BACKEND"] == "AO"
    yaml = tmp_path / "accelerate.yaml"
    yaml.write_text("mixed_precision: fp8\nfp8_config:\n  backend: AO\n")
    assert load_config(yaml).mixed_precision == "fp8"
    bad = build_parser().parse_args(
        ["launch", "--mixed_precision", "fp8", "--fp8_backend", "te", "--config_file",
         str(tmp_path / "none.yaml"), str(script)]
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="backend='te' \\(Transformer Engine\\)"):
        _launch.resolve_config(bad)


def test_every_fp8_row_of_the_migration_guide_names_a_test_that_exists() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "migration.md").read_text()
    section = text.split("## fp8 training", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| `")]
    names = {"AORecipeKwargs", "FP8RecipeKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs",
             "unscale_gradients"}  # fmt: skip
    assert names <= {r.split("`")[1].split("(")[0] for r in rows}
    sources = "".join(p.read_text() for p in (root / "tests").rglob("test_*.py"))
    for row in rows:
        test = row.rstrip(" |").rsplit("| ", 1)[1].split("`")[1]
        assert f"def {test}(" in sources, row
