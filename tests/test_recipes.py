"""Deployment recipes: every command the builder prints is one the installed vLLM accepts and means what was asked.

References: vLLM's own ``vllm serve`` parser, config classes and environment parsing (through ``vllm_glm53.testing``), the
requested features and the documented flag formats, and bash itself for the printed scripts. No engine starts.
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_glm53 import recipes as R

REPO = Path(__file__).resolve().parents[1]
ROLE_OPTIONS = {"headless", "data_parallel_start_rank", "api_server_count"}  # what may differ between DP nodes
POOL_OPTIONS = {"port", "kv_transfer_config", "compilation_config", "enforce_eager", "max_num_seqs"}  # PD pools


@pytest.fixture(scope="module")
def cli():
    from vllm_glm53 import testing

    return testing.ServeCli()  # built once: importing vLLM and adding ~400 options takes seconds


@pytest.fixture(scope="module")
def vllm_env():
    from vllm_glm53 import testing

    return testing


def example_params(recipe: R.Recipe) -> dict[str, str]:
    """A value for every parameter without a default: the recipe's example, or a node IP."""
    return {n: p.example for n, p in recipe.declared_params().items() if p.default is None and p.example}


def feature_combinations(recipe: R.Recipe):
    """Every on/off assignment of the recipe's non-required features, as build() requests."""
    toggles = [[name, f"no-{name}"] for name, cfg in recipe.features.items() if cfg.state != "required"]
    for choice in itertools.product(*toggles):
        yield list(choice)


def all_requests():
    for recipe in R.load_recipes().values():
        for hardware in recipe.hardware:
            for variant in recipe.variants:
                for features in feature_combinations(recipe):
                    yield recipe, hardware, variant, features


def accepted_plans():
    """(recipe, hardware, variant, requested-on features, plan) for every request the rules allow."""
    out = []
    for recipe, hardware, variant, features in all_requests():
        try:
            plan = R.build(hardware, recipe.strategy, variant, features, example_params(recipe))
        except R.RecipeError:
            continue
        on = {f for f in features if not f.startswith("no-")} | {
            n for n, c in recipe.features.items() if c.state == "required"}
        out.append((recipe, hardware, variant, on, plan))
    return out


ACCEPTED = accepted_plans()


def default_plan(recipe: R.Recipe, hardware: str, **kwargs) -> R.Plan:
    return R.build(hardware, recipe.strategy, params=example_params(recipe), **kwargs)


# ---------------------------------------------------------------------------------------------------------
# The catalogue
# ---------------------------------------------------------------------------------------------------------


def test_catalogue_covers_the_required_deployments():
    by_key = {(hw, r.strategy): r for r in R.load_recipes().values() for hw in r.hardware}
    for key in [("h200", "single-node-tp"), ("h100", "single-node-tp"), ("b200", "single-node-tp"),
                ("gb200", "single-node-tp"), ("mi355x", "single-node-tp"), ("ascend-950", "single-node-tp"),
                ("atlas-a3", "single-node-tp"), ("atlas-a2", "multi-node-dp"), ("h200", "pd-disagg"),
                ("h100", "multi-node-ray"), ("cpu", "tiny-checkpoint"), ("cpu", "large-memory")]:
        assert key in by_key, key
    files = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
    assert sorted(R.load_recipes()) == files  # every YAML file is a loaded recipe, under its file name


def test_every_default_build_succeeds_and_every_variant_builds_somewhere():
    for recipe in R.load_recipes().values():
        for hardware in recipe.hardware:
            plan = default_plan(recipe, hardware)
            assert plan.variant == recipe.default_variant and plan.unresolved == {}
        for variant in recipe.variants:
            built = [hw for hw in recipe.hardware
                     if any(p[0] is recipe and p[1] == hw and p[2] == variant for p in ACCEPTED)]
            assert built, f"{recipe.id}: variant {variant} builds on none of {recipe.hardware}"


def test_every_recipe_carries_the_glm_flags_and_the_install_step():
    for recipe, hardware, variant, on, plan in ACCEPTED:
        platform = R.HARDWARE[hardware].platform
        wanted = "pip install 'vllm-glm53[cpu]'" if platform == "cpu" else "pip install vllm-glm53"
        assert wanted in plan.install
        assert ("apt-get install -y libtcmalloc-minimal4" in plan.install) == (platform == "cpu")
        if "dflash" in recipe.features:  # a recipe with speculative decoding offers MTP too
            assert "mtp" in recipe.features, recipe.id


# ---------------------------------------------------------------------------------------------------------
# vLLM accepts every command, and it means what was requested
# ---------------------------------------------------------------------------------------------------------


def expected_speculative(recipe: R.Recipe, hardware: str, on: set[str]) -> dict | None:
    """The --speculative-config a request asks for, in the documented formats: DFlash2 drafts 7 tokens; MTP is
    method mtp, except on Ascend (deepseek_mtp, eager), at the recipe's default depth."""
    if "dflash" in on:
        return {"method": "dflash", "model": "incoai/GLM-5.3-Flash-DFlash2", "num_speculative_tokens": 7}
    if "mtp" not in on:
        return None
    tokens = recipe.features["mtp"].tokens
    if R.HARDWARE[hardware].platform == "ascend":
        return {"method": "deepseek_mtp", "num_speculative_tokens": tokens, "enforce_eager": True}
    return {"method": "mtp", "num_speculative_tokens": tokens}


def test_vllm_serve_accepts_every_command_and_parses_the_features(cli, vllm_env):
    baseline = cli.parse(["m"])
    checked = 0
    for recipe, hardware, variant, on, plan in ACCEPTED:
        for launch in plan.serve_launches():
            assert launch.program == ["vllm", "serve"]
            ns = cli.parse(launch.args)
            assert cli.deprecated_options_used(ns) == [], (plan.recipe, launch.args)
            assert ns.model == recipe.variants[variant].model == plan.model
            assert ns.tokenizer_mode == "glm5_next"
            assert (ns.tool_call_parser, ns.enable_auto_tool_choice) == (
                ("glm47", True) if "tools" in on else (baseline.tool_call_parser, baseline.enable_auto_tool_choice))
            assert ns.reasoning_parser == ("glm47" if "reasoning" in on else baseline.reasoning_parser)
            spec = expected_speculative(recipe, hardware, on)
            assert ns.speculative_config == (spec if spec is not None else baseline.speculative_config)
            if spec is not None:
                assert vllm_env.speculative_config_problems(ns.speculative_config) == []
            assert ns.kv_cache_dtype == ("fp8" if "fp8-kv" in on else baseline.kv_cache_dtype)
            assert ns.enable_expert_parallel == ("expert-parallel" in on)
            assert ns.sparse_indexer_topk_backend == (
                "aiter" if "aiter-topk" in on else baseline.sparse_indexer_topk_backend)
            checked += 1
    assert checked > 300  # the combinations really were enumerated


def test_mtp_depth_reaches_the_speculative_config(cli, vllm_env):
    for n in (1, 5):
        plan = R.build("h200", features=[f"mtp={n}"])
        ns = cli.parse(plan.serve_launches()[0].args)
        assert ns.speculative_config == {"method": "mtp", "num_speculative_tokens": n}
    plan = R.build("ascend-950", features=["mtp=4"])
    spec = cli.parse(plan.serve_launches()[0].args).speculative_config
    assert spec == {"method": "deepseek_mtp", "num_speculative_tokens": 4, "enforce_eager": True}
    assert vllm_env.speculative_config_problems(spec) == []


def json_tokens(args: list[str]):
    """(option, decoded JSON) for every JSON-valued option in a serve argument list."""
    for option, value in zip(args, args[1:]):
        if option.startswith("-") and value[:1] in "{[":
            yield option, json.loads(value)  # raises if a recipe wrote invalid JSON


def test_json_flags_are_json_and_become_vllm_configs(cli):
    seen = set()
    for recipe, hardware, variant, on, plan in ACCEPTED:
        for launch in plan.serve_launches():
            ns = cli.parse(launch.args)
            for option, decoded in json_tokens(launch.args):
                parsed = getattr(ns, cli.option_dest(option))
                seen.add(option)
                if isinstance(parsed, dict):
                    assert parsed == decoded, option
                    continue
                # A config object (CompilationConfig, KVTransferConfig): each key landed in its field.
                for key, value in decoded.items():
                    field_value = getattr(parsed, key)
                    assert getattr(field_value, "name", field_value) == value, (option, key)
    assert {"--speculative-config", "--compilation-config", "--kv-transfer-config",
            "--limit-mm-per-prompt"} <= seen


def test_limit_mm_per_prompt_names_modalities(cli):
    for recipe, hardware, variant, on, plan in ACCEPTED:
        for launch in plan.serve_launches():
            limits = cli.parse(launch.args).limit_mm_per_prompt
            if limits:
                assert set(limits) <= {"image", "video"} and all(isinstance(v, int) and v >= 0
                                                                 for v in limits.values())


def test_environment_variables_are_read_by_vllm(vllm_env, monkeypatch):
    """Every VLLM_* variable is one vLLM reads (or a note explains why not) and its value parses in vLLM."""
    names = vllm_env.vllm_env_names()
    for recipe in R.load_recipes().values():
        for hardware in recipe.hardware:
            plan = default_plan(recipe, hardware)
            for launch in plan.launches:
                for name, value in launch.env.items():
                    if not name.startswith("VLLM_"):
                        continue
                    if name not in names:
                        assert any(name in note for note in recipe.notes), (recipe.id, name)
                        continue
                    monkeypatch.setenv(name, value)
                    vllm_env.read_vllm_env(name)  # raises on a value vLLM rejects (e.g. a bad layout name)


def test_option_aliases_match_vllm(cli):
    for short, long in R.OPTION_ALIASES.items():
        assert cli.option_dest(short) == cli.option_dest(long) is not None, short


def test_extra_args_replace_recipe_options(cli):
    plan = R.build("h200", extra_args=["--tensor-parallel-size", "4", "--max-model-len", "65536"])
    args = plan.serve_launches()[0].args
    assert args.count("--tensor-parallel-size") == 1
    ns = cli.parse(args)
    assert (ns.tensor_parallel_size, ns.max_model_len) == (4, 65536)
    plan = R.build("cpu", params={"CPU_BIND": "0"}, extra_args=["--max-model-len=1024"])
    assert cli.parse(plan.serve_launches()[0].args).max_model_len == 1024
    with pytest.raises(R.RecipeError, match="must be options"):
        R.build("h200", extra_args=["other/model"])


# ---------------------------------------------------------------------------------------------------------
# Commands of one deployment agree with each other
# ---------------------------------------------------------------------------------------------------------


def devices_of(ns) -> int:
    """Devices holding one copy of the weights: TP x PP, times DP when experts are spread over DP ranks."""
    tp, pp, dp = ns.tensor_parallel_size, ns.pipeline_parallel_size, ns.data_parallel_size
    return tp * pp * (dp if ns.enable_expert_parallel else 1)


def test_device_counts_match_the_recipe_and_fit_the_nodes(cli):
    for recipe in R.load_recipes().values():
        if recipe.devices is None:
            continue
        for hardware in recipe.hardware:
            plan = default_plan(recipe, hardware)
            used = 0
            for launch in plan.serve_launches():
                ns = cli.parse(launch.args)
                assert devices_of(ns) == recipe.devices, (recipe.id, hardware)
                local_dp = ns.data_parallel_size_local or ns.data_parallel_size
                used += ns.tensor_parallel_size * ns.pipeline_parallel_size * local_dp
            assert used <= recipe.nodes * R.HARDWARE[hardware].devices_per_node, (recipe.id, hardware)


def multi_launch_plans(strategy: str):
    for recipe in R.load_recipes().values():
        if recipe.strategy == strategy:
            for hardware in recipe.hardware:
                for features in ([], ["mtp=3"] if "mtp" in recipe.features else []):
                    yield recipe, default_plan(recipe, hardware, features=features)


def test_data_parallel_nodes_agree(cli):
    plans = list(multi_launch_plans("multi-node-dp"))
    assert plans
    for recipe, plan in plans:
        params = example_params(recipe)
        launches = plan.serve_launches()
        assert sorted(launch.node for launch in launches) == list(range(recipe.nodes))
        parsed = [(launch, cli.parse(launch.args)) for launch in launches]
        dp = parsed[0][1].data_parallel_size
        assert sum(ns.data_parallel_size_local for _, ns in parsed) == dp
        for launch, ns in parsed:
            assert ns.data_parallel_start_rank == launch.node * ns.data_parallel_size_local
            assert ns.data_parallel_address == params["NODE0_IP"]
            assert ns.headless == (launch.node != 0)
            if ns.headless:
                assert ns.api_server_count in (None, 0)  # vllm serve refuses API servers on a headless node
        # Apart from the role options, every node runs the very same configuration.
        reference = {k: v for k, v in vars(parsed[0][1]).items() if k not in ROLE_OPTIONS}
        for _, ns in parsed[1:]:
            other = {k: v for k, v in vars(ns).items() if k not in ROLE_OPTIONS}
            assert other.keys() == reference.keys()
            assert {k for k in reference if str(reference[k]) != str(other[k])} == set(), recipe.id
        check_node_environments(recipe, plan, params)


def check_node_environments(recipe: R.Recipe, plan: R.Plan, params: dict[str, str]) -> None:
    """Node environments are equal except for variables carrying the node's own IP, which must be it."""
    for node, env in enumerate(plan.node_env):
        mine = params[f"NODE{node}_IP"]
        for name, value in env.items():
            if value in {params[f"NODE{k}_IP"] for k in range(recipe.nodes)}:
                assert value == mine, (recipe.id, node, name)
            else:
                assert value == plan.node_env[0][name], (recipe.id, node, name)


def test_ray_nodes_agree(cli):
    from vllm_glm53._vllm import CPU_RAY_RESOURCE

    plans = list(multi_launch_plans("multi-node-ray"))
    assert plans
    for recipe, plan in plans:
        params = example_params(recipe)
        head = [l for l in plan.launches if l.kind == "command" and "--head" in l.args]
        workers = [l for l in plan.launches if l.kind == "command" and "--address" in l.args]
        assert [l.node for l in head] == [0] and sorted(l.node for l in workers) == list(range(1, recipe.nodes))
        for launch in head + workers:
            assert launch.program == ["ray"] and launch.args[0] == "start"
            assert launch.args[launch.args.index("--node-ip-address") + 1] == params[f"NODE{launch.node}_IP"]
        port = head[0].args[head[0].args.index("--port") + 1]
        for launch in workers:
            assert launch.args[launch.args.index("--address") + 1] == f"{params['NODE0_IP']}:{port}"
        (serve,) = plan.serve_launches()
        ns = cli.parse(serve.args)
        assert serve.node == 0 and ns.distributed_executor_backend == "ray"
        per_node = R.HARDWARE[plan.hardware].devices_per_node
        if per_node is None:  # CPU: each Ray node declares the ranks it hosts (vllm_cpu_rank, _vllm ledger 8)
            ranks = [json.loads(l.args[l.args.index("--resources") + 1])[CPU_RAY_RESOURCE] for l in head + workers]
            assert ns.tensor_parallel_size * ns.pipeline_parallel_size == sum(ranks), recipe.id
            assert ns.tensor_parallel_size <= min(ranks), recipe.id  # TP stays inside a node
        else:
            assert ns.tensor_parallel_size * ns.pipeline_parallel_size == recipe.nodes * per_node
            assert ns.tensor_parallel_size <= per_node  # TP stays inside a node
        check_node_environments(recipe, plan, params)


def test_prefill_decode_pools_and_router_agree(cli):
    plans = list(multi_launch_plans("pd-disagg"))
    assert plans
    for recipe, plan in plans:
        prefill, decode = plan.serve_launches()
        (router,) = [l for l in plan.launches if l.kind == "command"]
        p_ns, d_ns = cli.parse(prefill.args), cli.parse(decode.args)
        assert (p_ns.kv_transfer_config.kv_role, d_ns.kv_transfer_config.kv_role) == ("kv_producer", "kv_consumer")
        assert p_ns.kv_transfer_config.kv_connector == d_ns.kv_transfer_config.kv_connector == "NixlConnector"
        p_gpus, d_gpus = (set(l.env["CUDA_VISIBLE_DEVICES"].split(",")) for l in (prefill, decode))
        assert not p_gpus & d_gpus
        assert (len(p_gpus), len(d_gpus)) == (p_ns.tensor_parallel_size, d_ns.tensor_parallel_size)
        assert prefill.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != decode.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
        for name in ("VLLM_SSM_CONV_STATE_LAYOUT", "VLLM_KV_CACHE_LAYOUT"):
            assert prefill.env[name] == decode.env[name]
        # The pools differ only in their role options: same model, speculative config, KV dtype, ...
        p_vars, d_vars = vars(p_ns), vars(d_ns)
        assert {k for k in p_vars if k not in POOL_OPTIONS and str(p_vars[k]) != str(d_vars[k])} == set()
        assert p_ns.port != d_ns.port
        route = dict(zip(router.args, router.args[1:]))
        assert route["--prefill"].rsplit(":", 1)[1] == str(p_ns.port)
        assert route["--decode"].rsplit(":", 1)[1] == str(d_ns.port)
        assert route["--port"] not in (str(p_ns.port), str(d_ns.port))


# ---------------------------------------------------------------------------------------------------------
# The printed script runs as planned (bash expands the placeholders; stubs record what would start)
# ---------------------------------------------------------------------------------------------------------

STUBS = r"""
record() { printf '@@LAUNCH\0'; printf '%s\0' "$@"; printf '@@ENV\0'; env -0; printf '@@END\0'; }
vllm() { record vllm "$@"; }
ray() { record ray "$@"; }
vllm-router() { record vllm-router "$@"; }
source() { :; }
"""


def run_node_script(script: str, env: dict[str, str]) -> list[tuple[list[str], dict[str, str]]]:
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", STUBS + script], env={"PATH": os.environ["PATH"], **env},
                         capture_output=True, check=True).stdout.decode()
    launches = []
    for chunk in out.split("@@LAUNCH\0")[1:]:
        argv, rest = chunk.split("@@ENV\0")
        env_out = dict(item.split("=", 1) for item in rest.split("@@END\0")[0].split("\0") if "=" in item)
        launches.append((argv.split("\0")[:-1], env_out))
    return launches


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_printed_scripts_run_the_planned_commands():
    for recipe in R.load_recipes().values():
        for hardware in recipe.hardware:
            for features in ([], ["mtp=2"] if "mtp" in recipe.features else []):
                params = example_params(recipe)
                printed = R.build(hardware, recipe.strategy, features=features)  # ${NAME} left for bash
                planned = R.build(hardware, recipe.strategy, features=features, params=params)
                for node in range(recipe.nodes):
                    ran = run_node_script(printed.node_script(node), params)
                    wanted = [l for l in planned.launches if l.node == node]
                    assert [argv for argv, _ in ran] == [l.argv for l in wanted], (recipe.id, hardware, node)
                    for (_, env), launch in zip(ran, wanted):
                        assert {k: env.get(k) for k in launch.env} == launch.env, (recipe.id, node)
                assert planned.script().count("### node") == recipe.nodes


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_printed_script_stops_on_a_missing_parameter():
    plan = R.build("atlas-a2")
    result = subprocess.run(["bash", "-c", STUBS + plan.node_script(1)], env={"PATH": os.environ["PATH"]},
                            capture_output=True, text=True)
    assert result.returncode != 0 and "set NIC_NAME" in result.stderr and "@@LAUNCH" not in result.stdout


# ---------------------------------------------------------------------------------------------------------
# Every printed command is one its model serves
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_interfaces():
    """The vLLM interfaces of each model's released-checkpoint class, by vLLM's own predicates."""
    from tests.vllm_glm5next import interfaces, vllm_interfaces
    from vllm_glm53 import model

    return {"plugin": set(interfaces(model.Glm5NextForConditionalGeneration)),
            "vllm": set(vllm_interfaces()["Glm5NextForConditionalGeneration"])}


def test_every_printed_command_is_served_by_its_model(cli, model_interfaces):
    """Walk every recipe x hardware x variant x feature set, with the recipe's own serving model and with the
    plugin's forced: each command the builder prints, read back by vLLM's own parser, asks of its serving model only
    interfaces that model's class declares, and never an option the plugin's model would ignore. Independent of the
    builder's reading of the options (vLLM's parser) and of serving.py's declarations (the classes themselves)."""
    printed, refused = 0, 0
    for recipe, hardware, variant, features in all_requests():
        for served_by in (None, "plugin"):
            try:
                plan = R.build(hardware, recipe.strategy, variant, features, example_params(recipe),
                               served_by=served_by)
            except R.RecipeError as exc:
                refused += "rule serving-model" in str(exc)
                continue
            have = model_interfaces["plugin" if plan.served_by == "plugin" else "vllm"]
            where = f"{recipe.id} {hardware} {variant} {features} served by {plan.served_by}"
            for launch in plan.serve_launches():
                ns = cli.parse(launch.args)
                printed += 1
                spec = ns.speculative_config or {}
                method = spec.get("method") if isinstance(spec, dict) else getattr(spec, "method", None)
                assert ns.pipeline_parallel_size == 1 or "SupportsPP" in have, where
                assert not ns.enable_lora or "SupportsLoRA" in have, where
                assert method not in ("eagle3", "dflash") or "SupportsEagle3" in have, where
                if plan.served_by == "plugin":  # options the plugin's model would silently ignore or fail on
                    assert not ns.enable_eplb, where
                    if ns.enable_expert_parallel:  # over the DP x TP ranks, experts unquantized (FP8 on CPU)
                        weights = R.select(hardware, recipe.strategy, variant)[1].weights
                        assert weights in ("bf16", "tiny") or (weights == "fp8-block" and hardware == "cpu"), where
                    # drafts with PP: on CPU workers only (adapter ledger 10)
                    assert ns.pipeline_parallel_size == 1 or not ns.speculative_config or hardware == "cpu", where
                    assert not str(ns.kv_cache_dtype).startswith("fp8"), where
                    assert ns.attention_backend is None and ns.sparse_indexer_topk_backend == "auto", where
                    assert R.select(hardware, recipe.strategy, variant)[1].weights != "nvfp4", where
    assert printed > 100 and refused > 10  # both sides of the rule are exercised


# ---------------------------------------------------------------------------------------------------------
# Rules reject what upstream found broken
# ---------------------------------------------------------------------------------------------------------

REJECTED = [
    (dict(hardware="h200", features=["fp8-kv"]), "rule fp8-kv"),
    (dict(hardware="h100", strategy="multi-node-ray", features=["fp8-kv"]), "Hopper"),
    (dict(hardware="h200", strategy="pd-disagg", features=["fp8-kv"]), "Hopper"),
    (dict(hardware="h200", extra_args=["--kv-cache-dtype", "fp8_e4m3"]), "rule fp8-kv"),
    (dict(hardware="cpu", features=["fp8-kv"]), "rule serving-model"),
    # where the plugin's model serves (CPU, or forced with --served-by plugin), what it cannot do is refused
    (dict(hardware="h200", strategy="multi-node-ray", features=["mtp=1"], served_by="plugin"),
     "--pipeline-parallel-size 2"),
    (dict(hardware="b200", served_by="plugin"), "--kv-cache-dtype fp8"),
    (dict(hardware="gb200", variant="nvfp4", features=["no-fp8-kv"], served_by="plugin"), "quantization nvfp4"),
    (dict(hardware="h200", features=["dflash"], served_by="plugin"), "SupportsEagle3"),
    (dict(hardware="h200", features=["expert-parallel"], served_by="plugin"), "--enable-expert-parallel"),
    (dict(hardware="mi355x", served_by="plugin"), "--attention-backend ROCM_AITER_MLA_SPARSE"),
    (dict(hardware="cpu", extra_args=["--enable-lora"]), "--enable-lora"),
    (dict(hardware="cpu", served_by="vllm"), "cannot run on cpu"),
    (dict(hardware="ascend-950", extra_args=["--quantization", "ascend"]), "rule ascend-quantization"),
    (dict(hardware="ascend-950", extra_args=["-q", "ascend"]), "rule ascend-quantization"),
    (dict(hardware="atlas-a3", extra_args=["--quantization", "fp8"]), "needs --quantization ascend"),
    (dict(hardware="ascend-950", extra_args=["--block-size", "128"]), "rule ascend-block-size"),
    (dict(hardware="ascend-950", features=["expert-parallel"]), "rule ascend-950-ep"),
    (dict(hardware="h200", features=["mtp=0"]), "rule mtp-tokens"),
    (dict(hardware="h200", features=["mtp=6"]), "rule mtp-tokens"),
    (dict(hardware="h200", features=["mtp", "dflash"]), "rule one-drafter"),
    (dict(hardware="b200", features=["dflash"]), "rule one-drafter"),  # MTP is on by default there
    (dict(hardware="mi355x", features=["dflash"]), "rule dflash-platform"),
    (dict(hardware="h100", variant="bf16"), "rule memory"),
    (dict(hardware="h200", extra_args=["--tokenizer-mode", "auto"]), "rule glm-flags"),
    (dict(hardware="atlas-a3", features=["no-expert-parallel"]), "required"),
    (dict(hardware="h200", features=["aiter-topk"]), "does not offer aiter-topk"),
    (dict(hardware="h200", features=["mtp=x"]), "not an integer"),
    (dict(hardware="h200", features=["tools=2"]), "takes no value"),
    (dict(hardware="h200", params={"NODE9_IP": "1"}), "unknown param"),
]


@pytest.mark.parametrize("request_, match", REJECTED)
def test_forbidden_requests_are_rejected(request_, match):
    with pytest.raises(R.RecipeError, match=match):
        R.build(**request_)


@pytest.mark.parametrize("request_", [
    dict(hardware="b200", strategy="pd-disagg", features=["fp8-kv"]),  # FP8 KV is fine on Blackwell
    dict(hardware="h200", features=["mtp=1"]),
    dict(hardware="h200", features=["mtp=5"]),
    dict(hardware="b200", features=["no-mtp", "dflash"]),
    dict(hardware="h200", variant="bf16"),  # 8 x 141 GB holds the BF16 checkpoint
    dict(hardware="gb200", variant="nvfp4", extra_args=["--kv-cache-dtype", "fp8"]),
    dict(hardware="cpu", features=["mtp"], extra_args=["--enable-prefix-caching"]),  # the plugin's model: both
])
def test_allowed_neighbours_of_forbidden_requests_build(request_, cli):
    plan = R.build(**request_, params=example_params(R.select(request_["hardware"], request_.get("strategy"))[0]))
    for launch in plan.serve_launches():
        cli.parse(launch.args)


def test_rust_frontend_is_rejected(monkeypatch):
    data = {"title": "t", "hardware": ["h200"], "strategy": "s", "status": "untested", "source": "test",
            "nodes": 1, "devices": 8, "variants": {"fp8": {"model": "m", "weights": "fp8-block"}},
            "env": {"VLLM_USE_RUST_FRONTEND": "1"}, "args": [],
            "features": {"tools": "default", "reasoning": "default"}}
    recipe = R.Recipe.from_dict("rust", data)
    from vllm_glm53.recipes import schema

    monkeypatch.setattr(schema, "_load", lambda: {"rust": recipe})  # the catalogue select() reads
    with pytest.raises(R.RecipeError, match="rule python-frontend"):
        R.build("h200")


@pytest.mark.parametrize("change, match", [
    (lambda d: d.update(colour="red"), "unknown key"),
    (lambda d: d.update(hardware=["tpu"]), "unknown hardware"),
    (lambda d: d.update(status="works"), "status"),
    (lambda d: d["features"].update(tools="optional"), "every recipe carries it"),
    (lambda d: d["features"].update(warp="default"), "unknown feature"),
    (lambda d: d["features"].update(mtp={"state": "optional", "tokens": 2}), "missing method"),
    (lambda d: d.update(args=["--port", 8000]), "quote numbers"),
    (lambda d: d.update(args=["--port", "${PORTT}"]), "not a declared param"),
    (lambda d: d.update(args=["--data-parallel-address", "${HEAD_IP}"]), "not a declared param"),
    (lambda d: d.update(launches=[{"name": "x", "node": 1}]), "node 1"),
    (lambda d: d["variants"].update(bf16={"model": "m2", "weights": "bf16"}), "default: true"),
    (lambda d: d["variants"]["fp8"].update(weights="fp4"), "weights"),
    (lambda d: d.pop("devices"), "devices"),
])
def test_schema_violations_are_reported(change, match):
    data = {"title": "t", "hardware": ["h200"], "strategy": "s", "status": "untested", "source": "test",
            "nodes": 1, "devices": 8, "variants": {"fp8": {"model": "m", "weights": "fp8-block"}}, "args": [],
            "features": {"tools": "default", "reasoning": "default"}}
    R.Recipe.from_dict("ok", json.loads(json.dumps(data)))
    change(data)
    with pytest.raises(R.RecipeError, match=match):
        R.Recipe.from_dict("broken", data)


# ---------------------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------------------


def test_list_shows_every_recipe(capsys):
    assert R.main(["--list"]) == 0
    out = capsys.readouterr().out
    for recipe in R.load_recipes().values():
        assert recipe.id in out and recipe.strategy in out
    for name in R.hardware_names():
        assert name in out


@pytest.mark.parametrize("argv, valid", [
    (["--hardware", "tpu"], lambda: R.hardware_names()),
    (["--hardware", "h200", "--strategy", "warp"], lambda: ["single-node-tp", "pd-disagg", "multi-node-ray"]),
    (["--hardware", "h200", "--variant", "int4"], lambda: ["fp8", "bf16"]),
    (["--hardware", "h200", "--feature", "warp"], lambda: list(R.FEATURES)),
])
def test_unknown_names_exit_2_and_list_the_valid_ones(argv, valid, capsys):
    with pytest.raises(SystemExit) as exc:
        R.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for name in valid():
        assert name in err


def test_rule_violations_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        R.main(["--hardware", "h200", "--feature", "fp8-kv"])
    assert exc.value.code == 2 and "Hopper" in capsys.readouterr().err


def test_json_output_is_the_plan(capsys):
    assert R.main(["--hardware", "atlas-a2", "--set", "NIC_NAME=eth1", "--set", "NODE0_IP=10.1.0.1",
                   "--set", "NODE1_IP=10.1.0.2", "--feature", "mtp=3", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    plan = R.build("atlas-a2", features=["mtp=3"], params={"NIC_NAME": "eth1", "NODE0_IP": "10.1.0.1",
                                                           "NODE1_IP": "10.1.0.2"})
    assert printed == json.loads(json.dumps(plan.to_dict()))
    assert [l["node"] for l in printed["launches"]] == [0, 1]


def test_model_option_and_extra_args_reach_the_command(capsys, cli):
    assert R.main(["--hardware", "mi355x", "--model", "/data/glm", "--", "--max-model-len", "65536"]) == 0
    text = capsys.readouterr().out
    command = text[text.index("vllm serve"):].split("\n\n")[0]
    argv = shlex.split(command.replace("\\\n", " "))
    ns = cli.parse(argv[2:])
    assert (ns.model, ns.max_model_len, ns.max_num_seqs) == ("/data/glm", 65536, 512)


def test_module_entry_point_exits_2_on_unknown_hardware():
    result = subprocess.run([sys.executable, "-m", "vllm_glm53.recipes", "--hardware", "tpu"],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2 and "h200" in result.stderr


# ---------------------------------------------------------------------------------------------------------
# CPU helpers
# ---------------------------------------------------------------------------------------------------------


def expand(bind: str) -> list[set[int]]:
    ranks = []
    for rank in bind.split("|"):
        cores = set()
        for part in rank.split(","):
            lo, _, hi = part.partition("-")
            cores |= set(range(int(lo), int(hi or lo) + 1))
        ranks.append(cores)
    return ranks


@pytest.mark.parametrize("tp, cpus", [(1, range(2)), (2, range(2)), (3, range(8)), (2, [0, 1, 2, 5, 6, 7]),
                                      (4, range(16, 32))])
def test_cpu_bind_partitions_the_cores(tp, cpus):
    """Every core but the last goes to a rank (the last is the engine core's) unless the ranks need them all."""
    ranks = expand(R.cpu_bind(tp, cpus))
    cpus = sorted(cpus)
    bound = cpus if len(cpus) == tp else cpus[:-1]
    assert len(ranks) == tp
    assert set().union(*ranks) == set(bound) and sum(map(len, ranks)) == len(bound)  # disjoint cover
    assert max(map(len, ranks)) - min(map(len, ranks)) <= 1
    assert all(max(a) < min(b) for a, b in zip(ranks, ranks[1:]))  # contiguous shares in order


def test_cpu_bind_needs_a_core_per_rank():
    with pytest.raises(R.RecipeError, match="own core"):
        R.cpu_bind(3, [0, 1])


def test_cpu_plan_serves_a_local_checkpoint(cli, vllm_env, monkeypatch, tmp_path):
    plan = R.cpu_plan(tmp_path / "tiny", port=8123, tp=2, cpus=[0, 1, 2, 3])
    (launch,) = plan.serve_launches()
    ns = cli.parse(launch.args)
    assert (ns.model, ns.port, ns.host, ns.tensor_parallel_size) == (str(tmp_path / "tiny"), 8123, "127.0.0.1", 2)
    assert (ns.enable_prefix_caching, ns.enforce_eager) == (None, True)  # vLLM's default: the plain command starts
    assert ns.max_model_len == 2048 and ns.kv_cache_memory_bytes == 512 * 2**20
    assert expand(launch.env["VLLM_CPU_OMP_THREADS_BIND"]) == [{0, 1}, {2}]  # core 3: the engine core's
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", launch.env["VLLM_CPU_OMP_THREADS_BIND"])
    assert vllm_env.read_vllm_env("VLLM_CPU_OMP_THREADS_BIND") == "0-1|2"
    assert plan.prepare == [f"python -m vllm_glm53.tiny {tmp_path / 'tiny'}"]


def test_parser_build_loaded_this_plugin(cli, vllm_env):
    import vllm_glm53

    assert vllm_env.general_plugins_loaded()
    assert vllm_glm53.register()  # idempotent: returns what the plugin load registered


@pytest.mark.engine
@pytest.mark.serve
def test_cpu_recipe_serves_the_tiny_checkpoint_for_real(tiny_ckpt):
    """The cpu-tiny recipe, exactly as the builder prints it (only this environment's `vllm` and a free port),
    started on a tiny checkpoint and asked for a completion over HTTP."""
    from vllm_glm53.demo import Server, free_port

    ckpt = tiny_ckpt("default")
    port = free_port()
    (launch,) = R.cpu_plan(ckpt, port=port).serve_launches()
    argv = [str(Path(sys.executable).with_name("vllm")), *launch.argv[1:]]
    server = Server(argv, dict(launch.env), echo=False)
    try:
        server.wait_healthy(f"http://127.0.0.1:{port}", timeout=600)
        import requests

        r = requests.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300,
                          json={"model": str(ckpt), "prompt": "Hello", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200, r.text[:500]
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        assert server.stop() == 0  # a clean shutdown
    assert R.load_recipes()["cpu-tiny"].status == "verified-here"
