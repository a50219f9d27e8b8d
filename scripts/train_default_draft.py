"""Train the draft model that speculates for pagedllm's embedded default model.

The draft shares the default model's tokenizer (loaded from the shipped
checkpoint, not retrained) and its corpus: the running interpreter's stdlib
``.py`` sources with the same modules held out. Its loss is the next-token
loss, or with ``--distill-weight W`` that share of the KL divergence from the
target's next-token distribution to the draft's plus ``1 - W`` of the
next-token loss: acceptance is agreement with the target, not with the
corpus, so learning the target's distribution is what pays (the target's
forward makes each step dearer). It is small where it counts on
a CPU, few layers, since every drafted token costs one draft forward and a layer's cost there is
mostly fixed, whatever its width; it starts
as an early exit of the target (its embeddings, first layers with the MLP cut to the draft's width, and
final norm), with tied embeddings to stay under a quarter of the target's parameters. The number of
steps is fixed so reruns match; the held-out argmax agreement with the target
is recorded, the greedy acceptance rate per drafted token it predicts.

    nice -n 19 python scripts/train_default_draft.py --num-layers 1 --intermediate-size 512 --steps 4000 \
        --distill-weight 0.7 --draft-vocab-size 1024 --threads 1    # the shipped draft; its time: training.json

Writes to ``backend/default_model/draft/``: bf16 safetensors, config,
generation config, tokenizer and ``training.json``; with ``--draft-vocab-size N`` also
``draft_vocab.safetensors``, the N tokens most frequent in the training corpus, which the engine
cuts the draft's LM head to (``pagedllm.worker.draft_proposer``). ``--draft-vocab-only`` writes just
that file (and its record in ``training.json``) beside an already trained draft, without training:

    python scripts/train_default_draft.py --draft-vocab-size 1024 --draft-vocab-only    # the shipped one
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm
from train_default_model import HELD_OUT_MODULES, _portable, greedy_samples, mean_loss, pack
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

from pagedllm.testing.tokenizer_training import python_stdlib_texts
from pagedllm.worker.draft_proposer import DRAFT_VOCAB_FILE, DRAFT_VOCAB_TENSOR

REPO = Path(__file__).resolve().parent.parent
TARGET = REPO / "backend" / "default_model"


@dataclass(frozen=True, slots=True)
class DraftArgs:
    target: Path
    out_dir: Path
    steps: int
    batch_size: int
    seq_len: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    lr: float
    min_lr_rate: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    eval_every: int
    seed: int
    threads: int
    init_from_target: bool
    distill_weight: float  # share of the loss that is KL(target || draft); the rest is the next-token loss
    draft_vocab_size: int  # 0: the draft scores the whole vocabulary
    draft_vocab_only: bool  # write only the vocabulary beside an existing draft


def parse_args() -> DraftArgs:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=TARGET)
    p.add_argument("--out-dir", type=Path, default=TARGET / "draft")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=384)
    p.add_argument("--no-init-from-target", dest="init_from_target", action="store_false",
                   help="start from random weights instead of the target's first layers")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr-rate", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--distill-weight", type=float, default=0.0,
                   help="share of the loss that is the KL divergence from the target's distribution (0: none)")
    p.add_argument("--draft-vocab-size", type=int, default=0,
                   help="ship the N most frequent corpus tokens as the draft's vocabulary (0: the whole vocabulary)")
    p.add_argument("--draft-vocab-only", action="store_true",
                   help="only write the vocabulary of --draft-vocab-size beside the draft in --out-dir")
    args = DraftArgs(**vars(p.parse_args()))
    for name in ("steps", "batch_size", "seq_len", "eval_every", "threads"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if not 0.0 <= args.distill_weight <= 1.0:
        p.error(f"--distill-weight={args.distill_weight}: expected a share in [0, 1]")
    if args.draft_vocab_size < 0:
        p.error(f"--draft-vocab-size={args.draft_vocab_size}: expected 0 (whole vocabulary) or a token count")
    if args.draft_vocab_only and args.draft_vocab_size == 0:
        p.error("--draft-vocab-only needs --draft-vocab-size")
    return args


def frequent_tokens(tokens: torch.Tensor, vocab_size: int, count: int) -> torch.Tensor:
    """The ``count`` ids most frequent in ``tokens`` (ties to the lower id), ascending: the draft's vocabulary."""
    if not 0 < count <= vocab_size:
        raise ValueError(f"a draft vocabulary of {count} tokens: expected 1..{vocab_size}")
    counts = torch.bincount(tokens.flatten(), minlength=vocab_size)
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:count].sort().values


def write_draft_vocab(out_dir: Path, train: torch.Tensor, held_out: torch.Tensor, vocab_size: int,
                      count: int) -> dict[str, float]:
    """Write ``draft_vocab.safetensors`` from ``train``'s counts; returns its record: its size and the share
    of the training and held-out tokens it holds."""
    ids = frequent_tokens(train, vocab_size, count)
    save_file({DRAFT_VOCAB_TENSOR: ids}, out_dir / DRAFT_VOCAB_FILE, metadata={"format": "pt"})
    return {"size": count, "train_token_coverage": torch.isin(train.flatten(), ids).float().mean().item(),
            "held_out_token_coverage": torch.isin(held_out.flatten(), ids).float().mean().item()}


@torch.no_grad()
def agreement(draft: LlamaForCausalLM, target: LlamaForCausalLM, chunks: torch.Tensor, batch_size: int) -> float:
    """Fraction of positions where the draft's argmax equals the target's: greedy acceptance per token."""
    draft.eval()
    same, count = 0, 0
    for start in range(0, len(chunks), batch_size):
        batch = chunks[start : start + batch_size]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            same += int((draft(input_ids=batch).logits.argmax(-1) == target(input_ids=batch).logits.argmax(-1)).sum())
        count += batch.numel()
    draft.train()
    return same / count


def training_loss(draft: LlamaForCausalLM, target: LlamaForCausalLM, batch: torch.Tensor,
                  distill_weight: float) -> torch.Tensor:
    """Next-token loss, mixed with the per-token KL(target || draft) at ``distill_weight``."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = draft(input_ids=batch, labels=batch)
    if distill_weight == 0.0:
        return out.loss
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        teacher = target(input_ids=batch).logits
    vocab = teacher.shape[-1]
    # float32 softmaxes: bf16 log-probabilities are too coarse for the small differences KL measures.
    kl = torch.nn.functional.kl_div(out.logits.float().reshape(-1, vocab).log_softmax(-1),
                                    teacher.float().reshape(-1, vocab).log_softmax(-1),
                                    log_target=True, reduction="batchmean")
    return distill_weight * kl + (1.0 - distill_weight) * out.loss


@torch.no_grad()
def init_from_target(draft: LlamaForCausalLM, target: LlamaForCausalLM) -> None:
    """Start from the target's embeddings, its first layers and final norm, each MLP cut to the draft's width
    (its first channels): the draft then begins as an early exit of the target instead of from noise."""
    if draft.config.hidden_size != target.config.hidden_size:
        raise SystemExit("--init-from-target needs the target's hidden size")
    draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    draft.model.norm.weight.copy_(target.model.norm.weight)
    width = draft.config.intermediate_size
    for mine, theirs in zip(draft.model.layers, target.model.layers):
        for name, tensor in theirs.state_dict().items():
            if name.startswith("mlp."):
                tensor = tensor[:, :width] if name == "mlp.down_proj.weight" else tensor[:width]
            mine.state_dict()[name].copy_(tensor)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    started = time.time()

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = LlamaForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    train_texts = python_stdlib_texts(exclude=HELD_OUT_MODULES)
    held_out_texts = python_stdlib_texts(include=HELD_OUT_MODULES)
    random.Random(args.seed).shuffle(train_texts)
    train = pack(tokenizer, train_texts, args.seq_len)
    held_out = pack(tokenizer, held_out_texts, args.seq_len)
    print(f"train: {train.numel():,} tokens; held out: {held_out.numel():,} tokens", flush=True)
    vocab_size = target.config.vocab_size
    if args.draft_vocab_only:
        record_path = args.out_dir / "training.json"
        record = json.loads(record_path.read_text())
        record["draft_vocab"] = write_draft_vocab(args.out_dir, train, held_out, vocab_size, args.draft_vocab_size)
        record_path.write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps(record["draft_vocab"], indent=2), flush=True)
        return

    eot = tokenizer.eos_token_id
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=target.config.max_position_embeddings,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        tie_word_embeddings=True,
    )
    draft = LlamaForCausalLM(config)
    if args.init_from_target:
        init_from_target(draft, target)
    num_params = sum(p.numel() for p in draft.parameters())
    target_params = sum(p.numel() for p in target.parameters())
    if num_params * 4 > target_params:
        raise SystemExit(f"the draft has {num_params:,} parameters, more than a quarter of {target_params:,}")
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    schedule = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, args.warmup_steps, args.steps, min_lr_rate=args.min_lr_rate
    )
    eval_chunks = held_out[:16]
    eval_log: list[tuple[int, float, float]] = []
    order_rng = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(train), generator=order_rng)
    cursor = 0
    draft.train()
    for step in tqdm(range(1, args.steps + 1), desc="train", mininterval=10):
        if cursor + args.batch_size > len(order):
            order, cursor = torch.randperm(len(train), generator=order_rng), 0
        batch = train[order[cursor : cursor + args.batch_size]]
        cursor += args.batch_size
        loss = training_loss(draft, target, batch, args.distill_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), args.grad_clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.eval_every == 0 or step == args.steps:
            eval_log.append((step, mean_loss(draft, eval_chunks, args.batch_size, bf16=True),
                             agreement(draft, target, eval_chunks, args.batch_size)))
            tqdm.write(f"step {step} train {loss.item():.3f} held-out ce {eval_log[-1][1]:.3f} "
                       f"argmax agreement {eval_log[-1][2]:.3f} elapsed {time.time() - started:.0f}s")
    train_seconds = time.time() - started

    draft = draft.to(torch.bfloat16)
    draft.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(args.out_dir)
    tokenizer.save_pretrained(args.out_dir)
    shipped = LlamaForCausalLM.from_pretrained(args.out_dir, dtype=torch.float32)
    record = {
        "target": _portable(args.target),
        "held_out_modules": list(HELD_OUT_MODULES),
        "num_parameters": num_params,
        "target_num_parameters": target_params,
        "held_out_loss": mean_loss(shipped, held_out, args.batch_size, bf16=False),
        "held_out_argmax_agreement_with_target": agreement(shipped, target, held_out, args.batch_size),
        "train_seconds": round(train_seconds),
        "args": {k: _portable(v) for k, v in asdict(args).items()},
        "samples": greedy_samples(shipped, tokenizer),
        "eval_log": eval_log,
    }
    record["held_out_perplexity"] = math.exp(record["held_out_loss"])
    if args.draft_vocab_size:
        record["draft_vocab"] = write_draft_vocab(args.out_dir, train, held_out, vocab_size, args.draft_vocab_size)
    (args.out_dir / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "eval_log"}, indent=2), flush=True)


if __name__ == "__main__":
    main()
