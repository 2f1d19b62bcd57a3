"""What a verification step costs against a plain decode step, by batch size: the measurement
behind SPEC_MAX_BATCH_SIZE (pagoda/config.py).

For each batch size B, B requests with random 256-token prompts are prefilled, then the engine
times STEPS decode steps with speculation off and STEPS steps in which every request verifies k
drafts (k + 1 query rows each; the drafts are the model's own greedy tokens, so the steps cost what
real ones do whatever is accepted). Speculating a step pays while the time ratio stays below the
mean acceptance length (1 + accepted drafts per request per step); the largest B where it does
for the acceptance a workload reaches is the batch limit.

    python benchmarks/spec_batch_limit.py [--batches 1 2 4 8 16 32] [--k 4] [--steps 20] [--model PATH]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagoda import LLM, SamplingParams
from pagoda.config import SpeculativeConfig
from pagoda.core.spec_decode import Proposer


class Always(Proposer):
    """k drafts for every request: the tokens its plain run produced next (all accepted)."""

    def __init__(self, config: SpeculativeConfig, expected: dict[str, list[int]]) -> None:
        super().__init__(config)
        self.expected = expected

    def draft(self, request, k):
        future = self.expected[request.request_id.rsplit("-", 1)[0]]
        return future[request.num_output_tokens : request.num_output_tokens + k]


def time_steps(
    llm: LLM, prompts: list[list[int]], steps: int, tag: str, warmup: int = 0
) -> tuple[float, list[list[int]]]:
    """Seconds per decode step over `steps` steps once every prompt is prefilled and `warmup`
    more steps ran (a draft model's first step prefills the prompts into its own cache), and the
    outputs."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps * 8 + 8, ignore_eos=True)
    ids = [engine.add_request(p, params, request_id=f"{tag}{i}-x") for i, p in enumerate(prompts)]
    while any(r.is_prefilling for r in engine.core.scheduler.requests.values()):
        engine.step()
    for _ in range(warmup):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - start) / steps
    outputs = [list(engine.core.scheduler.requests[f"{i}#0"].output_token_ids) for i in ids]
    engine.core.finish_requests([f"{i}#0" for i in ids], "abort")
    for i in ids:
        engine.outputs.drop(f"{i}#0")
    return elapsed, outputs


def draft_limit(args: argparse.Namespace) -> None:
    """Real draft-model steps against plain ones, by batch size, alternated `rounds` times."""
    spec = {"model": args.draft, "num_speculative_tokens": args.k, "max_batch_size": 4096}
    if args.draft_quantization:
        spec["quantization"] = args.draft_quantization
    llm = LLM(args.model, kv_cache_memory=4, max_model_len=1024, max_num_batched_tokens=4096, speculative_config=spec)
    scheduler = llm.engine.core.scheduler
    proposer = scheduler.proposer
    rng = random.Random(0)
    print(f"draft {args.draft} ({args.draft_quantization or 'as loaded'}), k={args.k}")
    print(f"{'batch':>6}{'decode ms':>11}{'spec ms':>9}{'accept len':>12}{'speed-up':>10}")
    for batch in args.batches:
        plain, speculated, lengths = [], [], []
        for r in range(args.rounds):
            prompts = [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(batch)]
            scheduler.proposer = None
            plain.append(time_steps(llm, prompts, args.steps, f"p{batch}-{r}-", warmup=2)[0])
            scheduler.proposer = proposer
            before = llm.engine.core.stats()
            speculated.append(time_steps(llm, prompts, args.steps, f"d{batch}-{r}-", warmup=2)[0])
            after = llm.engine.core.stats()
            drafts = after.spec_num_drafts - before.spec_num_drafts
            lengths.append(1 + (after.spec_num_accepted_tokens - before.spec_num_accepted_tokens) / max(drafts, 1))
        p, d, n = statistics.median(plain), statistics.median(speculated), statistics.mean(lengths)
        print(f"{batch:>6}{p * 1e3:>11.1f}{d * 1e3:>9.1f}{n:>12.2f}{n * p / d:>10.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default=None)
    parser.add_argument("--draft", default=None, help="a draft model: time real drafting steps")
    parser.add_argument("--draft-quantization", default=None)
    parser.add_argument("--rounds", type=int, default=2, help="--draft: plain/speculative alternations per batch")
    args = parser.parse_args()
    if args.draft:
        return draft_limit(args)
    llm = LLM(args.model, kv_cache_memory=4, max_model_len=1024, max_num_batched_tokens=4096)
    rng = random.Random(0)
    print(f"k={args.k}; speculating pays while the ratio is below the mean acceptance length")
    print(f"{'batch':>6}{'decode ms':>11}{'verify ms':>11}{'ratio':>8}")
    for batch in args.batches:
        prompts = [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(batch)]
        llm.engine.core.scheduler.proposer = None
        plain, outputs = time_steps(llm, prompts, args.steps * (args.k + 1), f"p{batch}-")
        config = SpeculativeConfig(num_speculative_tokens=args.k, max_batch_size=4096)
        expected = {f"v{batch}-{i}": out for i, out in enumerate(outputs)}
        llm.engine.core.scheduler.proposer = Always(config, expected)
        verify, _ = time_steps(llm, prompts, args.steps, f"v{batch}-")
        print(f"{batch:>6}{plain * 1e3:>11.1f}{verify * 1e3:>11.1f}{verify / plain:>8.2f}")


if __name__ == "__main__":
    main()
