"""Vision-language models (LLaVA) against transformers: the image processor, the vision
tower, and whole requests with images (greedy tokens and logprobs), batched with text,
with chunked prefill, prefix-cache hits, the encoder cache and preemption."""

from __future__ import annotations

import base64
import collections
import dataclasses
import io
import json

import numpy as np
import pytest
from PIL import Image

from jaxserve import LLM, SamplingParams
from jaxserve.config import ModelConfig

IMAGE_TOKEN = 259  # the byte tokenizer's next id: `<image>`
TOKENS_PER_IMAGE = 16  # (56 / 14) ** 2 patches, the class token dropped
# LLaVA's chat template (llava-hf's, without the `{% generation %}` markers).
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def _processor_kwargs():
    return dict(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """(directory, torch model, HF processor): a random tiny LLaVA (CLIP tower of 3 layers,
    features of layer -2, Llama of 2 layers) saved with its processor by transformers."""
    import torch
    import transformers as tf
    from tokenizers import AddedToken, Tokenizer

    from jaxserve.demo import write_byte_tokenizer

    path = tmp_path_factory.mktemp("llava")
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                 num_attention_heads=4, image_size=56, patch_size=14,
                                 initializer_range=0.2)
    text = tf.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          initializer_range=0.1, bos_token_id=0, eos_token_id=1,
                          max_position_embeddings=256)
    cfg = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                         initializer_range=0.1)
    torch.manual_seed(0)
    model = tf.LlavaForConditionalGeneration(cfg).eval()
    model.save_pretrained(path)
    write_byte_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    tok.save(str(path / "tokenizer.json"))
    assert tok.token_to_id("<image>") == IMAGE_TOKEN
    tokenizer = tf.PreTrainedTokenizerFast.from_pretrained(path)
    processor = tf.LlavaProcessor(image_processor=tf.CLIPImageProcessorPil(**_processor_kwargs()),
                                  tokenizer=tokenizer, patch_size=14,
                                  vision_feature_select_strategy="default",
                                  chat_template=LLAVA_TEMPLATE, image_token="<image>",
                                  num_additional_image_tokens=1)  # the class token
    processor.save_pretrained(path)
    return path, model, processor


@pytest.fixture(scope="module")
def llm(llava):
    """Chunks of 32 tokens (so images are split across steps), pages of 4 tokens."""
    return LLM(model=str(llava[0]), dtype="float32", max_num_seqs=4,
               max_num_batched_tokens=32, page_size=4, num_pages=160, max_model_len=128)


def _image(seed: int, h: int, w: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8))


def _hf_greedy(llava, ids: list[int], images: list[Image.Image], n: int) -> list[int]:
    """transformers' greedy tokens for a prompt with its image tokens expanded."""
    import torch

    _, model, processor = llava
    kwargs = {}
    if images:
        pixels = processor.image_processor(images=images, return_tensors="np")["pixel_values"]
        kwargs["pixel_values"] = torch.tensor(pixels)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             pad_token_id=1, **kwargs)
    return out[0, len(ids):].tolist()


def _expanded(prompt: list[int]) -> list[int]:
    return [t for x in prompt for t in ([x] * TOKENS_PER_IMAGE if x == IMAGE_TOKEN else [x])]


GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def test_image_processor_matches_transformers():
    from transformers import CLIPImageProcessorPil

    from jaxserve.loading.image_processor import ClipImageProcessor

    rng = np.random.default_rng(0)
    for h, w, mode in [(70, 90, "RGB"), (120, 40, "RGBA"), (30, 30, "L"), (20, 100, "P"),
                       (336, 500, "RGB")]:
        channels = 4 if mode == "RGBA" else 3
        image = Image.fromarray((rng.random((h, w, channels)) * 255).astype(np.uint8))
        image = image.convert(mode)
        for kwargs in (_processor_kwargs(), dict(size={"shortest_edge": 64},
                                                 crop_size={"height": 40, "width": 48})):
            want = CLIPImageProcessorPil(**kwargs)(images=[image],
                                                   return_tensors="np")["pixel_values"][0]
            got = ClipImageProcessor.from_config(kwargs)(image)
            np.testing.assert_array_equal(got, want)


def test_vision_tower_matches_transformers(llava):
    import jax
    import jax.numpy as jnp
    import torch

    from jaxserve.config import ModelConfig
    from jaxserve.loading.safetensors import checkpoint_tensors
    from jaxserve.loading.vision import VisionTensors
    from jaxserve.models.vision.llava import embed_images

    path, model, _ = llava
    cfg = ModelConfig.from_file(path)
    assert cfg.vision.tokens_per_image == TOKENS_PER_IMAGE and cfg.vision.layers_used == 2
    split = VisionTensors(cfg.vision)
    names = [name for name, _ in split.text(checkpoint_tensors(path))]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    params = split.params(jnp.float32, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    pixels = np.random.default_rng(0).standard_normal((2, 3, 56, 56)).astype(np.float32)
    with torch.no_grad():
        want = model.model.get_image_features(torch.tensor(pixels))
    want = getattr(want, "pooler_output", want)
    want = np.stack([np.asarray(x) for x in want]).reshape(2, TOKENS_PER_IMAGE, -1)
    got = np.asarray(embed_images(params, jnp.asarray(pixels), cfg.vision))
    assert np.abs(want).max() > 0.1  # the features are not vanishingly small
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_requests_with_images_match_transformers(llm, llava):
    """One image, two images of different sizes, text only and another image, batched
    together in 32-token chunks: each request's greedy tokens are transformers'."""
    a, b, c = _image(1, 80, 60), _image(2, 50, 90), _image(3, 120, 120)
    cases = [([0, 40, 41, IMAGE_TOKEN, 42, 43], [a]),
             ([0, 50, IMAGE_TOKEN, 51, 52, IMAGE_TOKEN, 53], [b, c]),
             ([0, 60, 61, 62, 63, 64, 65], []),
             ([0, IMAGE_TOKEN, 70, 71], [c])]
    prompts = [{"prompt_token_ids": p, "multi_modal_data": {"image": imgs}}
               for p, imgs in cases]
    outs = llm.generate(prompts, GREEDY)
    for (prompt, images), out in zip(cases, outs):
        assert out.prompt_token_ids == _expanded(prompt)
        assert out.outputs[0].token_ids == _hf_greedy(llava, _expanded(prompt), images, 10)
    # The image matters: the same prompt with another image continues otherwise.
    other = llm.generate({"prompt_token_ids": cases[0][0], "multi_modal_data": {"image": b}},
                         GREEDY)[0]
    assert other.outputs[0].token_ids != outs[0].outputs[0].token_ids
    assert other.outputs[0].token_ids == _hf_greedy(llava, _expanded(cases[0][0]), [b], 10)


def test_logprobs_match_transformers(llm, llava):
    """Every generated position's top-5 logprobs are transformers' (float32; 2e-4)."""
    import torch

    _, model, processor = llava
    image = _image(4, 64, 64)
    prompt = [0, 33, IMAGE_TOKEN, 34, 35]
    out = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": image}},
                       SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                      logprobs=5))[0].outputs[0]
    ids = _expanded(prompt) + out.token_ids
    pixels = torch.tensor(processor.image_processor(images=[image],
                                                    return_tensors="np")["pixel_values"])
    with torch.no_grad():
        logits = model(torch.tensor([ids]), pixel_values=pixels).logits[0].float()
    want = torch.log_softmax(logits, -1)[len(ids) - 5:len(ids) - 1].numpy()
    for position, got in zip(want, out.logprobs):
        top = np.argsort(-position)[:5]
        assert [t for t in got if got[t].rank is not None and got[t].rank <= 5] == top.tolist()
        np.testing.assert_allclose([got[t].logprob for t in top], position[top], atol=2e-4)


def test_embeddings_with_an_image_match_transformers(llm, llava):
    """An image prompt's last-token embedding (LLM.embed): transformers' last hidden state
    of the language model over the prompt with the image's features in place."""
    import torch

    _, model, processor = llava
    image = _image(5, 64, 64)
    prompt = [0, 33, IMAGE_TOKEN, 34, 35]
    got = llm.embed({"prompt_token_ids": prompt,
                     "multi_modal_data": {"image": image}})[0].outputs.embedding
    pixels = torch.tensor(processor.image_processor(images=[image],
                                                    return_tensors="np")["pixel_values"])
    with torch.no_grad():
        h = model.model(input_ids=torch.tensor([_expanded(prompt)]),
                        pixel_values=pixels).last_hidden_state[0, -1].numpy()
    np.testing.assert_allclose(got, h / np.linalg.norm(h), atol=2e-5)


def test_repeated_image_hits_the_prefix_and_encoder_caches(llm, llava):
    engine = llm.engine
    image = _image(5, 70, 70)
    prompt = [0] + [80 + i for i in range(12)] + [IMAGE_TOKEN, 81, 82, 83]
    first = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": image}},
                         GREEDY)[0]
    before = engine.status().images
    again = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": image}},
                         GREEDY)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # Pages over the image are cached: all but the last page's tokens come from the cache.
    assert again.num_cached_tokens >= 12 + TOKENS_PER_IMAGE
    # Its last token (position 28, past the 7 whole cached pages) read the image's
    # embeddings from the encoder cache: the tower did not run again.
    assert engine.status().images.images_encoded == before.images_encoded
    # The same image after other text: no prefix hit past the text, the encoder's output
    # is found in its cache (not encoded again), and the tokens are still transformers'.
    before = engine.status().images
    moved = [0, 90, 91, IMAGE_TOKEN, 81, 82, 83]
    out = llm.generate({"prompt_token_ids": moved, "multi_modal_data": {"image": image}},
                       GREEDY)[0]
    after = engine.status().images
    assert after.images_encoded == before.images_encoded
    assert after.encoder_cache_hits == before.encoder_cache_hits + 1
    assert out.outputs[0].token_ids == _hf_greedy(llava, _expanded(moved), [image], 10)
    # Another image in the same place is no prefix hit over the image's pages.
    other = llm.generate({"prompt_token_ids": prompt,
                          "multi_modal_data": {"image": _image(6, 70, 70)}}, GREEDY)[0]
    assert other.num_cached_tokens <= 12
    assert engine.status().images.images_encoded == after.images_encoded + 1


def test_chat_with_image_parts_matches_the_processor(llm, llava):
    """LLM.chat with a base64 PNG: the prompt is the HF processor's, tokens transformers'."""
    _, _, processor = llava
    image = _image(7, 90, 50)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is it?"}]}]
    out = llm.chat(messages, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    hf_messages = [{"role": "user", "content": [{"type": "image"},
                                                {"type": "text", "text": "What is it?"}]}]
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True)
    want = processor(text=text, images=[image], return_tensors="np",
                     add_special_tokens=False)["input_ids"][0].tolist()
    assert out.prompt_token_ids == want
    assert out.outputs[0].token_ids == _hf_greedy(llava, want, [image], 6)


def test_bad_images_fail_alone(llm):
    engine = llm.engine
    bad = [(b"not an image", "image 0 is not an image file"),
           (np.zeros((4, 4), np.float32), "uint8"),
           ("a string", "must be a PIL image")]
    for image, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", [0, IMAGE_TOKEN, 5], GREEDY, images=[image])
    with pytest.raises(ValueError, match="1 image placeholder"):
        engine.add_request("bad", [0, IMAGE_TOKEN, 5], GREEDY,
                           images=[_image(1, 9, 9), _image(2, 9, 9)])
    with pytest.raises(ValueError, match="at most"):
        from jaxserve.engine.multimodal.inputs import open_image
        open_image(_image(1, 9, 9), max_pixels=80)
    with pytest.raises(ValueError, match="not an image"):
        llm.chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}]}])
    with pytest.raises(ValueError, match="not allowed"):
        llm.chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}])
    assert not engine.has_unfinished() and engine.scheduler.num_used_pages == 0 or \
        engine.scheduler.num_waiting == 0
    good = llm.generate({"prompt_token_ids": [0, IMAGE_TOKEN, 5],
                         "multi_modal_data": {"image": _image(1, 9, 9)}}, GREEDY)[0]
    assert len(good.outputs[0].token_ids) == 10


def test_no_compile_after_warmup(llm):
    """Everything above (images of many sizes, chunks, text) ran the programs compiled at
    warm-up."""
    assert llm.engine.runner.compiles_after_warmup == 0
    assert llm.engine.images.encoder.compiles_after_warmup == 0


@pytest.mark.slow  # an engine (or a server) of its own
def test_preemption_with_images(llava):
    """A pool too small for all four requests at once: preempted requests recompute their
    images' tokens (the encoder cache or the tower again) and still match."""
    llm = LLM(model=str(llava[0]), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
              page_size=4, num_pages=32, max_model_len=64, enable_prefix_caching=False)
    cases = [([0, 40 + i, IMAGE_TOKEN, 41 + i], [_image(10 + i, 60 + 7 * i, 60)])
             for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p, "multi_modal_data": {"image": imgs}}
                         for p, imgs in cases], params)
    assert llm.engine.scheduler.num_preemptions > 0
    for (prompt, images), out in zip(cases, outs):
        assert out.outputs[0].token_ids == _hf_greedy(llava, _expanded(prompt), images, 24)
    assert llm.engine.scheduler.num_used_pages == 0
    assert llm.engine.images.cache.num_used_slots <= 4 * TOKENS_PER_IMAGE


def test_processor_files_are_read(llava):
    """The saved processor's files are what the loader reads (a guard on the fixture)."""
    path = llava[0]
    config = json.loads((path / "processor_config.json").read_text())["image_processor"]
    assert config["crop_size"] == {"height": 56, "width": 56}
    assert (path / "chat_template.jinja").exists()


@pytest.mark.slow  # an engine (or a server) of its own
def test_openai_client_against_jaxserve_serve(llava, llm, tmp_path):
    """The `openai` package sends base64 images to `jaxserve serve`: the answer is the
    offline engine's (streamed or not), usage counts the image's tokens, /metrics counts
    the images; each bad image is a 400 naming it, and the server goes on. gRPC carries
    image bytes (a chat's parts, or a token prompt's images): the same tokens."""
    import grpc
    import httpx
    import openai

    from server.client import Client
    from serverproc import running_server

    image = _image(8, 64, 48)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG")
    url = "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {"url": url}}]}]
    want = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    with running_server(llava[0], tmp_path / "server.log", "--limit-mm-per-prompt",
                        '{"image": 1}') as (target, proc):
        client = openai.OpenAI(base_url=proc.http_url + "/v1", api_key="none", max_retries=0)
        model = str(llava[0])
        params = dict(model=model, messages=messages, max_tokens=8, temperature=0,
                      extra_body={"ignore_eos": True})
        got = client.chat.completions.create(**params)
        assert got.choices[0].message.content == want.outputs[0].text
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        stream = client.chat.completions.create(**params, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
            want.outputs[0].text
        png = io.BytesIO()
        Image.new("RGB", (20000, 20000)).save(png, format="PNG")  # 400 MP: a bomb
        bomb = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
        bad = {"not an image": "data:image/png;base64," + base64.b64encode(b"junk").decode(),
               "media type is 'text/plain'": "data:text/plain;base64,aGk=",
               "not valid base64": "data:image/png;base64,@@@",
               "pixels; at most": bomb,
               "not allowed": "https://example.com/cat.png",
               "local image files": "file:///etc/passwd"}
        for message, bad_url in bad.items():
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(**{**params, "messages": [{"role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": bad_url}}]}]})
            assert message in str(e.value) and "content[0]" in str(e.value)
        with pytest.raises(openai.BadRequestError, match="at most 1"):
            client.chat.completions.create(**{**params, "messages": [{"role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}] * 2}]})
        again = client.chat.completions.create(**params)
        assert again.choices[0].message.content == want.outputs[0].text
        grpc_client = Client(target)
        sampling = dict(max_tokens=8, temperature=0, ignore_eos=True)
        chat = [{"role": "user", "content": [{"type": "text", "text": "Describe"},
                                             {"type": "image", "image": buffer.getvalue()}]}]
        assert grpc_client.complete(chat, **sampling)[0] == want.outputs[0].token_ids
        assert grpc_client.complete(want.prompt_token_ids, images=[buffer.getvalue()],
                                    **sampling)[0] == want.outputs[0].token_ids
        with pytest.raises(grpc.RpcError) as e:
            grpc_client.complete(want.prompt_token_ids, images=[b"junk"], **sampling)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "image 0 is not an image file" in e.value.details()
        grpc_client.close()
        metrics = {line.split("{")[0]: float(line.split()[-1])
                   for line in httpx.get(proc.http_url + "/metrics").text.splitlines()
                   if line and not line.startswith("#")}
        # Four requests with the image, encoded once: the later ones found every page
        # covering it in the prefix cache, so neither the tower nor its cache was needed.
        assert metrics["jaxserve:mm_images_encoded_total"] == 1.0
        assert metrics["jaxserve:mm_encoder_cache_hits_total"] == 0.0


@pytest.mark.slow
def test_prefill_and_decode_servers_with_an_image(llava, llm, tmp_path):
    """Through `jaxserve router`, a chat with a base64 image: the prefill server runs the
    tower, the decode server places the image and decodes the offline engine's text
    without encoding it. A decode request with another image than the one its K/V were
    computed from is refused, naming the images."""
    import httpx
    import openai

    from serverproc import running_router, running_server

    def data_url(image):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()

    def chat(image):
        return [{"role": "user", "content": [{"type": "text", "text": "Describe"}, {
            "type": "image_url", "image_url": {"url": data_url(image)}}]}]

    image, other = _image(8, 64, 48), _image(9, 64, 48)  # the same number of tokens
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = llm.chat(chat(image), params)[0]
    assert llm.chat(chat(other), params)[0].outputs[0].text != want.outputs[0].text
    with running_server(llava[0], tmp_path / "prefill.log", "--kv-transfer-config",
                        '{"kv_role": "kv_producer"}') as (_, prefill), \
            running_server(llava[0], tmp_path / "decode.log", "--kv-transfer-config",
                           '{"kv_role": "kv_consumer"}') as (_, decode), \
            running_router([prefill.http_url], [decode.http_url],
                           tmp_path / "router.log") as router:
        client = openai.OpenAI(base_url=router + "/v1", api_key="none", max_retries=0)
        body = dict(model=str(llava[0]), max_tokens=8, temperature=0,
                    extra_body={"ignore_eos": True})
        got = client.chat.completions.create(messages=chat(image), **body)
        assert got.choices[0].message.content == want.outputs[0].text
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)

        def encoded(url):
            text = httpx.get(url + "/metrics").text
            return float(next(line.split()[-1] for line in text.splitlines()
                              if line.startswith("jaxserve:mm_images_encoded_total")))

        assert (encoded(prefill.http_url), encoded(decode.http_url)) == (1.0, 0.0)
        request = {"model": str(llava[0]), "max_tokens": 8, "temperature": 0,
                   "ignore_eos": True}
        kv = httpx.post(prefill.http_url + "/v1/chat/completions", timeout=60, json={
            **request, "messages": chat(other),
            "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
        r = httpx.post(decode.http_url + "/v1/chat/completions", timeout=60, json={
            **request, "messages": chat(image),
            "kv_transfer_params": {**kv, "do_remote_prefill": True}})
        assert r.status_code == 400 and "images differ" in r.json()["error"]["message"]


# ------------------------------------------------------------------- Qwen2.5-VL

VISION_START, IMAGE_PAD, VISION_END = 259, 260, 261
QWEN_PIXELS = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 40)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(directory, torch model, HF image processor): a random tiny Qwen2.5-VL (a ViT of 3
    layers, windows of 2 x 2 merged tokens, layer 1 over the whole image; M-RoPE sections
    2/3/3 of a 16-wide head) saved by transformers with its image processor."""
    import torch
    import transformers as tf
    from tokenizers import AddedToken, Tokenizer

    from jaxserve.demo import write_byte_tokenizer

    path = tmp_path_factory.mktemp("qwen2_5_vl")
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4,
                  out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                  initializer_range=0.2)
    text = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2, 3, 3]},
                initializer_range=0.1, bos_token_id=0, eos_token_id=1)
    cfg = tf.Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_PAD,
                              video_token_id=262, vision_start_token_id=VISION_START,
                              vision_end_token_id=VISION_END)
    torch.manual_seed(0)
    model = tf.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    model.save_pretrained(path)
    write_byte_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (
        "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")])
    tok.save(str(path / "tokenizer.json"))
    processor = tf.Qwen2VLImageProcessorPil(**QWEN_PIXELS)
    processor.save_pretrained(path)
    return path, model, processor


@pytest.fixture(scope="module")
def qwen_llm(qwen):
    """Up to 4 decode steps per program: M-RoPE's offsets ride along the device's steps."""
    return LLM(model=str(qwen[0]), dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
               page_size=4, num_pages=192, max_model_len=160, num_scheduler_steps=4)


def _qwen_prompt(text_before: list[int], n_images: int, after: list[int]) -> list[int]:
    image = [VISION_START, IMAGE_PAD, VISION_END]
    return [0, *text_before, *image * n_images, *after]


def _qwen_expanded(qwen, prompt: list[int], images) -> tuple[list[int], dict]:
    """The prompt as Qwen2.5-VL's processor writes it (each <|image_pad|> repeated for its
    image's merged tokens) and the model's image inputs (transformers' own processor)."""
    import torch

    if not images:
        return prompt, {}
    out = qwen[2](images=images, return_tensors="pt")
    counts = iter((out["image_grid_thw"].prod(-1) // 4).tolist())
    ids = [t for x in prompt for t in ([x] * next(counts) if x == IMAGE_PAD else [x])]
    mm = torch.tensor([[int(t == IMAGE_PAD) for t in ids]])
    return ids, dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                     mm_token_type_ids=mm)


def _qwen_greedy(qwen, prompt: list[int], images, n: int) -> list[int]:
    import torch

    ids, kwargs = _qwen_expanded(qwen, prompt, images)
    with torch.no_grad():
        out = qwen[1].generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                               attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               pad_token_id=1, **kwargs)
    return out[0, len(ids):].tolist()


def test_qwen_image_processor_matches_transformers():
    from transformers import Qwen2VLImageProcessorPil

    from jaxserve.loading.image_processor import QwenImageProcessor

    rng = np.random.default_rng(0)
    for h, w in [(70, 90), (120, 40), (30, 30), (300, 500), (57, 200)]:
        image = Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8))
        want = Qwen2VLImageProcessorPil(**QWEN_PIXELS)(images=[image], return_tensors="np")
        patches, grid = QwenImageProcessor(**QWEN_PIXELS)(image)
        assert [1, *grid] == want["image_grid_thw"][0].tolist()
        np.testing.assert_array_equal(patches, want["pixel_values"])


def test_qwen_vision_tower_and_rope_index_match_transformers(qwen):
    """The ViT (windows laid out by the host, padded to a bucket) on images of several
    grids, and M-RoPE's positions of a prompt with two images."""
    import jax
    import jax.numpy as jnp
    import torch

    from jaxserve.config import ModelConfig
    from jaxserve.loading.safetensors import checkpoint_tensors
    from jaxserve.loading.vision import VisionTensors
    from jaxserve.models.vision import qwen2_5_vl

    path, model, _ = qwen
    cfg = ModelConfig.from_file(path)
    assert cfg.mrope_section == (2, 3, 3) and cfg.vision.window_patches == 16
    split = VisionTensors(cfg.vision)
    list(split.text(checkpoint_tensors(path)))
    params = split.params(jnp.float32, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    rng = np.random.default_rng(0)
    for gh, gw in [(4, 4), (6, 10), (12, 8), (2, 14)]:
        patches = rng.standard_normal((gh * gw, cfg.vision.patch_dim)).astype(np.float32)
        with torch.no_grad():
            want = model.model.visual(torch.tensor(patches),
                                      grid_thw=torch.tensor([[1, gh, gw]])).pooler_output.numpy()
        lay = qwen2_5_vl.layout(gh, gw, cfg.vision)
        lay = qwen2_5_vl.layout(gh, gw, cfg.vision, lay.num_windows(cfg.vision) + 3)  # padded
        x = np.where(lay.valid[:, None], patches[np.maximum(lay.patch, 0)], 0)
        out = np.asarray(qwen2_5_vl.embed_image(params, jnp.asarray(x),
                                                jnp.asarray(lay.positions),
                                                jnp.asarray(lay.valid), cfg.vision))
        got = np.zeros_like(want)
        got[lay.token[lay.token >= 0]] = out[lay.token >= 0]
        assert sorted(lay.token[lay.token >= 0]) == list(range(len(want)))
        assert np.abs(want).max() > 1.0
        # float32 through 3 layers and the merger, outputs up to ~6: 2e-6 of the largest.
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    images = [_image(1, 80, 60), _image(2, 50, 150)]
    ids, kwargs = _qwen_expanded(qwen, _qwen_prompt([40], 2, [41, 42]), images)
    want, delta = model.model.get_rope_index(
        torch.tensor([ids]), kwargs["mm_token_type_ids"], kwargs["image_grid_thw"])
    starts = [i for i, t in enumerate(ids) if t == IMAGE_PAD and ids[i - 1] == VISION_START]
    grids = [tuple(g[1:]) for g in kwargs["image_grid_thw"].tolist()]
    offsets, got_delta = qwen2_5_vl.rope_offsets(len(ids), list(zip(starts, grids)), cfg.vision)
    np.testing.assert_array_equal(offsets + np.arange(len(ids)), want[:, 0].numpy())
    assert got_delta == int(delta)


def test_qwen_requests_match_transformers(qwen, qwen_llm):
    """Images of different sizes (one and two per prompt), text only, batched in 32-token
    chunks; a repeated image hits the prefix cache; another image changes the tokens; no
    program compiles after warm-up."""
    a, b, c = _image(1, 80, 60), _image(2, 50, 150), _image(3, 120, 120)
    cases = [(_qwen_prompt([40], 2, [41, 42]), [a, b]),
             (_qwen_prompt([50, 51], 1, [52]), [c]),
             (_qwen_prompt([60, 61, 62, 63], 0, [64]), []),
             (_qwen_prompt([], 1, [70, 71, 72]), [b])]
    outs = qwen_llm.generate([{"prompt_token_ids": p, "multi_modal_data": {"image": imgs}}
                              for p, imgs in cases], GREEDY)
    for (prompt, images), out in zip(cases, outs):
        assert out.prompt_token_ids == _qwen_expanded(qwen, prompt, images)[0]
        assert out.outputs[0].token_ids == _qwen_greedy(qwen, prompt, images, 10)
    again = qwen_llm.generate({"prompt_token_ids": cases[0][0],
                               "multi_modal_data": {"image": [a, b]}}, GREEDY)[0]
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert again.num_cached_tokens > len(again.prompt_token_ids) - 8
    other = qwen_llm.generate({"prompt_token_ids": cases[1][0],
                               "multi_modal_data": {"image": [a]}}, GREEDY)[0]
    assert other.outputs[0].token_ids != outs[1].outputs[0].token_ids
    assert other.outputs[0].token_ids == _qwen_greedy(qwen, cases[1][0], [a], 10)
    engine = qwen_llm.engine
    assert engine.num_multi_steps > 0
    # 40 merged tokens at most: 20 windows for a 1 x 40 image (the widest), 32 a bucket.
    assert engine.images.encoder.buckets == [1, 2, 4, 8, 16, 32]
    assert engine.runner.compiles_after_warmup == 0
    assert engine.images.encoder.compiles_after_warmup == 0


@pytest.mark.slow  # ~40 s
def test_qwen_prefill_and_decode_engines(qwen):
    """Prefill/decode disaggregation with images: the prefill engine runs the tower and
    computes the prompts' K/V, the decode engine places the same images (M-RoPE's
    positions after them) and decodes transformers' tokens without encoding them. With a
    decode pool that holds any one request but no two (24 pages of 4 tokens; each needs
    16-18 by its end) and no prefix cache there, preempted requests recompute their
    images through the decode engine's own tower."""
    a, b, c = _image(1, 80, 60), _image(2, 50, 150), _image(3, 120, 120)
    cases = [(_qwen_prompt([40], 2, [41, 42]), [a, b]),
             (_qwen_prompt([50, 51], 1, [52]), [c]),
             (_qwen_prompt([], 1, [70, 71, 72]), [b]),
             (_qwen_prompt([60, 61, 62, 63], 0, [64]), [])]
    engine = dict(model=str(qwen[0]), dtype="float32", max_num_seqs=4,
                  max_num_batched_tokens=32, page_size=4, max_model_len=96,
                  num_scheduler_steps=4)
    for batch, new, decode, preempts in (
            (cases, 24, {"num_pages": 192}, False),
            (cases[:3], 48, {"num_pages": 24, "enable_prefix_caching": False}, True)):
        llm = LLM(prefill={"num_pages": 192}, decode=decode, **engine)
        outs = llm.generate([{"prompt_token_ids": p, "multi_modal_data": {"image": imgs}}
                             for p, imgs in batch],
                            SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
        for (prompt, images), out in zip(batch, outs):
            want = _qwen_greedy(qwen, prompt, images, new)
            # (transformers stops at an EOS; the engine, ignoring it, goes on)
            assert out.outputs[0].token_ids[:len(want)] == want
        pd = llm.engine
        assert pd.num_handoffs == len(batch) and pd.prefill.images.cache.num_encoded == 3
        assert (pd.decode.scheduler.num_preemptions > 0) == preempts
        assert (pd.decode.images.cache.num_encoded > 0) == preempts
        for side in (pd.prefill, pd.decode):
            assert side.status().num_used_pages == 0


@pytest.mark.parametrize("method", ["ngram", pytest.param("draft_model",
                                                          marks=pytest.mark.slow)])  # ~60 s
def test_qwen_requests_speculate(qwen, checkpoints, method):
    """n-gram drafts, or a text model's (a Qwen2 of the same vocabulary, which sees the
    images' placeholders as tokens), verified on requests with images: the draft tokens'
    M-RoPE positions follow the images (a wrong offset changes the greedy tokens);
    transformers' tokens."""
    spec = {"method": method, "num_speculative_tokens": 3, "disable_by_batch_size": None}
    if method == "draft_model":
        spec["model"] = str(checkpoints("qwen2")[0])
    llm = LLM(model=str(qwen[0]), dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
              page_size=4, num_pages=192, max_model_len=160, speculative_config=spec)
    a, b = _image(1, 80, 60), _image(2, 50, 150)
    cases = [(_qwen_prompt([40], 2, [41, 42]), [a, b]), (_qwen_prompt([50, 51], 1, [52]), [b]),
             (_qwen_prompt([60, 61, 62], 0, [64]), [])]
    outs = llm.generate([{"prompt_token_ids": p, "multi_modal_data": {"image": imgs}}
                         for p, imgs in cases], SamplingParams(max_tokens=24, temperature=0,
                                                                 ignore_eos=True))
    for (prompt, images), out in zip(cases, outs):
        want = _qwen_greedy(qwen, prompt, images, 24)
        assert out.outputs[0].token_ids[:len(want)] == want  # (transformers stops at EOS)
    stats = llm.engine.speculator.stats
    assert stats.num_proposed > 0  # (the random draft's guesses are all rejected)
    assert stats.num_accepted > 0 or method == "draft_model"
    assert llm.engine.scheduler.num_used_pages == 0
    assert llm.engine.runner.compiles_after_warmup == 0


def test_vision_parameter_counts_match_transformers(llava, qwen):
    """`jaxserve plan` counts the image side: LLaVA's tower up to its feature layer and
    its projector, Qwen2.5-VL's whole ViT and merger, as transformers holds them."""
    from jaxserve.config import ModelConfig

    llava_cfg = ModelConfig.from_file(llava[0]).vision
    used = [f"layers.{i}." for i in range(llava_cfg.layers_used)]
    want = sum(v.numel() for k, v in llava[1].state_dict().items()
               if ("vision_tower" in k and "post_layernorm" not in k
                   and ("layers." not in k or any(u in k for u in used)))
               or "multi_modal_projector" in k)
    assert llava_cfg.num_params() == want
    qwen_cfg = ModelConfig.from_file(qwen[0]).vision
    assert qwen_cfg.num_params() == sum(v.numel() for k, v in qwen[1].state_dict().items()
                                        if "visual." in k)


# ----------------------------------------------------------------------- Gemma 3

BOI, EOI, SOFT = 259, 260, 261
GEMMA_SOFT_TOKENS = 4


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(directory, torch model, HF image processor): a random tiny Gemma 3 (a SigLIP tower of
    2 layers at 56 px, pooled to 4 soft tokens; Gemma 3 text with a sliding layer of
    window 8 and a global one) saved by transformers with its image processor. The
    projector's weights are drawn larger than transformers' init (zeros and ones) so that
    images move the logits."""
    import torch
    import transformers as tf
    from tokenizers import AddedToken, Tokenizer

    from jaxserve.demo import write_byte_tokenizer

    path = tmp_path_factory.mktemp("gemma3")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=56, patch_size=14, vision_use_head=False)
    text = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
                initializer_range=0.3)
    cfg = tf.Gemma3Config(vision_config=vision, text_config=text,
                          mm_tokens_per_image=GEMMA_SOFT_TOKENS, boi_token_index=BOI,
                          eoi_token_index=EOI, image_token_index=SOFT, initializer_range=0.2)
    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.model.multi_modal_projector.mm_soft_emb_norm.weight.normal_()
        model.model.multi_modal_projector.mm_input_projection_weight.normal_()
    model.save_pretrained(path)
    write_byte_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (
        "<start_of_image>", "<end_of_image>", "<image_soft_token>")])
    tok.save(str(path / "tokenizer.json"))
    processor = tf.Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
    processor.save_pretrained(path)
    return path, model, processor


def _gemma_logprobs(gemma, ids: list[int], images, whole: bool = True):
    """transformers' last-position log-probabilities (`whole` False: image tokens
    attending causally, as if the bidirectional mask were missing)."""
    import torch

    _, model, processor = gemma
    kwargs = {}
    if images:
        kwargs["pixel_values"] = processor(images=images, return_tensors="pt")["pixel_values"]
        kwargs["token_type_ids"] = torch.tensor([[int(whole and t == SOFT) for t in ids]])
    with torch.no_grad():
        logits = model(torch.tensor([ids]), **kwargs).logits[0, -1]
    return torch.log_softmax(logits.float(), -1).numpy()


def test_gemma3_processor_and_tower_match_transformers(gemma):
    import jax
    import jax.numpy as jnp
    import torch

    from jaxserve.config import ModelConfig
    from jaxserve.loading.image_processor import load_image_processor
    from jaxserve.loading.safetensors import checkpoint_tensors
    from jaxserve.loading.vision import VisionTensors
    from jaxserve.models.vision.gemma3 import embed_images

    path, model, processor = gemma
    ours = load_image_processor(path, 56)
    rng = np.random.default_rng(0)
    for h, w, mode in [(80, 60, "RGB"), (50, 150, "RGBA"), (56, 56, "L")]:
        image = Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).convert(mode)
        want = processor(images=[image], return_tensors="np")["pixel_values"][0]
        np.testing.assert_array_equal(ours(image), want)
    cfg = ModelConfig.from_file(path)
    assert cfg.vision.pool == 2 and cfg.tie_word_embeddings
    split = VisionTensors(cfg.vision)
    list(split.text(checkpoint_tensors(path)))
    params = split.params(jnp.float32, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    pixels = rng.standard_normal((2, 3, 56, 56)).astype(np.float32)
    with torch.no_grad():
        want = model.model.get_image_features(torch.tensor(pixels))
    want = getattr(want, "pooler_output", want)
    want = np.stack([np.asarray(x) for x in want]).reshape(2, GEMMA_SOFT_TOKENS, -1)
    got = np.asarray(embed_images(params, jnp.asarray(pixels), cfg.vision))
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("gpu", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["", "gpu-kernel-branch-free"])
def test_gemma3_requests_see_images_whole(gemma, gpu, monkeypatch):
    """A text prompt with two <start_of_image> markers (written out as Gemma 3's processor
    does), in 8-token chunks that would otherwise end inside an image, batched with a text
    request: the first token's log-probabilities are transformers' with the image tokens
    attending to each other (and measurably not its causal-only ones), greedy tokens too.
    `gpu`: as a GPU runs it (interpreted here), the GPU attention kernel taking the images
    itself and the programs branch-free."""
    from jaxserve.engine import runner as runner_module

    path = gemma[0]
    if gpu:
        monkeypatch.setattr(runner_module, "branch_free", lambda: True)
    llm = LLM(model=str(path), dtype="float32", max_num_seqs=4, max_num_batched_tokens=8,
              page_size=4, num_pages=96, max_model_len=128,
              **(dict(kernel_impl="gpu", interpret_kernels=True) if gpu else {}))
    images = [_image(1, 80, 60), _image(2, 50, 150)]
    text = "ab<start_of_image>cd<start_of_image>e"
    image_text = ("\n\n<start_of_image>" + "<image_soft_token>" * GEMMA_SOFT_TOKENS
                  + "<end_of_image>\n\n")
    want_ids = llm.get_tokenizer().encode(text.replace("<start_of_image>", image_text))
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}},
                         "plain text, no image"], params)
    out = outs[0]
    assert out.prompt_token_ids == want_ids
    want = _gemma_logprobs(gemma, want_ids, images)
    causal = _gemma_logprobs(gemma, want_ids, images, whole=False)
    got = out.outputs[0].logprobs[0]
    top = np.argsort(-want)[:5]
    assert [t for t in got if got[t].rank is not None] == top.tolist()
    errors = [abs(got[t].logprob - want[t]) for t in top]
    assert max(errors) < 1e-4
    assert np.abs(causal - want)[top].max() > 100 * max(errors)  # the mask matters here
    text_out = outs[1].outputs[0].logprobs[0]
    text_want = _gemma_logprobs(gemma, outs[1].prompt_token_ids, [])
    assert max(abs(e.logprob - text_want[t]) for t, e in text_out.items()
               if e.rank is not None) < 1e-4
    assert llm.engine.runner.compiles_after_warmup == 0
    if gpu:  # traced as a GPU compiles them: no program holds a branch on the device
        from device_branches import gpu_programs

        found = gpu_programs(monkeypatch, True, model=str(path), dtype="float32",
                             max_num_seqs=4, max_num_batched_tokens=8, page_size=4,
                             num_pages=96, max_model_len=128)
        assert found and not sum(found.values(), collections.Counter()), found


# ------------------------------------------- with quantized weights, with grammars


def test_image_request_with_a_json_schema(llm):
    """Structured output with an image: every output parses and keeps to the schema (the
    `jsonschema` package's check), and the image still changes the answer."""
    import jsonschema

    from jaxserve.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    params = SamplingParams(max_tokens=60, temperature=0,
                            structured_outputs=StructuredOutputsParams(json=schema))
    texts = []
    for seed in (11, 12):
        out = llm.generate({"prompt_token_ids": [0, 40, IMAGE_TOKEN, 41],
                            "multi_modal_data": {"image": _image(seed, 60, 60)}}, params)[0]
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
        texts.append(out.outputs[0].text)
    assert texts[0] != texts[1]


@pytest.mark.slow  # an engine (or a server) of its own
def test_image_requests_with_int8_weights(llava):
    """The language model's linear layers quantized to int8 at load (the tower stays
    float): greedy tokens equal transformers' on the same weights rounded the same way
    (per output channel, symmetric: w = round(w / s) * s, s = max|w| / 127)."""
    import copy

    import torch

    path, model, processor = llava
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if "language_model" in name and name.endswith("proj.weight"):
                scale = p.abs().amax(dim=1, keepdim=True) / 127  # [out, 1]: per channel
                p.copy_(torch.round(p / scale) * scale)
    llm = LLM(model=str(path), dtype="float32", quantization="int8", max_num_seqs=4,
              max_num_batched_tokens=32, page_size=4, num_pages=96, max_model_len=96)
    cases = [([0, 40, 41, IMAGE_TOKEN, 42, 43], [_image(1, 80, 60)]),
             ([0, IMAGE_TOKEN, 50, IMAGE_TOKEN, 51], [_image(2, 50, 90), _image(3, 70, 70)])]
    outs = llm.generate([{"prompt_token_ids": p, "multi_modal_data": {"image": i}}
                         for p, i in cases], GREEDY)
    for (prompt, images), out in zip(cases, outs):
        assert out.outputs[0].token_ids == _hf_greedy((path, rounded, processor),
                                                      _expanded(prompt), images, 10)


def test_hub_and_module_layouts_load_alike(llava, tmp_path):
    """The hub's tensor names (`language_model.model.*`, `vision_tower.vision_model.*`) and
    transformers' module names (`model.language_model.*`, `model.vision_tower.*`,
    `model.multi_modal_projector.*`, top-level `lm_head`) give the same model."""
    import shutil

    import jax
    import jax.numpy as jnp
    from safetensors.numpy import load_file, save_file

    from jaxserve.config import ModelConfig
    from jaxserve.loading.safetensors import checkpoint_tensors
    from jaxserve.loading.vision import VisionTensors

    path = llava[0]
    saved = load_file(str(path / "model.safetensors"))
    assert any(k.startswith("vision_tower.encoder.") for k in saved)  # transformers 5's

    def hub(name: str) -> str:
        return name.replace("vision_tower.", "vision_tower.vision_model.", 1)

    def module(name: str) -> str:
        if name.startswith("language_model.lm_head"):
            return name[len("language_model."):]
        return "model." + name.replace("language_model.model.", "language_model.", 1)

    cfg = ModelConfig.from_file(path)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    results = []
    for label, rename in (("saved", lambda n: n), ("hub", hub), ("module", module)):
        out = tmp_path / label
        shutil.copytree(path, out)
        save_file({rename(k): v for k, v in saved.items()}, str(out / "model.safetensors"))
        split = VisionTensors(cfg.vision)
        text = dict(split.text(checkpoint_tensors(out)))
        params = split.params(jnp.float32, device)
        results.append((sorted(text), jax.tree.leaves(params)))
    for names, leaves in results[1:]:
        assert names == results[0][0]
        for a, b in zip(leaves, results[0][1]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_images_from_allowed_urls_and_files(llm, tmp_path):
    """An http URL on an allowed host (a local server) and a file under the allowed path
    give the same answer as the same image inline; a redirect to another host, a host or
    path not allowed are refused."""
    import http.server
    import threading

    from jaxserve.loading.media import MediaPolicy

    image = _image(21, 64, 64)
    png = io.BytesIO()
    image.save(png, format="PNG")
    (tmp_path / "cat.png").write_bytes(png.getvalue())

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server API
            if self.path == "/away":
                self.send_response(302)
                self.send_header("Location", "http://localhost:1/cat.png")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(png.getvalue())

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"

    def ask(url: str, policy: MediaPolicy) -> list[int]:
        messages = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]
        return llm.chat(messages, GREEDY, media=policy)[0].outputs[0].token_ids

    try:
        inline = ask("data:image/png;base64," + base64.b64encode(png.getvalue()).decode(),
                     MediaPolicy())
        allowed = MediaPolicy(allowed_domains=("127.0.0.1",),
                              allowed_local_path=str(tmp_path))
        assert ask(f"{base}/cat.png", allowed) == inline
        assert ask(f"file://{tmp_path}/cat.png", allowed) == inline
        for url, policy, message in (
                (f"{base}/away", allowed, "redirects to a host that is not allowed"),
                (f"{base}/cat.png", MediaPolicy(), "not allowed"),
                (f"file://{tmp_path}/../cat.png", allowed, "outside the allowed"),
                ("file:///etc/hostname", allowed, "outside the allowed")):
            with pytest.raises(ValueError, match=message):
                ask(url, policy)
    finally:
        server.shutdown()


def test_qwen_logprobs_match_transformers(qwen, qwen_llm):
    """Every generated position's top-5 logprobs, after two images of different sizes, are
    transformers' (float32; 1e-4)."""
    import torch

    images = [_image(4, 90, 60), _image(5, 40, 120)]
    prompt = _qwen_prompt([33], 2, [34, 35])
    out = qwen_llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": images}},
                            SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                           logprobs=5))[0].outputs[0]
    ids, kwargs = _qwen_expanded(qwen, prompt, images)
    full = ids + out.token_ids
    kwargs["mm_token_type_ids"] = torch.tensor([[int(t == IMAGE_PAD) for t in full]])
    with torch.no_grad():
        logits = qwen[1](torch.tensor([full]), **kwargs).logits[0].float()
    want = torch.log_softmax(logits, -1)[len(ids) - 1:len(full) - 1].numpy()
    for position, got in zip(want, out.logprobs):
        top = np.argsort(-position)[:5]
        assert [t for t in got if got[t].rank is not None] == top.tolist()
        np.testing.assert_allclose([got[t].logprob for t in top], position[top], atol=1e-4)


@pytest.mark.slow  # compiles for a TPU
@pytest.mark.parametrize("family", ["qwen", "gemma"])
def test_plan_counts_the_image_side_and_compiles_its_steps(family, request):
    """`jaxserve plan` of a vision-language model compiles the step the engine runs (M-RoPE
    offsets; Gemma 3's image ends, its attention behind a lax.cond with the Mosaic kernel)
    for a TPU, weights as the text model's, and takes the tower and the encoder buffer out
    of the KV cache's share."""
    from sharding.planner import encoder_rows, plan_target

    cfg = ModelConfig.from_file(request.getfixturevalue(family)[0])
    text = dataclasses.replace(cfg, vision=None, mrope_section=())
    small = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)
    with_images = plan_target(cfg, "v5e:1x1", **small)
    without = plan_target(text, "v5e:1x1", **small)
    assert all("error" not in b for b in with_images["buckets"].values())
    want = (cfg.vision.num_params() + encoder_rows(cfg, 32) * cfg.vision.text_hidden_size) * 2
    assert with_images["vision_bytes"] == want and without["vision_bytes"] == 0
    # The same weights (as shapes say; TPU tiles may pad the image buffer past its bytes).
    assert with_images["analytic_weight_bytes"] == without["analytic_weight_bytes"]
    p = with_images  # its own step's temporaries (M-RoPE's differ from plain rope's)
    assert p["kv_tokens_that_fit"] == (p["hbm_bytes"] - p["weight_bytes"] - want
                                       - p["temp_bytes"]) // p["kv_bytes_per_token"]
