"""Every scenario in scenarios/ runs clean under the fixed profiles (no false alarms)."""

from pathlib import Path

import pytest

from sim.api import load_scenario, run

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = sorted(p.stem for p in (ROOT / "scenarios").glob("*.toml"))


def test_every_scenario_is_listed_in_the_readme():
    readme = (ROOT / "scenarios" / "README.md").read_text()
    for name in SCENARIOS:
        assert f"`{name}.toml`" in readme, name


@pytest.mark.parametrize("profile", ["trtllm-post-17264", "vllm-v1"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_fixed_profiles_run_every_scenario_clean(name, profile):
    sc, base = load_scenario(ROOT / "scenarios" / f"{name}.toml")
    res = run(sc, profile=profile, base_dir=base)
    assert res.violations == [], res.violations[:3]
    assert res.summary["finished"] + res.summary["rejected"] == res.summary["requests"]
