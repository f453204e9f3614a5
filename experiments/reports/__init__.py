"""Reports read from the driver's results.jsonl: tables, CSV, plots."""
