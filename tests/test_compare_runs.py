"""Issue 6 on CPU: CODA (reference backend) and eager trained by one multirun on identical data,
seed and initial weights give the same curve; compare_runs.py writes the PNG and the table."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_multirun_coda_vs_eager_curves_agree_and_compare_writes_png(tiny, tmp_path):
    sweep = tmp_path / "sweep"
    run = subprocess.run([sys.executable, "train.py", "-m", "model.impl=eager,coda", "kernels.backend=reference",
                          "trainer.compute_dtype=float32", "trainer.max_steps=30", "trainer.ckpt_every=0",
                          f"trainer.run_dir={sweep}", *tiny], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    runs = sorted(p for p in sweep.iterdir() if (p / "metrics.jsonl").is_file())
    assert len(runs) == 2
    out = tmp_path / "compare.png"
    cmp = subprocess.run([sys.executable, "scripts/compare_runs.py", *map(str, runs), "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert cmp.returncode == 0, cmp.stderr[-3000:]
    assert out.stat().st_size > 10_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = json.loads(out.with_suffix(".json").read_text())["runs"]
    assert [row["run"].split()[0] for row in table] == ["eager", "coda"]
    coda = table[1]
    assert coda["steps"] == 30 and coda["max_abs_dloss"] < 1e-4, coda
    assert coda["final_val_loss"] is not None and abs(coda["final_val_loss"] - table[0]["final_val_loss"]) < 1e-4
    assert "| coda" in cmp.stdout and out.with_suffix(".md").read_text().startswith("| run |")
