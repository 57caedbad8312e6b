"""The attributes accel sets on user objects to route them to a DeepSpeed engine.

Shared below `precision`, `accumulate`, `checkpoint/` and `parallel/`: `wrap_model` sets
`ENGINE_REF` on the optimizers and modules it hands to the engine. The name is private to
accel; the public lookup is `accel.deepspeed_engine`.
"""

from __future__ import annotations

ENGINE_REF = "_accel_deepspeed_engine"
"""The attribute wrap_model sets on the optimizers it hands to the engine: a weak reference."""
