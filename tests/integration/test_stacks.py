"""Where is every rank: ``hvd-notebook stacks`` from a terminal while a cell is blocked, ``%hvd stacks``
between cells, and ``hvd-notebook stacks`` beside a job of ``hvd-notebook run``."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from conftest import CLI, Kernel, assert_gone, comes_within

BLOCKED_CELL = ("import time\n"
                "if hvd.rank() == 0:\n"
                "    hvd.barrier()  # rank 1 never joins: rank 0 blocks in the collective\n"
                "else:\n"
                "    time.sleep(30)\n")


def test_stacks_from_a_terminal_show_rank_0_blocked_in_the_barrier(tmp_path):
    kernel = Kernel(n=2, cell=BLOCKED_CELL, env={"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "25"})
    try:
        kernel.wait_ready()
        assert kernel.pids, f"the kernel did not start its cluster: {kernel.error[-3000:]}"
        def stacks_in_the_barrier() -> tuple[subprocess.CompletedProcess, float] | None:
            started = time.monotonic()
            proc = subprocess.run(CLI + ["stacks", kernel.workdir.name], capture_output=True, text=True, timeout=60)
            return (proc, time.monotonic() - started) if "in barrier" in proc.stdout else None

        found = comes_within(stacks_in_the_barrier, 30.0)  # (rank 0 in the barrier, rank 1 in its sleep)
        assert found, "rank 0 was never seen in the cell's barrier"
        proc, took = found
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = proc.stdout
        rank0, rank1 = out.split("== rank 1 of 2")[0], out.split("== rank 1 of 2")[1]
        assert "== rank 0 of 2" in rank0 and "in barrier" in rank0, out
        assert "in hvd.barrier(), called from a cell, line 3" in rank0.splitlines()[0], out  # the summary line
        assert "in wait" in rank0  # inside the runtime's wait for the other rank (the stall inspector's loop)
        assert "in barrier" not in rank1 and "<module>" in rank1, out  # rank 1 is in the cell's sleep
        assert took < 8, took  # (mostly the CLI's own start; the ranks answer within 2 s)
        everyone = subprocess.run(CLI + ["stacks", "--all-threads"], capture_output=True, text=True, timeout=60)
        assert everyone.stdout.count("== rank 0 of 2") >= 1 and "Thread 0x" in everyone.stdout
        missing = subprocess.run(CLI + ["stacks", "no-such-cluster"], capture_output=True, text=True, timeout=60)
        assert missing.returncode == 2 and kernel.workdir.name in missing.stderr
    finally:  # (the cell is still blocked: the kernel's death stops its cluster, as a crashed kernel's would)
        kernel.proc.kill()
        kernel.proc.wait()
    assert_gone(kernel.pids, timeout=20)


def test_hvd_stacks_magic_between_cells(ip, capsys):
    ip.run_line_magic("hvd", "start -n 2")
    try:
        capsys.readouterr()
        ip.run_line_magic("hvd", "stacks")
        out = capsys.readouterr().out
        assert "== rank 0 of 2" in out and "== rank 1 of 2" in out, out
        assert "no answer" not in out, out
    finally:
        ip.run_line_magic("hvd", "stop")


def test_stacks_of_a_script_run_by_hvd_notebook_run(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text("import time\n\ndef training_loop():\n    time.sleep(20)\n\ntraining_loop()\n")
    job = subprocess.Popen([sys.executable, "-m", "hvd_notebook.cli", "run", "-np", "2", sys.executable,
                            str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        out, ours = "", f"{script}, line 4, in training_loop"  # (other tests' jobs may be listed beside it)
        while time.monotonic() < deadline and out.count(ours) < 2:
            time.sleep(1)
            out = subprocess.run(CLI + ["stacks"], capture_output=True, text=True, timeout=60).stdout
        assert out.count(ours) >= 2, out
    finally:
        job.send_signal(signal.SIGTERM)  # the runner ends every rank it started
        job.wait(30)
