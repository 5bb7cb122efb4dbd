"""Settings are defined once (pdserve/settings.py); flags, --help, variables and docs follow."""

import os
import re
import subprocess
import sys
import types
from concurrent import futures
from pathlib import Path

import pytest

from pdserve import settings as cfg
from pdserve.cli import build_parser, main
from pdserve.launcher import SHARED_SETTINGS, stack_commands

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = "\n".join(
    line
    for line in (ROOT / "docker-compose.yml").read_text().splitlines()
    if not line.lstrip().startswith("#")
)  # its comments name examples
CONTAINERS_DOC = (ROOT / "docs" / "containers.md").read_text()
# Compose defaults that are deployment choices, not copies of a setting's default.
COMPOSE_OWN_DEFAULTS = {"PDSERVE_TORCH_THREADS"}


def all_settings() -> dict[str, object]:
    """Every setting's variable, mapped to its field."""
    return {
        cfg.env_name(f): f
        for classes in cfg.ROLE_SETTINGS.values()
        for cls in classes
        for f in cfg.settings_fields(cls)
    }


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No PDSERVE_* from the caller's shell; a wide terminal so help lines keep names whole."""
    for name in [n for n in os.environ if n.startswith(cfg.ENV_PREFIX)]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("COLUMNS", "120")


def parsed_settings(role: str, *flags: str):
    return cfg.settings_from_args(role, build_parser().parse_args(["serve", role, *flags]))


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*argv, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


# --- the compose file and the docs ---


def test_compose_passes_only_defined_settings():
    passed = set(re.findall(r"^\s+(PDSERVE_\w+):", COMPOSE, re.MULTILINE))
    assert {"PDSERVE_MODEL", "PDSERVE_DTYPE", "PDSERVE_NUM_BLOCKS"} <= passed
    assert passed - set(all_settings()) - {"PDSERVE_FAULTS"} == set()


def test_compose_repeats_no_default():
    defaults = dict(re.findall(r"\$\{(PDSERVE_\w+):-([^}]*)\}", COMPOSE))
    repeated = {
        name
        for name, default in defaults.items()
        if name in all_settings() and default and name not in COMPOSE_OWN_DEFAULTS
    }
    assert repeated == set()


def test_every_compose_service_gets_the_model_settings():
    shared = re.search(r"^x-pdserve-env: &pdserve-env\n((?:  .*\n)+)", COMPOSE, re.MULTILINE)
    assert shared and "PDSERVE_MODEL:" in shared.group(1) and "PDSERVE_DTYPE:" in shared.group(1)
    assert COMPOSE.count("<<: *pdserve-env") == 3  # decode, prefill, router


def test_compose_only_variables_are_documented():
    used = set(re.findall(r"\$\{(PDSERVE_\w+)", COMPOSE)) - set(all_settings())
    assert {name for name in used if f"`{name}`" not in CONTAINERS_DOC} == set()


def test_docs_settings_table_is_current():
    assert cfg.settings_table() in CONTAINERS_DOC, "run: python -m pdserve.settings"


# --- the command line ---


@pytest.mark.parametrize("role", list(cfg.ROLE_SETTINGS))
def test_help_lists_every_setting_of_the_role_with_its_variable(capsys, role):
    text = help_text(capsys, "serve", role)
    for cls in cfg.ROLE_SETTINGS[role]:
        for f in cfg.settings_fields(cls):
            assert cfg.flag_name(f) in text and cfg.env_name(f) in text, f.name
    assert "--model" in text and "--dtype" in text


def test_up_help_shows_model_and_dtype(capsys):
    text = help_text(capsys, "up")
    assert "--model" in text and "PDSERVE_MODEL" in text and "--dtype" in text


@pytest.mark.parametrize(
    "role,expected",
    [
        ("router", cfg.RouterSettings(cfg.CommonSettings(port=50051))),
        ("prefill", cfg.PrefillSettings(cfg.CommonSettings(port=50052))),
        ("decode", cfg.DecodeSettings(cfg.CommonSettings(port=50053))),
    ],
)
def test_flag_defaults_are_the_dataclass_defaults(role, expected):
    assert parsed_settings(role) == expected


def test_variables_override_defaults_with_the_right_type(monkeypatch):
    for name, value in {
        "NUM_BLOCKS": "128",
        "LEASE_TTL_SECONDS": "2.5",
        "MODEL": "tinygpt",
        "DTYPE": "float16",
        "MAX_DECODE_BATCH": "7",
        "PORT": "6000",
    }.items():
        monkeypatch.setenv(cfg.ENV_PREFIX + name, value)
    decode = parsed_settings("decode")
    assert (decode.num_blocks, decode.lease_ttl_seconds, decode.max_batch) == (128, 2.5, 7)
    assert type(decode.num_blocks) is int and type(decode.lease_ttl_seconds) is float
    assert (decode.common.model, decode.common.dtype, decode.common.port) == (
        "tinygpt",
        "float16",
        6000,
    )
    assert parsed_settings("decode", "--num-blocks", "64").num_blocks == 64  # the flag wins


def test_list_and_renamed_settings_from_variables(monkeypatch):
    monkeypatch.setenv("PDSERVE_PREFILL", "a:1, b:2")
    monkeypatch.setenv("PDSERVE_MAX_PREFILL_BATCH", "3")
    monkeypatch.setenv("PDSERVE_MAX_PREFILL_TOKENS", "99")
    assert parsed_settings("router").prefill == ["a:1", "b:2"]
    assert parsed_settings("router", "--prefill", "c:3", "d:4").prefill == ["c:3", "d:4"]
    colocated = parsed_settings("colocated")
    assert (colocated.prefill.max_batch_size, colocated.prefill.max_batch_tokens) == (3, 99)
    assert colocated.decode.common is colocated.common


def test_an_empty_variable_means_the_default(monkeypatch):
    monkeypatch.setenv("PDSERVE_NUM_BLOCKS", "")
    monkeypatch.setenv("PDSERVE_MODEL", "")
    decode = parsed_settings("decode")
    assert decode.num_blocks == 2048 and decode.common.model == "smollm2-135m-instruct"


def test_help_shows_the_value_in_force(capsys, monkeypatch):
    monkeypatch.setenv("PDSERVE_NUM_BLOCKS", "512")
    assert "now 512, from the environment" in help_text(capsys, "serve", "decode")


def test_help_never_shows_the_api_key(capsys, monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", "sk-very-secret-123")
    text = help_text(capsys, "serve", "router")
    assert "sk-very-secret-123" not in text and "PDSERVE_API_KEY; set)" in text


@pytest.mark.parametrize(
    "env,flags,says",
    [
        ({"PDSERVE_NUM_BLOCKS": "abc"}, [], "PDSERVE_NUM_BLOCKS"),
        ({}, ["--dtype", "int8"], "--dtype (PDSERVE_DTYPE) must be one of"),
        ({"PDSERVE_MAX_DECODE_BATCH": "0"}, [], "--max-decode-batch (PDSERVE_MAX_DECODE_BATCH)"),
    ],
)
def test_a_bad_value_is_a_clear_error_and_exit_2(env, flags, says):
    environment = {k: v for k, v in os.environ.items() if not k.startswith(cfg.ENV_PREFIX)}
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "decode", *flags],
        env=environment | env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr


def test_the_colocated_prefill_budgets_must_not_be_negative():
    for flag in ("--prefill-chunk-tokens", "--step-prompt-tokens"):
        with pytest.raises(ValueError, match=f"{flag} .* must be >= 0, got -1"):
            parsed_settings("colocated", flag, "-1")
    settings = parsed_settings("colocated", "--step-prompt-tokens", "512")
    assert (settings.chunk_tokens, settings.step_prompt_tokens) == (256, 512)


def run_service(service: str, *flags: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(cfg.ENV_PREFIX)}
    command = [sys.executable, "-m", "pdserve.cli", "serve", service, "--model", "tinygpt"]
    return subprocess.run(
        [*command, *flags], env=environment, capture_output=True, text=True, timeout=60, cwd=ROOT
    )


@pytest.mark.parametrize(
    "service,flags,says",
    [
        (
            "prefill",
            ["--decode-allow", "127.0.0.1"],
            "--decode-allow (PDSERVE_DECODE_ALLOW): '127.0.0.1' is not host:port",
        ),
        ("prefill", ["--decode-allow", "decode:5x"], "'decode:5x': the port must be a number"),
        ("router", ["--prefill", "localhost:0"], "--prefill (PDSERVE_PREFILL): 'localhost:0'"),
        ("router", ["--decode", "::1:50052"], "--decode (PDSERVE_DECODE): '::1:50052' is not"),
    ],
)
def test_a_bad_address_stops_the_service_at_start(service, flags, says, capsys, monkeypatch):
    """Before any request, before even the model is loaded: exit 2, naming the flag and the
    value (in-process: settings are checked before `serve` does anything else)."""
    for name in [k for k in os.environ if k.startswith(cfg.ENV_PREFIX)]:
        monkeypatch.delenv(name)
    assert main(["serve", service, "--model", "tinygpt", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


@pytest.mark.parametrize("wrong", ["ca", "cert", "key"])
def test_a_tls_file_that_is_not_pem_stops_the_service_at_start(tmp_path, wrong):
    from pdserve.certs import make_dev_certs

    certs = make_dev_certs(tmp_path / "certs")
    files = {"cert": certs / "decode.pem", "key": certs / "decode-key.pem", "ca": certs / "ca.pem"}
    files[wrong] = tmp_path / "not-pem"
    files[wrong].write_text("this is not a PEM file\n")
    flags = [f"--tls-{name}={path}" for name, path in files.items()]
    done = run_service("decode", *flags)
    assert done.returncode == 2, done.stderr
    assert f"--tls-{wrong} {files[wrong]}" in done.stderr and "Traceback" not in done.stderr


# --- pdserve serve: the model is loaded once and handed to the service ---


@pytest.fixture
def fake_loading(monkeypatch):
    """pdserve.models.loading and services.router.server stand-ins that record their calls."""
    calls = {}

    def load_served_model(name, dtype, weights, weight_format, numerics, q4_kernel, step_ops):
        calls["load"] = (name, dtype, weights)
        if name.startswith("/missing"):
            raise FileNotFoundError(f"no checkpoint at {name}")
        return "the model"

    async def serve(model, settings):
        calls["serve"] = (model, settings)

    monkeypatch.setitem(
        sys.modules,
        "pdserve.models.loading",
        types.SimpleNamespace(load_served_model=load_served_model),
    )
    monkeypatch.setitem(
        sys.modules, "pdserve.services.router.server", types.SimpleNamespace(serve=serve)
    )
    return calls


def test_the_router_loads_the_model_without_weights(fake_loading):
    assert main(["serve", "router", "--model", "tinygpt", "--dtype", "float32"]) == 0
    assert fake_loading["load"] == ("tinygpt", "float32", False)
    model, settings = fake_loading["serve"]
    assert model == "the model" and settings.common.model == "tinygpt"


def test_a_missing_model_is_a_clear_error_and_exit_2(fake_loading, capsys):
    assert main(["serve", "router", "--model", "/missing/ckpt"]) == 2
    assert "pdserve: no checkpoint at /missing/ckpt" in capsys.readouterr().err
    assert "serve" not in fake_loading


# --- pdserve up ---


def test_up_hands_model_and_dtype_to_every_service():
    args = build_parser().parse_args(["up", "--model", "tinygpt", "--dtype", "bfloat16"])
    shared = cfg.as_flags(cfg.CommonSettings, args, SHARED_SETTINGS)
    commands = stack_commands(50051, 50052, 50053, 64, 1, shared=shared)
    for role, command in commands.items():
        argv = command[command.index("serve") :]  # after `python -m pdserve.cli`
        common = cfg.settings_from_args(role, build_parser().parse_args(argv)).common
        assert (common.model, common.dtype, common.weights) == ("tinygpt", "bfloat16", "auto")


def test_up_lets_prefill_send_kv_to_its_own_decode_only():
    commands = stack_commands(50051, 50052, 50053, 64, 1)
    argv = commands["prefill"][commands["prefill"].index("serve") :]
    settings = cfg.settings_from_args("prefill", build_parser().parse_args(argv))
    assert settings.decode_allow == ["127.0.0.1:50053"]


def test_up_with_the_checkpoint_dtype_passes_an_empty_dtype():
    args = build_parser().parse_args(["up"])
    assert cfg.as_flags(cfg.CommonSettings, args, SHARED_SETTINGS) == [
        "--model",
        "smollm2-135m-instruct",
        "--dtype",
        "",
        "--weights",
        "auto",
        "--numerics",
        "fast",
        "--q4-kernel",
        "auto",
        "--step-ops",
        "auto",
    ]


def test_cpu_lists_parse_and_reach_each_service():
    from pdserve.launcher import stack_commands

    assert cfg.parse_cpu_list("0-2,5") == {0, 1, 2, 5} and cfg.parse_cpu_list("") == set()
    for bad in ("x", "3-1", "-1"):
        with pytest.raises(ValueError, match="PDSERVE_CPUS"):
            cfg.parse_cpu_list(bad)
    commands = stack_commands(50051, 50052, 50053, 64, 0, cpus={"prefill": "0", "decode": "1"})
    assert commands["prefill"][commands["prefill"].index("--cpus") + 1] == "0"
    assert commands["decode"][commands["decode"].index("--cpus") + 1] == "1"
    assert "--cpus" not in commands["router"]
    # Threads follow a service's CPUs (0: the service counts them).
    assert commands["decode"][commands["decode"].index("--torch-threads") + 1] == "0"


def test_up_splits_the_cpus_between_prefill_and_decode_by_default():
    from pdserve.launcher import default_placement, placement

    assert default_placement({0, 1}) == {"prefill": "0", "decode": "1", "router": "0"}
    assert default_placement({0, 1, 2, 3, 4}) == {
        "prefill": "0,1",
        "decode": "2,3,4",
        "router": "0,1",
    }
    assert default_placement({3}) == {"prefill": "3", "decode": "3", "router": "3"}
    # A role's own flag replaces its default; the others keep theirs.
    args = build_parser().parse_args(["up", "--decode-cpus", "0"])
    placed = placement(args)
    assert placed["decode"] == "0"
    assert placed["prefill"] == default_placement(os.sched_getaffinity(0))["prefill"]


def test_a_service_pinned_to_a_cpu_it_cannot_use_exits_with_a_message():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "serve",
            "decode",
            "--model",
            "tinygpt",
            "--cpus",
            "4095",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "cannot run there" in result.stderr


def test_a_service_on_a_port_another_grpc_server_holds_exits_with_a_message():
    """gRPC servers set SO_REUSEPORT by default, so a second one on a taken port would bind it
    too, silently, and take half of the first one's connections. A pdserve service refuses."""
    import grpc

    holder = grpc.server(futures.ThreadPoolExecutor(1))  # gRPC's defaults: SO_REUSEPORT on
    port = holder.add_insecure_port("127.0.0.1:0")
    holder.start()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "serve", "prefill", "--model", "tinygpt"]
            + ["--host", "127.0.0.1", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        holder.stop(None)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in result.stderr


def test_up_never_hands_two_services_one_port(monkeypatch):
    """A port free now can come back from the next free_port(), before anyone listens on it."""
    from pdserve import launcher

    offered = iter([5000, 5000, 6000, 6000, 7000])
    monkeypatch.setattr(launcher, "free_port", lambda: next(offered))
    assert launcher._ports(5000, 0, 0) == [5000, 6000, 7000]
    assert launcher._ports(5001, 5002, 5003) == [5001, 5002, 5003]  # given ones as they are


def test_a_test_service_whose_free_port_was_taken_starts_again_on_another(monkeypatch, tmp_path):
    """free_port() is true only when it answers; the test stacks start a service again on
    another port when its first one was taken meanwhile, rather than failing the test."""
    import grpc

    from pdserve import localstack

    holder = grpc.server(futures.ThreadPoolExecutor(1))
    taken = holder.add_insecure_port("127.0.0.1:0")
    holder.start()
    real = localstack.free_port
    answers = iter([taken])
    monkeypatch.setattr(localstack, "free_port", lambda: next(answers, None) or real())
    try:
        service = localstack.start_service("prefill", tmp_dir=str(tmp_path))
        try:
            assert service.port != taken and service.proc.poll() is None
        finally:
            service.stop()
    finally:
        holder.stop(None)
    assert "the port is in use" in (tmp_path / f"prefill-{taken}.log").read_text()
