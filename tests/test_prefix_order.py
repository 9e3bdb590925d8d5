"""The prefix tree and the request order, on small hand-checked cases (block size 2)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from batchllm.ordering import prefix_tree
from batchllm.ordering.prefix_tree import PrefixTree
from batchllm.ordering.request_order import order_requests

# Two "documents" (1 2 3 4 and 7 7 7 7) with questions after them, and a loner.
PROMPTS = [
    [7, 7, 7, 7, 5],  # 0: doc B + question
    [1, 2, 3, 4, 9, 9],  # 1: doc A + long question
    [1, 2, 3, 4, 8],  # 2: doc A + question
    [6, 6, 6],  # 3: shares nothing
    [7, 7, 7, 7, 6],  # 4: doc B + another question
    [1, 2, 3],  # 5: a prefix of doc A
]


def by_prompt(tree: PrefixTree, values) -> dict[int, int]:
    """Per-position values keyed by prompt index (groups sharing no block may come in any order)."""
    return dict(zip(tree.order.tolist(), np.asarray(values).tolist()))


def runs(tree: PrefixTree) -> list[tuple[int, ...]]:
    return sorted(tuple(tree.order[a:b].tolist()) for a, b in tree.subtrees())


def test_the_depth_first_order_puts_a_prefix_before_what_extends_it_and_siblings_together():
    tree = PrefixTree(PROMPTS, block_size=2)
    assert runs(tree) == [(0, 4), (3,), (5, 2, 1)]
    # whole shared blocks with the predecessor: 5->2 share [1 2] (3 is not a whole block),
    # 2->1 share [1 2 3 4], 0->4 share [7 7 7 7]; the first of each group shares nothing
    assert by_prompt(tree, tree.lcp) == {5: 0, 2: 2, 1: 4, 3: 0, 0: 0, 4: 4}


def test_equal_blocks_after_different_prefixes_are_different_branches():
    tree = PrefixTree([[1, 1, 5, 5, 9], [2, 2, 5, 5, 9], [1, 1, 5, 5, 8]], block_size=2)
    assert runs(tree) == [(0, 2), (1,)]
    assert by_prompt(tree, tree.lcp)[2] + by_prompt(tree, tree.lcp)[0] == 4  # the later of 0 and 2 shares [1 1 5 5]


@pytest.mark.skipif(prefix_tree.BLOCK_IDS_IN != "C", reason="the C accelerator was not built (no C compiler at install?)")
def test_the_c_accelerator_gives_the_python_loops_prefix_ids():
    from batchllm.ordering._block_ids import block_prefix_ids

    rng = random.Random(5)
    doc = [rng.randrange(50_000) for _ in range(300)]
    prompts = [doc[:rng.randrange(300)] + [rng.randrange(50_000) for _ in range(rng.randrange(40))] for _ in range(50)]
    # ints whose hash is not themselves: -1 hashes to -2, big ones modulo 2**61 - 1
    prompts += [[-1, -2, 2**61 - 1, 2**61, 2**63 + 5, -(2**70), 0, 1] * 5, [], [3]]
    for prompt in prompts:
        for block_size in (1, 3, 128):
            expected = prefix_tree.python_block_prefix_ids(prompt, block_size)
            assert block_prefix_ids(prompt, block_size) == expected
            assert block_prefix_ids(tuple(prompt), block_size) == expected
    assert len(block_prefix_ids(doc, 128)) == 2 * prefix_tree.ID_BYTES
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        block_prefix_ids(doc, 0)
    with pytest.raises(TypeError):
        block_prefix_ids([1, [2]], 1)


def test_ideal_cached_tokens_count_whole_blocks_and_never_a_prompts_last_token():
    tree = PrefixTree(PROMPTS, block_size=2)
    assert by_prompt(tree, tree.cached_tokens()) == {5: 0, 2: 2, 1: 4, 3: 0, 0: 0, 4: 4}
    assert tree.ideal_cached_tokens() == 10
    # [1 2 3 4] after itself: the last token is always computed, so one whole block only
    assert PrefixTree([[1, 2, 3, 4], [1, 2, 3, 4]], block_size=2).ideal_cached_tokens() == 2


def test_subtrees_are_the_runs_sharing_at_least_one_block():
    tree = PrefixTree(PROMPTS, block_size=2)
    assert sorted(b - a for a, b in tree.subtrees()) == [1, 2, 3] and runs(tree) == [(0, 4), (3,), (5, 2, 1)]
    assert PrefixTree([], block_size=2).subtrees() == []


def test_the_shallowest_split_cuts_at_the_first_branching_nearest_the_middle():
    tree = PrefixTree([[1, 1, 2, 2, 3], [1, 1, 2, 2, 4], [1, 1, 5, 5, 6], [1, 1, 5, 5, 7]], block_size=2)
    assert tree.lcp.tolist() == [0, 4, 2, 4]
    assert tree.shallowest_split(0, 4, np.ones(4)) == 2  # between the [2 2] and [5 5] branches
    with pytest.raises(ValueError):
        tree.shallowest_split(1, 2, np.ones(4))


def test_one_replica_gets_groups_whole_in_depth_first_order_longest_bucket_first():
    order = order_requests(PROMPTS, block_size=2)
    (only,) = order.replicas
    assert sorted(only) == list(range(len(PROMPTS)))
    assert order.ideal_cached_tokens == order.cached_tokens_after_split == 10
    # groups: doc A [5, 2, 1] (mean 4.7 tokens), loner [3] (3), doc B [0, 4] (5): buckets 2, 1, 2
    assert only in ([5, 2, 1, 0, 4, 3], [0, 4, 5, 2, 1, 3])


def test_replicas_get_whole_groups_balanced_by_work():
    order = order_requests(PROMPTS, block_size=2, replicas=2)
    assert sorted(order.replicas[0] + order.replicas[1]) == list(range(len(PROMPTS)))
    assert order.cached_tokens_after_split == order.ideal_cached_tokens  # no group had to be cut
    for group in ([5, 2, 1], [0, 4]):
        assert any(set(group) <= set(r) for r in order.replicas)


def test_a_group_heavier_than_a_replicas_share_is_cut_at_its_shallowest_branch():
    shared, rng = [1] * 8, np.random.default_rng(0)
    branches = [shared + [b] * 8 + rng.integers(10, 99, 3).tolist() for b in (2, 3) for _ in range(4)]
    order = order_requests(branches, block_size=4, replicas=2)
    halves = [sorted(r) for r in order.replicas]
    assert halves == [[0, 1, 2, 3], [4, 5, 6, 7]] or halves == [[4, 5, 6, 7], [0, 1, 2, 3]]
    # the cut costs the second branch its shared first 8 tokens once
    assert order.ideal_cached_tokens - order.cached_tokens_after_split == 8


def test_no_replicas_is_an_error():
    with pytest.raises(ValueError, match="replicas must be >= 1, got 0"):
        order_requests(PROMPTS, block_size=2, replicas=0)


def test_the_runtime_prepares_requests_tokenized_and_in_prefix_order():
    from batchllm.core.requests import EngineRequest
    from batchllm.core.sampling import SamplingSpec
    from batchllm.runtime.prepare import RequestPreparer

    class CharacterTokenizer:  # one token per character
        def token_ids_many(self, requests):
            return [[ord(c) for c in (r.system or "") + r.prompt] for r in requests]

    preparer = RequestPreparer(prefix_order=True, tokenizer_for=lambda model_dir: CharacterTokenizer())
    texts = ["zz question 1", "shared document, question a", "zz question 2", "shared document, question b"]
    requests = [EngineRequest(request_id=str(i), prompt=t, chat=False, sampling=SamplingSpec(max_tokens=4)) for i, t in enumerate(texts)]
    window = preparer.submit(requests, "model-dir", 4, 1).result(timeout=30)
    assert [p.request.request_id for p in window.replicas[0]] == ["1", "3", "0", "2"]
    assert window.replicas[0][0].request.prompt_token_ids == tuple(ord(c) for c in texts[1])  # the engine need not tokenize
    # "shared document, question " is 26 characters: 6 whole blocks of 4; "zz question " 12: 3 blocks
    assert window.ideal_cached_tokens == 24 + 12 and window.prompt_tokens == sum(map(len, texts))
    two = preparer.submit(requests, "model-dir", 4, 2).result(timeout=30)
    # the shared-document group is the heaviest: cut at its branch, the "zz" group beside one half
    assert [[p.request.request_id for p in part] for part in two.replicas] == [["1", "0", "2"], ["3"]]
    preparer.close()


def test_inside_a_length_bucket_the_longest_predicted_answer_goes_first():
    """Prompts alike in length and sharing nothing: with nothing predicted they keep their
    tree's order; with predicted answers, the longest first (and the split balances predicted work)."""
    prompts = [[k * 100 + i for i in range(8)] for k in range(4)]  # 8 tokens each, no shared block
    unordered = order_requests(prompts, block_size=4).replicas
    assert sorted(unordered[0]) == [0, 1, 2, 3] and order_requests(prompts, block_size=4, extra_work=[7] * 4).replicas == unordered
    assert order_requests(prompts, block_size=4, extra_work=[5, 40, 1, 90]).replicas == [[3, 1, 0, 2]]
    # two replicas: 90 alone against 40 + 5 + 1 (+ prompts): the long answers lead each replica
    assert order_requests(prompts, block_size=4, replicas=2, extra_work=[5, 40, 1, 90]).replicas == [[3], [1, 0, 2]]


def test_the_runtime_splits_by_the_forecast_not_by_max_tokens():
    """Four requests with max_tokens 100: by max_tokens alike; a forecast that knows two
    answers are long puts one long answer on each replica, first."""
    import numpy as np

    from batchllm.core.requests import EngineRequest
    from batchllm.core.sampling import SamplingSpec
    from batchllm.runtime.prepare import planned, split

    requests = [EngineRequest(str(i), "p", sampling=SamplingSpec(max_tokens=100), prompt_token_ids=(i, 1, 2, 3)) for i in range(4)]
    forecast = lambda batch: np.array([90.0 if r.request_id in ("0", "1") else 5.0 for r in batch])  # noqa: E731
    window = split(planned(requests, forecast), 2, 16, prefix_order=True)
    ids = [[p.request.request_id for p in part] for part in window.replicas]
    assert sorted(map(sorted, ids)) == [["0", "2"], ["1", "3"]] and all(part[0] in ("0", "1") for part in ids)
    assert [p.work for p in window.replicas[0]] == [94.0, 9.0]
