"""The parsers and the summary of ``benchmarks/ncu_probe.py`` on excerpts of real Nsight Compute output (an H200,
2026-11-29: the fp8 paged-decode kernel's details page, the GDN preparation kernel's warp-state page, and source
pages of the preparation and sequential GDN kernels), and its refusals; profiling itself needs a GPU and ``ncu``."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.bench import bench_module

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="module")
def ncu():
    with bench_module("ncu_probe") as module:
        yield module


@pytest.mark.parametrize("text, parsed", [
    ("decode:16", ("decode", ("16",))), ("decode:64:fp8", ("decode", ("64", "fp8"))),
    ("prefill:128:e4m3_qk", ("prefill", ("128", "e4m3_qk"))), ("gdn:3", ("gdn", ("3",)))])
def test_cases_parse(ncu, text, parsed):
    assert ncu.parse_case(text) == parsed


@pytest.mark.parametrize("text", ["mla:16", "decode", "decode:fp8", "decode:16:bf16", "gdn:1:2", "prefill:64:a:b"])
def test_bad_cases_are_refused_by_name(ncu, text):
    with pytest.raises(ValueError, match=text):
        ncu.parse_case(text)


def test_main_refuses_a_bad_case_before_looking_for_ncu(ncu, monkeypatch):
    monkeypatch.setattr(ncu.shutil, "which", lambda name: pytest.fail("looked for ncu"))
    with pytest.raises(ValueError, match="mla:1"):
        ncu.main(["decode:16", "mla:1"])


def test_main_without_ncu_says_so(ncu, monkeypatch, capsys):
    monkeypatch.setattr(ncu.shutil, "which", lambda name: None)
    assert ncu.main(["decode:16"]) == 2
    assert "ncu" in capsys.readouterr().err


def test_details_page_per_kernel(ncu):
    kernels = ncu.parse_details((DATA / "ncu_details_excerpt.txt").read_text())
    assert [k["name"] for k in kernels] == ["kvjax_paged_decode_fp8_s2_bk64", "anonymous_mosaic_gpu_kernel"]
    dec, prep = kernels
    assert dec["grid"] == (64, 8, 2) and dec["block"] == (128, 1, 1) and prep["grid"] == (16, 512, 1)
    m = dec["metrics"]
    assert m["Duration"] == (288.90, "us")
    assert m["Registers Per Thread"] == (168.0, "register/thread")
    assert m["Issued Instructions"][0] == 145_630_304  # thousands separators dropped
    assert m["Achieved Occupancy"][0] == 16.82 and m["Theoretical Occupancy"][0] == 18.75
    assert not any(name.startswith(("OPT", "Est.", "Metric", "Section", "Warning")) for name in m)
    assert prep["metrics"]["Avg. Active Threads Per Warp"] == (32.0, "")  # a metric without a unit
    assert prep["metrics"]["Stall Barrier"][0] == 1.00 and prep["metrics"]["Stall Long Scoreboard"][0] == 0.98
    assert "Duration" not in prep["metrics"]  # its page holds the warp states only


def test_source_page_per_kernel_and_summary(ncu):
    kernels = ncu.parse_source((DATA / "ncu_source_excerpt.csv").read_text())
    assert [k["name"] for k in kernels] == ["anonymous_mosaic_gpu_kernel", "gdn_chunk"]
    prep, seq = kernels
    assert len(prep["lines"]) == 6 and len(seq["lines"]) == 3
    assert prep["lines"][2] == ("@!P4  NANOSLEEP.SYNCS 0x989680", 2207.0, 32768.0)
    assert [ncu.opcode(s) for s, _, _ in prep["lines"]] == ["LDC", "S2R", "NANOSLEEP", "NANOSLEEP", "WARPGROUP",
                                                            "WARPGROUP"]
    text = ncu.source_summary(prep, top=2)
    samples = 118 + 3 + 2207 + 98 + 767 + 5
    assert f"| NANOSLEEP | {100 * (2207 + 98) / samples:.1f}% | {100 * 2 / 6:.1f}% |" in text
    assert text.index("| NANOSLEEP |") < text.index("| WARPGROUP |") < text.index("| LDC |")  # by samples
    assert text.count("`") == 4  # the top two lines only
    assert "| 2207 | 32768 | `@!P4  NANOSLEEP.SYNCS 0x989680` |" in text


def test_report_lists_big_kernels_and_sorted_stalls(ncu):
    details = ncu.parse_details((DATA / "ncu_details_excerpt.txt").read_text())
    details[1]["metrics"]["Duration"] = (1.5, "ms")  # ncu scales its units: 1500 us
    details[1]["metrics"]["Dynamic Shared Memory Per Block"] = (512.0, "byte/block")
    small = {"name": "tiny_fusion", "grid": (1, 1, 1), "block": (32, 1, 1), "metrics": {"Duration": (2000.0, "ns")}}
    source = ncu.parse_source((DATA / "ncu_source_excerpt.csv").read_text())
    text = ncu.report("gdn:3", details + [small], source)
    assert "3 kernels, 1790.9 us of kernel time" in text
    assert "| kvjax_paged_decode_fp8_s2_bk64 | 288.9 | 64x8x2 | 168 | 23.3 |" in text
    assert "| anonymous_mosaic_gpu_kernel | 1500.0 | 16x512x1 | - | 0.5 |" in text
    assert "tiny_fusion" not in text  # 2 us: under 2% of the call's kernel time
    stalls = text.split("by reason (cycles): ")[1].splitlines()[0]
    assert stalls.startswith("Barrier 1.00, Long Scoreboard 0.98, Wait 0.86")
    assert "GMMA" not in stalls  # under 0.05 cycles
    assert "#### anonymous_mosaic_gpu_kernel" in text and "#### gdn_chunk" not in text  # no such kernel in details
