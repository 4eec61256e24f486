"""PyTorch ranks (`%hvd start --framework torch`) through a real IPython shell and a real kernel:
no TensorFlow on the ranks, horovod.torch-style training in a cell equal to one process at the whole
batch, DistributedDataParallel on torch.distributed's default group, and the failures (an interrupt
while a rank is blocked in a gloo allreduce, a rank killed inside DDP's backward), each proven by PID
to leave nothing behind."""

from __future__ import annotations

import ipaddress
import os
import re
import textwrap
import time

import psutil
import pytest
from conftest import assert_gone, cluster_pids, execute, figure, interrupt_blocked_cell, started_kernel
from IPython.utils.capture import capture_output

from hvd_notebook import private
from hvd_notebook.kernel.session import Session

START = "%hvd start -n 2 --framework torch"


def _values(out: str, key: str) -> dict[int, str]:
    """``[rank] KEY value`` lines of a cell's output, by rank."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(rf"^\[(\d+)\] {key} (.+)$", out, re.M)}


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1, a dual-stack socket's view of loopback
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def sockets_beyond_loopback(pids: set[int]) -> list[str]:
    """Each TCP or UDP socket (IPv4 or IPv6) of these processes that is bound to an address other than
    loopback, listening or not (a socket not bound yet has port 0 and is left out)."""
    found = []
    for pid in sorted(pids):
        try:
            process = psutil.Process(pid)
            sockets, name = process.net_connections(kind="inet"), process.name()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        found += [f"{name} (pid {pid}): {c.type.name} {c.laddr.ip}:{c.laddr.port} {c.status}"
                  for c in sockets if c.laddr and c.laddr.port and not _is_loopback(c.laddr.ip)]
    return found


DIGITS = textwrap.dedent("""
    import hashlib, torch, numpy as np
    import horovod.torch as hvd_alias
    from sklearn.datasets import load_digits
    assert hvd_alias.allreduce is hvd.allreduce
    torch.manual_seed(hvd.rank())  # different initial weights: broadcast_parameters must fix them
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)

    def make():
        return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

    model = make()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    reference = make()
    reference.load_state_dict(model.state_dict())  # one process, the whole batch, from the same start
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    batch = 32  # per rank; the reference takes 2 x 32
    for epoch in range(5):
        for start in range(0, 1792 - 2 * batch + 1, 2 * batch):
            whole = slice(start, start + 2 * batch)
            mine = slice(start + hvd.rank() * batch, start + (hvd.rank() + 1) * batch)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
            opt.step()
            ref_opt.zero_grad()
            torch.nn.functional.cross_entropy(reference(x[whole]), y[whole]).backward()
            ref_opt.step()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    accuracy = (model(x).argmax(1) == y).float().mean().item()
    print('DIGEST', hashlib.sha256(weights.numpy().tobytes()).hexdigest())
    print('DIFF', float((weights - ref).abs().max()))
    print('ACC', round(accuracy, 3))
""")


DDP = textwrap.dedent("""
    import hashlib, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def two_models():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        reference = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        reference.load_state_dict(model.state_dict())
        return model, reference

    def train_beside_reference(model, reference, steps):
        \"\"\"model on this rank's half of each batch, reference on the whole batch, step by step\"\"\"
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        for step in range(steps):
            x, y = torch.randn(16, 16, generator=g), torch.randn(16, 1, generator=g)
            mine = slice(8 * dist.get_rank(), 8 * (dist.get_rank() + 1))
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            opt.step()
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()

    model, reference = two_models()
    ddp = DDP(model)
    train_beside_reference(ddp, reference, 10)
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    r = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    print('DIGEST', hashlib.sha256(w.numpy().tobytes()).hexdigest())
    print('DIFF', float((w - r).abs().max()))
""")


FSDP = textwrap.dedent("""
    from torch.distributed.fsdp import fully_shard
    sharded, reference = two_models()
    for layer in (sharded[0], sharded[2], sharded):
        fully_shard(layer)
    train_beside_reference(sharded, reference, 5)
    full = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
    print('FSDP_DIFF', max(float((full[k] - v).abs().max()) for k, v in reference.state_dict().items()))
""")


def test_interrupting_a_rank_blocked_in_a_gloo_allreduce():
    """JupyterLab's stop button while rank 0 waits in a gloo allreduce that rank 1 never joins."""
    with started_kernel() as (km, kc):
        reply, out = execute(kc, f"%load_ext hvd_notebook\n{START}\nfrom hvd_notebook.kernel.session import Session")
        assert reply["content"]["status"] == "ok", out
        old, reply, out, _, back = interrupt_blocked_cell(
            km, kc, "%%hvd\nimport time, torch, torch.distributed as dist\nif hvd.rank() == 0:\n"
                    "    dist.all_reduce(torch.ones(4))\nelse:\n    time.sleep(600)", limit=15)
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt", out
        assert "did not respond to an interrupt" in out, out
        figure(f"interrupt of a rank blocked in gloo: the cell returned with a fresh world in {back:.1f} s")
        reply, out = execute(kc, "%%hvd --all-output\nimport torch, torch.distributed as dist\n"
                                  "t = torch.ones(1)\ndist.all_reduce(t)\nprint('fresh', t.item(), "
                                  "hvd.allreduce(torch.ones(1), op=hvd.Sum).item())")
        assert reply["content"]["status"] == "ok" and "[1] fresh 2.0 2.0" in out, out
        pids = cluster_pids(kc)
        km.shutdown_kernel(now=False)
        assert_gone(pids | old, timeout=30)


def test_framework_torch_where_it_is_not_installed_says_what_to_do(session, run, tmp_path):
    # a rank whose Python cannot import torch (a sitecustomize hides it) fails the start with the remedy
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n            raise ModuleNotFoundError('hidden')\n"
        "sys.meta_path.insert(0, Hide())\n")
    result, out = run(f"{START} --env PYTHONPATH={tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    assert not result.success
    assert "--framework torch: torch is not installed" in out and "hvd_notebook[torch]" in out, out
    assert session.cluster is None


TQDM = textwrap.dedent("""
    import torch
    from tqdm.auto import tqdm, trange
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model = torch.nn.Linear(8, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    for epoch in trange(2, desc='epochs', disable=hvd.rank() != 0):
        bar = tqdm(loader, desc=f'epoch {epoch}')
        for x, y in bar:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            bar.set_postfix(loss=loss.item())
    print('trained')
""")


@pytest.fixture(scope="module")
def torch_cluster(ip):
    """One 2-rank PyTorch cluster for the module's tests that need a healthy world (the last of them kills a
    rank and restarts it); (what its start printed, the seconds it took). Stopped and proven gone at the end."""
    session = Session.get()
    assert session.cluster is None, "another test left a cluster running"
    t0 = time.monotonic()
    with capture_output() as captured:
        result = ip.run_cell(START)
    out = captured.stdout + captured.stderr
    assert result.success, out
    yield out, time.monotonic() - t0
    pids = session.cluster.pids() if session.cluster else set()
    session.stop()
    if pids:
        assert_gone(pids)


def test_a_torch_cluster_has_hvd_torch_and_torch_distributed_and_no_tensorflow(torch_cluster, run):
    out, seconds = torch_cluster
    figure(f"--framework torch: 2 ranks started in {seconds:.1f} s")
    assert "(hvd: builtin; torch 2." in out and "torch.distributed gloo)" in out, out
    result, out = run(
        "%%hvd --all-output\n"
        "import os, sys, torch, torch.distributed as dist, psutil\n"
        "print('TF', 'tensorflow' in sys.modules or 'keras' in sys.modules)\n"
        "print('HVD', hvd.__name__, dist.get_backend(), dist.get_rank(), dist.get_world_size(), hvd.rank(),"
        " os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_ADDR'], torch.get_num_threads(),"
        " os.environ.get('MASTER_PORT'), os.environ['GLOO_SOCKET_IFNAME'], os.environ['NCCL_SOCKET_IFNAME'])\n"
        "t = torch.ones(2) * (hvd.rank() + 1)\ndist.all_reduce(t)\nprint('SUM', t.tolist())\n"
        "print('RSS', psutil.Process().memory_info().rss >> 20)"
    )
    assert result.success, out
    assert _values(out, "TF") == {0: "False", 1: "False"}, out
    for r in (0, 1):
        # one host: the rendezvous is a file in the private folder (no port), gloo and NCCL on loopback
        assert _values(out, "HVD")[r] == f"hvd_notebook.runtime.torch gloo {r} 2 {r} {r} 2 127.0.0.1 1 None lo lo", out
        assert _values(out, "SUM")[r] == "[3.0, 3.0]"
    figure(f"--framework torch: a rank holds {_values(out, 'RSS')[0]} MiB after its first cell")
    assert all(r.framework.startswith("torch 2.") for r in Session.get().cluster.ranks)


def test_horovod_torch_training_equals_one_process_at_twice_the_batch(torch_cluster, run):
    result, out = run("%%hvd --all-output\n" + DIGITS)
    assert result.success, out
    digests = _values(out, "DIGEST")
    assert len(digests) == 2 and digests[0] == digests[1], out  # identical weights, bit for bit
    for r in (0, 1):
        assert float(_values(out, "DIFF")[r]) < 1e-4, out
        assert float(_values(out, "ACC")[r]) > 0.9, out


def test_tqdm_bars_in_a_cell_feed_the_dashboard(torch_cluster, run):
    result, out = run("%%hvd --progress text\n" + TQDM)
    assert result.success, out
    assert "[0] trained" in out and "it/s" not in out and "8/8" not in out, out  # no tqdm text at all
    lines = [line for line in out.splitlines() if line.startswith("[hvd_notebook]")]
    assert len(lines) == 4, out
    for epoch, line in enumerate(lines[::2], 1):
        assert f"epoch {epoch}/2 | 2 ranks | " in line and "samples/s | loss " in line, out
    for line in lines[1::2]:  # each epoch's steps timed from the bar's steps, with the optimizer's allreduces
        assert line.startswith("[hvd_notebook] communication ") and "% of each step" in line, out


def test_ddp_and_fsdp_in_cells_and_a_rank_killed_inside_ddp_backward(torch_cluster, run):
    """(Last of the module's: it kills a rank of the shared world and restarts it.)"""
    session = Session.get()
    result, out = run("%%hvd --all-output\n" + DDP)
    assert result.success, out
    digests = _values(out, "DIGEST")
    assert len(digests) == 2 and digests[0] == digests[1], out
    assert all(float(d) < 1e-5 for d in _values(out, "DIFF").values()), out
    # after the rendezvous and a DDP step: no process of the cluster (controller, launcher, ranks, ...)
    # has a socket beyond loopback, TCP or UDP; torch's TCPStore alone would listen on every interface
    assert sockets_beyond_loopback(session.cluster.pids()) == [], out
    result, out = run("%%hvd --all-output\n" + FSDP)  # FSDP2's fully_shard on the same default group
    assert result.success, out
    assert len(_values(out, "FSDP_DIFF")) == 2 and all(float(d) < 1e-5 for d in _values(out, "FSDP_DIFF").values()), out
    first = session.cluster.pids()
    t0 = time.monotonic()
    result, out = run(  # rank 1 dies in a gradient hook, in the middle of DDP's backward; rank 0 waits in gloo
        "%%hvd\nimport os, signal\n"
        "def die(grad):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "if hvd.rank() == 1:\n    model[0].weight.register_hook(die)\n"
        "x = torch.randn(8, 16)\nddp(x).sum().backward()"
    )
    assert not result.success and time.monotonic() - t0 < 15, out
    figure(f"SIGKILL of a rank inside DDP's backward: the cell failed after {time.monotonic() - t0:.1f} s")
    assert "rank(s) [1] died while running the cell (rank 1: signal Kill" in out, out
    result, out = run("%hvd restart")
    assert result.success, out
    assert_gone(first)
    result, out = run("%%hvd --all-output\nimport torch, torch.distributed as dist\nt = torch.ones(1)\n"
                      "dist.all_reduce(t)\nprint('SUM', t.item())")
    assert _values(out, "SUM") == {0: "2.0", 1: "2.0"}, out
    # the killed world's rendezvous file is gone (the new rank 0 removed it); the live world's is private
    stores = {p.name: int(p.name.split("-")[1]) for p in private.subdir("torch").glob("store-*")}
    assert stores and all(psutil.pid_exists(pid) for pid in stores.values()), stores
