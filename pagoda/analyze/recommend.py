"""What the measured overlap means, in words: a verdict and the reasoning behind it. All of it is
an upper bound, because the simulation serves requests one at a time, in arrival order."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.analyze.kv_memory import KVFootprint
from pagoda.analyze.summary import Summary

RADIX_HEURISTIC = 0.60  # a published rule of thumb, not a law
DECODE_HEAVY = 0.5  # below this prefill share of all tokens, decode dominates
LOW_OVERLAP = 0.20
GRANULARITY_GAP = 0.05
NEAR_UNLIMITED = 0.9
MIN_REQUESTS = 20  # fewer say too little about a server's traffic to recommend on


@dataclass(frozen=True)
class Recommendation:
    verdict: str
    reasons: tuple[str, ...]


def recommend(summary: Summary, kv: KVFootprint | None = None) -> Recommendation:
    """`kv`: the model's KV size, to put cache sizes in `--kv-cache-memory` GiB."""
    if summary.requests < MIN_REQUESTS:
        caveat = (
            f"Too few requests to recommend: {summary.requests} logged, and overlap measured on fewer than "
            f"{MIN_REQUESTS} says little about a server's traffic. Log more requests and run this again."
        )
        return Recommendation(caveat, (_upper_bound(summary),))
    reasons = (
        _upper_bound(summary),
        _ttft(summary),
        _total_work(summary),
        _heuristic(summary),
        _decode_heavy(summary),
        _granularity(summary),
        _capacity(summary, kv),
    )
    return Recommendation(_verdict(summary), tuple(r for r in reasons if r))


def _is_decode_heavy(summary: Summary) -> bool:
    return summary.prefill_share is not None and summary.prefill_share < DECODE_HEAVY


def _verdict(summary: Summary) -> str:
    share = summary.unlimited.block.share
    if share >= RADIX_HEURISTIC and _is_decode_heavy(summary):
        return (
            "High overlap, but decode dominates: a prefix cache will cut TTFT far more than total "
            "work. Choose on decode throughput first, with prefix caching on."
        )
    if share >= RADIX_HEURISTIC:
        return (
            "Prefix caching is likely the deciding feature for this traffic: choose an engine with a "
            "radix prefix cache, and give it enough KV memory to keep the shared prefixes."
        )
    if share >= LOW_OVERLAP:
        return (
            "Moderate overlap: keep prefix caching on (it costs little), but it is unlikely to decide "
            "the choice of engine."
        )
    return "Little overlap: a prefix cache saves little on this traffic; choose an engine on other grounds."


def _upper_bound(summary: Summary) -> str:
    unlimited, bs = summary.unlimited, summary.block_size
    return (
        f"Upper bound: with an unlimited cache and requests served one at a time in arrival order, "
        f"{unlimited.block.share:.0%} of prompt tokens come from the cache in {bs}-token blocks "
        f"({unlimited.token.share:.0%} at token granularity). A real server reuses less: its KV memory "
        "is limited, and concurrent requests can arrive before the prefix they share is computed."
    )


def _ttft(summary: Summary) -> str:
    ratios = summary.hit_ratios["block"]
    return (
        "TTFT: prefill time grows with the prompt tokens a request computes, so for long prompts TTFT "
        f"falls roughly in proportion to the share reused. The median request reuses {ratios.median:.0%} "
        f"of its prompt; {ratios.no_reuse / summary.requests:.1%} of requests reuse nothing and gain nothing."
    )


def _total_work(summary: Summary) -> str:
    share = summary.unlimited.block.share
    if summary.prefill_share is None:
        return (
            "Total work: the log has no output token counts, so the prefill share of the work is "
            f"unknown; the cache skips at most {share:.0%} of prompt processing."
        )
    return (
        f"Total work: prompt tokens are {summary.prefill_share:.0%} of all tokens processed, so the cache "
        f"skips at most {summary.prefill_share * share:.0%} of all token computations. A decode step "
        "costs more time per token than prefill, so the share of GPU time saved is lower still."
    )


def _heuristic(summary: Summary) -> str:
    share = summary.unlimited.block.share
    side = "above" if share >= RADIX_HEURISTIC else "below"
    return (
        f"A heuristic, not a law: published engine comparisons hold that above about "
        f"{RADIX_HEURISTIC:.0%} shared-prefix traffic, a radix (prefix) cache is the deciding feature "
        f"when choosing an engine. This traffic is {side} that, at {share:.0%}."
    )


def _decode_heavy(summary: Summary) -> str:
    if summary.prefill_share is None:
        return (
            "If outputs are long compared with prompts (decode-heavy traffic), even a high hit rate "
            "saves little: a prefix cache removes prefill work only."
        )
    if _is_decode_heavy(summary):
        return (
            f"This traffic is decode-heavy (outputs are {1 - summary.prefill_share:.0%} of tokens): a high "
            "hit rate saves little here, because a prefix cache removes prefill work only."
        )
    return (
        f"Prompt tokens dominate ({summary.prefill_share:.0%} of tokens), so prefill savings carry weight; "
        "on decode-heavy traffic even a high hit rate would save little."
    )


def _granularity(summary: Summary) -> str:
    gap, bs = summary.unlimited.token.share - summary.unlimited.block.share, summary.block_size
    if gap >= GRANULARITY_GAP:
        return (
            f"Token granularity reuses {gap:.0%} of prompt tokens more than {bs}-token blocks: prompts "
            "diverge inside blocks and a block cache loses the partial block each time; a smaller "
            "`--block-size` recovers part of it."
        )
    return f"Token and {bs}-token block granularity differ by {gap:.1%} of prompt tokens: blocks cost little here."


def _capacity(summary: Summary, kv: KVFootprint | None) -> str | None:
    best = summary.unlimited.block.tokens
    if best == 0 or not summary.capacity_curve:
        return None
    for point in summary.capacity_curve:
        if point.block.tokens >= NEAR_UNLIMITED * best:
            return (
                f"Capacity: a cache of {point.cache_tokens:,} tokens keeps {NEAR_UNLIMITED:.0%} of the "
                f"unlimited reuse (LRU eviction in arrival order). "
                f"{_pool_size(point.cache_tokens, kv, summary.block_size)}"
            )
    return (
        f"Capacity: none of the simulated sizes keeps {NEAR_UNLIMITED:.0%} of the unlimited reuse; an "
        f"unlimited cache ends up holding {summary.distinct_tokens:,} tokens. "
        f"{_pool_size(summary.distinct_tokens, kv, summary.block_size)}"
    )


def _pool_size(tokens: int, kv: KVFootprint | None, block_size: int) -> str:
    """The Pagoda flag that holds `tokens` in its KV pool, in the flag's unit (GiB); the pool keeps
    one block of `block_size` tokens aside (its null block)."""
    if kv is None:
        return (
            f"On Pagoda, `--kv-cache-memory` (GiB) must hold those {tokens:,} tokens (at 2 x layers x KV heads "
            "x head size x 4 bytes each) beside the running requests' KV."
        )
    if kv.max_model_len is not None and tokens < kv.max_model_len:  # the server starts with no less
        return (
            f"On Pagoda the pool must hold one sequence of the context, {kv.max_model_len:,} tokens, to start: "
            f"`--kv-cache-memory {kv.gib_for(kv.max_model_len + block_size):.2f}` (GiB) for {kv.model} "
            f"({kv.bytes_per_token / 1024:.0f} KiB of float32 KV per token), which holds those {tokens:,} "
            "tokens beside the running requests' KV (or lower `--max-model-len` to shrink it)."
        )
    return (
        f"On Pagoda that is `--kv-cache-memory {kv.gib_for(tokens):.2f}` (GiB) for {kv.model} "
        f"({kv.bytes_per_token / 1024:.0f} KiB of float32 KV per token), plus room for the running requests' KV."
    )
