"""``python -m kvjax info``: every op's table, the auto choice per example call and the decline reasons."""

import json

from kvjax import ops
from kvjax.cli import info as cli_info


def test_info_reports_every_table_and_its_choices(capsys):
    assert cli_info.main(["--json", "-", "--device", "h100"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info["ops"]) == {t.op for t in ops.tables()}
    assert info["meta"]["kvjax"] and info["meta"]["jax"] and info["meta"]["date"] and "device" in info["meta"]
    assert info["asked_for"].startswith("gpu sm_90")
    paged = info["ops"]["paged_attention"]["examples"]
    decode = next(v for k, v in paged.items() if k.startswith("decode"))
    assert decode["auto"] == "pallas"
    assert "decode-shaped" in decode["reasons"]["prefill"] and decode["reasons"]["pallas"] is None
    mla = info["ops"]["mla_decode"]["examples"]
    assert [v["auto"] for k, v in mla.items() if "H=128 page 64 bf16" in k] == ["mosaic"]
    assert all(ex["auto"] == "reference" for entry in cli_info.collect(cli_info.NAMED["cpu"])["ops"].values()
               for ex in entry["examples"].values())


def test_info_text_and_bad_arguments(capsys):
    assert cli_info.main(["--device", "a100"]) == 0
    out = capsys.readouterr().out
    assert "mla_decode:" in out
    # a reason that holds for every example call of an op is printed once, in the grouped section (issue 33 item 7)
    grouped = out.split("\n\n")[1]
    assert grouped.startswith("declined on every example call") and "mosaic in mla_decode" in grouped
    assert "mosaic declines" not in out.split("mla_decode:")[1].split("\n\n")[0]
    assert cli_info.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("needs a GPU") == 1 and "pallas in paged_attention" in out


def test_info_json_file(tmp_path, capsys):
    path = tmp_path / "info.json"
    assert cli_info.main(["--json", str(path), "--device", "cpu"]) == 0
    assert "kernel choice for" in capsys.readouterr().out  # the text still goes to stdout
    assert json.loads(path.read_text())["asked_for"].startswith("cpu")
    assert cli_info.main(["--device", "tpu9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("info: ") and len(err.strip().splitlines()) == 1
