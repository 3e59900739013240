"""scripts/bench_report.py turns bench.py's JSON into docs: tables, the gap summary and the chart.
The input is a bench.py-shaped result with made-up timings (the report is what is tested here;
real numbers come only from bench.py on the GPU)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _report(paths: list, md: Path, png: Path, cwd: Path) -> None:
    """scripts/bench_report.py on `paths`, writing `md` and `png`."""
    subprocess.run([sys.executable, str(ROOT / "scripts/bench_report.py"), *map(str, paths), "--md", str(md),
                    "--png", str(png)], check=True, cwd=cwd)


def _result(shape: str) -> dict:
    def row(ms, step=None, mem=None):
        r = {"fwd_bwd": {"median_ms": ms, "min_ms": ms * 0.98, "max_ms": ms * 1.05, "n": 8}, "mfu_fwd_bwd": 0.5,
             "over_coda": ms / 40.0, "over_floor": ms / 25.0}
        if step:
            r.update(step={"median_ms": step}, tokens_per_s=16384 / step * 1e3, peak_fwd_bwd_gib=mem + 1,
                     peak_above_weights_gib=mem)
        return r

    floor = row(25.0)
    floor.update(gemm_ms=20.0, attention_ms=5.0, attention_fwd_ms=0.1, attention_bwd_ms=0.3,
                 gemms=[{"gemm": "qkv fwd", "best": "cublas", "best_ms": 0.5, "count": 12},
                        {"gemm": "o fwd", "best": "quack", "best_ms": 0.25, "count": 12}])
    return {"shape": shape, "preset": "llama3_125m", "n_layers": 12, "batch": 8, "seq": 2048,
            "command": f"scripts/bench.py --shape {shape}", "gemm_peak_tflops": {"peak": 780.0},
            "environment": {"gpu": "NVIDIA H200", "cuda": "13.0", "date": "2026-11-30 17:00 UTC",
                            "packages": {"torch": "2.11.0"}},
            "variants": {"eager": row(50.0, 55.0, 9.0), "compile": row(31.0, 36.0, 4.0), "coda": row(40.0, 45.0, 3.0),
                         "floor": floor},
            "failed": {"liger": "RuntimeError: no liger here"}, "not_run": ["compile-max-autotune"],
            "coda_profile": {"version": 2, "launches_per_step": 800, "kernel_ms_per_step": 30.0, "busy_ms_per_step": 29.0,
                             "gpu_idle_fraction": 0.25, "gpu_window_ms_per_step": 40.0, "annotated_kernel_ms_per_step": 30.5,
                             "by_owner_ms": {"gemm_rowscale_rope": 7.0, "[copies / casts]": 2.0}}}


def test_report_writes_tables_summary_and_chart(tmp_path):
    paths = []
    for shape in ("1b-4x4096", "125m"):
        paths.append(tmp_path / f"bench_{shape}.json")
        paths[-1].write_text(json.dumps(_result(shape)))
    md, png = tmp_path / "benchmarks.md", tmp_path / "benchmarks.png"
    _report(paths, md, png, tmp_path)
    from PIL import Image
    with Image.open(png) as im:  # a palette PNG (scripts/palette_png.py): docs/ travels to the device, 64 MiB in all
        assert im.mode == "P" and im.size[0] > 0
    text = md.read_text()
    assert text.index("### 125m") < text.index("### 1b-4x4096")  # shapes in size order, not argument order
    # summary: coda 40 ms vs best peer compile 31 ms and floor 25 ms
    assert "| 125m | coda | 40.00 | compile | 31.00 | 1.29 | 25.00 | 1.60 | - | - | - | 3.0 | 4.0 |" in text  # no back-to-back floor in this JSON
    # the faster of coda and coda-graphs speaks for CODA (train.py replays the graph on one GPU)
    graphed = _result("125m")
    graphed["variants"]["coda-graphs"] = dict(graphed["variants"]["coda"], fwd_bwd={"median_ms": 30.0})
    graphed["variants"]["floor"]["back_to_back"] = {"median_ms": 27.0, "clocks": {"sm_mhz_mean": 1500.0}}
    paths[1].write_text(json.dumps(graphed))
    _report(paths, md, png, tmp_path)
    text_graphed = md.read_text()
    assert "| 125m | coda-graphs | 30.00 | compile | 31.00 | 0.97 | 25.00 | 1.20 | 27.00 | 1.11 | - | 3.0 | 4.0 |" in text_graphed
    assert "timed as a step: 27.00 ms at 1500 MHz mean SM clock." in text_graphed
    assert "Paired:" not in text_graphed  # a run before the paired rounds: no sentence
    # the paired rounds (bench.py --paired-rounds): each pair's ratio, the median in the summary's own column
    rounds = [dict(first=f, coda_ms=c, floor_ms=27.0, ratio=c / 27.0, coda_mhz=1500.0, floor_mhz=1490.0)
              for f, c in (("coda", 29.7), ("floor", 30.0), ("coda", 29.4))]
    graphed["paired"] = {"variant": "coda-graphs", "against": "floor back to back", "rounds": rounds,
                         "median_ratio": 29.7 / 27.0}
    paths[1].write_text(json.dumps(graphed))
    _report(paths, md, png, tmp_path)
    text_paired = md.read_text()
    assert "| 27.00 | 1.11 | 1.100 | 3.0 | 4.0 |" in text_paired
    assert ("Paired: coda-graphs and the floor back to back built side by side and timed in turn, 3 rounds, the first of "
            "each pair alternating; coda-graphs / floor back to back 29.70 / 27.00 = 1.100, 30.00 / 27.00 = 1.111, "
            "29.40 / 27.00 = 1.089; **median 1.100** (mean SM clock 1500 MHz for coda-graphs, 1490 MHz for the floor).") in text_paired
    del graphed["paired"]
    assert "written in fp32" not in text_graphed  # a run before that sequence: no sentence
    graphed["variants"]["floor"]["back_to_back_fp32_wgrads"] = {"median_ms": 27.6, "wgrads": ["down wgrad", "o wgrad"]}
    graphed["variants"]["coda-graphs"]["over_floor_fp32_wgrads"] = 30.0 / 27.6
    paths[1].write_text(json.dumps(graphed))
    _report(paths, md, png, tmp_path)
    assert ("timed as a step: 27.00 ms at 1500 MHz mean SM clock. The same sequence with "
            "its weight gradients (2 GEMM shapes) written in fp32, as CODA writes them (the floor's GEMMs write bf16): "
            "27.60 ms; coda / that: coda-graphs 1.087.") in md.read_text()
    assert "| liger | failed: RuntimeError: no liger here" in text
    assert "Not run at this shape: compile-max-autotune (opt-in: its GEMM autotuning" in text
    assert "cut short" not in text
    cut = _result("125m")
    cut["pending"] = ["liger", "floor"]  # bench.py's partial JSON, left by a device call that hit its time limit
    paths[1].write_text(json.dumps(cut))
    _report(paths, md, png, tmp_path)
    assert "This run was cut short (the device call's time limit) before: liger, floor." in md.read_text()
    paths[1].write_text(json.dumps(_result("125m")))
    assert "1 of 2 shapes on quack" in text and "| [copies / casts] | 2.000 |" in text
    # the gap: rope's 7 ms against its floor GEMM (qkv fwd, 12 x 0.5 ms), the casts have no floor, idle 40 - 29
    assert "| gemm_rowscale_rope | 7.00 | 6.00 | +1.00 |" in text and "| [copies / casts] | 2.00 | 0.00 | +2.00 |" in text
    assert "| GPU idle between kernels (coda) | - | - | +11.00 |" in text and "**+15.00** (coda 40.00 − floor 25.00)" in text
    assert "host latency before a step's first kernel) | - | - | +1.00 |" in text  # 15 - 3 attributed - 11 idle
    # with the profile's CUDA-graph pass and a coda-graphs timing, the gap is the graphed step's: its idle, its time
    graph_pass = _result("125m")
    graph_pass["variants"]["coda-graphs"] = dict(graph_pass["variants"]["coda"], fwd_bwd={"median_ms": 30.0})
    graph_pass["coda_profile"]["graph"] = {"launches_per_step": 790, "kernel_ms_per_step": 29.5, "busy_ms_per_step": 29.0,
                                           "gpu_window_ms_per_step": 29.75, "gpu_idle_fraction": 0.025}
    (tmp_path / "graph").mkdir()
    graph_path, graph_md = tmp_path / "graph" / "bench_125m.json", tmp_path / "graph" / "b.md"
    graph_path.write_text(json.dumps(graph_pass))
    _report([str(graph_path)], graph_md, tmp_path / "graph" / "b.png", tmp_path)
    graph_text = graph_md.read_text()
    assert "| GPU idle between kernels (coda-graphs) | - | - | +0.75 |" in graph_text
    assert "**+5.00** (coda-graphs 30.00 − floor 25.00)" in graph_text and "| - | - | +1.25 |" in graph_text
    # with the graph's kernel sequence, the idle is the gaps after its first kernel (not the batch copies' host wait)
    graph_pass["coda_profile"]["graph"]["sequence"] = [
        {"kernel": "Memcpy DtoD (Device -> Device)", "us": 1.5, "gap_us": None},
        {"kernel": "Memcpy DtoD (Device -> Device)", "us": 1.5, "gap_us": 80.0},
        {"kernel": "fill", "us": 1.0, "gap_us": 900.0}, {"kernel": "gemm", "us": 50.0, "gap_us": 300.0},
        {"kernel": "attention", "us": 90.0, "gap_us": 200.0}]
    graph_path.write_text(json.dumps(graph_pass))
    _report([str(graph_path)], graph_md, tmp_path / "graph" / "b.png", tmp_path)
    graph_text = graph_md.read_text()
    assert "| GPU idle between the graph's kernels (coda-graphs) | - | - | +0.50 |" in graph_text
    assert "| - | - | +1.50 |" in graph_text and "**+5.00**" in graph_text
    assert "replayed as a CUDA graph, 790 launches, 29.50 ms of kernels and 0.75 ms idle between them" in graph_text
    # the floor's items profiled back to back (at a sustained step's clocks): a second baseline per op
    graph_pass["variants"]["floor"]["back_to_back"] = {"median_ms": 26.0, "by_item_ms": {"qkv fwd": 6.5, "o fwd": 3.0}}
    graph_path.write_text(json.dumps(graph_pass))
    _report([str(graph_path)], graph_md, tmp_path / "graph" / "b.png", tmp_path)
    graph_text = graph_md.read_text()
    assert "| gemm_rowscale_rope | 7.00 | 6.00 | +1.00 | 6.50 | +0.50 |" in graph_text
    assert "| [copies / casts] | 2.00 | 0.00 | +2.00 | 0.00 | +2.00 |" in graph_text
    # against it: 30 - 26 = 4 ms, of which 2.5 attributed and 0.5 idle, so 1.0 rest
    assert "| - | - | +1.50 | - | +1.00 |" in graph_text and "**+4.00** (− floor back to back 26.00)" in graph_text
    # with the graph's kernels attributed to ops (bench.py graph_by_owner), the gap compares those, not the eager step's
    graph_pass["coda_profile"]["graph"].update(by_owner_ms={"gemm_rowscale_rope": 7.4, "[copies / casts]": 2.1},
                                               kernels_matched=780, kernels=790)
    graph_path.write_text(json.dumps(graph_pass))
    _report([str(graph_path)], graph_md, tmp_path / "graph" / "b.png", tmp_path)
    graph_text = graph_md.read_text()
    assert "replayed as a CUDA graph, each kernel given the op of the eager step's kernel it aligns with" in graph_text
    assert "(780 of 790 aligned" in graph_text
    assert "| gemm_rowscale_rope | 7.40 | 6.00 | +1.40 | 6.50 | +0.90 |" in graph_text
    assert "| - | - | +1.00 | - | +0.50 |" in graph_text  # the rest shrinks by the 0.5 ms the graph's kernels add
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    # results from before bench.py counted each variant's own memory carry a caveat naming their shapes
    assert "Peak memory of 125m, 1b-4x4096: measured before bench.py counted only each variant's own" in text
    for path in paths:
        path.write_text(json.dumps(dict(json.loads(path.read_text()), memory_accounting="own")))
    _report(paths, md, png, tmp_path)
    assert "Peak memory of" not in md.read_text()


def test_profile_from_a_profile_only_run_and_old_profiles_ignored(tmp_path):
    full, profile_only = _result("125m"), _result("125m")
    full["coda_profile"]["version"] = 1  # the double-counting breakdown: never shown
    profile_only["variants"] = {"coda": profile_only["variants"]["coda"]}
    profile_only["command"] = "scripts/bench.py --shape 125m --variants coda --tag=-profile"
    profile_only["coda_profile"]["by_owner_ms"] = {"rope_backward_rowscale_stat": 9.5}
    for name, r in (("a.json", full), ("b.json", profile_only)):
        (tmp_path / name).write_text(json.dumps(r))
    md = tmp_path / "b.md"
    _report([tmp_path / "a.json", tmp_path / "b.json"], md, tmp_path / "b.png", tmp_path)
    text = md.read_text()
    assert text.count("### 125m") == 1 and "| compile | 31.00 |" in text  # the variants of the full run
    assert "--tag=-profile" in text and "| rope_backward_rowscale_stat | 9.500 |" in text and "| gemm_rowscale_rope | 7.000 |" not in text


def test_a_profile_whose_model_recast_its_weights_every_forward_says_so_under_its_gap_table(tmp_path):
    plain, recast = _result("125m"), _result("1b-4x4096")
    recast["coda_profile"]["weights_recast_every_forward"] = True  # bench.py's profiles before the 2026-12-05 fix
    plain["coda_profile"]["weights_recast_every_forward"] = False
    for name, r in (("a.json", plain), ("b.json", recast)):
        (tmp_path / name).write_text(json.dumps(r))
    md = tmp_path / "r.md"
    _report([tmp_path / "a.json", tmp_path / "b.json"], md, tmp_path / "r.png", tmp_path)
    text = md.read_text()
    note = "This profile's model cast every weight to its bf16 compute copy in every forward"
    assert text.count(note) == 1 and text.index(note) > text.index("### 1b-4x4096")


def test_each_run_says_how_its_steps_were_timed(tmp_path):
    """bench.py since b088bec records --sustain-s; older results lack it and say so (their short timing windows
    could fall on the boosted clock left by a compile); an explicit 0 is named as such."""
    runs = {"125m": {}, "1b-4x4096": {"sustain_s": 0.0}, "8b-slice": {"sustain_s": 3.0}}
    paths = []
    for shape, extra in runs.items():
        paths.append(tmp_path / f"bench_{shape}.json")
        paths[-1].write_text(json.dumps({**_result(shape), **extra}))
    md = tmp_path / "s.md"
    _report(paths, md, tmp_path / "s.png", tmp_path)
    sections = md.read_text().split("### ")
    said = {shape: next(sec for sec in sections if sec.startswith(shape)) for shape in runs}
    assert "No sustained steps before each timing (bench.py before b088bec)" in said["125m"]
    assert "No sustained steps before each timing (--sustain-s 0, or a CPU run)" in said["1b-4x4096"]
    assert "Each step timing followed 3 s of its steps back to back" in said["8b-slice"]


def test_a_tuned_floor_run_supplements_the_main_run(tmp_path):
    """A newer --floor-quack-tuned run (opt-in, often without peers) does not replace the shape's main run: it is
    one line under the main floor, with its floor and its own CODA step's ratio to its graph floor."""
    main, tuned = _result("125m"), _result("125m")
    tuned["environment"] = dict(tuned["environment"], date="2026-12-05 19:41 UTC")
    tuned["command"] = "scripts/bench.py --shape 125m --variants coda,floor --floor-quack-tuned"
    tuned["variants"]["floor"] = dict(tuned["variants"]["floor"], quack_tuned=True, back_to_back={"median_ms": 26.0},
                                      back_to_back_autotuned={"median_ms": 25.5, "gemms_autotuned": ["o fwd"]},
                                      gemms=[dict(g, best="quack-tuned" if g["best"] == "cublas" else g["best"])
                                             for g in tuned["variants"]["floor"]["gemms"]])
    tuned["variants"]["coda"] = dict(tuned["variants"]["coda"], over_floor_back_to_back=39.0 / 26.0,
                                     fwd_bwd={"median_ms": 39.0})
    for name, r in (("main.json", main), ("tuned.json", tuned)):
        (tmp_path / name).write_text(json.dumps(r))
    md = tmp_path / "t.md"
    _report([tmp_path / "main.json", tmp_path / "tuned.json"], md, tmp_path / "t.png", tmp_path)
    text = md.read_text()
    assert "| 125m | coda | 40.00 | compile | 31.00 | 1.29 | 25.00 | 1.60 |" in text  # the main run's figures
    assert ("The floor with quack's autotuned config as a third candidate per GEMM (`scripts/bench.py --shape 125m "
            "--variants coda,floor --floor-quack-tuned`, 2026-12-05 19:41 UTC): GEMMs 20.00 ms, 1 of 2 shapes on the "
            "autotuned pick; floor 25.00 ms, back to back 26.00 ms; in that run coda 39.00 ms, / graph floor 1.50. "
            "The same sequence with its 1 GEMM shape on quack's default config at quack's autotuned pick instead: "
            "25.50 ms.") in text
    assert text.count("autotuned pick instead") == 1  # the main run timed no such sequence


def test_other_runs_against_the_graph_floor_are_listed_with_their_ratio(tmp_path):
    """Every other run of a shape that timed CODA against the floor back to back is one line under the main run's
    floor, newest first, each ratio within its own run (the run-to-run spread of the target's ratio); a run without
    that floor sequence, or a --floor-quack-tuned one (it has its own line), is not."""
    runs = {}
    for name, date, coda_ms, b2b in (("main", "2026-12-06 06:17 UTC", 40.0, 37.0), ("a", "2026-12-06 06:08 UTC", 39.0, 36.0),
                                     ("b", "2026-12-06 06:10 UTC", 38.0, 36.5), ("old", "2026-11-30 10:00 UTC", 41.0, None),
                                     ("tuned", "2026-12-06 05:00 UTC", 39.0, 36.0)):
        r = _result("125m")
        r["environment"] = dict(r["environment"], date=date)
        r["command"] = f"scripts/bench.py --shape 125m --tag=-{name}"
        r["variants"]["coda"]["fwd_bwd"] = {"median_ms": coda_ms}
        if b2b:
            r["variants"]["floor"]["back_to_back"] = {"median_ms": b2b}
        if name == "tuned":
            r["variants"]["floor"]["quack_tuned"] = True
        runs[name] = tmp_path / f"{name}.json"
        runs[name].write_text(json.dumps(r))
    md = tmp_path / "t.md"
    _report(list(runs.values()), md, tmp_path / "t.png", tmp_path)
    text = md.read_text()
    assert ("Other runs of this shape against the floor back to back, newest first (each ratio within its own run):\n\n"
            "- 2026-12-06 06:10 UTC: coda 38.00 ms / 36.50 ms = 1.041 (`scripts/bench.py --shape 125m --tag=-b`)\n"
            "- 2026-12-06 06:08 UTC: coda 39.00 ms / 36.00 ms = 1.083 (`scripts/bench.py --shape 125m --tag=-a`)\n\n") in text
    assert "--tag=-old`" not in text and "--tag=-tuned`)" not in text.split("Other runs")[1].split("\n\n")[1]


def test_peers_from_separate_runs_compare_within_their_own_run(tmp_path):
    """A newer run with a floor is the shape's main run; a separate `--variants compile-max-autotune,coda`
    run (and an older full run with Liger) add their peers, each against the CODA step of its own run."""
    old, main, extra = _result("125m"), _result("125m"), _result("125m")
    old["variants"]["liger"] = dict(old["variants"]["compile"], fwd_bwd={"median_ms": 60.0}, peak_above_weights_gib=2.5)
    old["variants"]["coda"] = dict(old["variants"]["coda"], fwd_bwd={"median_ms": 45.0})
    main["environment"] = dict(main["environment"], date="2026-12-01 01:00 UTC", code={"git_commit": "abc" * 10,
                                                                                        "git_dirty": True, "sources_sha256": "f00d"})
    main["not_run"] = ["compile-max-autotune", "liger"]
    extra["environment"] = dict(extra["environment"], date="2026-12-01 02:00 UTC")
    extra["command"] = "scripts/bench.py --shape 125m --variants compile-max-autotune,coda --tag=-max-autotune"
    extra["variants"] = {"compile-max-autotune": dict(main["variants"]["compile"], fwd_bwd={"median_ms": 36.0}),
                         "coda": dict(main["variants"]["coda"], fwd_bwd={"median_ms": 38.0})}
    paths = []
    for name, r in (("old.json", old), ("main.json", main), ("extra.json", extra)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(r))
    md = tmp_path / "b.md"
    _report(paths, md, tmp_path / "b.png", tmp_path)
    text = md.read_text()
    assert text.count("### 125m") == 1 and "2026-12-01 01:00 UTC, code abcabcabca with uncommitted changes (sources f00d)" in text
    # the main run's compile (40 / 31 = 1.29) is closer than max-autotune (38 / 36 = 1.06 in its own run); the old
    # run's compile is not shown (the main run timed compile), its liger is (the main run did not)
    assert "| 125m | coda | 40.00 | compile | 31.00 | 1.29 |" in text
    assert "- coda 38.00 ms against compile-max-autotune 36.00 ms (coda / compile-max-autotune 1.06" in text
    assert "- coda 45.00 ms against liger 60.00 ms (coda / liger 0.75, peak above weights 2.5 GiB, SM clock" in text
    assert "- compile 31.00 ms" not in text
    assert "| 2.5 |" in text.split("## Per shape")[0]  # the lowest peer memory counts the separate runs' peers
    assert "Not run at this shape:" not in text  # both not-run peers were timed in separate runs
    # a peer of a separate run that is the closest is named as such
    extra["variants"]["compile-max-autotune"]["fwd_bwd"] = {"median_ms": 28.0}
    paths[2].write_text(json.dumps(extra))
    _report(paths, md, tmp_path / "b.png", tmp_path)
    assert "| 125m | coda | 40.00 | compile-max-autotune (separate run) | 28.00 | 1.36 |" in md.read_text()  # 38 / 28


def test_sources_hash_leads_back_to_the_first_commit_with_those_sources(tmp_path):
    """code_version hashes coda_train's .py/.json and bench.py; commit_of_sources finds the first commit
    whose tree hashes the same (later commits that touch nothing it covers share it), None otherwise."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from code_version import code_version, commit_of_sources

    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True, text=True).stdout.strip()  # noqa: E731
    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    (tmp_path / "coda_train" / "kernels").mkdir(parents=True)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "bench.py").write_text("print(1)\n")
    (tmp_path / "coda_train" / "kernels" / "table.json").write_text("{}\n")
    (tmp_path / "coda_train" / "a.py").write_text("x = 1\n")
    git("add", "-A")
    git("commit", "-qm", "one")
    first = code_version(tmp_path)
    assert first["git_dirty"] is False and first["git_commit"] == git("rev-parse", "HEAD")
    (tmp_path / "README.md").write_text("not a source\n")
    git("add", "-A")
    git("commit", "-qm", "two: docs only")
    (tmp_path / "coda_train" / "a.py").write_text("x = 2\n")
    dirty = code_version(tmp_path)
    assert dirty["git_dirty"] is True and dirty["sources_sha256"] != first["sources_sha256"]
    assert commit_of_sources(first["sources_sha256"], tmp_path) == first["git_commit"]
    assert commit_of_sources(dirty["sources_sha256"], tmp_path) is None  # not committed yet
    git("commit", "-qam", "three")
    assert commit_of_sources(dirty["sources_sha256"], tmp_path) == git("rev-parse", "HEAD")


def test_a_later_coda_only_run_supersedes_the_coda_peak(tmp_path):
    main, later, earlier = _result("125m"), _result("125m"), _result("125m")
    for r, date, mem in ((later, "2026-12-01 05:00 UTC", 2.5), (earlier, "2026-11-29 05:00 UTC", 9.0)):
        r["variants"] = {"coda": dict(r["variants"]["coda"], peak_above_weights_gib=mem)}
        r["environment"] = dict(r["environment"], date=date)
        r["command"] = "scripts/bench.py --shape 125m --variants coda --tag=-memory"
        r["memory_accounting"] = "own"
    paths = []
    for i, r in enumerate((main, later, earlier)):
        paths.append(tmp_path / f"bench_125m-{i}.json")
        paths[-1].write_text(json.dumps(r))
    md = tmp_path / "b.md"
    _report(paths, md, tmp_path / "b.png", tmp_path)
    text = md.read_text()
    # the newer coda-only run's 2.5 GiB replaces the main run's 3.0; the older one is ignored
    assert "| 125m | coda | 40.00 | compile | 31.00 | 1.29 | 25.00 | 1.60 | - | - | - | 2.5 | 4.0 |" in text
    assert "measured again after this run (`scripts/bench.py --shape 125m --variants coda --tag=-memory`, " \
           "2026-12-01 05:00 UTC): coda 2.5 GiB" in text
    assert "9.0" not in text.split("## Per shape")[0]


def test_a_second_graph_tree_variants_peak_is_not_trusted_in_runs_without_the_reset(tmp_path):
    """Before bench.py reset torch.compile between variants, a second CUDA-graph-tree variant of one
    process recorded into the first one's pool and read low: such a peak is shown as not comparable
    and left out of the lowest peer's; with the reset recorded in the run, it counts."""
    r = _result("125m")
    v = r["variants"]
    v["compile-graphs"] = dict(v["compile"], peak_fwd_bwd_gib=6.0, peak_above_weights_gib=5.0)
    v["compile-max-autotune"] = dict(v["compile"], fwd_bwd={"median_ms": 30.5}, peak_fwd_bwd_gib=1.5, peak_above_weights_gib=0.5)
    v["compile"]["peak_above_weights_gib"] = 4.0
    path, md = tmp_path / "bench_125m.json", tmp_path / "b.md"
    path.write_text(json.dumps(r))
    _report([path], md, tmp_path / "b.png", tmp_path)
    text = md.read_text()
    assert "| compile-max-autotune | 30.50 |" in text and "Peak memory of compile-max-autotune not shown" in text
    assert "| 125m | coda | 40.00 | compile-max-autotune | 30.50 | 1.31 | 25.00 | 1.60 | - | - | - | 3.0 | 4.0 |" in text  # not 0.5
    r["variant_isolation"] = "dynamo_reset"
    path.write_text(json.dumps(r))
    _report([path], md, tmp_path / "b.png", tmp_path)
    text = md.read_text()
    assert "not shown" not in text and "| 3.0 | 0.5 |" in text


def test_results_of_two_gpus_are_refused_with_the_fix(tmp_path):
    """A shape's runs are compared with each other, so a report mixing GPUs would compare across machines."""
    h200, h100 = _result("125m"), _result("1b-4x4096")
    h100["environment"]["gpu"] = "NVIDIA H100 80GB HBM3"
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, r in zip(paths, (h200, h100)):
        path.write_text(json.dumps(r))
    run = subprocess.run([sys.executable, str(ROOT / "scripts/bench_report.py"), *map(str, paths), "--md",
                          str(tmp_path / "b.md"), "--png", str(tmp_path / "b.png")], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 2 and "more than one GPU" in run.stderr and "one report per GPU" in run.stderr
    assert not (tmp_path / "b.md").exists()


def test_inputs_that_are_not_bench_results_are_clear_errors(tmp_path):
    """A missing file, a non-JSON file, another tool's JSON: one line naming the file and what to pass, no traceback."""
    (tmp_path / "notes.json").write_text("not json")
    (tmp_path / "other.json").write_text(json.dumps({"loss": 1.0}))
    (tmp_path / "list.json").write_text("[1, 2]")
    no_env = _result("125m")
    del no_env["environment"]
    (tmp_path / "no_env.json").write_text(json.dumps(no_env))
    for name, named in (("missing.json", "cannot read"), ("notes.json", "is not JSON"),
                        ("other.json", "is not a scripts/bench.py result"), ("list.json", "holds a JSON list"),
                        ("no_env.json", "it lacks environment")):
        run = subprocess.run([sys.executable, str(ROOT / "scripts/bench_report.py"), str(tmp_path / name), "--md",
                              str(tmp_path / "b.md")], cwd=tmp_path, capture_output=True, text=True)
        assert run.returncode == 1 and named in run.stderr and "Traceback" not in run.stderr, (name, run.stderr)
        assert "pass the JSON results scripts/bench.py wrote" in run.stderr
    assert not (tmp_path / "b.md").exists()


def test_outputs_go_where_named_from_any_directory_and_help_says_the_defaults(tmp_path):
    path = tmp_path / "bench_125m.json"
    path.write_text(json.dumps(_result("125m")))
    md, png = tmp_path / "report" / "b.md", tmp_path / "charts" / "b.png"
    _report([path], md, png, cwd=tmp_path)  # folders that do not exist yet, outside the repo
    assert png.is_file() and "](../charts/b.png)" in md.read_text()
    assert f"--md {md.as_posix()} --png {png.as_posix()}`" in md.read_text()  # the header's command writes the same files
    help_text = subprocess.run([sys.executable, str(ROOT / "scripts/bench_report.py"), "--help"], cwd=tmp_path,
                               capture_output=True, text=True, check=True).stdout
    assert "default: docs/benchmarks.md of this repo" in help_text and "One report per GPU" in help_text


def test_the_documented_report_commands_run(tmp_path):
    """README's and the script's commands over docs/bench each select one GPU's results (the folder holds two GPUs'),
    run here with the outputs redirected."""
    docs = (ROOT / "README.md").read_text() + (ROOT / "scripts/bench_report.py").read_text()
    commands = sorted({line.strip().split("   #")[0] for line in docs.splitlines()
                       if line.strip().startswith("python scripts/bench_report.py") and "docs/bench/" in line})
    assert len(commands) == 2, commands
    for i, command in enumerate(commands):
        command = command.replace("python", f"'{sys.executable}'", 1) + f" --md {tmp_path}/{i}.md --png {tmp_path}/{i}.png"
        run = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True)
        assert run.returncode == 0, (command, run.stderr[-2000:])


def test_a_report_of_another_gpu_is_not_overwritten_and_the_chart_follows_the_report(tmp_path):
    """Results of one GPU written over another GPU's report (the default --md is the H200's) are refused, nothing
    written; without --png the chart goes beside the report, not over docs/benchmarks.png."""
    h200, h100 = _result("125m"), _result("125m")
    h100["environment"] = dict(h100["environment"], gpu="NVIDIA H100 80GB HBM3")
    (tmp_path / "h200.json").write_text(json.dumps(h200))
    (tmp_path / "h100.json").write_text(json.dumps(h100))
    md = tmp_path / "report.md"
    subprocess.run([sys.executable, str(ROOT / "scripts/bench_report.py"), str(tmp_path / "h200.json"), "--md", str(md)],
                   check=True, cwd=tmp_path)
    assert (tmp_path / "report.png").is_file() and "![forward+backward time per variant, floor as a line](report.png)" in md.read_text()
    before = md.read_text()
    refused = subprocess.run([sys.executable, str(ROOT / "scripts/bench_report.py"), str(tmp_path / "h100.json"), "--md",
                              str(md)], cwd=tmp_path, capture_output=True, text=True)
    assert refused.returncode == 2 and "is the report of another GPU (NVIDIA H200)" in refused.stderr
    assert md.read_text() == before


def test_a_cpu_smoke_run_reports_no_gemm_peak(tmp_path):
    """bench.py's CPU smoke run times a matmul rate that is no bf16 peak (it takes no MFU against it): the report's
    shape header names the CPU and leaves the peak out, where a GPU run's header gives it."""
    gpu, cpu = _result("125m"), _result("125m")
    cpu["environment"] = dict(cpu["environment"], gpu="CPU (smoke run: not a measurement)", cuda=None)
    for name, result in (("gpu", gpu), ("cpu", cpu)):
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
        _report([tmp_path / f"{name}.json"], tmp_path / f"{name}.md", tmp_path / f"{name}.png", tmp_path)
    assert "bf16 GEMM peak measured in the same run: " in (tmp_path / "gpu.md").read_text()
    text = (tmp_path / "cpu.md").read_text()
    assert "on CPU (smoke run: not a measurement)" in text and "bf16 GEMM peak measured in the same run: " not in text


def test_a_profile_without_its_runs_coda_step_is_left_out(tmp_path):
    """A result holding a coda_profile but no `coda` variant (one removed from the JSON by hand): the report has no
    coda step to read the profile against, so it shows no breakdown, and no KeyError."""
    graphs_only = _result("125m")
    graphs_only["variants"]["coda-graphs"] = graphs_only["variants"].pop("coda")
    (tmp_path / "a.json").write_text(json.dumps(graphs_only))
    md = tmp_path / "a.md"
    _report([tmp_path / "a.json"], md, tmp_path / "a.png", tmp_path)
    text = md.read_text()
    assert "| 125m | coda-graphs | 40.00 |" in text and "| gemm_rowscale_rope |" not in text
