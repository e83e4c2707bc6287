"""``python -m vllm_glm53.recipes``."""

import sys

from vllm_glm53.recipes.cli import main

sys.exit(main())
