"""`rollout_mtp_metrics` on vLLM's real ``SpecDecodingStats`` whose counts come back through numpy or torch.

A trainer that gathers its rollout workers' stats (Ray, ``torch.distributed``) gets numpy integers,
0-dim tensors and arrays back in place of ints: the same counts, the same metrics. A field the stats
lack a value for is a ValueError naming the worker and the step, never a bare TypeError.
"""

import numpy as np
import pytest
import torch
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from mtp_overlay.mtp import rollout_mtp_metrics

STEPS = ([(3, 3), (3, 0)], [(3, 1), (3, 2)], [(3, 2), (3, 3)])  # (draft tokens, accepted) per request per step


def stats(drafts, convert=None, convert_per_pos=None):
    """One scheduler step's stats built by vLLM (``observe_draft``), its counts then passed through ``convert``."""
    step = SpecDecodingStats.new(3)
    for drafted, accepted in drafts:
        step.observe_draft(drafted, accepted)
    if convert is not None:
        step.num_drafts, step.num_accepted_tokens = convert(step.num_drafts), convert(step.num_accepted_tokens)
    if convert_per_pos is not None:
        step.num_accepted_tokens_per_pos = convert_per_pos(step.num_accepted_tokens_per_pos)
    return step


CONVERSIONS = {
    "numpy integer": (np.int64, lambda counts: [np.int32(c) for c in counts]),
    "numpy array": (np.array, np.array),  # 0-dim arrays for the totals, a 1-D array per position
    "0-dim tensor": (torch.tensor, lambda counts: [torch.tensor(c, dtype=torch.int32) for c in counts]),
    "1-D tensor": (lambda c: torch.tensor(c, dtype=torch.int64), torch.tensor),
}


@pytest.mark.parametrize("conversion", CONVERSIONS)
def test_integer_scalars_from_numpy_or_torch_count_like_ints(conversion):
    convert, convert_per_pos = CONVERSIONS[conversion]
    plain = rollout_mtp_metrics([[stats(step) for step in STEPS]])
    drafts = sum(len(step) for step in STEPS)  # 6 drafts; accepted lengths 3, 0, 1, 2, 2, 3
    assert plain == pytest.approx({"rollout_acceptance_pos_1": 100 * 5 / drafts, "rollout_acceptance_pos_2": 100 * 4 / drafts,
                                   "rollout_acceptance_pos_3": 100 * 2 / drafts, "rollout_mean_acceptance_length": 1 + 11 / drafts})
    converted = [[stats(step, convert, convert_per_pos) for step in STEPS]]
    assert rollout_mtp_metrics(converted) == plain
    assert all(type(value) is float for value in rollout_mtp_metrics(converted).values())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_accepted_tokens_per_pos", None, r"worker_stats\[0\]\[1\]\.num_accepted_tokens_per_pos must be a sequence "
                                              r"of non-negative ints, one per speculative position, got None"),
        ("num_accepted_tokens_per_pos", 3, r"worker_stats\[0\]\[1\]\.num_accepted_tokens_per_pos must be a sequence"),
        ("num_accepted_tokens_per_pos", "21", r"worker_stats\[0\]\[1\]\.num_accepted_tokens_per_pos must be a sequence"),
        ("num_accepted_tokens_per_pos", np.array([[2, 1, 0]]), r"\.num_accepted_tokens_per_pos must be a sequence"),
        ("num_accepted_tokens_per_pos", [2, 1, None], r"worker_stats\[0\]\[1\]\.num_accepted_tokens_per_pos\[2\] must be "
                                                      "a non-negative int"),
        ("num_drafts", None, r"worker_stats\[0\]\[1\]\.num_drafts must be a non-negative int"),
        ("num_drafts", torch.tensor(2.0), r"\.num_drafts must be a non-negative int .*got tensor\(2\.\)"),
        ("num_drafts", torch.tensor([2]), r"\.num_drafts must be a non-negative int"),  # one element, but not a scalar
        ("num_drafts", np.int64(-2), r"\.num_drafts must be a non-negative int"),
        ("num_drafts", np.True_, r"\.num_drafts must be a non-negative int"),
        ("num_accepted_tokens", torch.tensor(True), r"\.num_accepted_tokens must be a non-negative int"),
    ],
)
def test_a_field_without_a_count_names_the_worker_and_the_step(field, value, message):
    broken = stats(STEPS[1])
    setattr(broken, field, value)
    with pytest.raises(ValueError, match=message):
        rollout_mtp_metrics([[stats(STEPS[0]), broken]])
