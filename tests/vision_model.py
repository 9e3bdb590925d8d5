"""A vision-language model made at test time, never downloaded: Idefics3's real architecture (the
one SmolVLM uses: a SigLIP vision tower, a pixel-shuffle connector, a Llama language model) with the
embedded SmolLM2-135M as its language model (its weights and tokenizer, the image tokens added) and
a tiny vision tower and connector of seeded random weights. What it says of an image is noise; the
loading, the image preprocessing (Idefics3's resize and normalisation), the image tokens and the
batching are vLLM's real ones. Images are resized to 128 x 128 pixels, in patches of 16, shuffled
by 2: 16 image tokens each (and 3 around them). (LLaVA's vLLM module needs torchvision, which has
no CPU build beside vLLM's torch on these machines; Idefics3's does not.)"""

from __future__ import annotations

from pathlib import Path

IMAGE_TOKEN = "<image>"
IMAGE_SIZE_PX, PATCH_PX, SCALE_FACTOR = 128, 16, 2
IMAGE_TOKENS = (IMAGE_SIZE_PX // PATCH_PX) ** 2 // SCALE_FACTOR ** 2
EXTRA_TOKENS = ("<fake_token_around_image>", IMAGE_TOKEN, "<global-img>", "<end_of_utterance>")

# ChatML as SmolLM2's own template, taking a message's content as text or as OpenAI content parts
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_vision_model(folder: Path, language_model: Path, *, seed: int) -> Path:
    """`language_model`: the embedded SmolLM2 folder; the Idefics3 model in `folder` (config, weights,
    tokenizer, image processor, chat template), about 550 MB in float32."""
    import torch  # in the engine's environment, as the real-engine tests are
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaForCausalLM,
    )

    tokenizer = AutoTokenizer.from_pretrained(language_model)
    tokenizer.add_special_tokens({"additional_special_tokens": list(EXTRA_TOKENS)})
    text = LlamaForCausalLM.from_pretrained(language_model, dtype=torch.float32)
    text.resize_token_embeddings(len(tokenizer))
    vision_config = Idefics3VisionConfig(image_size=IMAGE_SIZE_PX, patch_size=PATCH_PX, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=2)
    config = Idefics3Config(vision_config=vision_config, text_config=text.config, scale_factor=SCALE_FACTOR,
                            image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), tie_word_embeddings=True,
                            pad_token_id=text.config.pad_token_id)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    model.model.text_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": IMAGE_SIZE_PX},
                                                max_image_size={"longest_edge": IMAGE_SIZE_PX})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=IMAGE_TOKENS,
                                  chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    return folder
