"""The costs package: cost tables (format, checks, versions), step shapes and the cost model's pricing."""
from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import pytest

from costs.model import CostModel
from costs.shapes import DecodeShape, PrefillShape
from costs.synthetic import constant_table, linear_table
from costs.table import CostTable, StationarityWarning, as_cost_table, load_cost_table, save_cost_table, table_id
from traces.errors import InputError


def test_cost_table_round_trips(tmp_path):
    table = linear_table()
    tid = save_cost_table(table, tmp_path / "cost.json")
    loaded = load_cost_table(tmp_path / "cost.json")
    assert loaded.table_id == tid
    assert {k: v for k, v in loaded.raw.items() if k not in ("schema", "version", "table_id")} == \
        {k: v for k, v in table.items() if k not in ("schema", "version", "table_id")}


def test_shapes_price_a_padded_group_a_packed_one_and_a_chunk():
    assert PrefillShape.padded(3, 100) == PrefillShape(3, 300, 30000) and PrefillShape.padded(3, 100).span == 100
    assert PrefillShape.of([100, 20, 5]) == PrefillShape(3, 125, 100 ** 2 + 20 ** 2 + 5 ** 2)
    # A chunk of 512 positions after 1024 in the pool: each attends to the prefix and the chunk up to itself.
    assert PrefillShape.of([512], [1024]) == PrefillShape(1, 512, 512 * (512 + 2 * 1024))
    assert DecodeShape(4, 100, 40).after(3) == DecodeShape(4, 112, 43)


def test_the_simulator_side_imports_no_torch_and_no_scipy():
    code = ("import sys, costs, costs.model, costs.table, costs.shapes, sim, sim.simulator, sim.cli, sim.sweep; "
            "sys.exit(('torch' in sys.modules) or ('scipy.optimize' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
