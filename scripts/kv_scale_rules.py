"""Measured FP8 KV scales, rule against rule, on the embedded default model (the evidence for the rule in
``pagedllm.attention.kv_quant``): ``pagedllm bench kv_accuracy``'s default-model case, with the scale a first prefill
sets computed by each rule in turn (scale 1.0 is the bench's own row).

Rules: ``power-of-two`` (the engine's: the smallest power of two mapping twice the largest value into range),
``amax-2x`` (twice the largest value mapped to the format's largest, not rounded: the engine's rule before
14a4bc5) and ``vllm`` (vLLM's calculate_kv_scales: largest |K| / 200, largest |V| / 100, its K_SCALE_CONSTANT
and V_SCALE_CONSTANT defaults). Prints one markdown row per rule.
Usage: .venv/bin/python scripts/kv_scale_rules.py [power-of-two,amax-2x,vllm] [--prompts 8] [--new-tokens 256]
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch

from pagedllm_bench import kv_accuracy
from pagedllm.attention import kv_quant

Rule = Callable[[float, float, str], float]  # (largest |x|, format's largest, "k" or "v") -> scale
RULES: dict[str, Rule] = {
    "power-of-two": lambda amax, top, side: 2.0 ** math.ceil(math.log2(amax * 2.0 / top)),
    "amax-2x": lambda amax, top, side: amax * 2.0 / top,
    "vllm": lambda amax, top, side: amax / (200.0 if side == "k" else 100.0),
}


def measuring(rule: Rule) -> Callable[[kv_quant.LayerKvScales, torch.Tensor, torch.Tensor], None]:
    def measure(self: kv_quant.LayerKvScales, key: torch.Tensor, value: torch.Tensor) -> None:
        top = torch.finfo(self.cache_dtype).max
        for side, scale, rows in (("k", self.k, key), ("v", self.v, value)):
            scale.fill_(rule(float(rows.detach().abs().amax()), top, side))
        self.pending = False

    return measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rules", nargs="?", default=",".join(RULES))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    case = kv_accuracy._default_model_case(args.prompts, args.new_tokens)
    print("| rule | teacher-forced top-1 | mean KL | max KL | free-running agreement | mean first divergence |")
    print("|---|---|---|---|---|---|")
    for name in args.rules.split(","):
        kv_quant.LayerKvScales.measure = measuring(RULES[name])  # type: ignore[method-assign]
        kv_accuracy.ROWS = (("fp8_e4m3", True),)
        (row,) = kv_accuracy.measure(case)
        print(f"| {name} | {100 * row['top1']:.2f}% | {row['mean_kl']:.2e} | {row['max_kl']:.2e} | "
              f"{100 * row['free_running']:.1f}% | {row['first_divergence']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
