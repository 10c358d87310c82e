"""``python -m trainer`` / ``torchrun --nproc_per_node N -m trainer``: the trainer job with rtrl settings."""

import sys

from rtrl.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
