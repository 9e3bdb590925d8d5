"""Prompt tokens from the model's own tokenizer, batched and without transformers' import:
the same ids as transformers' apply_chat_template / encode, on a tokenizer built here."""

from __future__ import annotations

import json

import pytest

from batchllm.core.requests import EngineRequest
from batchllm.models.tokens import PromptTokenizer

TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ bos_token }}system\nDefault system.{{ eos_token }}\n{% endif %}"
            "{{ bos_token + message['role'] + '\n' + (message['content'] | trim) + eos_token + '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ bos_token + 'assistant\n' }}{% endif %}")


@pytest.fixture
def model_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "<s> </s> <unk> system user assistant Default Be brief . question number why is the sky blue ? 1 2 3 : {x}".split()
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>"}, "unk_token": "<unk>", "chat_template": TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tmp_path


@pytest.mark.starts_no_engine
@pytest.mark.engine  # transformers' tokenizer and the embedded model's package
def test_batched_ids_equal_transformers_chat_template_and_plain_encoding(model_dir):
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    reference.chat_template = TEMPLATE
    requests = [EngineRequest(f"r{i}", f"  why is the sky blue ? {i} {{x}} </s> " * (i % 3 + 1),
                              system="Be brief ." if i % 2 else None, chat=i % 4 != 0) for i in range(12)]

    def expected(request):
        if not request.chat:
            return list(reference.encode(request.prompt))
        messages = ([{"role": "system", "content": request.system}] if request.system else [])
        ids = reference.apply_chat_template(messages + [{"role": "user", "content": request.prompt}],
                                            add_generation_prompt=True, tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    tokenizer = PromptTokenizer(model_dir)
    assert tokenizer.loads_without_transformers
    assert tokenizer.token_ids_many(requests) == [expected(r) for r in requests]
    # the template trims the message, so it is not placed verbatim: no frame, rendered per prompt
    assert tokenizer.prompt_text(requests[1]).startswith("<s>system\nBe brief .</s>\n<s>user\nwhy is")
    assert tokenizer.frame(None) is None and tokenizer.frame("Be brief .") is None


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEXTS = ["why is the sky blue? because of scattering, mostly.", "  two spaces\n\nand new lines\t tabs",
         "<|im_end|> inside a message", "numbers 12345 and ünïcödé", ""]


def _byte_level_model(tmp_path, lstrip: bool = False):
    """A byte-level BPE trained here, with ChatML special tokens and a template that places the message verbatim."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(TEXTS * 20 + ["system user assistant Be brief."] * 20,
                                  trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.add_special_tokens([AddedToken("<|im_start|>", lstrip=lstrip), AddedToken("<|im_end|>", lstrip=lstrip)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHATML}))
    return tokenizer


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_stitched_ids_equal_the_whole_rendered_prompt_tokenized(tmp_path, system):
    whole = _byte_level_model(tmp_path)
    tokenizer = PromptTokenizer(tmp_path)
    requests = [EngineRequest(str(i), text, system=system) for i, text in enumerate(TEXTS)]
    stitch = tokenizer.stitch(system)
    assert stitch is not None and stitch.tail == "user\n"  # cut after the last <|im_start|>, before <|im_end|>
    expected = [whole.encode(tokenizer.prompt_text(r), add_special_tokens=False).ids for r in requests]
    assert tokenizer.token_ids_many(requests) == expected


def test_a_special_token_that_strips_whitespace_is_never_a_cut(tmp_path):
    whole = _byte_level_model(tmp_path, lstrip=True)
    tokenizer = PromptTokenizer(tmp_path)
    requests = [EngineRequest(str(i), text) for i, text in enumerate(TEXTS)]
    assert tokenizer.stitch(None) is None
    assert tokenizer.token_ids_many(requests) == [whole.encode(tokenizer.prompt_text(r), add_special_tokens=False).ids
                                                  for r in requests]
