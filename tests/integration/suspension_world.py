"""One rank of a world for test_suspension.py: notebook cells run into a namespace (as ``%%hvd`` cells run in a
rank), training Keras 3, Keras 2 (tf_keras), a ``horovod.torch`` loop and a DDP loop on shuffled data.

    mpiexec -n 2 python suspension_world.py first|second FOLDER

World ``first`` runs two phases, each in a namespace of its own: ``straight`` (N + M steps) and ``suspend`` (N
steps, then ``suspension.save``). World ``second`` (a new mpiexec) runs ``resume`` (``suspension.restore``, the
cells that made what was not saved replayed, ``reconcile``, M steps) and ``resume-no-rng`` (the same with the RNGs
drawn afresh after the restore: what a resume would do without them). Each phase writes its rank's weights and
optimizer state to ``FOLDER/PHASE-rankR.npz``; each world its reports to ``FOLDER/reports-WORLD-rankR.json``.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # (tf.keras is Keras 2; `import keras` stays Keras 3)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
N, M = 3, 3

CELLS = {
    "imports": """
import random
import numpy as np, torch, keras, tf_keras
import hvd_notebook.runtime.torch as hvd_torch
from hvd_notebook.engine import frameworks
""",
    "seeds": """
random.seed(hvd.rank()); np.random.seed(10 + hvd.rank()); torch.manual_seed(20 + hvd.rank())
keras.utils.set_random_seed(0); tf_keras.utils.set_random_seed(0)
np.random.seed(10 + hvd.rank())
""",
    "data": """
rng = np.random.default_rng(hvd.rank())
x = rng.standard_normal((64, 8)).astype("float32")
y = (x @ np.arange(8, dtype="float32")[:, None] / 8 + rng.standard_normal((64, 1)).astype("float32") / 10)
xt, yt = torch.from_numpy(x), torch.from_numpy(y)
step = 0
""",
    "keras3": """
k3 = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
k3.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
""",
    "keras2": """
k2 = tf_keras.Sequential([tf_keras.Input((8,)), tf_keras.layers.Dense(16, activation="relu"), tf_keras.layers.Dense(1)])
k2.compile(hvd.DistributedOptimizer(tf_keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
""",
    "torch_net": """
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
hvd_torch.broadcast_parameters(net.state_dict(), root_rank=0)
""",
    "torch_opt": """
opt = hvd_torch.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                                     named_parameters=net.named_parameters())
""",
    "ddp": """
torch.manual_seed(1)
ddp_net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
ddp = torch.nn.parallel.DistributedDataParallel(ddp_net)
ddp_opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
""",
    "train": """
def train(steps):
    global step
    for _ in range(steps):
        idx = np.random.permutation(len(x))[:16]
        k3.train_on_batch(x[idx], y[idx])
        idx = np.random.permutation(len(x))[:16]
        k2.train_on_batch(x[idx], y[idx])
        for model, optimizer in ((net, opt), (ddp, ddp_opt)):
            perm = torch.randperm(len(xt))[:16]
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(xt[perm]), yt[perm]).backward()
            optimizer.step()
        step += 1
""",
}
# the cells that made each name (what the flow helper's replay chooses; here, by hand)
MADE_BY = {"opt": "torch_opt", "ddp": "ddp"}


def run_cells(namespace: dict, names: list[str]) -> None:
    for name in names:
        exec(CELLS[name], namespace)


def state(namespace: dict) -> dict:
    """Every weight and optimizer variable, by a stable name."""
    out = {"step": namespace["step"]}
    for key in ("k3", "k2"):
        model = namespace[key]
        for i, w in enumerate(model.get_weights()):
            out[f"{key}.w{i}"] = w
        variables = model.optimizer.variables
        for i, v in enumerate(variables() if callable(variables) else variables):
            out[f"{key}.opt{i}"] = v.numpy()
    for key, opt in (("net", "opt"), ("ddp_net", "ddp_opt")):
        for name, p in namespace[key].state_dict().items():
            out[f"{key}.{name}"] = p.numpy()
        for index, slots in namespace[opt].state_dict()["state"].items():
            for slot, value in slots.items():
                out[f"{opt}.{index}.{slot}"] = value.numpy()
    return out


def phase(name: str, folder: Path, hvd: object) -> dict:
    """One phase in a namespace of its own; its reports. Its weights go to ``FOLDER/NAME-rankR.npz``."""
    import numpy as np

    from hvd_notebook.engine import suspension

    rank_folder = folder / f"rank{hvd.rank()}"
    namespace: dict = {"hvd": hvd, "__name__": "__main__"}
    reports = {}
    if name in ("straight", "suspend"):
        run_cells(namespace, list(CELLS))
        namespace["train"](N + M if name == "straight" else N)
        if name == "suspend":
            rank_folder.mkdir(mode=0o700)
            reports["save"] = suspension.save(namespace, str(rank_folder))
    else:
        reports["restore"] = suspension.restore(namespace, str(rank_folder))
        run_cells(namespace, [MADE_BY[made] for made in reports["restore"]["unsaved"]])
        reports["reconcile"] = suspension.reconcile(namespace)
        if name == "resume-no-rng":
            random.seed(), np.random.seed(), namespace["torch"].seed()
        namespace["train"](M)
    np.savez(folder / f"{name}-rank{hvd.rank()}.npz", **state(namespace))
    return reports


def main(world: str, folder: Path) -> None:
    """World ``first``: the straight run, then the one that suspends; world ``second``: the resumes."""
    import hvd_notebook.runtime as hvd
    from hvd_notebook.engine import frameworks

    hvd.init()
    frameworks.init_torch_distributed(hvd, "127.0.0.1")
    names = ["straight", "suspend"] if world == "first" else ["resume", "resume-no-rng"]
    reports = {name: phase(name, folder, hvd) for name in names}
    (folder / f"reports-{world}-rank{hvd.rank()}.json").write_text(json.dumps(reports))
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
