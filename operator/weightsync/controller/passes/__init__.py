"""The reconcile pass: `reconcile` runs passes one at a time per WeightSync
(`scheduling`); each pass is `observe` -> `decide` (pure, returns `actions.Actions`) ->
`apply`; `memory` is what a WeightSync's passes keep between them, `generations` plans
and delivers group generations."""
