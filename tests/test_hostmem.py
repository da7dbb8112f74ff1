"""The peak host memory bench convert records (parabench.hostmem): the sum of resident memory over
bench and its descendants (a page shared between them counted once), sampled, never below a
process's own peak."""

from __future__ import annotations

import mmap
import os
import time

from parabench import hostmem

MIB = 2**20


def _fresh_resident(size: int) -> mmap.mmap:
    """``size`` bytes of new anonymous pages, each written, so resident. Not a bytearray: malloc may
    serve one from pages freed earlier in this process and still resident (the default tier saw the
    worker's 1.67 GiB not grow by a 300 MiB bytearray), which is no new memory at all."""
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)  # anonymous, private: copy-on-write after a fork
    for offset in range(0, size, mmap.PAGESIZE):
        pages[offset] = 1
    return pages


def test_a_peak_inside_the_block_is_measured_and_one_before_it_is_not():
    before = hostmem.tree_resident_bytes(os.getpid())
    with hostmem.PeakHostMemory(sample_s=0.05) as peak:
        held = _fresh_resident(300 * MIB)
        time.sleep(0.3)
        held.close()
    assert peak.bytes >= before + 280 * MIB, (peak.bytes / MIB, before / MIB)
    with hostmem.PeakHostMemory(sample_s=0.05) as quiet:  # the 300 MiB are gone: ru_maxrss did not rise
        time.sleep(0.2)
    assert quiet.bytes < peak.bytes - 200 * MIB, (quiet.bytes / MIB, peak.bytes / MIB)


def test_the_tree_is_read_from_proc(tmp_path):
    """A made-up /proc: pid 10 with children 11 and 12, 12 with child 13; 99 is not in the tree.
    Pss where smaps_rollup is there (10, 11), VmRSS where it is not (12, 13)."""
    table = {10: (1, 1000), 11: (10, 200), 12: (10, 30), 13: (12, 4), 99: (1, 5000)}
    for pid, (ppid, rss_kb) in table.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (a name) with) S {ppid} 0 0")
        (tmp_path / str(pid) / "status").write_text(f"Name:\tx\nVmRSS:\t  {rss_kb} kB\n")
        if pid in (10, 11):  # Pss half the RSS: their pages shared
            rollup = f"Rss:  {rss_kb} kB\nPss:  {rss_kb // 2} kB\nPss_Anon:  1 kB\n"
            (tmp_path / str(pid) / "smaps_rollup").write_text(rollup)
    (tmp_path / "self").mkdir()
    assert hostmem.tree_resident_bytes(10, tmp_path) == (500 + 100 + 30 + 4) * 1024
    assert hostmem.tree_resident_bytes(12, tmp_path) == 34 * 1024


def test_a_forked_child_does_not_count_its_parents_pages_again():
    """A child forked while its parent holds 300 MiB shares those pages (copy-on-write, as Megatron's
    forked checkpoint writers do): the tree's resident bytes rise by them once, not twice (a sum of
    VmRSS counts them in each process)."""
    held = _fresh_resident(300 * MIB)
    before = hostmem.tree_resident_bytes(os.getpid())
    pid = os.fork()
    if pid == 0:  # the child only waits, touching nothing
        time.sleep(2)
        os._exit(0)
    try:
        time.sleep(0.5)
        with_child = hostmem.tree_resident_bytes(os.getpid())
    finally:
        os.waitpid(pid, 0)
    assert with_child < before + 100 * MIB, (before / MIB, with_child / MIB)
    held.close()  # held mapped until here: its pages are what the child shares
