"""The report of one or more results.jsonl files (the driver writes it after every run):

    python experiments/report.py --results=results/local/x/results.jsonl --out_dir=report/
    python experiments/report.py --results=cp_jax/results.jsonl,cp_torch/results.jsonl

report.md, results.csv, plots and mask pictures; for CP points also cp_report.md (efficiency
against the single-GPU rate, JAX vs PyTorch, targets, scaling). See experiments/reports/.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from absl import app, flags  # noqa: E402

from experiments.reports import report  # noqa: E402

RESULTS = flags.DEFINE_list("results", None, "results.jsonl files (comma list).", required=True)
OUT_DIR = flags.DEFINE_string("out_dir", None, "Report folder (default: beside the first file).")


def main(argv: list[str]) -> None:
    """Write the report of existing results files."""
    del argv
    missing = [p for p in RESULTS.value if not Path(p).is_file()]
    if missing:
        raise app.UsageError(f"--results: not a file: {', '.join(map(repr, missing))}")
    paths = report.write_report(RESULTS.value, OUT_DIR.value or str(Path(RESULTS.value[0]).parent))
    cp = f"; CP report: {paths['cp_report']}" if paths["cp_report"] else ""
    print(f"Report: {paths['markdown']} ({len(paths['plots'])} plots){cp}")


if __name__ == "__main__":
    app.run(main)
