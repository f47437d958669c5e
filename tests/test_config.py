import pathlib

import pytest
import yaml

from jtopoep.config import ConfigError, RunConfig, load_config

ROOT = pathlib.Path(__file__).resolve().parent.parent


def write(tmp_path, data) -> pathlib.Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


BASE = {"topology": {"preset": "cpu-2x4"}, "model": {"preset": "tiny"}, "moe": {"planner": "topoep"}}


def test_every_run_preset_loads():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        config = load_config(path)
        assert isinstance(config, RunConfig)


def test_every_model_preset_loads():
    from jtopoep.config import ModelConfig, section_from_dict
    for path in sorted((ROOT / "configs" / "models").glob("*.yaml")):
        model = section_from_dict("model", ModelConfig, yaml.safe_load(path.read_text()))
        assert model.top_k <= model.num_experts


def test_presets_and_overrides(tmp_path):
    config = load_config(write(tmp_path, BASE), ["moe.planner=taot", "moe.guest_slots=1", "model.top_k=4",
                                                 "topology.inter_bw=23.5e9"])
    assert config.moe.planner == "taot" and config.moe.guest_slots == 1
    assert config.model.top_k == 4 and config.model.d_model == 64
    assert config.topology.num_nodes == 2 and config.topology.inter_bw == 23.5e9
    assert config.topology.to_topology().link_cost()[0, 4] == pytest.approx(155e9 / 23.5e9)


@pytest.mark.parametrize("override,message", [
    ("moe.plannr=taot", r"unknown key moe\.plannr; allowed keys of moe: \[.*'planner'"),
    ("moe.planner=magic", r"moe\.planner = 'magic' is not allowed: expected one of \['none', 'eplb'"),
    ("moe.guest_slots=two", r"moe\.guest_slots = 'two' has type str: expected int"),
    ("moe.guest_slots=-1", r"moe\.guest_slots = -1 is not allowed: expected a value >= 0"),
    ("moe.hierarchical=3", r"moe\.hierarchical = 3 has type int: expected bool or str"),
    ("moe.hierarchical=always", r"moe\.hierarchical = 'always' is not allowed: expected true, false or 'auto'"),
    ("moe.max_nodes=-1", r"moe\.max_nodes = -1 is not allowed: expected a value >= 0"),
    ("moe.on_overflow=ignore", r"moe\.on_overflow = 'ignore' is not allowed: expected one of \['drop', 'error'\]"),
    ("moe.min_gain=-1.0", r"moe\.min_gain = -1\.0 is not allowed: expected a value >= 0"),
    ("moe.guest_weight_chunks=-1", r"moe\.guest_weight_chunks = -1 is not allowed: expected a value >= 0"),
    ("moe.guest_weight_chunks=5",
     r"moe\.guest_weight_chunks = 5 is not allowed: expected 0 \(by moe\.gemm\) or a divisor of "
     r"model\.expert_hidden = 64"),
    ("moe.recv_capacity_factor=0.5", r"moe\.recv_capacity_factor = 0\.5 is not allowed: expected 0 \(room for"),
    ("model.top_k=17", r"model\.top_k = 17 is not allowed: expected at most model\.num_experts = 16"),
    ("model.num_experts=12", r"model\.num_experts = 12 is not allowed: expected a multiple of .* = 8"),
    ("model.d_model=0", r"model\.d_model = 0 is not allowed: expected a value > 0"),
    ("model.first_dense_layers=2", r"model\.first_dense_layers = 2 is not allowed: expected below model\.num_layers "
                                   r"= 2 \(at least one MoE layer\)"),
    ("model.moe_every=3", r"model\.num_layers = 2 is not allowed: expected model\.first_dense_layers = 0 plus a "
                          r"multiple of model\.moe_every = 3"),
    ("model.dtype=float16", r"model\.dtype = 'float16' is not allowed: expected one of \['float32', 'bfloat16'\]"),
    ("train.batch_size=12", r"train\.batch_size = 12 is not allowed: expected a multiple of the 8 devices"),
    ("train.learning_rate=true", r"train\.learning_rate = True has type bool: expected float"),
    ("train.microbatches=0", r"train\.microbatches = 0 is not allowed: expected a value > 0"),
    ("train.eval_every=-1", r"train\.eval_every = -1 is not allowed: expected a value >= 0"),
    ("train.microbatches=3", r"train\.batch_size = 16 is not allowed: expected a multiple of train\.microbatches x "
                             r"devices = 3 x 8"),
    ("topology.mfu=2.0", r"topology\.mfu = 2\.0 is not allowed: expected a value in \(0, 1\]"),
    ("topology.preset=tpu-9x9", r"topology\.preset = 'tpu-9x9' is not allowed: expected one of \["),
    ("data.source=path", r"data\.path = None is not allowed"),
    ("optimizer.lr=1", r"override key 'optimizer\.lr' must be section\.key"),
    ("moe.planner", r"must look like section\.key=value"),
])
def test_bad_config_names_key(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, BASE), [override])


def test_unknown_section_and_missing_topology(tmp_path):
    with pytest.raises(ConfigError, match="unknown section 'optim'"):
        load_config(write(tmp_path, {**BASE, "optim": {}}))
    with pytest.raises(ConfigError, match="section 'topology' is required"):
        load_config(write(tmp_path, {"model": {"preset": "tiny"}}))


def test_mesh_larger_than_device_count(tmp_path):
    with pytest.raises(ConfigError, match=r"topology = 32 is not allowed: expected a mesh of at most the 8"):
        load_config(write(tmp_path, {**BASE, "topology": {"preset": "h800-4x8"}}),
                    ["model.num_experts=32", "train.batch_size=32"], num_devices=8)


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")


def test_planner_knobs_come_from_the_planner_classes():
    """Each planner's run-file keys are MoEConfig fields with the planner field's default, and the
    layer builds every planner with them: one source for names and defaults."""
    import dataclasses

    from jtopoep.config import PLANNERS, MoEConfig
    from jtopoep.costmodel import ExpertDims
    from jtopoep.layer import make_planner
    from jtopoep.planners import PLANNERS as CLASSES
    from jtopoep.topology import Topology

    assert PLANNERS == tuple(CLASSES)
    config_defaults = {f.name: f.default for f in dataclasses.fields(MoEConfig)}
    for name, cls in CLASSES.items():
        planner_defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        for field, key in cls.config_keys.items():
            assert config_defaults[key] == planner_defaults[field], (name, field, key)
        moe = MoEConfig(planner=name, min_gain=0.5, price_transfers=False, sinkhorn_epsilon=2.0, sinkhorn_iters=3)
        planner = make_planner(moe, Topology(2, 4), 16, ExpertDims(64, 128, 2))
        assert type(planner) is cls
        for field, key in cls.config_keys.items():
            assert getattr(planner, field) == getattr(moe, key), (name, field)
