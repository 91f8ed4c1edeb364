"""What runs on each rank: collectives with their conjugates, local kernels for sharded ops,
gradient synchronisation, the module that wraps an emitted graph, and launch helpers."""
