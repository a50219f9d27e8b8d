"""Adapters the engine refuses (each error names the problem), and the slot table's admission rules."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, SampleStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.stop_policy import StopPolicy
from pagedllm.lora.adapter import load_adapter
from pagedllm.lora.adapter_files import BaseModelShape
from pagedllm.lora.slots import AdapterSlots
from pagedllm.testing.lora_adapters import make_random_adapter

FEATURES = {"q_proj": (256, 256), "k_proj": (256, 128), "v_proj": (256, 128), "o_proj": (256, 256),
            "gate_proj": (256, 512), "up_proj": (256, 512), "down_proj": (512, 256)}
SHAPE = BaseModelShape(4, FEATURES, moe=False)


@pytest.fixture(scope="module")
def base(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


def edit_config(folder: Path, **changes: object) -> Path:
    file = folder / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))
    return folder


@pytest.mark.parametrize(("change", "message"), [
    ({"use_dora": True}, "use_dora=True is not supported: DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "'embed_tokens' is an embedding or LM head"),
    ({"target_modules": ["q_proj", "fc1"]}, "'fc1' is not one of q_proj"),
    ({"r": 32}, "r=32 is not supported: the rank is above max_lora_rank=16"),
    ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern"),
    ({"peft_type": "IA3"}, "peft_type"),
])
def test_config_refusals_name_the_key(base: Path, tmp_path: Path, change: dict[str, object], message: str) -> None:
    folder = edit_config(make_random_adapter(base, tmp_path / "a", 8, 16, seed=0), **change)
    with pytest.raises(ValueError, match=message):
        load_adapter("bad", folder, SHAPE, max_lora_rank=16)


def test_rank_above_limit_from_the_weights_too(base: Path, tmp_path: Path) -> None:
    folder = make_random_adapter(base, tmp_path / "a", 32, 16, seed=0)
    with pytest.raises(ValueError, match="above max_lora_rank=16"):
        load_adapter("big", folder, SHAPE, max_lora_rank=16)


def test_corrupt_safetensors_missing_path_and_missing_files(base: Path, tmp_path: Path) -> None:
    folder = make_random_adapter(base, tmp_path / "a", 8, 16, seed=0)
    (folder / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="adapter_model.safetensors is corrupt"):
        load_adapter("corrupt", folder, SHAPE, 16)
    with pytest.raises(ValueError, match="does not exist"):
        load_adapter("gone", tmp_path / "nowhere", SHAPE, 16)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="adapter_model.safetensors is missing"):
        load_adapter("half", folder, SHAPE, 16)


def test_base_model_mismatch_names_the_linear(base: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-base"
    other.mkdir()
    config = json.loads((base / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "intermediate_size": 384}))
    folder = make_random_adapter(other, tmp_path / "a", 8, 16, seed=0, target_modules=("q_proj", "up_proj"))
    with pytest.raises(ValueError, match=r"layers.0.up_proj adapts a 256->384 linear, but the base model's is "
                                         r"256->512 \(base model mismatch\)"):
        load_adapter("mismatch", folder, SHAPE, 16)


def test_experts_of_a_moe_model_are_refused(base: Path, tmp_path: Path) -> None:
    folder = make_random_adapter(base, tmp_path / "a", 8, 16, seed=0, target_modules=("q_proj", "down_proj"))
    with pytest.raises(ValueError, match="'down_proj' of a mixture-of-experts block"):
        load_adapter("moe", folder, BaseModelShape(4, FEATURES, moe=True), 16)
    assert load_adapter("attn", make_random_adapter(base, tmp_path / "b", 8, 16, seed=0, target_modules=("q_proj",)),
                        BaseModelShape(4, FEATURES, moe=True), 16).target_modules == {"q_proj"}


def test_engine_refuses_a_bad_adapter_and_keeps_serving(base: Path, tmp_path: Path) -> None:
    good = make_random_adapter(base, tmp_path / "good", 8, 16, seed=1)
    dora = edit_config(make_random_adapter(base, tmp_path / "dora", 8, 16, seed=2), use_dora=True)
    llm = LLM(model=str(base), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=16, num_kv_blocks=64)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match="use_dora"):
        llm.generate("hello", params, lora_request=LoRARequest("dora", 2, str(dora)))
    with pytest.raises(ValueError, match="lora_int_id=1 already names adapter 'good'"):
        llm.generate(["a", "b"], params, lora_request=[LoRARequest("good", 1, str(good)),
                                                     LoRARequest("other", 1, str(dora))])
    out = llm.generate("hello", params, lora_request=LoRARequest("good", 1, str(good)))
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.kv.num_free_blocks == 64
    plain = LLM(model=str(base), dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match="enable_lora=true"):
        plain.generate("hello", params, lora_request=LoRARequest("good", 1, str(good)))


def test_lora_engine_arguments_are_validated(base: Path) -> None:
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(model=str(base), enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank"):
        LLM(model=str(base), enable_lora=True, max_lora_rank=0)


def _request(name: str, lora_int_id: int) -> Request:
    request = Request(name, None, (1, 2, 3, 4, 5), SamplingParams(max_tokens=2), lora_int_id=lora_int_id)
    request.spawn([1, 2, 3, 4, 5])
    return request


def test_slots_evict_least_recently_used_and_never_a_running_adapter() -> None:
    slots = AdapterSlots(2)
    a, b, c, base_only = _request("a", 1), _request("b", 2), _request("c", 3), _request("base", 0)
    assert slots.admit(a, []) and slots.admit(b, []) and slots.admit(base_only, [])
    assert slots.take_loads() == [(0, 1), (1, 2)]
    assert slots.admit(a, [])  # a is now the most recently used
    assert not slots.admit(c, [a.sequences[0], b.sequences[0]])  # both pinned by running sequences
    assert slots.admit(c, [a.sequences[0]])  # b is evicted, a stays
    assert set(slots.resident) == {1, 3} and slots.num_evictions == 1
    assert slots.take_loads() == [(slots.slot_of(3), 3)]


def test_scheduler_skips_a_request_whose_adapter_has_no_slot_without_blocking_others() -> None:
    slots = AdapterSlots(1)
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    scheduler = Scheduler(kv, 8, 64, StopPolicy(128, frozenset()), adapter_gate=slots.admit)
    first, blocked, base_only, same = _request("x", 1), _request("y", 2), _request("z", 0), _request("w", 1)
    for request in (first, blocked, base_only, same):
        scheduler.add(request.sequences[0])
    out = scheduler.schedule()
    assert [item.seq.request.request_id for item in out.scheduled] == ["x", "z", "w"]
    assert [seq.request.request_id for seq in scheduler.waiting] == ["y"]
    for seq in list(scheduler.running):
        if seq.request.lora_int_id == 1:
            scheduler.finish(seq, "stop")
    out = scheduler.schedule()
    assert "y" in [item.seq.request.request_id for item in out.scheduled]
    assert blocked.sequences[0].status is SampleStatus.RUNNING and slots.num_evictions == 1


def test_named_adapters_keep_their_ids_and_follow_the_file(base: Path, tmp_path: Path) -> None:
    from pagedllm.lora.modules import LoRAModules, parse_lora_modules, write_multi_lora

    first = make_random_adapter(base, tmp_path / "first", 8, 16, seed=0)
    second = make_random_adapter(base, tmp_path / "second", 8, 16, seed=1)
    file = tmp_path / "multi_lora.json"
    write_multi_lora(file, {"a": str(first)})
    modules = LoRAModules.from_file(file)
    assert modules.request("a") == LoRARequest("a", 1, str(first))
    with pytest.raises(ValueError, match=r"unknown adapter 'b'; known adapters: \['a'\]"):
        modules.request("b")
    write_multi_lora(file, {"b": str(second), "a": str(first)})
    assert modules.request("b").lora_int_id == 2 and modules.request("a").lora_int_id == 1
    write_multi_lora(file, {"a": str(second)})  # a new folder under an old name is a new adapter
    assert modules.request("a").lora_int_id == 3
    write_multi_lora(file, {"a": str(first), "bad": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="entry 'bad': LoRA adapter 'bad': lora_path .* does not exist"):
        LoRAModules.from_file(file).check(base, 16)
    file.write_text('{"a": 3}')
    with pytest.raises(ValueError, match="entry 'a': expected a non-empty name and an adapter folder path"):
        LoRAModules.from_file(file)
    with pytest.raises(ValueError, match="expected NAME=PATH"):
        parse_lora_modules(["no-path"])


def test_moe_model_serves_attention_adapters_and_refuses_expert_ones(tiny_model_dir: Callable[[str], Path],
                                                                    tmp_path: Path) -> None:
    moe = tiny_model_dir("mixtral")
    attention = make_random_adapter(moe, tmp_path / "attn", 8, 16, seed=0, std=0.3,
                                    target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    experts = make_random_adapter(moe, tmp_path / "mlp", 8, 16, seed=1, target_modules=("q_proj", "down_proj"))
    llm = LLM(model=str(moe), dtype="float32", enable_lora=True, max_lora_rank=16, num_kv_blocks=32)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 17, 300, 42, 9]}
    adapted, plain = llm.generate([prompt, prompt], params, lora_request=[LoRARequest("attn", 1, str(attention)), None])
    assert adapted.outputs[0].token_ids != plain.outputs[0].token_ids
    with pytest.raises(ValueError, match="'down_proj' of a mixture-of-experts block"):
        llm.generate(prompt, params, lora_request=LoRARequest("mlp", 2, str(experts)))
