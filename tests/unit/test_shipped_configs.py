"""configs/serve-autoscale.yaml, the README's "Scaling" example: valid, autoscaled in both pools
by pd-serve's policies, and the README shows it as it is."""

from __future__ import annotations

import re

import yaml

from serve_app.config.settings import REPO_ROOT, load_config

AUTOSCALE_YAML = REPO_ROOT / "configs" / "serve-autoscale.yaml"


def test_the_autoscale_example_is_valid_and_differs_from_serve_yaml_only_in_the_pools_sizes():
    (app,) = yaml.safe_load(AUTOSCALE_YAML.read_text())["applications"]
    (plain,) = yaml.safe_load((REPO_ROOT / "configs" / "serve.yaml").read_text())["applications"]
    config = load_config(app["args"])  # Serve's own model checks each autoscaling_config
    for role in ("prefill", "decode"):
        scaling = getattr(config, role).autoscaling_config
        assert scaling is not None and scaling["min_replicas"] == 1 and scaling["max_replicas"] == 2
        assert scaling["policy"]["policy_function"].startswith("serve_app.config.autoscaling:")
    assert {k: v for k, v in app["args"].items() if k not in ("prefill", "decode")} == {
        k: v for k, v in plain["args"].items() if k not in ("prefill", "decode")
    }


def test_the_readmes_scaling_example_is_the_files_decode_pool():
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("## Scaling") :]
    shown = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    (app,) = yaml.safe_load(AUTOSCALE_YAML.read_text())["applications"]
    assert shown == {"decode": app["args"]["decode"]}
    assert "serve run configs/serve-autoscale.yaml" in section
