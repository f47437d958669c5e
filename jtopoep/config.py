"""Typed, validated configuration: frozen dataclasses loaded from YAML presets with dotted overrides.

A run file (configs/*.yaml) has the sections `topology`, `model`, `moe`, `train`, `data`. A section may
name a preset file with `preset: NAME` (configs/topologies/NAME.yaml, configs/models/NAME.yaml); the
other keys of the section override the preset's. Command-line overrides (`--set moe.planner=taot`) are
applied before presets are resolved. Unknown keys, wrong types, out-of-range values and inconsistent
combinations fail at load time with the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import types
import typing
from typing import Any

import yaml

from jtopoep.gemm import GEMMS
from jtopoep.planners import PLANNERS as PLANNER_CLASSES, PlannerBase, TaotPlanner
from jtopoep.topology import Topology

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"

PLANNERS = tuple(PLANNER_CLASSES)
TRANSPORTS = ("auto", "ragged", "dense")
OVERFLOW = ("drop", "error")
SCORE_FNS = ("softmax", "sigmoid")
REMAT = ("none", "attention", "full")
DTYPES = {"float32": 4, "bfloat16": 2}  # compute dtypes and their bytes per element
DATA_SOURCES = ("stdlib", "path", "synthetic")


class ConfigError(ValueError):
    """A configuration value that is unknown, mistyped, out of range or inconsistent."""


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {value!r} is not allowed: expected {allowed}")


def _positive(section: str, obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(value > 0, f"{section}.{name}", value, "a value > 0")


def _non_negative(section: str, obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(value >= 0, f"{section}.{name}", value, "a value >= 0")


def _choice(section: str, obj, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    _require(value in choices, f"{section}.{name}", value, f"one of {list(choices)}")


@dataclasses.dataclass(frozen=True)
class TopologyConfig:
    num_nodes: int  # scale-out domain size (e.g. InfiniBand nodes)
    gpus_per_node: int  # scale-up domain size (e.g. NVLink GPUs per node)
    intra_bw: float = 155e9  # bytes/s per GPU one way within a node
    inter_bw: float = 47e9  # bytes/s per GPU one way across nodes
    intra_latency: float = 3e-6  # seconds per message within a node
    inter_latency: float = 10e-6  # seconds per message across nodes
    flops: float = 989.5e12  # dense bf16 peak per GPU
    mfu: float = 0.6  # fraction of peak reached by grouped GEMMs
    data_parallel: int = 1  # replicas of the whole expert-parallel group (outer "data" mesh axis)

    def __post_init__(self):
        _positive("topology", self, "num_nodes", "gpus_per_node", "intra_bw", "inter_bw", "flops",
                  "data_parallel")
        _non_negative("topology", self, "intra_latency", "inter_latency")
        _require(0 < self.mfu <= 1, "topology.mfu", self.mfu, "a value in (0, 1]")

    @property
    def num_devices(self) -> int:
        return self.data_parallel * self.num_nodes * self.gpus_per_node

    def to_topology(self) -> Topology:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(Topology)}
        return Topology(**fields)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256  # byte-level by default
    seq_len: int = 64  # tokens per training sequence
    d_model: int = 64  # D
    num_layers: int = 2  # transformer blocks
    num_heads: int = 4  # attention heads; d_model / num_heads must be even (rotary embedding)
    num_experts: int = 16  # E, routed experts per MoE layer
    top_k: int = 2  # k
    expert_hidden: int = 64  # F, hidden width of one routed expert
    moe_every: int = 1  # every n-th layer is MoE (the others use a dense FFN)
    first_dense_layers: int = 0  # leading layers with a dense FFN (DeepSeek-style)
    dense_hidden: int = 128  # hidden width of dense FFN layers
    shared_experts: int = 0  # always-on experts, each of width expert_hidden
    rope_theta: float = 10000.0  # rotary embedding base
    # Compute dtype of activations, of the token exchange and of guest-weight transfers; parameters
    # and optimizer state stay float32. The cost model prices its bytes per element.
    dtype: str = "float32"
    # Run the MoE layers (each with the moe_every - 1 dense layers after it) with jax.lax.scan over
    # their stacked weights, so the step compiles one layer whatever the depth; false: a Python loop
    # over the same weights, one compiled copy per layer.
    scan_layers: bool = True
    # What the backward pass recomputes instead of keeping from the forward: "none" keeps every
    # activation; "attention" recomputes each block's attention (its [heads, L, L] scores are most of
    # a block's activations at long sequences; no communication is repeated); "full" keeps only the
    # input of each MoE layer (with the dense layers after it) and recomputes the rest, its planning
    # and token exchange included.
    remat: str = "none"

    def __post_init__(self):
        _positive("model", self, "vocab_size", "seq_len", "d_model", "num_layers", "num_heads",
                  "num_experts", "top_k", "expert_hidden", "moe_every", "dense_hidden", "rope_theta")
        _choice("model", self, "dtype", tuple(DTYPES))
        _choice("model", self, "remat", REMAT)
        _non_negative("model", self, "first_dense_layers", "shared_experts")
        _require(self.top_k <= self.num_experts, "model.top_k", self.top_k,
                 f"at most model.num_experts = {self.num_experts}")
        _require(self.d_model % self.num_heads == 0, "model.num_heads", self.num_heads,
                 f"a divisor of model.d_model = {self.d_model}")
        _require((self.d_model // self.num_heads) % 2 == 0, "model.num_heads", self.num_heads,
                 "a head width d_model / num_heads that is even (rotary embedding)")
        _require(self.first_dense_layers < self.num_layers, "model.first_dense_layers",
                 self.first_dense_layers, f"below model.num_layers = {self.num_layers} (at least one MoE layer)")
        _require((self.num_layers - self.first_dense_layers) % self.moe_every == 0, "model.num_layers",
                 self.num_layers, f"model.first_dense_layers = {self.first_dense_layers} plus a multiple of "
                 f"model.moe_every = {self.moe_every} (each MoE layer and the dense layers after it repeat whole)")

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_dense_layers and (layer - self.first_dense_layers) % self.moe_every == 0

    @property
    def element_bytes(self) -> int:
        """Bytes of one exchanged element (activation or expert weight) in the compute dtype."""
        return DTYPES[self.dtype]

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    planner: str = "topoep"  # one of PLANNERS
    guest_slots: int = 2  # K, guest expert slots per rank
    transport: str = "auto"  # "ragged" on GPU/TPU, "dense" emulation anywhere
    # Token dispatch in two stages: each token crosses once to every node it is routed to (to the GPU
    # with the sender's local index), which fans it out over NVLink; and the guest weights cross
    # nodes once per node. "auto": on when the topology has more than one node. false: every pair
    # straight to its rank.
    hierarchical: bool | str = "auto"
    # A copy must save >= min_gain x its weight-transfer time; 0 (the default, from the planner
    # benchmark's sweep) turns the test off: transfers mostly hide behind home GEMMs.
    min_gain: float = PlannerBase.min_gain
    # refuse copies exposing more transfer time than GEMM time they save
    price_transfers: bool = PlannerBase.price_transfers
    # Receive buffer of each rank (and of each relay of the hierarchical dispatch), in multiples of
    # its own pairs (T * k); the grouped GEMM runs over all of it. A plan that sends a rank more has
    # its last pairs cut (moe.on_overflow). 1.25 holds what topoep and taot plan on the real traces
    # (`python -m benchmarks.data_path` gives the factor each planner needs); `none` needs far more.
    # 0: room for every pair of every source (R x T x k rows), never cut: exact, and large.
    recv_capacity_factor: float = 1.25
    # Pairs that do not fit a receive buffer: "drop" them (Switch-style: the token keeps its residual;
    # counted per layer in metrics.jsonl, with a warning past train.overflow_warn_fraction of the
    # step's pairs), or stop training with an "error".
    on_overflow: str = "drop"
    # With train.microbatches > 1: a guest copy a rank already holds from the step's previous
    # micro-batch is kept, not fetched again (the weights have not changed). Saves forward weight
    # transfers and no maths (jtopoep.guests), and the planners price such a copy's gradients
    # only. Costs memory: every MoE layer's K guest copies stay live between
    # micro-batches.
    keep_copies: bool = True
    # Guest weights travel in this many slices of the expert hidden width, and the guest GEMM runs
    # slice by slice, so each slice's GEMM overlaps the next slice's transfer (jtopoep.guests); a
    # divisor of model.expert_hidden. The fetch's send buffers hold one slice of several whole experts;
    # each slice pays the fetch's exchange latencies again and runs narrower GEMMs. 0: by moe.gemm
    # (jtopoep.gemm.AUTO_WEIGHT_CHUNKS): 4 with tiled, whose loops write every slice into one buffer;
    # 2 with xla and pallas, which give each slice a buffer-sized output (benchmarks.memory).
    guest_weight_chunks: int = 0
    # The experts' grouped GEMM (jtopoep.gemm): "xla" (jax.lax.ragged_dot, as XLA lowers it for the
    # backend), "pallas" (megablox on TPU; JAX's Mosaic GPU ragged dot on Hopper GPUs, bfloat16 with
    # d_model and expert_hidden multiples of 128; megablox in interpret mode on CPU, for tests),
    # "tiled" (a loop over tiles of rows in plain XLA operations, any backend), "auto": pallas on
    # TPU, tiled on GPUs, xla on CPU.
    gemm: str = "auto"
    sinkhorn_epsilon: float = TaotPlanner.epsilon  # taot only: entropic regularisation, in link-cost units
    sinkhorn_iters: int = TaotPlanner.iterations  # taot only: fixed Sinkhorn iteration count
    score_fn: str = "softmax"  # router scores: softmax or sigmoid
    # Node-limited routing (DeepSeek-V3): each token's experts on at most this many nodes, chosen by
    # the sum of their best ceil(k / max_nodes) scores; 0: no limit. Fewer rows cross nodes with the
    # hierarchical dispatch.
    max_nodes: int = 0
    normalize_topk: bool = True  # renormalise the k selected weights to sum to 1
    aux_loss_coef: float = 0.01  # Switch-style load-balancing loss
    z_loss_coef: float = 0.001  # router z-loss
    bias_balancing: bool = False  # auxiliary-loss-free balancing (DeepSeek-V3) via a routing bias
    bias_update_rate: float = 0.001  # bias step per update, in logit units
    # Every this many steps, move the home experts (jtopoep.homes): a new placement from the layer's
    # averaged loads and co-activation, weights and optimizer moments migrated by all-to-all. 0: never.
    replace_every: int = 0
    # Decay per step of those averages (exponential moving averages kept in the model state).
    load_decay: float = 0.9

    def __post_init__(self):
        _choice("moe", self, "planner", PLANNERS)
        _choice("moe", self, "transport", TRANSPORTS)
        _choice("moe", self, "score_fn", SCORE_FNS)
        _choice("moe", self, "on_overflow", OVERFLOW)
        _choice("moe", self, "gemm", GEMMS)
        _require(self.hierarchical in (True, False, "auto"), "moe.hierarchical", self.hierarchical,
                 "true, false or 'auto' (on when the topology has more than one node)")
        _require(0 <= self.load_decay < 1, "moe.load_decay", self.load_decay, "a value in [0, 1)")
        _non_negative("moe", self, "replace_every", "guest_slots", "max_nodes", "min_gain", "aux_loss_coef", "z_loss_coef",
                      "bias_update_rate", "guest_weight_chunks")
        _positive("moe", self, "sinkhorn_epsilon", "sinkhorn_iters")
        _require(self.recv_capacity_factor == 0 or self.recv_capacity_factor >= 1, "moe.recv_capacity_factor",
                 self.recv_capacity_factor, "0 (room for every pair) or a value >= 1 (a rank's own pairs)")

    def uses_relays(self, topology: Topology) -> bool:
        """Whether the hierarchical dispatch is on for this topology (moe.hierarchical)."""
        return topology.num_nodes > 1 if self.hierarchical == "auto" else self.hierarchical

    @property
    def planned_guest_slots(self) -> int:
        """Guest slots the planner fills: none with planner 'none', which never copies an expert (so
        switching a run to 'none' needs no other change)."""
        return 0 if self.planner == "none" else self.guest_slots


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100  # optimizer steps of the run
    batch_size: int = 16  # global sequences per step, divided over all devices
    microbatches: int = 1  # the step's batch in this many micro-batches, gradients averaged
    learning_rate: float = 3e-3  # AdamW peak learning rate (linear warm-up, then cosine decay to a tenth)
    warmup_steps: int = 10  # linear warm-up steps; at train.steps or more, the run ends within the warm-up
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    grad_clip: float = 1.0  # global gradient-norm clip; 0 turns it off
    seed: int = 0  # parameters and batches are pure functions of it
    log_every: int = 10  # append a row to metrics.jsonl every this many steps (and at evaluations and the last step)
    eval_every: int = 50  # evaluate every this many steps, and at the last step; 0: never
    eval_batches: int = 2  # held-out batches per evaluation
    checkpoint_every: int = 50  # save a checkpoint every this many steps, and at the last step
    keep_checkpoints: int = 2  # checkpoints kept on disk (the newest)
    run_dir: str = "runs/tiny_cpu"  # checkpoints, metrics.jsonl, counts.npz, config.json and report.png
    # Warn when a step drops more than this share of an MoE layer's pairs (moe.on_overflow: drop).
    overflow_warn_fraction: float = 0.001

    def __post_init__(self):
        _positive("train", self, "steps", "batch_size", "microbatches", "learning_rate", "log_every",
                  "eval_batches", "checkpoint_every", "keep_checkpoints")
        _non_negative("train", self, "warmup_steps", "weight_decay", "grad_clip", "seed", "eval_every")
        _require(0 <= self.overflow_warn_fraction <= 1, "train.overflow_warn_fraction", self.overflow_warn_fraction,
                 "a value in [0, 1]")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"  # Python's standard-library sources, a directory of text, or synthetic
    path: str | None = None  # directory of text files, with source = "path"
    eval_fraction: float = 0.05  # share of files held out for evaluation

    def __post_init__(self):
        _choice("data", self, "source", DATA_SOURCES)
        _require(0 < self.eval_fraction < 1, "data.eval_fraction", self.eval_fraction, "a value in (0, 1)")
        _require((self.source == "path") == (self.path is not None), "data.path", self.path,
                 "a directory exactly when data.source = 'path'")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    topology: TopologyConfig
    model: ModelConfig = ModelConfig()
    moe: MoEConfig = MoEConfig()
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()

    def __post_init__(self):
        ranks = self.topology.num_nodes * self.topology.gpus_per_node
        _require(self.moe.guest_weight_chunks == 0 or self.model.expert_hidden % self.moe.guest_weight_chunks == 0,
                 "moe.guest_weight_chunks", self.moe.guest_weight_chunks,
                 f"0 (by moe.gemm) or a divisor of model.expert_hidden = {self.model.expert_hidden}")
        _require(self.model.num_experts % ranks == 0, "model.num_experts", self.model.num_experts,
                 f"a multiple of num_nodes * gpus_per_node = {ranks} expert-parallel ranks")
        nodes, max_nodes = self.topology.num_nodes, self.moe.max_nodes
        _require(max_nodes == 0 or max_nodes * (self.model.num_experts // nodes) >= self.model.top_k, "moe.max_nodes",
                 max_nodes, f"0 (no limit) or at least model.top_k / (experts per node) = "
                 f"{self.model.top_k} / {self.model.num_experts // nodes}")
        devices, micro = self.topology.num_devices, self.train.microbatches
        allowed = (f"a multiple of the {devices} devices of the mesh" if micro == 1 else
                   f"a multiple of train.microbatches x devices = {micro} x {devices}, so that every micro-batch "
                   f"has the same number of sequences on every device")
        _require(self.train.batch_size % (micro * devices) == 0, "train.batch_size", self.train.batch_size, allowed)

    def check_devices(self, num_devices: int) -> None:
        _require(self.topology.num_devices <= num_devices, "topology", self.topology.num_devices,
                 f"a mesh of at most the {num_devices} devices this process sees "
                 f"(data_parallel * num_nodes * gpus_per_node)")


_SECTIONS = {f.name: f.type for f in dataclasses.fields(RunConfig)}
_SECTION_CLASSES = {
    "topology": TopologyConfig, "model": ModelConfig, "moe": MoEConfig, "train": TrainConfig,
    "data": DataConfig,
}
_PRESET_DIRS = {"topology": "topologies", "model": "models"}


# PyYAML follows YAML 1.1, which reads `3e-4`, `1e3` and `155.0e9` (no dot or no exponent sign) as
# strings; a float key takes any decimal number, written as YAML 1.2 or Python would.
_DECIMAL = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _check_type(key: str, value: Any, annotation: Any) -> Any:
    """Return value converted to the annotated type, or raise naming the key."""
    hint = eval(annotation, vars(typing)) if isinstance(annotation, str) else annotation
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for option in options:
        if option is type(None) and value is None:
            return None
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is float and isinstance(value, str) and _DECIMAL.match(value.strip()):
            return float(value)
        if option is str and isinstance(value, str):
            return value
    names = " or ".join("null" if o is type(None) else o.__name__ for o in options)
    raise ConfigError(f"{key} = {value!r} has type {type(value).__name__}: expected {names}")


def section_from_dict(name: str, cls, raw: dict) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{name} = {raw!r} is not allowed: expected a mapping of keys")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key {name}.{unknown[0]}; allowed keys of {name}: {sorted(fields)}")
    values = {k: _check_type(f"{name}.{k}", v, fields[k].type) for k, v in raw.items()}
    try:
        return cls(**values)
    except TypeError as err:  # a required field is missing
        missing = [f for f, spec in fields.items() if f not in values
                   and spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING]
        raise ConfigError(f"{name} is missing required keys {missing}") from err


def _read_yaml(path: pathlib.Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise ConfigError(f"config file {path} is not valid YAML{at}: "
                          f"{getattr(err, 'problem', None) or err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return data


def _resolve_preset(section: str, raw: dict, config_dir: pathlib.Path) -> dict:
    if "preset" not in raw:
        return raw
    if section not in _PRESET_DIRS:
        raise ConfigError(f"{section}.preset is not allowed: only {sorted(_PRESET_DIRS)} have presets")
    name = raw["preset"]
    folder = config_dir / _PRESET_DIRS[section]
    known = sorted(p.stem for p in folder.glob("*.yaml"))
    if name not in known:
        raise ConfigError(f"{section}.preset = {name!r} is not allowed: expected one of {known}")
    base = _read_yaml(folder / f"{name}.yaml")
    return {**base, **{k: v for k, v in raw.items() if k != "preset"}}


def apply_override(raw: dict, assignment: str) -> None:
    """Apply one `section.key=value` override in place; the value is parsed as YAML."""
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} must look like section.key=value")
    dotted, text = assignment.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or parts[0] not in _SECTIONS:
        raise ConfigError(f"override key {dotted!r} must be section.key with section one of {list(_SECTIONS)}")
    section, key = parts
    raw.setdefault(section, {})
    if not isinstance(raw[section], dict):
        raise ConfigError(f"{section} = {raw[section]!r} is not allowed: expected a mapping of keys")
    try:
        raw[section][key] = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"override {assignment!r}: the value is not valid YAML "
                          f"({getattr(err, 'problem', None) or ' '.join(str(err).split())})") from err


def config_from_dict(raw: dict, config_dir: pathlib.Path = CONFIG_DIR) -> RunConfig:
    unknown = sorted(set(raw) - set(_SECTIONS))
    if unknown:
        raise ConfigError(f"unknown section {unknown[0]!r}; allowed sections: {list(_SECTIONS)}")
    if "topology" not in raw:
        raise ConfigError("section 'topology' is required (e.g. topology: {preset: cpu-2x4})")
    sections = {}
    for name, cls in _SECTION_CLASSES.items():
        if name in raw:
            section_raw = raw[name]
            if not isinstance(section_raw, dict):
                raise ConfigError(f"{name} = {section_raw!r} is not allowed: expected a mapping of keys")
            sections[name] = section_from_dict(name, cls, _resolve_preset(name, section_raw, config_dir))
    return RunConfig(**sections)


def load_config(path: str | pathlib.Path, overrides: list[str] = (), num_devices: int | None = None,
                config_dir: pathlib.Path = CONFIG_DIR) -> RunConfig:
    """Load a run config, apply `section.key=value` overrides, and validate everything.

    With `num_devices`, also checks that the mesh fits in that many devices.
    """
    raw = _read_yaml(pathlib.Path(path))
    for assignment in overrides:
        apply_override(raw, assignment)
    config = config_from_dict(raw, config_dir)
    if num_devices is not None:
        config.check_devices(num_devices)
    return config


def config_to_dict(config: RunConfig) -> dict:
    return dataclasses.asdict(config)
