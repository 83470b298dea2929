"""``mlx-mtp convert`` + ``mlx-mtp check`` on every family's predictable fixture.

    python scripts/convert_check_fixtures.py

For each family: convert the tiny checkpoint whose head often agrees with its trunk at
8-bit trunk / 8-bit heads, 4-bit trunk / 8-bit heads and 4-bit trunk / 4-bit heads, and
print the check's top-1 agreements with the float source (the trunk's; each head's on
the source trunk, the verdict; each head's end to end). These are fixtures, not trained
heads: the numbers show the conversion path, not a real model's quantization loss.
"""

import logging
import tempfile
from pathlib import Path

from mlx_mtp.convert import check, convert
from mlx_mtp.testing.fixtures import FAMILIES, write_checkpoint

SETTINGS = {"q8/h8": (8, 8), "q4/h8": (4, 8), "q4/h4": (4, 4)}


def main():
    logging.getLogger("mlx_mtp").setLevel(logging.ERROR)
    print(
        f"{'family':12} {'bits':6} {'trunk':>6} {'heads (source trunk)':>21} "
        f"{'end to end':>11}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            src = write_checkpoint(family, Path(tmp) / family, predictable=True)
            for name, (bits, head_bits) in SETTINGS.items():
                out = Path(tmp) / f"{family}-{name.replace('/', '-')}"
                convert(
                    str(src),
                    out,
                    quantize=True,
                    q_bits=bits,
                    head_bits=head_bits,
                    progress=False,
                )
                r = check(str(out))
                heads = " ".join(f"{a:.3f}" for a in r.head_agreement)
                e2e = " ".join(f"{a:.3f}" for a in r.end_to_end)
                print(
                    f"{family:12} {name:6} {r.trunk_agreement:6.3f} {heads:>21} "
                    f"{e2e:>11}"
                )


if __name__ == "__main__":
    main()
