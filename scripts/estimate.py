#!/usr/bin/env python3
"""Predict GPU memory, time and cost of a Hugging Face LLM job: a thin wrapper of estimator/cli.py
(also installed as `gpu-budget estimate`). No torch import.

Examples:
  python scripts/estimate.py --model llama-3.1-8b --method qlora --batch 4 --seq 4096 --gpu a10g-24gb
  python scripts/estimate.py --model llama-2-70b --method full --zero 3 --fit-gpus
  python scripts/estimate.py --axolotl my-recipe.yaml --gpu a100-80gb
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from estimator.cli import _parser, main  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main())
