"""Records of the former standalone Pallas tuning script (results/h200/tune_pallas*.jsonl) as
driver records, so the report reads them beside the driver's own."""

from __future__ import annotations

from experiments.core.points import SHORT_DTYPES, Point

STATUS = {"ok": "ok", "mismatch": "wrong", "error": "error"}
# What that script ran with: no L2 flush, warmup 2, 5 timed calls, seed 0, make_mask's window.
WARMUP, ITERS, SEED, WINDOW = 2, 5, 0, 1024


def is_legacy_tune(rec: dict) -> bool:
    """Whether a JSON line is a record of the former tuning script."""
    return "candidate" in rec and "key" not in rec


def as_driver_record(rec: dict) -> dict:
    """The driver record of a tuning line (median-only timing, its own row check)."""
    point = Point(
        workload="attention",
        framework="jax",
        impl="pallas",
        cp="none",
        layout="none",
        ulysses_size=None,
        ulysses_intra_node=None,
        mask=rec["mask"],
        seqlen_total=rec["seqlen"],
        seqlen_per_device=rec["seqlen"],
        scaling="none",
        num_devices=1,
        batch=rec["batch"],
        heads_q=rec["heads_q"],
        heads_kv=rec["heads_kv"],
        head_dim=rec["head_dim"],
        dtype=SHORT_DTYPES.get(rec["dtype"], rec["dtype"]),
        mode=rec["mode"],
        num_masks=1,
        seed=SEED,
        window=WINDOW,
        reference_compat=False,
        warmup=WARMUP,
        iters=ITERS,
        grid="tune_pallas",
        kernel_config=rec["candidate"],
    )
    metrics = None
    if "tflops" in rec:
        metrics = {
            "tflops": dict.fromkeys(("median", "p20", "p80"), rec["tflops"]),
            "time_ms": dict.fromkeys(("median", "p20", "p80"), rec["ms"]),
            "tflops_total": rec["tflops"],
            "peak_mem_gib": None,
            "mem_source": None,
        }
    return {
        "key": point.key,
        "status": STATUS.get(rec["status"], rec["status"]),
        "reason": rec.get("error"),
        "point": point.as_dict(),
        "metrics": metrics if rec["status"] == "ok" else None,
        "check": {"kind": "rows", "max_errors": rec.get("errors") or {}},
        "provenance": {"versions": {"jax": rec.get("jax")}},
    }
