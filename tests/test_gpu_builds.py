"""Concurrent and interrupted *full* builds on a GPU machine (issue 6): eight processes
``kdagen.load`` one uncached spec at once; a builder killed mid-compile leaves nothing
that blocks or poisons the next build. Each process runs the loaded op and checks it
against the float64 reference, so "loaded" means "computes", not only "dlopen worked".

The CPU twins of these tests (tests/test_build.py) use a fake compiler; these use nvcc
and the torch binding for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]
ROOT = Path(__file__).resolve().parents[1]

# Loads a spec, runs the recurrent op on fresh inputs against the float64 reference and
# prints one JSON line: the library it loaded and the error.
LOADER = r"""
import json, os, sys, time
from pathlib import Path
go = os.environ.get("LOADER_GO")
if go:
    Path(os.environ["LOADER_READY"] + f".{os.getpid()}").touch()
    while not Path(go).exists():
        time.sleep(0.01)
import torch, kdagen
from kdagen import reference as ref
from kdagen.jit import device_target
from kdagen.testing import make_inputs, rel_err
spec = json.loads(os.environ["LOADER_SPEC"])
kern = kdagen.load({"target": device_target(), **spec})
N, H, D = 6, 2, spec["head_dim"]
x = make_inputs([1] * N, H, D, seed=os.getpid() % 1000)
cache = torch.randn(N, H, D, D, device="cuda") * 0.1
init = cache.clone()
sq = lambda t: t[0]
out = kern.fused_recurrent_kda(sq(x.q), sq(x.k), sq(x.v), sq(x.g), sq(x.beta), x.A_log,
                               x.dt_bias, None, None, cache, torch.arange(N, device="cuda"))
o_ref, s_ref, _ = ref.recurrent_kda_reference(*x.args(), cu_seqlens=torch.arange(N + 1, device="cuda"),
                                              initial_state=init)
print(json.dumps({"library": str(kern.library), "err_o": rel_err(out, o_ref[0]),
                  "err_s": rel_err(cache, s_ref)}))
"""


def _env(cache: Path, spec: dict, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(KDAGEN_CACHE_DIR=str(cache), LOADER_SPEC=json.dumps(spec),
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), **extra)
    env.pop("KDAGEN_REBUILD", None)
    return env


def _loader(tmp: Path, env: dict[str, str], new_session: bool = False) -> subprocess.Popen:
    script = tmp / "loader.py"
    script.write_text(LOADER)
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=new_session)


def _check(out: str, err: str, rc: int) -> dict:
    assert rc == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    row = json.loads(out.strip().splitlines()[-1])
    assert row["err_o"] < 2e-2 and row["err_s"] < 2e-2, row
    return row


def test_eight_processes_load_one_uncached_spec(tmp_path, record):
    spec = {"head_dim": 64, "chunk_size": 64, "ops": ["recurrent", "prologue", "chunk"]}
    go, ready = tmp_path / "go", tmp_path / "ready"
    env = _env(tmp_path / "cache", spec, LOADER_GO=str(go), LOADER_READY=str(ready))
    procs = [_loader(tmp_path, env) for _ in range(8)]
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("ready.*"))) < 8:
            assert time.monotonic() < deadline, "8 loaders did not start"
            time.sleep(0.05)
        go.touch()
        results = [p.communicate(timeout=540) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    rows = [_check(out, err, p.returncode) for p, (out, err) in zip(procs, results)]
    builders = sum("kdagen: building" in err for _, err in results)
    waiters = sum("waiting for" in err for _, err in results)
    record(builders=builders, waiters=waiters, max_err=max(max(r["err_o"], r["err_s"]) for r in rows))
    assert builders == 1, [err[-500:] for _, err in results]
    assert len({r["library"] for r in rows}) == 1


def test_killed_full_build_does_not_block_or_poison(tmp_path):
    spec = {"head_dim": 64, "chunk_size": 64, "ops": ["recurrent"]}
    env = _env(tmp_path / "cache", spec)
    log = tmp_path / "victim.err"
    with open(log, "w") as err_file:
        victim = subprocess.Popen([sys.executable, "-c", LOADER], stdout=subprocess.DEVNULL,
                                  stderr=err_file, text=True, env=env, start_new_session=True)
    try:
        # wait until the compilers run, then kill the loader, ninja and nvcc at once
        deadline = time.monotonic() + 120
        while "kdagen: building" not in log.read_text():
            assert victim.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "the build did not start"
            time.sleep(0.05)
        time.sleep(3.0)
        assert victim.poll() is None, "the build finished before it could be killed"
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
    t0 = time.monotonic()
    nxt = _loader(tmp_path, env)
    out, err = nxt.communicate(timeout=540)
    _check(out, err, nxt.returncode)
    assert "kdagen: building" in err  # it rebuilt what the victim left unfinished
    assert time.monotonic() - t0 < 540
