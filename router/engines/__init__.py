"""What engines say of themselves, in one place below discovery, the policies and the agent.

- `facts`: what a worker record leaves open (bootstrap port, DP size, models, the
  engine's kind, its KV-event endpoints), asked of the engine while the worker waits;
- `models`: the models an engine serves and the LoRA adapters it holds (its
  `/v1/models`), and `adapter_lists`: that list read while the worker is in the fleet;
- `metrics`: the one mapping of engine metric names, and the reading of the work gauges
  an engine exports (the drain's and the load reader's); `lora_activity`: its LoRA
  adapter slots, from the same page;
- `kv_events`: the engines' KV-cache events and the block index built from them.
"""
