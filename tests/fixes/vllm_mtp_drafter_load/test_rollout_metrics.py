"""Rollout-side MTP metrics from vLLM's real ``SpecDecodingStats``.

Each worker's stats are built the way vLLM's scheduler builds them: ``SpecDecodingStats.new(k)``
then one ``observe_draft(num_draft_tokens, num_accepted_tokens)`` per request per step.
"""

import pytest
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from mtp_overlay.mtp import acceptance_gap, rollout_mtp_metrics, with_prefix


def worker(num_spec_tokens, drafts):
    """One scheduler step's stats: ``drafts`` lists (draft tokens, accepted tokens) per request."""
    stats = SpecDecodingStats.new(num_spec_tokens)
    for drafted, accepted in drafts:
        stats.observe_draft(drafted, accepted)
    return stats


def test_per_position_acceptance_and_mean_length_over_workers_and_steps():
    workers = [
        [worker(3, [(3, 3), (3, 0)]), worker(3, [(3, 1)])],  # worker 0, two steps
        worker(3, [(3, 2), (3, 2), (3, 3)]),  # worker 1, one step
    ]
    metrics = with_prefix(rollout_mtp_metrics(workers))
    drafts = 6  # accepted lengths 3, 0, 1, 2, 2, 3: position k accepted by the drafts of length >= k
    assert metrics == pytest.approx({
        "mtp/rollout_acceptance_pos_1": 100 * 5 / drafts,
        "mtp/rollout_acceptance_pos_2": 100 * 4 / drafts,
        "mtp/rollout_acceptance_pos_3": 100 * 2 / drafts,
        "mtp/rollout_mean_acceptance_length": 1 + 11 / drafts,
    })
    # the same numbers whatever way the steps are spread over workers
    flat = [step for entry in workers for step in (entry if isinstance(entry, list) else [entry])]
    assert rollout_mtp_metrics([[*flat]]) == rollout_mtp_metrics(workers) == rollout_mtp_metrics(flat)


def test_acceptance_gap_is_train_minus_rollout_at_depth_1():
    train = {"mtp_1_loss": 2.0, "mtp_1_acceptance_rate": 62.5}
    rollout = rollout_mtp_metrics([worker(1, [(1, 1), (1, 0), (1, 0), (1, 1)])])
    assert rollout == {"rollout_acceptance_pos_1": 50.0, "rollout_mean_acceptance_length": 1.5}
    assert acceptance_gap(train, rollout) == {"acceptance_gap_1": 12.5}
    assert acceptance_gap(with_prefix(train), with_prefix(rollout)) == {"acceptance_gap_1": 12.5}
    assert acceptance_gap({}, rollout) == {} and acceptance_gap(train, {}) == {}


def test_no_drafts_gives_no_metrics():
    assert rollout_mtp_metrics([SpecDecodingStats.new(2), [SpecDecodingStats.new(2)]]) == {}


def tampered(**fields):
    stats = worker(2, [(2, 2), (2, 1)])
    for name, value in fields.items():
        setattr(stats, name, value)
    return stats


@pytest.mark.parametrize(
    ("workers", "message"),
    [
        ([], "non-empty list"),
        (worker(2, [(2, 1)]), "non-empty list"),
        ([[]], r"worker_stats\[0\] is an empty list"),
        ([worker(2, [(2, 1)]), worker(3, [(3, 1)])], r"worker_stats\[1\]\.num_accepted_tokens_per_pos has 3 positions"),
        ([[worker(2, [(2, 1)]), tampered(num_drafts=-1)]], r"worker_stats\[0\]\[1\]\.num_drafts must be a non-negative int"),
        ([tampered(num_accepted_tokens_per_pos=[2, 1.5])], r"num_accepted_tokens_per_pos\[1\] must be a non-negative int"),
        ([tampered(num_accepted_tokens_per_pos=[1, 2], num_accepted_tokens=3)], "must not increase"),
        ([tampered(num_accepted_tokens=5)], "is not the sum"),
        ([tampered(num_accepted_tokens_per_pos=[], num_accepted_tokens=0)], "is empty"),
        ([{"num_drafts": 1}], "must be a vLLM SpecDecodingStats"),
    ],
)
def test_bad_input_is_refused_naming_the_worker_and_the_field(workers, message):
    with pytest.raises(ValueError, match=message):
        rollout_mtp_metrics(workers)


def test_gap_needs_the_depth_1_rates():
    with pytest.raises(ValueError, match="mtp_1_acceptance_rate"):
        acceptance_gap({"mtp_1_loss": 1.0}, {"rollout_acceptance_pos_1": 1.0})
    with pytest.raises(ValueError, match="must be a dict"):
        acceptance_gap([1], {"rollout_acceptance_pos_1": 1.0})


def test_drafter_staleness_is_logged_beside_acceptance_as_the_largest_over_workers():
    stats = [worker(1, [(1, 1), (1, 0)]), worker(1, [(1, 0)])]
    plain = rollout_mtp_metrics(stats)
    assert "rollout_drafter_refits_behind" not in plain
    assert rollout_mtp_metrics(stats, drafter_refits_behind=[0, 3]) == {**plain, "rollout_drafter_refits_behind": 3.0}
    assert rollout_mtp_metrics(stats, drafter_refits_behind=2)["rollout_drafter_refits_behind"] == 2.0
    assert rollout_mtp_metrics(stats, drafter_refits_behind=[None, 1])["rollout_drafter_refits_behind"] == 1.0
    assert rollout_mtp_metrics(stats, drafter_refits_behind=[None, None]) == plain  # no worker's drafter known
    # a stale drafter that drafted nothing yet still shows
    assert rollout_mtp_metrics([SpecDecodingStats.new(1)], drafter_refits_behind=[4]) == {"rollout_drafter_refits_behind": 4.0}


@pytest.mark.parametrize(("behind", "message"), [
    ([0, -1], r"drafter_refits_behind\[1\] must be a non-negative int"),
    ([True], r"drafter_refits_behind\[0\] must be a non-negative int"),
    ([1.0], r"drafter_refits_behind\[0\] must be a non-negative int"),
    ("2", "must be an int or a list"),
])
def test_bad_staleness_counts_are_refused_naming_the_worker(behind, message):
    with pytest.raises(ValueError, match=message):
        rollout_mtp_metrics([worker(1, [(1, 1)])], drafter_refits_behind=behind)
