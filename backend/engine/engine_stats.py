"""What the engine reports about itself: block use, queue lengths and token counts, for metrics and ``LLM.stats``."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagedllm.core.request import Sample
from pagedllm.engine.speculative import SpecDecodeCounts


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_blocks_total: int
    num_blocks_free: int
    peak_blocks_used: int
    peak_tokens_held: int  # tokens whose K/V sat in the cache when block use peaked
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_running: int
    num_waiting: int
    prompt_tokens_total: int
    generation_tokens_total: int
    block_size: int
    spec_decode: SpecDecodeCounts | None = None  # speculative decoding's counts; None when it is off
    enable_prefix_caching: bool = True
    # LoRA, as vLLM's lora_requests_info reports it: the adapter slots (0: no LoRA), and the adapters of the
    # running and of the waiting requests.
    max_loras: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()

    @property
    def num_blocks_used(self) -> int:
        return self.num_blocks_total - self.num_blocks_free

    @property
    def peak_waste_fraction(self) -> float:
        """Share of the KV slots allocated at peak that held no token."""
        slots = self.peak_blocks_used * self.block_size
        return 0.0 if slots == 0 else 1.0 - self.peak_tokens_held / slots


def adapters_of(seqs: Iterable[Sample]) -> tuple[str, ...]:
    """The adapters ``seqs`` run through, each once, sorted."""
    return tuple(sorted({seq.request.lora_name for seq in seqs if seq.request.lora_name is not None}))
