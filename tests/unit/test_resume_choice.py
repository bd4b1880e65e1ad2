"""elastic_ddp.worker.resume.decide: where an automatic resume goes next, from plain values only."""

from __future__ import annotations

import pytest

from elastic_ddp.memory.policy import Candidate
from elastic_ddp.worker.resume import AUTO, DURABLE, FRESH, MEMORY, NAMED, NEVER, VERIFY, Decision, decide, mode


def follow(memory, listed, *, verifies=lambda step: step, reads=lambda node: True):
    """Carry decide() out the way resume() does, with made-up tiers; the decisions taken, in order.

    ``verifies(listed)``: the step of the newest durable checkpoint that verifies (None: none does);
    ``reads(node)``: whether node memory of ``node`` can be read.
    """
    durable, verified, failed, taken = listed, False, set(), []
    for _ in range(20):
        decision = decide(memory, durable, verified=verified, failed=failed)
        taken.append(decision)
        if decision.action == MEMORY:
            if reads(decision.node):
                return taken
            failed.add(decision.node)
        elif decision.action == VERIFY:
            durable, verified = verifies(durable), True
        else:
            return taken
    raise AssertionError(f"decide() did not settle: {taken}")


def test_memory_newer_than_durable_resumes_from_memory_without_verifying_anything():
    decision = decide([Candidate(0, 12), Candidate(1, 12)], 10)
    assert (decision.action, decision.step, decision.node) == (MEMORY, 12, 0)
    assert "step 12" in decision.why and "step 10" in decision.why


def test_durable_newer_than_memory_is_verified_then_loaded():
    decision = decide([Candidate(0, 8)], 10)
    assert (decision.action, decision.step) == (VERIFY, 10)
    assert decide([Candidate(0, 8)], 10, verified=True) == Decision(DURABLE, 10, why=decision_why(8, 10))
    assert [d.action for d in follow([Candidate(0, 8)], 10)] == [VERIFY, DURABLE]


def decision_why(memory_step, durable_step):
    return (f"the durable checkpoint of step {durable_step} verified, and node memory holds nothing newer "
            f"(step {memory_step})")  # fmt: skip


def test_a_tie_goes_to_memory():
    decision = decide([Candidate(1, 10)], 10)
    assert (decision.action, decision.step, decision.node) == (MEMORY, 10, 1)


def test_among_nodes_with_the_same_step_the_lowest_serves_it():
    assert decide([Candidate(2, 10), Candidate(1, 10)], None).node == 1


def test_memory_read_failed_falls_back_to_the_durable_tier():
    taken = follow([Candidate(0, 12)], 10, reads=lambda node: False)
    assert [(d.action, d.step) for d in taken] == [(MEMORY, 12), (VERIFY, 10), (DURABLE, 10)]
    assert "node(s) [0] could not be read" in taken[1].why


def test_memory_read_failed_on_one_node_tries_the_next_node_holding_a_state():
    taken = follow([Candidate(0, 12), Candidate(1, 12), Candidate(1, 11)], 10, reads=lambda node: node == 1)
    assert [(d.action, d.step, d.node) for d in taken] == [(MEMORY, 12, 0), (MEMORY, 12, 1)]


def test_nothing_anywhere_is_a_fresh_start():
    decision = decide([], None)
    assert (decision.action, decision.step) == (FRESH, 0)
    assert decision.why == "no state in node memory and no durable checkpoint"


def test_every_memory_read_failed_and_no_durable_checkpoint_is_a_fresh_start():
    taken = follow([Candidate(0, 5), Candidate(1, 4)], None, reads=lambda node: False)
    assert [d.action for d in taken] == [MEMORY, MEMORY, FRESH]


def test_no_durable_checkpoint_verifies_and_no_memory_is_a_fresh_start():
    taken = follow([], 10, verifies=lambda step: None)
    assert [d.action for d in taken] == [VERIFY, FRESH]
    assert "verifies" in taken[-1].why


def test_the_newest_durable_failed_verification_and_memory_is_newer_than_what_is_left():
    # Listed step 10 beat memory's 8; only step 6 verifies: memory's 8 is now the newest.
    taken = follow([Candidate(0, 8)], 10, verifies=lambda step: 6)
    assert [(d.action, d.step) for d in taken] == [(VERIFY, 10), (MEMORY, 8)]


def test_the_newest_durable_failed_verification_and_nothing_verifies_memory_wins():
    taken = follow([Candidate(0, 8)], 10, verifies=lambda step: None)
    assert [(d.action, d.step) for d in taken] == [(VERIFY, 10), (MEMORY, 8)]


def test_a_verified_checkpoint_as_new_as_memory_is_loaded_after_verification():
    # Verification already read it: a tie with node memory right after it loads the checkpoint.
    taken = follow([Candidate(0, 6)], 10, verifies=lambda step: 6)
    assert [(d.action, d.step) for d in taken] == [(VERIFY, 10), (DURABLE, 6)]


def test_exact_states_only_compete_when_some_state_is_exact():
    # Step 12 is not every rank's own (world size changed); step 9 is, and beats durable 8.
    decision = decide([Candidate(0, 12, exact=False), Candidate(0, 9)], 8)
    assert (decision.action, decision.step) == (MEMORY, 9)
    assert "not every rank holds its own part" in decision.why


def test_a_verified_checkpoint_newer_than_every_exact_state_is_loaded_even_below_an_inexact_one():
    # Node memory: step 12 (not every rank's own) and step 8 (exact); durable step 10 verifies.
    # Exact states alone compete, so the checkpoint is loaded (and the choice settles).
    taken = follow([Candidate(0, 12, exact=False), Candidate(0, 8)], 10)
    assert [(d.action, d.step) for d in taken] == [(VERIFY, 10), (DURABLE, 10)]


def test_no_exact_state_lets_the_newest_inexact_one_compete():
    decision = decide([Candidate(0, 12, exact=False)], 10)
    assert (decision.action, decision.step) == (MEMORY, 12)


@pytest.mark.parametrize(
    ("setting", "kind"),
    [("auto", AUTO), (" auto ", AUTO), ("never", NEVER), ("120", NAMED), ("s3://b/ckpt/step-1", NAMED)],
)
def test_the_resume_setting_kinds(setting, kind):
    assert mode(setting) == kind
