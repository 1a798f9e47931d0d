"""A declarative, config-driven launcher for correct, fast, resumable PyTorch training."""

import logging

__version__ = "0.1.0"

# Notices of optional libraries that say nothing to a user of this launcher: torchao (imported by peft
# and transformers when installed) reports its CUDA-only kernels missing on every CPU machine, and
# registers enums that torch's pytree then calls deprecated. Errors still show.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
