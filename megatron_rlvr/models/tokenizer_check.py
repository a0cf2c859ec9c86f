"""The one check that two models read token ids the same way: a teacher and its student, a weak prefix model and the
policy, models whose candidates are compared token by token. Only ids travel between them, so the vocabularies
(every token string's id) and the special tokens' ids must be equal."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rlvr.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TokenizerMismatch(ConfigError):
    """A model that must share the policy's tokenizer does not; the message names the setting and the difference."""


SPECIAL_IDS = ("eos_token_id", "pad_token_id", "bos_token_id")


def tokenizer_differences(reference: PreTrainedTokenizerBase, other: PreTrainedTokenizerBase) -> list[str]:
    """Why ``other`` does not map text to ``reference``'s ids (empty: it does)."""
    problems = []
    ref_vocab, other_vocab = reference.get_vocab(), other.get_vocab()
    if ref_vocab != other_vocab:
        differ = sorted(set(ref_vocab.items()) ^ set(other_vocab.items()), key=lambda kv: kv[1])
        problems.append(
            f"vocabularies differ ({len(other_vocab)} vs {len(ref_vocab)} tokens, {len(differ)} entries differ; "
            f"e.g. {differ[:3]})"
        )
    for key in SPECIAL_IDS:
        if getattr(reference, key) != getattr(other, key):
            problems.append(f"{key} {getattr(other, key)} vs {getattr(reference, key)}")
    return problems


def check_same_tokenizer(
    setting: str,
    other_dir: str | Path,
    reference_dir: str | Path,
    *,
    reference_name: str = "model.hf_dir",
    tokenizers: tuple[PreTrainedTokenizerBase, PreTrainedTokenizerBase] | None = None,
) -> PreTrainedTokenizerBase:
    """Raise `TokenizerMismatch` (one line: ``{setting}={other_dir!r}: ...``, or ``--flag DIR: ...`` for a command-line
    flag) unless the model at ``other_dir`` reads token ids as ``reference_dir``'s does; returns the reference's
    tokenizer. ``tokenizers``: (reference, other) already loaded."""
    named = f"{setting} {other_dir}" if setting.startswith("--") else f"{setting}={str(other_dir)!r}"
    if tokenizers is None:
        if not (Path(other_dir) / "config.json").is_file():
            raise TokenizerMismatch(f"{named}: not an HF model directory (no config.json there)")
        from transformers import AutoTokenizer

        tokenizers = (AutoTokenizer.from_pretrained(reference_dir), AutoTokenizer.from_pretrained(other_dir))
    problems = tokenizer_differences(*tokenizers)
    if problems:
        raise TokenizerMismatch(
            f"{named}: its tokenizer differs from {reference_name}'s ({'; '.join(problems)}); "
            "the two models must share one tokenizer"
        )
    return tokenizers[0]
