"""tools.kernel_check keeps its rows in its JSON as each is checked: a GPU call cut at its time limit still brings
back what it checked (the checks themselves need the GPU)."""

import json

import torch

from tools.kernel_check import _Printed


def test_each_checked_row_is_in_the_json_before_the_next_is_checked(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a GPU")
    path = tmp_path / "rows.json"
    rows = _Printed(str(path))
    rows.append({"check": "decode", "case": "MHA", "metric": "rel. error", "value": 2e-5, "ok": True})
    assert json.loads(path.read_text())["rows"] == [rows[0]]
    rows.append({"check": "cuda", "case": "GQA", "metric": "rel. error", "value": 3e-3, "ok": False})
    kept = json.loads(path.read_text())
    assert kept["device"] == "a GPU" and [r["ok"] for r in kept["rows"]] == [True, False]
    assert capsys.readouterr().out.splitlines()[-1] == "cuda     GQA rel. error 3.00e-03 FAILED"
