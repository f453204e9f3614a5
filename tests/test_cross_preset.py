"""The cross-framework preset is the grid the comparison needs, at GPU sizes."""

from experiments.core import presets
from experiments.core.points import ALL


def test_cross_preset_is_the_full_comparison_grid():
    p = presets.get_preset("cross", on_gpu=True)
    (kernel,) = p.kernel
    assert p.cp == () and presets.select_grids(p, None) == [kernel]
    assert kernel.masks == presets.STATIC_MASKS and len(kernel.masks) == 12
    assert kernel.seqlens == (8192, 16384, 32768) and kernel.modes == ("fwd", "fwd_bwd")
    assert kernel.heads == ((64, 8), (64, 64)) and kernel.head_dim == 128
    assert kernel.dtype == "bf16" and kernel.impls == (ALL,) and kernel.cps == ("none",)
    small = presets.get_preset("cross", on_gpu=False).kernel[0]
    assert small.masks == kernel.masks and max(small.seqlens) <= 256
