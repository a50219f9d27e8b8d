"""Native Llama-family forward over a paged cache against transformers' own forward (float32)."""
from __future__ import annotations

import functools
import json
import logging
import shutil
from collections.abc import Callable, Sequence
from typing import Any
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
import torch.nn.functional as F
from torch import nn
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from pagedllm.attention.backends import attention_backend_named
from pagedllm.attention.cpu_attention import new_cpu_cache
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.native_decode import load_native_decode
from pagedllm.models import CausalLM, load_model
from pagedllm.models.llama import Attention
from pagedllm.platform.cpu_dtypes import native_cpu_dtypes, unsupported_cpu_dtype_message
from pagedllm.layers import cpu_linear
from pagedllm.layers.norm_rotary import MAX_ROTARY_TABLE_VALUES, RotaryEmbedding
from pagedllm.layers.cpu_linear import (SWITCH_ENV, MklPackedLinear, NativeLinear, OneDnnLinear, PackedLinear,
                                        packed_linear_choice)
from pagedllm.layers.native_gemm import load_native_gemm

ARCHES = ["llama", "mistral", "qwen2", "qwen3"]
# The production CPU attention, and the kernels' oracle it must agree with.
CPU_BACKENDS = ["torch", "torch-reference"]
BLOCK_SIZE = 16
NUM_BLOCKS = 24
CPU = torch.device("cpu")
# Logits here reach ~12. F.linear (transformers' MKL sgemm) and packed GEMMs (our CPU linears) add in
# different orders: swapping oneDNN in for F.linear inside transformers' own forward moves them by
# 1.2e-4, and our native GEMM's order by as much. MKL's packed GEMM and the unpacked path stay within the old 1e-4.
ATOL = {"native": 2.5e-4, "mkl-packed": 1e-4, "onednn": 2.5e-4, "mkl": 1e-4}
UNWRITTEN = 1e4


@dataclass
class Sequence_:
    tokens: torch.Tensor  # every token the sequence will ever hold
    blocks: list[int]  # physical block of each logical block
    computed: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)


def make_caches(model: CausalLM, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    # Filled with a huge value so that attending to any slot no step wrote wrecks the logits.
    return [(torch.full(shape, UNWRITTEN, dtype=dtype), torch.full(shape, UNWRITTEN, dtype=dtype))
            for _ in range(model.num_layers)]


def make_sequences(lengths: Sequence[int], seed: int, vocab_size: int) -> list[Sequence_]:
    generator = torch.Generator().manual_seed(seed)
    free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    seqs = []
    for length in lengths:
        num_blocks = -(-length // BLOCK_SIZE)
        blocks, free = free[:num_blocks], free[num_blocks:]
        tokens = torch.randint(1, vocab_size, (length,), generator=generator)
        seqs.append(Sequence_(tokens, blocks))
    return seqs


def run_step(model: CausalLM, caches: list[tuple[torch.Tensor, torch.Tensor]],
             scheduled: Sequence[tuple[Sequence_, int]]) -> None:
    """One engine step: each (sequence, n) computes its next n tokens; logits are kept per sequence."""
    ids, positions, slots, starts, lens = [], [], [], [0], []
    for seq, n in scheduled:
        pos = torch.arange(seq.computed, seq.computed + n)
        ids.append(seq.tokens[pos])
        positions.append(pos)
        slots.append(torch.tensor(seq.blocks)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        starts.append(starts[-1] + n)
        lens.append(seq.computed + n)
    width = max(len(seq.blocks) for seq, _ in scheduled)
    table = torch.zeros(len(scheduled), width, dtype=torch.int32)
    for row, (seq, _) in enumerate(scheduled):
        table[row, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
    attn = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.cat(slots).long(),
        max_query_len=max(n for _, n in scheduled),
        max_seq_len=max(lens),
    )
    attn = model.attention.plan(attn)  # once per step, as the runner does
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.cat(ids), torch.cat(positions), caches, attn))
    assert logits.dtype == torch.float32
    offset = 0
    for seq, n in scheduled:
        seq.logits.append(logits[offset : offset + n])
        seq.computed += n
        offset += n


@functools.cache
def transformers_model(model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_logits(model_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    hf = transformers_model(model_dir)
    with torch.inference_mode():
        return hf(tokens[None]).logits[0].float()


def load(model_dir: Path, dtype: torch.dtype = torch.float32, backend: str = "torch") -> CausalLM:
    return load_model(model_dir, dtype, CPU, attention_backend_named(backend))


@pytest.fixture(params=["native", "onednn", "mkl-packed", "mkl"])
def linears(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which CPU linears the models load with: packed for our GEMM, oneDNN or MKL, or plain F.linear."""
    if request.param == "native" and load_native_gemm() is None:
        pytest.skip("the native float32 GEMM does not build on this CPU")
    monkeypatch.setenv(SWITCH_ENV, request.param)
    return request.param


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("arch", ARCHES)
def test_chunked_prefill_then_decode_matches_transformers(arch: str, backend: str, linears: str,
                                                          tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir(arch)
    model = load(model_dir, backend=backend)
    caches = make_caches(model)
    (seq,) = make_sequences([44], seed=1, vocab_size=model.vocab_size)
    run_step(model, caches, [(seq, 23)])  # prefill chunk ending mid-block
    run_step(model, caches, [(seq, 17)])  # rest of the 40-token prompt
    for _ in range(4):
        run_step(model, caches, [(seq, 1)])
    torch.testing.assert_close(torch.cat(seq.logits), reference_logits(model_dir, seq.tokens), atol=ATOL[linears],
                               rtol=0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("arch", ARCHES)
def test_mixed_batch_matches_transformers_per_sequence(arch: str, backend: str, linears: str,
                                                       tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir(arch)
    model = load(model_dir, backend=backend)
    caches = make_caches(model)
    a, b, c = make_sequences([33, 27, 14], seed=2, vocab_size=model.vocab_size)
    run_step(model, caches, [(a, 31), (b, 10)])
    run_step(model, caches, [(a, 1), (b, 15), (c, 12)])
    run_step(model, caches, [(c, 1), (a, 1), (b, 1)])
    run_step(model, caches, [(b, 1), (c, 1)])
    for seq in (a, b, c):
        torch.testing.assert_close(torch.cat(seq.logits), reference_logits(model_dir, seq.tokens),
                                   atol=ATOL[linears], rtol=0)


@pytest.mark.parametrize("arch", ARCHES)
def test_cpu_decode_steps_attend_from_the_fused_rows_in_every_arch(arch: str,
                                                                   tiny_model_dir: Callable[[str], Path]) -> None:
    """Qwen3's per-head q/k norms are written back into the fused rows, so its decodes take attend_qkv as the
    others' do, and still match transformers."""
    if load_native_decode() is None:
        pytest.skip("the native decode routine cannot be built here")
    model_dir = tiny_model_dir(arch)
    model = load(model_dir)
    taken: list[bool] = []
    attend_qkv = model.attention.attend_qkv
    assert attend_qkv is not None

    def spy(*args: Any) -> torch.Tensor | None:
        out = attend_qkv(*args)
        taken.append(out is not None)
        return out

    spied = replace(model.attention, attend_qkv=spy)
    for layer in model.modules():
        if isinstance(layer, Attention):
            layer.attention = spied
    shape = (NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    caches = [(new_cpu_cache(shape, torch.float32, CPU).fill_(UNWRITTEN),
               new_cpu_cache(shape, torch.float32, CPU).fill_(UNWRITTEN)) for _ in range(model.num_layers)]
    (seq,) = make_sequences([24], seed=4, vocab_size=model.vocab_size)
    run_step(model, caches, [(seq, 21)])
    taken.clear()  # a prefill is left to write_kv + attend
    for _ in range(3):
        run_step(model, caches, [(seq, 1)])
    assert taken == [True] * 3 * model.num_layers
    torch.testing.assert_close(torch.cat(seq.logits), reference_logits(model_dir, seq.tokens), atol=ATOL["onednn"],
                               rtol=0)  # the loosest, whichever linears are the default here


def test_model_reports_cache_geometry(tiny_model_dir: Callable[[str], Path]) -> None:
    model = load(tiny_model_dir("qwen3"))
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.vocab_size) == (4, 2, 96, 2048)
    assert model.head_dim != model.config.hidden_size // model.config.num_attention_heads


def test_sharded_checkpoint_loads_the_same_weights(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    source = tiny_model_dir("llama")
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="1MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    sharded, single = weights(load(tmp_path)), weights(load(source))
    assert sharded.keys() == single.keys()
    for name, tensor in single.items():
        assert torch.equal(sharded[name], tensor), name


def weights(model: CausalLM) -> dict[str, torch.Tensor]:
    """Every tensor the model computes with, packed linears unpacked, by checkpoint-style name."""
    found = dict(model.state_dict())
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear):
            found[f"{name}.weight"] = module.unpacked_weight()
            if module.bias is not None:
                found[f"{name}.bias"] = module.bias
    return found


def test_tied_embeddings_use_the_embedding_matrix(tiny_model_dir: Callable[[str], Path], linears: str) -> None:
    model_dir = tiny_model_dir("qwen2")
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as handle:
        assert "lm_head.weight" not in handle.keys()
    model = load(model_dir)
    # Packed, the head is a copy of the embedding in the GEMM library's layout; unpacked, the embedding itself.
    assert (model.lm_head is None) == (linears == "mkl")
    hidden = torch.randn(3, model.config.hidden_size)
    expected = hidden @ model.model.embed_tokens.weight.T
    torch.testing.assert_close(model.compute_logits(hidden), expected)
    assert torch.equal(weights(model).get("lm_head.weight", model.model.embed_tokens.weight),
                       model.model.embed_tokens.weight)


def test_untied_head_is_its_own_matrix(tiny_model_dir: Callable[[str], Path], linears: str) -> None:
    model = load(tiny_model_dir("llama"))
    assert model.lm_head is not None
    assert not torch.equal(weights(model)["lm_head.weight"], model.model.embed_tokens.weight)


def test_cpu_linears_are_packed_unless_switched_off(tiny_model_dir: Callable[[str], Path],
                                                             linears: str) -> None:
    def kinds(model: CausalLM) -> set[type]:
        return {type(module) for module in model.modules() if isinstance(module, (nn.Linear, PackedLinear))}

    expected = {"native": NativeLinear, "mkl-packed": MklPackedLinear, "onednn": OneDnnLinear, "mkl": nn.Linear}[linears]
    assert kinds(load(tiny_model_dir("qwen3"))) == {expected}
    # bf16 packs for oneDNN (MKL packs float32 only) where the CPU computes bf16; "mkl" keeps F.linear.
    bf16_native = torch.bfloat16 in native_cpu_dtypes()
    assert kinds(load(tiny_model_dir("qwen3"), torch.bfloat16)) == {
        OneDnnLinear if linears != "mkl" and bf16_native else nn.Linear}


def test_the_mkl_packed_linear_refuses_input_it_would_misread() -> None:
    if cpu_linear._mkl() is None:
        pytest.skip("this torch build exports no MKL packed GEMM")
    linear = MklPackedLinear(torch.randn(8, 16), None)
    assert linear(torch.ones(3, 16)).shape == (3, 8)
    with pytest.raises(ValueError, match="takes float32 CPU input, got torch.float64"):
        linear(torch.ones(3, 16, dtype=torch.float64))


def test_the_bf16_onednn_linear_equals_f_linear_bit_for_bit() -> None:
    """What transformers' bf16 forward computes, so bf16 accuracy is not lost to the packing."""
    if packed_linear_choice(torch.bfloat16, torch.device("cpu")) != "onednn":
        pytest.skip("this CPU or torch build has no native bf16 oneDNN packing")
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, generator=generator).bfloat16()
    bias = torch.randn(48, generator=generator).bfloat16()
    linear = OneDnnLinear(weight, bias)
    for rows in (1, 16, 300):
        x = torch.randn(rows, 40, generator=generator).bfloat16()
        assert torch.equal(linear(x), F.linear(x, weight, bias))
    assert torch.equal(linear.unpacked_weight(), weight)


def test_an_unknown_cpu_linear_choice_is_refused(tiny_model_dir: Callable[[str], Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SWITCH_ENV, "openblas")
    with pytest.raises(ValueError,
                       match="PAGEDLLM_CPU_LINEAR='openblas' is invalid: expected one of native, onednn, mkl-packed, mkl"):
        load(tiny_model_dir("llama"))


def test_bfloat16_load_casts_weights_and_returns_float32_logits(tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir("qwen3")
    model = load(model_dir, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    caches = make_caches(model, torch.bfloat16)
    (seq,) = make_sequences([20], seed=3, vocab_size=model.vocab_size)
    run_step(model, caches, [(seq, 20)])
    reference = reference_logits(model_dir, seq.tokens)
    assert (seq.logits[0] - reference).abs().max() < 0.1 * reference.abs().max()


@pytest.mark.parametrize(("avx512_bf16", "amx", "warned"), [(True, False, False), (False, True, False),
                                                         (False, False, True)])
def test_bfloat16_on_a_cpu_without_bf16_units_warns(
    avx512_bf16: bool, amx: bool, warned: bool, tiny_model_dir: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    # Plain F.linear: a CPU faked into bf16 units would otherwise take oneDNN's bf16 packing, which the real
    # CPU's oneDNN refuses where it lacks AVX-512 (the packing is not what this test is about).
    monkeypatch.setenv(SWITCH_ENV, "mkl")
    assert (torch.bfloat16 not in native_cpu_dtypes()) == warned
    with caplog.at_level(logging.WARNING, logger="pagedllm.platform.cpu_dtypes"):
        load(tiny_model_dir("llama"), torch.bfloat16)
        load(tiny_model_dir("llama"), torch.float32)
    messages = [record.getMessage() for record in caplog.records]
    assert messages == (["dtype=bfloat16 on this CPU has no native support (it needs avx512_bf16 or AMX): torch "
                         "emulates it, so it runs slower than float32, the CPU default"] if warned else [])
    assert unsupported_cpu_dtype_message(torch.bfloat16, torch.device("cuda")) is None


def copy_with_config(source: Path, destination: Path, **changes: object) -> Path:
    shutil.copytree(source, destination)
    config = json.loads((destination / "config.json").read_text())
    config.update(changes)
    (destination / "config.json").write_text(json.dumps(config))
    return destination


def rewrite_weights(model_dir: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = model_dir / "model.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_unknown_architecture_is_named(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    model_dir = copy_with_config(tiny_model_dir("llama"), tmp_path / "m", architectures=["FalconForCausalLM"])
    with pytest.raises(ValueError, match=r"FalconForCausalLM.*LlamaForCausalLM.*MistralForCausalLM.*Qwen3ForCausalLM"):
        load(model_dir)


def test_missing_tensor_is_named(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    model_dir = copy_with_config(tiny_model_dir("qwen2"), tmp_path / "m")
    rewrite_weights(model_dir, lambda t: t.pop("model.layers.2.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"missing tensors \['model\.layers\.2\.self_attn\.k_proj\.bias'\]"):
        load(model_dir)


def test_unexpected_tensor_is_named(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    model_dir = copy_with_config(tiny_model_dir("mistral"), tmp_path / "m")
    rewrite_weights(model_dir, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(256)}))
    with pytest.raises(ValueError, match=r"unexpected tensors \['model\.layers\.0\.self_attn\.q_proj\.bias'\]"):
        load(model_dir)


def test_wrong_shape_is_named(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    model_dir = copy_with_config(tiny_model_dir("llama"), tmp_path / "m")
    rewrite_weights(model_dir, lambda t: t.update({"model.norm.weight": torch.ones(128)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight: \(128,\) != \(256,\)"):
        load(model_dir)


def test_directory_without_weights_is_rejected(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    model_dir = copy_with_config(tiny_model_dir("llama"), tmp_path / "m")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        load(model_dir)


def test_length_dependent_rope_is_rejected(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    model_dir = copy_with_config(tiny_model_dir("llama"), tmp_path / "m", rope_parameters=rope)
    with pytest.raises(ValueError, match="rope_type='dynamic' is not supported"):
        load(model_dir)


def test_context_beyond_sliding_window_is_refused(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    model_dir = copy_with_config(tiny_model_dir("mistral"), tmp_path / "m", sliding_window=16)
    model = load(model_dir)
    assert model.sliding_window == 16
    caches = make_caches(model)
    (seq,) = make_sequences([17], seed=4, vocab_size=model.vocab_size)
    run_step(model, caches, [(seq, 16)])
    with pytest.raises(ValueError, match="sliding_window=16"):
        run_step(model, caches, [(seq, 1)])


def test_kv_caches_must_cover_every_layer(tiny_model_dir: Callable[[str], Path]) -> None:
    model = load(tiny_model_dir("llama"))
    (seq,) = make_sequences([4], seed=5, vocab_size=model.vocab_size)
    with pytest.raises(ValueError, match="kv_caches has 3 layers; the model has 4"):
        run_step(model, make_caches(model)[:3], [(seq, 4)])


@pytest.mark.parametrize("arch", ARCHES)
def test_greedy_decode_equals_transformers_generate(arch: str, tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir(arch)
    model = load(model_dir)
    caches = make_caches(model)
    new_tokens = 24
    (seq,) = make_sequences([20 + new_tokens], seed=6, vocab_size=model.vocab_size)
    prompt = seq.tokens[:20].clone()
    hf = transformers_model(model_dir)
    with torch.inference_mode():
        expected = hf.generate(prompt[None], max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)[0, 20:]
    run_step(model, caches, [(seq, 20)])
    for i in range(new_tokens):
        seq.tokens[20 + i] = seq.logits[-1][-1].argmax()
        if i + 1 < new_tokens:
            run_step(model, caches, [(seq, 1)])
    assert seq.tokens[20:].tolist() == expected.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_tables_give_the_computed_bits(dtype: torch.dtype) -> None:
    """A small model's cos/sin come from tables of every position, bit for bit what computing them per call
    gives (the same elementwise ops); a model with more positions than the cap computes them."""
    config = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=300,
                         rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    rotary = RotaryEmbedding(config, CPU)
    positions = torch.tensor([0, 7, 8, 150, 299, 5])
    cos, sin = rotary(positions, dtype)
    assert dtype in rotary._tables  # the lookup ran, not the computation
    want_cos, want_sin = rotary._compute(positions, dtype)
    assert cos.shape == want_cos.shape == (6, 1, 32) and cos.dtype == dtype
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    for position in positions.tolist():  # each row as its position alone computes it
        alone = rotary._compute(torch.tensor([position]), dtype)
        assert torch.equal(rotary(torch.tensor([position]), dtype)[0], alone[0])

    long = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=MAX_ROTARY_TABLE_VALUES)
    computed = RotaryEmbedding(long, CPU)
    computed(positions, dtype)
    assert not computed._tables
