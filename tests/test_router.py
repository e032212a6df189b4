"""Router.choose over hand-built candidates; GatewayConfig validation; config flags/env/file."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import pytest

from engine.config_args import add_config_args, build_config, field_docs, load_config_file
from gateway.config import GatewayConfig
from gateway.router import Candidate, Router, RouterWeights


def cand(instance_id: str, *, in_flight: int = 0, max_in_flight: int = 8,
         max_num_seqs: int = 4, kv: float = 0.0, max_loras: int = 2,
         resident: tuple[str, ...] = (), busy: tuple[str, ...] = (),
         matched: int = 0, key_affine: bool = False) -> Candidate:
    return Candidate(instance_id=instance_id, in_flight=in_flight, max_in_flight=max_in_flight,
                     max_num_seqs=max_num_seqs, kv_usage=kv, max_loras=max_loras,
                     resident=frozenset(resident), busy_adapters=frozenset(busy),
                     matched_tokens=matched, key_affine=key_affine)


# Four instances, one per adapter tier for a request of adapter "ad".
ALL_BUSY = cand("a", resident=("x", "y"), busy=("x", "y"))
EVICT_IDLE = cand("b", resident=("x", "y"), busy=("x",))
FREE_SLOT = cand("c", resident=("x",))
RESIDENT = cand("d", resident=("ad", "x"), busy=("x",))


# --------------------------------------------------------------------------- adapter tiers
def test_adapter_tiers_of_a_candidate() -> None:
    assert [c.adapter_tier("ad") for c in (ALL_BUSY, EVICT_IDLE, FREE_SLOT, RESIDENT)] == [
        0, 1, 2, 3]
    assert [c.adapter_tier(None) for c in (ALL_BUSY, EVICT_IDLE, FREE_SLOT, RESIDENT)] == [
        3, 3, 3, 3]


def test_tier_order_resident_then_free_slot_then_evict_idle_then_all_busy() -> None:
    router = Router()
    pool = [ALL_BUSY, EVICT_IDLE, FREE_SLOT, RESIDENT]
    picks = []
    while pool:
        decision = router.choose(pool, "ad", prompt_len=32)
        assert decision is not None
        picks.append((decision.instance_id, decision.reason))
        pool = [c for c in pool if c.instance_id != decision.instance_id]
    assert picks == [("d", "adapter_resident"), ("c", "adapter_free_slot"),
                     ("b", "adapter_evict"), ("a", "only_candidate")]


def test_scores_are_tier_plus_prefix_minus_load() -> None:
    decision = Router().choose([ALL_BUSY, EVICT_IDLE, FREE_SLOT, RESIDENT], "ad", 32)
    assert decision is not None
    assert decision.scores == {"a": 0.0, "b": 1.0, "c": 2.0, "d": 3.0}
    assert decision.explain() == ("instance=d reason=adapter_resident matched=0 "
                                  "scores=a=0.000,b=1.000,c=2.000,d=3.000")


def test_tier_outweighs_a_moderate_load_gap() -> None:
    resident = cand("r", resident=("ad",), in_flight=3)  # load 0.75
    free = cand("f")  # load 0
    decision = Router().choose([free, resident], "ad", 32)
    assert decision is not None
    assert (decision.instance_id, decision.reason) == ("r", "adapter_resident")
    assert decision.scores == {"f": 2.0, "r": 2.25}


def test_busy_resident_instance_yields_to_an_idle_one_with_a_free_slot() -> None:
    # load 1.25 + 0.5 = 1.75 > one tier step: the adapter gets loaded on the idle instance.
    resident = cand("r", resident=("ad",), in_flight=5, kv=0.5)
    free = cand("f")
    decision = Router().choose([resident, free], "ad", 32)
    assert decision is not None
    assert (decision.instance_id, decision.reason) == ("f", "least_loaded")
    assert decision.scores == {"f": 2.0, "r": 1.25}


def test_base_requests_ignore_adapter_tiers() -> None:
    loaded = [cand("a", resident=("x", "y"), busy=("x", "y"), in_flight=0),
              cand("b", resident=("ad",), in_flight=1),
              cand("c", in_flight=2)]
    decision = Router().choose(loaded, None, 32)
    assert decision is not None
    assert (decision.instance_id, decision.reason) == ("a", "least_loaded")
    assert decision.scores == {"a": 3.0, "b": 2.75, "c": 2.5}


# --------------------------------------------------------------------------------- prefix
def test_prefix_match_wins_among_equal_tiers() -> None:
    a = cand("a", resident=("ad",))
    b = cand("b", resident=("ad",), matched=192)
    for adapter in ("ad", None):
        decision = Router().choose([a, b], adapter, prompt_len=256)
        assert decision is not None
        assert (decision.instance_id, decision.reason, decision.matched_tokens) == (
            "b", "prefix", 192)
        assert decision.scores == {"a": 3.0, "b": 4.5}


def test_longer_prefix_match_wins() -> None:
    decision = Router().choose([cand("a", matched=64), cand("b", matched=128),
                                cand("c", matched=0)], None, 256)
    assert decision is not None
    assert (decision.instance_id, decision.reason, decision.matched_tokens) == (
        "b", "prefix", 128)


def test_prefix_affinity_survives_a_load_gap_up_to_imbalance() -> None:
    holder = cand("holder", matched=256, in_flight=2)  # load 0.5: gap == imbalance
    idle = cand("idle")
    decision = Router().choose([holder, idle], None, 256)
    assert decision is not None
    assert (decision.instance_id, decision.reason) == ("holder", "prefix")
    assert decision.scores == {"holder": 4.5, "idle": 3.0}


@pytest.mark.parametrize(("in_flight", "kv"), [(3, 0.0), (1, 0.375)])
def test_prefix_affinity_yields_beyond_imbalance(in_flight: int, kv: float) -> None:
    holder = cand("holder", matched=256, in_flight=in_flight, kv=kv)  # load 0.75 or 0.625
    idle = cand("idle")
    decision = Router().choose([holder, idle], None, 256)
    assert decision is not None
    assert (decision.instance_id, decision.reason, decision.matched_tokens) == (
        "idle", "least_loaded", 0)
    assert decision.scores == {"holder": 3.0 - holder.load, "idle": 3.0}


def test_the_prompt_cache_key_s_instance_counts_as_holding_the_whole_prompt() -> None:
    # Over a partial prefix elsewhere; and yielding beyond imbalance like any prefix credit.
    keyed, other = cand("keyed", key_affine=True, in_flight=1), cand("other", matched=128)
    decision = Router().choose([keyed, other], None, 256)
    assert decision is not None
    assert (decision.instance_id, decision.reason, decision.matched_tokens) == (
        "keyed", "prompt_cache_key", 0)
    assert decision.scores == {"keyed": 5.0 - keyed.load, "other": 4.0}
    busy = cand("keyed", key_affine=True, in_flight=3)  # load 0.75 > imbalance 0.5
    decision = Router().choose([busy, cand("idle")], None, 256)
    assert decision is not None and (decision.instance_id, decision.reason) == (
        "idle", "least_loaded")


def test_imbalance_is_measured_from_the_least_loaded_open_candidate() -> None:
    # Both prefix holders are busy, but only relative to each other: within imbalance.
    a = cand("a", matched=256, in_flight=3)  # load 0.75
    b = cand("b", matched=128, in_flight=4)  # load 1.0
    decision = Router().choose([a, b], None, 256)
    assert decision is not None
    assert (decision.instance_id, decision.reason) == ("a", "prefix")
    assert decision.scores == {"a": 4.25, "b": 3.0}


# --------------------------------------------------------------------------- admission
def test_instances_at_max_in_flight_are_not_candidates() -> None:
    full = cand("full", resident=("ad",), matched=256, in_flight=2, max_in_flight=2)
    other = cand("other", in_flight=1, max_in_flight=2)
    decision = Router().choose([full, other], "ad", 256)
    assert decision is not None
    assert (decision.instance_id, decision.reason) == ("other", "only_candidate")
    assert decision.scores == {"other": 1.75}


def test_none_when_every_candidate_is_at_its_bound() -> None:
    full = [cand("a", in_flight=2, max_in_flight=2), cand("b", in_flight=3, max_in_flight=2)]
    assert Router().choose(full, None, 16) is None
    assert Router("round_robin").choose(full, None, 16) is None
    assert Router().choose([], None, 16) is None


def test_equal_scores_go_to_fewer_in_flight() -> None:
    a = cand("a", in_flight=1, max_num_seqs=8)  # load 0.125
    b = cand("b", in_flight=2, max_num_seqs=16)  # load 0.125
    decision = Router().choose([b, a], None, 16)
    assert decision is not None
    assert decision.instance_id == "a"


# ------------------------------------------------------------------------- round robin
def test_round_robin_rotates_in_instance_order_and_ignores_scores() -> None:
    router = Router("round_robin")
    pool = [cand("c"), cand("a", in_flight=5, max_in_flight=8), cand("b", resident=("ad",))]
    picks = [router.choose(pool, "ad", 32) for _ in range(5)]
    assert [(p.instance_id, p.reason) for p in picks if p] == [
        ("a", "round_robin"), ("b", "round_robin"), ("c", "round_robin"),
        ("a", "round_robin"), ("b", "round_robin")]


def test_round_robin_skips_full_instances() -> None:
    router = Router("round_robin")
    pool = [cand("a"), cand("b", in_flight=1, max_in_flight=1), cand("c")]
    picks = [router.choose(pool, None, 32) for _ in range(4)]
    assert [p.instance_id for p in picks if p] == ["a", "c", "a", "c"]


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="routing policy must be 'score' or 'round_robin', "
                                         "got 'random'"):
        Router("random")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- weights
# "p" holds a quarter of the prompt (prefix term 0.5 with weight 2) and has KV usage 0.4.
PREFIX_BUT_FULLER = cand("p", matched=64, kv=0.4)
EMPTY = cand("e")


@pytest.mark.parametrize(("weights", "winner", "scores"), [
    (RouterWeights(), "p", {"p": 3.1, "e": 3.0}),
    (RouterWeights(prefix=0.0), "e", {"p": 2.6, "e": 3.0}),
    (RouterWeights(prefix=4.0), "p", {"p": 3.6, "e": 3.0}),
    (RouterWeights(load=3.0), "e", {"p": 2.3, "e": 3.0}),
    (RouterWeights(imbalance=0.3), "e", {"p": 2.6, "e": 3.0}),
])
def test_router_weights_are_respected(weights: RouterWeights, winner: str,
                                      scores: dict[str, float]) -> None:
    decision = Router(weights=weights).choose([PREFIX_BUT_FULLER, EMPTY], None, 256)
    assert decision is not None
    assert decision.instance_id == winner
    assert decision.scores == pytest.approx(scores)


# ------------------------------------------------------------------------ GatewayConfig
def test_gateway_config_defaults_are_valid() -> None:
    config = GatewayConfig()
    assert (config.routing, config.max_in_flight_per_instance, config.request_timeout_s) == (
        "score", 256, 600.0)


@pytest.mark.parametrize(("changes", "message"), [
    ({"port": 0}, "port must be in 1..65535, got 0"),
    ({"port": 65536}, "port must be in 1..65535, got 65536"),
    ({"routing": "random"}, "routing must be 'score' or 'round_robin', got 'random'"),
    ({"max_in_flight_per_instance": 0}, "max_in_flight_per_instance must be an integer >= 1, "
                                        "got 0"),
    ({"eject_after_failures": 0}, "eject_after_failures must be an integer >= 1, got 0"),
    ({"max_attempts": 1.5}, "max_attempts must be an integer >= 1, got 1.5"),
    ({"request_timeout_s": 0}, "request_timeout_s must be a finite number > 0, got 0"),
    ({"request_timeout_s": math.nan}, "request_timeout_s must be a finite number > 0, got nan"),
    ({"poll_interval_s": -1.0}, "poll_interval_s must be a finite number > 0, got -1.0"),
    ({"startup_timeout_s": 0.0}, "startup_timeout_s must be a finite number > 0, got 0.0"),
    ({"drain_timeout_s": -5}, "drain_timeout_s must be a finite number > 0, got -5"),
    ({"drain_timeout_s": math.inf}, "drain_timeout_s must be a finite number > 0, got inf"),
    ({"retry_after_s": -1}, "retry_after_s must be >= 0, got -1"),
    ({"prefix_weight": -0.5}, "prefix_weight, load_weight, imbalance and routed_prefix_ttl_s "
                              "must be >= 0"),
    ({"imbalance": math.nan}, "prefix_weight, load_weight, imbalance and routed_prefix_ttl_s "
                              "must be >= 0"),
    ({"routed_prefix_ttl_s": -1.0}, "prefix_weight, load_weight, imbalance and "
                                    "routed_prefix_ttl_s must be >= 0"),
])
def test_gateway_config_refuses_bad_values(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        GatewayConfig(**changes)  # type: ignore[arg-type]


# ----------------------------------------------------------------- flags > env > file
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test")
    add_config_args(parser, GatewayConfig, title="gateway")
    return parser


def _config(argv: list[str], env: dict[str, str], file: Path | None = None) -> GatewayConfig:
    args = _parser().parse_args(argv)
    return build_config(GatewayConfig, args, load_config_file(str(file) if file else None),
                        env)


TOML = """
port = 8001
routing = "round_robin"
max-attempts = 5
request_timeout_s = 30
served_model_name = "from-file"
"""

YAML = """
port: 8001
routing: round_robin
max-attempts: 5
request_timeout_s: 30
served_model_name: from-file
"""


@pytest.mark.parametrize(("name", "text"), [("gw.toml", TOML), ("gw.yaml", YAML)])
def test_flags_beat_env_beat_file_beat_defaults(tmp_path: Path, name: str, text: str) -> None:
    file = tmp_path / name
    file.write_text(text)
    env = {"LORAGATE_PORT": "8002", "LORAGATE_MAX_ATTEMPTS": "4", "UNRELATED": "x"}
    config = _config(["--port", "8003"], env, file)
    assert config == GatewayConfig(port=8003, max_attempts=4, routing="round_robin",
                                   request_timeout_s=30.0, served_model_name="from-file")
    assert isinstance(config.request_timeout_s, float)
    assert _config([], env, file).port == 8002
    assert _config([], {}, file).port == 8001
    assert _config([], {}) == GatewayConfig()


def test_env_values_are_converted_to_field_types() -> None:
    env = {"LORAGATE_IMBALANCE": "0.25", "LORAGATE_RETRY_AFTER_S": "3",
           "LORAGATE_SERVED_MODEL_NAME": "none"}
    config = _config([], env)
    assert (config.imbalance, config.retry_after_s, config.served_model_name) == (
        0.25, 3, "none")


def test_field_docstrings_become_flag_help(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = field_docs(GatewayConfig)
    assert docs["routing"] == ('"score": adapter residency, prefix overlap and load (see '
                               'gateway/router.py); "round_robin": rotate over healthy '
                               'instances (a baseline).')
    assert set(docs) == set(GatewayConfig.__dataclass_fields__)
    monkeypatch.setenv("COLUMNS", "400")
    help_text = " ".join(_parser().format_help().split())
    assert ("--request-timeout-s REQUEST_TIMEOUT_S A request still running after this many "
            "seconds is aborted (504 or a stream error). (default 600.0; env "
            "LORAGATE_REQUEST_TIMEOUT_S)") in help_text
    assert ("--routing {score,round_robin} " + docs["routing"]) in help_text


@pytest.mark.parametrize(("argv", "env", "file_text", "message"), [
    (["--port", "abc"], {}, None,
     "--port: must be an integer, got 'abc'"),
    ([], {"LORAGATE_MAX_IN_FLIGHT_PER_INSTANCE": "1.5"}, None,
     "LORAGATE_MAX_IN_FLIGHT_PER_INSTANCE: must be an integer, got '1.5'"),
    ([], {"LORAGATE_ROUTING": "random"}, None,
     "LORAGATE_ROUTING: must be one of score, round_robin, got 'random'"),
    ([], {"LORAGATE_PORT": ""}, None, "LORAGATE_PORT: needs a value, got ''"),
    ([], {"LORAGATE_REQUEST_TIMEOUT_S": "none"}, None,
     "LORAGATE_REQUEST_TIMEOUT_S: needs a value, got 'none'"),
    ([], {}, "max_attempts = 2.5\n", "config file key max_attempts: must be an integer, got 2.5"),
    ([], {}, "poll_interval_s = 'fast'\n",
     "config file key poll_interval_s: must be a number, got 'fast'"),
    # Converted fine, refused by GatewayConfig itself: the message names the value.
    ([], {}, "port = 70000\n", "config file key port: port must be in 1..65535, got 70000"),
])
def test_bad_values_raise_value_error_naming_the_source(
        tmp_path: Path, argv: list[str], env: dict[str, str], file_text: str | None,
        message: str) -> None:
    file = None
    if file_text is not None:
        file = tmp_path / "gw.toml"
        file.write_text(file_text)
    with pytest.raises(ValueError) as info:
        _config(argv, env, file)
    assert str(info.value) == message


@pytest.mark.parametrize(("name", "text", "message"), [
    ("gw.json", "{}", "must end in .toml, .yaml or .yml"),
    ("gw.yaml", "- a\n- b\n", "must hold a table of settings"),
])
def test_bad_config_files_are_refused(tmp_path: Path, name: str, text: str, message: str
                                      ) -> None:
    file = tmp_path / name
    file.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config_file(str(file))
    with pytest.raises(ValueError, match="does not exist"):
        load_config_file(str(tmp_path / "missing.toml"))
