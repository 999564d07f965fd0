"""`python -m tests.scale run`: the scale harness (see `tests.scale.harness`);
`python -m tests.scale status-patch`: a large status's write, members atomic or a map
(see `tests.scale.statuspatch`).

python -m tests.scale run [--pods 1000] [--start 10] [--rounds 4] [--output FILE]
python -m tests.scale status-patch [--members 1001] [--patches 30] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tests.scale import statuspatch
from tests.scale.harness import run
from tests.scale.report import table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.scale", description=__doc__)
    parser.add_argument("command", choices=["run", "status-patch"])
    parser.add_argument("--pods", type=int, default=1000, help="inference pods to scale to")
    parser.add_argument("--start", type=int, default=10, help="inference pods to start with")
    parser.add_argument("--rounds", type=int, default=4, help="steady-state rounds")
    parser.add_argument("--round-seconds", type=float, default=15.0, help="between rounds")
    parser.add_argument("--output", type=Path, help="also write the figures here (JSON)")
    parser.add_argument(
        "--operator-tree", type=Path, help="run the operator package under DIR/operator instead"
    )
    parser.add_argument("--members", type=int, default=1001, help="status-patch: members")
    parser.add_argument("--patches", type=int, default=30, help="status-patch: per variant")
    parser.add_argument("--repeat", type=int, default=2, help="status-patch: variant pairs")
    args = parser.parse_args(argv)
    if args.command == "status-patch":
        statuspatch.run(args)
        return 0
    figures = run(args)
    print(table(figures))
    if args.output is not None:
        args.output.write_text(json.dumps(figures.as_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
