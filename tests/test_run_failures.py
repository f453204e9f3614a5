"""How runs fail: a busy output folder, a killed parent, a full disk, corrupt or missing results
files. Each failure is one line and an exit status, never a traceback, a torn line or a
duplicate record."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_driver import EIGHT_POINTS, ROOT, RUN, TINY, _fake_record, _records, _run_in_process

from experiments import workers
from experiments.core.results import LOCK_FILE

REPORT = str(ROOT / "experiments" / "report.py")
OUT_DIR_BUSY, WRITE_FAILED = 75, 74  # the driver's exit statuses for these failures
IMPLS = {"jax": "reference", "both": "reference,naive"}
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def _long_sweep(framework: str, out_dir: Path) -> list[str]:
    """Flags of a sweep of 64 tiny points per framework: it runs well past the test's acts."""
    return [
        f"--framework={framework}",
        f"--impl={IMPLS[framework]}",
        "--mask=full,causal",
        f"--seqlen={','.join(str(16 * i) for i in range(2, 34))}",
        "--mode=fwd",
        *TINY[1:],
        f"--out_dir={out_dir}",
    ]


def _start(args: list[str], log: Path) -> subprocess.Popen:
    """run.py in the background, its output in log (a pipe would outlive a killed parent)."""
    with log.open("w") as f:
        return subprocess.Popen(
            [sys.executable, RUN, *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=f,
            stderr=subprocess.STDOUT,
        )


def _first_record(out_dir: Path, proc: subprocess.Popen, log: Path) -> dict:
    """The first record a running sweep writes (it fails the test if none comes in time)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if records := _records(out_dir):
            return records[0]
        time.sleep(0.05)
    raise AssertionError(f"no record (exit status {proc.poll()}): {log.read_text()[-3000:]}")


def _alive(pid: int) -> bool:
    """Whether a process exists and has not exited (a zombie awaiting its reaper has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _freed(lock: Path, seconds: float) -> bool:
    """Whether the run lock can be taken within `seconds` (the kernel drops it once the last
    process holding it has closed its files, which a loaded machine may take a moment to do)."""
    deadline = time.monotonic() + seconds
    while True:
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
        finally:
            os.close(fd)
        time.sleep(0.05)


def _holders(path: Path) -> list[str]:
    """'pid: command' of every process with `path` open (for a failure message)."""
    found = []
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if os.readlink(fd) == str(path.resolve()):
                cmd = (fd.parents[1] / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append(f"{fd.parents[1].name}: {cmd[:200]}")
        except OSError:
            continue
    return found


def _end(*pids: int) -> None:
    """SIGKILL the processes a test started that still run (for a regression, not a pass)."""
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _assert_each_point_once(out_dir: Path) -> list[str]:
    """The keys of the records of points (lines that carry one), checked to be distinct."""
    keys = [r["key"] for r in _records(out_dir) if "point" in r]
    assert len(keys) == len(set(keys)), "a point was recorded twice"
    return keys


@linux_only
@pytest.mark.parametrize("framework", ["jax", "both"])
def test_second_run_into_a_busy_out_dir_is_one_line_and_writes_nothing(tmp_path, framework):
    """The same command twice into one folder: the second names the first's PID and stops."""
    out_dir, log = tmp_path / "out", tmp_path / "first.log"
    args = _long_sweep(framework, out_dir)
    first = _start(args, log)
    writer = first.pid
    try:
        writer = _first_record(out_dir, first, log)["provenance"]["pid"]
        second = subprocess.Popen(
            [sys.executable, RUN, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            out, err = (s.decode() for s in second.communicate(timeout=120))
        except subprocess.TimeoutExpired:
            second.kill()
            raise
        first_still_ran = first.poll() is None
    finally:
        first.kill()
        first.wait(timeout=60)
        _end(writer)
    assert second.returncode == OUT_DIR_BUSY, err[-3000:]
    assert first_still_ran, "the first run ended before the second was refused"
    assert out == ""
    (line,) = err.splitlines()
    holder = f"PID {first.pid}: {Path(sys.executable).name} {shlex.join([RUN, *args])}"
    assert line == f"{out_dir} is in use by another run ({holder}); " + (
        "wait for it to end or pick another --out_dir."
    )
    assert second.pid not in {r["provenance"]["pid"] for r in _records(out_dir)}
    _assert_each_point_once(out_dir)


@linux_only
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killing_the_parent_ends_its_worker_and_frees_the_out_dir(tmp_path, sig):
    """--framework=both killed: its worker ends with it, and the folder's lock goes with both."""
    out_dir, log = tmp_path / "out", tmp_path / "parent.log"
    parent = _start(_long_sweep("both", out_dir), log)
    worker = parent.pid
    try:
        worker = _first_record(out_dir, parent, log)["provenance"]["pid"]
        assert worker != parent.pid and _alive(worker)
        parent.send_signal(sig)
        parent.wait(timeout=60)
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker), f"worker {worker} outlived its parent"
        lock = out_dir / LOCK_FILE
        assert _freed(lock, seconds=20), f"{lock} still held by {_holders(lock)}"
    finally:
        _end(parent.pid, worker)
    tiny = ["--framework=jax", "--impl=reference", "--mask=full", "--mode=fwd", *TINY]
    assert _run_in_process([*tiny, f"--out_dir={out_dir}"]) == 0  # the lock is free again
    _assert_each_point_once(out_dir)


# A worker that marks itself started, waits (a minute at most) for the other to start, and says
# whether it saw it and whether it holds the run's lock descriptor, then exits with `code`.
MEETING_WORKER = f"""
import os, pathlib, sys, time
me, other, code = sys.argv[1:]
folder = pathlib.Path(os.environ["MEETING"])
(folder / me).touch()
deadline = time.monotonic() + 60
while not (folder / other).exists() and time.monotonic() < deadline:
    time.sleep(0.01)
print(me, "saw", other, (folder / other).exists(), flush=True)
os.fstat(int(os.environ["{workers.LOCK_FD_ENV}"]))
print(me, "holds the lock", flush=True)
sys.exit(int(code))
"""


def _meeting(tmp_path: Path, on_line) -> dict[str, int] | int:
    """Workers a (exits 0) and b (exits 3) side by side, meeting in tmp_path."""
    cmds = {
        "a": [sys.executable, "-c", MEETING_WORKER, "a", "b", "0"],
        "b": [sys.executable, "-c", MEETING_WORKER, "b", "a", "3"],
    }
    lock_fd = os.open(tmp_path / "lock", os.O_CREAT | os.O_RDWR)
    try:
        return workers.run_side_by_side(cmds, lock_fd, on_line, {"MEETING": str(tmp_path)})
    finally:
        os.close(lock_fd)


def test_side_by_side_workers_hand_over_named_lines_and_exit_statuses(tmp_path):
    """Two workers at once (each sees the other start): every line reaches the callback under
    its worker's name, in order; each exit status comes back by name, the failing one's too."""
    got: list[tuple[str, str]] = []
    codes = _meeting(tmp_path, lambda name, line: got.append((name, line)))
    assert codes == {"a": 0, "b": 3}
    for me, other in (("a", "b"), ("b", "a")):
        mine = [line for name, line in got if name == me]
        assert mine == [f"{me} saw {other} True", f"{me} holds the lock"]


def test_side_by_side_workers_after_ctrl_c_hand_over_the_rest_and_say_interrupted(tmp_path):
    """A Ctrl-C while the parent waits: it waits for the workers (here they do not stop), hands
    over their remaining lines, and returns INTERRUPTED."""
    got: list[str] = []

    def interrupted_once(name: str, line: str) -> None:
        got.append(line)
        if len(got) == 1:
            raise KeyboardInterrupt

    assert _meeting(tmp_path, interrupted_once) == workers.INTERRUPTED
    assert len(got) == 4


def test_side_by_side_workers_die_with_the_parent_when_on_line_raises(tmp_path, monkeypatch):
    """on_line fails on the first line while the workers would run a minute more: the error
    reaches the caller at once, and both workers are killed and reaped before it does."""
    spawned: list[subprocess.Popen] = []
    real_spawn = workers.spawn

    def spawn(*args, **kwargs) -> subprocess.Popen:
        spawned.append(real_spawn(*args, **kwargs))
        return spawned[-1]

    monkeypatch.setattr(workers, "spawn", spawn)

    def fail(name: str, line: str) -> None:
        raise RuntimeError(f"on_line failed on {line}")

    slow = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    lock_fd = os.open(tmp_path / "lock", os.O_CREAT | os.O_RDWR)
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="on_line failed on started"):
            workers.run_side_by_side({"a": slow, "b": slow}, lock_fd, fail)
    finally:
        os.close(lock_fd)
        alive = [p for p in spawned if p.poll() is None]
        for proc in alive:
            proc.kill()
            proc.wait()
    assert time.monotonic() - start < 20
    assert len(spawned) == 2 and not alive
    assert [proc.returncode for proc in spawned] == [-signal.SIGKILL] * 2


def _full_disk(monkeypatch, results: Path, whole: int) -> dict[str, bytes]:
    """After `whole` appends to results, the disk fills: half a line, then ENOSPC. Returns
    {'before': the file's bytes just before the append that fails}."""
    real_write, seen = os.write, {}
    appends = []

    def write(fd: int, data) -> int:
        if not results.exists() or not os.path.samestat(os.fstat(fd), os.stat(results)):
            return real_write(fd, data)
        appends.append(len(data))
        if len(appends) <= whole:
            return real_write(fd, data)
        if "before" not in seen:
            seen["before"] = results.read_bytes()
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", write)
    return seen


def test_full_disk_stops_with_one_line_keeps_whole_lines_and_rerun_resumes(
    tmp_path, monkeypatch, capsys
):
    results = tmp_path / "results.jsonl"
    args = [*EIGHT_POINTS, f"--out_dir={tmp_path}"]
    seen = _full_disk(monkeypatch, results, whole=2)
    assert _run_in_process(args) == WRITE_FAILED
    assert results.read_bytes() == seen["before"], "the failed append left bytes behind"
    assert len(_records(tmp_path)) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"Cannot append to {results}: No space left on device; free space (or make it "
        "writable) and rerun the same command to resume."
    ]
    monkeypatch.undo()
    assert _run_in_process(args) == 0
    assert "8 points, 2 already in" in capsys.readouterr().out
    assert len(_assert_each_point_once(tmp_path)) == 8


@linux_only
def test_file_size_limit_mid_line_leaves_no_torn_line(tmp_path, capsys):
    """A real short write (RLIMIT_FSIZE, as a disk filling mid-line): one line, exit 74, the
    file byte-identical to before the failed append."""
    results = tmp_path / "results.jsonl"
    args = [*EIGHT_POINTS, f"--out_dir={tmp_path}"]
    assert _run_in_process([*args, "--seqlen=32"]) == 0  # two points: 2 whole lines
    before = results.read_bytes()
    limit = len(before) + 1000  # the next line (~3 KB) is cut short by the kernel
    start = (
        "import resource, runpy, sys; limit = int(sys.argv.pop(1)); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)); "
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    res = subprocess.run(
        [sys.executable, "-c", start, str(limit), RUN, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == WRITE_FAILED, res.stderr[-3000:]
    assert res.stderr.splitlines() == [
        f"Cannot append to {results}: File too large; free space (or make it writable) and "
        "rerun the same command to resume."
    ]
    assert results.read_bytes() == before
    capsys.readouterr()
    assert _run_in_process(args) == 0
    assert "8 points, 2 already in" in capsys.readouterr().out
    assert len(_assert_each_point_once(tmp_path)) == 8


def test_report_of_a_missing_file_is_one_line(tmp_path):
    missing = tmp_path / "nowhere" / "results.jsonl"
    res = subprocess.run(
        [sys.executable, REPORT, f"--results={missing}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode != 0
    assert res.stdout == ""
    assert res.stderr.splitlines() == [f"--results: not a file: {str(missing)!r}"]


def test_report_skips_corrupt_lines_and_says_where(tmp_path):
    """Torn, non-JSON, non-object and field-less lines: skipped, counted, named; no traceback."""
    good = [_fake_record("pallas", n, "ok") for n in (1024, 2048, 4096)]
    lines = [
        json.dumps(good[0]),
        '{"torn',
        json.dumps(good[1]),
        "not json at all",
        json.dumps({"key": "jax/xla/1024", "status": "ok"}),
        "[1, 2]",
        json.dumps(good[2]),
    ]
    results = tmp_path / "results.jsonl"
    results.write_text("\n".join(lines) + "\n")
    res = subprocess.run(
        [sys.executable, REPORT, f"--results={results}", f"--out_dir={tmp_path / 'rep'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.splitlines() == [
        f"Skipped 4 unreadable lines of {results} (torn, not JSON, or missing "
        "required fields): lines 2, 4, 5, 6"
    ]
    rows = (tmp_path / "rep" / "results.csv").read_text().splitlines()[1:]
    assert [r.split(",")[0] for r in rows] == [r["key"] for r in good]


def test_a_gzipped_results_file_reads_as_the_plain_one(tmp_path, capsys):
    """A results file kept compressed (name ending .gz) gives the same records and the same
    skipped lines as the plain file."""
    import gzip

    from experiments.core.results import read_json_lines

    good = [_fake_record("pallas", n, "ok") for n in (1024, 2048)]
    text = "\n".join([json.dumps(good[0]), '{"torn', json.dumps(good[1])]) + "\n"
    plain, packed = tmp_path / "results.jsonl", tmp_path / "results.jsonl.gz"
    plain.write_text(text)
    packed.write_bytes(gzip.compress(text.encode()))
    assert read_json_lines(packed) == read_json_lines(plain) == good
    assert capsys.readouterr().err.count("): line 2") == 2
    whole = gzip.compress("".join(json.dumps(r) + "\n" for r in good * 200).encode())
    packed.write_bytes(whole[: len(whole) // 2])  # a copy cut short
    first = read_json_lines(packed)
    assert 0 < len(first) < 400 and all(r in good for r in first)
    assert "is cut short" in capsys.readouterr().err


def test_a_sweep_says_once_which_lines_it_skips_and_reruns_their_points(tmp_path, capsys):
    """Every read of a run (resume, statuses, report) skips the lines; one line says so."""
    args = ["--framework=jax", "--impl=reference", "--mask=full", "--mode=fwd", *TINY[1:-1]]
    assert _run_in_process([*args, "--seqlen=32", f"--out_dir={tmp_path}"]) == 0
    results = tmp_path / "results.jsonl"
    (record,) = _records(tmp_path)
    no_point = {k: v for k, v in record.items() if k != "point"}
    with results.open("a") as f:
        f.write("\n".join([*(["garbage"] * 5), json.dumps(no_point), '{"to']))
    capsys.readouterr()
    more = ["--seqlen=32,48", f"--out_dir={tmp_path}", "--report=true"]
    assert _run_in_process([*args, *more]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"Skipped 7 unreadable lines of {results} (torn, not JSON, or missing "
        "required fields): lines 2, 3, 4, 5, 6, ..."
    ]
    assert len(_assert_each_point_once(tmp_path)) == 2
