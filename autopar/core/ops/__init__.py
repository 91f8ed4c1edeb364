"""The instruction set of rank graphs: every function an emitted graph calls (collectives with their
conjugate backwards, point-to-point steps, local kernels for sharded ops, context-parallel attention,
mixture-of-experts token movement, ZeRO units' gathers and reductions). The compiler inserts calls to
them; the runtime runs graphs made of them. They plan nothing."""
