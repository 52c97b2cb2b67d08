"""Dropping the rows of requests nobody waits for from a running batch (``pipeline.loop``):
the others finish exactly as an uninterrupted run of the same batch would have them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipeline.cache_dit_params import CacheDiTParams
from pipeline.errors import BatchCancelled, dropped_rows
from pipeline.runner import BatchRunner
from tests.helpers import batch_of
from tests.helpers import flux_params as params
from tests.helpers import video_params

GUIDED = dict(negative="blurry", true_cfg_scale=3.0, size=(64, 64), steps=6)


def _gone_after(step: int, ids: set[str]):
    """``(on_step, requests_gone)``: ``ids`` are gone once ``step`` steps have run."""
    done = {"steps": 0}

    def on_step(steps: int, _total: int) -> None:
        done["steps"] = steps

    return on_step, lambda: frozenset(ids) if done["steps"] >= step else frozenset()


def _same_except(full, cut, gone: set[int]):
    for i, (a, b) in enumerate(zip(full.images, cut.images, strict=True)):
        if i in gone:
            assert b is None
        else:
            assert np.abs(a - b).max() <= 1e-5, i


@pytest.fixture(scope="module")
def flux():
    return BatchRunner("tiny-flux")


def test_flux_rows_of_a_gone_request_are_dropped_and_the_others_unchanged(flux):
    """Three requests (one of n=2), guided with the CFG gate (its reused delta is cut too)."""
    batch = batch_of(*(dataclasses.replace(params(f"prompt {s}", s, n=n, **GUIDED), cfg_gate_fraction=0.5)
                       for s, n in ((1, 1), (2, 2), (3, 1))))
    full = flux.denoise(batch)
    on_step, gone = _gone_after(2, {"r2"})
    cut = flux.denoise(batch, on_step=on_step, requests_gone=gone)
    assert cut.dropped == {1: 2}
    _same_except(full, cut, {1})
    on_step, gone = _gone_after(1, {"r1", "r3"})
    outputs = flux.run(batch, on_step=on_step, requests_gone=gone)
    assert [o.dropped_at_step for o in outputs] == [1, None, 1] and outputs[0].images == []
    assert len(outputs[1].images) == 2


def test_wan_rows_are_dropped_from_the_multistep_scheduler_history_too():
    """Wan's UniPC scheduler combines the previous model outputs of every row: they are cut too."""
    runner = BatchRunner("tiny-wan")
    fields = dict(guidance_scale=4.0, negative_prompt="blurry", num_inference_steps=5, size="64x64")
    batch = batch_of(*(video_params(runner.family, f"prompt {s}", s, **fields) for s in (1, 2, 3)))
    full = runner.denoise(batch)
    on_step, gone = _gone_after(2, {"v1"})
    cut = runner.denoise(batch, on_step=on_step, requests_gone=gone)
    assert cut.dropped == {0: 2}
    _same_except(full, cut, {0})


def test_a_batch_running_cache_dit_keeps_its_rows(flux):
    """Cache-DiT's buffers hold every row's residuals: its rows are not dropped, the batch runs
    to the end, and the next batch equals a fresh run."""
    key = CacheDiTParams(Fn_compute_blocks=1, max_warmup_steps=2, residual_diff_threshold=0.5)
    batch = batch_of(*(dataclasses.replace(params(f"prompt {s}", s, **GUIDED), enable_cache_dit=True,
                                           cache_dit_params=key) for s in (1, 2)))
    on_step, gone = _gone_after(2, {"r1"})
    cut = flux.denoise(batch, on_step=on_step, requests_gone=gone)
    assert cut.dropped is None and all(images is not None for images in cut.images)
    again = flux.denoise(batch)
    fresh = BatchRunner("tiny-flux").denoise(batch)
    for a, b in zip(again.images, fresh.images, strict=True):
        assert np.abs(a - b).max() <= 1e-5


def test_when_every_runnable_request_is_gone_the_failed_ones_still_get_their_400(flux):
    """A request whose own text failed to encode is answered with its 400 even when the others'
    callers all left: the batch ends there (decoding nothing) instead of stopping as unwanted."""
    good = params("a red circle", 1, steps=4, size=(64, 64))
    poisoned = dataclasses.replace(good, prompt="\ud800", request_id="poison", seed=99)
    on_step, gone = _gone_after(1, {"r1"})
    outputs = flux.run(batch_of(poisoned, good), on_step=on_step, requests_gone=gone)
    assert outputs[0].error is not None and outputs[0].error.status_code == 400
    assert outputs[1].dropped_at_step == 1 and outputs[1].images == []


def test_a_stopped_batch_names_the_rows_it_had_dropped_before(flux):
    """A request whose rows left the batch at step 1, then the others' callers leave too: the
    batch stops (``BatchCancelled``) and still names the request dropped earlier and its step,
    so the Router counts its saved work (the replica's ``cancelled_at`` event carries it); the
    same when the stop comes from ``should_stop`` instead of every row being gone."""
    batch = batch_of(*(params(f"prompt {s}", s, steps=6, size=(64, 64)) for s in (1, 2, 3)))
    done = {"steps": 0}

    def on_step(steps: int, _total: int) -> None:
        done["steps"] = steps

    def gone():
        return frozenset({"r2"} if done["steps"] < 3 else {"r1", "r2", "r3"})

    with pytest.raises(BatchCancelled) as stopped:
        flux.denoise(batch, on_step=on_step, requests_gone=gone)
    assert (stopped.value.steps_done, stopped.value.steps, stopped.value.dropped) == (3, 6, {1: 1})
    done["steps"] = 0
    with pytest.raises(BatchCancelled) as stopped:
        flux.denoise(batch, on_step=on_step, requests_gone=lambda: frozenset({"r3"}),
                     should_stop=lambda: done["steps"] >= 2)
    assert (stopped.value.steps_done, stopped.value.dropped) == (2, {2: 1})


def test_a_failed_batch_names_the_rows_it_had_dropped_before(flux, monkeypatch):
    """The model fails at step 4 after request r2's rows left at step 1: the error the runner
    raises names r2 and its step (``dropped_rows``), so the Router still counts its saved work;
    a failure with nothing dropped names nothing. A failure of the encoding after the loop fails
    each request it hits alone (``encoding_failed``), the dropped one still reported dropped."""
    batch = batch_of(*(params(f"prompt {s}", s, steps=6, size=(64, 64)) for s in (1, 2, 3)))
    done = {"steps": 0}

    def on_step(steps: int, _total: int) -> None:
        done["steps"] = steps
        if steps == 4:
            raise RuntimeError("the model failed")

    with pytest.raises(RuntimeError, match="the model failed") as failed:
        flux.run(batch, on_step=on_step, requests_gone=lambda: frozenset({"r2"}))
    assert dropped_rows(failed.value) == {1: 1}
    done["steps"] = 0
    with pytest.raises(RuntimeError, match="the model failed") as failed:
        flux.run(batch, on_step=on_step)
    assert dropped_rows(failed.value) == {}
    # encoding fails after the loop ended with r2 dropped at step 1: r1 and r3 fail alone, r2 is named
    import pipeline.runner

    def broken_encoder(*_args, **_kwargs):
        raise OSError("the encoder failed")

    monkeypatch.setattr(pipeline.runner, "encode_image", broken_encoder)
    outputs = flux.run(batch, requests_gone=lambda: frozenset({"r2"}))
    assert [o.error.code if o.error else None for o in outputs] == ["encoding_failed", None, "encoding_failed"]
    assert [o.dropped_at_step for o in outputs] == [None, 1, None]
    monkeypatch.undo()
    # the runner is left consistent: the next batch equals a fresh run's
    assert np.array_equal(flux.denoise(batch).images[0], BatchRunner("tiny-flux").denoise(batch).images[0])


@pytest.mark.parametrize(("steps_done", "num_steps", "elapsed_s", "expected"), [
    (0, 16, 0.25, True),  # no step done after the first wait: a long batch
    (15, 16, 0.25, False),  # one step left of a quarter-second batch: a poll costs more
    (8, 16, 0.25, False),  # 0.25 s left
    (4, 16, 0.25, True),  # 0.75 s left
    (2, 4, 1.0, True),  # 1 s left
    (16, 16, 0.3, False),  # done (decoding): no rows left to drop
    (12, 8, 0.3, False),  # past the end (cannot happen: num_steps is what runs): no poll
])
def test_a_running_batch_asks_for_its_callers_only_while_enough_of_it_is_left(steps_done, num_steps, elapsed_s,
                                                                               expected):
    from deployments.replica import WANTED_MIN_REMAINING_S, worth_polling

    assert WANTED_MIN_REMAINING_S == 0.5
    assert worth_polling(steps_done, num_steps, elapsed_s) is expected
