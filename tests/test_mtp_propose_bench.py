"""``benchmarks/mtp_propose.py`` on a CPU: its scanned proposes draft what single proposes draft (the pages carried
from one to the next), its two paths (the draft steps as the op, as the layer's own steps) draft alike, and a run
writes the compiled HLO and reports its time."""

from __future__ import annotations

import jax
import numpy as np

from helpers.bench import import_bench


def _bench():
    return import_bench("mtp_propose")


def test_mtp_propose_benchmark_scan_and_smoke(tmp_path, capsys):
    bench = _bench()
    propose, args = bench.build(rows=2, drafts=2, context=12)
    pages_n, drafts_n = bench.scanned(propose, 2)(*args)
    drafts_1, pages_1 = propose(*args)
    drafts_2, pages_2 = propose(*args[:2], pages_1, *args[3:])
    np.testing.assert_array_equal(np.asarray(drafts_n), np.stack([np.asarray(drafts_1), np.asarray(drafts_2)]))
    assert drafts_n.shape == (2, 2, 2) and int(np.asarray(drafts_n).min()) >= 0
    for name in pages_2:
        np.testing.assert_allclose(np.asarray(pages_n[name]), np.asarray(pages_2[name]), rtol=1e-6, atol=1e-6)
    assert not all(np.array_equal(np.asarray(pages_1[n]), np.asarray(args[2][n])) for n in pages_1), \
        "a propose wrote no K/V"
    loop, loop_args = bench.build(rows=2, drafts=2, context=12, path="loop")  # the layer's own draft steps
    np.testing.assert_array_equal(np.asarray(loop(*loop_args)[0]), np.asarray(drafts_1))
    out = bench.main(["--rows", "1", "--drafts", "2", "--context", "8", "--scan", "1", "--out", str(tmp_path)])
    assert out["wall_us"] > 0 and (tmp_path / "propose_hlo.txt").stat().st_size > 0
    assert "us a propose" in capsys.readouterr().out
    if jax.default_backend() != "gpu":
        assert "kernels" not in out
