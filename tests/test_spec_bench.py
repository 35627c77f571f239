"""``benchmarks/spec.py --smoke``: the speculative decoding benchmark runs end to end on a CPU in seconds (the copy
toy untrained), every mode at every row count, greedy tokens identical to plain decoding, its JSON the rows it
printed."""

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_spec_benchmark_smoke(tmp_path, capsys):
    sys.path.insert(0, str(BENCH))
    try:
        import spec as bench
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("spec", None)
    out = tmp_path / "spec.json"
    report = bench.main(["--smoke", "--json", str(out)])
    printed = capsys.readouterr().out
    rows = report["rows"]
    want = [m for m, _ in bench.modes(bench.SMOKE["ks"])]
    assert [(r["rows"], r["mode"]) for r in rows] == [(n, m) for n in bench.SMOKE["rows"] for m in want]
    for r in rows:
        assert r["identical"] is True, (r["rows"], r["mode"])  # greedy: speculation never changes a token
        assert r["tok_s"] > 0 and r["steps"] > 0 and f"| {r['rows']} | {r['mode']} |" in printed
        if r["mode"] == "plain":
            assert r["vs_plain"] == 1.0 and r["verify_steps"] == 0
        else:  # the copy prompts repeat a pattern: prompt lookup always finds drafts
            assert r["verify_steps"] > 0 and 0 < r["drafts_proposed"]
            assert 0.0 <= r["acceptance_rate"] <= 1.0
            assert 1.0 <= r["tokens_per_verify_row"] <= 1 + max(bench.SMOKE["ks"])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows, default=float))
