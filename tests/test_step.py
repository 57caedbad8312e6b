"""Single-process behaviour of wrap_model, precision and accumulation (no process group)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import accel
from accel import RunContext


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))


def test_wrap_model_places_and_returns_the_module() -> None:
    inner = _model()
    ctx = RunContext.single()
    assert accel.wrap_model(ctx, inner) is inner
    assert accel.wrap_model(ctx, _model(), strategy="none").training
    assert accel.unwrap_model(inner) is inner


@pytest.mark.slow
def test_compiled_model_unwraps_and_cannot_be_wrapped_again() -> None:
    inner = _model()
    compiled = accel.wrap_model(RunContext.single(), inner, compile=True)
    assert compiled is not inner and accel.unwrap_model(compiled) is inner
    with pytest.raises(ValueError, match=r"already wrapped by torch\.compile"):
        accel.wrap_model(RunContext.single(), compiled)


def test_wrap_model_bad_input_names_the_argument() -> None:
    ctx = RunContext.single()
    with pytest.raises(ValueError, match=r"strategy='zero3' is not one of"):
        accel.wrap_model(ctx, _model(), strategy="zero3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"model=list is not a torch\.nn\.Module"):
        accel.wrap_model(ctx, [])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ddp options were given but strategy='none'"):
        accel.wrap_model(ctx, _model(), strategy="none", ddp=accel.DDPOptions())
    with pytest.raises(ValueError, match="fsdp options were given but strategy='ddp'"):
        accel.wrap_model(ctx, _model(), strategy="ddp", fsdp=accel.FSDPOptions())
    with pytest.raises(ValueError, match="layer_classes contains"):
        accel.FSDPOptions(layer_classes=(int,))  # type: ignore[arg-type]


def test_ddp_without_a_process_group_explains_the_fix() -> None:
    ctx = RunContext(rank=0, world_size=2, local_rank=0, local_world_size=2)
    with pytest.raises(RuntimeError, match="wrap_model"):
        accel.wrap_model(ctx, _model(), strategy="ddp")


def test_autocast_bf16_on_cpu_and_fp32_no_op() -> None:
    x = torch.ones(2, 3)
    with accel.autocast(RunContext.single(precision="bf16")):
        assert _model()(x).dtype == torch.bfloat16
    with accel.autocast(RunContext.single()):
        assert _model()(x).dtype == torch.float32


def test_make_scaler_only_for_fp16() -> None:
    assert accel.make_scaler(RunContext.single()) is None
    assert accel.make_scaler(RunContext.single(precision="bf16")) is None
    scaler = accel.make_scaler(RunContext.single(precision="fp16"))
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()


def test_scaled_backward_divides_by_accumulation_steps_once() -> None:
    w = nn.Parameter(torch.ones(2))
    accel.scaled_backward(RunContext.single(grad_accum_steps=4), (w * 8).sum())
    assert w.grad is not None and w.grad.tolist() == [2.0, 2.0]


def _fp16_setup() -> tuple[RunContext, nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    ctx = RunContext.single(precision="fp16")
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = accel.make_scaler(ctx)
    assert scaler is not None
    x = torch.randn(4, 3)
    with accel.autocast(ctx):  # one good step so the optimizer has state to protect
        loss = model(x).float().pow(2).mean()
    accel.scaled_backward(ctx, loss, scaler=scaler)
    assert accel.optimizer_step(ctx, opt, scaler=scaler)
    opt.zero_grad()
    return ctx, model, opt, scaler


def test_fp16_inf_gradient_skips_the_step_and_lowers_the_scale() -> None:
    ctx, model, opt, scaler = _fp16_setup()
    params = copy.deepcopy(list(model.parameters()))
    state = copy.deepcopy(opt.state_dict())
    scale = scaler.get_scale()
    with accel.autocast(ctx):
        loss = model(torch.randn(4, 3)).float().pow(2).mean()
    accel.scaled_backward(ctx, loss, scaler=scaler)
    first = next(model.parameters())
    assert first.grad is not None
    first.grad[0, 0] = float("inf")  # an overflow in one gradient
    assert accel.optimizer_step(ctx, opt, scaler=scaler) is False
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
    after = opt.state_dict()
    for key, value in state["state"].items():
        for name, tensor in value.items():
            assert torch.equal(tensor, after["state"][key][name]), name
    assert scaler.get_scale() == scale * 0.5


def test_fp16_clip_unscales_once_before_the_step() -> None:
    ctx, model, opt, scaler = _fp16_setup()
    with accel.autocast(ctx):
        loss = model(torch.randn(4, 3)).float().pow(2).mean()
    accel.scaled_backward(ctx, loss, scaler=scaler)
    scaled = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    norm = accel.clip_grad_norm_(ctx, model, 1e9, optimizer=opt, scaler=scaler)
    unscaled = [p.grad for p in model.parameters() if p.grad is not None]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in scaled]))
    assert torch.allclose(norm, expected / scaler.get_scale(), rtol=1e-5)
    assert all(
        torch.allclose(u * scaler.get_scale(), s) for u, s in zip(unscaled, scaled, strict=True)
    )
    accel.clip_grad_value_(ctx, model, 1e9, optimizer=opt, scaler=scaler)  # no second unscale
    assert all(torch.equal(u, p.grad) for u, p in zip(unscaled, model.parameters(), strict=True))
    assert accel.optimizer_step(ctx, opt, scaler=scaler)


def test_clip_with_a_scaler_needs_the_optimizer() -> None:
    ctx, model, _, scaler = _fp16_setup()
    with pytest.raises(ValueError, match="scaler was given without optimizer="):
        accel.clip_grad_norm_(ctx, model, 1.0, scaler=scaler)
    with pytest.raises(ValueError, match="scaler was given without optimizer="):
        accel.clip_grad_value_(ctx, model, 1.0, scaler=scaler)


def test_clip_grad_norm_matches_torch() -> None:
    a, b = _model(), _model()
    for m in (a, b):
        m(torch.randn(5, 3, generator=torch.Generator().manual_seed(1))).sum().backward()
    norm = accel.clip_grad_norm_(RunContext.single(), a, 0.1)
    expected = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1)
    assert torch.equal(norm, expected)
    assert all(
        torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )
    assert accel.clip_grad_norm_(RunContext.single(), nn.Linear(2, 2), 1.0).item() == 0.0


@pytest.mark.parametrize(
    ("every", "is_last_at", "expected"),
    [
        (1, None, [True] * 5),
        (2, None, [False, True, False, True, False]),
        (2, 4, [False, True, False, True, True]),
        (4, 2, [False, False, True, True, False]),
    ],
)
def test_should_sync(every: int, is_last_at: int | None, expected: list[bool]) -> None:
    assert [accel.should_sync(s, every, is_last=s == is_last_at) for s in range(5)] == expected


def test_should_sync_bad_input() -> None:
    with pytest.raises(ValueError, match="every=0 must be >= 1"):
        accel.should_sync(0, 0)
    with pytest.raises(ValueError, match="step=-1 must be >= 0"):
        accel.should_sync(-1, 2)


def test_accumulate_single_process_gives_the_accumulated_gradient() -> None:
    ctx = RunContext.single(grad_accum_steps=3)
    model, reference = _model(), _model()
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(2))
    syncs = []
    for step, xb in enumerate(x.split(2)):
        with accel.accumulate(ctx, model, step, is_last=step == 2) as sync:
            accel.scaled_backward(ctx, model(xb).pow(2).mean())
        syncs.append(sync)
    reference(x).pow(2).mean().backward()
    assert syncs == [False, False, True]
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-7)


def test_num_items_in_batch_counts_real_labels() -> None:
    ctx = RunContext.single()
    batches = [{"labels": torch.tensor([[1, -100], [2, 3]])}, torch.tensor([7, 0, -1])]
    assert accel.num_items_in_batch(ctx, batches, shift=False) == 6
    assert accel.num_items_in_batch(ctx, batches, ignore_index=-1, shift=False) == 6 - 1 + 1
    assert accel.num_items_in_batch(ctx, [], shift=False) == 0
    with pytest.raises(TypeError, match="batch of type str has no labels"):
        accel.num_items_in_batch(ctx, ["x"], shift=False)


def test_num_items_in_batch_counts_what_a_causal_lm_scores_when_shifted() -> None:
    # A causal LM predicts token t+1 from tokens <= t: it scores labels[..., 1:] (3 here).
    ctx = RunContext.single()
    batch = {"labels": torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])}
    assert accel.num_items_in_batch(ctx, [batch], shift=True) == 3
    assert accel.num_items_in_batch(ctx, [batch], shift=False) == 5
    assert accel.num_items_in_batch(ctx, [torch.tensor([1, 2, 3])], shift=True) == 2
    # the shift is a choice the caller makes, never a guess
    with pytest.raises(TypeError, match="shift"):
        accel.num_items_in_batch(ctx, [batch])  # type: ignore[call-arg]


def test_fsdp2_without_a_process_group_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="strategy='fsdp2' needs a process group"):
        accel.wrap_model(RunContext.single(), _model(), strategy="fsdp2")
