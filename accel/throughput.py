"""Tokens per second and model FLOPs utilisation (MFU) from a step's time and size.

The FLOPs of a transformer step follow the usual estimate (Kaplan et al. 2020, appendix of the
PaLM paper; torchtitan's `get_num_flop_per_token`): 6 FLOPs per parameter per token for the
forward and backward matmuls, plus `12 * num_layers * num_heads * head_dim * seq_len` for the
attention scores and their weighted sum. MFU is the achieved model FLOPs per second over the
hardware's peak. Both are plain arithmetic, so they cost nothing in a loop and are checked by
hand in the tests; the metrics dict goes to any tracker through `accel.log_metrics`.
"""

from __future__ import annotations

import math

__all__ = ["num_flops_per_token", "throughput_metrics"]


def _check_count(fn: str, name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"{fn}: {name}={value!r} must be an int >= {minimum}. Pass a count such as "
            f"{name}={max(minimum, 1)}."
        )
    return value


def _check_positive(fn: str, name: str, value: object) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:  # type: ignore[arg-type, operator]
        raise ValueError(
            f"{fn}: {name}={value!r} must be a finite number > 0. Pass the measured or known "
            "value, e.g. from time.perf_counter() differences or the device's data sheet."
        )
    return float(value)  # type: ignore[arg-type]


def num_flops_per_token(
    num_params: int,
    *,
    num_layers: int = 0,
    num_heads: int = 0,
    head_dim: int = 0,
    seq_len: int = 0,
) -> int:
    """Return the model FLOPs of one training token (forward and backward).

    `6 * num_params` counts the matmuls of every parameter (2 forward, 4 backward); the
    attention term `12 * num_layers * num_heads * head_dim * seq_len` counts the score and
    value matmuls, which have no parameters. Leave the attention arguments at 0 for a model
    without attention (or to count parameters only, as Fabric's estimate does). torchtitan
    passes the parameter count without the embedding table, whose lookup is not a matmul; pass
    the count you want compared.

    Args:
        num_params: parameters of the model (`sum(p.numel() for p in model.parameters())`).
        num_layers: transformer blocks; 0 leaves the attention term out.
        num_heads: attention heads per block.
        head_dim: size of each head (hidden size // num_heads).
        seq_len: tokens per sequence (the attention span).

    Returns:
        FLOPs per token, an int.

    Raises:
        ValueError: for a count that is not an int >= 1 (`num_params`) or >= 0 (the others).

    Example:
        >>> from accel import num_flops_per_token
        >>> num_flops_per_token(1_000)
        6000
        >>> num_flops_per_token(1_000, num_layers=2, num_heads=4, head_dim=8, seq_len=16)
        18288
    """
    fn = "num_flops_per_token"
    _check_count(fn, "num_params", num_params, minimum=1)
    attention = 12
    for name, value in (
        ("num_layers", num_layers),
        ("num_heads", num_heads),
        ("head_dim", head_dim),
        ("seq_len", seq_len),
    ):
        attention *= _check_count(fn, name, value, minimum=0)
    return 6 * num_params + attention


def throughput_metrics(
    *,
    step_time_s: float,
    num_tokens: int,
    flops_per_token: float,
    peak_flops: float | None = None,
) -> dict[str, float]:
    """Turn one step's time and token count into tokens/s, achieved TFLOP/s and MFU.

    Give the tokens one device processed in `step_time_s` and that device's peak to get the
    per-device figures torchtitan and Fabric report (equal to the run's MFU when the ranks
    share the work evenly); or the whole run's tokens with the peak times the number of
    devices. The result is a flat dict, ready for `accel.log_metrics` and so for any tracker.

    Args:
        step_time_s: wall-clock seconds of the step (or the mean over several steps).
        num_tokens: tokens processed in that time.
        flops_per_token: model FLOPs per token, e.g. from `num_flops_per_token`.
        peak_flops: the hardware's peak FLOP/s for the compute dtype (989e12 for an H100 SXM
            in dense bf16); None leaves "mfu" out.

    Returns:
        {"tokens_per_s": ..., "tflops_per_s": ...} and "mfu" (a fraction, 0.4 = 40%) when
        `peak_flops` is given.

    Raises:
        ValueError: for a time, FLOPs count or peak that is not a finite number > 0, or a
            token count that is not an int >= 0.

    Example:
        >>> from accel import throughput_metrics
        >>> throughput_metrics(step_time_s=0.5, num_tokens=4096, flops_per_token=6e9,
        ...                    peak_flops=1e14)
        {'tokens_per_s': 8192.0, 'tflops_per_s': 49.152, 'mfu': 0.49152}
    """
    fn = "throughput_metrics"
    seconds = _check_positive(fn, "step_time_s", step_time_s)
    tokens = _check_count(fn, "num_tokens", num_tokens, minimum=0)
    per_token = _check_positive(fn, "flops_per_token", flops_per_token)
    tokens_per_s = tokens / seconds
    flops_per_s = tokens_per_s * per_token
    metrics = {"tokens_per_s": tokens_per_s, "tflops_per_s": flops_per_s / 1e12}
    if peak_flops is not None:
        metrics["mfu"] = flops_per_s / _check_positive(fn, "peak_flops", peak_flops)
    return metrics
