"""The one settings toolkit (modelforge_contract.settings) and the three programs that
declare against it: the same blank rule, the same unknown-name refusal, the same parsers."""

from __future__ import annotations

import pytest

from modelforge_appliance.core import settings as appliance_settings
from modelforge_contract.settings import SettingSpec, SettingTable
from modelforge_node_agent import settings as agent_settings
from modelforge_worker import settings as worker_settings

pytestmark = pytest.mark.every_python  # tests/parts.py: on every CPython


class Refused(Exception):
    pass


TABLE = SettingTable(
    (
        SettingSpec("MF_X_COUNT", "3", "a count"),
        SettingSpec("MF_X_RATIO", "0.5", "a ratio"),
        SettingSpec("MF_X_ON", "false", "a switch"),
        SettingSpec("MF_X_LOG_LEVEL", "INFO", "a level"),
        SettingSpec("MF_X_PATH", None, "a path"),
    ),
    prefixes=("MF_X_",),
    foreign_prefixes=("MF_X_OTHER_",),
    foreign_names=("MF_X_COMPOSE",),
    error=Refused,
    unknown_hint="see the docs",
)


@pytest.mark.parametrize("raw", [None, "", "   ", "\t"])
def test_unset_and_blank_take_the_default(raw):
    env = {} if raw is None else {"MF_X_COUNT": raw, "MF_X_PATH": raw}
    assert TABLE.integer(env, "MF_X_COUNT", 1, 10) == 3
    assert TABLE.value(env, "MF_X_PATH") is None


def test_values_lose_surrounding_whitespace():
    env = {"MF_X_COUNT": " 7 ", "MF_X_PATH": " /srv/x ", "MF_X_ON": " Yes "}
    assert TABLE.integer(env, "MF_X_COUNT", 1, 10) == 7
    assert TABLE.value(env, "MF_X_PATH") == "/srv/x"
    assert TABLE.boolean(env, "MF_X_ON") is True


@pytest.mark.parametrize(
    ("env", "parse", "message"),
    [
        ({"MF_X_COUNT": "x"}, lambda e: TABLE.integer(e, "MF_X_COUNT", 1, 10), "MF_X_COUNT='x' is not a whole number"),
        ({"MF_X_COUNT": "11"}, lambda e: TABLE.integer(e, "MF_X_COUNT", 1, 10), "MF_X_COUNT=11 is outside 1..10"),
        ({"MF_X_RATIO": "half"}, lambda e: TABLE.number(e, "MF_X_RATIO", 0, 1), "MF_X_RATIO='half' is not a number"),
        ({"MF_X_ON": "maybe"}, lambda e: TABLE.boolean(e, "MF_X_ON"), "MF_X_ON='maybe' is not true or false"),
        ({"MF_X_LOG_LEVEL": "loud"}, lambda e: TABLE.log_level(e, "MF_X_LOG_LEVEL"), "MF_X_LOG_LEVEL='LOUD' is not DEBUG, INFO, WARNING or ERROR"),
    ],
)  # fmt: skip
def test_a_bad_value_is_refused_naming_the_variable(env, parse, message):
    with pytest.raises(Refused) as refused:
        parse(env)
    assert str(refused.value) == message


def test_an_unknown_name_is_refused_with_the_nearest_or_the_hint():
    with pytest.raises(Refused, match=r"unknown setting MF_X_CUONT; did you mean MF_X_COUNT\?"):
        TABLE.check_names({"MF_X_CUONT": "1"})
    with pytest.raises(Refused, match="unknown setting MF_X_ZZZZZZZZZZZZ; see the docs"):
        TABLE.check_names({"MF_X_ZZZZZZZZZZZZ": "1"})


def test_other_programs_names_and_undeclared_reads_are_told_apart():
    TABLE.check_names({"MF_X_OTHER_ANYTHING": "1", "MF_X_COMPOSE": "1", "PATH": "/bin"})
    with pytest.raises(KeyError):
        TABLE.value({}, "MF_X_NEVER_DECLARED")


def test_help_rows_list_every_variable_with_its_default():
    rows = dict(TABLE.help_rows())
    assert list(rows) == ["MF_X_COUNT", "MF_X_RATIO", "MF_X_ON", "MF_X_LOG_LEVEL", "MF_X_PATH"]
    assert rows["MF_X_COUNT"] == "a count [default: 3]"
    assert rows["MF_X_PATH"] == "a path"


def test_the_three_programs_agree_on_a_blank_value(tmp_path):
    """Before the toolkit, a blank MODELFORGE_LOG_LEVEL stopped the control plane while a blank
    MODELFORGE_AGENT_LOG_LEVEL meant the default: each program had its own copy of the rule."""
    state = {"MODELFORGE_STATE_DIR": str(tmp_path)}
    appliance = appliance_settings.load_settings({**state, "MODELFORGE_LOG_LEVEL": " "})
    agent = agent_settings.load_settings({"MODELFORGE_AGENT_LOG_LEVEL": ""})
    worker = worker_settings.load_settings({"MODELFORGE_WORKER_LOG_LEVEL": "  "})
    assert (appliance.log_level, agent.log_level, worker.log_level) == ("INFO",) * 3
    blank_interval = {**state, "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": ""}
    assert appliance_settings.load_settings(blank_interval).heartbeat_interval_seconds == 10


def test_the_three_programs_declare_against_the_one_toolkit():
    for module in (appliance_settings, agent_settings, worker_settings):
        assert isinstance(module.TABLE, SettingTable), module.__name__
        assert module.TABLE.specs == module.SETTINGS
        assert all(isinstance(spec, SettingSpec) for spec in module.SETTINGS)
