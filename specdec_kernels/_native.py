"""The package's C sources, built at first use into one library: ``panels.c`` (the ``"panels"``
matmul form) and ``attention.c`` (the CPU path of `ragged_attention` at a few queries).

The library is compiled with the system's C compiler (``$CC``, else ``cc``) for the CPU it runs
on (``-march=native``) and kept in the package's cache folder
(`specdec_kernels.pretrained.cache_dir`, subfolder ``native``) under a name that digests the
source, the compiler's identity, the flags and the CPU's feature flags: a later process loads it
in milliseconds, and a changed source, compiler or CPU builds anew. Where it cannot be built (no
compiler, not x86-64 Linux, a compile error) or would not share torch's OpenMP runtime, the form
is unavailable (`library` returns None and `unavailable_reason` says why): the other matmul
forms serve every row count and attention runs its torch ops, with the same results up to
rounding, only slower at a few rows.
``SPECDEC_KERNELS_NO_NATIVE=1`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCES = tuple(Path(__file__).with_name(name) for name in ("panels.c", "attention.c"))
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC")
_NAMES = " and ".join(source.name for source in SOURCES)
DISABLE_VARIABLE = "SPECDEC_KERNELS_NO_NATIVE"
_COMPILE_TIMEOUT_S = 300

_reason: str | None = None  # why library() is None


def unavailable_reason() -> str | None:
    """Why the library is unavailable here (None: it is available)."""
    library()
    return _reason


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The sources built and loaded (once per process), or None where they cannot be (see the
    module docstring; `unavailable_reason` says why)."""
    global _reason
    try:
        loaded = _load()
    except _Unavailable as e:
        _reason = str(e)
        return None
    _reason = None
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for function in (loaded.panels_pack, loaded.panels_pack_bf16):
        function.argtypes, function.restype = [pointer, i64, i64, pointer, i32], None
    for function in (loaded.panels_matmul, loaded.panels_matmul_bf16):
        function.argtypes, function.restype = [pointer, i64, i64, pointer, i64, pointer, i32], None
    loaded.ragged_attention_few_queries.argtypes = [pointer, *[i64] * 4, pointer, pointer, *[i64] * 5, pointer,
                                                    pointer, i64, pointer, ctypes.c_float, pointer, pointer, i32]
    loaded.ragged_attention_few_queries.restype = None
    return loaded


class _Unavailable(Exception):
    pass


def _load() -> ctypes.CDLL:
    path, compiler = library_path()
    try:
        library = ctypes.CDLL(str(_build(compiler, path)))
    except OSError:  # a cached file cut short or overwritten: build it again
        try:
            library = ctypes.CDLL(str(_build(compiler, path, again=True)))
        except OSError as e:
            raise _Unavailable(f"{path} does not load: {e}") from None
    runtimes = _openmp_runtimes()
    if len(runtimes) > 1:  # two thread pools would fight for the cores
        raise _Unavailable(f"it would run a second OpenMP runtime beside torch's: {sorted(runtimes)}")
    return library


def library_path() -> tuple[Path, str]:
    """Where the library for these sources, compiler, flags and CPU is cached, and the compiler."""
    if os.environ.get(DISABLE_VARIABLE, "") not in ("", "0"):
        raise _Unavailable(f"turned off by {DISABLE_VARIABLE}={os.environ[DISABLE_VARIABLE]}")
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise _Unavailable(f"built for x86-64 Linux only, this is {platform.system()} {platform.machine()}")
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None:
        raise _Unavailable(f"no C compiler: {os.environ.get('CC') or 'cc'} is not on PATH (set CC to one)")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise _Unavailable(f"{compiler} --version failed: {e}") from None
    digest = hashlib.sha256(b"\0".join([*(source.read_bytes() for source in SOURCES), compiler.encode(),
                                        version.encode(), " ".join(FLAGS).encode(),
                                        cpuinfo_field("flags").encode()])).hexdigest()[:16]
    return _cache_folder() / f"native-{digest}.so", compiler


def _build(compiler: str, path: Path, *, again: bool = False) -> Path:
    """The library at ``path``, compiled there unless a process did already (or ``again``); a
    cache folder that cannot be written gets a private temporary folder instead."""
    if path.exists() and not again:
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        folder = path.parent
    except OSError:
        folder = Path(tempfile.mkdtemp(prefix="specdec_kernels_native_"))
        path = folder / path.name
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        built = Path(scratch) / path.name
        try:
            done = subprocess.run([compiler, *FLAGS, "-o", str(built), *map(str, SOURCES)], capture_output=True,
                                  text=True, timeout=_COMPILE_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as e:
            raise _Unavailable(f"compiling {_NAMES} with {compiler} failed: {e}") from None
        if done.returncode != 0:
            raise _Unavailable(f"compiling {_NAMES} with {compiler} failed:\n{done.stderr[-2000:]}")
        os.replace(built, path)  # whole or not at all, whatever another process loads meanwhile
    return path


def _cache_folder() -> Path:
    from .pretrained import cache_dir  # here: pretrained imports the model, which imports matmul, which imports us

    return cache_dir() / "native"


def cpuinfo_field(name: str) -> str:
    """The first CPU's ``name`` field in /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(name)), "")
    except OSError:
        return ""


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtime files mapped into this process (torch's, and any other)."""
    names = ("libgomp", "libiomp", "libomp")
    try:
        with open("/proc/self/maps") as f:
            return {os.path.realpath(line.split()[-1]) for line in f
                    if any(name in line.rsplit("/", 1)[-1] for name in names)}
    except OSError:
        return set()
