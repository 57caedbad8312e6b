"""`accel merge-weights SRC DST`: a sharded (DCP) checkpoint to Hugging Face safetensors."""

from __future__ import annotations

import argparse

from accel.checkpoint._merge import merge_weights


def run(args: argparse.Namespace) -> int:
    keys = merge_weights(
        args.src, args.dst, model=args.model, max_shard_size=args.max_shard_size,
        trust_pickle=args.trust_pickle,
    )  # fmt: skip
    print(f"wrote {len(keys)} tensors to {args.dst}")
    return 0
