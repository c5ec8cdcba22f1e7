"""Every hivemind 1.1.12 internal that the engine boundary relies on: the methods it overrides or calls (with the
signature it was written against), the instance attributes it reads or writes, and module constants.

`check()` returns what moved (empty when the pinned engine matches); tests/test_engine_boundary.py fails naming each
item, so that bumping the engine shows at once which part of trahiv/engine/ to re-read. Regenerate a signature only
after re-reading the code that depends on it.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, NamedTuple

__all__ = ["INTERNALS", "Internal", "check"]


class Internal(NamedTuple):
    owner: str  # "module:Class" or "module"
    name: str
    kind: str  # "method" (signature compared), "attribute" (exists), "instance" (assigned in the class's code), ...
    signature: str | None = None


INTERNALS: tuple[Internal, ...] = (
    Internal(
        "hivemind.averaging.averager:DecentralizedAverager",
        "run_in_background",
        "method",
        "(self, await_ready: 'bool' = True, timeout: 'Optional[float]' = None) -> 'None'",
    ),
    Internal(
        "hivemind.averaging.averager:DecentralizedAverager",
        "_step",
        "method",
        "(self, *, step: 'StepControl', future_for_init: 'MPFuture')",
    ),
    Internal(
        "hivemind.averaging.averager:DecentralizedAverager",
        "_run_allreduce_inplace_",
        "method",
        "(self, tensors: 'Sequence[torch.Tensor]', group_info: 'GroupInfo', group_id: 'Optional[bytes]' = None, **kwargs)",
    ),
    Internal(
        "hivemind.averaging.averager:DecentralizedAverager",
        "_get_handle_name",
        "method",
        "(cls, namespace: Optional[str], method_name: str) -> str",
    ),
    Internal(
        "hivemind.averaging.averager:DecentralizedAverager",
        "_load_state_from_peers",
        "method",
        "(self, future: 'MPFuture', timeout: 'Optional[float]' = None)",
    ),
    Internal(
        "hivemind.averaging.averager:DecentralizedAverager",
        "set_group_bits",
        "method",
        "(self, group_bits: 'str', wait: 'bool' = True)",
    ),
    Internal(
        "hivemind.averaging.averager:DecentralizedAverager",
        "get_current_state",
        "method",
        "(self) -> 'Tuple[Any, Sequence[torch.Tensor], Sequence[CompressionInfo]]'",
    ),
    Internal(
        "hivemind.averaging.averager:DecentralizedAverager", "_get_current_state_from_host_process", "method", "(self)"
    ),
    Internal(
        "hivemind.averaging.averager:DecentralizedAverager",
        "rpc_join_group",
        "method",
        "(self, request: 'averaging_pb2.JoinRequest', context: 'P2PContext') -> 'AsyncIterator[averaging_pb2.MessageFromLeader]'",
    ),
    Internal(
        "hivemind.averaging.averager:DecentralizedAverager",
        "rpc_aggregate_part",
        "method",
        "(self, stream: 'AsyncIterator[averaging_pb2.AveragingData]', context: 'P2PContext') -> 'AsyncIterator[averaging_pb2.AveragingData]'",
    ),
    Internal(
        "hivemind.averaging.averager:DecentralizedAverager",
        "rpc_download_state",
        "method",
        "(self, _request: 'averaging_pb2.DownloadRequest', _context: 'P2PContext') -> 'AsyncIterator[averaging_pb2.DownloadData]'",
    ),
    Internal(
        "hivemind.averaging.averager:DecentralizedAverager",
        "load_state_from_peers",
        "method",
        "(self, wait: 'bool' = True, timeout: 'Optional[float]' = None) -> 'Optional[Tuple[Any, Sequence[torch.Tensor]]]'",
    ),
    Internal(
        "hivemind.averaging.averager:DecentralizedAverager", "get_group_bits", "method", "(self, wait: 'bool' = True)"
    ),
    Internal(
        "hivemind.averaging.averager:DecentralizedAverager",
        "_set_group_bits",
        "method",
        "(self, group_bits: 'str', future: 'MPFuture')",
    ),
    Internal(
        "hivemind.averaging.averager:DecentralizedAverager",
        "get_stub",
        "method",
        "(cls, p2p: hivemind.p2p.p2p_daemon.P2P, peer: hivemind.p2p.p2p_daemon_bindings.datastructures.PeerID, *, namespace: Optional[str] = None) -> hivemind.p2p.servicer.StubBase",
    ),
    Internal("hivemind.averaging.averager:DecentralizedAverager", "state_sharing_priority", "attribute", None),
    Internal("hivemind.averaging.averager:DecentralizedAverager", "allow_state_sharing", "attribute", None),
    Internal("hivemind.averaging.averager:DecentralizedAverager", "_outer_pipe", "instance", None),
    # trahiv.engine.averagers.VersionedSchema: the hash hivemind assigns in __init__ and hands to its Matchmaking
    Internal("hivemind.averaging.averager:DecentralizedAverager", "schema_hash", "instance", None),
    Internal("hivemind.averaging.averager:DecentralizedAverager", "_running_groups", "instance", None),
    Internal("hivemind.averaging.averager:DecentralizedAverager", "_matchmaking", "instance", None),
    Internal("hivemind.averaging.averager:DecentralizedAverager", "_p2p", "instance", None),
    Internal("hivemind.averaging.averager:DecentralizedAverager", "_averaging_alpha", "instance", None),
    Internal("hivemind.averaging.averager:DecentralizedAverager", "serializer", "class", None),
    Internal("hivemind.averaging.averager:DecentralizedAverager", "last_updated", "instance", None),
    Internal(
        "hivemind.averaging.allreduce:AllReduceRunner",
        "__init__",
        "method",
        "(self, *, p2p: hivemind.p2p.p2p_daemon.P2P, servicer_type: Type[hivemind.p2p.servicer.ServicerBase], prefix: Optional[str], group_id: bytes, tensors: Sequence[torch.Tensor], weight: Optional[float] = None, ordered_peer_ids: Sequence[hivemind.p2p.p2p_daemon_bindings.datastructures.PeerID], peer_fractions: Tuple[float, ...], modes: Optional[Sequence[hivemind.averaging.allreduce.AveragingMode]] = None, sender_timeout: Optional[float] = None, reducer_timeout: Optional[float] = None, **kwargs)",
    ),
    Internal(
        "hivemind.averaging.allreduce:AllReduceRunner",
        "_communicate_with_peer",
        "method",
        "(self, peer_id: hivemind.p2p.p2p_daemon_bindings.datastructures.PeerID)",
    ),
    Internal(
        "hivemind.averaging.allreduce:AllReduceRunner",
        "_ban_sender",
        "method",
        "(self, peer_id: hivemind.p2p.p2p_daemon_bindings.datastructures.PeerID)",
    ),
    Internal(
        "hivemind.averaging.allreduce:AllReduceRunner",
        "_get_peer_stub",
        "method",
        "(self, peer: hivemind.p2p.p2p_daemon_bindings.datastructures.PeerID) -> hivemind.p2p.servicer.StubBase",
    ),
    Internal(
        "hivemind.averaging.allreduce:AllReduceRunner",
        "_generate_input_for_peer",
        "method",
        "(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]",
    ),
    Internal(
        "hivemind.averaging.allreduce:AllReduceRunner",
        "rpc_aggregate_part",
        "method",
        "(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: hivemind.p2p.p2p_daemon.P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]",
    ),
    Internal("hivemind.averaging.allreduce:AllReduceRunner", "__aiter__", "method", "(self)"),
    Internal(
        "hivemind.averaging.partition:TensorPartReducer",
        "__init__",
        "method",
        "(self, part_shapes: Sequence[torch.Size], num_senders: int)",
    ),
    Internal(
        "hivemind.averaging.partition:TensorPartReducer",
        "accumulate_part",
        "method",
        "(self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0) -> torch.Tensor",
    ),
    Internal("hivemind.averaging.partition:TensorPartReducer", "reset_accumulators", "method", "(self)"),
    Internal("hivemind.averaging.partition:TensorPartReducer", "check_current_part_finished", "method", "(self)"),
    Internal(
        "hivemind.optim.grad_averager:GradientAverager",
        "step",
        "method",
        "(self, weight: Optional[float] = None, reset_accumulators: bool = True, control: Optional[hivemind.averaging.control.StepControl] = None, timeout: Optional[float] = None, wait: bool = True, **kwargs)",
    ),
    Internal(
        "hivemind.optim.grad_averager:GradientAverager",
        "schedule_step",
        "method",
        "(self, scheduled_time: Optional[float] = None, **kwargs) -> hivemind.averaging.control.StepControl",
    ),
    Internal("hivemind.optim.grad_averager:GradientAverager", "load_accumulators_into_averager_", "method", "(self)"),
    Internal("hivemind.optim.grad_averager:GradientAverager", "reset_accumulated_grads_", "method", "(self)"),
    Internal("hivemind.optim.grad_averager:GradientAverager", "accumulate_grads_", "method", "(self, batch_size: int)"),
    Internal("hivemind.optim.grad_averager:GradientAverager", "local_times_accumulated", "instance", None),
    Internal(
        "hivemind.optim.grad_averager:GradientAverager",
        "_grad_accumulators",
        "method",
        "(self) -> Iterator[torch.Tensor]",
    ),
    Internal(
        "hivemind.optim.grad_averager:GradientAverager",
        "_grads_from_parameters",
        "method",
        "(self) -> Iterator[torch.Tensor]",
    ),
    Internal("hivemind.optim.grad_averager:GradientAverager", "_local_accumulators", "instance", None),
    Internal("hivemind.optim.grad_averager:GradientAverager", "_anchor_batch_size", "instance", None),
    Internal("hivemind.optim.grad_averager:GradientAverager", "_accumulators_used_in_step", "instance", None),
    Internal("hivemind.optim.grad_averager:GradientAverager", "reuse_grad_buffers", "instance", None),
    Internal("hivemind.optim.grad_averager:GradientAverager", "local_samples_accumulated", "instance", None),
    Internal(
        "hivemind.optim.state_averager:TrainingStateAverager",
        "step",
        "method",
        "(self, wait_for_delayed_updates: bool = None, apply_delayed_updates: bool = True, increment_epoch: bool = False, optimizer_step: bool = False, zero_grad: bool = False, delay_optimizer_step: bool = False, averaging_round: bool = False, delay_averaging: Optional[bool] = None, averaging_control: Optional[hivemind.averaging.control.StepControl] = None, wait_for_trigger: Optional[Callable[[], Any]] = None, grad_scaler: Optional[hivemind.optim.grad_scaler.GradScaler] = None, set_to_none: bool = True, averaging_opts: Optional[Dict[str, Any]] = None)",
    ),
    Internal("hivemind.optim.state_averager:TrainingStateAverager", "_update_scheduler", "method", "(self)"),
    Internal("hivemind.optim.state_averager:TrainingStateAverager", "_apply_optimizer_parameters_", "method", "(self)"),
    Internal(
        "hivemind.optim.state_averager:TrainingStateAverager", "_load_local_tensors_into_averager_", "method", "(self)"
    ),
    Internal("hivemind.optim.state_averager:TrainingStateAverager", "get_current_state", "method", "(self)"),
    Internal("hivemind.optim.state_averager:TrainingStateAverager", "lock_optimizer", "instance", None),
    Internal(
        "hivemind.optim.state_averager:TrainingStateAverager",
        "schedule_step",
        "method",
        "(self, scheduled_time: Optional[float] = None, **kwargs) -> hivemind.averaging.control.StepControl",
    ),
    Internal("hivemind.optim.state_averager:TrainingStateAverager", "local_epoch", "instance", None),
    Internal("hivemind.optim.state_averager:TrainingStateAverager", "pending_updates", "instance", None),
    Internal("hivemind.optim.state_averager:TrainingStateAverager", "finished_optimizer_step", "instance", None),
    Internal("hivemind.optim.state_averager:TrainingStateAverager", "finished_averaging_round", "instance", None),
    Internal("hivemind.optim.state_averager:TrainingStateAverager", "lock_averaged_tensors", "instance", None),
    Internal("hivemind.optim.state_averager:TrainingStateAverager", "extra_tensors", "instance", None),
    Internal("hivemind.optim.state_averager:TrainingStateAverager", "main_parameters", "instance", None),
    Internal("hivemind.optim.state_averager:TrainingStateAverager", "reuse_tensors", "instance", None),
    Internal("hivemind.optim.state_averager:TrainingStateAverager", "offload_optimizer", "instance", None),
    Internal(
        "hivemind.optim.power_sgd_averager:PowerSGDGradientAverager",
        "__init__",
        "method",
        "(self, parameters: Iterable[torch.nn.parameter.Parameter], averager_rank: int, *, dht: hivemind.dht.dht.DHT, prefix: str, reuse_grad_buffers: bool = False, accumulate_grads_on: Optional[torch.device] = None, client_mode: bool = None, warn: bool = True, min_compression_ratio: float = 0.5, averaged_grads: Optional[Sequence[torch.Tensor]] = None, **kwargs)",
    ),
    Internal(
        "hivemind.optim.power_sgd_averager:PowerSGDGradientAverager",
        "_run_allreduce_inplace_",
        "method",
        "(self, tensors: 'Sequence[torch.Tensor]', group_info: 'GroupInfo', group_id: 'Optional[bytes]' = None, **kwargs)",
    ),
    Internal(
        "hivemind.optim.power_sgd_averager:PowerSGDGradientAverager",
        "_get_handle_name",
        "method",
        "(cls, namespace: Optional[str], method_name: str) -> str",
    ),
    Internal(
        "hivemind.optim.optimizer:Optimizer",
        "__init__",
        "method",
        "(self, *, dht: 'DHT', run_id: 'str', target_batch_size: 'int', batch_size_per_step: 'Optional[int]' = None, optimizer: 'Union[TorchOptimizer, OptimizerFactory]', params: 'Optional[Union[Parameters, ParamGroups]]' = None, scheduler: 'Optional[Union[LRSchedulerBase, SchedulerFactory]]' = None, matchmaking_time: 'Optional[float]' = 15.0, averaging_timeout: 'Optional[float]' = 60.0, allreduce_timeout: 'Optional[float]' = None, next_chunk_timeout: 'Optional[float]' = None, load_state_timeout: 'float' = 600.0, reuse_grad_buffers: 'bool' = False, offload_optimizer: 'Optional[bool]' = None, delay_optimizer_step: 'Optional[bool]' = None, delay_grad_averaging: 'bool' = False, delay_state_averaging: 'bool' = True, average_state_every: 'int' = 1, use_local_updates: 'bool' = False, client_mode: 'bool' = None, auxiliary: 'bool' = False, grad_compression: 'CompressionBase' = hivemind.NoCompression(), grad_averager_factory: 'Optional[GradientAveragerFactory]' = None, state_averaging_compression: 'CompressionBase' = hivemind.NoCompression(), load_state_compression: 'CompressionBase' = hivemind.NoCompression(), average_opt_statistics: 'Sequence[str]' = (), extra_tensors: 'Sequence[torch.Tensor]' = (), averager_opts: 'Optional[dict]' = None, tracker_opts: 'Optional[dict]' = None, performance_ema_alpha: 'float' = 0.1, shutdown_timeout: 'float' = 5, verbose: 'bool' = False)",
    ),
    Internal(
        "hivemind.optim.optimizer:Optimizer",
        "step",
        "method",
        "(self, closure: 'Optional[Callable[[], torch.Tensor]]' = None, batch_size: 'Optional[int]' = None, grad_scaler: 'Optional[GradScaler]' = None)",
    ),
    Internal(
        "hivemind.optim.optimizer:Optimizer",
        "_update_global_epoch",
        "method",
        "(self, grad_scaler: 'Optional[GradScaler]') -> 'None'",
    ),
    Internal("hivemind.optim.optimizer:Optimizer", "_should_load_state_from_peers", "method", "(self) -> 'bool'"),
    Internal("hivemind.optim.optimizer:Optimizer", "_maybe_schedule_gradient_averaging", "method", "(self) -> 'None'"),
    Internal("hivemind.optim.optimizer:Optimizer", "_maybe_schedule_state_averaging", "method", "(self) -> 'None'"),
    Internal(
        "hivemind.optim.optimizer:Optimizer",
        "_make_state_averager",
        "method",
        "(self, **kwargs) -> 'TrainingStateAverager'",
    ),
    Internal(
        "hivemind.optim.optimizer:Optimizer",
        "_make_progress_tracker",
        "method",
        "(self, target_batch_size: 'int', **kwargs) -> 'ProgressTracker'",
    ),
    Internal(
        "hivemind.optim.optimizer:Optimizer",
        "_check_and_accumulate_gradients",
        "method",
        "(self, batch_size: 'int', grad_scaler: 'Optional[GradScaler]') -> 'bool'",
    ),
    Internal("hivemind.optim.optimizer:Optimizer", "load_state_from_peers", "method", "(self, **kwargs)"),
    Internal("hivemind.optim.optimizer:Optimizer", "shutdown", "method", "(self)"),
    Internal("hivemind.optim.optimizer:Optimizer", "scheduled_grads", "instance", None),
    Internal(
        "hivemind.optim.optimizer:Optimizer",
        "_tag_along_with_zero_weight",
        "method",
        "(self, control: 'StepControl')",
    ),
    Internal("hivemind.optim.optimizer:Optimizer", "load_state_timeout", "instance", None),
    Internal("hivemind.optim.optimizer:Optimizer", "status_loglevel", "instance", None),
    Internal("hivemind.optim.optimizer:Optimizer", "client_mode", "instance", None),
    Internal("hivemind.optim.optimizer:Optimizer", "use_gradient_averaging", "attribute", None),
    Internal("hivemind.optim.optimizer:Optimizer", "scheduled_state", "instance", None),
    Internal("hivemind.optim.optimizer:Optimizer", "grad_averager", "instance", None),
    Internal("hivemind.optim.optimizer:Optimizer", "delay_optimizer_step", "instance", None),
    Internal("hivemind.optim.optimizer:Optimizer", "_should_check_synchronization_on_update", "instance", None),
    Internal(
        "hivemind.optim.progress_tracker:ProgressTracker",
        "_parse_swarm_progress_data",
        "method",
        "(self, metadata: hivemind.optim.progress_tracker.TrainingProgressSchema) -> hivemind.optim.progress_tracker.GlobalTrainingProgress",
    ),
    Internal(
        "hivemind.optim.progress_tracker:ProgressTracker",
        "report_local_progress",
        "method",
        "(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True)",
    ),
    Internal(
        "hivemind.optim.progress_tracker:ProgressTracker",
        "update_epoch",
        "method",
        "(self, new_epoch: Optional[int] = None) -> int",
    ),
    Internal("hivemind.optim.progress_tracker:ProgressTracker", "pause_updates", "method", "(self)"),
    Internal(
        "hivemind.optim.progress_tracker:ProgressTracker",
        "_get_local_progress",
        "method",
        "(self, local_epoch: int, samples_accumulated: int)",
    ),
    Internal("hivemind.optim.progress_tracker:ProgressTracker", "local_progress", "instance", None),
    Internal("hivemind.optim.progress_tracker:ProgressTracker", "_local_public_key", "instance", None),
    Internal("hivemind.optim.progress_tracker:ProgressTracker", "training_progress_key", "instance", None),
    Internal("hivemind.optim.progress_tracker:ProgressTracker", "metadata_expiration", "instance", None),
    Internal("hivemind.optim.progress_tracker:ProgressTracker", "shutdown_triggered", "instance", None),
    Internal("hivemind.optim.progress_tracker:ProgressTracker", "should_report_progress", "instance", None),
    Internal("hivemind.optim.progress_tracker:ProgressTracker", "global_state_updated", "instance", None),
    Internal("hivemind.optim.progress_tracker:ProgressTracker", "shutdown_complete", "instance", None),
    Internal("hivemind.optim.progress_tracker:ProgressTracker", "fetched_global_progress_this_epoch", "instance", None),
    Internal("hivemind.optim.progress_tracker:ProgressTracker", "lock_global_progress", "instance", None),
    Internal("hivemind.optim.progress_tracker:ProgressTracker", "global_progress", "instance", None),
    Internal("hivemind.optim.progress_tracker:ProgressTracker", "performance_ema", "instance", None),
    Internal("hivemind.averaging.control:StepControl", "stage", "attribute", None),
    Internal("hivemind.averaging.control:StepControl", "triggered", "attribute", None),
    Internal("hivemind.averaging.control:StepControl", "weight", "attribute", None),
    Internal(
        "hivemind.compression.quantization:Quantization",
        "extract",
        "method",
        "(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor",
    ),
    Internal("hivemind.compression.quantization:Quantization", "codebook_dtype", "class", None),
    Internal("hivemind.compression.quantization:Quantization", "indices_dtype", "class", None),
    Internal(
        "hivemind.compression.quantization:BlockwiseQuantization",
        "extract",
        "method",
        "(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor",
    ),
    Internal("hivemind.compression.quantization", "_BLOCKWISE_QUANTIZATION_BLOCKSIZE", "module", None),
    Internal("hivemind.compression.serialization", "_BASE_COMPRESSION_TYPES", "module", None),
    Internal("hivemind.utils.multiaddr", "Multiaddr", "module", None),  # loaded from its files (engine/multiaddr.py)
    Internal("hivemind.dht.dht:DHT", "run", "method", "(self) -> 'None'"),
    Internal("hivemind.utils.crypto:RSAPrivateKey", "__setstate__", "method", "(self, state)"),
    Internal(
        "hivemind.averaging.key_manager:GroupKeyManager",
        "update_key_on_group_assembled",
        "method",
        "(self, group_info: hivemind.averaging.group_info.GroupInfo)",
    ),
    Internal("hivemind.averaging.key_manager:GroupKeyManager", "group_bits", "instance", None),
    Internal("hivemind.averaging.matchmaking:Matchmaking", "leader_assemble_group", "method", "(self) -> 'GroupInfo'"),
    Internal("hivemind.averaging.matchmaking:Matchmaking", "is_looking_for_group", "attribute", None),
    Internal("hivemind.averaging.matchmaking:Matchmaking", "lock_request_join_group", "instance", None),
    Internal("hivemind.averaging.matchmaking:Matchmaking", "assembled_group", "instance", None),
    Internal("hivemind.averaging.matchmaking:Matchmaking", "current_leader", "instance", None),
    Internal("hivemind.averaging.matchmaking:Matchmaking", "current_followers", "instance", None),
    Internal("hivemind.averaging.matchmaking:Matchmaking", "peer_id", "instance", None),
    Internal("hivemind.averaging.key_manager:GroupKeyManager", "target_group_size", "instance", None),
    # trahiv.engine.exact: the codec of a part, without encoding it
    Internal(
        "hivemind.compression.adaptive:AdaptiveCompressionBase",
        "choose_compression",
        "method",
        "(self, info: hivemind.compression.base.CompressionInfo) -> hivemind.compression.base.CompressionBase",
    ),
    # trahiv.engine.fixes, 7: matchmaking lookups of a group key are paced
    Internal(
        "hivemind.averaging.key_manager:GroupKeyManager",
        "get_averagers",
        "method",
        "(self, group_key: str, only_active: bool) -> List[Tuple[hivemind.p2p.p2p_daemon_bindings.datastructures.PeerID, float]]",
    ),
    # trahiv.engine.fixes, 10: a group that assembles as a member's search ends (a copy of look_for_group)
    Internal(
        "hivemind.averaging.matchmaking:Matchmaking",
        "look_for_group",
        "method",
        "(self, step: 'StepControl') -> 'Optional[GroupInfo]'",
    ),
    Internal(
        "hivemind.averaging.matchmaking:Matchmaking",
        "looking_for_group",
        "method",
        "(self, step_control: 'StepControl')",
    ),
    Internal(
        "hivemind.averaging.matchmaking:Matchmaking",
        "_request_join_potential_leaders",
        "method",
        "(self, step: 'StepControl') -> 'GroupInfo'",
    ),
    Internal("hivemind.averaging.matchmaking:Matchmaking", "follower_was_discarded", "instance", None),
    Internal("hivemind.averaging.matchmaking:Matchmaking", "was_accepted_to_group", "instance", None),
    # trahiv.engine.fixes, 11: a groupmate's parts for a group found but not begun wait for it
    Internal(
        "hivemind.averaging.averager:DecentralizedAverager",
        "_register_allreduce_group",
        "method",
        "(self, group_info: 'GroupInfo')",
    ),
    Internal("hivemind.averaging.control:StepControl", "deadline", "attribute", None),
    # trahiv.engine.fixes, 12: a member of a group this averager led, asking to join again, is sent the group
    Internal("hivemind.averaging.matchmaking:Matchmaking", "schema_hash", "instance", None),
    Internal("hivemind.averaging.matchmaking:Matchmaking", "group_key_manager", "instance", None),
    Internal("hivemind.averaging.key_manager:GroupKeyManager", "current_key", "attribute", None),
    Internal("hivemind.averaging.allreduce:AllReduceRunner", "sender_peer_ids", "instance", None),
    Internal("hivemind.averaging.allreduce:AllReduceRunner", "tensor_part_reducer", "instance", None),
    Internal("hivemind.averaging.partition:TensorPartReducer", "num_parts_received", "instance", None),
    Internal("hivemind.averaging.partition:TensorPartReducer", "sender_failed_after", "instance", None),
    # trahiv.engine.tell: a byte added to each StepControl's shared buffer, a handler on the gradient averagers
    Internal(
        "hivemind.averaging.control:StepControl",
        "__init__",
        "method",
        "(self, scheduled_time: float, deadline: float, allow_retries: bool, weight: float, data_for_gather: bytes)",
    ),
    Internal("hivemind.averaging.control:StepControl", "_shared_buffer", "instance", None),
    # trahiv.engine.fixes, 13: a cancelled step is marked cancelled before its averager is told
    Internal("hivemind.averaging.control:StepControl", "cancel", "method", "(self) -> bool"),
    Internal("hivemind.averaging.control:StepControl", "_trigger", "instance", None),
    Internal("hivemind.averaging.control:StepControl", "_cancel", "instance", None),
    # trahiv.engine.fixes, 6: a leader that answered a join request late is asked again
    Internal(
        "hivemind.averaging.matchmaking:Matchmaking",
        "_request_join_group",
        "method",
        "(self, leader: 'PeerID') -> 'Optional[GroupInfo]'",
    ),
    Internal("hivemind.averaging.matchmaking:Matchmaking", "request_timeout", "instance", None),
    Internal("hivemind.averaging.matchmaking:Matchmaking", "potential_leaders", "instance", None),
    Internal("hivemind.averaging.matchmaking:PotentialLeaders", "past_attempts", "instance", None),
    Internal("hivemind.averaging.matchmaking:PotentialLeaders", "leader_queue", "instance", None),
    # trahiv.engine.fixes, 12 and 15: a member sends a group it followed; a search asks the sender of an unknown group's part
    Internal("hivemind.averaging.matchmaking:PotentialLeaders", "pop_next_leader", "method", "(self) -> 'PeerID'"),
    Internal(
        "hivemind.averaging.matchmaking:Matchmaking",
        "follower_assemble_group",
        "method",
        "(self, leader: 'PeerID', msg: 'averaging_pb2.MessageFromLeader') -> 'GroupInfo'",
    ),
    Internal("hivemind.averaging.matchmaking:Matchmaking", "step_control", "instance", None),
    # trahiv.engine.dht_stats: the DHT's messages, counted in its clients and at its handlers' registration
    Internal(
        "hivemind.dht.protocol:DHTProtocol",
        "call_ping",
        "method",
        "(self, peer: 'PeerID', validate: 'bool' = False, strict: 'bool' = True) -> 'Optional[DHTID]'",
    ),
    Internal(
        "hivemind.dht.protocol:DHTProtocol",
        "call_store",
        "method",
        "(self, peer: 'PeerID', keys: 'Sequence[DHTID]', values: 'Sequence[Union[BinaryDHTValue, DictionaryDHTValue]]', expiration_time: 'Union[DHTExpiration, Sequence[DHTExpiration]]', subkeys: 'Optional[Union[Subkey, Sequence[Optional[Subkey]]]]' = None, in_cache: 'Optional[Union[bool, Sequence[bool]]]' = None) -> 'Optional[List[bool]]'",
    ),
    Internal(
        "hivemind.dht.protocol:DHTProtocol",
        "call_find",
        "method",
        "(self, peer: 'PeerID', keys: 'Collection[DHTID]') -> 'Optional[Dict[DHTID, Tuple[Optional[ValueWithExpiration[Union[BinaryDHTValue, DictionaryDHTValue]]], Dict[DHTID, PeerID]]]]'",
    ),
    Internal(
        "hivemind.dht.protocol:DHTProtocol",
        "rpc_ping",
        "method",
        "(self, request: 'dht_pb2.PingRequest', context: 'P2PContext') -> 'dht_pb2.PingResponse'",
    ),
    Internal(
        "hivemind.dht.protocol:DHTProtocol",
        "rpc_store",
        "method",
        "(self, request: 'dht_pb2.StoreRequest', context: 'P2PContext') -> 'dht_pb2.StoreResponse'",
    ),
    Internal(
        "hivemind.dht.protocol:DHTProtocol",
        "rpc_find",
        "method",
        "(self, request: 'dht_pb2.FindRequest', context: 'P2PContext') -> 'dht_pb2.FindResponse'",
    ),
    Internal(
        "hivemind.dht.protocol:DHTProtocol",
        "add_p2p_handlers",
        "method",
        "(self, p2p: hivemind.p2p.p2p_daemon.P2P, wrapper: Any = None, *, namespace: Optional[str] = None, balanced: bool = False) -> None",
    ),
    Internal("hivemind.dht.node:DHTNode", "protocol", "instance", None),
    Internal(
        "hivemind.dht.dht:DHT", "_get", "method", "(self, key: 'DHTKey', latest: 'bool', future: 'MPFuture', **kwargs)"
    ),
    Internal(
        "hivemind.dht.dht:DHT",
        "_store",
        "method",
        "(self, key: 'DHTKey', value: 'DHTValue', expiration_time: 'DHTExpiration', subkey: 'Optional[Subkey]', future: 'MPFuture', **kwargs)",
    ),
    # trahiv.engine.fixes, 16: a DHT node does not validate again a record it accepted
    Internal(
        "hivemind.dht.validation:CompositeValidator",
        "validate",
        "method",
        "(self, record: hivemind.dht.validation.DHTRecord) -> bool",
    ),
    Internal(
        "hivemind.dht.validation:CompositeValidator",
        "extend",
        "method",
        "(self, validators: Iterable[hivemind.dht.validation.RecordValidatorBase]) -> None",
    ),
    # fixes 8 and 9: the request pipes read in the engine processes, the process-wide locks their children share
    Internal("hivemind.dht.dht:DHT", "_inner_pipe", "instance", None),
    Internal("hivemind.averaging.averager:DecentralizedAverager", "_inner_pipe", "instance", None),
    Internal("hivemind.utils.mpfuture:MPFuture", "_update_lock", "attribute", None),
    Internal("hivemind.utils.mpfuture:MPFuture", "_initialization_lock", "attribute", None),
    Internal("hivemind.utils.mpfuture:SharedBytes", "_lock", "attribute", None),
    Internal("hivemind.utils.asyncio:_AsyncContextWrapper", "EXECUTOR_LOCK", "attribute", None),
    # trahiv.engine.ring: a ring round (its own run and streams, the container's parts, the gathered data's tag)
    Internal("hivemind.averaging.allreduce:AllReduceRunner", "run", "method", "(self) -> AsyncIterator[torch.Tensor]"),
    Internal(
        "hivemind.averaging.allreduce:AllReduceRunner",
        "_check_reasons_to_reject",
        "method",
        "(self, request: averaging_pb2.AveragingData, context: hivemind.p2p.p2p_daemon.P2PContext) -> Optional[averaging_pb2.AveragingData]",
    ),
    Internal(
        "hivemind.averaging.allreduce:AllReduceRunner",
        "finalize",
        "method",
        "(self, *, cancel: bool = False, exception: Optional[BaseException] = None)",
    ),
    Internal("hivemind.averaging.partition:TensorPartContainer", "_input_parts_by_peer", "instance", None),
    Internal("hivemind.averaging.partition:TensorPartContainer", "compression", "instance", None),
    Internal("hivemind.averaging.control:StepControl", "_data_for_gather", "instance", None),
)


def _resolve(owner: str) -> Any:
    module, _, qualname = owner.partition(":")
    obj: Any = importlib.import_module(module)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def _problem(item: Internal) -> str | None:
    try:
        obj = _resolve(item.owner)
    except (ImportError, AttributeError) as e:
        return f"{item.owner} is gone ({e})"
    where = f"{item.owner}.{item.name}"
    if item.kind == "instance":
        return None if f"self.{item.name}" in inspect.getsource(obj) else f"{where}: no longer assigned in its class"
    try:
        found = inspect.getattr_static(obj, item.name)
    except AttributeError:
        return f"{where} is gone"
    if item.kind != "method":
        return None
    signature = str(inspect.signature(getattr(found, "__func__", found)))
    return None if signature == item.signature else f"{where} changed: {item.signature} -> {signature}"


def check() -> list[str]:
    """What moved in the installed hivemind, one line per internal (empty: the engine is the one trahiv knows)."""
    return [problem for item in INTERNALS if (problem := _problem(item)) is not None]
