"""The TOML writer round-trips every scenario the strategies make and every shipped scenario."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from hypothesis import given

from sim.config import parse_scenario
from sim.fuzz.strategies import scenario_dicts
from sim.fuzz.toml_out import dumps

ROOT = Path(__file__).resolve().parents[2]


@given(scenario_dicts())
def test_generated_scenarios_round_trip(sc: dict) -> None:
    text = dumps(sc, header="a header\nover two lines")
    assert tomllib.loads(text) == sc
    parse_scenario(tomllib.loads(text), "<round-trip>")


@pytest.mark.parametrize("path", sorted((ROOT / "scenarios").rglob("*.toml")),
                         ids=lambda p: p.name)
def test_shipped_scenarios_round_trip(path: Path) -> None:
    data = tomllib.loads(path.read_text())
    assert tomllib.loads(dumps(data)) == data


def test_layout_matches_hand_written_scenarios() -> None:
    text = dumps({"seed": 0, "spec": {"mode": "mtp", "acceptance": {"kind": "forced",
                                                                      "accepted": [0, 3]}},
                  "switches": {}, "workload": {"requests": [{"arrival_ns": 0, "prompt_len": 8,
                                                             "output_len": 2}]}},
                 header="why")
    assert text == ("# why\nseed = 0\n\n[spec]\nmode = \"mtp\"\n"
                    "acceptance = {kind = \"forced\", accepted = [0, 3]}\n\n"
                    "[[workload.requests]]\narrival_ns = 0\nprompt_len = 8\noutput_len = 2\n")


def test_strings_and_odd_keys_are_escaped() -> None:
    data = {"a": {"odd key": "quote \" and \\ and \n newline", "f": 0.5, "t": True}}
    assert tomllib.loads(dumps(data)) == data
