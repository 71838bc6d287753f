"""Every manifest parses as a Serve config and its args as Tandem settings, and
`tandem check-manifest` says so, or names each problem of one that does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from cluster.config import AppSettings
from cluster.manifest_check import check_manifest

MANIFESTS = sorted((Path(__file__).parent.parent / "manifests").glob("*.yaml"))


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_manifest_validates(path):
    raw = yaml.safe_load(path.read_text())
    if raw.get("kind") == "RayService":
        raw = yaml.safe_load(raw["spec"]["serveConfigV2"])
    schema = ServeDeploySchema.model_validate(raw)
    for application in schema.applications:
        assert application.import_path == "cluster.app:build_app"
        AppSettings.model_validate(application.args)
    assert check_manifest(path) == []


def test_check_manifest_names_each_problem_in_one_line(tmp_path):
    local = (Path(__file__).parent.parent / "manifests" / "local.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(local.replace("block_size: 16,", "block_sise: 16,").replace("mode: disaggregated", "mode: both"))
    problems = check_manifest(bad)
    assert "application 'tandem': engine.block_sise: unknown setting" in problems
    assert any(p.startswith("application 'tandem': mode: ") for p in problems) and len(problems) == 2
    assert check_manifest(tmp_path / "missing.yaml")[0].startswith("cannot read a Serve config")
    cli = subprocess.run([sys.executable, "-m", "cluster.cli", "check-manifest", str(bad)], capture_output=True,
                         text=True, cwd=Path(__file__).parent.parent)
    assert cli.returncode == 2 and "Traceback" not in cli.stderr
    assert cli.stderr.splitlines()[1:] == [f"  {p}" for p in problems]


def test_two_applications_naming_one_pool_are_a_problem(tmp_path):
    """They passed: deployed, the second's settings were refused by the pools the
    first started, or its sizes taken for them."""
    manifest = tmp_path / "two.yaml"
    manifest.write_text(yaml.safe_dump({"applications": [
        {"name": name, "route_prefix": f"/{name}", "import_path": "cluster.app:build_app",
         "args": {"model": {"preset": "tiny"}}} for name in ("a", "b")]}))
    assert check_manifest(manifest) == ["application 'b': pool_name 'tandem-pool' is application 'a''s too: give "
                                        "each application a pool_name of its own"]


def test_malformed_manifests_are_problems_not_tracebacks(tmp_path, tiny_qwen2_dir):
    """Each was a traceback from the CLI: bytes that are not UTF-8, YAML nested too
    deeply, a RayService whose serveConfigV2 is a mapping (the `|` forgotten) or
    missing, a model folder whose config.json is JSON but no object."""
    import shutil

    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00bad")
    assert check_manifest(tmp_path / "binary.yaml") == [
        f"cannot read a Serve config: {tmp_path / 'binary.yaml'} is not UTF-8 text (byte 0)"]
    (tmp_path / "deep.yaml").write_text("a: " + "[" * 100_000 + "]" * 100_000)
    assert check_manifest(tmp_path / "deep.yaml") == [
        f"cannot read a Serve config: {tmp_path / 'deep.yaml'} nests too deeply"]
    for config in ("\n    applications: []", " null", ""):
        (tmp_path / "rs.yaml").write_text(f"kind: RayService\nspec:\n  serveConfigV2:{config}\n")
        [problem] = check_manifest(tmp_path / "rs.yaml")
        assert problem.startswith("a RayService's spec.serveConfigV2 must be the Serve config as a YAML string"), config
    (tmp_path / "deep_rs.yaml").write_text("kind: RayService\nspec:\n  serveConfigV2: '" + "[" * 5000 + "'\n")
    assert check_manifest(tmp_path / "deep_rs.yaml") == ["spec.serveConfigV2 nests too deeply to be a Serve config"]
    too_long = "/tmp/" + "x" * 300
    [problem] = check_manifest(_with_model_path(tmp_path, too_long), local=True)
    assert problem == "application 'tandem': model.path: File name too long"
    listed = tmp_path / "listed"
    shutil.copytree(tiny_qwen2_dir, listed)
    (listed / "config.json").write_text("[1, 2]")
    [problem] = check_manifest(_with_model_path(tmp_path, listed))
    assert problem == f"application 'tandem': model.path: {listed}/config.json: expected a JSON object, got list"


def _with_model_path(tmp_path, folder) -> Path:
    local = (Path(__file__).parent.parent / "manifests" / "local.yaml").read_text()
    manifest = tmp_path / "custom.yaml"
    manifest.write_text(local.replace("model: {preset: tiny, arch: qwen2}", f"model: {{path: '{folder}'}}"))
    return manifest


def test_a_model_folder_here_is_checked_as_a_worker_loads_it(tmp_path, tiny_qwen2_dir):
    import shutil

    assert check_manifest(_with_model_path(tmp_path, tiny_qwen2_dir), local=True) == []
    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen2_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a checkpoint")
    manifest = _with_model_path(tmp_path, broken)
    [problem] = check_manifest(manifest)
    assert problem.startswith(f"application 'tandem': model.path: {broken}/model.safetensors: corrupt or unreadable "
                              "safetensors (")
    (broken / "tokenizer.json").unlink()
    (broken / "vocab.json").unlink(missing_ok=True)
    [problem] = check_manifest(manifest)
    assert "tokenizer" in problem, problem
    cli = subprocess.run([sys.executable, "-m", "cluster.cli", "check-manifest", str(manifest)], capture_output=True,
                         text=True, cwd=Path(__file__).parent.parent)
    assert cli.returncode == 2 and "Traceback" not in cli.stderr and cli.stderr.splitlines()[1:] == [f"  {problem}"]


def test_the_check_compares_the_weights_headers_with_the_model_and_reads_the_sampling_defaults(tmp_path,
                                                                                              tiny_qwen2_dir):
    """A weight missing, of another shape, or unexpected, and a generation config
    whose defaults are not numbers, passed the check and failed every worker."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen2_dir, broken)
    manifest = _with_model_path(tmp_path, broken)
    tensors = load_file(broken / "model.safetensors")
    for damaged, message in [
        ({k: v for k, v in tensors.items() if k != "model.norm.weight"}, "weights missing or incomplete"),
        ({**tensors, "model.norm.weight": tensors["model.norm.weight"][:-1]}, "'model.norm.weight': shape"),
        ({**tensors, "foo.weight": tensors["model.norm.weight"].clone()}, "unexpected weight 'foo.weight'"),
    ]:
        save_file(damaged, broken / "model.safetensors")
        [problem] = check_manifest(manifest)
        assert message in problem, problem
    save_file(tensors, broken / "model.safetensors")
    (broken / "generation_config.json").write_text('{"temperature": "hot"}')
    [problem] = check_manifest(manifest)
    assert "temperature must be a number" in problem, problem


def test_a_model_folder_not_here_is_a_problem_only_for_a_local_manifest(tmp_path):
    manifest = _with_model_path(tmp_path, tmp_path / "on-the-cluster")
    assert check_manifest(manifest) == []
    [problem] = check_manifest(manifest, local=True)
    assert problem.startswith(f"application 'tandem': model.path: model folder {tmp_path / 'on-the-cluster'} not "
                              "found")


def test_rayservice_has_labelled_prefill_and_decode_groups():
    raw = yaml.safe_load((Path(__file__).parent.parent / "manifests" / "rayservice.yaml").read_text())
    assert raw["kind"] == "RayService"
    cluster = raw["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g["labels"] for g in cluster["workerGroupSpecs"]}
    assert groups == {"prefill": {"tandem/role": "prefill"}, "decode": {"tandem/role": "decode"}}
    # (found by a review: KubeRay 1.5 refuses labels in rayStartParams, and Ray's autoscaler ignored them there)
    assert all("labels" not in g["rayStartParams"] for g in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]])
    # Every pod mounts the models, the head's too: a scheduler replica (the tokenizer) may run there
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        [container] = group["template"]["spec"]["containers"]
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]


def test_local_profile_binds_to_loopback():
    raw = yaml.safe_load((Path(__file__).parent.parent / "manifests" / "local.yaml").read_text())
    assert raw["http_options"]["host"] == "127.0.0.1"


@pytest.mark.parametrize(
    "args, message",
    [
        ({"model": {}}, "exactly one of"),
        ({"model": {"preset": "huge"}}, "preset"),
        ({"model": {"preset": "tiny"}, "routing": "random"}, "routing"),
        ({"model": {"preset": "tiny"}, "prefill": {"replicas": 0}}, "prefill.replicas"),
        ({"model": {"preset": "tiny"}, "engine": {"block_size": 24}}, "block_size"),
        ({"model": {"preset": "tiny"}, "typo_field": 1}, "typo_field"),
        ({"model": {"preset": "tiny"}, "channel": "store"}, "kv_store.shared_path"),
        ({"model": {"preset": "tiny"}, "kv_store": {"host_gib": 0}}, "at least one tier"),
        ({"model": {"preset": "tiny"}, "kv_store": {"shared_path": "/mnt/kv"}}, "shared_path needs a bound"),
        ({"model": {"preset": "tiny"}, "kv_store": {"disk_path": "/mnt/kv", "shared_path": "/mnt/kv/", "ttl_s": 60}},
         "two folders"),
        ({"model": {"preset": "tiny"}, "prefill": {"label_selector": {"tandem role": "prefill"}}},
         "Invalid label key name `tandem role`"),
        ({"model": {"preset": "tiny"}, "decode": {"num_cpus": 1e-5}}, "cannot go beyond 0.0001"),
        # (0 turned scale-down off: an idle pool's backlog or KV use is never below 0)
        ({"model": {"preset": "tiny"}, "autoscaling": {"prefill_backlog_down_tokens": 0}}, "prefill_backlog_down"),
        ({"model": {"preset": "tiny"}, "autoscaling": {"kv_usage_down": 0}}, "kv_usage_down"),
        ({"model": {"preset": "tiny"}, "kv_store": {"low_watermark": 0.95}}, "must not exceed"),
        ({"model": {"preset": "tiny"}, "kv_store": {"disk_gib": -1}}, "disk_gib"),
        ({"model": {"preset": "tiny"}, "engine": {"device": "cuda"}, "decode": {"num_gpus": 1}}, "prefill pool"),
        ({"model": {"preset": "tiny"}, "mode": "colocated", "colocated": {"replicas": 1},
          "engine": {"device": "cuda:0"}}, "num_gpus > 0 in the colocated"),
        ({"model": {"preset": "tiny"}, "channel": "nccl"}, "channel: nccl"),
        ({"model": {"preset": "tiny"}, "engine": {"device": "cuda:1"}}, "engine.device"),
        ({"model": {"preset": "tiny"}, "stream_interval": 0}, "stream_interval"),
        ({"model": {"preset": "tiny"}, "engine": {"num_speculative_tokens": 4, "overlap_decode": True}},
         "exclude each other"),
        ({"model": {"preset": "tiny"}, "engine": {"prompt_lookup_min": 5}}, "prompt_lookup_min <= prompt_lookup_max"),
        ({"model": {"preset": "tiny"}, "engine": {"num_speculative_tokens": 17}}, "num_speculative_tokens"),
        ({"model": {"preset": "tiny"}, "engine": {"num_kv_blocks": 2}, "limits": {"max_prompt_tokens": 1536}},
         r"engine.num_kv_blocks \(2\) cannot hold one request of the longest prompt the settings let through: 1536 "
         r"tokens \(limits.max_prompt_tokens\) and one new token need 97 blocks of 16 tokens"),
        ({"model": {"preset": "tiny"}, "pool_name": ""}, "pool_name\n.*must name the pool manager's actor"),
        ({"model": {"preset": "tiny"}, "pool_name": " \t"}, "pool_name\n.*must name the pool manager's actor"),
        # Values of another type, which pydantic's lax mode took
        ({"model": {"preset": "tiny"}, "prefill": {"replicas": "2"}}, "prefill.replicas\n.*valid integer"),
        ({"model": {"preset": "tiny"}, "decode": {"num_gpus": True}}, "decode.num_gpus\n.*valid number"),
        ({"model": {"preset": "tiny"}, "engine": {"num_kv_blocks": "1024"}}, "engine.num_kv_blocks\n.*valid integer"),
        ({"model": {"preset": "tiny"}, "engine": {"max_num_seqs": 8.0}}, "engine.max_num_seqs\n.*valid integer"),
        ({"model": {"preset": "tiny"}, "engine": {"enable_prefix_cache": "no"}},
         "engine.enable_prefix_cache\n.*valid boolean"),
        ({"model": {"preset": "tiny"}, "slo": {"ttft_ms": "700"}}, "slo.ttft_ms\n.*valid number"),
        ({"model": {"preset": "tiny"}, "limits": {"max_prompt_tokens": 1536.0}}, "limits.max_prompt_tokens\n"),
        ({"model": {"preset": "tiny"}, "scheduler_replicas": True}, "scheduler_replicas\n.*valid integer"),
        # Found by a review: an empty key turned authentication off; .inf passed, then failed the pools' start
        ({"model": {"preset": "tiny"}, "api_key": ""}, "api_key\n.*at least 1 character"),
        ({"model": {"preset": "tiny"}, "api_key": "  "}, "api_key\n.*match pattern"),
        ({"model": {"preset": "tiny"}, "response_store_mib": float("inf")}, "response_store_mib\n.*finite number"),
        ({"model": {"preset": "tiny"}, "kv_store": {"host_gib": float("inf")}}, "kv_store.host_gib\n.*finite"),
        # Found by a review: traces went into a folder named `~`, or the workers' working directory
        ({"model": {"preset": "tiny"}, "profile_dir": "traces"}, "profile_dir must be an absolute path"),
        ({"model": {"preset": "tiny"}, "profile_dir": ""}, "profile_dir must be an absolute path"),
        # Found by a review: each was taken (a folder named `~` or relative to the worker, an arch unread)
        ({"model": {"preset": "tiny"}, "kv_store": {"disk_path": "kv"}}, "kv_store.disk_path must be an absolute"),
        ({"model": {"preset": "tiny"}, "kv_store": {"shared_path": "", "ttl_s": 60}},
         "kv_store.shared_path must be an absolute"),
        ({"model": {"path": "/models/x", "arch": "llama"}}, "model.arch is a preset's"),
        ({"model": {"preset": "tiny"}, "engine": {"max_model_len": 1024}, "limits": {"max_prompt_tokens": 1024}},
         r"limits.max_prompt_tokens \(1024\) must leave room for one new token within engine.max_model_len \(1024\)"),
        # Found by a review: each passed, then failed the pool manager's start (OverflowError) or Serve's deploy
        ({"model": {"preset": "tiny"}, "kv_store": {"host_gib": 1e300}}, "kv_store.host_gib\n.*less than or equal"),
        ({"model": {"preset": "tiny"}, "kv_store": {"disk_path": "/kv", "disk_gib": 1e300}}, "kv_store.disk_gib"),
        ({"model": {"preset": "tiny"}, "response_store_mib": 1.7e308}, "response_store_mib\n.*less than or equal"),
        ({"model": {"preset": "tiny"}, "scheduler_replicas": 2**31}, "scheduler_replicas\n.*less than or equal"),
    ],
)
def test_bad_settings_are_refused_clearly(args, message):
    with pytest.raises(ValidationError, match=message):
        AppSettings.model_validate(args)


def test_a_profile_dir_under_home_is_expanded():
    settings = AppSettings.model_validate({"model": {"preset": "tiny"}, "profile_dir": "~/traces"})
    assert settings.profile_dir == str(Path.home() / "traces")
    settings = AppSettings.model_validate({"model": {"path": "~/models/x"}, "kv_store": {"disk_path": "~/kv"}})
    assert settings.model.path == str(Path.home() / "models/x")
    assert settings.kv_store.disk_path == str(Path.home() / "kv")


def test_an_integer_is_a_float_setting_as_yaml_writes_it():
    settings = AppSettings.model_validate({"model": {"preset": "tiny"}, "prefill": {"num_cpus": 2, "num_gpus": 0},
                                           "slo": {"ttft_ms": 700}, "kv_store": {"host_gib": 1}})
    assert settings.prefill.num_cpus == 2.0 and settings.slo.ttft_ms == 700.0 and settings.kv_store.host_gib == 1.0


@pytest.mark.parametrize(
    "engine, limits, num_blocks",
    [
        ({"block_size": 16}, {"max_prompt_tokens": 1536}, 97),  # 1537 tokens
        ({"block_size": 32}, {"max_prompt_tokens": 1536}, 49),
        ({"block_size": 16}, {"max_prompt_tokens": 1535}, 96),  # 1536 tokens: whole blocks
        ({"block_size": 16}, {"max_prompt_tokens": 1536, "max_total_tokens": 48}, 3),  # a 47-token prompt
        ({"block_size": 16}, {}, 128),  # 4096 allowed, but the tiny preset's context is 2048: a 2047-token prompt
        ({"block_size": 64, "max_model_len": 1000}, {"max_prompt_tokens": 999}, 16),
    ],
)
def test_kv_blocks_must_hold_the_longest_prompt_and_one_token_and_no_more(engine, limits, num_blocks):
    def settings(n: int) -> dict:
        return {"model": {"preset": "tiny"}, "engine": {**engine, "num_kv_blocks": n}, "limits": limits}

    AppSettings.model_validate(settings(num_blocks))
    with pytest.raises(ValidationError, match=f"need {num_blocks} blocks"):
        AppSettings.model_validate(settings(num_blocks - 1))


def test_the_kv_blocks_rule_is_the_engines(tiny_qwen2_dir):
    """At the bound the rule names, an engine serves the longest prompt with one new
    token (and a decode engine reserves for it); one block fewer, it refuses it."""
    from actors.engine import Engine
    from actors.sampling_params import InvalidRequestError, SamplingParams
    from cluster.config import EngineSettings

    prompt, one_token = list(range(3, 103)), SamplingParams(max_new_tokens=1)
    for num_blocks in (7, 6):
        args = {"model": {"preset": "tiny"}, "engine": {"num_kv_blocks": num_blocks},
                "limits": {"max_prompt_tokens": 100}}
        engine = Engine(tiny_qwen2_dir, EngineSettings(num_kv_blocks=num_blocks).engine_config())
        if num_blocks == 7:
            AppSettings.model_validate(args)
            engine.validate(prompt, one_token)
            assert engine.reserve(prompt, one_token, "longest") is not None
        else:
            with pytest.raises(ValidationError, match="need 7 blocks"):
                AppSettings.model_validate(args)
            with pytest.raises(InvalidRequestError, match="needs 7 KV blocks, the pool has 6"):
                engine.validate(prompt, one_token)


def test_check_manifest_refuses_what_cannot_serve(tmp_path, tiny_qwen2_dir):
    local = (Path(__file__).parent.parent / "manifests" / "local.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    typed = local.replace("prefill: {replicas: 1,", "prefill: {replicas: '2',")
    bad.write_text(typed.replace("port: 8000", "port: 99999").replace("pool_name: tandem-local-pool", "pool_name: ''"))
    assert check_manifest(bad) == [
        "http_options.port: 99999 is not a TCP port (1 to 65535)",
        "application 'tandem': prefill.replicas: Input should be a valid integer, got str '2'",
        "application 'tandem': pool_name: must name the pool manager's actor (replicas find the pools by it), got ''",
    ]
    bad.write_text(local.replace("port: 8000", "port: 0"))
    assert check_manifest(bad) == ["http_options.port: 0 is not a TCP port (1 to 65535)"]
    bad.write_text(local.replace("port: 8000", "port: 65535"))
    assert check_manifest(bad) == []
    small = local.replace("num_kv_blocks: 1024", "num_kv_blocks: 2")
    bad.write_text(small)
    assert check_manifest(bad) == [
        "application 'tandem': args: engine.num_kv_blocks (2) cannot hold one request of the longest prompt the "
        "settings let through: 1536 tokens (limits.max_prompt_tokens) and one new token need 97 blocks of 16 tokens"]
    # A checkpoint folder's context is known where it is read: here, not in the settings alone
    bad.write_text(small.replace("model: {preset: tiny, arch: qwen2}", f"model: {{path: '{tiny_qwen2_dir}'}}"))
    assert check_manifest(bad) == [
        "application 'tandem': args: engine.num_kv_blocks (2) cannot hold one request of the longest prompt the "
        "settings let through: 1536 tokens (limits.max_prompt_tokens) and one new token need 97 blocks of 16 tokens"]
    unread = small.replace("model: {preset: tiny, arch: qwen2}", f"model: {{path: '{tmp_path / 'elsewhere'}'}}")
    bad.write_text(unread.replace("max_prompt_tokens: 1536", "max_prompt_tokens: 4000"))
    assert check_manifest(bad) == []
    bad.write_text(local.replace("model: {preset: tiny, arch: qwen2}", f"model: {{path: '{tiny_qwen2_dir}'}}")
                   .replace("num_kv_blocks: 1024", "num_kv_blocks: 127").replace("max_prompt_tokens: 1536",
                                                                                "max_prompt_tokens: 4000"))
    [problem] = check_manifest(bad)
    assert problem.endswith("2047 tokens (the model's context) and one new token need 128 blocks of 16 tokens")


def test_api_key_from_the_environment(monkeypatch):
    settings = AppSettings.model_validate({"model": {"preset": "tiny"}})
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    assert settings.resolved_api_key is None
    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    assert settings.resolved_api_key == "from-env"
    assert AppSettings.model_validate({"model": {"preset": "tiny"}, "api_key": "k"}).resolved_api_key == "k"


def test_kv_store_section_maps_to_store_settings():
    settings = AppSettings.model_validate({"model": {"preset": "tiny"}, "kv_store": {
        "host_gib": 0.5, "disk_path": "/var/tmp/kv", "shared_path": "/mnt/kv", "ttl_s": 60}})
    store = settings.kv_store.store_settings()
    assert store.host_bytes == 2**29 and store.disk_path == "/var/tmp/kv" and store.shared_bytes is None
    assert store.disk_bytes == 16 * 2**30 and store.ttl_s == 60


def test_deployment_overrides_are_checked_as_serve_would(tmp_path):
    """Found by a review: `check-manifest` said valid, then Serve refused the
    deploy (a misspelt deployment) or the replica's start (a user_config)."""
    manifest = tmp_path / "overrides.yaml"
    application = {"name": "tandem", "route_prefix": "/", "import_path": "cluster.app:build_app",
                   "args": {"model": {"preset": "tiny"}}}
    manifest.write_text(yaml.safe_dump({"applications": [{**application, "deployments": [
        {"name": "Schedulr", "num_replicas": 2}, {"name": "Scheduler", "user_config": {"a": 1}}]}]}))
    assert check_manifest(manifest) == [
        "application 'tandem': deployments: 'Schedulr' is not one of its deployments (it has one: Scheduler)",
        "application 'tandem': deployments: Scheduler takes no user_config (its settings are the application's args)"]
    manifest.write_text(yaml.safe_dump({"applications": [{**application, "deployments": [
        {"name": "Scheduler", "max_ongoing_requests": 256}]}]}))
    assert check_manifest(manifest) == []


@pytest.mark.parametrize("route_prefix, problem", [("abc", "must start with '/'"), ("/a/", "must not end with '/'"),
                                                    ("/{x}", "must not hold wildcards ({ or })")])
def test_a_route_prefix_serve_would_refuse_at_deploy_is_a_problem(tmp_path, route_prefix, problem):
    """Found by a review: Serve's config schema takes any string; its deploy does not."""
    manifest = tmp_path / "prefix.yaml"
    manifest.write_text(yaml.safe_dump({"applications": [{"name": "tandem", "route_prefix": route_prefix,
                                                           "import_path": "cluster.app:build_app",
                                                           "args": {"model": {"preset": "tiny"}}}]}))
    assert check_manifest(manifest) == [f"application 'tandem': route_prefix {route_prefix!r} {problem}"]


def test_a_long_prompt_limit_needs_no_max_model_len_to_compare_with():
    """Found by a review: without `max_model_len` the limit was held to 10**9, and
    the message named `max_model_len (None)`; the model's own context bounds it
    where the checkpoint is read (`kv_pool_problem`)."""
    AppSettings.model_validate({"model": {"preset": "tiny"}, "limits": {"max_prompt_tokens": 10**9},
                                "engine": {"num_kv_blocks": 10**8}})


def test_the_settings_example_validates_and_max_model_len_alone_bounds_the_prompt():
    """Found by a review: config.py's example was refused (a shared path needs a
    bound), and a max_model_len below the default prompt limit was refused though
    nobody set the limit."""
    import cluster.config

    example = cluster.config.__doc__.split("args:\n", 1)[1].split("\n\n", 1)[0]
    AppSettings.model_validate(yaml.safe_load(example))
    AppSettings.model_validate({"model": {"preset": "tiny"}, "engine": {"max_model_len": 1024}})
