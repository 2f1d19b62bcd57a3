"""Speculative decoding with a draft model: a smaller model with the target's vocabulary, run by
a ModelRunner of its own over a paged KV cache of its own, proposes its greedy next tokens.

The proposer keeps a mirror of each speculating request: its tokens as the draft last saw them
and how many of them the draft's KV cache holds. Before proposing, the mirror takes the target
request's tokens; where they differ from the mirror's (the target rejected a draft), the
mirror's computed count falls back to the common prefix, so rejected drafts' KV is rolled back
exactly as the target's is. A greedy draft is a point mass on its argmax, so the runner's
verification keeps a sampled request's tokens those of plain decoding (docs/speculative_decoding.md).

A step's drafting runs all its speculating requests together: k forward passes of the draft,
each over every request still drafting.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagoda.config import SpeculativeConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.outputs import SchedulerOutput
from pagoda.core.spec_decode import Proposer
from pagoda.model_executor.model_runner import ModelRunner
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


class DraftModelProposer(Proposer):
    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        assert config.draft is not None, "a draft model's engine config is made by EngineArgs"
        self.runner = ModelRunner(config.draft)
        num_blocks = self.runner.num_kv_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.compile_kernels()
        self.kv = KVCacheManager(num_blocks, config.draft.cache.block_size, enable_prefix_caching=False)
        self.mirrors: dict[str, Request] = {}  # request id -> the draft's view of it
        self._synced: dict[str, int] = {}  # request id -> the target's token count at the last sync

    @torch.inference_mode()
    def draft_batch(self, wanted: Sequence[tuple[Request, int]]) -> dict[str, list[int]]:
        """Each pass of the draft runs every request still drafting: its first pass catches a
        mirror up on the target's new tokens (a short prefill), the later ones decode."""
        drafts: dict[str, list[int]] = {request.request_id: [] for request, _ in wanted}
        active = [(self._sync(request), k) for request, k in wanted]
        while active:
            batch = []
            for mirror, k in active:
                num_new = mirror.num_tokens - mirror.num_computed_tokens
                blocks = self.kv.grow(mirror, num_new)
                if blocks is None:  # the draft's pool is full: this request proposes what it has
                    continue
                mirror.block_ids += blocks
                batch.append((mirror, k, num_new))
            if not batch:
                break
            step = SchedulerOutput(tuple((m, n) for m, _, n in batch), sum(n for _, _, n in batch))
            for (mirror, _, num_new), token in zip(batch, self.runner.execute(step).token_ids):
                assert token is not None
                mirror.num_computed_tokens += num_new
                mirror.append_token(token)
                drafts[mirror.request_id].append(token)
            active = [(m, k) for m, k, _ in batch if len(drafts[m.request_id]) < k]
        return drafts

    def finished(self, request_id: str) -> None:
        mirror = self.mirrors.pop(request_id, None)
        self._synced.pop(request_id, None)
        if mirror is not None:
            self.kv.free(mirror)

    def check_integrity(self) -> None:
        self.kv.check_integrity(list(self.mirrors.values()))
        for mirror in self.mirrors.values():
            assert mirror.num_computed_tokens < mirror.num_tokens, "a mirror computed past its tokens"

    def _sync(self, request: Request) -> Request:
        """The request's mirror, holding the target's tokens; computed only up to where they agree."""
        mirror = self.mirrors.get(request.request_id)
        if mirror is None:
            mirror = Request(request.request_id, list(request.token_ids), GREEDY, frozenset(), request.max_model_len)
            self.mirrors[request.request_id] = mirror
            self._synced[request.request_id] = request.num_tokens
            return mirror
        # tokens before the last sync's end are the target's, so agree; the last one is always
        # recomputed, for the logits of the first draft
        common = min(self._synced[request.request_id], mirror.num_computed_tokens, request.num_tokens - 1)
        limit = min(mirror.num_computed_tokens, request.num_tokens - 1)
        while common < limit and mirror.token_ids[common] == request.token_ids[common]:
            common += 1
        mirror.num_computed_tokens = common
        mirror.token_ids = list(request.token_ids)
        self._synced[request.request_id] = request.num_tokens
        return mirror
