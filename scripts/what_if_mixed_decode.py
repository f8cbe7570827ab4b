"""A cost table that prices fused (mixed:N) steps as an engine would pay them that attends their decode rows with
its paged decode kernel, made from a table measured on an engine that attends them with its prefill kernel: the
blind prediction of that engine change, before its code exists (servecap/costs/model.py, mixed_decode_terms).

The table's points and fit are kept. Its engine description says `mixed_decode_attention: paged`, so its fused steps
are priced from its prefill surface (their prompt positions' attention alone) and its decode fit (each decode row's
K/V read). Serving-context factors of the fused policy's steps are dropped: they measured the other kernel's steps.

  PYTHONPATH=. python scripts/what_if_mixed_decode.py TABLE.json --out TABLE-what-if.json [--force]
"""
from __future__ import annotations

import copy
import json
import shlex
import sys
from pathlib import Path

from servecap.costs.context import prefill_kind
from servecap.costs.model import CostModel, mixed_decode_terms
from servecap.costs.table import MIXED_DECODE_KEY, CostTable, check_table, load_cost_table, table_id
from servecap.traces.command import Parser, command
from servecap.traces.csvio import atomic_write_text
from servecap.traces.errors import InputError
from servecap.traces.outpath import check_new_file
from servecap.traces.provenance import git_commit, now_iso


def what_if(raw: dict, argv: list[str]) -> dict:
    t = copy.deepcopy(raw)
    t.pop("table_id", None)
    t["engine"] = {**t.get("engine", {}), MIXED_DECODE_KEY: "paged"}
    fused = prefill_kind("mixed")
    c = t.get("correction")
    if c:
        c["factors"] = {k: v for k, v in c["factors"].items() if not k.startswith(fused)}
        c["residual_sigma"] = {k: v for k, v in c.get("residual_sigma", {}).items() if not k.startswith(fused)}
    t["derived"] = {"from_table": raw["table_id"], "from_created_at": raw["created_at"], "created_at": now_iso(),
                    "git_commit": git_commit(), "command": shlex.join(["python", *argv]),
                    "what": "fused steps priced as an engine pays them that attends their decode rows with its paged "
                            "decode kernel (servecap/costs/model.py mixed_decode_terms); the fused policy's "
                            "serving-context factors dropped"}
    t["created_at"] = t["derived"]["created_at"]  # the table exists from now: runs graded against it come after
    t["table_id"] = table_id(t)
    return check_table(t)


@command("what_if_mixed_decode")
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("table", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--force", action="store_true", help="replace an existing table")
    args = p.parse_args(argv[1:])
    check_new_file(args.out, force=args.force)
    src = load_cost_table(args.table, allow_nonstationary=True)
    if mixed_decode_terms(src) is not None:
        raise InputError("already prices fused steps with the decode kernel", path=args.table)
    table = what_if(src.raw, argv)
    cost = CostModel(CostTable(table, args.out))
    atomic_write_text(args.out, json.dumps(table, indent=1) + "\n")
    per_token, fixed = mixed_decode_terms(cost.table)
    print(f"wrote cost table {table['table_id']} to {args.out} (from {src.table_id}): a fused step's decode rows "
          f"{per_token * 1e9:.2f} ns per K/V token, {fixed * 1e6:.0f} us fixed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
