"""The base every command stands on: flags, presets and points, the point loop, the results
store; it imports no runner, report or workload (experiments/driver.py sits above them)."""
