"""Production paged attention in plain torch, for CPUs: runs the step's plan in every layer.

:mod:`pagedllm.attention.cpu_attention_plan` groups a step's sequences once;
per layer, :class:`CpuPagedAttention` then does one block-level ``index_select``
of K and one of V into buffers it reuses across layers and steps, and one SDPA
per group (plus one per shared prefix, merged by log-sum-exp).

The cache is stored head-major (:func:`new_cpu_cache`): ``[kv_heads, blocks,
block_size, head_dim]`` in memory, seen by everyone else as the usual
``[blocks, block_size, kv_heads, head_dim]``. Gathered blocks then give each
(sequence, KV head) one contiguous ``[tokens, head_dim]`` matrix, which SDPA
reads faster than keys strided by the heads (scripts/ab_cpu_choices.py); the gather costs
the same. Caches in the usual layout still work, through a copy per layer.

``pagedllm.kernels.reference.unified_attention_ref`` stays the simple,
independent oracle that the tests compare this against.

Float32 decodes skip the gather: :mod:`pagedllm.attention.native_decode` compiles a
small C routine on first use that reads their blocks in place, faster per layer than
this gather + SDPA path, which copies every block before reading it once (``pagedllm bench
kernels`` on a CPU). Float32 prefill chunks up to the measured
crossover (:func:`pagedllm.attention.cpu_attention_plan.native_prefill_wins`) skip it too:
:mod:`pagedllm.attention.native_prefill` reads their context in place, a cache-sized tile
at a time, which wins over gather + mask + SDPA for small chunks; bigger chunks stay
on SDPA, whose matrix products win there. Without a C compiler every decode and prefill
runs the torch path below, which stays tested on its own.

bf16 decodes go to the same compiled routine: bf16 queries and blocks widened to float32 (exactly)
as they are read, float32 sums, the output rounded to bf16 there, and the softmax weights rounded to
bf16 before they weigh V, as torch's bf16 SDPA rounds them (bf16 greedy tokens are judged against
transformers' bf16 forward, which runs that SDPA: tests/test_bf16_accuracy.py). In a step that mixes bf16
prefills and decodes, the decodes (and the short chunks the plan turns into decodes) take the same routine: a
decode is then computed the same way whether or not a prefill shares its step. bf16 prefill chunks run in
:mod:`pagedllm.attention.native_prefill_bf16` on CPUs with AMX, which reads them in place and computes their
softmax as torch's bf16 SDPA does; elsewhere they gather their blocks for SDPA. In a decode-only step,
:meth:`CpuPagedAttention.attend_qkv` writes and attends straight from each layer's fused q|k|v rows, with the routines' arguments bound once for the step
(:class:`pagedllm.attention.native_decode.BoundDecodes`).

8-bit (fp8) caches are read without a full-precision copy of the cache: the compiled routine
dequantizes one block at a time as it reads it, and the torch path dequantizes the blocks it
gathered for the step, into a reused buffer.
Gathering in cache-sized chunks so that SDPA reads K/V from cache gained no more than
the host's noise, so it was left out. ``pagedllm bench kernels`` on a
CPU prints this backend next to the reference. The figures behind these choices:
RESULTS.md, "Figures behind the code's choices".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels.reference import FP8_DTYPES, quantize_kv_ref, write_kv_ref
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.platform.cpu_memory import advise_huge_pages
from pagedllm.attention.cpu_attention_plan import CpuAttentionPlan, DecodeBatch, PrefillChunk, SharedPrefix, StepLayout
from pagedllm.attention.native_decode import BoundDecodes, NativeDecode
from pagedllm.attention.native_prefill import NativePrefill
from pagedllm.attention.native_prefill_bf16 import NativePrefillBf16


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and each query row's log-sum-exp (natural log): SDPA's CPU flash kernel, which returns
    both, on CPU; the plain formula elsewhere (this backend on a GPU is for debugging only)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
    return math_attention_with_lse(q, k, v, mask, scale)


def math_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_with_lse` spelled out in float32, on any device."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v.float()).to(q.dtype), lse


def new_cpu_cache(shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed ``[blocks, block_size, kv_heads, head_dim]`` cache stored head-major (see the module doc)."""
    num_blocks, block_size, num_kv_heads, head_dim = shape
    cache = torch.empty((num_kv_heads, num_blocks, block_size, head_dim), dtype=dtype, device=device)
    advise_huge_pages(cache)  # before the zeros touch it: decodes read it in scattered blocks (cpu_memory)
    return cache.zero_().permute(1, 2, 0, 3)


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    """``[kv_heads, blocks, block_size, head_dim]``: contiguous for :func:`new_cpu_cache`'s caches."""
    return cache.permute(2, 0, 1, 3)


def _is_head_major(cache: torch.Tensor) -> bool:
    """Whether ``cache`` is laid out as :func:`new_cpu_cache` makes it: checked on the strides, without
    building the permuted view, because every layer asks twice per step."""
    num_blocks, block_size, _, head_dim = cache.shape
    return cache.stride() == (block_size * head_dim, head_dim, num_blocks * block_size * head_dim, 1)


def _native_fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The compiled decode routine reads float32 or 8-bit head-major caches for float32 queries on the CPU."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == v_cache.dtype
            and k_cache.dtype in (torch.float32, *FP8_DTYPES) and _is_head_major(k_cache) and _is_head_major(v_cache))


def _bf16_fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """bf16 queries over head-major bf16 caches: the compiled decode routine reads them for the step's decodes."""
    return (q.device.type == "cpu" and q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16
            and _is_head_major(k_cache) and _is_head_major(v_cache))


def _scale_value(scale: torch.Tensor | None) -> float:
    return 1.0 if scale is None else float(scale)


def write_kv_cpu(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; negative = padded token, skipped
    k_scale: torch.Tensor | None = None,  # fp32 [1]: an 8-bit k_cache's scale (None: 1.0)
    v_scale: torch.Tensor | None = None,
) -> None:
    """:func:`pagedllm.kernels.reference.write_kv_ref`'s contract, with ``index_copy_`` into
    head-major caches, one call per cache instead of the reference's indexed assignment, a few
    times faster (measured: RESULTS.md, "Figures behind the code's choices").
    An 8-bit cache gets the rows quantized as the reference does, copied as bytes (torch has
    no ``index_copy_`` for fp8)."""
    if not (_is_head_major(k_cache) and _is_head_major(v_cache)):
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    if slot_mapping.numel() and bool(slot_mapping.min() < 0):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if slot_mapping.numel() == 0:
        return
    slots = slot_mapping.long()
    for cache, new, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        num_kv_heads, head_dim = cache.shape[2:]
        target = _head_major(cache).view(num_kv_heads, -1, head_dim)
        if cache.dtype in FP8_DTYPES:
            new = quantize_kv_ref(new, 1.0 if scale is None else scale, cache.dtype).view(torch.uint8)
            target = target.view(torch.uint8)
        target.index_copy_(1, slots, new.to(target.dtype).transpose(0, 1))


def _rows_fit(key: torch.Tensor, value: torch.Tensor) -> bool:
    """Key and value rows the compiled write reads: float32, heads dense within a row, one row stride."""
    head_dim = key.shape[2]
    return (value.dtype == torch.float32 and key.shape == value.shape and key.stride(0) == value.stride(0)
            and key.stride()[1:] == value.stride()[1:] == (head_dim, 1))


def _bf16_rows_fit(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """bf16 rows as :func:`_rows_fit` lays them out, for head-major bf16 caches on the CPU: the compiled write
    copies them."""
    head_dim = key.shape[2]
    return (key.device.type == "cpu" and key.dtype == value.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16
            and key.shape == value.shape and key.stride(0) == value.stride(0)
            and key.stride()[1:] == value.stride()[1:] == (head_dim, 1)
            and _is_head_major(k_cache) and _is_head_major(v_cache))


class CpuPagedAttention:
    """Runs a planned step's attention; owns the gather and scratch buffers reused across layers and steps.

    With ``native`` (:func:`pagedllm.attention.native_decode.load_native_decode`), float32 and bf16 decodes
    run in the compiled routine, which reads their blocks in place; with ``native_prefill``
    (:func:`pagedllm.attention.native_prefill.load_native_prefill`), so do the float32 prefill
    chunks the plan's crossover rule gives it; with ``native_prefill_bf16``
    (:func:`pagedllm.attention.native_prefill_bf16.load_native_prefill_bf16`), the bf16 prefill chunks of
    steps whose decodes ``native`` runs. Everything else, and everything when all three are ``None``, runs in
    torch.
    """

    def __init__(self, native: NativeDecode | None = None, native_prefill: NativePrefill | None = None,
                 native_prefill_bf16: NativePrefillBf16 | None = None) -> None:
        self._native = native
        self._native_prefill = native_prefill
        self._native_prefill_bf16 = native_prefill_bf16
        self._buffers: dict[tuple[str, torch.dtype, torch.device, tuple[int, ...]], torch.Tensor] = {}
        # The current step's plan and its decodes bound for attend_qkv (None: the step is not for it).
        self._bound: tuple[object, BoundDecodes | None] = (None, None)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        """:func:`write_kv_cpu`'s contract and shapes; float32 rows go through the compiled routine (quantized
        there for an 8-bit cache), and so do bf16 rows into bf16 caches, which copies each row once from where it lies (e.g. a fused qkv output)
        instead of two ``index_copy_`` passes."""
        if self._native is not None and ((_native_fits(key, k_cache, v_cache) and _rows_fit(key, value))
                                         or _bf16_rows_fit(key, value, k_cache, v_cache)):
            self._native.write_kv(key, value, _head_major(k_cache), _head_major(v_cache), slot_mapping,
                                  _scale_value(k_scale), _scale_value(v_scale))
        else:
            write_kv_cpu(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def attend(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,  # fp32 [1]: an 8-bit k_cache's scale (None: 1.0)
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of each sequence's new tokens over its paged context: [num_tokens, num_heads, head_dim]."""
        plan = metadata.plan
        if not isinstance(plan, CpuAttentionPlan):
            raise ValueError("metadata.plan is not a CpuAttentionPlan: call the backend's plan(metadata) once per "
                             "step and pass its result to every layer")
        num_tokens, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        if self._native is not None and _bf16_fits(q, k_cache, v_cache):
            return self._attend_bf16(self._native, q, k_cache, v_cache, plan, scale)
        fits = _native_fits(q, k_cache, v_cache)
        native = self._native if fits else None
        native_prefill = self._native_prefill if fits and head_dim % 16 == 0 else None
        layout = plan.layout(block_size, q.dtype, native is not None, native_prefill is not None,
                             native_prefill is not None and native_prefill.wide)
        group = num_heads // num_kv_heads

        if layout.decodes_in_order:
            keys = self._gather("k", k_cache, layout.block_ids, k_scale, q.dtype)
            values = self._gather("v", v_cache, layout.block_ids, v_scale, q.dtype)
            attended, _ = self._decode(q, keys, values, layout.decodes[0], scale, group)
            return attended.reshape(num_tokens, num_heads, head_dim)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, as the compiled routine writes it
        # Per token and head, the log-sum-exp of its scores: what merging a shared prefix's part needs.
        lse = (self._reused(("lse", torch.float32, q.device, ()), num_tokens * num_heads).view(num_tokens, num_heads)
               if layout.shared_prefixes or layout.native_decodes is not None else None)
        if native is not None and layout.native_decodes is not None:
            q = q.contiguous()
            native(q, _head_major(k_cache), _head_major(v_cache), layout.native_decodes, scale, out, lse,
                   _scale_value(k_scale), _scale_value(v_scale))
        if native_prefill is not None and layout.native_prefills is not None:
            q = q.contiguous()
            native_prefill(q, _head_major(k_cache), _head_major(v_cache), layout.native_prefills, scale, out,
                           _scale_value(k_scale), _scale_value(v_scale))
        if not layout.block_ids.numel():  # the usual step: the compiled routines read every sequence in place
            return out
        # [kv_heads, rows, block_size, head_dim]
        keys = self._gather("k", k_cache, layout.block_ids, k_scale, q.dtype)
        values = self._gather("v", v_cache, layout.block_ids, v_scale, q.dtype)
        for batch in layout.decodes:
            attended, batch_lse = self._decode(q.index_select(0, batch.tokens), keys, values, batch, scale, group)
            out.index_copy_(0, batch.tokens, attended.reshape(batch.num_seqs, num_heads, head_dim))
            if lse is not None:
                lse.index_copy_(0, batch.tokens, batch_lse.reshape(batch.num_seqs, num_heads).float())
        for prefix in layout.shared_prefixes:
            self._merge_shared_prefix(q, keys, values, prefix, scale, out, lse)
        self._prefills(q, keys, values, layout.prefills, scale, out)
        return out

    def attend_qkv(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   metadata: AttentionMetadata, scale: float, num_heads: int) -> torch.Tensor | None:
        """A decode-only step's :meth:`write_kv` and :meth:`attend` in one, from a layer's fused, rotated q|k|v rows
        [num_tokens, (num_heads + 2 kv_heads) * head_dim]: the attention as [num_tokens, num_heads * head_dim], in
        a buffer that the next layer's call overwrites. ``None`` where the compiled routine does not take the step
        (prefills, 8-bit caches, no compiler): the caller then splits q|k|v and calls the two."""
        plan, bound = self._bound
        if plan is not metadata.plan or (bound is not None and not bound.fits(qkv, k_cache, v_cache, scale)):
            bound = self._bind(qkv, k_cache, v_cache, metadata, scale, num_heads)
            self._bound = (metadata.plan, bound)
        return None if bound is None else bound(qkv, k_cache, v_cache)

    def _bind(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
              scale: float, num_heads: int) -> BoundDecodes | None:
        plan = metadata.plan
        if (self._native is None or not isinstance(plan, CpuAttentionPlan) or qkv.dim() != 2 or qkv.dtype not in (torch.float32, torch.bfloat16) or qkv.device.type != "cpu"
                or not qkv.is_contiguous() or not (k_cache.dtype == v_cache.dtype == qkv.dtype)
                or not (_is_head_major(k_cache) and _is_head_major(v_cache))):
            return None
        layout = self._layout_for(plan, k_cache, qkv.dtype)  # the layout attend derives for the step
        decodes = layout.native_decodes
        if decodes is None or len(decodes.rows) != qkv.shape[0]:  # some tokens are prefills: the routine is not theirs
            return None
        bound = self._native.bind(decodes, metadata.slot_mapping, qkv, k_cache, num_heads, scale)
        return bound if bound.fits(qkv, k_cache, v_cache, scale) else None

    def _layout_for(self, plan: CpuAttentionPlan, k_cache: torch.Tensor, dtype: torch.dtype) -> StepLayout:
        """The layout of a step whose decodes the compiled routine runs: a bf16 step gives its prefill chunks to
        the AMX routine where that is built and takes the shapes."""
        amx = dtype == torch.bfloat16 and self._amx_fits(k_cache)
        return plan.layout(k_cache.shape[1], dtype, True, amx, amx)

    def _amx_fits(self, k_cache: torch.Tensor) -> bool:
        return self._native_prefill_bf16 is not None and self._native_prefill_bf16.fits(k_cache.shape[3],
                                                                                        k_cache.shape[1])

    def _attend_bf16(self, native: NativeDecode, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     plan: CpuAttentionPlan, scale: float) -> torch.Tensor:
        """A bf16 step: its decodes in the compiled routine, which widens the bf16 queries and blocks to float32
        (exact) as it reads them in place, sums in float32 and rounds each output to bf16 once, as torch's bf16
        SDPA does, reading and writing the bf16 rows itself (no float32 copy of them is made here); its prefill
        chunks in the AMX routine (:mod:`pagedllm.attention.native_prefill_bf16`), which reads them in place too,
        or, where that cannot run, in SDPA over their gathered blocks. A step of decodes gathers nothing."""
        num_tokens, num_heads, head_dim = q.shape
        layout = self._layout_for(plan, k_cache, torch.bfloat16)
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
        # The routines read query rows at any row stride (q is usually a view of the fused q|k|v rows).
        rows = q if q.stride()[1:] == (head_dim, 1) else q.contiguous()
        if layout.native_decodes is not None:  # None for a step of prefills only
            lse = self._reused(("lse", torch.float32, q.device, ()), num_tokens * num_heads).view(num_tokens,
                                                                                                  num_heads)
            native(rows, _head_major(k_cache), _head_major(v_cache), layout.native_decodes, scale, out, lse)
        if layout.native_prefills is not None and self._native_prefill_bf16 is not None:
            self._native_prefill_bf16(rows, _head_major(k_cache), _head_major(v_cache), layout.native_prefills,
                                      scale, out)
        if layout.prefills:
            keys = self._gather("k", k_cache, layout.block_ids, None, q.dtype)
            values = self._gather("v", v_cache, layout.block_ids, None, q.dtype)
            self._prefills(q, keys, values, layout.prefills, scale, out)
        return out

    @staticmethod
    def _prefills(
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        keys: torch.Tensor,  # [num_kv_heads, rows, block_size, head_dim]
        values: torch.Tensor,
        chunks: tuple[PrefillChunk, ...],
        scale: float,
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim]: each chunk's rows are written
    ) -> None:
        """Each prefill chunk's causal SDPA over its own gathered context."""
        num_kv_heads, _, _, head_dim = keys.shape
        group = q.shape[1] // num_kv_heads
        for chunk in chunks:
            rows = slice(chunk.first_block, chunk.first_block + chunk.num_blocks)
            k = keys[:, rows].reshape(1, num_kv_heads, -1, head_dim)[:, :, : chunk.seq_len]
            v = values[:, rows].reshape(1, num_kv_heads, -1, head_dim)[:, :, : chunk.seq_len]
            queries = q[chunk.start : chunk.start + chunk.query_len].transpose(0, 1)[None]
            attended = F.scaled_dot_product_attention(queries, k, v, attn_mask=chunk.mask, scale=scale,
                                                      is_causal=chunk.mask is None, enable_gqa=group > 1)
            out[chunk.start : chunk.start + chunk.query_len] = attended[0].transpose(0, 1)

    @staticmethod
    def _decode(
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
        keys: torch.Tensor,  # [num_kv_heads, rows, block_size, head_dim]
        values: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
        group: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_seqs, num_kv_heads, group, head_dim] and its log-sum-exps [num_seqs, num_kv_heads, group]:
        a KV head's query heads attend as one query block."""
        num_kv_heads, _, _, head_dim = keys.shape
        rows = slice(batch.first_block, batch.first_block + batch.num_seqs * batch.blocks_per_seq)
        k = keys[:, rows].view(num_kv_heads, batch.num_seqs, -1, head_dim).transpose(0, 1)
        v = values[:, rows].view(num_kv_heads, batch.num_seqs, -1, head_dim).transpose(0, 1)
        queries = q.reshape(batch.num_seqs, num_kv_heads, group, head_dim)
        return attention_with_lse(queries, k, v, batch.mask, scale)

    @staticmethod
    def _merge_shared_prefix(
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        keys: torch.Tensor,  # [num_kv_heads, rows, block_size, head_dim]
        values: torch.Tensor,
        prefix: SharedPrefix,
        scale: float,
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim]: each token's attention over its own blocks
        lse: torch.Tensor,  # [num_tokens, num_heads]: their log-sum-exps
    ) -> None:
        """Fold the shared prefix's attention into ``out`` for the tokens that share it."""
        num_kv_heads, _, _, head_dim = keys.shape
        num_seqs, num_heads = prefix.tokens.numel(), q.shape[1]
        rows = slice(prefix.first_block, prefix.first_block + prefix.num_blocks)
        k = keys[:, rows].reshape(1, num_kv_heads, -1, head_dim)
        v = values[:, rows].reshape(1, num_kv_heads, -1, head_dim)
        # Every sharing sequence's query heads of one KV head, stacked as that head's query rows.
        queries = q.index_select(0, prefix.tokens).view(num_seqs, num_kv_heads, -1, head_dim).transpose(0, 1)
        shared, shared_lse = attention_with_lse(queries.reshape(1, num_kv_heads, -1, head_dim), k, v, None, scale)
        shared = shared.view(num_kv_heads, num_seqs, -1, head_dim).transpose(0, 1).reshape(num_seqs, num_heads, head_dim)
        shared_lse = shared_lse.view(num_kv_heads, num_seqs, -1).transpose(0, 1).reshape(num_seqs, num_heads).float()
        own, own_lse = out.index_select(0, prefix.tokens), lse.index_select(0, prefix.tokens)
        total = torch.logaddexp(own_lse, shared_lse)
        merged = own * torch.exp(own_lse - total)[..., None] + shared * torch.exp(shared_lse - total)[..., None]
        out.index_copy_(0, prefix.tokens, merged.to(out.dtype))

    def _reused(self, key: tuple[str, torch.dtype, torch.device, tuple[int, ...]], size: int) -> torch.Tensor:
        """``size`` elements of the buffer named by ``key`` (name, dtype, device, shape), grown as needed:
        valid until the next call with the same key."""
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < size:
            buffer = torch.empty(max(size, 1), dtype=key[1], device=key[2])
            self._buffers[key] = buffer
        return buffer[:size]

    def _gather(self, name: str, cache: torch.Tensor, block_ids: torch.Tensor, scale: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
        """The blocks ``block_ids`` of every KV head, ``[kv_heads, rows, block_size, head_dim]``, written
        into a buffer that grows as needed and is reused after; an 8-bit cache's blocks are gathered
        as bytes and then dequantized to ``dtype`` into a second such buffer.

        Whole blocks are copied as flat rows: index_select on a 3-D view is a little faster
        than on the 4-D cache (measured: RESULTS.md, "Figures behind the code's choices").
        """
        if cache.dtype in FP8_DTYPES:
            stored = self._gather_rows(name, cache, block_ids)
            readable = self._reused((name + "-dequantized", dtype, cache.device, tuple(stored.shape[2:])),
                                    stored.numel()).view(stored.shape)
            readable.copy_(stored)
            return readable.mul_(_scale_value(scale))
        return self._gather_rows(name, cache, block_ids)

    def _gather_rows(self, name: str, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """:meth:`_gather` without dequantizing: the cache's own dtype."""
        num_blocks, block_size, num_kv_heads, head_dim = cache.shape
        width = block_size * head_dim
        size = num_kv_heads * block_ids.numel() * width
        buffer = self._reused((name, cache.dtype, cache.device, (block_size, num_kv_heads, head_dim)), size)
        rows = buffer.view(num_kv_heads, block_ids.numel(), width)
        source = _head_major(cache).reshape(num_kv_heads, num_blocks, width)  # a copy unless head-major
        torch.index_select(source, 1, block_ids, out=rows)
        return rows.view(num_kv_heads, block_ids.numel(), block_size, head_dim)
