"""The model a command line names: 'package.module:callable', or a Hugging Face config.

`accel estimate-memory` builds it on the meta device (its size per dtype) or, through
`estimate_memory`, on fake tensors; both read the spec here, with the same one-line errors.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def model_factory(spec: str) -> tuple[Callable[[], nn.Module], str]:
    """A callable building the model `spec` names, and the class name a config names."""
    if spec.endswith(".json") or Path(spec).is_dir():
        return _hf_factory(spec)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"model={spec!r} must look like 'package.module:callable', or be a Hugging Face "
            "config.json (or its folder)."
        )
    if os.getcwd() not in sys.path:  # `python -m` puts the current folder first; so does this
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except Exception as err:  # the user's module: any error while importing it is reported
        raise ValueError(f"model={spec!r} cannot be loaded: {first_line(err)}") from err

    # partial of a module-level function: the builder pickles (the estimate sends it to a
    # child process under DeepSpeed), where a closure would not
    return functools.partial(_build_named, spec, factory), ""


def _build_named(spec: str, factory: Callable[[], Any]) -> nn.Module:
    try:
        model = factory()
    except Exception as err:  # the user's callable: reported in one line, not a traceback
        module_name, _, attr = spec.partition(":")
        raise ValueError(
            f"model={spec!r} could not be built: {module_name}.{attr}() raised {first_line(err)}"
        ) from err
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={spec!r} returned a {type(model).__name__}, not an nn.Module.")
    return model


def _hf_factory(spec: str) -> tuple[Callable[[], nn.Module], str]:
    """The model class a Hugging Face config names (its first `architectures` entry, else
    `AutoModel`), built from the config alone."""
    file = Path(spec) / "config.json" if Path(spec).is_dir() else Path(spec)
    if not file.is_file():
        raise FileNotFoundError(f"model={spec!r}: {str(file)!r} does not exist.")
    try:
        import transformers
    except ImportError:
        raise ValueError(
            f"model={spec!r} is a Hugging Face config; building a model from it needs "
            "transformers. Install it: pip install transformers."
        ) from None
    try:
        config = transformers.AutoConfig.from_pretrained(str(file))
        names = getattr(config, "architectures", None) or []
        cls = getattr(transformers, names[0], None) if names else None
        make = cls or transformers.AutoModel.from_config
        with torch.device("meta"):
            name = type(make(config)).__name__
    except Exception as err:  # transformers' own errors, for a config it cannot read
        raise ValueError(f"model={spec!r} could not be built: {first_line(err)}") from err

    return functools.partial(make, config), name
