"""NCCL tensor parallelism: TP=2 on two GPUs gives TP=1's greedy tokens, graphs off and on; one GPU: says so."""
import sys, tempfile, torch
from pathlib import Path
from pagedllm import LLM, SamplingParams
from pagedllm.testing.tiny_model import make_tiny_model

if torch.cuda.device_count() < 2:
    print(f"{torch.cuda.device_count()} GPU on this machine: NCCL tensor parallelism (TP=2) needs two; not run")
    sys.exit(0)
lengths = (5, 40, 130, 300, 17, 64, 3, 90)
prompts = [{"prompt_token_ids": torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
           for n in lengths]
params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
failures = 0
for arch in ("llama", "qwen3"):
    model = str(make_tiny_model(Path(tempfile.mkdtemp()) / arch, arch=arch))
    with LLM(model=model, dtype="float32", device="cuda") as single:
        want = [o.outputs[0].token_ids for o in single.generate(prompts, params)]
    for label, extra in (("graphs off", {}), ("graphs on", {"cuda_graphs": True, "max_num_seqs": 16})):
        with LLM(model=model, dtype="float32", device="cuda", tensor_parallel_size=2, **extra) as llm:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        same = sum(a == b for a, b in zip(want, got))
        failures += same != len(prompts)
        print(f"{arch} TP=2 over NCCL, {label}: {same}/{len(prompts)} prompts give TP=1's greedy tokens")
sys.exit(1 if failures else 0)
