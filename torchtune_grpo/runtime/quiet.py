"""Drops import-time lines of other packages that tell a user of these recipes nothing.

Importing this module (the recipes and ``tune-grpo`` do it before anything imports torchtune) installs
narrow filters, each for one known message:

- torchao's "Skipping import of cpp extensions due to incompatible torch version ..." (a logging warning at
  ``import torchao``, which ``import torchtune`` triggers): torchao's compiled kernels are built for one
  torch version and skipped on the others; no recipe here uses them (NF4 for QLoRA is pure PyTorch).
  ``tune run`` itself imports torchtune before any recipe code runs, so that one process still prints the
  line once; every process a recipe starts (each rank, each generation worker) no longer does.
- torchdata's "'set_vital' is deprecated" (a UserWarning each time a ``StatefulDataLoader`` is built): an
  internal call of torchdata's, about nothing the user wrote.

Every other warning, of these packages too, is left as it is.
"""

import logging
import warnings

__all__ = ["NOISE"]

# (logger or warning category, start of the message) of each line that is dropped.
NOISE = (
    ("torchao", "Skipping import of cpp extensions due to incompatible torch version"),
    (UserWarning, "'set_vital' is deprecated"),
)


class _DropKnownLines(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def _install() -> None:
    for source, prefix in NOISE:
        if isinstance(source, str):
            logger = logging.getLogger(source)
            if not any(isinstance(f, _DropKnownLines) and f.prefix == prefix for f in logger.filters):
                logger.addFilter(_DropKnownLines(prefix))
        else:
            warnings.filterwarnings("ignore", message=prefix, category=source)


_install()
