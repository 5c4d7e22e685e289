"""``python -m torchtune_grpo.config --markdown``: the key tables of the docs, from the schema."""

import sys

from torchtune_grpo.config import main

sys.exit(main())
