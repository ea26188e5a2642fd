"""Host IR: the host program that loops over stream slices, and the passes over it.

Instructions are verbs (``SetCurrentStream``, ``Synchronize``), values are nouns (a tensor
name, ``Stream(i % 4)``, the caller's stream ``main_stream``). ``str(program)`` is the one
official dump: one node per line, loop bodies indented; the C++ renderer puts each of these
lines above the statements it emits.

The stage is a package, one module per concern:

- ``nodes``: values, nodes, ``HostProgram`` and ``verify``;
- ``cleanup``: ``remove_dead_code``;
- ``fusion``: ``fuse_pointwise``, ``accumulate_sums``;
- ``staging``: host operands (staging slots, the copy stream, the staging ring);
- ``streams``: ``assign_streams``, ``order_accumulation``;
- ``fork_join``: ``run_copies_ahead``, ``insert_fork_join``;
- ``checks``: the input checks (``dim_checks``).

``HOSTIR_PASSES`` is the order ``lowering.lower`` runs them in; the nodes and passes are
importable from ``codegen.hostir`` itself.
"""

from __future__ import annotations

from .checks import (  # noqa: F401
    DimCheck,
    dim_checks,
)
from .cleanup import (  # noqa: F401
    remove_dead_code,
    view_roots,
)
from .fork_join import (  # noqa: F401
    insert_fork_join,
    run_copies_ahead,
)
from .fusion import (  # noqa: F401
    accumulate_sums,
    fuse_pointwise,
    value_infos,
)
from .nodes import (  # noqa: F401
    GEMM_LIBRARIES,
    MAIN_STREAM,
    NODE_CLASSES,
    RING_POSITION,
    STAGINGS,
    Allocate,
    Apply,
    Compute,
    Constraint,
    ContractionChoice,
    Copy,
    CopyStream,
    CreateEvents,
    Deallocate,
    Event,
    ForLoop,
    GetCurrentStream,
    HostProgram,
    Linear,
    Matmul,
    Node,
    Options,
    RecordEvent,
    ReleaseRingSlot,
    RingSlot,
    RingStream,
    SetCurrentStream,
    ShardByStream,
    StagingSlot,
    Stream,
    StreamedMatmul,
    StreamRef,
    StreamSynchronize,
    Synchronize,
    TensorInfo,
    WaitEvent,
    node_class,
    verify,
)
from .staging import (  # noqa: F401
    _reads,
    hoist_staging,
    queue_copies_in,
    stage_host_tensors,
    stage_in_ring,
    synchronize_host_outputs,
)
from .streams import (  # noqa: F401
    HostPass,
    assign_streams,
    on_caller_stream,
    order_accumulation,
    stream_count,
    worker_stream,
)

HOSTIR_PASSES: tuple[HostPass, ...] = (
    remove_dead_code,
    fuse_pointwise,
    accumulate_sums,
    stage_host_tensors,
    assign_streams,
    order_accumulation,
    queue_copies_in,
    hoist_staging,
    stage_in_ring,
    run_copies_ahead,
    insert_fork_join,
    synchronize_host_outputs,
)
