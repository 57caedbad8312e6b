"""`accel merge-weights SRC DST`: a sharded (DCP) checkpoint to Hugging Face safetensors."""

from __future__ import annotations

import argparse
from typing import Any

from accel.checkpoint._merge import merge_weights
from accel.cli._args import add_flag


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "merge-weights",
        help="merge a sharded (DCP) checkpoint into Hugging Face safetensors files",
        description="Read the model of a save_state checkpoint of a sharded model (FSDP2, "
        "tensor parallel), or a DCP folder, and write model.safetensors (or shards and an "
        "index) with an accel manifest, in one process, one tensor in memory at a time.",
    )
    parser.add_argument("src", help="a save_state directory (or its dcp/ folder)")
    parser.add_argument("dst", help="the folder to write the safetensors files into")
    add_flag(parser, "model", default=None, help="the name the model was saved under")
    add_flag(parser, "max_shard_size", default="5GB", help="most bytes per file (default 5GB)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    keys = merge_weights(args.src, args.dst, model=args.model, max_shard_size=args.max_shard_size)
    print(f"wrote {len(keys)} tensors to {args.dst}")
    return 0
