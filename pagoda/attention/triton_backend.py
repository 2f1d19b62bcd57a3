"""Paged attention in Triton: the GPU serving path.

Each layer's forward is at most four launches: store this step's keys and values, then one
attention launch for the decodes (or a split-KV launch and its merge) and one for the rest
(prefills, prefill chunks after cached context, speculative verification). Everything a launch
grid needs is a host integer taken from AttentionInputs' *_cpu tuples when the step's metadata
is built, so forward never waits on the device and can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from pagoda.attention import triton_kernels as kernels
from pagoda.attention.backend import AttentionBackend, AttentionInputs, BackendSupport

_SMS_WITHOUT_CUDA = 132  # an H100/H200; only the split-KV heuristic reads it


@dataclass(frozen=True)
class RequestRange:
    """Consecutive requests attended by one launch; tensors are views of AttentionInputs'."""

    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], positions in the whole batch
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks]
    num_tokens: int
    max_query_len: int
    max_seq_len: int


@dataclass(frozen=True)
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]
    decodes: RequestRange | None  # the batch's first num_decodes requests, one token each
    others: RequestRange | None  # the rest


class TritonAttentionBackend(AttentionBackend[TritonAttentionMetadata]):
    name = "triton"
    # any head_dim: the kernels pad it to a power of two and mask the rest
    support = BackendSupport(
        devices=("cuda", "cpu"), dtypes=(torch.float32, torch.bfloat16, torch.float16), cuda_graphs=True
    )

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        if device.type == "cpu" and not triton.knobs.runtime.interpret:
            return "on the CPU it runs only under Triton's interpreter (TRITON_INTERPRET=1: tests, dry runs)"
        return None

    def __init__(self, decode_splits: int | None = None):
        """decode_splits: slices per decode context for split-KV (1 to MAX_SPLITS); None chooses per
        step, 1 never splits."""
        assert decode_splits is None or 1 <= decode_splits <= kernels.MAX_SPLITS, decode_splits
        self._forced_splits = decode_splits

    def first_use_shapes(
        self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, max_model_len: int
    ) -> tuple[tuple[int, int], ...]:
        """A prompt of the shortest query length of each tile config (choose_config's; the rest of a
        launch's integers are unspecialized, so one variant serves each), then a decode long enough
        to be split with its merge. The interpreter compiles nothing."""
        if triton.knobs.runtime.interpret:
            return ()
        configs = kernels.tile_configs(num_heads // num_kv_heads, head_dim, dtype, max_model_len)
        shapes = [(query_len, query_len) for query_len in configs.values()]
        split_context = 2 * kernels.MIN_SPLIT_KEYS  # slices of MIN_SPLIT_KEYS: split where the GPU has room
        if split_context <= max_model_len:
            shapes.append((1, split_context))
        return tuple(shapes)

    def build_metadata(self, inputs: AttentionInputs) -> TritonAttentionMetadata:
        nd, nr = inputs.num_decodes, inputs.num_reqs
        return TritonAttentionMetadata(
            slot_mapping=inputs.slot_mapping,
            decodes=_request_range(inputs, 0, nd),
            others=_request_range(inputs, nd, nr),
        )

    def forward(self, query, key, value, kv_cache, metadata: TritonAttentionMetadata, scale: float):
        kernels.store_kv(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        decodes, others = metadata.decodes, metadata.others
        if decodes is not None:
            splits = self.decode_splits(metadata, kv_cache)
            if splits > 1:
                kernels.paged_attention_split(
                    out, query, kv_cache, *_tensors(decodes), scale, num_tokens=decodes.num_tokens, num_splits=splits
                )
            else:
                kernels.paged_attention(
                    out, query, kv_cache, *_tensors(decodes), scale, num_tokens=decodes.num_tokens, max_query_len=1
                )
        if others is not None:
            kernels.paged_attention(
                out,
                query,
                kv_cache,
                *_tensors(others),
                scale,
                num_tokens=others.num_tokens,
                max_query_len=others.max_query_len,
            )
        return out

    def decode_splits(self, metadata: TritonAttentionMetadata, kv_cache: torch.Tensor) -> int:
        """Slices per decode context this step (1: no split-KV). A CUDA graph captured with it keeps
        the choice; any slice count is correct for any context length, only speed differs."""
        decodes = metadata.decodes
        if decodes is None:
            return 1
        if self._forced_splits is not None:
            return self._forced_splits
        num_reqs = decodes.seq_lens.shape[0]
        return kernels.choose_decode_splits(num_reqs, kv_cache.shape[3], decodes.max_seq_len, _num_sms(kv_cache.device))


def _request_range(inputs: AttentionInputs, first: int, end: int) -> RequestRange | None:
    if first == end:
        return None
    query_lens = inputs.query_lens_cpu[first:end]
    return RequestRange(
        query_start_loc=inputs.query_start_loc[first : end + 1],
        seq_lens=inputs.seq_lens[first:end],
        block_tables=inputs.block_tables[first:end],
        num_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(inputs.seq_lens_cpu[first:end]),
    )


def _tensors(r: RequestRange) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return r.query_start_loc, r.seq_lens, r.block_tables


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _SMS_WITHOUT_CUDA
    return torch.cuda.get_device_properties(device).multi_processor_count
