"""Type stubs of laminar._laminar, the extension re-exported by the package laminar.

Ids and versions are ints; durations are float seconds (None or math.inf: no deadline); arrays are
NumPy arrays.
"""

import datetime
import enum
from typing import Optional, Sequence, Union

import numpy as np
import numpy.typing as npt

__version__: str

# Seconds, a timedelta, or None (no deadline).
Seconds = Union[float, int, datetime.timedelta, None]
# A 1-D list, tuple, NumPy array or CPU torch tensor (read through __dlpack__).
ArrayLike = Union[Sequence[int], Sequence[float], npt.NDArray[np.generic], "torch.Tensor"]  # noqa: F821
# A tensor given through DLPack: a torch tensor or a NumPy array (read or written in place).
Tensor = Union["torch.Tensor", npt.NDArray[np.generic]]  # noqa: F821


class StatusCode(enum.IntEnum):
    """What the caller should do next, the code of every laminar error."""
    OK = 0
    INVALID_ARGUMENT = 1
    NOT_FOUND = 2
    ALREADY_EXISTS = 3
    FAILED_PRECONDITION = 4
    OUT_OF_RANGE = 5
    RESOURCE_EXHAUSTED = 6
    UNAVAILABLE = 7
    ABORTED = 8
    DEADLINE_EXCEEDED = 9
    CANCELLED = 10
    DATA_LOSS = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13


class Error(Exception):
    """Base of every laminar error. `code` is its StatusCode, `message` names what was wrong."""
    code: StatusCode
    message: str


class InvalidArgumentError(Error, ValueError):
    """Fix the input."""


class NotFoundError(Error, LookupError):
    """The named thing does not exist."""


class AlreadyExistsError(Error):
    """The thing being created is there already (e.g. a trajectory id the queue holds or retired)."""


class FailedPreconditionError(Error):
    """Fix the state first."""


class OutOfRangeError(Error, IndexError):
    """Asked past the end of something valid."""


class ResourceExhaustedError(Error):
    """Out of memory, KV blocks, credits or capacity."""


class UnavailableError(Error):
    """Retry the same call (a peer gone, a queue momentarily full)."""


class AbortedError(Error):
    """Redo the whole operation (e.g. a lease ran out)."""


class DeadlineExceededError(Error, TimeoutError):
    """Too slow."""


class CancelledError(Error):
    """The caller, or shutdown (close()), stopped it."""


class DataLossError(Error):
    """Data failed its checksum or is truncated."""


class UnimplementedError(Error, NotImplementedError):
    """Not compiled in, or not supported in this build."""


class InternalError(Error):
    """A bug of laminar's."""


class FinishReason(enum.IntEnum):
    """Why generation of a trajectory ended."""
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3


class Trajectory:
    """One finished rollout sample, as TrajectoryQueue.push takes it.

    Token arrays take a list or tuple of ints, or a 1-D NumPy array or CPU torch tensor of an
    integer dtype (values must fit int32); log-probs and rewards take numbers, or a floating dtype.
    A wrong dtype, a shape that is not 1-D or a value that does not fit raises InvalidArgumentError.
    Arrays read back as new NumPy arrays (int32 tokens, float32 log-probs and rewards).
    """
    id: int
    prompt_id: int
    group_id: int
    group_size: int
    sample_index: int
    version: int
    finish_reason: FinishReason
    generation_start_ns: int
    generation_end_ns: int
    metadata: str

    def __init__(self, *, id: int = 0, prompt_id: int = 0, group_id: int = 0, group_size: int = 1,
                 sample_index: int = 0, version: int = 0, prompt_tokens: ArrayLike = (),
                 response_tokens: ArrayLike = (), logprobs: ArrayLike = (), rewards: ArrayLike = (),
                 finish_reason: FinishReason = FinishReason.STOP, generation_start_ns: int = 0,
                 generation_end_ns: int = 0, metadata: str = "") -> None: ...
    @property
    def prompt_tokens(self) -> npt.NDArray[np.int32]: ...
    @prompt_tokens.setter
    def prompt_tokens(self, value: ArrayLike) -> None: ...
    @property
    def response_tokens(self) -> npt.NDArray[np.int32]: ...
    @response_tokens.setter
    def response_tokens(self, value: ArrayLike) -> None: ...
    @property
    def logprobs(self) -> npt.NDArray[np.float32]:
        """float32[num_response_tokens]: behaviour log-prob of each response token."""
    @logprobs.setter
    def logprobs(self, value: ArrayLike) -> None: ...
    @property
    def rewards(self) -> npt.NDArray[np.float32]:
        """float32[num_rewards >= 1]."""
    @rewards.setter
    def rewards(self, value: ArrayLike) -> None: ...
    @property
    def num_tokens(self) -> int:
        """Prompt plus response tokens."""
    def validate(self, contents: bool = True) -> None:
        """Raises InvalidArgumentError for what push would refuse without looking at the queue."""
    def encode(self) -> bytes:
        """The binary encoding of the write-ahead log and remote producers."""
    @staticmethod
    def decode(data: bytes, contents: bool = True) -> "Trajectory":
        """Inverse of encode; DataLossError for truncated or padded bytes, InvalidArgumentError for
        an invalid trajectory."""
    def __copy__(self) -> "Trajectory": ...
    def __deepcopy__(self, memo: dict) -> "Trajectory": ...
    def __eq__(self, other: object) -> bool: ...


class StalenessRule(enum.IntEnum):
    """staleness = consumer_version - trajectory.version (0 when the trajectory is newer)."""
    DROP = 0
    KEEP = 1
    KEEP_AND_MARK = 2


class PartialGroupPolicy(enum.IntEnum):
    """What happens to a GRPO group still incomplete when group_timeout runs out."""
    RELEASE = 0
    DROP = 1


class TrajectoryQueueOptions:
    """Options of a TrajectoryQueue; every field is also a keyword of the constructor. Durations
    read back as float seconds (math.inf: no timeout). An unknown keyword, a negative count or a
    negative duration raises InvalidArgumentError."""
    capacity_trajectories: int
    capacity_tokens: int
    default_lease: float
    group_timeout: float
    partial_group_policy: PartialGroupPolicy
    clock: Optional["Clock"]
    validate_contents: bool
    initial_version: int
    id_dedup_window: int
    wal_path: str
    wal_fsync: bool
    wal_compact_bytes: int

    def __init__(self, *, capacity_trajectories: int = ..., capacity_tokens: int = ...,
                 default_lease: Seconds = ..., group_timeout: Seconds = ...,
                 clock: Optional["Clock"] = ..., partial_group_policy: PartialGroupPolicy = ...,
                 validate_contents: bool = ...,
                 initial_version: int = ..., id_dedup_window: int = ..., wal_path: str = ...,
                 wal_fsync: bool = ..., wal_compact_bytes: int = ...) -> None: ...


class BatchSpec:
    """What pop_batch takes; every field is also a keyword of the constructor. At least one of
    max_trajectories and max_tokens is set. wait and lease are seconds (None or math.inf: forever)."""
    max_trajectories: int
    max_tokens: int
    min_trajectories: int
    wait: float
    consumer_version: int
    staleness_rule: StalenessRule
    max_staleness: int
    lease: float

    def __init__(self, *, max_trajectories: int = 0, max_tokens: int = 0, min_trajectories: int = 1,
                 wait: Seconds = 0, consumer_version: int = 0, staleness_rule: StalenessRule = StalenessRule.KEEP,
                 max_staleness: int = 0, lease: Seconds = 0) -> None: ...


class Batch:
    """A leased batch. Each field is a NumPy array with one entry per trajectory, or, for the token,
    log-prob and reward arrays, every trajectory's values end to end with an int64 offsets array of
    length len(batch) + 1: trajectory i's response tokens are
    response_tokens[response_offsets[i]:response_offsets[i + 1]], and so are its logprobs. Each
    access builds a new array. Reading stays valid after ack or expiry."""
    @property
    def id(self) -> int: ...
    def __len__(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def lease_deadline(self) -> float:
        """End of the lease, seconds on the queue's clock (math.inf: never)."""
    def __getitem__(self, i: int) -> Trajectory: ...
    def trajectories(self) -> list[Trajectory]: ...
    @property
    def ids(self) -> npt.NDArray[np.uint64]: ...
    @property
    def prompt_ids(self) -> npt.NDArray[np.uint64]: ...
    @property
    def group_ids(self) -> npt.NDArray[np.uint64]: ...
    @property
    def group_sizes(self) -> npt.NDArray[np.uint32]: ...
    @property
    def sample_indices(self) -> npt.NDArray[np.uint32]: ...
    @property
    def versions(self) -> npt.NDArray[np.uint64]: ...
    @property
    def finish_reasons(self) -> npt.NDArray[np.uint8]: ...
    @property
    def generation_start_ns(self) -> npt.NDArray[np.int64]: ...
    @property
    def generation_end_ns(self) -> npt.NDArray[np.int64]: ...
    @property
    def prompt_tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def prompt_offsets(self) -> npt.NDArray[np.int64]: ...
    @property
    def response_tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def response_offsets(self) -> npt.NDArray[np.int64]: ...
    @property
    def logprobs(self) -> npt.NDArray[np.float32]: ...
    @property
    def rewards(self) -> npt.NDArray[np.float32]: ...
    @property
    def reward_offsets(self) -> npt.NDArray[np.int64]: ...
    @property
    def metadata(self) -> list[str]: ...
    @property
    def staleness(self) -> npt.NDArray[np.uint64]: ...
    @property
    def over_limit(self) -> npt.NDArray[np.bool_]: ...
    @property
    def partial_group(self) -> npt.NDArray[np.bool_]: ...
    @property
    def delivery(self) -> npt.NDArray[np.uint32]: ...


class TrajectoryQueue:
    """The experience buffer between rollouts and the actor: bounded, version-tagged, releasing GRPO
    groups whole, delivering exactly once (a popped batch is leased until ack). Every call is
    thread-safe; the blocking ones (push, push_many, pop_batch) release the GIL while they wait, so
    Python producer and consumer threads run at the same time."""

    def __init__(self, options: Optional[TrajectoryQueueOptions] = None) -> None:
        """InvalidArgumentError for bad options; FailedPreconditionError or DataLossError for an
        unusable write-ahead log."""
    def publish_version(self, version: int) -> None:
        """Announces a published version; InvalidArgumentError if older than the newest."""
    def newest_version(self) -> int: ...
    def push(self, trajectory: Trajectory, *, block: bool = True, timeout: Seconds = None) -> None:
        """Pushes a copy of `trajectory` (which stays usable). When the queue is full: block=True
        waits (up to `timeout` seconds if given, then DeadlineExceededError); block=False raises
        UnavailableError at once (`timeout` is then ignored, as in queue.Queue.put). Raises
        InvalidArgumentError for an invalid trajectory or a version ahead of newest_version(),
        AlreadyExistsError for an id the queue holds or retired recently, FailedPreconditionError
        for a closed group, CancelledError after close()."""
    def push_many(self, trajectories: Sequence[Trajectory], *, block: bool = True,
                  timeout: Seconds = None) -> list[Optional[Error]]:
        """push for several trajectories at once; returns, per trajectory in order, None when it
        went in or the Error push would have raised (not raised)."""
    def pop_batch(self, spec: BatchSpec) -> Batch:
        """Leases a batch. InvalidArgumentError for a spec without a limit, min_trajectories above
        max_trajectories or a consumer_version ahead of newest_version(); UnavailableError when too
        few are ready and spec.wait is 0; DeadlineExceededError when they did not become ready
        within spec.wait; CancelledError after close()."""
    def ack(self, batch: Union[Batch, int]) -> None:
        """Commits a batch (a Batch or its id). NotFoundError for an unknown or acked id;
        AbortedError when its lease ran out (do not apply it)."""
    def nack(self, batch: Union[Batch, int]) -> None:
        """Gives a batch back for redelivery ahead of everything else. Errors as ack."""
    def close(self) -> None:
        """Wakes every blocked push and pop with CancelledError and refuses later ones; acks still
        work."""
    def stats(self) -> dict:
        """Depth, flow, drops, staleness histogram, group waits and log, as a dict."""
    def recovery(self) -> dict:
        """What replaying the write-ahead log found, as a dict."""
    def background_error(self) -> Optional[Error]:
        """The first error of work no caller waited on (an Error, not raised), or None."""


class TransportOptions:
    """Options of a Transport; every field is also a keyword of the constructor. Durations are
    seconds (None or math.inf: no deadline)."""
    cluster_token: bytes
    ucx_transports: str
    max_message_bytes: int
    connect_timeout: float
    handshake_timeout: float
    max_unauthenticated_connections: int
    operation_timeout: float
    idle_timeout: float
    max_inbox_bytes_per_connection: int
    max_inbox_bytes: int
    clock: Optional["Clock"]

    def __init__(self, *, cluster_token: Union[bytes, str] = ..., ucx_transports: str = ...,
                 max_message_bytes: int = ..., connect_timeout: Seconds = ..., handshake_timeout: Seconds = ...,
                 max_unauthenticated_connections: int = ..., operation_timeout: Seconds = ...,
                 idle_timeout: Seconds = ..., max_inbox_bytes_per_connection: int = ...,
                 max_inbox_bytes: int = ..., clock: Optional["Clock"] = ...) -> None: ...


class Transport:
    """laminar's one way across processes and machines (UCX), with its own progress and callback
    threads; a process makes one and hosts every networked part on it (queue server, remote
    producers). No Python code runs on its threads."""

    def __init__(self, options: Optional[TransportOptions] = None) -> None:
        """InvalidArgumentError for bad options (a cluster_token under 16 bytes, ...); UCX's errors
        as they come."""
    def listen(self, host: str, port: int = 0) -> str:
        """Listens on host:port (port 0: any free one) and returns the address peers connect to,
        "host:port"."""
    def listen_address(self) -> Optional[str]:
        """The address listen() returned, or None."""
    @property
    def options(self) -> TransportOptions:
        """A copy of the options it was made with."""
    def stats(self) -> dict:
        """Inbox depth and refusals, as a dict."""


class TrajectoryQueueServerOptions:
    """Options of a TrajectoryQueueServer (keywords too)."""
    credits_per_producer: int
    clock: Optional["Clock"]

    def __init__(self, *, credits_per_producer: int = 16, clock: Optional["Clock"] = None) -> None: ...


class TrajectoryQueueServer:
    """Serves a TrajectoryQueue on a Transport, for RemoteProducers in other processes. Its handlers
    run on the transport's callback thread and push in C++; no Python runs there. Dropping the last
    reference (del server) removes them and answers every held push with CancelledError."""

    def __init__(self, transport: Transport, queue: TrajectoryQueue,
                 options: Optional[TrajectoryQueueServerOptions] = None) -> None:
        """InvalidArgumentError for zero credits; AlreadyExistsError while another server serves on the transport."""
    def stats(self) -> dict:
        """Producers, messages received, trajectories accepted and refused, malformed and held
        messages."""


class RemoteProducerOptions:
    """Options of a RemoteProducer (keywords too); seconds."""
    connect_timeout: float
    stall_timeout: float
    clock: Optional["Clock"]

    def __init__(self, *, connect_timeout: Seconds = 10.0, stall_timeout: Seconds = 10.0,
                 clock: Optional["Clock"] = None) -> None: ...


class RemoteProducer:
    """Pushes into the TrajectoryQueue a TrajectoryQueueServer serves at "host:port", with the
    queue's own answers, over this process's Transport. Thread-safe: threads share its credits.
    push and push_many release the GIL while they wait."""

    def __init__(self, transport: Transport, address: str, options: Optional[RemoteProducerOptions] = None) -> None:
        """Connects and handshakes. InvalidArgumentError for bad options; UnavailableError or
        DeadlineExceededError when the server cannot be reached."""
    def push(self, trajectory: Trajectory, *, block: bool = True, timeout: Seconds = None) -> None:
        """TrajectoryQueue.push across the wire: the queue's errors, or UnavailableError when the
        server vanished (pushing again is safe: a duplicate is AlreadyExistsError). block and
        timeout govern the wait for a credit."""
    def push_many(self, trajectories: Sequence[Trajectory], *, block: bool = True,
                  timeout: Seconds = None) -> list[Optional[Error]]:
        """TrajectoryQueue.push_many across the wire: None or the Error (not raised) per trajectory."""
    @property
    def credits_granted(self) -> int:
        """Pushes in flight the server allows this producer."""
    @property
    def credits_free(self) -> int:
        """Credits not in use now."""


class KvLayout:
    """The shape of a paged KV cache (keywords too): num_layers pools of num_pages pages, each page
    page_size tokens of num_kv_heads x head_dim elements of dtype ("f32", "f16" or "bf16")."""
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    dtype: str

    def __init__(self, *, num_pages: int = 0, page_size: int = 0, num_kv_heads: int = 0, head_dim: int = 0,
                 num_layers: int = 1, dtype: str = "bf16") -> None: ...
    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's K (or V)."""


class PagedKvCache:
    """Block allocator and per-sequence page tables over K and V pools the caller allocated and
    keeps writing: k_pool and v_pool are tensors (torch or NumPy, through DLPack, used in place)
    [num_layers, num_pages, page_size, num_kv_heads, head_dim] of the layout's dtype, dense (with
    one layer, the 4-D [num_pages, ...] too). The cache keeps them alive. A sequence's K/V of token
    pos in a layer go at pool[layer, page, offset] for (page, offset) = token_slot(id, pos, layer)."""

    def __init__(self, layout: KvLayout, k_pool: Tensor, v_pool: Tensor) -> None:
        """InvalidArgumentError for a bad layout or a pool whose shape, dtype or strides do not
        match it."""
    @property
    def layout(self) -> KvLayout: ...
    def add_sequence(self, id: int) -> None:
        """Starts an empty sequence; AlreadyExistsError if the id is live."""
    def append_tokens(self, id: int, n: int) -> None:
        """Grows a sequence by n tokens, taking pages as needed; ResourceExhaustedError (and no
        change) when too few are free, NotFoundError for an unknown id."""
    def release(self, id: int) -> None:
        """Returns the sequence's pages to the free list."""
    def length(self, id: int) -> int:
        """Tokens of the sequence."""
    def pages(self, id: int) -> npt.NDArray[np.int32]:
        """int32 array: the sequence's pages in token order."""
    def token_slot(self, id: int, pos: int, layer: int = 0) -> tuple[int, int]:
        """(page, offset) of token pos in the pools; OutOfRangeError past the sequence's length or
        the layers."""
    def build_page_table(self, ids: Sequence[int]) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32],
                                                             npt.NDArray[np.int32]]:
        """(indptr, indices, last_page_len), int32 arrays of the sequences in that order: what
        paged_decode takes. NotFoundError for an unknown id, InvalidArgumentError for one given
        twice."""
    def reserve_pages(self, n: int) -> list[int]:
        """Takes n pages out of the free list for a sequence on its way here; a list of pages."""
    def unreserve_pages(self, pages: Sequence[int]) -> None:
        """Returns reserved pages to the free list."""
    def adopt_sequence(self, id: int, pages: Sequence[int], length: int) -> None:
        """Makes sequence id of length tokens from reserved pages (the first ones, in token
        order)."""
    @property
    def free_pages(self) -> int: ...
    @property
    def used_pages(self) -> int: ...
    @property
    def reserved_pages(self) -> int: ...
    @property
    def num_sequences(self) -> int: ...

class SequenceState:
    """What a sequence's decoding resumes from on the destination (keywords too): the host fills it
    when the source pauses the sequence (KvMigrator.finish) and gets it back in an ARRIVED event.
    Token and log-prob fields take lists or 1-D arrays and read back as NumPy arrays, as in
    Trajectory."""
    sequence: int
    trajectory: int
    prompt_id: int
    group_id: int
    group_size: int
    sample_index: int
    version: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    rng_position: int
    kv_length: int
    engine_state: bytes

    def __init__(self, *, sequence: int = 0, trajectory: int = 0, prompt_id: int = 0, group_id: int = 0,
                 group_size: int = 1, sample_index: int = 0, version: int = 0, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0, rng_position: int = 0, kv_length: int = 0,
                 prompt_tokens: ArrayLike = (), response_tokens: ArrayLike = (), logprobs: ArrayLike = (),
                 engine_state: bytes = b"") -> None: ...
    @property
    def prompt_tokens(self) -> npt.NDArray[np.int32]: ...
    @prompt_tokens.setter
    def prompt_tokens(self, value: ArrayLike) -> None: ...
    @property
    def response_tokens(self) -> npt.NDArray[np.int32]: ...
    @response_tokens.setter
    def response_tokens(self, value: ArrayLike) -> None: ...
    @property
    def logprobs(self) -> npt.NDArray[np.float32]: ...
    @logprobs.setter
    def logprobs(self, value: ArrayLike) -> None: ...
    def __eq__(self, other: object) -> bool: ...


class MigrationState(enum.IntEnum):
    """Where a migration stands, as either side sees it."""
    RUNNING = 0
    ABORTED_BY_SOURCE = 1
    ABORTED_BY_DESTINATION = 2
    DONE = 3


class MigrationEvent:
    """What poll() reports."""

    class Kind(enum.IntEnum):
        PAUSE_REQUESTED = 0
        DONE = 1
        ABORTED = 2
        ARRIVED = 3

    @property
    def kind(self) -> "MigrationEvent.Kind": ...
    @property
    def id(self) -> int:
        """Migration id (int)."""
    @property
    def outgoing(self) -> bool:
        """This worker is the migration's source."""
    @property
    def state(self) -> MigrationState: ...
    @property
    def sequences(self) -> list[int]: ...
    @property
    def states(self) -> list[SequenceState]:
        """ARRIVED only, in the order of `sequences`."""
    @property
    def reason(self) -> Optional[Error]:
        """ABORTED: why (an Error, not raised); otherwise None."""


class KvMigratorOptions:
    """Options of a KvMigrator (keywords too); durations in seconds."""
    lease: float
    stall_timeout: float
    connect_timeout: float
    max_live_stages: int
    pause_after_pages: int
    growth_pages: int
    stage_bytes: int
    max_sequences: int
    max_migrations: int
    clock: Optional[Clock]

    def __init__(self, *, lease: Seconds = ..., stall_timeout: Seconds = ..., connect_timeout: Seconds = ...,
                 max_live_stages: int = ..., pause_after_pages: int = ..., growth_pages: int = ...,
                 stage_bytes: int = ..., max_sequences: int = ..., max_migrations: int = ...,
                 clock: Optional[Clock] = ...) -> None: ...


class KvPool:
    """One pool (K or V) of a cache KvMigrator.allocate_cache made, lent through DLPack without a
    copy: torch.from_dlpack(pool) and numpy.from_dlpack(pool) give the tensor
    [num_layers, num_pages, page_size, num_kv_heads, head_dim] of the layout's dtype over the
    transport's own memory (NumPy 1.x marks its import read-only: numpy() is the writable array).
    Each tensor keeps the memory alive as long as it lives, after the cache and the migrator are
    gone."""

    def __dlpack__(self, *, stream: None = None, max_version: Optional[tuple[int, int]] = None,
                   dl_device: Optional[tuple[int, int]] = None, copy: Optional[bool] = None) -> object:
        """A DLPack capsule of the pool (the array API's __dlpack__). stream must be None (host
        memory); BufferError for copy=True or a dl_device other than the host's."""
    def __dlpack_device__(self) -> tuple[int, int]:
        """(1, 0): host memory."""
    def numpy(self) -> npt.NDArray[np.generic]:
        """A writable NumPy array over the pool, no copy (numpy.from_dlpack's is read-only in NumPy
        1.x); it keeps the memory alive too. InvalidArgumentError for bf16, which NumPy has no dtype
        for."""
    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """(num_layers, num_pages, page_size, num_kv_heads, head_dim)."""
    @property
    def dtype(self) -> str:
        """"f32", "f16" or "bf16"."""


class AllocatedKvCache:
    """A PagedKvCache whose pools the transport allocated (KvMigrator.allocate_cache): give it to
    KvMigrator in place of the cache, and peers put pages straight into its pools. Python reads and
    writes the pools through k_pool and v_pool (torch.from_dlpack(k_pool), k_pool.numpy()), without
    a copy."""

    @property
    def cache(self) -> PagedKvCache:
        """The PagedKvCache: sequences, pages and token slots."""
    @property
    def layout(self) -> KvLayout: ...
    @property
    def k_pool(self) -> KvPool:
        """The K pool, lent through DLPack."""
    @property
    def v_pool(self) -> KvPool:
        """The V pool, lent through DLPack."""


class KvMigrator:
    """Moves live sequences with their KV pages to the KvMigrator of another rollout worker holding
    the same version: pages are copied while the source keeps decoding, only the last stage pauses
    the sequences, every page is checked, and an abort or a lost peer leaves each sequence whole at
    exactly one worker. Drive it from the decode loop: poll() between steps and act on its events.
    Its pools are the PagedKvCache's, registered with the transport (which must listen to receive),
    or those of an AllocatedKvCache, which the transport allocated: on one host, peers put into
    those with one memcpy, more than ten times faster than into pools it registers
    (bench/README.md)."""

    def __init__(self, transport: Transport, cache: Union[PagedKvCache, AllocatedKvCache],
                 options: Optional[KvMigratorOptions] = None) -> None:
        """cache: a PagedKvCache or an AllocatedKvCache of this transport. InvalidArgumentError for
        bad options or an AllocatedKvCache of another transport; AlreadyExistsError when another
        migrator serves the transport."""
    @staticmethod
    def allocate_cache(transport: Transport, layout: KvLayout) -> AllocatedKvCache:
        """A cache whose zero-filled pools `transport` allocates, for a KvMigrator on the same
        transport. InvalidArgumentError naming the field for a bad layout; ResourceExhaustedError
        when the memory is not there."""
    def set_version(self, version: int) -> None:
        """The weights this worker decodes with; migrations only go between workers of one
        version."""
    def version(self) -> int: ...
    def migrate(self, destination: str, sequences: Sequence[int]) -> int:
        """Starts moving `sequences` to the migrator at "host:port"; the migration's id.
        NotFoundError for an id not in the cache, FailedPreconditionError for one already moving,
        ResourceExhaustedError past max_migrations, the transport's errors from connecting."""
    def poll(self) -> list[MigrationEvent]:
        """Advances every migration both ways and returns what happened since the last call, in
        order. Never blocks on a peer."""
    def finish(self, id: int, states: Sequence[SequenceState]) -> None:
        """After PAUSE_REQUESTED: the paused sequences' states; starts the final stage.
        InvalidArgumentError naming the sequence for a missing, repeated or inconsistent state."""
    def abort(self, id: int, reason: str) -> None:
        """Gives a running migration up; its sequences stay or return here."""
    def state(self, id: int) -> MigrationState: ...
    def moving(self) -> list[int]:
        """Sequences of this worker in outgoing migrations."""
    def address(self) -> Optional[str]:
        """Where peers reach this migrator, or None."""
    def stats(self) -> dict:
        """Migrations, pages and bytes moved, checksum failures, as a dict."""
    def background_error(self) -> Optional[Error]:
        """The first failure of its background work (an Error, not raised), or None."""

def cast(src: Tensor, dst: Tensor, *, stream: Optional[int] = None) -> None:
    """Converts src into dst, element by element, between float32, float16 and bfloat16 (round to
    nearest even, NaN kept; the same bits on the CPU and CUDA). Both are tensors given through
    DLPack (torch tensors, NumPy arrays) of the same shape, dense, on the host or one CUDA device;
    dst is written in place, nothing is copied on the way in. On CUDA the cast is enqueued on a
    stream (see below). InvalidArgumentError names the tensor and what is wrong (dtype, shape,
    strides, overlap).
    stream (CUDA): the cudaStream_t, an int, the kernel is enqueued on and the tensors are exported
    through DLPack for (0: the legacy default stream); None: torch's current stream of the tensor's
    device for a torch tensor, the legacy default stream otherwise. InvalidArgumentError for a
    negative or non-int stream, and for any stream with host tensors.
    CUDA tensors: UnimplementedError in a build without CUDA; FailedPreconditionError where no CUDA
    device or driver takes the launch (retrying cannot help)."""


class Clock:
    """The time every laminar timeout, lease and deadline reads. Options take one (their `clock`
    field; None: the steady clock). Clock.steady() is real time; a ManualClock moves only when told,
    so a test or a simulation makes leases and timeouts expire exactly when it says."""

    def now(self) -> float:
        """Seconds since the clock's epoch."""
    @staticmethod
    def steady() -> "Clock":
        """The process-wide steady (monotonic, real-time) clock."""


class ManualClock(Clock):
    """Virtual time that only moves when told to."""

    def __init__(self, start: Seconds = 0) -> None:
        """Starts at `start` seconds."""
    def advance(self, seconds: Seconds) -> None:
        """Moves time forward, then wakes every call waiting on this clock (they re-check their
        deadlines). InvalidArgumentError for a negative step or one reaching infinity."""
    def set(self, seconds: Seconds) -> None:
        """Jumps to `seconds`. InvalidArgumentError when that is before now()."""



class RelayStoreOptions:
    """Options of a RelayStore (keywords too)."""
    chunk_bytes: int
    memory_budget_bytes: int
    pin_memory: bool
    shareable: bool
    clock: Optional[Clock]

    def __init__(self, *, chunk_bytes: int = ..., memory_budget_bytes: int = ..., pin_memory: bool = ...,
                 shareable: bool = ..., clock: Optional[Clock] = ...) -> None: ...


class ReadHandle:
    """A reference on one committed version of a RelayStore: its bytes stay valid and unchanged
    while the handle (or an array it returned) lives."""
    @property
    def version(self) -> int: ...
    @property
    def manifest(self) -> dict:
        """The version's manifest: {"total_bytes", "tensors": [{"name", "dtype", "shape", "nbytes",
        "offset"}, ...]}."""
    def tensor_bytes(self, name: str) -> npt.NDArray[np.uint8]:
        """The stored bytes of one tensor, as a read-only uint8 array over the store's memory (no
        copy). NotFoundError naming the tensor when the manifest lacks it."""
    def verify(self) -> None:
        """Re-hashes every chunk against its checksum; DataLossError naming the first that differs."""


class RelayStore:
    """The versioned weight store: publish copies a version out of the caller's tensors and returns
    without waiting for readers; the version commits once every chunk is checksummed (in the
    background). Readers acquire the newest committed version, or pull it with a WeightPuller."""

    def __init__(self, options: Optional[RelayStoreOptions] = None) -> None:
        """InvalidArgumentError for a bad chunk size or a zero budget."""
    def publish(self, version: int, tensors: dict[str, Tensor]) -> None:
        """Publishes version `version` from {name: tensor} (torch tensors or NumPy arrays, through
        DLPack, read in place), laid out in the dict's order. Returns once the bytes are copied into
        the store. InvalidArgumentError when the version does not increase, the dict is empty, a
        name is empty, or a tensor is not dense row-major or has an unsupported dtype;
        ResourceExhaustedError past the memory budget."""
    def wait_for_version(self, version: int, timeout: Seconds = None) -> None:
        """Waits until a version >= `version` is committed; DeadlineExceededError after `timeout`
        seconds (None: no deadline)."""
    def newest_version(self) -> Optional[int]:
        """Newest committed version, or None."""
    def acquire(self, version: Optional[int] = None) -> ReadHandle:
        """A ReadHandle on `version` (None: the newest committed). NotFoundError when it is not
        held, UnavailableError while it is still arriving."""
    def stats(self) -> dict:
        """Bytes and versions held, chunks rejected, as a dict."""


class RelayNodeOptions:
    """Options of a RelayNode (keywords too)."""
    upstreams: list[str]
    window: int
    connect_timeout: float
    retry_interval: float
    stall_timeout: float
    clock: Optional[Clock]

    def __init__(self, *, upstreams: Sequence[str] = (), window: int = 4, connect_timeout: Seconds = 2.0,
                 retry_interval: Seconds = 0.05, stall_timeout: Seconds = 10.0,
                 clock: Optional[Clock] = None) -> None: ...


class RelayEvent:
    """What a RelayNode reports (events())."""

    class Kind(enum.IntEnum):
        UPSTREAM = 0
        UPSTREAM_LOST = 1
        UPSTREAM_UNREACHABLE = 2
        COMMITTED = 3
        CHUNK_STORED = 4
        CHUNK_REJECTED = 5
        UPSTREAM_STALLED = 6
        SUBSCRIBER_STALLED = 7

    @property
    def kind(self) -> "RelayEvent.Kind": ...
    @property
    def version(self) -> int: ...
    @property
    def chunk(self) -> int: ...
    @property
    def upstream(self) -> str: ...
    @property
    def subscriber(self) -> str: ...


class RelayNode:
    """One relay of the chain that spreads versions across processes and hosts: it serves its
    RelayStore to subscribers on the process's Transport (which the host makes listen) and, unless
    it is the head, feeds the store from the first upstream that answers, chunk by chunk, checked,
    failing over and resuming when one dies or hangs. Its threads run no Python: their events wait
    in a bounded buffer for events(). Dropping the last reference removes its handlers."""

    def __init__(self, transport: Transport, store: RelayStore, options: Optional[RelayNodeOptions] = None) -> None:
        """InvalidArgumentError for bad options; AlreadyExistsError when another RelayNode serves
        on the transport."""
    def address(self) -> Optional[str]:
        """Where subscribers reach this node (the transport's listen address), or None."""
    def upstream(self) -> Optional[str]:
        """The upstream it is subscribed to now, or None."""
    def stats(self) -> dict:
        """Chunks received, sent and resent, failovers, stalls and subscribers, as a dict."""
    def events(self) -> list[RelayEvent]:
        """The events since the last call, oldest first (at most 4096 kept; events_dropped counts
        the rest)."""
    @property
    def events_dropped(self) -> int: ...
    def background_error(self) -> Optional[Error]:
        """The first failure of its background work (an Error, not raised), or None."""

class PullPolicy(enum.IntEnum):
    """When a WeightPuller may take a newer version."""
    WHEN_IDLE = 0
    PREFETCH_THEN_SWAP = 1


class PullAction(enum.IntEnum):
    """What WeightPuller.next_action says to do."""
    NONE = 0
    PULL = 1
    PREFETCH = 2
    SWAP = 3


class WeightPullerOptions:
    """Options of a WeightPuller (keywords too)."""
    policy: PullPolicy
    verify_checksums: bool
    copy_chunk_bytes: int
    relay_timeout: float
    clock: Optional[Clock]

    def __init__(self, *, policy: PullPolicy = ..., verify_checksums: bool = ..., copy_chunk_bytes: int = ...,
                 relay_timeout: Seconds = ..., clock: Optional[Clock] = ...) -> None: ...


class WeightPuller:
    """The rollout side of the relay tier: takes the newest version when the worker has no live
    trajectory, copying it straight from the relay's memory into the engine's tensors (in place,
    through DLPack). One thread at a time uses a puller, except cancel(). pull, prefetch and swap
    release the GIL."""

    def __init__(self, relay: RelayStore, options: Optional[WeightPullerOptions] = None) -> None:
        """Pulls from a RelayStore in this process. InvalidArgumentError for bad options."""
    @staticmethod
    def local(socket_paths: Sequence[str], options: Optional[WeightPullerOptions] = None) -> "WeightPuller":
        """Pulls from the LocalRelayServers at these socket paths, the first that answers, in order
        (connecting on first use). InvalidArgumentError for an empty list or a path too long for a
        socket."""
    def relay(self) -> str:
        """Where requests go now: "this process" or a local relay's socket path."""
    def newest_version(self) -> Optional[int]:
        """Newest version the relay has committed, or None (also when no local relay answers)."""
    def current_version(self) -> Optional[int]:
        """Version the destinations hold after the last pull or swap, or None."""
    def prefetched_version(self) -> Optional[int]:
        """Version reserved by prefetch and not swapped in yet, or None."""
    def next_action(self, has_live_trajectory: bool) -> tuple[PullAction, Optional[int]]:
        """(PullAction, version or None): what to do next. Never PULL or SWAP with a live
        trajectory."""
    def pull(self, version: int, destinations: dict[str, Tensor], has_live_trajectory: bool = False) -> None:
        """Copies version `version`'s tensors named by {name: tensor} into those tensors, in place.
        FailedPreconditionError with a live trajectory; NotFoundError for a version or tensor name
        the relay lacks (UnavailableError while the version arrives); InvalidArgumentError for a
        tensor whose dtype or shape differs from the manifest's, or that is not dense; DataLossError
        when verify_checksums finds a bad chunk; CancelledError when cancel() stopped it (pulling
        again resumes)."""
    def prefetch(self, version: int) -> None:
        """Reserves `version` for a later swap (PREFETCH_THEN_SWAP only: FailedPreconditionError
        otherwise)."""
    def swap(self, destinations: dict[str, Tensor], has_live_trajectory: bool = False) -> None:
        """Copies the prefetched version into the destinations; errors as pull."""
    def cancel(self) -> None:
        """Stops a pull running on another thread at its next chunk; the one call that may run
        concurrently."""
    def stopped_pull(self) -> Optional[tuple[int, int]]:
        """(version, bytes_done) of the last cancelled pull until a pull completes, or None."""


class LocalRelayServerOptions:
    """Options of a LocalRelayServer (keywords too)."""
    max_clients: int
    max_leases_per_client: int
    max_client_buffer_bytes: int
    idle_timeout: float
    clock: Optional[Clock]

    def __init__(self, *, max_clients: int = ..., max_leases_per_client: int = ...,
                 max_client_buffer_bytes: int = ..., idle_timeout: Seconds = ...,
                 clock: Optional[Clock] = ...) -> None: ...


class LocalRelayEvent:
    """What a LocalRelayServer reports (events())."""

    class Kind(enum.IntEnum):
        GRANTED = 0
        RELEASED = 1
        REFUSED = 2
        CLOSED = 3

    @property
    def kind(self) -> "LocalRelayEvent.Kind": ...
    @property
    def version(self) -> int: ...
    @property
    def client_pid(self) -> int: ...
    @property
    def disconnected(self) -> bool: ...
    @property
    def detail(self) -> str: ...


class LocalRelayServer:
    """Serves a shareable RelayStore's committed versions to WeightPuller.local in other processes
    of this host, over a Unix domain socket: they map a version's memory read-only and copy from it
    in place. Runs one thread of its own, which runs no Python: its events wait in a bounded buffer
    for events(). Dropping the last reference stops it, drops every lease and removes the socket
    file."""

    def __init__(self, store: RelayStore, socket_path: str, options: Optional[LocalRelayServerOptions] = None) -> None:
        """FailedPreconditionError for a store that is not shareable; AlreadyExistsError when a live
        server owns the path; InvalidArgumentError for a bad path or options."""
    @property
    def socket_path(self) -> str: ...
    def stats(self) -> dict:
        """Clients, leases and closed connections, as a dict."""
    def events(self) -> list[LocalRelayEvent]:
        """The events since the last call, oldest first (at most 4096 kept; events_dropped counts
        the rest)."""
    @property
    def events_dropped(self) -> int: ...
    def background_error(self) -> Optional[Error]:
        """The failure that stopped the server's thread (an Error, not raised), or None."""


def sample(logits: Tensor, seed: Tensor, position: Tensor, token: Tensor, *, temperature: Optional[Tensor] = None,
           top_k: Optional[Tensor] = None, top_p: Optional[Tensor] = None, min_p: Optional[Tensor] = None,
           raw_logprob: Optional[Tensor] = None, processed_logprob: Optional[Tensor] = None,
           kept_mass: Optional[Tensor] = None, cpu_threads: int = 0, stream: Optional[int] = None) -> None:
    """Samples one token per row of logits [batch, vocab] (float32/16, bfloat16; rows may be
    strided) into token [batch] int32, in place. seed and position are int64 [batch]: each row's
    randomness is Philox keyed by (seed, position), so a row's token depends only on its own logits
    and settings, never on its batch mates, the thread count or CPU vs CUDA. Optional per-row
    settings: temperature float32 (below 1e-5: greedy), top_k int32 (0: off), top_p and min_p
    float32. Optional outputs, float32 [batch]: raw_logprob (log-softmax of the raw logits at the
    token, the same bits token_logprob gives), processed_logprob (under the distribution sampled
    from) and kept_mass. InvalidArgumentError names the tensor or the row and field that is wrong,
    before any output is written.
    stream (CUDA): the cudaStream_t, an int, the kernel is enqueued on and the tensors are exported
    through DLPack for (0: the legacy default stream); None: torch's current stream of the tensor's
    device for a torch tensor, the legacy default stream otherwise. InvalidArgumentError for a
    negative or non-int stream, and for any stream with host tensors.
    CUDA tensors: UnimplementedError in a build without CUDA; FailedPreconditionError where no CUDA
    device or driver takes the launch (retrying cannot help)."""


def token_logprob(logits: Tensor, token: Tensor, logprob: Tensor, *, cpu_threads: int = 0,
                  stream: Optional[int] = None) -> None:
    """Writes log-softmax(logits[row])[token[row]] into logprob [batch] float32, in place: what the
    trainer scores a rollout's tokens with, bit-identical to sample's raw_logprob for the same
    logits. token is int32, or int64 on the host. InvalidArgumentError names the row whose token is
    outside [0, vocab).
    stream (CUDA): the cudaStream_t, an int, the kernel is enqueued on and the tensors are exported
    through DLPack for (0: the legacy default stream); None: torch's current stream of the tensor's
    device for a torch tensor, the legacy default stream otherwise. InvalidArgumentError for a
    negative or non-int stream, and for any stream with host tensors.
    CUDA tensors: UnimplementedError in a build without CUDA; FailedPreconditionError where no CUDA
    device or driver takes the launch (retrying cannot help)."""


def paged_decode(q: Tensor, out: Tensor, k_pages: Tensor, v_pages: Tensor, indptr: Tensor, indices: Tensor,
                 last_page_len: Tensor, *, lse: Optional[Tensor] = None, qo_indptr: Optional[Tensor] = None,
                 sm_scale: Optional[float] = None, workspace: Optional[Tensor] = None,
                 max_kv_len: Optional[int] = None, cpu_threads: int = 0, stream: Optional[int] = None) -> None:
    """Paged attention over one layer's KV pages, writing out (and lse) in place. q, out:
    [num_rows, num_qo_heads, head_dim]; k_pages, v_pages: [num_pages, page_size, num_kv_heads,
    head_dim] (float32/16, bfloat16, all the same; head_dim 64 or 128; num_qo_heads = num_kv_heads *
    group, group 1, 2, 4 or 8: query head h reads KV head h // group). The page table as in
    FlashInfer: sequence b's pages are indices[indptr[b]:indptr[b + 1]], its last page holding
    last_page_len[b] tokens (int32; int64 on the host only, where it is copied to int32). Decode:
    one row per sequence, at its last position. Prefill: qo_indptr [batch + 1] gives each
    sequence's rows, its last positions in order, causal. lse: [num_rows, num_qo_heads] float32,
    natural-log sum of exp of the scaled scores. sm_scale defaults to 1 / sqrt(head_dim). On the
    host max_kv_len defaults to the longest sequence and no workspace is needed; CUDA tensors (the
    page table then on the device too) need max_kv_len and a workspace tensor of at least the
    bytes the InvalidArgumentError for a missing one names. InvalidArgumentError names the tensor and
    the mismatch.
    stream (CUDA): the cudaStream_t, an int, the kernel is enqueued on and the tensors are exported
    through DLPack for (0: the legacy default stream); None: torch's current stream of the tensor's
    device for a torch tensor, the legacy default stream otherwise. InvalidArgumentError for a
    negative or non-int stream, and for any stream with host tensors.
    CUDA tensors: UnimplementedError in a build without CUDA; FailedPreconditionError where no CUDA
    device or driver takes the launch (retrying cannot help)."""


class SequenceSnapshot:
    """One live sequence of a rollout worker (keywords too)."""
    id: int
    tokens: int
    pages: int
    expected_remaining_tokens: Optional[int]

    def __init__(self, *, id: int = 0, tokens: int = 0, pages: int = 0,
                 expected_remaining_tokens: Optional[int] = None) -> None: ...


class WorkerSnapshot:
    """One rollout worker as the policy sees it (keywords too). `sequences` is a list read and
    assigned whole: appending to the list it returns changes a copy."""
    id: int
    version: int
    sequences: list[SequenceSnapshot]
    pages_total: int
    pages_used: int
    slots_total: int
    slots_used: int
    step_time: float
    waiting_prompts: int
    kv_stopped_growing: bool

    def __init__(self, *, id: int = 0, version: int = 0, sequences: Sequence[SequenceSnapshot] = (),
                 pages_total: int = 0, pages_used: int = 0, slots_total: int = 0, slots_used: int = 0,
                 step_time: Seconds = 0, waiting_prompts: int = 0, kv_stopped_growing: bool = False) -> None: ...


class FleetSnapshot:
    """Every rollout worker (keywords too)."""
    tokens_per_page: int
    workers: list[WorkerSnapshot]
    prompts_waiting: Optional[int]

    def __init__(self, *, tokens_per_page: int = 0, workers: Sequence[WorkerSnapshot] = (),
                 prompts_waiting: Optional[int] = None) -> None: ...


class RepackStrategy(enum.IntEnum):
    """Which rule plans the moves."""
    PAPER_BEST_FIT = 0
    COST_AWARE = 1


class RepackPolicyOptions:
    """Options of plan_repack (keywords too); see repack_policy.h."""
    strategy: RepackStrategy
    growth_horizon_steps: int
    page_bytes: int
    link_bytes_per_s: float
    move_overhead: float
    step_seconds_per_token: Optional[float]
    max_tail_growth: float
    min_gain: float
    default_remaining_ratio: float
    max_step_slowdown: float
    only_for_waiting_prompts: bool

    def __init__(self, *, strategy: RepackStrategy = ..., growth_horizon_steps: int = ..., page_bytes: int = ...,
                 link_bytes_per_s: float = ..., move_overhead: Seconds = ...,
                 step_seconds_per_token: Optional[float] = ..., max_tail_growth: float = ...,
                 min_gain: Seconds = ..., default_remaining_ratio: float = ..., max_step_slowdown: float = ...,
                 only_for_waiting_prompts: bool = ...) -> None: ...


class Move:
    """One sequence to migrate."""
    @property
    def sequence(self) -> int: ...
    @property
    def from_worker(self) -> int:
        """The source worker."""
    @property
    def to_worker(self) -> int:
        """The destination worker."""
    @property
    def pages(self) -> int:
        """Pages the migrator copies."""


class FreedWorker:
    """A worker the plan empties, so it can pull the newest version."""
    @property
    def worker(self) -> int: ...
    @property
    def busy_left(self) -> float:
        """Seconds it was expected to stay busy without the plan."""
    @property
    def move_time(self) -> float:
        """Seconds of sending its pages, plus move_overhead per sequence."""
    @property
    def gain(self) -> float:
        """Seconds gained."""


class MigrationPlan:
    """What plan_repack decided."""
    @property
    def moves(self) -> list[Move]: ...
    @property
    def freed(self) -> list[FreedWorker]: ...
    @property
    def pages_moved(self) -> int: ...
    @property
    def gain(self) -> float:
        """Seconds: the sum of the freed workers' gains."""
    @property
    def tail_growth(self) -> float: ...


def plan_repack(fleet: FleetSnapshot, newest: int, options: Optional[RepackPolicyOptions] = None) -> MigrationPlan:
    """Which live sequences move where so that whole workers of older versions empty out and can
    pull `newest`. A pure function: never mixes versions, never overfills a worker, never moves a
    sequence twice, never moves onto a worker it empties. InvalidArgumentError names the worker,
    sequence or option that is wrong."""


class RepackCoordinatorOptions:
    """Options of a RepackCoordinator (keywords too)."""
    tokens_per_page: int
    min_plan_interval: float
    stale_after: float
    max_workers: int
    send_timeout: float
    policy: RepackPolicyOptions
    clock: Optional[Clock]

    def __init__(self, *, tokens_per_page: int = 0, min_plan_interval: Seconds = 0.01, stale_after: Seconds = 15.0,
                 max_workers: int = 1024, send_timeout: Seconds = 1.0, policy: RepackPolicyOptions = ...,
                 clock: Optional[Clock] = None) -> None: ...


class RepackCoordinator:
    """Plans repacks for the fleet: takes every RepackDriver's reports on its transport, plans on
    events (a changed report, a newer version, a new count of waiting prompts), never on a timer,
    and sends each source its moves. Its thread runs no Python."""

    def __init__(self, transport: Transport, options: Optional[RepackCoordinatorOptions] = None) -> None:
        """InvalidArgumentError for bad options (tokens_per_page must be set); AlreadyExistsError
        when another coordinator serves the transport."""
    def set_newest_version(self, version: int) -> None:
        """The newest version the relays publish; a newer one plans at once. InvalidArgumentError
        for an older one."""
    def newest_version(self) -> int: ...
    def set_prompts_waiting(self, n: int) -> None:
        """How many prompts wait for a worker, none holding them yet (the scheduler's queue, one
        per batch slot); every later plan reads the newest count. Under the cost-aware policy with
        only_for_waiting_prompts (the defaults), plans then free workers only while the prompts
        outnumber the newest version's free slots; never set, the count is not known and that
        rule stays off. Plans nothing at once. InvalidArgumentError outside [0, 2**40]."""
    def prompts_waiting(self) -> Optional[int]:
        """The newest count set_prompts_waiting gave, or None before the first."""
    def stats(self) -> dict:
        """Reports, plans, moves, freed workers and orders, as a dict."""
    def background_error(self) -> Optional[Error]:
        """The first plan plan_repack refused (an Error, not raised), or None."""


class RepackDriverOptions:
    """Options of a RepackDriver (keywords too)."""
    worker: int
    coordinator: str
    min_report_interval: float
    keepalive_interval: float
    connect_timeout: float
    retry_interval: float
    send_timeout: float
    clock: Optional[Clock]

    def __init__(self, *, worker: int = 0, coordinator: str = "", min_report_interval: Seconds = 0.1,
                 keepalive_interval: Seconds = 5.0,
                 connect_timeout: Seconds = 5.0, retry_interval: Seconds = 1.0, send_timeout: Seconds = 1.0,
                 clock: Optional[Clock] = None) -> None: ...


class RepackDriver:
    """The worker side of repacking, wrapping its KvMigrator: call step(snapshot) between decode
    steps. It starts the moves the coordinator ordered, reports the snapshot when it changes
    (its own thread sends, running no Python) and returns the migrator's events, to handle as
    KvMigrator.poll's."""

    def __init__(self, transport: Transport, migrator: KvMigrator, options: RepackDriverOptions) -> None:
        """InvalidArgumentError for bad options (an empty coordinator address, ...)."""
    def step(self, snapshot: WorkerSnapshot) -> list[MigrationEvent]:
        """Starts ordered migrations, reports when due, returns the migrator's events.
        InvalidArgumentError for a snapshot of another worker; FailedPreconditionError for a version
        other than the migrator's."""
    def stats(self) -> dict:
        """Reports, orders and migrations started or refused, as a dict."""


class AdmissionKind(enum.IntEnum):
    """Which admission rule."""
    SYNC = 0
    ONE_STEP_AHEAD = 1
    STREAM = 2
    INTERRUPTIBLE = 3


class AdmissionRule:
    """Which groups exist and which workers may take them; make one with sync(), one_step_ahead(),
    stream(max_staleness, max_in_flight) or interruptible(max_staleness, max_in_flight)."""
    kind: AdmissionKind
    max_staleness: int
    max_in_flight: int

    @staticmethod
    def sync() -> AdmissionRule: ...
    @staticmethod
    def one_step_ahead() -> AdmissionRule: ...
    @staticmethod
    def stream(max_staleness: int, max_in_flight: int) -> AdmissionRule: ...
    @staticmethod
    def interruptible(max_staleness: int, max_in_flight: int) -> AdmissionRule: ...
    def __eq__(self, other: object) -> bool: ...


class RolloutDispatcherOptions:
    """Options of a RolloutDispatcher (keywords too)."""
    rule: AdmissionRule
    clock: Optional[Clock]
    group_size: int
    seed: int
    first_prompt: int
    lease: float
    max_wait: float
    max_workers: int
    max_held: int
    max_open_groups: int

    def __init__(self, *, rule: AdmissionRule = ..., clock: Optional[Clock] = None, group_size: int = 0,
                 seed: int = 0, first_prompt: int = 0, lease: Seconds = 10.0, max_wait: Seconds = 5.0,
                 max_workers: int = 64, max_held: int = 1024, max_open_groups: int = 65536) -> None: ...


class Completion:
    """What RolloutDispatcher.completed found."""
    prompt_index: int
    duplicate: bool
    group_done: bool


class RolloutDispatcher:
    """The actor's side of rollout dispatch, on its (listening) transport: makes groups of samples
    under the admission rule, hands them to the workers' DispatchClients, and completes each
    exactly once. Its thread runs no Python."""

    def __init__(self, transport: Transport, options: RolloutDispatcherOptions) -> None:
        """InvalidArgumentError for bad options (group_size must be set); AlreadyExistsError when
        another dispatcher serves the transport."""
    def set_rule(self, rule: AdmissionRule) -> None:
        """Changes the rule. InvalidArgumentError for a stream whose max_in_flight is below a group."""
    def publish(self, version: int) -> None:
        """The newest published version. InvalidArgumentError for an older one."""
    def open(self, groups: int, version_min: Optional[int] = None, version_max: Optional[int] = None) -> int:
        """Makes `groups` groups, for the rule's window (sync, one step ahead) or for [version_min,
        version_max]; returns the first one's prompt index. FailedPreconditionError under a stream
        rule without versions; ResourceExhaustedError past max_open_groups."""
    def completed(self, id: int) -> Completion:
        """The trajectory reached the trainer's queue. NotFoundError for an id of no group made."""
    def wait_done(self, groups: int, timeout: Seconds = None) -> None:
        """Blocks until `groups` groups are done in all. DeadlineExceededError after `timeout`
        seconds."""
    def stats(self) -> dict:
        """Requests, groups, samples handed out, reissued and completed, workers, as a dict."""
    def background_error(self) -> Optional[Error]:
        """The first answer that could not be sent (an Error, not raised), or None."""


class GrantKind(enum.IntEnum):
    """What a Grant says."""
    WORK = 0
    PULL_NEWER = 1
    NOTHING = 2


class Sample:
    """One sample of one group."""
    id: int
    prompt_index: int
    sample_index: int
    seed: int
    payload: bytes


class Grant:
    """The dispatcher's answer to a request."""
    kind: GrantKind
    pull_version: int
    samples: list[Sample]
    drop: list[int]
    newest: int
    interrupt: bool


class DispatchClientOptions:
    """Options of a DispatchClient (keywords too)."""
    worker: int
    server: str
    connect_timeout: float
    retry_interval: float
    request_timeout: float

    def __init__(self, *, worker: int = 0, server: str = "", connect_timeout: Seconds = 10.0,
                 retry_interval: Seconds = 0.1, request_timeout: Seconds = 5.0) -> None: ...


class DispatchClient:
    """A rollout worker's side of dispatch: asks the dispatcher for samples, saying which it decodes
    now."""

    def __init__(self, transport: Transport, options: DispatchClientOptions) -> None:
        """Connects, retrying until connect_timeout. InvalidArgumentError for bad options."""
    def request(self, version: int, free_slots: int, held: Sequence[int] = ..., wait: Seconds = 0.0,
                idle_pull: bool = False, returned: Sequence[int] = ...) -> Grant:
        """Asks for up to `free_slots` samples for weights `version`, listing the ids it decodes now
        (`held`) and those granted that it gives back unstarted (`returned`, handed out again at
        once); the dispatcher may hold the request `wait` seconds while it has nothing for it.
        Returns the Grant."""
    def close(self) -> None:
        """Closes the connection: the dispatcher hands this worker's samples out again."""
