"""`fit`: refit a GPU's calibration table from measurement files (run folders or CSVs), compare
before and after, and write it unless --dry-run (`gpu-budget fit --gpu a100-80gb runs/a100-1`).
The same refresh `profile.py` runs after a sweep (fitting/refresh.py)."""

from __future__ import annotations

import json
import sys

from estimator import flags, tables
from estimator.errors import InputError

PROG = "fit"


def _parser(prog: str):
    p = flags.OneLineParser(prog=prog, description="Refit calibrations/<gpu>.json from measurements.")
    p.add_argument("runs", nargs="+", help="run folders or results CSV files of this GPU")
    p.add_argument("--gpu", required=True, help="GPU slug of estimator/data/gpus.csv")
    p.add_argument("--table", help="table path (default calibrations/<gpu>.json)")
    p.add_argument("--dry-run", action="store_true", help="compare only; write nothing")
    p.add_argument("--json", action="store_true", help="print the refresh result as JSON")
    return p


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    args = _parser(prog).parse_args(argv)
    try:
        tables.gpu(args.gpu)
        from fitting.refresh import refresh

        result = refresh(args.runs, args.gpu, table_path=args.table, write=not args.dry_run)
    except InputError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    text = result.text
    flags.print_stdout(json.dumps({"gpu": args.gpu, "table": str(result.table_path), "text": text}, indent=2)
                       if args.json else text)
    return 0
