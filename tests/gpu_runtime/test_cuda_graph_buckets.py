"""The graph runner's pure parts: bucket sizes, bucket choice, which steps replay, and the padded
static inputs a replay leaves (CPU: capture=False runs the forward on the static buffers)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagoda.attention.backend import AttentionInputs
from pagoda.config import CacheConfig, EngineConfig, SchedulerConfig
from pagoda.model_executor.cuda_graphs import CUDAGraphRunner, bucket_for, capture_sizes


def test_capture_sizes():
    assert capture_sizes(256) == (1, 2, 4, 8, *range(16, 257, 16))
    assert capture_sizes(1) == (1,)
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(16) == (1, 2, 4, 8, 16)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(100)[-3:] == (80, 96, 100)


@pytest.mark.parametrize("max_batch", [1, 5, 16, 33, 256])
def test_every_batch_has_the_smallest_bucket_that_holds_it(max_batch):
    sizes = capture_sizes(max_batch)
    for batch in range(1, max_batch + 1):
        bucket = bucket_for(batch, sizes)
        assert bucket >= batch and not any(batch <= s < bucket for s in sizes)
    assert bucket_for(max_batch + 1, sizes) is None


def test_bucket_padding_is_bounded():
    sizes = capture_sizes(256)
    assert max(bucket_for(b, sizes) - b for b in range(1, 257)) == 15
    assert bucket_for(17, sizes) == 32 and bucket_for(16, sizes) == 16 and bucket_for(3, sizes) == 4


@pytest.mark.parametrize(
    "device,capturable,eager,experts,expected",
    [
        ("cuda", True, False, (), True),
        ("cuda", True, True, (), False),
        ("cuda", False, False, (), False),
        ("cuda", True, False, (0, 1), False),  # a mixture of experts reads its row counts on the host
        ("cpu", True, False, (), False),
        ("cpu", False, False, (), False),
    ],
)
def test_graphs_only_on_gpu_with_a_capturable_backend_unless_eager(device, capturable, eager, experts, expected):
    model = SimpleNamespace(expert_layers=experts)  # the one field of ModelConfig that counts here
    config = EngineConfig(
        model, CacheConfig(), SchedulerConfig(), torch.device(device), "any", capturable, enforce_eager=eager
    )
    assert config.use_cuda_graphs is expected


class EchoModel(torch.nn.Module):
    """Stands in for the decoder: returns its input ids as hidden states, and keeps the metadata."""

    def forward(self, input_ids, positions, kv_caches, metadata):
        self.metadata = metadata
        return torch.stack([input_ids.float(), positions.float()], dim=1)


class RecordingBackend:
    def build_metadata(self, inputs: AttentionInputs):
        return inputs


def decode_step(block_tables: list[list[int]], seq_lens: list[int]) -> AttentionInputs:
    n, bs = len(seq_lens), 4
    tables = torch.tensor(block_tables, dtype=torch.int32)
    slots = torch.tensor([t[(s - 1) // bs] * bs + (s - 1) % bs for t, s in zip(block_tables, seq_lens)])
    return AttentionInputs(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=slots,
        num_decodes=n,
        query_lens_cpu=(1,) * n,
        seq_lens_cpu=tuple(seq_lens),
        block_size=bs,
    )


@pytest.fixture
def runner():
    graphs = CUDAGraphRunner(
        EchoModel(),
        RecordingBackend(),
        [],
        sizes=(1, 2, 4, 8),
        max_context=40,
        block_size=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
        capture=False,
    )
    graphs.capture()
    return graphs


def test_capture_metadata_has_every_lane_decoding_at_max_context(runner):
    runner.replay(torch.tensor([7]), torch.tensor([3]), decode_step([[5]], [4]))
    meta = runner.model.metadata
    assert meta.num_decodes == meta.num_reqs == 1 and meta.seq_lens_cpu == (40,) and meta.query_lens_cpu == (1,)
    assert runner.block_tables.shape == (8, 10)


def test_replay_fills_real_lanes_and_pads_the_rest(runner):
    big = decode_step([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12], [13, 14, 15]], [9, 10, 11, 12, 9])
    runner.replay(torch.arange(100, 105), torch.arange(8, 13), big)  # bucket 8: lanes 5..7 padded
    small = decode_step([[20, 21], [22, 23], [24, 25]], [5, 6, 8])
    hidden = runner.replay(torch.tensor([1, 2, 3]), torch.tensor([4, 5, 7]), small)  # bucket 4: lane 3 padded
    assert hidden.tolist() == [[1, 4], [2, 5], [3, 7]]  # the real lanes' rows only
    meta = runner.model.metadata
    assert meta.num_reqs == 4
    assert runner.input_ids[:3].tolist() == [1, 2, 3]
    assert runner.slot_mapping[:4].tolist() == small.slot_mapping.tolist() + [-1]  # padded: no KV write
    assert runner.seq_lens[:4].tolist() == [5, 6, 8, 1]
    assert runner.block_tables[:3, :2].tolist() == [[20, 21], [22, 23], [24, 25]]
    assert runner.block_tables[3, 0] == 0  # the padded lane reads block 0
    assert runner.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
    assert meta.seq_lens.data_ptr() == runner.seq_lens.data_ptr()  # metadata views the static buffers


def test_only_pure_decode_steps_that_fit_replay(runner):
    assert runner.covers(decode_step([[1]] * 8, [3] * 8))
    assert not runner.covers(decode_step([[1]] * 9, [3] * 9))  # more than the largest bucket
    mixed = decode_step([[1], [2]], [3, 4])
    mixed = AttentionInputs(**{**mixed.__dict__, "num_decodes": 1, "query_lens_cpu": (1, 2)})
    assert not runner.covers(mixed)
    wide = decode_step([[1] * 11], [41])  # a table wider than max_context allows
    assert not runner.covers(wide)
