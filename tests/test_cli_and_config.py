"""The `jaxserve` command and the config dataclasses."""

from __future__ import annotations

import json

import numpy as np

import pytest

from jaxserve.cli import main
from jaxserve.config import EngineConfig, ModelConfig


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_lists_every_command_and_its_flags(capsys):
    """`jaxserve --help` names every command, and each command's help its own flags, with
    the choices taken from the one list of each (strategies, dtypes, quantizations)."""
    assert "{generate,serve,client,plan,convert,router,bench}" in help_text(capsys)
    flags = {
        ("serve",): ["--port", "--mesh",
                     "--sharding {tp,tp+sp,dp,dp+tp,dp+tp+sp,ep,tp+ep,dp+ep,dp+tp+ep}",
                     "--dtype {bfloat16,float32}", "--quantization {int8,int4,fp8,fp4}",
                     "--kv-cache-dtype {auto,int8,fp8}", "--random-weights", "--coordinator",
                     "--grace", "--http-port", "--no-http", "--served-model-name",
                     "--stream-interval", "--kv-transfer-config"],
        ("generate",): ["--prompt", "--max-tokens", "--temperature", "--stop", "--model"],
        ("client",): ["{generate,chat,status,info}", "--target"],
        ("plan",): ["--topology", "--target", "--compare", "--strategy", "--plot"],
        ("convert",): ["--out", "--quantization"],
        ("bench", "serve"): ["--request-rate", "--max-concurrency"],
        ("router",): ["--prefill", "--decode", "--port"],
    }
    for argv, expected in flags.items():
        text = " ".join(help_text(capsys, *argv).split())
        missing = [f for f in expected if f not in text]
        assert not missing, (argv, missing)



def test_a_stream_interval_under_one_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--stream-interval", "0"])
    assert e.value.code == 2
    assert "--stream-interval: must be at least 1, got 0" in capsys.readouterr().err


def test_generate_on_demo_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    code = main(["generate", "--prompt", "Hi there", "--max-tokens", "5", "--ignore-eos",
                 "--max-num-batched-tokens", "16", "--max-num-seqs", "2", "--max-model-len", "64",
                 "--dtype", "float32"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "meaningless" in err
    assert "5 tokens, finish_reason=length" in out
    assert (tmp_path / "demo-v3" / "model.safetensors").exists()


def test_generate_bad_flag_value_is_a_clean_error(capsys):
    assert main(["generate", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "--token-buckets", "16,x"]) == 2
    assert "--token-buckets '16,x': write token counts" in capsys.readouterr().err
    # The largest bucket must hold a whole step (the default: 512 tokens).
    assert main(["generate", "--token-buckets", "16,64"]) == 2
    assert "must cover max_num_batched_tokens (512)" in capsys.readouterr().err


def test_presets_have_published_parameter_counts():
    counts = {name: ModelConfig.from_file(f"configs/models/{name}.yaml").num_params()
              for name in ("llama3-8b", "llama3-70b", "qwen2.5-0.5b", "smollm2-135m")}
    assert round(counts["llama3-8b"] / 1e9, 2) == 8.03
    assert round(counts["llama3-70b"] / 1e9, 1) == 70.6
    assert round(counts["qwen2.5-0.5b"] / 1e6) == 494
    assert round(counts["smollm2-135m"] / 1e6) == 135


def test_hf_config_mapping(tmp_path):
    hf = {"model_type": "qwen2", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2,
          "rope_scaling": {"type": "linear", "factor": 2.0}, "eos_token_id": [5, 6]}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = ModelConfig.from_file(tmp_path)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.head_dim, cfg.eos_token_ids) == (True, False, 8, (5, 6))
    assert [cfg.layer_window(i) for i in range(3)] == [None, None, 16]
    assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == ("linear", 2.0)
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf({**hf, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope scaling"):
        ModelConfig.from_hf({**hf, "rope_scaling": {"type": "dynamic", "factor": 4.0}})
    with pytest.raises(ValueError, match="partial_rotary_factor 0.375 must turn an even"):
        ModelConfig.from_hf({**hf, "partial_rotary_factor": 0.375})  # 3 of 8 dimensions
    longrope = {"type": "su", "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0],
                "original_max_position_embeddings": 64}
    half = ModelConfig.from_hf({**hf, "partial_rotary_factor": 0.5, "rope_scaling": longrope})
    assert (half.rotary_dim, half.rope_scaling.rope_type, half.rope_scaling.factor,
            half.rope_scaling.use_long_factor) == (4, "longrope", 4096 / 64, True)
    assert not half.for_context(64).rope_scaling.use_long_factor
    with pytest.raises(ValueError, match=r"long_factor \(2\) need one entry per rotary "
                                         r"frequency \(4\)"):
        ModelConfig.from_hf({**hf, "rope_scaling": longrope})
    yarn = ModelConfig.from_hf({**hf, "max_position_embeddings": 1024, "rope_scaling": {
        "type": "yarn", "factor": None, "original_max_position_embeddings": 256,
        "beta_fast": None}}).rope_scaling  # DeepSeek-V3's implicit factor, a null beta
    assert (yarn.rope_type, yarn.factor, yarn.beta_fast) == ("yarn", 4.0, 32.0)


def test_engine_config_validation(tmp_path):
    assert EngineConfig(max_num_batched_tokens=64).token_buckets == (1, 8, 16, 32, 64)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int3")
    (tmp_path / "e.yaml").write_text("max_num_seqs: 4\nbogus: 1\n")
    with pytest.raises(ValueError, match="bogus"):
        EngineConfig.from_yaml(tmp_path / "e.yaml")
    assert EngineConfig.from_yaml("configs/engine/cpu.yaml", max_num_seqs=3).max_num_seqs == 3
    with pytest.raises(ValueError, match=r"quant_group_size must be a positive integer \(even"):
        EngineConfig(quantization="int4", quant_group_size=33)
    assert EngineConfig(quantization="int8", quant_group_size=33).quant_group_size == 33
    with pytest.raises(ValueError, match="quant_zero_points .* describe integer weights"):
        EngineConfig(quantization="fp8", quant_zero_points=True)
    with pytest.raises(ValueError, match="describes quantized weights"):
        EngineConfig(quant_group_size=64)  # no quantization to group
    # quant_overrides (a GGUF file's layers of other types; a manifest's lists become tuples)
    down = ["layers.0.mlp.down_proj", "int8", 16, False]
    cfg = EngineConfig(quantization="int4", quant_overrides=[down])
    assert cfg.quant_overrides == (tuple(down),)
    opts = cfg.model_options
    assert opts.weight_options("layers.0.mlp.down_proj").quant_group_size == 16
    assert opts.weight_options("layers.1.mlp.down_proj") is opts
    with pytest.raises(ValueError, match="set quantization: int4 or int8"):
        EngineConfig(quant_overrides=[down])
    # Kind null: the layer in the dtype (a GGUF file's float or IQ layers), with no group.
    v = ["layers.0.attn.v_proj", None, None, False]
    assert EngineConfig(quantization="int4", quant_overrides=[v]).model_options \
        .weight_options(v[0]).quantization is None
    with pytest.raises(ValueError, match="or null, null, false"):
        EngineConfig(quantization="int4", quant_overrides=[[v[0], None, 32, False]])
    # The embedding: in the dtype unless an entry names it (which needs no quantization).
    assert opts.weight_options("embed").quantization is None
    embed = EngineConfig(quant_overrides=[["embed", "int8", None, False]]).model_options
    assert (embed.quantization, embed.weight_options("embed").quantization) == (None, "int8")
    with pytest.raises(ValueError, match="'int8' or 'int4'"):
        EngineConfig(quantization="int4", quant_overrides=[[down[0], "fp8", None, False]])
    with pytest.raises(ValueError, match="group size must be a positive integer"):
        EngineConfig(quantization="int8", quant_overrides=[[down[0], "int4", 15, False]])
    with pytest.raises(ValueError, match="names a layer twice"):
        EngineConfig(quantization="int4", quant_overrides=[down, down])
    with pytest.raises(ValueError, match=r"entries are \[path, kind"):
        EngineConfig(quantization="int4", quant_overrides=["layers.0.mlp.down_proj"])


def test_int4_group_size_and_zero_points_flags():
    """--quant-group-size / --quant-zero-points reach the model's int4 layers."""
    from jaxserve.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["generate", "--prompt", "x", "--quantization", "int4",
                                      "--quant-group-size", "64", "--quant-zero-points"])
    cfg = engine_config_from_args(args)
    assert (cfg.quant_group_size, cfg.quant_zero_points) == (64, True)
    opts = cfg.model_options
    assert (opts.quantization, opts.quant_group_size, opts.quant_zero_points) == ("int4", 64, True)


def test_mesh_and_sharding_settings(tmp_path):
    """mesh and sharding come from YAML (flags override), and bad ones say what to write;
    a strategy that does not use a mesh axis, or data shards that do not divide the seats,
    are errors too."""
    (tmp_path / "e.yaml").write_text("mesh: {data: 2, model: 4}\nsharding: dp+tp\n")
    cfg = EngineConfig.from_yaml(tmp_path / "e.yaml")
    assert (cfg.mesh, cfg.sharding) == ({"data": 2, "model": 4}, "dp+tp")
    assert EngineConfig.from_yaml(tmp_path / "e.yaml", sharding="dp+tp+sp").sharding == "dp+tp+sp"
    with pytest.raises(ValueError, match="sharding must be one of"):
        EngineConfig(sharding="pp")
    with pytest.raises(ValueError, match="axes are"):
        EngineConfig(mesh={"rows": 2})
    with pytest.raises(ValueError, match="positive integer"):
        EngineConfig(mesh={"model": 0})

    import jax

    from sharding.rules import strategy_rules
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    assert strategy_rules("dp", mesh, 8, 2, 100, 64).table == ()  # one device: nothing split
    two_by_four = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    with pytest.raises(ValueError, match="no data parallelism; use dp"):
        strategy_rules("tp", two_by_four, 8, 2, 100, 64)
    with pytest.raises(ValueError, match="no tensor or expert parallelism"):
        strategy_rules("dp", two_by_four, 8, 2, 100, 64)
    with pytest.raises(ValueError, match="splits experts, and this model has none"):
        strategy_rules("dp+tp+ep", two_by_four, 8, 2, 100, 64)
    with pytest.raises(ValueError, match=r"needs num_experts \(6\) divisible by 4"):
        strategy_rules("tp+ep", jax.sharding.AbstractMesh((1, 4), ("data", "model")), 8, 2,
                       100, 64, num_experts=6)
    with pytest.raises(ValueError, match=r"shared_expert_intermediate_size \(18\) divisible"):
        strategy_rules("dp+tp", two_by_four, 8, 2, 100, 64, num_experts=8,
                       expert_intermediate_size=32, shared_expert_intermediate_size=18)
    with pytest.raises(ValueError, match=r"over 8 devices \(every device of the mesh\) needs "
                       r"num_experts \(4\) divisible by 8"):
        strategy_rules("dp+ep", two_by_four, 8, 2, 100, 64, num_experts=4)
    # Experts over every device (the data shards share one copy), attention replicated over
    # `model` (dp+ep) or split (dp+tp+ep); experts over `data` alone with one model device.
    ep = strategy_rules("dp+ep", two_by_four, 8, 2, 100, 64, num_experts=8,
                        expert_intermediate_size=32)
    assert ep.spec(("experts", "embed", "expert_mlp")) == jax.sharding.PartitionSpec(
        ("data", "model"), None, None)
    assert ep.spec(("q_heads",)) == jax.sharding.PartitionSpec(None)
    assert strategy_rules("dp+tp+ep", two_by_four, 8, 2, 100, 64, num_experts=8).spec(
        ("experts", "q_heads")) == jax.sharding.PartitionSpec(("data", "model"), "model")
    eight_by_one = jax.sharding.AbstractMesh((8, 1), ("data", "model"))
    assert strategy_rules("dp+ep", eight_by_one, 8, 2, 100, 64, num_experts=16).spec(
        ("experts", "tokens", "pages")) == jax.sharding.PartitionSpec("data", "data", "data")
    rules = strategy_rules("dp+tp+sp", two_by_four, 8, 2, 100, 64)
    assert rules.kv_head_replicas == 2  # 2 KV heads on 4 model devices: each stored twice
    assert rules.spec(("residual", "embed")) == jax.sharding.PartitionSpec(("data", "model"), None)

    from jaxserve.engine.scheduler import SchedulerConfig
    with pytest.raises(ValueError, match="divide evenly over the 2 data-parallel shards"):
        SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=32,
                        page_size=4, num_pages=16, data_shards=2)


@pytest.mark.slow  # two server starts, ~45 s
def test_a_second_start_reads_every_step_program_from_the_compilation_cache(tmp_path):
    """`jaxserve generate` twice with the same settings: the first compiles the buckets
    into the default cache folder (under JAXSERVE_CACHE, keyed by jaxserve and JAX version
    and device) and keeps each compiled program whole beside it, the second reads all of
    them back and generates the same text."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "JAXSERVE_CACHE": str(tmp_path)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "jaxserve.cli", "generate", "--prompt", "Hi", "--max-tokens",
           "3", "--max-num-batched-tokens", "16", "--max-num-seqs", "2", "--max-model-len",
           "64", "--dtype", "float32", "--kernel-impl", "reference", "--token-buckets", "16"]
    runs = [subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
    # One bucket of 16 tokens (the default would add 1 and 8): its forward pass; sampling
    # for 2 sequences, with and without penalties; and, as 2 decodes take it, the two in
    # one program.
    programs = 1 + 2 + 1
    assert f"{programs} compiled, 0 read from the compilation cache" in runs[0].stderr
    assert f"0 compiled, {programs} read from the compilation cache" in runs[1].stderr
    assert runs[0].stdout == runs[1].stdout
    (folder,) = (tmp_path / "xla").iterdir()
    assert folder.name.startswith("jaxserve-") and "_jax-" in folder.name
    # The second start loaded them whole (executable_cache.py), not through tracing.
    assert len(list((folder / "jaxserve-executables").glob("*.bin"))) == programs


def test_distributed_config_from_flags_and_environment(monkeypatch):
    """Multi-host flags: all three or none (JAX's environment variables fill in), the
    process id in range, JAX's heartbeat timeout by default and at least 2 s."""
    from sharding.multihost import HEARTBEAT_TIMEOUT_S, DistributedConfig

    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert DistributedConfig.from_args(None, None, None) is None
    config = DistributedConfig.from_args("h:1", 2, 1)
    assert (config.process_id, config.heartbeat_timeout_s) == (1, HEARTBEAT_TIMEOUT_S)
    assert DistributedConfig.from_args("h:1", 2, 0, 7).heartbeat_timeout_s == 7
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    assert DistributedConfig.from_args("h:1", 2, None).process_id == 1
    for args, needle in ((("h:1", None, 0), "--num-processes"),
                         (("h:1", 2, 2), "--process-id 2"), (("h:1", 2, 0, 1), "heartbeat")):
        with pytest.raises(ValueError, match=needle):
            DistributedConfig.from_args(*args)
