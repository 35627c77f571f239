"""README's cpu-preset row of ``python -m kvjax run``, regenerated from the runs that produced it.

The runs are kept in ``benchmarks/readme_runs.json`` (each run's ``--json`` document without its per-step
columns: the command, kvjax / jax versions, git commit, device, seed, date and the summaries). README's row that
carries the (invisible) ``<!-- readme_figures:run-cpu -->`` marker in its last cell is rendered from them, and
``tests/test_new_user.py`` checks that README holds exactly that row, so a figure cannot drift from its runs.

Usage (repository root)::

    python -m kvjax run --json /tmp/a.json; python -m kvjax run --json /tmp/b.json
    python benchmarks/readme_figures.py set /tmp/a.json /tmp/b.json   # replace the stored runs, rewrite README
    python benchmarks/readme_figures.py check                           # exit 1 if README's row is stale
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "readme_runs.json"
README = ROOT / "README.md"
MARK = "<!-- readme_figures:run-cpu -->"


def trimmed(doc: dict) -> dict:
    """A ``run --json`` document without its per-step columns; ``ValueError`` unless it is a cpu-preset run of
    both policies with its provenance."""
    if doc.get("preset") != "cpu" or "meta" not in doc or not {"none", "timely"} <= set(doc.get("results", {})):
        raise ValueError("not a `python -m kvjax run --preset cpu --json` document with its meta")
    return {k: v for k, v in doc.items() if k != "steps"}


def render(runs: list[dict]) -> str:
    """README's table row for ``runs`` (its columns: command, device and date, none tok/s, timely tok/s, gain of
    the medians, identical tokens)."""
    if not runs:
        raise ValueError("no runs")
    rates = {p: [x for r in runs for x in r["results"][p]["generated_tokens_per_s_repeats"]] for p in ("none", "timely")}
    gains = sorted(r["gain_tokens_per_s"] for r in runs)
    commits = sorted({(r["meta"].get("git") or {}).get("commit", "")[:7] or "not recorded" for r in runs})
    dirty = any((r["meta"].get("git") or {}).get("dirty") for r in runs)
    dates = sorted({r["meta"]["date"][:10] for r in runs})
    hosts = sorted({f"{r['meta']['host']['cpus']}-core {r['meta']['host']['machine']}" for r in runs})
    repeats = sorted({r["repeats"] for r in runs})
    return (f"| `python -m kvjax run` (cpu preset, f32), {len(runs)} invocations x {'/'.join(map(str, repeats))} "
            f"repeats, commit {', '.join(commits)}{' (uncommitted changes)' if dirty else ''} "
            f"| {', '.join(sorted({r['meta']['device'] for r in runs}))}, {', '.join(hosts)} host, {', '.join(dates)} "
            f"| {min(rates['none']):.1f}–{max(rates['none']):.1f} | {min(rates['timely']):.1f}–{max(rates['timely']):.1f} "
            f"| {gains[0]:.2f}×–{gains[-1]:.2f}× | {'yes' if all(r['identical_tokens'] for r in runs) else 'NO'} {MARK} |")


def readme_row(text: str) -> str:
    """README's line that carries the marker (``ValueError`` unless exactly one does)."""
    rows = [line for line in text.splitlines() if MARK in line]
    if len(rows) != 1:
        raise ValueError(f"README has {len(rows)} lines with {MARK}, expected 1")
    return rows[0]


def main(argv: list[str]) -> int:
    """``set RUN.json ...`` or ``check``; returns the exit status."""
    if argv[:1] == ["set"] and len(argv) > 1:
        runs = [trimmed(json.loads(Path(p).read_text())) for p in argv[1:]]
        RUNS.write_text(json.dumps(runs, indent=1) + "\n")
        text = README.read_text()
        README.write_text(text.replace(readme_row(text), render(runs), 1))
        print(render(runs))
        return 0
    if argv == ["check"]:
        want, have = render(json.loads(RUNS.read_text())), readme_row(README.read_text())
        if want != have:
            print(f"README's row is stale:\n  README: {have}\n  runs:   {want}", file=sys.stderr)
            return 1
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
