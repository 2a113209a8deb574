"""A plain DDP training script with the few lines script mode asks for (run by the runner)."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import elastic_ops.runtime.script as elastic

g = torch.Generator().manual_seed(5)
x = torch.randn(60, 4, generator=g)
y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

ctx = elastic.init(num_samples=len(x))
torch.manual_seed(0)
model = DDP(nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
ctx.restore(model, optimizer)
for it in ctx.iterations():
    idx = ctx.my_samples(it)
    optimizer.zero_grad()
    loss = F.mse_loss(model(x[idx]), y[idx])
    (loss * ctx.loss_weight()).backward()  # DDP's average over workers is then the global mean
    optimizer.step()
    ctx.commit(it, loss.item())
