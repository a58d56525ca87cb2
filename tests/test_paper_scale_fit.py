"""benchmarks/paper_scale_fit.py, the H200 measurement of the paper scale's fit, in its CPU smoke mode:
every part runs on tiny shapes and writes the JSON a GPU run writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO


def test_smoke_mode_runs_every_part(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "paper_scale_fit.py"), "--smoke", "--out",
                           str(tmp_path), "--presets", "0.5B", "4B", "--configs", "lr", "--checkpointing", "off", "on",
                           "--ddp"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (path,) = tmp_path.glob("paper_scale_fit_smoke_memory_checkpoint_appendixi_0.5B-4B_lr_ckpt-off-on_ddp.json")
    r = json.loads(path.read_text())
    assert r["device"] == "cpu" and r["smoke"] is True and r["date"] and r["versions"]["torch"]
    assert "commit" in r["git"] and r["cluster"]["gpu_memory_gib"] == 74.5
    rows = r["results"]["memory"]
    assert [(x["preset"], x["activation_checkpointing"]) for x in rows] == [("0.5B", False), ("0.5B", True),
                                                                            ("4B", False), ("4B", True)]
    assert all(x["ddp"] and x["micro_batch_s"] > 0 and x["optimizer_s"] > 0 and x["tokens_per_s_planned"] > 0
               for x in rows)  # the job's DDP on one rank; the speed of one GPU at the plan's accumulation
    mem = {row["preset"]: row for row in rows if not row["activation_checkpointing"]}
    assert set(mem) == {"0.5B", "4B"} and not any("error" in row for row in rows)
    # one rank of the paper's plan: 8 GPUs; the 4B keeps only its share of the optimiser state
    assert mem["0.5B"]["world_planned"] == 8 and mem["0.5B"]["grad_accum_planned"] == 2
    assert not mem["0.5B"]["shard_optimizer"] and mem["0.5B"]["optimizer_params"] == mem["0.5B"]["parameters"]
    assert mem["4B"]["shard_optimizer"] and 0 < mem["4B"]["optimizer_params"] < mem["4B"]["parameters"] / 2
    assert all(row["update_s"] > 0 for row in mem.values())
    ck = r["results"]["checkpoint"]["rank0_share"]
    assert ck["bytes"] > 0 and ck["write_s"] > 0 and ck["hash_s"] > 0
    ai = r["results"]["appendix_i"]
    assert ai["all_pass"] and [c["reads"] for c in ai["checks"]] == [8, 8]  # the pair-large stand-in: L = 4
    assert {c["method"] for c in ai["checks"]} == {"attnres", "lr"}
