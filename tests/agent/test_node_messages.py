"""What node agents and their tasks say when something is off: a refused request is told from one
taken too late (and says why), a request from the future says so, a queue key of the wrong type
is named (not "cannot reach Redis"), bad ``--label``s and Redis URL parameters are errors that
name them, and a node that cannot reach Redis registers nothing in the pool."""

from __future__ import annotations

import time
import uuid

import pytest

from elastic_ops.agent import cli as agent_cli
from elastic_ops.agent.cluster import NodeConfig, node_config_from_env
from elastic_ops.agent.node_client import NodeClient
from elastic_ops.agent.protocol import StoreConfig
from elastic_ops.cli import main as cli_main
from elastic_ops.errors import NodeUnavailableError, SpecError
from tests.agent.node_helpers import SECRET, drop_namespace, make_config, running_node
from tests.agent.test_node import wait_for

pytestmark = pytest.mark.timeout(120)

UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"  # nothing listens on port 1: refused at once


def ask(config: NodeConfig, host: str, tmp_path) -> None:
    """The cheapest request a task sends a node: "the latest checkpoint?"."""
    NodeClient(config, accept_timeout_s=2.0).latest(host, StoreConfig(str(tmp_path / "ckpt")), None)


def test_a_node_whose_clock_is_far_off_is_unavailable_saying_so(redis_url, tmp_path):
    """Its announcements' signed times are 300 s old by the task's clock: not trusted (a replay
    looks the same), and the task says which it may be rather than "no node agent"."""
    config = make_config()
    try:
        with running_node("host-s", config, warm=False, wall_clock=lambda: time.time() - 300):
            with pytest.raises(NodeUnavailableError) as info:
                ask(config, "host-s", tmp_path)
    finally:
        drop_namespace(config)
    err = info.value
    assert "last announced itself 300 s ago by this host's clock" in str(err) and err.host == "host-s"
    assert "are the hosts' clocks in sync?" in str(err)


@pytest.fixture
def refused_from_the_future(redis_url, tmp_path, caplog, monkeypatch) -> tuple[NodeUnavailableError, str]:
    """What a task gets from a node whose clock is 300 s behind its own, and the node's log,
    when the task trusts the node's announcement (here: a wider announcement window) and the
    node refuses the request by its own clock."""
    from elastic_ops.agent import node_client

    monkeypatch.setattr(node_client, "CLOCK_SKEW_S", 1000.0)
    monkeypatch.setattr(node_client, "ANNOUNCEMENT_MAX_AGE_S", 1000.0)
    config = make_config()
    try:
        with (
            running_node("host-s", config, warm=False, wall_clock=lambda: time.time() - 300),
            caplog.at_level("WARNING", logger="elastic_ops.node"),
            pytest.raises(NodeUnavailableError) as info,
        ):
            ask(config, "host-s", tmp_path)
    finally:
        drop_namespace(config)
    return info.value, caplog.text


def test_a_refused_request_says_why_not_that_it_was_taken_too_late(refused_from_the_future):
    """The task said "(it took it too late; ended)" for a request the node refused as stale."""
    err, _ = refused_from_the_future
    assert "took it too late" not in str(err)
    assert "it refused the request, issued 300 s in the future by this node's clock" in str(err)
    assert "are the hosts' clocks in sync?" in str(err) and err.host == "host-s"


def test_a_request_from_the_future_is_logged_as_such(refused_from_the_future):
    """The node logged "issued -300 s ago"."""
    _, logged = refused_from_the_future
    assert "issued 300 s in the future by this node's clock (at most 120 s either way" in logged
    assert "-300" not in logged


def test_a_request_popped_but_not_answered_says_whether_the_node_took_it(redis_url):
    config = make_config()
    client = NodeClient(config)
    runs = config.runs_key("host-t")
    try:
        claimed = uuid.uuid4().hex
        config.redis().set(config.session_key(claimed, "claimed"), "host-t")
        assert client._not_taken(runs, b"gone", claimed) == " (it took it too late; ended)"
        forged = uuid.uuid4().hex  # a reason anyone could have written: not quoted
        config.redis().set(config.session_key(forged, "refused"), b'{"mac": "0", "body": "{}"}')
        for session in (forged, uuid.uuid4().hex):
            why = client._not_taken(runs, b"gone", session)
            assert why.startswith(": it took the request off its queue and refused it without a reason")
    finally:
        drop_namespace(config)


def test_a_queue_key_of_the_wrong_type_is_named_not_redis_unreachable(redis_url, tmp_path, caplog):
    config = make_config()
    runs = config.runs_key("host-w")
    try:
        with (
            running_node("host-w", config, warm=False),
            caplog.at_level("WARNING", logger="elastic_ops.node"),
        ):
            config.redis().set(runs, "someone else's value")
            wait_for("the node to name the key", lambda: "not a list of run requests" in caplog.text, 30)
            with pytest.raises(NodeUnavailableError) as info:
                ask(config, "host-w", tmp_path)
            config.redis().delete(runs)
    finally:
        drop_namespace(config)
    assert f"the Redis key {runs} holds a string, not a list of run requests" in caplog.text
    assert "cannot reach Redis" not in caplog.text
    assert f"the run queue of host host-w, Redis key {runs}, holds a string" in str(info.value)
    assert "unreachable" not in str(info.value) and info.value.host == "host-w"


@pytest.fixture
def node_cli(tmp_path, monkeypatch):
    """``elastic-ops node`` with an unreachable Redis and a pool ledger: ``(run, pool url)``."""
    monkeypatch.setenv("ELASTIC_OPS_NODE_REDIS_URL", UNREACHABLE_REDIS)
    monkeypatch.setenv("ELASTIC_OPS_NODE_SECRET", SECRET)
    monkeypatch.setattr(agent_cli, "_log_to_stderr", lambda level: None)  # the test's logging stays
    url = f"sqlite:///{tmp_path / 'pool.db'}"
    return (lambda *argv: cli_main(["node", "--host", "host-z", "--register-slots", "2", "--pool-url", url,
                                    *argv])), url


def test_a_label_given_twice_or_without_a_value_is_an_error_naming_it(node_cli, capsys):
    run, url = node_cli
    assert run("--label", "gpu=h100", "--label", "gpu=b200") == 2
    assert "invalid --label='gpu=b200': each label once: 'gpu' is given already as gpu=h100" in (
        capsys.readouterr().err
    )
    assert run("--label", "gpu=") == 2
    assert "invalid --label='gpu=': must be KEY=VALUE with a value after the '='" in capsys.readouterr().err
    # the pool's own --label reads them the same way
    pool = ["pool", "--pool-url", url, "add-host", "h", "1"]
    assert cli_main([*pool, "--label", "a=1", "--label", "a=2"]) == 2
    assert "invalid --label='a=2': each label once" in capsys.readouterr().err


def test_a_node_that_cannot_reach_redis_registers_nothing(node_cli, capsys):
    from elastic_ops.pool import PoolClient

    run, url = node_cli
    assert run("--label", "gpu=h100") == 2
    assert "invalid ELASTIC_OPS_NODE_REDIS_URL='redis://127.0.0.1:1/0'" in capsys.readouterr().err
    assert PoolClient(url).status()["hosts"] == []


def test_a_redis_url_parameter_that_is_not_a_number_is_a_spec_error_naming_it():
    url = "redis://:hunter2-password@h:6379/0?socket_timeout=abc"
    with pytest.raises(SpecError) as info:
        NodeConfig(url=url, secret=SECRET)
    assert str(info.value) == ("invalid ELASTIC_OPS_NODE_REDIS_URL parameter socket_timeout='abc': "
                               "a number (redis-py reads it as one)")
    assert "hunter2" not in str(info.value)
    env = {"ELASTIC_OPS_NODE_REDIS_URL": "redis://h:6379?db=one", "ELASTIC_OPS_NODE_SECRET": SECRET}
    with pytest.raises(SpecError, match=r"invalid ELASTIC_OPS_NODE_REDIS_URL parameter db='one': a whole"):
        node_config_from_env(env)
    NodeConfig(url="redis://h:6379/0?socket_timeout=2.5&db=1&health_check_interval=10", secret=SECRET)


def test_register_slots_gpus_registers_one_slot_per_gpu_cuda_sees(monkeypatch, caplog, node_cli, capsys):
    """``--register-slots gpus``: slot i is the host's i-th GPU, so the pool's count must be the
    GPUs'; a number above it on a GPU host is warned about (a CUDA job granted the extra slots
    fails there), and on a host without GPUs 'gpus' is refused, saying why."""
    from elastic_ops.runtime import launcher

    monkeypatch.setattr(launcher, "visible_gpus", lambda: ["0", "1", "2", "3"])
    assert agent_cli.slots_to_register("gpus") == 4 and agent_cli.slots_to_register(" GPUS ") == 4
    with caplog.at_level("WARNING", logger="elastic_ops.node"):
        assert agent_cli.slots_to_register("4") == 4
        assert "registering" not in caplog.text
        assert agent_cli.slots_to_register("8") == 8
    assert "registering 8 slots on a host where CUDA sees 4 GPUs ['0', '1', '2', '3']: a CUDA job granted " \
        "slot 4 or above fails here" in caplog.text
    # past the pool's bound, and past the 4,300 digits int() reads (it raised a bare ValueError)
    for bad in ("0", "-2", "2.5", "eight", "", "1000001", "9" * 30, "9" * 5000):
        with pytest.raises(SpecError, match=r"invalid --register-slots=.*a whole number of slots from 1 to "
                                            r"1000000, or"):
            agent_cli.slots_to_register(bad)
    assert agent_cli.slots_to_register("1000000") == 1_000_000
    monkeypatch.setattr(launcher, "visible_gpus", lambda: [])
    with pytest.raises(SpecError, match="CUDA sees no GPU here") as err:
        agent_cli.slots_to_register("gpus")
    assert err.value.field == "--register-slots"
    assert agent_cli.slots_to_register("16") == 16  # a CPU host: worker slots, no warning
    # through the CLI (node_cli's environment): refused before Redis is tried
    assert cli_main(["node", "--host", "host-z", "--register-slots", "gpus"]) == 2
    assert "invalid --register-slots='gpus'" in capsys.readouterr().err


def test_the_nodes_own_options_are_checked_before_its_cluster_settings(monkeypatch, capsys):
    """A typo in --register-slots / --label / --advertise-addr was reported only once the Redis
    settings were right (an operator fixed the environment first, then learned of the typo)."""
    monkeypatch.delenv("ELASTIC_OPS_NODE_REDIS_URL", raising=False)
    monkeypatch.delenv("ELASTIC_OPS_NODE_SECRET", raising=False)
    for argv, says in (
        (["--register-slots", "0"], "invalid --register-slots='0'"),
        (["--register-slots", "2", "--label", "gpu"], "invalid --label="),
        (["--advertise-addr", "not an address"], "--advertise-addr"),
    ):
        assert cli_main(["node", "--host", "host-z", *argv]) == 2
        err = capsys.readouterr().err
        assert says in err and "ELASTIC_OPS_NODE_REDIS_URL" not in err, err
