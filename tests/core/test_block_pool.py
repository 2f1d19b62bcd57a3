from __future__ import annotations

import pytest

from pagoda.core.block_pool import BlockPool


def never_cached(block: int) -> bool:
    return False


def test_new_pool_has_every_block_but_the_null_one_free() -> None:
    pool = BlockPool(5)
    assert (pool.num_free, pool.capacity) == (4, 4)
    assert not pool.is_free(0)
    assert all(pool.is_free(b) for b in range(1, 5))
    pool.check_integrity({}, set())


def test_too_small_pool_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)


def test_allocate_hands_out_blocks_in_order_with_one_reference() -> None:
    pool = BlockPool(5)
    assert pool.allocate(2) == [1, 2]
    assert pool.allocate(0) == []
    assert pool.ref_counts == [0, 1, 1, 0, 0]
    assert pool.num_free == 2
    assert not pool.is_free(1) and pool.is_free(3)
    pool.check_integrity({1: 1, 2: 1}, set())


def test_allocating_more_than_free_raises_and_takes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    with pytest.raises(MemoryError, match="asked for 2 blocks, 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.check_integrity({1: 1, 2: 1}, set())


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(3)
    for _ in range(5):
        blocks = pool.allocate(2)
        assert sorted(blocks) == [1, 2]
        pool.drop_ref(blocks, never_cached)
    assert pool.ref_counts[0] == 0 and not pool.is_free(0)


def test_refcounts_and_release_to_the_tail_of_the_free_list() -> None:
    pool = BlockPool(5)
    a, b = pool.allocate(2)
    pool.take_ref([a])
    assert pool.ref_counts[a] == 2
    pool.drop_ref([a, b], never_cached)
    # a is still held once; b is nobody's and not cached, so it is free again (after 3 and 4).
    assert (pool.ref_counts[a], pool.ref_counts[b]) == (1, 0)
    assert pool.is_free(b) and not pool.is_free(a)
    pool.check_integrity({a: 1}, set())
    assert pool.allocate(3) == [3, 4, b]


def test_dropping_the_last_reference_of_a_cached_block_keeps_it() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.drop_ref([a, b], lambda block: block == a)
    assert pool.ref_counts[a] == 0 and not pool.is_free(a)  # cached-idle: the cache's to free
    assert pool.is_free(b)
    pool.check_integrity({}, {a})
    pool.release(a)
    assert pool.is_free(a) and pool.num_free == 3
    pool.check_integrity({}, set())


def test_release_of_a_held_or_free_block_is_refused() -> None:
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    with pytest.raises(AssertionError):
        pool.release(a)  # still referenced
    with pytest.raises(AssertionError):
        pool.release(2)  # already free


# ---- check_integrity catches corruption ------------------------------------------------------


def test_integrity_catches_a_leaked_block() -> None:
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.ref_counts[a] = 0  # the reference vanished but the block never went back to the free list
    with pytest.raises(AssertionError, match=f"block {a} leaked"):
        pool.check_integrity({}, set())


def test_integrity_catches_a_reference_nobody_owns() -> None:
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    with pytest.raises(AssertionError, match=f"block {a}: ref 1 != owners 0"):
        pool.check_integrity({}, set())
    with pytest.raises(AssertionError, match=f"block {a}: ref 1 != owners 2"):
        pool.check_integrity({a: 2}, set())


def test_integrity_catches_a_free_block_the_cache_keeps() -> None:
    pool = BlockPool(4)
    with pytest.raises(AssertionError, match="block 1 is free but held"):
        pool.check_integrity({}, {1})


def test_integrity_catches_a_block_freed_twice() -> None:
    pool = BlockPool(4)
    pool._free.append(1)
    with pytest.raises(AssertionError, match="free list twice"):
        pool.check_integrity({}, set())


def test_integrity_catches_a_free_flag_out_of_sync() -> None:
    pool = BlockPool(4)
    pool._is_free[2] = False
    with pytest.raises(AssertionError, match="block 2: free flag out of sync"):
        pool.check_integrity({}, set())


def test_integrity_catches_the_null_block_handed_out() -> None:
    pool = BlockPool(4)
    pool._free.appendleft(0)
    with pytest.raises(AssertionError, match="null block"):
        pool.check_integrity({}, set())
