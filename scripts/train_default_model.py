"""Train pagedllm's embedded default model on the Python standard library.

A small Llama-architecture model and its byte-level BPE tokenizer are trained
from scratch on the running interpreter's own stdlib ``.py`` sources (PSF
license), so the repository can ship a checkpoint that writes recognizable
Python without downloading anything. A few whole modules are held out for
evaluation. The number of steps is fixed (not a time budget) so reruns match.

    nice -n 15 python scripts/train_default_model.py    # ~27 min on 2 idle CPU cores

Writes to ``backend/default_model/``: bf16 safetensors weights, config,
generation config, tokenizer and ``training.json`` (held-out modules,
hyperparameters, losses, sample completions); and the loss curve PNG.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

from pagedllm.testing.tokenizer_training import python_stdlib_texts, train_bpe_tokenizer

REPO = Path(__file__).resolve().parent.parent
HELD_OUT_MODULES = ("json", "csv", "textwrap", "fractions", "heapq", "shlex", "queue", "graphlib")
SAMPLE_PROMPTS = ("def fibonacci(n):", "class Stack:", "import os\n\ndef")


@dataclass(frozen=True, slots=True)
class TrainArgs:
    out_dir: Path
    plot: Path
    steps: int
    batch_size: int
    seq_len: int
    vocab_size: int
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


def parse_args() -> TrainArgs:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=REPO / "backend" / "default_model")
    p.add_argument("--plot", type=Path, default=REPO / "docs" / "default_model_loss.png")
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=6)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=768)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-rate", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = TrainArgs(**{k: v for k, v in vars(p.parse_args()).items()})
    for name in ("steps", "batch_size", "seq_len", "eval_every", "threads"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def pack(tokenizer: PreTrainedTokenizerFast, texts: list[str], seq_len: int) -> torch.Tensor:
    """Concatenate documents, each led by <|endoftext|>, into [n, seq_len] rows."""
    stream: list[int] = []
    for ids in tokenizer(texts)["input_ids"]:
        stream.extend(ids)
    rows = len(stream) // seq_len
    return torch.tensor(stream[: rows * seq_len], dtype=torch.long).view(rows, seq_len)


@torch.no_grad()
def mean_loss(model: LlamaForCausalLM, chunks: torch.Tensor, batch_size: int, bf16: bool) -> float:
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(chunks), batch_size):
        batch = chunks[start : start + batch_size]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=batch, labels=batch).loss
        predicted = batch.shape[0] * (batch.shape[1] - 1)
        total += loss.item() * predicted
        count += predicted
    model.train()
    return total / count


@torch.no_grad()
def greedy_samples(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> dict[str, str]:
    samples = {}
    for prompt in SAMPLE_PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=64, do_sample=False)
        samples[prompt] = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=False)
    return samples


def plot(path: Path, train: list[tuple[int, float]], held_out: list[tuple[int, float]], floor: float) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    steps, losses = zip(*train)
    # A 20-step moving average: single-batch losses are too noisy to read.
    smooth = [sum(losses[max(0, i - 19) : i + 1]) / len(losses[max(0, i - 19) : i + 1]) for i in range(len(losses))]
    ax.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8)
    ax.plot(steps, smooth, color="tab:blue", label="train (20-step mean)")
    ax.plot(*zip(*held_out), "o-", color="tab:orange", label="held-out modules")
    ax.axhline(floor, color="gray", linestyle="--", linewidth=0.8, label="random init (ln vocab)")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="pagedllm default model on Python stdlib")
    ax.set_ylim(0, floor + 0.5)
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _portable(value: object) -> object:
    """Paths inside the repository are recorded relative to it, so the record is machine-independent."""
    if isinstance(value, Path):
        return value.resolve().relative_to(REPO).as_posix() if value.resolve().is_relative_to(REPO) else str(value)
    return value


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    started = time.time()

    train_texts = python_stdlib_texts(exclude=HELD_OUT_MODULES)
    held_out_texts = python_stdlib_texts(include=HELD_OUT_MODULES)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe_tokenizer(train_texts, args.vocab_size, out_dir=args.out_dir)
    # Shuffle documents once so a batch mixes packages instead of walking the tree in order.
    random.Random(args.seed).shuffle(train_texts)
    train = pack(tokenizer, train_texts, args.seq_len)
    held_out = pack(tokenizer, held_out_texts, args.seq_len)
    print(f"train: {len(train_texts)} files, {train.numel():,} tokens; held out: {held_out.numel():,} tokens", flush=True)

    eot = tokenizer.eos_token_id
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=args.seq_len,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    num_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay
    )
    schedule = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, args.warmup_steps, args.steps, min_lr_rate=args.min_lr_rate
    )
    eval_chunks = held_out[:16]
    random_init = mean_loss(model, eval_chunks, args.batch_size, bf16=True)
    train_log: list[tuple[int, float]] = []
    eval_log: list[tuple[int, float]] = [(0, random_init)]
    order_rng = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(train), generator=order_rng)
    cursor = 0
    model.train()
    for step in tqdm(range(1, args.steps + 1), desc="train", mininterval=10):
        if cursor + args.batch_size > len(order):
            order, cursor = torch.randperm(len(train), generator=order_rng), 0
        batch = train[order[cursor : cursor + args.batch_size]]
        cursor += args.batch_size
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        train_log.append((step, loss.item()))
        if step % args.eval_every == 0 or step == args.steps:
            eval_log.append((step, mean_loss(model, eval_chunks, args.batch_size, bf16=True)))
            tqdm.write(f"step {step} train {loss.item():.3f} held-out {eval_log[-1][1]:.3f} "
                       f"lr {schedule.get_last_lr()[0]:.2e} elapsed {time.time() - started:.0f}s")
    train_seconds = time.time() - started

    # Ship bf16 and evaluate what ships, in float32 as pagedllm's exactness tests run it.
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    model.save_pretrained(args.out_dir)
    shipped = LlamaForCausalLM.from_pretrained(args.out_dir, dtype=torch.float32)
    final = mean_loss(shipped, held_out, args.batch_size, bf16=False)
    samples = greedy_samples(shipped, tokenizer)
    plot(args.plot, train_log, eval_log, math.log(config.vocab_size))
    record = {
        "held_out_modules": list(HELD_OUT_MODULES),
        "train_tokens_available": train.numel(),
        "held_out_tokens": held_out.numel(),
        "num_parameters": num_params,
        "random_init_held_out_loss": random_init,
        "held_out_loss": final,
        "held_out_perplexity": math.exp(final),
        "train_seconds": round(train_seconds),
        "args": {k: _portable(v) for k, v in asdict(args).items()},
        "samples": samples,
        "eval_log": eval_log,
    }
    (args.out_dir / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "eval_log"}, indent=2), flush=True)


if __name__ == "__main__":
    main()
