"""The transformers adapter: `DistributedConfig` layouts, tiny causal-LM fixtures, and the rank side that checks a
`from_pretrained(distributed_config=...)` model against a single-process run of the same checkpoint.

Modules: `layout` (torch-free names and rules), `fixtures` (torch-free index; configs built on demand),
`inputs` (the batches of each variant), `structure` (the placements the plans ask for), `controls` (planted
bugs), `rank` (one case on one rank).
"""

LIBRARY = "transformers"
