from __future__ import annotations

import pytest

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.prefix_cache import PrefixMatch
from pagoda.request import Request

from .fake_engine import make_request

BS = 4


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def computed(kv: KVCacheManager, request: Request, num_new: int) -> None:
    """What the scheduler does after a step: the tokens are computed, full blocks get cached."""
    request.num_computed_tokens += num_new
    request.block_ids = kv.cache_blocks(request)


def admit(kv: KVCacheManager, request: Request, budget: int, prefix: PrefixMatch | None = None) -> int | None:
    """What the scheduler does to admit a request: reuse a prefix (the cached one unless given),
    take blocks for up to `budget` more tokens, write them into the request."""
    prefix = kv.find_prefix(request) if prefix is None else prefix
    reused = len(prefix.blocks) * kv.block_size
    num_new = min(request.num_tokens - reused, budget)
    blocks = kv.admit(request.request_id, prefix, reused + num_new)
    if blocks is None:
        return None
    request.block_ids, request.num_computed_tokens = blocks, reused
    return num_new


def grow(kv: KVCacheManager, request: Request, num_new: int) -> bool:
    blocks = kv.grow(request, num_new)
    if blocks is not None:
        request.block_ids += blocks
    return blocks is not None


def free(kv: KVCacheManager, request: Request) -> None:
    kv.free(request)
    request.block_ids = []


def admit_all(kv: KVCacheManager, request: Request) -> None:
    num_new = admit(kv, request, 10_000)
    assert num_new == request.num_tokens - request.num_computed_tokens
    computed(kv, request, num_new)


def lookup(kv: KVCacheManager, request: Request) -> int:
    return len(kv.find_prefix(request).blocks) * kv.block_size


def test_cold_admission_allocates_blocks_for_the_chunk() -> None:
    kv = KVCacheManager(10, BS, True)
    request = make_request("a", tokens(10))
    assert admit(kv, request, 6) == 6  # the budget caps the first chunk
    assert request.block_ids == [1, 2] and request.num_computed_tokens == 0
    kv.check_integrity([request])
    computed(kv, request, 6)
    assert grow(kv, request, 4) and request.block_ids == [1, 2, 3]
    kv.check_integrity([request])


def test_grow_allocates_only_when_a_block_fills() -> None:
    kv = KVCacheManager(4, BS, False)
    request = make_request("a", tokens(5))
    admit_all(kv, request)
    assert request.block_ids == [1, 2]
    assert grow(kv, request, 3) and request.block_ids == [1, 2]  # positions 5..7 fit in block 2
    assert grow(kv, request, 4) and request.block_ids == [1, 2, 3]
    assert not grow(kv, request, 8)  # would need a fourth block; the pool has three
    assert request.block_ids == [1, 2, 3] and kv.pool.num_free == 0
    kv.check_integrity([request])


def test_admission_with_a_cache_hit_takes_the_cached_blocks() -> None:
    kv = KVCacheManager(10, BS, True)
    a = make_request("a", tokens(10))
    admit_all(kv, a)
    free(kv, a)
    assert a.block_ids == []
    b = make_request("b", tokens(9) + [99, 98, 97])
    assert admit(kv, b, 100) == 4  # two cached blocks (8 tokens), 4 to compute
    assert b.block_ids[:2] == [1, 2] and b.num_computed_tokens == 8
    assert kv.pool.ref_counts[1:3] == [1, 1]
    assert lookup(kv, make_request("c", tokens(12))) == 8
    kv.check_integrity([b])


def test_a_cache_salt_shares_blocks_only_within_its_namespace() -> None:
    kv = KVCacheManager(10, BS, True)
    salted = make_request("a", tokens(10))
    salted.cache_salt = "tenant-a"
    admit_all(kv, salted)
    free(kv, salted)
    assert kv.cache.num_cached_blocks == 2
    same_salt, other_salt, unsalted = (make_request(i, tokens(12)) for i in "bcd")
    same_salt.cache_salt, other_salt.cache_salt = "tenant-a", "tenant-b"
    assert (lookup(kv, same_salt), lookup(kv, other_salt), lookup(kv, unsalted)) == (8, 0, 0)
    admit_all(kv, unsalted)  # the same tokens computed again, cached beside the salted copy
    assert unsalted.num_computed_tokens == 12 and kv.cache.num_cached_blocks == 5
    assert lookup(kv, make_request("e", tokens(13))) == 12 and lookup(kv, same_salt) == 8
    kv.check_integrity([unsalted])


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_a_fully_cached_prompt_still_computes_its_last_token(bs: int) -> None:
    kv = KVCacheManager(20, bs, True)
    prompt = tokens(2 * bs)
    admit_all(kv, make_request("a", prompt))
    b = make_request("b", prompt)
    num_new = admit(kv, b, 100)
    hit = (len(prompt) - 1) // bs
    assert len(b.block_ids) == 2 and b.num_computed_tokens == hit * bs
    assert num_new == len(prompt) - hit * bs >= 1
    assert lookup(kv, b) == hit * bs


def test_admission_evicts_idle_cached_blocks_but_never_the_hit() -> None:
    kv = KVCacheManager(7, BS, True)  # capacity 6
    old = make_request("old", tokens(8, start=500))
    admit_all(kv, old)  # blocks 1, 2: least recently used
    shared = make_request("shared", tokens(8))
    admit_all(kv, shared)  # blocks 3, 4
    free(kv, old)
    free(kv, shared)
    assert kv.pool.num_free == 2 and kv.cache.num_evictable_blocks == 4
    # Needs 2 cached blocks + 4 new: the 2 free ones and the 2 idle blocks of "old".
    b = make_request("b", tokens(8) + tokens(13, start=900))
    assert admit(kv, b, 100) == 13
    assert b.block_ids[:2] == [3, 4] and sorted(b.block_ids[2:]) == [1, 2, 5, 6]
    assert not kv.cache.is_cached(1) and not kv.cache.is_cached(2)
    assert kv.pool.num_free == 0 and kv.cache.num_evictable_blocks == 0
    kv.check_integrity([b])


def test_refused_admission_takes_nothing() -> None:
    kv = KVCacheManager(6, BS, True)  # capacity 5
    a = make_request("a", tokens(8))
    admit_all(kv, a)
    free(kv, a)  # blocks 1, 2 cached and idle
    holder = make_request("holder", tokens(12, start=300))
    admit_all(kv, holder)  # takes the 3 free blocks
    b = make_request("b", tokens(8) + tokens(9, start=700))  # 2 cached + 3 new blocks; 0 available
    before = (list(kv.pool.ref_counts), kv.pool.num_free, kv.cache.num_evictable_blocks)
    assert kv.num_available == 2
    assert admit(kv, b, 100) is None
    assert admit(kv, b, 1) is None  # even one new token needs a new block
    assert (list(kv.pool.ref_counts), kv.pool.num_free, kv.cache.num_evictable_blocks) == before
    assert b.block_ids == [] and b.num_computed_tokens == 0 and b.request_id not in kv._locked
    assert kv.cache.root.children[None, tuple(tokens(BS))].lock_ref == 0
    kv.check_integrity([holder])
    free(kv, holder)  # its 3 blocks stay cached, idle: evictable for b
    assert admit(kv, b, 100) == 9
    assert b.block_ids[:2] == [1, 2] and sorted(b.block_ids[2:]) == [3, 4, 5]
    kv.check_integrity([b])


def test_free_keeps_computed_full_blocks_cached_and_frees_the_rest() -> None:
    kv = KVCacheManager(10, BS, True)
    request = make_request("a", tokens(10))
    assert admit(kv, request, 100) == 10
    computed(kv, request, 10)
    request.append_token(42)
    assert grow(kv, request, 1)
    assert request.block_ids == [1, 2, 3]
    assert kv.num_available == kv.pool.capacity - 3
    free(kv, request)
    assert request.block_ids == []
    assert kv.cache.num_cached_blocks == 2 and kv.cache.is_cached(1) and kv.cache.is_cached(2)
    assert kv.pool.is_free(3)  # the partial block
    assert kv.pool.ref_counts == [0] * 10
    assert kv.num_available == kv.pool.capacity
    kv.check_integrity([])


def test_free_caches_blocks_computed_in_the_last_step() -> None:
    kv = KVCacheManager(10, BS, True)
    request = make_request("a", tokens(10))
    admit(kv, request, 100)
    request.num_computed_tokens = 8  # the step's tokens are in the KV, the scheduler did not cache yet
    free(kv, request)
    assert kv.cache.num_cached_blocks == 2
    kv.check_integrity([])


def test_cache_off_sibling_borrows_the_parents_prompt_blocks() -> None:
    kv = KVCacheManager(10, BS, False)
    parent = make_request("p", tokens(10))
    admit_all(kv, parent)
    parent.append_token(42)
    sibling = make_request("s", tokens(10), parent=parent)
    shared = PrefixMatch(tuple(parent.block_ids[:2]))  # (10 - 1) // 4 = 2 shared blocks, 2 tokens to compute
    assert admit(kv, sibling, 100, shared) == 2
    assert sibling.block_ids[:2] == parent.block_ids[:2] and sibling.block_ids[2] not in parent.block_ids
    assert sibling.num_computed_tokens == 8
    assert [kv.pool.ref_counts[b] for b in parent.block_ids] == [2, 2, 1]
    kv.check_integrity([parent, sibling])
    free(kv, parent)
    assert [kv.pool.ref_counts[b] for b in sibling.block_ids] == [1, 1, 1]
    kv.check_integrity([sibling])
    free(kv, sibling)
    assert kv.pool.num_free == kv.pool.capacity
    kv.check_integrity([])


def test_cache_off_has_no_hits() -> None:
    kv = KVCacheManager(10, BS, False)
    a = make_request("a", tokens(10))
    admit_all(kv, a)
    free(kv, a)
    b = make_request("b", tokens(10))
    assert lookup(kv, b) == 0
    assert admit(kv, b, 100) == 10 and b.num_computed_tokens == 0
    assert kv.reset_prefix_cache()


def test_reset_prefix_cache_is_refused_while_blocks_are_locked() -> None:
    kv = KVCacheManager(10, BS, True)
    a = make_request("a", tokens(10))
    admit_all(kv, a)
    assert not kv.reset_prefix_cache()
    assert kv.cache.num_cached_blocks == 2
    free(kv, a)
    assert kv.reset_prefix_cache()
    assert kv.cache.num_cached_blocks == 0 and kv.pool.num_free == kv.pool.capacity
    assert lookup(kv, make_request("b", tokens(10))) == 0
    kv.check_integrity([])


def test_integrity_catches_blocks_held_by_an_unlisted_request() -> None:
    kv = KVCacheManager(10, BS, True)
    a = make_request("a", tokens(10))
    admit_all(kv, a)
    kv.check_integrity([a])
    with pytest.raises(AssertionError):
        kv.check_integrity([])
    a.num_computed_tokens = 13  # more computed tokens than its blocks hold
    with pytest.raises(AssertionError, match="computed tokens without blocks"):
        kv.check_integrity([a])


@pytest.mark.parametrize("caching", [True, False])
def test_one_interface_whether_caching_is_on_or_off(caching: bool) -> None:
    kv = KVCacheManager(10, BS, caching)
    a = make_request("a", tokens(10))
    admit_all(kv, a)
    assert kv.cache.num_cached_blocks == (2 if caching else 0)
    assert kv.cache.cached_blocks() == ({1, 2} if caching else set())
    kv.check_integrity([a])
    free(kv, a)
    assert lookup(kv, make_request("b", tokens(10))) == (8 if caching else 0)
    assert kv.num_available == kv.pool.capacity
    kv.check_integrity([])
