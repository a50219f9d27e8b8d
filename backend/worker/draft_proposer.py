"""Draft-model proposals: a smaller checkpoint with the target's tokenizer guesses the next ``k`` tokens.

The draft runs in its own ``ModelRunner`` (its own K/V caches, as many blocks as the target's) and
is indexed by the target's block tables: a sequence's draft K/V sits at the same block ids and
slots as its target K/V, so the scheduler's blocks hold both and a draft block is freed with the
request's blocks. Each call first catches the draft up on every token its sequences gained since
the last call (a prompt chunk the target just prefilled, the verified run and the target's new
token), in one forward over all of them, which also gives the first draft's logits; then ``k - 1``
one-token steps feed each draft back. The draft writes K/V for its own guesses beyond the last
token; those slots are rewritten by the target's next step, and only tokens the target has
committed count as caught up.

A sequence starts from nothing, even after a prefix-cache hit: a cached block's draft K/V may never
have been written (the draft runs only for steps that speculate), so the draft recomputes the
prefix itself, rewriting the shared block's draft slots with the same values. Preempted and
finished sequences are forgotten.

Each draft is drawn from ``q``: the draft's argmax for a greedy request, else its softmax at the
request's temperature, with the sample's own generator. The rows of ``q`` are returned for the
rejection sampler.

A sequence stops drafting for the step after a guess whose probability under the draft (its softmax
at temperature 1 for a greedy request, ``q`` for a sampled one) is below ``confidence_threshold``: the
guess itself is still proposed (its logits are paid for; it costs only a verifying row), but the draft
steps after it would mostly feed a rejected token. The stop depends on the draft's own draws only, so
rejection sampling stays exact.

A draft may score only part of the vocabulary (FR-Spec's frequency-ranked subset, EAGLE-3's ``d2t``): its
folder's ``draft_vocab.safetensors`` holds ``draft_to_target``, the target ids its LM head keeps, and the
loader cuts the head to those rows (:func:`restrict_lm_head`). The head is the costliest single operation
of a small draft's forward and most of its weight bytes, and tokens outside a corpus's frequent ones are
rarely accepted anyway. Drafts are then drawn over the subset and mapped back to target ids, and ``q`` is
zero outside it, which is the draft's true proposal distribution, so rejection sampling stays exact. The
draft's input embedding keeps the whole vocabulary: the target's tokens, any of them, are what it reads.
"""
from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import AutoConfig, AutoTokenizer

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.core.model_source import DEFAULT_MODEL_DIR, resolve_model_dir
from pagedllm.core.request import Sample
from pagedllm.layers.cpu_linear import PackedLinear, packed_linear, packed_linear_choice
from pagedllm.models.llama import CausalLM
from pagedllm.worker.input_batch import StepInputs
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.sampler import argmax_rows

DEFAULT_DRAFT_DIR = DEFAULT_MODEL_DIR / "draft"
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
DRAFT_VOCAB_TENSOR = "draft_to_target"


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """One sequence to propose for: how many drafts it may take and how to draw them."""

    seq: Sample
    max_drafts: int  # 0: only catch up (the sequence is mid-prefill or has no room)
    temperature: float  # 0: greedy
    generator: torch.Generator | None


@dataclass(frozen=True, slots=True)
class Proposal:
    token_ids: list[int]
    probs: torch.Tensor | None  # float32 [len(token_ids), vocab]: q at each draft; None for greedy (one-hot)


def draft_model_dir(model: str | None, target_dir: Path, revision: str | None) -> Path:
    """``speculative_config.model``'s folder; unset, the draft shipped beside the embedded default model."""
    if model is not None:
        return resolve_model_dir(model, revision, field="speculative_config.model")
    if target_dir.resolve() == DEFAULT_MODEL_DIR.resolve():
        return DEFAULT_DRAFT_DIR
    raise ValueError("speculative_config.model is required with method 'draft_model' (only the embedded default "
                     "model ships a draft)")


def check_draft_checkpoint(draft_dir: Path, target_dir: Path, target_vocab_size: int, max_model_len: int) -> None:
    """Refuse, naming the field, a draft that cannot propose for the target."""
    config = AutoConfig.from_pretrained(draft_dir)
    if config.vocab_size != target_vocab_size:
        raise ValueError(f"speculative_config.model={str(draft_dir)!r} has vocab_size {config.vocab_size}, the "
                         f"target has {target_vocab_size}: the draft must share the target's vocabulary")
    if AutoTokenizer.from_pretrained(draft_dir).get_vocab() != AutoTokenizer.from_pretrained(target_dir).get_vocab():
        raise ValueError(f"speculative_config.model={str(draft_dir)!r} has a tokenizer different from the "
                         "target's: drafted token ids would mean other text")
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and limit < max_model_len:
        raise ValueError(f"speculative_config.model={str(draft_dir)!r} allows contexts of {limit} tokens, fewer "
                         f"than the target's max_model_len={max_model_len}: lower max_model_len or use a draft "
                         "with a longer context")


def load_draft_vocab(draft_dir: Path, vocab_size: int) -> torch.Tensor | None:
    """The target ids the draft in ``draft_dir`` scores (int64, distinct, in ``[0, vocab_size)``), from its
    ``draft_vocab.safetensors``; None without that file (the draft scores the whole vocabulary)."""
    path = draft_dir / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as handle:
            names = list(handle.keys())
            if names != [DRAFT_VOCAB_TENSOR]:
                raise ValueError(f"draft vocabulary {str(path)!r} holds tensors {names}: expected exactly "
                                 f"[{DRAFT_VOCAB_TENSOR!r}]")
            ids = handle.get_tensor(DRAFT_VOCAB_TENSOR)
    except SafetensorError as error:
        raise ValueError(f"draft vocabulary {str(path)!r} is not a readable safetensors file ({error})") from error
    if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"draft vocabulary {str(path)!r}: {DRAFT_VOCAB_TENSOR} must be a non-empty 1-D integer "
                         f"tensor, got {ids.dtype} of shape {tuple(ids.shape)}")
    ids = ids.to(torch.int64)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"draft vocabulary {str(path)!r} holds token id {low if low < 0 else high}, outside the "
                         f"target's vocabulary of {vocab_size}")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"draft vocabulary {str(path)!r} lists a token id more than once")
    return ids


def restrict_lm_head(model: CausalLM, token_ids: torch.Tensor) -> None:
    """Cut ``model``'s LM head to the rows of ``token_ids``: its logits' column ``i`` is then token
    ``token_ids[i]``'s. The embedding keeps every row (a tied head gets a copy of its rows)."""
    head = model.lm_head
    if head is None:
        weight = model.model.embed_tokens.weight
    elif isinstance(head, PackedLinear):
        weight = head.unpacked_weight()
    elif isinstance(head, nn.Linear) and head.bias is None:
        weight = head.weight
    else:
        raise ValueError(f"a draft vocabulary needs a bias-free linear LM head, not {type(head).__name__}")
    rows = weight.detach()[token_ids.to(weight.device)].contiguous()
    packing = packed_linear_choice(rows.dtype, rows.device)
    if packing is not None:
        model.lm_head = packed_linear(rows, None, packing)
        return
    linear = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    linear.weight = nn.Parameter(rows, requires_grad=False)
    model.lm_head = linear


class DraftProposer:
    def __init__(self, runner: ModelRunner, num_speculative_tokens: int, max_num_batched_tokens: int,
                 confidence_threshold: float = 0.0, vocab: torch.Tensor | None = None) -> None:
        """``vocab``: the target ids of the draft's logit columns when its head is cut
        (:func:`restrict_lm_head`); None when it scores the whole vocabulary."""
        self.runner = runner
        self.k = num_speculative_tokens
        self.confidence_threshold = confidence_threshold
        self.block_size = runner.block_size
        self.device = runner.device
        self.max_tokens = max_num_batched_tokens
        self._caught_up: dict[int, int] = {}  # seq id -> leading tokens whose draft K/V is written
        self.vocab_size = runner.model.vocab_size
        # The cut head's column -> target id, as a tensor (to spread q) and as a list (to map a drawn id).
        self._vocab: tuple[torch.Tensor, list[int]] | None = (None if vocab is None
                                                               else (vocab.to(self.device), vocab.tolist()))

    def propose(self, requests: Seq[DraftRequest]) -> list[Proposal]:
        """Catch every sequence up to its committed tokens; then up to ``max_drafts`` drafts each."""
        # The newest token's K/V needs a slot, which a sequence without room to draft may not have yet.
        ends = [len(r.seq.token_ids) if self._room(r) > 0 else r.seq.num_computed_tokens for r in requests]
        first = self._catch_up(requests, ends)
        drafting = [i for i, r in enumerate(requests) if first[i] is not None and self._room(r) > 0]
        tokens: dict[int, list[int]] = {i: [] for i in drafting}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in drafting}
        logits = torch.stack([first[i] for i in drafting]) if drafting else None
        step = 0
        while drafting and logits is not None:
            doubted: set[int] = set()  # the sequences whose guess this step ends their drafting
            for i, (token, q, confident) in zip(drafting, self._draw(logits, [requests[i] for i in drafting])):
                tokens[i].append(token)
                if q is not None:
                    probs[i].append(q)
                if not confident:
                    doubted.add(i)
            step += 1
            drafting = [i for i in drafting if i not in doubted and len(tokens[i]) < self._room(requests[i])]
            if drafting:
                logits = self._decode([requests[i].seq for i in drafting], [tokens[i][-1] for i in drafting], step)
        return [Proposal(tokens.get(i, []), torch.stack(probs[i]) if probs.get(i) else None)
                for i in range(len(requests))]

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget sequences that finished or were preempted (their blocks, and so their draft K/V, are gone)."""
        for seq_id in seq_ids:
            self._caught_up.pop(seq_id, None)

    def _room(self, request: DraftRequest) -> int:
        """Drafts ``request`` may take: each but the last writes draft K/V after its last token, which must
        land in a block the sequence holds (the scheduler allocates lookahead slots for speculating ones)."""
        seq = request.seq
        capacity = len(seq.block_ids) * self.block_size
        return max(0, min(request.max_drafts, self.k, capacity - (len(seq.token_ids) - 1)))

    def _catch_up(self, requests: Seq[DraftRequest], ends: Seq[int]) -> list[torch.Tensor | None]:
        """Forward every sequence's tokens from where its draft K/V ends to ``ends``, chunked to the token
        budget; returns the logits after each one's last token (None when it had nothing to catch up)."""
        last: list[torch.Tensor | None] = [None] * len(requests)
        pending = [(i, self._caught_up.get(r.seq.seq_id, 0), end) for i, (r, end) in enumerate(zip(requests, ends))]
        pending = [(i, start, end) for i, start, end in pending if start < end]
        while pending:
            budget = self.max_tokens
            chunks: list[tuple[int, int, int]] = []
            rest: list[tuple[int, int, int]] = []
            for i, start, end in pending:
                take = min(end - start, budget)
                if take > 0:
                    chunks.append((i, start, start + take))
                    budget -= take
                if start + take < end:
                    rest.append((i, start + take, end))
            seqs = [requests[i].seq for i, _, _ in chunks]
            logits = self._forward(seqs, [(start, stop) for _, start, stop in chunks])
            for row, (i, _, stop) in enumerate(chunks):
                self._caught_up[requests[i].seq.seq_id] = stop
                if stop == ends[i]:
                    last[i] = logits[row]
            pending = rest
        return last

    def _decode(self, seqs: Seq[Sample], token_ids: Seq[int], step: int) -> torch.Tensor:
        """Feed each sequence's latest draft, ``step`` positions after its last token."""
        spans = [(len(seq.token_ids) - 1 + step, len(seq.token_ids) + step) for seq in seqs]
        return self._forward(seqs, spans, token_ids)

    def _forward(self, seqs: Seq[Sample], spans: Seq[tuple[int, int]],
                 token_ids: Seq[int] | None = None) -> torch.Tensor:
        """Draft logits after the last token of each ``seqs[i]``'s positions ``spans[i]``; the tokens are the
        sequences' own (or ``token_ids``, one per sequence, beyond them).

        Built from plain lists, each turned into a tensor once: a draft forward of a few positions is cheap
        enough that a numpy call per array (aranges, cumsum, fancy indexing) was a tenth of its cost."""
        bs = self.block_size
        positions = [p for start, stop in spans for p in range(start, stop)]
        ends = list(accumulate(stop - start for start, stop in spans))
        ids = (list(token_ids) if token_ids is not None
               else [t for seq, (start, stop) in zip(seqs, spans) for t in seq.token_ids[start:stop]])
        width = max(len(seq.block_ids) for seq in seqs)
        table = [seq.block_ids if len(seq.block_ids) == width else [*seq.block_ids, *[0] * (width - len(seq.block_ids))]
                 for seq in seqs]
        slots = [seq.block_ids[p // bs] * bs + p % bs for seq, (start, stop) in zip(seqs, spans)
                 for p in range(start, stop)]
        seq_lens = [stop for _, stop in spans]
        put = self._put
        attn = AttentionMetadata(query_start_loc=put([0, *ends], np.int32), seq_lens=put(seq_lens, np.int32),
                                 block_table=put(table, np.int32), slot_mapping=put(slots, np.int64),
                                 max_query_len=max(stop - start for start, stop in spans), max_seq_len=max(seq_lens))
        inputs = StepInputs(put(ids, np.int64), put(positions, np.int64), attn, put([end - 1 for end in ends], np.int64))
        logits = self.runner.run(inputs, ())
        if logits is None:
            raise RuntimeError("the draft model returned no logits")
        return logits.float()

    def _draw(self, logits: torch.Tensor, requests: Seq[DraftRequest]) -> list[tuple[int, torch.Tensor | None, bool]]:
        """Each row's guess, its ``q`` (None for greedy: one-hot) and whether the draft's probability of it
        reaches the confidence threshold."""
        threshold = self.confidence_threshold
        to_target = None if self._vocab is None else self._vocab[1]
        greedy = argmax_rows(logits).tolist()
        # A greedy guess is the argmax, so its probability is the softmax's largest.
        top = logits.softmax(dim=-1).amax(dim=-1).tolist() if threshold else None
        drawn: list[tuple[int, torch.Tensor | None, bool]] = []
        for row, request in enumerate(requests):
            if request.temperature == 0.0:
                token = greedy[row]
                drawn.append((token if to_target is None else to_target[token], None,
                              top is None or top[row] >= threshold))
                continue
            q = (logits[row] / request.temperature).softmax(dim=-1)
            token = int(torch.multinomial(q, 1, generator=request.generator))
            confident = float(q[token]) >= threshold
            if self._vocab is not None:
                # The rejection sampler reads q over the target's vocabulary: zero where the draft cannot propose.
                columns, ids = self._vocab
                q = q.new_zeros(self.vocab_size).index_copy_(0, columns, q)
                token = ids[token]
            drawn.append((token, q, confident))
        return drawn

    def _put(self, values: list[int] | list[list[int]], dtype: type[np.integer]) -> torch.Tensor:
        tensor = torch.from_numpy(np.array(values, dtype=dtype))  # a third of torch.tensor's cost on a list
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)
