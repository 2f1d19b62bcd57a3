from __future__ import annotations

import pytest

from pagoda.core.radix_cache import RadixCache, RadixNode

from .helpers import take

BS = 4


def seq(*labels: int, bs: int = BS) -> list[int]:
    """Token ids made of whole blocks; block `k` is [100k, 100k + 1, ...]."""
    return [100 * k + i for k in labels for i in range(bs)]


def unreferenced(block: int) -> bool:
    return True


def shape(node: RadixNode) -> list:
    """The tree below `node` as nested [blocks, children...], children ordered by first token."""
    children = sorted(node.children.values(), key=lambda c: c.key)
    return [node.blocks, *[shape(c) for c in children]]


def test_insert_into_empty_tree_makes_one_evictable_leaf() -> None:
    cache = RadixCache(BS)
    node = cache.insert(seq(1, 2, 3), [11, 12, 13])
    assert node.parent is cache.root
    assert node.key == tuple(seq(1, 2, 3)) and node.blocks == [11, 12, 13]
    assert shape(cache.root) == [[], [[11, 12, 13]]]
    assert cache.num_cached_blocks == 3 and cache.num_evictable_blocks == 3
    assert cache.is_cached(12) and not cache.is_cached(14)
    cache.check_integrity([])


def test_a_salt_is_a_namespace_of_its_own() -> None:
    cache = RadixCache(BS)
    cache.insert(seq(1, 2), [11, 12])
    cache.insert(seq(1, 2), [21, 22], "tenant-a")
    assert cache.find(seq(1, 2, 3), 3).blocks == (11, 12)
    assert cache.find(seq(1, 2, 3), 3, "tenant-a").blocks == (21, 22)
    assert cache.find(seq(1, 2, 3), 3, "tenant-b").blocks == ()
    blocks, node = take(cache, seq(1, 5), 2, "tenant-a")  # splits the salted path
    assert blocks == [21] and node.salt == "tenant-a" and node.children[("tenant-a", tuple(seq(2)))].blocks == [22]
    assert cache.evict(4, unreferenced) == [11, 12, 22, 21]  # least recently used first, across salts
    cache.check_integrity([])


def test_insert_of_nothing_returns_the_root() -> None:
    cache = RadixCache(BS)
    assert cache.insert([], []) is cache.root
    with pytest.raises(AssertionError):
        cache.insert(seq(1)[:3], [11])  # not whole blocks


def test_match_returns_the_longest_whole_block_prefix() -> None:
    cache = RadixCache(BS)
    leaf = cache.insert(seq(1, 2), [11, 12])
    # A partial trailing block never matches; a longer query matches what is there.
    assert take(cache, seq(1, 2, 3), 10) == ([11, 12], leaf)
    assert take(cache, seq(1, 2)[:7], 10)[0] == [11]
    assert take(cache, seq(5, 1, 2), 10) == ([], cache.root)
    # The first token of the second block differs: one block.
    tokens = seq(1, 2)
    tokens[BS] += 1
    blocks, node = take(cache, tokens, 10)
    assert blocks == [11] and node.blocks == [11]
    cache.check_integrity([])


def test_match_capped_by_max_blocks_splits_the_node() -> None:
    cache = RadixCache(BS)
    leaf = cache.insert(seq(1, 2, 3), [11, 12, 13])
    blocks, node = take(cache, seq(1, 2, 3), 2)
    assert blocks == [11, 12]
    assert node.key == tuple(seq(1, 2)) and node.blocks == [11, 12]
    assert shape(cache.root) == [[], [[11, 12], [[13]]]]
    # The lower part keeps its identity (a request locking it stays valid).
    assert leaf.parent is node and leaf.blocks == [13] and leaf.key == tuple(seq(3))
    assert take(cache, seq(1, 2, 3), 0) == ([], cache.root)
    assert cache.num_evictable_blocks == 3
    cache.check_integrity([])


def test_match_diverging_in_the_middle_of_a_node_splits_it() -> None:
    cache = RadixCache(BS)
    cache.insert(seq(1, 2, 3, 4), [11, 12, 13, 14])
    blocks, node = take(cache, seq(1, 2, 9), 10)
    assert blocks == [11, 12] and node.blocks == [11, 12]
    assert shape(cache.root) == [[], [[11, 12], [[13, 14]]]]
    cache.check_integrity([])


def test_insert_diverging_in_the_middle_of_a_node_splits_it() -> None:
    cache = RadixCache(BS)
    cache.insert(seq(1, 2, 3), [11, 12, 13])
    node = cache.insert(seq(1, 9, 8), [21, 22, 23])
    # The tree keeps its own block for the shared first block; 21 is a duplicate, not cached.
    assert node.blocks == [22, 23] and node.parent.blocks == [11]
    assert shape(cache.root) == [[], [[11], [[12, 13]], [[22, 23]]]]
    assert not cache.is_cached(21) and cache.is_cached(22)
    assert cache.num_cached_blocks == 5 and cache.num_evictable_blocks == 5
    cache.check_integrity([])


def test_insert_ending_inside_a_node_splits_it_and_returns_the_upper_part() -> None:
    cache = RadixCache(BS)
    cache.insert(seq(1, 2, 3), [11, 12, 13])
    node = cache.insert(seq(1, 2), [21, 22])
    assert node.blocks == [11, 12] and node.key == tuple(seq(1, 2))
    assert shape(cache.root) == [[], [[11, 12], [[13]]]]
    cache.check_integrity([])


def test_duplicate_insert_keeps_the_trees_blocks() -> None:
    cache = RadixCache(BS)
    first = cache.insert(seq(1, 2), [11, 12])
    again = cache.insert(seq(1, 2), [21, 22])
    assert again is first and first.blocks == [11, 12]
    assert not cache.is_cached(21) and not cache.is_cached(22)
    assert cache.num_cached_blocks == 2 and cache.num_evictable_blocks == 2
    cache.check_integrity([])


def test_insert_extending_a_cached_path_adds_only_the_new_blocks() -> None:
    cache = RadixCache(BS)
    cache.insert(seq(1, 2), [11, 12])
    node = cache.insert(seq(1, 2, 3, 4), [21, 22, 23, 24])
    assert node.blocks == [23, 24] and node.parent.blocks == [11, 12]
    assert cache.num_cached_blocks == 4
    cache.check_integrity([])


def test_lock_and_unlock_count_along_the_path() -> None:
    cache = RadixCache(BS)
    cache.insert(seq(1, 2, 3), [11, 12, 13])
    cache.insert(seq(1, 2, 4), [11, 12, 14])
    upper = cache.root.children[None, tuple(seq(1))]
    leaf3 = upper.children[None, tuple(seq(3))]
    leaf4 = upper.children[None, tuple(seq(4))]
    assert cache.num_evictable_blocks == 4
    cache.lock(leaf3)
    assert (upper.lock_ref, leaf3.lock_ref, leaf4.lock_ref, cache.root.lock_ref) == (1, 1, 0, 2)
    assert cache.num_evictable_blocks == 1  # only leaf4's block
    cache.lock(leaf4)
    cache.lock(upper)
    assert upper.lock_ref == 3 and cache.num_evictable_blocks == 0
    cache.check_integrity([leaf3, leaf4, upper])
    cache.unlock(leaf3)
    assert cache.num_evictable_blocks == 1
    cache.unlock(leaf4)
    cache.unlock(upper)
    assert cache.num_evictable_blocks == 4 and upper.lock_ref == 0 and cache.root.lock_ref == 1
    cache.check_integrity([])
    with pytest.raises(AssertionError):
        cache.unlock(leaf3)


def test_split_of_a_locked_node_keeps_lock_counts() -> None:
    cache = RadixCache(BS)
    leaf = cache.insert(seq(1, 2, 3), [11, 12, 13])
    cache.lock(leaf)
    blocks, upper = take(cache, seq(1, 2, 7), 10)
    assert blocks == [11, 12] and upper.lock_ref == 1 and leaf.lock_ref == 1
    assert cache.num_evictable_blocks == 0
    cache.check_integrity([leaf])
    cache.lock(upper)
    cache.check_integrity([leaf, upper])
    cache.unlock(leaf)
    assert cache.num_evictable_blocks == 1  # leaf's 13; upper is still locked
    cache.check_integrity([upper])


# ---- eviction ------------------------------------------------------------------------------


def test_eviction_takes_the_least_recently_used_leaf_from_its_tail() -> None:
    cache = RadixCache(BS)
    a = cache.insert(seq(1, 2, 3), [11, 12, 13])
    cache.insert(seq(4, 5), [14, 15])
    cache.insert(seq(6), [16])
    take(cache, seq(1), 10)  # touches only a's first block: a splits, its tail stays old
    assert cache.evict(1, unreferenced) == [13]
    assert a.blocks == [12] and a.key == tuple(seq(2))
    assert cache.evict(2, unreferenced) == [12, 15]  # then a's remaining tail; b's tail next
    assert cache.num_cached_blocks == 3 and cache.num_evictable_blocks == 3
    cache.check_integrity([])
    assert cache.evict(10, unreferenced) == [14, 16, 11]
    assert cache.num_cached_blocks == 0 and cache.root.children == {}
    cache.check_integrity([])


def test_eviction_follows_match_recency() -> None:
    cache = RadixCache(BS)
    cache.insert(seq(1), [11])
    cache.insert(seq(2), [12])
    cache.insert(seq(3), [13])
    take(cache, seq(1), 10)
    take(cache, seq(2), 10)
    assert cache.evict(1, unreferenced) == [13]
    assert cache.evict(1, unreferenced) == [11]


def test_parent_becomes_an_evictable_leaf_after_its_children_go() -> None:
    cache = RadixCache(BS)
    cache.insert(seq(1, 2), [11, 12])  # stamp 1
    cache.insert(seq(1, 3), [11, 13])  # stamp 2: splits into [11] -> {[12], [13]}
    cache.insert(seq(7), [17])  # stamp 3
    parent = cache.root.children[None, tuple(seq(1))]
    assert parent.blocks == [11] and parent.last_access == 2
    # Leaves by age: [12] (1), [13] (2), [17] (3). Once [12] and [13] are gone, the parent (2) is a
    # leaf and older than [17].
    assert cache.evict(3, unreferenced) == [12, 13, 11]
    assert shape(cache.root) == [[], [[17]]]
    cache.check_integrity([])


def test_locked_nodes_are_never_evicted() -> None:
    cache = RadixCache(BS)
    leaf = cache.insert(seq(1, 2), [11, 12])
    cache.insert(seq(1, 3, 4), [11, 13, 14])
    cache.insert(seq(5), [15])
    cache.lock(leaf)
    assert cache.num_evictable_blocks == 3
    assert sorted(cache.evict(10, unreferenced)) == [13, 14, 15]
    assert shape(cache.root) == [[], [[11], [[12]]]]
    assert cache.num_evictable_blocks == 0
    assert cache.evict(10, unreferenced) == []
    cache.check_integrity([leaf])


def test_eviction_refuses_a_block_a_request_holds() -> None:
    cache = RadixCache(BS)
    cache.insert(seq(1), [11])
    with pytest.raises(AssertionError, match="evicting a block a request holds"):
        cache.evict(1, lambda block: False)


def test_reset_is_refused_while_locked() -> None:
    cache = RadixCache(BS)
    leaf = cache.insert(seq(1, 2), [11, 12])
    cache.insert(seq(3), [13])
    cache.lock(leaf)
    with pytest.raises(RuntimeError, match="cannot reset"):
        cache.reset()
    assert cache.num_cached_blocks == 3
    cache.unlock(leaf)
    assert sorted(cache.reset()) == [11, 12, 13]
    assert cache.num_cached_blocks == 0 and cache.num_evictable_blocks == 0 and not cache.root.children
    cache.check_integrity([])


# ---- block sizes --------------------------------------------------------------------------


@pytest.mark.parametrize("bs", [1, 16])
def test_split_match_insert_evict_at_other_block_sizes(bs: int) -> None:
    cache = RadixCache(bs)
    leaf = cache.insert(seq(1, 2, 3, bs=bs), [11, 12, 13])
    assert len(leaf.key) == 3 * bs
    blocks, node = take(cache, seq(1, 2, 9, bs=bs), 10)
    assert blocks == [11, 12] and len(node.key) == 2 * bs
    other = cache.insert(seq(1, 2, 8, 7, bs=bs), [21, 22, 23, 24])
    assert other.blocks == [23, 24] and other.parent is node
    partial = seq(1, 2, 8, bs=bs)[:-1]  # the third block is incomplete
    assert take(cache, partial, 10)[0] == [11, 12]
    cache.lock(other)
    assert cache.evict(10, unreferenced) == [13]
    cache.check_integrity([other])


def test_block_size_one_matches_token_by_token() -> None:
    cache = RadixCache(1)
    cache.insert([5, 6, 7], [1, 2, 3])
    cache.insert([5, 6, 8], [1, 2, 4])
    assert take(cache, [5, 6, 8, 9], 10)[0] == [1, 2, 4]
    assert take(cache, [5, 6, 8, 9], 2)[0] == [1, 2]
    assert shape(cache.root) == [[], [[1, 2], [[3]], [[4]]]]
    assert take(cache, [5, 9], 10)[0] == [1]  # splits [1, 2]
    assert shape(cache.root) == [[], [[1], [[2], [[3]], [[4]]]]]
    cache.check_integrity([])


# ---- check_integrity catches corruption ----------------------------------------------------


def test_integrity_catches_a_wrong_lock_count() -> None:
    cache = RadixCache(BS)
    leaf = cache.insert(seq(1), [11])
    cache.lock(leaf)
    with pytest.raises(AssertionError, match="lock_ref"):
        cache.check_integrity([])
    with pytest.raises(AssertionError, match="lock_ref"):
        cache.check_integrity([leaf, leaf])


def test_integrity_catches_a_wrong_evictable_count() -> None:
    cache = RadixCache(BS)
    cache.insert(seq(1, 2), [11, 12])
    cache.num_evictable_blocks -= 1
    with pytest.raises(AssertionError, match="evictable count"):
        cache.check_integrity([])


def test_integrity_catches_a_block_index_out_of_sync() -> None:
    cache = RadixCache(BS)
    cache.insert(seq(1), [11])
    cache._block_node[99] = cache.root
    with pytest.raises(AssertionError, match="outside the tree"):
        cache.check_integrity([])


def test_path_blocks_are_the_trees_copies_in_token_order():
    cache = RadixCache(BS)
    cache.insert(seq(1, 2, 3), [11, 12, 13])
    node = cache.insert(seq(1, 2, 4, 5), [21, 22, 24, 25])  # shares two blocks, splits the first path
    assert cache.path_blocks(node) == [11, 12, 24, 25]
    assert cache.path_blocks(cache.root) == []


def test_find_is_a_pure_query_and_touch_takes_the_hit() -> None:
    cache = RadixCache(BS)
    leaf = cache.insert(seq(1, 2, 3), [11, 12, 13])
    other = cache.insert(seq(4), [14])
    stamps = (leaf.last_access, other.last_access)
    hit = cache.find(seq(1, 2, 9), 10)
    assert hit.blocks == (11, 12) and hit.node is leaf and hit.num_node_blocks == 2
    # Nothing split, nothing stamped: a policy may peek at many waiting requests.
    assert shape(cache.root) == [[], [[11, 12, 13]], [[14]]]
    assert (leaf.last_access, other.last_access) == stamps
    assert cache.find(seq(7), 10).blocks == () and cache.find(seq(7), 10).node is None
    node = cache.touch(hit)
    assert node.blocks == [11, 12] and leaf.parent is node and leaf.blocks == [13]
    assert node.last_access > stamps[1] and leaf.last_access == stamps[0]  # the hit is newest, the tail is not
    assert cache.evict(1, unreferenced) == [13]
    cache.check_integrity([])
