"""Where compiled programs persist between runs: the repository's ignored .cache/ folder, so
that a resumed run (a preset split by --time_budget) on the same machine compiles nothing twice."""

from __future__ import annotations

from pathlib import Path

CACHE_ROOT = Path(__file__).resolve().parents[2] / ".cache"


def compilation_cache_env() -> dict[str, str]:
    """Environment defaults for worker processes: JAX's persistent compilation cache (every
    program, however fast it compiled) and Triton's kernel cache under CACHE_ROOT."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(CACHE_ROOT / "jax"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "TRITON_CACHE_DIR": str(CACHE_ROOT / "triton"),
    }


def use_jax_compilation_cache(jax) -> bool:
    """Point JAX's persistent compilation cache at CACHE_ROOT/jax unless the environment chose a
    folder; it takes effect only before this process's first compilation. Returns whether this
    call set it."""
    if jax.config.jax_compilation_cache_dir:
        return False
    jax.config.update("jax_compilation_cache_dir", str(CACHE_ROOT / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return True
