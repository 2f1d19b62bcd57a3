"""Speculative decoding with a draft model: a smaller model with the target's vocabulary, run by
a ModelRunner of its own over a paged KV cache of its own, proposes its greedy next tokens.

The proposer keeps a mirror of each speculating request: its tokens as the draft last saw them
and how many of them the draft's KV cache holds. Before proposing, the mirror takes the target
request's tokens; where they differ from the mirror's (the target rejected a draft), the
mirror's computed count falls back to the common prefix, so rejected drafts' KV is rolled back
exactly as the target's is. A greedy draft is a point mass on its argmax, so the runner's
rejection sampling keeps a sampled request's distribution exactly the target's.

Drafting runs request by request (one forward pass of the draft per proposed token and request):
simple and correct, not yet batched across requests.
"""

from __future__ import annotations

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
        self.kv = KVCacheManager(num_blocks, config.draft.cache.block_size, enable_prefix_caching=False)
        self.mirrors: dict[str, Request] = {}  # request id -> the draft's view of it
        self._synced: dict[str, int] = {}  # request id -> the target's token count at the last sync

    @torch.inference_mode()
    def draft(self, request: Request, k: int) -> list[int]:
        mirror = self._sync(request)
        drafts: list[int] = []
        for _ in range(k):
            num_new = mirror.num_tokens - mirror.num_computed_tokens
            blocks = self.kv.grow(mirror, num_new)
            if blocks is None:  # the draft's pool is full: propose what there is
                break
            mirror.block_ids += blocks
            token = self.runner.execute(SchedulerOutput(((mirror, num_new),), num_new)).token_ids[0]
            assert token is not None
            mirror.num_computed_tokens += num_new
            mirror.append_token(token)
            drafts.append(token)
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
