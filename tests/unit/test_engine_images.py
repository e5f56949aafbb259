"""Issue 32: images through the CPU engine's `/generate` (SGLang's `image_data`) on a tiny random Qwen3-VL served by
transformers' own classes. A request with image_data (base64 data URLs, one or two images, pad runs sent collapsed or
already expanded) answers with the log-probs of transformers' plain forward over the same processed input (the
image processor's pixel values, M-RoPE positions from the model), through continuous batching with a text-only
request and a second wave; a resumed request (prompt + partial output, images again) continues the same way."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

from hpc_rl.engines.cpu import kv_batch
from hpc_rl.engines.cpu.__main__ import load_model
from hpc_rl.engines.cpu.requests import RequestError, parse_generate_body
from hpc_rl.engines.cpu.scheduler import Scheduler
from hpc_rl.engines.cpu.vision import EngineImages
from hpc_rl.models.qwen3_vl.tiny import build_vl_tokenizer, make_image_processor, make_tiny_qwen3_vl


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny_vl"))


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(str(checkpoint), "auto", "eager")


@pytest.fixture(scope="module")
def tokenizer():
    return build_vl_tokenizer()


def data_url(size: tuple[int, int], colour: tuple[int, int, int]) -> str:
    buffer = io.BytesIO()
    image = Image.new("RGB", size, (250, 250, 250))
    image.paste(Image.new("RGB", (size[0] // 2, size[1] // 2), colour), (2, 3))
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def prompt_ids(tokenizer, images: int, text: str = "what colour is the shape ?") -> list[int]:
    content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def reference_logprobs(model, tokenizer, ids: list[int], urls: list[str], output: list[int]) -> torch.Tensor:
    """transformers' plain forward (no cache, positions from the model) over the processed prompt and the output."""
    from hpc_rl.engines.cpu.vision import decode_item

    processed = make_image_processor()([decode_item(u) for u in urls], return_tensors="pt")
    sequence = torch.tensor([ids + output])
    pad = model.config.image_token_id
    with torch.no_grad():
        logits = model(input_ids=sequence, pixel_values=processed["pixel_values"],
                       image_grid_thw=processed["image_grid_thw"], mm_token_type_ids=(sequence == pad).int(),
                       use_cache=False).logits[0].float()
    logprobs = torch.log_softmax(logits[len(ids) - 1:-1], dim=-1)
    return logprobs.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)


def run(scheduler: Scheduler, requests) -> list[dict]:
    while scheduler.run_iteration():
        pass
    return [r.future.result() for r in requests]


def test_vision_model_runs_per_request(model):
    assert kv_batch.cache_kind(model) == "per_request"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_image_requests_carry_transformers_logprobs(model, tokenizer, checkpoint, temperature):
    images = EngineImages(checkpoint, model.config)
    scheduler = Scheduler(model, tokenizer, max_running_requests=8, context_length=256, weight_version="v0",
                          images=images)
    params = {"max_new_tokens": 5, "temperature": temperature, "ignore_eos": True}
    one, two = [data_url((16, 16), (255, 0, 0))], [data_url((16, 16), (0, 0, 255)), data_url((40, 24), (0, 255, 0))]
    expanded = images.prepare(prompt_ids(tokenizer, 2), two)[0]  # sent already expanded: kept as it is
    first = parse_generate_body({"input_ids": [prompt_ids(tokenizer, 1), [10, 11, 12]], "image_data": [one, None],
                                 "sampling_params": params, "return_logprob": True},
                                tokenizer=tokenizer, context_length=256, images=images).requests
    scheduler.submit_all(first)
    for _ in range(2):  # the second wave joins running requests mid-way
        scheduler.run_iteration()
    second = parse_generate_body({"input_ids": expanded, "image_data": two, "sampling_params": params,
                                  "return_logprob": True}, tokenizer=tokenizer, context_length=256,
                                 images=images).requests
    # 16x16: 2x2 patches / 4 = 1 token; 40x24 -> 32x32: 4x4 / 4 = 4
    assert second[0].input_ids == expanded and expanded.count(model.config.image_token_id) == 1 + 4
    scheduler.submit_all(second)
    answers = run(scheduler, first + second)
    for request, answer, urls in zip(first + second, answers, [one, [], two]):
        engine = torch.tensor([entry[0] for entry in answer["meta_info"]["output_token_logprobs"]])
        assert len(engine) == 5
        if urls:
            reference = reference_logprobs(model, tokenizer, request.input_ids, urls, answer["output_ids"])
        else:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([request.input_ids + answer["output_ids"]])).logits[0].float()
            reference = torch.log_softmax(logits[len(request.input_ids) - 1:-1], -1).gather(
                1, torch.tensor(answer["output_ids"]).unsqueeze(1)).squeeze(1)
        assert (engine - reference).abs().max().item() < 1e-5, (engine - reference).tolist()
    # the image mattered: the same ids with another image give other log-probs
    other = reference_logprobs(model, tokenizer, first[0].input_ids, [data_url((16, 16), (0, 255, 0))],
                               answers[0]["output_ids"])
    mine = torch.tensor([e[0] for e in answers[0]["meta_info"]["output_token_logprobs"]])
    assert (other - mine).abs().max().item() > 1e-4


def test_a_resumed_request_with_its_images_continues_the_same_sequence(model, tokenizer, checkpoint):
    images = EngineImages(checkpoint, model.config)
    scheduler = Scheduler(model, tokenizer, max_running_requests=4, context_length=256, weight_version="v0",
                          images=images)
    urls = [data_url((16, 16), (255, 0, 0))]
    ids = prompt_ids(tokenizer, 1)
    body = {"sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}, "return_logprob": True}
    whole = run(scheduler, scheduler_submit(scheduler, tokenizer, images, {**body, "input_ids": ids,
                                                                           "image_data": urls}))[0]
    part = parse_generate_body({**body, "input_ids": ids, "image_data": urls}, tokenizer=tokenizer,
                               context_length=256, images=images).requests[0]
    expanded = part.input_ids
    resumed_body = {**body, "input_ids": expanded + whole["output_ids"][:3], "image_data": urls,
                    "sampling_params": {**body["sampling_params"], "max_new_tokens": 3}}
    rest = run(scheduler, scheduler_submit(scheduler, tokenizer, images, resumed_body))[0]
    assert rest["output_ids"] == whole["output_ids"][3:]
    tail = [e[0] for e in whole["meta_info"]["output_token_logprobs"][3:]]
    assert max(abs(a[0] - b) for a, b in zip(rest["meta_info"]["output_token_logprobs"], tail)) < 1e-5


def scheduler_submit(scheduler, tokenizer, images, body):
    requests = parse_generate_body(body, tokenizer=tokenizer, context_length=256, images=images).requests
    scheduler.submit_all(requests)
    return requests


def test_image_data_misuse_is_a_400(model, tokenizer, checkpoint):
    images = EngineImages(checkpoint, model.config)
    ids = prompt_ids(tokenizer, 1)
    url = data_url((16, 16), (1, 2, 3))
    for body, images_given, match in [
        ({"input_ids": ids, "image_data": [url]}, None, "no vision tower"),
        ({"input_ids": ids, "image_data": [url, url]}, images, "1 image slot"),
        ({"input_ids": ids, "image_data": ["data:image/png;base64,AAAA"]}, images, "cannot load an image"),
        ({"input_ids": ids, "image_data": ["https://example.com/a.png"]}, images, "URLs are not fetched"),
        ({"input_ids": [ids, ids], "image_data": [[url]]}, images, "length of image_data"),
    ]:
        with pytest.raises(RequestError, match=match):
            parse_generate_body(body, tokenizer=tokenizer, context_length=256, images=images_given)
