"""The driver core: flags, presets and points, the plan, the point loop, the results store."""
