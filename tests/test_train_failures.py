"""train_step fails cleanly: an unusable folder or flag value ends the run in one line, a failed
checkpoint write still ends the process, --resume passes over damaged checkpoints, and a resumed
run logs every step once."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_workload import ROOT, TINY, TINY_FLAGS, Interrupted, _parse_run_flags, run

from experiments.core.results import read_records
from experiments.workloads import train_step
from experiments.workloads.config import TrainConfig
from experiments.workloads.records import STEP_LOG_FILE, StepLog

USAGE_ERROR = 2  # exit status of an unusable flag value (docs/training.md, Failure behaviour)
CLI_TIMEOUT_S = 60  # a run that hangs (Orbax threads left waiting) fails instead of hanging CI
# Orbax 0.12 writes checkpoint step N into this folder first, then renames it to N.
ORBAX_TMP_SUFFIX = ".orbax-checkpoint-tmp"


def _cli(*args: str) -> tuple[int, list[str]]:
    """Exit status and output lines (stdout and stderr) of run.py --workload=train_step on the
    tiny model in a fresh process; TimeoutExpired if it does not end."""
    proc = subprocess.run(
        [sys.executable, "experiments/run.py", "--workload=train_step", *TINY_FLAGS, *args],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    return proc.returncode, proc.stdout.splitlines()


def test_a_ckpt_dir_that_is_a_file_ends_the_run_in_one_line(tmp_path):
    file = tmp_path / "a_file"
    file.write_text("")
    args = ["--checkpoint_every=5", "--steps=10", f"--ckpt_dir={file}", f"--out_dir={tmp_path}"]
    code, lines = _cli(*args)
    assert code == USAGE_ERROR, lines
    assert len(lines) == 1 and lines[0].startswith(f"train_step: --ckpt_dir={file}: "), lines
    assert "expected a folder" in lines[0]


@pytest.mark.parametrize(
    "flag,expected",
    [
        ("--out_dir=/proc/x", "cannot create this folder"),
        ("--out_dir=/proc", "cannot write in this folder"),
        ("--ckpt_dir={tmp}/a_file/sub", "cannot create this folder"),
        ("--seqlen=256,512", "takes one sequence length"),
    ],
)
def test_an_unusable_flag_value_ends_the_run_in_one_line(tmp_path, flag, expected):
    (tmp_path / "a_file").write_text("")
    flag = flag.format(tmp=tmp_path)
    code, lines = _cli(f"--out_dir={tmp_path}", "--checkpoint_every=2", "--steps=2", flag)
    assert code == USAGE_ERROR, lines
    assert len(lines) == 1 and lines[0].startswith(f"train_step: {flag}: "), lines
    assert expected in lines[0]


def test_a_failed_checkpoint_write_ends_the_process(tmp_path):
    """--ckpt_dir passes its checks, then Orbax cannot make step 1's folder (a dangling link
    holds its name): one error line, exit status 1, and the process ends."""
    ckpt_dir = tmp_path / "ck"
    ckpt_dir.mkdir()
    (ckpt_dir / f"1{ORBAX_TMP_SUFFIX}").symlink_to(tmp_path / "nowhere")
    args = ["--steps=2", "--checkpoint_every=1", "--warmup=1", "--iters=1"]
    code, lines = _cli(*args, f"--ckpt_dir={ckpt_dir}", f"--out_dir={tmp_path / 'out'}")
    assert code == 1, lines
    errors = [line for line in lines if line.startswith("train_step: error: ")]
    assert len(errors) == 1 and f"{ckpt_dir}/1{ORBAX_TMP_SUFFIX}" in errors[0], lines
    assert not any("Traceback" in line for line in lines), lines


def _interrupted(tmp_path: Path, steps: int, every: int, last_step: int) -> TrainConfig:
    """Run TINY with checkpoints until `last_step` completes, then kill it; the same run with
    --resume."""
    cfg = dataclasses.replace(
        TINY,
        steps=steps,
        checkpoint_every=every,
        ckpt_dir=str(tmp_path / "ck"),
        out_dir=str(tmp_path / "out"),
    )

    def kill(step: int, loss: float) -> None:
        if step == last_step:
            raise Interrupted

    with pytest.raises(Interrupted):
        run(cfg, on_step=kill)
    return dataclasses.replace(cfg, resume=True)


def _truncate_meta(step_dir: Path) -> None:
    """Cut the checkpoint's JSON metadata to nothing, as a kill during a copy would."""
    (step_dir / "meta" / "metadata").write_text("")


def _truncate_largest_array_file(step_dir: Path) -> None:
    """Cut the largest array data file of the checkpoint to half its size."""
    largest = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=os.path.getsize)
    os.truncate(largest, largest.stat().st_size // 2)


def _step_dirs(ckpt_dir: str | Path) -> list[str]:
    """The names in a checkpoint folder (its step folders)."""
    return sorted(p.name for p in Path(ckpt_dir).iterdir())


@pytest.mark.parametrize("damage", [_truncate_meta, _truncate_largest_array_file])
def test_resume_passes_over_a_damaged_newest_checkpoint(tmp_path, monkeypatch, damage):
    resumed = _interrupted(tmp_path, steps=6, every=2, last_step=4)  # checkpoints 2 and 4
    assert _step_dirs(resumed.ckpt_dir) == ["2", "4"]
    damage(Path(resumed.ckpt_dir) / "4")
    unraisable = []  # errors Python would print as 'Exception ignored in: ...'
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    out = io.StringIO()
    got = train_step.run(resumed, stream=out)
    gc.collect()
    assert got.start_step == 2 and got.record["status"] == "ok"
    lines = out.getvalue().splitlines()
    (damaged,) = [line for line in lines if line.startswith("--resume: ")]
    assert damaged.startswith(f"--resume: checkpoint step 4 at {resumed.ckpt_dir}/4 is damaged (")
    assert damaged.endswith("; trying step 2"), damaged
    assert f"Resumed from {resumed.ckpt_dir} at step 2 (deleted damaged step 4)" in lines, lines
    # No 'Exception ignored in: <coroutine ...>' from Orbax's abandoned array reads either (an
    # unrelated asyncio 'Event loop is closed' at a collection is not Orbax's reads' and may come).
    abandoned = [u for u in unraisable if inspect.iscoroutine(u.object)]
    assert not abandoned, abandoned
    assert _step_dirs(resumed.ckpt_dir) == ["4", "6"]  # step 4 written again, then the last
    assert train_step.run(resumed, stream=out).start_step == 6  # both read back


def _run_flags(args: list[str]) -> int:
    """train_step.run_from_flags on the tiny model with `args` (exit status)."""
    fv = _parse_run_flags(["--workload=train_step", *TINY_FLAGS, *args])
    try:
        return train_step.run_from_flags(fv)
    finally:
        fv.unparse_flags()


def test_resume_with_no_intact_checkpoint_fails_in_one_line(tmp_path, capsys):
    ckpt_dir = tmp_path / "ck"
    args = ["--steps=4", "--checkpoint_every=2", "--warmup=1", "--iters=1"]
    args += [f"--ckpt_dir={ckpt_dir}", f"--out_dir={tmp_path}"]
    assert _run_flags(args) == 0
    for step_dir in ckpt_dir.iterdir():
        _truncate_meta(step_dir)
    capsys.readouterr()
    assert _run_flags([*args, "--resume"]) == 1
    lines = capsys.readouterr().out.splitlines()
    damaged = [line for line in lines if line.startswith("--resume: checkpoint step ")]
    assert len(damaged) == 2 and all(" is damaged (JSONDecodeError: " in d for d in damaged)
    errors = [line for line in lines if line.startswith("train_step: error: ")]
    assert errors == [
        f"train_step: error: --resume: no intact checkpoint in {ckpt_dir} (damaged: steps "
        "4, 2); move or delete that folder to start from step 0"
    ], lines
    assert _step_dirs(ckpt_dir) == ["2", "4"]  # nothing deleted


def test_a_resumed_run_logs_every_step_once(tmp_path):
    resumed = _interrupted(tmp_path, steps=8, every=4, last_step=5)  # steps 0-5 logged
    log = StepLog(resumed.out_dir)
    other = {"key": "another/run/step5", "step": 5, "loss": 1.0}
    log.append(other)
    got = run(resumed)
    assert got.start_step == 4
    lines = read_records(log.path)
    steps = [line["step"] for line in lines if line != other]
    assert steps == list(range(8)), steps  # steps 4 and 5 once each, in order
    assert other in lines  # another run's lines are kept
    assert not (log.path.parent / f"{STEP_LOG_FILE}.tmp").exists()
