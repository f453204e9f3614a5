"""Ctrl-C during a sweep: the first one waits for a point boundary, the second interrupts."""

import os
import signal
import threading

import pytest

from experiments.core import interrupt, sweep
from experiments.core.points import Grid, expand
from experiments.core.results import ResultsStore, read_records

pytestmark = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(),
    reason="signal handlers can only be installed from the main thread",
)


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def test_first_ctrl_c_is_deferred_to_the_point_boundary(capfd):
    before = signal.getsignal(signal.SIGINT)
    with interrupt.stop_between_points():
        _ctrl_c()  # no exception here, in the middle of a point
        err = capfd.readouterr().err  # ... but the user is told at once what will happen
        assert err.strip() == "stopping after the running point; Ctrl-C again to stop now"
        with pytest.raises(KeyboardInterrupt):
            interrupt.raise_if_requested()
    assert signal.getsignal(signal.SIGINT) is before
    interrupt.raise_if_requested()  # the request does not outlive the sweep


def test_second_ctrl_c_interrupts_at_once():
    with interrupt.stop_between_points():
        _ctrl_c()
        with pytest.raises(KeyboardInterrupt):
            _ctrl_c()


class _Runner:
    """Runs a point; the second point's run receives a Ctrl-C mid-way."""

    def __init__(self, seen: list):
        self.seen = seen

    def run(self, point):
        self.seen.append(point)
        if len(self.seen) == 2:
            _ctrl_c()
        return {"metrics": {}, "check": {"passed": True}}


def test_point_loop_records_the_running_point_then_stops(tmp_path):
    grid = Grid(
        name="tiny",
        cps=("none",),
        layouts=("contiguous",),
        impls=("reference",),
        masks=("full",),
        seqlens=(16, 32, 48),
        heads=((2, 1),),
        head_dim=8,
        dtype="fp32",
        modes=("fwd",),
    )
    kw = dict(seed=0, num_devices=1, ulysses_size=None, ulysses_intra_node=True)
    points = expand(grid, "jax", grid.impls, **kw)
    seen: list = []
    store = ResultsStore(tmp_path)
    with interrupt.stop_between_points(), pytest.raises(KeyboardInterrupt):
        sweep.run_points(points, lambda p: _Runner(seen), store=store, progress=None, provenance={})
    assert seen == points[:2]
    assert [r["key"] for r in read_records(store.path)] == [p.key for p in points[:2]]
    assert all(r["status"] == "ok" for r in read_records(store.path))
