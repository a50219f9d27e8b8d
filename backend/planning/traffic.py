"""The traffic to plan for: a benchmark workload file, or Poisson arrivals with length distributions.

A workload file (``pagedllm.simulation.workloads``) without ``--qps`` arrives all
at once, as ``pagedllm bench throughput`` submits it; with ``--qps`` its
requests arrive as a Poisson process at that rate, in file order.

Length distributions (``--prompt-len``, ``--output-len``):
``N`` (fixed), ``LO-HI`` or ``uniform:LO-HI`` (uniform integers), and
``longtail:LO-HI`` (``LO·e^X``, ``X ~ Exp(1)``, clipped at ``HI``: the
benchmarks' long-tail outputs).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedllm.simulation.workloads import Workload, long_tail_lengths

SYNTHETIC_VOCAB = 32000  # prompt ids are random, so prefix caching finds nothing to share


@dataclass(frozen=True, slots=True)
class TimedRequest:
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    n: int = 1

    @property
    def max_len(self) -> int:
        return len(self.prompt_token_ids) + self.max_tokens


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    kind: str  # fixed, uniform, longtail
    low: int
    high: int

    @classmethod
    def parse(cls, text: str, flag: str) -> LengthDistribution:
        kind, _, bounds = text.rpartition(":")
        kind = kind or ("uniform" if "-" in bounds else "fixed")
        try:
            low, _, high = bounds.partition("-")
            dist = cls(kind, int(low), int(high or low))
        except ValueError as error:
            raise ValueError(
                f"{flag}={text!r} is invalid: expected N, LO-HI, uniform:LO-HI or longtail:LO-HI") from error
        if kind not in ("fixed", "uniform", "longtail") or not 1 <= dist.low <= dist.high:
            raise ValueError(f"{flag}={text!r} is invalid: expected N, LO-HI, uniform:LO-HI or longtail:LO-HI "
                             "with 1 <= LO <= HI")
        return dist

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        if self.kind == "longtail":
            return long_tail_lengths(rng, count, self.low, self.high)
        return rng.integers(self.low, self.high + 1, count)


def from_workload_file(path: Path, qps: float | None, seed: int = 0) -> list[TimedRequest]:
    workload = Workload.load(path)
    arrivals = _poisson_arrivals(qps, len(workload.requests), seed)
    return [TimedRequest(t, r.prompt_token_ids, r.max_tokens, r.n) for t, r in zip(arrivals, workload.requests)]


def synthetic(qps: float, duration_s: float, prompt_len: LengthDistribution, output_len: LengthDistribution,
              seed: int = 0) -> list[TimedRequest]:
    """Poisson arrivals at ``qps`` over ``duration_s`` seconds with the given lengths."""
    if qps <= 0:
        raise ValueError(f"--qps={qps} is invalid: expected > 0")
    if duration_s <= 0:
        raise ValueError(f"--duration={duration_s} is invalid: expected > 0")
    rng = np.random.default_rng(seed)
    count = max(1, int(rng.poisson(qps * duration_s)))
    arrivals = np.sort(rng.uniform(0.0, duration_s, count))
    prompts, outputs = prompt_len.sample(rng, count), output_len.sample(rng, count)
    return [TimedRequest(float(t), tuple(int(x) for x in rng.integers(1, SYNTHETIC_VOCAB, int(p))), int(o))
            for t, p, o in zip(arrivals, prompts, outputs)]


def _poisson_arrivals(qps: float | None, count: int, seed: int) -> list[float]:
    if qps is None:
        return [0.0] * count
    if qps <= 0:
        raise ValueError(f"--qps={qps} is invalid: expected > 0")
    gaps = np.random.default_rng(seed).exponential(1.0 / qps, count)
    return [float(t) for t in np.cumsum(gaps) - gaps[0]]
