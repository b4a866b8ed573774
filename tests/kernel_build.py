"""The CPU kernels for the tests that exercise them: skip only where there is no C compiler.

``load_cpu_kernels`` falls back to torch's ops when a build fails, which is right for a user's
job and wrong for a test suite: every kernel test would skip and the suite stay green while
the kernels are broken. Tests take the kernels from ``built_kernels`` instead, which fails the
test when a compiler is here and the build (or loading the library) fails."""

from __future__ import annotations

import os

import pytest

from specray.models import cpu_kernels


def no_compiler_reason() -> str:
    return (f"no C compiler on this machine ({os.environ.get('CC', 'cc')!r} is not on PATH): "
            f"specray's CPU kernels cannot be built here, so their tests are skipped")


def built_kernels() -> cpu_kernels.CpuKernels:
    """The kernels built from ``cpu_kernels.SOURCES``; skips without a compiler, fails when a
    compiler is here and the build fails (its output in the failure)."""
    compiler = cpu_kernels.find_compiler()
    if compiler is None:
        pytest.skip(no_compiler_reason())
    try:
        return cpu_kernels.build_cpu_kernels(compiler)
    except cpu_kernels.KernelBuildError as e:
        pytest.fail(f"this machine has a C compiler, but specray's CPU kernels failed to build: {e}", pytrace=False)
