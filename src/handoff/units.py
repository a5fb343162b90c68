"""Byte units and the one way sizes are written for people (binary: MiB, GiB)."""

MiB = 1 << 20
GiB = 1 << 30


def fmt_bytes(nbytes: float) -> str:
    """1.50 GiB, 12.0 MiB or 512 B."""
    if abs(nbytes) >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    if abs(nbytes) >= MiB:
        return f"{nbytes / MiB:.1f} MiB"
    return f"{int(nbytes)} B"
