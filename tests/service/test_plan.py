"""The engine's decision (service/plan.py) alone: given pending prompt pieces and the decode batch's streams, which
pieces run, how the batch changes and whether it steps.  No model, no thread, no clock: states in, a plan out."""

from dataclasses import dataclass

from service import plan
from service.settings import Tuning

TUNING = Tuning(lookahead=8, rotate=8, gather=4)
BUDGET = 32  # new prompt tokens a call may take (--batch-tokens)


@dataclass
class Lane:
    queued: int = 0  # tokens its reader has not taken
    since: int = 0


def decide(rows, outside=(), pieces=(), steps=0, max_rows=64, live=None, shrink=False):
    live = list(range(len(rows))) if live is None else live
    return plan.schedule(list(pieces), rows, live, list(outside), steps, max_rows, BUDGET, TUNING, shrink)


def test_prompt_pieces_are_taken_oldest_first_within_rows_and_the_token_budget():
    assert plan.prompts([16, 16, 10], max_batch=8, max_tokens=32) == 2  # a third row would pad 3 x 16 > 32
    assert plan.prompts([10, 10, 10], max_batch=8, max_tokens=32) == 3  # 3 x 10 fits
    assert plan.prompts([4, 30], max_batch=8, max_tokens=32) == 1  # 2 x 30 does not
    assert plan.prompts([40, 1], max_batch=8, max_tokens=32) == 1  # a piece past the budget still runs, alone
    assert plan.prompts([1] * 10, max_batch=4, max_tokens=32) == 4  # rows capped
    assert plan.prompts([], max_batch=4, max_tokens=32) == 0


def test_a_batch_whose_readers_keep_up_steps_unchanged():
    got = decide([Lane(1), Lane(0), Lane(3)])
    assert got.regroup is None and got.step and got.prompts == 0 and not got.idle


def test_nothing_to_do_when_every_row_is_ahead_of_its_reader_and_no_one_waits():
    got = decide([Lane(8), Lane(9)])
    assert got.idle  # the engine waits for a reader


def test_a_row_far_ahead_leaves_with_its_state_while_another_reader_waits():
    got = decide([Lane(8, since=0), Lane(0, since=0), Lane(2, since=0)])
    assert (got.regroup.keep, got.regroup.out, got.regroup.enter) == ([1, 2], [0], [])
    assert got.step  # the rows left are not ahead


def test_readers_a_few_tokens_apart_only_pause_the_batch():
    got = decide([Lane(8), Lane(3)])  # one far ahead, the other has tokens to read: nobody starves
    assert got.regroup is None and not got.step


def test_finished_rows_leave_and_waiting_streams_come_in():
    got = decide([Lane(0), Lane(0), Lane(1)], outside=[Lane(0, since=2), Lane(8, since=1)], live=[0, 2], steps=5)
    # row 1 is gone (not live); the outside stream ahead of its reader stays outside
    assert (got.regroup.keep, got.regroup.out, got.regroup.enter) == ([0, 2], [], [0])
    assert got.step


def test_more_streams_than_rows_rotate_the_oldest_rows_out_after_their_turn():
    rows = [Lane(0, since=0), Lane(0, since=3)]
    waiting = [Lane(0, since=1)]
    early = decide(rows, waiting, steps=7, max_rows=2)  # no row has run `rotate` steps yet
    assert early.regroup is None
    due = decide(rows, waiting, steps=8, max_rows=2)  # row 0 has: it gives way to the waiting stream
    assert (due.regroup.keep, due.regroup.out, due.regroup.enter) == ([1], [0], [0])


def test_new_streams_wait_a_few_steps_to_join_together_while_prompts_are_prefilled():
    rows, new = [Lane(0, since=0)], [Lane(0, since=10)]
    assert decide(rows, new, pieces=[12], steps=11).regroup is None  # more prompts coming: wait
    assert decide(rows, new, pieces=[12], steps=10 + TUNING.gather).regroup.enter == [0]  # waited long enough
    assert decide(rows, new, steps=11).regroup.enter == [0]  # no prompt pending: join now


def test_a_shrink_regroups_a_batch_that_otherwise_stays():
    got = decide([Lane(0), Lane(0)], shrink=True)
    assert (got.regroup.keep, got.regroup.out, got.regroup.enter) == ([0, 1], [], [])


def test_prompts_and_a_step_share_one_plan():
    got = decide([Lane(0)], pieces=[10, 10, 20])
    assert got.prompts == 2 and got.step and got.regroup is None  # 3 x 20 > 32: the third waits for the next turn
