"""What to merge and how: the config and its YAML schemas, plan, per-tensor math (methods), the streaming engine
(which receives the adapter audit gate from above, see mergekit_lite/audited.py), RECALL weights, LoRA extraction."""
