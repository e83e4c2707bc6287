"""The benchmarks' cache flush: cold calls read their data from memory, as a model step's ops do (their data was
last used a layer ago)."""

from pathlib import Path

import torch


def l3_bytes() -> int:
    """The last-level cache of CPU 0 (Linux sysfs), 32 MiB where it cannot be read."""
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()  # e.g. "32768K"
        return int(size.rstrip("KM")) * {"K": 1 << 10, "M": 1 << 20}.get(size[-1], 1)
    except (OSError, ValueError):
        return 32 << 20


L3_BYTES = l3_bytes()
_FLUSH = torch.ones(2 * L3_BYTES // 4)  # twice the L3, written by every thread torch runs


def flush() -> None:
    """Evict everything from the caches (rewrite a buffer twice the L3)."""
    _FLUSH.mul_(1.0)
