"""Script mode: an ordinary PyTorch DDP training script, made elastic with a few lines.

Everything not marked ``# elastic_ops`` is what a DDP script already has. The additions:
``init`` (instead of ``init_process_group``), ``restore`` (resume where the job stands),
``iterations()`` (instead of ``range``; it stops at the chunk's end or when the worker count
changes, and the runner restarts the script with the new count), ``my_samples`` (instead of a
DistributedSampler: this worker's share of the fixed global batch, in the job's
deterministic data order), ``loss_weight()`` (weights this worker's mean loss by its share, so
DDP's equal-weight average is the global batch's mean when 64 samples split 22/21/21 over
three workers; 1.0 when the split is even) and ``commit`` (the iteration is done; the job's
loss is the workers' weighted mean).

Run from the repository root (``elastic-ops`` starts this file on every worker):

    elastic-ops run --spec examples/ddp_script.yaml --workers-schedule 1,2,4

The data is scikit-learn's bundled digits, split and standardised as in the ``DigitsMLP``
example, so a checkpoint of this script loads into ``DigitsMLP().build_model()``.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import elastic_ops.runtime.script as elastic  # elastic_ops
from elastic_ops.examples.digits import load_split

split = load_split()
x = torch.tensor(split["x_train"])
y = torch.tensor(split["y_train"])

ctx = elastic.init(num_samples=len(x))  # elastic_ops: joins the process group (gloo or NCCL)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
model = DDP(model.to(ctx.device))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.002, weight_decay=1e-4)
ctx.restore(model, optimizer)  # elastic_ops: model, optimizer, RNG and data cursor of the job

for it in ctx.iterations():  # elastic_ops
    idx = ctx.my_samples(it)  # elastic_ops: this worker's share of the global batch
    xb, yb = x[idx].to(ctx.device), y[idx].to(ctx.device)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(xb), yb)
    (loss * ctx.loss_weight()).backward()  # elastic_ops: DDP's average is the global batch's mean
    optimizer.step()
    ctx.commit(it, loss.item())  # elastic_ops: the iteration is done
