"""Step costs without torch: the cost-table format, the step shapes and the cost model that prices them.

calibrate/ writes cost tables (fitting them with costs.fit); sim/ reads them; neither imports the other.
"""
from .model import CostModel, ExtrapolationWarning
from .shapes import BACKENDS, DecodeShape, PrefillShape, kv_read
from .table import CostTable, StationarityWarning, load_cost_table, save_cost_table

__all__ = ["CostModel", "CostTable", "DecodeShape", "PrefillShape", "BACKENDS", "ExtrapolationWarning",
           "StationarityWarning", "kv_read", "load_cost_table", "save_cost_table"]
