"""Greedy tokens through LoRA adapters equal PEFT's merged model in transformers, token for token (fp32).

Adapters are built with ``peft`` (``get_peft_model``, random ``lora_B`` so they change the output,
``save_pretrained``); the reference is ``merge_and_unload()`` then transformers' ``generate``. Three adapters differ
in rank, alpha, rslora and targets (attention-only, all-linear, a mix). Divergence is allowed only at an exact
top-two tie of the reference. ``pytest --full`` adds more architectures and prompts.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import full_run

from pagedllm import LLM, LoRARequest, SamplingParams

FULL = full_run.full()
ARCHS = ("llama", "qwen3", "mistral", "qwen2") if FULL else ("llama", "qwen3")
NEW_TOKENS = 16
TIE = 1e-4
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    alpha: float
    rslora: bool
    targets: tuple[str, ...]


SPECS = (
    AdapterSpec("attn-r8", 8, 16.0, False, tuple(ATTENTION)),
    AdapterSpec("all-r16-rslora", 16, 8.0, True, tuple(ALL_LINEAR)),
    AdapterSpec("mix-r4", 4, 32.0, False, ("k_proj", "v_proj", "down_proj", "up_proj")),
)


@dataclass(frozen=True)
class Fixture:
    base: Path
    adapters: dict[str, Path]
    references: dict[str | None, list[tuple[list[int], list[float]]]]  # adapter name (None: base) -> per prompt

    def request(self, name: str | None) -> LoRARequest | None:
        if name is None:
            return None
        return LoRARequest(name, [spec.name for spec in SPECS].index(name) + 1, str(self.adapters[name]))


def prompts(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 1000, (40,), generator=generator).tolist()  # a prefix-cache hit for the later ones
    lengths = torch.linspace(5, 60, count).long().tolist()
    return [(shared if i % 2 else []) + torch.randint(3, 1000, (n,), generator=generator).tolist()
            for i, n in enumerate(lengths)]


PROMPTS = prompts(8 if FULL else 4)


def greedy_reference(model: torch.nn.Module) -> list[tuple[list[int], list[float]]]:
    model.generation_config.eos_token_id = None
    out = []
    for prompt in PROMPTS:
        result = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, output_logits=True, return_dict_in_generate=True)
        margins = [float(top[0, 0] - top[0, 1]) for top in (s.topk(2).values for s in result.logits)]
        out.append((result.sequences[0, len(prompt):].tolist(), margins))
    return out


def build_fixture(base: Path, out: Path) -> Fixture:
    adapters: dict[str, Path] = {}
    references: dict[str | None, list[tuple[list[int], list[float]]]] = {}
    references[None] = greedy_reference(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32))
    for seed, spec in enumerate(SPECS):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, use_rslora=spec.rslora,
                            target_modules=list(spec.targets), task_type="CAUSAL_LM")
        peft_model = get_peft_model(model, config)
        generator = torch.Generator().manual_seed(100 + seed)
        with torch.no_grad():
            for name, parameter in peft_model.named_parameters():
                if "lora_B" in name:  # PEFT starts B at zero: an adapter that changes nothing
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
        peft_model.save_pretrained(out / spec.name)
        adapters[spec.name] = out / spec.name
        references[spec.name] = greedy_reference(peft_model.merge_and_unload())
    return Fixture(base, adapters, references)


@pytest.fixture(scope="module", params=ARCHS)
def fixture(request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path],
            tmp_path_factory: pytest.TempPathFactory) -> Fixture:
    return build_fixture(tiny_model_dir(request.param), tmp_path_factory.mktemp(f"lora-{request.param}"))


def assert_own_tokens(fixture: Fixture, names: list[str | None], prompt_indices: list[int],
                      got: list[list[int]]) -> None:
    for name, index, tokens in zip(names, prompt_indices, got):
        want, margins = fixture.references[name][index]
        if tokens != want:
            step = next(i for i, (a, b) in enumerate(zip(tokens, want)) if a != b)
            assert margins[step] < TIE, (f"adapter {name} prompt {index} diverges from PEFT's merged model at step "
                                         f"{step} (top-2 margin {margins[step]:.2e}, not a tie)")


def run(llm: LLM, fixture: Fixture, names: list[str | None], prompt_indices: list[int]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in prompt_indices], GREEDY,
                        lora_request=[fixture.request(name) for name in names])
    return [out.outputs[0].token_ids for out in outs]


def test_adapters_are_not_trivial(fixture: Fixture) -> None:
    tokens = {name: [ref[0] for ref in refs] for name, refs in fixture.references.items()}
    assert len({tuple(map(tuple, t)) for t in tokens.values()}) == len(tokens)


def test_each_adapter_alone_matches_peft_merged(fixture: Fixture) -> None:
    llm = LLM(model=str(fixture.base), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=16, num_kv_blocks=128)
    for spec in SPECS:
        indices = list(range(len(PROMPTS)))
        assert_own_tokens(fixture, [spec.name] * len(indices), indices, run(llm, fixture, [spec.name] * len(indices),
                                                                             indices))


def test_mixed_batch_with_preemption_prefix_caching_and_swaps(fixture: Fixture) -> None:
    """Three adapters and base-only requests in one continuous batch, two slots, a KV cache small enough to preempt."""
    llm = LLM(model=str(fixture.base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2,
              num_kv_blocks=24, block_size=8, max_num_seqs=6, enable_prefix_caching=True)
    cycle: list[str | None] = [SPECS[0].name, None, SPECS[1].name, SPECS[2].name]
    names = [cycle[i % len(cycle)] for i in range(3 * len(PROMPTS))]
    indices = [i % len(PROMPTS) for i in range(len(names))]
    got = run(llm, fixture, names, indices)
    assert_own_tokens(fixture, names, indices, got)
    lora = llm.engine.lora
    assert lora is not None and lora.slots.num_evictions > 0, "three adapters over two slots must swap"
    assert lora.registry.num_disk_loads > len(SPECS), "two host slots for three adapters must reload one"
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hit_tokens > 0
    assert stats.num_blocks_free == stats.num_blocks_total


def test_prefix_cache_never_crosses_adapters(fixture: Fixture) -> None:
    """The same prompt under two adapters and the base: each exactly its own, the cache shared only within one."""
    llm = LLM(model=str(fixture.base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=64,
              block_size=8, enable_prefix_caching=True)
    index = len(PROMPTS) - 1  # the longest prompt: several full blocks
    first, second = SPECS[0].name, SPECS[1].name
    results = {}
    for name in (first, second, None):
        results[name] = run(llm, fixture, [name], [index])[0]
        assert llm.stats().prefix_cache_hit_tokens == 0, f"{name} reused KV computed under another adapter"
        assert_own_tokens(fixture, [name], [index], [results[name]])
    assert results[first] != results[second]
    assert run(llm, fixture, [first], [index])[0] == results[first]
    assert llm.stats().prefix_cache_hit_tokens > 0
