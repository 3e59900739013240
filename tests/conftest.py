import json
import sysconfig
from pathlib import Path

import pytest
import torch

from coda_train.data import DataConfig, prepare


def pytest_collection_modifyitems(config, items):
    """GPU tests (marked `gpu`) run on the device machine and are skipped where CUDA is absent."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_user_tile_cache(tmp_path_factory, monkeypatch):
    """Tests read the shipped tile config table, never this machine's user cache (kernels.tune=once
    writes one under ~/.cache): $CODA_TILE_CACHE names a file no test writes unless it sets its own."""
    from coda_train.kernels import tile_configs

    monkeypatch.setenv(tile_configs.CACHE_ENV, str(tmp_path_factory.getbasetemp() / "no_user_tile_cache.json"))
    tile_configs.reload()
    yield
    tile_configs.forget_tuned()  # and reload: a test's variables and tuned entries are gone for the next test


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> list[str]:
    """Overrides for a 2-layer dim-64 model on a prepared 60-document corpus with a 300-token BPE."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]
    with open(root / "corpus.jsonl", "w") as f:
        for path in stdlib:
            f.write(json.dumps({"text": path.read_text(errors="ignore")[:3000]}) + "\n")
    data = [f"data.source={root / 'corpus.jsonl'}", "data.vocab_size=300", "data.val_fraction=0.1",
            f"data.cache_dir={root / 'cache'}", "data.num_proc=1"]
    prepare(DataConfig(source=str(root / "corpus.jsonl"), vocab_size=300, val_fraction=0.1,
                       cache_dir=str(root / "cache"), num_proc=1))  # once; every run below reuses it
    return data + ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
                   "trainer.batch_size=4", "trainer.seq_len=32", "trainer.log_every=1", "trainer.eval_every=6",
                   "trainer.eval_batches=2", "optim.warmup_steps=4", "trainer.progress_bar=false"]
