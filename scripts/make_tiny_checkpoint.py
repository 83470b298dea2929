"""Write a tiny random checkpoint (HF layout, MTP tensors included) and print its path.

Usage: python scripts/make_tiny_checkpoint.py FAMILY OUT_DIR [--predictable] [--seed N]
    [--shards N]
"""

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from mlx_mtp.testing.fixtures import FAMILIES, write_checkpoint  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument("out_dir")
    parser.add_argument(
        "--predictable",
        action="store_true",
        help="MTP heads that often agree with the trunk (partial acceptance)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16")
    )
    args = parser.parse_args(argv)
    path = write_checkpoint(
        args.family,
        args.out_dir,
        seed=args.seed,
        predictable=args.predictable,
        vocab_size=args.vocab_size,
        dtype=args.dtype,
        num_shards=args.shards,
    )
    print(path)


if __name__ == "__main__":
    main()
