"""The parameter-server strategy (``strategy: parameter_server``; docs/runtime.md,
"Parameter-server strategy").

``servers`` processes hold the model's parameters in shards, each with its optimizer state:
an embedding table's rows are split in contiguous ranges over all servers, every other
parameter is held whole by one. Workers hold no state of their own: at every iteration each
pulls the dense parameters and, during its forward, the rows of the tables its batch touches;
computes the gradient of its fixed virtual shards of the global batch; and pushes it to the
servers, sparse for the tables (the rows touched and their gradient only). Each server sums
the V shards' gradients in shard order 0..V-1, whoever computed them, and steps; so the
result is bit for bit that of a 1-worker run for any worker schedule.

- :mod:`.layout`: which parameter lives on which server (deterministic from the model and K);
- :mod:`.wire`: the messages, over ``torch.distributed`` point-to-point (gloo);
- :mod:`.server`: the server process (lives for the whole chunk, joins each segment's group);
- :mod:`.worker`: the worker loop;
- :mod:`.group`: the runner's side: starting, joining, watching and stopping the servers.
"""
