"""Process-group setup: which device a rank takes, which backend, which network interface the
library's gloo groups use when only NCCL's variable names one, and the attempt id that every rank of
one worker group shares."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from elastic_ddp.worker.distributed import (
    ENV_GLOO_SOCKET_IFNAME,
    ENV_GROUP_WORLD_SIZE,
    ENV_MASTER_ADDR,
    ENV_MASTER_PORT,
    ENV_NCCL_SOCKET_IFNAME,
    ENV_RDZV_ROUND,
    ENV_RESTART_COUNT,
    attempt_id,
    gloo_interface_from_nccl,
    resolve_backend,
    select_device,
)

# --- device ----------------------------------------------------------------------------------


@pytest.mark.parametrize("local_rank,count", [(0, 1), (0, 8), (3, 8), (7, 8)])
def test_a_rank_takes_the_device_of_its_local_rank_when_that_many_are_visible(local_rank, count):
    assert select_device(local_rank, count, visible=None) == torch.device("cuda", local_rank)


@pytest.mark.parametrize("local_rank", [1, 5])
def test_a_rank_given_exactly_one_visible_device_takes_it(local_rank):
    # A scheduler that gives every process its own GPU: CUDA_VISIBLE_DEVICES=<that GPU> per process.
    assert select_device(local_rank, 1, visible=str(local_rank)) == torch.device("cuda", 0)


def test_more_local_ranks_than_visible_devices_is_an_error_naming_both():
    with pytest.raises(ValueError) as raised:
        select_device(3, 2, visible="0,1")
    message = str(raised.value)
    assert "LOCAL_RANK is 3 but 2 CUDA device(s) are visible (CUDA_VISIBLE_DEVICES='0,1')" in message
    assert "--nproc-per-node" in message
    no_devices = r"LOCAL_RANK is 0 but 0 CUDA device\(s\) are visible \(CUDA_VISIBLE_DEVICES=''\)"
    with pytest.raises(ValueError, match=no_devices):
        select_device(0, 0, visible="")


# --- backend ---------------------------------------------------------------------------------


def test_auto_backend_is_nccl_with_cuda_and_gloo_without():
    assert resolve_backend("auto", cuda_available=True) == "nccl"
    assert resolve_backend("auto", cuda_available=False) == "gloo"
    assert resolve_backend("gloo", cuda_available=True) == "gloo"
    assert resolve_backend("nccl", cuda_available=True) == "nccl"
    with pytest.raises(ValueError, match="dist.backend is 'nccl', but CUDA is not available"):
        resolve_backend("nccl", cuda_available=False)


# --- gloo's network interface ----------------------------------------------------------------

HOST = ["lo", "docker0", "eth0", "eth1", "ib0"]


@pytest.mark.parametrize(
    "nccl,expected",
    [
        ("eth0", "eth0"),  # a whole name is a prefix of itself
        ("eth", "eth0"),  # a prefix: the host's first interface that starts with it
        ("ib,eth", "ib0"),  # prefixes are tried in their order
        ("wlan,eth", "eth0"),
        (" eth1 ", "eth1"),
        ("=eth1", "eth1"),  # exact: passed on as it is
        ("=eth0,eth1", "eth0,eth1"),
        ("^docker", None),  # an exclusion names no interface to use
        ("^=docker0", None),
        ("", None),
        ("   ", None),
        ("wlan", None),  # a prefix that matches nothing here: gloo picks by host name
    ],
    ids=["whole-name", "prefix", "prefix-order", "first-that-matches", "spaces", "exact", "exact-list",
         "exclusion", "exact-exclusion", "empty", "blank", "no-match"],
)  # fmt: skip
def test_gloo_interface_follows_nccls_choice(nccl, expected):
    assert gloo_interface_from_nccl({ENV_NCCL_SOCKET_IFNAME: nccl}, interfaces=HOST) == expected


def test_an_already_set_gloo_interface_is_left_alone():
    environ = {ENV_NCCL_SOCKET_IFNAME: "eth", ENV_GLOO_SOCKET_IFNAME: "ib0"}
    assert gloo_interface_from_nccl(environ, interfaces=HOST) is None
    assert gloo_interface_from_nccl({}, interfaces=HOST) is None


def test_prefixes_are_matched_against_this_hosts_own_interfaces():
    # Every Linux host has the loopback interface "lo".
    assert gloo_interface_from_nccl({ENV_NCCL_SOCKET_IFNAME: "lo"}) == "lo"


_ONE_RANK = """
import os
from elastic_ddp.config import DistConfig
from elastic_ddp.worker.distributed import init_distributed, new_gloo_group, shutdown_distributed
ctx = init_distributed(DistConfig(backend="gloo"))
print(ctx.rank, ctx.world_size, ctx.device, ctx.backend, os.environ["GLOO_SOCKET_IFNAME"], new_gloo_group(10.0))
shutdown_distributed()
"""

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs the loopback interface named 'lo'")
def test_without_torchrun_a_process_is_a_job_of_one_rank_on_the_interface_nccl_names():
    # "l" is only a prefix of "lo": passed to gloo as it is, it would name no interface.
    env = {key: value for key, value in os.environ.items() if key not in _TORCHRUN_VARS}
    env[ENV_NCCL_SOCKET_IFNAME] = "l"
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_ONE_RANK)], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "1", "cpu", "gloo", "lo", "None"]


# --- attempt id ------------------------------------------------------------------------------


def _worker_env(**values: str) -> dict[str, str]:
    names = {"addr": ENV_MASTER_ADDR, "port": ENV_MASTER_PORT, "round_": ENV_RDZV_ROUND,
             "restarts": ENV_RESTART_COUNT, "nodes": ENV_GROUP_WORLD_SIZE}  # fmt: skip
    return {names[key]: value for key, value in values.items()}


def test_the_ranks_of_one_round_share_an_attempt_id_whatever_their_agents_restart_counts():
    group = [_worker_env(addr="10.0.0.1", port="41234", round_="17", restarts=str(n), nodes="3") for n in (0, 2, 1)]
    assert {attempt_id(env) for env in group} == {"10.0.0.1:41234/round-17"}
    # The next round: same store address (a port handed out again), same restart count: another id.
    again = _worker_env(addr="10.0.0.1", port="41234", round_="18", restarts="0", nodes="3")
    assert attempt_id(again) != attempt_id(group[0])


def test_without_the_round_several_nodes_share_the_rounds_store_address_as_attempt_id():
    # c10d: every round's rank-0 worker hosts a new store; each agent counts its own restarts.
    group = [_worker_env(addr="10.0.0.1", port="41234", restarts=str(n), nodes="2") for n in (0, 3)]
    assert {attempt_id(env) for env in group} == {"10.0.0.1:41234"}


def test_on_one_node_the_restart_count_numbers_the_attempts_as_before():
    assert attempt_id(_worker_env(addr="127.0.0.1", port="29500", restarts="2", nodes="1")) == "127.0.0.1:29500/2"
    assert attempt_id({}) == "local:0/0"  # no torchrun, no process group
