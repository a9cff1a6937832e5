"""Every scenario in scenarios/ runs clean under the fixed profiles (no false alarms)."""

from pathlib import Path

import pytest

from sim.api import load_scenario, run
from sim.errors import ScenarioError

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
    if profile == "vllm-v1" and sc.profile != profile:
        # kvsim's model of vLLM takes only what vLLM has: a TensorRT-LLM scenario is refused,
        # naming the field (docs/vllm.md, "Refused")
        with pytest.raises(ScenarioError, match=r"^scenario: [a-z_.]+: "):
            run(sc, profile=profile, base_dir=base)
        return
    res = run(sc, profile=profile, base_dir=base)
    assert res.violations == [], res.violations[:3]
    assert res.summary["finished"] + res.summary["rejected"] == res.summary["requests"]
