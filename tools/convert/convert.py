#!/usr/bin/env python
"""Released Kimi K2 / DeepSeek-V3 safetensors -> k2jax Orbax checkpoint (same as `k2jax convert`).

    python tools/convert/convert.py SRC DST [--dtype bfloat16|float32|float8] [--workers N] [--layers a:b]
                                            [--overwrite] [--quiet]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from k2jax.checkpoint.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
