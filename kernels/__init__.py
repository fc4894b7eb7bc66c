"""Triton kernels of specdec_kernels (installed as ``specdec_kernels.kernels``).

Kernel modules are imported lazily by the ops that launch them, so that
importing ``specdec_kernels`` never imports triton. `KERNEL_MODULES` lists
them for the compile check (`import_all`).
"""

# Each module here registers its launched specializations in `registry` on import.
KERNEL_MODULES: tuple[str, ...] = ("attention", "cache", "sampling", "tree_sampling")


def import_all() -> None:
    """Import every kernel module so that all specializations are registered."""
    import importlib

    for name in KERNEL_MODULES:
        importlib.import_module(f"{__name__}.{name}")
