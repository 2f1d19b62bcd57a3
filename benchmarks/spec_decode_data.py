"""Data and tables for benchmarks/spec_decode.sh.

python benchmarks/spec_decode_data.py dataset OUT.json [COUNT]
    an editing workload in vLLM bench's `sharegpt` format (sent as chat messages): real
    functions of this repository, each with a request to rename one of its variables and
    reply with the whole code, so the answer repeats long spans of the prompt
python benchmarks/spec_decode_data.py table OUT_DIR
    the table of OUT_DIR/{MODE}/r{ROUND}/{LEVEL}.json (vLLM's result files) and
    OUT_DIR/{MODE}/r{ROUND}/{LEVEL}.spec (drafts, draft tokens, accepted tokens in the level)
"""

from __future__ import annotations

import ast
import json
import random
import statistics
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def functions(min_lines: int = 10, max_lines: int = 30) -> list[tuple[str, list[str]]]:
    """(source, local variable names) of the package's functions of a fitting length."""
    found = []
    for path in sorted((ROOT / "pagoda").rglob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.FunctionDef) or not min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
                continue
            names = sorted({n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)})
            names = [n for n in names if len(n) > 2]
            if names:
                source = textwrap.dedent(" " * node.col_offset + ast.get_source_segment(text, node))
                found.append((source, names))
    return found


def dataset(out: Path, count: int) -> None:
    rng = random.Random(0)
    chosen = rng.sample(functions(), count)
    entries = []
    for source, names in chosen:
        name = rng.choice(names)
        prompt = (
            f"Rewrite this Python code with the variable `{name}` renamed to `{name}_value`. "
            f"Reply with the complete code only.\n```python\n{source}\n```"
        )
        # the answer is only vLLM bench's length hint; --sharegpt-output-len overrides it
        entries.append({"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": source}]})
    out.write_text(json.dumps(entries, indent=1))


def table(out: Path) -> None:
    # each engine's "-off" mode first: its speed is what the speculative mode is compared with
    modes = sorted((p.name for p in out.iterdir() if p.is_dir()), key=lambda m: (m.rsplit("-", 1)[0], m[-4:] != "-off"))
    levels = sorted(
        {f.stem for m in modes for f in (out / m).glob("r*/*.json")},
        key=lambda s: (s.split("-")[0], int(s.split("c")[-1])),
    )
    widths = {"workload": 10, "conc": 5, "mode": 14, "out tok/s": 11, "TPOT p50 ms": 13, "accept %": 10}
    widths |= {"mean len": 10, "runs": 6, "vs off": 8}
    print("".join(f"{h:>{w}}" for h, w in widths.items()))
    for level in levels:
        workload, conc = level.rsplit("-c", 1)
        speeds = {}
        for mode in modes:
            runs = sorted((out / mode).glob(f"r*/{level}.json"))
            if not runs:
                continue
            results = [json.loads(r.read_text()) for r in runs]
            speeds[mode] = tps = statistics.median(r["output_throughput"] for r in results)
            tpot = statistics.median(r["median_tpot_ms"] for r in results)
            spec = [json.loads(r.with_suffix(".spec").read_text()) for r in runs if r.with_suffix(".spec").exists()]
            drafts, proposed, accepted = (sum(s[k] for s in spec) for k in ("drafts", "draft_tokens", "accepted"))
            off = speeds.get(mode.rsplit("-", 1)[0] + "-off")
            cells = [workload, conc, mode, f"{tps:.1f}", f"{tpot:.1f}"]
            cells += [
                f"{accepted / proposed * 100:.1f}" if proposed else "-",
                f"{1 + accepted / drafts:.2f}" if drafts else "-",
            ]
            cells += [str(len(runs)), f"{tps / off:.2f}x" if off and not mode.endswith("-off") else ""]
            print("".join(f"{c:>{w}}" for c, w in zip(cells, widths.values())))
    print("(medians over rounds; vs off: output tok/s over the same engine with speculation off)")


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "dataset":
        dataset(Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 32)
    elif command == "table":
        table(Path(sys.argv[2]))
    else:
        sys.exit(__doc__)
