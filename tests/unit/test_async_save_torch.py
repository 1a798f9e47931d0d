"""Background checkpoint saves run only on a torch whose stager copies the loop's state."""

from __future__ import annotations

import torch

from launcher.components.checkpoint_async import background_saves, stager_works


def test_torch_versions_before_the_working_stager_save_synchronously() -> None:
    assert not stager_works("2.11.0+cu130") and not stager_works("2.6.0")
    assert stager_works("2.13.0+cpu") and stager_works("2.14.0.dev20261101") and stager_works("3.0.0")
    assert not stager_works("unknown")
    assert background_saves(False) is False
    assert background_saves(True) is stager_works(torch.__version__)  # this machine's torch
