"""Real SGLang 0.5.23 on CPU serving an hpc_rl LoRA adapter (docs/lora.md, docs/sglang-cpu-checks.md; marker
`sglang_cpu`, skipped without tools/install_sglang_cpu.sh's venv). Started with the options hpc_rl's LoRA runs give
engines (`config.lora.engine_lora_options`) plus the CPU LoRA backend (`--lora-backend torch_native`) and pinned
host memory made a no-op (SGLang's LoRA pins unconditionally, which CPU-only torch refuses: sglang_cpu_pinning/),
it loads a PEFT directory in the layout hpc_rl's adapter sync writes (`training.lora.peft_files`: PEFT names,
hpc_rl's adapter_config.json), serves it by `lora_path` with the prompt's log-probs equal to PEFT's forward pass on
transformers, serves the base beside it, and unloads it: the unload waits for a request using it to finish; a later
request naming it reloads it from its directory, and fails once the directory is gone. /load_lora_adapter_from_tensors
with SGLang's body (`weights.lora_sync.load_from_tensors_request`, the adapter pickled by
`weights.colocated.serialize_tensor_dict`, here CPU tensors shared through torch's file_system strategy) loads the same
adapter, served with PEFT's log-probs; the CPU engine's shared-memory descriptor is refused by SGLang (it unpickles).
One SGLang start (~50 s).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from hpc_rl.config.lora import LoraConfig, engine_lora_options
from hpc_rl.engines.engine_process import SglangEngineProcess
from hpc_rl.engines.sglang_launch import SGLANG_ON_CPU_ENV, SGLANG_ON_CPU_OPTIONS, SglangLaunchSpec
from hpc_rl.process.child_process import planned_port
from hpc_rl.training.lora.peft_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, adapter_config

SGLANG_VENV = Path(os.environ.get("HPC_RL_SGLANG_VENV", Path.home() / ".cache/hpc_rl/sglang-cpu-venv"))
SGLANG_PYTHON = SGLANG_VENV / "bin" / "python"
pytestmark = [pytest.mark.slow, pytest.mark.sglang_cpu,
              pytest.mark.skipif(not SGLANG_PYTHON.exists(),
                                 reason=f"no SGLang CPU venv at {SGLANG_VENV} (bash tools/install_sglang_cpu.sh)")]

PINNING_STAND_IN = Path(__file__).parent / "sglang_cpu_pinning"
"""Its sitecustomize.py makes pinning host memory a no-op: SGLang's LoRA pins unconditionally, CPU-only torch refuses."""
LORA = LoraConfig(lora_rank=8, lora_alpha=16, target_modules="all-linear")


def write_adapter(model_dir: Path, directory: Path) -> None:
    """Seeded fp32 adapter matrices (the tiny model is fp32) for every linear projection, under PEFT's names, with
    hpc_rl's adapter_config."""
    from safetensors.torch import load_file, save_file

    config = adapter_config(LORA, str(model_dir))
    generator = torch.Generator().manual_seed(3)
    state = {}
    for name, weight in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in config["target_modules"]:
            out_features, in_features = weight.shape
            state[f"{PEFT_PREFIX}{module}.lora_A.weight"] = 0.05 * torch.randn(LORA.lora_rank, in_features,
                                                                              generator=generator)
            state[f"{PEFT_PREFIX}{module}.lora_B.weight"] = 0.05 * torch.randn(out_features, LORA.lora_rank,
                                                                              generator=generator)
    directory.mkdir(parents=True)
    save_file({name: tensor.contiguous() for name, tensor in state.items()},
              str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def prompt_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def test_sglang_serves_an_hpc_rl_adapter_with_pefts_logprobs(tmp_path: Path, tiny_model_dir: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "policy-v1"
    write_adapter(tiny_model_dir, adapter)
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    ids = torch.randint(5, vocab, (24,), generator=torch.Generator().manual_seed(11)).tolist()
    base_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    expected_base = prompt_logprobs(base_model, ids)
    expected_lora = prompt_logprobs(PeftModel.from_pretrained(base_model, str(adapter)).eval(), ids)
    assert max(abs(a - b) for a, b in zip(expected_base, expected_lora)) > 1e-2  # the adapter matters

    options = {**SGLANG_ON_CPU_OPTIONS, "max_total_tokens": 4096, "dtype": "float32",  # auto: float16 on CPU
               **engine_lora_options(LORA), "lora_backend": "torch_native"}
    spec = SglangLaunchSpec(hf_checkpoint=str(tiny_model_dir), host="127.0.0.1", port=planned_port(),
                            python=str(SGLANG_PYTHON), sglang_options=options)
    engine = SglangEngineProcess(spec, log_path=tmp_path / "engine.log",
                                 env={**SGLANG_ON_CPU_ENV, "PYTHONPATH": str(PINNING_STAND_IN)})
    engine.start()
    try:
        engine.wait_healthy(600)
        post = lambda path, body: requests.post(f"{engine.url}{path}", json=body, timeout=300)
        loaded = post("/load_lora_adapter", {"lora_name": "policy-v1", "lora_path": str(adapter)})
        assert loaded.status_code == 200 and loaded.json()["success"], loaded.text
        body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
        served = {}
        for name, extra in (("base", {}), ("lora", {"lora_path": "policy-v1"})):
            answer = post("/generate", {**body, **extra})
            assert answer.status_code == 200, answer.text
            served[name] = [entry[0] for entry in answer.json()["meta_info"]["input_token_logprobs"][1:]]
        gaps = {name: max(abs(a - b) for a, b in zip(served[name], expected))
                for name, expected in (("base", expected_base), ("lora", expected_lora))}
        print(f"SGLang prompt log-probs vs transformers (base) and PEFT (lora): max |diff| {gaps}")
        assert len(served["base"]) == len(served["lora"]) == len(ids) - 1
        assert gaps["base"] < 1e-4 and gaps["lora"] < 1e-4, gaps
        # An unload waits until no request uses the adapter (the CPU engine refuses it with 400 instead).
        long = {"input_ids": ids, "lora_path": "policy-v1", "stream": True,
                "sampling_params": {"max_new_tokens": 480, "temperature": 0, "ignore_eos": True}}
        with ThreadPoolExecutor(1) as pool, \
                requests.post(f"{engine.url}/generate", json=long, stream=True, timeout=300) as response:
            events = response.iter_lines()
            next(line for line in events if line)  # running: its first token is back
            unloading = pool.submit(post, "/unload_lora_adapter", {"lora_name": "policy-v1"})
            time.sleep(0.5)
            assert not unloading.done()
            last = [line for line in events if line and line != b"data: [DONE]"][-1]
            assert json.loads(last[len(b"data: "):])["meta_info"]["finish_reason"]["length"] == 480
            unloaded = unloading.result(timeout=120)
        assert unloaded.status_code == 200 and unloaded.json()["success"], unloaded.text
        # SGLang 0.5.23 remembers each loaded name's path: a request naming an unloaded adapter reloads it from
        # there ("Reloading evicted adapter"; the CPU engine answers 400), and fails once the directory is gone.
        from safetensors.torch import load_file

        adapter_tensors = sorted(load_file(str(adapter / ADAPTER_WEIGHTS)).items())
        adapter_json = json.loads((adapter / ADAPTER_CONFIG).read_text())
        from_tensors_checks(post, adapter_tensors, adapter_json, body, expected_lora)
        reloaded = post("/generate", {**body, "lora_path": "policy-v1"})
        assert reloaded.status_code == 200, reloaded.text
        relogprobs = [entry[0] for entry in reloaded.json()["meta_info"]["input_token_logprobs"][1:]]
        assert max(abs(a - b) for a, b in zip(relogprobs, expected_lora)) < 1e-4
        assert post("/unload_lora_adapter", {"lora_name": "policy-v1"}).status_code == 200
        shutil.rmtree(adapter)
        gone = post("/generate", {**body, "lora_path": "policy-v1"})
        print(f"an unloaded adapter whose directory is gone: HTTP {gone.status_code} {gone.text[:300]}")
        assert gone.status_code != 200
        twin_share_kills_sglang(post, engine, adapter_tensors, adapter_json)
    finally:
        engine.stop()


def from_tensors_checks(post, tensors: list, config: dict, body: dict,  # noqa: ANN001
                        expected_lora: list[float]) -> None:
    """/load_lora_adapter_from_tensors on real SGLang: its own format (a pickled dict of tensors, one copy per TP
    rank) loads and serves PEFT's log-probs."""
    import torch.multiprocessing

    from hpc_rl.weights.colocated import serialize_tensor_dict
    from hpc_rl.weights.lora_sync import load_from_tensors_request

    torch.multiprocessing.set_sharing_strategy("file_system")  # CPU tensors by shm name: readable by another process
    try:
        pickled = serialize_tensor_dict(tensors)
        start = time.perf_counter()
        loaded = post("/load_lora_adapter_from_tensors", load_from_tensors_request("policy-v2", config, [pickled]))
        seconds = time.perf_counter() - start
    finally:
        torch.multiprocessing.set_sharing_strategy("file_descriptor")
    print(f"SGLang /load_lora_adapter_from_tensors: HTTP {loaded.status_code} in {seconds:.3f} s: {loaded.text[:300]}")
    assert loaded.status_code == 200 and loaded.json()["loaded_adapters"]["policy-v2"] == "__tensor__", loaded.text
    answer = post("/generate", {**body, "lora_path": "policy-v2"})
    assert answer.status_code == 200, answer.text
    served = [entry[0] for entry in answer.json()["meta_info"]["input_token_logprobs"][1:]]
    gap = max(abs(a - b) for a, b in zip(served, expected_lora))
    print(f"SGLang serving the adapter loaded from tensors vs PEFT: max |diff| {gap:.2e}")
    assert gap < 1e-4
    assert post("/unload_lora_adapter", {"lora_name": "policy-v2"}).status_code == 200


def twin_share_kills_sglang(post, engine: SglangEngineProcess, tensors: list, config: dict) -> None:  # noqa: ANN001
    """The CPU engine's share (a shared-memory descriptor, no pickle) sent to SGLang: its scheduler fails to unpickle
    it ("invalid load key") and the whole server exits (measured; the CPU engine answers 400 to a pickle)."""
    from hpc_rl.weights.colocated import serialize_adapter_share
    from hpc_rl.weights.lora_sync import load_from_tensors_request

    share, bucket = serialize_adapter_share(tensors)
    try:
        answer = post("/load_lora_adapter_from_tensors", load_from_tensors_request("twin", config, [share]))
        outcome = f"HTTP {answer.status_code} {answer.text[:200]}"
    except requests.exceptions.ConnectionError as error:
        outcome = f"no answer ({type(error).__name__})"
    finally:
        if bucket is not None:
            bucket.close()
    deadline = time.monotonic() + 60
    while engine.process.alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    print(f"SGLang given the CPU engine's shared-memory share: {outcome}; server exited: {not engine.process.alive()}")
    assert not outcome.startswith("HTTP 200")
