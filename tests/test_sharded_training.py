"""Data-parallel training with the optimiser state sharded (ZeroRedundancyOptimizer) on 2 gloo ranks,
checkpoints written by every rank side by side, and preemption that loses at most one interval."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

from lrattnres.train import checkpoint as ckpt
from lrattnres.train.checkpoint import CheckpointError, read_model
from conftest import word_corpus
from lrattnres.train.loop import Preempted, train



@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return word_corpus(tmp_path_factory.mktemp("shard_corpus"), seed=1)


def spec(**over):
    s = {"model": {"preset": "smoke", "method": "lr", "blocks": 2, "rank": 8}, "seed": 3, "steps": 6,
         "micro_batch": 2, "grad_accum": 2, "seq_len": 32, "schedule": {"warmup_steps": 2},
         "val": {"every": 0, "final": False}, "checkpoint": {"every": 2}, "device": "cpu"}
    s.update(over)
    return s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, spec_, manifest, out, kw):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        train(spec_, manifest, out, progress=False, **kw)
    except Preempted:
        pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run2(spec_, manifest, out, **kw):
    """Train on 2 gloo ranks (spawned processes)."""
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(2, _free_port(), spec_, manifest, str(out), kw), nprocs=2, join=True,
                       start_method="spawn")


def weights(out):
    return read_model(Path(out) / "model.safetensors")[0]


@pytest.fixture(scope="module")
def ddp_and_sharded(manifest, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    run2(spec(), manifest, root / "ddp")
    run2(spec(shard_optimizer=True), manifest, root / "sharded")
    return root


def test_sharded_optimiser_makes_the_ddp_update(ddp_and_sharded):
    a, b = weights(ddp_and_sharded / "ddp"), weights(ddp_and_sharded / "sharded")
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ  # bit for bit: each weight is stepped by one rank with the same arithmetic
    first = weights(ddp_and_sharded / "ddp")
    assert json.loads((ddp_and_sharded / "sharded" / "spec.json").read_text())["spec"]["shard_optimizer"] is True
    assert any(not torch.equal(first[k], torch.zeros_like(first[k])) for k in first)


def test_every_rank_writes_its_share_of_the_checkpoint(ddp_and_sharded):
    for name in ("ddp", "sharded"):
        out = ddp_and_sharded / name
        rec = ckpt.read_record(out)
        assert rec["world_size"] == 2 and [e["rank"] for e in rec["files"]["tensors"]] == [0, 1]
        from safetensors import safe_open

        keys = []
        for e in rec["files"]["tensors"]:
            with safe_open(str(out / e["file"]), framework="pt") as f:
                keys.append(set(f.keys()))
        assert keys[0] and keys[1] and not keys[0] & keys[1]  # disjoint shares
        sizes = [e["bytes"] for e in rec["files"]["tensors"]]
        assert max(sizes) < 0.8 * sum(sizes), sizes  # each rank writes a part, not the whole
        st = ckpt.load_checkpoint(out)
        assert set(st["model"]) == set(weights(out))  # together: every weight
        assert set(st["optimizers"]) == {"muon", "adam"} and len(st["loader"]) == 2


def test_preempted_sharded_run_resumes_bit_for_bit_either_way(manifest, ddp_and_sharded, tmp_path):
    """Stopped after 3 updates (as SIGTERM stops it), the sharded run resumes sharded, and also
    unsharded (the state is kept by parameter name): both end on the uninterrupted weights."""
    want = weights(ddp_and_sharded / "sharded")
    for resume_sharded in (True, False):
        out = tmp_path / f"resume-{resume_sharded}"
        run2(spec(shard_optimizer=True), manifest, out, stop_after=3)
        assert ckpt.read_record(out)["step"] == 3 and not (out / "model.safetensors").exists()
        run2(spec(shard_optimizer=resume_sharded), manifest, out)
        got = weights(out)
        assert [k for k in want if not torch.equal(want[k], got[k])] == []
        assert json.loads((out / "result.json").read_text())["resumed"] is True


def _close(a: dict, b: dict) -> list[str]:
    """Weights that differ beyond float rounding (another world size sums the gradients in another order)."""
    return [k for k in a if not torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6)]


def test_another_world_size_resumes_by_resharding(manifest, ddp_and_sharded, tmp_path):
    """2 -> 1 and 1 -> 2 ranks with the same tokens per update (grad_accum follows the GPU count): the
    optimiser state, sharded on 2 ranks, is read back by parameter name and resharded, the data position
    is carried over, and the run ends on the weights of the uninterrupted runs (on 1 rank, unsharded,
    and on 2) up to the order of float sums."""
    one = spec(grad_accum=4, tokens_per_update=256)  # 1 rank x 2 x 32 x 4 = 256 tokens per update
    two = spec(shard_optimizer=True, tokens_per_update=256)  # 2 ranks x 2 x 32 x 2
    ref = train(one, manifest, tmp_path / "one", progress=False)
    want1, want2 = weights(tmp_path / "one"), weights(ddp_and_sharded / "ddp")
    assert not _close(want1, want2)  # the same updates on either world size
    assert any(not torch.equal(want1[k], want2[k]) for k in want1)  # though not bit for bit

    out = tmp_path / "2to1"
    run2(two, manifest, out, stop_after=3)
    assert ckpt.read_record(out)["world_size"] == 2 and ckpt.read_record(out)["step"] == 3
    res = train(one, manifest, out, progress=False)
    assert res["resumed"] and res["steps"] == 6 and res["world_size"] == 1 and not (out / "stale").exists()
    got = weights(out)
    assert not _close(got, want1) and not _close(got, want2)
    assert [r["loss"] for r in _losses(out)] == pytest.approx([r["loss"] for r in _losses(tmp_path / "one")], rel=1e-4)

    out = tmp_path / "1to2"
    with pytest.raises(Preempted):
        train(one, manifest, out, progress=False, stop_after=3)
    run2(two, manifest, out)
    assert json.loads((out / "result.json").read_text())["world_size"] == 2 and not (out / "stale").exists()
    got = weights(out)
    assert not _close(got, want1) and not _close(got, want2)
    assert ref["steps"] == 6


def _losses(out):
    return [r for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def test_another_split_of_other_tokens_per_update_starts_over(manifest, tmp_path):
    """A world size whose tokens per update differ is another experiment: moved aside, started over."""
    with pytest.raises(Preempted):
        train(spec(grad_accum=4), manifest, tmp_path, progress=False, stop_after=2)
    res = train(spec(grad_accum=2, steps=3), manifest, tmp_path, progress=False)
    assert not res["resumed"]
    (stale,) = (tmp_path / "stale").iterdir()
    assert "tokens per update differ: checkpoint 2 x 32 x 4 x 1 ranks = 256 != now 2 x 32 x 2 x 1 ranks = 128" in (
        stale / "reason.txt").read_text()


def test_a_corrupt_share_stops_every_rank_naming_the_file(manifest, ddp_and_sharded, tmp_path):
    import shutil

    import torch.multiprocessing as mp

    out = tmp_path / "run"
    run2(spec(shard_optimizer=True), manifest, out, stop_after=2)
    rec = ckpt.read_record(out)
    bad = out / rec["files"]["tensors"][1]["file"]  # rank 1's share
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(mp.ProcessRaisedException, match=rf"{bad.name}: sha256 .* differs"):
        run2(spec(shard_optimizer=True), manifest, out)
    assert not (out / "model.safetensors").exists()
    shutil.rmtree(out)


def test_a_kill_during_a_checkpoint_write_loses_at_most_one_interval(manifest, tmp_path, monkeypatch):
    """The process dies after its step-4 files are written but before checkpoint.json names them:
    the run resumes from step 2 (one interval lost) and ends on the uninterrupted weights."""
    ref = train(spec(), manifest, tmp_path / "ref", progress=False)
    real = ckpt.atomic_write_json

    def dies_at_step_4(path, obj, *a, **kw):
        if Path(path).name == ckpt.CHECKPOINT_FILE and obj.get("step") == 4:
            raise SystemExit("killed while writing the checkpoint")
        return real(path, obj, *a, **kw)

    monkeypatch.setattr(ckpt, "atomic_write_json", dies_at_step_4)
    with pytest.raises(SystemExit):
        train(spec(), manifest, tmp_path / "run", progress=False)
    monkeypatch.setattr(ckpt, "atomic_write_json", real)
    out = tmp_path / "run"
    assert ckpt.read_record(out)["step"] == 2
    assert len(list(out.glob("checkpoint-00000004-*"))) == 2  # the orphaned files of the interrupted write
    res = train(spec(), manifest, out, progress=False)
    assert res["resumed"] and res["steps"] == ref["steps"]
    assert not list(out.glob("checkpoint-00000004-*"))  # removed by the next complete write
    a, b = weights(tmp_path / "ref"), weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))  # metrics cut back to step 2, then steps 3..6 once each


def test_a_v2_checkpoint_is_read_and_moved_aside(manifest, tmp_path):
    """A checkpoint of the earlier single-writer format still verifies and loads as weights; the
    trainer starts over instead of resuming it."""
    from safetensors.torch import save_file

    from lrattnres.io import sha256_file

    out = tmp_path / "run"
    train(spec(steps=2), manifest, out, progress=False)
    rec = ckpt.read_record(out)
    model = ckpt.read_tensors(out, rec)
    save_file({k: v.contiguous() for k, v in model.items()}, str(out / "checkpoint-00000002.model.safetensors"))
    torch.save({"optimizers": {}, "rng": [], "loader": [], "grad_norms": []}, out / "checkpoint-00000002.state.pt")
    v2 = {k: v for k, v in rec.items() if k != "files"}
    v2.update(format=ckpt.FORMAT_V2, files={p: {"file": f"checkpoint-00000002.{n}", "sha256": sha256_file(
        out / f"checkpoint-00000002.{n}")} for p, n in (("model", "model.safetensors"), ("state", "state.pt"))})
    for e in rec["files"]["tensors"] + rec["files"]["state"]:
        (out / e["file"]).unlink()
    (out / "checkpoint.json").write_text(json.dumps(v2))
    loaded, info = ckpt.load_model(out / "checkpoint.json")
    assert info["step"] == 2 and set(loaded.state_dict()) == set(model)
    (out / "model.safetensors").unlink()
    (out / "result.json").unlink()
    res = train(spec(steps=2), manifest, out, progress=False)
    assert not res["resumed"]
    (stale,) = (out / "stale").iterdir()
    assert "earlier format" in (stale / "reason.txt").read_text()
    with pytest.raises(CheckpointError, match="format"):
        (stale / "checkpoint.json").write_text(json.dumps(dict(v2, format="other/1")))
        ckpt.read_record(stale)


def test_a_job_on_another_gpu_count_than_its_spec_is_refused(manifest, tmp_path):
    """A spec made for 2 ranks (tokens_per_update) run on 1: refused before any update, naming the fix."""
    from lrattnres.train.spec import SpecError

    with pytest.raises(SpecError, match=r"'tokens_per_update' is 256 but .* x 1 ranks = 128: .* resources.train.gpu"):
        train(spec(tokens_per_update=256), manifest, tmp_path, progress=False)
    assert not (tmp_path / "checkpoint.json").exists()
    res = train(spec(tokens_per_update=128, steps=1), manifest, tmp_path / "ok", progress=False)
    assert res["steps"] == 1


def test_training_under_a_deadline_stops_with_a_checkpoint(manifest, tmp_path, monkeypatch):
    """LRATTNRES_DEADLINE: once the next update and a checkpoint would pass it, the trainer writes its
    checkpoint and stops (exit 75 on the command line); the same command then resumes."""
    from lrattnres.train import loop

    calls = {"n": 0}

    def left():
        calls["n"] += 1
        return 1e9 if calls["n"] <= 3 else 0.5

    monkeypatch.setattr(loop.deadline_mod, "left", left)
    with pytest.raises(Preempted, match=r"stopped at step 3 \(LRATTNRES_DEADLINE\)"):
        train(spec(), manifest, tmp_path, progress=False)
    assert ckpt.read_record(tmp_path)["step"] == 3
    monkeypatch.setattr(loop.deadline_mod, "left", lambda: None)
    res = train(spec(), manifest, tmp_path, progress=False)
    assert res["resumed"] and res["steps"] == 6
