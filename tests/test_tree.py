from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch

from accel._tree import flatten, send_to_device, tensor_leaves, tree_map, unflatten

Pair = namedtuple("Pair", "a b")


def test_flatten_and_unflatten_round_trip_every_container_kind() -> None:
    tree = {"x": (1, [2, 3]), "y": Pair(4, OrderedDict(z=5)), "w": []}
    leaves, treedef = flatten(tree)
    assert leaves == [1, 2, 3, 4, 5]
    rebuilt = unflatten(treedef, leaves)
    assert rebuilt == tree
    assert type(rebuilt["y"]) is Pair and type(rebuilt["y"].b) is OrderedDict
    assert treedef.num_leaves == 5


def test_tree_map_keeps_structure() -> None:
    assert tree_map(lambda v: v * 10, {"a": [1, (2,)]}) == {"a": [10, (20,)]}


def test_tensor_leaves_names_the_function_and_the_bad_leaf() -> None:
    with pytest.raises(TypeError, match=r"gather: leaf 1 of the input is a str"):
        tensor_leaves("gather", [torch.ones(1), "no"])


def test_send_to_device_moves_only_tensors() -> None:
    out = send_to_device({"t": torch.ones(1), "n": 3}, torch.device("cpu"))
    assert out["n"] == 3 and out["t"].device.type == "cpu"
