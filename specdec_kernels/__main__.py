"""``python -m specdec_kernels``: print the environment and which backend each op uses."""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence


def describe_environment() -> str:
    """A few lines on versions, devices and the backend each op picks for ``backend="auto"``."""
    import torch

    from specdec_kernels import __version__
    from specdec_kernels._backend import OPS, auto_backend, interpreter_enabled, triton_available

    if triton_available():
        import triton

        triton_line = f"triton {triton.__version__}" + (" (interpreter on)" if interpreter_enabled() else "")
    else:
        triton_line = "triton not installed (CPU paths only)"
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    gpu = f"{torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "none"
    lines = [
        f"specdec_kernels {__version__}",
        f"python {platform.python_version()} on {platform.platform()}",
        f"torch {torch.__version__}, {triton_line}",
        f"CPU threads: {torch.get_num_threads()}, GPU: {gpu}",
        "backend per op with backend='auto':",
    ]
    for op in OPS:
        lines.append(f"  {op:26} " + ", ".join(f"{d} -> {auto_backend(d)}" for d in devices))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec_kernels", description=__doc__)
    parser.add_argument("command", nargs="?", default="env", choices=["env"],
                        help="env: print versions, devices and backends (default)")
    parser.parse_args(argv)
    print(describe_environment())
    return 0


if __name__ == "__main__":
    sys.exit(main())
