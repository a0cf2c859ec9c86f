"""The doc-test directive grammar (tests/system/docs/blocks.py): what a page's comments mean, and the errors they give."""

import pytest

from tests.system.docs.blocks import DocTestError, commands, parse_blocks

pytestmark = pytest.mark.docs

PAGE = """# A page

<!-- doc-test: s|--n 1024|--n 8| fewer samples -->
<!-- doc-test: timeout 30 -->
```bash cpu
.venv/bin/megatron-rlvr eval --n 1024 \\
    --out outputs/x   # a comment
```

- an item:

  <!-- doc-test: skip: runs the suite -->
  ```bash cpu
  bash tools/run_tests.sh
  ```

```bash
echo unmarked
```

```text
output, never run
```
"""


def test_directives_attach_to_the_block_below_them(tmp_path):
    (tmp_path / "page.md").write_text(PAGE)
    run, skipped, unmarked, text = parse_blocks(tmp_path / "page.md", tmp_path)
    assert (run.where, run.kind, run.timeout, run.skip) == ("page.md:6", "cpu", 30.0, "")
    assert run.runnable_text().startswith(".venv/bin/megatron-rlvr eval --n 8 \\")
    assert commands(run.text) == [".venv/bin/megatron-rlvr eval --n 1024      --out outputs/x   # a comment"]
    assert (skipped.where, skipped.skip, skipped.text) == ("page.md:14", "runs the suite", "bash tools/run_tests.sh\n")
    assert unmarked.kind == "" and text.kind == "other"


@pytest.mark.parametrize(
    "directive, message",
    [
        ("s|--n 9|--n 8|", r"'--n 9' is not in the block"),
        ("skip:", "skip needs a reason"),
        ("long:", "long needs a reason"),
        ("timeout soon", "expected 'timeout SECONDS'"),
        ("s|a|b", r"expected s\|OLD\|NEW\| \[why\]"),
        ("run faster", "expected 'skip: REASON'"),
    ],
)
def test_a_bad_or_stale_directive_is_one_clear_error(tmp_path, directive, message):
    (tmp_path / "page.md").write_text(f"<!-- doc-test: {directive} -->\n```bash cpu\necho --n 1024\n```\n")
    with pytest.raises(DocTestError, match=message):
        [block.runnable_text() for block in parse_blocks(tmp_path / "page.md", tmp_path)]
