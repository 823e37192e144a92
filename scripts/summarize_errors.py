"""Turn the GPU tests' errors.jsonl into a markdown table: per test family, the worst
(largest) of each measured relative error, and how many cases were measured."""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str) -> None:
    worst: dict[str, dict[str, float]] = defaultdict(dict)
    count: dict[str, int] = defaultdict(int)
    for line in open(path):
        row = json.loads(line)
        family = row.pop("test").split("[")[0]
        tag = row.pop("output", None)
        count[family] += 1
        for k, v in row.items():
            if isinstance(v, (int, float)) and k not in ("groups", "segments"):  # (labels, not errors)
                key = f"{tag}.{k}" if tag else k
                worst[family][key] = max(worst[family].get(key, 0.0), float(v))
    print("| test | cases | worst relative error (‖out − ref‖ / ‖ref‖) |")
    print("|---|---|---|")
    for fam in worst:
        figs = ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst[fam].items()))
        print(f"| {fam} | {count[fam]} | {figs} |")


if __name__ == "__main__":
    main(sys.argv[1])
