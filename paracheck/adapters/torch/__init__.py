"""The torch adapter: a user's own `nn.Module` and their own parallelize function (torch's public parallel APIs),
checked against the same module on one device.

A spec names `build()` (the single-device module), `parallelize(model, mesh, layout)`, `inputs(layout, variant)`
and optionally `loss(output, inputs)` (see `spec`). Modules: `layout` (torch-free names and meshes' shapes),
`spec` (loading and validating a spec), `cases` (case expansion), `controls` (planted bugs), `structure` (the
structure checks), `body` (one case's passes on a rank), `rank` (the interim per-case loop), `adapter` (the
`Adapter` object), `mixin` (the pytest mixin).
"""

LIBRARY = "torch"
