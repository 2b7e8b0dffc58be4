"""The kernel's builds in tests: each one this CPU runs, skipped where it cannot."""

import shutil

import pytest

from hf_tidar.cpu.kernel import built_library, supported_isas


def library_of(isa: str):
    """The operator library of the kernel's ``isa`` build; the test is skipped where this CPU cannot run it."""
    if isa not in supported_isas() or shutil.which("c++") is None:
        pytest.skip(f"this CPU cannot run the kernel's {isa} build (or there is no C++ compiler)")
    library = built_library(isa)
    assert library is not None, f"the {isa} build should compile on this machine"
    return library
