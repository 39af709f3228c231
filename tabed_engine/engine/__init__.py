"""The request path: `Engine` (the public layer), the scheduler and its cost model, the runner
(static caches, CUDA graphs, prefill / AR / speculative steps), requests, prompts, outputs."""
