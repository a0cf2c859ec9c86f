"""The one prompt encoding: chat template off (base models) and on (a ChatML instruct template with a default system
prompt, or a system prompt given in its place), the special tokens of each, the same ids as the two copies it
replaced, data and eval agreeing, and the template's end of turn (where sampling a chat prompt stops)."""

from __future__ import annotations

import pytest

from megatron_rlvr.problems.prompt_encoding import ChatTemplateMissing, EndOfTurnUnknown, encode_prompt, end_of_turn_id

SYSTEM = "You are a helpful assistant."
# Qwen2.5-style ChatML: a default system turn when the conversation has none, <|im_end|> ending each turn
CHATML = (
    "{%- if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n" + SYSTEM + "<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
PROBLEM = "What is 2+2?\n\nPlease reason step by step, and put your final answer within \\boxed{}."


def chatml_tokenizer(chat_template: str | None = CHATML):
    """A byte-level tokenizer with ChatML's special tokens and a BOS it prepends to any text it encodes with
    add_special_tokens (as Llama's does): the case where the two settings give different ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    specials = ["<s>", "<|im_start|>", "<|im_end|>"]
    for token in specials:
        vocab[token] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="module")
def demo_tokenizer():
    from transformers import AutoTokenizer

    from megatron_rlvr.demo import MODEL_DIR

    return AutoTokenizer.from_pretrained(MODEL_DIR)


# The two copies this encoding replaced, as they read before: data/dataset.py's (_apply_template, then the ids) and
# eval/command.py's hf_encoder_factory's encode.
def data_copy(tokenizer, problem: str, chat_template: bool) -> tuple[str, tuple[int, ...]]:
    text = problem
    if chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": problem}], tokenize=False, add_generation_prompt=True
        )
    return text, tuple(tokenizer(text, add_special_tokens=not chat_template)["input_ids"])


def eval_copy(tokenizer, text: str, chat_template: bool) -> list[int]:
    if chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    return list(tokenizer(text, add_special_tokens=not chat_template)["input_ids"])


def test_without_the_template_the_text_is_the_problem_with_the_tokenizers_bos():
    tokenizer = chatml_tokenizer()
    encoded = encode_prompt(tokenizer, PROBLEM, chat_template=False)
    bare = tokenizer(PROBLEM, add_special_tokens=False)["input_ids"]
    assert encoded.text == PROBLEM
    assert encoded.ids == (tokenizer.bos_token_id, *bare)


def test_the_chatml_template_adds_the_default_system_prompt_and_the_assistant_turn_with_no_second_bos():
    tokenizer = chatml_tokenizer()
    encoded = encode_prompt(tokenizer, PROBLEM, chat_template=True)
    assert encoded.text == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{PROBLEM}<|im_end|>\n<|im_start|>assistant\n"
    )
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert encoded.ids[0] == start and tokenizer.bos_token_id not in encoded.ids
    assert encoded.ids.count(start) == 3 and encoded.ids.count(end) == 2  # each marker is one special id
    assistant = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert list(encoded.ids[-len(assistant) :]) == assistant and assistant[0] == start
    assert tokenizer.decode(encoded.ids) == encoded.text


@pytest.mark.parametrize("chat_template", [False, True])
@pytest.mark.parametrize("which", ["chatml", "demo"])
def test_the_same_text_and_ids_as_the_two_copies_it_replaced(chat_template, which, demo_tokenizer):
    if which == "chatml":
        tokenizer = chatml_tokenizer()
    else:  # the demo model's own tokenizer (no BOS); a ChatML template set on it for the templated case
        tokenizer = demo_tokenizer
        tokenizer.chat_template = CHATML if chat_template else None
    problem = "3 5 7 -> 22:" if which == "demo" else PROBLEM
    try:
        encoded = encode_prompt(tokenizer, problem, chat_template=chat_template)
        assert (encoded.text, encoded.ids) == data_copy(tokenizer, problem, chat_template)
        assert list(encoded.ids) == eval_copy(tokenizer, problem, chat_template)
    finally:
        if which == "demo":
            tokenizer.chat_template = None


def test_a_tokenizer_without_a_template_is_refused_only_when_the_template_is_asked_for():
    tokenizer = chatml_tokenizer(chat_template=None)
    with pytest.raises(ChatTemplateMissing, match="defines no chat template"):
        encode_prompt(tokenizer, PROBLEM, chat_template=True)
    assert encode_prompt(tokenizer, PROBLEM, chat_template=False).text == PROBLEM


@pytest.mark.parametrize("system", ["Answer with a number.", ""])
def test_a_system_prompt_replaces_the_templates_default_and_needs_the_template(system):
    tokenizer = chatml_tokenizer()
    encoded = encode_prompt(tokenizer, PROBLEM, chat_template=True, system_prompt=system)
    assert encoded.text == (
        f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{PROBLEM}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert SYSTEM not in encoded.text and tokenizer.decode(encoded.ids) == encoded.text
    assert encode_prompt(tokenizer, PROBLEM, chat_template=True, system_prompt=None).text.count(SYSTEM) == 1
    with pytest.raises(ValueError, match="a system prompt needs the chat template"):
        encode_prompt(tokenizer, PROBLEM, chat_template=False, system_prompt=system)


def test_the_end_of_turn_is_the_special_token_the_template_writes_after_an_answer():
    tokenizer = chatml_tokenizer()
    assert end_of_turn_id(tokenizer) == tokenizer.convert_tokens_to_ids("<|im_end|>")
    # a Llama-3-style template: the turn ends with its own special token, not the tokenizer's EOS
    llama_like = chatml_tokenizer(
        "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n\\n' + m['content'] + '<s>' }}{%- endfor %}"
    )
    assert end_of_turn_id(llama_like) == llama_like.bos_token_id != llama_like.eos_token_id
    plain_end = chatml_tokenizer("{%- for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}")
    with pytest.raises(EndOfTurnUnknown, match=r"writes '\\n' after the assistant's answer, not a special token"):
        end_of_turn_id(plain_end)
    with pytest.raises(ChatTemplateMissing, match="no end of turn"):
        end_of_turn_id(chatml_tokenizer(chat_template=None))


@pytest.mark.parametrize("chat_template", [False, True])
def test_the_trainers_prompts_and_the_evals_prompts_are_the_same_ids(tmp_path, chat_template):
    from megatron_rlvr.data import DataConfig, items_from_rows
    from megatron_rlvr.data.sources import Row
    from megatron_rlvr.eval.api import hf_encoder_factory
    from megatron_rlvr.eval.config import EvalConfig

    chatml_tokenizer().save_pretrained(tmp_path / "model")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    cfg = DataConfig(chat_template=chat_template, max_prompt_tokens=4096)
    (item,), _ = items_from_rows([Row("p:1", "p", 1, {"problem": PROBLEM, "answer": "4"})], cfg, tokenizer)
    encode = hf_encoder_factory(str(tmp_path / "model"), EvalConfig(chat_template=chat_template))
    assert encode(PROBLEM) == list(item.prompt_ids)
    assert item.prompt_ids == encode_prompt(chatml_tokenizer(), PROBLEM, chat_template=chat_template).ids


def test_a_system_prompt_reaches_the_trainers_and_the_evals_prompts_alike(tmp_path):
    from transformers import AutoTokenizer

    from megatron_rlvr.config import load_config
    from megatron_rlvr.data import DataConfig, items_from_rows
    from megatron_rlvr.data.sources import Row
    from megatron_rlvr.eval.api import hf_encoder_factory
    from megatron_rlvr.eval.config import EvalConfig

    chatml_tokenizer().save_pretrained(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    cfg = DataConfig(chat_template=True, system_prompt="Be brief.", max_prompt_tokens=4096)
    (item,), _ = items_from_rows([Row("p:1", "p", 1, {"problem": PROBLEM, "answer": "4"})], cfg, tokenizer)
    assert item.prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    encode = hf_encoder_factory(str(tmp_path / "model"), EvalConfig(chat_template=True, system_prompt="Be brief."))
    assert encode(PROBLEM) == list(item.prompt_ids)
    with pytest.raises(ValueError, match="data.system_prompt: a system turn needs the chat template"):
        load_config(None, ["data.system_prompt=Be brief.", "data.chat_template=false"])
