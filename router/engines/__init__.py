"""What engines say of themselves, in one place below discovery, the policies and the agent.

- `facts`: what a worker record leaves open (bootstrap port, DP size, models, the
  engine's kind, its KV-event endpoints), asked of the engine while the worker waits;
- `models`: the models an engine serves (its `/v1/models`);
- `metrics`: the one mapping of engine metric names, and the reading of the work gauges
  an engine exports (the drain's and the load reader's);
- `kv_events`: the engines' KV-cache events and the block index built from them.
"""
