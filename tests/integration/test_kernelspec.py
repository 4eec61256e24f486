"""The "Python 3 (hvd_notebook)" kernelspec: `hvd-notebook install-kernel`
installs it into a prefix, and a kernel started from it has the magics loaded
and the environment it was installed with."""

from __future__ import annotations

import json
import subprocess
import sys

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager


def test_install_kernel_into_a_prefix_and_start_it(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hvd_notebook.cli", "install-kernel", "--prefix", str(tmp_path),
                           "--name", "hvd-test", "--env", "HVD_NOTEBOOK_GPUS=", "--env", "NCCL_DEBUG=INFO"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    spec_dir = tmp_path / "share" / "jupyter" / "kernels" / "hvd-test"
    assert f"Installed kernelspec hvd-test in {spec_dir}" in proc.stdout
    spec = json.loads((spec_dir / "kernel.json").read_text())
    assert spec["display_name"] == "Python 3 (hvd_notebook)" and spec["argv"][0] == sys.executable
    assert spec["env"] == {"HVD_NOTEBOOK_GPUS": "", "NCCL_DEBUG": "INFO"}
    assert (spec_dir / "logo-64x64.png").read_bytes().startswith(b"\x89PNG")

    ksm = KernelSpecManager(kernel_dirs=[str(spec_dir.parent)])
    km = KernelManager(kernel_name="hvd-test", kernel_spec_manager=ksm)
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        out: list[str] = []

        def keep(msg):
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])

        reply = kc.execute_interactive("%hvd --help\nimport os\nprint('NCCL_DEBUG', os.environ['NCCL_DEBUG'])",
                                       output_hook=keep, timeout=60)
        text = "".join(out)
        assert reply["content"]["status"] == "ok", text
        assert "%hvd start" in text and "NCCL_DEBUG INFO" in text  # magics there without %load_ext
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_install_kernel_rejects_a_malformed_env(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hvd_notebook.cli", "install-kernel", "--prefix", str(tmp_path),
                           "--env", "NOEQUALS"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "argument --env: 'NOEQUALS' is not KEY=VALUE" in proc.stderr
    assert not (tmp_path / "share").exists()
