"""Real serving engines driven step by step, each in its own environment
(docs/vllm.md, docs/fidelity.md)."""
