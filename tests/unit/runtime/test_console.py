"""The user-error report's error file: a launcher polling it meets it whole or not at all."""

from __future__ import annotations

import json

from megatron_rlvr.runtime import console


def test_the_error_file_is_never_seen_part_written(tmp_path, monkeypatch, capsys):
    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": "earlier"}))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.delenv("RANK", raising=False)
    seen_while_writing = []
    real_dump = json.dump

    def dump_and_look(obj, f, **kwargs):
        real_dump(obj, f, **kwargs)
        f.flush()
        # what nemo-run's scheduler would parse at this moment
        seen_while_writing.append(json.loads(error_file.read_text())["message"])

    monkeypatch.setattr(console.json, "dump", dump_and_look)
    assert console.report_user_error(ValueError("data.path: not found")) == 2

    assert seen_while_writing == ["earlier"]
    assert json.loads(error_file.read_text())["message"] == "error: data.path: not found"
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"], "no temporary file is left"
    assert capsys.readouterr().err == "error: data.path: not found\n"


def test_an_unwritable_error_file_leaves_the_line_and_no_litter(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "missing" / "error.json"))
    monkeypatch.delenv("RANK", raising=False)
    assert console.report_user_error(ValueError("bad")) == 2
    assert capsys.readouterr().err == "error: bad\n"
    assert list(tmp_path.iterdir()) == []
