"""Images in prompts, without an engine: a row's value as image sources, reading them (a bad one
is that row's error), the chat with image placeholders as the model's template places them, the
content parts a server is sent, the prefix order's key, and the DAG's checks (exit 2 with nothing
written). The real engine's answers: tests/test_real_images.py."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchllm.cli import app
from batchllm.core.images import ImageUnreadable, data_uri, image_bytes, order_key_ids, row_images
from batchllm.core.requests import EngineRequest
from batchllm.engines.endpoint.request_body import request_body
from batchllm.models.model_kind import ModelKind
from batchllm.models.tokens import PromptTokenizer
from batchllm.runtime.prepare import planned, split

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16  # the signature is what the data: URI's media type is read from
runner = CliRunner()


def test_a_rows_value_gives_its_sources_relative_paths_from_the_input_folder(tmp_path):
    assert row_images("images/a.png", tmp_path) == (str(tmp_path / "images" / "a.png"),)
    assert row_images(str(tmp_path / "b.png"), Path("/elsewhere")) == (str(tmp_path / "b.png"),)
    for uri in ("data:image/png;base64,AAAA", "https://example.com/c.jpg", "file:///d/e.png"):
        assert row_images(uri, tmp_path) == (uri,)
    assert row_images(PNG, tmp_path) == (PNG,)
    assert row_images(np.array(["a.png", "b.png"], dtype=object), tmp_path) == (str(tmp_path / "a.png"), str(tmp_path / "b.png"))
    assert row_images({"bytes": PNG, "path": "ignored.png"}, tmp_path) == (PNG,)  # Hugging Face datasets' image struct
    assert row_images({"bytes": None, "path": "f.png"}, tmp_path) == (str(tmp_path / "f.png"),)
    assert row_images([], tmp_path) == ()
    assert row_images(None, tmp_path) == ("",)  # a null: that row's error when it runs


def test_reading_a_source_gives_its_bytes_or_says_which_image_and_why_not(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    encoded = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert image_bytes(str(tmp_path / "a.png"), 1) == PNG == image_bytes((tmp_path / "a.png").as_uri(), 1) == image_bytes(encoded, 1)
    cases = [(str(tmp_path / "gone.png"), f"image 2 at {str(tmp_path / 'gone.png')!r} cannot be read: No such file or directory"),
             ("https://example.com/c.jpg", "image 2 is a URL (https://example.com/c.jpg); batchllm's engines fetch nothing over the "
                                           "network: download the images and give their paths or bytes"),
             ("data:image/png,abc", "image 2 is a data: URI without ';base64': 'data:image/png,abc'"),
             ("data:image/png;base64,@@@", "image 2 is a data: URI whose base64 does not decode: 'data:image/png;base64,@@@'"),
             ("", "image 2 is empty (a null or an empty text): give a path, a data: URI or the image's bytes"),
             (b"", "image 2 is empty (0 bytes)")]
    for source, message in cases:
        with pytest.raises(ImageUnreadable) as raised:
            image_bytes(source, 2)
        assert str(raised.value) == message


def test_a_server_is_sent_the_images_as_content_parts_before_the_text(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    request = EngineRequest("r1", "What is it?", system="Be brief.", images=(str(tmp_path / "a.png"), "https://example.com/c.jpg"))
    body = request_body(request, "vlm", "vllm", None)
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(PNG).decode()}},
                                     {"type": "image_url", "image_url": {"url": "https://example.com/c.jpg"}},
                                     {"type": "text", "text": "What is it?"}]}]
    assert data_uri(b"\xff\xd8rest", 1).startswith("data:image/jpeg;base64,")
    with pytest.raises(ValueError, match="image 1 at .* cannot be read"):  # the engine makes it that row's error
        request_body(request._replace(images=(str(tmp_path / "gone.png"),)), "vlm", "vllm", None)


PARTS_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
                  "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
                  "{% endif %}</s>\n{% endfor %}<s>assistant\n")
TEXT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}<s>assistant\n"


def _vision_model_dir(folder: Path, template: str) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "<s> </s> <unk> <image> system user assistant what is it ?".split()
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>", "<image>"])
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}))
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"],
                                                    "vision_config": {"image_size": 336, "patch_size": 14}}))
    return folder


@pytest.mark.parametrize("template, user", [(PARTS_TEMPLATE, "<image><image>what is it ?"), (TEXT_TEMPLATE, "<image>\n<image>\nwhat is it ?")],
                         ids=["parts", "text-only"])
def test_the_prompt_has_a_placeholder_per_image_where_the_template_puts_parts_else_a_line_each_before_the_text(tmp_path, template, user):
    tokenizer = PromptTokenizer(_vision_model_dir(tmp_path / "m", template))
    request = EngineRequest("r1", "what is it ?", images=(PNG, PNG))
    assert tokenizer.prompt_text(request) == f"<s>user\n{user}</s>\n<s>assistant"
    ids = tokenizer.token_ids_many([request, request._replace(images=())])
    assert ids[0].count(3) == 2 and ids[1].count(3) == 0  # <image> is id 3: one placeholder an image, expanded by the engine
    assert tokenizer.image_tokens == 576 == ModelKind.of(tmp_path / "m").image_tokens  # LLaVA's: 336 px in patches of 14


def test_the_prefix_order_tells_requests_apart_by_their_images():
    a, b = order_key_ids((PNG,)), order_key_ids((PNG + b"x",))
    assert a == order_key_ids((PNG,)) and a != b and all(i < 0 for i in a + b) and len(a) == len(b) == 16
    same_text = [EngineRequest(f"r{k}", "x", prompt_token_ids=tuple(range(40)), images=(PNG if k % 2 else PNG + b"x",)) for k in range(8)]
    window = split(planned(same_text), 1, block_size=16, prefix_order=True)
    images = [p.request.images for p in window.replicas[0]]
    assert images == sorted(images, key=lambda i: i != images[0])  # each image's requests together, to share its cached blocks


DAG = """
inputs:
  photos: {path: photos.parquet, id_column: id}
nodes:
  look:
    model: %s
    prompt: "{{ question }}"
    %s
"""


@pytest.mark.parametrize("model, extra, where, message", [
    ("./vlm", "images: photo", "nodes.look.images",
     "nodes.look.images must be an expression such as \"{{ photo }}\" or a list of them, got 'photo'"),
    ("./vlm", "images: \"{{ photo }}\"\n    task: embed", "nodes.look.images",
     "nodes.look.images: images go to a generation node, not to one with `task: embed`"),
    ("./vlm", "images: \"{{ id }}\"\n    chat: false", "nodes.look.images",
     "nodes.look.images goes with a `prompt:` in the chat (the images come before its text), not with `chat: false`"),
    ("./vlm", "images: \"{{ size }}\"", "nodes.look.images",
     "column 'size' of input 'photos' has type int64, but `images:` reads paths, URIs or image bytes"),
    ("./text-model", "images: \"{{ photo }}\"", "nodes.look.images",
     "node 'look' gives its model images, but model './text-model' (LlamaForCausalLM) sees none: its config has no vision_config"),
])
def test_a_dag_whose_images_cannot_work_is_refused_at_validate_and_run_with_nothing_written(tmp_path, model, extra, where, message):
    pq.write_table(pa.table({"id": ["a"], "question": ["what is it ?"], "photo": ["p.png"], "size": [3]}), tmp_path / "photos.parquet")
    for name, architecture, vision in (("vlm", "LlavaForConditionalGeneration", {"image_size": 336, "patch_size": 14}),
                                       ("text-model", "LlamaForCausalLM", None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"architectures": [architecture], **({"vision_config": vision} if vision else {})}))
        (tmp_path / name / "tokenizer.json").write_text("{}")
        (tmp_path / name / "model.safetensors").write_bytes(b"")
    (tmp_path / "dag.yaml").write_text(DAG % (model, extra))
    for args in (["validate", str(tmp_path / "dag.yaml")], ["run", str(tmp_path / "dag.yaml"), "--out", str(tmp_path / "out")]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        text = " ".join(result.output.split())
        assert message in text and where in text, text
        assert not (tmp_path / "out").exists()


def test_the_plan_counts_each_image_as_the_tokens_it_expands_to_and_rows_of_one_image_as_sharing_its_prefix(tmp_path):
    from batchllm.dag.loader import load_dag
    from batchllm.io.node_data import _prompt_tokens

    model = _vision_model_dir(tmp_path / "vlm", PARTS_TEMPLATE)
    pq.write_table(pa.table({"id": ["a", "b", "c"], "question": ["what is it ?"] * 3, "photo": ["p.png", "q.png", "p.png"]}),
                   tmp_path / "photos.parquet")
    (tmp_path / "dag.yaml").write_text(DAG % ("./vlm", "images: \"{{ photo }}\""))
    node = load_dag(tmp_path / "dag.yaml").nodes["look"]
    rows = pq.read_table(tmp_path / "photos.parquet").to_pylist()
    tokens, cached, requests = _prompt_tokens(node, rows, 0.0, 8.0, 16, PromptTokenizer(model), {})
    text_tokens = len(PromptTokenizer(model).token_ids(requests[0]._replace(images=())))
    assert tokens.tolist() == [text_tokens + 576] * 3  # the placeholder expands to LLaVA's 576 tokens
    assert requests[0].images == requests[2].images == (str(tmp_path / "p.png"),) != requests[1].images
    assert cached[2] > 0 and cached[1] == 0 and cached[0] == 0  # only the row with the first row's image shares its prefix
