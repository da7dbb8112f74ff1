"""The peak host memory bench convert records (parabench.hostmem): the sum of resident memory over
bench and its descendants, sampled, never below a process's own peak."""

from __future__ import annotations

import os
import time

from parabench import hostmem

MIB = 2**20


def test_a_peak_inside_the_block_is_measured_and_one_before_it_is_not():
    before = hostmem.tree_rss_bytes(os.getpid())
    with hostmem.PeakHostMemory(sample_s=0.05) as peak:
        held = bytearray(300 * MIB)  # resident: bytearray writes its zeros
        time.sleep(0.3)
        del held
    assert peak.bytes >= before + 280 * MIB, (peak.bytes / MIB, before / MIB)
    with hostmem.PeakHostMemory(sample_s=0.05) as quiet:  # the 300 MiB are gone: ru_maxrss did not rise
        time.sleep(0.2)
    assert quiet.bytes < peak.bytes - 200 * MIB, (quiet.bytes / MIB, peak.bytes / MIB)


def test_the_tree_is_read_from_proc(tmp_path):
    """A made-up /proc: pid 10 with children 11 and 12, 12 with child 13; 99 is not in the tree."""
    table = {10: (1, 1000), 11: (10, 200), 12: (10, 30), 13: (12, 4), 99: (1, 5000)}
    for pid, (ppid, rss_kb) in table.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (a name) with) S {ppid} 0 0")
        (tmp_path / str(pid) / "status").write_text(f"Name:\tx\nVmRSS:\t  {rss_kb} kB\n")
    (tmp_path / "self").mkdir()
    assert hostmem.tree_rss_bytes(10, tmp_path) == (1000 + 200 + 30 + 4) * 1024
    assert hostmem.tree_rss_bytes(12, tmp_path) == 34 * 1024
