"""Error messages that more than one module raises, written once."""

from __future__ import annotations

__all__: list[str] = []

NOT_INITIALIZED_MSG = (
    "{fn}: the context has world_size={world_size} but no process group is initialised; "
    "collectives need one. "
    "Build the context with accel.init_distributed() (under `accel launch` or torchrun), or "
    "inside accel.testing.run_world(...) in tests."
)
