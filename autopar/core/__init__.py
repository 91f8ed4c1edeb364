"""The core: what every layer above speaks — the mesh, the placement IR, the program of stage
graphs, the communication registry, pipeline schedules as data, units of sharded state, errors —
and `ops/`, the instruction set that emitted rank graphs call. It imports nothing else of autopar."""
