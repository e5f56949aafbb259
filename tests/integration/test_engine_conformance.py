"""One protocol, two engines: the same /generate and control checks against hpc_rl's CPU engine and, when
installed, real SGLang 0.5.23 on CPU (tools/install_sglang_cpu.sh; marker `sglang_cpu`, skipped when
its venv is absent: `$HPC_RL_SGLANG_VENV`, default ~/.cache/hpc_rl/sglang-cpu-venv).

Each check is a behaviour hpc_rl relies on and that was measured to differ once (issue 9): text decoded
in the prompt's context, over-context 400, ignore_eos ignoring stop ids, batched input_ids (a rid per
item, one aborted alone, duplicates refused), SSE
streaming, error and control bodies, 0-token weight_versions, abort reasons, logprobs equal to a
forward pass. The last check sends an out-of-vocabulary id: SGLang's process exits, and so must the CPU
engine's (never a live /health with a dead scheduler). Tests run in file order per engine.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import orjson
import pytest
import requests

from hpc_rl.engines.child_process import free_port
from hpc_rl.engines.engine_process import CpuEngineProcess, SglangEngineProcess
from hpc_rl.engines.sglang_launch import SGLANG_ON_CPU_ENV, SGLANG_ON_CPU_OPTIONS, SglangLaunchSpec

SGLANG_VENV = Path(os.environ.get("HPC_RL_SGLANG_VENV", Path.home() / ".cache/hpc_rl/sglang-cpu-venv"))
SGLANG_PYTHON = SGLANG_VENV / "bin" / "python"
needs_sglang = pytest.mark.skipif(not SGLANG_PYTHON.exists(),
                                  reason=f"no SGLang CPU venv at {SGLANG_VENV} (bash tools/install_sglang_cpu.sh)")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["cpu", pytest.param("sglang", marks=[pytest.mark.sglang_cpu, needs_sglang])])
def engine(request, tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp(f"{request.param}_engine")
    if request.param == "cpu":
        process = CpuEngineProcess(tiny_model_dir, log_path=logs / "engine.log")
        timeout = 120
    else:
        spec = SglangLaunchSpec(hf_checkpoint=str(tiny_model_dir), host="127.0.0.1", port=free_port(),
                                python=str(SGLANG_PYTHON),
                                sglang_options={**SGLANG_ON_CPU_OPTIONS, "max_total_tokens": 4096})
        process = SglangEngineProcess(spec, log_path=logs / "engine.log", env=SGLANG_ON_CPU_ENV)
        timeout = 600
    process.start()
    try:
        process.wait_healthy(timeout)
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def generate(engine, body: dict, timeout: float = 120) -> requests.Response:
    return requests.post(f"{engine.url}/generate", json=body, timeout=timeout)


def greedy(max_new_tokens: int, **extra) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, **extra}


def test_text_is_the_continuation_of_the_prompt_text(engine, tokenizer):
    prompt = tokenizer.encode("add 1 + 2 =", add_special_tokens=False)
    answer = generate(engine, {"input_ids": prompt, "sampling_params": greedy(6, ignore_eos=True)}).json()
    whole = tokenizer.decode(prompt + answer["output_ids"], skip_special_tokens=True)
    assert answer["text"] == whole[len(tokenizer.decode(prompt, skip_special_tokens=True)):]


def test_logprobs_equal_a_forward_pass(engine, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = [9, 15, 12, 16, 11]
    answer = generate(engine, {"input_ids": prompt, "return_logprob": True,
                               "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}).json()
    output = answer["output_ids"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt + output])).logits[0].float(), -1)
    expected = [float(logprobs[len(prompt) - 1 + i, token]) for i, token in enumerate(output)]
    got = [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-3


def test_prompt_plus_max_new_tokens_over_the_context_is_a_400(engine):
    context = 512  # max_position_embeddings of assets/tiny_qwen3
    fits = generate(engine, {"input_ids": [9] * 500, "sampling_params": greedy(12, ignore_eos=True)})
    assert fits.status_code == 200, fits.text
    assert len(fits.json()["output_ids"]) == context - 2 - 500  # capped silently to max_req_len - input - 1
    over = generate(engine, {"input_ids": [9] * 500, "sampling_params": greedy(13)})
    assert over.status_code == 400
    assert over.json()["error"]["message"].startswith("Requested token count exceeds the model's maximum context")
    assert generate(engine, {"input_ids": [9] * 505, "sampling_params": greedy(1)}).status_code == 200
    long = generate(engine, {"input_ids": [9] * 506, "sampling_params": greedy(1)})
    assert long.status_code == 400 and "exceeds the maximum allowed length" in long.json()["error"]["message"]


def test_ignore_eos_ignores_stop_token_ids(engine):
    prompt = [9, 15, 12, 16, 11]
    free = generate(engine, {"input_ids": prompt, "sampling_params": greedy(8, ignore_eos=True)}).json()
    stop_id = free["output_ids"][1]
    held = generate(engine, {"input_ids": prompt,
                             "sampling_params": greedy(8, ignore_eos=True, stop_token_ids=[stop_id])}).json()
    assert held["output_ids"] == free["output_ids"]
    assert held["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    stopped = generate(engine, {"input_ids": prompt, "sampling_params": greedy(8, stop_token_ids=[stop_id])}).json()
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_batched_input_ids_answer_a_list_in_order(engine):
    body = {"input_ids": [[9, 15], [10], [9, 15, 12]], "rid": "batch",
            "sampling_params": [greedy(n, ignore_eos=True) for n in (1, 2, 3)]}
    answers = generate(engine, body).json()
    assert isinstance(answers, list)
    assert [a["meta_info"]["id"] for a in answers] == ["batch_0", "batch_1", "batch_2"]
    assert [len(a["output_ids"]) for a in answers] == [1, 2, 3]


def test_batched_rid_list_each_item_its_own_request(engine):
    """How the rollout sends a group (hpc_rl.rollout.request_batching): one rid per item, answered by
    id; aborting one rid ends that item only (the others run on); duplicate rids are refused (400)."""
    duplicate = generate(engine, {"input_ids": [[9], [10]], "rid": ["same", "same"],
                                  "sampling_params": greedy(1)})
    assert duplicate.status_code == 400 and "Duplicate request IDs" in duplicate.json()["error"]["message"]
    body = {"input_ids": [[9, 15], [10, 11]], "rid": ["keep-1", "cut-1"],
            "sampling_params": [greedy(8, ignore_eos=True), greedy(500, ignore_eos=True)]}
    answer: list = []
    sender = threading.Thread(target=lambda: answer.append(generate(engine, body)))
    sender.start()
    while sender.is_alive():  # until the batch answers: an abort before the item arrives is a no-op
        requests.post(f"{engine.url}/abort_request", json={"rid": "cut-1"}, timeout=30)
        sender.join(timeout=0.2)
    kept, cut = answer[0].json()
    assert [kept["meta_info"]["id"], cut["meta_info"]["id"]] == ["keep-1", "cut-1"]
    assert kept["meta_info"]["finish_reason"] == {"type": "length", "length": 8} and len(kept["output_ids"]) == 8
    assert cut["meta_info"]["finish_reason"]["type"] == "abort" and len(cut["output_ids"]) < 500


def test_stream_is_sse_ending_with_done(engine):
    body = {"input_ids": [9, 15], "stream": True, "sampling_params": greedy(3, ignore_eos=True)}
    with requests.post(f"{engine.url}/generate", json=body, stream=True, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(event.startswith(b"data: ") for event in events) and events[-1] == b"data: [DONE]"
    chunks = [orjson.loads(event[len(b"data: "):]) for event in events[:-1]]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert len(chunks[-1]["output_ids"]) == 3


def test_zero_new_tokens_report_one_empty_weight_version_span(engine):
    answer = generate(engine, {"input_ids": [9, 15], "sampling_params": {"max_new_tokens": 0}}).json()
    assert answer["output_ids"] == []
    spans = answer["meta_info"]["weight_versions"]
    assert len(spans) == 1 and spans[0]["start"] == 0 and spans[0]["end"] == 0
    assert isinstance(answer["meta_info"]["cached_tokens"], int)


def test_error_and_control_bodies(engine):
    missing = requests.get(f"{engine.url}/no_such_endpoint", timeout=30)
    assert missing.status_code == 404 and missing.json() == {"detail": "Not Found"}
    bad = generate(engine, {"input_ids": [9], "sampling_params": {"max_new_tokens": 2, "no_such_param": 1}})
    assert bad.status_code == 400 and "error" in bad.json()
    for path, message in [("/pause_generation", "Generation paused successfully."),
                          ("/continue_generation", "Generation continued successfully.")]:
        body = {"mode": "abort"} if path == "/pause_generation" else {}
        answer = requests.post(f"{engine.url}{path}", json=body, timeout=30)
        assert answer.status_code == 200 and answer.json() == {"message": message, "status": "ok"}


def test_abort_returns_partial_output_with_sglangs_reason(engine):
    """Aborts once the first token has streamed back, so the request is running (never a fixed sleep:
    a quiet machine decodes the whole budget within one)."""
    budget = 500  # as long as the tiny model's 512-token context allows
    body = {"rid": "to-abort", "input_ids": [9, 15], "stream": True,
            "sampling_params": {"max_new_tokens": budget, "ignore_eos": True}}
    with requests.post(f"{engine.url}/generate", json=body, stream=True, timeout=120) as response:
        events = response.iter_lines()
        first = next(line for line in events if line)
        assert first.startswith(b"data: ")
        aborted = requests.post(f"{engine.url}/abort_request", json={"rid": "to-abort"}, timeout=30)
        assert aborted.status_code == 200
        rest = [line for line in events if line]
    chunks = [orjson.loads(event[len(b"data: "):]) for event in [first, *rest] if event != b"data: [DONE]"]
    reason = chunks[-1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["message"] == "Aborted"
    assert len(chunks[-1]["output_ids"]) < budget


def test_an_out_of_vocabulary_id_ends_the_engine_process(engine):
    """Last: SGLang's process exits on it; the CPU engine's must too (never /health 200 with a dead scheduler)."""
    try:
        generate(engine, {"input_ids": [9, 10_000], "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    except requests.RequestException:
        pass  # the connection may drop as the process dies
    deadline = time.monotonic() + 120
    while engine.process.alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not engine.process.alive()
    assert engine.process.popen.returncode != 0
