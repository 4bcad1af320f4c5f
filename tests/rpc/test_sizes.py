"""Human-readable sizes for --kv-memory and friends."""

import pytest

from infinite_llm.rpc.sizes import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64MiB", 64 * 2**20),
        ("64 mib", 64 * 2**20),
        ("64Mi", 64 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("512KiB", 512 * 1024),
        ("100MB", 100_000_000),
        ("100M", 100_000_000),
        ("10k", 10_000),
        ("4096", 4096),
        ("4096B", 4096),
        ("0", 0),
        ("123456789012345678901234567890", 123456789012345678901234567890),
        (2048, 2048),
    ],
)
def test_sizes_parse_to_exact_bytes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "-1MiB", "64XB", "1m", "1.2.3GiB", "ten", -5])
def test_unreadable_sizes_are_refused_with_the_text(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_sizes_format_in_the_largest_binary_unit():
    assert [format_size(n) for n in (0, 1023, 1024, 64 * 2**20, 3 * 2**29)] == [
        "0B",
        "1023B",
        "1.0KiB",
        "64.0MiB",
        "1.5GiB",
    ]
