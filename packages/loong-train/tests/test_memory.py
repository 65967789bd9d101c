"""The allocator settings of loong_train.memory: a process that frees and allocates large blocks
again, as a decode step does its logits, page-faults them once with them and every time without."""

import os
import platform
import subprocess
import sys

import pytest

# Twenty rounds of allocating four 25 MB blocks, writing every page, freeing them (a decode step's
# logits and the sampler's copies of them); prints the minor page faults those rounds cost.
_ROUNDS = """
import ctypes, ctypes.util, resource, sys
from loong_train.memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: 4 KiB pages, so faults count pages where THP is on
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 25 << 20
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    blocks = [libc.malloc(size) for _ in range(4)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in blocks:
        libc.free(block)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")


def _faults(mode: str, **env: str) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run(
        [sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, check=True, env=clean | env
    ).stdout.split()
    return out[0] == "True", int(out[1])


def test_a_freed_block_is_reused_instead_of_faulted_in_again():
    pages = (25 << 20) // os.sysconf("SC_PAGE_SIZE")
    kept, with_settings = _faults("keep")
    _, without = _faults("default")
    assert kept
    assert without > 4 * 10 * pages  # glibc returns the blocks to the system every round
    assert with_settings < 4 * 3 * pages, (with_settings, without)  # faulted in once, then reused


@pytest.mark.parametrize(
    "setting",
    [{"MALLOC_TRIM_THRESHOLD_": "131072"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}],
)
def test_the_users_own_malloc_settings_win(setting):
    kept, faults = _faults("keep", **setting)
    assert not kept
    assert faults > 4 * 10 * (25 << 20) // os.sysconf("SC_PAGE_SIZE")  # their trimming, as they asked
