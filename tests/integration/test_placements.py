"""Placements are plug-ins: a placement the test suite alone defines and registers (nothing in the package
changed) is chosen by ``%hvd start --launcher NAME``, starts a real world of engines under its own launcher,
runs a ``%%hvd`` cell, and stops leaving nothing behind; once taken out, the name is refused again."""

from __future__ import annotations

import pytest
from conftest import assert_gone

from hvd_notebook.cluster.launching.placements import Placement, launcher_names, register, unregister
from hvd_notebook.kernel.session import Session


class HydraHere(Placement):
    """Every rank on this host under MPICH's hydra ``mpiexec`` (the one beside this Python), not gforker,
    which the package's own one-host placement prefers."""

    name = "test-hydra-here"
    launcher_name = "test-hydra"
    precedence = 50

    @classmethod
    def selected(cls, options, launcher):
        return launcher == cls.launcher_name

    def ranks(self, host_gpus):
        return self.options.n or 2

    def controller_ip(self):
        return "127.0.0.1"

    def rank_env(self, environ):
        return {"UCX_TLS": "self,posix,cma"}  # (MPI over shared memory only, as on one host)


@pytest.fixture
def hydra_here():
    register(HydraHere)
    yield HydraHere
    unregister(HydraHere)


def test_a_placement_from_the_test_suite_starts_a_world_and_leaves_nothing(hydra_here, ip, run):
    assert "test-hydra" in launcher_names()
    result, out = run("%hvd start -n 2 --launcher test-hydra --gpus none --standby off")
    assert result.error_in_exec is None, out
    cluster = Session.get().cluster
    pids = cluster.pids()
    try:
        assert type(cluster.placement) is HydraHere
        launcher = cluster.world.launcher_pid
        import psutil

        command = " ".join(psutil.Process(launcher).cmdline())
        assert "mpiexec" in command and "gforker" not in command, command  # (its own launcher: hydra)
        result, out = run("%%hvd --output-ranks 0,1\nprint('rank', hvd.rank(), 'of', hvd.size())")
        assert result.error_in_exec is None, out
        assert "[0] rank 0 of 2" in out and "[1] rank 1 of 2" in out, out
    finally:
        run("%hvd stop")
    assert_gone(pids)


def test_a_placement_taken_out_is_refused_by_name(hydra_here, ip, run):
    unregister(HydraHere)
    result, out = run("%hvd start -n 2 --launcher test-hydra")
    assert result.error_in_exec is not None and "--launcher 'test-hydra': use auto, mpiexec or srun." in out, out
    assert Session.get().cluster is None
