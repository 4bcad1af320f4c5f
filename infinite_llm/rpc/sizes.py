"""Human-readable byte sizes for flags and configs: ``parse_size("64MiB") == 64 * 2**20``.

Units follow Kubernetes and IEC: ``Ki Mi Gi Ti`` (and ``KiB``...) are powers of 1024; ``K/k M G T`` (and
``KB``...) are powers of 1000; ``B`` or no unit is bytes. Units are case-insensitive except that a bare
``m`` is refused (Kubernetes reads it as milli).
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    **{f"{p}{s}": 1000 ** (i + 1) for i, p in enumerate("kmgt") for s in ("", "b")},
    **{f"{p}i{s}": 1024 ** (i + 1) for i, p in enumerate("kmgt") for s in ("", "b")},
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in ``text`` (``"64MiB"``, ``"1.5 GiB"``, ``"100M"``, ``"4096"``), rounded down to whole bytes.

    Raises:
        ValueError: not a non-negative number with a known unit; the message carries the text.
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0 bytes, got {text}")
        return text
    match = _SIZE.match(text)
    unit = match.group(2) if match else ""
    if not match or unit == "m" or unit.lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; use e.g. 64MiB, 1.5GiB, 100MB or 4096")
    number, scale = match.group(1), _UNITS[unit.lower()]
    return int(number) * scale if number.isdigit() else int(float(number) * scale)


def format_size(num_bytes: int) -> str:
    """``67108864 -> "64.0MiB"``: the largest binary unit that keeps the number >= 1."""
    value, unit = float(num_bytes), "B"
    for next_unit in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, next_unit
    return f"{value:.1f}{unit}" if unit != "B" else f"{num_bytes}B"
