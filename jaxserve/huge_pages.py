"""Transparent huge pages for the memory of a CPU backend.

A decode step on CPU streams every weight from DRAM; with 4 KiB pages that stream misses
the TLB every 4 KiB. On the 2-core benchmark VM, smollm2-135m's decode forward pass took
7.7-9.5 ms in bf16 with its weights on 2 MiB pages against 9.95-10.8 ms on 4 KiB ones (six
alternating pairs), 13.3-17.4 against 18.0-19.9 ms in float32; a plain C read of 256 MiB
moves 34 GB/s against 31.

Linux's usual THP mode, `madvise`, gives huge pages only to memory that asks for them.
XLA's CPU buffers come from glibc's malloc, which asks (madvise(MADV_HUGEPAGE) on the
memory it maps) when the tunable `glibc.malloc.hugetlb=1` is set, and glibc reads its
tunables when a process starts. So `jaxserve` commands restart themselves once with it
(`restart_with_huge_pages`, before any work), and a program that builds an engine itself
(`jaxserve.LLM`) gets huge pages when started with
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1` in its environment. (Collapsing the buffers after
the fact with MADV_COLLAPSE also works, but slowed a warm start by 2.5 s: the kernel
copies the memory while holding the process's memory map lock.) An explicit
`glibc.malloc.hugetlb` setting is left as it is.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_page_environment(environ: dict[str, str]) -> dict[str, str] | None:
    """`environ` with glibc's malloc asking for huge pages, or None where that changes
    nothing: not Linux with glibc, THP not in `madvise` mode (`always` gives them anyway,
    `never` not at all), or the tunable already set either way."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        if "[madvise]" not in THP_MODE.read_text():
            return None
    except OSError:
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if TUNABLE in tunables:
        return None
    return {**environ, "GLIBC_TUNABLES": ":".join(filter(None, (tunables, f"{TUNABLE}=1")))}


def restart_with_huge_pages() -> None:
    """Replace this process with itself (same command line) under `huge_page_environment`,
    when that changes anything; else return. Call first thing in a program's entry point."""
    env = huge_page_environment(dict(os.environ))
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)
