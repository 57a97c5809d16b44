"""Eight virtual CPU devices for every test (set before JAX is imported), and the shared assets."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the suite runs on CPU devices (TPU plans need no TPU backend)

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def shared_asset(relative: str) -> Path:
    """Path of an asset in ../shared. Skips when it is absent, except under CI where that is a failure."""
    path = SHARED / relative
    if not path.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"shared asset {path} is missing under CI")
        pytest.skip(f"shared asset {path} is absent")
    return path


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache(tmp_path_factory):
    """One persistent XLA cache for the session: tests that build the same program compile it once."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla-cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(autouse=True)
def _seed_torch():
    """Same random PyTorch reference weights in every run."""
    try:
        import torch
    except ImportError:
        return
    torch.manual_seed(0)
