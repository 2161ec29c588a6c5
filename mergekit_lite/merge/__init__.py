"""What to merge and how: config, plan, per-tensor math (methods), the streaming engine, RECALL weights, LoRA extraction."""
