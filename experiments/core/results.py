"""The JSON-lines results store: one record per finished point, durable and whole as soon as
written, and the lock that lets one run at a time write into an output folder."""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import json
import math
import os
import shlex
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from experiments.core.outcomes import ERROR

RESULTS_FILE = "results.jsonl"
LOCK_FILE = ".run.lock"
RECORD_FIELDS = ("key", "status", "point")
SHOWN_LINES = 5  # line numbers named in the one line about skipped lines


class AppendFailed(Exception):
    """A record could not be appended (disk full, read-only, ...); the file keeps whole lines."""

    exit_code = 74  # EX_IOERR

    def __init__(self, path: Path, error: OSError) -> None:
        super().__init__(
            f"Cannot append to {path}: {error.strerror or error}; free space (or make it "
            "writable) and rerun the same command to resume."
        )


class OutDirBusy(Exception):
    """Another run holds the output folder's lock; the message names that process."""

    exit_code = 75  # EX_TEMPFAIL: try again later

    def __init__(self, out_dir: Path, holder: str) -> None:
        super().__init__(
            f"{out_dir} is in use by another run ({holder}); wait for it to end or pick "
            "another --out_dir."
        )


class _SkippedLines:
    """Reports skipped lines on stderr, each file's set of them once per process."""

    def __init__(self) -> None:
        self.enabled = True
        self.reported: set[tuple[str, tuple[int, ...]]] = set()

    def report(self, path: Path, numbers: list[int]) -> None:
        """One line: how many lines of path readers skip, and the first few line numbers."""
        seen = (str(path.resolve()), tuple(numbers))
        if not numbers or not self.enabled or seen in self.reported:
            return
        self.reported.add(seen)
        s = "" if len(numbers) == 1 else "s"
        shown = ", ".join(map(str, numbers[:SHOWN_LINES]))
        more = ", ..." if len(numbers) > SHOWN_LINES else ""
        print(
            f"Skipped {len(numbers)} unreadable line{s} of {path} (torn, not JSON, or missing "
            f"required fields): line{s} {shown}{more}",
            file=sys.stderr,
            flush=True,
        )


_skipped_lines = _SkippedLines()


def leave_skipped_lines_to_parent() -> None:
    """In a run's worker: say nothing of skipped lines, the parent run reports them once."""
    _skipped_lines.enabled = False


def folder_problem(path: str | os.PathLike) -> str | None:
    """Why files cannot be written in folder `path` (created if missing), or None: it is a
    file, it cannot be created, or a trial file cannot be written in it."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        return "is a file; expected a folder (or a path for one)"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot create this folder ({e.strerror or e}); expected one that can be created"
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"cannot write in this folder ({e.strerror or e}); expected a writable folder"
    return None


def _jsonable(x: object) -> object:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, np.generic):
        return _jsonable(x.item())
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def is_results_line(line: dict) -> bool:
    """Whether a results-file line is usable: a whole record (key, status, point object), or a
    keyless line of an older format that the reports convert."""
    if "key" not in line:
        return True
    return all(f in line for f in RECORD_FIELDS) and isinstance(line["point"], dict)


def _has_key(line: dict) -> bool:
    """Whether a JSON line has a key (what readers of other JSON-lines logs require)."""
    return "key" in line


def read_records(path: str | os.PathLike, keep: Callable[[dict], bool] = _has_key) -> list[dict]:
    """The keyed lines of a JSON-lines file that `keep` accepts (is_results_line for results
    files); the others are skipped and reported once on stderr."""
    return [line for line in read_json_lines(path, keep) if "key" in line]


def read_json_lines(
    path: str | os.PathLike, keep: Callable[[dict], bool] = is_results_line
) -> list[dict]:
    """The JSON-object lines of a file that `keep` accepts (none if it does not exist); the
    others (torn by a kill, corrupt, missing fields) are skipped and reported once on stderr.
    A name ending in .gz is read through gzip (large committed runs are kept compressed); a
    compressed file cut short gives its lines up to the cut, and says so on stderr."""
    path = Path(path)
    if not path.exists():
        return []
    kept, skipped = [], []
    with gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb") as f:
        try:
            for number, raw in enumerate(f, 1):
                line = _json_object(raw)
                if line is not None and keep(line):
                    kept.append(line)
                elif raw.strip():
                    skipped.append(number)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            print(f"{path} is cut short ({e}): read its lines before the cut", file=sys.stderr)
    _skipped_lines.report(path, skipped)
    return kept


def check_lines(path: str | os.PathLike) -> None:
    """Report (once, on stderr) the lines of a results file that its readers skip."""
    read_json_lines(path)


def _json_object(raw: bytes) -> dict | None:
    """A line's JSON object, or None for a blank, torn or non-object line."""
    try:
        line = json.loads(raw)
    except ValueError:
        return None
    return line if isinstance(line, dict) else None


def latest_by_key(records: list[dict]) -> dict[str, dict]:
    """The last record of each point key (a retried point supersedes its earlier record)."""
    out: dict[str, dict] = {}
    for r in records:
        out[r["key"]] = r
    return out


def _append_whole(fd: int, data: bytes) -> None:
    """Append data to an O_APPEND file and fsync it; on failure cut the file back to its size
    before (a torn line is never left behind) and re-raise."""
    size = os.fstat(fd).st_size
    if size and os.pread(fd, 1, size - 1) != b"\n":
        data = b"\n" + data  # a line torn by a kill stays a line of its own
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)
        raise


class ResultsStore:
    """Appends records to <out_dir>/results.jsonl whole and fsynced, and knows finished keys."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / RESULTS_FILE

    def records(self) -> list[dict]:
        """Every whole record of the file, in file order."""
        return read_records(self.path, is_results_line)

    def done_keys(self, *, retry_errors: bool = False) -> set[str]:
        """Keys already recorded (errors excluded when they are to be retried)."""
        latest = latest_by_key(self.records())
        return {k for k, r in latest.items() if not (retry_errors and r.get("status") == ERROR)}

    def append(self, record: dict) -> None:
        """Write one record durably as one whole line, or nothing of it (AppendFailed)."""
        data = (json.dumps(_jsonable(record), sort_keys=True, allow_nan=False) + "\n").encode()
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError as e:
            raise AppendFailed(self.path, e) from None
        try:
            _append_whole(fd, data)
        except OSError as e:
            raise AppendFailed(self.path, e) from None
        finally:
            os.close(fd)


@contextlib.contextmanager
def locked_out_dir(out_dir: str | os.PathLike, inherited_fd: int | None = None) -> Iterator[int]:
    """Hold out_dir's run lock for the block and yield its descriptor (for workers to inherit).

    A worker passes the descriptor its parent run gave it: the lock is the parent's, held as
    long as either lives. OutDirBusy (naming the holder) if another run holds the lock. The
    kernel drops the lock when the last holder exits, also on kill -9.
    """
    out_dir = Path(out_dir)
    fd = _adopted(out_dir, inherited_fd)
    if fd is None:
        fd = _locked(out_dir)
    try:
        yield fd
    finally:
        os.close(fd)


def _adopted(out_dir: Path, fd: int | None) -> int | None:
    """fd if it is out_dir's lock file and holds its lock (a parent run's, inherited)."""
    if fd is None:
        return None
    try:
        if not os.path.samestat(os.fstat(fd), os.stat(out_dir / LOCK_FILE)):
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # succeeds only on the holding file
    except OSError:
        return None
    return fd


def _locked(out_dir: Path) -> int:
    """A descriptor of out_dir's lock file, locked by this process, which it names as holder."""
    path = out_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OutDirBusy(out_dir, _holder(path)) from None
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    holder = {"pid": os.getpid(), "command": command}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    return fd


def _holder(path: Path) -> str:
    """Who holds a lock file, as its holder wrote it: 'PID n: command'."""
    try:
        holder = json.loads(path.read_bytes())
        return " ".join(f"PID {holder['pid']}: {holder['command']}".split())
    except (OSError, ValueError, TypeError, KeyError):
        return "PID unknown"
