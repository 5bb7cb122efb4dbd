"""Merges bench/peers.py results of separate runs into one comparison, round by round.

peers.py interleaves the systems of one code version. To compare two versions of pdserve (say,
a commit and the one before it, each run from its own worktree), run peers.py once per version
and round, alternating the versions, and merge: each input is labelled, its systems renamed
"LABEL: system", and the figures of the same system across rounds reduced to median (min-max).
Per-round ratios of tokens/s are given for each pair named with --ratio, so that a difference
is read against its own spread.

  .venv/bin/python bench/peers_merge.py --out merged.json \\
      after=results/after_r0.json after=results/after_r1.json \\
      before=results/before_r0.json before=results/before_r1.json \\
      --ratio "after: pdserve colocated" "before: pdserve colocated"

Inputs of one label are its rounds, in the order given; each must hold one round.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from common import spread

FIGURES = ("tokens_per_s", "decode_tokens_per_s", "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms")


def rounds_by_system(inputs: list[str]) -> tuple[dict, dict]:
    """ "label=path" inputs -> ({system: {streams: [row per round]}}, {label: [conditions]})."""
    rows: dict = defaultdict(lambda: defaultdict(list))
    conditions: dict = defaultdict(list)
    for item in inputs:
        label, sep, path = item.partition("=")
        if not sep:
            raise SystemExit(f"{item!r}: expected LABEL=PATH")
        with open(path) as f:
            result = json.load(f)
        conditions[label].append({k: v for k, v in result.items() if k not in ("runs", "summary")})
        for system, by_streams in result["runs"].items():
            for streams, runs in by_streams.items():
                if len(runs) != 1:
                    raise SystemExit(f"{path}: {system} has {len(runs)} rounds, expected 1")
                rows[f"{label}: {system}"][int(streams)].append(runs[0])
        if "engine ceiling" in result.get("summary", {}):
            for key, figure in result["summary"]["engine ceiling"].items():
                streams = int(key.split("_")[0])
                row = {"tokens_per_s": figure["tokens_per_s"]["median"]}
                rows[f"{label}: engine ceiling"][streams].append(row)
    return rows, conditions


def summary(rows: dict) -> dict:
    return {
        system: {
            f"{streams}_streams": {k: spread(r[k] for r in runs) for k in FIGURES if k in runs[0]}
            for streams, runs in sorted(by_streams.items())
        }
        for system, by_streams in rows.items()
    }


def ratios(rows: dict, pairs: list[list[str]]) -> dict:
    """For each (a, b): a's tokens/s over b's, round by round, and their spread."""
    out = {}
    for a, b in pairs:
        for streams in sorted(rows[a]):
            per_round = [
                x["tokens_per_s"] / y["tokens_per_s"]
                for x, y in zip(rows[a][streams], rows[b][streams], strict=True)
            ]
            out[f"{a} / {b}, tokens/s, {streams} streams"] = {
                "per_round": per_round,
                **spread(per_round),
            }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("inputs", nargs="+", help="LABEL=PATH of a peers.py result of one round")
    p.add_argument("--ratio", nargs=2, action="append", default=[], metavar=("A", "B"))
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rows, conditions = rounds_by_system(args.inputs)
    missing = [name for pair in args.ratio for name in pair if name not in rows]
    if missing:
        raise SystemExit(f"--ratio names no merged system: {missing}; there are {sorted(rows)}")
    merged = {
        "conditions": conditions,
        "summary": summary(rows),
        "ratios": ratios(rows, args.ratio),
        "runs": rows,
    }
    with open(args.out, "w") as f:
        json.dump(merged, f, indent=1)
    print(json.dumps({"summary": merged["summary"], "ratios": merged["ratios"]}, indent=1))


if __name__ == "__main__":
    main()
