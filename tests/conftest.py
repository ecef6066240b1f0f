"""Test-suite settings: offline, deterministic, small."""

import os

for _k, _v in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "WANDB_DISABLED": "true",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_k, _v)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield



@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    # accelerate keeps one process-wide AcceleratorState: a Trainer with bf16=True would leave a later test's own
    # Accelerator() running under bf16 autocast
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def fresh_compile():
    """For a test that compiles: dynamo's caches reset before and after, and torch's donated-buffers switch restored
    (FORGE's exact clipping by a second backward turns it off for the process)."""
    import torch._dynamo as dynamo
    from torch._functorch import config

    donated = config.donated_buffer
    dynamo.reset()
    yield
    dynamo.reset()
    config.donated_buffer = donated
