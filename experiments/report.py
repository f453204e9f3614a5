"""The report of one or more results.jsonl files (the driver writes it after every run):

    python experiments/report.py --results=results/local/x/results.jsonl --out_dir=report/
    python experiments/report.py --results=cp_jax/results.jsonl,cp_torch/results.jsonl
    python experiments/report.py --results=sim/results.jsonl --compare_with=gpus/results.jsonl
    python experiments/report.py --results=grid/results.jsonl --control_repeats=c1.jsonl,c2.jsonl

report.md, results.csv, plots and mask pictures; for CP points also cp_report.md (efficiency
against the single-GPU rate, JAX vs PyTorch, targets, scaling). See experiments/reports/.
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import app, flags

from experiments.reports import report
from experiments.reports.report_parts import md_table

RESULTS = flags.DEFINE_list("results", None, "results.jsonl files (comma list).", required=True)
OUT_DIR = flags.DEFINE_string("out_dir", None, "Report folder (default: beside the first file).")
COMPARE_WITH = flags.DEFINE_list(
    "compare_with",
    None,
    "Results files of measured multi-device CP points: each simulated point of --results is "
    "printed beside the measured point of the same configuration.",
)

CONTROL_REPEATS = flags.DEFINE_list(
    "control_repeats",
    None,
    "Results files of repeat runs of the cuDNN control (one run each): the JAX-vs-PyTorch "
    "table judges the control on the median of each framework's runs of a point.",
)


def _missing_files() -> str | None:
    """A line naming the --results/--compare_with paths that are not files, or None."""
    given = (
        ("results", RESULTS.value),
        ("compare_with", COMPARE_WITH.value or []),
        ("control_repeats", CONTROL_REPEATS.value or []),
    )
    for flag, files in given:
        missing = [p for p in files if not Path(p).is_file()]
        if missing:
            return f"--{flag}: not a file: {', '.join(map(repr, missing))}"
    return None


def main(argv: list[str]) -> int:
    """Write the report of existing results files (one line and status 1 if one is missing:
    absl's usage error would print the flags' help first)."""
    del argv
    missing = _missing_files()
    if missing:
        print(missing, file=sys.stderr)
        return 1
    out_dir = OUT_DIR.value or str(Path(RESULTS.value[0]).parent)
    paths = report.write_report(
        RESULTS.value, out_dir, COMPARE_WITH.value or (), CONTROL_REPEATS.value or ()
    )
    if COMPARE_WITH.value:
        rows = paths["comparison"]
        table = md_table(list(rows[0]), [list(r.values()) for r in rows]) if rows else []
        print("\n".join(table or ["No measured CP point matches a simulated one."]))
    cp = f"; CP report: {paths['cp_report']}" if paths["cp_report"] else ""
    print(f"Report: {paths['markdown']} ({len(paths['plots'])} plots){cp}")
    return 0


if __name__ == "__main__":
    app.run(main)
