# SPDX-License-Identifier: Apache-2.0
"""docs/training.md's verl recipe against verl's own config: the overrides the page gives, applied to verl's Hydra
config (``verl/trainer/config``) and converted with verl's config dataclasses, turn R3 on where verl reads it, and
put the plugin's variable into the ``runtime_env`` verl passes to ``ray.init``. Runs where verl is installed (the
trainer environments: ``make test-trainer``)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.verl

ROOT = Path(__file__).resolve().parent.parent
TRAINING = ROOT / "docs" / "training.md"
ENTRY = "verl.trainer.main_ppo"
# What a real run adds besides the recipe (the user's batch settings): verl's actor config requires one.
USER_SETTINGS = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]


def documented_overrides() -> list[str]:
    """The ``key=value`` overrides of the ``python -m verl.trainer.main_ppo`` command on docs/training.md."""
    blocks = re.findall(r"^```bash\n(.*?)^```", TRAINING.read_text(), flags=re.MULTILINE | re.DOTALL)
    block = next(block for block in blocks if ENTRY in block)
    command = " ".join(line.split(" # ")[0].strip() for line in block.replace("\\\n", " ").splitlines())
    words = shlex.split(command[command.index(ENTRY) + len(ENTRY) :], comments=True)
    overrides = [word for word in words if "=" in word]
    assert overrides and all(word == "..." or "=" in word for word in words), words
    return overrides


def compose(overrides: list[str]) -> Any:
    """verl's ``ppo_trainer`` config (what ``main_ppo`` loads) with ``overrides``, as Hydra composes it for it."""
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=overrides)


@pytest.fixture(scope="module")
def recipe() -> Any:
    """verl's config with the documented overrides (and a user's batch setting), composed once."""
    return compose(documented_overrides() + USER_SETTINGS)


def test_the_documented_overrides_are_the_expected_ones() -> None:
    assert documented_overrides() == [
        "model_engine=megatron",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.actor.megatron.router_replay.mode=R3",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=True",
        '+ray_kwargs.ray_init.runtime_env.env_vars.VLLM_ASCEND_ROUTING="1"',
    ]


def test_verl_reads_r3_from_the_documented_overrides(recipe: Any) -> None:
    import verl
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import McoreActorConfig, RolloutConfig

    assert verl.__version__ == "0.9.1"
    config = recipe
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    assert isinstance(actor, McoreActorConfig) and isinstance(rollout, RolloutConfig)
    # verl/workers/engine_workers.py: routing replay is on where the strategy's engine config says so
    assert actor.strategy == "megatron" and actor.megatron.router_replay.mode == "R3"
    # verl/workers/rollout/vllm_rollout/vllm_async_server.py: enable_return_routed_experts, and the rows returned
    assert rollout.name == "vllm" and rollout.enable_rollout_routing_replay is True


def test_the_runtime_env_verl_passes_to_ray_carries_the_switch(recipe: Any) -> None:
    from omegaconf import OmegaConf
    from ray.runtime_env import RuntimeEnv
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    config = recipe
    # verl/trainer/main_ppo.py, run_ppo: verl's defaults merged with ray_kwargs.ray_init.runtime_env
    merged = OmegaConf.merge(get_ppo_ray_runtime_env(config), config.ray_kwargs.ray_init.get("runtime_env", {}))
    runtime_env = OmegaConf.to_container(merged)
    assert runtime_env["env_vars"]["VLLM_ASCEND_ROUTING"] == "1"  # a string: Ray's env_vars take nothing else
    RuntimeEnv(env_vars=runtime_env["env_vars"])  # Ray's own validation of env_vars


@pytest.mark.parametrize(
    "wrong",
    [
        pytest.param(["actor_rollout_ref.actor.engine.router_replay_mode=R3"], id="actor.engine.router_replay_mode"),
        pytest.param(["actor_rollout_ref.actor.megatron.router_replay.mode=R3"], id="without-model_engine=megatron"),
    ],
)
def test_keys_verl_does_not_have_are_refused_by_its_config(wrong: list[str]) -> None:
    from hydra.errors import ConfigCompositionException

    overrides = ["actor_rollout_ref.rollout.name=vllm", *wrong, *USER_SETTINGS]
    if "engine" in wrong[0]:
        overrides.insert(0, "model_engine=megatron")
    with pytest.raises(ConfigCompositionException, match="Could not override"):
        compose(overrides)


def test_a_mode_verl_does_not_know_is_refused_by_its_dataclass() -> None:
    from verl.utils.config import omega_conf_to_dataclass

    config = compose(["model_engine=megatron", "actor_rollout_ref.actor.megatron.router_replay.mode=r3"])
    with pytest.raises(Exception, match="Invalid router_replay mode: r3"):
        omega_conf_to_dataclass(config.actor_rollout_ref.actor.megatron.router_replay)
