"""tools/benches/measure_memory.py's layouts as docs/plan.md and docs/lora.md write them: the parsing the documented
commands go through (their measurements are tests/integration/plan/test_measured.py's and test_moe_cp_plan.py's,
which build the same `Case`s)."""

from __future__ import annotations

import pytest

from tools.benches.measure_memory import DEFAULT_LAYOUTS, MOE_LAYOUTS, Case


def test_the_documented_layouts_parse_to_their_cases():
    assert Case.parse("2,1,dist,ref,lora8", seq_len=64) == Case(2, 1, True, True, seq_len=64, lora=8)
    assert Case.parse("1,1,local,ref,lora8") == Case(1, 1, False, True, lora=8)
    assert Case.parse("1,2,dist,lora8").label == "TP=1 PP=2 dist-opt LoRA r=8"
    assert Case.parse("1,1,dist,ep2", seq_len=64) == Case(1, 1, True, False, seq_len=64, ep=2)
    assert Case.parse("1,1,local,ref,ep2").label == "TP=1 PP=1 EP=2 local-opt +ref"
    assert all(Case.parse(text) for text in DEFAULT_LAYOUTS + MOE_LAYOUTS)


@pytest.mark.parametrize("text", ["2", "1,1,zero", "1,1,loraX", "1,1,ep"])
def test_a_bad_layout_is_one_line_naming_it_and_the_form(text):
    with pytest.raises(SystemExit, match=rf"--layouts '{text}': expected TP,PP\[,dist\|local\]\[,ref\]"):
        Case.parse(text)
