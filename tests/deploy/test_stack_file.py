"""deploy/swarm/stack.yml read as data (no engine needed; make swarm-test deploys it for real): the settings the
rolling-update test relies on, and every variable one the worker reads."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests.deploy.worker_settings import healthcheck_variables, known_variables

ROOT = Path(__file__).resolve().parents[2]


def seconds(value: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(ms|s|m)", value).groups()
    return float(number) * {"ms": 0.001, "s": 1, "m": 60}[unit]


def default(value: str) -> str:
    """The default of a ${VAR:-default} interpolation (the value itself when there is none)."""
    m = re.fullmatch(r"\$\{[A-Z_]+:-([^}]*)\}", str(value))
    return m.group(1) if m else str(value)


def test_stack_rolls_start_first_with_rollback_over_dns_round_robin():
    stack = yaml.safe_load((ROOT / "deploy" / "swarm" / "stack.yml").read_text())
    worker = stack["services"]["worker"]
    deploy = worker["deploy"]
    assert deploy["endpoint_mode"] == "dnsrr" and default(deploy["replicas"]) == "3"
    assert deploy["update_config"]["order"] == "start-first"
    assert deploy["update_config"]["failure_action"] == "rollback"
    assert deploy["restart_policy"]["condition"] == "any"
    assert worker["read_only"] is True and worker["volumes"][0]["read_only"] is True
    assert worker["volumes"][0]["target"] == "/models"
    assert stack["networks"]["posenc"] == {"driver": "overlay", "attachable": True}
    assert "service.healthcheck" in worker["healthcheck"]["test"]
    env = worker["environment"]
    assert set(env) <= known_variables(), set(env) - known_variables()
    # Connections are aged out, so clients spread over replicas a scale-up adds (make swarm-test measures it).
    assert float(default(env["POSENC_MAX_CONNECTION_AGE_SECONDS"])) > 0
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["worker"]["environment"]
    assert float(default(compose["POSENC_MAX_CONNECTION_AGE_SECONDS"])) > 0
    readers = known_variables() | healthcheck_variables()  # the worker's environment is also its healthcheck's
    assert set(compose) <= readers, set(compose) - readers
    # Swarm's SIGKILL must come after the worker's own drain.
    assert seconds(worker["stop_grace_period"]) > float(default(env["POSENC_GRACE_SECONDS"]))
