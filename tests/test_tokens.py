"""Prompt tokens from the model's own tokenizer, batched and without transformers' import:
the same ids as transformers' apply_chat_template / encode, on a tokenizer built here."""

from __future__ import annotations

import json

import pytest

from batchllm.engines.protocol import EngineRequest
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
